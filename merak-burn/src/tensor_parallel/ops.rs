//! The tensor-parallel communication operators as Burn autodiff operations.
//!
//! | operator | forward | backward |
//! | --- | --- | --- |
//! | [`copy_to_tp`] (*f*) | identity | all-reduce (sum) of the gradient |
//! | [`reduce_from_tp`] (*g*) | all-reduce (sum) | identity |
//! | [`gather_from_tp`] | all-gather along a dimension | keep this rank's chunk of the gradient |
//! | [`split_to_tp`] | keep this rank's chunk | all-gather of the gradient |
//! | [`gather_from_sp`] (*ḡ*, sequence parallelism) | all-gather along the sequence | reduce-scatter (sum) of the gradient |
//! | [`scatter_to_sp`] (*g*, sequence parallelism) | reduce-scatter (sum) along the sequence | all-gather of the gradient |
//!
//! They are methods of the backend extension trait [`ParallelBackend`]: on a plain backend
//! they run the forward communication; on `Autodiff<B>` they also register the backward
//! communication in the graph. A group of one rank makes all of them the identity.

use burn::tensor::{Shape, Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use crate::comm::{Group, ReduceOp, TensorComm};
use crate::kernels::{LinearState, linear_backward, linear_node};

pub use super::backend::ParallelBackend;

pub use crate::kernels::grad_sink::{GradSink, HookedGrad, set_grad_sink};

/// Forward-only implementations on a plain backend, shared by
/// [`impl_parallel_backend!`](crate::impl_parallel_backend).
#[doc(hidden)]
pub mod plain {
    use super::*;

    /// Communication failures inside a forward or backward pass cannot be returned through
    /// Burn's operator signatures; they are fatal for the job (the panic hook aborts it and
    /// names the rank).
    fn fatal(e: crate::comm::CommError) -> ! {
        panic!("tensor-parallel communication failed: {e}")
    }

    fn wrap<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(x))
    }

    fn unwrap<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
        t.into_primitive().tensor()
    }

    /// Views a primitive of any rank as a rank-`D` tensor with its own shape (`D` is only the
    /// type-level rank; the data keeps the primitive's shape).
    fn as_rank<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 1>, Shape) {
        let t = wrap::<B>(x);
        let shape = t.shape();
        (t, shape)
    }

    /// All-reduce (sum) of a primitive.
    pub fn reduce<B: Backend>(x: FloatTensor<B>, group: Group) -> FloatTensor<B> {
        if group.size() == 1 {
            return x;
        }
        let comm = group.comm().unwrap_or_else(|e| fatal(e));
        let (t, shape) = as_rank::<B>(x);
        let n = shape.num_elements();
        let flat = t.reshape([n]);
        let out = comm
            .all_reduce_tensor(flat, ReduceOp::Sum)
            .unwrap_or_else(|e| fatal(e));
        B::float_reshape(unwrap(out), shape)
    }

    /// All-gather along `dim` of a primitive.
    pub fn gather<B: Backend>(x: FloatTensor<B>, dim: usize, group: Group) -> FloatTensor<B> {
        if group.size() == 1 {
            return x;
        }
        let comm = group.comm().unwrap_or_else(|e| fatal(e));
        let (t, shape) = as_rank::<B>(x);
        let n = shape.num_elements();
        let flat = t.reshape([n]);
        // Gather flat buffers rank-major, then place each rank's block along `dim`.
        let all = comm.all_gather_tensor(flat, 0).unwrap_or_else(|e| fatal(e));
        let parts = all
            .chunk(group.size(), 0)
            .into_iter()
            .map(|c| B::float_reshape(unwrap(c), shape.clone()))
            .collect::<Vec<_>>();
        B::float_cat(parts, dim)
    }

    /// Reduce-scatter (sum) along `dim` of a primitive: the sum over the group, this rank's
    /// chunk along `dim` kept.
    pub fn reduce_scatter<B: Backend>(
        x: FloatTensor<B>,
        dim: usize,
        group: Group,
    ) -> FloatTensor<B> {
        if group.size() == 1 {
            return x;
        }
        let comm = group.comm().unwrap_or_else(|e| fatal(e));
        // With `dim` first, rank r's chunk is the r-th contiguous block of the flat buffer.
        let (t, shape) = as_rank::<B>(B::float_swap_dims(x, 0, dim));
        let flat = t.reshape([shape.num_elements()]);
        let out = comm
            .reduce_scatter_tensor(flat, 0, ReduceOp::Sum)
            .unwrap_or_else(|e| fatal(e));
        let mut dims = shape.as_slice().to_vec();
        dims[0] /= group.size();
        B::float_swap_dims(B::float_reshape(unwrap(out), Shape::from(dims)), 0, dim)
    }

    /// This rank's chunk along `dim` of a primitive.
    pub fn split<B: Backend>(x: FloatTensor<B>, dim: usize, group: Group) -> FloatTensor<B> {
        if group.size() == 1 {
            return x;
        }
        let shape = burn::tensor::TensorMetadata::shape(&x);
        let size = shape[dim];
        assert!(
            size.is_multiple_of(group.size()),
            "tensor-parallel split: dimension {dim} of size {size} is not divisible by tp={}",
            group.size()
        );
        let chunk = size / group.size();
        let start = chunk * group.rank();
        let ranges = shape
            .as_slice()
            .iter()
            .enumerate()
            .map(|(d, &s)| {
                if d == dim {
                    burn::tensor::Slice::from(start..start + chunk)
                } else {
                    burn::tensor::Slice::from(0..s)
                }
            })
            .collect::<Vec<_>>();
        B::float_slice(x, &ranges)
    }
}

