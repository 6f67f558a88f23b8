//! Explicit reads of the model file per region: the user side of `observer-ebpf/src/xread.rs`
//! (rule and layout: `observer_common::xread`).
//!
//! It turns the kernel side on once the churn intervals it searches are in place (their classes
//! in `EVICT_CLASS`), answers the kernel's questions about file descriptors (`(tgid, fd)` →
//! model file or not, from `stat` of `/proc/PID/fd/N` against the model's device and inode), and
//! knows which routed expert each interval is, to fold the per-read records into experts.

use std::{
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, RingBuf},
};
use engine::regions::RegionMap;
use observer_common::{
    model::{ExplicitReads, StepKind},
    xread::{FD_MODEL, FD_OTHER, MAX_SYSCALL, XreadConfig, fd_key, sys},
};

use super::{
    ResidencyError,
    churn::{Intervals, Owner},
};
use crate::capture::tokens::{Assembler, Snapshot};

/// The kernel side, configured and on.
pub struct Xread {
    fds: HashMap<MapData, u64, u32>,
    /// The model file's `st_dev` and `st_ino`.
    dev: u64,
    ino: u64,
    /// Per churn interval: the routed expert `(layer, expert)` it belongs to.
    pub cells: Vec<Option<(u32, u32)>>,
}

impl std::fmt::Debug for Xread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Xread").field("dev", &self.dev).field("ino", &self.ino).finish_non_exhaustive()
    }
}

fn err(what: &'static str) -> impl Fn(aya::maps::MapError) -> ResidencyError {
    move |e| ResidencyError::Churn(format!("{what}: {e}"))
}

/// `(st_dev, st_ino)` of what `path` refers to.
fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Xread {
    /// Configure the kernel side for the model at `path` (its churn `intervals` already in
    /// `FILEMAP_STARTS`, their index in `FILEMAP_INDEX` and their classes in `EVICT_CLASS`, with
    /// pages of `page` bytes) and turn it on.
    pub fn attach(
        ebpf: &mut Ebpf,
        path: &Path,
        map: &RegionMap,
        intervals: &Intervals,
        page: u64,
    ) -> Result<Xread, ResidencyError> {
        let meta = std::fs::metadata(path).map_err(|source| ResidencyError::Io {
            path: path.to_owned(),
            what: "stat",
            source,
        })?;
        let (dev, ino) = (meta.dev(), meta.ino());
        {
            let m = ebpf.map_mut("XREAD_ROLES").ok_or_else(|| ResidencyError::Churn("no map XREAD_ROLES".into()))?;
            let mut a: Array<_, u32> = Array::try_from(m).map_err(err("XREAD_ROLES"))?;
            for &(_, nr, role) in sys::ROLES {
                debug_assert!(nr < MAX_SYSCALL);
                a.set(nr, role, 0).map_err(err("XREAD_ROLES"))?;
            }
        }
        let fds = ebpf.take_map("XREAD_FDS").ok_or_else(|| ResidencyError::Churn("no map XREAD_FDS".into()))?;
        let fds = HashMap::try_from(fds).map_err(err("XREAD_FDS"))?;
        {
            let m = ebpf.map_mut("XREAD_CONFIG").ok_or_else(|| ResidencyError::Churn("no map XREAD_CONFIG".into()))?;
            let mut a: Array<_, XreadConfig> = Array::try_from(m).map_err(err("XREAD_CONFIG"))?;
            let config = XreadConfig { enabled: 1, page_shift: page.trailing_zeros(), arg_regs: sys::ARG_REGS };
            a.set(0, config, 0).map_err(err("XREAD_CONFIG"))?;
        }
        let cells = intervals
            .owners
            .iter()
            .map(|o| match *o {
                Owner::Cell(c) => {
                    let n = map.n_experts.max(1);
                    map.moe_layers.get((c / n) as usize).map(|&layer| (layer, c % n))
                }
                _ => None,
            })
            .collect();
        Ok(Xread { fds, dev, ino, cells })
    }

    /// Decide what descriptor `fd` of process `tgid` is, and tell the kernel side. A descriptor
    /// that is gone (closed, or its process exited) is forgotten: its next read asks again.
    pub fn resolve(&mut self, tgid: u32, fd: u32) {
        let key = fd_key(tgid, fd);
        match identity(Path::new(&format!("/proc/{tgid}/fd/{fd}"))) {
            Some(id) => {
                let verdict = if id == (self.dev, self.ino) { FD_MODEL } else { FD_OTHER };
                if let Err(e) = self.fds.insert(key, verdict, 0) {
                    log::warn!("explicit reads: cannot record fd {fd} of pid {tgid}: {e}");
                }
            }
            None => {
                _ = self.fds.remove(&key);
            }
        }
    }

    /// `tgid` called `exec`: the descriptors it closed there (`O_CLOEXEC`) were never `close`d,
    /// so every verdict of the process is dropped and its open descriptors are resolved again.
    pub fn exec(&mut self, tgid: u32) {
        let keys: Vec<u64> = self.fds.keys().filter_map(Result::ok).filter(|k| (k >> 32) as u32 == tgid).collect();
        for k in keys {
            _ = self.fds.remove(&k);
        }
        self.seed(tgid);
    }

    /// Resolve the descriptors `tgid` has open now (a process that opened the model before the
    /// probes were attached).
    pub fn seed(&mut self, tgid: u32) {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{tgid}/fd")) else { return };
        for e in dir.flatten() {
            if let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
                self.resolve(tgid, fd);
            }
        }
    }
}

