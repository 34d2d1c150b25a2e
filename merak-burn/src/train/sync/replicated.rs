//! ZeRO off ([`Replicated`]): every data-parallel rank holds every parameter and its optimizer
//! state; the gradient buckets are all-reduced whole (from host buffers during the backward
//! pass, or held on the device and all-reduced after it) and every rank steps every parameter.

use std::collections::HashMap;

use burn::module::ParamId;
use burn::optim::GradientsParams;

use crate::checkpoint::state::{self, ParamShape};
use crate::checkpoint::{Moments, RankState};
use crate::data_parallel::{DataParallel, DpStats};
use crate::grid::ProcessGrid;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::grad_norm::{LocalSquares, local_squares, scale_grads};
use crate::train::optim::Optimizers;
use crate::train::{TrainError, sum_tied_grads};

use super::{GradSync, NormParts};

/// ZeRO off: whole gradients, whole optimizer state on every rank.
pub(crate) struct Replicated<'g, B: TrainBackend> {
    reducer: DataParallel,
    grid: &'g ProcessGrid,
    /// This rank's copy of a tied embedding.
    tied: Option<ParamId>,
    device: B::Device,
    /// The step's gradients, summed over the micro-batches and the ranks (after
    /// [`finish`](GradSync::finish)).
    grads: GradientsParams,
}

impl<'g, B: TrainBackend> Replicated<'g, B> {
    /// All-reducing with `reducer` (reading whole gradients).
    pub fn new(
        reducer: DataParallel,
        grid: &'g ProcessGrid,
        tied: Option<ParamId>,
        device: B::Device,
    ) -> Self {
        Self {
            reducer,
            grid,
            tied,
            device,
            grads: GradientsParams::new(),
        }
    }
}

impl<B: TrainBackend, M: TrainModel<B>> GradSync<B, M> for Replicated<'_, B> {
    fn reducer(&self) -> &DataParallel {
        &self.reducer
    }

    fn begin_step(&mut self) {
        // The last step's gradients, kept when that step was skipped.
        self.grads = GradientsParams::new();
        self.reducer.begin_step();
    }

    fn finish(&mut self, model: &M) -> Result<DpStats, TrainError> {
        let (mut grads, dp) = self.reducer.finish::<B, _>(model)?;
        sum_tied_grads::<B>(&mut grads, self.grid, self.tied, &self.device)?;
        self.grads = grads;
        Ok(dp)
    }

    fn squares(
        &self,
        model: &M,
        parts: &NormParts,
    ) -> Result<LocalSquares<B::InnerBackend>, TrainError> {
        let (sharded, experts) = (&parts.sharded, &parts.experts);
        Ok(local_squares::<B, _>(
            model,
            &self.grads,
            (sharded, experts),
            &parts.not_counted,
        ))
    }

    fn scale(&mut self, model: &M, scale: f32) {
        scale_grads::<B, _>(model, &mut self.grads, scale);
    }

    fn apply(&mut self, model: M, lr: f64, optim: &mut Optimizers<M, B>) -> Result<M, TrainError> {
        let grads = std::mem::replace(&mut self.grads, GradientsParams::new());
        let groups = optim.split(&model, grads);
        Ok(optim.step(lr, model, groups))
    }

    fn param_shapes(&self, model: &M) -> Vec<ParamShape> {
        state::param_shapes(model)
    }

    fn resume(
        &mut self,
        model: M,
        _shapes: &[ParamShape],
        params: HashMap<String, Vec<f32>>,
        moments: &HashMap<String, Moments>,
        optim: &mut Optimizers<M, B>,
    ) -> Result<M, TrainError> {
        let model = state::assign_params(model, params)?;
        optim.load(&model, moments);
        Ok(model)
    }

    fn rank_state(&self, model: &M, optim: &Optimizers<M, B>) -> Result<RankState, TrainError> {
        // Every data-parallel copy holds the same state: the first one writes it, and the
        // first expert-parallel group's other ranks write their experts' state.
        let mut moments = Vec::new();
        let grid = self.grid;
        if grid.coords.dp < grid.ep.size() {
            moments = optim.moments(model)?;
            if grid.coords.dp != 0 {
                moments.retain(|(name, _)| crate::moe::is_expert_param(name));
            }
        }
        Ok(RankState {
            params: state::local_params(model)?,
            moments,
            pieces: Vec::new(),
        })
    }
}
