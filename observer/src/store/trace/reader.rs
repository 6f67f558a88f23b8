//! Reading a trace back: a streaming iterator of `Event`s that skips damage
//! and reports it (see the module above for the rules).
//!
//! ```no_run
//! use observer::store::trace::Reader;
//! let mut r = Reader::open("run.trace".as_ref())?;
//! for ev in r.by_ref() {
//!     // Header, Token…, Process…, End — the same events as the live run.
//!     let _ = ev;
//! }
//! for issue in r.issues() {
//!     eprintln!("{issue}"); // truncation, corruption: where and what was skipped
//! }
//! # Ok::<(), observer::store::trace::TraceError>(())
//! ```

use std::{
    fmt,
    fs::File,
    io::{BufReader, Read},
    path::{Path, PathBuf},
};

use observer_common::model::Event;
use serde::Deserialize;

use super::{
    ENCODING_JSON, FILE_HEADER_LEN, FILE_MAGIC, KIND_END, KIND_OTHER, KIND_TOKEN, KINDS, RECORD_HEADER_LEN,
    RECORD_MAGIC, RecorderStats, VERSION, grid, kind_of_payload, parse_record_header,
};

/// Errors that stop reading before the first record.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "{} is not an observer trace (it does not start with \"MOETRACE\"); record one with `observer record -o FILE -- CMD`",
        path.display()
    )]
    NotATrace { path: PathBuf },
    #[error(
        "{} is a version {version} trace; this observer reads version {VERSION}: read it with a newer observer",
        path.display()
    )]
    UnsupportedVersion { path: PathBuf, version: u16 },
}

/// Damage found while reading; the reader carries on after each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issue {
    /// The file ends inside a record (or inside the file header) that starts
    /// at `offset`: `available` of its `needed` bytes are there. Everything
    /// before `offset` was read.
    Truncated { offset: u64, available: u64, needed: u64 },
    /// `skipped` bytes from `offset` were not a valid record and were skipped.
    Corrupt { offset: u64, skipped: u64, reason: String },
    /// The record at `offset` is intact but its payload does not decode.
    Undecodable { offset: u64, reason: String },
    /// The record at `offset` has a kind or encoding this reader does not know.
    Unknown { offset: u64, kind: u8, encoding: u8 },
    /// The record at `offset` was read without a part of it (`reason` says which and why).
    Partial { offset: u64, reason: String },
}

impl Issue {
    pub fn offset(&self) -> u64 {
        match self {
            Issue::Truncated { offset, .. }
            | Issue::Corrupt { offset, .. }
            | Issue::Undecodable { offset, .. }
            | Issue::Unknown { offset, .. }
            | Issue::Partial { offset, .. } => *offset,
        }
    }
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Issue::Truncated { offset, available, needed } => write!(
                f,
                "truncated at byte {offset}: the last record is incomplete ({available} of {needed} bytes); everything before it was read"
            ),
            Issue::Corrupt { offset, skipped, reason } => {
                write!(f, "corrupt data at byte {offset} ({reason}): skipped {skipped} bytes to the next valid record")
            }
            Issue::Undecodable { offset, reason } => {
                write!(f, "record at byte {offset} does not decode ({reason}): skipped")
            }
            Issue::Unknown { offset, kind, encoding } => {
                write!(
                    f,
                    "record at byte {offset} has unknown kind {kind} / encoding {encoding} (newer observer?): skipped"
                )
            }
            Issue::Partial { offset, reason } => write!(f, "record at byte {offset} read without a part: {reason}"),
        }
    }
}

/// A streaming trace reader; an `Iterator` of the events that read back intact.
pub struct Reader<R = BufReader<File>> {
    src: R,
    buf: Vec<u8>,
    /// Index in `buf` of the byte at file offset `offset`.
    pos: usize,
    offset: u64,
    eof: bool,
    done: bool,
    issues: Vec<Issue>,
    records: u64,
    recorder: Option<RecorderStats>,
    saw_end: bool,
    grids: grid::Unpacker,
}

impl<R> fmt::Debug for Reader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reader").field("offset", &self.offset).field("issues", &self.issues).finish_non_exhaustive()
    }
}

impl Reader<BufReader<File>> {
    /// Open a trace file and check its file header.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let f = File::open(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
        Self::new(BufReader::with_capacity(1 << 16, f), path)
    }
}

#[derive(Deserialize)]
struct EndExtras {
    recorder: Option<RecorderStats>,
}

#[derive(Deserialize)]
struct TokenExtras {
    grid_packed: Option<grid::Packed>,
}

