//! Which expert the engine's expert cache holds where (version 1). **Reserved**: specified here
//! so that it is designed once, beside the other parts; no engine writes it yet.
//!
//! ## Why
//! An engine with an expert cache (a fixed budget of slots in anonymous memory, filled by
//! explicit reads of routed experts) serves experts from the slots instead of from the file's
//! mapping. An observer that measures only the file's page cache then misses the cache's
//! contents, and its memory can be swapped out like the dense copy's. The slot table says which
//! `(layer, expert)` each slot holds and where its memory is, so an observer can draw the
//! cache beside the page cache and measure the slots' pages from `/proc/PID/pagemap`.
//!
//! ## Spec
//! The executable exports the global data object (a published table, see the crate's rules for
//! the seqlock and the lifetime of tables)
//!
//! ```c
//! struct moe_expert_slot {          /* 40 bytes */
//!     uint32_t state;               /* 0 empty, 1 loading, 2 ready */
//!     uint32_t layer, expert;
//!     uint32_t reserved;            /* 0 */
//!     uint64_t addr, len;           /* the slot's memory */
//!     uint64_t last_use;            /* step index; UINT64_MAX: never used */
//! };
//! struct moe_expert_slots {         /* 40 bytes */
//!     uint32_t magic;               /* 0x544C534D ("MSLT" in memory) */
//!     uint32_t version;             /* 1 */
//!     uint64_t seq;                 /* seqlock */
//!     uint64_t n_slots;             /* 0 = no expert cache (yet) */
//!     uint64_t slot_size;           /* bytes from one slot to the next, >= 40 */
//!     struct moe_expert_slot *slots;
//! } moe_engine_expert_slots;
//! ```
//!
//! Header:
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x544C534D` |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u64 | `seq` | even when stable, odd during an update |
//! | 16 | u64 | `n_slots` | slots in the table, at most 2²⁰ ([`MAX_SLOTS`]); 0: no cache |
//! | 24 | u64 | `slot_size` | stride of the table, ≥ [`SLOT_SIZE`]: a later revision may append fields to a slot without a new version |
//! | 32 | ptr | `slots` | `n_slots` slots |
//!
//! Slot:
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `state` | [`STATE_EMPTY`] 0, [`STATE_LOADING`] 1 (a read into the slot is in flight), [`STATE_READY`] 2 (the slot holds the expert) |
//! | 4 | u32 | `layer` | the expert's layer: `N` of `blk.N.ffn_{gate,up,down}_exps` (loading, ready) |
//! | 8 | u32 | `expert` | the expert's index along those tensors' expert dimension (loading, ready) |
//! | 12 | u32 | `reserved` | 0 |
//! | 16 | u64 | `addr` | the slot's memory in the engine: `len` bytes of anonymous memory at `addr` |
//! | 24 | u64 | `len` | |
//! | 32 | u64 | `last_use` | the index (as passed to the token markers) of the last step that used the slot's expert; `u64::MAX`: never used |
//!
//! - **The table** is published when the cache is created, with every slot and its memory
//!   (`addr`, `len` never change while the table is published), and cleared (`n_slots` 0)
//!   before the slots' memory is freed.
//! - **`state`, `layer`, `expert`** change only inside an update of the seqlock: a reader's
//!   consistent snapshot never shows a slot half-way from one expert to another. A ready slot's
//!   bytes are the expert's slices of the three tensors, in an order (and with padding) of the
//!   engine's choosing; the file ranges of an expert follow from the model's tensor table.
//! - **`last_use`** is written with a single aligned 8-byte store *outside* the seqlock: it
//!   changes every step for every expert used, and bumping `seq` for it would keep readers
//!   retrying. A snapshot may therefore hold `last_use` values a step newer than the rest.

use core::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering::SeqCst};

use crate::{AbiError, NOT_MEASURED, TableHeader, assert_layout, u32_at, u64_at};

/// The exported symbol's name.
pub const SYMBOL: &str = "moe_engine_expert_slots";
pub const MAGIC: u32 = 0x544C_534D;
pub const VERSION: u32 = 1;
pub const HEADER_SIZE: usize = 40;
/// Bytes of a version-1 slot (the least `slot_size`).
pub const SLOT_SIZE: usize = 40;
/// More slots than any cache has: a reader refuses a larger `n_slots`.
pub const MAX_SLOTS: u64 = 1 << 20;

/// Slot states ([`ExpertSlot::state`]).
pub const STATE_EMPTY: u32 = 0;
pub const STATE_LOADING: u32 = 1;
pub const STATE_READY: u32 = 2;

/// `struct moe_expert_slot`, as the engine keeps it (its fields change in place).
#[repr(C)]
#[derive(Debug)]
pub struct ExpertSlot {
    pub state: AtomicU32,
    pub layer: AtomicU32,
    pub expert: AtomicU32,
    pub reserved: u32,
    pub addr: AtomicU64,
    pub len: AtomicU64,
    pub last_use: AtomicU64,
}
assert_layout!(ExpertSlot, SLOT_SIZE, align 8, {
    state: 0, layer: 4, expert: 8, reserved: 12, addr: 16, len: 24, last_use: 32,
});

impl ExpertSlot {
    /// An empty slot over `len` bytes at `addr`, never used.
    pub const fn new(addr: u64, len: u64) -> Self {
        ExpertSlot {
            state: AtomicU32::new(STATE_EMPTY),
            layer: AtomicU32::new(0),
            expert: AtomicU32::new(0),
            reserved: 0,
            addr: AtomicU64::new(addr),
            len: AtomicU64::new(len),
            last_use: AtomicU64::new(NOT_MEASURED),
        }
    }
}

/// A slot as a reader saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotView {
    pub state: u32,
    pub layer: u32,
    pub expert: u32,
    pub addr: u64,
    pub len: u64,
    /// `None`: never used.
    pub last_use: Option<u64>,
}

impl SlotView {
    /// The slot in the first [`SLOT_SIZE`] bytes of `b` (one stride of the table as read from
    /// the engine's memory).
    pub fn from_bytes(b: &[u8]) -> Result<Self, AbiError> {
        crate::need("moe_expert_slot", b, SLOT_SIZE)?;
        Ok(SlotView {
            state: u32_at(b, 0),
            layer: u32_at(b, 4),
            expert: u32_at(b, 8),
            addr: u64_at(b, 16),
            len: u64_at(b, 24),
            last_use: crate::measured(u64_at(b, 32)),
        })
    }
}

/// `struct moe_expert_slots`: the type of the exported header.
#[repr(C)]
#[derive(Debug)]
pub struct ExpertSlots {
    pub magic: u32,
    pub version: u32,
    pub seq: AtomicU64,
    pub n_slots: AtomicU64,
    pub slot_size: AtomicU64,
    pub slots: AtomicPtr<ExpertSlot>,
}
assert_layout!(ExpertSlots, HEADER_SIZE, align 8, {
    magic: 0, version: 4, seq: 8, n_slots: 16, slot_size: 24, slots: 32,
});
const _: () = assert!(core::mem::offset_of!(ExpertSlots, seq) as u64 == crate::SEQ_OFFSET);

impl ExpertSlots {
    /// An empty header (no cache) with the magic and version, for the exported static.
    pub const fn new() -> Self {
        ExpertSlots {
            magic: MAGIC,
            version: VERSION,
            seq: AtomicU64::new(0),
            n_slots: AtomicU64::new(0),
            slot_size: AtomicU64::new(SLOT_SIZE as u64),
            slots: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Writer: an update begins (`seq` odd). The caller is the only writer until
    /// [`Self::end_update`]; between the two it may change slots' `state`, `layer`, `expert`.
    pub fn begin_update(&self) {
        self.seq.fetch_add(1, SeqCst);
    }

    /// Writer: the update ends (`seq` even).
    pub fn end_update(&self) {
        self.seq.fetch_add(1, SeqCst);
    }

    /// Writer: publishes `slots` as the cache's table (or, empty, clears it) in one update. The
    /// slots must stay mapped for the life of the process (see the crate's rules).
    pub fn publish(&self, slots: &'static [ExpertSlot]) {
        self.begin_update();
        self.slots.store(slots.as_ptr().cast_mut(), SeqCst);
        self.n_slots.store(slots.len() as u64, SeqCst);
        self.end_update();
    }

    /// Reader: the header in `b` (the symbol's [`HEADER_SIZE`] bytes read from the engine's
    /// memory), checked.
    pub fn parse_header(b: &[u8]) -> Result<TableHeader, AbiError> {
        crate::need(SYMBOL, b, HEADER_SIZE)?;
        crate::check_magic(SYMBOL, b, MAGIC, VERSION)?;
        let h = TableHeader { seq: u64_at(b, 8), count: u64_at(b, 16), stride: u64_at(b, 24), table: u64_at(b, 32) };
        if h.count > MAX_SLOTS {
            return Err(AbiError::TooMany { what: SYMBOL, count: h.count, max: MAX_SLOTS });
        }
        if h.stride < SLOT_SIZE as u64 {
            return Err(AbiError::Stride { what: SYMBOL, stride: h.stride, min: SLOT_SIZE as u64 });
        }
        Ok(h)
    }
}

impl Default for ExpertSlots {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` bytes at `p` (a repr(C) object without padding that no other thread writes now).
    fn bytes<const N: usize, T>(p: &T) -> [u8; N] {
        assert_eq!(core::mem::size_of::<T>(), N);
        // SAFETY: `p` is N initialised bytes (checked above; the types here have no padding).
        unsafe { core::ptr::read((p as *const T).cast()) }
    }

    #[test]
    fn a_reader_sees_the_slots_the_writer_published() {
        assert_eq!(&MAGIC.to_le_bytes(), b"MSLT");
        static SLOTS: [ExpertSlot; 2] = [ExpertSlot::new(0x10_0000, 4096), ExpertSlot::new(0x20_0000, 4096)];
        let h = ExpertSlots::new();
        let none = ExpertSlots::parse_header(&bytes::<HEADER_SIZE, _>(&h)).unwrap();
        assert!(none.stable() && none.is_empty() && none.stride == SLOT_SIZE as u64);
        h.publish(&SLOTS);
        h.begin_update();
        SLOTS[1].layer.store(3, SeqCst);
        SLOTS[1].expert.store(17, SeqCst);
        SLOTS[1].state.store(STATE_READY, SeqCst);
        assert!(!ExpertSlots::parse_header(&bytes::<HEADER_SIZE, _>(&h)).unwrap().stable());
        h.end_update();
        SLOTS[1].last_use.store(42, SeqCst);
        let p = ExpertSlots::parse_header(&bytes::<HEADER_SIZE, _>(&h)).unwrap();
        assert_eq!((p.seq, p.count, p.table, p.table_bytes()), (4, 2, SLOTS.as_ptr() as u64, 80));
        let s = SlotView::from_bytes(&bytes::<SLOT_SIZE, _>(&SLOTS[1])).unwrap();
        let want =
            SlotView { state: STATE_READY, layer: 3, expert: 17, addr: 0x20_0000, len: 4096, last_use: Some(42) };
        assert_eq!(s, want);
        let e = SlotView::from_bytes(&bytes::<SLOT_SIZE, _>(&SLOTS[0])).unwrap();
        assert_eq!((e.state, e.last_use), (STATE_EMPTY, None));
    }

    #[test]
    fn other_bytes_are_refused() {
        let mut b = bytes::<HEADER_SIZE, _>(&ExpertSlots::new());
        b[24..32].copy_from_slice(&8u64.to_le_bytes());
        assert!(matches!(ExpertSlots::parse_header(&b), Err(AbiError::Stride { stride: 8, .. })));
        b[16..24].copy_from_slice(&(MAX_SLOTS + 1).to_le_bytes());
        assert!(matches!(ExpertSlots::parse_header(&b), Err(AbiError::TooMany { .. })));
        b[0] = 0;
        assert!(matches!(ExpertSlots::parse_header(&b), Err(AbiError::Mismatch { .. })));
    }
}
