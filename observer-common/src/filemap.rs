//! Page-cache churn of one file (the model), counted per region in the kernel.
//!
//! ## Measurement rule
//! The tracepoints `filemap:mm_filemap_add_to_page_cache` and
//! `filemap:mm_filemap_delete_from_page_cache` fire once per folio that enters or leaves the page
//! cache (read-in and readahead; reclaim, `fadvise(DONTNEED)`, truncation, `drop_caches`). A folio
//! is `1 << order` pages starting at page `index` of the file (`order` is 0 on kernels whose
//! format has no `order` field). Events whose `(s_dev, i_ino)` is not the model file's are
//! dropped first; `s_dev` uses the kernel's encoding `(major << 20) | minor`. The fields are read
//! at the offsets of the events' format files: with plain loads when both formats put them where
//! [`DIRECT_FIELDS`] says, else through `bpf_probe_read`.
//!
//! The file's pages are partitioned into *intervals* `[start[i], start[i + 1])` (sorted page
//! indices, `start[0] = 0`, the last interval open-ended), which user space derives from the
//! region map: a page belongs to the region that holds its middle byte. The program finds the
//! interval of the folio's first page in the fixed-size `FILEMAP_STARTS` array (padded with
//! `u64::MAX`) through the bucket index (below), then adds
//! each interval's share of the folio to `FILEMAP_CHURN[i]`, walking at most [`MAX_SPAN`]
//! intervals; pages of a folio spread over more intervals than that are counted in the
//! `*_SPILL` totals, never dropped. So, per direction,
//! `Σ_i churn[i] + spill == pages` exactly (all counts in pages).
//!
//! The counters are cumulative, updated with atomic adds, in arrays user space maps
//! (`BPF_F_MMAPABLE`, Linux >= 5.5): a read costs no system call and each counter only grows,
//! so deltas between two reads are exact for what the reads saw.
//!
//! ## Finding a page's interval: the bucket index
//! The interval of page `p` is the last `i` with `start[i] <= p` (`FILEMAP_STARTS`).
//! A binary search over all of them costs one dependent load per step, each of them mispredicted
//! half the time on random pages (a read storm's, a random fault's). Every program that needs a
//! page's interval (churn's folio, a refault, an explicit read: `xread`) first reads
//! `FILEMAP_INDEX`, built once by user space ([`IntervalIndex`]) before the programs are enabled:
//! - the pages are cut into buckets of `2^shift` pages, the fewest that give at most
//!   [`MAX_BUCKETS`] buckets (or fewer, when a test asks: `IntervalIndex::build`'s `most`); entry
//!   `b` is the interval of bucket `b`'s first page. A small index stays in the cache between
//!   reads: with 65 536 entries its misses cost more than the steps they saved;
//! - a page's interval is then one of the `span` intervals from that entry on (`span`, a power of
//!   two, covers the most intervals any bucket touches: one for a file whose intervals start only
//!   on bucket boundaries), found by `log2(span)` steps of a binary search that add `step` to the
//!   position when `start[pos + step] <= p`, computed without a jump;
//! - a page past the last bucket uses the last bucket; when the intervals are too many for
//!   `pos + span` to stay inside `FILEMAP_STARTS`, the index is one bucket (entry 0) and `span`
//!   [`MAX_INTERVALS`]: the whole search.

/// Capacity of the interval arrays (a power of two: the search is `log2` of it).
pub const MAX_INTERVALS: u32 = 1 << 16;
/// Binary-search steps over `MAX_INTERVALS` entries.
pub const SEARCH_STEPS: u32 = 16;
const _: () = assert!(MAX_INTERVALS == 1 << SEARCH_STEPS);
/// Intervals one folio's pages are walked over before the rest counts as spill.
pub const MAX_SPAN: u32 = 64;
/// `FilemapConfig` offset value meaning "this kernel's format has no such field".
pub const NO_FIELD: u32 = u32::MAX;

