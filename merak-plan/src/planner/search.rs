//! The search: the fastest 3D-parallel plan, its runner-ups and the Pareto set of (step time,
//! peak memory per device) plans that fit a memory budget.
//!
//! The space: every `dp * cp * tp * pp = gpus` with `tp` dividing the heads and within a node
//! and `pp <= L + 2`; every context-parallel degree `cp` whose zigzag cuts the sequence
//! (`2 cp` divides it) and leaves each rank at least [`SearchOptions::min_cp_tokens`] tokens of
//! it (or those of [`SearchOptions::cp`]); sequence parallelism where `tp > 1` divides a rank's
//! `s / cp` tokens (by default only with it: it never costs time in the cost model and saves
//! memory, see [`SearchOptions::sequence_parallel`]); every micro-batch size that divides the
//! per-replica batch (the global batch is fixed); every schedule (virtual stages for the
//! interleaved one); the recomputation policies none, selective, full (every stage) and
//! stage-aware; the ZeRO stages; every tensor-parallel overlap degree up to the hardware's
//! `max_tp_overlap` (only with tp > 1, and dividing the tokens a rank holds). Context and
//! sequence parallelism are searched only for a model with a transformer shape (their
//! divisibility needs the sequence length). For a mixture of experts, every expert-parallel
//! degree `ep` dividing the experts with its group within a node (`tp ep <= devices per
//! node`, or those of [`SearchOptions::ep`]) that divides `dp cp`, and tensor parallelism only
//! with sequence parallelism; a dense model only `ep = 1`. For the uniform policies, stage
//! boundaries come from [`balanced_partition`] of the per-unit compute.
//!
//! Stage-aware recomputation with one stage per pipeline rank (every schedule but the
//! interleaved one) is planned by the exact dynamic program of [`stage_dp`](super::stage_dp):
//! it chooses the stage boundaries *and* each stage's mode (none, selective, full) together,
//! minimising the bottleneck stage time per micro-batch (forward + backward + recomputation with
//! their TP communication; ties: smaller total, then smaller memory) subject to every stage's
//! exact peak memory — which depends on the stage's index through the micro-batches it holds in
//! flight — fitting the budget. Skeletons (degrees, micro-batch, schedule, ZeRO-1) that no cut
//! fits yield no stage-aware layout; a result with one mode everywhere and the partition of that
//! mode's uniform policy is left to that policy. With the interleaved schedule, stage-aware keeps
//! Merak's per-rank rule on the compute-balanced partition: per pipeline rank the cheapest mode
//! whose memory fits.
//!
//! The space is bounded before any layout is built: at most [`MAX_SEARCH_UNITS`] units, at
//! most [`MAX_SEARCH_LAYOUTS`] layouts and [`MAX_SEARCH_WORK`] steps of work (`units²` per
//! layout the stage planner cuts, `units` per other, [`layout_work`]), counted from the
//! degrees, micro-batch sizes, schedules and policies; the devices are never enumerated, so
//! `gpus = 10^12` is answered at once.
//! Beyond either the search is refused, naming the numbers; within them it takes seconds, and
//! [`search_with_progress`] reports how far it has come.
//!
//! Every layout is first *estimated* (exact memory and a lower bound of its time, no
//! simulation, see [`CostModel::estimate`]); plans over the budget are dropped. The rest are
//! predicted with the simulating cost model in increasing order of their lower bound, skipping a
//! plan when it can neither enter the fastest few (its bound is already slower) nor the Pareto
//! set (a Pareto member is at least as fast as its bound with at most its memory). The skipped
//! plans are therefore dominated by, or equal to, a member of the returned Pareto set.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::calibration::Calibration;
use super::cost::{CostError, CostModel, Layout, OptimizerCost, Prediction};
use super::hardware::HardwareSpec;
use super::model::{ModelProxy, RankSplit, RecomputeMode};
use super::stage_dp::{Skeleton, StageDp, StageDpError};
use crate::data_parallel::ReduceScatter;
use crate::pipeline::{Partition, Recompute, ScheduleKind, balanced_partition};

/// The most units (layers + the embedding + the head) a search plans: the stage planner
/// tabulates every range of units (`O(units²)` memory per tensor-parallel degree, micro-batch
/// size and overlap degree: about 230 MB at this bound), so a larger model is refused at once
/// ([`SearchError::TooManyUnits`]) instead of exhausting the memory.
pub const MAX_SEARCH_UNITS: usize = 514;

/// The most layouts a search considers, whatever the model.
pub const MAX_SEARCH_LAYOUTS: usize = 1 << 20;

/// The search's work bound, in steps ([`layout_work`]): the stage planner's passes over a
/// skeleton take up to `units²` steps each, a layout of a uniform recomputation policy (a
/// balanced cut and its estimate) about `units`; about 10 s at this bound on one core. A space
/// beyond it or beyond [`MAX_SEARCH_LAYOUTS`], counted before any layout is built, is refused
/// at once ([`SearchError::TooManyLayouts`]).
pub const MAX_SEARCH_WORK: usize = 1 << 30;

/// The steps the search spends on one layout of a model of `units` units: `units²` when the
/// stage planner cuts it (`stage_planned`, the stage-aware policy), `units` otherwise.
pub fn layout_work(units: usize, stage_planned: bool) -> usize {
    let units = units.max(1);
    if stage_planned {
        units.saturating_mul(units)
    } else {
        units
    }
}

/// The most layouts the stage planner cuts that a search of a model of `units` units
/// considers: [`MAX_SEARCH_WORK`] / units², at most [`MAX_SEARCH_LAYOUTS`].
pub fn layout_limit(units: usize) -> usize {
    (MAX_SEARCH_WORK / layout_work(units, true)).min(MAX_SEARCH_LAYOUTS)
}

/// How far a search has come, for a progress bar: `done` of `total` steps of `phase`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SearchProgress {
    /// What the search is doing: "building layouts" (the stage planner included), "estimating"
    /// or "simulating".
    pub phase: &'static str,
    /// Steps done.
    pub done: usize,
    /// Steps of the phase.
    pub total: usize,
}

/// What to search over.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchOptions {
    /// Devices to use (`dp * cp * tp * pp`).
    pub gpus: usize,
    /// Sequences per step.
    pub global_batch: usize,
    /// Memory per device; `None` uses the hardware's.
    pub memory_budget_bytes: Option<u64>,
    /// Micro-batch sizes to try (those dividing the per-replica batch are used).
    pub micro_batch_sizes: Vec<usize>,
    /// Schedules to try.
    pub schedules: Vec<ScheduleKind>,
    /// Virtual stages to try with the interleaved schedule.
    pub virtual_stages: Vec<usize>,
    /// Recomputation policies to try.
    pub recompute: Vec<Recompute>,
    /// ZeRO stages to try (0 to 3; above 0 only with dp > 1; 3 only with full recomputation,
    /// which is what merak's ZeRO-3 runs, and not with a schedule that splits the backward pass
    /// or keeps two weight versions).
    pub zero: Vec<u8>,
    /// Sub-pipelining degrees of tensor parallelism to try (`Layout::tp_overlap`); those above
    /// the hardware's `max_tp_overlap`, above 1 without tensor parallelism, or not dividing a
    /// micro-batch's tokens are skipped.
    pub tp_overlap: Vec<usize>,
    /// Context-parallel degrees to try; empty (the default): every divisor of the devices
    /// whose ring leaves each rank at least [`min_cp_tokens`](Self::min_cp_tokens) tokens of a
    /// sequence. Either way only degrees with `2 cp` dividing the sequence length are used.
    pub cp: Vec<usize>,
    /// With [`cp`](Self::cp) empty, the fewest tokens of a sequence a rank of a ring may hold
    /// (`s / cp`), 2048 by default: below about `F / B` tokens (the achievable FLOP/s over the
    /// link's bytes/s, 1 500 on the `h100-80g` preset's NVLink, 14 000 across its nodes) a
    /// hop takes longer than the attention block it hides behind, and the bound keeps the
    /// search of short sequences (2048 and below) as it was.
    pub min_cp_tokens: usize,
    /// Sequence parallelism to try where tp > 1 divides the tokens a rank holds (elsewhere
    /// layouts run without it). The default, `[true]`: with it wherever it applies, since the
    /// cost model never finds it slower (the same bytes travel, the LayerNorms and dropouts
    /// work on `1/t` of the tokens) and it holds less memory, so a layout without it is
    /// dominated by its twin; `[false, true]` searches both (twice the tensor-parallel
    /// layouts), `[false]` none.
    pub sequence_parallel: Vec<bool>,
    /// Expert-parallel degrees to try for a mixture of experts; empty (the default): every
    /// divisor of the experts whose group stays within a node (`tp ep <= devices per node`:
    /// the all-to-alls on the node's links, `ep = 1` among them); named, only those (name 1 to
    /// compare with no expert parallelism). Either way only degrees dividing `dp cp` and the
    /// experts are used; a dense model is searched at `ep = 1` only.
    pub ep: Vec<usize>,
    /// How many runner-up plans to return besides the fastest.
    pub runner_ups: usize,
    /// The optimizer the run steps with, as the cost model prices it (element-wise AdamW by
    /// default; Muon adds its orthogonalizations and their communication).
    pub optimizer: OptimizerCost,
}

