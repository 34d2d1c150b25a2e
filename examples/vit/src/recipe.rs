//! What `vit-train` asks of a run and what it prints of one: the training settings and the
//! report of the held-out evaluation.

use std::fmt::Write;

use merak_burn::prelude::*;

use crate::DigitsSource;
use crate::config::POSITIONS;

/// Predictions shown next to their labels.
const SHOWN: usize = 20;

/// `steps` AdamW steps of `global_batch` images at peak learning rate `lr` (a linear warm-up
/// over the first 5% of the steps, then cosine decay to `lr / 10`), weight decay 0.05,
/// seeded `seed`, with the model's [`POSITIONS`] positions between units.
pub fn settings(steps: usize, global_batch: usize, lr: f64, seed: u64) -> TrainSettings {
    TrainSettings::default()
        .with_steps(steps)
        .with_global_batch(global_batch)
        .with_seq_len(POSITIONS)
        .with_lr(lr)
        .with_min_lr(lr / 10.0)
        .with_warmup_steps(steps / 20)
        .with_weight_decay(0.05)
        .with_seed(seed)
}

/// What rank 0 prints of a finished run `r` (`None` on the other ranks): the plan, the
/// summary, the held-out loss and accuracy (from [`RunReport::metrics`], the head's sums
/// `loss`, `correct` and `images`) and the first predictions against their labels.
pub fn report(r: &RunReport, data: &DigitsSource) -> Option<String> {
    if r.rank != 0 {
        return None;
    }
    let mut s = String::new();
    let _ = writeln!(s, "vit: planned {}", r.plan);
    let _ = write!(s, "vit: {}", r.summary);
    let held_out = (r.metrics.as_ref()).and_then(|m| {
        let (correct, images) = (m.sum("correct")?, m.sum("images")?);
        Some((m.ratio("loss", "images")?, correct, images))
    });
    if let Some((loss, correct, images)) = held_out {
        let accuracy = correct / images;
        let _ = write!(
            s,
            "\nvit: held-out loss {loss:.6} accuracy {accuracy:.4} ({correct} of {images} \
             images, {} held out)",
            data.held_out()
        );
    }
    if let Some(p) = &r.predictions {
        let shown = p.rows.min(SHOWN);
        let predicted = &p.argmax()[..shown];
        let _ = write!(s, "\nvit: predicted {predicted:?}");
        let _ = write!(s, "\nvit: labels    {:?}", data.held_out_labels(0, shown));
    }
    Some(s)
}
