//! Token sources.

use merak_burn::tensor_parallel::InitRng;

use crate::config::Config;
use crate::tokens::{DataError, TokenData};

/// Where training and validation sequences come from.
pub enum Source {
    /// Generated from the seed.
    Synthetic(SyntheticData),
    /// A prepared data set, memory-mapped.
    Tokens(Box<TokenData>),
}

/// Validation sequences of the synthetic source come from steps this far away from training.
const SYNTHETIC_VAL_STEP: usize = 1 << 40;

impl Source {
    /// Opens the source of `cfg` and checks it against the model before training.
    pub fn open(cfg: &Config) -> Result<Self, DataError> {
        let g = &cfg.model.gpt;
        match cfg.data.kind.as_str() {
            "tokens" => Ok(Source::Tokens(Box::new(TokenData::open(
                std::path::Path::new(&cfg.data.path),
                g.seq_len,
                g.vocab_size,
                cfg.train.seed,
            )?))),
            _ => Ok(Source::Synthetic(SyntheticData::new(
                cfg.train.seed,
                g.vocab_size,
            ))),
        }
    }

    /// A one-line description for the log.
    pub fn describe(&self) -> String {
        match self {
            Source::Synthetic(_) => "synthetic sequences from the seed".into(),
            Source::Tokens(d) => format!(
                "{} training tokens ({} sequences per epoch), {} validation tokens, {} tokenizer",
                d.train.token_count(),
                d.samples_per_epoch(),
                d.val.token_count(),
                d.meta.tokenizer
            ),
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
            Source::Synthetic(d) => d.batch(step, first, count, seq),
            Source::Tokens(d) => d.train_batch((step * global_batch + first) as u64, count),
        }
    }

    /// Held-out sequences `first..first + count`.
    pub fn val_batch(&self, first: usize, count: usize, seq: usize) -> (Vec<i64>, Vec<i64>) {
        match self {
            Source::Synthetic(d) => d.batch(SYNTHETIC_VAL_STEP, first, count, seq),
            Source::Tokens(d) => d.val_batch(first as u64, count),
        }
    }
}

/// Deterministic synthetic sequences: each sequence is an arithmetic progression modulo the
/// vocabulary with a random start and a stride from a small set, so the next token is
/// predictable from the two before it and the loss falls quickly. Sequence `i` of step `k`
/// depends only on the seed, `k` and `i`: any layout reads the same global batch.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticData {
    rng: InitRng,
    vocab: usize,
}

impl SyntheticData {
    /// A source over `vocab` tokens.
    pub fn new(seed: u64, vocab: usize) -> Self {
        Self {
            rng: InitRng::new(seed ^ 0x5EED_DA7A),
            vocab,
        }
    }

    /// Sequence `index` of step `step`: `len` token ids.
    pub fn sequence(&self, step: usize, index: usize, len: usize) -> Vec<i64> {
        let r = self
            .rng
            .integers(&format!("synthetic/{step}/{index}"), 2, self.vocab as u64);
        let start = r[0];
        let stride = 1 + r[1] % 7;
        (0..len as u64)
            .map(|t| ((start + t * stride) % self.vocab as u64) as i64)
            .collect()
    }

    /// Sequences `first..first + count` of step `step` as `(inputs, targets)`, each
    /// `count * seq` ids, row-major: targets are the inputs shifted by one token.
    pub fn batch(
        &self,
        step: usize,
        first: usize,
        count: usize,
        seq: usize,
    ) -> (Vec<i64>, Vec<i64>) {
        let mut inputs = Vec::with_capacity(count * seq);
        let mut targets = Vec::with_capacity(count * seq);
        for i in first..first + count {
            let s = self.sequence(step, i, seq + 1);
            inputs.extend_from_slice(&s[..seq]);
            targets.extend_from_slice(&s[1..]);
        }
        (inputs, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_deterministic_and_shifted() {
        let d = SyntheticData::new(1, 100);
        let (x, y) = d.batch(3, 0, 2, 8);
        assert_eq!((x.clone(), y.clone()), d.batch(3, 0, 2, 8));
        assert_eq!(&x[1..8], &y[..7]);
        assert!(x.iter().all(|&t| (0..100).contains(&t)));
        // A shard of the batch is the same as the corresponding rows of the whole batch.
        assert_eq!(d.batch(3, 1, 1, 8).0, x[8..].to_vec());
    }
}
