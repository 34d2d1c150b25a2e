//! The gradient norm across all shards of a model.
//!
//! Parameters inside tensor-parallel layers are shards: each TP rank holds a different piece, so
//! their squared norms are summed over the TP group. Replicated parameters (LayerNorms, position
//! embeddings, row-parallel biases) are identical on every TP rank and counted once.

use std::collections::HashSet;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, backend::AutodiffBackend};

use crate::comm::{CommError, Group};
use crate::kernels::{FusedOps, Squares};
use crate::tensor_parallel::ParamSplits;

/// The ids of the parameters of `module` that the tensor-parallel layers split across the TP
/// group, as its layers declare them ([`ParamSplits`]).
pub fn sharded_param_ids<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
) -> HashSet<ParamId> {
    ParamSplits::of(module).sharded_ids()
}

/// Squared gradient norms of one rank, split into sharded and replicated parts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradStats {
    /// Sum of squares over sharded parameters (this rank's shards only).
    pub sharded_sq: f64,
    /// Sum of squares over replicated parameters.
    pub replicated_sq: f64,
    /// Sum of squares over this rank's routed experts (the expert-parallel ranks hold
    /// different ones; each is the same on every TP rank).
    pub expert_sq: f64,
}

/// Which part of [`GradStats`] a gradient's squares add to.
#[derive(Clone, Copy, Debug)]
enum Part {
    Sharded,
    Replicated,
    Expert,
}

/// Gathers each counted gradient with its part; the squares are summed afterwards in one call
/// ([`FusedOps::squares_of`]: on a GPU, left there for the step's one read with its losses).
struct NormVisitor<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    sharded: &'a HashSet<ParamId>,
    experts: &'a HashSet<ParamId>,
    skip: &'a HashSet<ParamId>,
    parts: Vec<Part>,
    tensors: Vec<FloatTensor<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for NormVisitor<'_, B>
where
    B::InnerBackend: FusedOps,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.skip.contains(&param.id) {
            return;
        }
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let part = if self.experts.contains(&param.id) {
                Part::Expert
            } else if self.sharded.contains(&param.id) {
                Part::Sharded
            } else {
                Part::Replicated
            };
            self.parts.push(part);
            self.tensors.push(g.into_primitive().tensor());
        }
    }
}

impl<B: AutodiffBackend> NormVisitor<'_, B>
where
    B::InnerBackend: FusedOps,
{
    /// The squares of the gathered gradients, as far as they are computed without a read.
    fn squares(self) -> LocalSquares<B::InnerBackend> {
        LocalSquares {
            squares: B::InnerBackend::squares_of(self.tensors),
            parts: self.parts,
        }
    }
}

/// This rank's squared gradient norms by part ([`GradStats`]), perhaps still on the device:
/// the trainer reads them with the step's losses, in one read.
#[derive(Clone, Debug)]
pub(crate) struct LocalSquares<C: burn::tensor::backend::Backend> {
    squares: Squares<C>,
    /// The part each sum adds to, in order.
    parts: Vec<Part>,
}

impl<C: burn::tensor::backend::Backend> LocalSquares<C> {
    /// Squares already known on the host.
    pub(crate) fn known(stats: GradStats) -> Self {
        let sums = vec![stats.sharded_sq, stats.replicated_sq, stats.expert_sq];
        Self {
            squares: Squares::Host(sums),
            parts: vec![Part::Sharded, Part::Replicated, Part::Expert],
        }
    }

    /// The values to read from the device, if any ([`Squares::values`]).
    pub(crate) fn values(&self) -> Option<Tensor<C, 1>> {
        self.squares.values()
    }

    /// The squares by part, given `read`, the host values of [`values`](Self::values): added
    /// to their parts in the order the gradients were visited.
    pub(crate) fn settle(&self, read: &[f32]) -> GradStats {
        let mut stats = GradStats::default();
        for (part, sq) in self.parts.iter().zip(self.squares.settle(read)) {
            match part {
                Part::Expert => stats.expert_sq += sq,
                Part::Sharded => stats.sharded_sq += sq,
                Part::Replicated => stats.replicated_sq += sq,
            }
        }
        stats
    }

