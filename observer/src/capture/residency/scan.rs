//! Which pages of a file are in the page cache: `mincore(2)` over a read-only mapping, and
//! `cachestat(2)` for counts over byte ranges.
//!
//! ## When `mincore` can be trusted
//! `mincore` on a file mapping reports the page cache only when the caller owns the file, has
//! `CAP_FOWNER`, or could open it for writing (`can_do_mincore()` in mm/mincore.c); otherwise it
//! reports **every page as resident**, whatever is cached (checked on this machine's 6.18:
//! `fincore` run as `nobody` on an evicted root-owned 0644 file prints the full size). [`trust`]
//! applies that rule (owner = effective uid, `CAP_FOWNER` from `/proc/self/status`, writability
//! from `faccessat(W_OK, AT_EACCESS)`) before any number is produced. When it fails,
//! `cachestat` (Linux 6.5, syscall 451) is the fallback; since Linux 6.14 it applies the same
//! rule but refuses with `EPERM` instead of answering wrongly, so an untrusted file on such a
//! kernel is an error that says how to fix it, never a made-up 100 %.
//!
//! ## Cost
//! The mapping reserves address space only: nothing is read or faulted. The file is scanned in
//! chunks of [`FILTER_PAGES`] pages: `cachestat` first (it walks only the cached folios, so an
//! absent chunk, or one cached in large folios, costs microseconds), a sparsely cached chunk is
//! halved while one half turns out uniform, and `mincore` gets only what is left partly cached, into one reused
//! vector. Memory stays at one bit per page of the file (a 1 TB
//! file needs a 32 MiB bitmap). (`mincore` counts a page only once its read completed,
//! `cachestat` as soon as it is in the page cache: they differ by the reads in flight.)

use std::{
    fs::File,
    io,
    ops::Range,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use super::ResidencyError;
use crate::capture::preflight::{CAP_FOWNER, has_capability};

/// Pages per chunk (16 MiB of file with 4 KiB pages; a multiple of 64).
pub const FILTER_PAGES: u64 = 4096;

/// `cachestat` system call number (the unified syscall table of Linux 6.5+, all 64-bit arches Rust targets).
const SYS_CACHESTAT: libc::c_long = 451;

/// The page size in bytes, as u64: [`engine::placement::page_size`], the one lookup.
pub fn page_size() -> u64 {
    engine::placement::page_size() as u64
}

/// Why `mincore` on this file tells the truth, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Reason: `owner`, `CAP_FOWNER` or `writable`.
    Trusted(&'static str),
    Untrusted,
}

/// The kernel's rule for `mincore` on a file mapping (see the module doc).
pub fn trust(path: &Path, meta: &std::fs::Metadata) -> Trust {
    // SAFETY: no preconditions.
    if meta.uid() == unsafe { libc::geteuid() } {
        return Trust::Trusted("owner");
    }
    if has_capability(CAP_FOWNER) {
        return Trust::Trusted("CAP_FOWNER");
    }
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return Trust::Untrusted };
    // SAFETY: valid NUL-terminated path.
    let rc = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    if rc == 0 { Trust::Trusted("writable") } else { Trust::Untrusted }
}

/// `struct cachestat` (pages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStat {
    pub nr_cache: u64,
    pub nr_dirty: u64,
    pub nr_writeback: u64,
    /// Pages evicted whose shadow entries are still there.
    pub nr_evicted: u64,
    /// … of which the eviction was recent enough for a refault to count as thrashing.
    pub nr_recently_evicted: u64,
}

/// `cachestat(fd, [off, off+len), …)`; `len == 0` means "to the end of the file".
pub fn cachestat(file: &File, range: Range<u64>) -> io::Result<CacheStat> {
    #[repr(C)]
    struct CRange {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct CStat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let r = CRange { off: range.start, len: range.end.saturating_sub(range.start) };
    let mut s = CStat::default();
    // SAFETY: valid fd and pointers to properly laid out structs that outlive the call.
    let rc = unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &r as *const CRange, &mut s as *mut CStat, 0u32) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(CacheStat {
        nr_cache: s.nr_cache,
        nr_dirty: s.nr_dirty,
        nr_writeback: s.nr_writeback,
        nr_evicted: s.nr_evicted,
        nr_recently_evicted: s.nr_recently_evicted,
    })
}

/// One bit per page of the file: set when the page is in the page cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bitmap {
    pub page: u64,
    pub n_pages: u64,
    words: Vec<u64>,
}

impl Bitmap {
    pub fn new(page: u64, n_pages: u64) -> Bitmap {
        Bitmap { page, n_pages, words: vec![0; n_pages.div_ceil(64) as usize] }
    }

    pub fn get(&self, p: u64) -> bool {
        p < self.n_pages && self.words[(p / 64) as usize] >> (p % 64) & 1 == 1
    }

    pub fn set(&mut self, p: u64, v: bool) {
        if p < self.n_pages {
            let w = &mut self.words[(p / 64) as usize];
            if v { *w |= 1 << (p % 64) } else { *w &= !(1 << (p % 64)) }
        }
    }

