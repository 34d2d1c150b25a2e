//! Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022).
//!
//! Between the tensor-parallel blocks (LayerNorms, dropout, residual adds, the bias of a
//! row-parallel layer, the embeddings' sum) every TP rank holds a slice of each sequence
//! instead of the whole of it, so those activations are divided by tp:
//!
//! - a column-parallel block's input is all-gathered along the sequence (*ḡ*; its backward
//!   reduce-scatters the gradient, replacing *f*'s all-reduce), a row-parallel block's output
//!   reduce-scattered along it (*g*; replacing its all-reduce): inside the products'
//!   operations ([`sequence_overlap`](super::sequence_overlap)), and as
//!   [`gather_from_sp`](super::ops::gather_from_sp) and
//!   [`scatter_to_sp`](super::ops::scatter_to_sp) for the embedding and the head;
//! - a replicated parameter used between the blocks sees only this rank's tokens, so its
//!   gradient is summed over the TP group ([`sp_param`]: *f* on the parameter's value);
//! - dropout between the blocks draws, for each sample, the rows of the mask the whole
//!   sequence would have that the rank holds
//!   ([`ReplicatedDropout::set_sequence_rows`](super::ReplicatedDropout::set_sequence_rows)
//!   with the rows of [`HeldPositions`], which also knows context parallelism's share).
//!
//! **Token order.** The canonical order is the sequence's own: TP rank `r` holds positions
//! `r s / tp .. (r + 1) s / tp` of every sequence, with or without `parallel.tp_overlap`
//! (whose chunks are cut inside the slices), so positions, dropout masks and gathers all use
//! it and a run equals the one-process run.

use burn::tensor::{Int, Tensor};

use super::ops::{ParallelBackend, copy_to_tp};
use crate::comm::Group;
use crate::context_parallel::{ZigZag, ZigZagError};
use crate::kernels::embedding;

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

/// How a model's sequences are split between its tensor-parallel blocks: by the TP group under
/// sequence parallelism, and across a context-parallel group. A model keeps one and asks it
/// which positions its rank holds ([`held`](Self::held)) and for their position embeddings.
#[derive(Clone, Copy, Debug)]
pub struct SequenceSplit {
    /// The tensor-parallel group.
    tp: Group,
    /// Whether sequence parallelism is on (tp > 1).
    sequence_parallel: bool,
    /// The context-parallel group, when it has more than one rank.
    context_parallel: Option<Group>,
    /// The sequence length the model is built for.
    seq_len: usize,
}

impl SequenceSplit {
    /// Whole sequences of `seq_len` tokens on every rank of `tp`.
    pub fn new(tp: Group, seq_len: usize) -> Self {
        Self {
            tp,
            sequence_parallel: false,
            context_parallel: None,
            seq_len,
        }
    }

    /// The same with sequence parallelism on or off (no effect at tp = 1).
    pub fn with_sequence_parallel(self, on: bool) -> Self {
        Self {
            sequence_parallel: on && self.tp.size() > 1,
            ..self
        }
    }

    /// The same with the sequences cut across `cp` (no effect for a group of one rank). Fails
    /// unless `2 cp` divides the sequence length.
    pub fn with_context_parallel(self, cp: Group) -> Result<Self, ZigZagError> {
        if cp.size() > 1 {
            ZigZag::new(self.seq_len, cp.size(), cp.rank())?;
        }
        Ok(Self {
            context_parallel: (cp.size() > 1).then_some(cp),
            ..self
        })
    }

    /// Whether sequence parallelism is on.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The context-parallel group, when the sequences are cut across one.
    pub fn context_parallel(&self) -> Option<Group> {
        self.context_parallel
    }

    /// Under sequence parallelism, the group whose ranks split the sequences and this rank's
    /// part; `(None, whole)` otherwise.
    pub fn region(&self) -> (Option<Group>, SeqShare) {
        match self.sequence_parallel {
            true => (Some(self.tp), SeqShare::of(self.tp)),
            false => (None, SeqShare::WHOLE),
        }
    }

    /// The positions of every sequence this rank's hidden states hold between the blocks.
    pub fn held(&self) -> HeldPositions {
        let zigzag = (self.context_parallel)
            .and_then(|cp| ZigZag::new(self.seq_len, cp.size(), cp.rank()).ok());
        HeldPositions::whole(self.seq_len)
            .with_context(zigzag)
            .with_share(self.region().1)
    }

    /// The position embeddings of this rank's rows of `[batch, seq]` tokens, from `table`
    /// (`[max positions, hidden]`): rows `positions` (`[batch, seq]`, when the samples carry
    /// them: a document mask's or context parallelism's), otherwise `0..seq` broadcast over
    /// the batch; under sequence parallelism only this rank's part (the table read through
    /// [`sp_param`]).
    pub fn position_embeddings<B: ParallelBackend>(
        &self,
        table: Tensor<B, 2>,
        seq: usize,
        positions: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        let (group, share) = self.region();
        let (start, len) = share.range(seq);
        let table = sp_param(table, group);
        match positions {
            Some(positions) => embedding(table, positions.narrow(1, start, len), 0),
            None => table.narrow(0, start, len).unsqueeze::<3>(),
        }
    }
}
