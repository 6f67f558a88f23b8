//! The page-cache cliff: tok/s against the memory limit, a line per system
//! (module spec in `plot`).
//!
//! ## Input
//! The JSON that `cargo xtask bench cliff --json FILE` writes, format
//! [`FORMAT`] (its spec: [`observer_common::bench_cliff`]). `tok_s` is in `0..=MAX_TOK_S`,
//! `limit_pct` in `(0, 100]`; anything else is an error naming the file and the system.
//! Several rounds of a (system, limit) are drawn as their median; each round as a small dot
//! beside it.

use std::{collections::BTreeMap, path::Path};

use anyhow::{Context, Result, bail};
pub use observer_common::bench_cliff::{Cell, CliffBench, FORMAT};
use plotters::{coord::Shift, prelude::*};

use super::{Plot, err, legend, nice_max, series_colour};

/// The largest tok/s a cell may have: far beyond any machine, and small enough that the axis
/// stays finite (a rate of 1e308 once made the axis infinite and its ticks endless).
pub const MAX_TOK_S: f64 = 1e6;

/// A bench result file, checked to be of [`FORMAT`]; errors name the file.
pub fn load(path: &Path) -> Result<CliffBench> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    parse(path, &text)
}

/// A bench result from its text; `path` names it in errors.
pub fn parse(path: &Path, text: &str) -> Result<CliffBench> {
    let b: CliffBench = serde_json::from_str(text)
        .with_context(|| format!("{}: not a bench cliff result ({FORMAT})", path.display()))?;
    if b.format != FORMAT {
        bail!("{}: format {:?}, expected {FORMAT:?}", path.display(), b.format);
    }
    Ok(b)
}

