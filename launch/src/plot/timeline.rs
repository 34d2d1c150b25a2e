//! `timeline.svg`: the pipeline timeline per rank, a Gantt chart of the actions of a Chrome
//! trace (`merak train --trace FILE`).

use std::collections::BTreeSet;

use plotters::prelude::*;

use super::read::Span;
use super::style::{self, DrawError, PALETTE};

/// At most this many actions are drawn (the latest ones); a longer run's timeline would be
/// unreadable and its file huge.
pub const MAX_SPANS: usize = 20_000;
/// The category of the gaps between a rank's actions: not drawn (the background shows).
const IDLE: &str = "idle";
/// The colours of the categories the trainer records, in legend order.
const KNOWN: [(&str, RGBColor); 7] = [
    ("forward", PALETTE[0]),
    ("backward", PALETTE[1]),
    ("weight", PALETTE[4]),
    ("recompute", PALETTE[2]),
    ("send", PALETTE[9]),
    ("recv", PALETTE[8]),
    ("optimizer", PALETTE[7]),
];
/// Colours of other categories, in order of their names.
const OTHERS: [RGBColor; 3] = [PALETTE[5], PALETTE[6], PALETTE[3]];
/// Pixel height of one rank's row (the chart grows with the ranks up to `MAX_HEIGHT`).
const ROW: u32 = 36;
/// The tallest the chart gets.
const MAX_HEIGHT: u32 = 4000;

/// The colour of every category that occurs in `spans` (but idle), in legend order.
pub fn categories(spans: &[Span]) -> Vec<(String, RGBColor)> {
    let present: BTreeSet<&str> = spans.iter().map(|s| s.category.as_str()).collect();
    let known = KNOWN
        .iter()
        .filter(|(c, _)| present.contains(c))
        .map(|&(c, colour)| (c.to_string(), colour));
    let others = present
        .iter()
        .filter(|c| **c != IDLE && KNOWN.iter().all(|k| k.0 != **c))
        .zip(OTHERS.iter().cycle())
        .map(|(c, &colour)| (c.to_string(), colour));
    known.chain(others).collect()
}

/// The actions of `spans` (not idle) in order of their start, the latest `MAX_SPANS` of them,
/// and how many there are in all.
fn latest_actions(spans: &[Span]) -> (Vec<&Span>, usize) {
    let mut actions: Vec<&Span> = spans.iter().filter(|s| s.category != IDLE).collect();
    actions.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    let all = actions.len();
    actions.drain(..all.saturating_sub(MAX_SPANS));
    (actions, all)
}

/// The time axis of a timeline: from the first span's start, in ms (s for 2 s and more).
struct TimeAxis {
    /// The time of the axis' origin, in µs.
    t0: f64,
    /// The time the axis covers, in µs.
    span_us: f64,
    /// The axis' unit per µs.
    scale: f64,
    /// The axis' unit.
    unit: &'static str,
}

impl TimeAxis {
    /// The axis from the first start to the last end of `shown` (0 to 1 µs without spans).
    fn of(shown: &[&Span]) -> Self {
        let t0 = shown
            .iter()
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        let t1 = shown
            .iter()
            .map(|s| s.start_us + s.dur_us)
            .fold(f64::NEG_INFINITY, f64::max);
        let (t0, span_us) = if t0 < t1 { (t0, t1 - t0) } else { (0.0, 1.0) };
        let (scale, unit) = if span_us < 2e6 {
            (1e-3, "ms")
        } else {
            (1e-6, "s")
        };
        Self {
            t0,
            span_us,
            scale,
            unit,
        }
    }
}

/// The timeline of `spans` (titled after `run`): one row per rank (rank 0 on top), one
/// rectangle per action from its start to its end coloured by category, a legend row of the
/// categories, time from the first span in ms (s for timelines of 2 s and more). Idle spans
/// are left out; of more than `MAX_SPANS` actions the latest are drawn and the title says so.
/// Without actions the axes are drawn empty with a "no data" note.
pub fn chart(run: &str, spans: &[Span]) -> Result<String, DrawError> {
    let ranks: Vec<u64> = spans
        .iter()
        .map(|s| s.rank)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let (actions, all) = latest_actions(spans);
    let kept =
        |s: &&Span| all <= MAX_SPANS || actions.first().is_some_and(|a| s.start_us >= a.start_us);
    let shown: Vec<&Span> = spans.iter().filter(kept).collect();
    let TimeAxis {
        t0,
        span_us,
        scale,
        unit,
    } = TimeAxis::of(&shown);
    let at = |t: f64| (t - t0) * scale;
    let mut title = format!("Pipeline timeline ({run})");
    if all > MAX_SPANS {
        title.push_str(&format!(": last {MAX_SPANS} of {all} actions"));
    }
    let colours = categories(spans);
    let rows = ranks.len().max(1);
    let height = (200 + ROW * rows as u32).clamp(style::HEIGHT, MAX_HEIGHT);
    style::render_sized((style::WIDTH, height), |root| {
        let area = style::titled(root, &title)?;
        let legend: Vec<(&str, RGBColor)> = colours.iter().map(|(c, k)| (c.as_str(), *k)).collect();
        let area = style::legend_row(&area, &legend)?;
        let mut chart = ChartBuilder::on(&area)
            .margin(14)
            .x_label_area_size(48)
            .y_label_area_size(78)
            .build_cartesian_2d(0.0..at(t0 + span_us), style::Slots(rows))?;
        // Row `i` from the top is slot `rows - 1 - i` from the bottom.
        let rank_label = |v: &f64| {
            style::Slots::of(*v)
                .filter(|k| *k < rows)
                .and_then(|k| ranks.get(rows - 1 - k))
                .map_or_else(String::new, |r| format!("rank {r}"))
        };
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc(format!("time ({unit})"))
            .x_label_formatter(&style::tick_label)
            .y_label_formatter(&rank_label)
            .label_style((style::FONT, 15))
            .axis_desc_style((style::FONT, 17))
            .light_line_style(TRANSPARENT)
            .bold_line_style(style::GRID)
            .draw()?;
        if actions.is_empty() {
            return style::no_data(&chart.plotting_area().strip_coord_spec());
        }
        let row_px = chart.plotting_area().dim_in_pixel().1 / rows as u32;
        let pad = (row_px / 8).min(6);
        for (category, colour) in &colours {
            let rects = actions
                .iter()
                .filter(|s| s.category == *category)
                .filter_map(|s| {
                    let row = ranks.binary_search(&s.rank).ok()?;
                    let slot = (rows - 1 - row) as f64;
                    let (start, end) = (at(s.start_us), at(s.start_us + s.dur_us));
                    let mut r = Rectangle::new([(start, slot + 1.0), (end, slot)], colour.filled());
                    r.set_margin(pad, pad, 0, 0);
                    Some(r)
                });
            chart.draw_series(rects)?;
        }
        Ok(())
    })
}