    /// The squares by part, read from the device when they are there (one read).
    pub(crate) fn read(&self) -> Result<GradStats, crate::host_read::ReadError> {
        let [read] = crate::host_read::together([self.values()])?;
        Ok(self.settle(&read))
    }
}

/// The groups a gradient norm adds its parts over.
#[derive(Clone, Copy, Debug)]
pub struct NormGroups {
    /// The tensor-parallel group: the sharded parameters' squares are summed over it.
    pub tp: Group,
    /// The pipeline group: the stages' sums are added over it.
    pub pp: Group,
    /// The expert-parallel group: the routed experts' squares are summed over it.
    pub ep: Group,
}

/// The L2 norm of all gradients of the model across its TP shards, expert-parallel ranks and
/// pipeline stages: sharded squares are summed over `groups.tp`, the routed experts' (in
/// `experts`) over `groups.ep`, replicated ones counted once, and the stages' sums added over
/// `groups.pp`; parameters in `skip` (a tied copy whose twin is counted on another stage) are
/// left out. Every rank of those groups gets the same value.
pub fn global_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    (sharded, experts): (&HashSet<ParamId>, &HashSet<ParamId>),
    groups: NormGroups,
    skip: &HashSet<ParamId>,
) -> Result<f64, CommError>
where
    B::InnerBackend: FusedOps,
{
    let squares = local_squares::<B, _>(module, grads, (sharded, experts), skip);
    let stats = squares.read().map_err(|e| CommError::TensorRead(e.0))?;
    norm_of(stats, groups)
}

/// This rank's squared gradient norms by part (see [`global_grad_norm`]), before any sum over
/// the ranks, perhaps still on the device.
pub(crate) fn local_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    (sharded, experts): (&HashSet<ParamId>, &HashSet<ParamId>),
    skip: &HashSet<ParamId>,
) -> LocalSquares<B::InnerBackend>
where
    B::InnerBackend: FusedOps,
{
    let mut v = NormVisitor::<B> {
        grads,
        sharded,
        experts,
        skip,
        parts: Vec::new(),
        tensors: Vec::new(),
    };
    module.visit(&mut v);
    v.squares()
}

/// The global norm of one rank's squared gradient norms `stats`: the sharded part summed over
/// `tp`, the experts' over `ep`, the replicated part counted once, the stages' sums added over
/// `pp`.
pub(crate) fn norm_of(stats: GradStats, groups: NormGroups) -> Result<f64, CommError> {
    let NormGroups { tp, pp, ep } = groups;
    let mut experts = [stats.expert_sq as f32];
    if ep.size() > 1 {
        ep.comm()?
            .all_reduce(&mut experts, crate::comm::ReduceOp::Sum)?;
    }
    let stats = GradStats {
        replicated_sq: stats.replicated_sq + f64::from(experts[0]),
        ..stats
    };
    let mut buf = [stats.sharded_sq as f32];
    if tp.size() > 1 {
        tp.comm()?
            .all_reduce(&mut buf, crate::comm::ReduceOp::Sum)?;
    }
    let mut stage = [(f64::from(buf[0]) + stats.replicated_sq) as f32];
    if pp.size() > 1 {
        pp.comm()?
            .all_reduce(&mut stage, crate::comm::ReduceOp::Sum)?;
        return Ok(f64::from(stage[0]).sqrt());
    }
    Ok((f64::from(buf[0]) + stats.replicated_sq).sqrt())
}

struct ScaleVisitor<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    scale: f32,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ScaleVisitor<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g * self.scale);
        }
    }
}

/// Scales every gradient by `max_norm / norm` when `norm > max_norm` (clipping by the global
/// norm); returns the factor applied (1 when nothing was clipped).
pub fn clip_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    norm: f64,
    max_norm: f64,
) -> f64 {
    if max_norm <= 0.0 || norm <= max_norm || !norm.is_finite() {
        return 1.0;
    }
    let scale = max_norm / (norm + 1e-6);
    scale_grads::<B, _>(module, grads, scale as f32);
    scale
}

/// Multiplies every gradient of `module`'s parameters in `grads` by `scale`.
pub(crate) fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    scale: f32,
) {
    let mut v = ScaleVisitor::<B> {
        grads,
        scale,
        _b: std::marker::PhantomData,
    };
    module.visit(&mut v);
}
