//! Column- and row-parallel linear layers.

use crate::precision::autocast;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Tensor, TensorData, TensorPrimitive, backend::Backend, ops::FloatTensor};

use super::init::{Shard, TpError, check_divisible};
use super::ops::{ParallelBackend, copy_to_tp, gather_from_tp, reduce_from_tp};
use super::overlap::{self, TpOverlap};
use super::sequence::sp_param;
use super::sharding::{ShardKind, Split};
use crate::comm::Group;
use crate::kernels::{self, FusedOps, bias_gelu};

pub(crate) fn shard_of(group: Group) -> Shard {
    Shard {
        rank: group.rank(),
        size: group.size(),
    }
}

/// `x W (+ b)` with every leading dimension of `x` folded into the rows of one fused matrix
/// product ([`crate::kernels::linear`]), so that the weight gradient is one product over all
/// rows (Burn's linear on a rank-3 input makes one per sequence and sums them, through a
/// `[batch, d_input, d_output]` temporary).
fn linear_rows<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    layer: &Linear<B>,
    bias: bool,
) -> Tensor<B, D> {
    let b = if bias {
        layer.bias.as_ref().map(|b| autocast(b.val()))
    } else {
        None
    };
    on_rows(x, |x| kernels::linear(x, autocast(layer.weight.val()), b))
}

/// A parameter of `shape` holding `values` (row-major) on `device`.
pub fn param_from_values<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device))
}

pub(crate) fn param2<B: Backend>(
    values: Vec<f32>,
    shape: [usize; 2],
    device: &B::Device,
) -> Param<Tensor<B, 2>> {
    param_from_values(values, shape, device)
}

pub(crate) fn param1<B: Backend>(values: Vec<f32>, device: &B::Device) -> Param<Tensor<B, 1>> {
    let n = values.len();
    param_from_values(values, [n], device)
}

fn check_full(what: &'static str, expected: usize, got: usize) -> Result<(), TpError> {
    if expected == got {
        Ok(())
    } else {
        Err(TpError::FullSize {
            what,
            expected,
            got,
        })
    }
}

/// A linear layer whose output features are split across the TP group (`Y_r = X A_r + b_r`).
///
/// The input is replicated; an *f* operator in front sums its gradient across the group. The
/// output stays split unless `gather_output` is set.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// The local Burn linear layer: weight `[d_input, d_output / tp]`.
    pub linear: Linear<B>,
    /// Weight and bias split by columns.
    pub split: Split<B>,
    #[module(skip)]
    group: Group,
    #[module(skip)]
    gather_output: bool,
    #[module(skip)]
    overlap: TpOverlap,
    #[module(skip)]
    sequence_parallel: bool,
}

impl<B: ParallelBackend> ColumnParallelLinear<B> {
    /// Builds this rank's shard from the full-size weight (`[d_input, d_output]`, row-major)
    /// and bias. The output features form `segments` equal parts (3 for a fused Q/K/V
    /// projection), each split across the group.
    #[allow(clippy::too_many_arguments)]
    pub fn from_full(
        weight: &[f32],
        bias: Option<&[f32]>,
        d_input: usize,
        d_output: usize,
        segments: usize,
        gather_output: bool,
        group: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        check_full("column-parallel weight", d_input * d_output, weight.len())?;
        check_divisible(
            "output features per segment",
            d_output / segments.max(1),
            group.size(),
        )?;
        check_divisible("output features", d_output, segments)?;
        let shard = shard_of(group);
        let local = d_output / group.size();
        let w = shard.columns(weight, d_input, d_output, segments);
        let bias = match bias {
            Some(b) => {
                check_full("column-parallel bias", d_output, b.len())?;
                Some(param1(shard.columns(b, 1, d_output, segments), device))
            }
            None => None,
        };
        let weight = param2(w, [d_input, local], device);
        let kind = ShardKind::Columns { segments };
        Ok(Self {
            linear: Linear { weight, bias },
            split: Split::new(group, [("linear.weight", kind), ("linear.bias", kind)]),
            group,
            gather_output,
            overlap: TpOverlap::default(),
            sequence_parallel: false,
        })
    }

    /// Sequence parallelism on (or off): the input is this rank's slice of every sequence
    /// (`[batch, seq / tp, d_input]`), all-gathered along the sequence in front of the product
    /// (*ḡ*: its backward reduce-scatters the input gradient).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// Sub-pipelines the layer: the all-reduce of its input gradient is cut into `overlap`
    /// token chunks ([`overlap`]).
    pub fn set_overlap(&mut self, overlap: TpOverlap) {
        self.overlap = overlap;
    }

    /// Whether the layer runs sub-pipelined (an overlap degree above 1 over several ranks).
    fn overlapped(&self) -> bool {
        !self.overlap.is_serial() && self.group.size() > 1
    }

