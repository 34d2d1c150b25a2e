//! The trainer ([`Trainer`]): the whole training step of a model cut over a process grid
//! (pipeline executor, data-parallel reduction, tied gradients, loss reduction, clipping, AdamW
//! groups, ZeRO-1), validation, checkpoints, metrics and progress; and its parts: the fused
//! AdamW, global gradient norm and clipping, learning-rate schedule, metrics, and the process's
//! page faults and peak memory.

mod adamw;
pub mod claim;
#[cfg(test)]
mod claim_tests;
mod error;
mod fit;
mod grad_norm;
mod metrics;
mod outputs;
pub mod process;
mod progress;
mod report;
mod save;
mod schedule;
mod settings;
mod source;
mod start;
mod stop;
mod tied;
mod trainer;

pub use adamw::FusedAdamW;
pub use claim::{Claim, ClaimError, ExistingRun, Origin, RUN_FILE, RunFolders, claim, run_of};
pub use error::TrainError;
pub use fit::Summary;
pub use grad_norm::{
    GradStats, clip_grads, global_grad_norm, sharded_param_ids, split_for_weight_decay,
};
pub use metrics::{MetricsWriter, StepMetrics};
pub use outputs::{OutputError, writable_dir, writable_file};
pub use report::{report_memory, write_trace};
pub use schedule::LrSchedule;
pub use settings::{CheckpointPolicy, RunFile, RunOutput, TrainSettings};
pub use source::{BatchSource, SourceError, Windows};
pub use stop::StopRequest;
pub use tied::sum_tied_grads;
pub use trainer::{AdamW, StepOutcome, StepPhases, Trainer};
