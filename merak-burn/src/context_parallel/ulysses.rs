//! All-to-all (DeepSpeed-Ulysses) context-parallel attention: the kernels behind
//! [`ulysses_attention`](super::ulysses_attention) and its autodiff node.
//!
//! Each rank of a cp group holds its zigzag shard of every sequence for all `h` heads. One
//! all-to-all exchanges sequence for heads: afterwards rank `j` holds the whole sequences (the
//! shards of every rank, put back in token order) for the heads `j h / cp .. (j + 1) h / cp`
//! of the queries, keys and values. It runs the ordinary fused attention
//! ([`FusedOps::attention_forward`]) on them, causal by the natural order, with the whole
//! sequences' segment ids (all-gathered), and a second all-to-all gives each rank its tokens'
//! context for all heads back. The backward pass runs the reverse exchanges on the gradients
//! around [`FusedOps::attention_backward`].
//!
//! The exchanges rearrange tensors with Burn's operators and communicate through
//! [`TensorComm::all_to_all_tensor`] (host buffers), so every backend has them.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorData, TensorMetadata};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use super::host::gather_segments;
use super::zigzag::ZigZag;
use crate::comm::{Group, TensorComm};
use crate::kernels::{AttentionSpec, FusedOps, lift, prim};

/// Why the all-to-all attention cannot split the heads over the cp group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UlyssesError {
    /// `cp` does not divide the heads a TP rank holds.
    #[error(
        "all-to-all (Ulysses) context parallelism gives each of the parallel.cp = {cp} ranks an \
         equal share of the attention heads, so parallel.cp must divide the {heads} heads per TP \
         rank (model heads / parallel.tp)"
    )]
    Heads {
        /// The attention heads of one TP rank.
        heads: usize,
        /// The cp group size (`parallel.cp`).
        cp: usize,
    },
}

/// The heads each of `cp` ranks attends over in the all-to-all attention, of the `heads` a TP
/// rank holds; an error unless `cp` divides `heads` (and both are at least 1).
pub fn ulysses_heads_per_rank(heads: usize, cp: usize) -> Result<usize, UlyssesError> {
    if cp == 0 || heads == 0 || !heads.is_multiple_of(cp) {
        return Err(UlyssesError::Heads { heads, cp });
    }
    Ok(heads / cp)
}

/// What the forward kernel keeps for the backward pass, all in the exchanged layout (the
/// whole sequences, this rank's `h / cp` heads): the fused Q/K/V (`[batch, seq, 3 * h / cp *
/// head_dim]`, as many values as the rank's shard), the context, the log-sum-exp where the
/// attention kernel gives it, and the whole sequences' segment ids.
#[derive(Clone, Debug)]
pub struct UlyssesSaved<B: Backend> {
    /// Q/K/V of the whole sequences for this rank's heads.
    pub qkv: FloatTensor<B>,
    /// Their context, `[batch, seq, h / cp * head_dim]`.
    pub ctx: FloatTensor<B>,
    /// Each query's log-sum-exp (`[batch, h / cp, seq]`), or `None`.
    pub lse: Option<FloatTensor<B>>,
    /// The segment ids of the whole sequences (`[batch, seq]`), or `None`.
    pub segments: Option<IntTensor<B>>,
}

/// A failure inside the operation: fatal for the job (the panic hook aborts it and names the
/// rank).
fn fatal(e: impl std::fmt::Display) -> ! {
    panic!("ulysses attention failed: {e}")
}

/// The sizes of one exchange: `n` tokens of a shard, `seq` of a whole sequence, `heads` of the
/// TP rank, `local` of them after the exchange.
#[derive(Clone, Copy, Debug)]
struct Layout {
    batch: usize,
    n: usize,
    seq: usize,
    cp: usize,
    heads: usize,
    local: usize,
    head_dim: usize,
}

impl Layout {
    /// The layout of a shard `[batch, n, parts * heads * head_dim]` (`parts` 3 for Q/K/V, 1
    /// for a context) over `group`; panics on a width that is not `parts * spec.heads` heads,
    /// or when the group size does not divide the heads.
    fn of(dims: &[usize], parts: usize, spec: AttentionSpec, group: Group) -> Self {
        let (batch, n, width) = (dims[0], dims[1], dims[2]);
        let heads = spec.heads.max(1);
        if width % (parts * heads) != 0 {
            panic!("ulysses attention: {width} features per token are not {parts} * {heads} heads");
        }
        let cp = group.size();
        let local = ulysses_heads_per_rank(heads, cp).unwrap_or_else(|e| panic!("{e}"));
        Self {
            batch,
            n,
            seq: n * cp,
            cp,
            heads,
            local,
            head_dim: width / (parts * heads),
        }
    }

    /// The attention of one rank after the exchange.
    fn local_spec(&self, spec: AttentionSpec) -> AttentionSpec {
        AttentionSpec {
            heads: self.local,
            causal: spec.causal,
        }
    }
}

/// Sequence for heads: this rank's shard `[batch, n, parts * heads * head_dim]` becomes the
/// whole sequences `[batch, seq, parts * local * head_dim]` of its heads.
fn seq_to_heads<B: Backend>(
    x: Tensor<B, 3>,
    parts: usize,
    l: &Layout,
    group: Group,
) -> Tensor<B, 3> {
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let x = x.reshape([l.batch, l.n, parts, l.heads * l.head_dim]);
    // Chunk j of the heads goes to rank j; chunk s received holds rank s's tokens.
    let x = comm.all_to_all_tensor(x, 3).unwrap_or_else(|e| fatal(e));
    let width = parts * l.local * l.head_dim;
    let shards = x
        .chunk(l.cp, 3)
        .into_iter()
        .map(|s| s.reshape([l.batch, l.n, width]))
        .collect();
    ZigZag::unshard_tensor(shards).unwrap_or_else(|e| fatal(e))
}

