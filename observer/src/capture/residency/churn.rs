//! Page-cache churn of the model file per region, counted in the kernel
//! (`observer-ebpf/src/filemap.rs`; rule and layout in `observer_common::filemap`).
//!
//! Page ownership: page `p` belongs to the region that holds its middle byte
//! `p·PAGE + PAGE/2`; pages whose middle byte is in no region (header, padding) are `other`.
//! Consecutive pages of one owner form an interval; the kernel counts per interval and this
//! module folds intervals into expert cells, dense weights, shared experts and `other`.
//! The per-page rule differs from residency's per-byte rule only at pages that two regions
//! share (at most one per region boundary).

use std::{
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{Array, Map, MapData},
    programs::TracePoint,
};
use engine::regions::{RegionKind, RegionMap};
use observer_common::filemap::{
    DIRECT_FIELDS, FilemapConfig, FilemapFields, IntervalIndex, MAX_BUCKETS, MAX_INTERVALS, N_TOTALS, NO_FIELD,
    T_ADD_EVENTS, T_ADD_PAGES, T_ADD_SPILL, T_DEL_EVENTS, T_DEL_PAGES, T_DEL_SPILL, T_OTHER_DEV, T_OTHER_DEV_LAST,
    kernel_dev,
};

use super::ResidencyError;
use crate::capture::{preflight, tracefs::Format};

/// Who owns an interval of pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// Row-major cell of the expert grid.
    Cell(u32),
    Dense,
    Shared,
    Other,
}

/// The page intervals of a region map: `starts[i]` is the first page of interval `i`
/// (`starts[0] == 0`; the last interval runs to infinity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intervals {
    pub starts: Vec<u64>,
    pub owners: Vec<Owner>,
}

impl Intervals {
    pub fn build(map: &RegionMap, page: u64) -> Intervals {
        let half = page / 2;
        // First page whose middle byte is at or after byte `b`.
        let first_at = |b: u64| b.saturating_sub(half).div_ceil(page);
        // (first page, owner) segments in file order; regions are sorted and disjoint, so the
        // pages they own are too.
        let mut segs: Vec<(u64, Owner)> = vec![(0, Owner::Other)];
        let mut end = 0;
        for r in &map.regions {
            let (a, b) = (first_at(r.range.start), first_at(r.range.end));
            if a >= b {
                continue; // within half a page of a boundary: owns no page
            }
            let owner = match r.kind {
                RegionKind::Dense => Owner::Dense,
                RegionKind::Shared { .. } => Owner::Shared,
                RegionKind::Expert { .. } => map.cell_of(r.kind).map_or(Owner::Other, |c| Owner::Cell(c as u32)),
            };
            if a > end {
                segs.push((end, Owner::Other));
            }
            segs.push((a, owner));
            end = b;
        }
        segs.push((end, Owner::Other));
        let (mut starts, mut owners): (Vec<u64>, Vec<Owner>) = (Vec::new(), Vec::new());
        for (s, o) in segs {
            if starts.last() == Some(&s) {
                // The previous segment is empty.
                starts.pop();
                owners.pop();
            }
            if owners.last() == Some(&o) {
                continue;
            }
            starts.push(s);
            owners.push(o);
        }
        Intervals { starts, owners }
    }

    /// The interval holding page `p`.
    pub fn find(&self, p: u64) -> usize {
        self.starts.partition_point(|&s| s <= p) - 1
    }

    /// Pages of interval `i` within a file of `n_pages`.
    pub fn pages(&self, i: usize, n_pages: u64) -> u64 {
        let end = self.starts.get(i + 1).copied().unwrap_or(u64::MAX).min(n_pages);
        end.saturating_sub(self.starts[i])
    }
}

/// Cumulative counts read from the kernel (pages).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Per grid cell.
    pub cell_added: Vec<u64>,
    pub cell_evicted: Vec<u64>,
    pub dense: (u64, u64),
    pub shared: (u64, u64),
    pub other: (u64, u64),
    /// Per interval (added, evicted), for checks.
    pub intervals: Vec<(u64, u64)>,
    pub add_events: u64,
    pub add_pages: u64,
    pub del_events: u64,
    pub del_pages: u64,
    pub add_spill: u64,
    pub del_spill: u64,
    /// Events on the model's inode number but another device (see `T_OTHER_DEV`).
    pub other_dev_events: u64,
    pub other_dev_last: u64,
    /// Refault faults and their `fault_io` per owner (`observer_common::evict`, refault cost per
    /// region), when eviction blame is measured.
    pub refault: Option<RefaultCells>,
}

