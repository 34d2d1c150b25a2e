//! Dependency-free SVG line charts for training curves (`loss.svg` from `metrics.jsonl`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Width of the SVG view box.
const WIDTH: f64 = 800.0;
/// Height of the SVG view box.
const HEIGHT: f64 = 480.0;
/// Font size of tick labels and legend entries.
const FONT: f64 = 12.0;
/// Rough width of one character at `FONT` (for layout only).
const CHAR_W: f64 = 7.0;
/// Series colours (the Tableau 10 palette), reused cyclically.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];
/// Values beyond this magnitude are clamped so that axis arithmetic stays finite.
const MAX_ABS: f64 = 1e300;
/// Series with at most this many points also get a dot per point.
const MARKER_MAX_POINTS: usize = 40;

/// One named series of (x, y) points.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// Name shown in the legend.
    pub name: String,
    /// The points, in any order (they are drawn sorted by x); points with a non-finite
    /// coordinate are skipped.
    pub points: Vec<(f64, f64)>,
}

/// Renders a line chart of `series` (shared axes) as a standalone SVG document.
///
/// The document has an 800x480 view box, a title, gridlines, "nice" ticks (steps of 1, 2 or
/// 5 times a power of ten) with labels on both axes, one polyline per series that has at
/// least one finite point, and a legend naming those series. Points with NaN or infinite
/// coordinates are skipped; when no series has a point left the axes are drawn empty with a
/// "no data" note. All text is XML-escaped.
pub fn line_chart_svg(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let drawn = drawn_series(series);
    let (frame, legend) = layout(&drawn);
    let mut s = String::with_capacity(8192);
    write_header(&mut s, title);
    write_grid(&mut s, &frame);
    write_tick_labels(&mut s, &frame);
    write_axis_titles(&mut s, &frame, x_label, y_label);
    write_plot_frame(&mut s, &frame, drawn.is_empty());
    for d in &drawn {
        write_series(&mut s, &frame, d);
    }
    write_legend(&mut s, &legend);
    s.push_str("</svg>\n");
    s
}

/// The series of `series` that have at least one finite point, each with its colour index
/// (its position in `series`) and its cleaned points.
fn drawn_series(series: &[Series]) -> Vec<Drawn<'_>> {
    series
        .iter()
        .enumerate()
        .map(|(colour, s)| Drawn {
            colour,
            name: &s.name,
            points: clean_points(&s.points),
        })
        .filter(|d| !d.points.is_empty())
        .collect()
}

/// The smallest and largest x and y over all points of `drawn` as `(x_min, x_max, y_min,
/// y_max)`, or the unit square when there are no points.
fn data_bounds(drawn: &[Drawn]) -> (f64, f64, f64, f64) {
    let bounds = drawn.iter().flat_map(|d| d.points.iter()).fold(
        None,
        |acc: Option<(f64, f64, f64, f64)>, &(x, y)| {
            Some(match acc {
                None => (x, x, y, y),
                Some((x0, x1, y0, y1)) => (x0.min(x), x1.max(x), y0.min(y), y1.max(y)),
            })
        },
    );
    bounds.unwrap_or((0.0, 1.0, 0.0, 1.0))
}

/// The plot area of a chart: its axes and its edges in SVG coordinates.
struct Frame {
    x_axis: Axis,
    y_axis: Axis,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
}

impl Frame {
    /// The width of the plot area.
    fn width(&self) -> f64 {
        self.right - self.left
    }

    /// The height of the plot area.
    fn height(&self) -> f64 {
        self.bottom - self.top
    }

    /// The SVG x coordinate of the data value `x`.
    fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x_axis.lo) / (self.x_axis.hi - self.x_axis.lo) * self.width()
    }

    /// The SVG y coordinate of the data value `y`.
    fn py(&self, y: f64) -> f64 {
        self.bottom - (y - self.y_axis.lo) / (self.y_axis.hi - self.y_axis.lo) * self.height()
    }
}

