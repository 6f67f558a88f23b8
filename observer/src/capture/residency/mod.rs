//! Residency of a model's weights: which dense weights and which experts are in RAM, which keep
//! leaving.
//!
//! ## Measurement rules
//! - **Regions** come from the GGUF tensor table (`engine::regions`): dense tensors, shared
//!   experts, and each routed expert's slices of `ffn_*_exps` (one cell of the layer × expert
//!   grid per expert).
//! - **Looking does not warm** ([`direct`]): the header is read with `O_DIRECT`, so opening a
//!   model adds nothing to its page cache; where the file system refuses direct reads, the
//!   pages the parse added are dropped again ([`ModelFile::open`]).
//! - **File residency** ([`scan`]): `mincore` over a read-only mapping of the whole file gives one
//!   bit per page; a region's resident bytes are the bytes of its resident pages that it covers
//!   (a page shared by two regions counts for both, each with its part). Fractions are resident
//!   bytes / bytes. The whole-file number is resident pages / pages, as `fincore` counts it.
//!   Where `mincore` would lie (no write permission: it then reports every page resident, see
//!   [`scan`]) `cachestat` per region is used (page granularity at region boundaries) where the
//!   kernel allows it (before 6.14), or the file is refused with the fix.
//! - **`dense_resident_frac`**: dense tensors and shared experts together, from the file; but
//!   when the target publishes an anonymous copy of its dense weights ([`anon`]), from
//!   `/proc/PID/pagemap` of that copy, and then `dense_swapped_frac` too (else `None`: file
//!   pages are evicted, never swapped).
//! - **The engine's expert cache** ([`slots`]): when the target publishes its slot table, which
//!   experts are in it, the reads it started (its version counter) and the observer's hit rate.
//! - **Churn** ([`churn`]): page-cache pages of the model file added and evicted, per expert,
//!   counted in the kernel from the `filemap` tracepoints. A [`Sample`] carries the pages added
//!   and evicted since the previous sample (per token when sampled at each token end; the
//!   boundary is the moment the observer processes the token's end mark, typically within a
//!   millisecond of it).
//! - **Scans follow the churn** ([`Sampler::sample`]): with churn attached, a scan due by its
//!   interval is skipped while the kernel has counted no page of the file added to or removed
//!   from the page cache since the last scan began (every insertion and removal on a regular
//!   file system passes the `filemap` tracepoints: reads, read-ahead, reclaim, DAMON,
//!   `drop_caches`, fadvise, truncation), so the last scan is still exact, provided no read was
//!   in flight during it: `mincore` counts a page once its read completed, which raises no
//!   event, so a scan whose whole-file `cachestat` holds more pages than `mincore` saw is never
//!   reused past the next due scan ([`Snapshot::settled`]; without `cachestat`, Linux < 6.5,
//!   no scan is skipped); one is taken anyway
//!   [`UNCHANGED_MAX_AGE`] after it, and on tmpfs, where shmem adds and swaps out pages without
//!   those tracepoints, every due scan is taken. A steady decode whose model stays put then
//!   costs the observer no scans.
//! - **Who evicted** ([`evict`]): each evicted page of the churn counters is also counted for the
//!   task in whose context it left the page cache, with a kind (kswapd, direct or memcg reclaim,
//!   DAMON, fadvise/madvise, truncation/`drop_caches`, other), per region class
//!   (`Churn::blame`).
//!
//! ## Live API (for `observer run`'s loop)
//! ```text
//! let mut s = residency::Sampler::new(&model_path, Some(pid))?;   // parses the GGUF, maps it
//! s.set_scan_interval(Duration::from_millis(500));                  // mincore at most this often
//! if let Err(e) = s.enable_churn(probes.ebpf_mut()) { log::warn!("churn not measured: {e}") }
//! // at each token record:
//! let x = s.sample()?;
//! record.residency = Some(x.residency);
//! record.counters.set(Counter::PagecacheAdded, x.pagecache_added);
//! record.counters.set(Counter::PagecacheEvicted, x.pagecache_evicted);
//! ```

pub mod anon;
pub mod churn;
pub mod direct;
pub mod evict;
pub mod scan;
pub mod slots;
pub mod xread;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use engine::{
    gguf::{Gguf, GgufError},
    regions::{RegionError, RegionKind, RegionMap},
};
use observer_common::model::{ExpertGrid, Residency};

pub use anon::AnonResidency;
pub use churn::Counts;
pub use scan::{Bitmap, CacheStat, MappedFile, Trust};

