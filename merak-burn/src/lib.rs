//! merak-burn: automated 3D parallelism (data, tensor and pipeline) for the Burn deep-learning
//! framework, over MPI or NCCL.
//!
//! - [`backend`]: the CPU backend (burn-flex) and its autodiff variants, named once.
//! - [`batch`]: samples of any shape as named fields, and a micro-batch of them as tensors.
//! - [`comm`]: the [`Communicator`](comm::Communicator) trait with MPI, NCCL and one-process
//!   implementations.
//! - [`rank_env`]: the launcher's environment (mpirun, srun, PMIx): rank, local rank, node.
//! - [`kernels`]: fused operations (cross-entropy, ...) with vectorized CPU kernels.
//! - [`grid`]: the process grid `world = dp * pp * tp` and its per-axis communicators.
//! - [`data`]: synthetic sequences and memory-mapped token data sets, as the trainer's windows.
//! - [`data_parallel`]: bucketed gradient all-reduce overlapped with the backward pass, ZeRO-1.
//! - [`tensor_parallel`]: the f/g autodiff operators and the tensor-parallel layers.
//! - [`context_parallel`]: sequences cut across ranks (zigzag shards) and ring attention over
//!   them, forward and backward.
//! - [`expert_ops`]: expert parallelism's autodiff operations (the token exchange, the
//!   auxiliary losses' injection), below the layers.
//! - [`moe`]: mixture-of-experts blocks (top-k routing, auxiliary losses, capacity) and
//!   expert parallelism (experts split over data-parallel ranks, tokens exchanged by
//!   all-to-all).
//! - [`train`]: global gradient norm and clipping, weight-decay groups, schedule, metrics.
//! - [`pipeline`]: stages, schedules as data (validated, simulated, executed), recomputation.
//! - [`parallelize`]: a Burn user's own model made parallel by describing it: which linear
//!   layers tensor parallelism splits, which sub-modules are the pipeline units.
//! - [`parallel_plan`]: [`ParallelPlan`](parallel_plan::ParallelPlan), the one typed plan of a run (layout,
//!   stages, schedule, recomputation, micro-batching, ZeRO-1, overlap).
//! - [`planner`]: model proxy, hardware spec, cost model and search of 3D-parallel plans.
//! - [`admission`]: the memory admission check: a run whose ranks' estimated peak does not
//!   fit the host's or the GPU's memory is refused before anything is built.
//! - [`checkpoint`]: atomic sharded checkpoints that load under any dp/tp layout.
//! - [`hf_files`]: Hugging Face safetensors and `config.json` files, read as untrusted input.
//! - [`probe`]: the machine measured for the planner (matrix products, memory, MPI, the
//!   tensor-parallel overlap), under `mpirun`.
//! - [`rng`]: deterministic randomness keyed by seed, name and global index.
//! - [`prelude`]: what a program training its own model imports (`use merak_burn::prelude::*`).
//! - [`entry`]: [`run`], the one call that trains a model described as units under any
//!   layout (detecting `mpirun`, planning, building each rank's units, training, checkpoints).
//!
//! The planner, the plan types ([`parallel_plan`], the layout of [`grid`]) and the pure half
//! of [`pipeline`] (schedules, partitions, validation, simulation, traces) are the
//! `merak-plan` crate's, which has no Burn in it; they are re-exported here under the same
//! paths.

#![warn(missing_docs)]

pub mod admission;
pub mod backend;
pub mod batch;
pub mod bounds;
pub mod checkpoint;
pub mod comm;
pub mod context_parallel;
pub mod data;
pub mod data_parallel;
pub mod device;
pub mod entry;
pub mod expert_ops;
pub mod grid;
pub mod hf_files;
pub mod host_read;
pub mod kernels;
pub mod moe;
pub use merak_plan::parallel_plan;
pub mod parallelize;
pub mod pipeline;
pub use merak_plan::planner;
pub mod precision;
pub mod prelude;
pub mod probe;
pub mod rank_env;
pub mod rng;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod self_test;
pub mod tensor_parallel;
pub mod train;
#[cfg(feature = "wgpu")]
pub mod wgpu_device;

pub use entry::{run, run_with_mpi};