/// Lays out the chart of `drawn`: axes covering its points, a left margin that fits the
/// widest y tick label, a right margin that fits half the last x tick label, and a top margin
/// that fits the legend rows (returned with the frame).
fn layout<'a>(drawn: &'a [Drawn<'a>]) -> (Frame, Vec<LegendEntry<'a>>) {
    let (x_min, x_max, y_min, y_max) = data_bounds(drawn);
    let x_axis = Axis::new(x_min, x_max);
    let y_axis = Axis::new(y_min, y_max);
    let y_label_w = y_axis
        .labels
        .iter()
        .map(|l| text_width(l))
        .fold(0.0, f64::max);
    let left = (34.0 + y_label_w).max(56.0);
    let last_x_label_w = x_axis.labels.last().map_or(0.0, |l| text_width(l));
    let right = WIDTH - (last_x_label_w / 2.0 + 8.0).max(28.0);
    let legend = layout_legend(drawn, left, right);
    let legend_rows = legend.iter().map(|e| e.row + 1).max().unwrap_or(0);
    let top = if legend_rows == 0 {
        46.0
    } else {
        44.0 + 18.0 * legend_rows as f64 + 10.0
    };
    let frame = Frame {
        x_axis,
        y_axis,
        left,
        right,
        top,
        bottom: HEIGHT - 54.0,
    };
    (frame, legend)
}

/// Writes the opening `<svg>` tag, the white background and the centred `title`.
fn write_header(s: &mut String, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="{FONT}">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="28" text-anchor="middle" font-size="17" font-weight="bold" fill="#222">{}</text>"##,
        WIDTH / 2.0,
        escape(title)
    );
}

/// Writes one group of lines, in `stroke`, at every x tick from `y1` to `y2` and at every y
/// tick from `x1` to `x2` (gridlines across the plot area, or tick marks outside it).
fn write_tick_lines(
    s: &mut String,
    frame: &Frame,
    stroke: &str,
    (y1, y2): (f64, f64),
    (x1, x2): (f64, f64),
) {
    let _ = writeln!(s, r#"<g stroke="{stroke}" stroke-width="1">"#);
    for &t in &frame.x_axis.ticks {
        let x = fmt_coord(frame.px(t));
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{}" x2="{x}" y2="{}"/>"#,
            fmt_coord(y1),
            fmt_coord(y2)
        );
    }
    for &t in &frame.y_axis.ticks {
        let y = fmt_coord(frame.py(t));
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{y}" x2="{}" y2="{y}"/>"#,
            fmt_coord(x1),
            fmt_coord(x2)
        );
    }
    let _ = writeln!(s, "</g>");
}

/// Writes the light gridlines across the plot area and the 5-unit tick marks outside its
/// bottom and left edges.
fn write_grid(s: &mut String, frame: &Frame) {
    let (left, right, top, bottom) = (frame.left, frame.right, frame.top, frame.bottom);
    write_tick_lines(s, frame, "#e3e3e3", (top, bottom), (left, right));
    write_tick_lines(s, frame, "#444", (bottom, bottom + 5.0), (left - 5.0, left));
}

/// Writes the tick labels: centred below the x ticks and right-aligned left of the y ticks.
fn write_tick_labels(s: &mut String, frame: &Frame) {
    let _ = writeln!(s, r##"<g fill="#333" text-anchor="middle">"##);
    for (&t, label) in frame.x_axis.ticks.iter().zip(&frame.x_axis.labels) {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            fmt_coord(frame.px(t)),
            fmt_coord(frame.bottom + 19.0),
            escape(label)
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, r##"<g fill="#333" text-anchor="end">"##);
    for (&t, label) in frame.y_axis.ticks.iter().zip(&frame.y_axis.labels) {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            fmt_coord(frame.left - 8.0),
            fmt_coord(frame.py(t) + 4.0),
            escape(label)
        );
    }
    let _ = writeln!(s, "</g>");
}

/// Writes the axis titles: `x_label` centred below the plot area and `y_label` rotated and
/// centred left of it.
fn write_axis_titles(s: &mut String, frame: &Frame, x_label: &str, y_label: &str) {
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle" font-size="13" fill="#222">{}</text>"##,
        fmt_coord(frame.left + frame.width() / 2.0),
        fmt_coord(HEIGHT - 12.0),
        escape(x_label)
    );
    let (yl_x, yl_y) = (18.0, fmt_coord(frame.top + frame.height() / 2.0));
    let _ = writeln!(
        s,
        r##"<text x="{yl_x}" y="{yl_y}" transform="rotate(-90 {yl_x} {yl_y})" text-anchor="middle" font-size="13" fill="#222">{}</text>"##,
        escape(y_label)
    );
}