/// One system's curve: (limit, median tok/s, every round's tok/s), limits ascending, unlimited last.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    pub system: String,
    pub points: Vec<(Option<f64>, f64, Vec<f64>)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CliffPlot {
    pub title: String,
    pub curves: Vec<Curve>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

impl CliffPlot {
    /// Curves of every file's systems; a system named in several files gets the file's name.
    pub fn of(benches: &[(String, CliffBench)]) -> Result<CliffPlot> {
        let mut curves: Vec<Curve> = Vec::new();
        for (file, b) in benches {
            let mut by: BTreeMap<(String, Option<u64>), Vec<f64>> = BTreeMap::new();
            for c in &b.cells {
                if !(0.0..=MAX_TOK_S).contains(&c.tok_s) {
                    bail!(
                        "{file}: a cell of {:?} has tok/s {}: expected a rate from 0 to {MAX_TOK_S:e}",
                        c.system,
                        c.tok_s
                    );
                }
                if let Some(l) = c.limit_pct
                    && !(l > 0.0 && l <= 100.0)
                {
                    bail!(
                        "{file}: a cell of {:?} has limit_pct {l}: expected a share of the model file in (0, 100], \
                         or null for unlimited",
                        c.system
                    );
                }
                by.entry((c.system.clone(), c.limit_pct.map(f64::to_bits))).or_default().push(c.tok_s);
            }
            let mut systems: Vec<String> = b.cells.iter().map(|c| c.system.clone()).collect();
            systems.dedup();
            systems.sort();
            systems.dedup();
            for s in systems {
                let mut points: Vec<(Option<f64>, f64, Vec<f64>)> = by
                    .iter()
                    .filter(|((sys, _), _)| *sys == s)
                    .map(|((_, l), v)| (l.map(f64::from_bits), median(&mut v.clone()), v.clone()))
                    .collect();
                points.sort_by(|a, b| match (a.0, b.0) {
                    (None, None) => std::cmp::Ordering::Equal,
                    (None, _) => std::cmp::Ordering::Greater,
                    (_, None) => std::cmp::Ordering::Less,
                    (Some(x), Some(y)) => x.total_cmp(&y),
                });
                let system = if benches.len() > 1 { format!("{s} ({file})") } else { s };
                curves.push(Curve { system, points });
            }
        }
        if curves.is_empty() {
            bail!("no cells in the bench results");
        }
        let model = benches.first().map(|(_, b)| (b.model.clone(), b.model_bytes)).unwrap_or_default();
        Ok(CliffPlot {
            title: format!(
                "tok/s against the memory limit ({}, {:.2} GB)",
                Path::new(&model.0).file_name().map_or(model.0.clone(), |n| n.to_string_lossy().into_owned()),
                model.1 as f64 / 1e9
            ),
            curves,
        })
    }

    /// Where a limit is drawn: its %, unlimited at the right edge.
    fn x_of(&self, l: Option<f64>) -> f64 {
        l.unwrap_or_else(|| self.max_limit() + 20.0)
    }

    fn max_limit(&self) -> f64 {
        self.curves.iter().flat_map(|c| c.points.iter().filter_map(|p| p.0)).fold(100.0, f64::max)
    }
}

impl Plot for CliffPlot {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(err)?;
        let top =
            self.curves.iter().flat_map(|c| c.points.iter().flat_map(|p| p.2.iter())).copied().fold(0.0, f64::max);
        let unlimited = self.max_limit() + 20.0;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..unlimited + 10.0, 0f64..nice_max(top * 1.05, 0.1))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("memory limit, % of the model file")
            .y_desc("tok/s")
            .x_label_formatter(&|x| if (*x - unlimited).abs() < 1.0 { "unlimited".into() } else { format!("{x:.0}") })
            .draw()
            .map_err(err)?;
        for (i, c) in self.curves.iter().enumerate() {
            let colour = series_colour(i);
            let pts: Vec<(f64, f64)> = c.points.iter().map(|p| (self.x_of(p.0), p.1)).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
                .map_err(err)?
                .label(&c.system)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], colour.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled()))).map_err(err)?;
            let rounds = c.points.iter().flat_map(|p| p.2.iter().map(move |&v| (self.x_of(p.0) + 1.5, v)));
            chart.draw_series(rounds.map(|p| Circle::new(p, 2, colour.mix(0.6).filled()))).map_err(err)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(system: &str, limit: Option<f64>, tok_s: f64) -> Cell {
        Cell {
            system: system.into(),
            round: 0,
            limit_pct: limit,
            tok_s,
            first_tok_s: None,
            read_bytes_per_token: None,
            hit_pct: None,
            components_ms: None,
        }
    }

    #[test]
    fn curves_are_medians_in_limit_order_with_unlimited_last() {
        let b = CliffBench {
            format: FORMAT.into(),
            model: "/m/cliff.gguf".into(),
            model_bytes: 5_600_000_000,
            cells: vec![
                cell("engine cache", None, 17.0),
                cell("engine cache", Some(40.0), 4.0),
                cell("engine cache", Some(40.0), 6.0),
                cell("engine cache", Some(40.0), 5.0),
                cell("llama.cpp mmap", Some(60.0), 1.0),
                cell("engine cache", Some(60.0), 9.0),
            ],
        };
        let p = CliffPlot::of(&[("a.json".into(), b)]).unwrap();
        assert_eq!(p.curves.len(), 2);
        let c = &p.curves[0];
        assert_eq!(c.system, "engine cache");
        let xs: Vec<(Option<f64>, f64)> = c.points.iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(xs, vec![(Some(40.0), 5.0), (Some(60.0), 9.0), (None, 17.0)]);
        assert_eq!(p.curves[1].points.len(), 1);
    }

    /// Found by fuzzing (`fuzz/corpus/bench-json/tok-s-1e308-hung-the-plot`): a rate of 1e308
    /// made the axis infinite and drawing it never ended. Such cells are errors now.
    #[test]
    fn absurd_rates_and_limits_are_errors_naming_the_cell() {
        let text = include_str!("../../../fuzz/corpus/bench-json/tok-s-1e308-hung-the-plot");
        let b = parse(Path::new("x.json"), text).unwrap();
        let e = CliffPlot::of(&[("x.json".into(), b)]).unwrap_err().to_string();
        assert!(e.contains("x.json") && e.contains("limit_pct -1000000000"), "{e}");
        for (limit, tok_s, says) in [
            (Some(50.0), 1e308, "tok/s 1000000000"),
            (Some(50.0), -1.0, "tok/s -1:"),
            (Some(150.0), 1.0, "limit_pct 150:"),
        ] {
            let b = CliffBench {
                format: FORMAT.into(),
                model: "m".into(),
                model_bytes: 0,
                cells: vec![cell("a", limit, tok_s)],
            };
            let e = CliffPlot::of(&[("y.json".into(), b)]).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("\"a\""), "{e}");
        }
        let ok = CliffBench {
            format: FORMAT.into(),
            model: "m".into(),
            model_bytes: 0,
            cells: vec![cell("a", Some(100.0), 0.0)],
        };
        let p = CliffPlot::of(&[("z.json".into(), ok)]).unwrap();
        crate::plot::svg_string(&p).unwrap();
    }
}
