//! Weight gradients deferred out of the backward pass: the split backward of zero-bubble
//! pipeline schedules (B computes the input gradient, W the weight gradients later).
//!
//! How it works, on one thread (a pipeline rank):
//! - [`enable`] turns it on for the executor's schedule. While on, every gradient hook
//!   ([`ParallelBackend::grad_hook`](crate::tensor_parallel::ParallelBackend::grad_hook),
//!   which the data-parallel reducer puts on each parameter) notes its graph node.
//! - During a backward pass opened with [`open`] for `(micro-batch, stage)`, the backward of a
//!   linear product ([`crate::kernels::linear`]) whose weight comes straight from a hook
//!   computes only the input and bias gradients. It keeps its input and output gradient in a
//!   job for that key, and hands the hook an empty gradient, which the hook ignores.
//! - [`run`] for the key (the schedule's `BackwardWeight`) computes the weight gradients of
//!   the jobs, in the order the backward made them, and delivers each to its hook as the
//!   backward would have. Running it right after the backward gives the unsplit backward's
//!   values and per-parameter order of accumulation, bit for bit.
//!
//! Only weights used by one operation are deferred (a hook feeding a linear product directly);
//! a tied output head reaches its table through a transpose and keeps its gradient in B.

use std::cell::RefCell;
use std::collections::HashMap;

use burn_autodiff::NodeId;

/// A backward pass's key: `(micro-batch, global stage)`.
pub type Key = (usize, usize);

/// One deferred weight gradient: the hook it goes to and how to compute it.
struct Job {
    hook: usize,
    compute: Box<dyn FnOnce() -> Vec<f32>>,
}

#[derive(Default)]
struct State {
    enabled: bool,
    /// Hook graph nodes of the forward passes whose backward has not run, by node id.
    hooks: HashMap<NodeId, usize>,
    /// The backward pass whose weight gradients are being deferred.
    open: Option<Key>,
    jobs: HashMap<Key, Vec<Job>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Turns deferral on (for a schedule that splits the backward) or off, dropping every pending
/// job and note.
pub fn enable(on: bool) {
    STATE.with(|s| {
        *s.borrow_mut() = State {
            enabled: on,
            ..State::default()
        }
    });
}

/// Notes that graph node `node` is gradient hook `hook` (called by the hook's forward).
pub(crate) fn note_hook(node: NodeId, hook: usize) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.enabled {
            s.hooks.insert(node, hook);
        }
    });
}

/// The hook's backward ran: forgets its node.
pub(crate) fn forget_hook(node: NodeId) {
    STATE.with(|s| {
        s.borrow_mut().hooks.remove(&node);
    });
}

/// The hook whose weight gradient a linear product's backward should defer, if a backward
/// pass is open and `weight` is a hook's node.
pub(crate) fn defer_for(weight: NodeId) -> Option<usize> {
    STATE.with(|s| {
        let s = s.borrow();
        s.open?;
        s.hooks.get(&weight).copied()
    })
}

/// Keeps the computation of hook `hook`'s gradient for the open backward pass.
pub(crate) fn push(hook: usize, compute: Box<dyn FnOnce() -> Vec<f32>>) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if let Some(key) = s.open {
            s.jobs.entry(key).or_default().push(Job { hook, compute });
        }
    });
}

/// Opens the backward pass of `key`: until the returned guard drops, linear weight gradients
/// are deferred to [`run`]`(key)`.
pub fn open(key: Key) -> OpenBackward {
    STATE.with(|s| s.borrow_mut().open = Some(key));
    OpenBackward(())
}

/// The backward pass opened by [`open`]; closed when dropped.
pub struct OpenBackward(());

impl Drop for OpenBackward {
    fn drop(&mut self) {
        STATE.with(|s| s.borrow_mut().open = None);
    }
}