/// Indices of the `FILEMAP_TOTALS` array.
pub const T_ADD_EVENTS: u32 = 0;
pub const T_ADD_PAGES: u32 = 1;
pub const T_DEL_EVENTS: u32 = 2;
pub const T_DEL_PAGES: u32 = 3;
/// Pages of added folios that spanned more than `MAX_SPAN` intervals beyond the first ones.
pub const T_ADD_SPILL: u32 = 4;
pub const T_DEL_SPILL: u32 = 5;
/// Events on the model's inode number but another device: the file system's `s_dev` differs
/// from `stat`'s `st_dev` (btrfs subvolumes, overlayfs); churn is then not measured.
pub const T_OTHER_DEV: u32 = 6;
/// The last such `s_dev` seen.
pub const T_OTHER_DEV_LAST: u32 = 7;
pub const N_TOTALS: u32 = 8;

/// Tracepoint field offsets of one of the two events (same event class, read separately).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilemapFields {
    pub ino: u32,
    pub dev: u32,
    pub index: u32,
    /// `NO_FIELD` on kernels without `order`.
    pub order: u32,
}
const _: () = assert!(core::mem::size_of::<FilemapFields>() == 16);

/// Filter and field offsets, index 0 of `FILEMAP_CONFIG`; `enabled == 0` turns the programs off.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilemapConfig {
    pub ino: u64,
    /// Kernel `dev_t` encoding: `(major << 20) | minor`.
    pub dev: u32,
    pub enabled: u32,
    pub add: FilemapFields,
    pub del: FilemapFields,
    /// log2 of the pages in a bucket of `FILEMAP_INDEX` ("Finding a page's interval").
    pub index_shift: u32,
    /// How many intervals from a bucket's entry on a page's can be (a power of two, at most
    /// [`MAX_INTERVALS`]).
    pub index_span: u32,
    /// 1: both events' fields are at [`DIRECT_FIELDS`], read with plain loads of the record;
    /// 0: read through `bpf_probe_read` at `add`'s and `del`'s offsets.
    pub direct: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<FilemapConfig>() == 64);

/// Where both events keep their fields on the development VM's kernel (6.18; the format files
/// decide, per kernel). A program's context is the event's record, so a field at an offset known when the
/// program is compiled is one load; the verifier refuses a load at an offset from a map (the
/// format's), which then takes a `bpf_probe_read` call.
pub const DIRECT_FIELDS: FilemapFields = FilemapFields { ino: 16, dev: 32, index: 24, order: 36 };

/// Cumulative pages of one interval, a value of `FILEMAP_CHURN`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Churn {
    pub added: u64,
    pub evicted: u64,
}
const _: () = assert!(core::mem::size_of::<Churn>() == 16);

/// Per-CPU scratch of the programs: the search position and the walk (kept in a map so that
/// the verifier sees unknown scalars, not one precise value per path).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FilemapScratch {
    pub lo: u64,
    pub cur: u64,
}
const _: () = assert!(core::mem::size_of::<FilemapScratch>() == 16);

/// The kernel's `dev_t` encoding of a user-space `(major, minor)`.
pub const fn kernel_dev(major: u32, minor: u32) -> u32 {
    (major << 20) | (minor & ((1 << 20) - 1))
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), only integer fields, no padding (size assertions above).
    unsafe impl aya::Pod for super::FilemapConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FilemapFields {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Churn {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FilemapScratch {}
}

/// Entries of `FILEMAP_INDEX`, one `u16` interval number each ([`MAX_INTERVALS`] of them fit).
pub const MAX_BUCKETS: u32 = 1 << 12;
const _: () = assert!(MAX_INTERVALS <= 1 << 16);

/// `FILEMAP_INDEX` and its two numbers ("Finding a page's interval").
#[cfg(feature = "user")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntervalIndex {
    pub shift: u32,
    pub span: u32,
    /// Per bucket, the interval of its first page.
    pub first: std::vec::Vec<u16>,
}

#[cfg(feature = "user")]
impl IntervalIndex {
    /// The index of intervals starting at pages `starts` (ascending) of a file of `pages` pages,
    /// in at most `most` buckets (at least 1, at most [`MAX_BUCKETS`]).
    pub fn build(starts: &[u64], pages: u64, most: u32) -> IntervalIndex {
        use std::vec::Vec;
        let most = most.clamp(1, MAX_BUCKETS) as u64;
        let of = |p: u64| starts.partition_point(|&s| s <= p).saturating_sub(1);
        let shift = (0..63).find(|&g| pages.div_ceil(1 << g) <= most).unwrap_or(63);
        let buckets = pages.div_ceil(1 << shift).max(1);
        let first: Vec<usize> = (0..buckets).map(|b| of(b << shift)).collect();
        let touched =
            (0..buckets as usize).map(|b| of(((b as u64 + 1) << shift) - 1) - first[b] + 1).max().unwrap_or(1);
        let span = touched.next_power_of_two() as u32;
        if starts.len() + span as usize > MAX_INTERVALS as usize + 1 {
            return IntervalIndex { shift: 63, span: MAX_INTERVALS, first: std::vec![0] };
        }
        IntervalIndex { shift, span, first: first.into_iter().map(|i| i as u16).collect() }
    }

