//! Where the anonymous copy of the dense weights is: the engine's side of the dense-regions ABI.
//!
//! Under `--dense anon|locked` the dense weights live in anonymous memory ([`crate::placement`]);
//! observers learn where from the exported `moe_engine_dense_regions`.
//!
//! The ABI (the header, the entries, the seqlock, when entries appear and go) is specified in
//! [`moe_abi::dense_regions`]. What the entries are in this engine (the merged runs of dense
//! tensors, each on pages of its own, in one mapping between guard pages): [`crate::placement`].
//!
//! ## Publishing
//! Placements publish through the registry here ([`publish`], dropping the [`Publication`]),
//! which rewrites one table of all live copies under the header's seqlock. A table that was
//! replaced by a bigger one is never freed (tables grow by doubling, so the kept ones are
//! smaller than the live one), as the ABI wants.
//!
//! ## Where the symbol is defined
//! In the *binary* (`engine`'s `main.rs`), not in this library: other binaries link this library
//! too (the observer and the test fixtures, for the GGUF reader), and a `#[used]` exported object
//! here would be pulled into every one of them, together with whatever shares its object file
//! (e.g. the token markers, which the fixtures' `workload` defines itself). The binary defines it
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
//! `observer/tests/engine_abi.rs` reads what this module publishes with the observer's reader.

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use moe_abi::dense_regions::*;

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
            h.begin_update();
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
            h.end_update(self.table.as_ptr(), n);
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
    use std::sync::atomic::Ordering::SeqCst;

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
