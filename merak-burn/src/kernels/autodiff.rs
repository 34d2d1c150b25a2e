//! [`FusedOps`] on `Autodiff<B>`: each fused operation is one graph node whose backward pass
//! calls `B`'s backward kernel.
//!
//! LayerNorm and bias + GELU are memory-bound: under Burn's balanced checkpointing (selective
//! recomputation) their outputs are recomputed from their inputs in the backward pass rather
//! than kept (each has a [`RetroForward`]); their inputs are read through the checkpointer.
//! Attention and cross-entropy are compute-bound and keep what their backward pass needs (the
//! attention: its context and each row's log-sum-exp, not its probabilities).

use std::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{
        base::Checkpointer, retro_forward::RetroForward, state::BackwardStates,
        strategy::CheckpointStrategy,
    },
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use super::{AttentionSpec, FusedOps, NormStats, VocabShard};
use crate::comm::Group;

#[derive(Debug)]
struct CrossEntropy;

impl<B: FusedOps> Backward<B, 1> for CrossEntropy {
    type State = (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::IntTensorPrimitive,
        VocabShard,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (logits, stats, targets, shard) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::cross_entropy_backward(logits, stats, targets, shard, g)
        });
    }
}

#[derive(Debug)]
struct Embedding;

impl<B: FusedOps> Backward<B, 1> for Embedding {
    type State = (B::IntTensorPrimitive, usize, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (ids, rows, start) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            B::gather_backward(ids, dy, rows, start)
        });
    }
}

#[derive(Debug)]
struct Linear;
#[derive(Debug)]
struct LinearBias;

/// The linear layer's saved inputs: `x` (for the weight gradient) and `w`.
pub(crate) type LinearState = (Option<NodeId>, NodeId);

/// Registers the gradients of a linear layer's parents (`x`, `w` and, with a bias, `bias`).
pub(crate) fn linear_backward<B: FusedOps, const N: usize>(
    ops: Ops<LinearState, N>,
    grads: &mut Gradients,
    c: &mut Checkpointer,
) {
    let x = ops
        .state
        .0
        .map(|id| c.retrieve_node_output::<B::FloatTensorPrimitive>(id));
    let w = c.retrieve_node_output::<B::FloatTensorPrimitive>(ops.state.1);
    let dy = grads.consume::<B>(&ops.node);
    let mut want = [false; 3];
    for (w, p) in want.iter_mut().zip(&ops.parents) {
        *w = p.is_some();
    }
    // A split backward (B) leaves the weight gradient to its W pass.
    let deferred = match (&ops.parents[1], &x) {
        (Some(node), Some(x)) => super::deferred::defer_for(node.id).map(|hook| {
            let empty = empty_like::<B>(&dy);
            let (x, w, g) = (x.clone(), w.clone(), dy.clone());
            let job = move || {
                let [_, dw, _] = B::linear_backward(Some(x), w, g, [false, true, false]);
                if let Some(dw) = dw {
                    super::grad_sink::hand_over::<B>(hook, dw);
                }
            };
            super::deferred::push(Box::new(job));
            (node.id, empty)
        }),
        _ => None,
    };
    if deferred.is_some() {
        want[1] = false;
    }
    let out = B::linear_backward(x, w, dy, want);
    for (parent, grad) in ops.parents.into_iter().zip(out) {
        if let (Some(node), Some(grad)) = (parent, grad) {
            grads.register::<B>(node.id, grad);
        }
    }
    if let Some((node, empty)) = deferred {
        // The hook's backward must run; an empty gradient tells it the W pass delivers.
        grads.register::<B>(node, empty);
    }
}

/// A tensor with no elements on `like`'s device: the deferred weight gradient's placeholder.
fn empty_like<B: FusedOps>(like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(
        burn::tensor::Shape::new([0]),
        &B::float_device(like),
        burn::tensor::FloatDType::F32,
    )
}

/// The graph node of a linear product `forward(x, w)` whose backward pass is `op`: it keeps
/// `x` (when `w` needs a gradient) and `w`, handed to `state` with anything else `op` needs.
pub(crate) fn linear_node<B: FusedOps, C: CheckpointStrategy, O: Backward<B, 2>>(
    op: O,
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    state: impl FnOnce(LinearState) -> O::State,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let w_tracked = w.is_tracked();
    match op
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let saved = (w_tracked.then(|| prep.checkpoint(&x)), prep.checkpoint(&w));
            prep.finish(state(saved), forward(x.primitive, w.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive, w.primitive)),
    }
}

impl<B: FusedOps> Backward<B, 2> for Linear {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        linear_backward::<B, 2>(ops, grads, c);
    }
}

impl<B: FusedOps> Backward<B, 3> for LinearBias {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, c: &mut Checkpointer) {
        linear_backward::<B, 3>(ops, grads, c);
    }
}

#[derive(Debug)]
struct LayerNorm;

