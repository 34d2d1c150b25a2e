//! Pipeline parallelism: layers cut into contiguous stages, schedules as data (how a step runs
//! through them: `docs/src/contributing/architecture.md`). The schedules, partitions,
//! recomputation, validation, simulation and traces are the `merak-plan` crate's
//! (`merak_plan::pipeline`, re-exported here); the executor and the stage traits are Burn's
//! side.
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

pub mod executor;
pub mod stack;
pub mod stage;

// The schedules, partitions, recomputation, validation, simulation and traces, under the
// paths they had when they lived here.
pub use merak_plan::pipeline::*;

pub use executor::{
    EvalValues, Executor, MicroBatch, PipelineError, RanAhead, StepLosses, StepReport, StepWork,
};
pub use stack::{TiedTable, param_ids};
pub use stage::{
    DEFAULT_METRICS, EvalOutput, Evaluate, PipelineModel, StageInput, StageOutput, TrainBackend,
    TrainModel,
};
