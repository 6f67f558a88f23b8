//! Where the anonymous copy of the dense weights is: the engine's side of the observer's
//! dense-regions ABI (version 1).
//!
//! ## Why
//! Under `--dense anon|locked` the dense weights live in anonymous memory ([`crate::placement`]).
//! An observer measures which of their pages are in RAM and which are in swap (zram) from
//! `/proc/PID/pagemap`, but it has to know where they are, and kernels without
//! `CONFIG_ANON_VMA_NAME` cannot label a mapping. So the engine publishes the copy's address
//! ranges in one exported data symbol.
//!
//! ## Spec
//! The `engine` binary exports (`.symtab`, a global data object) the object
//!
//! ```c
//! struct moe_dense_range   { uint64_t addr, len, file_offset; };   /* 24 bytes */
//! struct moe_dense_regions {                                        /* 32 bytes */
//!     uint32_t magic;     /* 0x4E45444D ("MDEN" in memory) */
//!     uint32_t version;   /* 1 */
//!     uint64_t seq;       /* seqlock: odd while count/table/entries change */
//!     uint64_t count;     /* entries in table; 0 = no anonymous copy now */
//!     const struct moe_dense_range *table;
//! } moe_engine_dense_regions;
//! ```
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x4E45444D` |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u64 | `seq` | even when stable; incremented before and after every update |
//! | 16 | u64 | `count` | entries of `table` |
//! | 24 | ptr | `table` | `count` × [`DenseRange`] (24 bytes: `addr`, `len`, `file_offset`) |
//!
//! An entry says: the engine's anonymous memory `addr..addr+len` holds a copy of the model file's
//! bytes `file_offset..file_offset+len` (`u64::MAX`: not a copy of a file range).
//!
//! - **When.** An entry is published once its copy is complete (after the `mlock` of `locked`),
//!   and removed (`count` back to 0 when it was the only copy) *before* the copy is unmapped. With
//!   `--dense mmap` nothing is ever published: `count` stays 0 and an observer measures the dense
//!   weights on the file.
//! - **Entries** are the merged runs of dense tensors in the file (one run = adjacent dense
//!   tensors, typically one per layer plus embeddings and output). The copy keeps each run at
//!   the same offset within a page as in the file and starts every run on a page of its own, so
//!   no page belongs to two entries and the entries' pages are exactly the copy's pages.
//! - **The copy's mapping** has a `PROT_NONE` guard page on each side, so it is a VMA of its own
//!   in `/proc/PID/maps` and `smaps` (it cannot merge with neighbouring anonymous memory).
//! - **Reading.** A reader (another process, through `/proc/PID/mem`) reads `seq`; if it is odd
//!   it retries; otherwise it reads `count`, `table` and the entries, then `seq` again, and
//!   retries when it changed. The writer makes `seq` odd, rewrites the table, stores
//!   `table`/`count` and makes `seq` even again, all under one lock. A table that was replaced
//!   is never freed (it is kept, and tables grow by doubling, so the kept ones are smaller than
//!   the live one): a reader that still holds the old pointer never reads unmapped memory.
//! - Several copies (several models loaded by one process, e.g. a test binary) are published
//!   together, each with its runs.
//!
//! ## Where the symbol is defined
//! In the *binary* (`engine`'s `main.rs`), not in this library: the observer's binaries link
//! this library too (for the GGUF reader), and a `#[used]` exported object here would be pulled
//! into every one of them, together with whatever shares its object file (e.g. the token
//! markers, which the observer's stand-in workloads define themselves). The binary defines it
//! with [`DenseRegions::new`] and hands it to [`export`] before loading a model; placements
//! publish through the registry here, which writes to the exported object when there is one:
//!
//! ```
//! use engine::dense_regions::{DenseRegions, export};
//!
//! #[unsafe(no_mangle)]
//! #[used]
//! pub static moe_engine_dense_regions: DenseRegions = DenseRegions::new();
//!
//! fn main() {
//!     export(&moe_engine_dense_regions);
//!     // … then load the model: `Placement` publishes its copy …
//! }
//! ```
//!
//! The observer has its own definition of these types (`observer::residency::anon`); the engine
//! does not depend on the observer, and a test in the observer crate checks that both have the
//! same sizes and field offsets, and reads what this module publishes.

use std::sync::{
    Mutex, MutexGuard, PoisonError,
    atomic::{AtomicPtr, AtomicU64, Ordering::SeqCst},
};

/// The exported symbol's name.
pub const SYMBOL: &str = "moe_engine_dense_regions";
pub const MAGIC: u32 = 0x4E45_444D;
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 32;
pub const ENTRY_SIZE: usize = 24;
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
const _: () = assert!(std::mem::size_of::<DenseRange>() == ENTRY_SIZE);

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
const _: () = assert!(std::mem::size_of::<DenseRegions>() == HEADER_SIZE);
const _: () = assert!(std::mem::align_of::<DenseRegions>() == 8);

