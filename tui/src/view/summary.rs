//! Summary: throughput now and over the run (with its bootstrap 95 %
//! interval), mean time per token by component beside the engine's own
//! compute, counts per token, the target's memory, who evicted the model file's pages (when
//! measured: per kind with its refaults, and per process), and the last lines the target
//! printed. Two columns when wide, with who evicted and the output full width below them; one
//! scrolling column otherwise.

use observer_common::{
    model::{Component, Counter, StepKind},
    vocab::Time,
};
use ratatui::{
    Frame,
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::Paragraph,
};

use super::{clamp_top, fmt};
use crate::{
    state::{App, NOW_STEPS, View},
    stats::RateInterval,
};

const LABEL: usize = 16;

fn row(label: &str, value: String) -> Line<'static> {
    Line::from(vec![Span::raw(format!("  {label:<LABEL$} ")), Span::raw(value)])
}

fn row_styled(label: &str, value: String, style: Style) -> Line<'static> {
    Line::from(vec![Span::raw(format!("  {label:<LABEL$} ")), Span::styled(value, style)])
}

fn heading(s: &str) -> Line<'static> {
    Line::styled(s.to_string(), fmt::title())
}

pub(super) fn per(kind: StepKind) -> &'static str {
    match kind {
        StepKind::Prompt => "prompt",
        StepKind::Generate => "token",
        StepKind::Call => "call",
        StepKind::Window => "window",
    }
}

fn throughput(app: &App) -> Vec<Line<'static>> {
    let mut out = vec![heading("Throughput")];
    let kind = app.main_kind();
    if kind == StepKind::Window {
        out.push(row("rate", "fixed windows: no token rate (no markers)".into()));
    } else {
        out.push(row(
            &format!("now (last {NOW_STEPS})"),
            app.rate_now().map_or_else(|| fmt::NA.into(), |r| format!("{r:.2} tok/s")),
        ));
        out.push(row_styled(
            "run",
            app.rate_run().map_or_else(|| fmt::NA.into(), |r| format!("{r:.2} tok/s")),
            Style::new().add_modifier(Modifier::BOLD),
        ));
        if let Some(r) = app.rate_in_steps() {
            out.push(row("in steps", format!("{r:.2} tok/s (tokens ÷ Σ step wall)")));
        }
        out.push(row(
            "95 % interval",
            match &app.rate {
                Some(RateInterval { ci95: Some((lo, hi)), resamples, steps, .. }) => {
                    format!("{lo:.2} – {hi:.2} (bootstrap ×{resamples}, {steps} steps)")
                }
                _ if app.rate_steps.len() < 2 => "needs 2 steps".into(),
                _ => "computing…".into(),
            },
        ));
    }
    let p = app.agg(StepKind::Prompt);
    if p.steps > 0 {
        let wall = p.wall_ns.total;
        out.push(row(
            "prompt",
            format!(
                "{} tokens in {} ms ({:.1} tok/s)",
                p.tokens,
                fmt::ms(wall),
                if wall > 0.0 { p.tokens as f64 * 1e9 / wall } else { 0.0 }
            ),
        ));
    }
    let g = app.agg(kind);
    out.push(row(
        &format!("{}s", per(kind)),
        if g.tokens == g.steps { g.steps.to_string() } else { format!("{} ({} tokens)", g.steps, g.tokens) },
    ));
    out
}

fn per_token_time(app: &App) -> Vec<Line<'static>> {
    let kind = app.main_kind();
    let g = app.agg(kind);
    let mut out = vec![heading(&format!("Mean ms per {}", per(kind)))];
    if g.steps == 0 {
        out.push(row("", "no steps yet".into()));
        return out;
    }
    out.push(row("wall", fmt::opt_ms(g.wall_ns.mean())));
    // The components this observer measures, and any other a source measured.
    for c in Component::ALL.into_iter().filter(|&c| c.row().measured() || g.component(c).n > 0) {
        let v = g.component(c).mean();
        let style = Style::new().fg(fmt::color(c));
        out.push(Line::from(vec![
            Span::styled("█ ", style),
            Span::raw(format!("{:<LABEL$} ", c.name())),
            Span::raw(v.map_or_else(|| "not measured".into(), fmt::ms)),
        ]));
    }
    out.push(row(Time::Residual.name(), fmt::opt_ms(g.residual_ns.mean())));
    out.push(row(
        Time::EngineCompute.name(),
        g.engine_compute_ns.mean().map_or_else(|| "not reported by the engine".into(), fmt::ms),
    ));
    if let Some(h) = g.hidden_ns.mean() {
        out.push(row_styled(
            "hidden in it",
            format!("{} (engine_compute − compute)", fmt::signed_ms(h)),
            Style::new().fg(Color::Magenta).add_modifier(Modifier::BOLD),
        ));
    }
    out
}

