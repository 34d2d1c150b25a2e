//! The profiled GPT's micro-batches: the unit timing itself is the library's
//! ([`merak_burn::probe::time_units`] and the rest).

use merak_burn::batch::Samples;
use merak_burn::train::Windows;

/// `b` sequences of deterministic token ids for the profiled model, inputs and targets.
pub(super) fn token_batch(cfg: &merak_gpt::GptConfig, b: usize) -> Samples {
    let s = cfg.seq_len;
    let ids: Vec<i64> = (0..b * s)
        .map(|i| (i * 7919 % cfg.vocab_size) as i64)
        .collect();
    let windows = Windows {
        inputs: ids.clone(),
        targets: ids,
    };
    windows
        .into_samples(b)
        .expect("b windows of seq_len tokens")
}