    /// Set (or clear) the pages `[a, b)`.
    pub fn fill(&mut self, r: Range<u64>, v: bool) {
        let b = r.end.min(self.n_pages);
        let mut p = r.start;
        while p < b {
            if p.is_multiple_of(64) && p + 64 <= b {
                self.words[(p / 64) as usize] = if v { !0 } else { 0 };
                p += 64;
            } else {
                self.set(p, v);
                p += 1;
            }
        }
    }

    /// Set pages among `[a, b)`.
    pub fn count(&self, a: u64, b: u64) -> u64 {
        let b = b.min(self.n_pages);
        if a >= b {
            return 0;
        }
        let (wa, wb) = ((a / 64) as usize, ((b - 1) / 64) as usize);
        let mask_lo = !0u64 << (a % 64);
        let mask_hi = !0u64 >> (63 - (b - 1) % 64);
        if wa == wb {
            return (self.words[wa] & mask_lo & mask_hi).count_ones() as u64;
        }
        let mut n = (self.words[wa] & mask_lo).count_ones() as u64 + (self.words[wb] & mask_hi).count_ones() as u64;
        for w in &self.words[wa + 1..wb] {
            n += w.count_ones() as u64;
        }
        n
    }

    pub fn total(&self) -> u64 {
        self.count(0, self.n_pages)
    }

    /// Resident bytes of the byte range `r`: every page it overlaps counts with the bytes of the
    /// overlap (a page shared by two regions counts for both, each with its part).
    pub fn resident_bytes(&self, r: &Range<u64>) -> u64 {
        if r.start >= r.end {
            return 0;
        }
        let p = self.page;
        let (p0, p1) = (r.start / p, (r.end - 1) / p);
        if p0 == p1 {
            return if self.get(p0) { r.end - r.start } else { 0 };
        }
        let mut n = 0;
        if self.get(p0) {
            n += (p0 + 1) * p - r.start;
        }
        if self.get(p1) {
            n += r.end - p1 * p;
        }
        n + self.count(p0 + 1, p1) * p
    }
}

/// A file mapped read-only for `mincore`.
pub struct MappedFile {
    pub path: PathBuf,
    pub file: File,
    pub len: u64,
    pub page: u64,
    pub trust: Trust,
    map: Option<memmap2::Mmap>,
    vec: Vec<u8>,
    /// `cachestat` works here (until it fails once).
    cachestat_ok: bool,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile").field("path", &self.path).field("len", &self.len).finish_non_exhaustive()
    }
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<MappedFile, ResidencyError> {
        let io = |what: &'static str| {
            let path = path.to_owned();
            move |source| ResidencyError::Io { path, what, source }
        };
        let file = engine::files::open_regular(path).map_err(io("opening"))?;
        let meta = file.metadata().map_err(io("stat"))?;
        let len = meta.len();
        let trust = trust(path, &meta);
        let map = if len == 0 {
            None
        } else {
            // SAFETY: read-only shared mapping that is never dereferenced here (only passed to
            // mincore), so a concurrent truncation cannot fault this process.
            Some(unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io("mapping"))?)
        };
        let cachestat_ok = cachestat(&file, 0..1).is_ok();
        Ok(MappedFile {
            path: path.to_owned(),
            file,
            len,
            page: page_size(),
            trust,
            map,
            vec: Vec::new(),
            cachestat_ok,
        })
    }

    pub fn n_pages(&self) -> u64 {
        self.len.div_ceil(self.page)
    }

    /// The residency bitmap of the whole file. Only meaningful when [`MappedFile::trust`] is
    /// `Trusted`.
    pub fn scan(&mut self, out: &mut Bitmap) -> Result<ScanStats, ResidencyError> {
        self.scan_pages(0..u64::MAX, out)
    }

    /// Scan the pages `pages` (clipped to the file) into `out`, which is reset to the file's
    /// size if it has another shape; bits outside `pages` are left as they are.
    pub fn scan_pages(&mut self, pages: Range<u64>, out: &mut Bitmap) -> Result<ScanStats, ResidencyError> {
        let n_pages = self.n_pages();
        if out.page != self.page || out.n_pages != n_pages {
            *out = Bitmap::new(self.page, n_pages);
        }
        let mut stats = ScanStats::default();
        if self.map.is_none() {
            return Ok(stats);
        }
        let mut p = pages.start.min(n_pages);
        let end = pages.end.min(n_pages);
        while p < end {
            // Chunks aligned to FILTER_PAGES, so that uniform ones are whole bitmap words.
            let n = ((p / FILTER_PAGES + 1) * FILTER_PAGES).min(end) - p;
            stats.chunks += 1;
            let cached = self.cached(p, n);
            self.settle(p, n, cached, out, &mut stats)?;
            p += n;
        }
        Ok(stats)
    }

    /// Cached pages among `p..p+n` (`None` without `cachestat`).
    fn cached(&mut self, p: u64, n: u64) -> Option<u64> {
        if !self.cachestat_ok {
            return None;
        }
        let bytes = (p * self.page)..((p + n) * self.page).min(self.len);
        let c = cachestat(&self.file, bytes).ok().map(|c| c.nr_cache);
        self.cachestat_ok = c.is_some();
        c
    }

    /// Pages `p..p+n` (of which `cached` are cached, per `cachestat`) into `out`: an empty or
    /// full range is settled; a sparsely cached one (< 1/4, at least `2·MIN_MINCORE` pages) is
    /// halved when one half turns out uniform; whatever is left goes to `mincore`.
    fn settle(
        &mut self,
        p: u64,
        n: u64,
        cached: Option<u64>,
        out: &mut Bitmap,
        stats: &mut ScanStats,
    ) -> Result<(), ResidencyError> {
        const MIN_MINCORE: u64 = 256;
        let mixed = |c: Option<u64>, n: u64| c.is_none_or(|c| c > 0 && c < n);
        match cached {
            Some(0) => {
                out.fill(p..p + n, false);
                return Ok(());
            }
            Some(c) if c >= n => {
                out.fill(p..p + n, true);
                return Ok(());
            }
            Some(c) if n >= 2 * MIN_MINCORE && c * 4 < n => {
                let half = n / 2 / 64 * 64;
                let (c1, c2) = (self.cached(p, half), self.cached(p + half, n - half));
                if !(mixed(c1, half) && mixed(c2, n - half)) {
                    self.settle(p, half, c1, out, stats)?;
                    return self.settle(p + half, n - half, c2, out, stats);
                }
            }
            _ => {}
        }
        let bytes = (p * self.page)..((p + n) * self.page).min(self.len);
        let Some(map) = &self.map else { return Ok(()) };
        self.vec.resize(n as usize, 0);
        // SAFETY: `bytes` lies inside the mapping; `vec` has one byte per page of it.
        let rc = unsafe {
            libc::mincore(
                map.as_ptr().add(bytes.start as usize) as *mut libc::c_void,
                (bytes.end - bytes.start) as usize,
                self.vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(ResidencyError::Io {
                path: self.path.clone(),
                what: "mincore",
                source: io::Error::last_os_error(),
            });
        }
        pack(&self.vec[..n as usize], p, out);
        stats.mincore_pages += n;
        Ok(())
    }

    /// Use `cachestat` to skip uniform chunks (default where the kernel has it); off: `mincore`
    /// for every page, as `fincore` does (for comparisons).
    pub fn set_cachestat_filter(&mut self, on: bool) {
        self.cachestat_ok = on && cachestat(&self.file, 0..1).is_ok();
    }
}

