//! The autodiff operations of expert parallelism, below the layers that use them: the token
//! exchange between the ranks of an expert-parallel group ([`mod@exchange`]) and the injection of
//! a router's auxiliary losses into the backward pass at its layer ([`aux`]). They are methods
//! of [`ExpertBackend`], a supertrait of
//! [`ParallelBackend`](crate::tensor_parallel::ParallelBackend); the mixture-of-experts block
//! is in [`crate::moe`].

pub mod aux;
pub mod exchange;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};

use crate::comm::Group;

pub use aux::{RoutingRecord, aux_scale, set_aux_scale, take_records, with_aux_loss};
pub use exchange::{
    ExchangeCounts, exchange, exchange_around, exchange_rows, take_exchange_seconds,
};

/// A backend on which expert parallelism's operations are defined. The defaults run the
/// forward operation (through host buffers), so `impl ExpertBackend for MyBackend {}` is
/// enough; `Autodiff<B>` adds the backward passes.
pub trait ExpertBackend: Backend {
    /// The exchange of `[rows, width]` rows with the ranks of `group` in blocks of `counts`
    /// ([`exchange`](exchange::exchange)), running `during` while the rows travel; backward
    /// (under autodiff), the reverse exchange.
    fn ep_exchange(
        x: FloatTensor<Self>,
        counts: &ExchangeCounts,
        group: Group,
        during: &mut dyn FnMut(),
    ) -> FloatTensor<Self> {
        exchange_rows::<Self>(x, counts, group, during)
    }

    /// Identity on `y` forward; backward (under autodiff), `y`'s gradient passes, the one-value
    /// `aux` gets the gradient [`aux_scale`] and `record` is kept for the step's metrics
    /// ([`with_aux_loss`]).
    fn moe_aux(
        y: FloatTensor<Self>,
        aux: FloatTensor<Self>,
        record: RoutingRecord,
    ) -> FloatTensor<Self> {
        let _ = (aux, record);
        y
    }
}

impl ExpertBackend for burn_flex::Flex {}
/// Every CubeCL backend (CUDA, wgpu): the exchanges through host buffers.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl<R, F, I, BT> ExpertBackend for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

impl<B: ExpertBackend, C: CheckpointStrategy> ExpertBackend for Autodiff<B, C> {
    fn ep_exchange(
        x: FloatTensor<Self>,
        counts: &ExchangeCounts,
        group: Group,
        during: &mut dyn FnMut(),
    ) -> FloatTensor<Self> {
        exchange::autodiff_exchange::<B, C>(x, counts, group, during)
    }

    fn moe_aux(
        y: FloatTensor<Self>,
        aux: FloatTensor<Self>,
        record: RoutingRecord,
    ) -> FloatTensor<Self> {
        aux::autodiff_aux::<B, C>(y, aux, record)
    }
}
