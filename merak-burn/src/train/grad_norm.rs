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
use crate::kernels::FusedOps;
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
#[derive(Clone, Copy)]
enum Part {
    Sharded,
    Replicated,
    Expert,
}

/// Gathers each counted gradient with its part; the squares are summed afterwards in one call
/// ([`FusedOps::sums_of_squares`]: on a GPU, one read of the device for all of them).
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
    /// The squares of the gathered gradients, added to their parts in the order visited.
    fn stats(self) -> GradStats {
        let mut stats = GradStats::default();
        let sums = B::InnerBackend::sums_of_squares(self.tensors);
        for (part, sq) in self.parts.into_iter().zip(sums) {
            match part {
                Part::Expert => stats.expert_sq += sq,
                Part::Sharded => stats.sharded_sq += sq,
                Part::Replicated => stats.replicated_sq += sq,
            }
        }
        stats
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
    norm_of(
        local_squares::<B, _>(module, grads, (sharded, experts), skip),
        groups,
    )
}

/// This rank's squared gradient norms by part (see [`global_grad_norm`]), before any sum over
/// the ranks.
pub(crate) fn local_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    (sharded, experts): (&HashSet<ParamId>, &HashSet<ParamId>),
    skip: &HashSet<ParamId>,
) -> GradStats
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
    v.stats()
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
