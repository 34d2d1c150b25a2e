//! Training glue: global gradient norm and clipping, learning-rate schedule, metrics.

mod grad_norm;
mod metrics;
mod schedule;

pub use grad_norm::{
    GradStats, clip_grads, global_grad_norm, sharded_param_ids, split_for_weight_decay,
};
pub use metrics::{MetricsWriter, StepMetrics};
pub use schedule::LrSchedule;
