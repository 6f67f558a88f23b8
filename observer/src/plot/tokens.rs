//! Per-token stacked components of one run, with the engine's own compute as a
//! line (module spec in `plot`).

use anyhow::Result;
use observer_common::vocab::{Component, Time};
use plotters::{coord::Shift, prelude::*};

use super::{Plot, chart, component_colour, err, legend, nice_max, swatch};
use crate::store::import::LoadedRun;

/// What the plot shows, in ms, per summarised record in order.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenSeries {
    pub title: String,
    /// Each measured component (measured in at least one record) and its value
    /// per record (`None`: not measured in that record).
    pub stacks: Vec<(Component, Vec<Option<f64>>)>,
    /// The engine's own compute per record, when any record has it.
    pub engine_compute: Option<Vec<Option<f64>>>,
    pub wall: Vec<f64>,
}

const MS: f64 = 1e-6;

impl TokenSeries {
    pub fn of(run: &LoadedRun) -> TokenSeries {
        let recs = run.summarised();
        let ms = |v: Option<u64>| v.map(|v| v as f64 * MS);
        let stacks = Component::ALL
            .into_iter()
            .map(|c| (c, recs.iter().map(|t| ms(t.components.get(c))).collect::<Vec<_>>()))
            .filter(|(_, v)| v.iter().any(Option::is_some))
            .collect();
        let engine: Vec<Option<f64>> = recs.iter().map(|t| ms(t.engine_compute_ns)).collect();
        let name = run.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        TokenSeries {
            title: format!("{name}: time per token ({} records)", recs.len()),
            stacks,
            engine_compute: engine.iter().any(Option::is_some).then_some(engine),
            wall: recs.iter().map(|t| t.wall_ns as f64 * MS).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.wall.len()
    }

    pub fn is_empty(&self) -> bool {
        self.wall.is_empty()
    }

    /// The top of record `i`'s stack.
    fn stack_top(&self, i: usize) -> f64 {
        self.stacks.iter().filter_map(|(_, v)| v[i]).sum()
    }
}

impl Plot for TokenSeries {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(err)?;
        let n = self.len().max(1);
        let mut top = (0..self.len()).map(|i| self.stack_top(i)).fold(0.0, f64::max);
        if let Some(e) = &self.engine_compute {
            top = e.iter().flatten().copied().fold(top, f64::max);
        }
        let mut chart = chart(root, &self.title, (40, 60), 0f64..n as f64, 0f64..nice_max(top * 1.05, 0.001))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("token (generated, in order)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc("ms")
            .draw()
            .map_err(err)?;
        let mut bottom = vec![0.0; self.len()];
        for (c, values) in &self.stacks {
            let colour = component_colour(*c);
            let bars: Vec<Rectangle<(f64, f64)>> = values
                .iter()
                .enumerate()
                .filter_map(|(i, v)| {
                    let v = (*v).filter(|v| *v > 0.0)?;
                    let b = bottom[i];
                    bottom[i] += v;
                    Some(Rectangle::new([(i as f64, b), (i as f64 + 1.0, b + v)], colour.filled()))
                })
                .collect();
            chart.draw_series(bars).map_err(err)?.label(c.name()).legend(swatch(colour));
        }
        if let Some(e) = &self.engine_compute {
            let points = e.iter().enumerate().filter_map(|(i, v)| Some((i as f64 + 0.5, (*v)?)));
            chart
                .draw_series(LineSeries::new(points, BLACK.stroke_width(2)))
                .map_err(err)?
                .label(format!("{} (the engine's own, a residual)", Time::EngineCompute.name()))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK.stroke_width(2)));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)
    }
}