/// `observer heatmap --pid`: the explicit reads of one running process, without the rest of the
/// observer (no token marks, no attribution). A span between two calls of [`Live::span`] is a
/// `--window` of the rule (`observer_common::xread`, "Spans"): the same [`Assembler`] folds it.
pub struct Live {
    pub pid: u32,
    xread: Xread,
    ring: RingBuf<MapData>,
    asm: Assembler,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("pid", &self.pid).field("xread", &self.xread).finish_non_exhaustive()
    }
}

impl Live {
    /// On a standalone object whose churn intervals for the model at `path` are in place (`churn::
    /// Churn::attach`): target `pid`, turn the reads on, resolve its open descriptors, and open the
    /// first span.
    pub fn attach(
        ebpf: &mut Ebpf,
        pid: u32,
        path: &Path,
        map: &RegionMap,
        intervals: &Intervals,
        page: u64,
    ) -> Result<Live, ResidencyError> {
        let probe =
            |e: crate::capture::bpf::ProbeError| ResidencyError::Churn(format!("explicit reads of pid {pid}: {e}"));
        let ring = ebpf.take_map("EVENTS").ok_or_else(|| ResidencyError::Churn("no map EVENTS".into()))?;
        let ring = RingBuf::try_from(ring).map_err(err("EVENTS"))?;
        let mut xread = Xread::attach(ebpf, path, map, intervals, page)?;
        crate::capture::bpf::attach_syscalls(ebpf, pid).map_err(probe)?;
        xread.seed(pid);
        let mut asm = Assembler::new(StepKind::Window);
        asm.xread = Some(xread.cells.clone());
        let mut live = Live { pid, xread, ring, asm };
        live.span(ebpf).map_err(probe)?;
        Ok(live)
    }

    /// Take the records in the ring, and answer the kernel's questions about descriptors (and an
    /// `exec`'s, whose `O_CLOEXEC` descriptors were closed without `close`).
    fn drain(&mut self) {
        while let Some(item) = self.ring.next() {
            self.asm.push(&item);
        }
        for (tgid, fd) in std::mem::take(&mut self.asm.fd_queries) {
            self.xread.resolve(tgid, fd);
        }
        for (tid, _) in std::mem::take(&mut self.asm.execs) {
            self.xread.exec(tid);
        }
    }

    /// Wait `d`, draining the ring whenever the kernel wakes it (a question about a descriptor:
    /// the sooner it is answered, the fewer reads stay unresolved).
    pub fn wait(&mut self, d: Duration) {
        let end = Instant::now() + d;
        loop {
            self.drain();
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut p = libc::pollfd { fd: self.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd we own; the ring's descriptor stays open for the call.
            unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, i32::MAX as u128) as i32) };
        }
    }

    /// End the current span and begin the next: its explicit reads (the ring drained first, then
    /// the totals read, as at a window's end).
    pub fn span(&mut self, ebpf: &Ebpf) -> Result<Option<ExplicitReads>, crate::capture::bpf::ProbeError> {
        self.drain();
        let totals = crate::capture::bpf::xread_totals(ebpf)?;
        let snap =
            Snapshot { xread: Some(totals), ..Snapshot::of_threads(crate::capture::seed::mono_ns(), Vec::new()) };
        Ok(self.asm.window(snap).and_then(|t| t.explicit_reads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_number_is_this_architectures() {
        assert!(!sys::ROLES.is_empty(), "no table for this architecture");
        for &(name, nr, _) in sys::ROLES {
            assert_eq!(crate::capture::syscalls::tests::libc_nr(name), Some(i64::from(nr)), "{name}");
        }
    }

    /// The argument registers the raw `sys_enter` reads against this kernel's BTF of `struct
    /// pt_regs` (x86-64's registers are named members; arm64's are an array, `regs[i]` at `8 i`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn argument_registers_are_the_kernels() {
        for (reg, off) in ["di", "si", "dx", "r10"].iter().zip(sys::ARG_REGS) {
            assert_eq!(crate::capture::btf::kernel_member_offset("pt_regs", reg), Ok(off), "pt_regs.{reg}");
        }
    }
}