impl<B: FusedOps> Backward<B, 3> for LayerNorm {
    type State = (NodeId, NodeId, NormStats<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, c: &mut Checkpointer) {
        let (x, gamma, stats) = ops.state;
        let x = c.retrieve_node_output::<B::FloatTensorPrimitive>(x);
        let gamma = c.retrieve_node_output::<B::FloatTensorPrimitive>(gamma);
        let dy = grads.consume::<B>(&ops.node);
        let [dx, dgamma, dbeta] = B::layer_norm_backward(x, gamma, stats, dy);
        for (parent, grad) in ops.parents.into_iter().zip([dx, dgamma, dbeta]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Recomputes a LayerNorm's output from its inputs (balanced checkpointing).
#[derive(Debug)]
struct RetroLayerNorm<B> {
    inputs: [NodeId; 3],
    eps: f64,
    _b: PhantomData<B>,
}

impl<B: FusedOps> RetroForward for RetroLayerNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let [x, gamma, beta] = self
            .inputs
            .map(|id| states.get_state::<B::FloatTensorPrimitive>(&id));
        states.save(out_node, B::layer_norm_forward(x, gamma, beta, self.eps).0);
    }
}

#[derive(Debug)]
struct BiasGelu;

impl<B: FusedOps> Backward<B, 2> for BiasGelu {
    type State = (NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let x = c.retrieve_node_output::<B::FloatTensorPrimitive>(ops.state.0);
        let bias = c.retrieve_node_output::<B::FloatTensorPrimitive>(ops.state.1);
        let dy = grads.consume::<B>(&ops.node);
        let [dx, dbias] = B::bias_gelu_backward(x, bias, dy);
        for (parent, grad) in ops.parents.into_iter().zip([dx, dbias]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Recomputes `gelu(x + bias)` from its inputs (balanced checkpointing).
#[derive(Debug)]
struct RetroBiasGelu<B> {
    inputs: [NodeId; 2],
    _b: PhantomData<B>,
}

impl<B: FusedOps> RetroForward for RetroBiasGelu<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let [x, bias] = self
            .inputs
            .map(|id| states.get_state::<B::FloatTensorPrimitive>(&id));
        states.save(out_node, B::bias_gelu_forward(x, bias));
    }
}

#[derive(Debug)]
struct Attention;

/// The state of the attention's node: the Q/K/V buffer (through the checkpointer), the
/// context (a second handle on the node's output: the backward pass needs
/// `D = rowsum(dctx ∘ ctx)`, and the output projection keeps the same buffer as its input), the
/// log-sum-exp, and the segment ids.
type AttentionState<B> = (
    NodeId,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Option<IntTensor<B>>,
    AttentionSpec,
);

impl<B: FusedOps> Backward<B, 1> for Attention {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, c: &mut Checkpointer) {
        let (qkv, ctx, lse, segments, spec) = ops.state;
        let qkv = c.retrieve_node_output::<B::FloatTensorPrimitive>(qkv);
        unary::<B, _>(ops.parents, ops.node, grads, |dctx| {
            B::attention_backward(qkv, ctx, lse, dctx, spec, segments)
        });
    }
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        group: Group,
    ) -> FloatTensor<Self> {
        match CrossEntropy
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (loss, stats) = B::cross_entropy_forward(
                    logits.primitive.clone(),
                    targets.clone(),
                    shard,
                    group,
                );
                prep.finish((logits.primitive, stats, targets, shard), loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::cross_entropy_forward(logits.primitive, targets, shard, group).0)
            }
        }
    }

    fn fused_embedding(
        table: FloatTensor<Self>,
        ids: IntTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        let rows = burn::tensor::TensorMetadata::shape(&table.primitive)[0];
        match Embedding
            .prepare::<C>([table.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::gather_forward(table.primitive, ids.clone(), start);
                prep.finish((ids, rows, start), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gather_forward(table.primitive, ids, start)),
        }
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let w_tracked = w.is_tracked();
        match bias {
            None => linear_node::<B, C, _>(
                Linear,
                x,
                w,
                |saved| saved,
                |x, w| B::linear_forward(x, w, None),
            ),
            Some(b) => match LinearBias
                .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = (w_tracked.then(|| prep.checkpoint(&x)), prep.checkpoint(&w));
                    prep.finish(
                        state,
                        B::linear_forward(x.primitive, w.primitive, Some(b.primitive)),
                    )
                }
                OpsKind::UnTracked(prep) => prep.finish(B::linear_forward(
                    x.primitive,
                    w.primitive,
                    Some(b.primitive),
                )),
            },
        }
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let retro = RetroLayerNorm::<B> {
            inputs: [x.node.id, gamma.node.id, beta.node.id],
            eps,
            _b: PhantomData,
        };
        match LayerNorm
            .prepare::<C>([x.node.clone(), gamma.node.clone(), beta.node.clone()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x, &gamma, &beta])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let (xs, gs) = (prep.checkpoint(&x), prep.checkpoint(&gamma));
                let (y, stats) =
                    B::layer_norm_forward(x.primitive, gamma.primitive, beta.primitive, eps);
                prep.finish((xs, gs, stats), y)
            }
            OpsKind::UnTracked(prep) => prep
                .finish(B::layer_norm_forward(x.primitive, gamma.primitive, beta.primitive, eps).0),
        }
    }

    fn fused_bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let retro = RetroBiasGelu::<B> {
            inputs: [x.node.id, bias.node.id],
            _b: PhantomData,
        };
        match BiasGelu
            .prepare::<C>([x.node.clone(), bias.node.clone()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x, &bias])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&x), prep.checkpoint(&bias));
                prep.finish(state, B::bias_gelu_forward(x.primitive, bias.primitive))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::bias_gelu_forward(x.primitive, bias.primitive))
            }
        }
    }

    fn fused_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> FloatTensor<Self> {
        match Attention
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&qkv);
                let (ctx, lse) = B::attention_forward(qkv.primitive, spec, segments.clone());
                prep.finish((state, ctx.clone(), lse, segments, spec), ctx)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::attention_forward(qkv.primitive, spec, segments).0)
            }
        }
    }
}
