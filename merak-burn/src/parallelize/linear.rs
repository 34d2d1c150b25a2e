//! A linear layer that tensor parallelism may split: Burn's `Linear` plus the collectives of
//! its split.

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::comm::Group;
use crate::kernels;
use crate::tensor_parallel::ops::{gather_from_sp, scatter_to_sp};
use crate::tensor_parallel::{ParallelBackend, ShardKind, Split, copy_to_tp, reduce_from_tp};

/// `x W + b` like `burn::nn::Linear` (weight `[d_input, d_output]`), which a
/// [`TpPlan`](super::TpPlan) may split: column-parallel (this rank holds a slice of the output
/// features; the input's gradient is summed over the TP group) or row-parallel (a slice of the
/// input features; the partial outputs are summed over the group and the bias added once) or
/// shared (whole on every rank, which uses part of the output; the gradients of the input and
/// of the parameters are summed over the group). Unsplit, it is Burn's linear layer.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// Burn's layer, holding this rank's slice once split.
    pub linear: burn::nn::Linear<B>,
    /// How it is split: nothing until [`shard_module`](super::shard_module) cuts it.
    pub split: Split<B>,
}

impl<B: Backend> From<burn::nn::Linear<B>> for Linear<B> {
    fn from(linear: burn::nn::Linear<B>) -> Self {
        Self {
            linear,
            split: Split::none(),
        }
    }
}

impl<B: ParallelBackend> Linear<B> {
    /// `[..., d_input] -> [..., d_output]` (the local `d_output / tp` when column-parallel).
    ///
    /// Shared ([`TpStyle::Shared`](super::TpStyle::Shared)), every rank computes the whole
    /// output; the caller uses its part of it, and the backward pass sums the gradients of
    /// the input and of the weight and bias over the group, so that each rank gets the sum of
    /// the parts every rank used (and the same gradient, as a replicated parameter needs).
    ///
    /// Under sequence parallelism ([`TpPlan::sequence_parallel`](super::TpPlan)) the input is
    /// `[batch, positions, ...]` with this rank's `seq / tp` positions outside the split
    /// layers: a column-parallel or shared layer all-gathers it along the positions first (its
    /// gradient reduce-scattered), a row-parallel layer reduce-scatters its output instead of
    /// all-reducing it. Its replicated parameters (a row-parallel bias, a shared layer's
    /// weights) are then read as they are: the unit sums their gradients over the group
    /// ([`Units::with_sequence_parallel`](super::Units::with_sequence_parallel)).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.linear.bias.as_ref().map(|b| b.val());
        let (kind, group) = match self.split.group() {
            Some(group) => (self.split.kind("linear.weight"), group),
            None => return rows(x, self.linear.weight.val(), bias),
        };
        if self.split.sequence_parallel() {
            return self.forward_sequence_parallel(x, kind, group, bias);
        }
        match kind {
            ShardKind::Rows => {
                let y = reduce_from_tp(rows(x, self.linear.weight.val(), None), group);
                match bias {
                    Some(b) => y + b.unsqueeze(),
                    None => y,
                }
            }
            // Only a shared layer declares a group with its weight whole.
            ShardKind::Replicated => rows(
                copy_to_tp(x, group),
                copy_to_tp(self.linear.weight.val(), group),
                bias.map(|b| copy_to_tp(b, group)),
            ),
            _ => rows(copy_to_tp(x, group), self.linear.weight.val(), bias),
        }
    }

    /// [`forward`](Self::forward) with the positions outside the layer split over `group`.
    fn forward_sequence_parallel<const D: usize>(
        &self,
        x: Tensor<B, D>,
        kind: ShardKind,
        group: Group,
        bias: Option<Tensor<B, 1>>,
    ) -> Tensor<B, D> {
        assert!(
            D >= 3,
            "a sequence-parallel linear layer takes [batch, positions, ...] inputs, not {D}-D"
        );
        let weight = self.linear.weight.val();
        match kind {
            ShardKind::Rows => {
                let y = scatter_to_sp(rows(x, weight, None), 1, group);
                match bias {
                    Some(b) => y + b.unsqueeze(),
                    None => y,
                }
            }
            _ => rows(gather_from_sp(x, 1, group), weight, bias),
        }
    }
}

/// `x w (+ b)` with the leading dimensions of `x` folded into the rows of one fused matrix
/// product ([`crate::kernels::linear`]).
fn rows<B: ParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let n: usize = dims[..D - 1].iter().product();
    let y = kernels::linear(x.reshape([n, dims[D - 1]]), w, b);
    let mut out = dims;
    out[D - 1] = y.dims()[1];
    y.reshape(out)
}
