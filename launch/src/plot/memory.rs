//! `memory.svg`: every rank's peak resident memory, from `memory.json`.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::read::MemoryReport;
use super::style::{self, DrawError, PALETTE};

/// Colour of the bars.
pub const BAR: RGBColor = PALETTE[4];
/// The widest a bar gets, in pixels.
const MAX_BAR: u32 = 120;

/// The memory chart of `report` (titled after `run` and the pipeline schedule): one bar per
/// rank with a known peak, labelled with its MiB, ranks in order along the x axis. Without such
/// a rank the axes are drawn empty with a "no data" note.
pub fn chart(run: &str, report: &MemoryReport) -> Result<String, DrawError> {
    let mut bars: Vec<(usize, f64)> = report
        .ranks
        .iter()
        .filter_map(|r| Some((r.rank, style::finite(r.peak_rss_mib?)?.max(0.0))))
        .collect();
    bars.sort_by_key(|b| b.0);
    let title = match report.schedule.as_str() {
        "" => format!("Peak memory per rank ({run})"),
        s => format!("Peak memory per rank ({run}, schedule {s})"),
    };
    let (_, y_hi) = style::value_range(bars.iter().map(|b| b.1), true);
    let slots = bars.len().max(1);
    style::render(|root| {
        let area = style::titled(root, &title)?;
        let area = area.margin(30, 0, 0, 0);
        let mut chart = ChartBuilder::on(&area)
            .margin(14)
            .x_label_area_size(48)
            .y_label_area_size(78)
            .build_cartesian_2d(style::Slots(slots), 0.0..y_hi)?;
        let rank_label = |v: &f64| {
            style::Slots::of(*v)
                .and_then(|i| bars.get(i))
                .map_or_else(String::new, |b| format!("rank {}", b.0))
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("rank")
            .y_desc("peak resident memory (MiB)")
            .x_label_formatter(&rank_label)
            .y_label_formatter(&style::tick_label)
            .label_style((style::FONT, 15))
            .axis_desc_style((style::FONT, 17))
            .light_line_style(TRANSPARENT)
            .bold_line_style(style::GRID)
            .draw()?;
        if bars.is_empty() {
            return style::no_data(&chart.plotting_area().strip_coord_spec());
        }
        // Bars fill 60% of their slot, at most `MAX_BAR` pixels.
        let slot_px = chart.plotting_area().dim_in_pixel().0 / slots as u32;
        let gap = (slot_px / 5).max(slot_px.saturating_sub(MAX_BAR) / 2);
        chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
            let mut bar = Rectangle::new([(i as f64, 0.0), (i as f64 + 1.0, b.1)], BAR.filled());
            bar.set_margin(0, 0, gap, gap);
            bar
        }))?;
        let text = (style::FONT, 14)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
            let label = format!("{} MiB", style::tick_label(&b.1));
            Text::new(label, (i as f64 + 0.5, b.1), text.clone())
        }))?;
        Ok(())
    })
}
