//! Heatmap: the layer × expert residency grid of the latest step that carried
//! one. A cell's shade is the resident fraction of that expert's bytes
//! (`·` none, `░` < 25 %, `▒` < 50 %, `▓` < 75 %, `█` from 75 %); its colour
//! marks churn within the last [`CHURN_WINDOW`] steps: green where pages were
//! added, red where evicted, yellow where both. When the grid is wider or
//! taller than the screen, a cell stands for several experts or layers (mean
//! residency, any churn) and the header says how many. A row is labelled with
//! its layer, the block index of its first grid row (`ExpertGrid::layer`: a
//! model with leading dense layers starts above 0).
//!
//! With an engine that publishes its expert cache (`residency.engine_cache`), a cell whose
//! expert is ready in one of its slots has a blue background (a binned cell: any of its
//! experts), and a line above the grid gives the cache's slots and the hit rates of its last
//! snapshot: the observer's (from the slot table's version counter;
//! `observer::capture::residency::slots`) beside the engine's own `cache_hit_pct`, and the
//! observer's mean over the run.
//!
//! `r` switches the cells to the explicit reads (`read_bytes` and `read_calls` of the grids,
//! `vocab::GRID_LAYERS`, whose short labels the header and the legend use): a cell's shade is the
//! bytes read of that expert over the run relative to the most-read expert's (`·` none, `░` < 25 %,
//! … `█` from 75 %; a binned cell: the sum of its experts against the largest such sum), cyan
//! where it was read within the last [`CHURN_WINDOW`] steps. The line above the grid gives the
//! bytes and calls of the grid's last step and of the run.
//!
//! `f` switches the cells to the refault cost (`refault_faults` and `refault_io_ns` of the grids):
//! a cell's shade is the `fault_io` time its refault faults cost over the run relative to the
//! costliest expert's (binned cells: sums, as for reads), red where it was refaulted within the last
//! [`CHURN_WINDOW`] steps. The line above the grid gives the faults and time of the grid's last
//! step and of the run, beside the run's evicted pages; the Summary's "who evicted" table names the actors.

use ratatui::{
    Frame,
    layout::Rect,
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::Paragraph,
};

use observer_common::vocab::{G_READ_BYTES, G_READ_CALLS, G_REFAULT_FAULTS, G_REFAULT_IO, GRID_LAYERS};

use super::fmt;
use crate::state::{App, CHURN_WINDOW, Heat, HeatLayer};

/// The colour of a cell read within the last [`CHURN_WINDOW`] steps (reads layer).
pub const READ_RECENTLY: Color = Color::Cyan;

/// The colour of a cell refaulted within the last [`CHURN_WINDOW`] steps (refault-cost layer).
pub const REFAULTED_RECENTLY: Color = Color::Red;

/// The background of a cell whose expert is in the engine's own cache.
pub const ENGINE_CACHE_BG: Color = Color::Blue;

/// Columns for the `L 12 ` row label.
const LABEL_W: usize = 6;

pub fn shade(frac: f32) -> char {
    if frac <= 0.0 {
        '·'
    } else if frac < 0.25 {
        '░'
    } else if frac < 0.5 {
        '▒'
    } else if frac < 0.75 {
        '▓'
    } else {
        '█'
    }
}

fn churn_style(added: bool, evicted: bool) -> Style {
    match (added, evicted) {
        (true, true) => Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD),
        (true, false) => Style::new().fg(Color::Green).add_modifier(Modifier::BOLD),
        (false, true) => Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        (false, false) => Style::new().fg(Color::Gray),
    }
}

/// The reads layer's header line and its legend (with the hint), or why it has none.
fn reads_lines(h: &Heat, w: usize) -> (Line<'static>, Line<'static>) {
    let (rb, rc) = (GRID_LAYERS[G_READ_BYTES].short, GRID_LAYERS[G_READ_CALLS].short);
    if !h.reads_measured {
        return (
            Line::raw(fmt::fit(&format!("explicit reads ({rb}, {rc}): not measured · r: residency"), w)),
            Line::styled(
                fmt::fit("no grid carried per-expert reads (the target read no model bytes with read/pread)", w),
                fmt::dim(),
            ),
        );
    }
    let (sb, sc) = h.step_reads.unwrap_or_default();
    let (b, c) = h.run_reads;
    (
        Line::raw(fmt::fit(
            &format!(
                "explicit reads ({rb}, {rc}) at step #{}: {} in {} calls · run {} in {} calls",
                h.grid_seq,
                fmt::bytes(sb as f64),
                fmt::int(sc),
                fmt::bytes(b as f64),
                fmt::int(c)
            ),
            w,
        )),
        Line::from(vec![
            Span::raw(format!("{rb} over the run vs max: · 0 ░ <25% ▒ <50% ▓ <75% █ ≥75%  ")),
            Span::styled("■ read", Style::new().fg(READ_RECENTLY).add_modifier(Modifier::BOLD)),
            Span::raw(format!(" (last {CHURN_WINDOW} steps) · r: residency")),
        ]),
    )
}

