//! Tokens: one stacked bar per step, newest at the bottom.
//!
//! Each bar is the step's wall time split into the mean thread's components
//! (compute first, then the memory and scheduling costs), on a common scale:
//! the longest non-prompt step on screen fills the width; longer steps (the
//! prompt) are cut and end in `»`. `░` is the residual, time no component accounts for. The
//! engine's own residual compute is drawn as `┃` at its length on the same
//! scale, so the gap between the end of the green compute and the `┃` is the
//! cost the engine's `compute_ms` hides (also printed in the `hidden` column).

use observer_common::{
    model::{Component, StepKind},
    vocab::Time,
};
use ratatui::{
    Frame,
    layout::Rect,
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::Paragraph,
};

use super::{
    columns::{self, Column},
    fmt,
};
use crate::state::{App, TokenRow};

/// Legend, column header and detail rows around the list.
const CHROME_ROWS: u16 = 3;
/// Width of `   seq k  wall ms  hidden ` and of its narrow form `  seq  wall ms `.
const PREFIX_WIDE: usize = 26;
const PREFIX_NARROW: usize = 14;
const MARKER: char = '┃';

/// Rows of the token list in a body of `h` rows.
pub fn list_rows(h: u16) -> u16 {
    if h > CHROME_ROWS + 1 { h - CHROME_ROWS } else { h }
}

fn kind_char(k: StepKind) -> char {
    match k {
        StepKind::Prompt => 'P',
        StepKind::Generate => 'g',
        StepKind::Call => 'c',
        StepKind::Window => 'w',
    }
}

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    if area.height == 0 || area.width == 0 {
        return;
    }
    let chrome = area.height > CHROME_ROWS + 1;
    let rows_h = list_rows(area.height) as usize;
    let list_y = if chrome { area.y + 2 } else { area.y };
    let wide = area.width as usize >= 60;
    let prefix = if wide { PREFIX_WIDE } else { PREFIX_NARROW };
    let bar_w = (area.width as usize).saturating_sub(prefix + 1);

    let n = app.rows.len();
    let offset = app.tokens_offset.min(n.saturating_sub(rows_h));
    let end = n - offset;
    let start = end.saturating_sub(rows_h);
    let visible: Vec<&TokenRow> = app.rows.range(start..end).collect();
    let scale = scale_ns(&visible);

    if chrome {
        f.render_widget(Paragraph::new(legend(app, area.width as usize)), Rect { height: 1, ..area });
        let head = if wide {
            format!("{:>6} {} {:>8} {:>7} ", "seq", "k", "wall ms", "hidden")
        } else {
            format!("{:>5} {:>7} ", "seq", "wall ms")
        };
        let scale_label = format!("{} ms", fmt::ms(scale));
        let bar_head = if bar_w > scale_label.len() + 2 && !visible.is_empty() {
            format!("0{:>w$}", scale_label, w = bar_w - 1)
        } else {
            String::new()
        };
        f.render_widget(
            Paragraph::new(Line::from(vec![
                Span::styled(head, fmt::title()),
                Span::styled(format!("│{bar_head}"), fmt::dim()),
            ])),
            Rect { y: area.y + 1, height: 1, ..area },
        );
    }

    if visible.is_empty() {
        let msg = if app.ended() || app.source_done {
            "no tokens were recorded (no engine markers? try --token-symbol or --window)"
        } else {
            "waiting for the first token…"
        };
        f.render_widget(
            Paragraph::new(fmt::fit(msg, area.width as usize)).style(fmt::dim()),
            Rect { y: list_y, height: 1, ..area },
        );
        return;
    }

    // Straight into the buffer: this is the view redrawn while tokens stream.
    let buf = f.buffer_mut();
    let right = area.x + area.width;
    for (i, r) in visible.iter().enumerate() {
        let y = list_y + i as u16;
        let hidden = r.hidden_ns().map_or_else(|| fmt::NA.to_string(), |h| fmt::signed_ms(h as f64));
        let head = if wide {
            format!("{:>6} {} {:>8} {:>7} ", r.seq, kind_char(r.kind), fmt::ms(r.wall_ns as f64), hidden)
        } else {
            format!("{:>5} {:>7} ", r.seq % 100_000, fmt::ms(r.wall_ns as f64))
        };
        buf.set_stringn(area.x, y, &head, area.width as usize, Style::new());
        if bar_w >= 4 {
            let x0 = area.x + prefix as u16;
            buf.set_stringn(x0, y, "│", 1, fmt::dim());
            for (j, (ch, st)) in bar(r, scale, bar_w).into_iter().enumerate() {
                let x = x0 + 1 + j as u16;
                if x < right {
                    buf[(x, y)].set_char(ch).set_style(st);
                }
            }
        }
    }

    if chrome && let Some(last) = visible.last() {
        let y = list_y + rows_h as u16;
        f.render_widget(Paragraph::new(detail(last, area.width as usize)), Rect { y, height: 1, ..area });
    }
}

/// Nanoseconds that fill the bar: the longest non-prompt step on screen (or
/// its engine compute, if longer); the longest step when all are prompts.
fn scale_ns(rows: &[&TokenRow]) -> f64 {
    let len = |r: &&TokenRow| r.wall_ns.max(r.engine_compute_ns.unwrap_or(0));
    let m = rows
        .iter()
        .filter(|r| r.kind != StepKind::Prompt)
        .map(len)
        .max()
        .or_else(|| rows.iter().map(len).max())
        .unwrap_or(1);
    m.max(1) as f64
}