/// Cumulative refault cost (faults, `fault_io` ns) folded from the kernel's per-interval counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RefaultCells {
    /// Per grid cell.
    pub faults: Vec<u64>,
    pub io_ns: Vec<u64>,
    /// The dense tensors, shared experts and the rest of the file (header, padding), together.
    pub not_experts: (u64, u64),
}

impl Counts {
    /// Sum of the per-owner counts plus spill: equals `(add_pages, del_pages)` by construction
    /// of the kernel side (a test checks it).
    pub fn attributed(&self) -> (u64, u64) {
        let a: u64 = self.cell_added.iter().sum::<u64>() + self.dense.0 + self.shared.0 + self.other.0 + self.add_spill;
        let e: u64 =
            self.cell_evicted.iter().sum::<u64>() + self.dense.1 + self.shared.1 + self.other.1 + self.del_spill;
        (a, e)
    }
}

/// A read-only or read-write mapping of an mmapable array map.
pub(super) struct MapMem {
    ptr: *mut libc::c_void,
    len: usize,
}

impl MapMem {
    pub(super) fn new(data: &MapData, len: usize, write: bool, name: &'static str) -> Result<MapMem, ResidencyError> {
        let prot = if write { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        let fd = data.fd().as_fd().as_raw_fd();
        // SAFETY: mapping a BPF array map created with BPF_F_MMAPABLE; `len` is its value area
        // rounded up to pages.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(ResidencyError::Churn(format!(
                "mapping the eBPF map {name}: {} (mmapable arrays need Linux >= 5.5)",
                std::io::Error::last_os_error()
            )));
        }
        Ok(MapMem { ptr, len })
    }

    fn u64_at(&self, i: usize) -> u64 {
        assert!((i + 1) * 8 <= self.len, "index {i} beyond the mapped map");
        // SAFETY: in bounds (checked), aligned; the kernel updates it with atomic adds, an
        // aligned 8-byte load is never torn.
        unsafe { std::ptr::read_volatile((self.ptr as *const u64).add(i)) }
    }

    pub(super) fn set_u64(&mut self, i: usize, v: u64) {
        assert!((i + 1) * 8 <= self.len, "index {i} beyond the mapped map");
        // SAFETY: in bounds, aligned, writable mapping.
        unsafe { std::ptr::write_volatile((self.ptr as *mut u64).add(i), v) }
    }
}

impl Drop for MapMem {
    fn drop(&mut self) {
        // SAFETY: unmapping what `new` mapped.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

pub(super) fn round_page(n: usize) -> usize {
    let p = super::scan::page_size() as usize;
    n.div_ceil(p) * p
}

pub(super) fn array_data<'a>(ebpf: &'a Ebpf, name: &'static str) -> Result<&'a MapData, ResidencyError> {
    match ebpf.map(name) {
        Some(Map::Array(d)) => Ok(d),
        Some(_) => Err(ResidencyError::Churn(format!("eBPF map {name} is not an array"))),
        None => Err(ResidencyError::Churn(format!("the eBPF object has no map {name} (stale build?)"))),
    }
}

fn fields(category: &str, name: &str) -> Result<FilemapFields, ResidencyError> {
    let f = Format::load(category, name).map_err(|e| ResidencyError::Churn(format!("{e:#}")))?;
    let need = |field: &str, size: u32| -> Result<u32, ResidencyError> {
        let x = f.field(field).map_err(|e| ResidencyError::Churn(format!("{e:#}")))?;
        if x.size != size {
            return Err(ResidencyError::Churn(format!(
                "tracepoint {category}:{name} field `{field}` is {} bytes, expected {size}",
                x.size
            )));
        }
        Ok(x.offset)
    };
    Ok(FilemapFields {
        ino: need("i_ino", 8)?,
        dev: need("s_dev", 4)?,
        index: need("index", 8)?,
        order: f.field("order").ok().filter(|x| x.size == 1).map_or(NO_FIELD, |x| x.offset),
    })
}

/// The attached churn counters of one model file.
pub struct Churn {
    pub intervals: Intervals,
    /// Their bucket index, as the kernel has it (`FILEMAP_INDEX`).
    pub index: IntervalIndex,
    n_cells: usize,
    churn: MapMem,
    totals: MapMem,
    /// `EVICT_REFAULT_CELLS`, when eviction blame is attached.
    refault: Option<MapMem>,
    /// The kernel `dev_t` the filter uses.
    pub dev: u32,
    pub ino: u64,
    /// Attached tracepoints, for headers.
    pub attached: Vec<String>,
    /// Eviction blame ([`super::evict`]): `Err` says why it is not measured.
    pub blame: Result<super::evict::Attached, String>,
}

impl std::fmt::Debug for Churn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Churn").field("dev", &self.dev).field("ino", &self.ino).finish_non_exhaustive()
    }
}

