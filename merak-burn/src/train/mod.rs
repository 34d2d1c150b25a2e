//! The trainer ([`Trainer`]): the whole training step of a model cut over a process grid
//! (pipeline executor, data-parallel reduction, tied gradients, loss reduction, clipping, the
//! optimizer's parameter groups, ZeRO), validation, evaluation, checkpoints, metrics and
//! progress; and its parts: the optimizers (the fused AdamW, Burn's Adam, SGD, AdaGrad and
//! RMSProp, and Muon with AdamW), global gradient norm and clipping, learning-rate schedules, metrics, the run
//! folder and its lineage, and the process's page faults and peak memory.

mod adamw;
pub mod attempts;
pub mod claim;
#[cfg(test)]
mod claim_tests;
mod error;
mod evaluate;
mod experts;
mod fit;
mod goodput;
mod grad_norm;
mod hybrid;
pub mod injected;
mod metrics;
mod optim;
mod optimizer_settings;
mod outputs;
mod param_values;
mod plan_check;
pub mod process;
mod progress;
mod report;
pub mod run_folder;
pub mod run_lock;
mod save;
mod schedule;
mod settings;
mod source;
mod start;
mod stop;
pub mod stragglers;
mod sync;
mod tied;
mod trainer;
mod versions;
mod zero3;

pub use adamw::FusedAdamW;
pub use claim::{Claim, ClaimError, ExistingRun, Origin, RUN_FILE, RunFolders, claim, run_of};
pub use error::InvalidSetting;
pub use error::TrainError;
pub use evaluate::Predictions;
pub use experts::RoutingStats;
pub use fit::Summary;
pub use goodput::Goodput;
pub use grad_norm::{GradStats, NormGroups, clip_grads, global_grad_norm, sharded_param_ids};
pub use metrics::{MetricsWriter, StepMetrics};
pub use optim::{OPTIMIZER_REAL_KEYS, TRAIN_REAL_KEYS, check_settings};
pub use optim::{ParamGroup, ParamInfo};
pub use optim::{RmsPropStep, Slots, StateSlots};
pub use optimizer_settings::{MuonScale, OptimizerKind, OptimizerSettings};
pub use outputs::{OutputError, not_a_file, writable_dir, writable_file};
pub use plan_check::check_plan;
pub use report::{StateBytes, report_memory, write_trace};
pub use run_lock::{LOCK_FILE, LockError, RunLock, RunLocks};
pub use schedule::LrSchedule;
pub use schedule::LrScheduleKind;
pub use settings::{CheckpointPolicy, RunFile, RunOutput, TrainSettings};
pub use source::{BatchSource, SourceError, TokenSource, Windows};
pub use stop::{StopRequest, stop_on_signals};
pub use stragglers::StragglerRule;
pub use tied::sum_tied_grads;
pub(crate) use trainer::read_samples;
pub use trainer::{AdamW, StepOutcome, StepPhases, Trainer};
