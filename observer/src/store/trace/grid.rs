//! The expert grid of a token record, packed for trace files.
//!
//! ## Format (the `grid_packed` key of a `token` record's JSON)
//! ```text
//! "grid_packed": {
//!   "n_layers": L, "n_experts": E,      the grid's shape (L × E cells, row-major)
//!   "layers": [N, …],                   the block index of each row (absent in traces
//!                                       written before it existed: row r is block r)
//!   "base": S | null,                   a delta against the grid of the token record with
//!                                       `seq` S (the previous one written with a grid), or
//!                                       null: a key frame, complete in itself
//!   "resident": "<runs>",               resident fractions (f32)
//!   "added": "<runs>" | null,           page-cache pages added per expert (u32), if measured
//!   "evicted": "<runs>" | null,         … evicted
//!   "read_bytes": "<runs>",             explicit-read bytes per expert (u64), if measured
//!   "read_calls": "<runs>",             … calls (u32)
//!   "refault_faults": "<runs>",         refault faults per expert (u32), if measured
//!   "refault_io_ns": "<runs>"           … their fault_io ns (u64)
//! }
//! ```
//! The key names after `base` are the grid layers of `vocab::GRID_LAYERS`. `read_bytes`,
//! `read_calls`, `refault_faults` and `refault_io_ns` are absent when not measured (and in traces
//! written before they existed): new keys, no new version.
//! and the record's `residency.grid` is `null`, so that a reader that does not
//! know `grid_packed` (they skip unknown keys) reads every record, without the grid.
//!
//! `<runs>` is standard base64 (with padding) of a sequence of runs, each a byte
//! `op` and an unsigned LEB128 count `n ≥ 1`, until the cells are covered:
//! - `0`: `n` cells equal to 0 (the bits of `+0.0` for fractions);
//! - `1`: `n` cells equal to 1 (`1.0`, fractions only);
//! - `2`: `n` cells equal to the base grid's (deltas only; fractions only);
//! - `3`: `n` literal values follow: little-endian f32 bits (fractions) or LEB128 (counts).
//!
//! Values are compared and stored by their bits, so a packed grid reads back
//! exactly. The writer writes a key frame for the first grid, after a change
//! of shape and every [`KEY_EVERY`] grids, so that a reader that lost a record
//! (damage) recovers at the next key frame; a delta whose base was not read
//! gives a record without its grid, and the reader reports it.

use base64::{Engine, engine::general_purpose::STANDARD};
use observer_common::model::ExpertGrid;
use serde::{Deserialize, Serialize};

/// At most this many grids between two key frames.
pub const KEY_EVERY: u64 = 64;

const OP_ZERO: u8 = 0;
const OP_ONE: u8 = 1;
const OP_SAME: u8 = 2;
const OP_LITERAL: u8 = 3;

/// The JSON object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Packed {
    pub n_layers: u32,
    pub n_experts: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<u32>,
    pub base: Option<u64>,
    pub resident: String,
    pub added: Option<String>,
    pub evicted: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_calls: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refault_faults: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refault_io_ns: Option<String>,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn get_varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("runs end inside a number")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a number longer than 64 bits".into())
}

/// Cell classes of one value: the run op it belongs to.
fn op_of<T: Copy + Eq + Default>(v: T, base: Option<T>, one: Option<T>) -> u8 {
    if base == Some(v) {
        OP_SAME
    } else if v == T::default() {
        OP_ZERO
    } else if one == Some(v) {
        OP_ONE
    } else {
        OP_LITERAL
    }
}

/// Runs of `vals` (bits), against `base` (same length) if any. `one`: the bits
/// of the value op 1 stands for (fractions only). `literal` writes one value.
fn runs<T: Copy + Eq + Default>(
    vals: &[T],
    base: Option<&[T]>,
    one: Option<T>,
    literal: fn(&mut Vec<u8>, T),
) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < vals.len() {
        let op = op_of(vals[i], base.map(|b| b[i]), one);
        let mut j = i + 1;
        while j < vals.len() && op_of(vals[j], base.map(|b| b[j]), one) == op {
            j += 1;
        }
        out.push(op);
        put_varint(&mut out, (j - i) as u64);
        if op == OP_LITERAL {
            for &v in &vals[i..j] {
                literal(&mut out, v);
            }
        }
        i = j;
    }
    out
}

