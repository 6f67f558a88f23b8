//! Per-token output of `observer run`: one line per token while running and a
//! summary at the end (mean ms per token per component, tok/s, faults and
//! swap-ins per token, bytes read per token, the hidden cost
//! `engine_compute − compute`).
//!
//! tok/s is `tokens / Σ wall` over generated tokens (or over all records when
//! the run has no engine markers), the definition users already apply.

use std::io::Write;

use observer_common::{
    model::{Component, Counter, StepKind, TokenRecord},
    vocab::Time,
};
use serde::Serialize;

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Counters on the per-token lines.
const LINE_COUNTERS: [Counter; 5] =
    [Counter::MajfltFile, Counter::MajfltSwap, Counter::Minflt, Counter::Swapins, Counter::ReadBytes];

/// Header for [`line`]: the vocabulary's short labels, for the components this
/// observer measures (`Component::measured`).
pub fn header() -> String {
    let mut s = format!("{:>6} {:<6} {:>8}", "tok", "kind", Time::Wall.short());
    for c in Component::measured() {
        s.push_str(&format!(" {:>8}", c.short()));
    }
    s.push_str(&format!(
        " {:>7} {:>8} {:>8} |",
        Time::Residual.short(),
        Time::EngineCompute.short(),
        Time::Hidden.short()
    ));
    for c in LINE_COUNTERS {
        s.push_str(&format!(" {:>7}", c.short()));
    }
    s.push_str("\n(ms per token, read in MB; components are the mean over the threads that ran; - not measured)");
    s
}

fn opt_ms(v: Option<u64>) -> String {
    v.map(|v| format!("{:.2}", ms(v))).unwrap_or_else(|| "-".into())
}

/// One line per token.
pub fn line(t: &TokenRecord) -> String {
    let idx = t.index.unwrap_or(t.seq);
    let mut s = format!("{:>6} {:<6} {:>8.2}", idx, t.kind.row().short, ms(t.wall_ns));
    for c in Component::measured() {
        s.push_str(&format!(" {:>8}", opt_ms(t.components.get(c))));
    }
    let hidden = t.hidden_ns().map(|h| format!("{:.2}", h as f64 / 1e6)).unwrap_or_else(|| "-".into());
    s.push_str(&format!(" {:>7.2} {:>8} {:>8} |", t.residual_ns as f64 / 1e6, opt_ms(t.engine_compute_ns), hidden));
    for c in LINE_COUNTERS {
        let v = t.counters.get(c);
        let v = if c == Counter::ReadBytes {
            v.map(|b| format!("{:.2}", b as f64 / 1e6))
        } else {
            v.map(|n| n.to_string())
        };
        s.push_str(&format!(" {:>7}", v.unwrap_or_else(|| "-".into())));
    }
    if t.lost_events > 0 {
        s.push_str(&format!(" \x1b[31mlost {}\x1b[0m", t.lost_events));
    }
    s
}

/// Means over the summarised tokens, in the design's vocabulary (ns, counts).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// All token records (prompt steps included).
    pub records: u64,
    pub prompt_steps: u64,
    /// Records summarised below: generated tokens, or all when none is marked as such.
    pub summarised: u64,
    pub tokens: u64,
    /// tokens / Σ wall of the summarised records.
    pub tok_s: Option<f64>,
    /// Mean per token: `wall_ns`, each `<component>_ns`, `residual_ns`,
    /// `engine_compute_ns`, `hidden_ns`.
    pub mean_ns: std::collections::BTreeMap<String, f64>,
    /// Mean per token of each counter.
    pub per_token: std::collections::BTreeMap<String, f64>,
    pub lost_events: u64,
}