const TRACEPOINTS: [(&str, &str); 2] =
    [("filemap_add", "mm_filemap_add_to_page_cache"), ("filemap_delete", "mm_filemap_delete_from_page_cache")];

/// A test's bound on the buckets of the interval index (`observer_common::filemap`, "Finding a
/// page's interval"): a small model then needs the search steps that only large ones do. The
/// observer says so on stderr when it is set.
pub const BUCKETS_VAR: &str = "MOE_OBSERVER_INDEX_BUCKETS";

/// [`BUCKETS_VAR`]'s bound, when it is set.
fn buckets_from_env() -> Result<Option<u32>, ResidencyError> {
    let Ok(v) = std::env::var(BUCKETS_VAR) else { return Ok(None) };
    let n = v.parse::<u32>().ok().filter(|n| (1..=MAX_BUCKETS).contains(n));
    n.map(Some).ok_or_else(|| {
        ResidencyError::Churn(format!("{BUCKETS_VAR}={v:?}: expected a number of buckets from 1 to {MAX_BUCKETS}"))
    })
}

/// A test's choices for [`Churn::attach_with`]; the observer takes the defaults.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tuning {
    /// At most this many buckets in the interval index (default [`MAX_BUCKETS`]).
    pub most_buckets: Option<u32>,
    /// Read the events' fields through `bpf_probe_read` even where plain loads would do
    /// (`observer_common::filemap::DIRECT_FIELDS`).
    pub probe_reads: bool,
}

impl Churn {
    /// Configure and attach the `filemap` programs of `ebpf` (the observer's loaded object,
    /// `Probes::ebpf_mut()`, or [`load_standalone`]) for the model at `path`.
    pub fn attach(ebpf: &mut Ebpf, path: &Path, map: &RegionMap, page: u64) -> Result<Churn, ResidencyError> {
        let most_buckets = buckets_from_env()?;
        if let Some(n) = most_buckets {
            eprintln!("observer: {BUCKETS_VAR}={n}: a test's bound on the interval index's buckets");
        }
        Churn::attach_with(ebpf, path, map, page, Tuning { most_buckets, ..Tuning::default() })
    }

