//! Dense weights an engine copied into anonymous memory: resident vs swapped, from
//! `/proc/PID/pagemap`.
//!
//! ## Spec: the dense-regions ABI (version 1)
//! This kernel has no `CONFIG_ANON_VMA_NAME`, so an anonymous copy cannot be told apart from
//! other anonymous memory by its mapping. An engine that copies its dense weights out of the
//! file publishes where they are in one exported data symbol, found like the token markers
//! (`.symtab` or `.dynsym` of the executable):
//!
//! ```c
//! struct moe_dense_range   { uint64_t addr, len, file_offset; };   /* 24 bytes */
//! struct moe_dense_regions {                                        /* 32 bytes */
//!     uint32_t magic;     /* 0x4E45444D, "MDEN" */
//!     uint32_t version;   /* 1 */
//!     uint64_t seq;       /* even while stable: odd during an update of count/table */
//!     uint64_t count;     /* entries in table; 0 = no anonymous copy (yet) */
//!     const struct moe_dense_range *table;
//! } moe_engine_dense_regions;
//! ```
//!
//! `addr..addr+len` is anonymous memory of the engine holding a copy of the model file's bytes
//! `file_offset..file_offset+len` (`u64::MAX` when not a copy of the file). The observer reads
//! the symbol and the table through `/proc/PID/mem` (root, or ptrace rights over the engine)
//! with the seqlock above (retried while odd or changed), at most once per sample.
//!
//! ## Measurement rule
//! For every page of the published ranges, `/proc/PID/pagemap` says *present* (bit 63: in RAM)
//! or *swapped* (bit 62: in swap, zram included) or neither (never touched, or dropped).
//! `dense_resident_frac = present / pages`, `dense_swapped_frac = swapped / pages`. Reading the
//! present/swapped bits needs no privilege beyond reading the file; PFNs are not used.

use std::{
    fs::File,
    os::unix::fs::{FileExt, MetadataExt},
    path::PathBuf,
};

use super::ResidencyError;

pub const SYMBOL: &str = "moe_engine_dense_regions";
pub const MAGIC: u32 = 0x4E45_444D;
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 32;
pub const ENTRY_SIZE: usize = 24;
/// More entries than any engine needs (one per tensor); bounds what is read from the target.
pub const MAX_ENTRIES: u64 = 1 << 20;

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;

/// The header as an engine lays it out (for engines written in Rust, and the tests' stand-in).
#[repr(C)]
#[derive(Debug)]
pub struct DenseRegionsV1 {
    pub magic: u32,
    pub version: u32,
    pub seq: std::sync::atomic::AtomicU64,
    pub count: std::sync::atomic::AtomicU64,
    pub table: std::sync::atomic::AtomicPtr<DenseRange>,
}
const _: () = assert!(std::mem::size_of::<DenseRegionsV1>() == HEADER_SIZE);