fn unruns<T: Copy + Default>(
    b: &[u8],
    n: usize,
    base: Option<&[T]>,
    one: Option<T>,
    literal: fn(&[u8], &mut usize) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    while out.len() < n {
        let op = *b.get(at).ok_or("runs end before the grid does")?;
        at += 1;
        let count = get_varint(b, &mut at)? as usize;
        if count == 0 || count > n - out.len() {
            return Err(format!("a run of {count} cells where {} remain", n - out.len()));
        }
        match op {
            OP_ZERO => out.extend(std::iter::repeat_n(T::default(), count)),
            OP_ONE => out.extend(std::iter::repeat_n(one.ok_or("run of ones in counts")?, count)),
            OP_SAME => {
                let base = base.ok_or("a run of unchanged cells in a key frame")?;
                out.extend_from_slice(&base[out.len()..out.len() + count]);
            }
            OP_LITERAL => {
                for _ in 0..count {
                    out.push(literal(b, &mut at)?);
                }
            }
            other => return Err(format!("unknown run op {other}")),
        }
    }
    if at != b.len() {
        return Err(format!("{} bytes after the last run", b.len() - at));
    }
    Ok(out)
}

fn f32_literal(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn f32_read(b: &[u8], at: &mut usize) -> Result<u32, String> {
    let s = b.get(*at..*at + 4).ok_or("runs end inside a value")?;
    *at += 4;
    Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn count_literal(out: &mut Vec<u8>, v: u32) {
    put_varint(out, u64::from(v));
}

fn count_read(b: &[u8], at: &mut usize) -> Result<u32, String> {
    u32::try_from(get_varint(b, at)?).map_err(|_| "a count beyond u32".to_string())
}

fn count64_literal(out: &mut Vec<u8>, v: u64) {
    put_varint(out, v);
}

fn count64_read(b: &[u8], at: &mut usize) -> Result<u64, String> {
    get_varint(b, at)
}

const ONE_BITS: u32 = 0x3f80_0000;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Packs grids one after another (the writer's side).
#[derive(Debug, Default)]
pub struct Packer {
    /// The last grid written: its record's seq and its resident bits.
    last: Option<(u64, u32, u32, Vec<u32>)>,
    since_key: u64,
}

impl Packer {
    /// Pack the grid of the token record `seq`.
    pub fn pack(&mut self, seq: u64, g: &ExpertGrid) -> Packed {
        let resident = bits(&g.resident);
        let base = match &self.last {
            Some((s, l, e, b)) if *l == g.n_layers && *e == g.n_experts && self.since_key + 1 < KEY_EVERY => {
                self.since_key += 1;
                Some((*s, b.as_slice()))
            }
            _ => {
                self.since_key = 0;
                None
            }
        };
        let counts = |v: &Option<Vec<u32>>| v.as_ref().map(|v| STANDARD.encode(runs(v, None, None, count_literal)));
        let counts64 = |v: &Option<Vec<u64>>| v.as_ref().map(|v| STANDARD.encode(runs(v, None, None, count64_literal)));
        let p = Packed {
            n_layers: g.n_layers,
            n_experts: g.n_experts,
            layers: g.layers.clone(),
            base: base.map(|(s, _)| s),
            resident: STANDARD.encode(runs(&resident, base.map(|(_, b)| b), Some(ONE_BITS), f32_literal)),
            added: counts(&g.added),
            evicted: counts(&g.evicted),
            read_bytes: counts64(&g.read_bytes),
            read_calls: counts(&g.read_calls),
            refault_faults: counts(&g.refault_faults),
            refault_io_ns: counts64(&g.refault_io_ns),
        };
        self.last = Some((seq, g.n_layers, g.n_experts, resident));
        p
    }
}

/// Unpacks grids in record order (the reader's side).
#[derive(Debug, Default)]
pub struct Unpacker {
    last: Option<(u64, Vec<u32>)>,
}

impl Unpacker {
    /// The grid of the token record `seq`; an error names what is missing or malformed.
    pub fn unpack(&mut self, seq: u64, p: &Packed) -> Result<ExpertGrid, String> {
        let n = p.n_layers as usize * p.n_experts as usize;
        let base = match p.base {
            None => None,
            Some(b) => match &self.last {
                Some((s, v)) if *s == b && v.len() == n => Some(v.as_slice()),
                _ => return Err(format!("its expert grid is a delta against token record {b}, which was not read")),
            },
        };
        let decode = |s: &str| STANDARD.decode(s).map_err(|e| format!("expert grid: bad base64: {e}"));
        let resident = unruns(&decode(&p.resident)?, n, base, Some(ONE_BITS), f32_read)
            .map_err(|e| format!("expert grid: {e}"))?;
        let counts = |s: &Option<String>| -> Result<Option<Vec<u32>>, String> {
            s.as_ref()
                .map(|s| unruns(&decode(s)?, n, None, None, count_read).map_err(|e| format!("expert grid churn: {e}")))
                .transpose()
        };
        let counts64 = |s: &Option<String>, what: &str| -> Result<Option<Vec<u64>>, String> {
            s.as_ref()
                .map(|s| {
                    unruns(&decode(s)?, n, None, None, count64_read).map_err(|e| format!("expert grid {what}: {e}"))
                })
                .transpose()
        };
        if !p.layers.is_empty() && p.layers.len() != p.n_layers as usize {
            return Err(format!("expert grid: {} layer indices for {} rows", p.layers.len(), p.n_layers));
        }
        let g = ExpertGrid {
            n_layers: p.n_layers,
            n_experts: p.n_experts,
            layers: p.layers.clone(),
            resident: resident.iter().map(|b| f32::from_bits(*b)).collect(),
            added: counts(&p.added)?,
            evicted: counts(&p.evicted)?,
            read_bytes: counts64(&p.read_bytes, "reads")?,
            read_calls: counts(&p.read_calls)?,
            refault_faults: counts(&p.refault_faults)?,
            refault_io_ns: counts64(&p.refault_io_ns, "refault cost")?,
        };
        self.last = Some((seq, resident));
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(l: u32, e: u32, f: impl Fn(usize) -> f32) -> ExpertGrid {
        let n = (l * e) as usize;
        ExpertGrid {
            n_layers: l,
            n_experts: e,
            // A model whose first block is dense: row r is block r + 1.
            layers: (1..=l).collect(),
            resident: (0..n).map(f).collect(),
            added: Some((0..n).map(|i| if i % 7 == 0 { i as u32 * 1000 } else { 0 }).collect()),
            evicted: None,
            // Explicit-read bytes beyond u32 in some cells.
            read_bytes: Some((0..n).map(|i| if i % 11 == 0 { (i as u64) << 30 } else { 0 }).collect()),
            read_calls: Some((0..n).map(|i| if i % 11 == 0 { i as u32 } else { 0 }).collect()),
            refault_faults: Some((0..n).map(|i| if i % 13 == 0 { i as u32 } else { 0 }).collect()),
            // Refault time beyond u32 in some cells.
            refault_io_ns: Some((0..n).map(|i| if i % 13 == 0 { (i as u64) << 33 } else { 0 }).collect()),
        }
    }

    #[test]
    fn grids_round_trip_exactly_through_key_frames_and_deltas() {
        let mut p = Packer::default();
        let mut u = Unpacker::default();
        let odd = [0.0, 1.0, -0.0, f32::MIN_POSITIVE, 1.0 / 3.0, f32::NAN, 0.999_999_9, 1e-7];
        for seq in 0..200u64 {
            // Every 10th token changes some cells; token 100 changes shape.
            let (l, e) = if seq < 100 { (12, 128) } else { (40, 256) };
            let g = grid(l, e, |i| if (i as u64 + seq / 10).is_multiple_of(5) { odd[i % odd.len()] } else { 1.0 });
            let packed = p.pack(seq, &g);
            assert_eq!(packed.base.is_none(), [0, KEY_EVERY, 100, 100 + KEY_EVERY].contains(&seq), "{seq}");
            let back = u.unpack(seq, &packed).unwrap();
            assert_eq!(bits(&back.resident), bits(&g.resident), "token {seq}");
            assert_eq!(back.added, g.added);
            assert_eq!(back.evicted, None);
            assert_eq!((&back.read_bytes, &back.read_calls), (&g.read_bytes, &g.read_calls));
            assert_eq!((&back.refault_faults, &back.refault_io_ns), (&g.refault_faults, &g.refault_io_ns));
            assert_eq!((back.layers.len(), back.layer(0), back.layer(l as usize - 1)), (l as usize, 1, l));
        }
    }

    #[test]
    fn an_unchanged_grid_packs_to_a_few_bytes() {
        let mut p = Packer::default();
        let g = grid(64, 512, |i| (i % 3) as f32 / 2.0);
        let key = p.pack(0, &g);
        let delta = p.pack(1, &g);
        assert!(key.resident.len() > 10_000, "{}", key.resident.len());
        assert!(delta.resident.len() < 16, "{:?}", delta.resident);
        assert_eq!(delta.base, Some(0));
    }

    #[test]
    fn a_missing_base_or_damage_is_an_error_not_a_wrong_grid() {
        let mut p = Packer::default();
        let g = grid(2, 4, |i| i as f32 / 8.0);
        let _ = p.pack(5, &g);
        let d = p.pack(6, &g);
        let mut u = Unpacker::default();
        let e = u.unpack(6, &d).unwrap_err();
        assert!(e.contains("token record 5"), "{e}");
        let mut bad = d.clone();
        bad.base = None;
        assert!(u.unpack(6, &bad).unwrap_err().contains("key frame"));
        let mut short = Packer::default().pack(0, &g);
        short.n_experts = 5;
        assert!(u.unpack(0, &short).is_err());
        let mut junk = Packer::default().pack(0, &g);
        junk.resident = "!!".into();
        assert!(u.unpack(0, &junk).unwrap_err().contains("base64"));
        let mut rows = Packer::default().pack(0, &g);
        rows.layers.pop();
        assert!(u.unpack(0, &rows).unwrap_err().contains("1 layer indices for 2 rows"));
    }

    #[test]
    fn a_grid_of_a_trace_without_layer_indices_reads_row_r_as_layer_r() {
        let mut packed = serde_json::to_value(Packer::default().pack(0, &grid(3, 2, |_| 1.0))).unwrap();
        assert_eq!(packed["layers"], serde_json::json!([1, 2, 3]));
        packed.as_object_mut().unwrap().remove("layers");
        let old: Packed = serde_json::from_value(packed).unwrap();
        let g = Unpacker::default().unpack(0, &old).unwrap();
        assert!(g.layers.is_empty());
        assert_eq!((0..3).map(|r| g.layer(r)).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn a_grid_of_a_trace_without_read_layers_reads_them_as_not_measured() {
        let mut packed = serde_json::to_value(Packer::default().pack(0, &grid(3, 2, |_| 1.0))).unwrap();
        assert!(packed["read_bytes"].is_string() && packed["read_calls"].is_string(), "{packed}");
        const NEW: [&str; 4] = ["read_bytes", "read_calls", "refault_faults", "refault_io_ns"];
        for k in NEW {
            packed.as_object_mut().unwrap().remove(k);
        }
        let old: Packed = serde_json::from_value(packed).unwrap();
        let g = Unpacker::default().unpack(0, &old).unwrap();
        assert_eq!((g.read_bytes, g.read_calls), (None, None));
        assert_eq!((g.refault_faults, g.refault_io_ns), (None, None));
        // And a grid without them is written without the keys.
        let mut none = grid(3, 2, |_| 1.0);
        none.read_bytes = None;
        none.read_calls = None;
        none.refault_faults = None;
        none.refault_io_ns = None;
        let v = serde_json::to_value(Packer::default().pack(0, &none)).unwrap();
        assert!(NEW.iter().all(|k| v.get(k).is_none()), "{v}");
    }
}