/// Implements [`ParallelBackend`] for a plain (non-autodiff) backend type with host-buffer
/// communication.
#[macro_export]
macro_rules! impl_parallel_backend {
    ($backend:ty) => {
        impl $crate::tensor_parallel::ParallelBackend for $backend {
            fn tp_copy(
                x: burn::tensor::ops::FloatTensor<Self>,
                _group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                x
            }
            fn tp_reduce(
                x: burn::tensor::ops::FloatTensor<Self>,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::ops::plain::reduce::<Self>(x, group)
            }
            fn tp_gather(
                x: burn::tensor::ops::FloatTensor<Self>,
                dim: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::ops::plain::gather::<Self>(x, dim, group)
            }
            fn tp_split(
                x: burn::tensor::ops::FloatTensor<Self>,
                dim: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::ops::plain::split::<Self>(x, dim, group)
            }
            fn sp_gather(
                x: burn::tensor::ops::FloatTensor<Self>,
                dim: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::ops::plain::gather::<Self>(x, dim, group)
            }
            fn sp_scatter(
                x: burn::tensor::ops::FloatTensor<Self>,
                dim: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::ops::plain::reduce_scatter::<Self>(x, dim, group)
            }
            fn tp_row_linear(
                x: burn::tensor::ops::FloatTensor<Self>,
                w: burn::tensor::ops::FloatTensor<Self>,
                chunks: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::overlap::row_forward::<Self>(x, w, chunks, group)
            }
            fn tp_column_linear(
                x: burn::tensor::ops::FloatTensor<Self>,
                w: burn::tensor::ops::FloatTensor<Self>,
                _chunks: usize,
                _group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                <Self as $crate::kernels::FusedOps>::linear_forward(x, w, None)
            }
            fn sp_row_linear(
                x: burn::tensor::ops::FloatTensor<Self>,
                w: burn::tensor::ops::FloatTensor<Self>,
                chunks: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::sequence_overlap::row_forward::<Self>(x, w, chunks, group)
            }
            fn sp_column_linear(
                x: burn::tensor::ops::FloatTensor<Self>,
                w: burn::tensor::ops::FloatTensor<Self>,
                _chunks: usize,
                group: $crate::comm::Group,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                $crate::tensor_parallel::sequence_overlap::column_forward::<Self>(x, w, group)
            }
            fn grad_hook(
                x: burn::tensor::ops::FloatTensor<Self>,
                _hook: usize,
            ) -> burn::tensor::ops::FloatTensor<Self> {
                x
            }
        }
    };
}

impl_parallel_backend!(burn_flex::Flex);
#[cfg(feature = "cuda")]
impl_parallel_backend!(burn_cuda::Cuda<f32>);
#[cfg(feature = "wgpu")]
impl_parallel_backend!(crate::backend::Wgpu);

#[derive(Debug)]
struct CopyBackward;
#[derive(Debug)]
struct ReduceBackward;
#[derive(Debug)]
struct GatherBackward;
#[derive(Debug)]
struct SplitBackward;
#[derive(Debug)]
struct SpGatherBackward;
#[derive(Debug)]
struct SpScatterBackward;
#[derive(Debug)]
struct SpRowLinearBackward;
#[derive(Debug)]
struct SpColumnLinearBackward;
#[derive(Debug)]
struct HookBackward;
#[derive(Debug)]
struct RowLinearBackward;
#[derive(Debug)]
struct ColumnLinearBackward;

