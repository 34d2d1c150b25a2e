//! What a block of a model of your own needs to run under context parallelism: its rank's
//! share of every sequence and the attention over the whole sequences.

use burn::tensor::Tensor;

use super::{ContextParallelBackend, CpAttention, ZigZag, ring_attention, ulysses_attention};
use crate::comm::Group;
use crate::kernels::AttentionSpec;

/// A context-parallel rank's share of every sequence: the cp group, the zigzag chunks this
/// rank holds ([`ZigZag`]) and how the attention exchanges the other ranks' keys and values.
/// A block built at a [`UnitPlace`](crate::entry::UnitPlace) with one runs its attention
/// through [`attention`](Self::attention) and its position encoding at
/// [`ZigZag::chunks`]'s positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextShare {
    /// The context-parallel group.
    pub group: Group,
    /// The positions this rank holds of each sequence.
    pub zigzag: ZigZag,
    /// The exchange: a ring of keys and values, or two all-to-alls.
    pub exchange: CpAttention,
}

impl ContextShare {
    /// Softmax attention of this rank's queries against the keys and values of the whole
    /// sequences (causal when `causal`, in sequence order), scaled by `1 / sqrt(head_dim)`.
    /// `q`, `k` and `v` are `[batch, heads, positions, head_dim]` for this rank's positions,
    /// with as many key and value heads as query heads (repeat grouped ones first); the
    /// context has the same shape. Every rank of the group must call it at the same point.
    pub fn attention<B: ContextParallelBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        causal: bool,
    ) -> Tensor<B, 4> {
        let [b, heads, n, d] = q.dims();
        let flat = |t: Tensor<B, 4>| t.swap_dims(1, 2).reshape([b, n, heads * d]);
        let qkv = Tensor::cat(vec![flat(q), flat(k), flat(v)], 2);
        let spec = AttentionSpec { heads, causal };
        let context = match self.exchange {
            CpAttention::Ring => ring_attention(qkv, spec, None, self.group),
            CpAttention::AllToAll => ulysses_attention(qkv, spec, None, self.group),
        };
        context.reshape([b, n, heads, d]).swap_dims(1, 2)
    }
}
