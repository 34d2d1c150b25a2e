//! One expert's feed-forward network (GELU or SwiGLU), as plain parameters: experts are not
//! split by tensor parallelism (every TP rank holds its expert-parallel rank's experts whole
//! and computes its own tokens; the gradients are summed over the TP ranks by the
//! data-parallel reducer's expert group, never inside the graph, because the TP ranks of a
//! layer need not route tokens to the same experts).

use burn::module::{Module, Param};
use burn::tensor::activation::{gelu, silu};
use burn::tensor::{Tensor, backend::Backend};

use super::config::ExpertActivation;
use crate::comm::Group;
use crate::precision::autocast;
use crate::rng::InitRng;
use crate::tensor_parallel::ParallelBackend;
use crate::tensor_parallel::{param_from_values, sp_param};

/// A feed-forward network `[tokens, hidden] -> [tokens, hidden]`.
#[derive(Module, Debug)]
pub struct Expert<B: Backend> {
    /// The input projection `[hidden, width]` (GELU) or `[hidden, 2 width]` (SwiGLU: the gate's
    /// columns, then the up projection's).
    pub w_in: Param<Tensor<B, 2>>,
    /// The input projection's bias (GELU only).
    pub b_in: Option<Param<Tensor<B, 1>>>,
    /// The output projection `[width, hidden]`.
    pub w_out: Param<Tensor<B, 2>>,
    /// The output projection's bias (GELU only).
    pub b_out: Option<Param<Tensor<B, 1>>>,
}

/// How an expert is initialized: the model's streams and standard deviations.
#[derive(Clone, Copy, Debug)]
pub struct ExpertInit<'a> {
    /// The model's named random streams.
    pub rng: &'a InitRng,
    /// The standard deviation of the input projection.
    pub std: f32,
    /// The standard deviation of the output projection (a residual branch's).
    pub out_std: f32,
}

impl<B: ParallelBackend> Expert<B> {
    /// An expert of `width` hidden units on `hidden`-wide tokens, its parameters drawn from the
    /// streams `{name}.w_in` and `{name}.w_out` (biases zero).
    pub fn new(
        name: &str,
        hidden: usize,
        width: usize,
        activation: ExpertActivation,
        init: ExpertInit<'_>,
        device: &B::Device,
    ) -> Self {
        let cols = match activation {
            ExpertActivation::Gelu => width,
            ExpertActivation::Swiglu => 2 * width,
        };
        let w_in = init
            .rng
            .normal(&format!("{name}.w_in"), hidden * cols, init.std);
        let w_out = init
            .rng
            .normal(&format!("{name}.w_out"), width * hidden, init.out_std);
        let gelu = activation == ExpertActivation::Gelu;
        Self {
            w_in: param_from_values(w_in, [hidden, cols], device),
            b_in: gelu.then(|| param_from_values(vec![0.0; width], [width], device)),
            w_out: param_from_values(w_out, [width, hidden], device),
            b_out: gelu.then(|| param_from_values(vec![0.0; hidden], [hidden], device)),
        }
    }

    /// The network on `x` (`[tokens, hidden]`); the parameters are read through `sp` (the
    /// TP group under sequence parallelism, whose ranks all run this network on their own
    /// tokens: a shared expert) or as they are (`None`: a routed expert).
    pub fn forward(&self, x: Tensor<B, 2>, sp: Option<Group>) -> Tensor<B, 2> {
        let w = |p: &Param<Tensor<B, 2>>| autocast(sp_param(p.val(), sp));
        let b =
            |p: &Option<Param<Tensor<B, 1>>>| p.as_ref().map(|p| autocast(sp_param(p.val(), sp)));
        let h = x.matmul(w(&self.w_in));
        let h = match b(&self.b_in) {
            Some(bias) => gelu(h + bias.unsqueeze::<2>()),
            None => {
                let width = h.dims()[1] / 2;
                silu(h.clone().narrow(1, 0, width)) * h.narrow(1, width, width)
            }
        };
        let y = h.matmul(w(&self.w_out));
        match b(&self.b_out) {
            Some(bias) => y + bias.unsqueeze::<2>(),
            None => y,
        }
    }
}
