//! Training data: deterministic synthetic sequences (the built-in default) and prepared token
//! data sets read memory-mapped, addressed by global position so that every layout reads the
//! same sequences. [`CausalWindows`] feeds either to the [`Trainer`](crate::train::Trainer)
//! as next-token windows.

mod documents;
mod error;
mod synthetic;
mod tokens;

pub use documents::{DocumentMasked, document_fields};
pub use error::DataError;
pub use synthetic::SyntheticData;
pub use tokens::{GPT2_EOT, GPT2_VOCAB, Meta, TokenData, TokenFile, io};

/// [`crate::rng::splitmix64`], here for data sources keying augmentation by sample index.
pub use crate::rng::splitmix64;

use crate::train::{SourceError, TokenSource, Windows};

/// Validation sequences of the synthetic source come from steps this far away from training.
const SYNTHETIC_VAL_STEP: usize = 1 << 40;

/// Where training and validation sequences come from.
pub enum Dataset {
    /// Generated from the seed.
    Synthetic(SyntheticData),
    /// A prepared data set, memory-mapped.
    Tokens(Box<TokenData>),
}

impl Dataset {
    /// A one-line description for the log.
    pub fn describe(&self) -> String {
        match self {
            Dataset::Synthetic(_) => "synthetic sequences from the seed".into(),
            Dataset::Tokens(d) => format!(
                "{} training tokens ({} sequences per epoch), {} validation tokens, {} tokenizer",
                d.train.token_count(),
                d.samples_per_epoch(),
                d.val.token_count(),
                d.meta.tokenizer
            ),
        }
    }

    /// The token that ends a document: the data set's (`eot` of its meta), or for the
    /// synthetic sequences the last id of the vocabulary (`vocab - 1`, as GPT-2's is).
    pub fn eot(&self) -> i64 {
        match self {
            Dataset::Synthetic(d) => d.vocab() as i64 - 1,
            Dataset::Tokens(d) => i64::from(d.meta.eot),
        }
    }

    /// Sequences `first..first + count` of the global batch of `step` (`global_batch`
    /// sequences per step), as `(inputs, targets)`.
    pub fn train_batch(
        &self,
        step: usize,
        global_batch: usize,
        first: usize,
        count: usize,
        seq: usize,
    ) -> (Vec<i64>, Vec<i64>) {
        match self {
            Dataset::Synthetic(d) => d.batch(step, first, count, seq),
            Dataset::Tokens(d) => d.train_batch((step * global_batch + first) as u64, count),
        }
    }

    /// Held-out sequences `first..first + count`.
    pub fn val_batch(&self, first: usize, count: usize, seq: usize) -> (Vec<i64>, Vec<i64>) {
        match self {
            Dataset::Synthetic(d) => d.batch(SYNTHETIC_VAL_STEP, first, count, seq),
            Dataset::Tokens(d) => d.val_batch(first as u64, count),
        }
    }
}

/// A [`Dataset`] as the trainer's next-token windows of `seq` tokens, `global_batch` sequences
/// per step.
pub struct CausalWindows<'a> {
    /// The data.
    pub data: &'a Dataset,
    /// Sequences per step.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

impl TokenSource for CausalWindows<'_> {
    fn train_windows(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError> {
        let (inputs, targets) =
            self.data
                .train_batch(step, self.global_batch, first, count, self.seq);
        Ok(Windows { inputs, targets })
    }

    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        let (inputs, targets) = self.data.val_batch(first, count, self.seq);
        Ok(Windows { inputs, targets })
    }
}
