//! The admission check of memory: before anything is built, the planner's memory model
//! estimates each rank's peak for the resolved plan ([`estimate`]), and a run that will not fit
//! the memory its ranks share ([`MemoryLimit`]: the machine's available memory, or a GPU's free
//! memory) stops with the estimate, the limit and the keys to change ([`admit`]), instead of
//! being killed by the kernel (or failing in the allocator) minutes later.

use std::fmt;

use thiserror::Error;

use crate::pipeline::PipelinePlan;
use crate::plan::ParallelPlan;
use crate::planner::{CostModel, HardwareSpec, ModelProxy, TransformerShape};

/// What a rank's process holds on the host besides model states and activations (code,
/// allocator, MPI).
pub const HOST_RUNTIME_BYTES: f64 = 256.0 * MIB;
/// What a rank holds on its GPU besides model states and activations (CUDA context, kernels,
/// the allocator's pools).
pub const GPU_RUNTIME_BYTES: f64 = 512.0 * MIB;

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// A rank's estimated peak memory (bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters, gradients and optimizer state.
    pub states: f64,
    /// Activations kept for the backward pass.
    pub activations: f64,
    /// What the process holds besides both ([`HOST_RUNTIME_BYTES`], [`GPU_RUNTIME_BYTES`]).
    pub runtime: f64,
}

impl MemoryEstimate {
    /// The whole peak.
    pub fn total(&self) -> f64 {
        self.states + self.activations + self.runtime
    }
}

/// The memory that a run's ranks share.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryLimit {
    /// Whose memory.
    pub kind: MemoryKind,
    /// Bytes available to the run.
    pub available: f64,
    /// Ranks that share them (at least 1).
    pub ranks: usize,
}

/// Which memory a [`MemoryLimit`] describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// The machine's available memory (`MemAvailable` of /proc/meminfo).
    Host,
    /// The free memory of CUDA device `ordinal`.
    Gpu {
        /// The device's ordinal.
        ordinal: usize,
    },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => write!(f, "available host memory"),
            MemoryKind::Gpu { ordinal } => write!(f, "free memory of CUDA device {ordinal}"),
        }
    }
}

impl MemoryLimit {
    /// Each rank's share.
    pub fn per_rank(&self) -> f64 {
        self.available / self.ranks.max(1) as f64
    }

    /// The host's available memory shared by `ranks` ranks; `None` where /proc/meminfo cannot
    /// be read.
    pub fn host(ranks: usize) -> Option<Self> {
        Some(Self {
            kind: MemoryKind::Host,
            available: meminfo_bytes("MemAvailable")? as f64,
            ranks: ranks.max(1),
        })
    }

    /// The free memory of CUDA device `ordinal` shared by `ranks` ranks; `None` where the CUDA
    /// driver is missing or cannot query the device (the backend then reports it).
    #[cfg(feature = "cuda")]
    pub fn gpu(ordinal: usize, ranks: usize) -> Option<Self> {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return None;
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
        let (free, _total) = ctx.mem_get_info().ok()?;
        Some(Self {
            kind: MemoryKind::Gpu { ordinal },
            available: free as f64,
            ranks: ranks.max(1),
        })
    }
}

/// A run that does not fit its memory; the message names the estimate, the limit and the keys
/// to change.
#[derive(Clone, Debug, Error, PartialEq)]
#[error(
    "this run needs about {need:.1} GiB per rank (model states {states:.1} GiB, activations \
     {act:.1} GiB for train.micro_batch = {micro_batch}) but {ranks} rank(s) share {avail:.1} \
     GiB of {kind} ({each:.1} GiB each): lower train.micro_batch or train.global_batch, add \
     ranks (parallel.tp, parallel.pp), or set parallel.recompute = \"full\"",
    need = .estimate.total() / GIB,
    states = .estimate.states / GIB,
    act = .estimate.activations / GIB,
    ranks = .limit.ranks,
    avail = .limit.available / GIB,
    kind = .limit.kind,
    each = .limit.per_rank() / GIB
)]
pub struct AdmissionError {
    /// The busiest rank's estimate.
    pub estimate: MemoryEstimate,
    /// The memory it would have.
    pub limit: MemoryLimit,
    /// The micro-batch the activations were counted for.
    pub micro_batch: usize,
}

