//! Where the engine's anonymous copy of the dense weights is (version 1).
//!
//! ## Why
//! An engine that copies its dense weights out of the file into anonymous memory (the embedded
//! engine's `--dense anon|locked`) leaves an observer no way to find the copy: kernels without
//! `CONFIG_ANON_VMA_NAME` cannot label a mapping. Yet which of its pages are in RAM and which in
//! swap (zram) is what decides the cost of a token under pressure, and `/proc/PID/pagemap`
//! tells it once the addresses are known. So the engine publishes them.
//!
//! ## Spec
//! The executable exports the global data object (a published table, see the crate's rules for
//! the seqlock and the lifetime of tables)
//!
//! ```c
//! struct moe_dense_range   { uint64_t addr, len, file_offset; };   /* 24 bytes */
//! struct moe_dense_regions {                                        /* 32 bytes */
//!     uint32_t magic;     /* 0x4E45444D ("MDEN" in memory) */
//!     uint32_t version;   /* 1 */
//!     uint64_t seq;       /* seqlock */
//!     uint64_t count;     /* entries in table; 0 = no anonymous copy now */
//!     const struct moe_dense_range *table;
//! } moe_engine_dense_regions;
//! ```
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x4E45444D` |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u64 | `seq` | even when stable, odd during an update |
//! | 16 | u64 | `count` | entries of `table`, at most 2²⁰ ([`MAX_ENTRIES`]) |
//! | 24 | ptr | `table` | `count` × [`DenseRange`]: `addr` (0), `len` (8), `file_offset` (16) |
//!
//! An entry says: the engine's anonymous memory `addr..addr+len` holds a copy of the model
//! file's bytes `file_offset..file_offset+len` ([`NOT_A_FILE_COPY`]: not a copy of a file
//! range).
//! - **When.** An entry is published once its copy is complete, and removed *before* the copy is
//!   unmapped. An engine without an anonymous copy publishes nothing (`count` stays 0); an
//!   observer then measures the dense weights on the file.
//! - **Pages.** Entries never share a page (each starts on a page of its own), so the pages of
//!   the entries are the copy's pages, each counted once.
//! - Several copies (several models in one process) are published together, each with its
//!   entries.

use core::sync::atomic::{AtomicPtr, AtomicU64, Ordering::SeqCst};

use crate::{AbiError, TableHeader, assert_layout, u64_at};

/// The exported symbol's name.
pub const SYMBOL: &str = "moe_engine_dense_regions";
pub const MAGIC: u32 = 0x4E45_444D;
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 32;
pub const ENTRY_SIZE: usize = 24;
/// More entries than any engine needs (one per tensor): a reader refuses a larger `count`.
pub const MAX_ENTRIES: u64 = 1 << 20;
/// `file_offset` of an entry that is not a copy of a file range.
pub const NOT_A_FILE_COPY: u64 = u64::MAX;

/// `struct moe_dense_range`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseRange {
    pub addr: u64,
    pub len: u64,
    pub file_offset: u64,
}
assert_layout!(DenseRange, ENTRY_SIZE, align 8, { addr: 0, len: 8, file_offset: 16 });

impl DenseRange {
    /// The entry in the first [`ENTRY_SIZE`] bytes of `b` (as read from the engine's memory).
    pub fn from_bytes(b: &[u8]) -> Result<Self, AbiError> {
        crate::need("moe_dense_range", b, ENTRY_SIZE)?;
        Ok(DenseRange { addr: u64_at(b, 0), len: u64_at(b, 8), file_offset: u64_at(b, 16) })
    }
}

/// `struct moe_dense_regions`: the type of the exported header.
#[repr(C)]
#[derive(Debug)]
pub struct DenseRegions {
    pub magic: u32,
    pub version: u32,
    pub seq: AtomicU64,
    pub count: AtomicU64,
    pub table: AtomicPtr<DenseRange>,
}
assert_layout!(DenseRegions, HEADER_SIZE, align 8, { magic: 0, version: 4, seq: 8, count: 16, table: 24 });
const _: () = assert!(core::mem::offset_of!(DenseRegions, seq) as u64 == crate::SEQ_OFFSET);

impl DenseRegions {
    /// An empty header (`count` 0) with the magic and version, for the exported static.
    pub const fn new() -> Self {
        DenseRegions {
            magic: MAGIC,
            version: VERSION,
            seq: AtomicU64::new(0),
            count: AtomicU64::new(0),
            table: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Writer: an update begins (`seq` odd, `count` 0). The caller is the only writer until
    /// [`Self::end_update`].
    pub fn begin_update(&self) {
        self.seq.fetch_add(1, SeqCst);
        self.count.store(0, SeqCst);
    }

    /// Writer: publishes `count` entries at `table` and ends the update (`seq` even). The
    /// entries must stay unchanged, and the memory mapped for the life of the process, until
    /// the next update (see the crate's rules).
    pub fn end_update(&self, table: *const DenseRange, count: usize) {
        self.table.store(table.cast_mut(), SeqCst);
        self.count.store(count as u64, SeqCst);
        self.seq.fetch_add(1, SeqCst);
    }

    /// Writer: publishes `table` in one update.
    pub fn publish(&self, table: &'static [DenseRange]) {
        self.begin_update();
        self.end_update(table.as_ptr(), table.len());
    }

    /// Writer: publishes nothing (`count` 0, no table).
    pub fn clear(&self) {
        self.begin_update();
        self.end_update(core::ptr::null(), 0);
    }

    /// Reader: the header in `b` (the symbol's [`HEADER_SIZE`] bytes read from the engine's
    /// memory), checked.
    pub fn parse_header(b: &[u8]) -> Result<TableHeader, AbiError> {
        crate::need(SYMBOL, b, HEADER_SIZE)?;
        crate::check_magic(SYMBOL, b, MAGIC, VERSION)?;
        let h =
            TableHeader { seq: u64_at(b, 8), count: u64_at(b, 16), table: u64_at(b, 24), stride: ENTRY_SIZE as u64 };
        if h.count > MAX_ENTRIES {
            return Err(AbiError::TooMany { what: SYMBOL, count: h.count, max: MAX_ENTRIES });
        }
        Ok(h)
    }
}

impl Default for DenseRegions {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(h: &DenseRegions) -> [u8; HEADER_SIZE] {
        // SAFETY: a repr(C) header of HEADER_SIZE bytes without padding (asserted), read while no
        // other thread writes it.
        unsafe { core::ptr::read((h as *const DenseRegions).cast()) }
    }

    #[test]
    fn a_reader_sees_what_the_writer_published() {
        assert_eq!(&MAGIC.to_le_bytes(), b"MDEN");
        static TABLE: [DenseRange; 2] = [
            DenseRange { addr: 0x1000, len: 10, file_offset: 64 },
            DenseRange { addr: 0x3000, len: 5, file_offset: 0 },
        ];
        let h = DenseRegions::new();
        let empty = DenseRegions::parse_header(&bytes(&h)).unwrap();
        assert!(empty.stable() && empty.is_empty());
        h.publish(&TABLE);
        let p = DenseRegions::parse_header(&bytes(&h)).unwrap();
        assert_eq!((p.seq, p.count, p.table, p.table_bytes()), (2, 2, TABLE.as_ptr() as u64, 48));
        // SAFETY: TABLE is 48 bytes of plain u64 fields.
        let raw: [u8; 48] = unsafe { core::ptr::read(TABLE.as_ptr().cast()) };
        assert_eq!(DenseRange::from_bytes(&raw[24..]), Ok(TABLE[1]));
        h.begin_update();
        let mid = DenseRegions::parse_header(&bytes(&h)).unwrap();
        assert!(!mid.stable() && mid.is_empty(), "odd seq and no entries during an update");
        h.clear();
        assert!(DenseRegions::parse_header(&bytes(&h)).unwrap().is_empty());
    }

    #[test]
    fn other_bytes_are_refused() {
        let mut b = bytes(&DenseRegions::new());
        assert!(matches!(DenseRegions::parse_header(&b[..31]), Err(AbiError::Short { .. })));
        b[16..24].copy_from_slice(&(MAX_ENTRIES + 1).to_le_bytes());
        assert!(matches!(DenseRegions::parse_header(&b), Err(AbiError::TooMany { .. })));
        b[4] = 9;
        assert!(matches!(DenseRegions::parse_header(&b), Err(AbiError::Mismatch { version: 9, .. })));
    }
}
