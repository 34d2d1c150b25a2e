//! `loss.svg`: the training loss per step and the validation loss where it was measured.

use super::line::{self, Labels, Series};
use super::read::StepRecord;
use super::style::{DrawError, PALETTE};

/// The loss chart of `records` (titled after `run`): a "training" series of every step's
/// loss and, when any step measured one, a "validation" series with a dot per point.
pub fn chart(run: &str, records: &[StepRecord]) -> Result<String, DrawError> {
    let points = |field: fn(&StepRecord) -> Option<f64>| -> Vec<(u64, f64)> {
        records
            .iter()
            .filter_map(|r| Some((r.step, field(r)?)))
            .collect()
    };
    let mut series = vec![Series {
        name: "training".into(),
        colour: PALETTE[0],
        points: points(|r| r.loss),
        markers: false,
    }];
    let val = points(|r| r.val_loss);
    if !val.is_empty() {
        series.push(Series {
            name: "validation".into(),
            colour: PALETTE[1],
            points: val,
            markers: true,
        });
    }
    let title = format!("Loss ({run})");
    let labels = Labels {
        title: &title,
        y: "loss",
        from_zero: false,
    };
    line::line_chart(&labels, &series)
}
