//! The transformer MLP: column-parallel expansion, GELU, row-parallel contraction.

use burn::module::Module;
use burn::tensor::{Tensor, activation::gelu, backend::Backend};

use super::init::TpError;
use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::ops::ParallelBackend;
use super::overlap::TpOverlap;
use crate::comm::Group;

/// The full-size parameters of an MLP block, row-major.
#[derive(Clone, Debug)]
pub struct MlpWeights {
    /// Expansion `[d_model, d_ff]`.
    pub fc_weight: Vec<f32>,
    /// Its bias, `[d_ff]`.
    pub fc_bias: Vec<f32>,
    /// Contraction `[d_ff, d_model]`.
    pub proj_weight: Vec<f32>,
    /// Its bias, `[d_model]`.
    pub proj_bias: Vec<f32>,
}

/// `x -> proj(gelu(fc(x)))` with `fc` column-parallel and `proj` row-parallel: one all-reduce
/// forward (after `proj`) and one backward (in front of `fc`).
#[derive(Module, Debug)]
pub struct ParallelMlp<B: Backend> {
    /// Expansion, `[d_model, d_ff / tp]`.
    pub fc: ColumnParallelLinear<B>,
    /// Contraction, `[d_ff / tp, d_model]`.
    pub proj: RowParallelLinear<B>,
}

impl<B: ParallelBackend> ParallelMlp<B> {
    /// Builds this rank's shard. Fails unless `tp` divides `d_ff`.
    pub fn from_full(
        w: &MlpWeights,
        d_model: usize,
        d_ff: usize,
        group: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        Ok(Self {
            fc: ColumnParallelLinear::from_full(
                &w.fc_weight,
                Some(&w.fc_bias),
                d_model,
                d_ff,
                1,
                false,
                group,
                device,
            )?,
            proj: RowParallelLinear::from_full(
                &w.proj_weight,
                Some(&w.proj_bias),
                d_ff,
                d_model,
                group,
                device,
            )?,
        })
    }

    /// Sub-pipelines both products over `overlap` token chunks: the
    /// expansion's input-gradient all-reduce (backward) and the contraction's all-reduce
    /// (forward).
    pub fn set_overlap(&mut self, overlap: TpOverlap) {
        self.fc.set_overlap(overlap);
        self.proj.set_overlap(overlap);
    }

    /// Sequence parallelism on (or off): the input and the output are this rank's slice of
    /// every sequence (`[batch, seq / tp, d_model]`); the input is all-gathered in front of the
    /// first product and the output reduce-scattered after the second
    /// ([`sequence`](super::sequence)).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.fc.set_sequence_parallel(on);
        self.proj.set_sequence_parallel(on);
    }

    /// `[batch, seq, d_model] -> [batch, seq, d_model]`. The expansion's bias and the GELU
    /// are one fused operation ([`crate::kernels::bias_gelu`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.proj.forward(self.fc.forward_bias_gelu(x))
    }

    /// The same as [`ParallelMlp::forward`] with Burn's bias addition and GELU: the reference
    /// the fused one is tested against.
    pub fn forward_unfused(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.proj.forward(gelu(self.fc.forward(x)))
    }
}
