//! Expert parallelism's token exchange: rows of a `[rows, width]` tensor sent to the ranks of
//! the expert-parallel group in blocks of any size (an all-to-all with counts), as an autodiff
//! operation whose backward pass sends the gradients back the way the rows came.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use super::ExpertBackend;
use crate::comm::{Group, TensorComm};

/// The rows one exchange sends to, and receives from, each rank of the group (rank order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExchangeCounts {
    /// Rows for rank `j`, in the order they leave.
    pub send: Vec<usize>,
    /// Rows from rank `i`, in the order they arrive.
    pub recv: Vec<usize>,
}

impl ExchangeCounts {
    /// The exchange that sends the received rows back (the combine after a dispatch, and the
    /// backward pass of either).
    pub fn reversed(&self) -> Self {
        Self {
            send: self.recv.clone(),
            recv: self.send.clone(),
        }
    }

    /// Rows received.
    pub fn received(&self) -> usize {
        self.recv.iter().sum()
    }
}

thread_local! {
    static SECONDS: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// Adds `s` seconds to this thread's exchange time.
pub(crate) fn count_seconds(s: f64) {
    SECONDS.with(|c| c.set(c.get() + s));
}

/// The seconds this thread spent in expert-parallel exchanges (rows, with their host copies,
/// and counts, forward and backward) since the last call.
pub fn take_exchange_seconds() -> f64 {
    SECONDS.with(|c| c.replace(0.0))
}

/// A failed exchange: the job ends as a failed rank ([`crate::comm::fail`]: `merak: rank R
/// failed: ...`, exit status 1), not as a panic.
fn failed(e: impl std::fmt::Display) -> ! {
    crate::comm::fail(format!("expert-parallel exchange failed: {e}"))
}

/// The forward exchange on any backend, through host buffers
/// ([`TensorComm::all_to_all_rows_start`]): `x` (`[rows, width]`, rows in blocks of
/// `counts.send`) becomes `[counts.received(), width]`; `during` runs while the rows are on
/// their way (the time it takes is not counted as the exchange's).
pub fn exchange_rows<B: Backend>(
    x: FloatTensor<B>,
    counts: &ExchangeCounts,
    group: Group,
    during: &mut dyn FnMut(),
) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let comm = group.comm().unwrap_or_else(|e| failed(e));
    let t0 = std::time::Instant::now();
    let mut flight = comm
        .all_to_all_rows_start(x, &counts.send, &counts.recv)
        .unwrap_or_else(|e| failed(e));
    // One call into the library posts what it can before the compute in between.
    flight.test().unwrap_or_else(|e| failed(e));
    count_seconds(t0.elapsed().as_secs_f64());
    during();
    // A DualPipeV pair's forward computes deferred weight gradients while the rows travel.
    while crate::kernels::deferred::fill_one() {
        if flight.test().unwrap_or_else(|e| failed(e)) {
            break;
        }
    }
    let t0 = std::time::Instant::now();
    let rows = flight.finish().unwrap_or_else(|e| failed(e));
    count_seconds(t0.elapsed().as_secs_f64());
    rows.into_primitive().tensor()
}

#[derive(Debug)]
struct ExchangeBackward;

impl<B: ExpertBackend> Backward<B, 1> for ExchangeBackward {
    type State = (ExchangeCounts, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let (counts, group) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            B::ep_exchange(g, &counts.reversed(), group, &mut || {})
        });
    }
}

/// [`ExpertBackend::ep_exchange`] on `Autodiff<B>`: the exchange (with `during` run while
/// the rows travel), and in the backward pass the reverse exchange of the gradient.
pub(crate) fn autodiff_exchange<B: ExpertBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    counts: &ExchangeCounts,
    group: Group,
    during: &mut dyn FnMut(),
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::ep_exchange(x.primitive, counts, group, during);
    match ExchangeBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((counts.clone(), group), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// Sends the rows of `x` (`[rows, width]`, in blocks of `counts.send` for the group's ranks in
/// order) to their ranks; returns the rows received (`[counts.received(), width]`, in blocks of
/// `counts.recv`). Differentiable: the gradient goes back by the reverse exchange. A group of
/// one rank returns `x`.
pub fn exchange<B: ExpertBackend>(
    x: Tensor<B, 2>,
    counts: &ExchangeCounts,
    group: Group,
) -> Tensor<B, 2> {
    exchange_around(x, counts, group, || ()).0
}

/// [`exchange`], computing `during` while the rows travel (forward; the backward pass's
/// exchange waits): returns the rows received and what `during` returned. A group of one rank
/// runs `during` and returns `x`.
pub fn exchange_around<B: ExpertBackend, T>(
    x: Tensor<B, 2>,
    counts: &ExchangeCounts,
    group: Group,
    during: impl FnOnce() -> T,
) -> (Tensor<B, 2>, T) {
    if group.size() == 1 {
        return (x, during());
    }
    let (mut during, mut out) = (Some(during), None);
    let mut run = || out = during.take().map(|f| f());
    let x = x.into_primitive().tensor();
    let rows = B::ep_exchange(x, counts, group, &mut run);
    let out = out.unwrap_or_else(|| panic!("the work beside the exchange did not run"));
    (Tensor::from_primitive(TensorPrimitive::Float(rows)), out)
}
