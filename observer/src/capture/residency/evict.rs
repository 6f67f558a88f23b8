//! Eviction blame: who evicted the model file's pages (kernel side
//! `observer-ebpf/src/evict.rs`; rule and layout in `observer_common::evict`).
//!
//! [`attach`] gives the churn intervals their region class, the kernel the system-call rules of
//! this architecture, and attaches the reclaim-window programs; the per-actor counters then grow
//! in the same event as the churn counters. [`read`] returns the table: one [`ActorRow`] per actor
//! (kind, pid, comm, system call, cgroup) and one overflow row per kind for actors the bounded
//! table could not hold, so `Σ rows == Counts::del_pages` at any read that sees no eviction in
//! flight; and the pages added back after an eviction (refaults) per kind of the eviction.

use std::collections::BTreeMap;

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData},
    programs::TracePoint,
};
use observer_common::{
    evict::{
        ActorKey, ActorPages, C_DENSE, C_OTHER, C_ROUTED, C_SHARED, EvictConfig, K_OTHER, MAX_SYSCALL, N_KINDS,
        S_NOT_REMEMBERED, S_REFAULT_FAULT_LOST, S_WINDOW_LOST, sys,
    },
    filemap::NO_FIELD,
    model::{EvictedBy, ProcessEvictions},
    vocab::{EVICTION_ACTORS, OTHER},
};

use super::{
    ResidencyError,
    churn::{Intervals, Owner},
};
use crate::capture::preflight;

/// (program, category, tracepoint) of the reclaim windows.
const WINDOWS: [(&str, &str, &str); 4] = [
    ("evict_direct_begin", "vmscan", "mm_vmscan_direct_reclaim_begin"),
    ("evict_reclaim_end", "vmscan", "mm_vmscan_direct_reclaim_end"),
    ("evict_memcg_begin", "vmscan", "mm_vmscan_memcg_reclaim_begin"),
    ("evict_reclaim_end", "vmscan", "mm_vmscan_memcg_reclaim_end"),
];

/// The kernel side's system-call field: [`sys::NR_FIELD`] of this architecture, or none.
fn config() -> EvictConfig {
    match sys::NR_FIELD {
        Some(f) => EvictConfig { enabled: 1, syscall_off: f.offset, syscall_bytes: f.bytes, _pad: 0 },
        None => EvictConfig { enabled: 1, syscall_off: NO_FIELD, syscall_bytes: 0, _pad: 0 },
    }
}

fn err(what: &str) -> impl Fn(aya::maps::MapError) -> ResidencyError + '_ {
    move |e| ResidencyError::Churn(format!("eviction blame: {what}: {e}"))
}

/// What [`attach`] attached and what it could not, and the maps [`Attached::read`] reads
/// (taken out of the object: they live as long as this).
pub struct Attached {
    pub attached: Vec<String>,
    pub missing: Vec<String>,
    actors: HashMap<MapData, ActorKey, ActorPages>,
    overflow: Array<MapData, ActorPages>,
    stats: Array<MapData, u64>,
    refaults: Array<MapData, u64>,
    /// [`v2_memcg_of`] per cgroup v2 ID, once looked up (an ID is never reused).
    v2_memcgs: std::sync::Mutex<std::collections::HashMap<u64, Option<String>>>,
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attached").field("attached", &self.attached).field("missing", &self.missing).finish()
    }
}

fn take<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<T, ResidencyError> {
    let m = ebpf
        .take_map(name)
        .ok_or_else(|| ResidencyError::Churn(format!("the eBPF object has no map {name} (stale build?)")))?;
    T::try_from(m).map_err(err(name))
}