fn per_token_counts(app: &App) -> Vec<Line<'static>> {
    let kind = app.main_kind();
    let g = app.agg(kind);
    let mut out = vec![heading(&format!("Counts per {}", per(kind)))];
    for c in [Counter::Minflt, Counter::MajfltFile, Counter::MajfltSwap, Counter::Swapins, Counter::CtxSwitches] {
        out.push(row(c.name(), g.counter(c).mean().map_or_else(|| "not measured".into(), fmt::count)));
    }
    out.push(row(
        Counter::ReadBytes.name(),
        g.counter(Counter::ReadBytes).mean().map_or_else(|| "not measured".into(), fmt::bytes),
    ));
    let (a, e) = (g.counter(Counter::PagecacheAdded).mean(), g.counter(Counter::PagecacheEvicted).mean());
    out.push(row(
        "pagecache +/−",
        if a.is_none() && e.is_none() {
            "not measured".into()
        } else {
            format!("{} / {} pages", fmt::opt_count(a), fmt::opt_count(e))
        },
    ));
    out
}

/// Processes listed under the kinds in the who-evicted table.
pub const EVICTING_PROCESSES_SHOWN: usize = 5;

/// Who evicted the model file's pages: per actor kind that evicted any (or whose evictions were
/// refaulted), over the run: pages, MB, the pages refaulted after its evictions and the
/// `fault_io` of the observed threads' faults that brought them back, and the pages of the last
/// minute; then the processes that evicted most so far. Empty when no step carried the split.
fn who_evicted(app: &App) -> Vec<Line<'static>> {
    let e = &app.evictions;
    let Some(run) = &e.run else { return Vec::new() };
    let recent = e.recent();
    let refaults = e.refaults.unwrap_or_default();
    let page = app.header.as_ref().and_then(|h| h.model.as_ref()).and_then(|m| m.page_bytes);
    let mb = |pages: u64| page.map_or_else(|| fmt::NA.to_string(), |p| format!("{:.1}", (pages * p) as f64 / 1e6));
    let mut out = vec![heading("Who evicted (model-file pages)")];
    out.push(row("", format!("{:>9} {:>8} {:>9} {:>9} {:>9}", "pages", "MB", "refaulted", "io ms", "last min")));
    let mut kinds: Vec<usize> =
        (0..run.0.len()).filter(|&i| run.0[i] > 0 || refaults.pages.0[i] > 0 || refaults.faults.0[i] > 0).collect();
    kinds.sort_by_key(|&i| std::cmp::Reverse(run.0[i]));
    if kinds.is_empty() {
        out.push(row("", "none".into()));
    }
    let have_refaults = e.refaults.is_some();
    for i in kinds {
        let (refaulted, io) = if have_refaults {
            (refaults.pages.0[i].to_string(), fmt::ms(refaults.fault_io_ns.0[i] as f64))
        } else {
            (fmt::NA.to_string(), fmt::NA.to_string())
        };
        let name = observer_common::vocab::EVICTION_ACTORS[i].name;
        out.push(row(
            name,
            format!("{:>9} {:>8} {:>9} {:>9} {:>9}", run.0[i], mb(run.0[i]), refaulted, io, recent.0[i]),
        ));
    }
    if !e.processes.is_empty() {
        out.push(row("by process", format!("{:>9} {:>8}  {}", "pages", "MB", "as")));
        for p in e.processes.iter().take(EVICTING_PROCESSES_SHOWN) {
            let who = if p.pid == 0 { format!("{} (rest)", p.comm) } else { format!("{} {}", p.comm, p.pid) };
            out.push(row(&who, format!("{:>9} {:>8}  {}", p.pages, mb(p.pages), p.kind)));
        }
        let more = e.processes.len().saturating_sub(EVICTING_PROCESSES_SHOWN);
        if more > 0 {
            out.push(row("", format!("({more} more in the JSON summary)")));
        }
    }
    out
}

fn memory(app: &App) -> Vec<Line<'static>> {
    let mut out = vec![heading("Memory of the target (last sample)")];
    let Some(p) = &app.process else {
        out.push(row("", "not sampled yet".into()));
        return out;
    };
    let b = |v: Option<u64>| v.map_or_else(|| "not measured".into(), |v| fmt::bytes(v as f64));
    out.push(row("rss", b(p.rss_bytes)));
    out.push(row("  anon", b(p.rss_anon_bytes)));
    out.push(row("  file", b(p.rss_file_bytes)));
    out.push(row("swap", b(p.swap_bytes)));
    out.push(row("mem available", b(p.mem_available_bytes)));
    out
}