impl<B: ParallelBackend> Backward<B, 2> for RowLinearBackward {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        linear_backward::<B, 2>(ops, grads, c);
    }
}

impl<B: ParallelBackend> Backward<B, 2> for ColumnLinearBackward {
    type State = SpLinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        chunked_linear_backward::<B>(ops, grads, c, super::overlap::column_backward::<B>);
    }
}

/// The saved `x` (when the weight needs its gradient) and `w` of a chunked tensor- or
/// sequence-parallel product, with its token chunks and group.
type SpLinearState = (Option<NodeId>, NodeId, usize, Group);

/// The backward pass of a linear node that saved `(x, w, chunks, group)`: `backward(x, w, dy,
/// chunks, group)` gives `[dx, dw]`, registered with the node's parents.
fn chunked_linear_backward<B: ParallelBackend>(
    ops: Ops<SpLinearState, 2>,
    grads: &mut Gradients,
    c: &mut Checkpointer,
    backward: impl FnOnce(
        Option<FloatTensor<B>>,
        FloatTensor<B>,
        FloatTensor<B>,
        usize,
        Group,
    ) -> [Option<FloatTensor<B>>; 2],
) {
    let (x, w, chunks, group) = ops.state;
    let x = x.map(|id| c.retrieve_node_output::<B::FloatTensorPrimitive>(id));
    let w = c.retrieve_node_output::<B::FloatTensorPrimitive>(w);
    let dy = grads.consume::<B>(&ops.node);
    let out = backward(x, w, dy, chunks, group);
    for (parent, grad) in ops.parents.into_iter().zip(out) {
        if let (Some(node), Some(grad)) = (parent, grad) {
            grads.register::<B>(node.id, grad);
        }
    }
}

impl<B: ParallelBackend> Backward<B, 2> for SpRowLinearBackward {
    type State = SpLinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let row = |x, w, dy, _, group| super::sequence_overlap::row_backward::<B>(x, w, dy, group);
        chunked_linear_backward::<B>(ops, grads, c, row);
    }
}

impl<B: ParallelBackend> Backward<B, 2> for SpColumnLinearBackward {
    type State = SpLinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let column = super::sequence_overlap::column_backward::<B>;
        chunked_linear_backward::<B>(ops, grads, c, column);
    }
}

impl<B: ParallelBackend> Backward<B, 1> for HookBackward {
    type State = usize;
    /// Hands the gradient to the reducer, which owns it from here: the parameter leaf behind
    /// the hook (a fresh leaf of one forward pass) gets no gradient of its own, so the buffer
    /// moves to the reducer without a copy. An empty gradient is a split backward's
    /// placeholder: its W pass delivers this one (`kernels::deferred`).
    fn backward(self, ops: Ops<usize, 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        crate::kernels::deferred::forget_hook(ops.node.id);
        crate::kernels::grad_sink::hand_over::<B>(ops.state, g);
    }
}

impl<B: ParallelBackend> Backward<B, 1> for CopyBackward {
    type State = Group;
    fn backward(self, ops: Ops<Group, 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let group = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| B::tp_reduce(g, group));
    }
}

impl<B: ParallelBackend> Backward<B, 1> for ReduceBackward {
    type State = ();
    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |g| g);
    }
}

impl<B: ParallelBackend> Backward<B, 1> for GatherBackward {
    type State = (usize, Group);
    fn backward(self, ops: Ops<(usize, Group), 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (dim, group) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| B::tp_split(g, dim, group));
    }
}

impl<B: ParallelBackend> Backward<B, 1> for SplitBackward {
    type State = (usize, Group);
    fn backward(self, ops: Ops<(usize, Group), 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (dim, group) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::tp_gather(g, dim, group)
        });
    }
}

impl<B: ParallelBackend> Backward<B, 1> for SpGatherBackward {
    type State = (usize, Group);
    fn backward(self, ops: Ops<(usize, Group), 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (dim, group) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::sp_scatter(g, dim, group)
        });
    }
}

impl<B: ParallelBackend> Backward<B, 1> for SpScatterBackward {
    type State = (usize, Group);
    fn backward(self, ops: Ops<(usize, Group), 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (dim, group) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::sp_gather(g, dim, group)
        });
    }
}