impl SearchOptions {
    /// Everything: micro-batches 1, 2, 4, 8; every schedule that trains like one process (all
    /// but PipeDream-2BW, whose delayed update changes the training: add
    /// [`ScheduleKind::TwoBw`] to `schedules` to search it too); 2 or 4 virtual stages; every
    /// recomputation policy; ZeRO stages 0 to 3; tensor-parallel overlap 1, 2 and 4 (as
    /// far as the hardware allows); context parallelism where each rank keeps at least 2048
    /// tokens of a sequence; sequence parallelism wherever it applies; 4 runner-ups; the
    /// hardware's memory.
    pub fn new(gpus: usize, global_batch: usize) -> Self {
        SearchOptions {
            gpus,
            global_batch,
            memory_budget_bytes: None,
            micro_batch_sizes: vec![1, 2, 4, 8],
            schedules: ScheduleKind::ALL
                .into_iter()
                .filter(|k| k.flushes())
                .collect(),
            virtual_stages: vec![2, 4],
            recompute: Recompute::ALL.to_vec(),
            zero: vec![0, 1, 2, 3],
            tp_overlap: vec![1, 2, 4],
            cp: Vec::new(),
            min_cp_tokens: 2048,
            sequence_parallel: vec![true],
            ep: Vec::new(),
            runner_ups: 4,
            optimizer: OptimizerCost::ElementWise,
        }
    }
}

/// One plan: a layout, the recomputation policy that produced it and its prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// The layout.
    pub layout: Layout,
    /// The policy (stage-aware plans have per-stage modes in the layout).
    pub policy: Recompute,
    /// The predicted time and memory.
    pub prediction: Prediction,
}

impl Plan {
    /// `(step time, peak memory)`.
    pub fn point(&self) -> (f64, u64) {
        (
            self.prediction.step_time_s,
            self.prediction.max_memory_bytes(),
        )
    }
}

/// The result of [`search`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchResult {
    /// The fastest plan that fits.
    pub best: Plan,
    /// The next fastest plans, fastest first.
    pub runner_ups: Vec<Plan>,
    /// The Pareto set of (step time, peak memory), fastest first.
    pub pareto: Vec<Plan>,
    /// Layouts considered (estimated).
    pub considered: usize,
    /// Layouts that fit the budget.
    pub feasible: usize,
    /// Layouts predicted with the simulator.
    pub predicted: usize,
}

/// Why the search found no plan.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum SearchError {
    /// No layout satisfies the structural constraints.
    #[error(
        "no layout for {gpus} devices and global batch {global_batch}: need dp * cp * tp * pp \
         = gpus with tp dividing the {heads} heads and at most {per_node} per node, pp <= \
         {units} units and dp dividing the global batch"
    )]
    NoLayout {
        /// Devices.
        gpus: usize,
        /// Global batch.
        global_batch: usize,
        /// Heads.
        heads: usize,
        /// Devices per node.
        per_node: usize,
        /// Units of the model.
        units: usize,
    },
    /// Nothing fits the memory budget.
    #[error(
        "no plan fits in {budget_bytes} bytes per device; the smallest plan needs \
         {smallest_bytes} bytes ({:.2} GiB)", *smallest_bytes as f64 / 1073741824.0
    )]
    DoesNotFit {
        /// The budget.
        budget_bytes: u64,
        /// The smallest peak memory of any layout.
        smallest_bytes: u64,
    },
    /// The model has more units than a search plans ([`MAX_SEARCH_UNITS`]).
    #[error(
        "the model has {units} units (layers + embedding + head): the planner searches at most \
         {limit} (its stage planner's tables grow with the square of the units)"
    )]
    TooManyUnits {
        /// The model's units.
        units: usize,
        /// [`MAX_SEARCH_UNITS`].
        limit: usize,
    },
    /// The space holds more work than a search does ([`MAX_SEARCH_WORK`], [`layout_work`]), or
    /// more layouts than [`MAX_SEARCH_LAYOUTS`].
    #[error(
        "{gpus} devices with global batch {global_batch}: the search would consider {layouts} \
         layouts of a model of {units} units, {staged} of them cut by the stage planner: \
         {work} steps of work (units² per layout the stage planner cuts, units per other), \
         the limit is 2^30 steps and 2^20 layouts: plan fewer layers or devices, or search \
         fewer micro-batch sizes, schedules, overlap or context-parallel degrees or \
         recomputation policies"
    )]
    TooManyLayouts {
        /// Devices.
        gpus: usize,
        /// Global batch.
        global_batch: usize,
        /// The layouts of the space.
        layouts: usize,
        /// Those the stage planner cuts (the stage-aware policy).
        staged: usize,
        /// The model's units.
        units: usize,
        /// The steps of work of the space ([`layout_work`]).
        work: usize,
    },
    /// A layout could not be costed.
    #[error(transparent)]
    Cost(#[from] CostError),
    /// The stage planner rejected a skeleton (should not happen for generated skeletons).
    #[error(transparent)]
    StagePlan(#[from] StageDpError),
}

/// A layout with its policy.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// The policy that produced its recomputation modes.
    pub policy: Recompute,
}

/// The divisors of `n` up to `at_most`, in increasing order, found in `O(√n)` steps.
fn divisors_up_to(n: usize, at_most: usize) -> Vec<usize> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut d = 1usize;
    while d.checked_mul(d).is_some_and(|square| square <= n) {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small.retain(|&d| d <= at_most);
    small
}

