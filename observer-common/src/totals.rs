//! Run totals: the `totals` event of the model stream (`model::Event::Totals`),
//! what a live session accumulated per thread and per device over the whole
//! run. (User-space only: `user` feature.)
//!
//! Spec:
//! - A session with eBPF probes emits one `totals` event at the end of the
//!   run, after the last token, `histograms` and `health` events and just
//!   before `end`; the procfs fallback emits none (it brackets no faults and
//!   counts no block reads). Values are cumulative up to `mono_ns`, so if a
//!   stream ever carries several, the last one supersedes the others.
//! - `threads`, ordered by TID, are the target's threads the probes saw
//!   (the target's and its followed descendants'), each with its process (`pid`):
//!   - `faults`: the fault bracketing of `observer_common::faults` since the
//!     probes were attached: completed major and minor faults, the time
//!     between entry and exit (`*_ns`), entries and exits that could not be
//!     paired, and per-bucket log2 latency histograms (bucket `i` counts
//!     latencies in `(2^(i-1), 2^i]` ns, the last is +Inf: `observer_common::hist`).
//!     `None` when no fault of the thread was seen. A thread beyond the
//!     attribution slots has its faults here too (the overflow table of
//!     `observer_common::faults`) and `time` `None`; the faults of threads
//!     beyond that table's room are one row of their own, `tid`
//!     [`OTHER_TID`] (0), `pid` 0, `comm` [`OTHER_COMM`]: their counts, every
//!     exit unmatched (no time), never a silent drop.
//!   - `time`: where the thread's time went since it was first seen (or
//!     seeded at attach): `wall_ns` accounted, the time components and the
//!     counters of the vocabulary (`<component>_ns`, `majflt_file`, …), and the
//!     thread's block reads: bios issued (`read_ios`) and the summed
//!     queue→complete latency of those on disks and on zram. `exited` once the
//!     thread has exited. `None` when the attribution probes never saw the thread.
//!   - Threads that exited and gave their slot back (`attrib::MAX_SLOTS`, "Slots") keep a row
//!     each, up to [`MAX_RETIRED_ROWS`] of them; each later one is added to the row of the last
//!     retired thread of its process and name (from [`MAX_RETIRED_ROWS`] × 2 rows on, of its
//!     process: `comm` [`EXITED_COMM`]). `folded` counts the threads added to a row besides the
//!     one its `tid` names (absent when 0): an engine that starts threads for every token
//!     (llama.cpp without OpenMP) has a bounded table over any length of run.
//! - `devices`: block reads the target caused, per device (`major:minor`, and
//!   the kernel name when known): bytes, requests, and the summed
//!   queue→complete latency over the `completed` requests whose completion was seen.
//! - `evicted_by_process`: who evicted the model file's pages over the whole run, per
//!   process (`model::ProcessEvictions`), when eviction blame is measured.
//!
//! The end-of-run summary (`observer run`'s table, `observer report` on a trace)
//! is built from this event and the rest of the stream, never from the maps.

extern crate alloc;

use alloc::{string::String, vec::Vec};

use serde::{Deserialize, Serialize};

use crate::{
    FaultTimes, OverflowFaults,
    attrib::{
        C_DISK_READ_NS, C_FAULT_UNMATCHED_ENTRY, C_FAULT_UNMATCHED_EXIT, C_FAULT_UNTIMED, C_MAJFLT_FILE, C_MAJFLT_SWAP,
        C_MINFLT, C_MISSED_SWITCH_IN, C_READ_IOS, C_ZRAM_READ_NS, F_EXITED, ThreadState,
    },
    model::{Components, Counters},
};

/// Totals of a run at `mono_ns` (CLOCK_MONOTONIC).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunTotals {
    pub mono_ns: u64,
    pub threads: Vec<ThreadTotals>,
    pub devices: Vec<DeviceReads>,
    /// Who evicted the model file's pages over the run, per process
    /// (`model::ProcessEvictions`), when eviction blame is measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evicted_by_process: Vec<crate::model::ProcessEvictions>,
}

