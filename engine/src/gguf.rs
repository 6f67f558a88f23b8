//! GGUF v3 reader (over memmap2) and writer.
//!
//! # Format (little-endian throughout)
//! ```text
//! header   : magic "GGUF" (u32 0x46554747) | version u32 (2 or 3) | tensor_count u64 | kv_count u64
//! kv       : key string | value_type u32 | value
//! string   : len u64 | len bytes of UTF-8 (no terminator)
//! value    : 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (u8 0|1), 8 string,
//!            9 array (elem_type u32 | count u64 | count values; arrays of arrays allowed),
//!            10 u64, 11 i64, 12 f64
//! tensor   : name string | n_dims u32 (1..=4) | dims u64 × n_dims (ne0 = row length first)
//!            | ggml_type u32 | offset u64 (relative to the data section, multiple of alignment)
//! padding  : zeros up to the next multiple of `general.alignment` (u32, default 32)
//! data     : tensor bytes; a tensor of type T with dims [ne0, ne1, …] is ne1·ne2·ne3 rows of
//!            `T.row_bytes(ne0)` bytes, the slowest dimension last.
//! ```
//! For a routed-expert tensor `blk.N.ffn_{gate,up,down}_exps.weight` the expert index is the
//! slowest dimension (ne2), so expert `e` is the contiguous byte range
//! `offset + e·ne1·row_bytes .. offset + (e+1)·ne1·row_bytes` ([`TensorInfo::slice_range`]).
//!
//! The reader validates every length and offset against the file size before any slice is
//! taken, so a malformed or truncated file yields a [`GgufError`] naming what is wrong, never a
//! panic or an out-of-bounds read. Tensor byte ranges are kept as absolute file offsets so that
//! callers can treat weights as ranges of the mapping (residency sampling, copies to anonymous
//! memory).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::quant::GgmlType;

pub const GGUF_MAGIC: u32 = 0x4655_4747;
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bound on counts read from the header, far beyond any real model, so that a corrupt
/// count fails fast instead of reserving absurd amounts of memory.
const MAX_COUNT: u64 = 1 << 24;
const MAX_DIMS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a GGUF file (magic {magic:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic { path: PathBuf, magic: u32 },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    BadVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated at byte {at}: needed {needed} more bytes for {what}, file has {len}")]
    Truncated { path: PathBuf, at: u64, needed: u64, what: String, len: u64 },
    #[error("{path}: malformed at byte {at}: {what}")]
    Malformed { path: PathBuf, at: u64, what: String },
    #[error("{path}: tensor {name:?}: {what}")]
    BadTensor { path: PathBuf, name: String, what: String },
    #[error("{path}: metadata key {key:?}: {what}")]
    BadKey { path: PathBuf, key: String, what: String },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// Any integer type that fits, as u64 (GGUF writers disagree on the integer width).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Short human description for `engine inspect`.
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) if s.len() > 80 => format!("{:?}…", &s[..s.floor_char_boundary(80)]),
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => {
                let head: Vec<String> = a.iter().take(4).map(Value::summary).collect();
                let more = if a.len() > 4 { ", …" } else { "" };
                format!("[{}{}] ({} items)", head.join(", "), more, a.len())
            }
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
        }
    }
}

/// One entry of the tensor table, with its absolute byte range in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Total bytes.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of one row (`dims[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        // Validated at load: dims[0] is a multiple of the block size and the product fits.
        self.size / self.n_rows().max(1)
    }

    /// Number of rows (product of all dims but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    pub fn byte_range(&self) -> Range<u64> {
        self.offset..self.offset + self.size
    }

    /// Number of slices along the slowest dimension (experts for `*_exps` tensors).
    pub fn n_slices(&self) -> u64 {
        self.dims.last().copied().unwrap_or(1)
    }

    /// Absolute byte range of slice `i` along the slowest dimension (expert `i` of an
    /// `ffn_*_exps` tensor).
    pub fn slice_range(&self, i: u64) -> Option<Range<u64>> {
        let n = self.n_slices();
        if i >= n || n == 0 {
            return None;
        }
        let per = self.size / n;
        Some(self.offset + i * per..self.offset + (i + 1) * per)
    }

    /// Whether this is a routed-expert tensor (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`).
    pub fn is_routed_expert(&self) -> bool {
        self.name.contains("_exps.")
    }
}

enum Backing {
    Mmap(memmap2::Mmap),
    Bytes(Vec<u8>),
    /// The first bytes of the file, through the tensor table ([`Gguf::from_header`]).
    Header(Vec<u8>),
}

