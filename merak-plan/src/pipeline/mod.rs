//! Pipeline parallelism as data: layers cut into contiguous stages ([`partition`]), schedules
//! (how a step runs through them), recomputation, and the proofs and predictions made from a
//! schedule without running it (validation, simulation, traces). The executor that runs a
//! schedule with tensors and messages is the runtime's (`merak_burn::pipeline::Executor`).
//!
//! A schedule is, for every pipeline rank, an ordered list of [`Action`]s. The same lists drive
//! the executor (which runs them with real point-to-point messages) and the simulator (which
//! predicts their time), and [`validate`](fn@validate) proves them complete and free of
//! deadlock before either uses them.
//!
//! Stages: with `p` pipeline ranks and `v` virtual stages per rank there are `p * v` model
//! stages; stage `s` lives on rank `s % p` as its chunk `s / p` (Megatron's interleaved
//! mapping; `v = 1` is the plain one-stage-per-rank pipeline), except under ZB-V, whose two
//! stages per rank form a V (rank `r` holds `r` and `2p - 1 - r`;
//! [`schedule::rank_of_stage`]). Consecutive stages on one rank hand over without messages.

mod dual_pipe_v;
#[cfg(test)]
mod dual_pipe_v_tests;
mod order;
pub mod pairs;
pub mod partition;
mod pipeline_plan;
pub mod recompute;
pub mod schedule;
pub mod simulate;
pub mod timing;
pub mod trace;
pub mod two_bw;
pub mod validate;
mod zero_bubble;
#[cfg(test)]
mod zero_bubble_tests;

pub use partition::{
    Partition, PartitionError, balanced_partition, explicit_partition, unit_costs_gpt,
};
pub use pipeline_plan::PipelinePlan;
pub use recompute::{
    ParseRecomputeError, Recompute, RecomputeMode, activation_bytes_per_layer, in_flight_1f1b,
    in_flight_gpipe, kept_bytes_per_layer, stage_aware_recompute,
};
pub use schedule::{Action, Schedule, ScheduleError, ScheduleKind, build_schedule};
pub use simulate::{Simulation, simulate, steady_step_time};
pub use timing::{Costs, TimedAction};
pub use trace::{TraceEvent, chrome_trace, write_chrome_trace};
pub use validate::{ValidationError, validate};