/// Whether a payload may hold a packed grid (a cheap check before a second parse).
fn has_packed_grid(payload: &[u8]) -> bool {
    const KEY: &[u8] = b"\"grid_packed\"";
    payload.windows(KEY.len()).any(|w| w == KEY)
}

impl<R: Read> Reader<R> {
    /// Read from any source; `name` is used in errors.
    pub fn new(src: R, name: &Path) -> Result<Self, TraceError> {
        let mut r = Reader {
            src,
            buf: Vec::new(),
            pos: 0,
            offset: 0,
            eof: false,
            done: false,
            issues: Vec::new(),
            records: 0,
            recorder: None,
            saw_end: false,
            grids: grid::Unpacker::default(),
        };
        let io = |source| TraceError::Io { path: name.to_path_buf(), source };
        let have = r.fill(FILE_HEADER_LEN).map_err(io)?;
        let h = &r.buf[r.pos..r.pos + have];
        let magic_len = have.min(FILE_MAGIC.len());
        if h[..magic_len] != FILE_MAGIC[..magic_len] {
            return Err(TraceError::NotATrace { path: name.to_path_buf() });
        }
        if have < FILE_HEADER_LEN {
            r.issues.push(Issue::Truncated { offset: 0, available: have as u64, needed: FILE_HEADER_LEN as u64 });
            r.done = true;
            return Ok(r);
        }
        let version = u16::from_le_bytes([h[8], h[9]]);
        let crc_ok = crc32fast::hash(&h[0..12]) == u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        if crc_ok && version != VERSION {
            return Err(TraceError::UnsupportedVersion { path: name.to_path_buf(), version });
        }
        if !crc_ok {
            // The magic is right: assume version 1 and read on.
            r.issues.push(Issue::Corrupt {
                offset: 0,
                skipped: 0,
                reason: format!(
                    "file header checksum mismatch (version field says {version}); reading as version {VERSION}"
                ),
            });
        }
        r.advance(FILE_HEADER_LEN);
        Ok(r)
    }

    /// Damage found so far (all of it once the iterator returned `None`).
    pub fn issues(&self) -> &[Issue] {
        &self.issues
    }

    /// Records read intact so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// The recorder's counts from the `end` record; `None` when the trace has
    /// no end record (cut short: the drops before the cut are unknown).
    pub fn recorder(&self) -> Option<RecorderStats> {
        self.recorder
    }

    /// Whether an `end` record was read.
    pub fn complete(&self) -> bool {
        self.saw_end
    }

    /// The file offset up to which the file has been consumed.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The events, as an iterator over `&mut self` (so that `issues()` can be
    /// asked afterwards).
    pub fn events(&mut self) -> &mut Self {
        self
    }