/// The estimated peak of the busiest rank of `plan` (cut into `pipeline`) training `model` on
/// `global_batch` sequences per step, with activations of `activation_bytes` bytes per element
/// (4 for f32, 2 for bf16) and `runtime` bytes besides; `None` where the cost model cannot
/// describe the plan.
pub fn estimate(
    model: &TransformerShape,
    plan: &ParallelPlan,
    pipeline: &PipelinePlan,
    global_batch: usize,
    activation_bytes: f64,
    runtime: f64,
) -> Option<MemoryEstimate> {
    let layout = plan.planned_layout(pipeline, global_batch);
    let hw = HardwareSpec::preset("local-cpu")?.with_devices(plan.dp * plan.tp * plan.pp);
    let proxy = ModelProxy::from_shape(*model);
    let p = CostModel::new(&proxy, &hw).predict(&layout).ok()?;
    // The cost model counts activations of 16-bit training.
    let activations = p.breakdown.get("activations_bytes").copied()? * activation_bytes / 2.0;
    Some(MemoryEstimate {
        states: p.breakdown.get("model_states_bytes").copied()?,
        activations,
        runtime,
    })
}

/// Admits a run whose busiest rank needs `estimate` when it gets its share of `limit`.
pub fn admit(
    estimate: MemoryEstimate,
    limit: MemoryLimit,
    micro_batch: usize,
) -> Result<(), AdmissionError> {
    if estimate.total() <= limit.per_rank() {
        return Ok(());
    }
    Err(AdmissionError {
        estimate,
        limit,
        micro_batch,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::PRESETS;

    fn gpt2_small() -> TransformerShape {
        PRESETS
            .iter()
            .find(|(name, _)| *name == "gpt2")
            .map(|(_, shape)| *shape)
            .expect("preset")
    }

    fn peak(plan: &ParallelPlan, global_batch: usize) -> MemoryEstimate {
        let model = gpt2_small();
        let pipeline = plan.pipeline(&model, global_batch).expect("pipeline");
        estimate(&model, plan, &pipeline, global_batch, 4.0, 0.0).expect("estimate")
    }

    #[test]
    fn activations_grow_with_the_micro_batch_and_states_shrink_with_tp() {
        let one = ParallelPlan::default();
        let big = ParallelPlan {
            micro_batch: 8,
            ..ParallelPlan::default()
        };
        let (a, b) = (peak(&one, 8), peak(&big, 8));
        assert!(b.activations > 7.0 * a.activations, "{a:?} {b:?}");
        assert_eq!(a.states, b.states);
        let tp2 = ParallelPlan {
            tp: 2,
            ..ParallelPlan::default()
        };
        assert!(peak(&tp2, 8).states < 0.6 * a.states);
        // 124M parameters: 16 bytes each (f32 weights, gradients, two Adam moments).
        assert!((a.states / 124e6 - 16.0).abs() < 1.5, "{a:?}");
    }

    #[test]
    fn a_run_over_its_share_is_refused_naming_the_numbers_and_keys() {
        let e = MemoryEstimate {
            states: 2.0 * GIB,
            activations: 1.0 * GIB,
            runtime: 0.5 * GIB,
        };
        let limit = MemoryLimit {
            kind: MemoryKind::Gpu { ordinal: 1 },
            available: 6.0 * GIB,
            ranks: 2,
        };
        let err = admit(e, limit.clone(), 4).expect_err("3.5 GiB > 3 GiB");
        let msg = err.to_string();
        for part in [
            "3.5 GiB per rank",
            "model states 2.0 GiB",
            "activations 1.0 GiB for train.micro_batch = 4",
            "2 rank(s) share 6.0 GiB of free memory of CUDA device 1 (3.0 GiB each)",
            "train.global_batch",
            "parallel.recompute",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        let roomy = MemoryLimit { ranks: 1, ..limit };
        assert_eq!(admit(e, roomy, 4), Ok(()));
    }

    #[test]
    fn meminfo_reads_the_machines_memory() {
        let total = meminfo_bytes("MemTotal").expect("Linux has /proc/meminfo");
        assert!(total > 64 << 20);
        assert_eq!(meminfo_bytes("NoSuchField"), None);
        assert!(MemoryLimit::host(2).is_some_and(|l| l.per_rank() > 0.0));
    }
}
