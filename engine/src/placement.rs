//! Weight placement: where the dense weights live while the engine decodes.
//!
//! ## Policies
//! *Dense* weights are every tensor but the routed experts (`ffn_{gate,up,down}_exps`): token
//! embeddings, attention, norms, routers, the output matrix. They are touched every token.
//! - `mmap`: served from the read-only file mapping, i.e. from the page cache (like llama.cpp's
//!   default). Under pressure the kernel drops them and faults them back from the file.
//! - `anon`: copied at load into one private anonymous mapping. Under pressure the kernel may
//!   swap them out, e.g. to zram, and every later touch is a synchronous swap-in on the decoding
//!   thread (charged to the engine's "compute").
//! - `locked`: as `anon`, then `mlock`ed: the Linux counterpart of pinned buffers. Needs
//!   `CAP_IPC_LOCK` or an `RLIMIT_MEMLOCK` of at least the dense size.
//!
//! After the copy (`anon`, `locked`) the file's dense pages are released, from this process's
//! mapping (`MADV_DONTNEED`) and from the page cache (`POSIX_FADV_DONTNEED`), so that the dense
//! weights are held once, in anonymous memory.
//!
//! *Routed experts* (`--experts`):
//! - `mmap`: served from the file mapping (page cache). With `--expert-advice random`
//!   ([`Placement::advise_experts`]) the expert tensors' pages get `MADV_RANDOM`, so a fault on
//!   an expert reads only around the faulting page instead of an 8 MiB read-ahead window that
//!   drags in neighbouring experts.
//! - `cache`: streamed into the expert cache's slots by `O_DIRECT` reads ([`crate::cache`]); the
//!   mapping's expert pages are never touched.
//!
//! ## Layout of the copy
//! The dense tensors' file ranges are merged into runs (adjacent dense tensors). Each run is
//! copied whole, at the same offset within a page as in the file (so every tensor keeps the
//! file's alignment, as under `mmap`), and starts on a page of its own: no page of the copy
//! holds two runs. The mapping has a `PROT_NONE` guard page on each side, so it is one VMA of
//! its own in `/proc/PID/maps`. Once the copy is complete (and locked), its runs are published
//! for observers in the exported `moe_engine_dense_regions` ([`crate::dense_regions`]), and
//! unpublished before the copy is unmapped.
//!
//! ## Residency (`dense_resident_frac`)
//! The share of the dense weights' pages that are in RAM, by `mincore(2)`: over the pages of the
//! file mapping that overlap dense tensors for `mmap` (page-cache residency of those file pages),
//! over the anonymous copy for `anon`/`locked` (a page swapped out to zram is not resident; a
//! page in the swap cache is). Page granular: a page shared by a dense tensor and an expert
//! counts as dense.

use std::ops::Range;

use crate::gguf::Gguf;

/// Where the dense weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DensePolicy {
    Mmap,
    Anon,
    Locked,
}

impl DensePolicy {
    pub fn name(self) -> &'static str {
        match self {
            DensePolicy::Mmap => "mmap",
            DensePolicy::Anon => "anon",
            DensePolicy::Locked => "locked",
        }
    }
}

impl std::str::FromStr for DensePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mmap" => Ok(DensePolicy::Mmap),
            "anon" => Ok(DensePolicy::Anon),
            "locked" => Ok(DensePolicy::Locked),
            _ => Err(format!("unknown dense policy {s:?} (mmap, anon, locked)")),
        }
    }
}

/// Where the routed experts live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPolicy {
    Mmap,
    /// The expert cache ([`crate::cache`]).
    Cache,
}

impl ExpertPolicy {
    pub fn name(self) -> &'static str {
        match self {
            ExpertPolicy::Mmap => "mmap",
            ExpertPolicy::Cache => "cache",
        }
    }
}

impl std::str::FromStr for ExpertPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mmap" => Ok(ExpertPolicy::Mmap),
            "cache" => Ok(ExpertPolicy::Cache),
            _ => Err(format!("unknown expert policy {s:?} (mmap, cache)")),
        }
    }
}

/// `madvise` advice for the routed experts' pages of the mapping (`--expert-advice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertAdvice {
    /// The kernel's default read-ahead.
    Normal,
    /// `MADV_RANDOM`: no read-ahead around faults.
    Random,
}

