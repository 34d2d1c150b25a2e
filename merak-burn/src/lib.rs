//! merak-burn: automated 3D parallelism (data, tensor and pipeline) for the Burn deep-learning
//! framework, over MPI or NCCL.
//!
//! - [`backend`]: the CPU backend (burn-flex) and its autodiff variants, named once.
//! - [`comm`]: the [`Communicator`](comm::Communicator) trait with MPI, NCCL and one-process
//!   implementations.
//! - [`kernels`]: fused operations (cross-entropy, ...) with vectorized CPU kernels.
//! - [`grid`]: the process grid `world = dp * pp * tp` and its per-axis communicators.
//! - [`data_parallel`]: bucketed gradient all-reduce overlapped with the backward pass, ZeRO-1.
//! - [`tensor_parallel`]: the f/g autodiff operators and the tensor-parallel layers.
//! - [`train`]: global gradient norm and clipping, weight-decay groups, schedule, metrics.
//! - [`pipeline`]: stages, schedules as data (validated, simulated, executed), recomputation.
//! - [`planner`]: model proxy, hardware spec, cost model and search of 3D-parallel plans.
//! - [`checkpoint`]: atomic sharded checkpoints that load under any dp/tp layout.

#![warn(missing_docs)]

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod data_parallel;
pub mod grid;
pub mod kernels;
pub mod pipeline;
pub mod planner;
pub mod tensor_parallel;
pub mod train;