impl<B: ParallelBackend, C: CheckpointStrategy> ParallelBackend for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        match CopyBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(group, B::tp_copy(x.primitive, group)),
            OpsKind::UnTracked(prep) => prep.finish(B::tp_copy(x.primitive, group)),
        }
    }

    fn tp_reduce(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        match ReduceBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), B::tp_reduce(x.primitive, group)),
            OpsKind::UnTracked(prep) => prep.finish(B::tp_reduce(x.primitive, group)),
        }
    }

    fn tp_gather(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self> {
        along_dim::<B, C, _>(GatherBackward, x, dim, group, B::tp_gather)
    }

    fn tp_split(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self> {
        along_dim::<B, C, _>(SplitBackward, x, dim, group, B::tp_split)
    }

    fn sp_gather(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self> {
        along_dim::<B, C, _>(SpGatherBackward, x, dim, group, B::sp_gather)
    }

    fn sp_scatter(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self> {
        along_dim::<B, C, _>(SpScatterBackward, x, dim, group, B::sp_scatter)
    }

    fn tp_row_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self> {
        linear_node::<B, C, _>(
            RowLinearBackward,
            x,
            w,
            |saved| saved,
            |x, w| B::tp_row_linear(x, w, chunks, group),
        )
    }

    fn tp_column_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self> {
        let state = |(x, w): LinearState| (x, w, chunks, group);
        linear_node::<B, C, _>(ColumnLinearBackward, x, w, state, |x, w| {
            B::tp_column_linear(x, w, chunks, group)
        })
    }

    fn sp_row_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self> {
        let state = |(x, w): LinearState| (x, w, chunks, group);
        linear_node::<B, C, _>(SpRowLinearBackward, x, w, state, |x, w| {
            B::sp_row_linear(x, w, chunks, group)
        })
    }

    fn sp_column_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self> {
        let state = |(x, w): LinearState| (x, w, chunks, group);
        linear_node::<B, C, _>(SpColumnLinearBackward, x, w, state, |x, w| {
            B::sp_column_linear(x, w, chunks, group)
        })
    }

    fn grad_hook(x: FloatTensor<Self>, hook: usize) -> FloatTensor<Self> {
        match HookBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = prep.finish(hook, x.primitive);
                crate::kernels::deferred::note_hook(out.node.id, hook);
                out
            }
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }
}

/// The graph node of a communication `forward` along `dim` over `group`, whose backward pass
/// is `op` (a gather's split, a split's gather, ...).
fn along_dim<
    B: ParallelBackend,
    C: CheckpointStrategy,
    O: Backward<B, 1, State = (usize, Group)>,
>(
    op: O,
    x: FloatTensor<Autodiff<B, C>>,
    dim: usize,
    group: Group,
    forward: fn(FloatTensor<B>, usize, Group) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match op.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((dim, group), forward(x.primitive, dim, group)),
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive, dim, group)),
    }
}

fn lift<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    f: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(f(x.into_primitive().tensor())))
}

/// *f*: identity forward, all-reduce (sum) of the gradient backward. Placed in front of a
/// column-parallel block whose input is replicated across the TP group.
pub fn copy_to_tp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::tp_copy(p, group))
}

/// *g*: all-reduce (sum) forward, identity backward. Placed after a row-parallel block.
pub fn reduce_from_tp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::tp_reduce(p, group))
}

/// All-gather along `dim` forward (rank order); this rank's chunk of the gradient backward.
pub fn gather_from_tp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::tp_gather(p, dim, group))
}

/// This rank's chunk along `dim` forward; all-gather of the gradient backward.
pub fn split_to_tp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::tp_split(p, dim, group))
}

/// Sequence parallelism's *ḡ*: all-gather along `dim` (the sequence) forward, in rank order;
/// reduce-scatter (sum) of the gradient along `dim` backward. In front of a column-parallel
/// block whose input is split along the sequence (it replaces *f*).
pub fn gather_from_sp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::sp_gather(p, dim, group))
}

/// Sequence parallelism's *g*: reduce-scatter (sum) along `dim` (the sequence) forward, this
/// rank keeping its chunk; all-gather of the gradient backward. After a row-parallel block
/// whose output continues split along the sequence (it replaces *g*'s all-reduce).
pub fn scatter_to_sp<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    lift(x, |p| B::sp_scatter(p, dim, group))
}
