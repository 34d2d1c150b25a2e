//! How a model is cut and run ([`PipelinePlan`]).

use super::partition::Partition;
use super::schedule::Schedule;

/// How a model is cut and run: the schedule, the stages and the recomputation per stage.
#[derive(Clone, Debug)]
pub struct PipelinePlan {
    /// The validated schedule.
    pub schedule: Schedule,
    /// The units of every global stage.
    pub partition: Partition,
    /// Per global stage: how many of its first units are recomputed (0: none; all of its
    /// units: full recomputation).
    pub recompute_units: Vec<usize>,
}
