//! Token assembly: from the ring-buffer records of two marks (or two window
//! snapshots) to a [`TokenRecord`] of the model.
//!
//! Rule: a thread's share of a token is the difference of its cumulative
//! accumulators between the `begin` and the `end` snapshot (each closed at
//! its mark's instant, so they add up to the token's wall time for a thread
//! that lived through it). A thread first seen during the token contributes
//! from its first sighting; its `residual_ns` says what is missing.
//!
//! A marked step belongs to the process whose thread made its `begin` mark
//! (the engine, the decode call's caller): its thread rows, its counters (sums)
//! and its components are those of that process's threads only. Other observed
//! processes (a wrapper that started the engine, a launcher's other children)
//! carry no step time; their time is in the whole-run tables. The token-level
//! components are the mean over the step's threads that were on a CPU during
//! it (the decode thread and its workers), so the threads that did nothing in
//! the step (a server's idle HTTP threads, a sleeping main thread) are not in
//! the mean. A window has no caller: all observed threads are its threads.
//!
//! Explicit reads: a token or window is a span of `observer_common::xread`'s rule ("Spans"):
//! [`Assembler::span_reads`].
//!
//! Threads whose slots were given back (`observer_common::attrib::MAX_SLOTS`, "Slots"): the
//! kernel sends a thread's final state before it zeroes its slot, so a snapshot that follows
//! that record in the ring no longer finds the thread in the slots. Every snapshot therefore
//! takes the final states received so far of the threads it does not hold (by TID), until a
//! snapshot that begins a span (a `begin` mark, a window) has taken them: a token pairs a
//! thread's state at its `begin` with its final state, and a thread gone before a `begin` is
//! skipped (exited). Slots given back and not reused yet (TID 0) are skipped. Approximate: at
//! most [`MAX_PENDING_RETIRED`] final states wait for a `begin`; a span over more thread exits
//! than that (or a window's snapshot taken after a slot was given back, whose record was
//! drained before it) would count the oldest ones' whole lives in the span.

use std::collections::BTreeMap;

use observer_common::{
    attrib::{
        ExecRecord, F_EXITED, MarkRecord, N_CNT, N_TIME, PHASE_BEGIN, PHASE_END, REC_EXEC, REC_FD, REC_MARK, REC_READ,
        REC_RETIRED, REC_THREAD, RetiredRecord, ThreadRecord, ThreadState,
    },
    model::{
        Component, Components, Counter, Counters, EvictedBy, ExpertRead, ExplicitReads, ReadKinds, Refaults, StepKind,
        ThreadToken, TokenRecord,
    },
    totals::{RetiredRows, ThreadTotals},
    xread::{
        FdQuery, N_KINDS, N_TOTALS, ReadRecord, T_BYTES, T_CALLS, T_LOST_BYTES, T_NS, T_UNRESOLVED_BYTES,
        T_UNRESOLVED_CALLS,
    },
};

use crate::capture::{comm_str, engine_abi};

/// All threads' states at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub ts: u64,
    pub index: u64,
    pub threads: Vec<ThreadState>,
    pub engine: Option<Vec<u8>>,
    pub lost: u64,
    /// The model file's cumulative page-cache (adds, evictions) at this
    /// instant, when churn is measured.
    pub churn: Option<(u64, u64)>,
    /// The cumulative evictions per actor kind at this instant, when eviction blame is measured.
    pub evicted_by: Option<EvictedBy>,
    /// The cumulative refaults per kind at this instant, when eviction blame is measured.
    pub refaults: Option<Refaults>,
    /// The step's token count read from the probed call's arguments (a
    /// `begin` mark of a profile's entry point that knows the layout).
    pub n_tokens: Option<u64>,
    /// The cumulative explicit-read totals (`xread::T_*`) at this instant, when measured.
    pub xread: Option<[u64; N_TOTALS]>,
    /// The thread that made the mark (none for a window snapshot).
    pub tid: Option<u32>,
}

