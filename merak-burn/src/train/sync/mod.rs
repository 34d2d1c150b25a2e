//! Gradient synchronisation over the data-parallel ranks as a strategy ([`GradSync`]): what a
//! step does with its gradients from the executor's hooks to the optimizer's update, one
//! implementation per kind of data parallelism:
//!
//! - [`Replicated`] (ZeRO off): every rank holds every parameter and its optimizer state; the
//!   buckets are all-reduced whole (from host or device buffers) and every rank steps every
//!   parameter.
//! - [`ShardedState`] (ZeRO-1 and 2, hybrid sharding too): every rank holds every parameter
//!   but steps only its chunk of each bucket, with the optimizer state of that chunk; the
//!   buckets are all-reduced and cut (1) or reduce-scattered (2, once a step or every
//!   micro-batch), and the new values all-gathered.
//! - [`ShardedParams`] (ZeRO-3): as [`ShardedState`], and a rank keeps only its chunks of the
//!   parameter values too (the executor gathers a unit's before running it).
//!
//! The trainer runs one step the same way for all of them: [`begin_step`](GradSync::begin_step),
//! the executor's passes on [`step_model`](GradSync::step_model) hooked into
//! [`reducer`](GradSync::reducer), [`finish`](GradSync::finish), one
//! [`grad_norm`](GradSync::grad_norm) and [`clip`](GradSync::clip), then
//! [`apply`](GradSync::apply).
//!
//! Names: ZeRO cuts each gradient bucket into one *chunk* per rank of the shard group; a
//! parameter's part of a chunk is a *piece* ([`RankChunks`](crate::data_parallel::chunks::RankChunks)).

mod build;
mod chunks;
mod replicated;
mod sharded_params;
mod sharded_state;

use std::collections::HashSet;

use burn::module::ParamId;

use crate::checkpoint::state::ParamShape;
use crate::checkpoint::{Moments, RankState};
use crate::data_parallel::{DataParallel, DpStats, Shards};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::grad_norm::LocalSquares;
use crate::train::optim::Optimizers;
use crate::train::{GradStats, NormGroups, TrainError};

pub(crate) use build::build;
pub(crate) use replicated::Replicated;
pub(crate) use sharded_params::ShardedParams;
pub(crate) use sharded_state::ShardedState;

/// The global gradient norm of a step, before clipping, on the host: this rank's squares are
/// read with the step's losses (one read), and the norm's collectives add them there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GradNorm {
    value: f64,
}

impl GradNorm {
    /// The global norm of one rank's squares `stats` ([`norm_of`](crate::train::grad_norm::norm_of)).
    pub fn of(stats: GradStats, groups: NormGroups) -> Result<Self, TrainError> {
        let value = crate::train::grad_norm::norm_of(stats, groups)?;
        Ok(Self { value })
    }

    /// The norm's value.
    pub fn to_f64(self) -> f64 {
        self.value
    }

    /// The factor the gradients are scaled by to clip them at `max` (`None`: no clipping, when
    /// `max` is 0, the norm is within it or is not finite).
    pub fn clip_scale(self, max: f64) -> Option<f32> {
        let norm = self.value;
        (max > 0.0 && norm > max && norm.is_finite()).then(|| (max / (norm + 1e-6)) as f32)
    }
}

/// Which gradients a norm adds where: the parameters split over the tensor-parallel ranks,
/// the routed experts', and those left out (the head's copy of a tied embedding, counted on
/// the embedding's rank only), and the groups the parts are summed over.
pub(crate) struct NormParts {
    /// The tensor-parallel layers' split parameters.
    pub sharded: HashSet<ParamId>,
    /// The routed experts' parameters (under a mixture of experts).
    pub experts: HashSet<ParamId>,
    /// Parameters not counted on this rank.
    pub not_counted: HashSet<ParamId>,
    /// The groups the parts are summed over.
    pub groups: NormGroups,
}

/// What a rank of one kind of data parallelism holds and does with a step's gradients (see
/// the module docs). Every rank of the grid calls the same methods in the same order.
pub(crate) trait GradSync<B: TrainBackend, M: TrainModel<B>> {
    /// The reducer whose gradient hooks the executor puts on the model.
    fn reducer(&self) -> &DataParallel;

    /// ZeRO-3's shards of the parameter values, from which the executor gathers each unit
    /// (`None` for the other kinds).
    fn shards(&self) -> Option<&Shards> {
        None
    }

    /// Starts a step: clears the reducer's buffers (and the gradients a skipped step left).
    fn begin_step(&mut self) {
        self.reducer().begin_step();
    }

    /// The model the step's passes run on, when it is not `model`: ZeRO-3 keeping the
    /// parameters gathered through the step. The executor then gets no shards.
    fn step_model(&self, _model: &M) -> Result<Option<M>, TrainError> {
        Ok(None)
    }

    /// Waits for the step's reduction and keeps the gradients for the update (the two copies
    /// of a tied embedding summed); the reduction's statistics.
    fn finish(&mut self, model: &M) -> Result<DpStats, TrainError>;

    /// This rank's squared gradient norms by part ([`GradStats`]), summed over the ranks that
    /// hold other chunks of the same gradients; left on the device where they are computed
    /// there, for the step's one read (with its losses).
    fn squares(
        &self,
        model: &M,
        parts: &NormParts,
    ) -> Result<LocalSquares<B::InnerBackend>, TrainError>;

    /// Scales the step's gradients by `scale`.
    fn scale(&mut self, model: &M, scale: f32);

    /// Clips the step's gradients at the global norm `max` ([`GradNorm::clip_scale`]).
    fn clip(&mut self, model: &M, norm: GradNorm, max: f64) {
        if let Some(scale) = norm.clip_scale(max) {
            self.scale(model, scale);
        }
    }

    /// The optimizer's step at `lr` on the step's gradients: `model` with the new values
    /// (under ZeRO-3, `model` itself; the new values are this rank's shards).
    fn apply(&mut self, model: M, lr: f64, optim: &mut Optimizers<M, B>) -> Result<M, TrainError>;

    /// Every parameter's name, id and full local shape, in visit order (under ZeRO-3 as the
    /// shards know them: the model's are empty).
    fn param_shapes(&self, model: &M) -> Vec<ParamShape>;

    /// `model` with every parameter's values (under ZeRO-3 gathered from every rank's shards:
    /// every rank of the shard group must call it).
    fn gathered_model(&self, model: &M) -> Result<M, TrainError> {
        Ok(model.clone())
    }

    /// Loads a checkpoint's parameters (`params`, by name, cut for this rank's
    /// tensor-parallel shard; `shapes` as [`param_shapes`](Self::param_shapes) gives them) and
    /// moments into this rank's state and `optim`; returns the model with them.
    fn resume(
        &mut self,
        model: M,
        shapes: &[ParamShape],
        params: std::collections::HashMap<String, Vec<f32>>,
        moments: &std::collections::HashMap<String, Moments>,
        optim: &mut Optimizers<M, B>,
    ) -> Result<M, TrainError>;

    /// What this rank writes into a checkpoint: its parameters, and the moments of its
    /// optimizer state (whole tensors) or its chunks of them (and of the parameters under
    /// ZeRO-3).
    fn rank_state(&self, model: &M, optim: &Optimizers<M, B>) -> Result<RankState, TrainError>;

    /// The parameter values this rank stores when not the model's (ZeRO-3's shards).
    fn stored_params(&self) -> Option<u64> {
        None
    }

    /// The parameter values whose optimizer state this rank keeps when not every parameter's
    /// (ZeRO's chunks).
    fn stepped_elements(&self) -> Option<u64> {
        None
    }
}
