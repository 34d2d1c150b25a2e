//! What a program training its own model imports: `use merak_burn::prelude::*;`.
//!
//! The unit traits and their constructor trait, the tensor-parallel layer and plan, the loss
//! type, the micro-batch and its standard fields, the data traits, the run's settings, options,
//! plan choice and report, and the CPU backend. Everything else stays under its module.

pub use crate::backend::{Cpu, CpuAutodiff};
pub use crate::batch::{Batch, Samples, TARGETS, TOKENS};
pub use crate::context_parallel::ContextShare;
pub use crate::entry::{
    AutoPlan, MetricSums, ModelDims, PlanChoice, RunError, RunOptions, RunReport, UnitModel,
    UnitPlace, exit_code,
};
pub use crate::parallel_plan::ParallelPlan;
pub use crate::parallelize::{EmbedUnit, HeadUnit, LayerUnit, Linear, LossSum, TpPlan, TpStyle};
pub use crate::pipeline::ScheduleKind;
pub use crate::run;
pub use crate::tensor_parallel::ParallelBackend;
pub use crate::train::{BatchSource, SourceError, TokenSource, TrainSettings, Windows};
