//! The expert cache's slot table for observers: the engine's side of `moe_engine_expert_slots`.
//!
//! The ABI (header, 40-byte slots, seqlock, lifetime) is specified in
//! [`moe_abi::expert_slots`]. In this engine:
//! - one slot per cache slot, `addr`/`len` = the slot's memory (a page-aligned part of the cache's
//!   one anonymous mapping); a ready slot holds the expert's three parts, each at its
//!   [`super::io::ALIGN`]ed file window (layout in [`super`]).
//! - `state`, `layer`, `expert` change under the header's seqlock, from the decode thread
//!   (a slot taken for an expert: `loading`) and from the I/O worker that completes the slot's
//!   last read (`ready`, or `empty` when the read failed); `last_use` is the marker index of
//!   the last step that used the slot, written outside the seqlock.
//! - the `state` word of a slot is also the futex the decode thread waits on for that slot
//!   ([`super::io`]), so an observer can map a `futex(FUTEX_WAIT_PRIVATE)` address to the slot.
//!
//! Like `moe_engine_dense_regions`, the symbol is defined in the binary (`main.rs`) and handed to
//! [`export`]; a cache publishes its table when it is created and clears it when it is dropped
//! (before its memory is unmapped). Tables are leaked: the ABI wants published table memory to
//! stay mapped for the life of the process.

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use moe_abi::expert_slots::*;

struct Registry {
    exported: Option<&'static ExpertSlots>,
    /// The table published now (its first slot's address), if any.
    live: Option<usize>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { exported: None, live: None });

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes `header` (the binary's exported `moe_engine_expert_slots`) the object caches publish to.
pub fn export(header: &'static ExpertSlots) {
    let mut reg = registry();
    if let Some(old) = reg.exported.replace(header)
        && !std::ptr::eq(old, header)
    {
        old.publish(&[]);
    }
}

/// One cache's table, published until dropped. Updates of its slots go through
/// [`Table::update`], which holds the writer lock and the seqlock of the header when the table is
/// the published one.
#[derive(Debug)]
pub struct Table {
    pub slots: &'static [ExpertSlot],
}

impl Table {
    /// Leaks `slots` (see the module docs) and publishes them when no other cache's table is.
    pub fn publish(slots: Vec<ExpertSlot>) -> Table {
        let slots: &'static [ExpertSlot] = Box::leak(slots.into_boxed_slice());
        let mut reg = registry();
        if reg.live.is_none() {
            reg.live = Some(slots.as_ptr() as usize);
            if let Some(h) = reg.exported {
                h.publish(slots);
            }
        }
        Table { slots }
    }

    /// Whether this table is the one in the exported header.
    pub fn is_published(&self) -> bool {
        let reg = registry();
        reg.exported.is_some() && reg.live == Some(self.slots.as_ptr() as usize)
    }

    /// Runs `f` as one update of the table (one writer at a time; inside the seqlock when the
    /// table is published).
    pub fn update<R>(&self, f: impl FnOnce(&[ExpertSlot]) -> R) -> R {
        let reg = registry();
        let header = reg.exported.filter(|_| reg.live == Some(self.slots.as_ptr() as usize));
        if let Some(h) = header {
            h.begin_update();
        }
        let r = f(self.slots);
        if let Some(h) = header {
            h.end_update();
        }
        r
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let mut reg = registry();
        if reg.live == Some(self.slots.as_ptr() as usize) {
            reg.live = None;
            if let Some(h) = reg.exported {
                h.publish(&[]);
            }
        }
    }
}