impl std::str::FromStr for ExpertAdvice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "normal" => Ok(ExpertAdvice::Normal),
            "random" => Ok(ExpertAdvice::Random),
            _ => Err(format!("unknown expert advice {s:?} (normal, random)")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("{path}: cannot allocate {bytes} bytes of anonymous memory for the dense weights: {source}")]
    Alloc { path: String, bytes: usize, source: std::io::Error },
    #[error(
        "{path}: mlock of the {bytes} bytes of dense weights failed: {source} (`--dense locked` needs \
         CAP_IPC_LOCK or `ulimit -l` of at least that size, and enough memory in the cgroup)"
    )]
    Mlock { path: String, bytes: usize, source: std::io::Error },
}

/// The anonymous copy of the dense tensors (layout in the module docs).
struct AnonCopy {
    /// The copy's first page (after the leading guard page).
    ptr: *mut u8,
    /// Length of the copy in whole pages (guard pages excluded).
    len: usize,
    /// Bytes from `ptr` to the end of the last run (≤ `len`).
    used: usize,
    /// `(file range of a run, offset of its copy from ptr)`, sorted by file offset.
    entries: Vec<(Range<usize>, usize)>,
    /// The runs as published in `moe_engine_dense_regions`; `None` until the copy is complete.
    published: Option<crate::dense_regions::Publication>,
}

// SAFETY: the copy is written once in `Placement::new` and only read afterwards; the pointer is
// owned (unmapped on drop) and never aliased mutably.
unsafe impl Send for AnonCopy {}
// SAFETY: as above (shared read-only access).
unsafe impl Sync for AnonCopy {}

impl Drop for AnonCopy {
    fn drop(&mut self) {
        // Observers must stop reading the runs before the memory goes away.
        drop(self.published.take());
        let page = page_size();
        // SAFETY: the mapping (guard pages included) comes from a successful mmap, and nothing
        // borrows the copy any more (borrows are tied to `&Placement`).
        unsafe { libc::munmap(self.ptr.sub(page).cast(), self.len + 2 * page) };
    }
}

impl AnonCopy {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the first `used` bytes of the mapping are mapped read/write; the runs were
        // copied in, the rest is zero-filled by the kernel.
        unsafe { std::slice::from_raw_parts(self.ptr, self.used) }
    }

    /// The runs as `dense_regions` entries.
    fn ranges(&self) -> Vec<crate::dense_regions::DenseRange> {
        self.entries
            .iter()
            .map(|(r, off)| crate::dense_regions::DenseRange {
                addr: self.ptr as u64 + *off as u64,
                len: r.len() as u64,
                file_offset: r.start as u64,
            })
            .collect()
    }
}

/// The dense/expert split of a model file and the dense weights' placement.
pub struct Placement {
    pub dense: DensePolicy,
    pub experts: ExpertPolicy,
    /// Bytes of dense tensors / of routed-expert tensors.
    pub dense_bytes: u64,
    pub expert_bytes: u64,
    /// Dense tensors' file ranges, merged into runs (see `new`) and sorted.
    dense_ranges: Vec<Range<usize>>,
    copy: Option<AnonCopy>,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Placement(dense {} {} B, experts {} {} B)",
            self.dense.name(),
            self.dense_bytes,
            self.experts.name(),
            self.expert_bytes
        )
    }
}

/// The page size in bytes: the one lookup of it in the workspace (the observer and the test
/// fixtures call this too).
pub fn page_size() -> usize {
    procfs::page_size() as usize
}

/// Resident pages among `len` bytes from page-aligned `addr`, by mincore.
fn mincore_count(addr: *const u8, len: usize, page: usize, vec: &mut Vec<u8>) -> std::io::Result<(usize, usize)> {
    let pages = len.div_ceil(page);
    vec.clear();
    vec.resize(pages, 0);
    // SAFETY: `addr` is page-aligned and `addr..addr+len` lies in one live mapping of ours;
    // `vec` holds one byte per page.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((vec.iter().filter(|&&b| b & 1 != 0).count(), pages))
}

