//! The expert grids of one run over time: a row per MoE layer (labelled with its
//! block index, `ExpertGrid::layer`), a column per record with a grid, the
//! layer's mean resident fraction as the colour (module spec in `plot`).

use anyhow::{Result, bail};
use observer_common::vocab::ResidencyField;
use plotters::{coord::Shift, prelude::*};

use super::{Plot, chart, err};
use crate::store::import::LoadedRun;

#[derive(Debug, Clone, PartialEq)]
pub struct ResidencyMap {
    pub title: String,
    pub n_layers: usize,
    /// The block index of each row (of the tallest grid).
    pub layers: Vec<u32>,
    /// Per column: the record's `seq` and each layer's mean resident fraction.
    pub columns: Vec<(u64, Vec<f64>)>,
}

impl ResidencyMap {
    pub fn of(run: &LoadedRun) -> Result<ResidencyMap> {
        let mut columns = Vec::new();
        let (mut n_layers, mut layers) = (0, Vec::new());
        for t in &run.tokens {
            let Some(g) = t.residency.as_ref().and_then(|r| r.grid.as_ref()) else { continue };
            let (l, e) = (g.n_layers as usize, g.n_experts as usize);
            if e == 0 || g.resident.len() != l * e {
                continue;
            }
            if l > n_layers || layers.is_empty() {
                layers = (0..l).map(|r| g.layer(r)).collect();
            }
            n_layers = n_layers.max(l);
            let means = g.resident.chunks(e).map(|row| row.iter().map(|&v| v as f64).sum::<f64>() / e as f64);
            columns.push((t.seq, means.collect()));
        }
        if columns.is_empty() {
            bail!(
                "{}: no record carries an expert grid (record with the engine's markers and a model the observer maps; \
                 `observer record --residency-interval`)",
                run.path.display()
            );
        }
        let name = run.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(ResidencyMap {
            title: format!("{name}: {} per layer over the run", ResidencyField::ExpertsResident.name()),
            n_layers,
            layers,
            columns,
        })
    }
}

/// 0 → white, 1 → dark blue.
fn shade(v: f64) -> RGBColor {
    let v = v.clamp(0.0, 1.0);
    let lerp = |a: f64, b: f64| (a + (b - a) * v).round() as u8;
    RGBColor(lerp(255.0, 8.0), lerp(255.0, 48.0), lerp(255.0, 107.0))
}

impl Plot for ResidencyMap {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(err)?;
        let (main, key) = root.split_horizontally(root.dim_in_pixel().0 - 110);
        let n = self.columns.len();
        let mut chart = chart(&main, &self.title, (40, 60), 0f64..n as f64, 0f64..self.n_layers as f64)?;
        let seqs: Vec<u64> = self.columns.iter().map(|c| c.0).collect();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("record (seq)")
            .y_desc("MoE layer")
            .x_label_formatter(&|x| {
                if x.fract() == 0.0 {
                    seqs.get(*x as usize).map_or(String::new(), |s| s.to_string())
                } else {
                    String::new()
                }
            })
            .y_labels(self.n_layers.min(24) + 1)
            .y_label_formatter(&|y| match self.layers.get(*y as usize) {
                Some(l) if y.fract() == 0.0 => l.to_string(),
                _ => String::new(),
            })
            .draw()
            .map_err(err)?;
        let cells = self.columns.iter().enumerate().flat_map(|(x, (_, layers))| {
            layers.iter().enumerate().map(move |(l, &v)| {
                Rectangle::new([(x as f64, l as f64), (x as f64 + 1.0, l as f64 + 1.0)], shade(v).filled())
            })
        });
        chart.draw_series(cells).map_err(err)?;
        // The colour key.
        let mut k = ChartBuilder::on(&key)
            .margin_top(60)
            .margin_bottom(52)
            .margin_right(50)
            .y_label_area_size(0)
            .right_y_label_area_size(40)
            .build_cartesian_2d(0f64..1.0, 0f64..1.0)
            .map_err(err)?;
        k.configure_mesh().disable_mesh().disable_x_axis().y_labels(6).draw().map_err(err)?;
        let steps = (0..100).map(|i| {
            let v = i as f64 / 100.0;
            Rectangle::new([(0.0, v), (1.0, v + 0.01)], shade(v + 0.005).filled())
        });
        k.draw_series(steps).map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::shade;

    #[test]
    fn shades_run_from_white_to_dark() {
        assert_eq!(shade(0.0), plotters::style::RGBColor(255, 255, 255));
        assert_eq!(shade(1.0), plotters::style::RGBColor(8, 48, 107));
        assert_eq!(shade(7.0), shade(1.0));
    }
}
