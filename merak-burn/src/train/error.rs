//! Why a training run stops.

use crate::checkpoint::CheckpointError;
use crate::comm::CommError;
use crate::pipeline::PipelineError;
use crate::train::SourceError;

/// An error of a [`Trainer`](crate::train::Trainer).
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A collective or point-to-point message failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The pipeline executor failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A checkpoint could not be read, cut or written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The data source failed.
    #[error("reading the data of step {step}: {source}")]
    Data {
        /// The 1-based step (0 for validation before any step).
        step: usize,
        /// The source's error.
        source: SourceError,
    },
    /// The loss is NaN or infinite and skipping such steps is off.
    #[error(
        "the loss is {loss} at step {step}: training stopped (set train.skip_nonfinite = true to skip such steps, or lower train.lr)"
    )]
    NonFiniteLoss {
        /// The 1-based step.
        step: usize,
        /// The loss.
        loss: f64,
    },
    /// A resumed checkpoint is already at or past the last step.
    #[error(
        "the checkpoint is at step {start}, and train.steps = {steps}: nothing left to train (raise train.steps)"
    )]
    NothingLeft {
        /// The checkpoint's step.
        start: usize,
        /// The run's steps.
        steps: usize,
    },
    /// The batch does not split over the ranks and micro-batches.
    #[error(
        "global_batch = {global_batch} must be a multiple of dp = {dp} x micro_batch = {micro_batch}"
    )]
    Batch {
        /// Sequences per step.
        global_batch: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Sequences per micro-batch.
        micro_batch: usize,
    },
    /// The step's losses and gradient squares could not be read from the device.
    #[error("step {step}: reading its losses and gradient norm: {source}")]
    StepRead {
        /// The 1-based step.
        step: usize,
        /// Why the read failed.
        source: crate::host_read::ReadError,
    },
    /// The tied embedding has no gradient on a rank that holds one of its copies.
    #[error("the tied embedding has no gradient")]
    TiedGradient,
    /// ZeRO failed reading or putting together a tensor's values (its chunks and pieces).
    #[error("ZeRO: {0}")]
    ZeroValues(String),
    /// ZeRO-3 cannot shard this model: what is missing.
    #[error("parallel.zero = 3: {0}")]
    Zero3(String),
    /// The run may not write into its folders (they hold another run, or later checkpoints).
    #[error(transparent)]
    Claim(#[from] super::ClaimError),
    /// Another run holds one of the run's folders ([`run_lock`](mod@super::run_lock)).
    #[error(transparent)]
    Lock(#[from] super::LockError),
    /// A caller's file of [`RunOutput::files`](super::RunOutput::files) is not a plain name.
    #[error(
        "run file {0:?}: give a file name without folders (it is written into the output folder)"
    )]
    BadRunFile(String),
    /// A path the run writes cannot be written (checked before the first step).
    #[error(transparent)]
    Output(#[from] super::OutputError),
    /// A setting is out of range (checked by [`Trainer::new`](crate::train::Trainer::new)
    /// before anything trains).
    #[error(transparent)]
    Setting(#[from] InvalidSetting),
    /// A parameter-group rule gave a parameter a group that cannot be used.
    #[error("parameter group of {name}: {reason}")]
    ParamGroup {
        /// The parameter's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Parameter groups were set after the optimizer state was loaded or used.
    #[error(
        "parameter groups must be set before the first step and before resuming (the optimizer state is kept per group)"
    )]
    GroupsTooLate,
    /// The checkpoint holds the state of another optimizer, or the same optimizer keeping
    /// other state.
    #[error(
        "the checkpoint holds the state of optimizer {checkpoint}, but this run uses {run}: resume with the checkpoint's optimizer settings, or start a new run from its weights (its optimizer state cannot be carried over)"
    )]
    OptimizerMismatch {
        /// The checkpoint's optimizer and what its state holds: "`sgd` (momentum buffer)".
        checkpoint: String,
        /// This run's.
        run: String,
    },
    /// Writing metrics, the trace or the memory report failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl TrainError {
    /// Wraps an I/O error on `path`.
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Whether the error is found before the first step (bad settings, a folder another run
    /// holds, a path that cannot be written, parameter groups or an optimizer state that do not
    /// fit): the input's fault, not the run's.
    pub fn found_before_training(&self) -> bool {
        matches!(
            self,
            Self::Setting(_)
                | Self::Claim(_)
                | Self::Lock(_)
                | Self::Output(_)
                | Self::BadRunFile(_)
                | Self::ParamGroup { .. }
                | Self::GroupsTooLate
                | Self::OptimizerMismatch { .. }
        )
    }
}

/// A training setting out of range, or set for an optimizer or schedule that does not use it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("setting `{key}` = {value}: {reason}")]
pub struct InvalidSetting {
    /// The key: a field of [`TrainSettings`](crate::train::TrainSettings) (`lr`), or
    /// `optimizer.<field>` for [`OptimizerSettings`](crate::train::OptimizerSettings).
    pub key: String,
    /// Its value, as written.
    pub value: String,
    /// What is wrong.
    pub reason: String,
}
