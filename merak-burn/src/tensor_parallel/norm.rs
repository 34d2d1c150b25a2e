//! LayerNorm, replicated on every tensor-parallel rank, on the fused kernel.

use crate::precision::autocast;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use crate::kernels::{FusedOps, layer_norm};

/// LayerNorm over the last dimension with a gain and a shift, computed by the fused kernel
/// ([`FusedOps::fused_layer_norm`]). Its parameters are named like those of Burn's `LayerNorm`
/// (`gamma`, `beta`), so parameter paths, checkpoints and exports are the same.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// The gain, `[d]`, initialized to 1.
    pub gamma: Param<Tensor<B, 1>>,
    /// The shift, `[d]`, initialized to 0.
    pub beta: Param<Tensor<B, 1>>,
    #[module(skip)]
    epsilon: f64,
}

impl<B: Backend> LayerNorm<B> {
    /// A LayerNorm over `d` features with `epsilon` added to the variance.
    pub fn new(d: usize, epsilon: f64, device: &B::Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d], device)),
            beta: Param::from_tensor(Tensor::zeros([d], device)),
            epsilon,
        }
    }

    /// The epsilon added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }
}

impl<B: FusedOps> LayerNorm<B> {
    /// `[..., d] -> [..., d]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (gamma, beta) = (autocast(self.gamma.val()), autocast(self.beta.val()));
        layer_norm(x, gamma, beta, self.epsilon)
    }
}
