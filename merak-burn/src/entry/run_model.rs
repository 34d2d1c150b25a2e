//! What [`merak_burn::run`](crate::run) trains: a model that plans its run and builds each
//! rank's part of it ([`RunModel`]). Every [`UnitModel`] is one: the library builds its units,
//! splits them for tensor parallelism and wraps them for sequence and context parallelism. A
//! model that builds its own parallel layers (GPT and BERT, with their fused tensor-parallel
//! layers) implements it itself, and trains through the same door.

use burn::tensor::backend::Backend;

use super::{PlanChoice, RunError, UnitModel, UnitPlace, UnitsOf, build_units_on};
use super::{choose, experts, sequence};
use crate::comm::Communicator;
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::parallelize::shard_module;
use crate::pipeline::{PipelinePlan, TrainBackend, TrainModel};
use crate::planner::{HardwareSpec, ModelProxy, SearchOptions, TransformerShape, search};
use crate::train::{BatchSource, TrainSettings};

/// What a run asks a model to plan ([`RunModel::plan_run`]).
pub struct PlanRequest<'a, B: Backend> {
    /// How the plan is chosen: given, or the planner's.
    pub choice: &'a PlanChoice,
    /// The run's settings (global batch, sequence length, seed).
    pub settings: &'a TrainSettings,
    /// The run's data (a model that times its units reads a sample micro-batch).
    pub data: &'a dyn BatchSource,
    /// Every launched rank (`None`: one process); every rank must plan the same.
    pub world: Option<&'a dyn Communicator>,
    /// The device the units would be timed on.
    pub device: &'a B::Device,
}

impl<B: Backend> PlanRequest<'_, B> {
    /// The number of launched ranks.
    pub fn ranks(&self) -> usize {
        self.world.map_or(1, |w| w.size())
    }

    /// The plan of a transformer of shape `shape` (its sequences `shape.seq` positions): the
    /// plan given, or the planner's search on the shape's analytic costs
    /// ([`PlanChoice::Auto`]'s hardware); the pipeline cut by the shape's costs.
    pub fn plan_of_shape(&self, shape: &TransformerShape) -> Result<RunPlan, RunError> {
        let global_batch = self.settings.global_batch;
        let plan = match self.choice {
            PlanChoice::Given(plan) => plan.clone(),
            PlanChoice::Auto(auto) => {
                let ranks = self.ranks();
                let hardware = HardwareSpec::load(&auto.hardware)?.with_devices(ranks);
                let options = SearchOptions {
                    optimizer: self.settings.optimizer.cost(),
                    ..SearchOptions::new(ranks, global_batch)
                };
                let best = search(&ModelProxy::from_shape(*shape), &hardware, &options)?;
                ParallelPlan::from_planned(&best.best.layout)
            }
        };
        choose::check_batch(self.settings, plan.dp, plan.micro_batch)?;
        let pipeline = plan.pipeline(shape, global_batch)?;
        Ok(RunPlan::new(plan, pipeline, shape.seq))
    }
}

/// A run's plan as the model decided it ([`RunModel::plan_run`]).
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// The plan, with the pipeline's stages as cut (`stage_units`).
    pub plan: ParallelPlan,
    /// The pipeline: schedule, stages, recomputation.
    pub pipeline: PipelinePlan,
    /// Positions per sample of the hidden states between units (the sequence length the
    /// messages between stages are sized by).
    pub positions: usize,
}

impl RunPlan {
    /// `plan` cut as `pipeline` says, with `positions` per sample between units.
    pub fn new(plan: ParallelPlan, pipeline: PipelinePlan, positions: usize) -> Self {
        let plan = ParallelPlan {
            stage_units: pipeline.partition.sizes(),
            ..plan
        };
        Self {
            plan,
            pipeline,
            positions,
        }
    }
}

/// Where a rank's part is built ([`RunModel::build_part`]).
pub struct PartPlace<'a, B: Backend> {
    /// This rank's place in the grid and its groups (tensor, context, expert parallel).
    pub grid: &'a ProcessGrid,
    /// The run's plan (with the stages as cut).
    pub plan: &'a ParallelPlan,
    /// The pipeline: which stage holds which units, and which rank which stage.
    pub pipeline: &'a PipelinePlan,
    /// The run's seed: every layout builds the weights one process builds.
    pub seed: u64,
    /// Positions per sample between units.
    pub positions: usize,
    /// This rank's device.
    pub device: &'a B::Device,
}

