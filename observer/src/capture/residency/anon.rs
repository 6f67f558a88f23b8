//! Dense weights an engine copied into anonymous memory: resident vs swapped, from
//! `/proc/PID/pagemap`.
//!
//! ## Where the copy is
//! This kernel has no `CONFIG_ANON_VMA_NAME`, so an anonymous copy cannot be told apart from
//! other anonymous memory by its mapping. An engine that copies its dense weights out of the
//! file publishes where they are in the exported `moe_engine_dense_regions`, specified in
//! [`moe_abi::dense_regions`]. The observer finds the symbol like the token markers (`.symtab` or
//! `.dynsym` of the executable) and reads it and its table through `/proc/PID/mem` (root, or
//! ptrace rights over the engine) with the ABI's seqlock, at most once per sample.
//!
//! ## Measurement rule
//! For every page of the published ranges, `/proc/PID/pagemap` says *present* (bit 63: in RAM)
//! or *swapped* (bit 62: in swap, zram included) or neither (never touched, or dropped).
//! `dense_resident_frac = present / pages`, `dense_swapped_frac = swapped / pages`. Reading the
//! present/swapped bits needs no privilege beyond reading the file; PFNs are not used. A reading
//! stands only if the table's version (`seq`) is the same after the pagemap read as before it
//! (the engine unpublishes a range before unmapping it).

use std::{
    fs::File,
    os::unix::fs::{FileExt, MetadataExt},
    path::PathBuf,
};

use super::ResidencyError;

pub use moe_abi::dense_regions::DenseRange;
use moe_abi::{
    TableHeader,
    dense_regions::{DenseRegions, ENTRY_SIZE, HEADER_SIZE, SYMBOL},
};

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;

/// Reads of a published table that found it changing before the reader gives up.
const SEQLOCK_TRIES: usize = 8;

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

/// A published table as read: the process's memory, the table header's address, its version
/// (`seq`) and its ranges.
struct Published {
    mem: File,
    addr: u64,
    seq: u64,
    ranges: Vec<DenseRange>,
}

/// Finds and reads the table of one process.
#[derive(Debug)]
pub struct DenseCopy {
    symbol: ExportedSymbol,
    page: u64,
}

pub(super) fn proc_err(pid: u32, what: &'static str) -> impl Fn(std::io::Error) -> ResidencyError {
    move |source| ResidencyError::Process { pid, what, source }
}

/// A data symbol of a process's executable, found by name (`.symtab` or `.dynsym`) and moved by
/// the executable's load bias.
#[derive(Debug)]
pub(super) struct ExportedSymbol {
    pub pid: u32,
    name: &'static str,
    /// (dev, ino) of the executable the symbol was looked up in, and its link-time address there
    /// (`None`: the file has no such symbol).
    exe: Option<((u64, u64), Option<u64>)>,
    /// The runtime address, once the executable is mapped.
    addr: Option<u64>,
}

impl ExportedSymbol {
    pub fn new(pid: u32, name: &'static str) -> ExportedSymbol {
        ExportedSymbol { pid, name, exe: None, addr: None }
    }

    /// The runtime address of the symbol, looked up again whenever the executable changed
    /// (e.g. the spawned target was still the observer's fork before `exec`).
    pub fn addr(&mut self) -> Result<Option<u64>, ResidencyError> {
        let exe = PathBuf::from(format!("/proc/{}/exe", self.pid));
        let meta = std::fs::metadata(&exe).map_err(proc_err(self.pid, "reading /proc/PID/exe"))?;
        let id = (meta.dev(), meta.ino());
        let vaddr = match self.exe {
            Some((seen, vaddr)) if seen == id => vaddr,
            _ => {
                let vaddr = crate::capture::bpf::elf_symbol_addr(&exe, self.name);
                (self.exe, self.addr) = (Some((id, vaddr)), None);
                vaddr
            }
        };
        let Some(vaddr) = vaddr else { return Ok(None) };
        // In the middle of `exec`, `/proc/PID/exe` already names the new file before the loader
        // has mapped it: no bias yet, asked again next time (never remembered as "absent").
        if self.addr.is_none() {
            self.addr = load_bias(self.pid, &exe, id)?.map(|bias| bias.wrapping_add(vaddr));
        }
        Ok(self.addr)
    }

    /// The process's `/proc/PID/mem` (raw bytes: nothing for procfs to parse).
    pub fn mem(&self) -> Result<File, ResidencyError> {
        File::open(format!("/proc/{}/mem", self.pid)).map_err(proc_err(self.pid, "opening /proc/PID/mem"))
    }
}

impl DenseCopy {
    pub fn new(pid: u32) -> DenseCopy {
        DenseCopy { symbol: ExportedSymbol::new(pid, SYMBOL), page: super::scan::page_size() }
    }

    /// The published ranges now; `None` when the process does not export the symbol.
    pub fn ranges(&mut self) -> Result<Option<Vec<DenseRange>>, ResidencyError> {
        Ok(self.ranges_at()?.map(|t| t.ranges))
    }

