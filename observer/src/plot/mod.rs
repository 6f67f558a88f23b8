//! `observer plot`: pictures of runs, drawn from the numbers `report`, `diff`
//! and the benchmarks print.
//!
//! ## Spec
//! - The output's extension picks the format: `.svg` (text as SVG `<text>`),
//!   or `.png` (text rasterised). Both lay out text with the DejaVu Sans font
//!   compiled into the binary (`observer/assets/`), so a plot looks the same on
//!   every machine and needs no system font.
//! - An output is written to a temporary file beside it and renamed into place;
//!   an output that is one of the inputs is refused.
//! - Every label that names a measured quantity is its vocabulary name
//!   (`observer_common::vocab`); colours are one per time component, in the
//!   vocabulary's order ([`component_colour`]), the same in every plot.
//! - Plots, each from one data function that tests check against the inputs:
//!   - [`tokens`]: one run, per record of the summarised steps (generated
//!     tokens; `LoadedRun::summarised`): stacked bars of the measured time
//!     components (ms), the engine's own (residual) compute as a line.
//!   - [`compare`]: the first comparison of `diff` (side A against side B): per
//!     time metric (wall, each component measured on both sides, the engine's
//!     compute) the two means with their 95 % bootstrap intervals as error bars.
//!   - [`residency`]: one run's expert grids over time: a row per MoE layer, a
//!     column per record that carries a grid, the colour the layer's mean
//!     resident fraction (0 white … 1 dark).
//!   - [`cliff`]: tok/s against the memory limit (% of the model file; the
//!     unlimited cell drawn at the right edge), a line per system, from the
//!     JSON `cargo xtask bench cliff` writes (format [`cliff::FORMAT`]).
//!   - [`cliff::SplitPlot`] (`plot cliff-split`), from the same JSON: the
//!     observer's split of a token per cell (system × limit), a horizontal
//!     stacked bar each: unlimited first, then the limits falling, the systems
//!     in the file's order; each component's mean ms per token (its cells'
//!     components in vocabulary order), the cell's mean wall time per token
//!     (1000 / tok/s) as a black tick, and both numbers written at the end.

pub mod cliff;
pub mod compare;
pub mod residency;
pub mod tokens;

use std::{ops::Range, path::Path};

use anyhow::{Context, Result, bail};
use observer_common::vocab::Component;
use plotters::{
    chart::{ChartBuilder, ChartContext},
    coord::{Shift, cartesian::Cartesian2d, types::RangedCoordf64},
    prelude::{BitMapBackend, DrawingArea, DrawingBackend, IntoDrawingArea, Rectangle, SVGBackend},
    style::{Color, FontStyle, RGBColor},
};

/// Pixel size of every plot.
pub const SIZE: (u32, u32) = (1200, 640);

/// The font compiled into the binary (DejaVu Sans; licence beside it).
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// One palette, indexed by `Component::ALL` order (compute first); its first entries also colour
/// the series of plots that are not about components ([`series_colour`]).
const PALETTE: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 187, 120),
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(152, 223, 138),
];

/// The colour of a time component, the same in every plot.
pub fn component_colour(c: Component) -> RGBColor {
    let i = Component::ALL.iter().position(|&x| x == c).unwrap_or(0);
    PALETTE[i % PALETTE.len()]
}

/// The colour of the `i`-th series of a plot that is not about components.
pub fn series_colour(i: usize) -> RGBColor {
    [PALETTE[0], PALETTE[3], PALETTE[2], PALETTE[4], PALETTE[5], PALETTE[8]][i % 6]
}

/// Something drawable on any plotters backend.
pub trait Plot {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>;
}

/// A plotters error, which borrows its backend's error type, as an `anyhow` one.
pub fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing failed: {e:?}")
}

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| {
        ["sans-serif", "serif", "monospace"]
            .iter()
            .all(|name| plotters::style::register_font(name, FontStyle::Normal, FONT).is_ok())
    });
    if !ok {
        bail!("the built-in font could not be loaded (observer/assets/DejaVuSans.ttf)");
    }
    Ok(())
}

