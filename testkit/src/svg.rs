//! Reading back what a plot drew (plotters' SVG): its rectangles, and whether its bars are the
//! stacks of given values. For tests that check a picture against the numbers it was drawn from.

/// A `<rect>` of an SVG, in pixels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rect {
    pub x: i64,
    pub y: i64,
    pub width: i64,
    pub height: i64,
    /// `#RRGGBB` or `none`.
    pub fill: String,
}

/// Every `<rect …/>` of `svg`, in document order (a rect without a number attribute reads it as 0).
pub fn rects(svg: &str) -> Vec<Rect> {
    svg.match_indices("<rect")
        .map(|(i, _)| {
            let tag = svg[i..].split('>').next().unwrap_or("");
            let attr = |name: &str| {
                let key = format!(" {name}=\"");
                tag.find(&key).map(|s| &tag[s + key.len()..]).and_then(|v| v.split('"').next()).unwrap_or("")
            };
            let num = |name: &str| attr(name).parse().unwrap_or(0);
            Rect { x: num("x"), y: num("y"), width: num("width"), height: num("height"), fill: attr("fill").into() }
        })
        .collect()
}

/// The horizontal bars of `svg`: its filled, non-white rects taller than `min_height` (legend
/// swatches and frames are not), grouped into rows by (y, height), top row first, each row left
/// to right.
pub fn bar_rows(svg: &str, min_height: i64) -> Vec<Vec<Rect>> {
    let mut rows: Vec<Vec<Rect>> = Vec::new();
    for r in rects(svg) {
        if r.height <= min_height || r.fill == "none" || r.fill.eq_ignore_ascii_case("#FFFFFF") {
            continue;
        }
        match rows.iter_mut().find(|row| (row[0].y, row[0].height) == (r.y, r.height)) {
            Some(row) => row.push(r),
            None => rows.push(vec![r]),
        }
    }
    rows.sort_by_key(|row| row[0].y);
    for row in &mut rows {
        row.sort_by_key(|r| r.x);
    }
    rows
}

/// Whether `rows` (of [`bar_rows`]) are stacked bars of `values`, a bar per row in order, each
/// bar its values' segments left to right (values of 0 are not drawn), all from one origin at
/// one scale (pixels per unit, taken from the longest bar): every segment's right edge within
/// `tol_px` pixels of where its value puts it. `Err` says what differs.
pub fn check_stacks(rows: &[Vec<Rect>], values: &[Vec<f64>], tol_px: f64) -> Result<(), String> {
    if rows.len() != values.len() {
        return Err(format!("{} bars drawn, {} expected", rows.len(), values.len()));
    }
    let values: Vec<Vec<f64>> = values.iter().map(|v| v.iter().copied().filter(|x| *x > 0.0).collect()).collect();
    let (Some(first), Some(longest)) = (
        rows.first().and_then(|r| r.first()),
        (0..values.len()).max_by(|&a, &b| values[a].iter().sum::<f64>().total_cmp(&values[b].iter().sum())),
    ) else {
        return Ok(());
    };
    let x0 = first.x as f64;
    let right = |r: &Rect| (r.x + r.width) as f64;
    let scale = rows[longest].last().map_or(0.0, |r| right(r) - x0) / values[longest].iter().sum::<f64>();
    for (i, (row, vals)) in rows.iter().zip(&values).enumerate() {
        if row.len() != vals.len() {
            return Err(format!("bar {i}: {} segments drawn, {} values above 0 ({vals:?})", row.len(), vals.len()));
        }
        if (row[0].x as f64 - x0).abs() > tol_px {
            return Err(format!("bar {i} starts at x {}, the first at {x0}", row[0].x));
        }
        let mut sum = 0.0;
        for (k, (r, v)) in row.iter().zip(vals).enumerate() {
            sum += v;
            let want = x0 + sum * scale;
            if (right(r) - want).abs() > tol_px {
                return Err(format!(
                    "bar {i}, segment {k} ({v}): ends at x {}, its value puts it at {want:.1} ({scale:.3} px per unit)",
                    right(r)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rect(x: i64, y: i64, w: i64, h: i64, fill: &str) -> String {
        format!(
            "<rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{h}\" opacity=\"1\" fill=\"{fill}\" stroke=\"none\"/>"
        )
    }

    #[test]
    fn bars_are_read_and_checked_against_their_values() {
        let svg = [
            rect(0, 0, 800, 600, "#FFFFFF"),
            rect(100, 300, 40, 30, "#1F77B4"),
            rect(100, 100, 100, 30, "#1F77B4"),
            rect(200, 100, 50, 30, "#FF7F0E"),
            rect(700, 20, 12, 10, "#1F77B4"),
            rect(690, 10, 100, 60, "none"),
        ]
        .concat();
        let rows = bar_rows(&svg, 12);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].iter().map(|r| r.width).collect::<Vec<_>>(), [100, 50]);
        assert_eq!(check_stacks(&rows, &[vec![2.0, 0.0, 1.0], vec![0.8]], 1.0), Ok(()));
        assert!(check_stacks(&rows, &[vec![2.0, 1.0], vec![1.0]], 1.0).unwrap_err().contains("bar 1, segment 0"));
        assert!(check_stacks(&rows, &[vec![2.0], vec![0.8]], 1.0).unwrap_err().contains("2 segments drawn"));
        assert!(check_stacks(&rows, &[vec![2.0, 1.0]], 1.0).unwrap_err().contains("2 bars drawn, 1 expected"));
    }
}
