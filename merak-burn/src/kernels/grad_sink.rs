//! Where a gradient hook hands its parameter's gradient: the sink the data-parallel reducer
//! installs on its thread for a step.
//!
//! A gradient reaches the sink in one of two forms, which the sink chooses when installed:
//! copied to host memory (`Vec<f32>`, what the host buckets and MPI send), or as the backend's
//! own tensor, left where it is (on the GPU: no copy; [`HookedGrad::Device`]). The hook of
//! [`ParallelBackend::grad_hook`](crate::tensor_parallel::ParallelBackend::grad_hook) and the
//! split backward's deferred weight gradients ([`super::deferred`]) both hand over through
//! `hand_over`.

use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;

use super::FusedOps;

/// A parameter gradient handed to the sink.
pub enum HookedGrad {
    /// The values in host memory, as `f32`.
    Host(Vec<f32>),
    /// The backend's tensor, where it was computed: a `FloatTensor<B>` of the inner
    /// (non-autodiff) backend `B` of the hooked model, boxed.
    Device(Box<dyn Any>),
}

/// A gradient sink: `deliver(hook, gradient)`, the gradients in the form `on_device` picks.
#[derive(Clone)]
pub struct GradSink {
    /// Whether gradients stay the backend's tensors ([`HookedGrad::Device`]) instead of being
    /// copied to host memory.
    pub on_device: bool,
    /// Receives gradient `hook` of the step's backward passes.
    pub deliver: Rc<dyn Fn(usize, HookedGrad)>,
}

impl GradSink {
    /// A sink that receives host copies: `deliver(hook, values)`.
    pub fn host(deliver: impl Fn(usize, Vec<f32>) + 'static) -> Self {
        Self {
            on_device: false,
            deliver: Rc::new(move |hook, grad| match grad {
                HookedGrad::Host(values) => deliver(hook, values),
                // Never sent to a host sink (see `hand_over`).
                HookedGrad::Device(_) => {}
            }),
        }
    }
}

thread_local! {
    static GRAD_SINK: RefCell<Option<GradSink>> = const { RefCell::new(None) };
}

/// Installs (or, with `None`, removes) this thread's gradient sink.
pub fn set_grad_sink(sink: Option<GradSink>) {
    GRAD_SINK.with(|s| *s.borrow_mut() = sink);
}

/// Hands gradient `hook` to the installed sink, in the form it asked for (dropped when none is
/// installed, and when it has no elements: the placeholder a split backward leaves for its W
/// pass, which delivers the gradient itself).
pub(crate) fn hand_over<B: FusedOps>(hook: usize, grad: FloatTensor<B>) {
    let Some(sink) = GRAD_SINK.with(|s| s.borrow().clone()) else {
        return;
    };
    if grad.shape().num_elements() == 0 {
        return;
    }
    let grad = match sink.on_device {
        true => HookedGrad::Device(Box::new(grad)),
        false => HookedGrad::Host(B::into_host_vec(grad)),
    };
    (sink.deliver)(hook, grad);
}
