//! A BERT trains through [`merak_burn::run`]: it plans its run from its transformer shape and
//! builds each rank's part with its own fused tensor-parallel layers.

use merak_burn::entry::{OwnLayers, PartPlace, PlanRequest, RunError, RunModel, RunPlan};
use merak_burn::pipeline::TrainBackend;
use merak_burn::tensor_parallel::TpOverlap;

use crate::{Bert, BertConfig};

impl<B: TrainBackend> RunModel<B, OwnLayers> for BertConfig {
    type Part = Bert<B>;

    /// The plan given, or the planner's for the BERT's shape; the pipeline cut by the shape's
    /// costs. An encoder has no experts: `parallel.ep > 1` is refused.
    fn plan_run(&self, request: &PlanRequest<'_, B>) -> Result<RunPlan, RunError> {
        let planned = request.plan_of_shape(&self.shape())?;
        match planned.plan.ep {
            1 => Ok(planned),
            ep => Err(RunError::ExpertParallel {
                ep,
                reason: "a BERT has no mixtures of experts; set parallel.ep = 1".into(),
            }),
        }
    }

    /// The layers, embeddings and head this rank holds, split over its tensor-parallel group
    /// (sub-pipelined over `parallel.tp_overlap` chunks), its sequences over its
    /// context-parallel group, and with sequence parallelism as the plan says.
    fn build_part(&self, at: &PartPlace<'_, B>) -> Result<Bert<B>, RunError> {
        let grid = at.grid;
        let holds = |unit: usize| at.holds(unit);
        let overlap = TpOverlap::new(at.plan.tp_overlap)?;
        Ok(Bert::new_units(self, at.seed, grid.tp, at.device, &holds)?
            .with_tp_overlap(overlap)
            .with_context_parallel(grid.cp, at.plan.cp_attention)?
            .with_sequence_parallel(at.plan.sequence_parallel))
    }

    /// A BERT has no experts; its grid is grouped as a GPT's (as `merak train` has always
    /// built it).
    fn experts_across_tp(&self) -> bool {
        true
    }
}
