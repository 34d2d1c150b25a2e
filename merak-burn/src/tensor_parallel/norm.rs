//! LayerNorm, replicated on every tensor-parallel rank, on the fused kernel.

use crate::precision::autocast;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use super::ops::ParallelBackend;
use super::sequence::sp_param;
use crate::comm::Group;
use crate::kernels::layer_norm;

/// LayerNorm over the last dimension with a gain and a shift, computed by the fused kernel
/// ([`FusedOps::fused_layer_norm`](crate::kernels::FusedOps::fused_layer_norm)). Its
/// parameters are named like those of Burn's `LayerNorm` (`gamma`, `beta`), so parameter
/// paths, checkpoints and exports are the same.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// The gain, `[d]`, initialized to 1.
    pub gamma: Param<Tensor<B, 1>>,
    /// The shift, `[d]`, initialized to 0.
    pub beta: Param<Tensor<B, 1>>,
    #[module(skip)]
    epsilon: f64,
    /// The TP group under sequence parallelism (the input is a slice of the sequence: the
    /// parameters' gradients are summed over it), `None` otherwise.
    #[module(skip)]
    sequence_parallel: Option<Group>,
}

impl<B: Backend> LayerNorm<B> {
    /// A LayerNorm over `d` features with `epsilon` added to the variance.
    pub fn new(d: usize, epsilon: f64, device: &B::Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d], device)),
            beta: Param::from_tensor(Tensor::zeros([d], device)),
            epsilon,
            sequence_parallel: None,
        }
    }

    /// Marks the LayerNorm as inside sequence parallelism's split region over `group` (its
    /// input holds this rank's slice of the sequence) or, with `None`, outside it.
    pub fn set_sequence_parallel(&mut self, group: Option<Group>) {
        self.sequence_parallel = group.filter(|g| g.size() > 1);
    }

    /// The epsilon added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }
}

impl<B: ParallelBackend> LayerNorm<B> {
    /// `[..., d] -> [..., d]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let sp = self.sequence_parallel;
        let gamma = autocast(sp_param(self.gamma.val(), sp));
        let beta = autocast(sp_param(self.beta.val(), sp));
        layer_norm(x, gamma, beta, self.epsilon)
    }
}
