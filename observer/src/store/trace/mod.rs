//! Trace files: the model stream (`observer_common::model::Event`) on disk.
//!
//! `observer record` (or `observer run --record FILE`) writes one with
//! [`TraceWriter`], a [`Sink`](crate::sinks::Sink); `report`, `diff`, `export`
//! and the TUI's replay read it back with [`Reader`], which yields the same
//! `Event`s the live run produced.
//!
//! ## Format, version 1 (all integers little-endian)
//!
//! ```text
//! file   = file_header record*
//! file_header (16 bytes)
//!   0  [u8; 8]  magic     b"MOETRACE"
//!   8  u16      version   1
//!  10  u16      reserved  0
//!  12  u32      crc       CRC-32 (ISO-HDLC, as zlib) of bytes 0..12
//! record = record_header payload
//! record_header (20 bytes)
//!   0  [u8; 4]  magic     b"MREC"  (lets a reader resynchronise after damage)
//!   4  u8       kind      the event's type: 1 header, 2 token, 3 process,
//!                         4 end, 5 histograms, 6 health, 7 totals, 8 marks;
//!                         255 a newer type
//!                         (the payload's JSON `type` tag names it)
//!   5  u8       encoding  1 = JSON (UTF-8)
//!   6  u16      reserved  0
//!   8  u32      len       payload length in bytes (≤ MAX_PAYLOAD)
//!  12  u32      data_crc  CRC-32 of the payload
//!  16  u32      head_crc  CRC-32 of record_header bytes 0..16
//! payload = `len` bytes: the JSON of one `Event` (`{"type":"token",…}`)
//! ```
//!
//! - A token record's expert grid is packed ([`grid`]): its `residency.grid`
//!   is `null` and a `grid_packed` key holds the grid as runs (base64), a delta
//!   against the previous grid written or a key frame. A 64 × 512 grid that did
//!   not change since the previous token takes a few bytes instead of ~300 KB
//!   of JSON arrays. Readers that do not know the key read the record without
//!   its grid; traces written before it (plain `grid` arrays) read as before.
//!   (The packing lives inside the JSON rather than in a new `encoding`: older
//!   readers skip a record whose encoding they do not know, and would lose
//!   every token instead of only the grids.)
//! - A token record's `explicit_reads` (explicit reads of the model file per kind of region and
//!   per routed expert, `observer_common::xread`) is a newer key of the same `token` payload: no
//!   new version or record kind (by the rule below: readers skip unknown keys, and a record
//!   without it reads as "not measured"). So are its `calls` per expert (0 when absent), and the
//!   grid's read layers `read_bytes` / `read_calls` (in `grid_packed`; absent: not measured).
//! - Names in payloads are the vocabulary's (`observer_common::vocab`); older
//!   names it lists as aliases (latency-histogram kinds before the renames)
//!   read as the current ones.
//!
//! - The first record is the `header` (the self-describing `RunHeader`: observer
//!   version, kernel, host, CPU, memory, boot, target command line, model path,
//!   size and hash, engine configuration); then `token`, `process`,
//!   `histograms`, `health` and `marks` records (what marks the tokens, when a
//!   descendant's exec or a dlopen changed it) in the order the run produced them, one
//!   `totals` record (per-thread and per-device totals, eBPF runs only); the
//!   last is `end`. `kind` always agrees with the payload's `type` tag.
//! - The `end` payload is the `Event::End` JSON plus a `"recorder"` object
//!   ([`RecorderStats`]): how many events the recorder wrote and how many it
//!   dropped because the disk could not keep up. A trace without an `end`
//!   record was cut short (the observer was killed): its drop count is unknown.
//! - JSON keeps the payload self-describing: readers skip unknown keys, so
//!   newer model fields do not break older readers; a new encoding or record
//!   kind gets a new number (unknown kinds are reported and skipped).
//! - The file is append-only and written record by record, so a writer killed
//!   at any instant leaves complete records followed by at most one partial one.
//!
//! Reading rules ([`Reader`]): a record is accepted only when its magic and
//! both CRCs match and its payload decodes. A file truncated at any byte reads
//! back every complete record and reports [`Issue::Truncated`] with the offset
//! of the partial record. A record with a bad header is reported as
//! [`Issue::Corrupt`] and the reader scans forward to the next offset where a
//! record header with a valid `head_crc` starts; a record whose header is valid
//! but whose payload CRC fails is skipped by its (CRC-protected) length.