#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: std::io::Error },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Regions(#[from] RegionError),
    #[error(
        "cannot see which pages of {path} are in the page cache: the kernel shows a file's page-cache residency only to its owner, to root (CAP_FOWNER) or to a process that may write it (mincore would report every page as resident; cachestat {cachestat}); run as root, or as the file's owner"
    )]
    Untrusted { path: PathBuf, cachestat: String },
    #[error("pid {pid}: {what}: {source}")]
    Process { pid: u32, what: &'static str, source: std::io::Error },
    #[error("pid {pid}: {what}")]
    Abi { pid: u32, what: String },
    #[error("page-cache churn: {0}")]
    Churn(String),
}

/// Where the file numbers came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Mincore,
    Cachestat,
}

/// Bytes of a part of the model and how many of them are resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Part {
    pub bytes: u64,
    pub resident_bytes: u64,
}

impl Part {
    pub fn frac(&self) -> Option<f64> {
        (self.bytes > 0).then(|| self.resident_bytes as f64 / self.bytes as f64)
    }
    fn add(&mut self, bytes: u64, resident: u64) {
        self.bytes += bytes;
        self.resident_bytes += resident;
    }
}

/// One scan of the model file.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub source: Source,
    pub page_size: u64,
    pub file_bytes: u64,
    pub file_pages: u64,
    pub file_resident_pages: u64,
    /// `cachestat` of the whole file, where the kernel has it.
    pub cachestat: Option<CacheStat>,
    pub dense: Part,
    pub shared: Part,
    pub experts: Part,
    /// Row-major layer × expert cells.
    pub cells: Vec<Part>,
    /// Time the scan took (mapping excluded: done once).
    pub scan_ns: u64,
    /// CPU time of the scanning thread during the scan (kernel time of mincore/cachestat
    /// included).
    pub scan_cpu_ns: u64,
    /// Pages `mincore` was asked about (the other chunks were settled by `cachestat`).
    pub mincore_pages: u64,
}

impl Snapshot {
    /// Whether no page of the file was on its way in when it was scanned, so that it stays true
    /// until the page cache changes (module spec, "Scans follow the churn"): `mincore` reports a
    /// page only once its read completed, while the page cache (and `cachestat`'s `nr_cache`)
    /// holds it from the start of the read, so the two agree unless a read was in flight. Without
    /// `cachestat` this cannot be told: never. A `cachestat` scan counts pages from the start of
    /// their read: always.
    pub fn settled(&self) -> bool {
        match (self.source, self.cachestat) {
            (Source::Cachestat, _) => true,
            (Source::Mincore, Some(c)) => c.nr_cache == self.file_resident_pages,
            (Source::Mincore, None) => false,
        }
    }

    pub fn file_resident_frac(&self) -> Option<f64> {
        (self.file_pages > 0).then(|| self.file_resident_pages as f64 / self.file_pages as f64)
    }

    /// Dense weights as the engine reads them from the file: dense tensors and shared experts.
    pub fn dense_with_shared(&self) -> Part {
        Part {
            bytes: self.dense.bytes + self.shared.bytes,
            resident_bytes: self.dense.resident_bytes + self.shared.resident_bytes,
        }
    }

    pub fn cell_fracs(&self) -> Vec<f32> {
        self.cells.iter().map(|c| c.frac().unwrap_or(0.0) as f32).collect()
    }
}

/// The prefix of the file whose residency is compared around the header parse: headers of real
/// models are a few MiB (vocabularies), read-around adds at most twice the device's read-ahead.
const HEADER_WINDOW: u64 = 256 << 20;

/// Rounds of dropping the pages a buffered header parse added (2 ms apart).
const SETTLE_TRIES: u32 = 50;

/// A GGUF model file mapped for residency scans.
#[derive(Debug)]
pub struct ModelFile {
    pub map: RegionMap,
    pub file: MappedFile,
    bitmap: Bitmap,
    /// Pages that parsing the header brought into the page cache and that were dropped again
    /// (0 when the header was read with `O_DIRECT`, see [`direct`]).
    pub header_pages_dropped: u64,
    /// `expert_used_count` of the model's metadata (experts per token and MoE layer).
    pub expert_used: Option<u64>,
}