/// One thread's totals.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreadTotals {
    pub tid: u32,
    /// The thread's process (0: not known, in traces of older versions).
    #[serde(default)]
    pub pid: u32,
    /// The thread's name when first seen.
    pub comm: String,
    pub faults: Option<FaultTotals>,
    pub time: Option<ThreadTime>,
    /// Exited threads added to this row besides the one `tid` names (module spec).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub folded: u32,
}

/// For `serde(skip_serializing_if)`: a count of 0 is left out.
pub fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl ThreadTotals {
    /// A thread's row from its attribution state and the fault latencies at its slot.
    pub fn from_kernel(s: &ThreadState, f: &FaultTimes) -> Self {
        ThreadTotals {
            tid: s.tid,
            pid: s.tgid,
            comm: comm_str(&s.comm),
            faults: FaultTotals::from_kernel(s, f),
            time: Some(ThreadTime {
                wall_ns: s.accounted(),
                components: Components::from_kernel(&s.time),
                counters: Counters::from_kernel(&s.cnt),
                read_ios: s.cnt[C_READ_IOS],
                disk_read_ns: s.cnt[C_DISK_READ_NS],
                zram_read_ns: s.cnt[C_ZRAM_READ_NS],
                missed_switch_ins: s.cnt[C_MISSED_SWITCH_IN],
                exited: s.flags & F_EXITED != 0,
            }),
            folded: 0,
        }
    }

    /// Add another thread's row to this one (module spec: `folded`).
    pub fn absorb(&mut self, other: &ThreadTotals) {
        match (&mut self.faults, &other.faults) {
            (Some(f), Some(o)) => f.add(o),
            (f @ None, Some(o)) => *f = Some(o.clone()),
            _ => {}
        }
        match (&mut self.time, &other.time) {
            (Some(t), Some(o)) => t.add(o),
            (t @ None, Some(o)) => *t = Some(o.clone()),
            _ => {}
        }
        self.folded += 1 + other.folded;
    }
}

/// A kernel `comm` (NUL-padded, at most 16 bytes) as a string.
pub fn comm_str(c: &[u8; 16]) -> String {
    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
    String::from_utf8_lossy(&c[..end]).into_owned()
}

/// Rows kept one per retired thread before they are added together (module spec).
pub const MAX_RETIRED_ROWS: usize = 4096;
/// The `comm` of a process's row of retired threads beyond `2 × MAX_RETIRED_ROWS` rows.
pub const EXITED_COMM: &str = "(exited threads)";

/// The rows of the threads that gave their slot back, bounded (module spec).
#[derive(Clone, Debug, Default)]
pub struct RetiredRows {
    rows: Vec<ThreadTotals>,
    /// (process, name) → the row a later thread of that process and name is added to.
    last: alloc::collections::BTreeMap<(u32, String), usize>,
}

impl RetiredRows {
    pub fn add(&mut self, row: ThreadTotals) {
        let mut key = (row.pid, row.comm.clone());
        if self.rows.len() >= 2 * MAX_RETIRED_ROWS && !self.last.contains_key(&key) {
            key.1 = String::from(EXITED_COMM);
        }
        match self.last.get(&key) {
            Some(&i) if self.rows.len() >= MAX_RETIRED_ROWS => self.rows[i].absorb(&row),
            _ => {
                self.last.insert(key.clone(), self.rows.len());
                self.rows.push(ThreadTotals { comm: key.1, ..row });
            }
        }
    }

    pub fn rows(&self) -> &[ThreadTotals] {
        &self.rows
    }
}