/// Writes the border of the plot area and, when `no_data`, a "no data" note in its centre.
fn write_plot_frame(s: &mut String, frame: &Frame, no_data: bool) {
    let _ = writeln!(
        s,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444" stroke-width="1"/>"##,
        fmt_coord(frame.left),
        fmt_coord(frame.top),
        fmt_coord(frame.width()),
        fmt_coord(frame.height())
    );
    if no_data {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="middle" font-size="16" fill="#888">no data</text>"##,
            fmt_coord(frame.left + frame.width() / 2.0),
            fmt_coord(frame.top + frame.height() / 2.0)
        );
    }
}

/// The `points` attribute of a series' polyline: its points in SVG coordinates, with
/// consecutive points that round to the same coordinates written once.
fn polyline_coords(frame: &Frame, points: &[(f64, f64)]) -> String {
    let mut coords = String::with_capacity(points.len() * 12);
    let mut previous = String::new();
    for &(x, y) in points {
        let pair = format!("{},{}", fmt_coord(frame.px(x)), fmt_coord(frame.py(y)));
        if pair != previous {
            if !coords.is_empty() {
                coords.push(' ');
            }
            coords.push_str(&pair);
            previous = pair;
        }
    }
    coords
}

/// Writes the polyline of one series in its palette colour and, when it has at most
/// `MARKER_MAX_POINTS` points, a dot at each point (a bigger one for a single point).
fn write_series(s: &mut String, frame: &Frame, drawn: &Drawn) {
    let Drawn { colour, points, .. } = drawn;
    let colour = PALETTE[colour % PALETTE.len()];
    let coords = polyline_coords(frame, points);
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{colour}" stroke-width="1.8" stroke-linejoin="round" stroke-linecap="round" points="{coords}"/>"#
    );
    if points.len() <= MARKER_MAX_POINTS {
        let r = if points.len() == 1 { 3.5 } else { 2.5 };
        let _ = writeln!(s, r#"<g fill="{colour}">"#);
        for &(x, y) in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{}" cy="{}" r="{r}"/>"#,
                fmt_coord(frame.px(x)),
                fmt_coord(frame.py(y))
            );
        }
        let _ = writeln!(s, "</g>");
    }
}

/// Writes the legend between the title and the plot area: per entry a short line in its
/// series' colour followed by the series' name.
fn write_legend(s: &mut String, legend: &[LegendEntry]) {
    for entry in legend {
        let colour = PALETTE[entry.colour % PALETTE.len()];
        let cy = 44.0 + 9.0 + 18.0 * entry.row as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{cy}" x2="{}" y2="{cy}" stroke="{colour}" stroke-width="3" stroke-linecap="round"/>"#,
            fmt_coord(entry.x),
            fmt_coord(entry.x + 22.0)
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#222">{}</text>"##,
            fmt_coord(entry.x + 28.0),
            fmt_coord(cy + 4.0),
            escape(entry.name)
        );
    }
}

/// Writes `dir/loss.svg` from the records of `dir/metrics.jsonl` and returns its path.
///
/// Every line is one JSON object; those with a numeric `step` and `loss` give the
/// "training" series, and those with a numeric `val_loss` (and `step`) a second
/// "validation" series. Lines that are not valid JSON, lack the fields or carry
/// non-finite values are skipped. Fails only when the file cannot be read or the SVG
/// cannot be written.
pub fn write_loss_curve(dir: &Path) -> std::io::Result<PathBuf> {
    let bytes = std::fs::read(dir.join("metrics.jsonl"))?;
    let text = String::from_utf8_lossy(&bytes);
    let field = |rec: &serde_json::Value, key: &str| {
        rec.get(key)
            .and_then(serde_json::Value::as_f64)
            .filter(|v| v.is_finite())
    };
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Ok(rec) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = field(&rec, "step") else {
            continue;
        };
        if let Some(loss) = field(&rec, "loss") {
            train.push((step, loss));
        }
        if let Some(loss) = field(&rec, "val_loss") {
            val.push((step, loss));
        }
    }
    let mut series = vec![Series {
        name: "training".to_string(),
        points: train,
    }];
    if !val.is_empty() {
        series.push(Series {
            name: "validation".to_string(),
            points: val,
        });
    }
    let title = match dir.file_name() {
        Some(name) => format!("Loss ({})", name.to_string_lossy()),
        None => "Loss".to_string(),
    };
    let path = dir.join("loss.svg");
    std::fs::write(&path, line_chart_svg(&title, "step", "loss", &series))?;
    Ok(path)
}

/// One axis: its range (the outermost ticks), ticks and tick labels.
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    labels: Vec<String>,
}

