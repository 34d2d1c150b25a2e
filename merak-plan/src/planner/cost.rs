//! The cost model: predicted step time and per-rank memory of a 3D-parallel [`Layout`].
//!
//! Time. For every global pipeline stage the forward, backward and recomputation times of one
//! micro-batch are its FLOPs on one tensor-parallel rank divided by the matrix products'
//! achievable FLOP/s ([`HardwareSpec::achievable_flops`]), plus the bytes its memory-bound
//! operations move ([`UnitProfile::forward_memory_bytes`](super::model::UnitProfile), twice
//! that backward) over the sustained memory bandwidth, so a layer's share of peak grows with
//! its size, plus its tensor-parallel
//! all-reduces (ring: `2 (t-1)/t * bytes / bandwidth + latency` each, on the intra-node link
//! when the `t` ranks fit in a node), of which sub-pipelined tensor parallelism
//! ([`Layout::tp_overlap`]) hides part behind compute (see `tp_exposed`). These costs and the
//! point-to-point message time drive a discrete-event simulation of the actual schedule
//! ([`pipeline::simulate`](crate::pipeline::simulate())), so the bubble is what the schedule
//! really does with unequal stages, recomputation and messages. Large micro-batch counts are
//! simulated at two smaller counts in the steady state and extrapolated linearly (exact for
//! equal stages); simulations are cached. After the pipeline drains, each rank pays the part
//! of its data-parallel gradient all-reduce (`2 (d-1)/d` of its 16-bit gradients) that its last
//! micro-batch's backward pass could not hide, the optimizer step (memory-bound: 28 bytes per
//! local parameter) and, with ZeRO-1, the all-gather of the updated parameters.
//!
//! Context parallelism (`cp`) gives each rank `s/cp` tokens of every sequence: its compute,
//! memory-bound work, TP all-reduces, activations and pipeline messages are `1/cp` of a whole
//! sequence's, and its attention's keys and values travel around a ring of the `cp` ranks,
//! each hop hidden behind the attention of one block as far as it lasts (see `ring_exposed`);
//! for the parameters it is data parallelism (gradients all-reduced and ZeRO sharded over
//! `dp * cp` ranks). Sequence parallelism splits what tensor parallelism leaves whole (the
//! LayerNorms' and dropouts' activations, memory-bound work and the pipeline messages) over the
//! `t` ranks; its reduce-scatters and all-gathers move the bytes of the all-reduces they
//! replace, so they cost the same ([`RankSplit`]).
//!
//! Mixture of experts (`ep`, see [`MoeShape`](super::MoeShape)): a MoE block's compute is its
//! attention, router and the `top_k` (plus shared) experts' MLPs a token uses, the routed
//! experts' matrix products [`EXPERT_IMBALANCE`] times longer under expert parallelism (the
//! busiest rank sets the pace); per micro-batch it adds two all-to-alls forward (dispatch,
//! combine), two backward and two more when full recomputation repeats the forward pass, each
//! moving `top_k b s h / (cp t)` 16-bit values per rank of which `(ep - 1)/ep` leave it (see
//! `alltoall`). A rank holds `E / ep` routed experts per MoE block whole (tensor parallelism
//! does not split them); their gradients are reduced over the `dp cp / ep` ranks that hold the
//! same experts with their `tp` peers, and ZeRO shards their states over the `dp cp / ep`.
//!
//! Memory. Per pipeline rank: model states by the one accounting of
//! [`memory`](super::memory) (mixed-precision Adam: 16 bytes per parameter, `4 + 12/d` with
//! ZeRO-1, `16/d` with ZeRO-3 reduce-scattering every micro-batch; an fp32 calibration
//! counts fp32 states),
//! for each of its stages the activations of one micro-batch (per the stage's
//! [`RecomputeMode`]) times the most micro-batches that stage holds at once
//! ([`Schedule::max_in_flight`](crate::pipeline::Schedule::max_in_flight)), a second 16-bit
//! weight version under PipeDream-2BW, plus a workspace: the largest unit's full activations
//! (rebuilt during its backward pass) and [`FRAMEWORK_BYTES`].

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::calibration::{Calibration, UnitKind};
use super::hardware::HardwareSpec;
use super::memory::{GATHERED_AHEAD, StateFormat, StateSharding, gathered_bytes, model_states};
use super::model::{
    BYTES_16BIT, EXPERT_IMBALANCE, ModelProxy, RankSplit, RecomputeMode, UnitProfile,
};
use crate::data_parallel::ReduceScatter;
use crate::pipeline::schedule::stage_of_chunk;
use crate::pipeline::{
    Costs, Partition, ScheduleError, ScheduleKind, ValidationError, build_schedule,
    steady_step_time,
};

/// Memory every rank needs besides model states and activations: CUDA context, communication
/// buffers, allocator slack.
pub const FRAMEWORK_BYTES: f64 = 1.0 * 1024.0 * 1024.0 * 1024.0;

/// Bytes the optimizer step reads and writes per parameter (mixed-precision Adam: fp32 master
/// weight, two moments, 16-bit gradient read; the same written back with the 16-bit weight).
const OPTIMIZER_BYTES_PER_PARAM: f64 = 28.0;

/// A layout that cannot be costed.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CostError {
    /// A degree or count of zero.
    #[error("layout field `{field}` must be at least 1, got 0")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// The partition does not match the model or the pipeline.
    #[error(
        "the partition has {stages} stages over {units} units, but the layout needs \
         {expected_stages} stages (pp x virtual_stages) over the model's {expected_units} units"
    )]
    Partition {
        /// Stages of the partition.
        stages: usize,
        /// Units of the partition.
        units: usize,
        /// `pp * virtual_stages`.
        expected_stages: usize,
        /// The model's units.
        expected_units: usize,
    },
    /// `recompute` does not have one entry per stage.
    #[error("recompute has {got} entries for {stages} stages")]
    RecomputeLength {
        /// Entries.
        got: usize,
        /// Stages.
        stages: usize,
    },
    /// The overlap degree does not divide the tokens of a micro-batch.
    #[error(
        "tp_overlap = {overlap} does not divide the {tokens} tokens of a micro-batch \
         (micro_batch x sequence length / cp; under sequence parallelism the sequence length \
         / (cp x tp))"
    )]
    Overlap {
        /// The overlap degree.
        overlap: usize,
        /// Tokens per micro-batch.
        tokens: usize,
    },
    /// Context parallelism's zigzag split does not cut the sequence.
    #[error(
        "cp = {cp}: 2 x cp must divide the sequence length {seq} (each rank of the ring holds \
         two zigzag chunks)"
    )]
    ContextSplit {
        /// The context-parallel degree.
        cp: usize,
        /// The sequence length.
        seq: usize,
    },
    /// Sequence parallelism without tensor parallelism, or not dividing a rank's tokens.
    #[error(
        "sequence parallelism needs tp > 1 dividing the {tokens} tokens of a sequence that a \
         rank holds (sequence length / cp); tp = {tp}"
    )]
    SequenceParallel {
        /// The tensor-parallel degree.
        tp: usize,
        /// Tokens per sequence per rank.
        tokens: usize,
    },
    /// An expert-parallel degree that does not divide the ranks holding the same parameters or
    /// the experts (or `ep > 1` for a model without experts).
    #[error(
        "ep = {ep} must divide dp x cp = {replicas} and the model's {experts} experts (expert \
         parallelism splits the experts over data-parallel ranks)"
    )]
    ExpertParallel {
        /// The expert-parallel degree.
        ep: usize,
        /// `dp * cp`.
        replicas: usize,
        /// Routed experts of a MoE layer (0 for a dense model).
        experts: usize,
    },
    /// Tensor parallelism of a mixture of experts without sequence parallelism.
    #[error(
        "tp = {tp} with a mixture of experts needs sequence parallelism (each tensor-parallel \
         rank routes its own positions to whole experts)"
    )]
    ExpertsNeedSequenceParallel {
        /// The tensor-parallel degree.
        tp: usize,
    },
    /// Context or sequence parallelism for a model whose sequence length is unknown (a proxy
    /// without a transformer shape).
    #[error(
        "cp > 1 and sequence parallelism need the model's sequence length; this model has no \
         transformer shape"
    )]
    UnknownSequence,
    /// The schedule cannot be built.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The simulation failed.
    #[error(transparent)]
    Simulation(#[from] ValidationError),
}

/// A 3D-parallel training layout: everything the cost model needs to predict it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline ranks.
    pub pp: usize,
    /// Model chunks per pipeline rank (`> 1` only for the interleaved schedule).
    pub virtual_stages: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step (per data-parallel replica).
    pub micro_batches: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Per global stage (`pp * virtual_stages`), how it treats activations.
    pub recompute: Vec<RecomputeMode>,
    /// The ZeRO stage over data parallelism: 0 none, 1 the optimizer states sharded, 2 the
    /// gradients too, 3 the parameters too (every unit recomputed, its parameters gathered
    /// before its forward and backward passes). Plan files of earlier versions say
    /// `"zero1": true` for stage 1.
    #[serde(alias = "zero1", deserialize_with = "super::zero_stage", default)]
    pub zero: u8,
    /// Under ZeRO-2 and 3 with several micro-batches: the gradients reduce-scattered once per
    /// step (whole buckets add up) or every micro-batch (only chunks add up, `m` times the
    /// traffic).
    #[serde(default)]
    pub reduce_scatter: ReduceScatter,
    /// Hybrid sharding under ZeRO: the data-parallel ranks that share one copy's slices (a
    /// divisor of `dp`; 0 or `dp`: all of them), the `dp / shard` copies summing each chunk.
    #[serde(default)]
    pub shard: usize,
    /// Under ZeRO-3: each unit's gathered parameters freed after its forward pass and
    /// gathered again for its recomputed backward pass (true: the default, and in plan files
    /// of earlier versions), or the rank's parameters gathered once per step and kept whole
    /// until the update (false: nothing recomputed).
    #[serde(default = "super::yes")]
    pub reshard_after_forward: bool,
    /// The model's units cut into `pp * virtual_stages` stages.
    pub partition: Partition,
    /// Sub-pipelined tensor parallelism (Merak, Oases): each micro-batch's tokens are split into
    /// this many chunks inside every tensor-parallel block, so the all-reduce of chunk `i` runs
    /// while chunk `i + 1` computes. 1 (the default): no overlap.
    #[serde(default = "super::one")]
    pub tp_overlap: usize,
    /// Context-parallel degree: each sequence cut over `cp` ranks (two zigzag chunks each, the
    /// keys and values passed around a ring), folded into data parallelism for the parameters
    /// (gradients reduced and ZeRO sharded over `dp x cp` ranks). 1 (the default, and in plan
    /// files of earlier versions): none.
    #[serde(default = "super::one")]
    pub cp: usize,
    /// Sequence parallelism (tp > 1): between the tensor-parallel blocks each TP rank holds
    /// `1 / tp` of the positions (false by default, and in plan files of earlier versions).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Expert-parallel degree (a mixture of experts): each group of `ep` consecutive ranks of
    /// the `dp x cp` that hold the same parameters splits every MoE layer's routed experts
    /// (a divisor of `dp x cp` and of the experts). 1 (the default, and in plan files of
    /// earlier versions): every rank holds every expert.
    #[serde(default = "super::one")]
    pub ep: usize,
}

impl Layout {
    /// `zero=N`, with `reduce_scatter=micro-batch` when stage 2 or 3 reduce-scatters every
    /// micro-batch and `shard=S` under hybrid sharding: how plan listings name the ZeRO
    /// settings.
    pub fn zero_label(&self) -> String {
        let mut label = format!("zero={}", self.zero);
        if self.zero >= 2 && self.reduce_scatter == ReduceScatter::MicroBatch {
            label += &format!(" reduce_scatter={}", self.reduce_scatter);
        }
        if self.shard_degree() < self.dp {
            label += &format!(" shard={}", self.shard_degree());
        }
        label
    }

    /// The data-parallel ranks that share one copy's slices: `shard` when it is a proper
    /// divisor of dp under ZeRO (hybrid sharding), else all of dp.
    pub fn shard_degree(&self) -> usize {
        let s = self.shard;
        if self.zero == 0 || s == 0 || s >= self.dp || !self.dp.is_multiple_of(s) {
            self.dp
        } else {
            s
        }
    }

    /// How ZeRO cuts a rank's model states under this layout ([`StateSharding::of`]).
    pub fn state_sharding(&self) -> StateSharding {
        StateSharding::of(
            self.zero,
            self.dp,
            self.shard,
            self.split(),
            self.reduce_scatter,
            self.schedule.weight_versions(),
        )
    }

    /// Devices used: `dp * cp * tp * pp` (saturating).
    pub fn gpus(&self) -> usize {
        (self.dp.saturating_mul(self.cp))
            .saturating_mul(self.tp)
            .saturating_mul(self.pp)
    }

    /// How one micro-batch is split over its ranks: tensor, context, sequence and expert
    /// parallelism.
    pub fn split(&self) -> RankSplit {
        RankSplit::new(self.tp, self.cp, self.sequence_parallel).with_ep(self.ep)
    }