/// Fault bracketing totals of one thread (module spec).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultTotals {
    pub majflt: u64,
    pub minflt: u64,
    pub majflt_ns: u64,
    pub minflt_ns: u64,
    /// A fault entry while another was open (the earlier one failed).
    pub unmatched_entries: u64,
    /// A fault exit with no open entry (counted, without time).
    pub unmatched_exits: u64,
    /// Minor faults taken untimed in fault storms (`observer_common::faults`, storm sampling):
    /// counted in `minflt`; their time in `minflt_ns` and the histogram is estimated from the
    /// sample that stood for them.
    #[serde(default)]
    pub minflt_untimed: u64,
    pub majflt_hist: Vec<u64>,
    pub minflt_hist: Vec<u64>,
}

impl FaultTotals {
    /// Add another thread's faults.
    pub fn add(&mut self, o: &FaultTotals) {
        self.majflt += o.majflt;
        self.minflt += o.minflt;
        self.majflt_ns += o.majflt_ns;
        self.minflt_ns += o.minflt_ns;
        self.unmatched_entries += o.unmatched_entries;
        self.unmatched_exits += o.unmatched_exits;
        self.minflt_untimed += o.minflt_untimed;
        let add = |a: &mut Vec<u64>, b: &Vec<u64>| {
            a.resize(a.len().max(b.len()), 0);
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        };
        add(&mut self.majflt_hist, &o.majflt_hist);
        add(&mut self.minflt_hist, &o.minflt_hist);
    }

    /// A thread's fault totals from the kernel: its counts and open fault in its attribution
    /// state, the latencies of its completed faults at the same slot (`observer_common::faults`).
    /// `None` when no fault of the thread was seen.
    pub fn from_kernel(s: &ThreadState, t: &FaultTimes) -> Option<Self> {
        let f = FaultTotals {
            majflt: s.cnt[C_MAJFLT_FILE] + s.cnt[C_MAJFLT_SWAP],
            minflt: s.cnt[C_MINFLT],
            majflt_ns: t.majflt.sum,
            minflt_ns: t.minflt.sum,
            unmatched_entries: s.cnt[C_FAULT_UNMATCHED_ENTRY],
            unmatched_exits: s.cnt[C_FAULT_UNMATCHED_EXIT],
            minflt_untimed: s.cnt[C_FAULT_UNTIMED],
            majflt_hist: t.majflt.b.to_vec(),
            minflt_hist: t.minflt.b.to_vec(),
        };
        let seen = f.majflt + f.minflt + f.unmatched_entries + f.unmatched_exits > 0 || s.fault_open();
        seen.then_some(f)
    }

    /// The fault totals of a thread without a slot, from its overflow entry.
    pub fn from_overflow(o: &OverflowFaults) -> Self {
        FaultTotals {
            majflt: o.majflt,
            minflt: o.minflt,
            majflt_ns: o.times.majflt.sum,
            minflt_ns: o.times.minflt.sum,
            unmatched_entries: o.unmatched_entries,
            unmatched_exits: o.unmatched_exits,
            minflt_untimed: 0,
            majflt_hist: o.times.majflt.b.to_vec(),
            minflt_hist: o.times.minflt.b.to_vec(),
        }
    }

    /// The [`OTHER_TID`] row's faults: exits counted without an entry, so without time; `None`
    /// when there were none.
    pub fn other(majflt: u64, minflt: u64) -> Option<Self> {
        (majflt + minflt > 0).then(|| FaultTotals {
            majflt,
            minflt,
            unmatched_exits: majflt + minflt,
            majflt_hist: alloc::vec![0; crate::hist::HIST_BUCKETS],
            minflt_hist: alloc::vec![0; crate::hist::HIST_BUCKETS],
            ..Default::default()
        })
    }
}