/// A parsed GGUF file, memory-mapped.
pub struct Gguf {
    path: PathBuf,
    backing: Backing,
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .field("metadata", &self.metadata.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// The file's length (`buf` may be its first bytes only: [`Gguf::from_header`]).
    file_len: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                path: self.path.to_owned(),
                at: self.pos as u64,
                needed: n - remaining,
                what: what.to_owned(),
                len: self.file_len,
            });
        }
        let n = n as usize; // n <= remaining <= usize::MAX
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn malformed(&self, what: String) -> GgufError {
        GgufError::Malformed { path: self.path.to_owned(), at: self.pos as u64, what }
    }

    fn count(&mut self, what: &str) -> Result<u64, GgufError> {
        let n = self.u64(what)?;
        if n > MAX_COUNT {
            return Err(self.malformed(format!("{what} = {n} is absurd (limit {MAX_COUNT})")));
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Malformed {
            path: self.path.to_owned(),
            at: at as u64,
            what: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.arr(key)?)),
            1 => Value::I8(i8::from_le_bytes(self.arr(key)?)),
            2 => Value::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => match self.arr::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.malformed(format!("{key}: bool value {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 4 {
                    return Err(self.malformed(format!("{key}: arrays nested too deep")));
                }
                let ety = self.u32(key)?;
                let n = self.count(&format!("{key}: array length"))?;
                // Every element takes at least one byte: a count beyond the remaining bytes is
                // a truncation, reported before reserving memory for it.
                let remaining = (self.buf.len() - self.pos) as u64;
                if n > remaining {
                    return Err(GgufError::Truncated {
                        path: self.path.to_owned(),
                        at: self.pos as u64,
                        needed: n - remaining,
                        what: format!("{key}: {n} array elements"),
                        len: self.file_len,
                    });
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(key)?)),
            t => return Err(self.malformed(format!("{key}: unknown value type {t}"))),
        })
    }
}