    /// The ranks that hold the same parameters: `dp * cp` (context parallelism is folded into
    /// data parallelism for the gradients and ZeRO).
    pub fn replicas(&self) -> usize {
        self.dp.saturating_mul(self.cp.max(1))
    }

    /// The ranks that hold the same routed experts: `dp * cp / ep` (at least 1).
    pub fn expert_replicas(&self) -> usize {
        (self.replicas() / self.ep.max(1)).max(1)
    }

    /// `cp=C` when context parallelism is on, `sp` under sequence parallelism, `ep=E` under
    /// expert parallelism, joined by a space (empty when none): how plan listings name them.
    pub fn sequence_label(&self) -> String {
        let mut parts = Vec::new();
        if self.cp > 1 {
            parts.push(format!("cp={}", self.cp));
        }
        if self.sequence_parallel {
            parts.push("sp".to_string());
        }
        if self.ep > 1 {
            parts.push(format!("ep={}", self.ep));
        }
        parts.join(" ")
    }

    /// Sequences per step: `dp * micro_batch * micro_batches` (saturating).
    pub fn global_batch(&self) -> usize {
        self.dp
            .saturating_mul(self.micro_batch)
            .saturating_mul(self.micro_batches)
    }

    /// Global pipeline stages `pp * virtual_stages`.
    pub fn stages(&self) -> usize {
        self.pp * self.virtual_stages
    }

    /// Whether every stage recomputes fully.
    pub fn full_recompute(&self) -> bool {
        self.recompute.iter().all(|&m| m == RecomputeMode::Full)
    }
}

/// What the cost model predicts for a layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prediction {
    /// Seconds per training step.
    pub step_time_s: f64,
    /// TFLOP/s per device, with the Megatron-LM FLOP count of `ModelProxy::reported_flops` (the
    /// full-recompute formula when every stage recomputes fully; see "FLOPs and MFU" in
    /// `docs/src/contributing/architecture.md`).
    pub tflops_per_gpu: f64,
    /// Peak memory of each pipeline rank, bytes.
    pub peak_memory_bytes: Vec<u64>,
    /// Named terms: times in seconds (`*_s`), memory in bytes (`*_bytes`, of the rank with the
    /// highest peak).
    pub breakdown: BTreeMap<String, f64>,
}

impl Prediction {
    /// The largest per-rank peak memory.
    pub fn max_memory_bytes(&self) -> u64 {
        self.peak_memory_bytes.iter().copied().max().unwrap_or(0)
    }
}

/// The quick part of a prediction: memory exactly, time as a lower bound (no bubble).
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// Peak memory per pipeline rank, bytes.
    pub peak_memory_bytes: Vec<u64>,
    /// A lower bound of the predicted step time: the busiest rank's compute and communication
    /// plus the post-pipeline terms.
    pub time_lower_bound_s: f64,
}

/// What one unit costs one tensor-parallel rank for one micro-batch: the single source of every
/// per-unit time and memory term ([`CostModel::unit_terms`]), shared by the cost model and the
/// stage planner ([`stage_dp`](super::stage_dp)).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct UnitTerms {
    /// Forward compute, seconds.
    pub forward_s: f64,
    /// Backward compute, seconds.
    pub backward_s: f64,
    /// Recomputation compute, seconds.
    pub recompute_s: f64,
    /// Tensor-parallel all-reduces of the forward pass, seconds.
    pub tp_forward_s: f64,
    /// Tensor-parallel all-reduces of the backward pass, seconds.
    pub tp_backward_s: f64,
    /// Context parallelism's ring exchanges of the forward pass that the attention blocks do
    /// not hide, seconds.
    pub cp_forward_s: f64,
    /// The ring's exchanges of the backward pass that its attention blocks do not hide.
    pub cp_backward_s: f64,
    /// The ring's exchanges repeated by recomputation (of the attention core), seconds.
    pub cp_recompute_s: f64,
    /// Tensor-parallel all-reduces of the recomputed forward pass, seconds.
    pub tp_recompute_s: f64,
    /// Expert parallelism's all-to-alls of the forward pass (dispatch and combine), seconds.
    pub ep_forward_s: f64,
    /// The all-to-alls of the backward pass, seconds.
    pub ep_backward_s: f64,
    /// The all-to-alls repeated by full recomputation, seconds.
    pub ep_recompute_s: f64,
    /// Activation bytes kept between forward and backward.
    pub activation_bytes: f64,
    /// Parameters held (tied copies and routed experts excluded).
    pub params: f64,
    /// Routed experts' parameters held (`1/ep` of the unit's).
    pub expert_params: f64,
    /// Parameters of a tied copy held (0 unless asked for).
    pub tied_params: f64,
    /// Activation bytes without recomputation (the workspace a recomputing unit rebuilds).
    pub largest_activation_bytes: f64,
}

/// The sums of [`UnitTerms`] over the units of one stage, added in unit order.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct StageTerms {
    forward_s: f64,
    backward_s: f64,
    recompute_s: f64,
    tp_forward_s: f64,
    tp_backward_s: f64,
    tp_recompute_s: f64,
    cp_forward_s: f64,
    cp_backward_s: f64,
    cp_recompute_s: f64,
    ep_forward_s: f64,
    ep_backward_s: f64,
    ep_recompute_s: f64,
    /// Activation bytes of one micro-batch.
    pub activation_bytes: f64,
    /// Parameters held, tied copies included, routed experts excluded.
    pub params: f64,
    /// Routed experts' parameters held.
    pub expert_params: f64,
    /// The largest unit's activation bytes without recomputation.
    pub largest_activation_bytes: f64,
    /// The largest unit's parameters, tied copies and experts included (what ZeRO-3 gathers
    /// at once).
    pub largest_params: f64,
}

impl StageTerms {
    /// Adds the next unit of the stage.
    pub(crate) fn add(&mut self, unit: &UnitTerms) {
        self.forward_s += unit.forward_s;
        self.backward_s += unit.backward_s;
        self.recompute_s += unit.recompute_s;
        self.tp_forward_s += unit.tp_forward_s;
        self.tp_backward_s += unit.tp_backward_s;
        self.tp_recompute_s += unit.tp_recompute_s;
        self.cp_forward_s += unit.cp_forward_s;
        self.cp_backward_s += unit.cp_backward_s;
        self.cp_recompute_s += unit.cp_recompute_s;
        self.ep_forward_s += unit.ep_forward_s;
        self.ep_backward_s += unit.ep_backward_s;
        self.ep_recompute_s += unit.ep_recompute_s;
        self.activation_bytes += unit.activation_bytes;
        self.params += unit.params;
        self.params += unit.tied_params;
        self.expert_params += unit.expert_params;
        self.largest_activation_bytes = self
            .largest_activation_bytes
            .max(unit.largest_activation_bytes);
        let params = unit.params + unit.tied_params + unit.expert_params;
        self.largest_params = self.largest_params.max(params);
    }

    /// Forward pass of one micro-batch with its TP, CP and EP communication, seconds.
    pub(crate) fn forward(&self) -> f64 {
        self.forward_s + self.tp_forward_s + self.cp_forward_s + self.ep_forward_s
    }

    /// Backward pass of one micro-batch with its TP, CP and EP communication, seconds.
    pub(crate) fn backward(&self) -> f64 {
        self.backward_s + self.tp_backward_s + self.cp_backward_s + self.ep_backward_s
    }

    /// Recomputation of one micro-batch with its TP, CP and EP communication, seconds.
    pub(crate) fn recompute(&self) -> f64 {
        self.recompute_s + self.tp_recompute_s + self.cp_recompute_s + self.ep_recompute_s
    }

    /// The stage's time per micro-batch: forward + backward + recomputation (each with its TP,
    /// CP and EP communication), what the stage planner balances.
    pub(crate) fn time(&self) -> f64 {
        self.forward() + self.backward() + self.recompute()
    }

    /// Compute-only seconds per micro-batch.
    fn compute(&self) -> f64 {
        self.forward_s + self.backward_s + self.recompute_s
    }

    /// TP communication seconds per micro-batch.
    fn tp_comm(&self) -> f64 {
        self.tp_forward_s + self.tp_backward_s + self.tp_recompute_s
    }

    /// Exposed CP ring seconds per micro-batch.
    fn cp_comm(&self) -> f64 {
        self.cp_forward_s + self.cp_backward_s + self.cp_recompute_s
    }

    /// EP all-to-all seconds per micro-batch.
    fn ep_comm(&self) -> f64 {
        self.ep_forward_s + self.ep_backward_s + self.ep_recompute_s
    }
}

/// The memory-relevant terms of one stage (model chunk) of a pipeline rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChunkMemory {
    /// Parameters held, tied copies included, routed experts excluded.
    pub params: f64,
    /// Routed experts' parameters held.
    pub expert_params: f64,
    /// Activation bytes of one micro-batch.
    pub activation_bytes: f64,
    /// The most micro-batches the stage holds at once.
    pub in_flight: usize,
    /// How the stage treats its activations.
    pub mode: RecomputeMode,
    /// The largest unit's activation bytes without recomputation.
    pub largest_activation_bytes: f64,
}

/// Memory of one pipeline rank, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RankMemory {
    /// Parameters held (all chunks), routed experts excluded.
    pub params: f64,
    /// Routed experts' parameters held (all chunks).
    pub expert_params: f64,
    /// Model states (weights, gradients, optimizer states, a second 2BW weight version).
    pub states: f64,
    /// Activations of the micro-batches in flight.
    pub activations: f64,
    /// Workspace and framework memory.
    pub workspace: f64,
}

/// Bytes of model states per parameter held ([`CostModel::state_bytes`]): of the
/// dense parameters (sharded over the `dp x cp` replicas, or a shard group) and of the routed
/// experts (sharded over the `dp x cp / ep` ranks that hold the same experts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct StateBytes {
    /// Per dense parameter.
    pub dense: f64,
    /// Per routed expert's parameter.
    pub expert: f64,
}

impl StateBytes {
    /// Per dense and per expert parameter under `sharding`, in `format`.
    pub(crate) fn of(sharding: &StateSharding, format: &StateFormat) -> Self {
        Self {
            dense: model_states(1.0, 0.0, sharding, format).total(),
            expert: model_states(0.0, 1.0, sharding, format).total(),
        }
    }
}

impl RankMemory {
    /// The peak: states + activations + workspace, rounded up.
    pub(crate) fn peak_bytes(&self) -> u64 {
        (self.states + self.activations + self.workspace).ceil() as u64
    }
}

/// Per-layout derived costs.
struct Derived {
    costs: Costs,
    schedule_recompute: Vec<bool>,
    /// Per pipeline rank: compute-only seconds per micro-batch (all its chunks).
    compute_per_mb: Vec<f64>,
    /// Per pipeline rank: TP communication seconds per micro-batch.
    tp_per_mb: Vec<f64>,
    /// Per pipeline rank: exposed CP ring seconds per micro-batch.
    cp_per_mb: Vec<f64>,
    /// Per pipeline rank: EP all-to-all seconds per micro-batch.
    ep_per_mb: Vec<f64>,
    /// Per pipeline rank: the time after the pipeline drains (DP, optimizer, all-gather).
    tail: Vec<f64>,
    /// A lower bound of the pipeline time (see [`CostModel::estimate`]).
    pipeline_lb: f64,
    dp_exposed: Vec<f64>,
    optimizer: Vec<f64>,
    allgather: Vec<f64>,
    states: Vec<f64>,
    activations: Vec<f64>,
    workspace: Vec<f64>,
}

/// A pipeline rank's data-parallel work after its pipeline drains
/// ([`CostModel::data_parallel_tail`]).
struct DataParallelTail {
    /// Seconds of gradient reduction the backward pass does not hide.
    exposed: f64,
    /// Seconds of the all-gather of the updated values.
    allgather: f64,
    /// Parameters the rank's optimizer steps.
    local_params: f64,
}

impl Derived {
    /// Zeros for `p` pipeline ranks, with the schedule's `costs` and `layout`'s recomputation.
    fn new(p: usize, costs: Costs, layout: &Layout) -> Self {
        Self {
            schedule_recompute: (layout.recompute.iter())
                .map(|&mode| mode == RecomputeMode::Full)
                .collect(),
            compute_per_mb: vec![0.0; p],
            tp_per_mb: vec![0.0; p],
            cp_per_mb: vec![0.0; p],
            ep_per_mb: vec![0.0; p],
            tail: vec![0.0; p],
            pipeline_lb: 0.0,
            dp_exposed: vec![0.0; p],
            optimizer: vec![0.0; p],
            allgather: vec![0.0; p],
            states: vec![0.0; p],
            activations: vec![0.0; p],
            workspace: vec![0.0; p],
            costs,
        }
    }

    /// A lower bound of the pipeline time with `m` micro-batches: rank r cannot start before
    /// micro-batch 0 has gone forward through stages 0..r, and cannot be done before its last
    /// backward has gone back through them (every schedule drains at the end of a step in the
    /// executor, see pipeline_time); in between it works m times its per-micro-batch time.
    fn pipeline_lower_bound(&self, m: f64) -> f64 {
        let mut bound = 0.0f64;
        let mut before = 0.0;
        let mut after = 0.0;
        for rank in 0..self.compute_per_mb.len() {
            bound = bound.max(before + m * self.busy_per_mb(rank) + after);
            before += self.costs.forward[rank] + self.costs.send_activation;
            after += self.costs.backward[rank] + self.costs.send_grad;
        }
        bound
    }

