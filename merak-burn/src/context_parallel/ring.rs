//! Ring attention as a Burn operation: [`ring_attention`], a method of the backend extension
//! trait [`ContextParallelBackend`].
//!
//! On a plain backend the operation is the forward kernel; on `Autodiff<B>` it records one
//! graph node that keeps the Q/K/V shard (through the checkpointer), the context and each
//! query's log-sum-exp (never a `[seq, seq]` matrix), and whose backward pass runs the ring
//! again ([`host`](super::host)). The kernels' default implementations read the tensors to host
//! memory, run the blockwise CPU kernels with point-to-point messages of the group's
//! [`Communicator`](crate::comm::Communicator), and write the results back to the tensors'
//! device, so every backend has them. On CUDA this is correct but slow: it wants device
//! kernels and NCCL's send and receive instead (a later issue).
//!
//! A group of one rank is the ordinary fused attention ([`FusedOps::fused_attention`]).
//!
//! The trait also carries the all-to-all variant, [`ulysses_attention`] (kernels and node in
//! [`ulysses`](super::ulysses)), with the same contract, so a layer can pick either.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Shape as TensorShape, Tensor, TensorMetadata};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use super::host::{Ring, RingError};
use super::ulysses::{self, UlyssesSaved};
use crate::comm::Group;
use crate::comm::host::vec_to_tensor;
use crate::kernels::cpu::blockwise::Shape;
use crate::kernels::{AttentionSpec, FusedOps, lift, prim};

/// A backend that runs context-parallel ring attention. Every method has a default (the ring
/// on host buffers), so `impl ContextParallelBackend for MyBackend {}` is enough.
pub trait ContextParallelBackend: FusedOps {
    /// Forward kernel: the context (`[batch, n, heads * head_dim]`) of this rank's zigzag
    /// shard of Q/K/V (`[batch, n, 3 * heads * head_dim]`, see [`ring_attention`]) against
    /// the keys and values of every rank of `group`, and each query's log-sum-exp of its
    /// scaled scores (`[batch, heads, n]`, `f32`) for the backward pass.
    fn ring_attention_forward(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        host_forward::<Self>(qkv, spec, segments, group)
    }