impl DenseRegions {
    /// An empty header (`count` 0) with the magic and version, for the exported static.
    pub const fn new() -> Self {
        DenseRegions {
            magic: MAGIC,
            version: VERSION,
            seq: AtomicU64::new(0),
            count: AtomicU64::new(0),
            table: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Empties the header (for a header that is no longer the exported one).
    fn clear(&self) {
        self.seq.fetch_add(1, SeqCst);
        self.count.store(0, SeqCst);
        self.table.store(std::ptr::null_mut(), SeqCst);
        self.seq.fetch_add(1, SeqCst);
    }
}

impl Default for DenseRegions {
    fn default() -> Self {
        Self::new()
    }
}

/// The live publications and the table storage behind the exported header.
struct Registry {
    exported: Option<&'static DenseRegions>,
    next_id: u64,
    live: Vec<(u64, Vec<DenseRange>)>,
    /// The published table (its heap buffer is what `table` points to).
    table: Vec<DenseRange>,
    /// Tables that were replaced by bigger ones: kept, never freed (see the module docs).
    retired: Vec<Vec<DenseRange>>,
}

static REGISTRY: Mutex<Registry> =
    Mutex::new(Registry { exported: None, next_id: 0, live: Vec::new(), table: Vec::new(), retired: Vec::new() });

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Registry {
    /// Rewrites the table from `live` and publishes it under the seqlock of the exported header.
    fn republish(&mut self) {
        let n: usize = self.live.iter().map(|(_, v)| v.len()).sum();
        let header = self.exported;
        if let Some(h) = header {
            h.seq.fetch_add(1, SeqCst); // odd: changing
            h.count.store(0, SeqCst);
        }
        if n > self.table.capacity() {
            let bigger = Vec::with_capacity(n.next_power_of_two().max(16));
            self.retired.push(std::mem::replace(&mut self.table, bigger));
        }
        self.table.clear();
        for (_, v) in &self.live {
            self.table.extend_from_slice(v);
        }
        if let Some(h) = header {
            h.table.store(self.table.as_mut_ptr(), SeqCst);
            h.count.store(n as u64, SeqCst);
            h.seq.fetch_add(1, SeqCst); // even: stable
        }
    }
}

/// Makes `header` (the binary's exported `moe_engine_dense_regions`) the object publications
/// are written to, and writes the current ones to it. Call it once, before loading a model; a
/// later call with another header moves publishing there and empties the previous one.
pub fn export(header: &'static DenseRegions) {
    let mut reg = registry();
    if let Some(old) = reg.exported.replace(header)
        && !std::ptr::eq(old, header)
    {
        old.clear();
    }
    reg.republish();
}

/// The entries published now (this process's own view, for tests and diagnostics), whether or
/// not a header is exported.
pub fn published() -> Vec<DenseRange> {
    registry().table.clone()
}

/// One published copy; dropping it removes its entries (do so before the copy is freed).
#[derive(Debug)]
#[must_use = "dropping the publication unpublishes the ranges at once"]
pub struct Publication {
    id: u64,
}

/// Publishes `ranges` (the runs of one anonymous copy) until the returned [`Publication`] is
/// dropped.
pub fn publish(ranges: Vec<DenseRange>) -> Publication {
    let mut reg = registry();
    let id = reg.next_id;
    reg.next_id += 1;
    reg.live.push((id, ranges));
    reg.republish();
    Publication { id }
}

impl Drop for Publication {
    fn drop(&mut self) {
        let mut reg = registry();
        reg.live.retain(|(id, _)| *id != self.id);
        reg.republish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layout_matches_the_spec_table() {
        assert_eq!(offset_of!(DenseRegions, magic), 0);
        assert_eq!(offset_of!(DenseRegions, version), 4);
        assert_eq!(offset_of!(DenseRegions, seq), 8);
        assert_eq!(offset_of!(DenseRegions, count), 16);
        assert_eq!(offset_of!(DenseRegions, table), 24);
        assert_eq!((offset_of!(DenseRange, addr), offset_of!(DenseRange, len)), (0, 8));
        assert_eq!(offset_of!(DenseRange, file_offset), 16);
        // The magic reads "MDEN" from memory (little-endian).
        assert_eq!(&MAGIC.to_le_bytes(), b"MDEN");
    }

    /// The header of this test binary (the engine binary defines its own in `main.rs`).
    static HEADER: DenseRegions = DenseRegions::new();

    #[test]
    fn publications_are_listed_while_alive_and_the_seqlock_ends_even() {
        export(&HEADER);
        let in_header = || -> Vec<DenseRange> {
            let _reg = registry(); // no update while we read
            assert_eq!(HEADER.seq.load(SeqCst) % 2, 0, "seq is even when stable");
            let (n, t) = (HEADER.count.load(SeqCst) as usize, HEADER.table.load(SeqCst));
            if n == 0 {
                return Vec::new();
            }
            // SAFETY: the registry's table holds `n` entries while its lock is held.
            unsafe { std::slice::from_raw_parts(t, n) }.to_vec()
        };
        let mine = |addr| DenseRange { addr, len: 4096, file_offset: addr / 2 };
        // Other tests of this binary may publish copies meanwhile: look for ours only.
        let a = publish(vec![mine(0x1000_0000), mine(0x1000_2000)]);
        // Enough entries to replace the table by a bigger one.
        let b = publish((0..40).map(|i| mine(0x2000_0000 + i * 0x1000)).collect());
        let has = |addr| in_header().iter().any(|d| d.addr == addr);
        assert!(has(0x1000_0000) && has(0x1000_2000) && has(0x2000_0000 + 39 * 0x1000));
        assert_eq!(in_header(), published());
        drop(a);
        assert!(!has(0x1000_0000) && !has(0x1000_2000), "dropped entries are unpublished");
        assert!(has(0x2000_0000));
        drop(b);
        assert!(!has(0x2000_0000));
        assert_eq!((HEADER.magic, HEADER.version), (MAGIC, VERSION));
    }
}