    /// Pipeline rank `rank`'s seconds per micro-batch: compute and the TP, CP and EP
    /// communication it does not hide.
    fn busy_per_mb(&self, rank: usize) -> f64 {
        self.compute_per_mb[rank]
            + self.tp_per_mb[rank]
            + self.cp_per_mb[rank]
            + self.ep_per_mb[rank]
    }
}

type SimKey = Vec<u64>;

/// Schedule kind, ranks, virtual stages, micro-batches.
type InFlightKey = (ScheduleKind, usize, usize, usize);

/// Predicts layouts of one model on one cluster, caching schedules' in-flight counts and
/// simulations.
pub struct CostModel<'a> {
    model: &'a ModelProxy,
    hardware: &'a HardwareSpec,
    calibration: Option<&'a Calibration>,
    /// The busiest expert-parallel rank's load over the mean (the model's
    /// [`MoeShape::imbalance`](super::MoeShape::imbalance), [`EXPERT_IMBALANCE`] without one).
    expert_load: f64,
    /// The element sizes of the model states ([`StateFormat::MIXED_ADAM`] unless set).
    state_format: StateFormat,
    in_flight: RefCell<HashMap<InFlightKey, Vec<usize>>>,
    simulations: RefCell<HashMap<SimKey, f64>>,
}

impl<'a> CostModel<'a> {
    /// A cost model of `model` on `hardware`.
    pub fn new(model: &'a ModelProxy, hardware: &'a HardwareSpec) -> Self {
        CostModel {
            model,
            hardware,
            calibration: None,
            expert_load: model
                .shape
                .and_then(|s| s.moe)
                .map_or(EXPERT_IMBALANCE, |m| m.imbalance()),
            state_format: StateFormat::MIXED_ADAM,
            in_flight: RefCell::new(HashMap::new()),
            simulations: RefCell::new(HashMap::new()),
        }
    }

    /// The same cost model using measured layer times (`merak profile`) wherever they cover
    /// a unit at the layout's tensor-parallel degree: a unit's forward and backward times are
    /// then the measured ones (tensor-parallel communication included, so it is not added
    /// again), its recomputation the forward time scaled by the recomputed share of FLOPs,
    /// the optimizer the measured time per parameter, and gradients and activations have the
    /// calibration's element size. A layout with `tp_overlap = k` takes the units measured with
    /// that overlap degree where the profile timed them (those without overlap otherwise).
    /// Units or degrees it does not cover use FLOPs over the hardware's rate.
    pub fn with_calibration(mut self, calibration: &'a Calibration) -> Self {
        self.calibration = Some(calibration);
        if calibration.element_bytes >= 4.0 {
            // Profiled in fp32: the states of an fp32 run (AdamW's two moments).
            self.state_format = StateFormat::f32(2);
        }
        self
    }

    /// The same cost model with the busiest rank of an expert-parallel group computing and
    /// keeping activations for `load` times its share of the routed tokens instead of the
    /// model's expected imbalance (the admission check counts the stated bound,
    /// [`EXPERT_LOAD_BOUND`](super::EXPERT_LOAD_BOUND)).
    pub fn with_expert_load(mut self, load: f64) -> Self {
        self.expert_load = load;
        self
    }

    /// The same cost model counting model states in `format` instead of mixed-precision
    /// Adam's ([`StateFormat::MIXED_ADAM`]): what the admission check of an fp32 run uses
    /// ([`StateFormat::f32`]).
    pub fn with_state_format(mut self, format: StateFormat) -> Self {
        self.state_format = format;
        self
    }

    /// Bytes per element of gradients and pipeline messages: 2 (16-bit training), or the
    /// calibration's.
    fn element_bytes(&self) -> f64 {
        self.calibration.map_or(BYTES_16BIT, |c| c.element_bytes)
    }

    /// The model.
    pub fn model(&self) -> &ModelProxy {
        self.model
    }

    /// The hardware.
    pub fn hardware(&self) -> &HardwareSpec {
        self.hardware
    }

    /// The micro-batches each global stage holds when its rank holds the most at once
    /// ([`Schedule::in_flight_at_peak`](crate::pipeline::Schedule::in_flight_at_peak)): with
    /// several stages per rank (interleaved, ZB-V) their own maxima fall at different times.
    pub(crate) fn in_flight(
        &self,
        kind: ScheduleKind,
        p: usize,
        v: usize,
        m: usize,
    ) -> Result<Vec<usize>, CostError> {
        if kind == ScheduleKind::GPipe {
            return Ok(vec![m; p * v]);
        }
        // Beyond 4p micro-batches the warm-up (at most 2(p-1) + (v-1)p forwards) is unchanged.
        let m_small = m.min(4 * p);
        let key = (kind, p, v, m_small);
        if let Some(found) = self.in_flight.borrow().get(&key) {
            return Ok(found.clone());
        }
        let schedule = build_schedule(kind, p, m_small, v, &vec![false; p * v])?;
        let counts = schedule.in_flight_at_peak();
        self.in_flight.borrow_mut().insert(key, counts.clone());
        Ok(counts)
    }

    /// Seconds of one ring all-reduce of `bytes` over `n` ranks spanning `span` ranks.
    fn allreduce(&self, bytes: f64, n: usize, span: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let (bw, lat) = self.hardware.link(span);
        2.0 * (n - 1) as f64 / n as f64 * bytes / bw + lat
    }

    /// Exposed seconds of `n` tensor-parallel all-reduces of `bytes` each over `t` ranks, each
    /// after a block of `compute_s / n` seconds of compute it depends on, with the micro-batch's
    /// tokens split into `k` chunks (sub-pipelined tensor parallelism): per block, chunk `i`'s
    /// all-reduce `a` (of `bytes / k`) runs while chunk `i + 1` computes (`c = compute_s / (n k)`),
    /// so a block exposes `a + (k - 1) * (max(0, a - c) + slowdown * min(a, c))`: the last
    /// chunk's all-reduce, what the compute cannot hide, and the compute lost to the contention
    /// of overlapped communication ([`HardwareSpec::tp_overlap_slowdown`]). `k = 1` gives
    /// `n * a` (nothing hidden); a larger `k` hides more but pays the latency `k` times.
    pub(crate) fn tp_exposed(&self, n: u32, bytes: f64, t: usize, compute_s: f64, k: usize) -> f64 {
        if n == 0 || t <= 1 {
            return 0.0;
        }
        let k = k.max(1);
        let a = self.allreduce(bytes / k as f64, t, t);
        if k == 1 {
            return n as f64 * a;
        }
        let c = compute_s / n as f64 / k as f64;
        let hidden_slowdown = self.hardware.tp_overlap_slowdown * a.min(c);
        n as f64 * (a + (k - 1) as f64 * ((a - c).max(0.0) + hidden_slowdown))
    }

    /// Exposed seconds of context parallelism's ring for one micro-batch of `b` sequences of
    /// `u` on a rank of `split`: (forward, backward). Each rank holds the keys and values of its
    /// `s/cp` tokens, `kv = kv_elements b / (cp t)` elements; a hop sends them to the next rank
    /// of the group (ranks `t` apart, on the node's links when `t cp` fit in a node) while the
    /// rank computes its queries against the block it holds, `1/cp` of its attention. Forward:
    /// `cp - 1` hops of `kv`, each exposing what that block's compute does not hide; backward:
    /// `cp - 1` hops of the keys and values with their gradients (`2 kv`) behind the block's
    /// backward (twice the forward's compute), and the last hop of the gradients home, exposed
    /// (the projections' backward waits for it).
    fn ring_exposed(&self, u: &UnitProfile, b: usize, split: RankSplit) -> (f64, f64) {
        let c = split.cp.max(1);
        if c == 1 || u.kv_elements <= 0.0 {
            return (0.0, 0.0);
        }
        let (t, cf) = (split.tp.max(1), c as f64);
        let kv = u.kv_elements * b as f64 / (cf * t as f64) * self.element_bytes();
        let (bw, lat) = self.hardware.link(t * c);
        let hop = |bytes: f64| bytes / bw + lat;
        let rank_attention =
            u.attention_flops * b as f64 / (self.hardware.achievable_flops() * t as f64 * cf);
        let block = rank_attention / cf;
        let hops = (c - 1) as f64;
        let forward = hops * (hop(kv) - block).max(0.0);
        let backward = hops * (hop(2.0 * kv) - 2.0 * block).max(0.0) + hop(kv);
        (forward, backward)
    }

    /// Seconds of one all-to-all in which each of `n` ranks, `stride` devices apart, sends
    /// `bytes` spread evenly over the group (`bytes / n` to each member, its own share
    /// staying): the members on its node (`devices_per_node / stride` of them, all when the
    /// group fits in a node) get theirs over the node's links, the others over the inter-node
    /// links, both at once, so the slower of the two sets the time, plus the latency of the
    /// link the group spans. A group within a node moves `(n - 1)/n` of the bytes at the
    /// node's bandwidth.
    fn alltoall(&self, bytes: f64, n: usize, stride: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let hw = self.hardware;
        let stride = stride.max(1);
        let on_node = (hw.devices_per_node / stride).clamp(1, n);
        let (intra_bw, _) = hw.link(1);
        let (inter_bw, _) = hw.link(usize::MAX);
        let (_, latency) = hw.link(stride.saturating_mul(n));
        let share = bytes / n as f64;
        let intra = share * (on_node - 1) as f64 / intra_bw;
        let inter = share * (n - on_node) as f64 / inter_bw;
        intra.max(inter) + latency
    }

    /// Seconds of expert parallelism's all-to-alls for one micro-batch of `b` sequences of `u`
    /// on a rank of `split`, per pass (forward; backward the same): a dispatch and a combine,
    /// each of the rank's `a2a_elements b / cp` values (`1/tp` of them under sequence
    /// parallelism: a TP rank routes its own positions) over the `ep` ranks of its group,
    /// `tp` devices apart (consecutive ranks of the `dp x cp` that hold the same parameters).
    fn alltoall_exposed(&self, u: &UnitProfile, b: usize, split: RankSplit) -> f64 {
        if split.ep <= 1 || u.a2a_elements <= 0.0 {
            return 0.0;
        }
        let tokens = b as f64 / (split.cp.max(1) as f64 * split.replicated_divisor());
        let bytes = u.a2a_elements * tokens * self.element_bytes();
        2.0 * self.alltoall(bytes, split.ep, split.tp)
    }

    /// Seconds one rank of `split` spends per forward pass of a micro-batch streaming its routed
    /// experts' weights (`params_expert / ep` 16-bit values) from memory (the backward pass
    /// twice: it reads them for the input gradients and writes their gradients). A routed
    /// expert's matrix product over `m` tokens (`2 M h f m` FLOPs for `M` matrices of `h f`)
    /// then runs at `m / (m + m*)` of the achievable rate, with `m* = F / B` (achievable FLOP/s
    /// over memory bandwidth, 256 tokens on an H100 preset): a small share of tokens per expert
    /// (many experts, small micro-batches, little expert parallelism) makes the experts'
    /// products memory-bound, where a dense layer's products see `b s` tokens.
    fn expert_weights_s(&self, u: &UnitProfile, split: RankSplit) -> f64 {
        if u.params_expert == 0 {
            return 0.0;
        }
        let weights = u.params_expert as f64 / split.ep.max(1) as f64 * BYTES_16BIT;
        weights / self.hardware.memory_bandwidth
    }