/// What a scan did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanStats {
    pub chunks: u64,
    /// Pages asked of `mincore` (the rest were settled by `cachestat`).
    pub mincore_pages: u64,
}

/// Store mincore's bytes (bit 0 = resident) for pages `first..` into the bitmap, a word at a time.
fn pack(bytes: &[u8], first: u64, out: &mut Bitmap) {
    if !first.is_multiple_of(64) {
        for (i, b) in bytes.iter().enumerate() {
            out.set(first + i as u64, b & 1 == 1);
        }
        return;
    }
    let w0 = (first / 64) as usize;
    for (k, chunk) in bytes.chunks(64).enumerate() {
        let mut w = 0u64;
        for (i, b) in chunk.iter().enumerate() {
            w |= u64::from(b & 1) << i;
        }
        out.words[w0 + k] = w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_counts_and_partial_pages() {
        let mut b = Bitmap::new(4096, 200);
        for p in [0u64, 1, 63, 64, 65, 130, 199] {
            b.set(p, true);
        }
        assert_eq!(b.total(), 7);
        assert_eq!(b.count(1, 64), 2);
        assert_eq!(b.count(63, 66), 3);
        assert_eq!(b.count(66, 130), 0);
        assert_eq!(b.count(130, 500), 2);
        // A range inside page 1 (resident), straddling 1→2 (2 is not), and whole pages 63..66.
        assert_eq!(b.resident_bytes(&(4096 + 10..4096 + 20)), 10);
        assert_eq!(b.resident_bytes(&(2 * 4096 - 5..2 * 4096 + 5)), 5);
        assert_eq!(b.resident_bytes(&(63 * 4096 + 100..66 * 4096)), 4096 - 100 + 2 * 4096);
        assert_eq!(b.resident_bytes(&(5..5)), 0);
    }

    #[test]
    fn pack_matches_bytes_at_any_alignment() {
        let bytes: Vec<u8> = (0..300u32).map(|i| ((i * 7 + i / 5) % 3 == 0) as u8 | 0x80).collect();
        for first in [0u64, 64, 5] {
            let mut f = Bitmap::new(4096, 400);
            f.fill(first..first + 130, true);
            assert_eq!(f.total(), 130);
            assert_eq!(f.count(first, first + 130), 130);
            f.fill(first + 1..first + 129, false);
            assert_eq!(f.total(), 2);
            let mut b = Bitmap::new(4096, 400);
            pack(&bytes, first, &mut b);
            for (i, v) in bytes.iter().enumerate() {
                assert_eq!(b.get(first + i as u64), v & 1 == 1, "page {i} at {first}");
            }
        }
    }
}
