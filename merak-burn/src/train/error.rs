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
    /// The tied embedding has no gradient on a rank that holds one of its copies.
    #[error("the tied embedding has no gradient")]
    TiedGradient,
    /// The run may not write into its folders (they hold another run, or later checkpoints).
    #[error(transparent)]
    Claim(#[from] super::ClaimError),
    /// A caller's file of [`RunOutput::files`](super::RunOutput::files) is not a plain name.
    #[error(
        "run file {0:?}: give a file name without folders (it is written into the output folder)"
    )]
    BadRunFile(String),
    /// A path the run writes cannot be written (checked before the first step).
    #[error(transparent)]
    Output(#[from] super::OutputError),
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
}