/// The refault-cost layer's header line and its legend, or why it has none.
fn refault_lines(h: &Heat, w: usize) -> (Line<'static>, Line<'static>) {
    let (rf, rio) = (GRID_LAYERS[G_REFAULT_FAULTS].short, GRID_LAYERS[G_REFAULT_IO].short);
    if !h.refaults_measured {
        return (
            Line::raw(fmt::fit(&format!("refault cost ({rf}, {rio}): not measured · f: residency"), w)),
            Line::styled(
                fmt::fit("no grid carried refault costs (eviction blame needs a model file and eBPF)", w),
                fmt::dim(),
            ),
        );
    }
    let (sf, sio) = h.step_refaults.unwrap_or_default();
    let (rf_n, rf_io) = h.run_refaults;
    let ms = |ns: u64| format!("{:.3} ms", ns as f64 / 1e6);
    (
        Line::raw(fmt::fit(
            &format!(
                "refault cost ({rf}, {rio}) at step #{}: {} faults, {} · run {} faults, {} · run evicted {} pages",
                h.grid_seq,
                fmt::int(sf),
                ms(sio),
                fmt::int(rf_n),
                ms(rf_io),
                h.run_evicted
            ),
            w,
        )),
        Line::from(vec![
            Span::raw(format!("{rio} over the run vs max: · 0 ░ <25% ▒ <50% ▓ <75% █ ≥75%  ")),
            Span::styled("■ refault", Style::new().fg(REFAULTED_RECENTLY).add_modifier(Modifier::BOLD)),
            Span::raw(format!(" (last {CHURN_WINDOW} steps) · f: residency")),
        ]),
    )
}

