//! Where a [`Trainer`](crate::train::Trainer) takes its token windows from.

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
}

/// The data of a run, addressed by global position so that every layout reads the same
/// sequences: a data-parallel rank asks only for its share of each global batch.
pub trait BatchSource {
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
