//! What the charts share: their size, colours and fonts, the SVG canvas, the legend row, the
//! "no data" note and the number formats of the axes.
//!
//! plotters is built without its `ttf`/`ab_glyph` features, so it needs no font files: it
//! estimates text extents from the font size (about 0.46 em per character) for layout, and the
//! SVG's `<text>` elements are drawn by whatever views the file. The layout below keeps text
//! short and leaves room around it so that a wrong estimate costs nothing.

use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Width of every chart, in pixels.
pub const WIDTH: u32 = 900;
/// Height of every chart, in pixels.
pub const HEIGHT: u32 = 520;
/// The font family of all text (the viewer picks the face).
pub const FONT: &str = "sans-serif";
/// Series colours (the Tableau 10 palette), reused cyclically.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];
/// Colour of the gridlines.
pub const GRID: RGBColor = RGBColor(0xe3, 0xe3, 0xe3);
/// Colour of the "no data" note.
const NOTE: RGBColor = RGBColor(0x88, 0x88, 0x88);
/// Values beyond this magnitude are clamped, so that axis arithmetic stays finite.
const MAX_ABS: f64 = 1e300;

/// The drawing area of a chart (an SVG canvas, or part of one).
pub type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
/// What plotters' SVG backend fails with.
pub type DrawError = DrawingAreaErrorKind<std::io::Error>;

/// Renders one chart: a white `WIDTH` x `HEIGHT` canvas handed to `draw`, as an SVG document.
pub fn render(draw: impl FnOnce(&Area<'_>) -> Result<(), DrawError>) -> Result<String, DrawError> {
    render_sized((WIDTH, HEIGHT), draw)
}

/// [`render`] on a canvas of `size` (width, height) pixels.
pub fn render_sized(
    size: (u32, u32),
    draw: impl FnOnce(&Area<'_>) -> Result<(), DrawError>,
) -> Result<String, DrawError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
    }
    Ok(svg)
}

/// Draws `title` at the top of `area` and returns the area below it.
pub fn titled<'a>(area: &Area<'a>, title: &str) -> Result<Area<'a>, DrawError> {
    area.titled(title, (FONT, 24).into_font().style(FontStyle::Bold))
}

/// Splits `area` into a row of legend entries (a colour swatch and a name each, left to right)
/// and the area below it, which it returns. Without entries nothing is split off.
pub fn legend_row<'a>(
    area: &Area<'a>,
    entries: &[(&str, RGBColor)],
) -> Result<Area<'a>, DrawError> {
    if entries.is_empty() {
        return Ok(area.clone());
    }
    let (row, rest) = area.split_vertically(30);
    let text = (FONT, 16)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let mut x = 70;
    for &(name, colour) in entries {
        row.draw(&Rectangle::new([(x, 9), (x + 22, 21)], colour.filled()))?;
        row.draw(&Text::new(name.to_string(), (x + 28, 15), text.clone()))?;
        x += 28 + text_width(name, 16) + 24;
    }
    Ok(rest)
}

/// An axis of `n` unit slots (one per rank) from 0 to `n`, its ticks at the slot centres
/// (`0.5`, `1.5`, ...; every k-th when they are too many to label).
#[derive(Clone, Copy, Debug)]
pub struct Slots(pub usize);

impl Slots {
    /// The slot whose centre is `v`.
    pub fn of(v: f64) -> Option<usize> {
        (v >= 0.0 && (v - v.floor() - 0.5).abs() < 1e-6).then(|| v.floor() as usize)
    }
}

impl Ranged for Slots {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let n = self.0.max(1) as f64;
        limit.0 + ((limit.1 - limit.0) as f64 * v / n).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let every = self.0.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0).step_by(every).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        0.0..self.0.max(1) as f64
    }
}

/// Writes "no data" in the middle of `area`.
pub fn no_data(area: &Area<'_>) -> Result<(), DrawError> {
    let (w, h) = area.dim_in_pixel();
    let style = (FONT, 22)
        .into_font()
        .color(&NOTE)
        .pos(Pos::new(HPos::Center, VPos::Center));
    area.draw(&Text::new("no data", (w as i32 / 2, h as i32 / 2), style))
}

/// The rough width in pixels of `text` at font size `size` (as plotters estimates it).
fn text_width(text: &str, size: u32) -> i32 {
    (text.chars().count() as f64 * size as f64 * 0.46).ceil() as i32
}

/// `v`, or `None` when it is not finite; clamped to `±MAX_ABS`.
pub fn finite(v: f64) -> Option<f64> {
    v.is_finite().then(|| v.clamp(-MAX_ABS, MAX_ABS))
}

/// A range covering `values` with 5% room at both ends (`from_zero`: starting at 0 when all
/// values are positive); a single value gets room around it, no values the range 0..1.
pub fn value_range(values: impl IntoIterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (lo, hi) = values
        .into_iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let lo = if from_zero && lo > 0.0 { 0.0 } else { lo };
    let span = hi / 2.0 - lo / 2.0;
    if span <= hi.abs().max(lo.abs()) * 1e-12 {
        let pad = if hi.abs() < 1e-290 {
            1.0
        } else {
            hi.abs() * 0.1
        };
        return (lo - pad, hi + pad);
    }
    let pad = span * 0.1;
    let lo = if from_zero && lo == 0.0 {
        0.0
    } else {
        lo - pad
    };
    (lo, hi + pad)
}

/// An axis label for `v` with up to 4 significant digits: `1234`, `0.25`, `2.5e-4`, `3e7`.
pub fn tick_label(v: &f64) -> String {
    let v = *v;
    let a = v.abs();
    if a < 1e-300 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            v.to_string()
        };
    }
    let e = a.log10().floor() as i32;
    if !(-3..6).contains(&e) {
        let mantissa = trim_zeros(format!("{:.3}", v / 10f64.powi(e)));
        return match mantissa.trim_start_matches('-') {
            "10" => format!("{}e{}", if v < 0.0 { "-1" } else { "1" }, e + 1),
            _ => format!("{mantissa}e{e}"),
        };
    }
    let decimals = (3 - e).clamp(0, 6) as usize;
    trim_zeros(format!("{v:.decimals$}"))
}

/// Drops trailing zeros (and a trailing dot) after a decimal point.
fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_are_compact() {
        let cases = [
            (0.0, "0"),
            (0.25, "0.25"),
            (0.30000000000000004, "0.3"),
            (1500.0, "1500"),
            (12_345.678, "12346"),
            (-3.0, "-3"),
            (2.0e7, "2e7"),
            (0.00025, "2.5e-4"),
            (9.9999e6, "1e7"),
            (0.001, "0.001"),
        ];
        for (v, want) in cases {
            assert_eq!(tick_label(&v), want, "{v}");
        }
    }

    #[test]
    fn value_ranges_cover_their_values() {
        assert_eq!(value_range([], false), (0.0, 1.0));
        let (lo, hi) = value_range([2.0, 4.0], false);
        assert!(lo < 2.0 && hi > 4.0);
        assert_eq!(value_range([2.0, 4.0], true).0, 0.0);
        let (lo, hi) = value_range([5.0], false);
        assert!(lo < 5.0 && hi > 5.0);
        let (lo, hi) = value_range([0.0, 0.0], false);
        assert!(lo < 0.0 && hi > 0.0);
        let (lo, hi) = value_range([-MAX_ABS, MAX_ABS], false);
        assert!(lo.is_finite() && hi.is_finite() && lo < hi);
    }
}