impl Gguf {
    /// Maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = crate::files::open_regular(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(GgufError::Truncated {
                path: path.to_owned(),
                at: 0,
                needed: 24,
                what: "header".into(),
                len: 0,
            });
        }
        // SAFETY: the mapping is read-only and private to this process; the model file is not
        // expected to be modified while the engine runs (as with llama.cpp's mmap). A concurrent
        // truncation could raise SIGBUS, which no safe API can prevent for mapped files.
        let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        let len = mmap.len() as u64;
        Self::parse(path, Backing::Mmap(mmap), len)
    }

    /// Parses an in-memory GGUF image (tests, tools).
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        let len = bytes.len() as u64;
        Self::parse(&name.into(), Backing::Bytes(bytes), len)
    }

    /// Parses the metadata and tensor table of a file of `file_len` bytes from its first bytes,
    /// `prefix` (for readers that must not map the file: the observer reads them with
    /// `O_DIRECT`, so that parsing brings nothing into the page cache). Tensor ranges are
    /// checked against `file_len`. A prefix that ends inside the header gives
    /// [`GgufError::Truncated`], whose `needed` is how many bytes beyond the prefix the header
    /// needs at least (read that many more and parse again; the error is final when the
    /// prefix was the whole file). The result has no tensor data: [`Gguf::bytes`] is the prefix, and
    /// [`Gguf::tensor_data`] panics.
    pub fn from_header(path: impl Into<PathBuf>, prefix: Vec<u8>, file_len: u64) -> Result<Gguf, GgufError> {
        assert!(prefix.len() as u64 <= file_len, "a prefix longer than its file");
        Self::parse(&path.into(), Backing::Header(prefix), file_len)
    }

    fn parse(path: &Path, backing: Backing, file_len: u64) -> Result<Gguf, GgufError> {
        let buf: &[u8] = match &backing {
            Backing::Mmap(m) => m,
            Backing::Bytes(b) | Backing::Header(b) => b,
        };
        let mut c = Cursor { buf, pos: 0, path, file_len };
        let magic = c.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { path: path.to_owned(), magic });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::BadVersion { path: path.to_owned(), version });
        }
        let n_tensors = c.count("tensor count")?;
        let n_kv = c.count("metadata count")?;

        let mut metadata = Vec::with_capacity(n_kv.min(4096) as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&format!("type of {key}"))?;
            let v = c.value(ty, &key, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(c.malformed(format!("duplicate metadata key {key:?}")));
            }
            metadata.push((key, v));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let a = metadata[i].1.as_u64().filter(|a| a.is_power_of_two());
                a.ok_or_else(|| GgufError::BadKey {
                    path: path.to_owned(),
                    key: "general.alignment".into(),
                    what: format!("must be a power-of-two integer, got {}", metadata[i].1.summary()),
                })?
            }
        };

        struct Raw {
            name: String,
            dims: Vec<u64>,
            ty: GgmlType,
            rel: u64,
            size: u64,
        }
        let mut raw = Vec::with_capacity(n_tensors.min(65536) as usize);
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("name of tensor #{i}"))?;
            let bad = |what: String| GgufError::BadTensor { path: path.to_owned(), name: name.clone(), what };
            let n_dims = c.u32(&format!("dims of {name}"))? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad(format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("dims of {name}"))?);
            }
            let ty_raw = c.u32(&format!("type of {name}"))?;
            let rel = c.u64(&format!("offset of {name}"))?;
            let ty = GgmlType::from_u32(ty_raw).ok_or_else(|| bad(format!("unknown ggml type {ty_raw}")))?;
            if dims.contains(&0) {
                return Err(bad(format!("zero dimension in {dims:?}")));
            }
            let n_el = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let n_el = n_el.filter(|&n| n < (1u64 << 48)).ok_or_else(|| bad(format!("absurd shape {dims:?}")))?;
            let row = usize::try_from(dims[0]).ok().and_then(|ne0| ty.row_bytes(ne0)).ok_or_else(|| {
                bad(format!(
                    "row length {} is not a multiple of {}'s block size {}",
                    dims[0],
                    ty.name(),
                    ty.block_size()
                ))
            })?;
            let size = (row as u64).checked_mul(n_el / dims[0]).ok_or_else(|| bad(format!("absurd shape {dims:?}")))?;
            if rel % alignment != 0 {
                return Err(bad(format!("offset {rel} is not a multiple of the alignment {alignment}")));
            }
            if tensor_index.insert(name.clone(), raw.len()).is_some() {
                return Err(bad("duplicate tensor name".into()));
            }
            raw.push(Raw { name, dims, ty, rel, size });
        }

        let data_offset = (c.pos as u64).next_multiple_of(alignment);
        if data_offset > file_len && n_tensors > 0 {
            return Err(GgufError::Truncated {
                path: path.to_owned(),
                at: c.pos as u64,
                needed: data_offset - file_len,
                what: "padding before the data section".into(),
                len: file_len,
            });
        }
        let mut tensors = Vec::with_capacity(raw.len());
        for r in raw {
            let offset = data_offset.checked_add(r.rel);
            let end = offset.and_then(|o| o.checked_add(r.size));
            match (offset, end) {
                (Some(offset), Some(end)) if end <= file_len => {
                    tensors.push(TensorInfo { name: r.name, dims: r.dims, ty: r.ty, offset, size: r.size })
                }
                _ => {
                    return Err(GgufError::BadTensor {
                        path: path.to_owned(),
                        name: r.name,
                        what: format!(
                            "data {}..+{} (offset {} in the data section at {}) lies beyond the end of the file ({} bytes)",
                            data_offset.saturating_add(r.rel),
                            r.size,
                            r.rel,
                            data_offset,
                            file_len
                        ),
                    });
                }
            }
        }

        Ok(Gguf {
            path: path.to_owned(),
            backing,
            version,
            alignment,
            data_offset,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file image (the mapping); only the header for [`Gguf::from_header`].
    pub fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mmap(m) => m,
            Backing::Bytes(b) | Backing::Header(b) => b,
        }
    }

    /// Whether [`Gguf::bytes`] is a file mapping (from [`Gguf::open`]) rather than a buffer.
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mmap(_))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (ranges were validated at load). Panics on a [`Gguf::from_header`].
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes()[t.offset as usize..(t.offset + t.size) as usize]
    }

    fn key_err(&self, key: &str, what: impl Into<String>) -> GgufError {
        GgufError::BadKey { path: self.path.clone(), key: key.to_owned(), what: what.into() }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key).ok_or_else(|| self.key_err(key, "missing"))?;
        v.as_u64().ok_or_else(|| self.key_err(key, format!("expected an unsigned integer, got {}", v.summary())))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.get(key).ok_or_else(|| self.key_err(key, "missing"))?;
        v.as_f64().map(|f| f as f32).ok_or_else(|| self.key_err(key, format!("expected a float, got {}", v.summary())))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key).ok_or_else(|| self.key_err(key, "missing"))?;
        v.as_str().ok_or_else(|| self.key_err(key, format!("expected a string, got {}", v.summary())))
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let v = self.get(key).ok_or_else(|| self.key_err(key, "missing"))?;
        let a = v.as_array().ok_or_else(|| self.key_err(key, "expected an array"))?;
        a.iter().map(|e| e.as_str().ok_or_else(|| self.key_err(key, "expected an array of strings"))).collect()
    }

    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }
}

