//! The admission check of memory: before anything is built, the planner's memory model
//! estimates each rank's peak for the resolved layout, and a run that will not fit the
//! machine's available memory stops with the estimate, the limit and the keys to change
//! (instead of being killed by the kernel minutes later, with the other processes at risk).

use anyhow::{Result, bail};
use merak_burn::pipeline::PipelinePlan;
use merak_burn::plan::ParallelPlan;
use merak_burn::planner::{CostModel, HardwareSpec, Layout, ModelProxy, RecomputeMode};

use crate::config::Config;

/// The planner counts activations of 16-bit training; merak trains in f32.
const F32_OVER_16BIT: f64 = 2.0;
/// What a rank's process holds besides model states and activations (code, allocator, MPI).
const RUNTIME_BYTES: f64 = 256.0 * 1024.0 * 1024.0;

/// A rank's estimated peak: model states and activations (bytes).
#[derive(Clone, Copy, Debug)]
pub struct Estimate {
    /// Parameters, gradients and optimizer state.
    pub states: f64,
    /// Activations kept for the backward pass, f32.
    pub activations: f64,
}

impl Estimate {
    /// The whole peak, runtime included.
    pub fn total(&self) -> f64 {
        self.states + self.activations + RUNTIME_BYTES
    }
}

/// The estimate of the busiest rank of the run, `None` where the cost model cannot describe
/// the layout.
pub fn estimate(
    cfg: &Config,
    parallel: &ParallelPlan,
    pipeline: &PipelinePlan,
) -> Option<Estimate> {
    let shape = cfg.shape().ok()?;
    let model = ModelProxy::from_shape(shape);
    let size = parallel.dp * parallel.tp * parallel.pp;
    let hw = HardwareSpec::preset("local-cpu")?.with_devices(size);
    let partition = pipeline.partition.clone();
    let recompute = (0..parallel.stages())
        .map(|s| {
            let units = partition.range(s).len();
            let recomputed = pipeline.recompute_units.get(s).copied().unwrap_or(0);
            match recomputed.min(units) {
                0 if parallel.selective_on_rank(s % parallel.pp) => RecomputeMode::Selective,
                0 => RecomputeMode::None,
                // Some or all of the stage's units: counted as full recomputation, so that the
                // estimate errs low rather than refusing a run that fits.
                _ => RecomputeMode::Full,
            }
        })
        .collect();
    let layout = Layout {
        dp: parallel.dp,
        tp: parallel.tp,
        pp: parallel.pp,
        virtual_stages: parallel.virtual_stages,
        micro_batch: parallel.micro_batch,
        micro_batches: parallel.micro_batches(cfg.train.global_batch),
        schedule: parallel.schedule,
        recompute,
        zero1: parallel.zero1,
        partition,
        tp_overlap: parallel.tp_overlap,
    };
    let p = CostModel::new(&model, &hw).predict(&layout).ok()?;
    Some(Estimate {
        states: p.breakdown.get("model_states_bytes").copied()?,
        activations: p.breakdown.get("activations_bytes").copied()? * F32_OVER_16BIT,
    })
}

/// Fails when a rank's estimated peak exceeds its share of the available memory
/// (`MemAvailable` over the ranks on this machine).
pub fn check(cfg: &Config, parallel: &ParallelPlan, pipeline: &PipelinePlan) -> Result<()> {
    let (Some(e), Some(available)) = (estimate(cfg, parallel, pipeline), available_bytes()) else {
        return Ok(());
    };
    let local = local_ranks(parallel);
    let limit = available / local as f64;
    if e.total() <= limit {
        return Ok(());
    }
    let gib = |b: f64| b / (1u64 << 30) as f64;
    bail!(
        "this run needs about {:.1} GiB per rank (model states {:.1} GiB, activations {:.1} GiB \
         for train.micro_batch = {}) but {local} rank(s) share {:.1} GiB of available memory \
         ({:.1} GiB each): lower train.micro_batch or train.global_batch, add ranks \
         (parallel.tp, parallel.pp), or set parallel.recompute = \"full\"",
        gib(e.total()),
        gib(e.states),
        gib(e.activations),
        parallel.micro_batch,
        gib(available),
        gib(limit)
    )
}

/// Ranks of the job on this machine (Open MPI says; otherwise all of them).
fn local_ranks(parallel: &ParallelPlan) -> usize {
    std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(parallel.dp * parallel.tp * parallel.pp)
        .max(1)
}

/// `MemAvailable` of /proc/meminfo in bytes; `None` where it cannot be read.
fn available_bytes() -> Option<f64> {
    meminfo_bytes("MemAvailable").map(|b| b as f64)
}

/// The line `field` of /proc/meminfo (`MemTotal`, `MemAvailable`, ...) in bytes; `None` where
/// it cannot be read.
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