/// Configure eviction blame in `ebpf` for the churn `intervals` and attach its programs. The
/// churn programs (attached by the caller) do the counting.
pub fn attach(ebpf: &mut Ebpf, intervals: &Intervals) -> Result<Attached, ResidencyError> {
    {
        let m = ebpf.map_mut("EVICT_CLASS").ok_or_else(|| ResidencyError::Churn("no map EVICT_CLASS".into()))?;
        let mut a: Array<_, u32> = Array::try_from(m).map_err(err("EVICT_CLASS"))?;
        for (i, o) in intervals.owners.iter().enumerate() {
            let c = match o {
                Owner::Dense => C_DENSE,
                Owner::Shared => C_SHARED,
                Owner::Cell(_) => C_ROUTED,
                Owner::Other => C_OTHER,
            };
            a.set(i as u32, c, 0).map_err(err("EVICT_CLASS"))?;
        }
    }
    if sys::NR_FIELD.is_some() {
        let m = ebpf.map_mut("EVICT_SYSCALLS").ok_or_else(|| ResidencyError::Churn("no map EVICT_SYSCALLS".into()))?;
        let mut a: Array<_, u32> = Array::try_from(m).map_err(err("EVICT_SYSCALLS"))?;
        for rule in sys::RULES {
            debug_assert!(rule.nr < MAX_SYSCALL);
            a.set(rule.nr, rule.kind + 1, 0).map_err(err("EVICT_SYSCALLS"))?;
        }
    }
    let (mut attached, mut missing) = (Vec::new(), Vec::new());
    for (program, category, name) in WINDOWS {
        if !preflight::tracepoint_exists(category, name) {
            missing.push(format!("{category}:{name} (not on this kernel: its evictions count by comm/system call)"));
            continue;
        }
        let prog: &mut TracePoint = ebpf
            .program_mut(program)
            .ok_or_else(|| ResidencyError::Churn(format!("the eBPF object has no program {program}")))?
            .try_into()
            .map_err(|e| ResidencyError::Churn(format!("{program}: {e}")))?;
        if prog.fd().is_err() {
            prog.load().map_err(|e| ResidencyError::Churn(format!("loading {program}: {e}")))?;
        }
        match prog.attach(category, name) {
            Ok(_) => attached.push(format!("tp:{category}:{name}")),
            Err(e) => missing.push(format!("{category}:{name} ({e})")),
        }
    }
    let m = ebpf.map_mut("EVICT_CONFIG").ok_or_else(|| ResidencyError::Churn("no map EVICT_CONFIG".into()))?;
    let mut a: Array<_, EvictConfig> = Array::try_from(m).map_err(err("EVICT_CONFIG"))?;
    a.set(0, config(), 0).map_err(err("EVICT_CONFIG"))?;
    Ok(Attached {
        attached,
        missing,
        actors: take(ebpf, "EVICT_ACTORS")?,
        overflow: take(ebpf, "EVICT_OVERFLOW")?,
        stats: take(ebpf, "EVICT_STATS")?,
        refaults: take(ebpf, "EVICT_REFAULTS")?,
        v2_memcgs: Default::default(),
    })
}

/// One actor's evictions (cumulative since [`attach`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ActorRow {
    /// Vocabulary name of the kind (`vocab::EVICTION_ACTORS`).
    pub kind: &'static str,
    /// Process ID (the kernel's tgid; 0 for the overflow rows).
    pub pid: u32,
    /// Task name at the eviction (`other` for the overflow rows).
    pub comm: String,
    /// The system call it was in, when one of the rules' calls.
    pub syscall: Option<String>,
    /// cgroup v2 ID (`bpf_get_current_cgroup_id`).
    pub cgroup_v2: u64,
    /// Memory cgroup path from `/proc/PID/cgroup` at read time; when the process is gone, its
    /// cgroup v2 group's path if memory is on v2 and the group exists ([`v2_memcg_of`]); else `None`.
    pub memcg: Option<String>,
    pub events: u64,
    pub pages: u64,
    pub dense_pages: u64,
    pub shared_pages: u64,
    pub routed_pages: u64,
    pub other_pages: u64,
    pub spill_pages: u64,
    /// This is a kind's row of actors the bounded table could not hold.
    pub overflow: bool,
}

/// The blame table.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Table {
    /// Sorted by pages, most first.
    pub rows: Vec<ActorRow>,
    /// Reclaim windows the kernel could not record (their evictions fell to the next rule).
    pub windows_lost: u64,
    /// Pages added back to the page cache after an eviction, per kind of the eviction
    /// (`vocab::EVICTION_ACTORS` order; rule in `observer_common::evict`).
    pub refaults: [u64; N_KINDS as usize],
    /// Evicted pages the kernel could not remember (their refaults are not counted).
    pub not_remembered: u64,
    /// Refault faults the kernel could not follow to their exit (their `fault_io` is not counted).
    pub refault_faults_lost: u64,
}

