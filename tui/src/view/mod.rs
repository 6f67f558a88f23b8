//! Drawing: a pure function of the state ([`draw`]). Layout, top to bottom:
//! a two-line header (target, live tok/s and hidden cost ([`header_figures`]), status;
//! kernel, probes, lost/dropped events in red),
//! the view tabs, the current view, and a help line. Below
//! [`MIN_WIDTH`]×[`MIN_HEIGHT`] a compact view shows only the essentials.

mod columns;
mod faults;
pub mod fmt;
pub mod heatmap;
mod summary;
mod threads;
mod tokens;

use ratatui::{
    Frame,
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Paragraph, Tabs},
};

use observer_common::model::StepKind;

use crate::{
    input,
    state::{App, View},
};

pub const MIN_WIDTH: u16 = 40;
pub const MIN_HEIGHT: u16 = 8;

/// Rows above / below the body.
const HEADER_ROWS: u16 = 2;
const TABS_ROWS: u16 = 1;
const HELP_ROWS: u16 = 1;

pub fn draw(app: &App, f: &mut Frame<'_>) {
    let area = f.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        draw_compact(app, f, area);
        return;
    }
    let [header, tabs, body, help] = Layout::vertical([
        Constraint::Length(HEADER_ROWS),
        Constraint::Length(TABS_ROWS),
        Constraint::Min(0),
        Constraint::Length(HELP_ROWS),
    ])
    .areas(area);
    draw_header(app, f, header);
    draw_tabs(app, f, tabs);
    match app.view {
        View::Tokens => tokens::draw(app, f, body),
        View::Summary => summary::draw(app, f, body),
        View::Heatmap => heatmap::draw(app, f, body),
        View::Threads => threads::draw(app, f, body),
        View::Faults => faults::draw(app, f, body),
    }
    draw_help(app, f, help);
}

/// Rows of scrollable content a view shows on a `w`×`h` terminal (page size).
pub fn body_rows(view: View, w: u16, h: u16) -> usize {
    if w < MIN_WIDTH || h < MIN_HEIGHT {
        return 1;
    }
    let body = h.saturating_sub(HEADER_ROWS + TABS_ROWS + HELP_ROWS);
    match view {
        View::Tokens => tokens::list_rows(body) as usize,
        _ => body as usize,
    }
}

/// Status word for the header: what the run is doing.
fn status(app: &App) -> Span<'static> {
    let s = if let Some(e) = &app.end {
        match e.exit_code {
            Some(0) => Span::styled("EXITED 0", Style::new().fg(Color::Green).add_modifier(Modifier::BOLD)),
            Some(c) => Span::styled(format!("EXITED {c}"), fmt::alarm()),
            None => Span::styled("ENDED", Style::new().add_modifier(Modifier::BOLD)),
        }
    } else if app.source_done {
        Span::styled("TRACE ENDS (no end record)", Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD))
    } else if app.header.is_none() {
        Span::styled("STARTING", Style::new().fg(Color::Yellow))
    } else {
        Span::styled("RUNNING", Style::new().fg(Color::Green).add_modifier(Modifier::BOLD))
    };
    if app.paused {
        Span::styled(format!("PAUSED · {}", s.content), Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD))
    } else {
        s
    }
}

/// The header's figures, on every view: tok/s (over the last steps while the run goes on, the
/// whole run's once it ended: the Summary's `now` and `run`), and the mean time per step that the
/// engine's own compute hides (the Summary's `hidden in it`), when the engine reports its compute.
/// Empty before the first step and for fixed windows.
pub fn header_figures(app: &App) -> String {
    let kind = app.main_kind();
    if kind == StepKind::Window {
        return String::new();
    }
    let rate = if app.ended() { app.rate_run() } else { app.rate_now() };
    let mut s = rate.map(|r| format!("{r:.2} tok/s")).unwrap_or_default();
    if let Some(h) = app.agg(kind).hidden_ns.mean() {
        s.push_str(&format!(" · hidden {} ms/{}", fmt::signed_ms(h), summary::per(kind)));
    }
    s
}

