//! A GPT trains through [`merak_burn::run`]: it plans its run from its transformer shape and
//! builds each rank's part with its own fused tensor-parallel layers.

use merak_burn::entry::{OwnLayers, PartPlace, PlanRequest, RunError, RunModel, RunPlan};
use merak_burn::pipeline::TrainBackend;
use merak_burn::tensor_parallel::TpOverlap;

use crate::{Gpt, GptConfig};

impl<B: TrainBackend> RunModel<B, OwnLayers> for GptConfig {
    type Part = Gpt<B>;

    /// The plan given, or the planner's for the GPT's shape; the pipeline cut by the shape's
    /// costs. A mixture of experts is checked against `parallel.ep`.
    fn plan_run(&self, request: &PlanRequest<'_, B>) -> Result<RunPlan, RunError> {
        let planned = request.plan_of_shape(&self.shape())?;
        let ep = planned.plan.ep;
        if let Some(moe) = self.moe.as_ref().filter(|_| ep > 1) {
            moe.check_ep(ep).map_err(|e| RunError::ExpertParallel {
                ep,
                reason: e.to_string(),
            })?;
        }
        Ok(planned)
    }

    /// The blocks, embeddings and head this rank holds, split over its tensor-parallel group
    /// (sub-pipelined over `parallel.tp_overlap` chunks), its experts over its expert-parallel
    /// group, its sequences over its context-parallel group, and with sequence parallelism
    /// as the plan says.
    fn build_part(&self, at: &PartPlace<'_, B>) -> Result<Gpt<B>, RunError> {
        let grid = at.grid;
        let holds = |unit: usize| at.holds(unit);
        let overlap = TpOverlap::new(at.plan.tp_overlap)?;
        Ok(
            Gpt::new_expert_parallel(self, at.seed, grid.tp, grid.ep, at.device, &holds)?
                .with_tp_overlap(overlap)
                .with_context_parallel(grid.cp, at.plan.cp_attention)?
                .with_sequence_parallel(at.plan.sequence_parallel),
        )
    }

    /// A GPT's mixture of experts splits each micro-batch's tokens over the tensor-parallel
    /// ranks, so they sum an expert's gradient with the data-parallel ones.
    fn experts_across_tp(&self) -> bool {
        true
    }
}
