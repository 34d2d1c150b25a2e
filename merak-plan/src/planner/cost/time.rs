//! The step time of the cost model: per-unit and per-stage terms ([`UnitTerms`],
//! [`StageTerms`]), the costs derived from a layout, the simulated pipeline, and the
//! [`Prediction`] and [`Estimate`] built from them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    ChunkMemory, CostError, CostModel, Layout, OPTIMIZER_BYTES_PER_PARAM, RankMemory, SimKey,
};
use crate::pipeline::schedule::stage_of_chunk;
use crate::pipeline::{Costs, build_schedule, steady_step_time};
use crate::planner::calibration::UnitKind;
use crate::planner::memory::{GATHERED_AHEAD, gathered_bytes};
use crate::planner::model::{RankSplit, RecomputeMode};

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
/// stage planner ([`stage_dp`](crate::planner::stage_dp)).
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

/// Per-layout derived costs.
pub(super) struct Derived {
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
    /// Under a schedule that splits the backward (`split`) a rank's last work need not be a
    /// backward that the earlier stages wait for: its weight gradients (W) may run after it
    /// has sent the last input gradient, while the earlier stages work, which is how such a
    /// schedule fills the bubble. There the bound keeps only the forward chain before the
    /// rank and its own work.
    fn pipeline_lower_bound(&self, m: f64, split: bool) -> f64 {
        let chain = if split { 0.0 } else { 1.0 };
        let mut bound = 0.0f64;
        let mut before = 0.0;
        let mut after = 0.0;
        for rank in 0..self.compute_per_mb.len() {
            bound = bound.max(before + m * self.busy_per_mb(rank) + after);
            before += self.costs.forward[rank] + self.costs.send_activation;
            after += chain * (self.costs.backward[rank] + self.costs.send_grad);
        }
        bound
    }

    /// Each pipeline rank's peak bytes: its model states, activations and workspace.
    fn peak_memory(&self) -> Vec<u64> {
        (0..self.states.len())
            .map(|r| {
                RankMemory {
                    params: 0.0,
                    expert_params: 0.0,
                    states: self.states[r],
                    activations: self.activations[r],
                    workspace: self.workspace[r],
                }
                .peak_bytes()
            })
            .collect()
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

impl<'a> CostModel<'a> {
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

    pub(super) fn derive(&self, layout: &Layout) -> Result<Derived, CostError> {
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
        derived.pipeline_lb = derived.pipeline_lower_bound(
            layout.micro_batches as f64,
            layout.schedule.splits_backward(),
        );
        Ok(derived)
    }

    /// Each stage's terms (its units' compute, communication and memory) and the schedule's
    /// costs of its passes, ZeRO-3's gathers included.
    fn stage_terms(&self, layout: &Layout) -> (Vec<StageTerms>, Costs) {
        // Context parallelism folds into data parallelism for the parameters: `d` counts the
        // `dp * cp` ranks that hold the same parameters (ranks ordered tp, cp, dp, pp).
        let (t, d) = (layout.tp, layout.replicas());
        let s = Self::shard_ranks(layout);
        // The ranks that share the routed experts' shards, tensor-parallel peers apart (all
        // that hold the same experts, or under hybrid sharding those of one copy).
        let de = (layout.state_sharding().expert_shard / t.max(1)).max(1);
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
            // What a DualPipeV pair's forward fills with weight gradients.
            costs.forward_comm[j] = terms[j].ep_forward_s;
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
        let (mut last_backward, mut units) = (0.0, 0);
        let ranges = layout.partition.ranges();
        let mut held = Vec::new();
        for chunk in 0..v {
            let j = stage(chunk);
            last_backward += derived.costs.backward[j] + derived.costs.recompute[j];
            units += ranges.get(j).map_or(0, |r| r.len());
            held.extend(ranges.get(j).cloned().into_iter().flatten());
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
        // Muon keeps one state tensor for its matrices where AdamW keeps two.
        memory.states -= self.muon_state_saving(layout, &held);
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
        let tail = self.data_parallel_tail(layout, &memory, (last_backward, units));
        let optimizer = match self.calibration {
            Some(c) => tail.local_params * c.optimizer_s_per_param + c.step_overhead_s,
            None => tail.local_params * OPTIMIZER_BYTES_PER_PARAM / self.hardware.memory_bandwidth,
        } + self.muon_terms(layout, &held).seconds;
        derived.dp_exposed[rank] = tail.exposed;
        derived.allgather[rank] = tail.allgather;
        derived.optimizer[rank] = optimizer;
        derived.tail[rank] = tail.exposed + tail.allgather + optimizer;
        derived.states[rank] = memory.states;
        derived.activations[rank] = memory.activations;
        derived.workspace[rank] = memory.workspace;
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

    /// Memory per rank and a lower bound of the step time, without simulating: for a flushing
    /// schedule, rank `r` starts after micro-batch 0's forward passes (and messages) of the
    /// stages before it, works `m` times its per-micro-batch time, and the step ends after the
    /// last backward passes of those stages; the bound is the largest over ranks, plus the
    /// largest post-pipeline term. [`predict`](Self::predict) never returns less.
    pub fn estimate(&self, layout: &Layout) -> Result<Estimate, CostError> {
        let derived = self.derive(layout)?;
        Ok(Estimate {
            peak_memory_bytes: derived.peak_memory(),
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
    pub(super) fn pipeline_time(
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
        for v in [
            &costs.forward,
            &costs.backward,
            &costs.recompute,
            &costs.forward_comm,
        ] {
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
        let memory = derived.peak_memory();
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
