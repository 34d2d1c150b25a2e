//! The checks of a run's settings and plan that need no model, made by
//! [`Trainer::new`](super::Trainer::new) before anything is built, and by a launcher before it
//! makes any folder (`merak train` refuses such a run with exit status 2, leaving nothing).

use super::zero3::check_zero;
use super::{TrainError, TrainSettings, check_settings};
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::PipelinePlan;

/// Refuses out-of-range optimizer and schedule settings ([`check_settings`]), a global batch
/// that `dp` ranks and the micro-batch do not split, a ZeRO stage that does not exist,
/// and ZeRO-3 with a schedule it does not run; each error
/// names the key and the numbers.
pub fn check_plan(
    parallel: &ParallelPlan,
    pipeline: &PipelinePlan,
    settings: &TrainSettings,
    dp: usize,
) -> Result<(), TrainError> {
    check_settings(settings)?;
    let micro = parallel.micro_batch;
    if micro == 0 || !settings.global_batch.is_multiple_of(dp * micro) {
        return Err(TrainError::Batch {
            global_batch: settings.global_batch,
            dp,
            micro_batch: micro,
        });
    }
    check_zero(parallel, pipeline)
}
