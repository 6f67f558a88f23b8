//! A run's evictions and what they cost, per routed expert (`observer heatmap --trace`): which
//! evicted experts the engine paid for in `fault_io`, beside who evicted.
//!
//! Rule: per grid cell, the sums over the run's records that carry a grid of its `evicted`,
//! `refault_faults` and `refault_io_ns` layers (each grid counts the steps since the previous
//! one, so the sums cover the run up to its last grid; rule of the refault layers:
//! `observer_common::evict`, refault cost per region). Per kind of the eviction, the sums over
//! every record of `evicted_by` and `refaults` (the token records' split). Who evicted: the
//! per-process rows of the run's last process sample (`evicted_by_process`, cumulative). Over the
//! run, the refault layers summed over the cells are at most the records' refault faults and
//! `fault_io` summed over the kinds (the rest is the dense tensors', shared experts' and the
//! header's refaults), and equal to them when every refault fault is an expert's and the last
//! grid came after the last one closed.

use observer_common::{
    model::{EvictedBy, ProcessEvictions, TokenRecord},
    vocab::{EVICTION_ACTORS, G_EVICTED, G_REFAULT_FAULTS, G_REFAULT_IO, GRID_LAYERS},
};
use serde_json::{Value, json};

/// One routed expert's evictions and refault cost over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertRefaults {
    /// The block index (`blk.N`).
    pub layer: u32,
    pub expert: u32,
    /// Pages evicted (churn; by anyone).
    pub evicted: u64,
    pub refault_faults: u64,
    pub refault_io_ns: u64,
}

/// A run's refault cost (module rule).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunRefaults {
    /// Records in the run, those that carried a grid with the refault layers, and those that
    /// carried the per-kind refaults.
    pub records: u64,
    pub grids: u64,
    pub measured: u64,
    /// Per kind of the eviction: pages evicted, and the refaults (pages, faults, `fault_io` ns).
    pub evicted_by: EvictedBy,
    pub refaulted_pages: EvictedBy,
    pub refault_faults: EvictedBy,
    pub refault_io_ns: EvictedBy,
    /// Who evicted, per process (the last process sample's rows).
    pub evicted_by_process: Vec<ProcessEvictions>,
    /// Experts with a refault fault or an eviction: most `fault_io` first, then most evicted pages,
    /// then by layer and expert.
    pub experts: Vec<ExpertRefaults>,
}

fn add(a: &mut EvictedBy, b: &EvictedBy) {
    for (x, y) in a.0.iter_mut().zip(b.0) {
        *x += y;
    }
}