/// A tensor to be written: name, ggml dims (row length first) and type.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    pub fn size(&self) -> Option<u64> {
        let row = self.ty.row_bytes(usize::try_from(self.dims[0]).ok()?)? as u64;
        self.dims.iter().skip(1).try_fold(row, |a, &d| a.checked_mul(d))
    }
}

/// Streaming GGUF writer: metadata and the tensor table first, then each tensor's bytes in
/// table order via [`GgufWriter::write_tensor`], so that huge models never sit in memory.
pub struct GgufWriter {
    out: BufWriter<File>,
    path: PathBuf,
    specs: Vec<TensorSpec>,
    next: usize,
    alignment: u64,
    pos: u64,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => {
            let ety = a.first().map_or(4, Value::type_id);
            out.extend_from_slice(&ety.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for e in a {
                put_value(out, e);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Serializes the header, metadata and tensor table (without the padding to the data section).
pub fn encode_header(metadata: &[(String, Value)], specs: &[TensorSpec], alignment: u64) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(specs.len() as u64).to_le_bytes());
    h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut h, k);
        h.extend_from_slice(&v.type_id().to_le_bytes());
        put_value(&mut h, v);
    }
    let mut rel = 0u64;
    for s in specs {
        put_str(&mut h, &s.name);
        h.extend_from_slice(&(s.dims.len() as u32).to_le_bytes());
        for d in &s.dims {
            h.extend_from_slice(&d.to_le_bytes());
        }
        h.extend_from_slice(&(s.ty as u32).to_le_bytes());
        h.extend_from_slice(&rel.to_le_bytes());
        rel = (rel + s.size().unwrap_or(0)).next_multiple_of(alignment);
    }
    h
}

impl GgufWriter {
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        specs: Vec<TensorSpec>,
    ) -> io::Result<GgufWriter> {
        let path = path.as_ref().to_owned();
        let alignment = metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT);
        for s in &specs {
            if s.size().is_none() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("tensor {}: shape {:?} does not fit type {}", s.name, s.dims, s.ty.name()),
                ));
            }
        }
        let header = encode_header(metadata, &specs, alignment);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&path)?);
        out.write_all(&header)?;
        let mut w = GgufWriter { out, path, specs, next: 0, alignment, pos: header.len() as u64 };
        w.pad()?;
        Ok(w)
    }

    fn pad(&mut self) -> io::Result<()> {
        let target = self.pos.next_multiple_of(self.alignment);
        let zeros = vec![0u8; (target - self.pos) as usize];
        self.out.write_all(&zeros)?;
        self.pos = target;
        Ok(())
    }

    /// The spec of the next tensor to write, if any.
    pub fn next_spec(&self) -> Option<&TensorSpec> {
        self.specs.get(self.next)
    }

    /// Writes the next tensor's bytes (possibly in several calls: `done` marks the last chunk).
    pub fn write_chunk(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Closes the current tensor, checking that exactly its size was written.
    pub fn end_tensor(&mut self, start: u64) -> io::Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| io::Error::other("no tensor left to end"))?;
        let want = spec.size().unwrap_or(0);
        if self.pos - start != want {
            return Err(io::Error::other(format!(
                "{}: tensor {} got {} bytes, expected {want}",
                self.path.display(),
                spec.name,
                self.pos - start
            )));
        }
        self.next += 1;
        self.pad()
    }

    /// Current write position (start of the next tensor's data).
    pub fn position(&self) -> u64 {
        self.pos
    }

    pub fn write_tensor(&mut self, bytes: &[u8]) -> io::Result<()> {
        let start = self.pos;
        self.write_chunk(bytes)?;
        self.end_tensor(start)
    }

    pub fn finish(mut self) -> io::Result<()> {
        if self.next != self.specs.len() {
            return Err(io::Error::other(format!(
                "{}: only {} of {} tensors written",
                self.path.display(),
                self.next,
                self.specs.len()
            )));
        }
        self.out.flush()?;
        let f = self.out.get_mut();
        f.seek(SeekFrom::End(0))?;
        f.sync_all()
    }
}