impl Table {
    pub fn pages(&self) -> u64 {
        self.rows.iter().map(|r| r.pages).sum()
    }
    /// Pages per kind, in vocabulary order.
    pub fn by_kind(&self) -> [u64; N_KINDS as usize] {
        let mut k = [0; N_KINDS as usize];
        for r in &self.rows {
            if let Some(i) = EVICTION_ACTORS.iter().position(|a| a.name == r.kind) {
                k[i] += r.pages;
            }
        }
        k
    }
    /// Pages of the rows matching `f`.
    pub fn pages_where(&self, f: impl Fn(&ActorRow) -> bool) -> u64 {
        self.rows.iter().filter(|r| f(r)).map(|r| r.pages).sum()
    }
    /// Refaulted pages per kind as a per-kind object (`model::EvictedBy`).
    pub fn refaulted(&self) -> EvictedBy {
        EvictedBy(self.refaults)
    }

    /// The rows per process (model rule: `model::ProcessEvictions`): the actors of one kind and
    /// process are one row (the kernel's key also has the system call and the cgroup), the `max`
    /// with the most pages are listed, and the pages of the others and of the overflow rows are
    /// in one row per kind with PID 0 and comm `other`. The rows add up to [`Table::pages`].
    pub fn by_process(&self, max: usize) -> Vec<ProcessEvictions> {
        let mut merged: BTreeMap<(&'static str, u32, &str), u64> = BTreeMap::new();
        let mut rest = [0u64; N_KINDS as usize];
        for r in &self.rows {
            if r.overflow {
                rest[kind_index(r.kind)] += r.pages;
            } else {
                *merged.entry((r.kind, r.pid, r.comm.as_str())).or_default() += r.pages;
            }
        }
        let mut rows: Vec<ProcessEvictions> = merged
            .into_iter()
            .filter(|x| x.1 > 0)
            .map(|((kind, pid, comm), pages)| ProcessEvictions { kind: kind.into(), pid, comm: comm.into(), pages })
            .collect();
        rows.sort_by(|a, b| b.pages.cmp(&a.pages).then(a.pid.cmp(&b.pid)).then(a.kind.cmp(&b.kind)));
        for r in rows.drain(max.min(rows.len())..) {
            rest[kind_index(&r.kind)] += r.pages;
        }
        for (k, pages) in rest.into_iter().enumerate().filter(|x| x.1 > 0) {
            rows.push(ProcessEvictions { kind: EVICTION_ACTORS[k].name.into(), pid: 0, comm: OTHER.into(), pages });
        }
        rows
    }

    /// Rows whose pages grew since `base` (same actor), with the growth; for per-interval views.
    pub fn since(&self, base: &Table) -> Table {
        let mut rows: Vec<ActorRow> = self
            .rows
            .iter()
            .filter_map(|r| {
                let b = base.rows.iter().find(|b| same_actor(b, r));
                let mut d = r.clone();
                if let Some(b) = b {
                    d.events -= b.events.min(d.events);
                    d.pages -= b.pages.min(d.pages);
                    d.dense_pages -= b.dense_pages.min(d.dense_pages);
                    d.shared_pages -= b.shared_pages.min(d.shared_pages);
                    d.routed_pages -= b.routed_pages.min(d.routed_pages);
                    d.other_pages -= b.other_pages.min(d.other_pages);
                    d.spill_pages -= b.spill_pages.min(d.spill_pages);
                }
                (d.pages > 0).then_some(d)
            })
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.pages));
        let mut refaults = self.refaults;
        for (r, b) in refaults.iter_mut().zip(base.refaults) {
            *r -= b.min(*r);
        }
        Table {
            rows,
            windows_lost: self.windows_lost - base.windows_lost.min(self.windows_lost),
            refaults,
            not_remembered: self.not_remembered - base.not_remembered.min(self.not_remembered),
            refault_faults_lost: self.refault_faults_lost - base.refault_faults_lost.min(self.refault_faults_lost),
        }
    }
}

/// The vocabulary index of a kind's name (`other` for a name it does not know).
fn kind_index(name: &str) -> usize {
    EVICTION_ACTORS.iter().position(|a| a.name == name).unwrap_or(K_OTHER as usize)
}