impl Placement {
    /// Splits `g`'s tensors into dense and expert ranges and places the dense ones.
    pub fn new(g: &Gguf, dense: DensePolicy, experts: ExpertPolicy) -> Result<Placement, PlacementError> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        let (mut dense_bytes, mut expert_bytes) = (0u64, 0u64);
        for t in &g.tensors {
            if t.is_routed_expert() {
                expert_bytes += t.size;
            } else {
                dense_bytes += t.size;
                ranges.push(t.offset as usize..(t.offset + t.size) as usize);
            }
        }
        ranges.sort_by_key(|r| r.start);
        // Runs of dense tensors: adjacent ones merge across the file's alignment padding (a gap
        // shorter than the alignment cannot hold another tensor, whose start is aligned).
        let align = (g.alignment as usize).max(1);
        let mut merged: Vec<Range<usize>> = Vec::new();
        for r in &ranges {
            match merged.last_mut() {
                Some(m) if r.start <= m.end.next_multiple_of(align) => m.end = m.end.max(r.end),
                _ => merged.push(r.clone()),
            }
        }
        let path = g.path().display().to_string();
        let copy = match dense {
            DensePolicy::Mmap => None,
            DensePolicy::Anon | DensePolicy::Locked => {
                let mut c = Self::copy_dense(g, &merged, &path)?;
                if dense == DensePolicy::Locked {
                    // SAFETY: the whole copy is ours.
                    if unsafe { libc::mlock(c.ptr.cast(), c.len) } != 0 {
                        return Err(PlacementError::Mlock {
                            path,
                            bytes: c.len,
                            source: std::io::Error::last_os_error(),
                        });
                    }
                }
                if g.is_mapped() {
                    Self::release_file_pages(g, &merged);
                }
                c.published = Some(crate::dense_regions::publish(c.ranges()));
                Some(c)
            }
        };
        Ok(Placement { dense, experts, dense_bytes, expert_bytes, dense_ranges: merged, copy })
    }

    /// Copies the merged dense runs `runs` (sorted, disjoint) into a fresh anonymous mapping.
    fn copy_dense(g: &Gguf, runs: &[Range<usize>], path: &str) -> Result<AnonCopy, PlacementError> {
        let page = page_size();
        let mut entries = Vec::with_capacity(runs.len());
        let mut used = 0usize;
        for r in runs {
            // A page of its own, at the file's offset within the page.
            let off = used.next_multiple_of(page) + r.start % page;
            entries.push((r.clone(), off));
            used = off + r.len();
        }
        let len = used.max(1).next_multiple_of(page);
        let alloc_err =
            || PlacementError::Alloc { path: path.to_owned(), bytes: len, source: std::io::Error::last_os_error() };
        // SAFETY: a fresh private anonymous mapping chosen by the kernel: the copy and a guard
        // page on each side.
        let outer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + 2 * page,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if outer == libc::MAP_FAILED {
            return Err(alloc_err());
        }
        // SAFETY: one page into the mapping of `len + 2 * page` bytes.
        let ptr = unsafe { outer.cast::<u8>().add(page) };
        let c = AnonCopy { ptr, len, used, entries, published: None };
        // SAFETY: the inner `len` bytes of our own mapping (`c` unmaps it on error).
        if unsafe { libc::mprotect(ptr.cast(), len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return Err(alloc_err());
        }
        let file = g.bytes();
        for (r, off) in &c.entries {
            // SAFETY: `off + r.len() <= used <= len`; the mapping is ours and not yet shared.
            let dst = unsafe { std::slice::from_raw_parts_mut(c.ptr.add(*off), r.len()) };
            dst.copy_from_slice(&file[r.clone()]);
        }
        Ok(c)
    }

    /// Drops the file's dense pages from our mapping and from the page cache (best effort).
    fn release_file_pages(g: &Gguf, merged: &[Range<usize>]) {
        let page = page_size();
        let base = g.bytes().as_ptr();
        let fd = std::fs::File::open(g.path()).ok();
        for r in merged {
            let start = r.start.next_multiple_of(page);
            let end = r.end / page * page;
            if end > start {
                // SAFETY: the range lies inside our private read-only file mapping, which is never
                // written: after MADV_DONTNEED a read faults the same bytes back from the file, so
                // outstanding borrows still see identical contents.
                unsafe { libc::madvise(base.add(start) as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
            }
            if let Some(f) = &fd {
                use std::os::fd::AsRawFd;
                // SAFETY: plain advice on a valid fd.
                unsafe {
                    libc::posix_fadvise(
                        f.as_raw_fd(),
                        r.start as libc::off_t,
                        r.len() as libc::off_t,
                        libc::POSIX_FADV_DONTNEED,
                    )
                };
            }
        }
    }

    /// Serves the routed experts by `experts` from now on (the model loads with `mmap`).
    pub fn set_experts(&mut self, experts: ExpertPolicy) {
        self.experts = experts;
    }

    /// Applies `advice` to the pages of `g`'s mapping that hold only routed-expert bytes
    /// (`madvise`; pages shared with a dense tensor keep the default). Returns the bytes advised.
    pub fn advise_experts(g: &Gguf, advice: ExpertAdvice) -> std::io::Result<usize> {
        if !g.is_mapped() {
            return Ok(0);
        }
        let adv = match advice {
            ExpertAdvice::Normal => libc::MADV_NORMAL,
            ExpertAdvice::Random => libc::MADV_RANDOM,
        };
        let page = page_size();
        let base = g.bytes().as_ptr();
        let mut done = 0;
        for t in g.tensors.iter().filter(|t| t.is_routed_expert()) {
            let start = (t.offset as usize).next_multiple_of(page);
            let end = (t.offset + t.size) as usize / page * page;
            if end > start {
                // SAFETY: advice on whole pages inside our read-only file mapping.
                if unsafe { libc::madvise(base.add(start) as *mut libc::c_void, end - start, adv) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                done += end - start;
            }
        }
        Ok(done)
    }

    /// The copy of `r` when `r` lies inside one run of dense tensors that was copied.
    #[inline]
    pub fn dense_copy(&self, r: &Range<usize>) -> Option<&[u8]> {
        let c = self.copy.as_ref()?;
        let i = c.entries.partition_point(|(fr, _)| fr.start <= r.start);
        let (fr, off) = c.entries.get(i.checked_sub(1)?)?;
        if r.end > fr.end {
            return None;
        }
        let s = off + (r.start - fr.start);
        c.bytes().get(s..s + r.len())
    }

    /// Bytes of the anonymous copy, whole pages (0 for `mmap`).
    pub fn copy_bytes(&self) -> usize {
        self.copy.as_ref().map_or(0, |c| c.len)
    }

    /// The anonymous copy's address range (guard pages excluded); `None` for `mmap`.
    pub fn copy_range(&self) -> Option<Range<usize>> {
        self.copy.as_ref().map(|c| c.ptr as usize..c.ptr as usize + c.len)
    }

    /// The entries this copy published in `moe_engine_dense_regions` (empty for `mmap`).
    pub fn published_ranges(&self) -> Vec<crate::dense_regions::DenseRange> {
        self.copy.as_ref().filter(|c| c.published.is_some()).map_or_else(Vec::new, AnonCopy::ranges)
    }

    /// The dense tensors' file ranges (merged into runs across alignment padding, sorted).
    pub fn dense_ranges(&self) -> &[Range<usize>] {
        &self.dense_ranges
    }

    /// `dense_resident_frac` now (see the module docs); `None` when it cannot be measured (a
    /// model read from a buffer rather than mapped, or no dense tensors).
    pub fn dense_resident_frac(&self, g: &Gguf, scratch: &mut Vec<u8>) -> Option<f64> {
        let page = page_size();
        let (mut res, mut total) = (0usize, 0usize);
        match &self.copy {
            Some(c) => {
                let (r, t) = mincore_count(c.ptr, c.used, page, scratch).ok()?;
                (res, total) = (r, t);
            }
            None => {
                if !g.is_mapped() {
                    return None;
                }
                let base = g.bytes().as_ptr();
                let mut last_page_end = 0usize;
                for r in &self.dense_ranges {
                    // Page-aligned cover, without counting a page twice.
                    let start = (r.start / page * page).max(last_page_end);
                    let end = r.end.next_multiple_of(page).min(g.bytes().len().next_multiple_of(page));
                    if end <= start {
                        continue;
                    }
                    // SAFETY: `start` is page-aligned inside the mapping (which is page-aligned
                    // and whose last page is mapped in full).
                    let (rr, t) = mincore_count(unsafe { base.add(start) }, end - start, page, scratch).ok()?;
                    res += rr;
                    total += t;
                    last_page_end = end;
                }
            }
        }
        (total > 0).then(|| res as f64 / total as f64)
    }
}
