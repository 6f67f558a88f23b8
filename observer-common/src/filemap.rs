//! Page-cache churn of one file (the model), counted per region in the kernel.
//!
//! ## Measurement rule
//! The tracepoints `filemap:mm_filemap_add_to_page_cache` and
//! `filemap:mm_filemap_delete_from_page_cache` fire once per folio that enters or leaves the page
//! cache (read-in and readahead; reclaim, `fadvise(DONTNEED)`, truncation, `drop_caches`). A folio
//! is `1 << order` pages starting at page `index` of the file (`order` is 0 on kernels whose
//! format has no `order` field). Events whose `(s_dev, i_ino)` is not the model file's are
//! dropped first; `s_dev` uses the kernel's encoding `(major << 20) | minor`.
//!
//! The file's pages are partitioned into *intervals* `[start[i], start[i + 1])` (sorted page
//! indices, `start[0] = 0`, the last interval open-ended), which user space derives from the
//! region map: a page belongs to the region that holds its middle byte. The program finds the
//! interval of the folio's first page by binary search over the fixed-size `FILEMAP_STARTS`
//! array (padded with `u64::MAX`, so the search is always [`SEARCH_STEPS`] steps), then adds
//! each interval's share of the folio to `FILEMAP_CHURN[i]`, walking at most [`MAX_SPAN`]
//! intervals; pages of a folio spread over more intervals than that are counted in the
//! `*_SPILL` totals, never dropped. So, per direction,
//! `Σ_i churn[i] + spill == pages` exactly (all counts in pages).
//!
//! The counters are cumulative, updated with atomic adds, in arrays user space maps
//! (`BPF_F_MMAPABLE`, Linux >= 5.5): a read costs no system call and each counter only grows,
//! so deltas between two reads are exact for what the reads saw.

/// Capacity of the interval arrays (a power of two: the search is `log2` of it).
pub const MAX_INTERVALS: u32 = 1 << 16;
/// Binary-search steps over `MAX_INTERVALS` entries.
pub const SEARCH_STEPS: u32 = 16;
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
}
const _: () = assert!(core::mem::size_of::<FilemapConfig>() == 48);

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