    /// The table's ranges, where and at which version they were read.
    fn ranges_at(&mut self) -> Result<Option<Published>, ResidencyError> {
        let Some(addr) = self.symbol.addr()? else { return Ok(None) };
        let pid = self.symbol.pid;
        let mem = self.symbol.mem()?;
        let (header, table) = read_published(&mem, pid, addr, SYMBOL, HEADER_SIZE, DenseRegions::parse_header)?;
        let ranges = table.chunks_exact(ENTRY_SIZE).map(DenseRange::from_bytes).collect::<Result<_, _>>();
        let ranges = ranges.map_err(|e| ResidencyError::Abi { pid, what: e.to_string() })?;
        Ok(Some(Published { mem, addr, seq: header.seq, ranges }))
    }

    /// Present/swapped pages of `ranges` from `/proc/PID/pagemap`.
    /// Hand-read: two bits of up to millions of entries, 64 Ki per `pread`; procfs's `PageMap`
    /// decodes each entry into a `PageInfo` and allocates a vector per range.
    pub fn pagemap(&self, ranges: &[DenseRange]) -> Result<AnonResidency, ResidencyError> {
        let pid = self.symbol.pid;
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

    /// Resolve, read and measure in one go; `None` when the process publishes nothing. A
    /// measurement counts only if the table is the same version after the pagemap read: an
    /// engine unpublishes its ranges before it unmaps them, so a changed table means the pages
    /// read may have been going away (an engine at its end read 0 present and 0 swapped).
    pub fn sample(&mut self) -> Result<Option<AnonResidency>, ResidencyError> {
        let pid = self.symbol.pid;
        for _ in 0..SEQLOCK_TRIES {
            let Some(t) = self.ranges_at()? else { return Ok(None) };
            if t.ranges.is_empty() {
                return Ok(None);
            }
            let r = self.pagemap(&t.ranges)?;
            if seq_now(&t.mem, pid, t.addr)? == t.seq {
                return Ok(Some(r));
            }
        }
        Err(ResidencyError::Abi { pid, what: format!("{SYMBOL} kept changing while its pages were read") })
    }
}

/// The version (`seq`) of the published table whose header is at `addr`, as it is now.
fn seq_now(mem: &File, pid: u32, addr: u64) -> Result<u64, ResidencyError> {
    let mut seq = [0u8; 8];
    mem.read_exact_at(&mut seq, addr + moe_abi::SEQ_OFFSET)
        .map_err(proc_err(pid, "reading a published table's header"))?;
    Ok(u64::from_le_bytes(seq))
}

/// The table of the published-table header `symbol` at `addr` of process `pid`, read through
/// its `/proc/PID/mem` with the seqlock of the ABI (`moe_abi`, "Published tables"): the header
/// as read (its even `seq` the version of the snapshot) and the bytes of `count` entries,
/// `stride` apart (empty when nothing is published).
pub(super) fn read_published(
    mem: &File,
    pid: u32,
    addr: u64,
    symbol: &'static str,
    header_size: usize,
    parse: fn(&[u8]) -> Result<TableHeader, moe_abi::AbiError>,
) -> Result<(TableHeader, Vec<u8>), ResidencyError> {
    let abi_err = |e: moe_abi::AbiError| ResidencyError::Abi { pid, what: e.to_string() };
    let mut h = vec![0u8; header_size];
    for _ in 0..SEQLOCK_TRIES {
        mem.read_exact_at(&mut h, addr).map_err(proc_err(pid, "reading a published table's header"))?;
        let header = parse(&h).map_err(abi_err)?;
        if !header.stable() {
            std::thread::yield_now();
            continue;
        }
        if header.is_empty() {
            return Ok((header, Vec::new()));
        }
        let mut table = vec![0u8; header.table_bytes() as usize];
        mem.read_exact_at(&mut table, header.table).map_err(proc_err(pid, "reading a published table"))?;
        if seq_now(mem, pid, addr)? == header.seq {
            return Ok((header, table));
        }
    }
    Err(ResidencyError::Abi { pid, what: format!("{symbol} kept changing while being read") })
}

/// Runtime address minus link-time address of the executable, from its program headers and
/// the process's mappings of the same file.
fn load_bias(pid: u32, exe: &std::path::Path, id: (u64, u64)) -> Result<Option<u64>, ResidencyError> {
    use object::{Object, ObjectSegment};
    let data = crate::capture::bpf::map_elf(exe).map_err(proc_err(pid, "reading the executable"))?;
    let Ok(file) = object::File::parse(&*data) else { return Ok(None) };
    let maps = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.maps())
        .map_err(|e| proc_err(pid, "reading /proc/PID/maps")(std::io::Error::other(e)))?;
    let page = super::scan::page_size();
    let (major, minor) = (libc::major(id.0), libc::minor(id.0));
    for m in maps.iter().filter(|m| m.inode == id.1 && m.dev == (major as i32, minor as i32)) {
        for seg in file.segments() {
            let (foff, _) = seg.file_range();
            if foff / page * page == m.offset {
                return Ok(Some(m.address.0.wrapping_sub(seg.address() / page * page)));
            }
        }
    }
    Ok(None)
}
