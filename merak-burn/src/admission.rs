//! The admission check of memory: before anything is built, the planner's memory model
//! estimates each rank's peak for the resolved plan ([`estimate`]), and a run that will not fit
//! the memory its ranks share ([`MemoryLimit`]: the machine's available memory, or a GPU's free
//! memory) stops with the estimate, the limit and the keys to change ([`admit`]), instead of
//! being killed by the kernel (or failing in the allocator) minutes later.
//!
//! Building the pipeline plan and [`estimate`] itself take memory and time per layer, so a
//! shape far beyond any machine (`model.layers = 100000000`) is refused first, from the shape
//! and the degrees alone, in microseconds: [`estimate_shape`] is a lower bound of the busiest
//! rank's peak that builds nothing per layer, [`admit_shape`] refuses it naming the model's
//! keys. Call both in that order:
//!
//! ```
//! use merak_burn::admission::{
//!     HOST_RUNTIME_BYTES, MemoryKind, MemoryLimit, RunFormat, admit_shape, estimate_shape,
//! };
//! use merak_burn::parallel_plan::ParallelPlan;
//! use merak_burn::planner::TransformerShape;
//!
//! let huge = TransformerShape::gpt(100_000_000, 64, 4, 32, 512);
//! let plan = ParallelPlan::default();
//! let limit = MemoryLimit { kind: MemoryKind::Host, available: 64e9, ranks: 1 };
//! let bound = estimate_shape(&huge, &plan, RunFormat::f32(), HOST_RUNTIME_BYTES, true);
//! let refused = admit_shape(&huge, bound, limit, plan.micro_batch).unwrap_err();
//! assert!(refused.to_string().contains("model.layers = 100000000"));
//! ```
//!
//! A mixture of experts counts each rank's `E / ep` routed experts per MoE block (whole under
//! tensor parallelism, their states sharded over the `dp x cp / ep` ranks that hold them) and
//! the activations of the rows they receive at the stated bound
//! [`MoeShape::max_load`](crate::planner::MoeShape::max_load) (`ep > 1`; default
//! [`crate::planner::EXPERT_LOAD_BOUND`]): a rank receives at most that
//! many times its mean share, beyond which the runtime stops with an error instead of running
//! out of memory.

use std::fmt;

use thiserror::Error;

use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{PipelinePlan, Recompute};
use crate::planner::{
    CostModel, EXPERT_LOAD_BOUND, HardwareSpec, ModelProxy, RankSplit, RecomputeMode, StateFormat,
    TransformerShape, UnitProfile, model_states,
};

/// What a rank's process holds on the host besides model states and activations (code,
/// allocator, MPI).
pub const HOST_RUNTIME_BYTES: f64 = 256.0 * MIB;
/// What a rank holds on its GPU besides model states and activations (CUDA context, kernels,
/// the allocator's pools).
pub const GPU_RUNTIME_BYTES: f64 = 512.0 * MIB;

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// The element sizes a run keeps its activations and model states in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunFormat {
    /// Bytes of an activation element: 4 in fp32, 2 under bf16.
    pub activation: f64,
    /// The model states' ([`StateFormat::f32`] for `merak train`, in fp32 and bf16 alike).
    pub states: StateFormat,
}