    /// [`Churn::attach`] with a test's [`Tuning`]. It says on stderr how many buckets of how many
    /// pages it made, and their span, when `most_buckets` is given.
    pub fn attach_with(
        ebpf: &mut Ebpf,
        path: &Path,
        map: &RegionMap,
        page: u64,
        tuning: Tuning,
    ) -> Result<Churn, ResidencyError> {
        use std::os::unix::fs::MetadataExt;
        preflight::ensure_tracefs().map_err(|e| ResidencyError::Churn(format!("{e:#}")))?;
        let meta = std::fs::metadata(path).map_err(|source| ResidencyError::Io {
            path: path.to_owned(),
            what: "stat",
            source,
        })?;
        let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
        let dev = kernel_dev(major, minor);
        let ino = meta.ino();
        let intervals = Intervals::build(map, page);
        if intervals.starts.len() > MAX_INTERVALS as usize {
            return Err(ResidencyError::Churn(format!(
                "{}: {} page intervals, more than the {MAX_INTERVALS} the kernel side holds",
                path.display(),
                intervals.starts.len()
            )));
        }
        let add = fields("filemap", TRACEPOINTS[0].1)?;
        let del = fields("filemap", TRACEPOINTS[1].1)?;

        let mut starts = MapMem::new(
            array_data(ebpf, "FILEMAP_STARTS")?,
            round_page(MAX_INTERVALS as usize * 8),
            true,
            "FILEMAP_STARTS",
        )?;
        for i in 0..MAX_INTERVALS as usize {
            starts.set_u64(i, intervals.starts.get(i).copied().unwrap_or(u64::MAX));
        }
        drop(starts);
        // The index before the configuration that turns the programs on.
        let index = IntervalIndex::build(
            &intervals.starts,
            meta.len().div_ceil(page),
            tuning.most_buckets.unwrap_or(MAX_BUCKETS),
        );
        if tuning.most_buckets.is_some() {
            eprintln!(
                "observer: the interval index has {} buckets of {} pages, span {}",
                index.first.len(),
                1u64 << index.shift.min(63),
                index.span
            );
        }
        {
            let m = ebpf
                .map_mut("FILEMAP_INDEX")
                .ok_or_else(|| ResidencyError::Churn("the eBPF object has no map FILEMAP_INDEX".into()))?;
            let mut a: Array<_, [u16; MAX_BUCKETS as usize]> =
                Array::try_from(m).map_err(|e| ResidencyError::Churn(format!("FILEMAP_INDEX: {e}")))?;
            let mut first = [0u16; MAX_BUCKETS as usize];
            first[..index.first.len()].copy_from_slice(&index.first);
            a.set(0, first, 0).map_err(|e| ResidencyError::Churn(format!("FILEMAP_INDEX: {e}")))?;
        }
        let churn = MapMem::new(
            array_data(ebpf, "FILEMAP_CHURN")?,
            round_page(MAX_INTERVALS as usize * 16),
            false,
            "FILEMAP_CHURN",
        )?;
        let totals = MapMem::new(
            array_data(ebpf, "FILEMAP_TOTALS")?,
            round_page(N_TOTALS as usize * 8),
            false,
            "FILEMAP_TOTALS",
        )?;
        {
            let m = ebpf
                .map_mut("FILEMAP_CONFIG")
                .ok_or_else(|| ResidencyError::Churn("the eBPF object has no map FILEMAP_CONFIG".into()))?;
            let mut a: Array<_, FilemapConfig> =
                Array::try_from(m).map_err(|e| ResidencyError::Churn(format!("FILEMAP_CONFIG: {e}")))?;
            let config = FilemapConfig {
                ino,
                dev,
                enabled: 1,
                add,
                del,
                index_shift: index.shift,
                index_span: index.span,
                direct: (add == DIRECT_FIELDS && del == DIRECT_FIELDS && !tuning.probe_reads) as u32,
                _pad: 0,
            };
            a.set(0, config, 0).map_err(|e| ResidencyError::Churn(format!("FILEMAP_CONFIG: {e}")))?;
        }
        // Blame first: the delete program counts actors from its first event on.
        let blame = super::evict::attach(ebpf, &intervals).map_err(|e| e.to_string());
        let mut attached = Vec::new();
        for (program, tp) in TRACEPOINTS {
            let prog: &mut TracePoint = ebpf
                .program_mut(program)
                .ok_or_else(|| ResidencyError::Churn(format!("the eBPF object has no program {program}")))?
                .try_into()
                .map_err(|e| ResidencyError::Churn(format!("{program}: {e}")))?;
            if prog.fd().is_err() {
                prog.load().map_err(|e| ResidencyError::Churn(format!("loading {program}: {e}")))?;
            }
            prog.attach("filemap", tp).map_err(|e| ResidencyError::Churn(format!("attaching filemap:{tp}: {e}")))?;
            attached.push(format!("tp:filemap:{tp}"));
        }
        let mut refault = None;
        if let Ok(b) = &blame {
            attached.extend(b.attached.iter().cloned());
            refault = Some(MapMem::new(
                array_data(ebpf, "EVICT_REFAULT_CELLS")?,
                round_page(MAX_INTERVALS as usize * 16),
                false,
                "EVICT_REFAULT_CELLS",
            )?);
        }
        Ok(Churn { intervals, index, n_cells: map.n_cells(), churn, totals, refault, dev, ino, attached, blame })
    }

    /// Who evicted the file's pages so far (cumulative), when blame is attached.
    pub fn blame(&self) -> Option<Result<super::evict::Table, ResidencyError>> {
        self.blame.as_ref().ok().map(super::evict::Attached::read)
    }

