//! The ABI between an MoE engine and an observer of it, written once. The engine lays these
//! objects out in its own memory; the observer reads them (uprobe arguments, `/proc/PID/mem`).
//! The `engine`, the `observer` (user space, and its eBPF programs through `observer-common`)
//! and the test `fixtures` all use this crate; none keeps a copy.
//!
//! | module | what it says | symbols | version |
//! |---|---|---|---|
//! | [`markers`] | where each step (the prompt, a generated token) begins and ends, and the engine's own 152-byte record of it | `moe_engine_token_begin`, `moe_engine_token_end` | 1 |
//! | [`dense_regions`] | where the engine's anonymous copy of the dense weights is | `moe_engine_dense_regions` | 1 |
//! | [`expert_slots`] | which expert the expert cache holds in which slot | `moe_engine_expert_slots` | 1, reserved: no engine writes it yet |
//!
//! ## Rules every part follows
//! - `repr(C)`, little-endian, fixed-width fields, explicit padding; every struct starts with
//!   `magic: u32, version: u32`, and a reader refuses any other magic or version. Sizes and
//!   offsets are asserted at compile time next to each spec table.
//! - Symbols are found by name in the executable's `.symtab` (or `.dynsym`): a stripped binary
//!   loses them. Functions are `extern "C"` and never inlined; data objects are global,
//!   initialised (magic and version are in the file's image) and kept although no code of the
//!   engine reads them (`#[used]`).
//! - *Not measured* is [`NOT_MEASURED`] (`u64::MAX`) in an integer field and a negative number
//!   in a float field, never 0 ([`measured`], [`measured_f64`]).
//!
//! ## Published tables: a header with a seqlock
//! [`dense_regions`] and [`expert_slots`] are a header in a data symbol that points at a table of
//! entries in the engine's memory. Every header starts
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | the table's |
//! | 4 | u32 | `version` | the table's |
//! | 8 | u64 | `seq` | even when stable; odd while the writer changes the header or the table |
//!
//! and then says how many entries the table has and where it is.
//! - **Writer** (the engine; one at a time, under its own lock): makes `seq` odd, changes the
//!   table and the header, makes `seq` even again.
//! - **Reader** (another process, through `/proc/PID/mem`): reads the header; when `seq` is odd
//!   it retries; otherwise it reads the table, then `seq` again (at [`SEQ_OFFSET`]), and retries
//!   when it changed. After a few retries it gives up with an error (a writer that never stops).
//! - **Lifetime.** Table memory that was once published is never freed while the process lives
//!   (a replaced table is kept), so a reader holding a stale pointer reads stale bytes, which the
//!   second `seq` read discards, and never unmapped memory.
#![no_std]

#[cfg(test)]
extern crate std;

// The published tables are atomics in the engine: not on targets without 32- and 64-bit atomic
// read-modify-write, such as BPF, whose programs read only the token record.
#[cfg(all(target_has_atomic = "32", target_has_atomic = "64"))]
pub mod dense_regions;
#[cfg(all(target_has_atomic = "32", target_has_atomic = "64"))]
pub mod expert_slots;
pub mod markers;

/// An integer field's *not measured*.
pub const NOT_MEASURED: u64 = u64::MAX;

/// `v`, unless it is *not measured* ([`NOT_MEASURED`]).
pub const fn measured(v: u64) -> Option<u64> {
    if v == NOT_MEASURED { None } else { Some(v) }
}

/// `v`, unless it is *not measured*: negative (or not a finite number).
pub fn measured_f64(v: f64) -> Option<f64> {
    (v >= 0.0 && v.is_finite()).then_some(v)
}

/// Offset of `seq` in every published table's header.
pub const SEQ_OFFSET: u64 = 8;

/// A published table's header as a reader saw it (magic and version checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableHeader {
    pub seq: u64,
    /// Entries in the table.
    pub count: u64,
    /// The table's address in the engine's memory.
    pub table: u64,
    /// Bytes from one entry to the next (at least the entry's size).
    pub stride: u64,
}