fn draw_header(app: &App, f: &mut Frame<'_>, area: Rect) {
    let [l1, l2] = Layout::vertical([Constraint::Length(1), Constraint::Length(1)]).areas(area);
    // Line 1: target … rate, hidden cost, status.
    let figures = header_figures(app);
    let figures = if figures.is_empty() { figures } else { format!("{figures} · ") };
    let st = status(app);
    let st_w = (figures.chars().count() + st.content.chars().count()) as u16 + 1;
    let st = Line::from(vec![Span::styled(figures, Style::new().fg(Color::Magenta).add_modifier(Modifier::BOLD)), st]);
    let [left, right] = Layout::horizontal([Constraint::Min(0), Constraint::Length(st_w)]).areas(l1);
    let target = match &app.header {
        Some(h) => format!(
            "pid {} · {}{}",
            h.target_pid,
            if h.target_command.is_empty() { "?".to_string() } else { h.target_command.join(" ") },
            if h.tokens.is_empty() { String::new() } else { format!(" · tokens: {}", h.tokens) }
        ),
        None => "waiting for the run header (attaching probes)…".to_string(),
    };
    let name = Span::styled(" observer ", Style::new().fg(Color::Black).bg(Color::Cyan).add_modifier(Modifier::BOLD));
    let w = left.width.saturating_sub(11) as usize;
    f.render_widget(Paragraph::new(Line::from(vec![name, Span::raw(" "), Span::raw(fmt::fit(&target, w))])), left);
    f.render_widget(Paragraph::new(st), right);

    // Line 2: kernel, mode, probes … lost, dropped (red when not zero).
    let lost = app.lost();
    let dropped = app.dropped_total();
    let counts = vec![
        Span::styled(format!("lost {lost}"), if lost > 0 { fmt::alarm() } else { fmt::dim() }),
        Span::raw(" "),
        Span::styled(format!("dropped {dropped}"), if dropped > 0 { fmt::alarm() } else { fmt::dim() }),
    ];
    let counts_w = counts.iter().map(|s| s.content.chars().count()).sum::<usize>() as u16 + 1;
    let [left, right] = Layout::horizontal([Constraint::Min(0), Constraint::Length(counts_w)]).areas(l2);
    let facts = match &app.header {
        Some(h) => {
            let model = h.model.as_ref().map(|m| format!(" · model {}", m.path)).unwrap_or_default();
            format!(
                " kernel {} · {} · probes {}: {}{model}",
                if h.kernel.is_empty() { "?" } else { &h.kernel },
                if h.mode.is_empty() { "?" } else { &h.mode },
                h.probes.len(),
                h.probes.iter().map(|p| short_probe(p)).collect::<Vec<_>>().join(" "),
            )
        }
        None => String::new(),
    };
    // What the run cannot measure (the header's `degraded`, with what marks the tokens restated
    // later: markers refused, or never called), first and in the alarm style.
    let warn = match &app.header {
        Some(h) if !h.degraded.is_empty() => format!(" ⚠ {} ·", h.degraded.join(" · ")),
        _ => String::new(),
    };
    let warn = fmt::fit(&warn, left.width as usize);
    let rest = fmt::fit(&facts, (left.width as usize).saturating_sub(warn.chars().count()));
    let line = Line::from(vec![Span::styled(warn, fmt::alarm()), Span::styled(rest, fmt::dim())]);
    f.render_widget(Paragraph::new(line), left);
    f.render_widget(Paragraph::new(Line::from(counts)), right);
}

fn draw_tabs(app: &App, f: &mut Frame<'_>, area: Rect) {
    let titles: Vec<String> = View::ALL.iter().enumerate().map(|(i, v)| format!("{} {}", i + 1, v.title())).collect();
    let tabs = Tabs::new(titles)
        .select(app.view.index())
        .style(fmt::dim())
        .highlight_style(Style::new().fg(Color::Black).bg(Color::White).add_modifier(Modifier::BOLD))
        .divider("│");
    f.render_widget(tabs, area);
}

fn draw_help(app: &App, f: &mut Frame<'_>, area: Rect) {
    let mut spans = Vec::new();
    if app.paused {
        spans.push(Span::styled(
            format!(" paused, {} events queued · ", app.pending()),
            Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD),
        ));
    } else if app.ended() {
        spans.push(Span::styled(" target ended: final summary · ", Style::new().add_modifier(Modifier::BOLD)));
    }
    let used: usize = spans.iter().map(|s| s.content.chars().count()).sum();
    let room = (area.width as usize).saturating_sub(used + 1);
    let help = if input::HELP.chars().count() <= room { input::HELP } else { input::HELP_SHORT };
    spans.push(Span::styled(format!(" {}", fmt::fit(help, room)), fmt::dim()));
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// Too small for the views: the numbers that matter, as many lines as fit.
fn draw_compact(app: &App, f: &mut Frame<'_>, area: Rect) {
    let w = area.width as usize;
    let rate = match (app.rate_run(), app.rate.and_then(|r| r.ci95)) {
        (Some(r), Some((lo, hi))) => format!("{r:.2} tok/s [{lo:.2}–{hi:.2}]"),
        (Some(r), None) => format!("{r:.2} tok/s"),
        (None, _) => "no tokens yet".to_string(),
    };
    let lost = app.lost();
    let dropped = app.dropped_total();
    let lines = vec![
        Line::from(vec![Span::raw(fmt::fit("observer ", w)), status(app)]),
        Line::raw(fmt::fit(&rate, w)),
        Line::styled(
            fmt::fit(&format!("lost {lost} dropped {dropped}"), w),
            if lost + dropped > 0 { fmt::alarm() } else { fmt::dim() },
        ),
        Line::styled(fmt::fit("q quit · enlarge for views", w), fmt::dim()),
    ];
    f.render_widget(Paragraph::new(lines), area);
}

/// `tp:exceptions:page_fault_user` → `page_fault_user`; uprobes → `uprobe:SYMBOLS`.
fn short_probe(p: &str) -> String {
    if p.starts_with("uprobe") {
        let sym = p.rsplit(':').next().unwrap_or(p);
        return format!("uprobe:{sym}");
    }
    p.rsplit(':').next().unwrap_or(p).to_string()
}

/// Clamp a top offset so that the last page stays full.
fn clamp_top(offset: usize, len: usize, rows: usize) -> usize {
    offset.min(len.saturating_sub(rows))
}