/// The greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `values` without repeats (the first of each kept) and without those `keep` refuses.
fn distinct<T: Copy + PartialEq>(values: &[T], keep: impl Fn(T) -> bool) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for &v in values {
        if keep(v) && !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

fn unit_costs(model: &ModelProxy, mode: RecomputeMode) -> Vec<f64> {
    model
        .units
        .iter()
        .map(|u| u.forward_flops + u.backward_flops + u.recompute_flops(1, mode))
        .collect()
}

/// The plain policy that uses `mode` on every stage, and its index in [`RecomputeMode::ALL`].
fn uniform_policy(mode: RecomputeMode) -> (Recompute, usize) {
    match mode {
        RecomputeMode::None => (Recompute::None, 0),
        RecomputeMode::Selective => (Recompute::Selective, 1),
        RecomputeMode::Full => (Recompute::Full, 2),
    }
}

/// Every layout of the search space, with stage-aware recomputation resolved against `budget`.
///
/// # Errors
///
/// [`SearchError::TooManyUnits`] or [`SearchError::TooManyLayouts`] for a space beyond the
/// search's bounds; a layout that the cost model rejects (should not happen for generated
/// layouts).
pub fn candidates(
    cm: &CostModel<'_>,
    options: &SearchOptions,
    budget: u64,
) -> Result<Vec<Candidate>, SearchError> {
    let slots = space(cm.model(), cm.hardware(), options)?;
    let mut dp_planner = StageDp::new(cm, budget);
    generate(
        cm,
        options,
        &slots,
        &mut dp_planner,
        &mut Vec::new(),
        &mut |_| {},
    )
}

/// A point of the search space before the recomputation policy and ZeRO-1.
#[derive(Clone, Copy, Debug)]
struct Slot {
    dp: usize,
    /// Tensor, context and sequence parallelism.
    split: RankSplit,
    pp: usize,
    /// Micro-batch size.
    b: usize,
    /// Micro-batches per step.
    m: usize,
    /// Tensor-parallel overlap degree.
    k: usize,
    schedule: ScheduleKind,
    /// Virtual stages.
    v: usize,
    /// Devices per node (hybrid sharding keeps a copy's shards within one).
    per_node: usize,
}

impl Slot {
    /// The layouts of this slot under `policy`: one per ZeRO stage it allows
    /// ([`Slot::allows`]) and way it runs ([`Slot::variants`]).
    fn layouts(&self, options: &SearchOptions, policy: Recompute) -> usize {
        (options.zero.iter().filter(|&&z| self.allows(z, policy)))
            .map(|&z| self.variants(z, policy).len())
            .sum()
    }

    /// The ways ZeRO stage `zero` runs under `policy`, each when it reduce-scatters and over
    /// how many ranks it shards. Stages 2 and 3 reduce-scatter every micro-batch as well as
    /// once per step (one micro-batch: only every micro-batch, as fast and holding less);
    /// ZeRO-3, whose gathers run every pass, also
    /// shards within a node when its data-parallel group spans more (hybrid sharding: the
    /// largest divisor of dp whose copy fits in a node and that the expert-parallel degree
    /// divides; stages 1 and 2 may be hybrid too, but
    /// are not searched, to keep the space within its bound). Only under a uniform policy: the
    /// stage planner's cuts assume once per step and all of dp.
    fn variants(&self, zero: u8, policy: Recompute) -> Vec<Zeroed> {
        let uniform = policy != Recompute::StageAware;
        let mut rs = vec![ReduceScatter::Step];
        if zero >= 2 && uniform {
            // With one micro-batch both move the same bytes, and once per step holds whole
            // gradient buckets: only every micro-batch is searched.
            if self.m == 1 {
                rs.clear();
            }
            rs.push(ReduceScatter::MicroBatch);
        }
        let mut shards = vec![0];
        let tp = self.split.tp;
        if zero == 3 && uniform && self.split.cp == 1 && self.dp * tp > self.per_node {
            let largest = (self.per_node / tp.max(1)).min(self.dp - 1);
            // Each copy holds every routed expert: ep divides the copy.
            let ep = self.split.ep.max(1);
            let within = (2..=largest)
                .rev()
                .find(|&s| self.dp.is_multiple_of(s) && s.is_multiple_of(ep));
            shards.extend(within);
        }
        (rs.iter())
            .flat_map(|&rs| shards.iter().map(move |&shard| Zeroed { zero, rs, shard }))
            .collect()
    }

    /// Whether ZeRO stage `zero` goes with this slot under `policy`: any stage above 0 needs
    /// more than one replica (`dp * cp > 1`), and stage 3 (every unit recomputed, one unit's
    /// backward pass at a time) full recomputation and a schedule that neither splits the
    /// backward pass nor keeps two weight versions. (A mixture of experts only limits hybrid
    /// sharding: see [`variants`](Self::variants).)
    fn allows(&self, zero: u8, policy: Recompute) -> bool {
        let three_runs = policy == Recompute::Full
            && !self.schedule.splits_backward()
            && self.schedule != ScheduleKind::TwoBw;
        let replicas = self.dp * self.split.cp;
        match zero {
            0 => true,
            1 | 2 => replicas > 1,
            3 => replicas > 1 && three_runs,
            _ => false,
        }
    }
}

/// The slots of the search space (see the [module docs](self)), in the order the layouts are
/// generated, after checking the bounds: at most [`MAX_SEARCH_UNITS`] units,
/// [`MAX_SEARCH_LAYOUTS`] layouts and [`MAX_SEARCH_WORK`] steps. The device count is never enumerated: tensor parallelism ranges
/// over the divisors of the heads, context parallelism over those of half the sequence,
/// pipeline parallelism over the units, so any `gpus` is answered at once.
fn space(
    model: &ModelProxy,
    hw: &HardwareSpec,
    options: &SearchOptions,
) -> Result<Vec<Slot>, SearchError> {
    let units = model.num_units();
    if units > MAX_SEARCH_UNITS {
        return Err(SearchError::TooManyUnits {
            units,
            limit: MAX_SEARCH_UNITS,
        });
    }
    let gpus = options.gpus;
    let mut slots = Vec::new();
    let (mut layouts, mut staged, mut work) = (0usize, 0usize, 0usize);
    for tp in divisors_up_to(gcd(gpus, model.heads), hw.devices_per_node) {
        for split in splits(model, gpus / tp, tp, options) {
            let rest = gpus / (tp * split.cp);
            for split in expert_splits(model, hw, options, split) {
                for pp in (1..=units.min(rest)).filter(|&pp| rest.is_multiple_of(pp)) {
                    let dp = rest / pp;
                    if !(dp * split.cp).is_multiple_of(split.ep) {
                        continue;
                    }
                    for slot in pipeline_slots(model, hw, options, dp, split, pp) {
                        for &policy in &options.recompute {
                            let n = slot.layouts(options, policy);
                            let stage_planned = policy == Recompute::StageAware;
                            layouts = layouts.saturating_add(n);
                            staged = staged.saturating_add(if stage_planned { n } else { 0 });
                            let each = layout_work(units, stage_planned);
                            work = work.saturating_add(n.saturating_mul(each));
                        }
                        if work <= MAX_SEARCH_WORK && layouts <= MAX_SEARCH_LAYOUTS {
                            slots.push(slot);
                        }
                    }
                }
            }
        }
    }
    if work > MAX_SEARCH_WORK || layouts > MAX_SEARCH_LAYOUTS {
        return Err(SearchError::TooManyLayouts {
            gpus,
            global_batch: options.global_batch,
            layouts,
            staged,
            units,
            work,
        });
    }
    Ok(slots)
}

/// The context-parallel degrees and sequence-parallel settings to search with `tp`, `rest`
/// devices left (`gpus / tp`): see [`SearchOptions::cp`] and
/// [`SearchOptions::sequence_parallel`]; only `cp = 1` without sequence parallelism for a
/// model without a transformer shape.
fn splits(model: &ModelProxy, rest: usize, tp: usize, options: &SearchOptions) -> Vec<RankSplit> {
    let Some(seq) = model.seq() else {
        return vec![RankSplit::from(tp)];
    };
    let degrees = if options.cp.is_empty() {
        divisors_up_to(gcd(rest, (seq / 2).max(1)), usize::MAX)
            .into_iter()
            .filter(|&cp| cp == 1 || seq / cp >= options.min_cp_tokens)
            .collect()
    } else {
        distinct(&options.cp, |cp| {
            cp == 1 || (cp > 0 && rest.is_multiple_of(cp))
        })
    };
    let mut out = Vec::new();
    for cp in degrees {
        let with = |sequence_parallel| RankSplit::new(tp, cp, sequence_parallel);
        // A mixture of experts runs tensor parallelism only with sequence parallelism.
        let experts_fit = |sp: bool| sp || tp == 1 || model.experts().is_none();
        let valid = |&sp: &bool| model.splits_sequence(with(sp)).is_ok() && experts_fit(sp);
        let mut settings = distinct(&options.sequence_parallel, |sp| valid(&sp));
        if settings.is_empty() {
            settings.push(false);
        }
        out.extend(
            settings
                .into_iter()
                .map(with)
                .filter(|s| valid(&s.sequence_parallel)),
        );
    }
    out
}

/// `split` with each expert-parallel degree to search (see [`SearchOptions::ep`]): only
/// `ep = 1` for a dense model.
fn expert_splits(
    model: &ModelProxy,
    hw: &HardwareSpec,
    options: &SearchOptions,
    split: RankSplit,
) -> Vec<RankSplit> {
    let Some(experts) = model.experts() else {
        return vec![split];
    };
    let degrees = if options.ep.is_empty() {
        divisors_up_to(experts, hw.devices_per_node / split.tp.max(1))
    } else {
        distinct(&options.ep, |ep| ep > 0 && experts.is_multiple_of(ep))
    };
    degrees.into_iter().map(|ep| split.with_ep(ep)).collect()
}

/// The slots with `dp` replicas of `split` over `pp` pipeline ranks: every micro-batch size,
/// overlap degree, schedule and virtual stage count that fits (none when `dp` does not divide
/// the global batch).
fn pipeline_slots(
    model: &ModelProxy,
    hw: &HardwareSpec,
    options: &SearchOptions,
    dp: usize,
    split: RankSplit,
    pp: usize,
) -> Vec<Slot> {
    let units = model.num_units();
    if !options.global_batch.is_multiple_of(dp) {
        return Vec::new();
    }
    let per_replica = options.global_batch / dp;
    let overlaps = distinct(&options.tp_overlap, |k| k == 1 || k <= hw.max_tp_overlap);
    let schedules = distinct(&options.schedules, |_| true);
    let virtual_stages = distinct(&options.virtual_stages, |v| v >= 2 && v <= units);
    let mut out = Vec::new();
    for b in distinct(&options.micro_batch_sizes, |b| {
        b > 0 && per_replica.is_multiple_of(b)
    }) {
        let m = per_replica / b;
        let tokens_split = |k: usize| model.splits_tokens_on(b, k, split).is_ok();
        let ks = (overlaps.iter()).filter(|&&k| k == 1 || (split.tp > 1 && tokens_split(k)));
        for (&k, &schedule) in ks.flat_map(|k| schedules.iter().map(move |s| (k, s))) {
            for v in stage_counts(schedule, pp, m, units, &virtual_stages) {
                out.push(Slot {
                    dp,
                    split,
                    pp,
                    b,
                    m,
                    k,
                    schedule,
                    v,
                    per_node: hw.devices_per_node,
                });
            }
        }
    }
    out
}

/// The virtual stages of `schedule` with `pp` ranks, `m` micro-batches and `units` units:
/// 2 for ZB-V and DualPipeV (which also needs `2 pp` micro-batches), those of `virtual` for
/// the interleaved schedule, 1 otherwise.
fn stage_counts(
    schedule: ScheduleKind,
    pp: usize,
    m: usize,
    units: usize,
    virtual_stages: &[usize],
) -> Vec<usize> {
    let fits = |v: usize| pp >= 2 && pp.checked_mul(v).is_some_and(|s| s <= units);
    if schedule.v_shaped() {
        let enough = m >= schedule.min_micro_batches(pp);
        [2].into_iter().filter(|&v| fits(v) && enough).collect()
    } else if schedule.uses_virtual_stages() {
        virtual_stages
            .iter()
            .copied()
            .filter(|&v| fits(v) && m.is_multiple_of(pp))
            .collect()
    } else {
        vec![1]
    }
}

/// The layouts of `slots` (from [`space`]) with the stage planner `dp_planner` (and its
/// budget); the skeletons it finds no cut for are pushed to `unplanned`. `progress` hears of
/// every slot done.
fn generate(
    cm: &CostModel<'_>,
    options: &SearchOptions,
    slots: &[Slot],
    dp_planner: &mut StageDp<'_, '_>,
    unplanned: &mut Vec<Skeleton>,
    progress: &mut dyn FnMut(SearchProgress),
) -> Result<Vec<Candidate>, SearchError> {
    let model = cm.model();
    let partitions: Vec<Vec<f64>> = RecomputeMode::ALL
        .iter()
        .map(|&m| unit_costs(model, m))
        .collect();
    let mut cache: HashMap<(usize, usize), Partition> = HashMap::new();
    let none = || no_layout(model, cm.hardware(), options);
    let mut plain_partition = |mode_index: usize, stages: usize| {
        if let Some(p) = cache.get(&(mode_index, stages)) {
            return Ok(p.clone());
        }
        let p = balanced_partition(&partitions[mode_index], stages).map_err(|_| none())?;
        cache.insert((mode_index, stages), p.clone());
        Ok::<_, SearchError>(p)
    };
    let mut out = Vec::new();
    let mut split = None;
    for (done, slot) in slots.iter().enumerate() {
        if split != Some(slot.split) {
            // The stage planner's tables are per rank split: keep one split's.
            dp_planner.release_tables();
            split = Some(slot.split);
        }
        progress(SearchProgress {
            phase: "building layouts",
            done,
            total: slots.len(),
        });
        for &policy in &options.recompute {
            let mode_index = match policy {
                Recompute::None | Recompute::StageAware => 0,
                Recompute::Selective => 1,
                Recompute::Full => 2,
            };
            let partition = plain_partition(mode_index, slot.pp * slot.v)?;
            for &zero in options.zero.iter().filter(|&&z| slot.allows(z, policy)) {
                if policy == Recompute::StageAware && slot.v == 1 {
                    let layout = planned(
                        slot,
                        zero,
                        dp_planner,
                        unplanned,
                        &mut plain_partition,
                        options,
                    )?;
                    out.extend(layout.map(|layout| Candidate { layout, policy }));
                    continue;
                }
                for zeroed in slot.variants(zero, policy) {
                    let layout = shaped(cm, slot, policy, zeroed, &partition, dp_planner.budget())?;
                    out.extend(layout.map(|layout| Candidate { layout, policy }));
                }
            }
        }
    }
    Ok(out)
}

/// The stage planner's layout of `slot` with ZeRO stage `zero`, or `None` when no cut fits
/// (the skeleton goes to `unplanned`) or when a uniform policy searched makes the same layout.
fn planned(
    slot: &Slot,
    zero: u8,
    dp_planner: &mut StageDp<'_, '_>,
    unplanned: &mut Vec<Skeleton>,
    plain_partition: &mut dyn FnMut(usize, usize) -> Result<Partition, SearchError>,
    options: &SearchOptions,
) -> Result<Option<Layout>, SearchError> {
    let skeleton = Skeleton {
        dp: slot.dp,
        tp: slot.split.tp,
        pp: slot.pp,
        micro_batch: slot.b,
        micro_batches: slot.m,
        schedule: slot.schedule,
        zero,
        tp_overlap: slot.k,
        cp: slot.split.cp,
        sequence_parallel: slot.split.sequence_parallel,
        ep: slot.split.ep,
    };
    let Some(plan) = dp_planner.plan(&skeleton)? else {
        unplanned.push(skeleton);
        return Ok(None);
    };
    let layout = plan.layout;
    let first = layout.recompute[0];
    if layout.recompute.iter().all(|&mode| mode == first) {
        // Left to the uniform policy when it makes this layout.
        let (plain, index) = uniform_policy(first);
        if options.recompute.contains(&plain)
            && plain_partition(index, slot.pp)? == layout.partition
        {
            return Ok(None);
        }
    }
    Ok(Some(layout))
}

/// A ZeRO stage, when it reduce-scatters and over how many ranks it shards.
#[derive(Clone, Copy)]
struct Zeroed {
    zero: u8,
    rs: ReduceScatter,
    /// The hybrid sharding degree (0: all of dp).
    shard: usize,
}

/// The layout of `slot` with ZeRO stage `zero` under a uniform `policy` on `partition`, or the
/// per-rank
/// stage-aware rule for interleaved slots (`None` when that is uniform).
fn shaped(
    cm: &CostModel<'_>,
    slot: &Slot,
    policy: Recompute,
    zero: Zeroed,
    partition: &Partition,
    budget: u64,
) -> Result<Option<Layout>, SearchError> {
    let uniform = |mode| Layout {
        dp: slot.dp,
        tp: slot.split.tp,
        pp: slot.pp,
        virtual_stages: slot.v,
        micro_batch: slot.b,
        micro_batches: slot.m,
        schedule: slot.schedule,
        recompute: vec![mode; slot.pp * slot.v],
        zero: zero.zero,
        reduce_scatter: zero.rs,
        shard: zero.shard,
        reshard_after_forward: true,
        gradient_buffers: Default::default(),
        partition: partition.clone(),
        tp_overlap: slot.k,
        cp: slot.split.cp,
        sequence_parallel: slot.split.sequence_parallel,
        ep: slot.split.ep,
    };
    Ok(match policy {
        Recompute::None => Some(uniform(RecomputeMode::None)),
        Recompute::Selective => Some(uniform(RecomputeMode::Selective)),
        Recompute::Full => Some(uniform(RecomputeMode::Full)),
        Recompute::StageAware => stage_aware(cm, &uniform, budget)?,
    })
}

/// The error for a space without layouts.
fn no_layout(model: &ModelProxy, hw: &HardwareSpec, options: &SearchOptions) -> SearchError {
    SearchError::NoLayout {
        gpus: options.gpus,
        global_batch: options.global_batch,
        heads: model.heads,
        per_node: hw.devices_per_node,
        units: model.num_units(),
    }
}

/// Merak's stage-aware recomputation for interleaved layouts: per pipeline rank, the cheapest
/// mode (none, selective, full) whose memory fits `budget` (full when none does). `None` when
/// the result is a uniform layout (the plain policies cover it).
fn stage_aware(
    cm: &CostModel<'_>,
    uniform: &dyn Fn(RecomputeMode) -> Layout,
    budget: u64,
) -> Result<Option<Layout>, SearchError> {
    let mut memories = Vec::with_capacity(3);
    for mode in RecomputeMode::ALL {
        memories.push(cm.estimate(&uniform(mode))?.peak_memory_bytes);
    }
    let mut layout = uniform(RecomputeMode::None);
    let p = layout.pp;
    for rank in 0..p {
        let mode = RecomputeMode::ALL
            .into_iter()
            .zip(&memories)
            .find(|(_, mem)| mem[rank] <= budget)
            .map_or(RecomputeMode::Full, |(mode, _)| mode);
        for chunk in 0..layout.virtual_stages {
            layout.recompute[chunk * p + rank] = mode;
        }
    }
    let first = layout.recompute[0];
    if layout.recompute.iter().all(|&m| m == first) {
        return Ok(None);
    }
    Ok(Some(layout))
}

/// Whether `a` dominates `b` (no worse in both, better in one) in (time, memory).
pub fn dominates(a: (f64, u64), b: (f64, u64)) -> bool {
    a.0 <= b.0 && a.1 <= b.1 && (a.0 < b.0 || a.1 < b.1)
}

/// Searches the plans of `model` on `hardware` (see the [module docs](self)).
///
/// # Errors
///
/// [`SearchError::NoLayout`] when the degrees admit no layout, [`SearchError::DoesNotFit`]
/// (with the smallest memory any layout needs) when no plan fits the budget.
pub fn search(
    model: &ModelProxy,
    hardware: &HardwareSpec,
    options: &SearchOptions,
) -> Result<SearchResult, SearchError> {
    search_calibrated(model, hardware, None, options)
}

/// [`search`] with the cost model using measured layer times (see
/// [`CostModel::with_calibration`]) when `calibration` is given.
///
/// # Errors
///
/// As [`search`].
pub fn search_calibrated(
    model: &ModelProxy,
    hardware: &HardwareSpec,
    calibration: Option<&Calibration>,
    options: &SearchOptions,
) -> Result<SearchResult, SearchError> {
    search_with_progress(model, hardware, calibration, options, &mut |_| {})
}

/// [`search_calibrated`] telling `progress` how far it has come (a few calls per layout), for
/// a progress bar on long searches.
///
/// # Errors
///
/// As [`search`], and [`SearchError::TooManyUnits`] or [`SearchError::TooManyLayouts`] at
/// once for a space beyond the bounds.
pub fn search_with_progress(
    model: &ModelProxy,
    hardware: &HardwareSpec,
    calibration: Option<&Calibration>,
    options: &SearchOptions,
    progress: &mut dyn FnMut(SearchProgress),
) -> Result<SearchResult, SearchError> {
    let slots = space(model, hardware, options)?;
    let cm = match calibration {
        Some(c) => CostModel::new(model, hardware).with_calibration(c),
        None => CostModel::new(model, hardware),
    }
    .with_optimizer(options.optimizer);
    let budget = options.memory_budget_bytes.unwrap_or(hardware.memory_bytes);
    let mut dp_planner = StageDp::new(&cm, budget);
    let mut unplanned = Vec::new();
    let all = generate(
        &cm,
        options,
        &slots,
        &mut dp_planner,
        &mut unplanned,
        progress,
    )?;
    if all.is_empty() && unplanned.is_empty() {
        return Err(no_layout(model, hardware, options));
    }
    let considered = all.len();
    let (feasible, smallest) = estimate_all(&cm, all, budget, progress)?;
    if feasible.is_empty() {
        let smallest = least_memory(&mut dp_planner, &unplanned, smallest)?;
        return Err(SearchError::DoesNotFit {
            budget_bytes: budget,
            smallest_bytes: smallest,
        });
    }
    let feasible_count = feasible.len();
    let ranked = rank(&cm, feasible, options.runner_ups + 1, progress)?;
    let mut top = ranked.top.into_iter();
    let Some(best) = top.next() else {
        return Err(SearchError::DoesNotFit {
            budget_bytes: budget,
            smallest_bytes: smallest,
        });
    };
    Ok(SearchResult {
        best,
        runner_ups: top.collect(),
        pareto: ranked.pareto,
        considered,
        feasible: feasible_count,
        predicted: ranked.predicted,
    })
}

/// A candidate that fits with its estimate: the lower bound of its step time and its peak
/// memory, bytes.
type Feasible = (f64, u64, Candidate);

/// The candidates that fit in `budget` with their estimates, ordered by time bound then
/// memory, and the least peak memory of all.
fn estimate_all(
    cm: &CostModel<'_>,
    all: Vec<Candidate>,
    budget: u64,
    progress: &mut dyn FnMut(SearchProgress),
) -> Result<(Vec<Feasible>, u64), SearchError> {
    let considered = all.len();
    let mut smallest = u64::MAX;
    let mut feasible = Vec::new();
    for (done, c) in all.into_iter().enumerate() {
        progress(SearchProgress {
            phase: "estimating",
            done,
            total: considered,
        });
        let est = cm.estimate(&c.layout)?;
        let mem = est.peak_memory_bytes.iter().copied().max().unwrap_or(0);
        smallest = smallest.min(mem);
        if mem <= budget {
            feasible.push((est.time_lower_bound_s, mem, c));
        }
    }
    feasible.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    Ok((feasible, smallest))
}

/// The least memory of `smallest` and of what a cut of the stage planner's `unplanned`
/// skeletons (none of whose cuts fits) can reach.
fn least_memory(
    dp_planner: &mut StageDp<'_, '_>,
    unplanned: &[Skeleton],
    mut smallest: u64,
) -> Result<u64, SearchError> {
    let mut split = None;
    for skeleton in unplanned {
        if split != Some(skeleton.split()) {
            dp_planner.release_tables();
            split = Some(skeleton.split());
        }
        smallest = smallest.min(dp_planner.min_memory(skeleton)?);
    }
    Ok(smallest)
}

/// The simulated best plans: the fastest `keep` and the Pareto front of time and memory.
struct Ranked {
    top: Vec<Plan>,
    pareto: Vec<Plan>,
    /// How many candidates were simulated.
    predicted: usize,
}

/// Simulates the `feasible` candidates (in order of their time bound) that could still enter
/// the fastest `keep` or the Pareto front, and keeps those that do.
fn rank(
    cm: &CostModel<'_>,
    feasible: Vec<Feasible>,
    keep: usize,
    progress: &mut dyn FnMut(SearchProgress),
) -> Result<Ranked, SearchError> {
    let total = feasible.len();
    let mut top: Vec<Plan> = Vec::new();
    let mut front: Vec<(f64, u64)> = Vec::new();
    let mut pareto: Vec<Plan> = Vec::new();
    let mut predicted = 0;
    for (done, (bound, mem, c)) in feasible.into_iter().enumerate() {
        progress(SearchProgress {
            phase: "simulating",
            done,
            total,
        });
        let top_full = top.len() >= keep;
        let kth = top
            .last()
            .map_or(f64::INFINITY, |p| p.prediction.step_time_s);
        let could_top = !top_full || bound < kth;
        let could_front = !front.iter().any(|&(t, m)| t <= bound && m <= mem);
        if !could_top && !could_front {
            continue;
        }
        let prediction = cm.predict(&c.layout)?;
        predicted += 1;
        let plan = Plan {
            layout: c.layout,
            policy: c.policy,
            prediction,
        };
        let point = plan.point();
        if !front.iter().any(|&q| dominates(q, point) || q == point) {
            let keep_members: Vec<bool> = front.iter().map(|&q| !dominates(point, q)).collect();
            let mut i = 0;
            pareto.retain(|_| {
                let k = keep_members[i];
                i += 1;
                k
            });
            front.retain(|&q| !dominates(point, q));
            front.push(point);
            pareto.push(plan.clone());
        }
        if !top_full || point.0 < kth {
            let at = top.partition_point(|p| p.prediction.step_time_s <= point.0);
            top.insert(at, plan);
            top.truncate(keep);
        }
    }
    pareto.sort_by(|a, b| a.point().0.total_cmp(&b.point().0));
    Ok(Ranked {
        top,
        pareto,
        predicted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::memory::sharded;
    use crate::planner::model::TransformerShape;
    use std::time::Instant;

    /// A 7B GPT on `devices` A100s of 80 GB (8 a node).
    fn seven_b(devices: usize) -> (ModelProxy, HardwareSpec) {
        let model =
            ModelProxy::parse("gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200").unwrap();
        (
            model,
            HardwareSpec::preset("a100-80g")
                .unwrap()
                .with_devices(devices),
        )
    }

    fn small_case() -> (ModelProxy, HardwareSpec, SearchOptions) {
        let model = ModelProxy::parse("gpt2-medium").unwrap();
        let mut hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(8);
        hw.memory_bytes = 4_000_000_000;
        let mut options = SearchOptions::new(8, 16);
        options.micro_batch_sizes = vec![1, 2, 4];
        (model, hw, options)
    }

    /// A 32-layer, 4096-wide GPT on 8 × 80 GB with 8 sequences per step (one micro-batch per
    /// replica at dp = 8): ZeRO-2 holds less than ZeRO-1 there, and ZeRO-3 (full
    /// recomputation) gives the least memory with data parallelism alone; both are on the
    /// Pareto set, and every ZeRO-3 layout searched recomputes fully and runs dp > 1.
    #[test]
    fn zero_stages_two_and_three_reach_the_pareto_set_of_a_7b_model() {
        let (model, hw) = seven_b(8);
        let options = SearchOptions::new(8, 8);
        let result = search(&model, &hw, &options).unwrap();
        let zeros: Vec<u8> = result.pareto.iter().map(|p| p.layout.zero).collect();
        assert!(zeros.contains(&2) && zeros.contains(&3), "{zeros:?}");
        let cm = CostModel::new(&model, &hw);
        for c in candidates(&cm, &options, hw.memory_bytes).unwrap() {
            let l = &c.layout;
            if l.zero == 3 {
                assert!(l.dp > 1 && l.recompute.iter().all(|&m| m == RecomputeMode::Full));
                assert!(!l.schedule.splits_backward() && l.schedule != ScheduleKind::TwoBw);
            }
        }
        // The same layout at stages 0 to 3: memory falls stage by stage.
        let three = (result.pareto.iter())
            .find(|p| p.layout.zero == 3)
            .expect("a ZeRO-3 plan");
        let memory: Vec<u64> = (0..=3)
            .map(|zero| {
                let l = Layout {
                    zero,
                    ..three.layout.clone()
                };
                cm.predict(&l).unwrap().max_memory_bytes()
            })
            .collect();
        assert!(memory.windows(2).all(|w| w[1] < w[0]), "{memory:?}");
        // Per parameter, at d = 8: 16, 4 + 12/8, and under ZeRO-2 and 3 with the whole
        // gradients adding up through the step 4 + 12/8 and 2 + 14/8; reduce-scattered every
        // micro-batch, only chunks add up: 2 + 14/8 and 16/8.
        let per = |zero, rs| cm.state_bytes(&sharded(zero, 8, rs)).dense;
        let (step, each) = (ReduceScatter::Step, ReduceScatter::MicroBatch);
        assert_eq!(
            [per(0, step), per(1, step), per(2, step), per(3, step)],
            [16.0, 5.5, 5.5, 3.75]
        );
        assert_eq!([per(2, each), per(3, each)], [3.75, 2.0]);
    }

    /// ZeRO-2 and 3 layouts with several micro-batches come in both variants; every
    /// micro-batch's reduce-scatter holds less and exposes at least as much communication
    /// (with one micro-batch, the same: only that variant is searched).
    #[test]
    fn reducing_every_micro_batch_is_searched_and_trades_traffic_for_memory() {
        let (model, hw) = seven_b(8);
        let options = SearchOptions::new(8, 8);
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        let each: Vec<&Layout> = (all.iter().map(|c| &c.layout))
            .filter(|l| l.reduce_scatter == ReduceScatter::MicroBatch)
            .collect();
        assert!(each.iter().any(|l| l.micro_batches == 1));
        assert!(each.iter().any(|l| l.micro_batches > 1));
        for l in &each {
            assert!(l.zero >= 2, "{l:?}");
            let once = Layout {
                reduce_scatter: ReduceScatter::Step,
                ..(*l).clone()
            };
            let (a, b) = (cm.predict(l).unwrap(), cm.predict(&once).unwrap());
            assert!(a.max_memory_bytes() < b.max_memory_bytes(), "{l:?}");
            assert!(a.step_time_s >= b.step_time_s, "{l:?}");
            if l.micro_batches == 1 {
                assert_eq!(a.step_time_s, b.step_time_s, "{l:?}");
            }
        }
        // One micro-batch: once per step is not searched under a uniform policy (it only holds
        // more; the stage planner's cuts assume it).
        let uniform = all.iter().filter(|c| c.policy != Recompute::StageAware);
        assert!((uniform.map(|c| &c.layout)).all(|l| l.zero < 2
            || l.micro_batches > 1
            || l.reduce_scatter == ReduceScatter::MicroBatch));
    }

    /// Where data parallelism spans nodes, hybrid sharding is searched with a copy per node:
    /// it holds more per rank than sharding over all of dp, and keeps ZeRO's collectives on
    /// the node's links, so only its larger optimizer step can make it slower.
    #[test]
    fn hybrid_sharding_is_searched_within_a_node() {
        let (model, hw) = seven_b(16);
        let options = SearchOptions::new(16, 32);
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        let hybrid: Vec<&Layout> = (all.iter().map(|c| &c.layout))
            .filter(|l| l.shard_degree() < l.dp)
            .collect();
        assert!(!hybrid.is_empty());
        for l in &hybrid {
            let s = l.shard_degree();
            assert!(l.zero == 3 && l.dp.is_multiple_of(s) && s * l.tp <= hw.devices_per_node);
            assert!(l.dp * l.tp > hw.devices_per_node, "{l:?}");
            assert!(l.zero_label().contains(&format!("shard={s}")));
            let flat = Layout {
                shard: 0,
                ..(*l).clone()
            };
            let (a, b) = (cm.predict(l).unwrap(), cm.predict(&flat).unwrap());
            assert!(a.max_memory_bytes() > b.max_memory_bytes(), "{l:?}");
            // The step less the optimizer (which steps s / dp times more per rank).
            let moving = |p: &Prediction| p.step_time_s - p.breakdown["optimizer_s"];
            assert!(moving(&a) <= moving(&b) + 1e-12, "{l:?}");
        }
        // Within a node (8 devices here) nothing changes.
        let small = HardwareSpec::preset("a100-80g").unwrap().with_devices(8);
        let cm = CostModel::new(&model, &small);
        let options = SearchOptions::new(8, 8);
        let all = candidates(&cm, &options, small.memory_bytes).unwrap();
        assert!(all.iter().all(|c| c.layout.shard == 0));
    }

    /// A Llama-3-8B-like GPT (32 x 4096, 128k vocabulary) at 32768 tokens on 8 H100s with 8
    /// sequences per step: context parallelism makes the Pareto set (the ring hides behind
    /// 16k-token attention blocks), every layout searched cuts the sequence into zigzag chunks
    /// of at least 1024 tokens, and sequence parallelism is on wherever tp > 1.
    #[test]
    fn context_parallelism_reaches_the_pareto_set_at_32k_tokens() {
        let model =
            ModelProxy::parse("gpt:layers=32,hidden=4096,heads=32,seq=32768,vocab=128256").unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
        let options = SearchOptions::new(8, 8);
        let result = search(&model, &hw, &options).unwrap();
        let cps: Vec<usize> = result.pareto.iter().map(|p| p.layout.cp).collect();
        assert!(cps.iter().any(|&cp| cp > 1), "{cps:?}");
        assert!(result.best.layout.cp > 1, "{:?}", result.best.layout);
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for l in all.iter().map(|c| &c.layout) {
            assert_eq!(l.gpus(), 8);
            assert!(32768 % (2 * l.cp) == 0 && 32768 / l.cp >= 2048, "{l:?}");
            assert_eq!(l.sequence_parallel, l.tp > 1, "{l:?}");
            seen.insert((l.tp, l.cp));
        }
        // Every (tp, cp) with tp cp | 8.
        assert_eq!(seen.len(), 10, "{seen:?}");
        // The same layout without the ring: the fastest plan's memory does not fit.
        let flat = Layout {
            cp: 1,
            dp: result.best.layout.dp * result.best.layout.cp,
            micro_batches: result.best.layout.micro_batches / result.best.layout.cp,
            ..result.best.layout.clone()
        };
        let flat = cm.predict(&flat).unwrap();
        assert!(flat.max_memory_bytes() > hw.memory_bytes, "{flat:?}");
    }

    /// Searching layouts without sequence parallelism too adds only dominated ones: the Pareto
    /// set and the fastest plan are those of the default search.
    #[test]
    fn layouts_without_sequence_parallelism_are_dominated_by_their_twins() {
        let model =
            ModelProxy::parse("gpt:layers=8,hidden=2048,heads=16,seq=8192,vocab=32000").unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
        let options = SearchOptions::new(8, 8);
        let both = SearchOptions {
            sequence_parallel: vec![false, true],
            ..options.clone()
        };
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &both, u64::MAX).unwrap();
        let mut twins = 0;
        for l in all.iter().map(|c| &c.layout).filter(|l| l.tp > 1) {
            if l.sequence_parallel {
                continue;
            }
            let twin = Layout {
                sequence_parallel: true,
                ..l.clone()
            };
            let (off, on) = (cm.predict(l).unwrap(), cm.predict(&twin).unwrap());
            assert!(on.step_time_s <= off.step_time_s, "{l:?}");
            assert!(on.max_memory_bytes() < off.max_memory_bytes(), "{l:?}");
            twins += 1;
        }
        assert!(twins > 100, "{twins}");
        let points = |o: &SearchOptions| -> Vec<(f64, u64)> {
            search(&model, &hw, o)
                .unwrap()
                .pareto
                .iter()
                .map(Plan::point)
                .collect()
        };
        assert_eq!(points(&both), points(&options));
        let off = SearchOptions {
            sequence_parallel: vec![false],
            ..options.clone()
        };
        let all = candidates(&cm, &off, u64::MAX).unwrap();
        assert!(all.iter().all(|c| !c.layout.sequence_parallel));
    }

    /// Short sequences keep the search as it was (no ring below 2048 tokens a rank), unless
    /// degrees are given; a model without a shape gets neither context nor sequence
    /// parallelism.
    #[test]
    fn context_parallel_degrees_follow_the_sequence() {
        let (model, hw) = seven_b(8);
        let cps = |o: &SearchOptions, m: &ModelProxy| -> Vec<usize> {
            let cm = CostModel::new(m, &hw);
            let mut cps: Vec<usize> = (candidates(&cm, o, u64::MAX).unwrap().iter())
                .map(|c| c.layout.cp)
                .collect();
            cps.sort_unstable();
            cps.dedup();
            cps
        };
        let options = SearchOptions::new(8, 8);
        assert_eq!(cps(&options, &model), vec![1]);
        let given = SearchOptions {
            cp: vec![4, 2, 3, 16],
            ..options.clone()
        };
        // 3 does not divide 8 devices, 16 exceeds them; 2 and 4 cut the 2048 tokens.
        assert_eq!(cps(&given, &model), vec![2, 4]);
        let long =
            ModelProxy::parse("gpt:layers=4,hidden=1024,heads=8,seq=8192,vocab=1000").unwrap();
        assert_eq!(cps(&options, &long), vec![1, 2, 4]);
        let low = SearchOptions {
            min_cp_tokens: 1024,
            ..options.clone()
        };
        assert_eq!(cps(&low, &long), vec![1, 2, 4, 8]);
        let shapeless = ModelProxy::from_costs(&model.shape.unwrap());
        let all = candidates(&CostModel::new(&shapeless, &hw), &given, u64::MAX).unwrap();
        assert!(
            all.iter()
                .all(|c| c.layout.cp == 1 && !c.layout.sequence_parallel)
        );
    }

    /// A plan file of an earlier version has neither `cp` nor `sequence_parallel`: one rank a
    /// sequence, no sequence parallelism.
    #[test]
    fn a_layout_without_the_sequence_fields_reads_as_cp_1() {
        let (model, hw, options) = small_case();
        let layout = search(&model, &hw, &options).unwrap().best.layout;
        let json = serde_json::to_value(&layout).unwrap();
        let mut fields = json.as_object().unwrap().clone();
        fields.remove("cp");
        fields.remove("sequence_parallel");
        let read: Layout = serde_json::from_value(fields.into()).unwrap();
        assert_eq!((read.cp, read.sequence_parallel), (1, false));
    }

    /// A plan file of an earlier version names ZeRO-1 `"zero1": true`; it reads as stage 1.
    #[test]
    fn a_layout_with_the_old_zero1_flag_reads_as_stage_one() {
        let (model, hw, options) = small_case();
        let layout = search(&model, &hw, &options).unwrap().best.layout;
        let json = serde_json::to_value(&layout).unwrap();
        let mut fields = json.as_object().unwrap().clone();
        fields.remove("zero");
        for (flag, stage) in [(true, 1), (false, 0)] {
            fields.insert("zero1".into(), flag.into());
            let read: Layout = serde_json::from_value(fields.clone().into()).unwrap();
            assert_eq!(read.zero, stage);
        }
    }

    #[test]
    fn pareto_set_is_exact_on_a_small_case() {
        let (model, hw, options) = small_case();
        let result = search(&model, &hw, &options).unwrap();
        let points: Vec<(f64, u64)> = result.pareto.iter().map(Plan::point).collect();
        for (i, &a) in points.iter().enumerate() {
            for (j, &b) in points.iter().enumerate() {
                assert!(i == j || (!dominates(a, b) && a != b), "{a:?} vs {b:?}");
            }
        }
        // Brute force: every feasible layout is dominated by or equal to a member.
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        let mut feasible = 0;
        let mut fastest = f64::INFINITY;
        for c in &all {
            let pred = cm.predict(&c.layout).unwrap();
            let est = cm.estimate(&c.layout).unwrap();
            assert!(est.time_lower_bound_s <= pred.step_time_s);
            assert_eq!(est.peak_memory_bytes, pred.peak_memory_bytes);
            let point = (pred.step_time_s, pred.max_memory_bytes());
            if point.1 > hw.memory_bytes {
                continue;
            }
            feasible += 1;
            fastest = fastest.min(point.0);
            assert!(
                points.iter().any(|&q| q == point || dominates(q, point)),
                "{point:?} is not covered by {points:?}"
            );
        }
        assert_eq!(feasible, result.feasible);
        assert!(
            result.feasible < all.len(),
            "the budget should exclude some layouts"
        );
        assert_eq!(result.best.prediction.step_time_s, fastest);
        assert_eq!(result.pareto[0].prediction.step_time_s, fastest);
        for w in result.runner_ups.windows(2) {
            assert!(w[0].prediction.step_time_s <= w[1].prediction.step_time_s);
        }
        assert_eq!(result.runner_ups.len(), options.runner_ups);
    }

    #[test]
    fn overlap_degrees_follow_the_hardware_and_tensor_parallelism() {
        let (model, mut hw, options) = small_case();
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        let overlapped = all.iter().filter(|c| c.layout.tp_overlap > 1).count();
        assert!(overlapped > 0, "the a100 preset allows overlap");
        for c in &all {
            let l = &c.layout;
            assert!(l.tp_overlap == 1 || l.tp > 1, "{l:?}: overlap without TP");
            assert!(l.tp_overlap <= hw.max_tp_overlap);
        }
        // Every overlapped layout has its non-overlapped twin among the candidates.
        let plain = all.len() - overlapped;
        assert!(plain > 0);
        // Hardware that cannot overlap (merak train's CPU ranks) gets none.
        hw.max_tp_overlap = 1;
        let cm = CostModel::new(&model, &hw);
        let all = candidates(&cm, &options, hw.memory_bytes).unwrap();
        assert!(all.iter().all(|c| c.layout.tp_overlap == 1));
        assert_eq!(all.len(), plain);
    }

    #[test]
    fn infeasible_budget_names_the_smallest_memory() {
        let (model, mut hw, options) = small_case();
        hw.memory_bytes = 1_000_000;
        let err = search(&model, &hw, &options).unwrap_err();
        let SearchError::DoesNotFit { smallest_bytes, .. } = err.clone() else {
            panic!("{err}");
        };
        assert!(err.to_string().contains(&smallest_bytes.to_string()));
        hw.memory_bytes = smallest_bytes;
        let result = search(&model, &hw, &options).unwrap();
        assert_eq!(result.best.prediction.max_memory_bytes(), smallest_bytes);
        hw.memory_bytes = smallest_bytes - 1;
        assert!(matches!(
            search(&model, &hw, &options),
            Err(SearchError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn stage_aware_layouts_come_from_the_stage_planner() {
        let (model, hw, options) = small_case();
        let cm = CostModel::new(&model, &hw);
        let budget = hw.memory_bytes;
        let all = candidates(&cm, &options, budget).unwrap();
        let mut planner = StageDp::new(&cm, budget);
        let (mut planned, mut mixed, mut interleaved) = (0, 0, 0);
        for c in all.iter().filter(|c| c.policy == Recompute::StageAware) {
            let l = &c.layout;
            if l.virtual_stages > 1 {
                interleaved += 1;
                continue;
            }
            let est = cm.estimate(l).unwrap();
            assert!(est.peak_memory_bytes.iter().all(|&m| m <= budget), "{l:?}");
            let skeleton = Skeleton {
                dp: l.dp,
                tp: l.tp,
                pp: l.pp,
                micro_batch: l.micro_batch,
                micro_batches: l.micro_batches,
                schedule: l.schedule,
                zero: l.zero,
                tp_overlap: l.tp_overlap,
                cp: l.cp,
                sequence_parallel: l.sequence_parallel,
                ep: l.ep,
            };
            let plan = planner.plan(&skeleton).unwrap().unwrap();
            assert_eq!(&plan.layout, l);
            planned += 1;
            if l.recompute.iter().any(|&m| m != l.recompute[0]) {
                mixed += 1;
            }
        }
        assert!(planned > 0 && mixed > 0 && interleaved > 0);
    }

    #[test]
    fn stage_aware_alone_reports_the_smallest_memory_a_cut_reaches() {
        let (model, mut hw, mut options) = small_case();
        options.recompute = vec![Recompute::StageAware];
        options.schedules = vec![ScheduleKind::OneFOneB];
        hw.memory_bytes = 1_000_000;
        let err = search(&model, &hw, &options).unwrap_err();
        let SearchError::DoesNotFit { smallest_bytes, .. } = err else {
            panic!("{err}");
        };
        hw.memory_bytes = smallest_bytes;
        let result = search(&model, &hw, &options).unwrap();
        assert_eq!(result.best.prediction.max_memory_bytes(), smallest_bytes);
        assert_eq!(result.best.policy, Recompute::StageAware);
        hw.memory_bytes = smallest_bytes - 1;
        assert!(matches!(
            search(&model, &hw, &options),
            Err(SearchError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn divisors_are_found_in_order() {
        for n in 0..300usize {
            for at_most in [1, 4, 8, 1000] {
                let brute: Vec<usize> = (1..=n)
                    .filter(|d| n.is_multiple_of(*d) && *d <= at_most)
                    .collect();
                assert_eq!(divisors_up_to(n, at_most), brute, "{n} {at_most}");
            }
        }
        // √n steps: the search passes gcd(gpus, heads), at most the heads.
        assert_eq!(divisors_up_to(1 << 40, 8), vec![1, 2, 4, 8]);
        assert_eq!(
            divisors_up_to(3 * 5 * (1 << 30), 8),
            vec![1, 2, 3, 4, 5, 6, 8]
        );
    }

    #[test]
    fn a_trillion_devices_are_answered_at_once() {
        let model = ModelProxy::parse("gpt2").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap();
        let start = Instant::now();
        let err = search(&model, &hw, &SearchOptions::new(1_000_000_000_000, 8)).unwrap_err();
        assert!(start.elapsed().as_secs_f64() < 0.5, "{:?}", start.elapsed());
        assert!(matches!(err, SearchError::NoLayout { .. }), "{err}");
        assert!(err.to_string().contains("1000000000000 devices"), "{err}");
        // With a batch that admits layouts, the search still finishes (few divisors qualify).
        let result = search(&model, &hw, &SearchOptions::new(1 << 40, 1 << 40)).unwrap();
        assert_eq!(result.best.layout.gpus(), 1 << 40);
        assert!(start.elapsed().as_secs_f64() < 5.0, "{:?}", start.elapsed());
    }

    #[test]
    fn a_model_beyond_the_unit_bound_is_refused_before_any_layout() {
        let model = ModelProxy::parse("gpt:layers=513,hidden=64,heads=4,seq=32,vocab=100").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(8);
        let start = Instant::now();
        let err = search(&model, &hw, &SearchOptions::new(8, 8)).unwrap_err();
        assert!(start.elapsed().as_secs_f64() < 0.5, "{:?}", start.elapsed());
        assert_eq!(
            err,
            SearchError::TooManyUnits {
                units: 515,
                limit: MAX_SEARCH_UNITS
            }
        );
        assert!(err.to_string().contains("515 units"), "{err}");
        let cm = CostModel::new(&model, &hw);
        assert!(candidates(&cm, &SearchOptions::new(8, 8), hw.memory_bytes).is_err());
    }

    #[test]
    fn a_space_beyond_the_layout_limit_is_refused_naming_the_numbers() {
        let model = ModelProxy::parse("gpt:layers=256,hidden=64,heads=4,seq=32,vocab=100").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap();
        let start = Instant::now();
        let err = search(&model, &hw, &SearchOptions::new(720_720, 720_720)).unwrap_err();
        assert!(start.elapsed().as_secs_f64() < 0.5, "{:?}", start.elapsed());
        let SearchError::TooManyLayouts {
            layouts,
            staged,
            units,
            work,
            ..
        } = err
        else {
            panic!("{err}");
        };
        assert_eq!(units, 258);
        assert!(
            work > MAX_SEARCH_WORK && staged > 0 && layouts > staged,
            "{work}"
        );
        assert!(
            work >= staged * 258 * 258 + (layouts - staged) * 258,
            "{work}"
        );
        let msg = err.to_string();
        for part in [
            "720720 devices".to_string(),
            format!("consider {layouts} layouts"),
            format!("{staged} of them cut by the stage planner"),
            format!("{work} steps of work"),
        ] {
            assert!(msg.contains(&part), "{part:?} not in {msg}");
        }
        assert_eq!(layout_limit(3), MAX_SEARCH_LAYOUTS);
        assert_eq!(layout_limit(258), (1 << 30) / (258 * 258));
    }

    #[test]
    fn progress_covers_every_phase() {
        let (model, hw, options) = small_case();
        let mut seen: Vec<SearchProgress> = Vec::new();
        let result =
            search_with_progress(&model, &hw, None, &options, &mut |p| seen.push(p)).unwrap();
        for phase in ["building layouts", "estimating", "simulating"] {
            let steps: Vec<_> = seen.iter().filter(|p| p.phase == phase).collect();
            assert!(!steps.is_empty(), "{phase}");
            assert!(steps.iter().all(|p| p.done < p.total), "{phase}");
        }
        let estimates = seen.iter().filter(|p| p.phase == "estimating").count();
        assert_eq!(estimates, result.considered);
        assert_eq!(result, search(&model, &hw, &options).unwrap());
    }

    #[test]
    #[cfg_attr(debug_assertions, ignore = "the time limits are for release builds")]
    fn gpt_20b_on_64_a100_is_fast() {
        let model = ModelProxy::parse("gpt-20b").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(64);
        let start = Instant::now();
        let result = search(&model, &hw, &SearchOptions::new(64, 512)).unwrap();
        let elapsed = start.elapsed().as_secs_f64();
        eprintln!(
            "gpt-20b: {elapsed:.2} s, considered {} feasible {} predicted {}",
            result.considered, result.feasible, result.predicted
        );
        assert!(elapsed < 1.0, "took {elapsed} s");
        assert!(result.best.prediction.max_memory_bytes() <= hw.memory_bytes);
        assert_eq!(result.best.layout.gpus(), 64);
    }

    /// The search of a 1T-parameter GPT (128 layers, hidden 25,600) with sequences of `seq`
    /// tokens on 3,072 A100s at `global_batch` sequences a step: within 10 s, its best plan
    /// within the memory.
    fn one_trillion_within_10_s(seq: usize, global_batch: usize) -> SearchResult {
        let spec = format!("gpt:layers=128,hidden=25600,heads=160,seq={seq},vocab=51200");
        let model = ModelProxy::parse(&spec).unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(3072);
        let start = Instant::now();
        let result = search(&model, &hw, &SearchOptions::new(3072, global_batch)).unwrap();
        let elapsed = start.elapsed().as_secs_f64();
        eprintln!(
            "1T at {seq} tokens: {elapsed:.2} s, considered {} feasible {} predicted {}",
            result.considered, result.feasible, result.predicted
        );
        assert!(elapsed < 10.0, "took {elapsed} s");
        assert!(result.best.prediction.max_memory_bytes() <= hw.memory_bytes);
        result
    }

    #[test]
    #[cfg_attr(debug_assertions, ignore = "the time limits are for release builds")]
    fn one_trillion_parameters_on_3072_gpus_is_fast() {
        one_trillion_within_10_s(2048, 3072);
    }

    /// The same model at 16k tokens a sequence, 1,536 sequences a step: context parallelism
    /// multiplies the layouts (about 195,000, beyond the 63,535 that `units²` work for each
    /// allowed), but only the stage-aware ones take the stage planner's `units²`, so it plans,
    /// within the same time.
    #[test]
    #[cfg_attr(debug_assertions, ignore = "the time limits are for release builds")]
    fn one_trillion_parameters_at_16k_tokens_plan_in_time() {
        let result = one_trillion_within_10_s(16384, 1536);
        assert!(
            result.considered > layout_limit(130),
            "{}",
            result.considered
        );
    }

    /// Issue 32: Mixtral 8x7B on 64 H100s of 80 GB (8 a node), 256 sequences of 4096 tokens.
    /// Expert parallelism reaches the Pareto set (its plans hold the least memory) and every
    /// plan keeps `ep` dividing `dp cp` and the 8 experts, with sequence parallelism under
    /// tensor parallelism and a ZeRO setting the trainer runs with experts. The fastest plan
    /// keeps `ep = 1`: pipelining over the nodes keeps the data-parallel gradients on NVLink, where the experts' reduction is cheap, and expert
    /// parallelism would add the all-to-alls and the busiest rank's imbalance (see
    /// `megatron_cores_mixtral_layout_is_faster_with_expert_parallelism` in the cost model's
    /// tests for a layout whose data parallelism spans nodes).
    #[test]
    #[cfg_attr(debug_assertions, ignore = "the time limits are for release builds")]
    fn mixtral_on_64_h100_puts_expert_parallelism_on_the_pareto_set() {
        let model = ModelProxy::parse("mixtral-8x7b").unwrap();
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(64);
        let start = Instant::now();
        let result = search(&model, &hw, &SearchOptions::new(64, 256)).unwrap();
        let elapsed = start.elapsed().as_secs_f64();
        let best = &result.best;
        eprintln!(
            "mixtral: {elapsed:.2} s, considered {} feasible {} predicted {}: {:?} {:.3} s",
            result.considered,
            result.feasible,
            result.predicted,
            best.layout.split(),
            best.prediction.step_time_s
        );
        let with_ep = result.pareto.iter().filter(|p| p.layout.ep > 1).count();
        assert!(with_ep >= 3, "{with_ep}");
        let smallest = result.pareto.last().unwrap();
        assert!(smallest.layout.ep > 1, "{:?}", smallest.layout);
        assert!(smallest.prediction.breakdown["ep_comm_s"] > 0.0);
        assert!(best.prediction.max_memory_bytes() <= hw.memory_bytes);
        assert_eq!(best.layout.gpus(), 64);
        for plan in result.pareto.iter().chain(&result.runner_ups).chain([best]) {
            let l = &plan.layout;
            assert!(l.replicas().is_multiple_of(l.ep) && 8 % l.ep == 0, "{l:?}");
            assert!(l.tp == 1 || l.sequence_parallel, "{l:?}");
        }
        assert!(elapsed < 5.0, "took {elapsed} s");
        // Named, the degrees are the only ones searched: Mixtral's best plan at ep = 8.
        let options = SearchOptions {
            ep: vec![8],
            ..SearchOptions::new(64, 256)
        };
        let at_8 = search(&model, &hw, &options).unwrap();
        assert!(at_8.pareto.iter().all(|p| p.layout.ep == 8));
        assert_eq!(at_8.best.layout.ep, 8, "{:?}", at_8.best.layout);
        let slower = at_8.best.prediction.step_time_s / best.prediction.step_time_s;
        assert!((1.0..1.5).contains(&slower), "{slower}");
    }

    /// A dense model is searched at ep = 1 whatever `SearchOptions::ep` names, so its plans
    /// are those of a search without experts.
    #[test]
    fn a_dense_model_ignores_expert_parallel_degrees() {
        let (model, hw, options) = small_case();
        let plain = search(&model, &hw, &options).unwrap();
        let named = SearchOptions {
            ep: vec![1, 2, 4],
            ..options
        };
        assert_eq!(search(&model, &hw, &named).unwrap(), plain);
        assert!(plain.pareto.iter().all(|p| p.layout.ep == 1));
    }

    /// Multi-token prediction: the depths' parameters in the shape's count and on the head unit,
    /// their compute, activations and context-parallel ring there, and the search over the
    /// same layouts as without them.
    #[test]
    fn mtp_depths_weigh_on_the_head_unit() {
        let base = TransformerShape::gpt(2, 64, 4, 4096, 512);
        let mtp = base.with_mtp(2);
        let h = 64u64;
        assert_eq!(mtp.params() - base.params(), 2 * (14 * h * h + 19 * h));
        let (a, b) = (ModelProxy::from_shape(base), ModelProxy::from_shape(mtp));
        let (head_a, head_b) = (a.units.last().unwrap(), b.units.last().unwrap());
        let block = &a.units[1];
        assert_eq!(
            head_b.params_split,
            head_a.params_split + 2 * block.params_split
        );
        assert!(head_b.forward_flops > head_a.forward_flops + 2.0 * block.forward_flops);
        assert!(head_b.act_split > head_a.act_split);
        assert_eq!(
            head_b.kv_elements,
            head_a.kv_elements + 2.0 * block.kv_elements
        );
        assert_eq!(a.units[1], b.units[1]);
        let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
        let options = SearchOptions {
            min_cp_tokens: 512,
            ..SearchOptions::new(8, 16)
        };
        let (with, without) = (
            search(&b, &hw, &options).unwrap(),
            search(&a, &hw, &options).unwrap(),
        );
        assert_eq!(with.considered, without.considered);
        // The head's ring is priced under context parallelism.
        let model = CostModel::new(&b, &hw);
        let split = RankSplit {
            cp: 2,
            ..RankSplit::from(1)
        };
        let head = model.unit_terms(b.units.len() - 1, 1, split, 1, RecomputeMode::None, false);
        assert!(head.cp_forward_s > 0.0 && head.cp_backward_s > 0.0);
    }
}
