//! merak-plan: the planner of merak-burn and the plans it makes, without Burn, MPI or tensors,
//! so that a laptop can plan a thousand-GPU cluster and this crate compiles beside Burn.
//!
//! - [`planner`]: model proxies, hardware, the one memory accounting, the cost model and the
//!   search of parallel layouts.
//! - [`pipeline`]: pipeline schedules as data (built, validated, simulated, traced),
//!   partitions into stages and recomputation.
//! - [`parallel_plan`]: [`ParallelPlan`](parallel_plan::ParallelPlan), the one typed plan of a
//!   run that a config file and the planner both produce.
//! - [`grid`]: the process grid's [`Layout`](grid::Layout) (the degrees of each axis) and a
//!   rank's coordinates in it.
//! - [`data_parallel`] and [`context_parallel`]: the settings of data and context parallelism
//!   a plan names.
//!
//! `merak-burn` re-exports every module under the same path (`merak_burn::planner::search`
//! is [`planner::search()`]), and runs the plans with Burn.

#![warn(missing_docs)]

pub mod context_parallel;
pub mod data_parallel;
pub mod grid;
pub mod parallel_plan;
pub mod pipeline;
pub mod planner;
