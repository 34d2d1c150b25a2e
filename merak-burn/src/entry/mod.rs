//! One call trains a Burn user's model under any layout: [`merak_burn::run`](crate::run).
//!
//! The user describes the model as units ([`UnitModel`]: a constructor per unit and a tensor
//! parallel plan by sub-module name), says how to choose the plan ([`PlanChoice`]: given, or
//! the planner's from the units timed on this backend), and hands over the data
//! ([`BatchSource`], by global sample index) with the
//! [`TrainSettings`] and [`RunOptions`]. The library then does
//! what every such program does:
//!
//! 1. detects `mpirun` (or runs as one process) and, when asked, installs the stop signals;
//! 2. runs the first unit, one block and the last unit on a sample micro-batch, refusing units
//!    whose shapes do not fit together ([`RunError::UnitShape`]), and times them to plan (when
//!    asked) or to cut a pipeline, the same on every rank;
//! 3. builds the process grid and the pipeline, and **builds on each rank only the units it
//!    holds**, each from its own seed ([`unit_seed`]), so every layout starts from the weights
//!    one process starts from;
//! 4. splits them for tensor parallelism, loads pretrained weights or a checkpoint to resume
//!    (cut for this layout), trains with validation, metrics, progress and checkpoints, then
//!    evaluates held-out samples when asked ([`RunOptions::eval_batches`],
//!    [`RunOptions::predict_batches`]).
//!
//! A program that starts MPI itself uses [`run_with_mpi`]; one that builds its model's part
//! itself (its own layers, its own plan, as `merak train` does for GPT and BERT) trains it
//! with [`train_part`], the step `run` ends in.
//!
//! Under `mpirun` with several ranks an error on one rank ends the whole job (`MPI_Abort`,
//! after printing it with the rank), since the other ranks would otherwise wait for it.

mod choose;
mod error;
mod experts;
mod metric_sums;
mod model;
mod options;
mod sequence;
mod train_part;

pub use choose::{AutoPlan, PlanChoice};
pub use error::{RunError, exit_code};
pub use metric_sums::MetricSums;
pub use model::{
    ModelDims, UnitModel, UnitPlace, UnitsOf, build_units, build_units_on, sample_units, unit_seed,
};
pub use options::{FullParams, InitWeights, ParamGroups, RunOptions};
pub use train_part::{Part, train_part};

use std::path::PathBuf;

use crate::checkpoint::{Checkpoint, FullState, state};
use crate::comm::{Communicator, MpiWorld, launched_by_mpirun, watchdog};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::parallelize::shard_module;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::{
    BatchSource, Predictions, StopRequest, Summary, TrainSettings, run_folder, stop_on_signals,
};

/// What a finished [`run`] reports (on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// Steps, final loss, throughput; whether a signal stopped the run.
    pub summary: Summary,
    /// The plan the run trained under, with the stages as cut (`stage_units`).
    pub plan: ParallelPlan,
    /// This process's rank (0 without `mpirun`).
    pub rank: usize,
    /// The output folder.
    pub out: PathBuf,
    /// The sums of the head's metrics over the held-out batches
    /// ([`RunOptions::eval_batches`]), by name, the same on every rank; `None` when not asked
    /// for.
    pub metrics: Option<MetricSums>,
    /// The head's outputs for the held-out samples ([`RunOptions::predict_batches`]), on
    /// every rank; `None` when not asked for.
    pub predictions: Option<Predictions>,
}

/// Trains `model` on `data` as `settings` say, under the plan `plan` chooses, in one process or
/// on every rank `mpirun` started (see the [module](self)). Returns on every rank.
pub fn run<B, M>(
    model: &M,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
) -> Result<RunReport, RunError>
where
    B: TrainBackend,
    M: UnitModel<B>,
    UnitsOf<B, M>: TrainModel<B>,
{
    let mpi = if launched_by_mpirun() {
        Some(MpiWorld::init()?)
    } else {
        None
    };
    run_with_mpi(mpi.as_ref(), model, plan, data, settings, options)
}

/// [`run`] for a program that starts MPI itself ([`MpiWorld::init`], before its own MPI work)
/// and keeps it after the run: `mpi` is its world, `None` for one process without MPI. An
/// error on one of several ranks still ends the job (`MPI_Abort` with its
/// [`exit_status`](RunError::exit_status)).
pub fn run_with_mpi<B, M>(
    mpi: Option<&MpiWorld>,
    model: &M,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
) -> Result<RunReport, RunError>
where
    B: TrainBackend,
    M: UnitModel<B>,
    UnitsOf<B, M>: TrainModel<B>,
{
    let result = run_on(model, plan, data, settings, options, mpi);
    match (result, mpi) {
        (Err(e), Some(m)) if m.world().size() > 1 => {
            m.abort(i32::from(e.exit_status()), &e.to_string())
        }
        (result, _) => result,
    }
}