impl Snapshot {
    /// The threads' states at `ts`, with nothing else measured (a window's end, before the
    /// caller fills in what it has).
    pub fn of_threads(ts: u64, threads: Vec<ThreadState>) -> Snapshot {
        Snapshot {
            ts,
            index: 0,
            threads,
            engine: None,
            lost: 0,
            churn: None,
            evicted_by: None,
            refaults: None,
            n_tokens: None,
            xread: None,
            tid: None,
        }
    }
}

/// Final states of retired threads kept for the snapshots at most (module spec).
pub const MAX_PENDING_RETIRED: usize = 4096;

/// Reassembles ring-buffer records into snapshots and pairs them into tokens.
#[derive(Debug)]
pub struct Assembler {
    pending: Vec<ThreadState>,
    /// Final states of retired threads that no `begin` snapshot has taken yet (module spec).
    retired: std::collections::VecDeque<ThreadState>,
    /// Every retired thread's row, for the run's table.
    pub retired_rows: RetiredRows,
    pending_seq: u64,
    begin: Option<Snapshot>,
    next_seq: u64,
    /// The kind of a step without an engine record (what marks the steps).
    pub default_kind: StepKind,
    /// Records that could not be parsed (never expected; counted, not hidden).
    pub malformed: u64,
    /// The observed processes (by PID) that called `exec` since this was
    /// last cleared, in order, with the kernel's time of the exec.
    pub execs: Vec<(u32, u64)>,
    /// Page-cache churn of the model file is counted (marks carry it).
    pub churn: bool,
    /// Its evictions are counted per actor kind too (marks carry them).
    pub blame: bool,
    /// Explicit reads are measured: the routed expert `(layer, expert)` of each churn interval
    /// (`None`: not an expert), to fold the read records into experts.
    pub xread: Option<Vec<Option<(u32, u32)>>>,
    /// Bytes and calls per interval of the read records since the current token's `begin` mark
    /// (or the current window's start).
    reads: BTreeMap<u32, (u64, u32)>,
    /// `(tgid, fd)` of the descriptors the kernel asked about since this was last cleared.
    pub fd_queries: Vec<(u32, u32)>,
}