fn same_actor(a: &ActorRow, b: &ActorRow) -> bool {
    (a.kind, a.pid, &a.comm, &a.syscall, a.cgroup_v2, a.overflow)
        == (b.kind, b.pid, &b.comm, &b.syscall, b.cgroup_v2, b.overflow)
}

fn comm(c: &[u8; 16]) -> String {
    let n = c.iter().position(|&b| b == 0).unwrap_or(16);
    String::from_utf8_lossy(&c[..n]).into_owned()
}

/// The memory cgroup of a live process (v1 `memory` controller line, else the v2 line).
pub fn memcg_of(pid: u32) -> Option<String> {
    let groups = procfs::process::Process::new(pid as i32).and_then(|p| p.cgroups()).ok()?.0;
    let v1 = groups.iter().find(|g| g.controllers.iter().any(|c| c == "memory"));
    v1.or_else(|| groups.iter().find(|g| g.controllers.is_empty())).map(|g| g.pathname.clone())
}

/// Directories of a cgroup2 hierarchy walked to find a group by its ID, at most.
const MAX_V2_WALK: usize = 65536;

/// The memory cgroup whose cgroup v2 ID (`bpf_get_current_cgroup_id`: the inode of its directory)
/// is `id`, as `/proc/PID/cgroup` names it (`/a/b`), when the memory controller is on cgroup v2 and
/// the group still exists; `None` on a v1 host (there the v2 ID says nothing of the memcg).
pub fn v2_memcg_of(id: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let point = std::path::PathBuf::from(left.split(' ').nth(4)?);
        let memory = std::fs::read_to_string(point.join("cgroup.controllers")).ok()?;
        (right.split(' ').next() == Some("cgroup2") && memory.split_whitespace().any(|c| c == "memory"))
            .then_some(point)
    })?;
    let mut stack = vec![root.clone()];
    let mut seen = 0;
    while let Some(dir) = stack.pop() {
        seen += 1;
        if seen > MAX_V2_WALK {
            return None;
        }
        if std::fs::metadata(&dir).is_ok_and(|m| m.ino() == id) {
            let rel = dir.strip_prefix(&root).ok()?;
            return Some(format!("/{}", rel.display()));
        }
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        stack.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
    }
    None
}

fn row(kind: u32, pid: u32, comm: String, syscall: Option<String>, cgroup_v2: u64, p: &ActorPages) -> ActorRow {
    ActorRow {
        kind: EVICTION_ACTORS.get(kind as usize).map_or("other", |r| r.name),
        pid,
        comm,
        syscall,
        cgroup_v2,
        memcg: None,
        events: p.events,
        pages: p.total(),
        dense_pages: p.pages[C_DENSE as usize],
        shared_pages: p.pages[C_SHARED as usize],
        routed_pages: p.pages[C_ROUTED as usize],
        other_pages: p.pages[C_OTHER as usize],
        spill_pages: p.spill,
        overflow: false,
    }
}

impl Attached {
    /// The blame table now.
    pub fn read(&self) -> Result<Table, ResidencyError> {
        read(self)
    }
}

fn read(m: &Attached) -> Result<Table, ResidencyError> {
    let mut rows = Vec::new();
    for kv in m.actors.iter() {
        let (k, v) = kv.map_err(err("EVICT_ACTORS"))?;
        let sc = sys::name(k.syscall)
            .map(str::to_string)
            .or_else(|| (k.syscall != observer_common::evict::NO_SYSCALL).then(|| format!("syscall {}", k.syscall)));
        let mut r = row(k.kind, k.tgid, comm(&k.comm), sc, k.cgroup, &v);
        // A process that exited: its v2 group, where memory is on v2 and the group still exists.
        r.memcg = memcg_of(k.tgid).or_else(|| {
            let mut known = m.v2_memcgs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            known.entry(k.cgroup).or_insert_with(|| v2_memcg_of(k.cgroup)).clone()
        });
        rows.push(r);
    }
    for kind in 0..N_KINDS {
        let v = m.overflow.get(&kind, 0).map_err(err("EVICT_OVERFLOW"))?;
        if v.events > 0 {
            let mut r = row(kind, 0, OTHER.into(), None, 0, &v);
            r.overflow = true;
            rows.push(r);
        }
    }
    let windows_lost = m.stats.get(&S_WINDOW_LOST, 0).map_err(err("EVICT_STATS"))?;
    let not_remembered = m.stats.get(&S_NOT_REMEMBERED, 0).map_err(err("EVICT_STATS"))?;
    let refault_faults_lost = m.stats.get(&S_REFAULT_FAULT_LOST, 0).map_err(err("EVICT_STATS"))?;
    let mut refaults = [0; N_KINDS as usize];
    for (k, r) in refaults.iter_mut().enumerate() {
        *r = m.refaults.get(&(k as u32), 0).map_err(err("EVICT_REFAULTS"))?;
    }
    rows.sort_by(|a, b| b.pages.cmp(&a.pages).then(a.pid.cmp(&b.pid)));
    Ok(Table { rows, windows_lost, refaults, not_remembered, refault_faults_lost })
}

