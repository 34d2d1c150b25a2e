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
//!   the jobs, in the order the backward made them, and hands each to the gradient sink
//!   ([`super::grad_sink`]) as the hook's backward would have. Running it right after the
//!   backward gives the unsplit backward's values and per-parameter order of accumulation, bit
//!   for bit.
//!
//! Only weights used by one operation are deferred (a hook feeding a linear product directly);
//! a tied output head reaches its table through a transpose and keeps its gradient in B.

use std::cell::RefCell;
use std::collections::HashMap;

use burn_autodiff::NodeId;

/// A backward pass's key: `(micro-batch, global stage)`.
pub type Key = (usize, usize);

/// One deferred weight gradient: computes it and hands it to its hook's sink.
type Job = Box<dyn FnOnce()>;

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

/// Keeps a deferred weight gradient's job (which computes it and hands it over) for the open
/// backward pass.
pub(crate) fn push(job: Job) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if let Some(key) = s.open {
            s.jobs.entry(key).or_default().push(job);
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

/// Computes the deferred weight gradients of `key` and hands each to the gradient sink
/// installed on this thread ([`super::grad_sink`]), in the order they were deferred. Returns
/// how many there were.
pub fn run(key: Key) -> usize {
    let jobs = STATE.with(|s| s.borrow_mut().jobs.remove(&key).unwrap_or_default());
    let n = jobs.len();
    for job in jobs {
        job();
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
    use super::*;

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