impl RunFormat {
    /// fp32 activations and fp32 states with AdamW: `merak train`'s default.
    pub fn f32() -> Self {
        Self {
            activation: 4.0,
            states: StateFormat::f32(2),
        }
    }
}

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
pub struct AdmissionError {
    /// The busiest rank's estimate (a lower bound when `shape` is set).
    pub estimate: MemoryEstimate,
    /// The memory it would have.
    pub limit: MemoryLimit,
    /// The micro-batch the activations were counted for.
    pub micro_batch: usize,
    /// Set when the shape alone was refused ([`admit_shape`]): the estimate is then the lower
    /// bound of [`estimate_shape`] and the message names the model's keys (boxed: a shape
    /// with its mixture of experts is large).
    pub shape: Option<Box<TransformerShape>>,
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (e, l) = (&self.estimate, &self.limit);
        let memory = format!(
            "{} rank(s) share {:.1} GiB of {} ({:.1} GiB each)",
            l.ranks,
            l.available / GIB,
            l.kind,
            l.per_rank() / GIB
        );
        let Some(m) = &self.shape else {
            return write!(
                f,
                "this run needs about {:.1} GiB per rank (model states {:.1} GiB, activations \
                 {:.1} GiB for train.micro_batch = {}) but {memory}: lower train.micro_batch or \
                 train.global_batch, add ranks (parallel.tp, parallel.cp for long sequences, \
                 parallel.pp), or set parallel.recompute = \"full\"",
                e.total() / GIB,
                e.states / GIB,
                e.activations / GIB,
                self.micro_batch
            );
        };
        write!(
            f,
            "the model's shape (model.layers = {}, model.hidden = {}, model.vocab_size = {}, \
             model.seq_len = {}) needs at least {:.1} GiB per rank (model states {:.1} GiB, \
             activations {:.1} GiB for train.micro_batch = {}, runtime and bookkeeping {:.1} \
             GiB) but {memory}: lower model.layers or model.hidden (or train.micro_batch), or \
             add ranks (parallel.tp, parallel.cp for long sequences, parallel.pp)",
            m.layers,
            m.hidden,
            m.vocab,
            m.seq,
            e.total() / GIB,
            e.states / GIB,
            e.activations / GIB,
            self.micro_batch,
            e.runtime / GIB
        )
    }
}

/// The estimated peak of the busiest rank of `plan` (cut into `pipeline`) training `model` on
/// `global_batch` sequences per step, keeping its activations and model states in `format`,
/// and `runtime` bytes besides; `None` where the cost model cannot
/// describe the plan. Context and sequence parallelism count through the plan's layout
/// ([`ParallelPlan::planned_layout`]): a rank keeps the activations of its `s / cp` tokens
/// (and under sequence parallelism `1 / tp` of what tensor parallelism leaves whole), and
/// ZeRO shards over the `dp x cp` ranks that hold the same parameters.
pub fn estimate(
    model: &TransformerShape,
    plan: &ParallelPlan,
    pipeline: &PipelinePlan,
    global_batch: usize,
    format: RunFormat,
    runtime: f64,
) -> Option<MemoryEstimate> {
    let layout = plan.planned_layout(pipeline, global_batch);
    let hw = HardwareSpec::preset("local-cpu")?.with_devices(layout.gpus());
    let proxy = ModelProxy::from_shape(*model);
    let p = CostModel::new(&proxy, &hw)
        .with_expert_load(max_load(model))
        .with_state_format(format.states)
        .predict(&layout)
        .ok()?;
    // The cost model counts activations of 16-bit training.
    let activations = p.breakdown.get("activations_bytes").copied()? * format.activation / 2.0;
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
        shape: None,
    })
}

/// Host bytes the planner's proxy and the pipeline's cost arrays take per unit (embedding,
/// block, head) of a model, whatever the device: what building the pipeline plan and
/// [`estimate`] allocate before the model exists.
pub const BOOKKEEPING_BYTES_PER_UNIT: f64 =
    (std::mem::size_of::<UnitProfile>() + 4 * std::mem::size_of::<f64>()) as f64;

/// The host bytes of [`BOOKKEEPING_BYTES_PER_UNIT`] for every unit of `model`.
pub fn bookkeeping_bytes(model: &TransformerShape) -> f64 {
    (model.layers as f64 + 2.0) * BOOKKEEPING_BYTES_PER_UNIT
}

