//! Training glue: the fused AdamW, global gradient norm and clipping, learning-rate schedule, metrics, and the
//! process's page faults and peak memory.

mod adamw;
mod grad_norm;
mod metrics;
pub mod process;
mod schedule;

pub use adamw::FusedAdamW;
pub use grad_norm::{
    GradStats, clip_grads, global_grad_norm, sharded_param_ids, split_for_weight_decay,
};
pub use metrics::{MetricsWriter, StepMetrics};
pub use schedule::LrSchedule;