    /// Ensure `n` bytes are buffered from `pos` unless the source ends first;
    /// returns how many are available (≤ n).
    fn fill(&mut self, n: usize) -> std::io::Result<usize> {
        while self.buf.len() - self.pos < n && !self.eof {
            if self.pos > 0 && self.pos >= self.buf.len() / 2 {
                self.buf.drain(..self.pos);
                self.pos = 0;
            }
            let old = self.buf.len();
            let want = (n - (old - self.pos)).max(1 << 16);
            self.buf.resize(old + want, 0);
            let got = loop {
                match self.src.read(&mut self.buf[old..]) {
                    Ok(g) => break g,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.buf.truncate(old);
                        return Err(e);
                    }
                }
            };
            self.buf.truncate(old + got);
            if got == 0 {
                self.eof = true;
            }
        }
        Ok((self.buf.len() - self.pos).min(n))
    }

    fn advance(&mut self, n: usize) {
        self.pos += n;
        self.offset += n as u64;
    }

    /// From a bad record header at the current offset, skip to the next
    /// offset where a valid record header starts (or to the end).
    fn resync(&mut self, reason: &str) -> std::io::Result<()> {
        let start = self.offset;
        self.advance(1);
        loop {
            let have = self.fill(RECORD_HEADER_LEN)?;
            if have == 0 {
                break;
            }
            let window = &self.buf[self.pos..self.pos + have];
            if window.starts_with(&RECORD_MAGIC[..have.min(4)]) {
                if have < RECORD_HEADER_LEN {
                    // A record header cut by the end of the file: leave it
                    // to be reported as the truncation point.
                    break;
                }
                if parse_record_header(window).is_some() {
                    break;
                }
            }
            // Jump to the next possible magic start inside the buffered data.
            let avail = self.buf.len() - self.pos;
            let next = self.buf[self.pos + 1..self.pos + avail]
                .iter()
                .position(|&b| b == RECORD_MAGIC[0])
                .map(|i| i + 1)
                .unwrap_or(avail);
            self.advance(next);
        }
        self.issues.push(Issue::Corrupt { offset: start, skipped: self.offset - start, reason: reason.into() });
        Ok(())
    }

    fn read_one(&mut self) -> std::io::Result<Option<Event>> {
        loop {
            let at = self.offset;
            let have = self.fill(RECORD_HEADER_LEN)?;
            if have == 0 {
                return Ok(None);
            }
            let hb = &self.buf[self.pos..self.pos + have];
            if have < RECORD_HEADER_LEN {
                if hb.starts_with(&RECORD_MAGIC[..have.min(4)]) {
                    self.issues.push(Issue::Truncated {
                        offset: at,
                        available: have as u64,
                        needed: RECORD_HEADER_LEN as u64,
                    });
                    self.advance(have);
                    return Ok(None);
                }
                self.resync("not a record header")?;
                continue;
            }
            let Some(h) = parse_record_header(hb) else {
                let reason =
                    if hb[0..4] != RECORD_MAGIC { "no record magic" } else { "record header checksum mismatch" };
                self.resync(reason)?;
                continue;
            };
            let total = RECORD_HEADER_LEN + h.len as usize;
            let have = self.fill(total)?;
            if have < total {
                self.issues.push(Issue::Truncated { offset: at, available: have as u64, needed: total as u64 });
                self.advance(have);
                return Ok(None);
            }
            let payload = &self.buf[self.pos + RECORD_HEADER_LEN..self.pos + total];
            if crc32fast::hash(payload) != h.data_crc {
                self.issues.push(Issue::Corrupt {
                    offset: at,
                    skipped: total as u64,
                    reason: "payload checksum mismatch".into(),
                });
                self.advance(total);
                continue;
            }
            let known_kind = h.kind == KIND_OTHER || KINDS.iter().any(|(k, _)| *k == h.kind);
            if h.encoding != ENCODING_JSON || !known_kind {
                self.issues.push(Issue::Unknown { offset: at, kind: h.kind, encoding: h.encoding });
                self.advance(total);
                continue;
            }
            let decoded = serde_json::from_slice::<Event>(payload);
            let extras = if h.kind == KIND_END { serde_json::from_slice::<EndExtras>(payload).ok() } else { None };
            let packed = if h.kind == KIND_TOKEN && has_packed_grid(payload) {
                serde_json::from_slice::<TokenExtras>(payload).map(|e| e.grid_packed)
            } else {
                Ok(None)
            };
            let payload_kind = kind_of_payload(payload);
            self.advance(total);
            match decoded {
                Ok(mut ev) if payload_kind == h.kind => {
                    if let Event::Token(t) = &mut ev {
                        match packed {
                            Ok(Some(p)) => match self.grids.unpack(t.seq, &p) {
                                Ok(g) => t.residency.get_or_insert_with(Default::default).grid = Some(g),
                                Err(reason) => self.issues.push(Issue::Partial { offset: at, reason }),
                            },
                            Ok(None) => {}
                            Err(e) => self.issues.push(Issue::Partial {
                                offset: at,
                                reason: format!("its expert grid does not decode: {e}"),
                            }),
                        }
                    }
                    self.records += 1;
                    if h.kind == KIND_END {
                        self.saw_end = true;
                        self.recorder = extras.and_then(|e| e.recorder);
                    }
                    return Ok(Some(ev));
                }
                Ok(_) => self.issues.push(Issue::Undecodable {
                    offset: at,
                    reason: format!("payload type does not match record kind {}", h.kind),
                }),
                Err(_) if h.kind == KIND_OTHER => {
                    // A model event type this reader does not know (newer observer).
                    self.issues.push(Issue::Unknown { offset: at, kind: h.kind, encoding: h.encoding });
                }
                Err(e) => self.issues.push(Issue::Undecodable { offset: at, reason: e.to_string() }),
            }
        }
    }
}

impl<R: Read> Iterator for Reader<R> {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        match self.read_one() {
            Ok(Some(ev)) => Some(ev),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                // An I/O error mid-file: report it where it happened and stop.
                self.issues.push(Issue::Corrupt {
                    offset: self.offset,
                    skipped: 0,
                    reason: format!("read error: {e}"),
                });
                self.done = true;
                None
            }
        }
    }
}
