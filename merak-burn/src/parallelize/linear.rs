//! A linear layer that tensor parallelism may split: Burn's `Linear` plus the collectives of
//! its split.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::comm::Group;
use crate::kernels;
use crate::parallelize::TpStyle;
use crate::tensor_parallel::{ParallelBackend, copy_to_tp, reduce_from_tp};

thread_local! {
    /// The split and TP group of every weight [`shard_module`](super::shard_module) cut, by
    /// parameter id (stable across optimizer steps, clones and `valid()`).
    static SPLITS: RefCell<HashMap<ParamId, (TpStyle, Group)>> = RefCell::new(HashMap::new());
}

/// Records that the weight `id` is split as `style` over `group`.
pub(crate) fn record_split(id: ParamId, style: TpStyle, group: Group) {
    SPLITS.with(|s| s.borrow_mut().insert(id, (style, group)));
}

/// How the weight `id` is split (replicated unless [`record_split`] said otherwise).
fn split_of(id: ParamId) -> Option<(TpStyle, Group)> {
    SPLITS.with(|s| s.borrow().get(&id).copied())
}

/// `x W + b` like `burn::nn::Linear` (weight `[d_input, d_output]`), which a
/// [`TpPlan`](super::TpPlan) may split: column-parallel (this rank holds a slice of the output
/// features; the input's gradient is summed over the TP group) or row-parallel (a slice of the
/// input features; the partial outputs are summed over the group and the bias added once).
/// Unsplit, it is Burn's linear layer.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// Burn's layer, holding this rank's slice once split.
    pub linear: burn::nn::Linear<B>,
}

impl<B: Backend> From<burn::nn::Linear<B>> for Linear<B> {
    fn from(linear: burn::nn::Linear<B>) -> Self {
        Self { linear }
    }
}

impl<B: ParallelBackend> Linear<B> {
    /// `[..., d_input] -> [..., d_output]` (the local `d_output / tp` when column-parallel).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.linear.bias.as_ref().map(|b| b.val());
        match split_of(self.linear.weight.id) {
            None => rows(x, self.linear.weight.val(), bias),
            Some((TpStyle::Column, group)) => {
                rows(copy_to_tp(x, group), self.linear.weight.val(), bias)
            }
            Some((TpStyle::Row, group)) => {
                let y = reduce_from_tp(rows(x, self.linear.weight.val(), None), group);
                match bias {
                    Some(b) => y + b.unsqueeze(),
                    None => y,
                }
            }
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
