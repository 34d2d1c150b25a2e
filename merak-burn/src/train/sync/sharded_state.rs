//! ZeRO-1 and 2 ([`ShardedState`], hybrid sharding too): every data-parallel rank holds every
//! parameter but steps only its chunk of each gradient bucket, with the optimizer state of
//! that chunk; the buckets are all-reduced and cut (ZeRO-1) or reduce-scattered (ZeRO-2, once
//! a step or every micro-batch), and the new values all-gathered into every rank's model.

use std::collections::HashMap;

use crate::checkpoint::state::{self, ParamShape};
use crate::checkpoint::{Moments, RankState};
use crate::data_parallel::{DataParallel, DpStats};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::TrainError;
use crate::train::grad_norm::LocalSquares;
use crate::train::optim::Optimizers;

use super::chunks::{Chunks, read_params};
use super::{GradSync, NormParts};

/// ZeRO-1 and 2: whole parameters, this rank's chunks of the optimizer state.
pub(crate) struct ShardedState<'g, B: TrainBackend> {
    chunks: Chunks<'g, B>,
}

impl<'g, B: TrainBackend> ShardedState<'g, B> {
    /// Stepping the chunks `chunks` holds.
    pub fn new(chunks: Chunks<'g, B>) -> Self {
        Self { chunks }
    }
}

impl<B: TrainBackend, M: TrainModel<B>> GradSync<B, M> for ShardedState<'_, B> {
    fn reducer(&self) -> &DataParallel {
        &self.chunks.reducer
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
        let values = read_params(&model)?;
        let mine = self.chunks.step(&values, false, lr, optim)?;
        drop(values);
        self.chunks.gather_into(model, mine)
    }

    fn param_shapes(&self, _model: &M) -> Vec<ParamShape> {
        self.chunks.params.clone()
    }

    fn resume(
        &mut self,
        model: M,
        _shapes: &[ParamShape],
        params: HashMap<String, Vec<f32>>,
        moments: &HashMap<String, Moments>,
        _optim: &mut Optimizers<M, B>,
    ) -> Result<M, TrainError> {
        let model = state::assign_params(model, params)?;
        self.chunks.load(moments);
        Ok(model)
    }

    fn rank_state(&self, model: &M, _optim: &Optimizers<M, B>) -> Result<RankState, TrainError> {
        Ok(RankState {
            pieces: self.chunks.pieces_to_write(None)?,
            params: state::local_params(model)?,
            moments: Vec::new(),
        })
    }

    fn stepped_elements(&self) -> Option<u64> {
        Some(self.chunks.rank_chunks.held() as u64)
    }
}