/// Computes the deferred weight gradients of `key` and hands each, as `(hook, gradient)`, to
/// `deliver`, in the order they were deferred. Returns how many there were.
pub fn run(key: Key, mut deliver: impl FnMut(usize, Vec<f32>)) -> usize {
    let jobs = STATE.with(|s| s.borrow_mut().jobs.remove(&key).unwrap_or_default());
    let n = jobs.len();
    for job in jobs {
        deliver(job.hook, (job.compute)());
    }
    n
}

/// Backward passes (keys) whose deferred weight gradients have not run yet.
pub fn pending_backwards() -> usize {
    STATE.with(|s| s.borrow().jobs.len())
}

/// Deferred jobs not yet run, over all keys.
pub fn pending() -> usize {
    STATE.with(|s| s.borrow().jobs.values().map(Vec::len).sum())
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::*;
    use crate::backend::{CpuAutodiff, CpuDevice};
    use crate::tensor_parallel::{ParallelBackend, set_grad_sink};

    type B = CpuAutodiff;
    type Deliveries = Vec<(usize, Vec<f32>)>;
    type Delivered = Rc<RefCell<Deliveries>>;

    fn tensor(rows: usize, cols: usize, seed: f32) -> Tensor<B, 2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
            .collect();
        Tensor::from_data(TensorData::new(v, [rows, cols]), &CpuDevice::default()).require_grad()
    }

    /// One backward pass of `(x W + b) * g` with `W` behind gradient hook 7: the hooks'
    /// deliveries and the input gradient. With `split`, B runs in an open backward and W after.
    fn backward(split: bool) -> (Deliveries, Vec<f32>, usize) {
        enable(split);
        let got: Delivered = Rc::default();
        let sink = got.clone();
        set_grad_sink(Some(Rc::new(move |hook, grad| {
            sink.borrow_mut().push((hook, grad))
        })));
        let (x, w) = (tensor(5, 4, 0.1), tensor(4, 3, 0.7));
        let hooked = B::grad_hook(w.into_primitive().tensor(), 7);
        let w = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(hooked));
        let b = Tensor::<B, 1>::from_data([0.1f32, -0.2, 0.3], &CpuDevice::default());
        let y = crate::kernels::linear(x.clone(), w, Some(b.require_grad()));
        let loss = (y * tensor(5, 3, 1.3)).sum();
        let grads = {
            let _open = split.then(|| open((0, 1)));
            loss.backward()
        };
        let dx = x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap();
        let before_w = got.borrow().len();
        run((0, 1), |hook, grad| got.borrow_mut().push((hook, grad)));
        set_grad_sink(None);
        enable(false);
        let delivered = got.borrow().clone();
        (delivered, dx, before_w)
    }

    #[test]
    fn b_then_w_is_the_unsplit_backward_bit_for_bit() {
        let (unsplit, dx, during) = backward(false);
        assert_eq!(
            during, 1,
            "the unsplit backward delivers the weight gradient itself"
        );
        let (split, dx_split, during_b) = backward(true);
        assert_eq!(during_b, 0, "B delivers no weight gradient");
        assert_eq!(split, unsplit, "W delivers what the unsplit backward did");
        assert_eq!(split[0].0, 7);
        assert_eq!(split[0].1.len(), 12);
        assert_eq!(dx_split, dx);
        assert_eq!(pending(), 0);
    }

    #[test]
    fn nothing_is_deferred_outside_an_open_backward_or_when_off() {
        enable(true);
        assert_eq!(defer_for(NodeId { value: 1 }), None);
        note_hook(NodeId { value: 1 }, 3);
        assert_eq!(defer_for(NodeId { value: 1 }), None, "no backward is open");
        let open = open((2, 0));
        assert_eq!(defer_for(NodeId { value: 1 }), Some(3));
        drop(open);
        enable(false);
        note_hook(NodeId { value: 1 }, 3);
        let _open = super::open((2, 0));
        assert_eq!(defer_for(NodeId { value: 1 }), None, "off");
    }
}