/// A lower bound of the busiest rank's peak under `plan` (micro-batch `plan.micro_batch`),
/// from the shape and the degrees alone: nothing per layer is built, so it answers at once for
/// any shape.
///
/// Model states and one micro-batch's activations (under the recomputation of the plan that
/// keeps the least, [`least_kept`]; counted at 16 bits, or `activation_bytes` per element if
/// fewer) are summed over the units and shared evenly by the pipeline ranks: the busiest holds
/// at least the mean, less the recomputation workspace by which the ranks' peaks may differ
/// (one unit's activations), which is taken off. `runtime` is added, and on the host (`host`)
/// the [`bookkeeping_bytes`] too. So the [`estimate`] of the same plan, whatever its
/// partition, is never smaller (with the same `runtime`).
pub fn estimate_shape(
    model: &TransformerShape,
    plan: &ParallelPlan,
    format: RunFormat,
    runtime: f64,
    host: bool,
) -> MemoryEstimate {
    let (t, b, p) = (
        plan.tp.max(1),
        plan.micro_batch.max(1),
        plan.pp.max(1) as f64,
    );
    let ep = plan.ep.max(1);
    let split = RankSplit::new(t, plan.cp.max(1), plan.sequence_parallel).with_ep(ep);
    let units: Vec<_> = (model.counted_units().into_iter())
        .filter(|(_, n)| *n > 0)
        .collect();
    let sum = |f: &dyn Fn(&UnitProfile) -> f64| -> f64 {
        units.iter().map(|(u, n)| *n as f64 * f(u)).sum()
    };
    let params = sum(&|u| u.params_per_rank(t));
    let experts = sum(&|u| u.params_expert as f64 / ep as f64);
    let kept = |u: &UnitProfile, mode| {
        u.activation_bytes(b, split, mode, true)
            + u.expert_activation_bytes(b, split, mode, max_load(model))
    };
    // ZeRO-3 recomputes every unit.
    let mode = match plan.zero {
        3 => RecomputeMode::Full,
        _ => least_kept(plan),
    };
    // The CPU attention is blockwise (no probabilities kept); for other devices leaving them
    // out keeps this a lower bound.
    let activations = sum(&|u| kept(u, mode));
    let workspace = match mode {
        RecomputeMode::None => 0.0,
        _ => (units.iter())
            .map(|(u, _)| kept(u, RecomputeMode::None))
            .fold(0.0, f64::max),
    };
    // Sharded over the shard group (hybrid sharding) or all of dp, with their context-parallel
    // peers; the experts' over the ranks holding the same experts, TP peers included.
    let sharding = plan.state_sharding();
    let held = model_states(params, experts, &sharding, &format.states);
    let states = held.total() / p;
    // The cost model counts activations of 16-bit training.
    let activations = activations * (format.activation / 2.0).min(1.0) / p - workspace;
    MemoryEstimate {
        states: (states + activations.min(0.0)).max(0.0),
        activations: activations.max(0.0),
        runtime: runtime + if host { bookkeeping_bytes(model) } else { 0.0 },
    }
}

/// The stated bound on the rows an expert-parallel rank receives over its mean
/// ([`MoeShape::max_load`](crate::planner::MoeShape::max_load)).
fn max_load(model: &TransformerShape) -> f64 {
    model.moe.map_or(EXPERT_LOAD_BOUND, |m| m.max_load) as f64
}

/// Of the recomputation modes `plan` may give a stage, the one that keeps the fewest
/// activations (full, then selective, then none).
pub fn least_kept(plan: &ParallelPlan) -> RecomputeMode {
    let modes = match plan.stage_recompute.as_slice() {
        [] => vec![match plan.recompute {
            Recompute::None => RecomputeMode::None,
            Recompute::Selective => RecomputeMode::Selective,
            Recompute::Full | Recompute::StageAware => RecomputeMode::Full,
        }],
        given => given.to_vec(),
    };
    [RecomputeMode::Full, RecomputeMode::Selective]
        .into_iter()
        .find(|m| modes.contains(m))
        .unwrap_or(RecomputeMode::None)
}