/// A layer of per-cell totals over the run: the values, whether a cell changed recently, and the
/// colour of a recent cell.
type TotalsLayer<'a> = (&'a [u64], &'a dyn Fn(usize) -> bool, Color);

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    let w = area.width as usize;
    let h = &app.heat;
    let mut lines: Vec<Line<'static>> = Vec::new();
    if !h.measured {
        lines.push(Line::styled("Residency: not measured", fmt::title()));
        lines.push(Line::styled(
            fmt::fit("no step carried residency (no model file known, or the sampler is off)", w),
            fmt::dim(),
        ));
        f.render_widget(Paragraph::new(lines), area);
        return;
    }
    let p = |v: Option<f64>| v.map_or_else(|| "not measured".into(), fmt::pct);
    lines.push(Line::raw(fmt::fit(
        &format!(
            "experts resident {} · dense resident {} · dense swapped {}",
            p(h.experts_resident_frac),
            p(h.dense_resident_frac),
            p(h.dense_swapped_frac)
        ),
        w,
    )));
    let Some(g) = &h.grid else {
        lines.push(Line::styled("expert grid: not measured", fmt::dim()));
        f.render_widget(Paragraph::new(lines), area);
        return;
    };
    // A layer of per-cell run totals (reads, refault cost): its values and its recent test.
    let totals: Option<TotalsLayer<'_>> = match h.layer {
        HeatLayer::Residency => None,
        HeatLayer::Reads => Some((&h.run_read_bytes, &|i| h.read_recently(i), READ_RECENTLY)),
        HeatLayer::Refaults => Some((&h.run_refault_io, &|i| h.refaulted_recently(i), REFAULTED_RECENTLY)),
    };
    let mut reads_legend = None;
    if totals.is_some() {
        let (head, legend) = if h.layer == HeatLayer::Reads { reads_lines(h, w) } else { refault_lines(h, w) };
        lines.push(head);
        reads_legend = Some(legend);
    } else {
        let churn = match (h.step_added, h.step_evicted) {
            (None, None) => "churn: not measured".to_string(),
            (a, e) => format!(
                "churn at step #{}: +{} / −{} pages · run +{} / −{}",
                h.grid_seq,
                a.map_or_else(|| fmt::NA.into(), |v| v.to_string()),
                e.map_or_else(|| fmt::NA.into(), |v| v.to_string()),
                h.run_added,
                h.run_evicted
            ),
        };
        lines.push(Line::raw(fmt::fit(&churn, w)));
        if let Some((seq, c)) = &h.engine_cache {
            let hit = |v: Option<f64>| v.map_or_else(|| fmt::NA.into(), |v| format!("{v:.1} %"));
            lines.push(Line::raw(fmt::fit(
                &format!(
                    "engine cache at step #{seq}: {} slots, {} ready, {} loading · hit rate: observer {} (run {}), engine {}",
                    c.slots,
                    c.ready.len(),
                    c.loading,
                    hit(c.hit_pct),
                    hit(h.run_hit_pct()),
                    hit(h.engine_hit_pct)
                ),
                w,
            )));
        }
    }

    let (nl, ne) = (g.n_layers as usize, g.n_experts as usize);
    let grid_cols = w.saturating_sub(LABEL_W).max(1);
    let per_col = ne.div_ceil(grid_cols).max(1);
    let mut grid_rows = (area.height as usize).saturating_sub(lines.len() + 2).max(1);
    if nl > grid_rows || per_col > 1 {
        grid_rows = grid_rows.saturating_sub(1).max(1); // the binning note
    }
    let per_row = nl.div_ceil(grid_rows).max(1);
    let (cols, rows) = (ne.div_ceil(per_col), nl.div_ceil(per_row));

    if let Some(legend) = reads_legend {
        lines.push(legend);
    } else {
        let mut legend = vec![
            Span::raw("· 0 ░ <25% ▒ <50% ▓ <75% █ ≥75%  "),
            Span::styled("■ added ", churn_style(true, false)),
            Span::styled("■ evicted ", churn_style(false, true)),
            Span::styled("■ both", churn_style(true, true)),
            Span::raw(format!(" (last {CHURN_WINDOW} steps)")),
        ];
        if h.engine_cache.is_some() {
            legend.push(Span::raw("  "));
            legend.push(Span::styled("█", churn_style(false, false).bg(ENGINE_CACHE_BG)));
            legend.push(Span::raw(" in the engine's cache"));
        }
        if h.reads_measured {
            legend.push(Span::raw(" · r: reads"));
        }
        if h.refaults_measured {
            legend.push(Span::raw(" · f: refault cost"));
        }
        lines.push(Line::from(legend));
    }
    // Reads and refault layers: a (binned) cell's total over the run, against the largest cell's.
    let vals: &[u64] = totals.map_or(&[], |t| t.0);
    let bin = |l0: usize, l1: usize, e0: usize, e1: usize| -> u64 {
        (l0..l1).flat_map(|l| (e0..e1).map(move |e| l * ne + e)).map(|i| vals.get(i).copied().unwrap_or(0)).sum()
    };
    let max_read = if totals.is_some() {
        (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| bin(r * per_row, ((r + 1) * per_row).min(nl), c * per_col, ((c + 1) * per_col).min(ne)))
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    if per_col > 1 || per_row > 1 {
        let s = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        lines.push(Line::styled(
            fmt::fit(
                &format!(
                    "one cell = {} × {} ({})",
                    s(per_row, "layer", "layers"),
                    s(per_col, "expert", "experts"),
                    match h.layer {
                        HeatLayer::Reads => "their reads summed, any recent read",
                        HeatLayer::Refaults => "their refault cost summed, any recent refault",
                        HeatLayer::Residency => "mean residency, any churn",
                    }
                ),
                w,
            ),
            fmt::dim(),
        ));
    }
    // Expert index ticks every 10 cells.
    let mut ticks = format!("{:<LABEL_W$}", "layer");
    let mut c = 0;
    while c < cols {
        let label = format!("{}", c * per_col);
        if c % 10 == 0 && c + label.len() <= cols {
            ticks.push_str(&label);
            c += label.len();
        } else {
            ticks.push(' ');
            c += 1;
        }
    }
    lines.push(Line::styled(fmt::fit(&ticks, w), fmt::dim()));

    for r in 0..rows {
        let (l0, l1) = (r * per_row, ((r + 1) * per_row).min(nl));
        // Labelled with the layer (block index) of its first row.
        let mut spans = vec![Span::styled(format!("{:>4}  ", g.layer(l0)), fmt::dim())];
        for c in 0..cols {
            let (e0, e1) = (c * per_col, ((c + 1) * per_col).min(ne));
            if let Some((_, recently, colour)) = totals {
                let b = bin(l0, l1, e0, e1);
                let recent = (l0..l1).any(|l| (e0..e1).any(|e| recently(l * ne + e)));
                let ch = if max_read == 0 { shade(0.0) } else { shade((b as f64 / max_read as f64) as f32) };
                let style = if recent {
                    Style::new().fg(colour).add_modifier(Modifier::BOLD)
                } else {
                    churn_style(false, false)
                };
                spans.push(Span::styled(ch.to_string(), style));
                continue;
            }
            let (mut sum, mut n, mut added, mut evicted, mut cached) = (0.0f32, 0u32, false, false, false);
            for l in l0..l1 {
                for e in e0..e1 {
                    let i = l * ne + e;
                    if let Some(&v) = g.resident.get(i) {
                        sum += v;
                        n += 1;
                    }
                    let (a, ev) = h.churn(i);
                    added |= a;
                    evicted |= ev;
                    cached |= h.in_engine_cache(i as u32);
                }
            }
            let ch = if n == 0 { ' ' } else { shade(sum / n as f32) };
            let style = churn_style(added, evicted);
            spans.push(Span::styled(ch.to_string(), if cached { style.bg(ENGINE_CACHE_BG) } else { style }));
        }
        lines.push(Line::from(spans));
    }
    f.render_widget(Paragraph::new(lines), area);
}
