//! A learnable synthetic data set, the same for every layout.

use merak_burn::data::splitmix64;
use merak_burn::prelude::*;

/// Sequences that count up from a random start by a random stride (1 to 3), modulo the
/// vocabulary: learnable, and the same for every layout (keyed by the global sample index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counting {
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Sequences per optimizer step.
    pub global_batch: usize,
    /// Seed of the starts and strides.
    pub seed: u64,
}

impl Counting {
    /// Sequences over a vocabulary of `vocab` tokens, shaped and seeded as `settings` say.
    pub fn new(vocab: usize, settings: &TrainSettings) -> Self {
        Self {
            vocab,
            seq: settings.seq_len,
            global_batch: settings.global_batch,
            seed: settings.seed,
        }
    }

    /// The `seq + 1` tokens of global sample `g`.
    fn sample(&self, g: usize) -> Vec<i64> {
        let h = splitmix64(self.seed ^ splitmix64(g as u64));
        let (start, stride) = (h % self.vocab as u64, 1 + (h >> 32) % 3);
        (0..=self.seq as u64)
            .map(|j| ((start + j * stride) % self.vocab as u64) as i64)
            .collect()
    }

    /// Inputs and next-token targets of samples `first..first + count`.
    fn windows(&self, first: usize, count: usize) -> Windows {
        let mut w = Windows::default();
        for g in first..first + count {
            let s = self.sample(g);
            w.inputs.extend_from_slice(&s[..self.seq]);
            w.targets.extend_from_slice(&s[1..]);
        }
        w
    }
}

impl TokenSource for Counting {
    fn train_windows(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError> {
        Ok(self.windows(step * self.global_batch + first, count))
    }

    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        Ok(self.windows(usize::MAX / 2 + first, count))
    }
}
