//! Faults: what the stream says about page faults per step, and per-fault
//! latency histograms when the stream carries them.
//!
//! From the token records: faults per step and time per step for each kind,
//! and a *mean* latency = time ÷ count. The pairing is approximate by
//! construction: `fault_minor`/`minflt` is exact in kind; zram swap-ins pair
//! `swapin_zram` (on-CPU decompression) with `majflt_swap`; blocked fault time
//! `fault_io` covers file refaults *and* disk swap, paired with `majflt_file`.
//!
//! Histograms (`Event::Histograms`, cumulative since the start; log2 buckets,
//! `observer_common::hist`): one bar per bucket between the first and last
//! non-empty one, with p50/p99 upper bounds; the vocabulary's kinds first, in
//! its order (`vocab::HISTOGRAMS`).

use observer_common::{
    hist::bucket_upper_ns,
    model::{Component, Counter},
    vocab::HISTOGRAMS,
};
use ratatui::{
    Frame,
    layout::Rect,
    style::{Color, Style},
    text::{Line, Span},
    widgets::Paragraph,
};

use super::{clamp_top, fmt};
use crate::state::{App, View};

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    let w = area.width as usize;
    let mut lines: Vec<Line<'static>> = Vec::new();
    let kind = app.main_kind();
    let g = app.agg(kind);
    lines.push(Line::styled(
        fmt::fit(
            &format!("{:<14}{:>10}  {:<13}{:>9}{:>15}", "faults", "per step", "time", "ms/step", "mean µs/fault"),
            w,
        ),
        fmt::title(),
    ));
    // Each kind of fault beside the component that holds its time.
    let table = [
        (Counter::Minflt, Component::FaultMinor),
        (Counter::MajfltSwap, Component::SwapinZram),
        (Counter::MajfltFile, Component::FaultIo),
    ];
    for (counter, comp) in table {
        let count = g.counter(counter).mean();
        let time = g.component(comp).mean();
        let mean_us = match (count, time) {
            (Some(c), Some(t)) if c > 0.0 => format!("{:.2}", t / c / 1e3),
            (Some(_), Some(_)) => "no faults".into(),
            _ => fmt::NA.into(),
        };
        lines.push(Line::from(vec![
            Span::styled("█ ", Style::new().fg(fmt::color(comp))),
            Span::raw(fmt::fit(
                &format!(
                    "{:<12}{:>10}  {:<13}{:>9}{:>15}",
                    counter.name(),
                    fmt::opt_count(count),
                    comp.name(),
                    fmt::opt_ms(time),
                    mean_us
                ),
                w.saturating_sub(2),
            )),
        ]));
    }
    lines.push(Line::styled(
        fmt::fit(
            &format!(
                "swapins {} · read_bytes {} per step · means are time ÷ count (fault_io includes disk swap)",
                fmt::opt_count(g.counter(Counter::Swapins).mean()),
                fmt::opt_bytes(g.counter(Counter::ReadBytes).mean())
            ),
            w,
        ),
        fmt::dim(),
    ));
    lines.push(Line::raw(""));
    match &app.latency {
        None => {
            lines.push(Line::styled("Latency histograms: none received yet", fmt::title()));
            lines.push(Line::styled(
                fmt::fit("the observer sends them with each memory sample (procfs mode has none)", w),
                fmt::dim(),
            ));
        }
        Some(hs) => {
            lines.push(Line::styled("Latency per event (log2 buckets, since the start)", fmt::title()));
            let known = HISTOGRAMS.iter().filter_map(|r| hs.kinds.get(r.name).map(|b| (r.name, r.help, b)));
            let other = hs
                .kinds
                .iter()
                .filter(|(k, _)| !HISTOGRAMS.iter().any(|r| r.name == k.as_str()))
                .map(|(k, b)| (k.as_str(), "", b));
            for (name, what, buckets) in known.chain(other) {
                lines.extend(histogram(name, what, buckets, w));
            }
        }
    }
    let rows = area.height as usize;
    let top = clamp_top(app.table_offset[View::Faults.index()], lines.len(), rows);
    f.render_widget(Paragraph::new(lines).scroll((top as u16, 0)), area);
}

/// Smallest bucket upper bound below which `q` of the counts fall.
fn quantile_bound(b: &[u64], q: f64) -> Option<usize> {
    let total: u64 = b.iter().sum();
    if total == 0 {
        return None;
    }
    let want = (q * total as f64).ceil() as u64;
    let mut cum = 0;
    for (i, &n) in b.iter().enumerate() {
        cum += n;
        if cum >= want.max(1) {
            return Some(i);
        }
    }
    Some(b.len() - 1)
}

fn bound(i: usize) -> String {
    bucket_upper_ns(i).map_or_else(|| "+Inf".into(), |ns| format!("≤{}", fmt::duration_ns(ns)))
}

fn histogram(name: &str, what: &str, buckets: &[u64], w: usize) -> Vec<Line<'static>> {
    let total: u64 = buckets.iter().sum();
    let mut out = Vec::new();
    let what = if what.is_empty() { String::new() } else { format!(" · {what}") };
    let (Some(first), Some(last)) = (buckets.iter().position(|&n| n > 0), buckets.iter().rposition(|&n| n > 0)) else {
        out.push(Line::styled(fmt::fit(&format!("  {name}: no events{what}"), w), fmt::dim()));
        return out;
    };
    let q = |p| quantile_bound(buckets, p).map(bound).unwrap_or_default();
    let name = format!("  {name}");
    let rest = format!("  n={total}  p50 {}  p99 {}{what}", q(0.5), q(0.99));
    out.push(Line::from(vec![
        Span::styled(name.clone(), fmt::title()),
        Span::styled(fmt::fit(&rest, w.saturating_sub(name.chars().count())), fmt::dim()),
    ]));
    let max = buckets[first..=last].iter().copied().max().unwrap_or(1).max(1);
    let label_w = 12;
    let count_w = 10;
    let bar_w = w.saturating_sub(label_w + count_w + 4);
    for (i, &n) in buckets.iter().enumerate().take(last + 1).skip(first) {
        let len = ((n as f64 / max as f64) * bar_w as f64).round() as usize;
        let len = if n > 0 { len.max(1) } else { 0 };
        out.push(Line::from(vec![
            Span::styled(format!("  {:>label_w$} ", bound(i)), fmt::dim()),
            Span::styled("█".repeat(len), Style::new().fg(Color::Cyan)),
            Span::raw(format!("{:>pad$} {n:>count_w$}", "", pad = bar_w - len)),
        ]));
    }
    out
}