    /// `x A_r` with the *f* operator in front (identity forward, gradient summed over the
    /// group backward), sub-pipelined when an overlap is set; no bias. Under sequence
    /// parallelism *ḡ* replaces *f*.
    fn product<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.sequence_parallel && self.group.size() > 1 {
            let w = autocast(self.linear.weight.val());
            return sequence_product(B::sp_column_linear, x, w, self.overlap, self.group);
        }
        if !self.overlapped() {
            return linear_rows(copy_to_tp(x, self.group), &self.linear, false);
        }
        on_rows(x, |x| {
            let chunks = self.overlap.chunks_for(x.dims()[0]);
            overlap::column_linear(x, autocast(self.linear.weight.val()), chunks, self.group)
        })
    }

    /// `[..., d_input] -> [..., d_output / tp]` (or `d_output` when gathering).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = if self.overlapped() || self.sequence_parallel {
            add_bias(self.product(x), self.linear.bias.as_ref(), None)
        } else {
            linear_rows(copy_to_tp(x, self.group), &self.linear, true)
        };
        if self.gather_output {
            gather_from_tp(y, D - 1, self.group)
        } else {
            y
        }
    }

    /// `gelu(x A_r + b_r)` as one matrix product and one fused bias + GELU
    /// ([`crate::kernels::bias_gelu`]); the output stays split (an MLP's expansion).
    pub fn forward_bias_gelu<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = self.product(x);
        match &self.linear.bias {
            Some(b) => bias_gelu(y, autocast(b.val())),
            None => burn::tensor::activation::gelu(y),
        }
    }

    /// The TP group.
    pub fn group(&self) -> Group {
        self.group
    }
}

/// A linear layer whose input features are split across the TP group: each rank multiplies
/// its slice and a *g* operator sums the partial outputs; the bias is added once, after the sum
/// (also for tp = 1, so that parameter names do not depend on the layout).
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// The local Burn linear layer: weight `[d_input / tp, d_output]`, no bias.
    pub linear: Linear<B>,
    /// The bias, replicated on every rank and added after the all-reduce.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The weight split by rows.
    pub split: Split<B>,
    #[module(skip)]
    group: Group,
    #[module(skip)]
    overlap: TpOverlap,
    #[module(skip)]
    sequence_parallel: bool,
}

impl<B: ParallelBackend> RowParallelLinear<B> {
    /// Builds this rank's shard from the full-size weight (`[d_input, d_output]`) and bias.
    pub fn from_full(
        weight: &[f32],
        bias: Option<&[f32]>,
        d_input: usize,
        d_output: usize,
        group: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        check_full("row-parallel weight", d_input * d_output, weight.len())?;
        check_divisible("input features", d_input, group.size())?;
        if let Some(b) = bias {
            check_full("row-parallel bias", d_output, b.len())?;
        }
        let shard = shard_of(group);
        let w = param2(
            shard.rows(weight, d_input, d_output),
            [d_input / group.size(), d_output],
            device,
        );
        Ok(Self {
            split: Split::new(group, [("linear.weight", ShardKind::Rows)]),
            linear: Linear {
                weight: w,
                bias: None,
            },
            bias: bias.map(|b| param1(b.to_vec(), device)),
            group,
            overlap: TpOverlap::default(),
            sequence_parallel: false,
        })
    }

    /// Sequence parallelism on (or off): the partial products are reduce-scattered along the
    /// sequence (*g*), each rank keeping its slice, `[batch, seq / tp, d_output]`; the bias is
    /// added to the slice and its gradient summed over the group.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// Sub-pipelines the layer: its all-reduce is cut into `overlap` token chunks
    /// ([`overlap`]).
    pub fn set_overlap(&mut self, overlap: TpOverlap) {
        self.overlap = overlap;
    }

    /// `[..., d_input / tp] -> [..., d_output]` (`[batch, seq / tp, d_output]` under sequence
    /// parallelism).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.sequence_parallel && self.group.size() > 1 {
            let w = autocast(self.linear.weight.val());
            let y = sequence_product(B::sp_row_linear, x, w, self.overlap, self.group);
            return add_bias(y, self.bias.as_ref(), Some(self.group));
        }
        let y = if self.overlap.is_serial() || self.group.size() == 1 {
            reduce_from_tp(linear_rows(x, &self.linear, true), self.group)
        } else {
            on_rows(x, |x| {
                let chunks = self.overlap.chunks_for(x.dims()[0]);
                overlap::row_linear(x, autocast(self.linear.weight.val()), chunks, self.group)
            })
        };
        add_bias(y, self.bias.as_ref(), None)
    }
}

/// `y + b`, the bias broadcast over every leading dimension; with `sequence_parallel`, the
/// bias read through [`sp_param`] (its gradient summed over that group).
fn add_bias<B: ParallelBackend, const D: usize>(
    y: Tensor<B, D>,
    bias: Option<&Param<Tensor<B, 1>>>,
    sequence_parallel: Option<Group>,
) -> Tensor<B, D> {
    match bias {
        Some(b) => y + autocast(sp_param(b.val(), sequence_parallel)).unsqueeze(),
        None => y,
    }
}

/// A sequence-parallel product `op` ([`ParallelBackend::sp_row_linear`] or
/// [`ParallelBackend::sp_column_linear`]) of `x: [batch, seq, features]` and `w`, its collectives cut
/// into the chunks of `overlap`.
fn sequence_product<B: ParallelBackend, const D: usize>(
    op: fn(FloatTensor<B>, FloatTensor<B>, usize, Group) -> FloatTensor<B>,
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    overlap: TpOverlap,
    group: Group,
) -> Tensor<B, D> {
    assert_eq!(
        D, 3,
        "sequence parallelism acts on [batch, seq, features] tensors"
    );
    let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
    let y = op(x, w, overlap.chunks(), group);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// `f` applied to `x` with its leading dimensions folded into rows (`[rows, features]`), the
/// result unfolded again.
fn on_rows<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    f: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    let y = f(x.reshape([rows, dims[D - 1]]));
    let mut out = dims;
    out[D - 1] = y.dims()[1];
    y.reshape(out)
}