/// Admits the shape `model` whose lower bound ([`estimate_shape`]) is `estimate`, when it fits
/// its share of `limit`; the error names the model's keys and `micro_batch`.
pub fn admit_shape(
    model: &TransformerShape,
    estimate: MemoryEstimate,
    limit: MemoryLimit,
    micro_batch: usize,
) -> Result<(), AdmissionError> {
    admit(estimate, limit, micro_batch).map_err(|e| AdmissionError {
        shape: Some(Box::new(*model)),
        ..e
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
        estimate(&model, plan, &pipeline, global_batch, RunFormat::f32(), 0.0).expect("estimate")
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

    /// 16384 tokens of a 4 x 512 GPT in f32: about 2.5 GB of activations on one rank, 1/4 of
    /// them on each rank of a ring of 4; the model states stay (no ZeRO).
    #[test]
    fn a_long_sequence_refused_at_cp_1_is_admitted_at_cp_4() {
        let model = TransformerShape::gpt(4, 512, 8, 16384, 1000);
        let at = |cp: usize, tp: usize, sequence_parallel: bool| {
            let plan = ParallelPlan {
                cp,
                tp,
                sequence_parallel,
                ..ParallelPlan::default()
            };
            let pipeline = plan.pipeline(&model, 1).expect("pipeline");
            let e = estimate(&model, &plan, &pipeline, 1, RunFormat::f32(), 0.0).expect("estimate");
            let bound = estimate_shape(&model, &plan, RunFormat::f32(), 0.0, false);
            assert!(bound.total() <= e.total(), "{plan:?}: {bound:?} vs {e:?}");
            e
        };
        let (one, four) = (at(1, 1, false), at(4, 1, false));
        // f32: twice the 16-bit bytes of 4 blocks (34 s h each), the embedding's mask (s h)
        // and the head's inputs and fp32 logits (4 s h + 4 s V).
        let (s, h, v) = (16384.0, 512.0, 1000.0);
        let want = 2.0 * (4.0 * 34.0 * s * h + s * h + 4.0 * s * h + 4.0 * s * v);
        assert!(
            (one.activations / want - 1.0).abs() < 1e-12,
            "{one:?} vs {want}"
        );
        assert!((one.activations / four.activations - 4.0).abs() < 1e-12);
        assert_eq!(one.states, four.states);
        let limit = MemoryLimit {
            kind: MemoryKind::Host,
            available: 1.5 * GIB,
            ranks: 1,
        };
        assert!(
            one.total() > 2.5 * GIB && four.total() < 1.0 * GIB,
            "{one:?} {four:?}"
        );
        let refused = admit(one, limit.clone(), 1).expect_err("2.6 GiB > 1.5 GiB");
        let msg = refused.to_string();
        assert!(
            msg.contains("needs about 2.6 GiB") && msg.contains("parallel.cp"),
            "{msg}"
        );
        assert_eq!(admit(four, limit, 1), Ok(()));
        // Sequence parallelism at tp = 2: a block keeps 34/2 instead of 10 + 24/2 of s h.
        let (tp, sp) = (at(1, 2, false), at(1, 2, true));
        let saved = 2.0 * (4.0 * 10.0 + 1.0 + 4.0) * s * h / 2.0;
        assert!(((tp.activations - sp.activations) / saved - 1.0).abs() < 1e-12);
        // ZeRO shards over the dp x cp ranks that hold the same parameters.
        let zero = |dp, cp| {
            let plan = ParallelPlan {
                dp,
                cp,
                zero: 1,
                ..ParallelPlan::default()
            };
            let pipeline = plan.pipeline(&model, 4).expect("pipeline");
            estimate(&model, &plan, &pipeline, 4, RunFormat::f32(), 0.0).expect("estimate")
        };
        assert_eq!(zero(1, 4).states, zero(4, 1).states);
        // fp32 with AdamW: 4 + 4 bytes whole and 8 sharded over 4, against 16.
        let share = zero(1, 4).states / four.states;
        assert!((share - (8.0 + 8.0 / 4.0) / 16.0).abs() < 1e-12, "{share}");
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
    fn the_shape_bound_never_exceeds_the_estimate() {
        use crate::pipeline::ScheduleKind;
        let shapes = [
            gpt2_small(),
            TransformerShape::bert(4, 128, 4, 64, 1000),
            TransformerShape::gpt(2, 64, 4, 32, 512),
        ];
        let plans = [
            (1, 1, 1, 1, ScheduleKind::OneFOneB, Recompute::None, false),
            (2, 2, 1, 4, ScheduleKind::OneFOneB, Recompute::None, true),
            (1, 1, 2, 1, ScheduleKind::GPipe, Recompute::Full, false),
            (
                1,
                2,
                4,
                2,
                ScheduleKind::OneFOneB,
                Recompute::StageAware,
                false,
            ),
            (2, 1, 2, 1, ScheduleKind::TwoBw, Recompute::Selective, true),
        ];
        for model in shapes {
            for (dp, tp, pp, micro_batch, schedule, recompute, zero1) in plans {
                let plan = ParallelPlan {
                    dp,
                    tp,
                    pp,
                    micro_batch,
                    schedule,
                    recompute,
                    zero: u8::from(zero1),
                    ..ParallelPlan::default()
                };
                let global_batch = 8 * dp * micro_batch;
                let pipeline = plan.pipeline(&model, global_batch).expect("pipeline");
                for activation in [2.0, 4.0] {
                    let bytes = RunFormat {
                        activation,
                        ..RunFormat::f32()
                    };
                    let full = estimate(&model, &plan, &pipeline, global_batch, bytes, 0.0)
                        .expect("estimate");
                    let bound = estimate_shape(&model, &plan, bytes, 0.0, false);
                    // A bound, and not a vacuous one: at least the mean model states less
                    // one unit's activations.
                    assert!(
                        bound.total() <= full.total() && bound.states > 0.1 * full.states,
                        "{model} {plan:?}: {bound:?} vs {full:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_shape_beyond_any_machine_is_refused_at_once_naming_the_keys() {
        let huge = TransformerShape::gpt(100_000_000, 64, 4, 32, 512);
        let plan = ParallelPlan::default();
        let start = std::time::Instant::now();
        let bound = estimate_shape(&huge, &plan, RunFormat::f32(), HOST_RUNTIME_BYTES, true);
        let limit = MemoryLimit {
            kind: MemoryKind::Host,
            available: 64.0 * GIB,
            ranks: 2,
        };
        let msg = admit_shape(&huge, bound, limit.clone(), 1)
            .expect_err("80 TB of model states")
            .to_string();
        assert!(start.elapsed().as_millis() < 50, "{:?}", start.elapsed());
        let need = format!("needs at least {:.1} GiB per rank", bound.total() / GIB);
        for part in [
            "model.layers = 100000000",
            "model.hidden = 64",
            &need,
            "2 rank(s) share 64.0 GiB of available host memory (32.0 GiB each)",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        // 12 h² + 13 h parameters per layer at 16 bytes, and the bookkeeping per unit.
        let states = 1e8 * (12.0 * 64.0 * 64.0 + 13.0 * 64.0) * 16.0;
        assert!((bound.states / states - 1.0).abs() < 1e-3, "{bound:?}");
        assert!(bound.runtime > 1e8 * BOOKKEEPING_BYTES_PER_UNIT);
        let small = TransformerShape::gpt(2, 64, 4, 32, 512);
        let bound = estimate_shape(&small, &plan, RunFormat::f32(), HOST_RUNTIME_BYTES, true);
        assert_eq!(admit_shape(&small, bound, limit, 1), Ok(()));
    }

    #[test]
    fn meminfo_reads_the_machines_memory() {
        let total = meminfo_bytes("MemTotal").expect("Linux has /proc/meminfo");
        assert!(total > 64 << 20);
        assert_eq!(meminfo_bytes("NoSuchField"), None);
        assert!(MemoryLimit::host(2).is_some_and(|l| l.per_rank() > 0.0));
    }
}
