//! ZeRO-3 ([`ShardedParams`]): as ZeRO-2, and each data-parallel rank keeps only its chunks of
//! the parameter values too (its model's parameters are empty). The executor gathers each
//! unit's parameters from the shards before running it (again for its backward pass when
//! resharding after the forward), or the whole model is gathered once a step and kept to the
//! update; each rank steps its pieces and keeps the new values as its shards.

use std::collections::HashMap;

use crate::checkpoint::state::{self, ParamShape};
use crate::checkpoint::{Moments, RankState};
use crate::data_parallel::{DataParallel, DpStats, Shards};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::TrainError;
use crate::train::grad_norm::LocalSquares;
use crate::train::optim::Optimizers;
use crate::train::zero3::chunks_by_name;

use super::chunks::Chunks;
use super::{GradSync, NormParts};

/// ZeRO-3: this rank's chunks of the parameters and of their optimizer state.
pub(crate) struct ShardedParams<'g, B: TrainBackend> {
    chunks: Chunks<'g, B>,
    /// This rank's shards of the parameter values.
    shards: Shards,
    /// Whether each unit's parameters are gathered for its pass and freed after it (false:
    /// the whole model gathered once a step and kept to the update).
    reshard_after_forward: bool,
}

impl<'g, B: TrainBackend> ShardedParams<'g, B> {
    /// Stepping the chunks `chunks` holds, the values in `shards`.
    pub fn new(chunks: Chunks<'g, B>, shards: Shards, reshard_after_forward: bool) -> Self {
        Self {
            chunks,
            shards,
            reshard_after_forward,
        }
    }
}

impl<B: TrainBackend, M: TrainModel<B>> GradSync<B, M> for ShardedParams<'_, B> {
    fn reducer(&self) -> &DataParallel {
        &self.chunks.reducer
    }

    fn shards(&self) -> Option<&Shards> {
        Some(&self.shards)
    }

    fn step_model(&self, model: &M) -> Result<Option<M>, TrainError> {
        match self.reshard_after_forward {
            true => Ok(None),
            // This step's parameters gathered once, kept to the update.
            false => GradSync::<B, M>::gathered_model(self, model).map(Some),
        }
    }

    fn begin_step(&mut self) {
        self.chunks.begin_step();
    }

    fn finish(&mut self, _model: &M) -> Result<DpStats, TrainError> {
        self.chunks.finish()
    }

    fn squares(
        &self,
        _model: &M,
        parts: &NormParts,
    ) -> Result<LocalSquares<B::InnerBackend>, TrainError> {
        self.chunks.squares(parts)
    }

    fn scale(&mut self, _model: &M, scale: f32) {
        self.chunks.scale(scale);
    }

    fn apply(&mut self, model: M, lr: f64, optim: &mut Optimizers<M, B>) -> Result<M, TrainError> {
        // This rank's own values are its chunks.
        let mine = self.chunks.step(self.shards.own(), true, lr, optim)?;
        self.shards.set_own(mine);
        Ok(model)
    }

    fn param_shapes(&self, _model: &M) -> Vec<ParamShape> {
        self.chunks.params.clone()
    }

    fn gathered_model(&self, model: &M) -> Result<M, TrainError> {
        let s = &self.shards;
        Ok(s.fill(model.clone(), s.gathered_all()?))
    }

    fn resume(
        &mut self,
        model: M,
        shapes: &[ParamShape],
        params: HashMap<String, Vec<f32>>,
        moments: &HashMap<String, Moments>,
        _optim: &mut Optimizers<M, B>,
    ) -> Result<M, TrainError> {
        // The checkpoint's values go straight into this rank's chunks: no gathered model.
        let own = chunks_by_name(self.shards.rank_chunks(), shapes, params)?;
        self.shards.set_own(own);
        self.chunks.load(moments);
        Ok(model)
    }

    fn rank_state(&self, model: &M, _optim: &Optimizers<M, B>) -> Result<RankState, TrainError> {
        let pieces = (self.chunks).pieces_to_write(Some(self.shards.own()))?;
        // The model's parameters are empty; their values travel as pieces.
        let shapes: HashMap<&str, &[usize]> = (self.chunks.params.iter())
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        let mut params = state::local_params(model)?;
        for p in &mut params {
            p.shape = shapes
                .get(p.name.as_str())
                .map(|s| s.to_vec())
                .unwrap_or_default();
            p.values.clear();
        }
        Ok(RankState {
            params,
            moments: Vec::new(),
            pieces,
        })
    }

    fn stored_params(&self) -> Option<u64> {
        Some(self.shards.stored_elements() as u64)
    }

    fn stepped_elements(&self) -> Option<u64> {
        Some(self.chunks.rank_chunks.held() as u64)
    }
}