/// A plain-text table (most pages first), `page` bytes per page.
pub fn render(t: &Table, page: u64) -> String {
    let mut s = format!(
        "{:<18} {:>7} {:<16} {:<16} {:>10} {:>9} {:>9} {:>9} {:>9}\n",
        "actor", "pid", "comm", "syscall", "pages", "MB", "dense", "routed", "shared"
    );
    for r in &t.rows {
        s += &format!(
            "{:<18} {:>7} {:<16} {:<16} {:>10} {:>9.1} {:>9} {:>9} {:>9}\n",
            r.kind,
            r.pid,
            r.comm,
            r.syscall.as_deref().unwrap_or("-"),
            r.pages,
            (r.pages * page) as f64 / 1e6,
            r.dense_pages,
            r.routed_pages,
            r.shared_pages
        );
    }
    let refaulted: Vec<String> = EVICTION_ACTORS
        .iter()
        .zip(t.refaults)
        .filter(|(_, n)| *n > 0)
        .map(|(a, n)| format!("{} {n}", a.name))
        .collect();
    if !refaulted.is_empty() {
        s += &format!("refaulted pages by who evicted them: {}\n", refaulted.join(", "));
    }
    if t.refault_faults_lost > 0 {
        s += &format!("refault faults not followed (their fault_io is missing): {}\n", t.refault_faults_lost);
    }
    s
}

#[cfg(test)]
mod tests {
    use observer_common::evict::{
        K_DIRECT, K_FADVISE, K_KSWAPD, K_MEMCG, K_OTHER, K_PROACTIVE, K_TRUNCATE, NO_SYSCALL,
    };

    use super::*;

    fn r(kind: &'static str, pid: u32, pages: u64) -> ActorRow {
        let p = ActorPages { events: 1, pages: [0, 0, pages, 0], spill: 0 };
        row(EVICTION_ACTORS.iter().position(|a| a.name == kind).unwrap() as u32, pid, "x".into(), None, 0, &p)
    }

    #[test]
    fn since_keeps_the_actors_that_grew_with_their_growth() {
        let a = Table { rows: vec![r("kswapd", 45, 10), r("fadvise", 7, 5)], windows_lost: 1, ..Table::default() };
        let b = Table {
            rows: vec![r("kswapd", 45, 10), r("fadvise", 7, 8), r("truncate", 9, 100)],
            windows_lost: 3,
            ..Table::default()
        };
        let d = b.since(&a);
        let got: Vec<(&str, u32, u64, u64)> = d.rows.iter().map(|x| (x.kind, x.pid, x.pages, x.routed_pages)).collect();
        assert_eq!(got, vec![("truncate", 9, 100, 100), ("fadvise", 7, 3, 3)]);
        assert_eq!(d.windows_lost, 2);
        assert_eq!(d.pages(), 103);
        assert_eq!(b.by_kind()[K_KSWAPD as usize], 10);
        assert_eq!(b.by_kind()[K_TRUNCATE as usize], 100);
    }