    /// The terms of unit `unit` for a micro-batch of `b` sequences on one rank of `split`
    /// (a tensor-parallel degree, or tensor, context and sequence parallelism) with the
    /// tensor-parallel overlap degree `k` under `mode`; `tied` says whether its stage also
    /// holds the unit's tied parameters (more than one stage and not the first). Every
    /// per-unit time of the cost model comes from here.
    ///
    /// A rank of `cp` computes `1/cp` of the unit's FLOPs and memory-bound work of its `t`-th
    /// (its `s/cp` tokens; zigzag chunks balance the causal attention) and all-reduces `1/cp`
    /// of the bytes; sequence parallelism's reduce-scatters and all-gathers cost what the
    /// all-reduces they replace cost (the same bytes), and its LayerNorms and dropouts work on
    /// `1/t` of the tokens.
    pub(crate) fn unit_terms(
        &self,
        unit: usize,
        b: usize,
        split: impl Into<RankSplit>,
        k: usize,
        mode: RecomputeMode,
        tied: bool,
    ) -> UnitTerms {
        let split = split.into();
        let Some(u) = self.model.units.get(unit) else {
            return UnitTerms::default();
        };
        let (t, c) = (split.tp.max(1), split.cp.max(1) as f64);
        let flops = self.hardware.achievable_flops() * t as f64 * c;
        let bytes = u.tp_allreduce_elements * b as f64 / c * self.element_bytes();
        // Matrix products at the achievable FLOP/s, memory-bound operations at the sustained
        // memory bandwidth; the backward pass moves twice the forward's bytes.
        let bandwidth = self.hardware.memory_bandwidth;
        let flash = self.hardware.flash_attention;
        let memory_s = u.forward_memory_bytes(b, split, flash) / bandwidth;
        // The busiest expert-parallel rank computes `load` times its share of routed tokens,
        // and streams its experts' weights once per pass.
        let load = if split.ep > 1 { self.expert_load } else { 1.0 };
        let expert_extra_s =
            (load - 1.0) * u.expert_flops * b as f64 / flops + self.expert_weights_s(u, split);
        let forward_s = u.forward_flops(b) / flops + memory_s + expert_extra_s;
        let backward_s = u.backward_flops(b) / flops + 2.0 * (memory_s + expert_extra_s);
        let full = mode == RecomputeMode::Full && u.recomputable;
        let ep_s = self.alltoall_exposed(u, b, split);
        let tp_forward_s = self.tp_exposed(u.tp_forward_allreduces, bytes, t, forward_s, k);
        let (cp_forward_s, cp_backward_s) = self.ring_exposed(u, b, split);
        let recomputes_attention = match mode {
            RecomputeMode::None => false,
            RecomputeMode::Selective => u.selective_recompute_flops > 0.0,
            RecomputeMode::Full => u.recomputable,
        };
        let repeated = |seconds: f64| if full { seconds } else { 0.0 };
        let mut terms = UnitTerms {
            forward_s,
            backward_s,
            recompute_s: u.recompute_flops(b, mode) / flops
                + u.recompute_memory_bytes(b, split, mode, flash) / bandwidth
                + repeated(expert_extra_s),
            tp_forward_s,
            tp_backward_s: self.tp_exposed(u.tp_backward_allreduces, bytes, t, backward_s, k),
            tp_recompute_s: repeated(tp_forward_s),
            ep_forward_s: ep_s,
            ep_backward_s: ep_s,
            ep_recompute_s: repeated(ep_s),
            cp_forward_s,
            cp_backward_s,
            cp_recompute_s: if recomputes_attention {
                cp_forward_s
            } else {
                0.0
            },
            activation_bytes: u.activation_bytes(b, split, mode, flash)
                + u.expert_activation_bytes(b, split, mode, self.expert_load),
            params: u.params_per_rank(t),
            expert_params: u.params_expert as f64 / split.ep.max(1) as f64,
            tied_params: if tied {
                u.params_tied as f64 / t as f64
            } else {
                0.0
            },
            largest_activation_bytes: u.activation_bytes(b, split, RecomputeMode::None, flash)
                + u.expert_activation_bytes(b, split, RecomputeMode::None, self.expert_load),
        };
        self.calibrate(&mut terms, unit, b, split, k, mode);
        // What a measured unit pays per micro-batch whatever its size.
        terms.forward_s += u.fixed_forward_s;
        terms.backward_s += u.fixed_backward_s;
        terms.recompute_s += repeated(u.fixed_forward_s);
        terms
    }

    /// Replaces the compute and TP terms of `terms` (unit `unit`, micro-batch `b` on a rank of
    /// `split`, overlap `k`, `mode`) by the calibration's measured times where it covers them.
    /// Measured times include the unit's TP communication and were taken on whole sequences:
    /// a rank of `cp` takes `1/cp` of them (the ring's exchanges stay modelled); recomputation
    /// repeats the recomputed share of the forward pass; the framework's work per micro-batch
    /// grows with the parameters the pass hooks.
    fn calibrate(
        &self,
        terms: &mut UnitTerms,
        unit: usize,
        b: usize,
        split: RankSplit,
        k: usize,
        mode: RecomputeMode,
    ) {
        let kind = UnitKind::of(unit, self.model.units.len());
        let (Some(c), Some(u)) = (self.calibration, self.model.units.get(unit)) else {
            return;
        };
        let Some((forward_s, backward_s)) = c.unit_time_overlapped(kind, split.tp.max(1), k, b)
        else {
            return;
        };
        let share = 1.0 / split.cp.max(1) as f64;
        let (forward_s, backward_s) = (forward_s * share, backward_s * share);
        let forward_flops = u.forward_flops(b);
        terms.recompute_s = if forward_flops > 0.0 {
            forward_s * u.recompute_flops(b, mode) / forward_flops
        } else {
            0.0
        };
        terms.forward_s = forward_s + c.micro_batch_s_per_param * terms.params;
        terms.backward_s = backward_s;
        terms.tp_forward_s = 0.0;
        terms.tp_backward_s = 0.0;
        terms.tp_recompute_s = 0.0;
    }

    /// The memory of a pipeline rank holding `chunks` (its stages, in chunk order), with
    /// `state_bytes` per dense and per expert parameter from
    /// [`state_bytes`](Self::state_bytes): model states, each chunk's
    /// activations times its micro-batches in flight, and a workspace ([`FRAMEWORK_BYTES`]
    /// plus, when a chunk recomputes, the largest unit's full activations).
    pub(crate) fn rank_memory(
        chunks: impl IntoIterator<Item = ChunkMemory>,
        state_bytes: StateBytes,
    ) -> RankMemory {
        let mut memory = RankMemory::default();
        let mut recomputes = false;
        let mut largest_unit = 0.0f64;
        for chunk in chunks {
            memory.params += chunk.params;
            memory.expert_params += chunk.expert_params;
            memory.activations += chunk.in_flight as f64 * chunk.activation_bytes;
            recomputes |= chunk.mode != RecomputeMode::None;
            largest_unit = largest_unit.max(chunk.largest_activation_bytes);
        }
        memory.states =
            memory.params * state_bytes.dense + memory.expert_params * state_bytes.expert;
        memory.workspace = FRAMEWORK_BYTES + if recomputes { largest_unit } else { 0.0 };
        memory
    }

    fn check(&self, layout: &Layout) -> Result<(), CostError> {
        for (field, v) in [
            ("dp", layout.dp),
            ("tp", layout.tp),
            ("cp", layout.cp),
            ("ep", layout.ep),
            ("pp", layout.pp),
            ("virtual_stages", layout.virtual_stages),
            ("micro_batch", layout.micro_batch),
            ("micro_batches", layout.micro_batches),
        ] {
            if v == 0 {
                return Err(CostError::Zero { field });
            }
        }
        if layout.tp_overlap == 0 {
            return Err(CostError::Zero {
                field: "tp_overlap",
            });
        }
        self.check_split(layout)?;
        self.check_experts(layout.split(), layout.replicas())?;
        let stages = layout.stages();
        if layout.partition.stages() != stages || layout.partition.units() != self.model.num_units()
        {
            return Err(CostError::Partition {
                stages: layout.partition.stages(),
                units: layout.partition.units(),
                expected_stages: stages,
                expected_units: self.model.num_units(),
            });
        }
        if layout.recompute.len() != stages {
            return Err(CostError::RecomputeLength {
                got: layout.recompute.len(),
                stages,
            });
        }
        Ok(())
    }

    /// Context and sequence parallelism cut the model's sequence, and the overlap degree the
    /// tokens a rank holds.
    fn check_split(&self, layout: &Layout) -> Result<(), CostError> {
        let split = layout.split();
        self.model.splits_sequence(split).map_err(|seq| {
            if seq == 0 {
                CostError::UnknownSequence
            } else if split.cp > 1 && !seq.is_multiple_of(2 * split.cp) {
                CostError::ContextSplit { cp: split.cp, seq }
            } else {
                CostError::SequenceParallel {
                    tp: split.tp,
                    tokens: seq / split.cp,
                }
            }
        })?;
        self.model
            .splits_tokens_on(layout.micro_batch, layout.tp_overlap, split)
            .map_err(|tokens| CostError::Overlap {
                overlap: layout.tp_overlap,
                tokens,
            })
    }

    /// Expert parallelism divides the `replicas` (`dp x cp`) and the experts (only `ep = 1`
    /// for a dense model), and a mixture of experts under tensor parallelism runs with
    /// sequence parallelism.
    pub(crate) fn check_experts(&self, split: RankSplit, replicas: usize) -> Result<(), CostError> {
        let experts = self.model.experts();
        let ep = split.ep.max(1);
        let divides = |n: usize| n.is_multiple_of(ep);
        if ep > 1 && !(divides(replicas) && experts.is_some_and(divides)) {
            return Err(CostError::ExpertParallel {
                ep,
                replicas,
                experts: experts.unwrap_or(0),
            });
        }
        if experts.is_some() && split.tp > 1 && !split.sequence_parallel {
            return Err(CostError::ExpertsNeedSequenceParallel { tp: split.tp });
        }
        Ok(())
    }

    /// Model-state bytes per dense and per expert parameter under `sharding`, in this model's
    /// [`StateFormat`], by the one accounting of [`memory`](super::memory).
    pub(crate) fn state_bytes(&self, sharding: &StateSharding) -> StateBytes {
        StateBytes::of(sharding, &self.state_format)
    }

    fn derive(&self, layout: &Layout) -> Result<Derived, CostError> {
        self.check(layout)?;
        let p = layout.pp;
        let (terms, mut costs) = self.stage_terms(layout);
        if p > 1 {
            let message = self.pp_message_time(layout);
            costs.send_activation = message;
            costs.send_grad = message;
        }
        let in_flight = self.in_flight(
            layout.schedule,
            p,
            layout.virtual_stages,
            layout.micro_batches,
        )?;
        let mut derived = Derived::new(p, costs, layout);
        for rank in 0..p {
            self.derive_rank(layout, rank, &terms, &in_flight, &mut derived);
        }
        derived.pipeline_lb = derived.pipeline_lower_bound(layout.micro_batches as f64);
        Ok(derived)
    }

    /// Hybrid sharding: ZeRO's collectives within a copy of this many consecutive DP ranks
    /// (with their context-parallel peers), spanning `s * tp` devices; each chunk summed over
    /// the `replicas / s` copies.
    fn shard_ranks(layout: &Layout) -> usize {
        layout.shard_degree() * layout.cp.max(1)
    }

    /// Each stage's terms (its units' compute, communication and memory) and the schedule's
    /// costs of its passes, ZeRO-3's gathers included.
    fn stage_terms(&self, layout: &Layout) -> (Vec<StageTerms>, Costs) {
        // Context parallelism folds into data parallelism for the parameters: `d` counts the
        // `dp * cp` ranks that hold the same parameters (ranks ordered tp, cp, dp, pp).
        let (t, d) = (layout.tp, layout.replicas());
        let s = Self::shard_ranks(layout);
        // The ranks that hold the same routed experts.
        let de = layout.expert_replicas();
        let stages = layout.stages();
        let mut costs = Costs::uniform(stages, 0.0, 0.0);
        let ranges = layout.partition.ranges();
        let head_separate = ranges.len() > 1;
        let mut terms = vec![StageTerms::default(); stages];
        for (j, range) in ranges.iter().enumerate() {
            let mode = layout.recompute[j];
            for unit in range.clone() {
                terms[j].add(&self.unit_terms(
                    unit,
                    layout.micro_batch,
                    layout.split(),
                    layout.tp_overlap,
                    mode,
                    head_separate && j > 0,
                ));
            }
            costs.forward[j] = terms[j].forward();
            costs.backward[j] = terms[j].backward();
            costs.recompute[j] = terms[j].recompute();
            if layout.zero == 3 && layout.reshard_after_forward && (s > 1 || de > 1) {
                // ZeRO-3 gathers the stage's parameters before its forward pass and again
                // before its recomputed backward pass, a unit ahead of the compute, which
                // hides what it can (the experts' over the ranks that hold them).
                let bytes = terms[j].params * self.element_bytes();
                let experts = terms[j].expert_params * self.element_bytes();
                let gather = self.allreduce(bytes, s, s * t) / 2.0
                    + self.expert_allreduce(experts, de, d * t) / 2.0;
                costs.forward[j] += (gather - costs.forward[j]).max(0.0);
                costs.backward[j] += (gather - costs.backward[j] - costs.recompute[j]).max(0.0);
            }
        }
        (terms, costs)
    }

    /// Seconds of one pipeline message (an activation or its gradient) between two stages.
    fn pp_message_time(&self, layout: &Layout) -> f64 {
        let (pp_bw, pp_lat) = self.hardware.link(2 * layout.replicas() * layout.tp);
        self.model
            .pp_message_bytes_per_rank(layout.micro_batch, layout.split())
            / BYTES_16BIT
            * self.element_bytes()
            / pp_bw
            + pp_lat
    }

