//! The engine's own expert cache, from the slot table it publishes (`moe_engine_expert_slots`,
//! specified in [`moe_abi::expert_slots`]), read like the dense regions ([`super::anon`]): symbol
//! in the executable, `/proc/PID/mem`, the ABI's seqlock.
//!
//! ## Measurement rules
//! - **In the cache**: the `(layer, expert)` of every `ready` slot of one consistent snapshot of
//!   the table, as grid cells (`row * n_experts + expert`, row = the layer's index among the
//!   model's MoE layers). Experts only in the page cache are the grid's `resident` fractions.
//! - **Reads started** between two snapshots, from the table's version counter `seq` alone. The
//!   engine makes every expert read exactly two updates of the table (the slot taken: `loading`;
//!   its last `pread64` done: `ready`, or `empty` when it failed; `engine/src/cache/slots.rs`),
//!   and each update adds 2 to `seq`. So over an interval `Δseq = 2·started + 2·finished` and
//!   `finished = started − Δloading`, hence `started = (Δseq / 2 + Δloading) / 2`. A new table
//!   (another address or slot count) starts a new baseline (`reads` `None`).
//! - **The observer's hit rate** over the generated tokens between two snapshots:
//!   `1 − min(started, uses) / uses`, `uses = tokens × MoE layers × expert_used_count`: a
//!   generated token asks every MoE layer for `expert_used_count` experts, and the cache reads
//!   each one it does not hold. Not
//!   for intervals with a prompt step (a batch of tokens shares experts the observer cannot
//!   count). With `--prefetch` the reads include prefetched experts, so this is the share of
//!   experts not read, not the engine's `cache_hit_pct`.
//! - **Timing.** Snapshots are taken with the token records' residency sample, when the observer
//!   handles a batch of end marks: the engine may already be in its next token, whose first reads
//!   then count in this interval and not the next (more reads than uses: 0 %). Per token
//!   approximate; the version counter itself is exact: after the last token it says every read
//!   of the run.
//! - **io_uring.** An engine that reads with io_uring hides its offsets from the syscall
//!   tracepoints; this table is then the only source. This engine reads with `pread64`.

use moe_abi::expert_slots::{ExpertSlots, HEADER_SIZE, STATE_LOADING, STATE_READY, SYMBOL, SlotView};
use observer_common::model::EngineCache;

use super::{
    ResidencyError,
    anon::{ExportedSymbol, read_published},
};

/// Reads one process's slot table and keeps the previous snapshot's counters.
#[derive(Debug)]
pub struct SlotTable {
    symbol: ExportedSymbol,
    /// Block index → grid row.
    rows: Vec<Option<u32>>,
    n_experts: u32,
    /// (table address, slot count, seq, loading) of the previous snapshot.
    last: Option<(u64, u64, u64, u32)>,
}

impl SlotTable {
    /// `moe_layers`, `n_experts`: the grid's rows (block indices) and columns.
    pub fn new(pid: u32, moe_layers: &[u32], n_experts: u32) -> SlotTable {
        let n = moe_layers.iter().max().map_or(0, |&m| m as usize + 1);
        let mut rows = vec![None; n];
        for (r, &b) in moe_layers.iter().enumerate() {
            rows[b as usize] = Some(r as u32);
        }
        SlotTable { symbol: ExportedSymbol::new(pid, SYMBOL), rows, n_experts, last: None }
    }

    /// The slots now, with the snapshot's version; `None` when the process does not export the
    /// symbol.
    pub fn read(&mut self) -> Result<Option<(moe_abi::TableHeader, Vec<SlotView>)>, ResidencyError> {
        let Some(addr) = self.symbol.addr()? else { return Ok(None) };
        let pid = self.symbol.pid;
        let mem = self.symbol.mem()?;
        let (h, table) = read_published(&mem, pid, addr, SYMBOL, HEADER_SIZE, ExpertSlots::parse_header)?;
        let slots = table
            .chunks_exact(h.stride as usize)
            .map(SlotView::from_bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ResidencyError::Abi { pid, what: e.to_string() })?;
        Ok(Some((h, slots)))
    }

    /// A snapshot for a token record (`hit_pct` left to the caller, [`hit_pct`]); `None` when
    /// the process publishes no cache (yet).
    pub fn sample(&mut self) -> Result<Option<EngineCache>, ResidencyError> {
        let Some((h, slots)) = self.read()? else { return Ok(None) };
        if h.is_empty() {
            self.last = None;
            return Ok(None);
        }
        let loading = slots.iter().filter(|s| s.state == STATE_LOADING).count() as u32;
        let mut ready: Vec<u32> = slots
            .iter()
            .filter(|s| s.state == STATE_READY && s.expert < self.n_experts)
            .filter_map(|s| Some(self.rows.get(s.layer as usize).copied()?? * self.n_experts + s.expert))
            .collect();
        ready.sort_unstable();
        let reads = match self.last {
            Some((table, count, seq, was_loading)) if table == h.table && count == h.count && h.seq >= seq => {
                let twice = ((h.seq - seq) / 2) as i64 + i64::from(loading) - i64::from(was_loading);
                Some(twice.max(0) as u64 / 2)
            }
            _ => None,
        };
        self.last = Some((h.table, h.count, h.seq, loading));
        Ok(Some(EngineCache { version: h.seq, slots: h.count as u32, loading, ready, reads, hit_pct: None }))
    }
}

/// The observer's hit rate (percent) of `reads` started for `generated` tokens of a model with
/// `moe_layers` MoE layers of `expert_used` experts per token (see the module's rules).
pub fn hit_pct(reads: u64, generated: u64, moe_layers: u64, expert_used: u64) -> Option<f64> {
    let used = generated * moe_layers * expert_used;
    (used > 0).then(|| 100.0 * (1.0 - reads.min(used) as f64 / used as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_the_share_of_experts_not_read() {
        // 2 tokens × 12 layers × 8 experts = 192 uses, 48 reads.
        assert_eq!(hit_pct(48, 2, 12, 8), Some(75.0));
        assert_eq!(hit_pct(0, 0, 12, 8), None);
        // Reads of the next token's first layers in this interval (see Timing): 0 %, not less.
        assert_eq!(hit_pct(5, 1, 2, 2), Some(0.0));
    }
}