    /// Backward kernel: the gradient of this rank's Q/K/V shard from the context's gradient
    /// `dctx`, given the forward kernel's context `ctx` and log-sum-exp `lse`. Every rank of
    /// `group` calls it together.
    fn ring_attention_backward(
        qkv: FloatTensor<Self>,
        ctx: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dctx: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> FloatTensor<Self> {
        host_backward::<Self>([qkv, ctx, lse, dctx], spec, segments, group)
    }

    /// The differentiable ring attention (see [`ring_attention`]).
    fn ring_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> FloatTensor<Self> {
        if group.size() == 1 {
            return Self::fused_attention(qkv, spec, segments);
        }
        Self::ring_attention_forward(qkv, spec, segments, group).0
    }

    /// Forward kernel of the all-to-all (Ulysses) attention (see [`ulysses_attention`]): the
    /// context of this rank's zigzag shard (`[batch, n, heads * head_dim]`) and what the
    /// backward pass needs, in the exchanged layout.
    fn ulysses_attention_forward(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> (FloatTensor<Self>, UlyssesSaved<Self>) {
        ulysses::forward::<Self>(qkv, spec, segments, group)
    }

    /// Backward kernel of the all-to-all attention: the gradient of this rank's Q/K/V shard
    /// from the context's gradient `dctx`. Every rank of `group` calls it together.
    fn ulysses_attention_backward(
        saved: UlyssesSaved<Self>,
        dctx: FloatTensor<Self>,
        spec: AttentionSpec,
        group: Group,
    ) -> FloatTensor<Self> {
        ulysses::backward::<Self>(saved, dctx, spec, group)
    }

    /// The differentiable all-to-all attention (see [`ulysses_attention`]).
    fn ulysses_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> FloatTensor<Self> {
        if group.size() == 1 {
            return Self::fused_attention(qkv, spec, segments);
        }
        Self::ulysses_attention_forward(qkv, spec, segments, group).0
    }
}

impl ContextParallelBackend for burn_flex::Flex {}

/// Every CubeCL backend (CUDA, wgpu), with the composed attention of its [`FusedOps`].
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl<R, F, I, BT> ContextParallelBackend for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

/// Context-parallel self-attention on this rank's zigzag shard of a fused Q/K/V projection
/// ([`ContextParallelBackend::ring_attention`]).
///
/// Rank `r` of `group` (`cp` ranks) holds, of every sequence of `cp * n` tokens, the chunks
/// `r` and `2 cp - 1 - r` of `2 cp` ([`ZigZag`](super::ZigZag)): `qkv` is `[batch, n, 3 * heads
/// * head_dim]` (query heads, then key heads, then value heads, as
/// [`attention`](crate::kernels::attention) takes them) and the result, the context of these
/// tokens over all the keys of their sequence, `[batch, n, heads * head_dim]`. `segments`
/// (`[batch, n]`, this rank's shard of the segment ids), when given, keep each token to the
/// keys of its own segment; every rank passes them, or none does. The ranks' keys and values
/// travel around the ring, `cp - 1` exchanges forward and `cp` (with their gradient) backward.
///
/// Every rank of `group` must call it at the same point with shards of the same shape, and on
/// `Autodiff` every rank's shard requires a gradient or none does (the backward pass is a
/// ring too). A
/// failed exchange panics (fatal for the job, as every communication failure inside an
/// operation); so does a shard of an odd number of tokens.
pub fn ring_attention<B: ContextParallelBackend>(
    qkv: Tensor<B, 3>,
    spec: AttentionSpec,
    segments: Option<Tensor<B, 2, Int>>,
    group: Group,
) -> Tensor<B, 3> {
    let segments = segments.map(Tensor::into_primitive);
    lift(B::ring_attention(prim(qkv), spec, segments, group))
}

/// Context-parallel self-attention by all-to-all exchanges (DeepSpeed-Ulysses,
/// [`ContextParallelBackend::ulysses_attention`]): the same arguments, result and contract as
/// [`ring_attention`], so a layer can run either.
///
/// One all-to-all gives each of the `cp` ranks of `group` the whole sequences (every rank's
/// zigzag shard, in token order) for `heads / cp` of its query, key and value heads; it runs
/// the ordinary fused attention on them (with the whole sequences' segment ids, all-gathered)
/// and a second all-to-all returns each rank its tokens' context for all heads. The backward
/// pass runs the reverse exchanges on the gradients. `cp` must divide `spec.heads` (the heads
/// of this TP rank; [`ulysses_heads_per_rank`](super::ulysses_heads_per_rank)): otherwise,
/// and on a failed exchange, it panics (fatal for the job).
pub fn ulysses_attention<B: ContextParallelBackend>(
    qkv: Tensor<B, 3>,
    spec: AttentionSpec,
    segments: Option<Tensor<B, 2, Int>>,
    group: Group,
) -> Tensor<B, 3> {
    let segments = segments.map(Tensor::into_primitive);
    lift(B::ulysses_attention(prim(qkv), spec, segments, group))
}

/// A failure inside the operation: fatal for the job (the panic hook aborts it and names the
/// rank).
fn fatal(e: RingError) -> ! {
    panic!("ring attention failed: {e}")
}

/// The kernel's shape of this rank's `[batch, n, 3 * heads * head_dim]` shard.
fn shard_shape(dims: &TensorShape, spec: AttentionSpec) -> Shape {
    let (batch, seq, width) = (dims[0], dims[1], dims[2]);
    let heads = spec.heads.max(1);
    if width % (3 * heads) != 0 {
        panic!("ring attention: {width} Q/K/V features per token are not 3 * {heads} heads");
    }
    Shape {
        batch,
        seq,
        heads,
        head_dim: width / (3 * heads),
    }
}

/// The segment ids of an integer tensor, as `i64`.
fn segment_ids<B: Backend>(segments: IntTensor<B>) -> Vec<i64> {
    crate::host_read::ints(Tensor::<B, 2, Int>::from_primitive(segments))
        .unwrap_or_else(|e| panic!("ring attention: cannot read the segment ids: {e}"))
}

/// A host vector as a tensor of `shape` on `device`, of element type `dtype`.
fn to_device<B: Backend>(
    values: Vec<f32>,
    shape: [usize; 3],
    device: &B::Device,
    dtype: DType,
) -> FloatTensor<B> {
    prim(vec_to_tensor::<B, 3>(values, shape.into(), device, dtype))
}

/// The default forward kernel: the ring on host buffers.
fn host_forward<B: FusedOps>(
    qkv: FloatTensor<B>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
    group: Group,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = shard_shape(&qkv.shape(), spec);
    let (device, dtype) = (B::float_device(&qkv), qkv.dtype());
    let values = B::into_host_vec(qkv);
    let segments = segments.map(segment_ids::<B>);
    let comm = group.comm().unwrap_or_else(|e| fatal(e.into()));
    let (ctx, lse) = Ring::new(&*comm, shape, spec.causal, segments.as_deref())
        .and_then(|ring| ring.forward(&values))
        .unwrap_or_else(|e| fatal(e));
    let Shape {
        batch: b,
        seq: n,
        heads: h,
        head_dim: d,
    } = shape;
    (
        to_device::<B>(ctx, [b, n, h * d], &device, dtype),
        to_device::<B>(lse, [b, h, n], &device, DType::F32),
    )
}

/// The default backward kernel: the ring on host buffers. `tensors` are the shard of Q/K/V,
/// the context, the log-sum-exp and the context's gradient.
fn host_backward<B: FusedOps>(
    tensors: [FloatTensor<B>; 4],
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
    group: Group,
) -> FloatTensor<B> {
    let shape = shard_shape(&tensors[0].shape(), spec);
    let (device, dtype) = (B::float_device(&tensors[0]), tensors[0].dtype());
    let [qkv, ctx, lse, dctx] = tensors.map(B::into_host_vec);
    let segments = segments.map(segment_ids::<B>);
    let comm = group.comm().unwrap_or_else(|e| fatal(e.into()));
    let dqkv = Ring::new(&*comm, shape, spec.causal, segments.as_deref())
        .and_then(|ring| ring.backward(&qkv, &ctx, &lse, &dctx))
        .unwrap_or_else(|e| fatal(e));
    let dims = [shape.batch, shape.seq, 3 * shape.heads * shape.head_dim];
    to_device::<B>(dqkv, dims, &device, dtype)
}

#[derive(Debug)]
struct RingAttention;

/// The state of the ring attention's node: the Q/K/V shard (through the checkpointer), the
/// context (a second handle on the node's output), the log-sum-exp, the segment ids, the
/// shape arguments and the group.
type RingState<B> = (
    NodeId,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<IntTensor<B>>,
    AttentionSpec,
    Group,
);

impl<B: ContextParallelBackend> Backward<B, 1> for RingAttention {
    type State = RingState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, c: &mut Checkpointer) {
        let (qkv, ctx, lse, segments, spec, group) = ops.state;
        let qkv = c.retrieve_node_output::<B::FloatTensorPrimitive>(qkv);
        unary::<B, _>(ops.parents, ops.node, grads, |dctx| {
            B::ring_attention_backward(qkv, ctx, lse, dctx, spec, segments, group)
        });
    }
}

impl<B: ContextParallelBackend, C: CheckpointStrategy> ContextParallelBackend for Autodiff<B, C> {
    fn ring_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> FloatTensor<Self> {
        if group.size() == 1 {
            return Self::fused_attention(qkv, spec, segments);
        }
        match RingAttention
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let saved = prep.checkpoint(&qkv);
                let (ctx, lse) =
                    B::ring_attention_forward(qkv.primitive, spec, segments.clone(), group);
                prep.finish((saved, ctx.clone(), lse, segments, spec, group), ctx)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::ring_attention_forward(qkv.primitive, spec, segments, group).0)
            }
        }
    }

    fn ulysses_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
        group: Group,
    ) -> FloatTensor<Self> {
        if group.size() == 1 {
            return Self::fused_attention(qkv, spec, segments);
        }
        let kernels = (
            B::ulysses_attention_forward as ulysses::ForwardKernel<B>,
            B::ulysses_attention_backward as ulysses::BackwardKernel<B>,
        );
        ulysses::tracked::<B, C>(qkv, spec, segments, group, kernels)
    }
}