impl ModelFile {
    /// Parse the tensor table and map the file, leaving the page cache as it was: the header
    /// is read with `O_DIRECT` ([`direct`]). Where the file system refuses that, it is parsed
    /// through a mapping, around which the kernel reads ahead (into the first tensors, some
    /// pages still under I/O when the parse returns): the pages of the first [`HEADER_WINDOW`]
    /// that were not resident before and are now are dropped with `POSIX_FADV_DONTNEED`
    /// (which never drops pages another process has mapped), again until none is left (pages
    /// under I/O are not dropped until it completes) or after [`SETTLE_TRIES`] rounds.
    pub fn open(path: &Path) -> Result<ModelFile, ResidencyError> {
        let mut file = MappedFile::open(path)?;
        let trusted = matches!(file.trust, Trust::Trusted(_));
        if !trusted {
            // Refuse before parsing: the parse would warm the file for nothing.
            untrusted_fallback(&file)?;
        }
        let window = 0..HEADER_WINDOW / file.page;
        let mut before = Bitmap::new(file.page, file.n_pages());
        if trusted {
            file.scan_pages(window.clone(), &mut before)?;
        }
        let g = match direct::gguf_header(path, file.len)? {
            Some(g) => g,
            None => Gguf::open(path)?,
        };
        let map = RegionMap::from_gguf(&g)?;
        let expert_used = g.get_u64(&format!("{}.expert_used_count", map.architecture)).ok();
        drop(g);
        let mut bitmap = Bitmap::new(file.page, file.n_pages());
        let mut header_pages_dropped = 0;
        if trusted {
            let mut first = None;
            for round in 0..SETTLE_TRIES {
                file.scan_pages(window.clone(), &mut bitmap)?;
                let added = new_pages(&before, &bitmap);
                let first = *first.get_or_insert(added);
                header_pages_dropped = first.saturating_sub(added);
                if added == 0 || round + 1 == SETTLE_TRIES {
                    break;
                }
                drop_new_pages(&file, &before, &bitmap);
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(ModelFile { map, file, bitmap, header_pages_dropped, expert_used })
    }

    /// The last bitmap `scan` produced (mincore source only).
    pub fn bitmap(&self) -> &Bitmap {
        &self.bitmap
    }

    /// Scan the file's residency now.
    pub fn scan(&mut self) -> Result<Snapshot, ResidencyError> {
        let t0 = Instant::now();
        let cpu0 = thread_cpu_ns();
        let whole = scan::cachestat(&self.file.file, 0..0);
        let page = self.file.page;
        let mut s = Snapshot {
            source: Source::Mincore,
            page_size: page,
            file_bytes: self.file.len,
            file_pages: self.file.n_pages(),
            file_resident_pages: 0,
            cachestat: whole.as_ref().ok().copied(),
            dense: Part::default(),
            shared: Part::default(),
            experts: Part::default(),
            cells: vec![Part::default(); self.map.n_cells()],
            scan_ns: 0,
            scan_cpu_ns: 0,
            mincore_pages: 0,
        };
        let mut per_region: Vec<u64> = Vec::with_capacity(self.map.regions.len());
        match self.file.trust {
            Trust::Trusted(_) => {
                s.mincore_pages = self.file.scan(&mut self.bitmap)?.mincore_pages;
                s.file_resident_pages = self.bitmap.total();
                per_region.extend(self.map.regions.iter().map(|r| self.bitmap.resident_bytes(&r.range)));
            }
            Trust::Untrusted => {
                let w = untrusted_fallback(&self.file)?;
                s.source = Source::Cachestat;
                s.file_resident_pages = w.nr_cache;
                for r in &self.map.regions {
                    let c = scan::cachestat(&self.file.file, r.range.clone()).map_err(|source| ResidencyError::Io {
                        path: self.file.path.clone(),
                        what: "cachestat",
                        source,
                    })?;
                    let span = (r.range.end.div_ceil(page) - r.range.start / page).max(1);
                    per_region.push(((r.len() as u128 * c.nr_cache.min(span) as u128) / span as u128) as u64);
                }
            }
        }
        for (r, &res) in self.map.regions.iter().zip(&per_region) {
            match r.kind {
                RegionKind::Dense => s.dense.add(r.len(), res),
                RegionKind::Shared { .. } => s.shared.add(r.len(), res),
                RegionKind::Expert { .. } => {
                    s.experts.add(r.len(), res);
                    if let Some(c) = self.map.cell_of(r.kind) {
                        s.cells[c].add(r.len(), res);
                    }
                }
            }
        }
        s.scan_ns = t0.elapsed().as_nanos() as u64;
        s.scan_cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
        Ok(s)
    }
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The whole-file `cachestat` when the kernel lets an untrusted caller use it, else the error
/// that says why residency cannot be seen.
fn untrusted_fallback(file: &MappedFile) -> Result<CacheStat, ResidencyError> {
    scan::cachestat(&file.file, 0..0).map_err(|e| {
        let why = if e.raw_os_error() == Some(libc::EPERM) {
            "refuses it too (EPERM, Linux >= 6.14)".to_string()
        } else {
            format!("is not available ({e})")
        };
        ResidencyError::Untrusted { path: file.path.clone(), cachestat: why }
    })
}

/// Pages resident in `after` but not in `before`.
fn new_pages(before: &Bitmap, after: &Bitmap) -> u64 {
    (0..after.n_pages).filter(|&p| after.get(p) && !before.get(p)).count() as u64
}

/// Drop (`POSIX_FADV_DONTNEED`) the runs of pages resident in `after` but not in `before`.
fn drop_new_pages(file: &MappedFile, before: &Bitmap, after: &Bitmap) {
    use std::os::fd::AsRawFd;
    let mut p = 0;
    while p < after.n_pages {
        if after.get(p) && !before.get(p) {
            let start = p;
            while p < after.n_pages && after.get(p) && !before.get(p) {
                p += 1;
            }
            let (off, len) = (start * file.page, (p - start) * file.page);
            // SAFETY: plain advice on our own descriptor.
            unsafe {
                libc::posix_fadvise(
                    file.file.as_raw_fd(),
                    off as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
        }
        p += 1;
    }
}

/// What one call of [`Sampler::sample`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// For `TokenRecord::residency`: dense/expert fractions and the grid, with per-expert churn
    /// (`added`/`evicted`, pages since the previous sample) when churn is attached.
    pub residency: Residency,
    /// Model-file pages added to / evicted from the page cache since the previous sample, all
    /// regions (for the `pagecache_added` / `pagecache_evicted` counters); `None` without churn.
    pub pagecache_added: Option<u64>,
    pub pagecache_evicted: Option<u64>,
    /// The scan the residency numbers come from: up to the scan interval old, or older while the
    /// churn counted no change since it (module spec).
    pub snapshot: Snapshot,
    /// The engine's anonymous dense copy, when it publishes one.
    pub anon: Option<AnonResidency>,
}

/// The default budget for file scans: at most 1/`SCAN_BUDGET` of one CPU
/// (the observer shares the machine with the engine it measures).
pub const SCAN_BUDGET: u32 = 200;

/// With churn attached, a scan is taken this long after the last one even when the churn
/// counted no change (module spec, "Scans follow the churn").
pub const UNCHANGED_MAX_AGE: Duration = Duration::from_secs(30);

/// Whether every page-cache insertion and removal of `file` passes the `filemap` tracepoints that
/// churn counts: not on tmpfs (module spec). A file system that cannot be asked counts as not
/// (every due scan is taken, as without churn), and the log says why.
fn churn_sees_every_change(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: an open descriptor and a valid out-pointer.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        log::debug!("fstatfs of the model: {}: every due residency scan is taken", std::io::Error::last_os_error());
        return false;
    }
    st.f_type != libc::TMPFS_MAGIC
}

/// Residency of one model (and optionally one engine process) sampled at a configurable rate.
#[derive(Debug)]
pub struct Sampler {
    model: ModelFile,
    path: PathBuf,
    dense: Option<anon::DenseCopy>,
    slots: Option<slots::SlotTable>,
    churn: Option<churn::Churn>,
    xread: Option<xread::Xread>,
    last_counts: Option<Counts>,
    scan_interval: Duration,
    /// CPU time the last file scan took: with a budget, scans are spaced so
    /// that they cost at most 1/budget of one CPU.
    last_scan_cost: Duration,
    scan_budget: Option<u32>,
    last_scan: Option<(Instant, Snapshot)>,
    /// The churn's (add, delete) event counts read just before the last scan began, when a scan
    /// may be skipped while they stay (module spec, "Scans follow the churn").
    scanned_at: Option<(u64, u64)>,
    /// Whether churn sees every change of the file's page cache ([`churn_sees_every_change`]).
    churn_exact: bool,
    unchanged_max_age: Duration,
    scans: u64,
    last_anon: Option<(Instant, Option<AnonResidency>)>,
}

impl Sampler {
    /// Parse `model`'s tensor table and map it (nothing is read). `pid`: the engine process,
    /// for its anonymous dense copy (see [`anon`]); it may still be before `exec`.
    pub fn new(model: &Path, pid: Option<u32>) -> Result<Sampler, ResidencyError> {
        let path = model.to_owned();
        let model = ModelFile::open(model)?;
        Ok(Sampler {
            path,
            dense: pid.map(anon::DenseCopy::new),
            slots: pid.map(|p| slots::SlotTable::new(p, &model.map.moe_layers, model.map.n_experts)),
            churn: None,
            xread: None,
            last_counts: None,
            scan_interval: Duration::ZERO,
            last_scan_cost: Duration::ZERO,
            scan_budget: None,
            last_scan: None,
            scanned_at: None,
            churn_exact: false,
            unchanged_max_age: UNCHANGED_MAX_AGE,
            scans: 0,
            last_anon: None,
            model,
        })
    }

    /// The process has exited: later samples keep its last reading of the anonymous dense copy
    /// and carry no engine cache (nothing of the process is read again), while the file's
    /// residency and the kernel's counters since the previous sample (per-expert churn,
    /// refaults, reads) go on: they hold what the process's last tokens did.
    pub fn process_ended(&mut self) {
        self.dense = None;
        self.slots = None;
    }

    /// Rescan residency (mincore, pagemap) at most this often; churn is read at every sample.
    /// Default: every sample.
    pub fn set_scan_interval(&mut self, d: Duration) {
        self.scan_interval = d;
    }

    /// Space scans so that they take at most 1/`budget` of one CPU (e.g.
    /// [`SCAN_BUDGET`]), on top of the scan interval.
    pub fn set_scan_budget(&mut self, budget: Option<u32>) {
        self.scan_budget = budget;
    }

    /// Attach the page-cache churn programs of the observer's eBPF object to this model.
    pub fn enable_churn(&mut self, ebpf: &mut aya::Ebpf) -> Result<(), ResidencyError> {
        let c = churn::Churn::attach(ebpf, &self.path, &self.model.map, self.model.file.page)?;
        self.last_counts = Some(c.read());
        self.churn = Some(c);
        self.churn_exact = churn_sees_every_change(&self.model.file.file);
        Ok(())
    }

    /// Whether a scan due by its interval is skipped while the churn counts no change (module
    /// spec, "Scans follow the churn"): churn attached, and not on tmpfs.
    pub fn skips_unchanged_scans(&self) -> bool {
        self.churn.is_some() && self.churn_exact
    }

    /// Take a scan this long after the last one even when nothing changed (default
    /// [`UNCHANGED_MAX_AGE`]).
    pub fn set_unchanged_max_age(&mut self, d: Duration) {
        self.unchanged_max_age = d;
    }

    /// File scans taken so far.
    pub fn scans(&self) -> u64 {
        self.scans
    }

    /// Charge the target's explicit reads of the model to its regions (`xread`), on the churn
    /// intervals ([`Self::enable_churn`] first); `pid`'s descriptors open now are resolved at once.
    pub fn enable_explicit_reads(&mut self, ebpf: &mut aya::Ebpf, pid: u32) -> Result<(), ResidencyError> {
        let c = self.churn.as_ref().ok_or_else(|| ResidencyError::Churn("needs page-cache churn".into()))?;
        let mut x = xread::Xread::attach(ebpf, &self.path, &self.model.map, &c.intervals, self.model.file.page)?;
        x.seed(pid);
        self.xread = Some(x);
        Ok(())
    }

    pub fn xread(&self) -> Option<&xread::Xread> {
        self.xread.as_ref()
    }

    pub fn xread_mut(&mut self) -> Option<&mut xread::Xread> {
        self.xread.as_mut()
    }

    pub fn churn(&self) -> Option<&churn::Churn> {
        self.churn.as_ref()
    }

    pub fn regions(&self) -> &RegionMap {
        &self.model.map
    }

    pub fn model(&self) -> &ModelFile {
        &self.model
    }

    /// Cumulative churn counters now (without moving the per-sample baseline).
    pub fn churn_counts(&self) -> Option<Counts> {
        self.churn.as_ref().map(churn::Churn::read)
    }

    pub fn sample(&mut self) -> Result<Sample, ResidencyError> {
        self.sample_after(None)
    }

    /// [`Self::sample`], told how many tokens were generated since the previous sample (`None`:
    /// unknown, or a prompt step among them), for the observer's hit rate of the engine's cache.
    pub fn sample_after(&mut self, generated: Option<u64>) -> Result<Sample, ResidencyError> {
        let now = Instant::now();
        let spacing = match self.scan_budget {
            Some(b) => self.scan_interval.max(self.last_scan_cost * b),
            None => self.scan_interval,
        };
        let due = |t: Option<Instant>| t.is_none_or(|t| now.duration_since(t) >= spacing);
        // Read before any scan, so that a change during one makes the next one due.
        let counts = self.churn.as_ref().map(churn::Churn::read);
        let events = counts.as_ref().map(|c| (c.add_events, c.del_events));
        let unchanged = |t: Instant| {
            self.skips_unchanged_scans() && events == self.scanned_at && now.duration_since(t) < self.unchanged_max_age
        };
        let snapshot = match &self.last_scan {
            Some((t, s)) if !due(Some(*t)) || unchanged(*t) => s.clone(),
            _ => {
                let s = self.model.scan()?;
                self.last_scan_cost = now.elapsed();
                self.last_scan = Some((now, s.clone()));
                // A scan that saw a read in flight is not trusted past the next due one.
                self.scanned_at = if s.settled() { events } else { None };
                self.scans += 1;
                s
            }
        };
        if let Some(d) = &mut self.dense
            && due(self.last_anon.as_ref().map(|x| x.0))
        {
            // A target that exited (or was never an engine) simply has no anonymous copy.
            let a = match d.sample() {
                Ok(a) => a,
                Err(ResidencyError::Process { .. }) => None,
                Err(e) => return Err(e),
            };
            self.last_anon = Some((now, a));
        }
        let anon = self.last_anon.as_ref().and_then(|x| x.1);
        let engine_cache = match self.slots.as_mut().map(slots::SlotTable::sample) {
            Some(Ok(mut c)) => {
                if let (Some(c), Some(n), Some(k)) = (&mut c, generated, self.model.expert_used) {
                    let layers = self.model.map.moe_layers.len() as u64;
                    c.hit_pct = c.reads.and_then(|r| slots::hit_pct(r, n, layers, k));
                }
                c
            }
            Some(Err(ResidencyError::Process { .. })) | None => None,
            Some(Err(e)) => return Err(e),
        };

        let (mut added, mut evicted, mut total_added, mut total_evicted) = (None, None, None, None);
        let (mut refault_faults, mut refault_io_ns) = (None, None);
        if let Some(now_counts) = counts {
            let last = self.last_counts.take().unwrap_or_default();
            let d = |a: &[u64], b: &[u64]| -> Vec<u32> {
                a.iter()
                    .enumerate()
                    .map(|(i, &x)| u32::try_from(x.saturating_sub(b.get(i).copied().unwrap_or(0))).unwrap_or(u32::MAX))
                    .collect()
            };
            added = Some(d(&now_counts.cell_added, &last.cell_added));
            evicted = Some(d(&now_counts.cell_evicted, &last.cell_evicted));
            total_added = Some(now_counts.add_pages.saturating_sub(last.add_pages));
            total_evicted = Some(now_counts.del_pages.saturating_sub(last.del_pages));
            if let Some(r) = &now_counts.refault {
                let before = last.refault.unwrap_or_default();
                refault_faults = Some(d(&r.faults, &before.faults));
                refault_io_ns = Some(
                    r.io_ns
                        .iter()
                        .enumerate()
                        .map(|(i, &x)| x.saturating_sub(before.io_ns.get(i).copied().unwrap_or(0)))
                        .collect(),
                );
            }
            self.last_counts = Some(now_counts);
        }

        let map = &self.model.map;
        let grid = (map.n_cells() > 0).then(|| ExpertGrid {
            n_layers: map.moe_layers.len() as u32,
            n_experts: map.n_experts,
            layers: map.moe_layers.clone(),
            resident: snapshot.cell_fracs(),
            added,
            evicted,
            read_bytes: None,
            read_calls: None,
            refault_faults,
            refault_io_ns,
        });
        let (dense_resident_frac, dense_swapped_frac) = match anon {
            Some(a) => (a.resident_frac(), a.swapped_frac()),
            None => (snapshot.dense_with_shared().frac(), None),
        };
        Ok(Sample {
            residency: Residency {
                dense_resident_frac,
                dense_swapped_frac,
                experts_resident_frac: snapshot.experts.frac(),
                grid,
                engine_cache,
            },
            pagecache_added: total_added,
            pagecache_evicted: total_evicted,
            snapshot,
            anon,
        })
    }
}