    /// Pipeline rank `rank`'s share of `derived`: its per-micro-batch compute and
    /// communication over its chunks, its memory, and its tail after the pipeline drains.
    fn derive_rank(
        &self,
        layout: &Layout,
        rank: usize,
        terms: &[StageTerms],
        in_flight: &[usize],
        derived: &mut Derived,
    ) {
        let (p, v) = (layout.pp, layout.virtual_stages);
        let stage = |chunk| stage_of_chunk(layout.schedule, p, rank, chunk);
        let mut last_backward = 0.0;
        for chunk in 0..v {
            let j = stage(chunk);
            last_backward += derived.costs.backward[j] + derived.costs.recompute[j];
            derived.compute_per_mb[rank] += terms[j].compute();
            derived.tp_per_mb[rank] += terms[j].tp_comm();
            derived.cp_per_mb[rank] += terms[j].cp_comm();
            derived.ep_per_mb[rank] += terms[j].ep_comm();
        }
        let mut memory = Self::rank_memory(
            (0..v).map(|chunk| {
                let j = stage(chunk);
                ChunkMemory {
                    params: terms[j].params,
                    expert_params: terms[j].expert_params,
                    activation_bytes: terms[j].activation_bytes,
                    in_flight: in_flight[j],
                    mode: layout.recompute[j],
                    largest_activation_bytes: terms[j].largest_activation_bytes,
                }
            }),
            self.layout_state_bytes(layout),
        );
        if layout.zero == 3 {
            let largest = (0..v)
                .map(|chunk| terms[stage(chunk)].largest_params)
                .fold(0.0, f64::max);
            let held = memory.params + memory.expert_params;
            memory.workspace += gathered_bytes(
                layout.reshard_after_forward,
                GATHERED_AHEAD,
                largest,
                held,
                &self.state_format,
            );
        }
        let tail = self.data_parallel_tail(layout, &memory, last_backward);
        let optimizer = match self.calibration {
            Some(c) => tail.local_params * c.optimizer_s_per_param + c.step_overhead_s,
            None => tail.local_params * OPTIMIZER_BYTES_PER_PARAM / self.hardware.memory_bandwidth,
        };
        derived.dp_exposed[rank] = tail.exposed;
        derived.allgather[rank] = tail.allgather;
        derived.optimizer[rank] = optimizer;
        derived.tail[rank] = tail.exposed + tail.allgather + optimizer;
        derived.states[rank] = memory.states;
        derived.activations[rank] = memory.activations;
        derived.workspace[rank] = memory.workspace;
    }

    /// Bytes of model states per parameter under `layout` (dense and routed experts).
    fn layout_state_bytes(&self, layout: &Layout) -> StateBytes {
        self.state_bytes(&layout.state_sharding())
    }

    /// A pipeline rank's data-parallel work after its last backward pass (which lasted
    /// `last_backward` and hides what it can): the exposed gradient reduction, the all-gather
    /// of ZeRO's updated values, and the parameters its optimizer steps.
    fn data_parallel_tail(
        &self,
        layout: &Layout,
        memory: &RankMemory,
        last_backward: f64,
    ) -> DataParallelTail {
        let (t, d) = (layout.tp, layout.replicas());
        let s = Self::shard_ranks(layout);
        let expert_shard = layout.expert_replicas() * t;
        let rank_params = memory.params;
        let grad_bytes = rank_params * self.element_bytes();
        let experts = memory.expert_params;
        let (expert_reduce, expert_gather) =
            self.expert_exchange(experts * self.element_bytes(), layout, expert_shard);
        if layout.zero == 0 {
            let full = self.allreduce(grad_bytes, d, d * t) + expert_reduce;
            return DataParallelTail {
                exposed: (full - last_backward).max(0.0),
                allgather: 0.0,
                local_params: rank_params + experts,
            };
        }
        // Reduce-scattered every micro-batch: m collectives, each hidden behind its
        // micro-batch's backward pass as far as it goes.
        let scatters = if layout.zero >= 2 && layout.reduce_scatter == ReduceScatter::MicroBatch {
            layout.micro_batches.max(1) as f64
        } else {
            1.0
        };
        // Reduce-scatter (half a ring all-reduce) overlaps the backward pass; the all-gather
        // of the updated 16-bit parameters does not.
        let half = self.allreduce(grad_bytes, s, s * t) / 2.0;
        // Under hybrid sharding each chunk is all-reduced over the copies.
        let copies = self.allreduce(grad_bytes / s as f64, d / s, d * t);
        let exchange = match self.calibration {
            // Measured at dp = the calibration's ranks; scaled by the ring's (d-1)/d.
            Some(c) if c.ranks > 1 => {
                let at = |n: usize| (n - 1) as f64 / n as f64;
                c.zero1_s_per_param * rank_params * at(s) / at(c.ranks)
            }
            _ => half,
        };
        DataParallelTail {
            // The copies' all-reduce starts as each chunk is reduced, during the backward
            // pass; m reduce-scatters expose m times what one does.
            exposed: (half + copies + expert_reduce - last_backward).max(0.0)
                + (scatters - 1.0) * (half - last_backward).max(0.0),
            // ZeRO-3 keeps its slices: no all-gather after the update, but without resharding
            // one of the whole parameters before the step's first forward pass.
            allgather: if s > 1 && (layout.zero < 3 || !layout.reshard_after_forward) {
                exchange + expert_gather
            } else {
                expert_gather
            },
            local_params: rank_params / s as f64 + experts / expert_shard as f64,
        }
    }

    /// A ring all-reduce of `bytes` of routed experts' values over `n` ranks spanning `span`
    /// devices; nothing (not even the latency) when the rank holds no experts.
    fn expert_allreduce(&self, bytes: f64, n: usize, span: usize) -> f64 {
        if bytes > 0.0 {
            self.allreduce(bytes, n, span)
        } else {
            0.0
        }
    }

    /// Seconds of the routed experts' gradient reduction and of the all-gather of their
    /// updated values (ZeRO stages 1 and 2) on a rank of `layout` holding `bytes` of their
    /// gradients, with `holders` ranks holding the same experts (`dp cp / ep` and their `tp`
    /// peers, which route other positions to the same experts): a ring all-reduce over them,
    /// spanning the `dp x cp x tp` devices of the data-parallel group (its reduce-scatter half
    /// under ZeRO, whose chunks are cut over the same ranks; the all-gather half after the
    /// update). Overlapped with the backward pass like the dense gradients'.
    fn expert_exchange(&self, bytes: f64, layout: &Layout, holders: usize) -> (f64, f64) {
        let span = layout.replicas() * layout.tp;
        let reduce = self.expert_allreduce(bytes, holders, span);
        match layout.zero {
            0 => (reduce, 0.0),
            1 | 2 => (reduce / 2.0, reduce / 2.0),
            _ => (reduce / 2.0, 0.0),
        }
    }

    /// The lower bound of the time from derived costs: the pipeline bound plus the largest
    /// tail (then shared cores, see [`shared`](Self::shared)).
    fn lower_bound(&self, layout: &Layout, derived: &Derived) -> f64 {
        self.shared(
            layout,
            derived,
            derived.pipeline_lb + derived.tail.iter().copied().fold(0.0, f64::max),
        )
    }

    /// The step time `time` (computed as if every rank had its device to itself) on hardware
    /// whose ranks share fewer compute units than there are ranks on a node (CPU ranks on
    /// fewer cores, `HardwareSpec::compute_units_per_node`). The unit times were measured with
    /// every rank working, so a rank whose peers wait runs `share` of its measured time (the
    /// calibration's `alone_time_fraction`, else the hardware's, else `units / ranks`); the
    /// step takes the longer of
    /// the critical path at that speed and the mean work of the ranks (all work shares the
    /// same units). Unchanged when every rank has its own device.
    fn shared(&self, layout: &Layout, derived: &Derived, time: f64) -> f64 {
        let ranks = layout.gpus().min(self.hardware.devices_per_node);
        let units = self.hardware.compute_units_per_node;
        if units == 0 || units >= ranks {
            return time;
        }
        let measured = self
            .calibration
            .map(|c| c.alone_time_fraction)
            .filter(|&f| f > 0.0)
            .unwrap_or(self.hardware.alone_time_fraction);
        let share = if measured > 0.0 {
            measured.min(1.0)
        } else {
            units as f64 / ranks as f64
        };
        let m = layout.micro_batches as f64;
        let p = layout.pp;
        let work: f64 = (0..p)
            .map(|r| m * derived.busy_per_mb(r) + derived.tail[r])
            .sum::<f64>()
            / p as f64;
        (time * share).max(work)
    }

    fn memory(derived: &Derived) -> Vec<u64> {
        (0..derived.states.len())
            .map(|r| {
                RankMemory {
                    params: 0.0,
                    expert_params: 0.0,
                    states: derived.states[r],
                    activations: derived.activations[r],
                    workspace: derived.workspace[r],
                }
                .peak_bytes()
            })
            .collect()
    }

    /// Memory per rank and a lower bound of the step time, without simulating: for a flushing
    /// schedule, rank `r` starts after micro-batch 0's forward passes (and messages) of the
    /// stages before it, works `m` times its per-micro-batch time, and the step ends after the
    /// last backward passes of those stages; the bound is the largest over ranks, plus the
    /// largest post-pipeline term. [`predict`](Self::predict) never returns less.
    pub fn estimate(&self, layout: &Layout) -> Result<Estimate, CostError> {
        let derived = self.derive(layout)?;
        Ok(Estimate {
            peak_memory_bytes: CostModel::memory(&derived),
            time_lower_bound_s: self.lower_bound(layout, &derived),
        })
    }

    /// Per global stage, the forward + backward + recomputation seconds of one micro-batch that
    /// the simulation uses (for tests of the stage planner).
    #[cfg(test)]
    pub(crate) fn stage_times(&self, layout: &Layout) -> Result<Vec<f64>, CostError> {
        let costs = self.derive(layout)?.costs;
        Ok((0..layout.stages())
            .map(|j| costs.forward[j] + costs.backward[j] + costs.recompute[j])
            .collect())
    }

    /// The per-stage forward, backward and recomputation times (TP communication included)
    /// and the pipeline message times of `layout`: what [`predict`](Self::predict) simulates,
    /// for example to draw the predicted pipeline with
    /// [`crate::pipeline::simulate`](fn@crate::pipeline::simulate).
    ///
    /// # Errors
    ///
    /// [`CostError`] for a layout inconsistent with the model.
    pub fn stage_costs(&self, layout: &Layout) -> Result<Costs, CostError> {
        Ok(self.derive(layout)?.costs)
    }

    /// The simulated pipeline time of one step with `m` micro-batches (cached).
    fn pipeline_time(
        &self,
        layout: &Layout,
        derived: &Derived,
        m: usize,
    ) -> Result<f64, CostError> {
        let costs = &derived.costs;
        let mut key: SimKey = vec![
            layout.schedule as u64,
            layout.pp as u64,
            layout.virtual_stages as u64,
            m as u64,
            costs.send_activation.to_bits(),
        ];
        key.extend(derived.schedule_recompute.iter().map(|&r| r as u64));
        for v in [&costs.forward, &costs.backward, &costs.recompute] {
            key.extend(v.iter().map(|x| x.to_bits()));
        }
        if let Some(&t) = self.simulations.borrow().get(&key) {
            return Ok(t);
        }
        let schedule = build_schedule(
            layout.schedule,
            layout.pp,
            m,
            layout.virtual_stages,
            &derived.schedule_recompute,
        )?;
        // PipeDream-2BW runs each step's warm-up during the previous step's cool-down (the
        // optimizer step stays a barrier); the others drain every step.
        let time = steady_step_time(&schedule, costs)?;
        self.simulations.borrow_mut().insert(key, time);
        Ok(time)
    }

