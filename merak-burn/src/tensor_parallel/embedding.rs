//! The vocabulary-parallel embedding, also used as the tied output head.

use crate::precision::autocast;
use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::{Int, Tensor, backend::Backend};

use super::init::{Shard, TpError};
use super::linear::{param2, shard_of};
use super::ops::{ParallelBackend, copy_to_tp, gather_from_sp, reduce_from_tp, scatter_to_sp};
use super::sharding::padded_vocab;
use super::sharding::{ShardKind, Split};
use crate::comm::Group;
use crate::kernels::{embedding, linear};

/// An embedding table split over the vocabulary: rank `r` holds rows
/// `r * V_pad / tp .. (r + 1) * V_pad / tp`. A token outside the local range contributes zero,
/// and a *g* operator sums the partial lookups.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// The local Burn embedding: weight `[V_pad / tp, d_model]`.
    pub embedding: Embedding<B>,
    /// The table split by vocabulary rows.
    pub split: Split<B>,
    #[module(skip)]
    vocab_size: usize,
    #[module(skip)]
    vocab_start: usize,
    #[module(skip)]
    local_rows: usize,
    #[module(skip)]
    group: Group,
    #[module(skip)]
    sequence_parallel: bool,
}

impl<B: ParallelBackend> VocabParallelEmbedding<B> {
    /// Builds this rank's shard from the full `[vocab, d_model]` table (without padding).
    pub fn from_full(
        weight: &[f32],
        vocab_size: usize,
        d_model: usize,
        group: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        if weight.len() != vocab_size * d_model {
            return Err(TpError::FullSize {
                what: "embedding table",
                expected: vocab_size * d_model,
                got: weight.len(),
            });
        }
        let padded = padded_vocab(vocab_size, group.size());
        let mut full = weight.to_vec();
        full.resize(padded * d_model, 0.0);
        let shard: Shard = shard_of(group);
        let local_rows = padded / group.size();
        let weight = param2(
            shard.rows(&full, padded, d_model),
            [local_rows, d_model],
            device,
        );
        let kind = ShardKind::VocabRows { vocab: vocab_size };
        Ok(Self {
            embedding: Embedding { weight },
            split: Split::new(group, [("embedding.weight", kind)]),
            vocab_size,
            vocab_start: shard.rank * local_rows,
            local_rows,
            group,
            sequence_parallel: false,
        })
    }

    /// Sequence parallelism on (or off): the lookup's sum is reduce-scattered along the
    /// sequence (each rank keeps its slice, [`SeqShare`](super::SeqShare)) and the head
    /// all-gathers its input along the sequence.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// The real (unpadded) vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The first global token id held by this rank.
    pub fn vocab_start(&self) -> usize {
        self.vocab_start
    }

    /// The TP group.
    pub fn group(&self) -> Group {
        self.group
    }

    /// `[batch, seq]` token ids to `[batch, seq, d_model]` embeddings: each rank looks up the
    /// ids it holds (zeros for the others, one fused operation,
    /// [`crate::kernels::embedding`]) and the TP group sums the results. Under sequence
    /// parallelism the sum is reduce-scattered: `[batch, seq / tp, d_model]`, this rank's
    /// slice of every sequence.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let rows = embedding(self.embedding.weight.val(), ids, self.vocab_start);
        // The table stays f32 (its gradient is scattered into it); the rows enter the
        // compute precision here.
        if self.sequence_parallel {
            return autocast(scatter_to_sp(rows, 1, self.group));
        }
        autocast(reduce_from_tp(rows, self.group))
    }

    /// The tied output head: `[batch, seq, d_model]` hidden states to this rank's slice of
    /// the logits, `[batch, seq, V_pad / tp]`. Use with
    /// [`vocab_parallel_cross_entropy`](super::vocab_parallel_cross_entropy). Under sequence
    /// parallelism `hidden` is this rank's slice, `[batch, seq / tp, d_model]`, all-gathered
    /// along the sequence first.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        let hidden = if self.sequence_parallel {
            gather_from_sp(hidden, 1, self.group)
        } else {
            copy_to_tp(hidden, self.group)
        };
        let [b, s, h] = hidden.dims();
        let hidden = hidden.reshape([b * s, h]);
        // One [b s, h] x [h, V] product (its weight gradient one product over every token).
        let logits = linear(
            hidden,
            autocast(self.embedding.weight.val()).transpose(),
            None,
        );
        logits.reshape([b, s, self.local_rows])
    }
}