    #[test]
    fn by_process_merges_a_processs_actors_and_keeps_the_rest_in_other_rows_that_add_up() {
        let mut rows = vec![r("fadvise", 7, 5), r("fadvise", 7, 6), r("kswapd", 45, 100), r("truncate", 9, 3)];
        rows[1].syscall = Some("madvise".into()); // another actor of the same process and kind
        for pid in 100..140 {
            rows.push(r("memcg_reclaim", pid, 1));
        }
        let mut over = r("fadvise", 0, 50);
        over.overflow = true;
        rows.push(over);
        let t = Table { rows, ..Table::default() };
        let p = t.by_process(3);
        let got: Vec<(&str, u32, &str, u64)> =
            p.iter().map(|x| (x.kind.as_str(), x.pid, x.comm.as_str(), x.pages)).collect();
        assert_eq!(
            got,
            vec![
                ("kswapd", 45, "x", 100),
                ("fadvise", 7, "x", 11),
                ("truncate", 9, "x", 3),
                ("memcg_reclaim", 0, "other", 40),
                ("fadvise", 0, "other", 50),
            ]
        );
        assert_eq!(p.iter().map(|x| x.pages).sum::<u64>(), t.pages(), "the rows add up to the table");
        assert_eq!(t.by_process(usize::MAX).len(), 3 + 40 + 1);
    }

    #[test]
    fn kernel_kinds_follow_the_vocabulary() {
        let names: Vec<&str> = EVICTION_ACTORS.iter().map(|r| r.name).collect();
        assert_eq!(names.len(), N_KINDS as usize);
        for (k, n) in [
            (K_KSWAPD, "kswapd"),
            (K_DIRECT, "direct_reclaim"),
            (K_MEMCG, "memcg_reclaim"),
            (K_PROACTIVE, "proactive_reclaim"),
            (K_FADVISE, "fadvise"),
            (K_TRUNCATE, "truncate"),
            (K_OTHER, "other"),
        ] {
            assert_eq!(names[k as usize], n);
        }
    }

    #[test]
    fn the_rules_are_this_architectures_system_calls() {
        use crate::capture::syscalls::tests::libc_nr;
        assert!(!sys::RULES.is_empty(), "no eviction rules for this architecture");
        for rule in sys::RULES {
            assert_eq!(Some(i64::from(rule.nr)), libc_nr(rule.name), "{}", rule.name);
            assert!(rule.nr < MAX_SYSCALL, "{}", rule.name);
            assert_eq!(sys::name(rule.nr), Some(rule.name), "numbers are unique");
        }
        let kind = |n: &str| sys::RULES.iter().find(|r| r.name == n).map(|r| r.kind);
        assert_eq!(kind("fadvise64"), Some(K_FADVISE));
        assert_eq!(
            (kind("write"), kind("openat"), kind("unlinkat")),
            (Some(K_TRUNCATE), Some(K_TRUNCATE), Some(K_TRUNCATE))
        );
    }

    /// The kernel side reads 8 bytes at the field's offset: where the field is 4 bytes the other
    /// half is another field, and −1 (outside a system call) must not become a number.
    #[test]
    fn the_syscall_field_is_this_architectures_pt_regs_field() {
        let f = sys::NR_FIELD.expect("x86-64 and aarch64 have a field");
        #[cfg(target_arch = "x86_64")]
        assert_eq!((f.offset as usize, f.bytes), (std::mem::offset_of!(libc::user_regs_struct, orig_rax), 8));
        // `user_regs_struct` is arm64's `user_pt_regs`, the head of `pt_regs`; then `u64 orig_x0`.
        #[cfg(target_arch = "aarch64")]
        assert_eq!((f.offset as usize, f.bytes), (std::mem::size_of::<libc::user_regs_struct>() + 8, 4));
        let c = config();
        assert_eq!((c.syscall_off, c.syscall_bytes), (f.offset, f.bytes));
        let write = libc::SYS_write;
        let other_half = 0x5a5a_5a5a_i64 << 32;
        if f.bytes == 4 {
            assert_eq!(c.syscall_nr(other_half | write), write as u32);
            assert_eq!(c.syscall_nr(other_half | 0xffff_ffff), NO_SYSCALL);
        } else {
            assert_eq!(c.syscall_nr(write), write as u32);
            assert_eq!(c.syscall_nr(other_half | write), NO_SYSCALL);
        }
        assert_eq!(c.syscall_nr(-1), NO_SYSCALL);
    }
}