fn read<T: Copy>(b: &[u8]) -> Option<T> {
    if b.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked; T is a repr(C) plain-data type.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

impl Assembler {
    pub fn new(default_kind: StepKind) -> Self {
        Assembler {
            pending: Vec::new(),
            retired: Default::default(),
            retired_rows: RetiredRows::default(),
            pending_seq: 0,
            begin: None,
            next_seq: 0,
            default_kind,
            malformed: 0,
            execs: Vec::new(),
            churn: false,
            blame: false,
            xread: None,
            reads: BTreeMap::new(),
            fd_queries: Vec::new(),
        }
    }

    /// Feed one ring-buffer record; returns a token when it completes one.
    pub fn push(&mut self, bytes: &[u8]) -> Option<TokenRecord> {
        let Some(kind) = read::<u32>(bytes) else {
            self.malformed += 1;
            return None;
        };
        match kind {
            REC_THREAD => {
                let Some(r) = read::<ThreadRecord>(bytes) else {
                    self.malformed += 1;
                    return None;
                };
                if r.mark_seq != self.pending_seq {
                    self.pending.clear();
                    self.pending_seq = r.mark_seq;
                }
                self.pending.push(r.state);
                None
            }
            REC_MARK => {
                let Some(m) = read::<MarkRecord>(bytes) else {
                    self.malformed += 1;
                    return None;
                };
                let mut threads =
                    if m.mark_seq == self.pending_seq { std::mem::take(&mut self.pending) } else { Vec::new() };
                threads.retain(|t| t.tid != 0);
                self.add_retired(&mut threads);
                // The kernel sends raw copies: close them at the mark's instant.
                for t in &mut threads {
                    t.account(m.ts);
                }
                let snap = Snapshot {
                    ts: m.ts,
                    index: m.index,
                    threads,
                    engine: (m.has_engine != 0).then(|| m.engine.to_vec()),
                    lost: m.n_lost as u64,
                    churn: self.churn.then_some((m.churn_added, m.churn_evicted)),
                    evicted_by: (self.churn && self.blame).then_some(EvictedBy(m.churn_evicted_by)),
                    refaults: (self.churn && self.blame).then_some(Refaults {
                        pages: EvictedBy(m.churn_refaulted_by),
                        faults: EvictedBy(m.churn_refault_faults),
                        fault_io_ns: EvictedBy(m.churn_refault_io_ns),
                    }),
                    n_tokens: (m.n_tokens_known != 0).then_some(m.n_tokens as u64),
                    xread: self.xread.is_some().then_some(m.xread),
                    tid: Some(m.tid),
                };
                match m.phase {
                    PHASE_BEGIN => {
                        self.retired.clear();
                        self.begin = Some(snap);
                        self.reads.clear();
                        None
                    }
                    PHASE_END => {
                        let Some(begin) = self.begin.take() else {
                            self.reads.clear();
                            return None;
                        };
                        let mut t = build(&begin, &snap, self.next_seq, self.default_kind);
                        t.explicit_reads = self.span_reads(&begin, &snap);
                        self.next_seq += 1;
                        Some(t)
                    }
                    _ => {
                        self.malformed += 1;
                        None
                    }
                }
            }
            REC_READ => {
                match read::<ReadRecord>(bytes) {
                    Some(r) if self.begin.is_some() => {
                        let e = self.reads.entry(r.interval).or_default();
                        e.0 += r.bytes;
                        e.1 += 1;
                    }
                    Some(_) => {} // between tokens
                    None => self.malformed += 1,
                }
                None
            }
            REC_FD => {
                match read::<FdQuery>(bytes) {
                    Some(q) => self.fd_queries.push((q.tgid, q.fd)),
                    None => self.malformed += 1,
                }
                None
            }
            REC_RETIRED => {
                let Some(r) = read::<RetiredRecord>(bytes) else {
                    self.malformed += 1;
                    return None;
                };
                if self.retired.len() == MAX_PENDING_RETIRED {
                    self.retired.pop_front();
                }
                self.retired.push_back(r.state);
                self.retired_rows.add(ThreadTotals::from_kernel(&r.state, &r.faults));
                None
            }
            REC_EXEC => {
                // After exec the caller is its process's only thread: its TID is the PID.
                match read::<ExecRecord>(bytes) {
                    Some(e) => self.execs.push((e.tid, e.ts)),
                    None => self.malformed += 1,
                }
                None
            }
            _ => {
                self.malformed += 1;
                None
            }
        }
    }

    /// Records completed so far.
    pub fn records(&self) -> u64 {
        self.next_seq
    }

    /// The final states of retired threads that `threads` does not hold (module spec).
    fn add_retired(&self, threads: &mut Vec<ThreadState>) {
        let missing: Vec<ThreadState> = self.retired.iter().filter(|r| !holds(threads.iter(), r)).copied().collect();
        threads.extend(missing);
    }

    /// Whether `s` is the state of a thread whose final state came since the last `begin`
    /// snapshot (module spec).
    pub fn retired_since_begin(&self, s: &ThreadState) -> bool {
        holds(self.retired.iter(), s)
    }

    /// Window mode: `snap` ends the current window (if any) and begins the next. The caller
    /// drains the ring before it takes `snap` (a window's end in the rule's "Spans"), and again
    /// after it (the final states of threads whose slots were given back before it: module spec).
    pub fn window(&mut self, mut snap: Snapshot) -> Option<TokenRecord> {
        self.add_retired(&mut snap.threads);
        self.retired.clear();
        let Some(begin) = self.begin.replace(snap.clone()) else {
            self.reads.clear();
            return None;
        };
        let mut t = build(&begin, &snap, self.next_seq, StepKind::Window);
        t.explicit_reads = self.span_reads(&begin, &snap);
        self.next_seq += 1;
        Some(t)
    }

    /// The explicit reads of the span from `begin` to `end` (`observer_common::xread`, "Spans"):
    /// per kind the difference of their totals, per expert the read records taken since `begin`
    /// (which starts the next span empty). `None` when reads are not measured.
    fn span_reads(&mut self, begin: &Snapshot, end: &Snapshot) -> Option<ExplicitReads> {
        let records = std::mem::take(&mut self.reads);
        let (cells, b, e) = (self.xread.as_ref()?, begin.xread?, end.xread?);
        Some(explicit_reads(&b, &e, &records, cells))
    }
}

/// Whether `states` hold a state of the thread of `s`: the same TID, first seen at the same instant
/// (a TID is reused once its thread is gone).
fn holds<'a>(states: impl IntoIterator<Item = &'a ThreadState>, s: &ThreadState) -> bool {
    states.into_iter().any(|t| t.tid == s.tid && t.first_ts == s.first_ts)
}

