//! The auxiliary losses of the routers, injected where they are computed: the layer's output
//! carries them into the backward pass (an identity node whose second input, the layer's
//! auxiliary loss, receives the gradient `scale`), so a pipeline stage without the head trains
//! them as one process does. Each injection also records, when its backward pass runs (once per
//! micro-batch, whatever is recomputed), the loss and the experts' loads for the step's
//! metrics.

use std::cell::RefCell;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, binary},
};

use super::ExpertBackend;

/// What one MoE layer's routing of one micro-batch did on this rank, recorded when its
/// backward pass runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingRecord {
    /// The layer (0-based block index).
    pub layer: usize,
    /// This rank's part of the auxiliary loss, already weighted by the micro-batch's share
    /// of the step.
    pub aux_loss: f64,
    /// Assignments this rank's tokens made to each expert (before any drop).
    pub loads: Vec<usize>,
    /// Assignments dropped by the capacity.
    pub dropped: usize,
    /// The smallest gap between a token's `k`-th and `k + 1`-th router score
    /// ([`crate::moe::routing::min_margin`]).
    pub margin: f32,
}

thread_local! {
    static SCALE: RefCell<f32> = const { RefCell::new(1.0) };
    static RECORDS: RefCell<Vec<RoutingRecord>> = const { RefCell::new(Vec::new()) };
}

/// Sets the weight of one micro-batch's auxiliary losses (a layer's being the mean over the
/// micro-batch's routing groups) in the step's loss on this thread: the micro-batch's share of
/// the step, `micro_batch / global_batch` as the trainer sets it, so that the step trains the
/// mean over the global batch's routing groups, as one process does. 1 until set.
pub fn set_aux_scale(scale: f32) {
    SCALE.with(|s| *s.borrow_mut() = scale);
}

/// The weight set by [`set_aux_scale`].
pub fn aux_scale() -> f32 {
    SCALE.with(|s| *s.borrow())
}

/// Takes the routing records of the backward passes run on this thread since the last call.
pub fn take_records() -> Vec<RoutingRecord> {
    RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

fn record(r: RoutingRecord) {
    RECORDS.with(|all| all.borrow_mut().push(r));
}

#[derive(Debug)]
struct AuxBackward;

impl<B: ExpertBackend> Backward<B, 2> for AuxBackward {
    type State = (f32, RoutingRecord);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (scale, rec) = ops.state;
        record(rec);
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |g| g,
            |g| {
                let device = B::float_device(&g);
                let one = TensorData::new(vec![scale], [1]);
                Tensor::<B, 1>::from_data(one, &device)
                    .into_primitive()
                    .tensor()
            },
        );
    }
}

/// [`ExpertBackend::moe_aux`] on `Autodiff<B>`.
pub(crate) fn autodiff_aux<B: ExpertBackend, C: CheckpointStrategy>(
    y: FloatTensor<Autodiff<B, C>>,
    aux: FloatTensor<Autodiff<B, C>>,
    record: RoutingRecord,
) -> FloatTensor<Autodiff<B, C>> {
    let scale = aux_scale();
    let record = RoutingRecord {
        aux_loss: record.aux_loss * f64::from(scale),
        ..record
    };
    match AuxBackward
        .prepare::<C>([y.node.clone(), aux.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((scale, record), y.primitive),
        OpsKind::UnTracked(prep) => prep.finish(y.primitive),
    }
}

/// `y`, with `aux` (a one-value tensor, this rank's part of the layer's auxiliary loss)
/// trained at weight [`aux_scale`] and `record` kept for the metrics, both when the backward
/// pass reaches `y`. Outside autodiff: `y`.
pub fn with_aux_loss<B: ExpertBackend>(
    y: Tensor<B, 3>,
    aux: Tensor<B, 1>,
    record: RoutingRecord,
) -> Tensor<B, 3> {
    let dims = y.dims();
    let y = y.reshape([dims.iter().product::<usize>()]);
    let out = B::moe_aux(
        y.into_primitive().tensor(),
        aux.into_primitive().tensor(),
        record,
    );
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(out)).reshape(dims)
}
