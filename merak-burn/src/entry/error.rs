//! Why [`merak_burn::run`](crate::run) stopped before or during training.

use thiserror::Error;

use crate::checkpoint::CheckpointError;
use crate::comm::{CommError, RankFailure};
use crate::context_parallel::ZigZagError;
use crate::grid::GridError;
use crate::parallel_plan::PlanError;
use crate::parallelize::{NoTokenTable, TpPlanError};
use crate::planner::{HardwareError, MeasuredError, SearchError};
use crate::tensor_parallel::TpError;
use crate::train::{SourceError, TrainError};

/// An error of [`merak_burn::run`](crate::run). Everything but [`Train`](Self::Train) and
/// [`Failed`](Self::Failed) is found before the first step.
#[derive(Debug, Error)]
pub enum RunError {
    /// MPI could not start, or a message between ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The plan's layout needs more ranks than one process without `mpirun`.
    #[error(
        "the plan's layout dp x tp x pp = {ranks} ranks, but this is one process: run it under `mpirun -np {ranks}`"
    )]
    NotLaunched {
        /// Ranks the layout needs.
        ranks: usize,
    },
    /// The layout does not fit the launched ranks.
    #[error(transparent)]
    Grid(#[from] GridError),
    /// The plan cannot cut this model or batch.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The tensor-parallel plan names layers the model does not have, or cannot split them.
    #[error(transparent)]
    TpPlan(#[from] TpPlanError),
    /// The model declares a tied head but its first unit names no token table.
    #[error(transparent)]
    Tie(#[from] NoTokenTable),
    /// The planner's hardware is neither a preset nor a valid hardware file.
    #[error(transparent)]
    Hardware(#[from] HardwareError),
    /// The units' timings cannot make a model proxy.
    #[error(transparent)]
    Measured(#[from] MeasuredError),
    /// The planner found no plan.
    #[error(transparent)]
    Search(#[from] SearchError),
    /// The data source failed or returned windows of the wrong size.
    #[error(transparent)]
    Data(#[from] SourceError),
    /// A unit panicked on the sample micro-batch run before training (for example asking
    /// the batch for a field the data does not have, or an operation refusing a shape).
    #[error("{unit} failed on a sample micro-batch: {message}")]
    UnitPanic {
        /// The unit.
        unit: String,
        /// The panic's message.
        message: String,
    },
    /// A unit returns another shape than the next one takes (found on a sample micro-batch
    /// before training).
    #[error("{unit} returns {got:?}, but {expected} = {want:?}")]
    UnitShape {
        /// The unit (or the tied table's name).
        unit: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape wanted.
        want: Vec<usize>,
        /// What wants it.
        expected: &'static str,
    },
    /// The head's [`LossSum`](crate::parallelize::LossSum) counts another number of loss terms
    /// than the sample micro-batch has (found before training).
    #[error(
        "the last unit's LossSum counts {counted} loss terms, but the micro-batch has {expected} \
         (Batch::loss_terms): return the sum of the terms with their count (LossSum::new), or \
         a mean with LossSum::from_mean"
    )]
    LossTerms {
        /// The terms the head counted.
        counted: usize,
        /// The terms of the micro-batch.
        expected: usize,
    },
    /// The head's loss adds another number of logged parts than the names it declares
    /// ([`HeadUnit::LOSS_PARTS`](crate::parallelize::HeadUnit::LOSS_PARTS)); found before
    /// training for a model described by units.
    #[error(
        "the last unit's LossSum adds {counted} logged parts, but HeadUnit::LOSS_PARTS names \
         {names:?}: declare one name per LossSum::with_part_mean"
    )]
    LossParts {
        /// The parts the head added.
        counted: usize,
        /// The names it declares.
        names: Vec<&'static str>,
    },
    /// The head's metrics have another length than the names it declares
    /// ([`HeadUnit::METRICS`](crate::parallelize::HeadUnit::METRICS)); found before training
    /// for a model described by units.
    #[error(
        "the last unit's metrics are {counted} sums, but HeadUnit::METRICS names {names:?}: \
         declare one name per sum"
    )]
    MetricNames {
        /// The names declared.
        names: Vec<String>,
        /// The sums the head returned.
        counted: usize,
    },
    /// The checkpoint to resume or the pretrained weights cannot be used.
    #[error("{source_name}: {error}")]
    Checkpoint {
        /// The checkpoint or weights named.
        source_name: String,
        /// What is wrong.
        error: CheckpointError,
    },
    /// Expert parallelism the model cannot take: no declared experts, an expert count `ep`
    /// does not divide, tensor parallelism beside it, or blocks holding every routed expert.
    #[error("parallel.ep = {ep}: {reason}")]
    ExpertParallel {
        /// The expert-parallel degree asked for.
        ep: usize,
        /// What is wrong.
        reason: String,
    },
    /// Sequence parallelism the model cannot take: a sequence length `tp` does not divide,
    /// or blocks holding mixtures of experts.
    #[error("parallel.sequence_parallel at parallel.tp = {tp}: {reason}")]
    SequenceParallel {
        /// The tensor-parallel degree.
        tp: usize,
        /// What is wrong.
        reason: String,
    },
    /// Context parallelism the model cannot take: blocks that do not declare it
    /// ([`UnitModel::context_parallel`](super::UnitModel::context_parallel)), or sequences
    /// `2 cp` does not divide.
    #[error("parallel.cp = {cp}: {reason}")]
    ContextParallel {
        /// The context-parallel degree.
        cp: usize,
        /// What is wrong.
        reason: String,
    },
    /// A model's own tensor-parallel layers cannot be built as asked (a width the degree does
    /// not divide).
    #[error(transparent)]
    TensorParallel(#[from] TpError),
    /// A model's own context-parallel split cannot be made (sequences `2 cp` does not divide).
    #[error(transparent)]
    ZigZag(#[from] ZigZagError),
    /// A rank failed during training where no `Result` could carry the error (inside a
    /// forward pass: an expert-parallel rank receiving more rows than its capacity).
    #[error(transparent)]
    Failed(#[from] RankFailure),
    /// The signal handlers could not be installed.
    #[error("installing the signal handlers: {0}")]
    Signals(std::io::Error),
    /// Training failed (or its settings were refused before the first step).
    #[error(transparent)]
    Train(#[from] TrainError),
}

impl RunError {
    /// The exit status a program should end with, as `merak train` does: 2 for bad input
    /// found before training (every variant but [`Train`](Self::Train), and the settings,
    /// folders and parameter groups [`TrainError::found_before_training`] names), 1 for a
    /// failure during training.
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::Train(e) if !e.found_before_training() => 1,
            Self::Failed(_) => 1,
            _ => 2,
        }
    }
}

/// How a program training through [`run`](crate::run) ends its `main`: success, or `result`'s
/// error printed as a `main` returning it prints it (`Error: {error:?}`) and the exit status
/// of the [`RunError`] in its chain of sources ([`RunError::exit_status`]), 2 (bad input found
/// before training) when there is none.
pub fn exit_code<E>(result: Result<(), E>) -> std::process::ExitCode
where
    E: std::fmt::Debug + AsRef<dyn std::error::Error>,
{
    let Err(error) = result else {
        return std::process::ExitCode::SUCCESS;
    };
    eprintln!("Error: {error:?}");
    let status = std::iter::successors(Some(error.as_ref()), |e| e.source())
        .find_map(|e| e.downcast_ref::<RunError>())
        .map_or(2, RunError::exit_status);
    std::process::ExitCode::from(status)
}
