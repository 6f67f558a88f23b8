//! `engine inspect`: a human-readable dump of a GGUF file (metadata, tensor table, byte
//! ranges, and each routed expert's contiguous byte range per tensor).

use std::fmt::Write as _;

use crate::gguf::Gguf;

/// Renders the report; `experts` also lists every expert's byte range.
pub fn report(g: &Gguf, experts: bool) -> String {
    let mut s = String::new();
    let arch = g.architecture().unwrap_or("?");
    let _ = writeln!(s, "file: {}", g.path().display());
    let _ = writeln!(
        s,
        "gguf v{}, {} tensors, {} metadata keys, alignment {}, data at {:#x}, {} bytes",
        g.version,
        g.tensors.len(),
        g.metadata.len(),
        g.alignment,
        g.data_offset,
        g.bytes().len()
    );
    let _ = writeln!(s, "architecture: {arch}");
    let _ = writeln!(s, "\nmetadata:");
    for (k, v) in &g.metadata {
        let _ = writeln!(s, "  {k} = {}", v.summary());
    }
    let (mut dense, mut routed) = (0u64, 0u64);
    let _ = writeln!(s, "\ntensors:");
    let _ = writeln!(s, "  {:<36} {:<6} {:<22} {:>14} {:>14}", "name", "type", "shape", "offset", "bytes");
    for t in &g.tensors {
        let shape = format!("{:?}", t.dims);
        let _ = writeln!(s, "  {:<36} {:<6} {:<22} {:>14} {:>14}", t.name, t.ty.name(), shape, t.offset, t.size);
        if t.is_routed_expert() {
            routed += t.size;
            if experts {
                for e in 0..t.n_slices() {
                    if let Some(r) = t.slice_range(e) {
                        let _ = writeln!(s, "      expert {e:>4}: {}..{} ({} bytes)", r.start, r.end, r.end - r.start);
                    }
                }
            } else if let (Some(r0), Some(r1)) = (t.slice_range(0), t.slice_range(1)) {
                let _ = writeln!(
                    s,
                    "      {} experts × {} bytes; expert e = {} + e·{} .. +{}",
                    t.n_slices(),
                    r0.end - r0.start,
                    r0.start,
                    r1.start - r0.start,
                    r0.end - r0.start
                );
            }
        } else {
            dense += t.size;
        }
    }
    let _ = writeln!(s, "\ndense bytes: {dense} ({:.1} MiB)", dense as f64 / (1 << 20) as f64);
    let _ = writeln!(s, "routed expert bytes: {routed} ({:.1} MiB)", routed as f64 / (1 << 20) as f64);
    s
}