    /// Predicts the step time, throughput and memory of `layout`.
    pub fn predict(&self, layout: &Layout) -> Result<Prediction, CostError> {
        let derived = self.derive(layout)?;
        let p = layout.pp;
        let m = layout.micro_batches;
        // Extrapolation points in the steady state (the interleaved warm-up is longest).
        let (m1, m2) = if layout.virtual_stages > 1 {
            (2 * p, 3 * p)
        } else {
            (p, 2 * p)
        };
        let simulated = if m <= m2 + p {
            self.pipeline_time(layout, &derived, m)?
        } else {
            let t1 = self.pipeline_time(layout, &derived, m1)?;
            let t2 = self.pipeline_time(layout, &derived, m2)?;
            t1 + (m - m1) as f64 * (t2 - t1) / (m2 - m1) as f64
        };
        let busy = (0..p)
            .map(|r| m as f64 * derived.busy_per_mb(r))
            .fold(0.0, f64::max);
        let pipeline = simulated.max(derived.pipeline_lb);
        let tail = derived.tail.iter().copied().fold(0.0, f64::max);
        let step = self.shared(layout, &derived, pipeline + tail);
        let memory = CostModel::memory(&derived);
        let gpus = layout.gpus() as f64;
        let flops = self
            .model
            .reported_flops(layout.global_batch(), layout.full_recompute());
        let worst = (0..p).max_by_key(|&r| memory[r]).unwrap_or(0);
        let busiest = (0..p)
            .max_by(|&a, &c| derived.busy_per_mb(a).total_cmp(&derived.busy_per_mb(c)))
            .unwrap_or(0);
        let mut breakdown = BTreeMap::new();
        let mut put = |k: &str, v: f64| {
            breakdown.insert(k.to_string(), v);
        };
        put("pipeline_s", pipeline);
        if step != pipeline + tail {
            put("shared_cores_step_s", step);
        }
        put("compute_s", m as f64 * derived.compute_per_mb[busiest]);
        put("tp_comm_s", m as f64 * derived.tp_per_mb[busiest]);
        if layout.cp > 1 {
            put("cp_comm_s", m as f64 * derived.cp_per_mb[busiest]);
        }
        if layout.ep > 1 {
            put("ep_comm_s", m as f64 * derived.ep_per_mb[busiest]);
        }
        put("pp_message_s", derived.costs.send_activation);
        put("bubble_s", pipeline - busy);
        put(
            "dp_exposed_s",
            derived.dp_exposed.iter().copied().fold(0.0, f64::max),
        );
        put(
            "zero_allgather_s",
            derived.allgather.iter().copied().fold(0.0, f64::max),
        );
        put(
            "optimizer_s",
            derived.optimizer.iter().copied().fold(0.0, f64::max),
        );
        put("model_states_bytes", derived.states[worst]);
        put("activations_bytes", derived.activations[worst]);
        put("workspace_bytes", derived.workspace[worst]);
        Ok(Prediction {
            step_time_s: step,
            tflops_per_gpu: flops / step / gpus / 1e12,
            peak_memory_bytes: memory,
            breakdown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::balanced_partition;
    use crate::planner::UnitTiming;
    use crate::planner::memory::sharded;

    fn layout(model: &ModelProxy, dp: usize, tp: usize, pp: usize, m: usize) -> Layout {
        let costs: Vec<f64> = model
            .units
            .iter()
            .map(|u| u.forward_flops + u.backward_flops)
            .collect();
        Layout {
            dp,
            tp,
            pp,
            virtual_stages: 1,
            micro_batch: 1,
            micro_batches: m,
            schedule: ScheduleKind::OneFOneB,
            recompute: vec![RecomputeMode::Full; pp],
            zero: 0,
            reduce_scatter: ReduceScatter::Step,
            shard: 0,
            reshard_after_forward: true,
            partition: balanced_partition(&costs, pp).unwrap(),
            tp_overlap: 1,
            cp: 1,
            sequence_parallel: false,
            ep: 1,
        }
    }

    #[test]
    fn tp_overlap_hides_communication_behind_compute() {
        let model = ModelProxy::parse("gpt-8.3b").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(8);
        let cm = CostModel::new(&model, &hw);
        let (b, t) = (4, 8);
        let layer = 1;
        let u = &model.units[layer];
        let plain = cm.unit_terms(layer, b, t, 1, RecomputeMode::None, false);
        // k = 1: every all-reduce exposed, as Megatron runs it.
        let bytes = u.tp_allreduce_elements * b as f64 * BYTES_16BIT;
        let (bw, lat) = hw.link(t);
        let ring = |bytes: f64| 2.0 * (t - 1) as f64 / t as f64 * bytes / bw + lat;
        assert!((plain.tp_forward_s - 2.0 * ring(bytes)).abs() < 1e-12);
        let mut previous = plain;
        for k in [2usize, 4] {
            let terms = cm.unit_terms(layer, b, t, k, RecomputeMode::None, false);
            // The same compute; per block of half the forward pass, the last chunk's all-reduce
            // plus what each chunk's compute cannot hide plus the contention of the hidden part.
            assert_eq!(terms.forward_s, plain.forward_s);
            assert_eq!(terms.activation_bytes, plain.activation_bytes);
            let (a, c) = (ring(bytes / k as f64), plain.forward_s / 2.0 / k as f64);
            let block = a + (k - 1) as f64 * ((a - c).max(0.0) + hw.tp_overlap_slowdown * a.min(c));
            assert!((terms.tp_forward_s - 2.0 * block).abs() < 1e-12, "k={k}");
            assert!(terms.tp_forward_s < previous.tp_forward_s, "k={k}");
            assert!(terms.tp_backward_s < previous.tp_backward_s, "k={k}");
            previous = terms;
        }
        // The whole step gets faster, memory does not change.
        let mut l = layout(&model, 1, 8, 1, 4);
        l.micro_batch = b;
        let slow = cm.predict(&l).unwrap();
        l.tp_overlap = 4;
        let fast = cm.predict(&l).unwrap();
        assert!(fast.step_time_s < slow.step_time_s);
        assert!(fast.breakdown["tp_comm_s"] < slow.breakdown["tp_comm_s"]);
        assert_eq!(fast.peak_memory_bytes, slow.peak_memory_bytes);
        // Where latency dominates (a tiny layer), splitting only adds latencies.
        let tiny = ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512").unwrap();
        let cm = CostModel::new(&tiny, &hw);
        let one = cm.unit_terms(1, 1, 4, 1, RecomputeMode::None, false);
        let four = cm.unit_terms(1, 1, 4, 4, RecomputeMode::None, false);
        assert!(four.tp_forward_s > one.tp_forward_s);
        // A degree of 0, or one that does not divide the tokens, is refused.
        l.tp_overlap = 0;
        assert!(matches!(
            CostModel::new(&model, &hw).predict(&l),
            Err(CostError::Zero {
                field: "tp_overlap"
            })
        ));
        l.tp_overlap = 3;
        let err = CostModel::new(&model, &hw).predict(&l).unwrap_err();
        assert!(err.to_string().contains("4096 tokens"), "{err}");
    }

    fn split(tp: usize, cp: usize, sequence_parallel: bool) -> RankSplit {
        RankSplit::new(tp, cp, sequence_parallel)
    }

    /// The ring's exchanges as `ring_exposed` states them, recomputed here from the shape:
    /// per hop the keys and values of the rank's `s/cp` tokens (`2 b (s/cp) (h/t)` 16-bit
    /// values) against `1/cp` of the rank's attention (`4 b s² h / (t cp)` FLOPs).
    #[test]
    fn a_context_parallel_layout_predicts_the_rings_exchange() {
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
        let b = 2usize;
        for seq in [1024usize, 32768] {
            let spec = format!("gpt:layers=2,hidden=4096,heads=32,seq={seq},vocab=1000");
            let model = ModelProxy::parse(&spec).unwrap();
            let cm = CostModel::new(&model, &hw);
            let (s, h) = (seq as f64, 4096.0);
            // t cp = 2 and 8 on NVLink, 16 across nodes.
            for (t, c) in [(1usize, 2usize), (2, 4), (4, 4)] {
                let (tf, cf) = (t as f64, c as f64);
                let terms = cm.unit_terms(1, b, split(t, c, false), 1, RecomputeMode::Full, false);
                let kv = 2.0 * b as f64 * (s / cf) * (h / tf) * BYTES_16BIT;
                let (bw, lat) = hw.link(t * c);
                let hop = |bytes: f64| bytes / bw + lat;
                let block = 4.0 * b as f64 * s * s * h / (hw.achievable_flops() * tf * cf) / cf;
                let forward = (cf - 1.0) * (hop(kv) - block).max(0.0);
                let backward = (cf - 1.0) * (hop(2.0 * kv) - 2.0 * block).max(0.0) + hop(kv);
                assert!(
                    (terms.cp_forward_s - forward).abs() < 1e-15,
                    "{seq} {t} {c}"
                );
                assert!(
                    (terms.cp_backward_s - backward).abs() < 1e-15,
                    "{seq} {t} {c}"
                );
                // Full recomputation runs the ring again.
                assert_eq!(terms.cp_recompute_s, terms.cp_forward_s);
                // 1/cp of the compute of the same TP degree.
                let whole = cm.unit_terms(1, b, t, 1, RecomputeMode::Full, true);
                assert!((terms.forward_s * cf / whole.forward_s - 1.0).abs() < 1e-12);
                assert!((terms.backward_s * cf / whole.backward_s - 1.0).abs() < 1e-12);
                if seq == 1024 && t * c > hw.devices_per_node {
                    // Short blocks across nodes: the hops are exposed.
                    assert!(terms.cp_forward_s > 1e-4, "{}", terms.cp_forward_s);
                }
                if seq == 32768 && t * c <= hw.devices_per_node {
                    // Long blocks on NVLink hide every hop but the gradients' last one.
                    assert_eq!(terms.cp_forward_s, 0.0);
                    assert_eq!(terms.cp_backward_s, hop(kv));
                }
                // The embedding and the head have no attention: no ring.
                for unit in [0, 3] {
                    let other =
                        cm.unit_terms(unit, b, split(t, c, false), 1, RecomputeMode::Full, false);
                    assert_eq!((other.cp_forward_s, other.cp_backward_s), (0.0, 0.0));
                }
            }
        }
        // The prediction shows the ring per step: the two blocks' exchanges, m micro-batches.
        let model =
            ModelProxy::parse("gpt:layers=2,hidden=4096,heads=32,seq=1024,vocab=1000").unwrap();
        let cm = CostModel::new(&model, &hw);
        let mut l = layout(&model, 2, 2, 1, 4);
        l.cp = 4;
        l.micro_batch = b;
        let terms = cm.unit_terms(1, b, l.split(), 1, RecomputeMode::Full, false);
        let ring = 4.0 * 2.0 * (terms.cp_forward_s + terms.cp_backward_s + terms.cp_recompute_s);
        let pred = cm.predict(&l).unwrap();
        assert!((pred.breakdown["cp_comm_s"] / ring - 1.0).abs() < 1e-12);
        assert!(
            !cm.predict(&layout(&model, 2, 2, 1, 4))
                .unwrap()
                .breakdown
                .contains_key("cp_comm_s")
        );
    }

    /// Each rank of a ring keeps `1/cp` of the activations, and under sequence parallelism
    /// the part TP leaves whole is split; parameters and optimizer states are unchanged by cp,
    /// ZeRO shards them over `dp x cp`, and the gradients are all-reduced over `dp x cp` ranks.
    #[test]
    fn context_and_sequence_parallelism_in_the_memory_model() {
        let model =
            ModelProxy::parse("gpt:layers=8,hidden=2048,heads=16,seq=16384,vocab=32000").unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
        let cm = CostModel::new(&model, &hw);
        let mut plain = layout(&model, 1, 2, 1, 4);
        plain.recompute = vec![RecomputeMode::None];
        let base = cm.predict(&plain).unwrap();
        let activations = |l: &Layout| cm.predict(l).unwrap().breakdown["activations_bytes"];
        let states = |l: &Layout| cm.predict(l).unwrap().breakdown["model_states_bytes"];
        for cp in [2, 4] {
            let l = Layout {
                cp,
                ..plain.clone()
            };
            assert!((activations(&l) * cp as f64 / activations(&plain) - 1.0).abs() < 1e-12);
            assert_eq!(states(&l), states(&plain));
            // The compute splits over the ring's ranks.
            let pred = cm.predict(&l).unwrap();
            let ratio = base.breakdown["compute_s"] / pred.breakdown["compute_s"];
            assert!((ratio / cp as f64 - 1.0).abs() < 1e-9, "{ratio}");
        }
        // Sequence parallelism: a block keeps 34/t instead of 10 + 24/t of s b h.
        let sp = Layout {
            sequence_parallel: true,
            ..plain.clone()
        };
        let (s, h) = (16384.0, 2048.0);
        let saved = 8.0 * s * h * 10.0 * (1.0 - 1.0 / 2.0);
        let embedding_and_head = s * h * (1.0 + 4.0) * (1.0 - 1.0 / 2.0);
        let want = activations(&plain) - saved - embedding_and_head;
        assert!((activations(&sp) / want - 1.0).abs() < 1e-12);
        assert!(cm.predict(&sp).unwrap().step_time_s < base.step_time_s);
        // ZeRO over the replicas: dp = 1 x cp = 4 holds what dp = 4 holds.
        let zero = |dp, cp| Layout {
            dp,
            cp,
            zero: 1,
            ..plain.clone()
        };
        assert_eq!(states(&zero(1, 4)), states(&zero(4, 1)));
        assert!(states(&zero(1, 4)) < 0.5 * states(&plain));
        // The gradients' all-reduce over the two replicas of dp = 1 x cp = 2 (on the node's
        // links, behind the last backward pass): what dp = 2 pays, with half its tokens.
        let a = cm.predict(&zero(1, 2)).unwrap();
        let b = cm.predict(&zero(2, 1)).unwrap();
        assert_eq!(
            a.breakdown["zero_allgather_s"],
            b.breakdown["zero_allgather_s"]
        );
        // A split the sequence refuses is an error naming it.
        let bad = Layout {
            cp: 3,
            ..plain.clone()
        };
        let err = cm.predict(&bad).unwrap_err();
        assert_eq!(err, CostError::ContextSplit { cp: 3, seq: 16384 });
        let bad = Layout {
            tp: 1,
            sequence_parallel: true,
            ..plain.clone()
        };
        let err = cm.predict(&bad).unwrap_err().to_string();
        assert!(
            err.contains("tp > 1") && err.contains("16384 tokens"),
            "{err}"
        );
    }

    /// A calibration of the tiny GPT with round numbers: every unit 1 ms forward and 2 ms
    /// backward at tp = 1 and micro-batch 1 (growing linearly with the micro-batch), half that
    /// at tp = 2.
    fn tiny_calibration() -> (ModelProxy, Calibration) {
        use crate::planner::CALIBRATION_FORMAT;
        let model = ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512").unwrap();
        let mut timings = Vec::new();
        for unit in [UnitKind::Embedding, UnitKind::Layer, UnitKind::Head] {
            for (tp, scale) in [(1, 1.0), (2, 0.5)] {
                for b in [1, 2] {
                    timings.push(UnitTiming {
                        unit,
                        tp,
                        micro_batch: b,
                        forward_s: 1e-3 * scale * b as f64,
                        backward_s: 2e-3 * scale * b as f64,
                        tp_overlap: 1,
                    });
                }
            }
        }
        let cal = Calibration {
            format: CALIBRATION_FORMAT.into(),
            model: model.shape.unwrap(),
            backend: "test".into(),
            ranks: 2,
            element_bytes: 4.0,
            optimizer_s_per_param: 1e-9,
            micro_batch_s_per_param: 0.0,
            step_overhead_s: 5e-3,
            zero1_s_per_param: 0.0,
            alone_time_fraction: 0.0,
            timings,
        };
        (model, cal)
    }

    #[test]
    fn calibrated_units_replace_flops_and_tp_communication() {
        let (model, cal) = tiny_calibration();
        let hw = HardwareSpec::preset("local-cpu").unwrap();
        let cm = CostModel::new(&model, &hw).with_calibration(&cal);
        let params = model.params() as f64;
        // One rank, 4 micro-batches of 2: 4 units x (2 + 4) ms per micro-batch.
        let mut l = layout(&model, 1, 1, 1, 4);
        l.micro_batch = 2;
        l.recompute = vec![RecomputeMode::None];
        let pred = cm.predict(&l).unwrap();
        let want = 4.0 * 4.0 * 6e-3 + params * 1e-9 + 5e-3;
        assert!(
            (pred.step_time_s - want).abs() < 1e-9,
            "{} vs {want}",
            pred.step_time_s
        );
        // Full recomputation repeats the forward passes of the layers and the embedding (the
        // head's loss is not recomputed).
        l.recompute = vec![RecomputeMode::Full];
        let full = cm.predict(&l).unwrap().step_time_s;
        assert!(full > pred.step_time_s + 4.0 * 2.0 * 2e-3 - 1e-9, "{full}");
        // tp = 2 halves the measured times; no TP all-reduce is added on top.
        let mut l2 = layout(&model, 1, 2, 1, 4);
        l2.micro_batch = 2;
        l2.recompute = vec![RecomputeMode::None];
        let pred2 = cm.predict(&l2).unwrap();
        assert_eq!(pred2.breakdown["tp_comm_s"], 0.0);
        let optimizer = pred2.breakdown["optimizer_s"];
        assert!((pred2.step_time_s - optimizer - 4.0 * 4.0 * 3e-3).abs() < 1e-9);
        // The optimizer works on this rank's parameters: more than half (replicated norms and
        // biases), fewer than all.
        assert!(optimizer > params / 2.0 * 1e-9 + 5e-3 && optimizer < params * 1e-9 + 5e-3);
        // A degree the calibration does not cover falls back to FLOPs over the rate.
        let l4 = layout(&model, 1, 4, 1, 4);
        let uncalibrated = CostModel::new(&model, &hw).predict(&l4).unwrap();
        let fallback = cm.predict(&l4).unwrap();
        assert!(fallback.breakdown["compute_s"] == uncalibrated.breakdown["compute_s"]);
    }

    #[test]
    fn an_overlapped_layout_takes_the_layers_measured_with_its_degree() {
        let (model, mut cal) = tiny_calibration();
        // The layer measured at tp = 2 with 2 chunks: 1 ms slower forward and backward.
        for b in [1, 2] {
            cal.timings.push(UnitTiming {
                unit: UnitKind::Layer,
                tp: 2,
                micro_batch: b,
                forward_s: 0.5e-3 * b as f64 + 1e-3,
                backward_s: 1e-3 * b as f64 + 1e-3,
                tp_overlap: 2,
            });
        }
        let hw = HardwareSpec::preset("local-cpu").unwrap();
        let cm = CostModel::new(&model, &hw).with_calibration(&cal);
        let mut l = layout(&model, 1, 2, 1, 4);
        l.micro_batch = 2;
        l.recompute = vec![RecomputeMode::None];
        let serial = cm.predict(&l).unwrap().step_time_s;
        l.tp_overlap = 2;
        let overlapped = cm.predict(&l).unwrap().step_time_s;
        // 2 layers x 4 micro-batches x 2 ms.
        assert!(
            (overlapped - serial - 16e-3).abs() < 1e-9,
            "{overlapped} vs {serial}"
        );
        // Degree 4 was not measured: the timings without overlap.
        l.tp_overlap = 4;
        assert!((cm.predict(&l).unwrap().step_time_s - serial).abs() < 1e-12);
    }

    #[test]
    fn ranks_sharing_cores_take_the_mean_work_or_the_slowed_critical_path() {
        let (model, cal) = tiny_calibration();
        let mut hw = HardwareSpec::preset("local-cpu").unwrap();
        hw.devices_per_node = 4;
        let mut cores = hw.clone();
        cores.compute_units_per_node = 2;
        let own = CostModel::new(&model, &hw).with_calibration(&cal);
        let shared = CostModel::new(&model, &cores).with_calibration(&cal);
        // Data parallelism: every rank busy all the time, so sharing changes nothing (the
        // measured times already had every rank working).
        let mut dp = layout(&model, 4, 1, 1, 1);
        dp.recompute = vec![RecomputeMode::None];
        let a = own.predict(&dp).unwrap().step_time_s;
        let b = shared.predict(&dp).unwrap().step_time_s;
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        // A pipeline with idle ranks: a rank alone runs at units/ranks = 1/2 of its measured
        // time, so the step is shorter than the simulated one, but never shorter than the
        // ranks' mean work, and the estimate stays a lower bound.
        let mut pp = layout(&model, 1, 1, 4, 2);
        pp.recompute = vec![RecomputeMode::None; 4];
        let alone = own.predict(&pp).unwrap().step_time_s;
        let together = shared.predict(&pp).unwrap();
        assert!(together.step_time_s < alone);
        assert!(together.step_time_s >= alone / 2.0 - 1e-12);
        assert!(shared.estimate(&pp).unwrap().time_lower_bound_s <= together.step_time_s);
        assert!(together.breakdown.contains_key("shared_cores_step_s"));
        // A measured alone-time fraction (the calibration's first, then the hardware's)
        // replaces units / ranks: waiting ranks that keep their cores make the step slower.
        let mut measured = cal.clone();
        measured.alone_time_fraction = 0.9;
        let kept = CostModel::new(&model, &cores).with_calibration(&measured);
        let slower = kept.predict(&pp).unwrap().step_time_s;
        assert!(slower > together.step_time_s && slower <= alone, "{slower}");
        let mut spec = cores.clone();
        spec.alone_time_fraction = 0.9;
        let from_spec = CostModel::new(&model, &spec).with_calibration(&cal);
        assert_eq!(from_spec.predict(&pp).unwrap().step_time_s, slower);
    }

    #[test]
    fn single_device_time_is_flops_over_rate() {
        let model = ModelProxy::parse("gpt2").unwrap();
        let mut hw = HardwareSpec::preset("a100-80g").unwrap();
        // Memory-bound work for free: only the matrix products' FLOPs count.
        hw.memory_bandwidth = 1e30;
        let cm = CostModel::new(&model, &hw);
        let pred = cm.predict(&layout(&model, 1, 1, 1, 8)).unwrap();
        let flops = model.flops_per_iteration(8, RecomputeMode::Full);
        let expect = flops / hw.achievable_flops();
        let tail = pred.breakdown["optimizer_s"];
        assert!((pred.step_time_s - tail - expect).abs() < 1e-9 * expect);
    }

    /// The share of peak one device reaches on a GPT layer stack (no recomputation, 8
    /// sequences of 2048).
    fn single_device_efficiency(hidden: usize, flash_attention: bool) -> f64 {
        let heads = hidden / 128;
        let spec = format!("gpt:layers=8,hidden={hidden},heads={heads},seq=2048,vocab=51200");
        let model = ModelProxy::parse(&spec).unwrap();
        let mut hw = HardwareSpec::preset("h100-80g").unwrap();
        hw.flash_attention = flash_attention;
        hw.memory_bytes = u64::MAX / 4;
        let cm = CostModel::new(&model, &hw);
        let mut l = layout(&model, 1, 1, 1, 8);
        l.recompute = vec![RecomputeMode::None];
        let pred = cm.predict(&l).unwrap();
        let compute = pred.breakdown["compute_s"];
        model.flops_per_iteration(8, RecomputeMode::None) / compute / hw.peak_flops_fp16
    }

    #[test]
    fn larger_layers_reach_a_higher_share_of_peak() {
        // The memory-bound work grows like s h (and a s² without flash attention), the
        // matrix products like s h²: a small model runs further below the products' rate.
        for flash in [false, true] {
            let e: Vec<f64> = [1024, 2048, 4096, 8192]
                .iter()
                .map(|&h| single_device_efficiency(h, flash))
                .collect();
            assert!(e.windows(2).all(|w| w[0] < w[1]), "{flash}: {e:?}");
            assert!(e[3] < 0.70 && e[0] > 0.2, "{flash}: {e:?}");
        }
        // Flash attention removes the scores' memory traffic.
        assert!(single_device_efficiency(2048, true) > single_device_efficiency(2048, false));
    }

    #[test]
    fn extrapolation_matches_full_simulation() {
        let model = ModelProxy::parse("gpt-1.5b").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(16);
        let cm = CostModel::new(&model, &hw);
        for (kind, v) in [
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::ShiftedCriticalPath, 1),
            (ScheduleKind::TwoBw, 1),
            (ScheduleKind::Interleaved, 2),
        ] {
            let mut l = layout(&model, 1, 2, 4, 40);
            l.schedule = kind;
            if v > 1 {
                let costs: Vec<f64> = model
                    .units
                    .iter()
                    .map(|u| u.forward_flops + u.backward_flops)
                    .collect();
                l.virtual_stages = v;
                l.recompute = vec![RecomputeMode::Full; 4 * v];
                l.partition = balanced_partition(&costs, 4 * v).unwrap();
            }
            let derived = cm.derive(&l).unwrap();
            let exact = cm.pipeline_time(&l, &derived, 40).unwrap();
            let pred = cm.predict(&l).unwrap();
            let predicted = pred.breakdown["pipeline_s"];
            assert!(
                (predicted - exact).abs() < 1e-3 * exact,
                "{kind}: {predicted} vs {exact}"
            );
        }
    }

    #[test]
    fn memory_terms_follow_the_formulas() {
        let model = ModelProxy::parse("gpt-8.3b").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(64);
        let cm = CostModel::new(&model, &hw);
        let l = layout(&model, 4, 8, 2, 16);
        let pred = cm.predict(&l).unwrap();
        // Rank 0 holds min(p - 0, m) = 2 micro-batches of kept inputs.
        let range = l.partition.range(0);
        let blocks = (range.end - 1) as f64;
        let kept = 2.0 * 1024.0 * 3072.0 * (blocks * 2.0 + 1.0);
        let est = cm.estimate(&l).unwrap();
        assert_eq!(est.peak_memory_bytes, pred.peak_memory_bytes);
        let states: f64 = model.units[range]
            .iter()
            .map(|u| u.params_per_rank(8))
            .sum::<f64>()
            * 16.0;
        let expected = states
            + kept
            + FRAMEWORK_BYTES
            + model.units[1].activation_bytes(1, 8, RecomputeMode::None, false);
        assert!((pred.peak_memory_bytes[0] as f64 - expected).abs() < 2.0);
        let mut z = l.clone();
        z.zero = 1;
        let zp = cm.predict(&z).unwrap();
        assert!(zp.peak_memory_bytes[0] < pred.peak_memory_bytes[0]);
        assert!(est.time_lower_bound_s <= pred.step_time_s);
    }

    /// A mixture of experts with 16 experts (top-2, width 4096) on the h100-80g preset.
    fn moe_model() -> ModelProxy {
        ModelProxy::parse(
            "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
             expert_hidden=4096",
        )
        .unwrap()
    }

    /// Expert parallelism's all-to-alls as `alltoall` states them: per MoE block and
    /// micro-batch a dispatch and a combine forward, the same backward and again under full
    /// recomputation, each sending the rank's `top_k b s h / cp` 16-bit values spread over
    /// the `ep` ranks of its group; within a node `(ep - 1)/ep` of them at NVLink's bandwidth,
    /// across nodes the slower of the node's and the inter-node share.
    #[test]
    fn an_expert_parallel_layout_predicts_the_all_to_all() {
        let model = moe_model();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(32);
        let cm = CostModel::new(&model, &hw);
        let (b, s, h, k) = (2usize, 2048.0, 1024.0, 2.0);
        let bytes = k * b as f64 * s * h * 2.0;
        let (intra, inter) = (hw.intra_node_bandwidth, hw.inter_node_bandwidth);
        for (ep, cp, one) in [
            (1usize, 1usize, 0.0),
            (2, 1, bytes / 2.0 / intra + hw.intra_node_latency),
            (
                8,
                2,
                bytes / 2.0 * 7.0 / 8.0 / intra + hw.intra_node_latency,
            ),
            // 8 of the 16 ranks on the node: 7 shares over NVLink, 8 across nodes.
            (16, 1, bytes / 16.0 * 8.0 / inter + hw.inter_node_latency),
        ] {
            let split = RankSplit::new(1, cp, false).with_ep(ep);
            let none = cm.unit_terms(1, b, split, 1, RecomputeMode::None, false);
            assert!((none.ep_forward_s - 2.0 * one).abs() < 1e-15, "ep {ep}");
            assert_eq!(none.ep_backward_s, none.ep_forward_s);
            assert_eq!(none.ep_recompute_s, 0.0);
            let full = cm.unit_terms(1, b, split, 1, RecomputeMode::Full, false);
            assert_eq!(full.ep_recompute_s, full.ep_forward_s);
            // The embedding has no experts.
            let embedding = cm.unit_terms(0, b, split, 1, RecomputeMode::None, false);
            assert_eq!(embedding.ep_forward_s, 0.0);
        }
        // Under sequence parallelism a TP rank sends its 1/tp of the positions; the group's
        // ranks are tp apart (tp = 2, ep = 4: 8 devices, one node).
        let sp = RankSplit::new(2, 1, true).with_ep(4);
        let terms = cm.unit_terms(1, b, sp, 1, RecomputeMode::None, false);
        let one = bytes / 2.0 / 4.0 * 3.0 / intra + hw.intra_node_latency;
        assert!((terms.ep_forward_s - 2.0 * one).abs() < 1e-15);
        // The busiest rank computes EXPERT_IMBALANCE times its share of the routed experts
        // (and streams half the experts' weights).
        let even = cm.unit_terms(1, b, RankSplit::from(1), 1, RecomputeMode::None, false);
        let ep2 = cm.unit_terms(
            1,
            b,
            RankSplit::from(1).with_ep(2),
            1,
            RecomputeMode::None,
            false,
        );
        let routed = model.units[1].expert_flops * b as f64 / hw.achievable_flops();
        let weights = model.units[1].params_expert as f64 * 2.0 / hw.memory_bandwidth;
        let extra = (EXPERT_IMBALANCE - 1.0) * routed - weights / 2.0;
        assert!((ep2.forward_s - even.forward_s - extra).abs() < 1e-12);
        assert!((ep2.backward_s - even.backward_s - 2.0 * extra).abs() < 1e-12);
        // The step's breakdown names the all-to-alls: m micro-batches of the 4 blocks.
        let mut l = layout(&model, 8, 1, 1, 4);
        l.ep = 8;
        l.recompute = vec![RecomputeMode::None];
        let p = cm.predict(&l).unwrap();
        let per_block = cm
            .unit_terms(1, 1, l.split(), 1, RecomputeMode::None, false)
            .ep_forward_s;
        let expected = 4.0 * 4.0 * 2.0 * per_block;
        assert!((p.breakdown["ep_comm_s"] - expected).abs() < 1e-12);
    }

    /// The busiest rank's expected load is the model's `imbalance` (percent of the mean): its
    /// routed products take `(imbalance - 1)` times their share longer under ep > 1 (twice
    /// that backward), none at ep = 1.
    #[test]
    fn the_expert_imbalance_is_an_input_of_the_model() {
        let spec = "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
                    expert_hidden=4096";
        let even = ModelProxy::parse(&format!("{spec},imbalance=100")).unwrap();
        let skewed = ModelProxy::parse(&format!("{spec},imbalance=150")).unwrap();
        assert_eq!(moe_model().shape.unwrap().moe.unwrap().imbalance_pct, 120);
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
        let (a, c) = (CostModel::new(&even, &hw), CostModel::new(&skewed, &hw));
        let routed = even.units[1].expert_flops * 2.0 / hw.achievable_flops();
        for ep in [1usize, 4] {
            let split = RankSplit::from(1).with_ep(ep);
            let x = a.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
            let y = c.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
            let extra = if ep > 1 { 0.5 * routed } else { 0.0 };
            assert!((y.forward_s - x.forward_s - extra).abs() < 1e-12, "ep {ep}");
            assert!((y.backward_s - x.backward_s - 2.0 * extra).abs() < 1e-12);
            // The busiest rank also keeps 1.5 times the routed experts' activations.
            let kept = even.units[1].act_expert * 2.0;
            let more = if ep > 1 { 0.5 * kept } else { 0.0 };
            assert!((y.activation_bytes - x.activation_bytes - more).abs() < 1e-3);
        }
    }

    /// A routed expert's products over `m` tokens run at `m / (m + F/B)` of the achievable
    /// rate: a rank streams its `E/ep` experts' weights once per forward pass (twice
    /// backward), so few tokens per expert (small micro-batches, little ep) cost more per FLOP.
    #[test]
    fn small_expert_products_run_below_the_achievable_rate() {
        let spec = "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
                    expert_hidden=4096,imbalance=100";
        let model = ModelProxy::parse(spec).unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
        let cm = CostModel::new(&model, &hw);
        let u = &model.units[1];
        let terms = |b: usize, ep: usize| {
            cm.unit_terms(
                1,
                b,
                RankSplit::from(1).with_ep(ep),
                1,
                RecomputeMode::None,
                false,
            )
        };
        let weights = |ep: f64| u.params_expert as f64 * 2.0 / ep / hw.memory_bandwidth;
        let (two, four) = (terms(1, 2), terms(1, 4));
        assert!((two.forward_s - four.forward_s - (weights(2.0) - weights(4.0))).abs() < 1e-12);
        assert!(
            (two.backward_s - four.backward_s - 2.0 * (weights(2.0) - weights(4.0))).abs() < 1e-12
        );
        // Per sequence a micro-batch of 4 is cheaper than one of 1 (a dense unit: the same).
        assert!(terms(4, 2).forward_s / 4.0 < terms(1, 2).forward_s);
        let dense = |b: usize| {
            cm.unit_terms(0, b, 1, 1, RecomputeMode::None, false)
                .forward_s
        };
        assert!((dense(4) / 4.0 - dense(1)).abs() < 1e-12 * dense(1).max(1e-9));
        // The knee: the tokens per expert at which its products run at half the rate (about
        // 256 on the H100 preset); the expert share of an ep = 2 rank at b = 1, 2 k s / E = 512
        // tokens per expert, runs at 512 / (512 + 256).
        let knee = hw.achievable_flops() / hw.memory_bandwidth;
        assert!((knee - 256.0).abs() < 1.0, "{knee}");
        let products = u.expert_flops / hw.achievable_flops();
        let m = 2.0 * 2.0 * 2048.0 / 16.0;
        let share = products / (products + weights(2.0));
        // (GeLU experts: their biases add h + f values to the 2 h f weights.)
        assert!((share - m / (m + knee)).abs() < 1e-3, "{share}");
    }

    /// Selective recomputation keeps a MoE block's routed experts without their
    /// activation-function outputs (SwiGLU: SiLU and the product, `2 × 2 f` bytes a routed
    /// token; GeLU: `2 f`), as the runtime's checkpointing recomputes them.
    #[test]
    fn selective_recomputation_keeps_less_of_a_moe_block() {
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
        for (spec, per_token) in [
            ("experts=8,top_k=2,expert_hidden=512,swiglu=1", 4.0 * 512.0),
            ("experts=8,top_k=2,expert_hidden=512", 2.0 * 512.0),
        ] {
            let model = ModelProxy::parse(&format!(
                "gpt:layers=2,hidden=128,heads=4,seq=256,vocab=100,{spec},imbalance=125"
            ))
            .unwrap();
            let cm = CostModel::new(&model, &hw);
            for ep in [1usize, 2] {
                let split = RankSplit::from(1).with_ep(ep);
                let none = cm.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
                let sel = cm.unit_terms(1, 2, split, 1, RecomputeMode::Selective, false);
                let load = if ep > 1 { 1.25 } else { 1.0 };
                let saved = load * 2.0 * 2.0 * 256.0 * per_token;
                let got = none.activation_bytes - sel.activation_bytes;
                assert!(
                    (got - saved).abs() < 1e-6,
                    "{spec} ep {ep}: {got} vs {saved}"
                );
                assert!(sel.recompute_s > 0.0, "{spec}");
            }
        }
    }

    /// Memory per rank against ep: a rank holds `E/ep` routed experts (whole under tensor
    /// parallelism), their states sharded under ZeRO over the `dp/ep` ranks that hold them
    /// and their TP peers; the dense parameters as before.
    #[test]
    fn a_rank_holds_its_share_of_the_experts() {
        let model = moe_model();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
        let cm = CostModel::new(&model, &hw);
        let dense: f64 = model.units.iter().map(|u| u.params_per_rank(2)).sum();
        let experts: f64 = model.units.iter().map(|u| u.params_expert as f64).sum();
        assert_eq!(
            experts,
            4.0 * 16.0 * (2.0 * 1024.0 * 4096.0 + 4096.0 + 1024.0)
        );
        for zero in [0u8, 1, 2] {
            let mut previous = f64::INFINITY;
            for ep in [1usize, 2, 4, 8] {
                let mut l = layout(&model, 8, 2, 1, 1);
                (l.ep, l.zero, l.sequence_parallel) = (ep, zero, true);
                let p = cm.predict(&l).unwrap();
                let per = |d: usize| cm.state_bytes(&sharded(zero, d, ReduceScatter::Step)).dense;
                // The experts' states are cut over the dp / ep ranks and their 2 TP peers.
                let states = dense * per(8) + experts / ep as f64 * per(2 * 8 / ep);
                let got = p.breakdown["model_states_bytes"];
                assert!(
                    (got - states).abs() < 1e-3 * states.max(1.0),
                    "zero {zero} ep {ep}"
                );
                assert!(got < previous, "zero {zero} ep {ep}");
                previous = got;
            }
        }
        // ZeRO-2 reducing every micro-batch: the dense gradients are chunks, the experts' add
        // up whole through the step.
        let mut l = layout(&model, 8, 2, 1, 4);
        (l.ep, l.zero, l.sequence_parallel) = (2, 2, true);
        l.reduce_scatter = ReduceScatter::MicroBatch;
        let per = |d: usize, rs| cm.state_bytes(&sharded(2, d, rs)).dense;
        let states =
            dense * per(8, ReduceScatter::MicroBatch) + experts / 2.0 * per(8, ReduceScatter::Step);
        let got = cm.predict(&l).unwrap().breakdown["model_states_bytes"];
        assert!((got - states).abs() < 1e-3 * states, "{got} {states}");
        assert!(per(8, ReduceScatter::Step) > per(8, ReduceScatter::MicroBatch));
        // Layouts expert parallelism cannot take are refused naming the numbers.
        let mut l = layout(&model, 8, 1, 1, 1);
        l.ep = 3;
        let err = cm.predict(&l).unwrap_err();
        assert_eq!(
            err,
            CostError::ExpertParallel {
                ep: 3,
                replicas: 8,
                experts: 16
            }
        );
        let mut l = layout(&model, 4, 2, 1, 1);
        l.sequence_parallel = false;
        let err = cm.predict(&l).unwrap_err().to_string();
        assert!(
            err.contains("tp = 2 with a mixture of experts needs sequence"),
            "{err}"
        );
        let dense_model = ModelProxy::parse("gpt2").unwrap();
        let mut l = layout(&dense_model, 8, 1, 1, 1);
        l.ep = 2;
        let err = CostModel::new(&dense_model, &hw).predict(&l).unwrap_err();
        assert!(err.to_string().contains("model's 0 experts"), "{err}");
    }

    /// Megatron-Core's Mixtral 8x7B layout on 64 H100s (TP 1, EP 8, PP 4, VP 8, global batch
    /// 256): its data parallelism spans the nodes, so holding 1/8 of the experts cuts the
    /// gradients' exposed reduction and ZeRO's all-gather of the experts by more than the
    /// all-to-alls and the imbalance cost, and the model states to less than a third.
    #[test]
    fn megatron_cores_mixtral_layout_is_faster_with_expert_parallelism() {
        let model = ModelProxy::parse("mixtral-8x7b").unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(64);
        let cm = CostModel::new(&model, &hw);
        let costs: Vec<f64> = model.units.iter().map(|u| u.forward_flops).collect();
        let at = |ep: usize| {
            let mut l = layout(&model, 16, 1, 4, 16);
            (l.ep, l.zero, l.virtual_stages) = (ep, 1, 8);
            l.schedule = ScheduleKind::Interleaved;
            l.recompute = vec![RecomputeMode::None; 32];
            l.partition = balanced_partition(&costs, 32).unwrap();
            cm.predict(&l).unwrap()
        };
        let (plain, experts) = (at(1), at(8));
        assert!(experts.step_time_s < plain.step_time_s);
        let states = |p: &Prediction| p.breakdown["model_states_bytes"];
        assert!(states(&experts) < states(&plain) / 3.0);
        assert!(experts.breakdown["dp_exposed_s"] < plain.breakdown["dp_exposed_s"]);
        assert!(experts.breakdown["ep_comm_s"] > 0.0);
    }
}