    /// The interval of page `page`, found as the kernel finds it (the unit tests hold it to a
    /// linear scan; the kernel's is held to the engine's own log by `observer/tests/engine.rs` and
    /// `observer/tests/residency.rs`).
    pub fn find(&self, starts: &[u64], page: u64) -> u32 {
        let b = ((page >> self.shift) as usize).min(self.first.len() - 1);
        let mut pos = self.first[b] as u32;
        let mut step = MAX_INTERVALS / 2;
        while step > 0 {
            if step < self.span && starts.get((pos + step) as usize).is_some_and(|&s| s <= page) {
                pos += step;
            }
            step /= 2;
        }
        pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// The last interval starting at or before `page` (0 when none), by a linear scan.
    fn linear(starts: &[u64], page: u64) -> u32 {
        starts.iter().rposition(|&s| s <= page).unwrap_or(0) as u32
    }

    fn check(starts: &[u64], pages: u64) -> IntervalIndex {
        let ix = IntervalIndex::build(starts, pages, MAX_BUCKETS);
        assert!(ix.span.is_power_of_two() && ix.span <= MAX_INTERVALS, "span {}", ix.span);
        assert!(ix.first.len() <= MAX_BUCKETS as usize);
        for page in (0..pages + 3).chain([u64::MAX >> 12, 1 << 40]) {
            assert_eq!(
                ix.find(starts, page),
                linear(starts, page),
                "page {page} of {pages}, shift {} span {}",
                ix.shift,
                ix.span
            );
        }
        ix
    }

    /// A small-step generator, so that the cases are the same on every run.
    fn lcg(x: &mut u64) -> u64 {
        *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *x >> 33
    }

    #[test]
    fn the_index_finds_what_a_linear_scan_finds() {
        // Intervals only on page boundaries of a small file: one step at most per bucket.
        let ix = check(&[0, 3, 4, 10, 11, 12, 40], 64);
        assert_eq!((ix.shift, ix.span), (0, 1));
        // Intervals sharing a first page: the last of them is the page's.
        check(&[0, 5, 5, 5, 9], 20);
        // No intervals, one interval, a file of no pages (intervals start inside the file).
        check(&[], 10);
        check(&[0], 10);
        check(&[0], 0);
        // Random layouts, small and large files (buckets of many pages, several intervals each).
        let mut x = 7;
        for case in 0..200 {
            let pages = 1 + lcg(&mut x) % if case % 2 == 0 { 5000 } else { 3_000_000 };
            let n = 1 + lcg(&mut x) % 300;
            let mut starts: Vec<u64> = (0..n).map(|_| lcg(&mut x) % pages).collect();
            starts.push(0);
            starts.sort_unstable();
            let most = [MAX_BUCKETS, 1, 64][case % 3];
            let ix = IntervalIndex::build(&starts, pages, most);
            assert!(ix.first.len() <= most as usize, "{} buckets, at most {most}", ix.first.len());
            for _ in 0..2000 {
                let page = lcg(&mut x) % (pages + 10);
                assert_eq!(
                    ix.find(&starts, page),
                    linear(&starts, page),
                    "case {case}: page {page} of {pages}, shift {} span {}",
                    ix.shift,
                    ix.span
                );
            }
        }
    }

    #[test]
    fn too_many_intervals_for_the_span_search_the_whole_array() {
        // 65 000 intervals, one bucket of them touching 1024: 65 000 + 1024 > 65 537.
        let mut starts: Vec<u64> = (0..64_000u64).map(|i| i * 4).collect();
        starts.extend((0..1000u64).map(|i| 256_000 + i / 100));
        let ix = check(&starts, 300_000);
        assert_eq!((ix.shift, ix.span, ix.first.len()), (63, MAX_INTERVALS, 1));
    }
}