impl Axis {
    /// The axis covering the data range `[min, max]` with nice ticks.
    fn new(min: f64, max: f64) -> Self {
        let (ticks, step) = nice_ticks(min, max);
        let lo = ticks.first().copied().unwrap_or(min);
        let hi = ticks.last().copied().unwrap_or(max);
        let max_abs = lo.abs().max(hi.abs());
        let scientific = max_abs > 0.0 && !(1e-3..1e6).contains(&max_abs);
        let labels = ticks
            .iter()
            .map(|&t| fmt_with_step(t, step, scientific))
            .collect();
        Self {
            lo,
            hi,
            ticks,
            labels,
        }
    }
}

/// A series that is drawn: its colour index (its position among all series), name and
/// finite points sorted by x.
struct Drawn<'a> {
    colour: usize,
    name: &'a str,
    points: Vec<(f64, f64)>,
}

/// One legend entry: its series' colour index and name, and where it goes.
struct LegendEntry<'a> {
    colour: usize,
    name: &'a str,
    x: f64,
    row: usize,
}

/// Lays the legend entries out left to right from `left`, wrapping before `right`.
fn layout_legend<'a>(drawn: &'a [Drawn<'a>], left: f64, right: f64) -> Vec<LegendEntry<'a>> {
    let (mut x, mut row) = (left, 0);
    let mut entries = Vec::with_capacity(drawn.len());
    for &Drawn { colour, name, .. } in drawn {
        let w = 28.0 + text_width(name);
        if x > left && x + w > right {
            x = left;
            row += 1;
        }
        entries.push(LegendEntry {
            colour,
            name,
            x,
            row,
        });
        x += w + 22.0;
    }
    entries
}

/// The finite points of `points`, clamped to `±MAX_ABS` and sorted by x (stable).
fn clean_points(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .map(|&(x, y)| (x.clamp(-MAX_ABS, MAX_ABS), y.clamp(-MAX_ABS, MAX_ABS)))
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Nice ticks covering `[min, max]`: multiples of a step of 1, 2 or 5 times a power of ten,
/// from the last multiple at or below `min` to the first at or above `max`, preferring 5 or 6
/// ticks. A degenerate range (a single value) is widened around that value first. Returns the
/// ticks and the step.
fn nice_ticks(min: f64, max: f64) -> (Vec<f64>, f64) {
    let (min, max) = if min <= max { (min, max) } else { (max, min) };
    let scale = min.abs().max(max.abs());
    // Callers pass finite values, so the comparisons below are total.
    let (lo, hi) = if max - min <= scale * 1e-12 || max - min < 1e-290 {
        let center = (min + max) / 2.0;
        let pad = if center.abs() < 1e-290 {
            1.0
        } else {
            center.abs() * 0.1
        };
        (center - pad, center + pad)
    } else {
        (min, max)
    };
    let range = hi - lo;
    let exp = range.log10().floor() as i32;
    let mut best: Option<(usize, f64, i64, i64)> = None;
    for e in (exp - 3)..=(exp + 1) {
        for m in [1.0, 2.0, 5.0] {
            let step = m * 10f64.powi(e);
            let first = (lo / step + 1e-9).floor();
            let last = (hi / step - 1e-9).ceil();
            let count = (last - first) as i64 + 1;
            if !(1..=10_000).contains(&count) {
                continue;
            }
            let penalty = match count {
                5 | 6 => 0,
                c if c < 5 => (5 - c) as usize,
                c => (c - 6) as usize,
            };
            // Steps grow, so on a tie the earlier (more ticks) wins.
            if best.is_none_or(|(p, ..)| penalty < p) {
                best = Some((penalty, step, first as i64, last as i64));
            }
        }
    }
    let Some((_, step, first, last)) = best else {
        return (vec![lo, hi], range);
    };
    let ticks = (first..=last)
        .map(|k| {
            let t = k as f64 * step;
            if t.abs() < step * 1e-9 { 0.0 } else { t }
        })
        .collect();
    (ticks, step)
}

/// Formats `v` compactly with the precision that `step` calls for: plain decimals (thousands
/// without decimals), or `2.5e-4` style when `scientific`. Trailing zeros are trimmed.
fn fmt_with_step(v: f64, step: f64, scientific: bool) -> String {
    let a = v.abs();
    if !v.is_finite() {
        return v.to_string();
    }
    if a == 0.0 || a < step.abs() * 1e-6 {
        return "0".to_string();
    }
    let step_exp = step.abs().log10().floor() as i32;
    if scientific {
        let mut e = a.log10().floor() as i32;
        let decimals = (e - step_exp).clamp(0, 6) as usize;
        let mut mantissa = trim_zeros(format!("{:.decimals$}", v / 10f64.powi(e)));
        if mantissa.trim_start_matches('-').starts_with("10") {
            e += 1;
            let decimals = (e - step_exp).clamp(0, 6) as usize;
            mantissa = trim_zeros(format!("{:.decimals$}", v / 10f64.powi(e)));
        }
        format!("{mantissa}e{e}")
    } else {
        let decimals = (-step_exp).clamp(0, 9) as usize;
        let s = trim_zeros(format!("{v:.decimals$}"));
        if s == "-0" { "0".to_string() } else { s }
    }
}

/// Formats a lone value compactly with up to 4 significant digits (`1e-3` style below
/// 0.001 and from a million up, thousands without decimals).
#[cfg(test)]
fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() || a == 0.0 {
        return fmt_with_step(v, 1.0, false);
    }
    let e = a.log10().floor() as i32;
    fmt_with_step(v, 10f64.powi(e - 3), !(1e-3..1e6).contains(&a))
}

/// Drops trailing zeros (and a trailing dot) after a decimal point.
fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A coordinate with one decimal, without a trailing `.0`.
fn fmt_coord(v: f64) -> String {
    trim_zeros(format!("{v:.1}"))
}

/// The rough rendered width of `text` at the tick-label font size.
fn text_width(text: &str) -> f64 {
    text.chars().count() as f64 * CHAR_W
}

/// Escapes the XML special characters of `text`.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.to_string(),
            points,
        }
    }

    /// Whether `step` is 1, 2 or 5 times a power of ten.
    fn is_nice(step: f64) -> bool {
        let e = step.log10().floor();
        let m = step / 10f64.powf(e);
        [1.0, 2.0, 5.0, 10.0].iter().any(|n| (m - n).abs() < 1e-9)
    }

    #[test]
    fn nice_ticks_known_ranges() {
        let (t, s) = nice_ticks(0.0, 1.0);
        assert_eq!(s, 0.2);
        assert_eq!(t.len(), 6);
        assert_eq!(t[0], 0.0);
        assert!((t[5] - 1.0).abs() < 1e-12);

        let (t, s) = nice_ticks(2.1, 10.9);
        assert_eq!(s, 2.0);
        assert_eq!(t, vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);

        let (t, s) = nice_ticks(1.0, 100.0);
        assert_eq!(s, 20.0);
        assert_eq!(t, vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);

        let (t, s) = nice_ticks(-0.003, 0.0021);
        assert_eq!(s, 0.002);
        assert_eq!(t.len(), 5);
        assert!(t.contains(&0.0));
    }

    #[test]
    fn nice_ticks_are_nice_and_cover_the_range() {
        let ranges = [
            (0.0, 1.1),
            (0.0, 1.9),
            (3.7, 4.2),
            (-250.0, 13.0),
            (1e-7, 3.3e-6),
            (12_345.0, 98_765.0),
            (5.0, 5.0),
            (0.0, 0.0),
            (-1e300, 1e300),
            (1.0, 1.0 + 1e-14),
        ];
        for (lo, hi) in ranges {
            let (t, step) = nice_ticks(lo, hi);
            assert!(is_nice(step), "{lo}..{hi}: step {step}");
            assert!((4..=7).contains(&t.len()), "{lo}..{hi}: {t:?}");
            assert!(t[0] <= lo && *t.last().unwrap() >= hi, "{lo}..{hi}: {t:?}");
            assert!(t.iter().all(|v| v.is_finite()));
            assert!(t.windows(2).all(|w| w[1] > w[0]));
        }
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(0.0005), "5e-4");
        assert_eq!(fmt_num(0.00012346), "1.235e-4");
        assert_eq!(fmt_num(0.001), "0.001");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(1500.0), "1500");
        assert_eq!(fmt_num(12_345.678), "12346");
        assert_eq!(fmt_num(-3.0), "-3");
        assert_eq!(fmt_num(2.0e7), "2e7");
        assert_eq!(fmt_with_step(0.30000000000000004, 0.1, false), "0.3");
        assert_eq!(fmt_with_step(2e-4, 1e-4, true), "2e-4");
        assert_eq!(fmt_with_step(1.5e-4, 5e-5, true), "1.5e-4");
        assert_eq!(fmt_with_step(-1e-20, 0.1, false), "0");
        let axis = Axis::new(0.0, 0.0004);
        assert!(
            axis.labels.iter().skip(1).all(|l| l.contains('e')),
            "{:?}",
            axis.labels
        );
        let axis = Axis::new(0.0, 10_000.0);
        assert_eq!(axis.labels.last().map(String::as_str), Some("10000"));
    }

    #[test]
    fn one_polyline_per_non_empty_series_with_legend() {
        let svg = line_chart_svg(
            "loss",
            "step",
            "loss",
            &[
                series(
                    "train",
                    (1..=50).map(|i| (i as f64, 10.0 / i as f64)).collect(),
                ),
                series("empty one", vec![]),
                series("val", vec![(10.0, 1.5), (20.0, 0.9), (f64::NAN, 1.0)]),
                series("only nan", vec![(f64::NAN, 1.0), (2.0, f64::INFINITY)]),
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(r#"viewBox="0 0 800 480""#));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">train</text>"));
        assert!(svg.contains(">val</text>"));
        assert!(!svg.contains("empty one"));
        assert!(!svg.contains("only nan"));
        assert!(!svg.contains("no data"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert!(svg.contains(PALETTE[0]) && svg.contains(PALETTE[2]));
    }

    #[test]
    fn escapes_text() {
        let svg = line_chart_svg(
            "a<b & c>d",
            "x \"quoted\"",
            "y's",
            &[series("<s>", vec![(0.0, 1.0), (1.0, 2.0)])],
        );
        assert!(svg.contains("a&lt;b &amp; c&gt;d"));
        assert!(svg.contains("&lt;s&gt;"));
        assert!(svg.contains("x &quot;quoted&quot;"));
        assert!(svg.contains("y&apos;s"));
        assert!(!svg.contains("a<b"));
        assert!(!svg.contains("<s>"));
    }

    #[test]
    fn degenerate_inputs() {
        let empty = line_chart_svg("t", "x", "y", &[]);
        assert!(empty.contains("no data"));
        assert_eq!(empty.matches("<polyline").count(), 0);
        let all_nan = line_chart_svg("t", "x", "y", &[series("a", vec![(f64::NAN, 0.0)])]);
        assert!(all_nan.contains("no data"));

        let single = line_chart_svg("t", "x", "y", &[series("a", vec![(3.0, 7.0)])]);
        assert_eq!(single.matches("<polyline").count(), 1);
        assert_eq!(single.matches("<circle").count(), 1);
        assert!(!single.contains("NaN") && !single.contains("inf"));

        let flat = line_chart_svg("t", "x", "y", &[series("a", vec![(0.0, 2.0), (5.0, 2.0)])]);
        assert_eq!(flat.matches("<polyline").count(), 1);
        assert!(!flat.contains("NaN") && !flat.contains("inf"));

        let huge = line_chart_svg(
            "t",
            "x",
            "y",
            &[series("a", vec![(0.0, f64::MAX), (1.0, -f64::MAX)])],
        );
        assert!(!huge.contains("NaN") && !huge.contains("inf"));
    }

    #[test]
    fn write_loss_curve_with_validation() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!(
            "merak-plot-test-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir)?;
        let metrics = [
            r#"{"step":1,"loss":10.5,"lr":0.001}"#,
            r#"{"step":2,"loss":8.25}"#,
            "not json {",
            r#"{"step":3,"loss":null}"#,
            r#"{"step":4,"loss":6.0,"val_loss":6.5}"#,
            "",
            r#"{"loss":5.0}"#,
            r#"{"step":5,"loss":5.5}"#,
            r#"{"step":8,"loss":4.0,"val_loss":4.75}"#,
        ]
        .join("\n");
        std::fs::write(dir.join("metrics.jsonl"), metrics)?;
        let path = write_loss_curve(&dir)?;
        assert_eq!(path, dir.join("loss.svg"));
        let svg = std::fs::read_to_string(&path)?;
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">training</text>"));
        assert!(svg.contains(">validation</text>"));

        // Without val_loss there is one series; without the file an error.
        std::fs::write(dir.join("metrics.jsonl"), r#"{"step":1,"loss":2.0}"#)?;
        let svg = std::fs::read_to_string(write_loss_curve(&dir)?)?;
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(!svg.contains("validation"));
        std::fs::remove_file(dir.join("metrics.jsonl"))?;
        assert!(write_loss_curve(&dir).is_err());
        std::fs::remove_dir_all(&dir)
    }
}
