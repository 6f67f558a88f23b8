//! Threads: one row per thread of the target, the mean milliseconds per step
//! of each component over the steps the thread took part in, and its fault
//! counts per step; busiest (most measured time) first. Columns that do not
//! fit are left out from the right.

use observer_common::model::{Component, Counter};
use ratatui::{
    Frame,
    layout::Rect,
    style::Style,
    text::{Line, Span},
    widgets::Paragraph,
};

use super::{clamp_top, fmt};
use crate::state::{App, ThreadAgg, View};

const COMP_W: usize = 8;
const COUNT_W: usize = 9;

enum Col {
    Comp(Component),
    Count(Counter),
}

pub fn draw(app: &App, f: &mut Frame<'_>, area: Rect) {
    let w = area.width as usize;
    let mut lines: Vec<Line<'static>> = vec![Line::styled(
        fmt::fit("mean ms per step the thread ran in, over the run · – not measured", w),
        fmt::dim(),
    )];
    if app.threads.is_empty() {
        lines.push(Line::styled("no per-thread data yet", fmt::dim()));
        f.render_widget(Paragraph::new(lines), area);
        return;
    }
    let fixed = 8 + 16 + 7; // tid, comm, steps
    // Components some thread has a measured value of, then counters.
    let measured = |c: Component| app.threads.values().any(|t| t.components[c as usize].n > 0);
    let mut cols: Vec<Col> = Component::ALL.into_iter().filter(|&c| measured(c)).map(Col::Comp).collect();
    cols.extend([Counter::Minflt, Counter::MajfltFile, Counter::MajfltSwap, Counter::CtxSwitches].map(Col::Count));
    let mut used = fixed;
    let cols: Vec<Col> = cols
        .into_iter()
        .take_while(|c| {
            used += match c {
                Col::Comp(_) => COMP_W,
                Col::Count(..) => COUNT_W,
            };
            used <= w
        })
        .collect();

    let mut head = vec![Span::styled(format!("{:>7} {:<15} {:>6}", "tid", "comm", "steps"), fmt::title())];
    for c in &cols {
        match c {
            Col::Comp(c) => head.push(Span::styled(format!("{:>COMP_W$}", c.short()), fmt::title().fg(fmt::color(*c)))),
            Col::Count(c) => head.push(Span::styled(format!("{:>COUNT_W$}", c.short()), fmt::title())),
        }
    }
    lines.push(Line::from(head));

    let mut threads: Vec<&ThreadAgg> = app.threads.values().collect();
    threads.sort_by(|a, b| b.total_ns().total_cmp(&a.total_ns()).then(a.tid.cmp(&b.tid)));
    let rows = (area.height as usize).saturating_sub(lines.len());
    let top = clamp_top(app.table_offset[View::Threads.index()], threads.len(), rows);
    for t in threads.iter().skip(top).take(rows) {
        let mut spans = vec![Span::raw(format!("{:>7} {:<15} {:>6}", t.tid, fmt::fit(&t.comm, 15), t.steps))];
        for c in &cols {
            match c {
                Col::Comp(c) => {
                    spans.push(Span::raw(format!("{:>COMP_W$}", fmt::opt_ms(t.components[*c as usize].mean()))))
                }
                Col::Count(c) => spans.push(Span::styled(
                    format!("{:>COUNT_W$}", fmt::opt_count(t.counters[*c as usize].mean())),
                    Style::new(),
                )),
            }
        }
        lines.push(Line::from(spans));
    }
    f.render_widget(Paragraph::new(lines), area);
}