impl<B: Backend> PartPlace<'_, B> {
    /// Whether this rank holds unit `unit` (0: the first unit; `layers + 1`: the last).
    pub fn holds(&self, unit: usize) -> bool {
        let stage = self.pipeline.partition.stage_of(unit);
        self.pipeline.schedule.rank_of(stage) == self.grid.coords.pp
    }
}

/// The way every [`UnitModel`] is a [`RunModel`]: its units built, split and wrapped by the
/// library.
#[derive(Clone, Copy, Debug)]
pub struct ByUnits;

/// The way a model that builds its own parallel layers (GPT, BERT) is a [`RunModel`].
#[derive(Clone, Copy, Debug)]
pub struct OwnLayers;

/// A model that [`merak_burn::run`](crate::run) trains: it plans the run (or takes the plan
/// given) and builds, on each rank, the part that rank holds. Every [`UnitModel`] is one
/// ([`ByUnits`]); a model that builds its own tensor-parallel layers implements
/// `RunModel<B, OwnLayers>` itself. `Kind` only tells the two apart (the compiler infers it
/// at the call: `run::<B, _>(&model, ..)`).
pub trait RunModel<B: TrainBackend, Kind = ByUnits> {
    /// What a rank holds and trains: its units, cut for its tensor-parallel rank.
    type Part: TrainModel<B>;

    /// The run's plan, its pipeline and the positions between units, checked against the
    /// model: everything refused here is refused before any folder is written.
    fn plan_run(&self, request: &PlanRequest<'_, B>) -> Result<RunPlan, RunError>;

    /// This rank's part at `place`: the units it holds, each from its own seed, split for
    /// its tensor-parallel rank, sharing sequences with its context-parallel group.
    fn build_part(&self, place: &PartPlace<'_, B>) -> Result<Self::Part, RunError>;

    /// Whether the tensor-parallel ranks of a mixture of experts route different tokens (GPT
    /// splits a micro-batch's tokens over them), so that the ranks summing an expert's
    /// gradient span the tensor-parallel group as well as the data-parallel one
    /// ([`ProcessGrid::with_expert_parallel`] at every `parallel.ep`). The default, false:
    /// they route the same tokens, and only `parallel.ep > 1` changes the expert groups.
    fn experts_across_tp(&self) -> bool {
        false
    }
}

impl<B, M> RunModel<B, ByUnits> for M
where
    B: TrainBackend,
    M: UnitModel<B>,
    UnitsOf<B, M>: TrainModel<B>,
{
    type Part = UnitsOf<B, M>;

    /// The plan given or planned from the units timed on the sample micro-batch
    /// ([`PlanChoice`]), checked against what the model declares (experts, sequence and
    /// context parallelism); the pipeline cut by the units' times.
    fn plan_run(&self, r: &PlanRequest<'_, B>) -> Result<RunPlan, RunError> {
        let chosen = choose::choose_plan(self, r.choice, r.settings, r.data, r.world, r.device)?;
        let (plan, positions) = (chosen.plan, chosen.positions);
        experts::check_plan(self.experts(), &plan)?;
        sequence::check_sequence_parallel(self.experts(), &plan, positions)?;
        sequence::check_context_parallel(self, &plan)?;
        let pipeline = plan.pipeline_with_costs(&chosen.costs, r.settings.global_batch)?;
        Ok(RunPlan::new(plan, pipeline, positions))
    }

    /// The units this rank holds, built at its place, split by the model's
    /// [`tp_plan`](UnitModel::tp_plan), wrapped for sequence and context parallelism.
    fn build_part(&self, at: &PartPlace<'_, B>) -> Result<Self::Part, RunError> {
        let grid = at.grid;
        let place = UnitPlace {
            experts: grid.ep,
            context: sequence::context_share(at.plan, grid, at.positions)?,
        };
        let units = build_units_on(self, at.seed, at.device, |u| at.holds(u), &place)?;
        if let (Some((_, count)), 2..) = (self.experts(), grid.ep.size()) {
            let shapes = crate::checkpoint::state::param_shapes(&units);
            experts::check_split(&shapes, count, grid.ep.size())?;
        }
        let sequence_parallel = at.plan.sequence_parallel && grid.tp.size() > 1;
        let tp_plan = self.tp_plan().with_sequence_parallel(sequence_parallel);
        let units = shard_module(units, &tp_plan, grid.tp)?;
        let units = match sequence_parallel {
            true => units.with_sequence_parallel(grid.tp),
            false => units,
        };
        Ok(units.with_context_parallel(grid.cp))
    }
}