pub fn summarise(records: &[TokenRecord]) -> Summary {
    let gen_: Vec<&TokenRecord> = records.iter().filter(|t| t.kind == StepKind::Generate).collect();
    let set: Vec<&TokenRecord> =
        if gen_.is_empty() { records.iter().filter(|t| t.kind != StepKind::Prompt).collect() } else { gen_ };
    let mut s = Summary {
        records: records.len() as u64,
        prompt_steps: records.iter().filter(|t| t.kind == StepKind::Prompt).count() as u64,
        summarised: set.len() as u64,
        lost_events: records.iter().map(|t| t.lost_events).sum(),
        ..Summary::default()
    };
    if set.is_empty() {
        return s;
    }
    let n = set.len() as f64;
    let wall: u64 = set.iter().map(|t| t.wall_ns).sum();
    // Windows are not tokens: no token rate for them.
    if set.iter().all(|t| t.kind != StepKind::Window) {
        let tokens: u64 = set.iter().map(|t| t.n_tokens).sum();
        s.tokens = tokens;
        s.tok_s = (wall > 0).then(|| tokens as f64 / (wall as f64 / 1e9));
    }
    let mean = |f: &dyn Fn(&TokenRecord) -> Option<f64>| -> Option<f64> {
        let v: Vec<f64> = set.iter().filter_map(|t| f(t)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    s.mean_ns.insert(Time::Wall.json_key().into(), wall as f64 / n);
    for c in Component::ALL {
        if let Some(m) = mean(&|t| t.components.get(c).map(|v| v as f64)) {
            s.mean_ns.insert(c.json_key().into(), m);
        }
    }
    s.mean_ns.insert(Time::Residual.json_key().into(), set.iter().map(|t| t.residual_ns as f64).sum::<f64>() / n);
    if let Some(m) = mean(&|t| t.engine_compute_ns.map(|v| v as f64)) {
        s.mean_ns.insert(Time::EngineCompute.json_key().into(), m);
    }
    if let Some(m) = mean(&|t| t.hidden_ns().map(|v| v as f64)) {
        s.mean_ns.insert(Time::Hidden.json_key().into(), m);
    }
    for c in Counter::ALL {
        if let Some(m) = mean(&|t| t.counters.get(c).map(|v| v as f64)) {
            s.per_token.insert(c.json_key().into(), m);
        }
    }
    s
}

impl Summary {
    pub fn print(&self, out: &mut impl Write) -> std::io::Result<()> {
        if self.summarised == 0 {
            return Ok(());
        }
        writeln!(
            out,
            "tokens: {} records ({} prompt steps); summary over {} records, {} tokens: {} tok/s (tokens / Σ wall)",
            self.records,
            self.prompt_steps,
            self.summarised,
            self.tokens,
            self.tok_s.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into())
        )?;
        let g = |k: &str| self.mean_ns.get(k).map(|v| format!("{:.3}", v / 1e6)).unwrap_or_else(|| "-".into());
        write!(out, "mean ms/token: {} {}", Time::Wall.name(), g(Time::Wall.json_key()))?;
        for c in Component::ALL.into_iter().filter(|c| c.row().measured() || self.mean_ns.contains_key(c.json_key())) {
            write!(out, ", {} {}", c.name(), g(c.json_key()))?;
        }
        writeln!(out, ", {} {}", Time::Residual.name(), g(Time::Residual.json_key()))?;
        if self.mean_ns.contains_key(Time::EngineCompute.json_key()) {
            writeln!(
                out,
                "engine's own compute (a residual): {} ms/token; measured compute: {} ms/token; hidden cost: {} ms/token",
                g(Time::EngineCompute.json_key()),
                g(Component::Compute.json_key()),
                g(Time::Hidden.json_key())
            )?;
        }
        write!(out, "per token:")?;
        for (i, c) in LINE_COUNTERS.into_iter().enumerate() {
            let v = self.per_token.get(c.json_key());
            let v = if c == Counter::ReadBytes {
                v.map(|v| format!("{:.3} MB", v / 1e6))
            } else {
                v.map(|v| format!("{v:.1}"))
            };
            write!(out, "{} {} {}", if i == 0 { "" } else { "," }, c.name(), v.unwrap_or_else(|| "-".into()))?;
        }
        writeln!(out)?;
        Ok(())
    }
}