impl RunTotals {
    /// What a live session says when threads of the target had no attribution slot (module spec:
    /// the overflow table's rows, `time` `None`, and the [`OTHER_TID`] row); `None` when every
    /// thread had one.
    pub fn slotless_warning(&self) -> Option<String> {
        let other = self.threads.iter().any(|t| t.tid == OTHER_TID);
        let rows = self.threads.iter().filter(|t| t.tid != OTHER_TID && t.time.is_none()).count();
        if rows == 0 && !other {
            return None;
        }
        Some(alloc::format!(
            "{rows} thread(s) of the target{} had no attribution slot: {} threads at a time get one, and \
             a slot is given back only once its thread's task is freed (never where the kernel refused \
             program thread_free: see the probes missing). Their faults are counted (in rows without \
             time{}), their time is in no component and their events count as lost. An engine that \
             starts new worker threads for each decode on such a kernel does this (llama.cpp built \
             without OpenMP and with no threadpool attached starts them in every graph compute)",
            if other { ", and more without a row of their own," } else { "" },
            crate::attrib::MAX_SLOTS,
            if other { alloc::format!(", the last ones in the `{OTHER_COMM}` row") } else { String::new() },
        ))
    }
}

/// The `tid` of the row that counts the faults of threads with no row of their own (module spec).
pub const OTHER_TID: u32 = 0;
/// That row's `comm`.
pub const OTHER_COMM: &str = "(other threads)";

/// Where one thread's time went over the run (module spec).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreadTime {
    pub wall_ns: u64,
    #[serde(flatten)]
    pub components: Components,
    #[serde(flatten)]
    pub counters: Counters,
    pub read_ios: u64,
    pub disk_read_ns: u64,
    pub zram_read_ns: u64,
    /// Switch-ins the kernel did without a `sched_switch`, repaired from `sched_stat_runtime`
    /// (`attrib`'s spec); absent from traces written before it was counted.
    #[serde(default)]
    pub missed_switch_ins: u64,
    pub exited: bool,
}

impl ThreadTime {
    /// Add another thread's time (measured values add; unmeasured stay unmeasured; `exited` only
    /// when both exited).
    pub fn add(&mut self, other: &ThreadTime) {
        self.wall_ns += other.wall_ns;
        for (c, v) in other.components.iter() {
            if let Some(v) = v {
                self.components.add(c, v);
            }
        }
        for (c, v) in other.counters.iter() {
            if let Some(v) = v {
                self.counters.add(c, v);
            }
        }
        self.read_ios += other.read_ios;
        self.disk_read_ns += other.disk_read_ns;
        self.zram_read_ns += other.zram_read_ns;
        self.missed_switch_ins += other.missed_switch_ins;
        self.exited &= other.exited;
    }

    /// A counter's value, 0 when not measured.
    pub fn counter(&self, c: crate::model::Counter) -> u64 {
        self.counters.get(c).unwrap_or(0)
    }
}