pub mod grid;
mod reader;

pub use reader::{Issue, Reader, TraceError};

pub use crate::sinks::trace_writer::{RecorderStats, TraceWriter};

pub const FILE_MAGIC: [u8; 8] = *b"MOETRACE";
pub const VERSION: u16 = 1;
pub const FILE_HEADER_LEN: usize = 16;
pub const RECORD_MAGIC: [u8; 4] = *b"MREC";
pub const RECORD_HEADER_LEN: usize = 20;
/// Largest payload a reader accepts (a token record whose 64 × 512 expert
/// grid is a key frame of all-distinct fractions is ~190 KB).
pub const MAX_PAYLOAD: u32 = 64 << 20;
pub const ENCODING_JSON: u8 = 1;

/// Record kinds by the event's JSON `type` tag (`observer_common::model::Event`).
pub const KINDS: [(u8, &str); 8] = [
    (1, "header"),
    (2, "token"),
    (3, "process"),
    (4, "end"),
    (5, "histograms"),
    (6, "health"),
    (7, "totals"),
    (8, "marks"),
];
pub const KIND_HEADER: u8 = 1;
pub const KIND_TOKEN: u8 = 2;
pub const KIND_END: u8 = 4;
/// A model event type newer than [`KINDS`]: the JSON `type` tag names it.
pub const KIND_OTHER: u8 = 255;

const _: () = assert!(FILE_MAGIC.len() + 2 + 2 + 4 == FILE_HEADER_LEN);
const _: () = assert!(RECORD_MAGIC.len() + 1 + 1 + 2 + 4 + 4 + 4 == RECORD_HEADER_LEN);

/// The 16-byte file header.
pub fn file_header() -> [u8; FILE_HEADER_LEN] {
    let mut h = [0u8; FILE_HEADER_LEN];
    h[0..8].copy_from_slice(&FILE_MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    let crc = crc32fast::hash(&h[0..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The `type` tag at the start of an event's JSON (`{"type":"token",…`);
/// serde writes an internally tagged enum's tag first.
pub fn type_tag(payload: &[u8]) -> Option<&str> {
    let rest = payload.strip_prefix(b"{\"type\":\"")?;
    let end = rest.iter().position(|&b| b == b'"')?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The record kind of an event's JSON payload.
pub fn kind_of_payload(payload: &[u8]) -> u8 {
    let tag = type_tag(payload);
    KINDS.iter().find(|(_, t)| Some(*t) == tag).map(|(k, _)| *k).unwrap_or(KIND_OTHER)
}

/// The 20-byte header of a record with this payload.
pub fn record_header(kind: u8, payload: &[u8]) -> [u8; RECORD_HEADER_LEN] {
    let mut h = [0u8; RECORD_HEADER_LEN];
    h[0..4].copy_from_slice(&RECORD_MAGIC);
    h[4] = kind;
    h[5] = ENCODING_JSON;
    h[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[12..16].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    let crc = crc32fast::hash(&h[0..16]);
    h[16..20].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A whole record (header + payload) for `payload` of `kind`.
pub fn encode_record(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(RECORD_HEADER_LEN + payload.len());
    v.extend_from_slice(&record_header(kind, payload));
    v.extend_from_slice(payload);
    v
}

/// A parsed record header whose CRC matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub kind: u8,
    pub encoding: u8,
    pub len: u32,
    pub data_crc: u32,
}

/// Parse a record header; `None` when the magic, the CRC or the length is wrong.
pub(crate) fn parse_record_header(b: &[u8]) -> Option<RecordHeader> {
    if b.len() < RECORD_HEADER_LEN || b[0..4] != RECORD_MAGIC {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    if crc32fast::hash(&b[0..16]) != u32_at(16) {
        return None;
    }
    let len = u32_at(8);
    if len > MAX_PAYLOAD {
        return None;
    }
    Some(RecordHeader { kind: b[4], encoding: b[5], len, data_crc: u32_at(12) })
}

#[cfg(test)]
pub(crate) mod tests;
