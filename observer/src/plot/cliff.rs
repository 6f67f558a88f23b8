//! The page-cache cliff (module spec in `plot`): tok/s against the memory limit, a line per
//! system ([`CliffPlot`]), and the observer's split of a token per cell ([`SplitPlot`]).
//!
//! ## Input
//! The JSON that `cargo xtask bench cliff --json FILE` writes, format
//! [`FORMAT`] (its spec: [`observer_common::bench_cliff`]). `tok_s` is in `0..=MAX_TOK_S`,
//! `limit_pct` in `(0, 100]`, each value of `components_ms` a vocabulary component's name and
//! `0..=MAX_MS`; anything else is an error naming the file and the system.
//! - The curve: several rounds of a (system, limit) are drawn as their median; each round as a
//!   small dot beside it.
//! - The split: a cell's component is the mean over its rounds that measured it, so that with
//!   rounds of equal token counts the stack is the mean token; its wall time is the mean of the
//!   rounds' `1000 / tok_s`. Cells without `components_ms` (not measured) are left out.

use std::{cmp::Ordering, collections::BTreeMap, path::Path};

use anyhow::{Context, Result, bail};
use moe_stats::{mean, median};
pub use observer_common::bench_cliff::{Cell, CliffBench, FORMAT};
use observer_common::vocab::{Component, Time};
use plotters::{
    coord::Shift,
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use super::{
    Plot, category_label, category_ticks, chart, component_colour, err, legend, nice_max, series_colour, swatch,
};

/// The largest tok/s a cell may have: far beyond any machine, and small enough that the axis
/// stays finite (a rate of 1e308 once made the axis infinite and its ticks endless).
pub const MAX_TOK_S: f64 = 1e6;

/// The largest ms per token a component of a cell may have (about 11.6 days), for the same reason.
pub const MAX_MS: f64 = 1e9;

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

/// A cell's rate and limit checked against the input's rules; errors name `file` and the system.
fn check(file: &str, c: &Cell) -> Result<()> {
    if !(0.0..=MAX_TOK_S).contains(&c.tok_s) {
        bail!("{file}: a cell of {:?} has tok/s {}: expected a rate from 0 to {MAX_TOK_S:e}", c.system, c.tok_s);
    }
    if let Some(l) = c.limit_pct
        && !(l > 0.0 && l <= 100.0)
    {
        bail!(
            "{file}: a cell of {:?} has limit_pct {l}: expected a share of the model file in (0, 100], or null for \
             unlimited",
            c.system
        );
    }
    Ok(())
}

/// A cell's split checked against the input's rules: its components and their ms per token
/// (`None`: not measured).
fn split_of(file: &str, c: &Cell) -> Result<Option<Vec<(Component, f64)>>> {
    let Some(split) = &c.components_ms else { return Ok(None) };
    let mut out = Vec::with_capacity(split.len());
    for (name, &ms) in split {
        let Some(comp) = Component::from_name(name) else {
            bail!("{file}: a cell of {:?} has component {name:?}: not a time component of the vocabulary", c.system)
        };
        if !(0.0..=MAX_MS).contains(&ms) {
            bail!("{file}: a cell of {:?} has {name} {ms} ms per token: expected 0 to {MAX_MS:e}", c.system);
        }
        out.push((comp, ms));
    }
    Ok(Some(out))
}

/// Limits in ascending order, unlimited last.
fn by_limit(a: Option<f64>, b: Option<f64>) -> Ordering {
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, _) => Ordering::Greater,
        (_, None) => Ordering::Less,
        (Some(x), Some(y)) => x.total_cmp(&y),
    }
}

/// A system's name in a plot of `files` files: with the file's name when there are several.
fn series_name(system: &str, file: &str, files: usize) -> String {
    if files > 1 { format!("{system} ({file})") } else { system.to_string() }
}

