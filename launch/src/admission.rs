//! The launch's side of the memory admission check ([`merak_burn::admission`]): which memory
//! the run's ranks share on this machine (the host's, or this rank's CUDA device's) and how many
//! of them share it. [`check_shape`] refuses a shape beyond the host from the shape alone,
//! before the pipeline plan is built; [`check`] then admits the whole plan.

use anyhow::Result;
use merak_burn::admission::{
    GPU_RUNTIME_BYTES, HOST_RUNTIME_BYTES, MemoryEstimate, MemoryLimit, RunFormat, admit,
    admit_shape, estimate, estimate_shape,
};
use merak_burn::device::DeviceChoice;
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::PipelinePlan;
use merak_burn::planner::StateFormat;

use crate::config::Config;

/// What a run of `cfg` keeps: activation elements of 4 bytes in f32, 2 under bf16
/// (`train.precision`); fp32 model states with the optimizer's state tensors either way.
fn run_format(cfg: &Config) -> RunFormat {
    let activation = match cfg.train.precision {
        merak_burn::precision::Precision::Fp32 => 4.0,
        merak_burn::precision::Precision::Bf16 => 2.0,
    };
    RunFormat {
        activation,
        states: StateFormat::f32(cfg.optimizer.state_tensors()),
    }
}

/// Fails, in microseconds and before anything per layer is built, when the shape of `cfg`
/// under `parallel` cannot fit this machine: on the CPU the lower bound of the busiest rank's
/// peak ([`estimate_shape`]), on CUDA the host's share of it (runtime and the planner's
/// bookkeeping per layer), against the available host memory. Where the memory cannot be
/// read it admits.
pub fn check_shape(cfg: &Config, parallel: &ParallelPlan) -> Result<()> {
    let Ok(shape) = cfg.shape() else {
        return Ok(());
    };
    let Some(limit) = MemoryLimit::host(local_ranks(parallel)) else {
        return Ok(());
    };
    let mut bound = estimate_shape(&shape, parallel, run_format(cfg), HOST_RUNTIME_BYTES, true);
    if cfg.train.device != "cpu" {
        // Model states and activations live on the device; `check` admits them there (on
        // CUDA; wgpu does not tell its free memory).
        bound = MemoryEstimate {
            states: 0.0,
            activations: 0.0,
            ..bound
        };
    }
    Ok(admit_shape(&shape, bound, limit, parallel.micro_batch)?)
}

/// Fails when the busiest rank's estimated peak exceeds its share of the memory it trains in:
/// the host's, or that of `device`, this rank's CUDA device (first from the shape alone, as
/// [`check_shape`], then for the plan's partition). Where the memory cannot be read, or the
/// cost model cannot describe the run, it admits. Returns the busiest rank's estimate where
/// there is one.
pub fn check(
    cfg: &Config,
    parallel: &ParallelPlan,
    pipeline: &PipelinePlan,
    device: Option<DeviceChoice>,
) -> Result<Option<MemoryEstimate>> {
    let Ok(shape) = cfg.shape() else {
        return Ok(None);
    };
    let ranks = local_ranks(parallel);
    let (limit, runtime) = match cfg.train.device.as_str() {
        "cuda" => (device.and_then(gpu_limit), GPU_RUNTIME_BYTES),
        "wgpu" => (None, GPU_RUNTIME_BYTES),
        _ => (MemoryLimit::host(ranks), HOST_RUNTIME_BYTES),
    };
    let Some(limit) = limit else {
        return Ok(None);
    };
    let bytes = run_format(cfg);
    // The host's share was admitted by `check_shape`; this is the device's.
    let bound = estimate_shape(&shape, parallel, bytes, runtime, false);
    admit_shape(&shape, bound, limit.clone(), parallel.micro_batch)?;
    let global_batch = cfg.train.global_batch;
    let Some(e) = estimate(&shape, parallel, pipeline, global_batch, bytes, runtime) else {
        return Ok(None);
    };
    admit(e, limit, parallel.micro_batch)?;
    Ok(Some(e))
}

/// Logs the busiest rank's estimated peak `e` and its parts, in MiB.
pub fn log_estimate(e: &MemoryEstimate) {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    tracing::info!(
        "memory: estimated peak of the busiest rank {:.1} MiB (model states {:.2}, \
         activations {:.2}, runtime {:.0})",
        mib(e.total()),
        mib(e.states),
        mib(e.activations),
        mib(e.runtime)
    );
}

/// The memory of this rank's CUDA device, shared by the ranks of the node that use it.
#[cfg(feature = "cuda")]
fn gpu_limit(choice: DeviceChoice) -> Option<MemoryLimit> {
    MemoryLimit::gpu(choice.ordinal, choice.ranks_on_device)
}

#[cfg(not(feature = "cuda"))]
fn gpu_limit(_choice: DeviceChoice) -> Option<MemoryLimit> {
    None
}

/// Ranks of the job on this machine (Open MPI says; otherwise all of them).
fn local_ranks(parallel: &ParallelPlan) -> usize {
    merak_burn::rank_env::Launch::from_env()
        .ok()
        .and_then(|l| l.local_size)
        .unwrap_or(parallel.layout().world_size())
        .max(1)
}