fn observer(app: &App) -> Vec<Line<'static>> {
    let Some(h) = &app.health else { return Vec::new() };
    let mut out = vec![heading("The observer (last health sample)")];
    let elapsed = app.header.as_ref().map(|hd| h.mono_ns.saturating_sub(hd.started_mono_ns)).filter(|&e| e > 0);
    match h.bpf_run_ns {
        Some(ns) => {
            let share = elapsed.map(|e| format!(" ({:.2} % CPU)", ns as f64 * 100.0 / e as f64)).unwrap_or_default();
            out.push(row("eBPF run time", format!("{} ms{share}", fmt::ms(ns as f64))));
            if let Some(r) = h.bpf_run_count {
                out.push(row("eBPF runs", fmt::int(r)));
            }
        }
        None => out.push(row("eBPF run time", "not measured (kernel BPF stats off)".into())),
    }
    out.push(row(
        "probes",
        if h.probes_missing > 0 {
            format!("{} attached, {} missing", h.probes_attached, h.probes_missing)
        } else {
            format!("{} attached", h.probes_attached)
        },
    ));
    out.push(row_styled(
        "lost events",
        app.lost().to_string(),
        if app.lost() > 0 { fmt::alarm() } else { Style::new() },
    ));
    out
}

fn run_state(app: &App) -> Line<'static> {
    let s = match (&app.end, &app.header) {
        (Some(e), _) => {
            let how = match e.exit_code {
                Some(c) => format!("target exited with code {c}"),
                None => "observation ended".into(),
            };
            let secs = app.header.as_ref().map(|h| e.mono_ns.saturating_sub(h.started_mono_ns) as f64 / 1e9);
            format!("{how}{} · final summary, q quits", secs.map(|s| format!(" after {s:.1} s")).unwrap_or_default())
        }
        (None, Some(_)) if app.source_done => "the trace ends here (no end record: truncated?)".into(),
        (None, Some(_)) => format!("running · {} steps so far", app.steps_seen),
        (None, None) => "waiting for the run to start…".into(),
    };
    Line::styled(s, Style::new().add_modifier(Modifier::BOLD))
}

fn output(app: &App, rows: usize) -> Vec<Line<'static>> {
    if app.output.is_empty() || rows < 2 {
        return Vec::new();
    }
    let mut out = vec![heading("Output (target, observer)")];
    let n = app.output.len();
    for l in app.output.range(n.saturating_sub(rows - 1)..) {
        out.push(Line::styled(format!("  {l}"), fmt::dim()));
    }
    out
}

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    if area.height == 0 {
        return;
    }
    f.render_widget(Paragraph::new(run_state(app)), Rect { height: 1, ..area });
    let area = Rect { y: area.y + 1, height: area.height - 1, ..area };
    let mut left = vec![Line::raw("")];
    left.extend(throughput(app));
    left.push(Line::raw(""));
    left.extend(per_token_time(app));
    let mut right = vec![Line::raw("")];
    right.extend(per_token_counts(app));
    let evicted = who_evicted(app);
    right.push(Line::raw(""));
    right.extend(memory(app));
    let obs = observer(app);
    if !obs.is_empty() {
        right.push(Line::raw(""));
        right.extend(obs);
    }

    if area.width >= 96 {
        // Two columns, then who evicted and the target's output full width below them.
        let cols_h = left.len().max(right.len()) as u16;
        let mut out = evicted;
        let used = if out.is_empty() { 0 } else { out.len() as u16 + 1 };
        let room = area.height.saturating_sub(cols_h + 1 + used);
        let lines = output(app, room as usize);
        if !lines.is_empty() && !out.is_empty() {
            out.push(Line::raw(""));
        }
        out.extend(lines);
        let (cols, below) = if out.is_empty() || area.height <= cols_h + 1 {
            (area, None)
        } else {
            let [c, _, b] =
                Layout::vertical([Constraint::Length(cols_h), Constraint::Length(1), Constraint::Min(0)]).areas(area);
            (c, Some(b))
        };
        let [l, r] = Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(cols);
        let top = clamp_top(app.table_offset[View::Summary.index()], left.len(), cols.height as usize);
        f.render_widget(Paragraph::new(left).scroll((top as u16, 0)), l);
        let top_r = clamp_top(app.table_offset[View::Summary.index()], right.len(), cols.height as usize);
        f.render_widget(Paragraph::new(right).scroll((top_r as u16, 0)), r);
        if let Some(b) = below {
            f.render_widget(Paragraph::new(out), b);
        }
    } else {
        if !evicted.is_empty() {
            left.push(Line::raw(""));
            left.extend(evicted);
        }
        left.push(Line::raw(""));
        left.extend(right);
        left.push(Line::raw(""));
        left.extend(output(app, 6));
        let top = clamp_top(app.table_offset[View::Summary.index()], left.len(), area.height as usize);
        f.render_widget(Paragraph::new(left).scroll((top as u16, 0)), area);
    }
}