/// The model of the first file, as titles name it: `cliff.gguf, 5.60 GB`.
fn model_of(benches: &[(String, CliffBench)]) -> String {
    let (model, bytes) = benches.first().map(|(_, b)| (b.model.clone(), b.model_bytes)).unwrap_or_default();
    let name = Path::new(&model).file_name().map_or(model.clone(), |n| n.to_string_lossy().into_owned());
    format!("{name}, {:.2} GB", bytes as f64 / 1e9)
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

impl CliffPlot {
    /// Curves of every file's systems; a system named in several files gets the file's name.
    pub fn of(benches: &[(String, CliffBench)]) -> Result<CliffPlot> {
        let mut curves: Vec<Curve> = Vec::new();
        for (file, b) in benches {
            let mut by: BTreeMap<(String, Option<u64>), Vec<f64>> = BTreeMap::new();
            for c in &b.cells {
                check(file, c)?;
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
                points.sort_by(|a, b| by_limit(a.0, b.0));
                curves.push(Curve { system: series_name(&s, file, benches.len()), points });
            }
        }
        if curves.is_empty() {
            bail!("no cells in the bench results");
        }
        Ok(CliffPlot { title: format!("tok/s against the memory limit ({})", model_of(benches)), curves })
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
        let mut chart = chart(root, &self.title, (45, 60), 0f64..unlimited + 10.0, 0f64..nice_max(top * 1.05, 0.1))?;
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

/// One cell's bar of the split: its system and limit, its components' means.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitBar {
    pub system: String,
    /// % of the model file; `None`: unlimited.
    pub limit_pct: Option<f64>,
    /// Ms per token of each of the plot's components (`SplitPlot::components`, same order): the
    /// mean over the cell's rounds that measured it, 0 where none did.
    pub ms: Vec<f64>,
    /// The mean of the rounds' `1000 / tok_s` (`None`: a round decoded nothing).
    pub wall_ms: Option<f64>,
    /// The rounds with a split.
    pub rounds: usize,
}

impl SplitBar {
    /// The bar's name on the axis: `engine cache, 60 %`.
    pub fn label(&self) -> String {
        format!("{}, {}", self.system, self.limit_pct.map_or("unlimited".into(), |l| format!("{l:.0} %")))
    }

    /// The stack's length: the sum of its components.
    pub fn total(&self) -> f64 {
        self.ms.iter().sum()
    }
}

/// The observer's split of a token per cell (module spec in `plot`).
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPlot {
    pub title: String,
    /// The components some cell measured, in vocabulary order.
    pub components: Vec<Component>,
    /// From the top: unlimited first, then the limits falling; a limit's systems in file order.
    pub bars: Vec<SplitBar>,
}

impl SplitPlot {
    pub fn of(benches: &[(String, CliffBench)]) -> Result<SplitPlot> {
        // Per bar: each component's rounds (vocabulary order), the rounds' wall ms per token.
        let mut cells: Vec<(SplitBar, Vec<Vec<f64>>, Vec<f64>)> = Vec::new();
        for (file, b) in benches {
            let first = cells.len();
            for c in &b.cells {
                check(file, c)?;
                let Some(split) = split_of(file, c)? else { continue };
                let system = series_name(&c.system, file, benches.len());
                let at = cells[first..].iter().position(|(bar, ..)| {
                    bar.system == system && bar.limit_pct.map(f64::to_bits) == c.limit_pct.map(f64::to_bits)
                });
                let (_, comps, walls) = match at {
                    Some(i) => &mut cells[first + i],
                    None => {
                        let bar = SplitBar { system, limit_pct: c.limit_pct, ms: Vec::new(), wall_ms: None, rounds: 0 };
                        cells.push((bar, vec![Vec::new(); Component::N], Vec::new()));
                        cells.last_mut().expect("just pushed")
                    }
                };
                for (comp, ms) in split {
                    comps[comp as usize].push(ms);
                }
                walls.push(1e3 / c.tok_s);
            }
            // Stable: a limit's systems stay in file order.
            cells[first..].sort_by(|a, b| by_limit(b.0.limit_pct, a.0.limit_pct));
        }
        if cells.is_empty() {
            bail!("no cell of the bench results has the observer's split (components_ms)");
        }
        let components: Vec<Component> = Component::ALL
            .into_iter()
            .filter(|&c| cells.iter().any(|(_, comps, _)| !comps[c as usize].is_empty()))
            .collect();
        let bars = cells
            .into_iter()
            .map(|(mut bar, comps, walls)| {
                bar.ms = components.iter().map(|&c| mean(&comps[c as usize]).unwrap_or(0.0)).collect();
                bar.wall_ms = mean(&walls).filter(|w| (0.0..=MAX_MS).contains(w));
                bar.rounds = walls.len();
                bar
            })
            .collect();
        Ok(SplitPlot {
            title: format!("the observer's split of a token per cell, ms ({}; mean over rounds)", model_of(benches)),
            components,
            bars,
        })
    }
}

impl Plot for SplitPlot {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        root.fill(&WHITE).map_err(err)?;
        let n = self.bars.len();
        let end = |b: &SplitBar| b.total().max(b.wall_ms.unwrap_or(0.0));
        let top = self.bars.iter().map(end).fold(0.0, f64::max);
        // The first bar on top: bar i in the slot [n - 1 - i, n - i).
        let slot = |i: usize| (n - 1 - i) as f64;
        let names: Vec<String> = self.bars.iter().rev().map(SplitBar::label).collect();
        let mut chart = chart(root, &self.title, (45, 250), 0f64..nice_max(top * 1.15, 0.001), 0f64..n as f64)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("ms per token (the observer's mean thread)")
            .y_labels(category_ticks(n))
            .y_label_formatter(&|y| category_label(&names, *y))
            .draw()
            .map_err(err)?;
        let mut left = vec![0.0; n];
        for (k, &c) in self.components.iter().enumerate() {
            let colour = component_colour(c);
            let bars: Vec<Rectangle<(f64, f64)>> = self
                .bars
                .iter()
                .enumerate()
                .filter_map(|(i, b)| {
                    let v = Some(b.ms[k]).filter(|v| *v > 0.0)?;
                    let l = left[i];
                    left[i] += v;
                    Some(Rectangle::new([(l, slot(i) + 0.2), (l + v, slot(i) + 0.8)], colour.filled()))
                })
                .collect();
            chart.draw_series(bars).map_err(err)?.label(c.name()).legend(swatch(colour));
        }
        let ticks = self.bars.iter().enumerate().filter_map(|(i, b)| {
            let w = b.wall_ms?;
            Some(PathElement::new(vec![(w, slot(i) + 0.1), (w, slot(i) + 0.9)], BLACK.stroke_width(2)))
        });
        chart
            .draw_series(ticks)
            .map_err(err)?
            .label(format!("{} (1000 / tok/s)", Time::Wall.name()))
            .legend(|(x, y)| PathElement::new(vec![(x + 6, y - 6), (x + 6, y + 6)], BLACK.stroke_width(2)));
        let style = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        let totals = self.bars.iter().enumerate().map(|(i, b)| {
            let text = match b.wall_ms {
                Some(w) => format!("{:.1} ms (wall {w:.1})", b.total()),
                None => format!("{:.1} ms", b.total()),
            };
            EmptyElement::at((end(b), slot(i) + 0.5)) + Text::new(text, (6, 0), style.clone())
        });
        chart.draw_series(totals).map_err(err)?;
        legend(&mut chart, SeriesLabelPosition::UpperRight)
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