/// [`run`] with MPI started (or not, for one process).
fn run_on<B, M>(
    model: &M,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
    mpi: Option<&MpiWorld>,
) -> Result<RunReport, RunError>
where
    B: TrainBackend,
    M: UnitModel<B>,
    UnitsOf<B, M>: TrainModel<B>,
{
    let stop = stop_request(options)?;
    let world = mpi.map(MpiWorld::world);
    let comm = world.as_ref().map(|w| w as &dyn Communicator);
    let device = B::Device::default();
    let chosen = choose::choose_plan(model, plan, settings, data, comm, &device)?;
    let (plan, costs) = (chosen.plan, chosen.costs);
    experts::check_plan(model.experts(), &plan)?;
    sequence::check_sequence_parallel(model.experts(), &plan, chosen.positions)?;
    sequence::check_context_parallel(model, &plan)?;
    // The messages between stages are as wide as the first unit's output.
    let settings = &settings.clone().with_seq_len(chosen.positions);
    let resume = options.resume.as_deref().map(open_resume).transpose()?;
    let out =
        run_folder::output_folder(options.out.as_deref(), resume.as_ref().map(|r| &r.0), comm)?;
    let ranks = plan.layout().world_size();
    let grid = match world {
        Some(w) => ProcessGrid::from_mpi(w, plan.layout())?,
        None if ranks == 1 => ProcessGrid::single(),
        None => return Err(RunError::NotLaunched { ranks }),
    };
    let grid = match plan.ep > 1 {
        true => grid.with_expert_parallel(plan.ep)?,
        false => grid,
    };
    if ranks > 1 && options.comm_timeout_s > 0.0 {
        watchdog::arm(
            watchdog::saturating_duration(options.comm_timeout_s),
            grid.rank,
        );
    }
    let pipeline = plan.pipeline_with_costs(&costs, settings.global_batch)?;
    // Reported as cut: a balanced cut is decided here, from the units' times.
    let plan = ParallelPlan {
        stage_units: pipeline.partition.sizes(),
        ..plan
    };
    let me = grid.coords.pp;
    let holds = |u: usize| pipeline.schedule.rank_of(pipeline.partition.stage_of(u)) == me;
    let place = UnitPlace {
        experts: grid.ep,
        context: sequence::context_share(&plan, &grid, settings.seq_len)?,
    };
    let units = build_units_on(model, settings.seed, &device, holds, &place)?;
    if let (Some((_, count)), 2..) = (model.experts(), grid.ep.size()) {
        experts::check_split(&state::param_shapes(&units), count, grid.ep.size())?;
    }
    let sequence_parallel = plan.sequence_parallel && grid.tp.size() > 1;
    let tp_plan = model.tp_plan().with_sequence_parallel(sequence_parallel);
    let units = shard_module(units, &tp_plan, grid.tp)?;
    let units = match sequence_parallel {
        true => units.with_sequence_parallel(grid.tp),
        false => units,
    };
    let units = units.with_context_parallel(grid.cp);
    let part = Part {
        grid: &grid,
        device,
        plan,
        pipeline,
        out,
    };
    let resume = resume.as_ref().map(|(c, s)| (c, s));
    Ok(train_part(part, units, data, settings, options, resume, stop)?.0)
}

/// The stop request the signal handlers set, when the options ask for them.
fn stop_request(options: &RunOptions) -> Result<Option<StopRequest>, RunError> {
    if !options.signals {
        return Ok(None);
    }
    let stop = StopRequest::new();
    stop_on_signals(&stop).map_err(RunError::Signals)?;
    Ok(Some(stop))
}

/// The checkpoint to resume and its tensors at full size.
fn open_resume(path: &std::path::Path) -> Result<(Checkpoint, FullState), RunError> {
    let error = |error| RunError::Checkpoint {
        source_name: format!("resume {}", path.display()),
        error,
    };
    let checkpoint = Checkpoint::open(path).map_err(error)?;
    let state = checkpoint.read_full().map_err(error)?;
    Ok((checkpoint, state))
}
