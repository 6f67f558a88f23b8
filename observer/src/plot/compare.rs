//! A against B: per time metric, both sides' means with their 95 % bootstrap
//! intervals, from `diff`'s own rows (module spec in `plot`).

use anyhow::{Result, bail};
use observer_common::vocab::{Component, Time};
use plotters::{coord::Shift, prelude::*};

use super::{
    Plot, category_label, category_ticks, chart, component_colour, err, legend, nice_max, series_colour, swatch,
};
use crate::analysis::{
    diff::DiffReport,
    stats::{Estimate, Interval},
};

/// One metric's two sides.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The vocabulary name.
    pub name: String,
    /// The component it is, for its colour (`None` for wall and engine compute).
    pub component: Option<Component>,
    pub a: (f64, Option<Interval>),
    pub b: (f64, Option<Interval>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub title: String,
    pub a_name: String,
    pub b_name: String,
    pub bars: Vec<Bar>,
}

impl Comparison {
    /// The first comparison of the report: wall, each component measured on
    /// both sides, the engine's compute; in ms per token.
    pub fn of(d: &DiffReport) -> Result<Comparison> {
        let Some(c) = d.comparisons.first() else {
            bail!("nothing to compare: the runs form one side (give runs of two configurations, or two files)")
        };
        let point = |e: &Estimate| Some((e.value?, e.ci95));
        let wanted = |metric: &str| -> Option<Option<Component>> {
            let name = metric.strip_suffix("_ms")?;
            if name == Time::Wall.name() || name == Time::EngineCompute.name() {
                return Some(None);
            }
            Component::from_name(name).map(Some)
        };
        let bars = c
            .rows
            .iter()
            .filter_map(|r| {
                let component = wanted(&r.metric)?;
                Some(Bar {
                    name: r.metric.trim_end_matches("_ms").to_string(),
                    component,
                    a: point(&r.a)?,
                    b: point(&r.b)?,
                })
            })
            .collect();
        let tok_s = c.rows.iter().find(|r| r.metric == "tok_s");
        let rate = |e: Option<&Estimate>| e.and_then(|e| e.value).map_or("?".into(), |v| format!("{v:.2}"));
        Ok(Comparison {
            title: format!(
                "{} vs {}: ms per token, 95 % intervals (tok/s {} → {})",
                c.a,
                c.b,
                rate(tok_s.map(|r| &r.a)),
                rate(tok_s.map(|r| &r.b))
            ),
            a_name: c.a.clone(),
            b_name: c.b.clone(),
            bars,
        })
    }
}

impl Plot for Comparison {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(err)?;
        let hi = |s: &(f64, Option<Interval>)| s.1.map_or(s.0, |i| i.hi.max(s.0));
        let top = self.bars.iter().map(|b| hi(&b.a).max(hi(&b.b))).fold(0.0, f64::max);
        let n = self.bars.len().max(1);
        let names: Vec<String> = self.bars.iter().map(|b| b.name.clone()).collect();
        let mut chart = chart(root, &self.title, (50, 60), 0f64..n as f64, 0f64..nice_max(top * 1.05, 0.001))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(category_ticks(n))
            .x_label_formatter(&|x| category_label(&names, *x))
            .y_desc("ms per token")
            .draw()
            .map_err(err)?;
        for (side, (name, off)) in [(&self.a_name, 0.1), (&self.b_name, 0.5)].into_iter().enumerate() {
            let colour = series_colour(side);
            let pick = |b: &Bar| if side == 0 { b.a } else { b.b };
            let bars: Vec<Rectangle<(f64, f64)>> = self
                .bars
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let x = i as f64 + off;
                    let fill = b.component.map_or(colour, component_colour);
                    let style = if side == 0 { fill.mix(0.55).filled() } else { fill.filled() };
                    Rectangle::new([(x, 0.0), (x + 0.38, pick(b).0)], style)
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(err)?
                .label(format!("{} (side {})", name, if side == 0 { "A: lighter" } else { "B: solid" }))
                .legend(swatch(colour));
            let whiskers = self.bars.iter().enumerate().filter_map(|(i, b)| {
                let (v, ci) = pick(b);
                let ci = ci?;
                Some(ErrorBar::new_vertical(i as f64 + off + 0.19, ci.lo, v, ci.hi, BLACK.stroke_width(1), 8))
            });
            chart.draw_series(whiskers).map_err(err)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)
    }
}