/// Block reads the target caused on one device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceReads {
    /// `major:minor`.
    pub dev: String,
    /// Kernel name (`vda`, `zram0`, …) when known.
    pub name: Option<String>,
    pub read_bytes: u64,
    pub read_ios: u64,
    /// Σ queue→complete latency over the `completed` reads.
    pub read_ns: u64,
    pub completed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Component, Counter, Event};

    /// Threads without a slot (overflow rows: no `time`; the other row) are said, with how many;
    /// a run whose threads all had one says nothing.
    #[test]
    fn threads_without_a_slot_are_said() {
        let row = |tid, time: bool| ThreadTotals {
            tid,
            time: time.then(ThreadTime::default),
            faults: Some(FaultTotals::default()),
            ..Default::default()
        };
        let mut t = RunTotals { threads: alloc::vec![row(7, true), row(8, true)], ..Default::default() };
        assert_eq!(t.slotless_warning(), None);
        t.threads.extend([row(9, false), row(10, false)]);
        let w = t.slotless_warning().expect("overflow rows are said");
        assert!(w.starts_with("2 thread(s) of the target had no attribution slot: 256 threads at a time"), "{w}");
        assert!(!w.contains(OTHER_COMM), "{w}");
        t.threads.push(row(OTHER_TID, false));
        let w = t.slotless_warning().expect("the other row is said");
        assert!(w.starts_with("2 thread(s) of the target, and more without a row of their own,"), "{w}");
        assert!(w.contains("the last ones in the `(other threads)` row"), "{w}");
    }

    #[test]
    fn fault_totals_come_from_the_thread_state_and_its_fault_times() {
        use crate::{attrib::Hist, hist::bucket_of};
        let mut s = ThreadState::zeroed();
        let mut t = FaultTimes { majflt: Hist::zeroed(), minflt: Hist::zeroed() };
        assert_eq!(FaultTotals::from_kernel(&s, &t), None, "no fault seen");
        // As the exit program does: the state counts, the fault times keep the latency.
        for (enter, exit, major) in [(100, 350, false), (400, 1400, true), (2000, 2001, false)] {
            s.fault_enter(enter, &mut crate::attrib::Storm::zeroed(), false, 0);
            let (lat, _) = s.fault_exit(exit, major);
            let h = if major { &mut t.majflt } else { &mut t.minflt };
            h.add_in(bucket_of(lat), lat);
        }
        s.fault_enter(3000, &mut crate::attrib::Storm::zeroed(), false, 0);
        s.fault_enter(3100, &mut crate::attrib::Storm::zeroed(), false, 0);
        let f = FaultTotals::from_kernel(&s, &t).expect("faults seen");
        assert_eq!((f.majflt, f.minflt, f.majflt_ns, f.minflt_ns), (1, 2, 1000, 251));
        assert_eq!((f.unmatched_entries, f.unmatched_exits), (1, 0));
        assert_eq!(f.minflt_hist.iter().sum::<u64>(), 2);
        assert_eq!((f.majflt_hist[10], f.minflt_hist[8], f.minflt_hist[0]), (1, 1, 1));
    }

    /// The overflow entry's memcg close follows `ThreadState::fault_close`.
    #[test]
    fn overflow_entries_close_by_memcg_as_slotted_threads_do() {
        use crate::faults::{OVF_MAJOR, OverflowFaults};
        let mut o = OverflowFaults::zeroed(7);
        assert_eq!(o.close(100), None);
        o.enter(100);
        o.flags |= OVF_MAJOR;
        assert_eq!(o.close(300), Some((200, true)));
        assert!(!o.retried_major());
        o.enter(400);
        assert_eq!(o.close(410), Some((10, false)));
        assert!(o.retried_major());
        assert_eq!((o.minflt, o.majflt, o.unmatched_exits), (0, 2, 0));
    }

    #[test]
    fn threads_without_a_slot_keep_their_faults_and_the_rest_is_counted_without_time() {
        use crate::hist::bucket_of;
        let mut o = OverflowFaults::zeroed(7);
        // As the exit program does: the entry counts, the latency goes into its histogram.
        for (enter, exit, major) in [(100, 350, false), (400, 1400, true)] {
            o.enter(enter);
            let lat = o.exit(exit, major);
            let h = if major { &mut o.times.majflt } else { &mut o.times.minflt };
            h.add_in(bucket_of(lat), lat);
        }
        assert_eq!(o.exit(2000, false), 0, "an exit without an entry has no time");
        o.enter(3000);
        o.enter(3100);
        let f = FaultTotals::from_overflow(&o);
        assert_eq!((f.majflt, f.minflt, f.majflt_ns, f.minflt_ns), (1, 2, 1000, 250));
        assert_eq!((f.unmatched_entries, f.unmatched_exits), (1, 1));
        assert_eq!(f.minflt_hist.iter().sum::<u64>(), 1);
        assert_eq!(FaultTotals::other(0, 0), None);
        let other = FaultTotals::other(2, 5).expect("faults counted");
        assert_eq!((other.majflt, other.minflt, other.unmatched_exits, other.minflt_ns), (2, 5, 7, 0));
        assert_eq!(other.minflt_hist.len(), crate::hist::HIST_BUCKETS);
    }

    /// Module spec: a row per retired thread up to `MAX_RETIRED_ROWS`, then added to the last row
    /// of the same process and name, then of the same process; faults and time add up.
    #[test]
    fn retired_threads_keep_a_row_each_up_to_a_bound_then_add_up() {
        let row = |tid: u32, pid: u32, comm: &str| {
            let mut time = ThreadTime { wall_ns: 10, exited: true, ..Default::default() };
            time.components.set(Component::Compute, Some(4));
            ThreadTotals {
                tid,
                pid,
                comm: comm.into(),
                faults: Some(FaultTotals { minflt: 3, minflt_hist: alloc::vec![1, 2], ..Default::default() }),
                time: Some(time),
                folded: 0,
            }
        };
        let mut r = RetiredRows::default();
        for i in 0..MAX_RETIRED_ROWS as u32 {
            r.add(row(1000 + i, 7, "worker"));
        }
        assert_eq!(r.rows().len(), MAX_RETIRED_ROWS);
        r.add(row(90_000, 7, "worker"));
        r.add(row(90_001, 7, "worker"));
        assert_eq!(r.rows().len(), MAX_RETIRED_ROWS, "added to the last worker's row");
        let last = &r.rows()[MAX_RETIRED_ROWS - 1];
        assert_eq!((last.tid, last.folded), (1000 + MAX_RETIRED_ROWS as u32 - 1, 2));
        assert_eq!(last.faults.as_ref().map(|f| (f.minflt, f.minflt_hist.clone())), Some((9, alloc::vec![3, 6])));
        let t = last.time.as_ref().unwrap();
        assert_eq!((t.wall_ns, t.components.get(Component::Compute), t.exited), (30, Some(12), true));
        // New names still get rows, up to twice the bound; then one row per process.
        for i in 0..MAX_RETIRED_ROWS as u32 {
            r.add(row(200_000 + i, 8, &alloc::format!("w{i}")));
        }
        assert_eq!(r.rows().len(), 2 * MAX_RETIRED_ROWS);
        r.add(row(300_000, 8, "fresh"));
        r.add(row(300_001, 8, "fresher"));
        r.add(row(300_002, 7, "worker"));
        assert_eq!(r.rows().len(), 2 * MAX_RETIRED_ROWS + 1);
        let exited = r.rows().last().unwrap();
        assert_eq!((exited.tid, exited.comm.as_str(), exited.folded), (300_000, EXITED_COMM, 1));
        assert_eq!(r.rows()[MAX_RETIRED_ROWS - 1].folded, 3, "a known name still goes to its row");
        let j = serde_json::to_string(&r.rows()[0]).unwrap();
        assert!(!j.contains("folded"), "absent when 0: {j}");
    }

    #[test]
    fn totals_round_trip_with_vocabulary_names() {
        let mut time = ThreadTime { wall_ns: 10, read_ios: 2, exited: true, ..Default::default() };
        time.components.set(Component::Compute, Some(7));
        time.counters.set(Counter::MajfltFile, Some(3));
        let t = RunTotals {
            mono_ns: 5,
            threads: alloc::vec![ThreadTotals {
                tid: 42,
                pid: 40,
                comm: "engine".into(),
                faults: Some(FaultTotals { majflt: 3, majflt_hist: alloc::vec![0, 3], ..Default::default() }),
                time: Some(time),
                folded: 0,
            }],
            devices: alloc::vec![DeviceReads { dev: "253:0".into(), read_bytes: 4096, ..Default::default() }],
            evicted_by_process: alloc::vec![crate::model::ProcessEvictions {
                kind: "fadvise".into(),
                pid: 7,
                comm: "dd".into(),
                pages: 512,
            }],
        };
        let j = serde_json::to_string(&Event::Totals(t.clone())).unwrap();
        assert!(j.starts_with("{\"type\":\"totals\""), "{j}");
        assert!(j.contains("\"compute_ns\":7") && j.contains("\"majflt_file\":3"), "{j}");
        assert_eq!(serde_json::from_str::<Event>(&j).unwrap(), Event::Totals(t));
    }
}