/// Draw `plot` into `out` (`.svg` or `.png`), never over one of `inputs`.
pub fn save(plot: &impl Plot, out: &Path, inputs: &[&Path]) -> Result<()> {
    for i in inputs {
        if same_file(i, out) {
            bail!("{}: the output is one of the inputs; choose another file name", out.display());
        }
    }
    let ext = out.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let png = match ext.as_deref() {
        Some("svg") => false,
        Some("png") => true,
        _ => bail!("{}: the output must end in .svg or .png", out.display()),
    };
    register_font()?;
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = tempfile::Builder::new()
        .prefix(".observer-plot-")
        .suffix(if png { ".png" } else { ".svg" })
        .tempfile_in(dir)
        .with_context(|| format!("{}: cannot create a file in this directory", dir.display()))?;
    {
        if png {
            let root = BitMapBackend::new(tmp.path(), SIZE).into_drawing_area();
            plot.draw(&root)?;
            root.present().map_err(err)?;
        } else {
            let root = SVGBackend::new(tmp.path(), SIZE).into_drawing_area();
            plot.draw(&root)?;
            root.present().map_err(err)?;
        }
    }
    // tempfile creates 0600; a picture is for sharing.
    std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .with_context(|| format!("{}: setting permissions", tmp.path().display()))?;
    tmp.persist(out).map_err(|e| anyhow::anyhow!("{}: {}", out.display(), e.error))?;
    Ok(())
}

/// `plot` drawn as SVG text (what `save` writes to a `.svg` file).
pub fn svg_string(plot: &impl Plot) -> Result<String> {
    register_font()?;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        plot.draw(&root)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The series legend every plot draws: framed, on a translucent white box, at `pos`.
pub fn legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut plotters::chart::ChartContext<
        'a,
        DB,
        plotters::coord::cartesian::Cartesian2d<RangedCoordf64, RangedCoordf64>,
    >,
    pos: plotters::chart::SeriesLabelPosition,
) -> Result<()> {
    use plotters::style::{BLACK, Color, WHITE};
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// The legend's mark of a series drawn as filled bars of `colour`.
pub fn swatch(colour: RGBColor) -> impl Fn((i32, i32)) -> Rectangle<(i32, i32)> {
    move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled())
}

/// The chart of every plot: `title` above, `label_areas` (x axis, y axis) pixels for the axes'
/// labels, linear axes over `x` and `y`.
pub fn chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: &str,
    label_areas: (u32, u32),
    x: Range<f64>,
    y: Range<f64>,
) -> Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>> {
    ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(label_areas.0)
        .y_label_area_size(label_areas.1)
        .build_cartesian_2d(x, y)
        .map_err(err)
}

/// How many labels to ask of an axis of `n` categories: its ticks then fall on every half unit
/// (plotters' key points), so that [`category_label`] finds each category's centre.
pub fn category_ticks(n: usize) -> usize {
    2 * n + 1
}

/// The axis label at `v` of categories `names`, the `i`-th drawn on `[i, i + 1)`: its name at the
/// centre, nothing elsewhere.
pub fn category_label(names: &[String], v: f64) -> String {
    let i = v.floor();
    if i >= 0.0 && (v - i - 0.5).abs() < 0.26 {
        names.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

/// Round `v` up to a "nice" axis maximum (1, 2 or 5 × 10^k), at least `min`.
pub fn nice_max(v: f64, min: f64) -> f64 {
    let v = v.max(min);
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|&m| m >= v).unwrap_or(10.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_maxima() {
        assert_eq!(nice_max(0.0, 1.0), 1.0);
        assert_eq!(nice_max(13.0, 1.0), 20.0);
        assert_eq!(nice_max(20.0, 1.0), 20.0);
        assert_eq!(nice_max(51.0, 1.0), 100.0);
        assert_eq!(nice_max(0.3, 0.1), 0.5);
    }

    #[test]
    fn components_have_distinct_colours() {
        let mut seen: Vec<RGBColor> = Vec::new();
        for c in Component::ALL {
            let col = component_colour(c);
            assert!(!seen.contains(&col), "{} shares a colour", c.name());
            seen.push(col);
        }
    }
}