/// A span's explicit reads: the difference of the totals at its ends `b` and `e`, and its read
/// records folded into experts (`cells`: interval → `(layer, expert)`).
fn explicit_reads(
    b: &[u64; N_TOTALS],
    e: &[u64; N_TOTALS],
    reads: &BTreeMap<u32, (u64, u32)>,
    cells: &[Option<(u32, u32)>],
) -> ExplicitReads {
    let d = |i: usize| e[i].saturating_sub(b[i]);
    let kinds = |base: usize| ReadKinds(std::array::from_fn::<u64, N_KINDS, _>(|k| d(base + k)));
    let mut experts: BTreeMap<(u32, u32), (u64, u32)> = BTreeMap::new();
    for (&i, &(bytes, calls)) in reads {
        if let Some(Some(c)) = cells.get(i as usize) {
            let x = experts.entry(*c).or_default();
            x.0 += bytes;
            x.1 += calls;
        }
    }
    ExplicitReads {
        bytes: kinds(T_BYTES),
        ns: kinds(T_NS),
        calls: kinds(T_CALLS),
        unresolved_bytes: d(T_UNRESOLVED_BYTES),
        unresolved_calls: d(T_UNRESOLVED_CALLS),
        experts: experts
            .into_iter()
            .map(|((layer, expert), (bytes, calls))| ExpertRead { layer, expert, bytes, calls })
            .collect(),
        lost_bytes: d(T_LOST_BYTES),
    }
}

fn on_cpu(t: &[u64; N_TIME]) -> u64 {
    Component::ALL.iter().filter(|c| c.on_cpu()).filter_map(|c| c.slot()).map(|s| t[s]).sum()
}

