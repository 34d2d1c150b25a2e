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
//! - While a [`fill_with`] guard for a key lives (DualPipeV's pair runs its forward pass under
//!   one for the W that follows the pair), the expert-parallel exchanges of that forward pass
//!   compute the key's jobs one at a time while their rows travel ([`fill_one`]: at least one
//!   per exchange, more until the rows are there); [`run`] computes the rest. The jobs keep
//!   their order, so the values and the order of accumulation are those of [`run`] alone.
//!
//! Only weights used by one operation are deferred (a hook feeding a linear product directly);
//! a tied output head reaches its table through a transpose and keeps its gradient in B.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

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
    jobs: HashMap<Key, VecDeque<Job>>,
    /// The key whose jobs fill the waits of the running forward pass's exchanges.
    fill: Option<Key>,
    /// Jobs computed while exchanges waited, since the last [`take_filled`].
    filled: usize,
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
            s.jobs.entry(key).or_default().push_back(job);
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

/// Lets the exchanges of the forward pass that runs until the returned guard drops compute
/// the deferred weight gradients of `key` while they wait ([`fill_one`]).
pub fn fill_with(key: Key) -> FillGuard {
    STATE.with(|s| s.borrow_mut().fill = Some(key));
    FillGuard(())
}

/// The filling allowed by [`fill_with`]; ends when dropped.
pub struct FillGuard(());

impl Drop for FillGuard {
    fn drop(&mut self) {
        STATE.with(|s| s.borrow_mut().fill = None);
    }
}

/// Computes the oldest deferred job of the key [`fill_with`] names, outside a backward pass;
/// returns whether there was one.
pub(crate) fn fill_one() -> bool {
    let job = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let key = s.fill.filter(|_| s.open.is_none())?;
        let job = s.jobs.get_mut(&key)?.pop_front()?;
        if s.jobs.get(&key).is_some_and(VecDeque::is_empty) {
            s.jobs.remove(&key);
        }
        s.filled += 1;
        Some(job)
    });
    job.map(|job| job()).is_some()
}

/// How many jobs exchanges computed while they waited since the last call.
pub fn take_filled() -> usize {
    STATE.with(|s| std::mem::take(&mut s.borrow_mut().filled))
}

/// Backward passes (keys) whose deferred weight gradients have not run yet.
pub fn pending_backwards() -> usize {
    STATE.with(|s| s.borrow().jobs.len())
}

/// Deferred jobs not yet run, over all keys.
pub fn pending() -> usize {
    STATE.with(|s| s.borrow().jobs.values().map(VecDeque::len).sum())
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

    #[test]
    fn a_fill_computes_its_keys_jobs_in_order_and_run_the_rest() {
        use std::cell::RefCell;
        use std::rc::Rc;
        enable(true);
        let ran = Rc::new(RefCell::new(Vec::new()));
        for (key, job) in [((1, 0), 0), ((1, 0), 1), ((2, 1), 2), ((1, 0), 3)] {
            let _open = open(key);
            let ran = ran.clone();
            push(Box::new(move || ran.borrow_mut().push(job)));
        }
        assert!(!fill_one(), "no fill allowed");
        {
            let _fill = fill_with((1, 0));
            {
                let _open = open((3, 0));
                assert!(!fill_one(), "not inside a backward pass");
            }
            assert!(fill_one() && fill_one());
        }
        assert!(!fill_one(), "the guard dropped");
        assert_eq!(take_filled(), 2);
        assert_eq!(run((1, 0)), 1);
        assert_eq!(run((2, 1)), 1);
        assert_eq!(*ran.borrow(), [0, 1, 3, 2]);
        assert_eq!(pending(), 0);
        enable(false);
    }
}
