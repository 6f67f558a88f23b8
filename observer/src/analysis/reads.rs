//! A run's explicit reads of the model file, per kind of region and per routed expert
//! (`observer heatmap --trace`, and `--pid` over its refreshes).
//!
//! Rule: the sums, over the run's token (or window) records that carry `explicit_reads` (rule of
//! the field: `observer_common::xread`), of its per-kind bytes, times and calls, its unresolved
//! and lost bytes, and of its per-expert bytes and calls (`explicit_reads.experts`). These cover
//! every step the observer closed, also the ones that carry no grid (the grid's `read_bytes` and
//! `read_calls` layers are the same records folded into cells at each residency sample).
//! Per-expert names are the grid layers' (`vocab::GRID_LAYERS`).

use std::collections::BTreeMap;

use observer_common::{
    model::{ExplicitReads, ReadKinds, TokenRecord},
    vocab::{G_READ_BYTES, G_READ_CALLS, GRID_LAYERS},
};
use serde_json::{Value, json};

/// One routed expert's explicit reads over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertReads {
    /// The block index (`blk.N`).
    pub layer: u32,
    pub expert: u32,
    pub read_bytes: u64,
    pub read_calls: u64,
}

/// A run's explicit reads (module rule).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunReads {
    /// Records in the run, and those that carried explicit reads.
    pub records: u64,
    pub measured: u64,
    pub bytes: ReadKinds,
    pub ns: ReadKinds,
    pub calls: ReadKinds,
    pub unresolved_bytes: u64,
    pub unresolved_calls: u64,
    pub lost_bytes: u64,
    /// By layer, then expert; only experts that were read.
    pub experts: Vec<ExpertReads>,
}

fn add(a: &mut ReadKinds, b: &ReadKinds) {
    for (x, y) in a.0.iter_mut().zip(b.0) {
        *x += y;
    }
}

impl RunReads {
    pub fn of<'a>(tokens: impl IntoIterator<Item = &'a TokenRecord>) -> RunReads {
        RunReads::of_spans(tokens.into_iter().map(|t| t.explicit_reads.as_ref()))
    }

    /// The same sums over spans (`observer_common::xread`, "Spans"; `None`: a span that did not
    /// measure them), e.g. the refreshes of `observer heatmap --pid`.
    pub fn of_spans<'a>(spans: impl IntoIterator<Item = Option<&'a ExplicitReads>>) -> RunReads {
        let mut r = RunReads::default();
        let mut experts: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
        for x in spans {
            r.records += 1;
            let Some(x) = x else { continue };
            r.measured += 1;
            add(&mut r.bytes, &x.bytes);
            add(&mut r.ns, &x.ns);
            add(&mut r.calls, &x.calls);
            r.unresolved_bytes += x.unresolved_bytes;
            r.unresolved_calls += x.unresolved_calls;
            r.lost_bytes += x.lost_bytes;
            for e in &x.experts {
                let s = experts.entry((e.layer, e.expert)).or_default();
                s.0 += e.bytes;
                s.1 += u64::from(e.calls);
            }
        }
        r.experts = experts
            .into_iter()
            .map(|((layer, expert), (read_bytes, read_calls))| ExpertReads { layer, expert, read_bytes, read_calls })
            .collect();
        r
    }

    /// `{"records", "measured", "bytes", "ns", "calls" (per kind, as in the token records),
    /// "unresolved_bytes", "unresolved_calls", "lost_bytes", "experts": [{"layer", "expert",
    /// "read_bytes", "read_calls"}]}`.
    pub fn to_json(&self) -> Value {
        let (rb, rc) = (GRID_LAYERS[G_READ_BYTES].json, GRID_LAYERS[G_READ_CALLS].json);
        let experts: Vec<Value> = self
            .experts
            .iter()
            .map(|e| {
                let mut v = json!({"layer": e.layer, "expert": e.expert});
                v[rb] = json!(e.read_bytes);
                v[rc] = json!(e.read_calls);
                v
            })
            .collect();
        json!({
            "records": self.records,
            "measured": self.measured,
            "bytes": self.bytes,
            "ns": self.ns,
            "calls": self.calls,
            "unresolved_bytes": self.unresolved_bytes,
            "unresolved_calls": self.unresolved_calls,
            "lost_bytes": self.lost_bytes,
            "experts": experts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::model::ExpertRead;

    fn rec(seq: u64, reads: Option<ExplicitReads>) -> TokenRecord {
        let mut t = crate::store::trace::tests::token(seq);
        t.explicit_reads = reads;
        t
    }

    #[test]
    fn reads_add_up_per_kind_and_per_expert_over_the_records() {
        let r = |layer, expert, bytes, calls| ExpertRead { layer, expert, bytes, calls };
        let x = |experts: Vec<ExpertRead>, unresolved| ExplicitReads {
            bytes: ReadKinds([1, experts.iter().map(|e| e.bytes).sum(), 2]),
            calls: ReadKinds([1, experts.iter().map(|e| u64::from(e.calls)).sum(), 1]),
            unresolved_bytes: unresolved,
            experts,
            ..Default::default()
        };
        let tokens = [
            rec(0, Some(x(vec![r(1, 5, 100, 1), r(2, 0, 10, 2)], 7))),
            rec(1, None),
            rec(2, Some(x(vec![r(1, 5, 50, 1)], 0))),
        ];
        let s = RunReads::of(&tokens);
        assert_eq!((s.records, s.measured, s.unresolved_bytes), (3, 2, 7));
        assert_eq!(s.bytes, ReadKinds([2, 160, 4]));
        assert_eq!(s.calls, ReadKinds([2, 4, 2]));
        let e = |layer, expert, read_bytes, read_calls| ExpertReads { layer, expert, read_bytes, read_calls };
        assert_eq!(s.experts, [e(1, 5, 150, 2), e(2, 0, 10, 2)]);
        let v = s.to_json();
        assert_eq!(v["experts"][0], json!({"layer": 1, "expert": 5, "read_bytes": 150, "read_calls": 2}));
        assert_eq!(v["bytes"], json!({"dense": 2, "experts": 160, "other": 4}));
    }
}
