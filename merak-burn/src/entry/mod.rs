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
//! `run` takes any [`RunModel`]: every [`UnitModel`] is one, and a model that builds its own
//! parallel layers (GPT and BERT, with their fused tensor-parallel layers) implements it
//! itself, planning its run and building each rank's part ([`PlanRequest`], [`PartPlace`]);
//! `merak train` trains them through this same door. A program that starts MPI itself uses
//! [`run_with_mpi`]; one that chooses each rank's device and transport, has read the
//! checkpoint to resume, or needs the trained part afterwards uses [`run_on`].
//!
//! Under `mpirun` with several ranks an error on one rank ends the whole job (`MPI_Abort`,
//! after printing it with the rank), since the other ranks would otherwise wait for it.

mod choose;
mod error;
mod experts;
mod metric_sums;
mod model;
mod options;
mod run_model;
mod sequence;
mod train_part;

pub use choose::{AutoPlan, PlanChoice};
pub use error::{RunError, exit_code};
pub use metric_sums::MetricSums;
pub use model::{
    ModelDims, UnitModel, UnitPlace, UnitsOf, build_units, build_units_on, sample_units, unit_seed,
};
pub use options::{FullParams, InitWeights, ParamGroups, RunOptions};
pub use run_model::{ByUnits, OwnLayers, PartPlace, PlanRequest, RunModel, RunPlan};

use std::path::PathBuf;

use burn::tensor::backend::Backend;

use crate::checkpoint::{Checkpoint, FullState};
use crate::comm::{
    Communicator, MpiCommunicator, MpiWorld, Transport, catch_failure, launched_by_mpirun, watchdog,
};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::TrainBackend;
use crate::train::{
    BatchSource, Predictions, StopRequest, Summary, TrainSettings, run_folder, stop_on_signals,
};
use train_part::{Part, train_part};

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
pub fn run<B, K>(
    model: &impl RunModel<B, K>,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
) -> Result<RunReport, RunError>
where
    B: TrainBackend,
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
pub fn run_with_mpi<B, K>(
    mpi: Option<&MpiWorld>,
    model: &impl RunModel<B, K>,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
) -> Result<RunReport, RunError>
where
    B: TrainBackend,
{
    let result = run_on(RunOn::new(mpi), model, plan, data, settings, options);
    match (result, mpi) {
        (Err(e), Some(m)) if m.world().size() > 1 => {
            m.abort(i32::from(e.exit_status()), &e.to_string())
        }
        (result, _) => result.map(|trained| trained.report),
    }
}

/// Where [`run_on`] trains: the MPI world, this rank's device, the transport of the
/// grid's collectives, and a checkpoint the program has already read.
pub struct RunOn<'a, B: Backend> {
    /// The MPI world (`None`: one process without MPI).
    pub mpi: Option<&'a MpiWorld>,
    /// This rank's device.
    pub device: B::Device,
    /// What carries the tensor- and data-parallel groups' collectives (NCCL between GPUs).
    pub transport: Transport,
    /// The checkpoint to continue from and its tensors at full size, read by the program
    /// (which checked it against its own config); [`RunOptions::resume`] reads one by path.
    pub resume: Option<(&'a Checkpoint, &'a FullState)>,
}

impl<'a, B: Backend> RunOn<'a, B> {
    /// The ranks of `mpi` (one process for `None`) on the default device, over MPI.
    pub fn new(mpi: Option<&'a MpiWorld>) -> Self {
        Self {
            mpi,
            device: B::Device::default(),
            transport: Transport::Mpi,
            resume: None,
        }
    }
}

/// What [`run_on`] returns on every rank: the report, this rank's trained part and its
/// place in the grid (for work after training, such as sampling).
pub struct Trained<P> {
    /// What [`run`] reports.
    pub report: RunReport,
    /// This rank's part of the model, trained.
    pub part: P,
    /// This rank's place in the grid.
    pub grid: ProcessGrid,
}

/// [`run`] as a program that owns its launch calls it: on `on`'s ranks, device and
/// transport, from its checkpoint when it gives one. Returns the trained part with the
/// report. An error is returned on the rank that found it without ending the job: the
/// program ends it (`MPI_Abort` with [`RunError::exit_status`]) once it has released what it
/// holds, as `merak train` does with its folders' locks.
pub fn run_on<B, K, M>(
    on: RunOn<'_, B>,
    model: &M,
    plan: &PlanChoice,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
) -> Result<Trained<M::Part>, RunError>
where
    B: TrainBackend,
    M: RunModel<B, K>,
{
    let stop = stop_request(options)?;
    let world = on.mpi.map(MpiWorld::world);
    let comm = world.as_ref().map(|w| w as &dyn Communicator);
    let device = on.device;
    let request = PlanRequest {
        choice: plan,
        settings,
        data,
        world: comm,
        device: &device,
    };
    let RunPlan {
        plan,
        pipeline,
        positions,
    } = model.plan_run(&request)?;
    // The messages between stages are as wide as the first unit's output.
    let settings = &settings.clone().with_seq_len(positions);
    let opened = match on.resume {
        Some(_) => None,
        None => options.resume.as_deref().map(open_resume).transpose()?,
    };
    let resume = on.resume.or(opened.as_ref().map(|(c, s)| (c, s)));
    let out = run_folder::output_folder(options.out.as_deref(), resume.map(|r| r.0), comm)?;
    let grid = process_grid(world, &plan, on.transport, model.experts_across_tp())?;
    if grid.layout.world_size() > 1 && options.comm_timeout_s > 0.0 {
        let limit = watchdog::saturating_duration(options.comm_timeout_s);
        watchdog::arm(limit, grid.rank);
    }
    let place = PartPlace {
        grid: &grid,
        plan: &plan,
        pipeline: &pipeline,
        seed: settings.seed,
        positions,
        device: &device,
    };
    let part = model.build_part(&place)?;
    let at = Part {
        grid: &grid,
        device,
        plan,
        pipeline,
        out,
    };
    // A failure a forward pass raises (an expert-parallel rank receiving more rows than its
    // capacity) is an error of the run; under MPI the panic hook has already ended the job.
    let trained = catch_failure(|| train_part(at, part, data, settings, options, resume, stop))?;
    let (report, part) = trained?;
    Ok(Trained { report, part, grid })
}

/// This rank's grid for `plan`'s layout over `world` (one process without it), its tensor-
/// and data-parallel groups on `transport`, its expert groups split `plan.ep` ways (and
/// spanning the tensor-parallel ranks where the model's experts route `across_tp`).
fn process_grid(
    world: Option<MpiCommunicator>,
    plan: &ParallelPlan,
    transport: Transport,
    across_tp: bool,
) -> Result<ProcessGrid, RunError> {
    let ranks = plan.layout().world_size();
    let grid = match world {
        Some(w) => ProcessGrid::from_mpi_with(w, plan.layout(), transport)?,
        None if ranks == 1 => ProcessGrid::single(),
        None => return Err(RunError::NotLaunched { ranks }),
    };
    Ok(match plan.ep > 1 || across_tp {
        true => grid.with_expert_parallel(plan.ep)?,
        false => grid,
    })
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
