//! Multi-head self-attention with the heads split across the TP group.

use burn::module::Module;
use burn::tensor::{Bool, Int, Tensor, activation::softmax, backend::Backend};

use super::init::{TpError, check_divisible};
use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::ops::ParallelBackend;
use super::overlap::TpOverlap;
use crate::comm::Group;
use crate::context_parallel::{CpAttention, ring_attention, ulysses_attention};
use crate::kernels::{AttentionSpec, attention, attention_in_segments};

/// Which positions a query may attend to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionMask {
    /// Only earlier positions and itself (GPT).
    Causal,
    /// Every position (BERT).
    Bidirectional,
}

/// The full-size parameters of a self-attention block, row-major, as a single process has them.
#[derive(Clone, Debug)]
pub struct AttentionWeights {
    /// Fused Q/K/V projection `[d_model, 3 * d_model]` (Q columns, then K, then V).
    pub qkv_weight: Vec<f32>,
    /// Its bias, `[3 * d_model]`.
    pub qkv_bias: Vec<f32>,
    /// Output projection `[d_model, d_model]`.
    pub proj_weight: Vec<f32>,
    /// Its bias, `[d_model]`.
    pub proj_bias: Vec<f32>,
}

/// Self-attention: a column-parallel fused Q/K/V projection (each rank computes
/// `heads / tp` heads) and a row-parallel output projection.
#[derive(Module, Debug)]
pub struct ParallelSelfAttention<B: Backend> {
    /// Q/K/V projection, `[d_model, 3 * d_model / tp]`.
    pub qkv: ColumnParallelLinear<B>,
    /// Output projection, `[d_model / tp, d_model]`.
    pub proj: RowParallelLinear<B>,
    #[module(skip)]
    local_heads: usize,
    #[module(skip)]
    head_dim: usize,
    #[module(skip)]
    mask: AttentionMask,
    /// The context-parallel group whose ranks hold the other parts of each sequence and how
    /// the attention exchanges them (`None`: whole sequences).
    #[module(skip)]
    context_parallel: Option<(Group, CpAttention)>,
}

impl<B: ParallelBackend> ParallelSelfAttention<B> {
    /// Builds this rank's shard. Fails unless `tp` divides the head count.
    pub fn from_full(
        w: &AttentionWeights,
        d_model: usize,
        heads: usize,
        mask: AttentionMask,
        group: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        check_divisible("attention heads", heads, group.size())?;
        check_divisible("hidden size (per head)", d_model, heads)?;
        let qkv = ColumnParallelLinear::from_full(
            &w.qkv_weight,
            Some(&w.qkv_bias),
            d_model,
            3 * d_model,
            3,
            false,
            group,
            device,
        )?;
        let proj = RowParallelLinear::from_full(
            &w.proj_weight,
            Some(&w.proj_bias),
            d_model,
            d_model,
            group,
            device,
        )?;
        Ok(Self {
            qkv,
            proj,
            local_heads: heads / group.size(),
            head_dim: d_model / heads,
            mask,
            context_parallel: None,
        })
    }

    /// Context parallelism over `group` (or, with `None`, none): this rank's sequences are its
    /// zigzag share of every sequence ([`crate::context_parallel::ZigZag`]), and the attention
    /// runs as a ring over the group ([`ring_attention`]) or by all-to-all exchanges
    /// ([`ulysses_attention`]; the group's size must divide this rank's heads).
    pub fn set_context_parallel(&mut self, group: Option<Group>, exchange: CpAttention) {
        self.context_parallel = group.filter(|g| g.size() > 1).map(|g| (g, exchange));
    }

    /// Sub-pipelines both projections over `overlap` token chunks: the
    /// Q/K/V projection's input-gradient all-reduce (backward) and the output projection's
    /// all-reduce (forward). The attention between them keeps whole sequences: it mixes the
    /// tokens of a sequence, so it is not cut.
    pub fn set_overlap(&mut self, overlap: TpOverlap) {
        self.qkv.set_overlap(overlap);
        self.proj.set_overlap(overlap);
    }

    /// Sequence parallelism on (or off): the input and the output are this rank's slice of
    /// every sequence (`[batch, seq / tp, d_model]`); the input is all-gathered in front of the
    /// first product and the output reduce-scattered after the second
    /// ([`sequence`](super::sequence)).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.qkv.set_sequence_parallel(on);
        self.proj.set_sequence_parallel(on);
    }

    /// `[batch, seq, d_model] -> [batch, seq, d_model]`. The attention between the two
    /// projections is one fused operation ([`crate::kernels::attention`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_in_segments(x, None)
    }

    /// [`forward`](Self::forward) where `segments` (`[batch, seq]`, when given) are segment
    /// ids: a token attends only to the tokens of its own segment (a document packed with
    /// others into one sequence, [`crate::data::DocumentMasked`]).
    pub fn forward_in_segments(
        &self,
        x: Tensor<B, 3>,
        segments: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        let spec = AttentionSpec {
            heads: self.local_heads,
            causal: self.mask == AttentionMask::Causal,
        };
        let qkv = self.qkv.forward(x);
        let ctx = match (self.context_parallel, segments) {
            (Some((cp, CpAttention::Ring)), segments) => ring_attention(qkv, spec, segments, cp),
            (Some((cp, CpAttention::AllToAll)), segments) => {
                ulysses_attention(qkv, spec, segments, cp)
            }
            (None, Some(segments)) => attention_in_segments(qkv, spec, segments),
            (None, None) => attention(qkv, spec),
        };
        self.proj.forward(ctx)
    }

    /// The same as [`ParallelSelfAttention::forward`] with the attention composed of Burn
    /// operators (each differentiated by Burn): the reference the fused one is tested against.
    pub fn forward_unfused(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let (h, d) = (self.local_heads, self.head_dim);
        let qkv = self.qkv.forward(x);
        let [b, s, _] = qkv.dims();
        let mut parts = qkv.chunk(3, 2).into_iter();
        let mut heads = || {
            parts
                .next()
                .map(|t| t.reshape([b, s, h, d]).swap_dims(1, 2))
                .expect("chunk(3) yields three parts")
        };
        let (q, k, v) = (heads(), heads(), heads());
        let scale = 1.0 / (d as f64).sqrt();
        let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
        if self.mask == AttentionMask::Causal {
            let future = Tensor::<B, 2, Bool>::tril_mask([s, s], 0, &scores.device());
            scores = scores.mask_fill(
                future.unsqueeze::<4>().expand([b, h, s, s]),
                f32::NEG_INFINITY,
            );
        }
        let probs = softmax(scores, 3);
        let ctx = probs.matmul(v).swap_dims(1, 2).reshape([b, s, h * d]);
        self.proj.forward(ctx)
    }
}
