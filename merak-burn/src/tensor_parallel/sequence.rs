//! Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022).
//!
//! Between the tensor-parallel blocks (LayerNorms, dropout, residual adds, the bias of a
//! row-parallel layer, the embeddings' sum) every TP rank holds a slice of each sequence
//! instead of the whole of it, so those activations are divided by tp:
//!
//! - a column-parallel block's input is all-gathered along the sequence
//!   ([`gather_from_sp`](super::ops::gather_from_sp), *ḡ*; its backward reduce-scatters the
//!   gradient, replacing *f*'s all-reduce);
//! - a row-parallel block's output is reduce-scattered along the sequence
//!   ([`scatter_to_sp`](super::ops::scatter_to_sp), *g*; replacing its all-reduce);
//! - a replicated parameter used between the blocks sees only this rank's tokens, so its
//!   gradient is summed over the TP group ([`sp_param`]: *f* on the parameter's value);
//! - dropout between the blocks draws, for each sample, the slice of the mask the whole
//!   sequence would have ([`ReplicatedDropout`](super::ReplicatedDropout) with a
//!   [`SeqShare`]).
//!
//! **Token order.** The canonical order is the sequence's own: TP rank `r` holds positions
//! `r s / tp .. (r + 1) s / tp` of every sequence, with or without `parallel.tp_overlap`
//! (whose chunks are cut inside the slices), so positions, dropout masks and gathers all use
//! it and a run equals the one-process run.

use burn::tensor::Tensor;

use super::ops::{ParallelBackend, copy_to_tp};
use crate::comm::Group;
use crate::context_parallel::ZigZag;

/// The part of every sequence a rank holds between the tensor-parallel blocks: part `index`
/// of `parts` equal, contiguous parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqShare {
    /// Which part this rank holds, `0..parts`.
    pub index: usize,
    /// How many parts each sequence is cut into (tp under sequence parallelism).
    pub parts: usize,
}

impl Default for SeqShare {
    /// The whole sequence.
    fn default() -> Self {
        Self::WHOLE
    }
}

impl SeqShare {
    /// The whole sequence (no sequence parallelism).
    pub const WHOLE: SeqShare = SeqShare { index: 0, parts: 1 };

    /// This rank's part of the sequence under sequence parallelism over `group`.
    pub fn of(group: Group) -> Self {
        Self {
            index: group.rank(),
            parts: group.size(),
        }
    }

    /// The first position and the length of this part of a sequence of `seq` positions
    /// (which `parts` must divide; configurations are checked before training).
    pub fn range(self, seq: usize) -> (usize, usize) {
        let len = seq / self.parts.max(1);
        (self.index * len, len)
    }
}

/// A replicated parameter's value as a layer between the tensor-parallel blocks reads it: under
/// sequence parallelism (`group` given) through *f*, so that its gradient, computed from this
/// rank's tokens only, is summed over the TP group; unchanged otherwise.
pub fn sp_param<B: ParallelBackend, const D: usize>(
    value: Tensor<B, D>,
    group: Option<Group>,
) -> Tensor<B, D> {
    match group {
        Some(group) => copy_to_tp(value, group),
        None => value,
    }
}

/// Which positions of every sequence a rank's hidden states hold between the tensor-parallel
/// blocks: its context-parallel share (the zigzag chunks of [`ZigZag`], all positions without
/// context parallelism) and, within it, its sequence-parallel part ([`SeqShare`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldPositions {
    /// The sequence length.
    seq: usize,
    /// The context-parallel share, if any.
    context: Option<ZigZag>,
    /// The sequence-parallel part of the share.
    share: SeqShare,
}

impl HeldPositions {
    /// Every position of sequences of `seq` tokens.
    pub fn whole(seq: usize) -> Self {
        Self {
            seq,
            context: None,
            share: SeqShare::WHOLE,
        }
    }

    /// The same with the context-parallel share `context` (`None`: none).
    pub fn with_context(self, context: Option<ZigZag>) -> Self {
        Self { context, ..self }
    }

    /// The same with the sequence-parallel part `share`.
    pub fn with_share(self, share: SeqShare) -> Self {
        Self { share, ..self }
    }

    /// The sequence-parallel part.
    pub fn share(&self) -> SeqShare {
        self.share
    }

    /// The parts every sequence is cut into: cp × the sequence-parallel parts.
    pub fn parts(&self) -> usize {
        self.context.map_or(1, |z| z.cp()) * self.share.parts
    }

    /// The positions held, in the order of the rows (`None`: all of them, in order).
    pub fn rows(&self) -> Option<Vec<usize>> {
        if self.parts() == 1 {
            return None;
        }
        let all = match self.context {
            Some(z) => z.positions(),
            None => (0..self.seq).collect(),
        };
        let (start, len) = self.share.range(all.len());
        Some(all[start..start + len].to_vec())
    }
}
