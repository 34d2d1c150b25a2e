//! A line chart of per-step series on shared axes, the form of `loss.svg` and
//! `throughput.svg`.

use plotters::prelude::*;

use super::style::{self, DrawError};

/// One named series of (step, value) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Name shown in the legend.
    pub name: String,
    /// Its colour.
    pub colour: RGBColor,
    /// The points; those with a non-finite value are skipped, the rest drawn sorted by step.
    pub points: Vec<(u64, f64)>,
    /// Also a dot at every point (for sparse series, such as validation losses).
    pub markers: bool,
}

/// What a line chart shows besides its series.
pub struct Labels<'a> {
    /// The chart's title.
    pub title: &'a str,
    /// The name of the y axis (the x axis is the step).
    pub y: &'a str,
    /// Whether the y axis starts at 0 (when all values are positive).
    pub from_zero: bool,
}

/// Renders `series` as one SVG line chart: a title, a legend row naming the series that have a
/// point, the axes with gridlines and one polyline per such series. Without any point the axes
/// are drawn empty with a "no data" note.
pub fn line_chart(labels: &Labels<'_>, series: &[Series]) -> Result<String, DrawError> {
    let drawn: Vec<Series> = series
        .iter()
        .map(|s| {
            let mut points: Vec<(u64, f64)> = s
                .points
                .iter()
                .filter_map(|&(x, y)| Some((x, style::finite(y)?)))
                .collect();
            points.sort_by_key(|p| p.0);
            Series {
                points,
                ..s.clone()
            }
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    let all = || drawn.iter().flat_map(|s| s.points.iter());
    let (x_lo, x_hi) = match (all().map(|p| p.0).min(), all().map(|p| p.0).max()) {
        (Some(lo), Some(hi)) if lo < hi => (lo, hi),
        (Some(lo), _) => (lo.saturating_sub(1), lo.saturating_add(1)),
        _ => (0, 1),
    };
    let (y_lo, y_hi) = style::value_range(all().map(|p| p.1), labels.from_zero);
    style::render(|root| {
        let area = style::titled(root, labels.title)?;
        let legend: Vec<(&str, RGBColor)> =
            drawn.iter().map(|s| (s.name.as_str(), s.colour)).collect();
        let area = style::legend_row(&area, &legend)?;
        let mut chart = ChartBuilder::on(&area)
            .margin(14)
            .x_label_area_size(48)
            .y_label_area_size(78)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(labels.y)
            .y_label_formatter(&style::tick_label)
            .label_style((style::FONT, 15))
            .axis_desc_style((style::FONT, 17))
            .light_line_style(TRANSPARENT)
            .bold_line_style(style::GRID)
            .draw()?;
        if drawn.is_empty() {
            return style::no_data(&chart.plotting_area().strip_coord_spec());
        }
        for s in &drawn {
            let line = s.colour.stroke_width(2);
            chart.draw_series(LineSeries::new(s.points.iter().copied(), line))?;
            if s.markers || s.points.len() == 1 {
                let dot = s.colour.filled();
                chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, dot)))?;
            }
        }
        Ok(())
    })
}
