//! Where a [`Trainer`](crate::train::Trainer) takes its samples from.

use crate::batch::{Samples, TARGETS, TOKENS};

/// An error of a user's data source.
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Token windows: `count` sequences of `seq_len` ids, inputs and targets (negative targets are
/// ignored by the loss), row after row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Windows {
    /// Input ids, `[count * seq_len]`.
    pub inputs: Vec<i64>,
    /// Target ids, `[count * seq_len]`; negative: not counted.
    pub targets: Vec<i64>,
}

impl Windows {
    /// Target positions that count in the loss.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }

    /// The windows as `count` samples: the fields [`TOKENS`] and [`TARGETS`], `[seq]` each,
    /// holding as many loss terms as targets count. Fails when the windows are not `count`
    /// sequences of equal length.
    pub fn into_samples(self, count: usize) -> Result<Samples, crate::batch::BatchError> {
        let seq = self.inputs.len() / count.max(1);
        let terms = self.target_count();
        Samples::new(count)
            .with_int(TOKENS, &[seq], self.inputs)?
            .with_int(TARGETS, &[seq], self.targets)
            .map(|s| s.with_loss_terms(terms))
    }
}

/// The data of a run, addressed by global sample index so that every layout reads the same
/// samples: a data-parallel rank asks only for its share of each global batch, and every
/// pipeline rank reads the fields of its micro-batches itself. Augmentation must draw from
/// randomness keyed by the step and the global index (for example
/// [`splitmix64`](crate::data::splitmix64)), never from a stream that depends on which rank
/// reads.
pub trait BatchSource {
    /// Samples `first..first + count` of the global batch of step `step` (0-based).
    fn train_samples(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Samples, SourceError>;

    /// Held-out samples `first..first + count` (validation and evaluation).
    fn val_samples(&self, first: usize, count: usize) -> Result<Samples, SourceError>;
}

/// A token language model's data: windows of token ids and their targets, addressed like
/// [`BatchSource`] (which every `TokenSource` is, through
/// [`Windows::into_samples`]).
pub trait TokenSource {
    /// Sequences `first..first + count` of the global batch of step `step` (0-based).
    fn train_windows(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError>;

    /// Held-out sequences `first..first + count` (validation).
    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError>;
}

impl<T: TokenSource + ?Sized> BatchSource for T {
    fn train_samples(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Samples, SourceError> {
        Ok(self
            .train_windows(step, first, count)?
            .into_samples(count)?)
    }

    fn val_samples(&self, first: usize, count: usize) -> Result<Samples, SourceError> {
        Ok(self.val_windows(first, count)?.into_samples(count)?)
    }
}