    /// The cumulative counters now.
    pub fn read(&self) -> Counts {
        let n = self.intervals.starts.len();
        let mut c = Counts {
            cell_added: vec![0; self.n_cells],
            cell_evicted: vec![0; self.n_cells],
            intervals: Vec::with_capacity(n),
            ..Counts::default()
        };
        for (i, owner) in self.intervals.owners.iter().enumerate() {
            let (a, e) = (self.churn.u64_at(2 * i), self.churn.u64_at(2 * i + 1));
            c.intervals.push((a, e));
            let slot = match *owner {
                Owner::Cell(k) if (k as usize) < self.n_cells => {
                    c.cell_added[k as usize] += a;
                    c.cell_evicted[k as usize] += e;
                    continue;
                }
                Owner::Cell(_) | Owner::Other => &mut c.other,
                Owner::Dense => &mut c.dense,
                Owner::Shared => &mut c.shared,
            };
            slot.0 += a;
            slot.1 += e;
        }
        let t = |i: u32| self.totals.u64_at(i as usize);
        c.add_events = t(T_ADD_EVENTS);
        c.add_pages = t(T_ADD_PAGES);
        c.del_events = t(T_DEL_EVENTS);
        c.del_pages = t(T_DEL_PAGES);
        c.add_spill = t(T_ADD_SPILL);
        c.del_spill = t(T_DEL_SPILL);
        c.other_dev_events = t(T_OTHER_DEV);
        c.other_dev_last = t(T_OTHER_DEV_LAST);
        c.refault = self.refault.as_ref().map(|m| {
            let mut r =
                RefaultCells { faults: vec![0; self.n_cells], io_ns: vec![0; self.n_cells], not_experts: (0, 0) };
            for (i, owner) in self.intervals.owners.iter().enumerate() {
                let (f, io) = (m.u64_at(2 * i), m.u64_at(2 * i + 1));
                match *owner {
                    Owner::Cell(k) if (k as usize) < self.n_cells => {
                        r.faults[k as usize] += f;
                        r.io_ns[k as usize] += io;
                    }
                    _ => {
                        r.not_experts.0 += f;
                        r.not_experts.1 += io;
                    }
                }
            }
            r
        });
        c
    }
}

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-ebpf.o"));

/// Load the observer's eBPF object on its own (for `observer heatmap --churn`, which has no
/// target process): only the programs [`Churn::attach`] loads are loaded.
pub fn load_standalone() -> Result<Ebpf, ResidencyError> {
    Ebpf::load(OBJECT).map_err(|e| {
        let hint = if crate::capture::preflight::privileged() {
            String::new()
        } else {
            format!(" ({})", crate::capture::preflight::permission_hint())
        };
        ResidencyError::Churn(format!("loading the eBPF object: {e}{hint}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::regions::Region;

    fn map(regions: Vec<(u64, u64, RegionKind)>, layers: Vec<u32>, n_experts: u32) -> RegionMap {
        RegionMap {
            path: "t".into(),
            architecture: "t".into(),
            file_len: regions.last().map_or(0, |r| r.1),
            n_experts,
            n_blocks: layers.iter().max().map_or(0, |l| l + 1),
            layers: Vec::new(),
            moe_layers: layers,
            regions: regions
                .into_iter()
                .map(|(a, b, kind)| Region { range: a..b, kind, tensor: 0, layer: None })
                .collect(),
        }
    }

    #[test]
    fn intervals_follow_the_middle_byte_and_merge_neighbours() {
        let p = 4096;
        let e = |expert| RegionKind::Expert { layer: 0, expert };
        let m = map(
            vec![
                (1000, 5000, RegionKind::Dense),                 // pages 0 (mid 2048 ✓)
                (5000, 9000, RegionKind::Dense),                 // page 1 (mid 6144 ✓): merged with page 0
                (9000, 3 * p + 100, e(0)),                       // page 2 (mid 10240 ✓), page 3 mid 14336 ✗
                (3 * p + 100, 3 * p + 200, e(1)),                // owns nothing
                (3 * p + 200, 6 * p, e(2)),                      // pages 3, 4, 5
                (7 * p, 8 * p, RegionKind::Shared { layer: 0 }), // page 7; page 6 is a gap
            ],
            vec![0],
            3,
        );
        let iv = Intervals::build(&m, p);
        assert_eq!(iv.starts, vec![0, 2, 3, 6, 7, 8]);
        assert_eq!(
            iv.owners,
            vec![Owner::Dense, Owner::Cell(0), Owner::Cell(2), Owner::Other, Owner::Shared, Owner::Other]
        );
        assert_eq!(iv.find(0), 0);
        assert_eq!(iv.find(5), 2);
        assert_eq!(iv.find(1 << 40), 5);
        assert_eq!(iv.pages(2, 100), 3);
        assert_eq!(iv.pages(5, 10), 2);
    }

    #[test]
    fn a_header_before_the_first_region_is_other() {
        let p = 4096;
        let m = map(vec![(3 * p, 5 * p, RegionKind::Dense)], vec![], 0);
        let iv = Intervals::build(&m, p);
        assert_eq!(iv.starts, vec![0, 3, 5]);
        assert_eq!(iv.owners, vec![Owner::Other, Owner::Dense, Owner::Other]);
    }
}