/// Heads for sequence: the whole sequences `[batch, seq, parts * local * head_dim]` of this
/// rank's heads become its shard `[batch, n, parts * heads * head_dim]` of every head.
fn heads_to_seq<B: Backend>(
    x: Tensor<B, 3>,
    parts: usize,
    l: &Layout,
    group: Group,
) -> Tensor<B, 3> {
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let blocks = (0..l.cp)
        .map(|j| {
            let zz = ZigZag::new(l.seq, l.cp, j).unwrap_or_else(|e| fatal(e));
            let shard = zz.shard_tensor(x.clone()).unwrap_or_else(|e| fatal(e));
            shard.reshape([l.batch, l.n, parts, l.local * l.head_dim])
        })
        .collect();
    // Block j (rank j's tokens) goes to rank j; block s received holds rank s's heads.
    let x = comm
        .all_to_all_tensor(Tensor::cat(blocks, 3), 3)
        .unwrap_or_else(|e| fatal(e));
    x.reshape([l.batch, l.n, parts * l.heads * l.head_dim])
}

/// The whole sequences' segment ids `[batch, seq]` from every rank's shard (one all-gather).
fn whole_segments<B: Backend>(segments: IntTensor<B>, l: &Layout, group: Group) -> IntTensor<B> {
    let shard = Tensor::<B, 2, Int>::from_primitive(segments);
    let device = shard.device();
    let ids = crate::host_read::ints(shard)
        .unwrap_or_else(|e| fatal(format!("cannot read the segment ids: {e}")));
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let shards = gather_segments(&*comm, &ids).unwrap_or_else(|e| fatal(e));
    let whole = ZigZag::unshard(l.seq, &shards, 1).unwrap_or_else(|e| fatal(e));
    let data = TensorData::new(whole, [l.batch, l.seq]);
    Tensor::<B, 2, Int>::from_data(data, &device).into_primitive()
}

/// The default forward kernel: this rank's shard of the context (`[batch, n, heads *
/// head_dim]`) and what the backward pass needs.
pub(super) fn forward<B: FusedOps>(
    qkv: FloatTensor<B>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
    group: Group,
) -> (FloatTensor<B>, UlyssesSaved<B>) {
    let l = Layout::of(&qkv.shape(), 3, spec, group);
    let qkv = prim(seq_to_heads(lift::<B, 3>(qkv), 3, &l, group));
    let segments = segments.map(|s| whole_segments::<B>(s, &l, group));
    let (ctx, lse) = B::attention_forward(qkv.clone(), l.local_spec(spec), segments.clone());
    let out = prim(heads_to_seq(lift::<B, 3>(ctx.clone()), 1, &l, group));
    let saved = UlyssesSaved {
        qkv,
        ctx,
        lse,
        segments,
    };
    (out, saved)
}

/// The default backward kernel: the gradient of this rank's Q/K/V shard from its context
/// shard's gradient `dctx`.
pub(super) fn backward<B: FusedOps>(
    saved: UlyssesSaved<B>,
    dctx: FloatTensor<B>,
    spec: AttentionSpec,
    group: Group,
) -> FloatTensor<B> {
    let l = Layout::of(&dctx.shape(), 1, spec, group);
    let dctx = prim(seq_to_heads(lift::<B, 3>(dctx), 1, &l, group));
    let UlyssesSaved {
        qkv,
        ctx,
        lse,
        segments,
    } = saved;
    let dqkv = B::attention_backward(qkv, ctx, lse, dctx, l.local_spec(spec), segments);
    prim(heads_to_seq(lift::<B, 3>(dqkv), 3, &l, group))
}

/// A forward kernel (the backend's `ulysses_attention_forward`).
pub(super) type ForwardKernel<B> = fn(
    FloatTensor<B>,
    AttentionSpec,
    Option<IntTensor<B>>,
    Group,
) -> (FloatTensor<B>, UlyssesSaved<B>);

/// A backward kernel (the backend's `ulysses_attention_backward`).
pub(super) type BackwardKernel<B> =
    fn(UlyssesSaved<B>, FloatTensor<B>, AttentionSpec, Group) -> FloatTensor<B>;

#[derive(Debug)]
struct UlyssesAttention;

/// The state of the node: the forward kernel's saved tensors, the shape arguments, the group
/// and the backward kernel to run.
type UlyssesState<B> = (UlyssesSaved<B>, AttentionSpec, Group, BackwardKernel<B>);

impl<B: FusedOps> Backward<B, 1> for UlyssesAttention {
    type State = UlyssesState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (saved, spec, group, kernel) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dctx| {
            kernel(saved, dctx, spec, group)
        });
    }
}

/// The differentiable all-to-all attention on `Autodiff<B, C>` with the inner backend's
/// kernels: one compute-bound node that keeps [`UlyssesSaved`] (as many values as the Q/K/V
/// shard and the context, plus the log-sum-exp) and whose backward pass exchanges again.
pub(super) fn tracked<B: FusedOps, C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<B, C>>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
    group: Group,
    kernels: (ForwardKernel<B>, BackwardKernel<B>),
) -> FloatTensor<Autodiff<B, C>> {
    let (forward, backward) = kernels;
    match UlyssesAttention
        .prepare::<C>([qkv.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (ctx, saved) = forward(qkv.primitive, spec, segments, group);
            prep.finish((saved, spec, group, backward), ctx)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(qkv.primitive, spec, segments, group).0),
    }
}

#[cfg(test)]
mod tests;