/// Pair two snapshots into a token record.
pub fn build(begin: &Snapshot, end: &Snapshot, seq: u64, default_kind: StepKind) -> TokenRecord {
    let wall = end.ts.saturating_sub(begin.ts);
    let mut threads = Vec::new();
    let mut sum_active = [0u64; N_TIME];
    let mut n_active = 0u64;
    let mut counters = [0u64; N_CNT];
    // The step's process (module rule): the caller's, from its thread's state at either mark.
    let process = begin.tid.and_then(|tid| begin.threads.iter().chain(&end.threads).find(|t| t.tid == tid));
    let process = process.map(|t| t.tgid);
    for e in end.threads.iter().filter(|e| process.is_none_or(|p| e.tgid == p)) {
        let b = begin.threads.iter().find(|b| b.tid == e.tid);
        if let Some(b) = b
            && b.flags & F_EXITED != 0
        {
            continue; // gone before the token
        }
        let zero = [0u64; N_TIME];
        let zero_c = [0u64; N_CNT];
        let (bt, bc) = b.map(|b| (&b.time, &b.cnt)).unwrap_or((&zero, &zero_c));
        let mut dt = [0u64; N_TIME];
        for i in 0..N_TIME {
            dt[i] = e.time[i].saturating_sub(bt[i]);
        }
        let mut dc = [0u64; N_CNT];
        for i in 0..N_CNT {
            dc[i] = e.cnt[i].saturating_sub(bc[i]);
            counters[i] += dc[i];
        }
        let sum: u64 = dt.iter().sum();
        if on_cpu(&dt) > 0 {
            n_active += 1;
            for i in 0..N_TIME {
                sum_active[i] += dt[i];
            }
        }
        threads.push(ThreadToken {
            tid: e.tid,
            comm: comm_str(&e.comm),
            components: Components::from_kernel(&dt),
            counters: Counters::from_kernel(&dc),
            residual_ns: wall as i64 - sum as i64,
        });
    }
    let mean = if n_active == 0 { [0; N_TIME] } else { sum_active.map(|v| v / n_active) };
    let components = Components::from_kernel(&mean);
    let decoded = end.engine.as_deref().and_then(engine_abi::decode);
    let (kind, index, n_tokens, engine) = match decoded {
        Some(d) => (d.kind, Some(d.index), d.n_tokens, Some(d.telemetry)),
        None => (default_kind, (default_kind != StepKind::Window).then_some(end.index), 1, None),
    };
    // A call's own count, read at its entry: more than one token is a prompt.
    let (kind, n_tokens) = match begin.n_tokens {
        Some(n) if end.engine.is_none() => (if n > 1 { StepKind::Prompt } else { StepKind::Generate }, n),
        _ => (kind, n_tokens),
    };
    let mut counters = Counters::from_kernel(&counters);
    if let (Some(b), Some(e)) = (begin.churn, end.churn) {
        counters.set(Counter::PagecacheAdded, Some(e.0.saturating_sub(b.0)));
        counters.set(Counter::PagecacheEvicted, Some(e.1.saturating_sub(b.1)));
    }
    TokenRecord {
        seq,
        index,
        kind,
        n_tokens,
        start_ns: begin.ts,
        wall_ns: wall,
        residual_ns: wall as i64 - components.sum() as i64,
        components,
        counters,
        engine_compute_ns: engine.as_ref().and_then(|e| e.compute_ns),
        threads,
        engine,
        residency: None,
        lost_events: end.lost,
        evicted_by: begin.evicted_by.zip(end.evicted_by).map(|(b, e)| e.since(&b)),
        refaults: begin.refaults.zip(end.refaults).map(|(b, e)| e.since(&b)),
        explicit_reads: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::attrib::{F_ON_CPU, T_COMPUTE, T_SLEEP};

    fn st(tid: u32, compute: u64, sleep: u64) -> ThreadState {
        let mut s = ThreadState::zeroed();
        s.tid = tid;
        s.flags = F_ON_CPU;
        s.time[T_COMPUTE] = compute;
        s.time[T_SLEEP] = sleep;
        s
    }

    fn snap(ts: u64, threads: Vec<ThreadState>) -> Snapshot {
        Snapshot::of_threads(ts, threads)
    }

    /// The bytes of a ring-buffer record.
    fn raw<T: Copy>(r: &T) -> Vec<u8> {
        // SAFETY: a repr(C) plain-data record, read as its bytes.
        unsafe { std::slice::from_raw_parts((r as *const T).cast::<u8>(), std::mem::size_of::<T>()) }.to_vec()
    }

    #[test]
    fn a_window_carries_the_explicit_reads_between_its_snapshots() {
        let mut asm = Assembler::new(StepKind::Window);
        // Intervals 0 and 2 are experts (layer 3, expert 1) and (layer 3, expert 5); 1 is not.
        asm.xread = Some(vec![Some((3, 1)), None, Some((3, 5))]);
        let totals = |experts: u64, calls: u64, unresolved: u64| {
            let mut t = [0u64; N_TOTALS];
            t[T_BYTES + observer_common::xread::K_EXPERTS] = experts;
            t[T_CALLS + observer_common::xread::K_EXPERTS] = calls;
            t[T_UNRESOLVED_BYTES] = unresolved;
            t
        };
        let at = |ts, t| Snapshot { xread: Some(t), ..snap(ts, vec![st(1, 0, 0)]) };
        let read = |interval, bytes| raw(&ReadRecord { kind: REC_READ, tid: 1, interval, _pad: 0, bytes });
        assert!(asm.push(&read(0, 99)).is_none(), "before the first window: no window to charge");
        assert!(asm.window(at(1000, totals(99, 1, 7))).is_none());
        for r in [read(0, 4096), read(2, 100), read(0, 4096)] {
            assert!(asm.push(&r).is_none());
        }
        let w = asm.window(at(2000, totals(99 + 8292, 4, 7))).expect("a window");
        let x = w.explicit_reads.expect("explicit reads");
        assert_eq!(
            (x.bytes.0[observer_common::xread::K_EXPERTS], x.calls.0[observer_common::xread::K_EXPERTS]),
            (8292, 3)
        );
        assert_eq!(x.unresolved_bytes, 0);
        let e = |layer, expert, bytes, calls| ExpertRead { layer, expert, bytes, calls };
        assert_eq!(x.experts, [e(3, 1, 8192, 2), e(3, 5, 100, 1)]);
        // The next window starts empty.
        let w = asm.window(at(3000, totals(99 + 8292, 4, 7))).expect("a window");
        assert!(w.explicit_reads.expect("measured").experts.is_empty());
    }

    #[test]
    fn token_is_the_difference_of_two_snapshots() {
        let b = snap(1000, vec![st(1, 100, 0), st(2, 0, 50), st(3, 0, 10)]);
        let e = snap(2000, vec![st(1, 900, 200), st(2, 600, 450), st(3, 0, 1010)]);
        let t = build(&b, &e, 0, StepKind::Generate);
        assert_eq!(t.wall_ns, 1000);
        // Threads 1 and 2 ran; thread 3 slept throughout and is not in the mean.
        assert_eq!(t.components.get(Component::Compute), Some((800 + 600) / 2));
        assert_eq!(t.components.get(Component::Sleep), Some((200 + 400) / 2));
        assert_eq!(t.residual_ns, 0);
        assert_eq!(t.threads.len(), 3);
        assert!(t.threads.iter().all(|th| th.residual_ns == 0));
    }

    #[test]
    fn a_step_is_its_callers_process_and_a_wrapper_carries_none_of_it() {
        let of = |tid, tgid, compute, sleep| ThreadState { tgid, ..st(tid, compute, sleep) };
        // The wrapper (process 1) ran during the step too; the caller is thread 10 of process 10.
        let mut b = snap(1000, vec![of(1, 1, 0, 0), of(10, 10, 0, 0), of(11, 10, 0, 0)]);
        let e = snap(2000, vec![of(1, 1, 100, 900), of(10, 10, 800, 200), of(11, 10, 600, 400)]);
        let window = build(&b, &e, 0, StepKind::Window);
        assert_eq!(window.components.get(Component::Compute), Some((100 + 800 + 600) / 3), "a window: every thread");
        b.tid = Some(10);
        let t = build(&b, &e, 0, StepKind::Generate);
        assert_eq!(t.components.get(Component::Compute), Some((800 + 600) / 2));
        assert_eq!(t.components.get(Component::Sleep), Some((200 + 400) / 2));
        assert_eq!(t.threads.iter().map(|th| th.tid).collect::<Vec<_>>(), [10, 11], "the wrapper has no row");
    }

    #[test]
    fn a_new_thread_reports_what_is_missing() {
        let b = snap(1000, vec![st(1, 0, 0)]);
        let e = snap(2000, vec![st(1, 1000, 0), st(9, 300, 0)]);
        let t = build(&b, &e, 0, StepKind::Generate);
        let th = t.threads.iter().find(|t| t.tid == 9).unwrap();
        assert_eq!(th.residual_ns, 700);
    }

    #[test]
    fn window_mode_pairs_consecutive_snapshots() {
        let mut a = Assembler::new(StepKind::Window);
        assert!(a.window(snap(0, vec![st(1, 0, 0)])).is_none());
        let t = a.window(snap(100, vec![st(1, 100, 0)])).unwrap();
        assert_eq!((t.kind, t.wall_ns, t.index), (StepKind::Window, 100, None));
        let t = a.window(snap(300, vec![st(1, 250, 50)])).unwrap();
        assert_eq!(t.seq, 1);
        assert_eq!(t.components.get(Component::Compute), Some(150));
    }

    /// A retired thread's final-state record, as `thread_free` sends it.
    fn retired(s: ThreadState) -> Vec<u8> {
        // SAFETY: plain data; zero is a valid value of every field.
        let mut r: RetiredRecord = unsafe { std::mem::zeroed() };
        r.kind = REC_RETIRED;
        r.state = s;
        raw(&r)
    }

    fn exited(s: ThreadState) -> ThreadState {
        ThreadState { flags: F_EXITED, ..s }
    }

    /// A mark's records: a thread record per state (a zeroed slot has TID 0), each accounted up to
    /// the mark, then the mark.
    fn mark(asm: &mut Assembler, seq: u64, phase: u32, ts: u64, states: &[ThreadState]) -> Option<TokenRecord> {
        for &state in states {
            let state = ThreadState { last_ts: ts, ..state };
            assert!(asm.push(&raw(&ThreadRecord { kind: REC_THREAD, phase, mark_seq: seq, state })).is_none());
        }
        // SAFETY: plain data; zero is a valid value of every field.
        let mut m: MarkRecord = unsafe { std::mem::zeroed() };
        (m.kind, m.phase, m.mark_seq, m.ts, m.tid) = (REC_MARK, phase, seq, ts, 1);
        asm.push(&raw(&m))
    }

    /// Module spec, "Threads whose slots were given back": a thread gone during a token is in it
    /// from its final state, once, and not in the next; a slot given back (TID 0) is no thread.
    #[test]
    fn a_thread_whose_slot_was_given_back_is_in_its_last_token_from_its_final_state() {
        let mut asm = Assembler::new(StepKind::Generate);
        assert!(mark(&mut asm, 1, PHASE_BEGIN, 1000, &[st(1, 0, 0), st(2, 100, 0)]).is_none());
        assert!(asm.push(&retired(exited(st(2, 400, 0)))).is_none());
        let t = mark(&mut asm, 2, PHASE_END, 2000, &[st(1, 1000, 0), ThreadState::zeroed()]).expect("a token");
        let tids: Vec<u32> = t.threads.iter().map(|t| t.tid).collect();
        assert_eq!(tids, [1, 2], "the gone thread from its final state, no row for the blank slot");
        assert_eq!(t.threads[1].components.get(Component::Compute), Some(300));
        assert!(mark(&mut asm, 3, PHASE_BEGIN, 3000, &[st(1, 1000, 0)]).is_none());
        let t = mark(&mut asm, 4, PHASE_END, 4000, &[st(1, 2000, 0)]).expect("a token");
        assert_eq!(t.threads.iter().map(|t| t.tid).collect::<Vec<_>>(), [1], "gone before the token");
        let rows = asm.retired_rows.rows();
        assert_eq!((rows.len(), rows[0].tid), (1, 2), "the run's table keeps its row");
        assert_eq!(rows[0].time.as_ref().map(|t| t.exited), Some(true));
        // A thread that lived its whole life within a window.
        let mut w = Assembler::new(StepKind::Window);
        assert!(w.window(snap(0, vec![st(1, 0, 0)])).is_none());
        assert!(w.push(&retired(exited(ThreadState { first_ts: 10, ..st(5, 70, 0) }))).is_none());
        let t = w.window(snap(100, vec![st(1, 100, 0)])).expect("a window");
        let five = t.threads.iter().find(|t| t.tid == 5).expect("the short-lived thread");
        assert_eq!(five.components.get(Component::Compute), Some(70));
        let t = w.window(snap(200, vec![st(1, 200, 0)])).expect("a window");
        assert!(t.threads.iter().all(|t| t.tid != 5), "not again");
    }

    #[test]
    fn malformed_records_are_counted() {
        let mut a = Assembler::new(StepKind::Call);
        assert!(a.push(&[1, 2]).is_none());
        assert!(a.push(&[9, 0, 0, 0, 0, 0, 0, 0]).is_none());
        assert_eq!(a.malformed, 2);
    }
}