impl RunRefaults {
    pub fn of<'a>(
        tokens: impl IntoIterator<Item = &'a TokenRecord>,
        last_process: Option<&[ProcessEvictions]>,
    ) -> RunRefaults {
        let mut r = RunRefaults { evicted_by_process: last_process.unwrap_or_default().to_vec(), ..Default::default() };
        // (layer, expert) → (evicted, faults, io); the grid's shape is the model's, fixed in a run.
        let mut cells: Vec<((u32, u32), [u64; 3])> = Vec::new();
        for t in tokens {
            r.records += 1;
            if let Some(e) = &t.evicted_by {
                add(&mut r.evicted_by, e);
            }
            if let Some(x) = &t.refaults {
                r.measured += 1;
                add(&mut r.refaulted_pages, &x.pages);
                add(&mut r.refault_faults, &x.faults);
                add(&mut r.refault_io_ns, &x.fault_io_ns);
            }
            let Some(g) = t.residency.as_ref().and_then(|x| x.grid.as_ref()) else { continue };
            let (Some(f), Some(io)) = (&g.refault_faults, &g.refault_io_ns) else { continue };
            r.grids += 1;
            let n = g.n_layers as usize * g.n_experts as usize;
            if cells.len() != n {
                cells = (0..n)
                    .map(|i| ((g.layer(i / g.n_experts as usize), (i % g.n_experts as usize) as u32), [0; 3]))
                    .collect();
            }
            for (i, c) in cells.iter_mut().enumerate() {
                c.1[0] += g.evicted.as_ref().and_then(|v| v.get(i)).copied().map_or(0, u64::from);
                c.1[1] += f.get(i).copied().map_or(0, u64::from);
                c.1[2] += io.get(i).copied().unwrap_or(0);
            }
        }
        r.experts = cells
            .into_iter()
            .filter(|(_, v)| v.iter().any(|&x| x > 0))
            .map(|((layer, expert), [evicted, refault_faults, refault_io_ns])| ExpertRefaults {
                layer,
                expert,
                evicted,
                refault_faults,
                refault_io_ns,
            })
            .collect();
        r.experts.sort_by(|a, b| {
            (b.refault_io_ns, b.evicted)
                .cmp(&(a.refault_io_ns, a.evicted))
                .then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
        });
        r
    }

    /// The refault faults and `fault_io` ns summed over the experts.
    pub fn experts_total(&self) -> (u64, u64) {
        self.experts.iter().fold((0, 0), |a, e| (a.0 + e.refault_faults, a.1 + e.refault_io_ns))
    }

    /// `{"records", "grids", "measured", "evicted_by", "refaulted_by", "refault_faults_by",
    /// "refault_io_ns_by" (per kind, as in the token records), "evicted_by_process", "experts":
    /// [{"layer", "expert", "evicted", "refault_faults", "refault_io_ns"}] (the grid layers'
    /// names, most `fault_io` first)}`.
    pub fn to_json(&self) -> Value {
        let keys = [G_EVICTED, G_REFAULT_FAULTS, G_REFAULT_IO].map(|k| GRID_LAYERS[k].json);
        let experts: Vec<Value> = self
            .experts
            .iter()
            .map(|e| {
                let mut v = json!({"layer": e.layer, "expert": e.expert});
                for (k, x) in keys.iter().zip([e.evicted, e.refault_faults, e.refault_io_ns]) {
                    v[*k] = json!(x);
                }
                v
            })
            .collect();
        json!({
            "records": self.records,
            "grids": self.grids,
            "measured": self.measured,
            "evicted_by": self.evicted_by,
            "refaulted_by": self.refaulted_pages,
            "refault_faults_by": self.refault_faults,
            "refault_io_ns_by": self.refault_io_ns,
            "evicted_by_process": self.evicted_by_process,
            "experts": experts,
        })
    }

    /// The terminal table: per kind, then who evicted, then the `top` costliest experts.
    pub fn render(&self, top: usize) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let ms = |ns: u64| ns as f64 / 1e6;
        let _ = writeln!(
            s,
            "evictions of the model and what they cost ({} of {} records measured them, {} grids):",
            self.measured, self.records, self.grids
        );
        let _ = writeln!(
            s,
            "  {:<14} {:>10} {:>10} {:>9} {:>12}",
            "evicted by", "pages", "refaulted", "faults", "fault_io"
        );
        for (k, row) in EVICTION_ACTORS.iter().enumerate() {
            let v =
                [self.evicted_by.0[k], self.refaulted_pages.0[k], self.refault_faults.0[k], self.refault_io_ns.0[k]];
            if v.iter().all(|&x| x == 0) {
                continue;
            }
            let _ = writeln!(s, "  {:<14} {:>10} {:>10} {:>9} {:>9.3} ms", row.name, v[0], v[1], v[2], ms(v[3]));
        }
        if !self.evicted_by_process.is_empty() {
            let _ = writeln!(s, "  who evicted (processes, pages):");
            for p in &self.evicted_by_process {
                let _ = writeln!(s, "    {:<14} {:>8} {:<16} {:>10}", p.kind, p.pid, p.comm, p.pages);
            }
        }
        let (f, io) = self.experts_total();
        let (rf, rio) = (&GRID_LAYERS[G_REFAULT_FAULTS], &GRID_LAYERS[G_REFAULT_IO]);
        let _ = writeln!(
            s,
            "{} experts evicted or refaulted; {} refault faults, {:.3} ms of fault_io on experts; costliest first ({}: {}; {}: {}):",
            self.experts.len(),
            f,
            ms(io),
            rf.name,
            rf.help,
            rio.name,
            rio.help
        );
        let ev = GRID_LAYERS[G_EVICTED].short;
        let _ = writeln!(s, "{:>6} {:>7} {:>10} {:>8} {:>12}", "layer", "expert", ev, rf.short, "rf_io ms");
        for e in self.experts.iter().take(top) {
            let _ = writeln!(
                s,
                "{:>6} {:>7} {:>10} {:>8} {:>12.3}",
                e.layer,
                e.expert,
                e.evicted,
                e.refault_faults,
                ms(e.refault_io_ns)
            );
        }
        if self.experts.len() > top {
            let _ = writeln!(s, "  … {} more (--json lists all)", self.experts.len() - top);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::model::{ExpertGrid, Refaults, Residency};

    fn rec(seq: u64, grid: Option<(Vec<u32>, Vec<u32>, Vec<u64>)>, refaults: Option<Refaults>) -> TokenRecord {
        let mut t = crate::store::trace::tests::token(seq);
        t.refaults = refaults;
        t.residency = grid.map(|(evicted, faults, io)| Residency {
            grid: Some(ExpertGrid {
                n_layers: 2,
                n_experts: 2,
                layers: vec![3, 4],
                resident: vec![0.0; 4],
                evicted: Some(evicted),
                refault_faults: Some(faults),
                refault_io_ns: Some(io),
                ..Default::default()
            }),
            ..Default::default()
        });
        t
    }

    #[test]
    fn refault_cost_adds_up_per_expert_over_the_grids_and_per_kind_over_the_records() {
        let mut k = Refaults::default();
        k.faults.0[4] = 3;
        k.fault_io_ns.0[4] = 700;
        k.pages.0[4] = 5;
        let tokens = [
            rec(0, Some((vec![1, 0, 0, 0], vec![0, 2, 0, 0], vec![0, 500, 0, 0])), Some(k)),
            rec(1, None, Some(Refaults::default())),
            rec(2, Some((vec![0, 0, 9, 0], vec![1, 0, 0, 0], vec![0, 0, 0, 0])), None),
            rec(3, Some((vec![0, 0, 0, 0], vec![0, 0, 0, 0], vec![200, 0, 0, 0])), None),
        ];
        let r = RunRefaults::of(&tokens, None);
        assert_eq!((r.records, r.grids, r.measured), (4, 3, 2));
        assert_eq!((r.refault_faults.0[4], r.refault_io_ns.0[4], r.refaulted_pages.0[4]), (3, 700, 5));
        let e = |layer, expert, evicted, refault_faults, refault_io_ns| ExpertRefaults {
            layer,
            expert,
            evicted,
            refault_faults,
            refault_io_ns,
        };
        // Most fault_io first, then most evicted; the cell that was only evicted is listed too.
        assert_eq!(r.experts, [e(3, 1, 0, 2, 500), e(3, 0, 1, 1, 200), e(4, 0, 9, 0, 0)]);
        assert_eq!(r.experts_total(), (3, 700));
        let v = r.to_json();
        assert_eq!(
            v["experts"][0],
            json!({"layer": 3, "expert": 1, "evicted": 0, "refault_faults": 2, "refault_io_ns": 500})
        );
        assert_eq!(v["refault_io_ns_by"]["fadvise"], 700);
        let text = r.render(2);
        assert!(text.contains("fadvise") && text.contains("… 1 more"), "{text}");
    }
}