impl TableHeader {
    /// No update was in progress when the header was read (`seq` even).
    pub const fn stable(&self) -> bool {
        self.seq.is_multiple_of(2)
    }

    /// Nothing published (`count` 0, or no table).
    pub const fn is_empty(&self) -> bool {
        self.count == 0 || self.table == 0
    }

    /// Bytes to read for the whole table.
    pub const fn table_bytes(&self) -> u64 {
        self.count * self.stride
    }
}

/// Why bytes are not an object of this ABI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbiError {
    /// Fewer bytes than the object has.
    Short { what: &'static str, len: usize, need: usize },
    /// Another magic or version than this crate's.
    Mismatch { what: &'static str, magic: u32, version: u32, want_magic: u32, want_version: u32 },
    /// More entries than the ABI allows: not a table of this ABI, or a corrupt one.
    TooMany { what: &'static str, count: u64, max: u64 },
    /// Entries closer together than their size.
    Stride { what: &'static str, stride: u64, min: u64 },
}

impl core::fmt::Display for AbiError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            AbiError::Short { what, len, need } => write!(f, "{what}: {len} bytes, need {need}"),
            AbiError::Mismatch { what, magic, version, want_magic, want_version } => write!(
                f,
                "{what} has magic {magic:#x} version {version} (expected {want_magic:#x} version {want_version})"
            ),
            AbiError::TooMany { what, count, max } => {
                write!(f, "{what} has {count} entries (at most {max}): not this ABI, or corrupt")
            }
            AbiError::Stride { what, stride, min } => {
                write!(f, "{what} has entries {stride} bytes apart (at least {min})")
            }
        }
    }
}

/// Little-endian `u32` / `u64` at `off` of `b` (which the caller checked is long enough).
fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
#[cfg(all(target_has_atomic = "32", target_has_atomic = "64"))]
fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// `Short` unless `b` holds at least `need` bytes.
fn need(what: &'static str, b: &[u8], need: usize) -> Result<(), AbiError> {
    if b.len() < need { Err(AbiError::Short { what, len: b.len(), need }) } else { Ok(()) }
}

/// `Mismatch` unless the first 8 bytes of `b` are `magic` and `version`.
fn check_magic(what: &'static str, b: &[u8], magic: u32, version: u32) -> Result<(), AbiError> {
    let (m, v) = (u32_at(b, 0), u32_at(b, 4));
    if (m, v) == (magic, version) {
        Ok(())
    } else {
        Err(AbiError::Mismatch { what, magic: m, version: v, want_magic: magic, want_version: version })
    }
}

// The layout below is little-endian by specification.
const _: () = assert!(cfg!(target_endian = "little"), "the moe ABI is little-endian");

/// Compile-time checks that `$t` is `$size` bytes with each field at its spec table's offset.
macro_rules! assert_layout {
    ($t:ty, $size:expr, align $align:expr, { $($f:ident: $off:expr),* $(,)? }) => {
        const _: () = {
            assert!(core::mem::size_of::<$t>() == $size);
            assert!(core::mem::align_of::<$t>() == $align);
            $( assert!(core::mem::offset_of!($t, $f) == $off); )*
        };
    };
}
pub(crate) use assert_layout;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_measured_conventions() {
        assert_eq!(measured(NOT_MEASURED), None);
        assert_eq!(measured(0), Some(0), "0 is a measurement");
        assert_eq!(measured_f64(-1.0), None);
        assert_eq!(measured_f64(f64::NAN), None);
        assert_eq!(measured_f64(0.0), Some(0.0));
    }

    #[test]
    fn errors_name_what_and_why() {
        let e = AbiError::Mismatch { what: "x", magic: 1, version: 2, want_magic: 3, want_version: 1 };
        assert_eq!(std::format!("{e}"), "x has magic 0x1 version 2 (expected 0x3 version 1)");
    }
}
