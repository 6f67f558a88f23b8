//! Threads: one row per thread of the target, the mean milliseconds per step
//! of each component over the steps the thread took part in, and its fault
//! counts per step; busiest (most measured time) first. Which columns show is
//! the rule of `columns` (all-zero and unmeasured ones are left out, then those
//! that do not fit, from the right).

use ratatui::{
    Frame,
    layout::Rect,
    style::Style,
    text::{Line, Span},
    widgets::Paragraph,
};

use super::{
    clamp_top,
    columns::{self, Column},
    fmt,
};
use crate::state::{App, ThreadAgg, View};

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    let w = area.width as usize;
    if app.threads.is_empty() {
        let lines = vec![
            Line::styled(fmt::fit("mean ms per step the thread ran in, over the run · – not measured", w), fmt::dim()),
            Line::styled("no per-thread data yet", fmt::dim()),
        ];
        f.render_widget(Paragraph::new(lines), area);
        return;
    }
    let fixed = 8 + 16 + 7; // tid, comm, steps
    let sum = |s: &crate::state::Sum| (s.n > 0).then_some(s.total);
    let total = |c: Column| {
        app.threads
            .values()
            .filter_map(|t| match c {
                Column::Time(c) => sum(&t.components[c as usize]),
                Column::Count(c) => sum(&t.counters[c as usize]),
            })
            .reduce(|a, b| a + b)
    };
    let mut cols = columns::choose(Column::times().chain(Column::per_thread_counts()), true, total);
    cols.fit(w.saturating_sub(fixed));
    let mut lines: Vec<Line<'static>> = vec![Line::styled(
        fmt::fit(&format!("mean ms per step the thread ran in, over the run · – not measured{}", cols.note()), w),
        fmt::dim(),
    )];

    let mut head = vec![Span::styled(format!("{:>7} {:<15} {:>6}", "tid", "comm", "steps"), fmt::title())];
    for &c in &cols.shown {
        let style = match c {
            Column::Time(t) => fmt::title().fg(fmt::color(t)),
            Column::Count(_) => fmt::title(),
        };
        head.push(Span::styled(format!("{:>w$}", c.short(), w = c.width()), style));
    }
    lines.push(Line::from(head));

    let mut threads: Vec<&ThreadAgg> = app.threads.values().collect();
    threads.sort_by(|a, b| b.total_ns().total_cmp(&a.total_ns()).then(a.tid.cmp(&b.tid)));
    let rows = (area.height as usize).saturating_sub(lines.len());
    let top = clamp_top(app.table_offset[View::Threads.index()], threads.len(), rows);
    for t in threads.iter().skip(top).take(rows) {
        let mut spans = vec![Span::raw(format!("{:>7} {:<15} {:>6}", t.tid, fmt::fit(&t.comm, 15), t.steps))];
        for &c in &cols.shown {
            let mean = match c {
                Column::Time(c) => t.components[c as usize].mean(),
                Column::Count(c) => t.counters[c as usize].mean(),
            };
            spans.push(Span::styled(format!("{:>w$}", c.format(mean), w = c.width()), Style::new()));
        }
        lines.push(Line::from(spans));
    }
    f.render_widget(Paragraph::new(lines), area);
}
