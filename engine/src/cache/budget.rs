//! `--cache-mib auto`: how much anonymous memory the expert cache may take.
//!
//! # Rule
//! ```text
//! limit  = the smallest memory limit of this process's memory cgroup and its ancestors
//!          (v1 memory.limit_in_bytes, v2 memory.max), when there is one
//! budget = limit − anon now − dense (only when the dense weights stay on the mapping)
//!                − state − headroom                              with a cgroup limit
//! budget = MemAvailable − dense (mapping only) − state − headroom             without
//! headroom = 64 MiB + 5 % of the limit (or of MemAvailable)
//! state    = 2 × KV cache + recurrent state at the run's context (`Config::state_bytes`; the
//!            KV buffers grow by doubling, the DeltaNet layers' state is allocated at full size)
//! ```
//! `anon now` is the cgroup's anonymous memory (`memory.stat`, so the anonymous copy of the dense
//! weights and everything else the process has allocated); the page cache is not subtracted: it
//! is what the kernel reclaims first, and the cache reads bypass it. The headroom keeps room for
//! the binary's and libraries' pages, buffers that grow later, and the kernel's own slack, so
//! that a full cache never pushes the cgroup into reclaiming what the decode loop touches every
//! token (a cache that starves the page cache gets slower, not faster). The cache never takes
//! more than every routed expert (the caller caps it).

use std::path::{Path, PathBuf};

/// What the budget was computed from (printed by `engine run`).
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub bytes: u64,
    /// `cgroup v1 /sys/fs/cgroup/memory/X limit N`, or `MemAvailable N`.
    pub source: String,
}

/// This process's memory cgroup directory and its hierarchy's mount point, from
/// `/proc/self/cgroup` and `/proc/self/mountinfo`.
fn own_memory_cgroup() -> Option<(PathBuf, PathBuf)> {
    let me = procfs::process::Process::myself().ok()?;
    let (cgroups, mountinfo) = (me.cgroups().ok()?, me.mountinfo().ok()?);
    // (mount point, root of the mount within the hierarchy) of the v1 memory or the v2 hierarchy
    let mount = |v1: bool| {
        mountinfo.iter().find_map(|m| {
            let ok = if v1 {
                m.fs_type == "cgroup" && m.super_options.contains_key("memory")
            } else {
                m.fs_type == "cgroup2"
            };
            ok.then(|| (m.mount_point.clone(), PathBuf::from(&m.root)))
        })
    };
    for g in cgroups {
        let v1 = g.controllers.iter().any(|c| c == "memory");
        if !(v1 || g.controllers.is_empty()) {
            continue;
        }
        let path = g.pathname.as_str();
        let Some((point, root)) = mount(v1) else { continue };
        let rel = Path::new(path).strip_prefix(&root).unwrap_or(Path::new(path));
        let rel = rel.strip_prefix("/").unwrap_or(rel);
        let dir = point.join(rel);
        let has_memory = dir.join("memory.limit_in_bytes").exists() || dir.join("memory.max").exists();
        if has_memory {
            return Some((dir, point));
        }
    }
    None
}

/// The smallest limit on the way from `dir` up to `top`, with the group that sets it.
fn smallest_limit(dir: &Path, top: &Path) -> Option<(u64, memcg::Group)> {
    let mut best: Option<(u64, memcg::Group)> = None;
    let mut d = Some(dir);
    while let Some(p) = d {
        if let Ok(g) = memcg::Group::open(p)
            && let Ok(Some(l)) = g.limit()
            // v1 reports "unlimited" as a huge page-rounded number.
            && l < (1u64 << 60)
            && best.as_ref().is_none_or(|(b, _)| l < *b)
        {
            best = Some((l, g));
        }
        if p == top {
            break;
        }
        d = p.parent();
    }
    best
}

/// The automatic budget (module docs) for `dense_on_mapping` bytes of dense weights served from
/// the page cache (0 with an anonymous copy) and `state` bytes of KV cache and recurrent state to
/// come.
pub fn auto(dense_on_mapping: u64, state: u64) -> Result<Budget, String> {
    let headroom = |base: u64| (64 << 20) + base / 20;
    if let Some((dir, top)) = own_memory_cgroup()
        && let Some((limit, group)) = smallest_limit(&dir, &top)
    {
        let anon =
            group.stat().ok().and_then(|s| s.get(memcg::StatKey::Anon)).ok_or_else(|| {
                format!("cannot read the anonymous memory of {} (memory.stat)", group.dir().display())
            })?;
        let bytes = limit.saturating_sub(anon + dense_on_mapping + state + headroom(limit));
        return Ok(Budget {
            bytes,
            source: format!(
                "{} limit {} MiB − anon {} MiB − dense on the mapping {} MiB − KV + state {} MiB − headroom {} MiB",
                group.dir().display(),
                limit >> 20,
                anon >> 20,
                dense_on_mapping >> 20,
                state >> 20,
                headroom(limit) >> 20
            ),
        });
    }
    let avail = {
        use procfs::Current;
        procfs::Meminfo::current().ok().and_then(|m| m.mem_available)
    };
    let avail = avail.ok_or("cannot read MemAvailable from /proc/meminfo")?;
    Ok(Budget {
        bytes: avail.saturating_sub(dense_on_mapping + state + headroom(avail)),
        source: format!(
            "MemAvailable {} MiB − dense on the mapping {} MiB − KV + state {} MiB − headroom {} MiB (no memory cgroup limit)",
            avail >> 20,
            dense_on_mapping >> 20,
            state >> 20,
            headroom(avail) >> 20
        ),
    })
}