impl DenseRegionsV1 {
    pub const fn new() -> Self {
        DenseRegionsV1 {
            magic: MAGIC,
            version: VERSION,
            seq: std::sync::atomic::AtomicU64::new(0),
            count: std::sync::atomic::AtomicU64::new(0),
            table: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Publish a table (which must stay alive and unchanged until the next `publish`).
    pub fn publish(&self, table: &'static [DenseRange]) {
        use std::sync::atomic::Ordering::SeqCst;
        self.seq.fetch_add(1, SeqCst);
        self.table.store(table.as_ptr().cast_mut(), SeqCst);
        self.count.store(table.len() as u64, SeqCst);
        self.seq.fetch_add(1, SeqCst);
    }
}

impl Default for DenseRegionsV1 {
    fn default() -> Self {
        Self::new()
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseRange {
    pub addr: u64,
    pub len: u64,
    pub file_offset: u64,
}
const _: () = assert!(std::mem::size_of::<DenseRange>() == ENTRY_SIZE);

/// Present / swapped pages of the published ranges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AnonResidency {
    pub pages: u64,
    pub present: u64,
    pub swapped: u64,
    pub ranges: u64,
}

impl AnonResidency {
    pub fn resident_frac(&self) -> Option<f64> {
        (self.pages > 0).then(|| self.present as f64 / self.pages as f64)
    }
    pub fn swapped_frac(&self) -> Option<f64> {
        (self.pages > 0).then(|| self.swapped as f64 / self.pages as f64)
    }
}

/// Finds and reads the table of one process.
#[derive(Debug)]
pub struct DenseCopy {
    pid: u32,
    /// (dev, ino) of the executable the symbol was looked up in, and its runtime address.
    resolved: Option<((u64, u64), Option<u64>)>,
    page: u64,
}

fn proc_err(pid: u32, what: &'static str) -> impl Fn(std::io::Error) -> ResidencyError {
    move |source| ResidencyError::Process { pid, what, source }
}

impl DenseCopy {
    pub fn new(pid: u32) -> DenseCopy {
        DenseCopy { pid, resolved: None, page: super::scan::page_size() }
    }

    /// The runtime address of the symbol, looked up again whenever the executable changed
    /// (e.g. the spawned target was still the observer's fork before `exec`).
    fn symbol_addr(&mut self) -> Result<Option<u64>, ResidencyError> {
        let exe = PathBuf::from(format!("/proc/{}/exe", self.pid));
        let meta = std::fs::metadata(&exe).map_err(proc_err(self.pid, "reading /proc/PID/exe"))?;
        let id = (meta.dev(), meta.ino());
        if let Some((seen, addr)) = self.resolved
            && seen == id
        {
            return Ok(addr);
        }
        let addr = match crate::bpf::elf_symbol_addr(&exe, SYMBOL) {
            Some(vaddr) => load_bias(self.pid, &exe, id)?.map(|bias| bias.wrapping_add(vaddr)),
            None => None,
        };
        self.resolved = Some((id, addr));
        Ok(addr)
    }

    /// The published ranges now; `None` when the process does not export the symbol.
    pub fn ranges(&mut self) -> Result<Option<Vec<DenseRange>>, ResidencyError> {
        let Some(addr) = self.symbol_addr()? else { return Ok(None) };
        let pid = self.pid;
        let mem = File::open(format!("/proc/{pid}/mem")).map_err(proc_err(pid, "opening /proc/PID/mem"))?;
        for _ in 0..8 {
            let mut h = [0u8; HEADER_SIZE];
            mem.read_exact_at(&mut h, addr).map_err(proc_err(pid, "reading moe_engine_dense_regions"))?;
            let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap_or_default());
            let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or_default());
            if u32_at(0) != MAGIC || u32_at(4) != VERSION {
                return Err(ResidencyError::Abi {
                    pid,
                    what: format!(
                        "{SYMBOL} has magic {:#x} version {} (expected {MAGIC:#x} version {VERSION})",
                        u32_at(0),
                        u32_at(4)
                    ),
                });
            }
            let (seq, count, table) = (u64_at(8), u64_at(16), u64_at(24));
            if seq % 2 == 1 {
                std::thread::yield_now();
                continue;
            }
            if count == 0 || table == 0 {
                return Ok(Some(Vec::new()));
            }
            if count > MAX_ENTRIES {
                return Err(ResidencyError::Abi { pid, what: format!("{SYMBOL}.count = {count} is absurd") });
            }
            let mut buf = vec![0u8; count as usize * ENTRY_SIZE];
            mem.read_exact_at(&mut buf, table).map_err(proc_err(pid, "reading the dense-regions table"))?;
            let mut again = [0u8; 8];
            mem.read_exact_at(&mut again, addr + 8).map_err(proc_err(pid, "reading moe_engine_dense_regions"))?;
            if u64::from_le_bytes(again) != seq {
                continue;
            }
            let v = buf
                .chunks_exact(ENTRY_SIZE)
                .map(|e| {
                    let f = |o: usize| u64::from_le_bytes(e[o..o + 8].try_into().unwrap_or_default());
                    DenseRange { addr: f(0), len: f(8), file_offset: f(16) }
                })
                .collect();
            return Ok(Some(v));
        }
        Err(ResidencyError::Abi { pid, what: format!("{SYMBOL} kept changing while being read") })
    }

    /// Present/swapped pages of `ranges` from `/proc/PID/pagemap`.
    pub fn pagemap(&self, ranges: &[DenseRange]) -> Result<AnonResidency, ResidencyError> {
        let pid = self.pid;
        let pm = File::open(format!("/proc/{pid}/pagemap")).map_err(proc_err(pid, "opening /proc/PID/pagemap"))?;
        let mut r = AnonResidency { ranges: ranges.len() as u64, ..AnonResidency::default() };
        let mut buf = vec![0u8; 8 * 65536];
        for d in ranges {
            if d.len == 0 {
                continue;
            }
            let (first, last) = (d.addr / self.page, (d.addr + d.len - 1) / self.page);
            let mut p = first;
            while p <= last {
                let n = (last + 1 - p).min(65536);
                let bytes = &mut buf[..n as usize * 8];
                pm.read_exact_at(bytes, p * 8).map_err(proc_err(pid, "reading /proc/PID/pagemap"))?;
                for e in bytes.chunks_exact(8) {
                    let v = u64::from_le_bytes(e.try_into().unwrap_or_default());
                    r.present += u64::from(v & PM_PRESENT != 0);
                    r.swapped += u64::from(v & PM_SWAPPED != 0);
                }
                r.pages += n;
                p += n;
            }
        }
        Ok(r)
    }

    /// Resolve, read and measure in one go; `None` when the process publishes nothing.
    pub fn sample(&mut self) -> Result<Option<AnonResidency>, ResidencyError> {
        match self.ranges()? {
            Some(r) if !r.is_empty() => Ok(Some(self.pagemap(&r)?)),
            _ => Ok(None),
        }
    }
}

/// Runtime address minus link-time address of the executable, from its program headers and
/// the process's mappings of the same file.
fn load_bias(pid: u32, exe: &std::path::Path, id: (u64, u64)) -> Result<Option<u64>, ResidencyError> {
    use object::{Object, ObjectSegment};
    let data = crate::bpf::map_elf(exe).map_err(proc_err(pid, "reading the executable"))?;
    let Ok(file) = object::File::parse(&*data) else { return Ok(None) };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(proc_err(pid, "reading /proc/PID/maps"))?;
    let page = super::scan::page_size();
    let (major, minor) = (libc::major(id.0), libc::minor(id.0));
    for line in maps.lines() {
        // start-end perms offset major:minor inode path
        let mut it = line.split_whitespace();
        let (Some(range), Some(_perms), Some(off), Some(dev), Some(ino)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        if ino.parse::<u64>().ok() != Some(id.1) {
            continue;
        }
        let dev_ok = dev
            .split_once(':')
            .and_then(|(a, b)| Some((u32::from_str_radix(a, 16).ok()?, u32::from_str_radix(b, 16).ok()?)))
            == Some((major, minor));
        let (Some(start), Ok(off)) =
            (range.split_once('-').and_then(|(s, _)| u64::from_str_radix(s, 16).ok()), u64::from_str_radix(off, 16))
        else {
            continue;
        };
        if !dev_ok {
            continue;
        }
        for seg in file.segments() {
            let (foff, _) = seg.file_range();
            if foff / page * page == off {
                return Ok(Some(start.wrapping_sub(seg.address() / page * page)));
            }
        }
    }
    Ok(None)
}
