//! `throughput.svg`: tokens per second of every step.

use super::line::{self, Labels, Series};
use super::read::StepRecord;
use super::style::{DrawError, PALETTE};

/// The throughput chart of `records` (titled after `run`, with the mean over the steps): one
/// "tokens/s" series, its y axis from 0.
pub fn chart(run: &str, records: &[StepRecord]) -> Result<String, DrawError> {
    let points: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| Some((r.step, r.tokens_per_s.filter(|v| v.is_finite())?)))
        .collect();
    let title = if points.is_empty() {
        format!("Throughput ({run})")
    } else {
        let mean = points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
        format!("Throughput ({run}): mean {mean:.0} tokens/s")
    };
    let series = [Series {
        name: "tokens/s".into(),
        colour: PALETTE[2],
        points,
        markers: false,
    }];
    let labels = Labels {
        title: &title,
        y: "tokens/s",
        from_zero: true,
    };
    line::line_chart(&labels, &series)
}