/// The stacked bar of one step, `w` cells wide.
fn bar(r: &TokenRow, scale: f64, w: usize) -> Vec<(char, Style)> {
    let mut cells: Vec<(char, Style)> = vec![(' ', Style::new()); w];
    let px = |ns: f64| (((ns / scale) * w as f64).round().max(0.0) as usize).min(w);
    let mut cum = 0.0;
    let fill = |cells: &mut Vec<(char, Style)>, cum: &mut f64, ns: f64, ch: char, color: Color| {
        let a = px(*cum);
        *cum += ns;
        let b = px(*cum);
        for c in &mut cells[a..b] {
            *c = (ch, Style::new().fg(color));
        }
    };
    for c in Component::ALL {
        if let Some(v) = r.components.get(c) {
            fill(&mut cells, &mut cum, v as f64, '█', fmt::color(c));
        }
    }
    if r.residual_ns > 0 {
        fill(&mut cells, &mut cum, r.residual_ns as f64, '░', fmt::RESIDUAL);
    }
    let cut = cum > scale;
    if cut && w > 0 {
        cells[w - 1] = ('»', Style::new().fg(Color::White).add_modifier(Modifier::BOLD));
    }
    // The marker sits on the first cell past the engine's compute. On a cut
    // bar (the prompt) a marker beyond the scale is left out rather than
    // misplaced; on the longest whole bar, an engine compute a little longer
    // than the step's wall (the engine's clock starts before the begin
    // marker) is drawn on the last cell.
    if let Some(ec) = r.engine_compute_ns.filter(|&ec| !cut || (ec as f64) < scale) {
        let x = px(ec as f64).min(w.saturating_sub(1));
        if w > 0 {
            let under = cells[x].1.fg;
            let mut st = Style::new().fg(Color::White).add_modifier(Modifier::BOLD);
            if let Some(bg) = under {
                st = st.bg(bg);
            }
            cells[x] = (MARKER, st);
        }
    }
    cells
}

/// The marker, the components (chosen by the rule of `columns`: all-zero ones are named at the
/// end; vocabulary names, short labels when narrow), and the residual.
fn legend(app: &App, w: usize) -> Line<'static> {
    let mut spans = Vec::new();
    let mut used = 0;
    let mut push = |spans: &mut Vec<Span<'static>>, sym: char, sym_style: Style, name: &str| -> bool {
        let need = name.chars().count() + 3;
        if used + need > w {
            return false;
        }
        used += need;
        spans.push(Span::styled(sym.to_string(), sym_style));
        spans.push(Span::raw(format!("{name}  ")));
        true
    };
    let narrow = w < 130;
    let name = |t: Time| if narrow { t.short() } else { t.name() };
    let _ =
        push(&mut spans, MARKER, Style::new().fg(Color::White).add_modifier(Modifier::BOLD), name(Time::EngineCompute));
    let g = app.agg(app.main_kind());
    let cols = columns::choose(Column::times(), g.steps > 0, |c| match c {
        Column::Time(c) => (g.component(c).n > 0).then_some(g.component(c).total),
        Column::Count(_) => None,
    });
    for c in cols.shown.iter().filter_map(|c| match *c {
        Column::Time(c) => Some(c),
        Column::Count(_) => None,
    }) {
        if !push(&mut spans, '█', Style::new().fg(fmt::color(c)), if narrow { c.short() } else { c.name() }) {
            return Line::from(spans);
        }
    }
    if push(&mut spans, '░', Style::new().fg(fmt::RESIDUAL), name(Time::Residual)) {
        let note = cols.note();
        if used + note.chars().count() <= w {
            spans.push(Span::styled(note.trim_start_matches(" · ").to_string(), fmt::dim()));
        }
    }
    Line::from(spans)
}

/// The newest visible step in words.
fn detail(r: &TokenRow, w: usize) -> Line<'static> {
    let mut s = format!("#{} {}: wall {} ms =", r.seq, kind_name(r.kind, r.n_tokens), fmt::ms(r.wall_ns as f64));
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    for c in Component::ALL {
        match r.components.get(c) {
            Some(v) if v >= 5_000 => parts.push(format!(" {} {}", c.name(), fmt::ms(v as f64))),
            Some(_) => {}
            // Components named ahead of their measurement are not "missing" here.
            None if c.row().measured() => missing.push(c.name()),
            None => {}
        }
    }
    if r.residual_ns.unsigned_abs() >= 5_000 {
        parts.push(format!(" {} {}", Time::Residual.name(), fmt::signed_ms(r.residual_ns as f64)));
    }
    s.push_str(&parts.join(" +"));
    match (r.engine_compute_ns, r.hidden_ns()) {
        (Some(ec), Some(h)) => s.push_str(&format!(
            " │ {} {} ({} {})",
            Time::EngineCompute.name(),
            fmt::ms(ec as f64),
            Time::Hidden.name(),
            fmt::signed_ms(h as f64)
        )),
        (Some(ec), None) => s.push_str(&format!(" │ {} {}", Time::EngineCompute.name(), fmt::ms(ec as f64))),
        _ => s.push_str(&format!(" │ {}: not reported", Time::EngineCompute.name())),
    }
    if !missing.is_empty() {
        s.push_str(&format!(" │ not measured: {}", missing.join(", ")));
    }
    Line::styled(fmt::fit(&s, w), fmt::title())
}

fn kind_name(k: StepKind, n: u64) -> String {
    match k {
        StepKind::Prompt => format!("prompt ({n} tokens)"),
        StepKind::Generate => "token".into(),
        StepKind::Call => "call".into(),
        StepKind::Window => "window".into(),
    }
}
