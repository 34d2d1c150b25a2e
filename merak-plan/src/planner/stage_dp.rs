//! Stage boundaries and per-stage recomputation under a memory budget: an exact dynamic program
//! over the model's units (Galvatron and PipeDream style) for non-interleaved pipelines, where
//! stage `s` is pipeline rank `s`.
//!
//! Given a [`Skeleton`] (everything of a [`Layout`] but the partition and the recomputation
//! modes) and a memory budget, [`StageDp::plan`] cuts the `L + 2` units into `pp` contiguous,
//! non-empty stages and gives each stage a [`RecomputeMode`] so that
//!
//! - every stage's peak memory, exactly as [`CostModel::estimate`] computes it for the final
//!   layout (model states with ZeRO-1 and the second 2BW weight version, one micro-batch's
//!   activations times the micro-batches that stage holds in flight under the schedule, the
//!   workspace, and the tied embedding copy of the head when it is not on stage 0), fits the
//!   budget, and
//! - the *bottleneck* — the largest stage time per micro-batch, forward + backward +
//!   recomputation with their tensor-parallel communication, as the cost model gives them to the
//!   pipeline simulation — is the smallest possible; among the cuts with that bottleneck the one
//!   with the smallest total time (sum over stages) is taken, then the one with the smallest
//!   peak memory, then, from the first stage on, the smaller stage and the earlier mode
//!   (`none < selective < full`).
//!
//! # Algorithm
//!
//! All per-unit terms come from `CostModel::unit_terms`, the function the cost model itself
//! uses, and are summed per stage with the same accumulator in the same unit order, so the stage
//! times and memories below are bit for bit those of the final layout. For each (tensor-parallel
//! degree, micro-batch size) the sums over every unit range `i..e` and mode are tabulated once
//! (`O(units² × 3)`) and shared by every skeleton with those two numbers.
//!
//! A stage's time and memory never decrease when it grows by a unit (all terms are non-negative
//! and rounding is monotone), which lets both passes below stop extending a stage early.
//!
//! 1. `B[s][i]`: the smallest bottleneck of stages `s..pp` over units `i..`, the minimum over the
//!    first stage's end `e` and mode of `max(time(i..e), B[s + 1][e])` with the stage's memory
//!    within the budget. `B[0][0]` is the optimal bottleneck `B*`; infinite means no cut fits.
//! 2. With every stage time capped at `B*`, `T[s][i]`: the smallest (total time, peak memory)
//!    of stages `s..pp` over units `i..`, in that order. Capping first makes the tie-breaks
//!    exact: the total is additive, so the second pass is an ordinary shortest path.
//!
//! Each pass is `O(pp × units² × 3)` at worst; results are cached per skeleton (tensor
//! parallelism, micro-batch, stages, in-flight counts, model-state bytes per parameter).
//!
//! When nothing fits, [`StageDp::min_memory`] gives the smallest peak memory any cut and modes
//! can reach (the same recursion with memory as the bottleneck), which the search reports.

use std::collections::HashMap;
use std::rc::Rc;

use thiserror::Error;

use super::cost::{ChunkMemory, CostError, CostModel, Layout, StageTerms, StateBytes};
use super::memory::StateSharding;
use super::model::{RankSplit, RecomputeMode};
use crate::data_parallel::ReduceScatter;
use crate::pipeline::{PartitionError, ScheduleKind, explicit_partition};

/// The fields of a non-interleaved [`Layout`] that the stage planner does not choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skeleton {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline ranks (= stages).
    pub pp: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The pipeline schedule (not the interleaved one).
    pub schedule: ScheduleKind,
    /// The ZeRO stage (0, 1 or 2: ZeRO-3 recomputes every unit, which the uniform full policy
    /// plans).
    pub zero: u8,
    /// Sub-pipelining degree of tensor parallelism.
    pub tp_overlap: usize,
    /// Context-parallel degree.
    pub cp: usize,
    /// Sequence parallelism.
    pub sequence_parallel: bool,
    /// Expert-parallel degree.
    pub ep: usize,
}

impl Skeleton {
    /// How one micro-batch is split over its ranks.
    pub fn split(&self) -> RankSplit {
        RankSplit::new(self.tp, self.cp, self.sequence_parallel).with_ep(self.ep)
    }
}

/// The stage planner's answer for one skeleton.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePlan {
    /// The layout: the skeleton with the chosen partition and per-stage modes.
    pub layout: Layout,
    /// The largest stage time per micro-batch, seconds.
    pub bottleneck_s: f64,
    /// The sum of the stage times per micro-batch, seconds.
    pub total_s: f64,
    /// The largest per-rank peak memory, bytes.
    pub max_memory_bytes: u64,
}

/// Why the stage planner cannot plan a skeleton (a budget that nothing fits is not an error:
/// [`StageDp::plan`] returns `None`).
#[derive(Clone, Debug, PartialEq, Error)]
pub enum StageDpError {
    /// The skeleton is not a valid layout (a zero degree, a schedule that cannot be built).
    #[error(transparent)]
    Cost(#[from] CostError),
    /// More stages than units.
    #[error("cannot cut {units} units into {stages} non-empty stages")]
    TooManyStages {
        /// Stages asked for.
        stages: usize,
        /// The model's units.
        units: usize,
    },
    /// The interleaved schedule (the planner handles one stage per rank).
    #[error("the stage planner needs one stage per pipeline rank, not the {schedule} schedule")]
    Interleaved {
        /// The schedule.
        schedule: ScheduleKind,
    },
    /// The partition could not be built (a bug).
    #[error(transparent)]
    Partition(#[from] PartitionError),
}

/// Per-range sums of the unit terms for one (rank split, micro-batch size, overlap), indexed
/// `i * (units + 1) + e` for the units `i..e`.
struct Tables {
    units: usize,
    /// Per mode: stage time per micro-batch.
    time: [Vec<f64>; 3],
    /// Per mode: activation bytes of one micro-batch.
    activation: [Vec<f64>; 3],
    /// Without and with the tied copies: parameters held (routed experts excluded).
    params: [Vec<f64>; 2],
    /// Routed experts' parameters held (empty for a model without experts: all 0).
    experts: Vec<f64>,
    /// The largest unit's activation bytes without recomputation.
    largest: Vec<f64>,
}

impl Tables {
    fn new(cm: &CostModel<'_>, split: RankSplit, b: usize, overlap: usize) -> Tables {
        let units = cm.model().num_units();
        let n = (units + 1) * (units + 1);
        let has_experts = cm.model().units.iter().any(|u| u.params_expert > 0);
        let mut tables = Tables {
            units,
            time: std::array::from_fn(|_| vec![0.0; n]),
            activation: std::array::from_fn(|_| vec![0.0; n]),
            params: std::array::from_fn(|_| vec![0.0; n]),
            experts: vec![0.0; if has_experts { n } else { 0 }],
            largest: vec![0.0; n],
        };
        for (k, &mode) in RecomputeMode::ALL.iter().enumerate() {
            for tied in [false, true] {
                // Time, activations and the largest unit do not depend on the tied copy, the
                // parameters do not depend on the mode: tabulate each once.
                if tied && k > 0 {
                    continue;
                }
                let terms: Vec<_> = (0..units)
                    .map(|u| cm.unit_terms(u, b, split, overlap, mode, tied))
                    .collect();
                for i in 0..units {
                    let mut stage = StageTerms::default();
                    for e in i + 1..=units {
                        stage.add(&terms[e - 1]);
                        let at = i * (units + 1) + e;
                        if !tied {
                            tables.time[k][at] = stage.time();
                            tables.activation[k][at] = stage.activation_bytes;
                            tables.largest[at] = stage.largest_activation_bytes;
                        }
                        if k == 0 {
                            tables.params[usize::from(tied)][at] = stage.params;
                        }
                        if let Some(experts) = tables.experts.get_mut(at) {
                            *experts = stage.expert_params;
                        }
                    }
                }
            }
        }
        tables
    }
}

/// Everything a plan depends on besides the budget: the rank split with the overlap degree,
/// micro-batch size, stages, in-flight counts per stage and the bits of the model-state bytes
/// per dense and per expert parameter.
type PlanKey = ((RankSplit, usize), usize, usize, Vec<usize>, (u64, u64));

/// A solved cut: stage sizes and modes with the objective.
#[derive(Clone, Debug, PartialEq)]
struct Solution {
    sizes: Vec<usize>,
    modes: Vec<RecomputeMode>,
    bottleneck_s: f64,
    total_s: f64,
    max_memory_bytes: u64,
}

/// One skeleton's inputs to the recursions.
struct Problem<'t> {
    tables: &'t Tables,
    stages: usize,
    in_flight: &'t [usize],
    state_bytes: StateBytes,
}

impl Problem<'_> {
    fn index(&self, i: usize, e: usize) -> usize {
        i * (self.tables.units + 1) + e
    }

    /// The peak memory of stage `s` holding units `i..e` (flat index `at`) under mode `k`.
    fn memory(&self, s: usize, at: usize, k: usize) -> u64 {
        let tied = self.stages > 1 && s > 0;
        let chunk = ChunkMemory {
            params: self.tables.params[usize::from(tied)][at],
            expert_params: self.tables.experts.get(at).copied().unwrap_or(0.0),
            activation_bytes: self.tables.activation[k][at],
            in_flight: self.in_flight[s],
            mode: RecomputeMode::ALL[k],
            largest_activation_bytes: self.tables.largest[at],
        };
        CostModel::rank_memory([chunk], self.state_bytes).peak_bytes()
    }

    /// The units stage `s` may start at and the largest end it may have, so that every stage
    /// keeps at least one unit.
    fn bounds(&self, s: usize) -> (std::ops::RangeInclusive<usize>, usize) {
        let units = self.tables.units;
        (s..=units - (self.stages - s), units - (self.stages - s - 1))
    }

    /// The smallest bottleneck under `budget` (infinite when nothing fits).
    fn bottleneck(&self, budget: u64) -> f64 {
        let (units, p) = (self.tables.units, self.stages);
        let mut best = vec![f64::INFINITY; (p + 1) * (units + 1)];
        best[p * (units + 1) + units] = 0.0;
        for s in (0..p).rev() {
            let (starts, e_max) = self.bounds(s);
            for i in starts {
                let mut current = f64::INFINITY;
                for k in 0..RecomputeMode::ALL.len() {
                    for e in i + 1..=e_max {
                        let at = self.index(i, e);
                        let time = self.tables.time[k][at];
                        if time >= current || self.memory(s, at, k) > budget {
                            break;
                        }
                        let rest = best[(s + 1) * (units + 1) + e];
                        current = current.min(time.max(rest));
                    }
                }
                best[s * (units + 1) + i] = current;
            }
        }
        best[0]
    }

    /// The cut with every stage time at most `cap` and memory within `budget` that has the
    /// smallest (total time, peak memory), first in (sizes, modes) order on ties.
    fn cheapest(&self, cap: f64, budget: u64) -> Option<Solution> {
        let (units, p) = (self.tables.units, self.stages);
        // Per state: (total, memory, end, mode) of the best choice.
        let mut best: Vec<Option<(f64, u64, usize, usize)>> = vec![None; (p + 1) * (units + 1)];
        best[p * (units + 1) + units] = Some((0.0, 0, units, 0));
        for s in (0..p).rev() {
            let (starts, e_max) = self.bounds(s);
            for i in starts {
                let mut current: Option<(f64, u64, usize, usize)> = None;
                for k in 0..RecomputeMode::ALL.len() {
                    for e in i + 1..=e_max {
                        let at = self.index(i, e);
                        let time = self.tables.time[k][at];
                        if time > cap {
                            break;
                        }
                        let memory = self.memory(s, at, k);
                        if memory > budget {
                            break;
                        }
                        let Some((rest_total, rest_memory, _, _)) = best[(s + 1) * (units + 1) + e]
                        else {
                            continue;
                        };
                        let total = time + rest_total;
                        let memory = memory.max(rest_memory);
                        let better = current.is_none_or(|(t, m, ce, ck)| {
                            total < t
                                || (total == t
                                    && (memory < m || (memory == m && (e, k) < (ce, ck))))
                        });
                        if better {
                            current = Some((total, memory, e, k));
                        }
                    }
                }
                best[s * (units + 1) + i] = current;
            }
        }
        let (total_s, max_memory_bytes, _, _) = best[0]?;
        let mut sizes = Vec::with_capacity(p);
        let mut modes = Vec::with_capacity(p);
        let mut bottleneck_s = 0.0f64;
        let mut i = 0;
        for s in 0..p {
            let (_, _, e, k) = best[s * (units + 1) + i]?;
            sizes.push(e - i);
            modes.push(RecomputeMode::ALL[k]);
            bottleneck_s = bottleneck_s.max(self.tables.time[k][self.index(i, e)]);
            i = e;
        }
        Some(Solution {
            sizes,
            modes,
            bottleneck_s,
            total_s,
            max_memory_bytes,
        })
    }

    /// The smallest peak memory of any cut and modes.
    fn min_memory(&self) -> u64 {
        let (units, p) = (self.tables.units, self.stages);
        let mut best = vec![u64::MAX; (p + 1) * (units + 1)];
        best[p * (units + 1) + units] = 0;
        for s in (0..p).rev() {
            let (starts, e_max) = self.bounds(s);
            for i in starts {
                let mut current = u64::MAX;
                for k in 0..RecomputeMode::ALL.len() {
                    for e in i + 1..=e_max {
                        let memory = self.memory(s, self.index(i, e), k);
                        if memory >= current {
                            break;
                        }
                        current = current.min(memory.max(best[(s + 1) * (units + 1) + e]));
                    }
                }
                best[s * (units + 1) + i] = current;
            }
        }
        best[0]
    }
}

/// The model-state bytes of a [`PlanKey`]'s bits.
fn bytes_of((dense, expert): (u64, u64)) -> StateBytes {
    StateBytes {
        dense: f64::from_bits(dense),
        expert: f64::from_bits(expert),
    }
}

/// The stage planner of one cost model and memory budget, caching its tables and answers (see
/// the [module docs](self)).
pub struct StageDp<'c, 'a> {
    cm: &'c CostModel<'a>,
    budget: u64,
    tables: HashMap<(RankSplit, usize, usize), Rc<Tables>>,
    plans: HashMap<PlanKey, Option<Solution>>,
    min_memory: HashMap<PlanKey, u64>,
}

impl<'c, 'a> StageDp<'c, 'a> {
    /// A planner for `cm` under `budget` bytes per device.
    pub fn new(cm: &'c CostModel<'a>, budget: u64) -> Self {
        StageDp {
            cm,
            budget,
            tables: HashMap::new(),
            plans: HashMap::new(),
            min_memory: HashMap::new(),
        }
    }

    /// The memory budget, bytes per device.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Frees the tables of unit ranges (`O(units²)` each, see the [module docs](self)); the
    /// answers found stay cached. The search calls it when it moves to the next
    /// tensor-parallel degree, whose tables are all different.
    pub fn release_tables(&mut self) {
        self.tables.clear();
    }

    fn check(&self, skeleton: &Skeleton) -> Result<(), StageDpError> {
        for (field, v) in [
            ("dp", skeleton.dp),
            ("tp", skeleton.tp),
            ("cp", skeleton.cp),
            ("ep", skeleton.ep),
            ("pp", skeleton.pp),
            ("micro_batch", skeleton.micro_batch),
            ("micro_batches", skeleton.micro_batches),
            ("tp_overlap", skeleton.tp_overlap),
        ] {
            if v == 0 {
                return Err(CostError::Zero { field }.into());
            }
        }
        let units = self.cm.model().num_units();
        if skeleton.pp > units {
            return Err(StageDpError::TooManyStages {
                stages: skeleton.pp,
                units,
            });
        }
        if skeleton.schedule.uses_virtual_stages() {
            return Err(StageDpError::Interleaved {
                schedule: skeleton.schedule,
            });
        }
        Ok(())
    }

    /// The tables and the cache key of `skeleton`.
    fn prepare(&mut self, skeleton: &Skeleton) -> Result<(Rc<Tables>, PlanKey), StageDpError> {
        self.check(skeleton)?;
        let (t, b, p, k) = (
            skeleton.split(),
            skeleton.micro_batch,
            skeleton.pp,
            skeleton.tp_overlap,
        );
        let in_flight = self
            .cm
            .in_flight(skeleton.schedule, p, 1, skeleton.micro_batches)?;
        let replicas = skeleton.dp * skeleton.cp.max(1);
        self.cm.check_experts(t, replicas)?;
        // The stage planner's cuts assume once-per-step reduce-scatters over all of dp.
        let sharding = StateSharding::of(
            skeleton.zero,
            skeleton.dp,
            0,
            t,
            ReduceScatter::Step,
            skeleton.schedule.weight_versions(),
        );
        let state_bytes = self.cm.state_bytes(&sharding);
        let cm = self.cm;
        let tables = Rc::clone(
            self.tables
                .entry((t, b, k))
                .or_insert_with(|| Rc::new(Tables::new(cm, t, b, k))),
        );
        let bits = (state_bytes.dense.to_bits(), state_bytes.expert.to_bits());
        Ok((tables, ((t, k), b, p, in_flight, bits)))
    }

    /// The fastest cut of the model into `skeleton.pp` stages with per-stage recomputation whose
    /// every stage fits the budget, or `None` when no cut fits.
    ///
    /// # Errors
    ///
    /// A skeleton with a zero field, more stages than units, or the interleaved schedule.
    pub fn plan(&mut self, skeleton: &Skeleton) -> Result<Option<StagePlan>, StageDpError> {
        let (tables, key) = self.prepare(skeleton)?;
        let solution = match self.plans.get(&key) {
            Some(found) => found.clone(),
            None => {
                let problem = Problem {
                    tables: &tables,
                    stages: skeleton.pp,
                    in_flight: &key.3,
                    state_bytes: bytes_of(key.4),
                };
                let cap = problem.bottleneck(self.budget);
                let solution = if cap.is_finite() {
                    problem.cheapest(cap, self.budget)
                } else {
                    None
                };
                self.plans.insert(key, solution.clone());
                solution
            }
        };
        let Some(solution) = solution else {
            return Ok(None);
        };
        let partition = explicit_partition(&solution.sizes, tables.units)?;
        Ok(Some(StagePlan {
            layout: Layout {
                dp: skeleton.dp,
                tp: skeleton.tp,
                pp: skeleton.pp,
                virtual_stages: 1,
                micro_batch: skeleton.micro_batch,
                micro_batches: skeleton.micro_batches,
                schedule: skeleton.schedule,
                recompute: solution.modes,
                zero: skeleton.zero,
                reduce_scatter: ReduceScatter::Step,
                shard: 0,
                reshard_after_forward: true,
                gradient_buffers: Default::default(),
                partition,
                tp_overlap: skeleton.tp_overlap,
                cp: skeleton.cp,
                sequence_parallel: skeleton.sequence_parallel,
                ep: skeleton.ep,
            },
            bottleneck_s: solution.bottleneck_s,
            total_s: solution.total_s,
            max_memory_bytes: solution.max_memory_bytes,
        }))
    }

    /// The smallest peak memory (bytes, largest over ranks) that any cut of the model into
    /// `skeleton.pp` stages with any per-stage modes needs: the smallest budget for which
    /// [`plan`](Self::plan) finds a cut.
    ///
    /// # Errors
    ///
    /// As [`plan`](Self::plan).
    pub fn min_memory(&mut self, skeleton: &Skeleton) -> Result<u64, StageDpError> {
        let (tables, key) = self.prepare(skeleton)?;
        if let Some(&found) = self.min_memory.get(&key) {
            return Ok(found);
        }
        let problem = Problem {
            tables: &tables,
            stages: skeleton.pp,
            in_flight: &key.3,
            state_bytes: bytes_of(key.4),
        };
        let memory = problem.min_memory();
        self.min_memory.insert(key, memory);
        Ok(memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::hardware::HardwareSpec;
    use crate::planner::model::ModelProxy;

    fn model(layers: usize) -> ModelProxy {
        ModelProxy::parse(&format!(
            "gpt:layers={layers},hidden=1024,heads=16,seq=1024,vocab=50000"
        ))
        .unwrap()
    }

    fn hardware() -> HardwareSpec {
        let mut hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(16);
        hw.memory_bytes = 6_000_000_000;
        hw
    }

    /// A dp=2 x tp=2 skeleton; the ZeRO-1 ones also overlap tensor parallelism (degree 2), so
    /// the brute-force checks cover both.
    fn skeleton(pp: usize, schedule: ScheduleKind, zero1: bool) -> Skeleton {
        Skeleton {
            dp: 2,
            tp: 2,
            pp,
            micro_batch: 2,
            micro_batches: 8,
            schedule,
            zero: u8::from(zero1),
            tp_overlap: if zero1 { 2 } else { 1 },
            cp: 1,
            sequence_parallel: false,
            ep: 1,
        }
    }

    /// Every composition of `units` into `parts` non-empty parts.
    fn compositions(units: usize, parts: usize) -> Vec<Vec<usize>> {
        if parts == 1 {
            return vec![vec![units]];
        }
        let mut out = Vec::new();
        for first in 1..=units - (parts - 1) {
            for mut rest in compositions(units - first, parts - 1) {
                rest.insert(0, first);
                out.push(rest);
            }
        }
        out
    }

    /// Every mode assignment of `parts` stages.
    fn assignments(parts: usize) -> Vec<Vec<RecomputeMode>> {
        let mut out = vec![Vec::new()];
        for _ in 0..parts {
            out = out
                .into_iter()
                .flat_map(|prefix| {
                    RecomputeMode::ALL.into_iter().map(move |mode| {
                        let mut next = prefix.clone();
                        next.push(mode);
                        next
                    })
                })
                .collect();
        }
        out
    }

    /// (bottleneck, total, max memory, modes) of every cut and assignment, computed through the
    /// cost model's own `estimate` and stage costs.
    struct Point {
        bottleneck: f64,
        total: f64,
        memory: u64,
        modes: Vec<RecomputeMode>,
    }

    fn brute_force(cm: &CostModel<'_>, sk: &Skeleton) -> Vec<Point> {
        let units = cm.model().num_units();
        let mut out = Vec::new();
        for sizes in compositions(units, sk.pp) {
            for modes in assignments(sk.pp) {
                let layout = Layout {
                    dp: sk.dp,
                    tp: sk.tp,
                    pp: sk.pp,
                    virtual_stages: 1,
                    micro_batch: sk.micro_batch,
                    micro_batches: sk.micro_batches,
                    schedule: sk.schedule,
                    recompute: modes.clone(),
                    zero: sk.zero,
                    reduce_scatter: ReduceScatter::Step,
                    shard: 0,
                    reshard_after_forward: true,
                    gradient_buffers: Default::default(),
                    partition: explicit_partition(&sizes, units).unwrap(),
                    tp_overlap: sk.tp_overlap,
                    cp: sk.cp,
                    sequence_parallel: sk.sequence_parallel,
                    ep: sk.ep,
                };
                let times = cm.stage_times(&layout).unwrap();
                let est = cm.estimate(&layout).unwrap();
                out.push(Point {
                    bottleneck: times.iter().copied().fold(0.0, f64::max),
                    // Summed from the last stage, in the order of the DP's shortest path.
                    total: times.iter().rev().fold(0.0, |rest, &t| t + rest),
                    memory: est.peak_memory_bytes.iter().copied().max().unwrap(),
                    modes,
                });
            }
        }
        out
    }

    fn max_memory(cm: &CostModel<'_>, layout: &Layout) -> u64 {
        let est = cm.estimate(layout).unwrap();
        est.peak_memory_bytes.iter().copied().max().unwrap()
    }

    #[test]
    fn covers_every_unit_without_empty_stages() {
        let hw = hardware();
        for layers in [1, 2, 3, 6, 10] {
            let model = model(layers);
            let units = model.num_units();
            let cm = CostModel::new(&model, &hw);
            let mut dp = StageDp::new(&cm, u64::MAX);
            for pp in 1..=units {
                for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
                    let sk = skeleton(pp, schedule, false);
                    let plan = dp.plan(&sk).unwrap().unwrap();
                    let l = &plan.layout;
                    assert_eq!(l.partition.units(), units);
                    assert_eq!(l.partition.stages(), pp);
                    assert_eq!(l.recompute.len(), pp);
                    let mut next = 0;
                    for range in l.partition.ranges() {
                        assert_eq!(range.start, next);
                        assert!(range.end > range.start, "empty stage in {:?}", l.partition);
                        next = range.end;
                    }
                    assert_eq!(next, units);
                    // Unlimited memory: nothing recomputes.
                    assert!(l.recompute.iter().all(|&m| m == RecomputeMode::None));
                    let times = cm.stage_times(l).unwrap();
                    assert_eq!(plan.bottleneck_s, times.iter().copied().fold(0.0, f64::max));
                    assert_eq!(plan.max_memory_bytes, max_memory(&cm, l));
                }
            }
            let err = dp.plan(&skeleton(units + 1, ScheduleKind::OneFOneB, false));
            assert!(matches!(err, Err(StageDpError::TooManyStages { .. })));
            let err = dp.plan(&skeleton(2, ScheduleKind::Interleaved, false));
            assert!(matches!(err, Err(StageDpError::Interleaved { .. })));
            let mut zero = skeleton(1, ScheduleKind::OneFOneB, false);
            zero.micro_batches = 0;
            assert!(matches!(dp.plan(&zero), Err(StageDpError::Cost(_))));
        }
    }

    #[test]
    fn respects_the_memory_budget() {
        let model = model(12);
        let hw = hardware();
        let cm = CostModel::new(&model, &hw);
        for pp in [1, 2, 3, 4, 7] {
            for schedule in [
                ScheduleKind::OneFOneB,
                ScheduleKind::GPipe,
                ScheduleKind::TwoBw,
            ] {
                for zero1 in [false, true] {
                    let sk = skeleton(pp, schedule, zero1);
                    let smallest = StageDp::new(&cm, 0).min_memory(&sk).unwrap();
                    let largest = StageDp::new(&cm, u64::MAX)
                        .plan(&sk)
                        .unwrap()
                        .unwrap()
                        .max_memory_bytes;
                    assert!(smallest <= largest);
                    let mut budgets = vec![smallest, largest, smallest.saturating_sub(1)];
                    budgets.extend((1..8).map(|q| smallest + (largest - smallest) * q / 8));
                    for budget in budgets {
                        let plan = StageDp::new(&cm, budget).plan(&sk).unwrap();
                        let Some(plan) = plan else {
                            assert!(budget < smallest, "{sk:?}: nothing fits {budget}");
                            continue;
                        };
                        assert!(budget >= smallest);
                        let need = max_memory(&cm, &plan.layout);
                        assert!(need <= budget, "{sk:?}: {need} > {budget}");
                        assert_eq!(need, plan.max_memory_bytes);
                        // Just below what this answer needs: nothing, or something else that fits.
                        let tighter = StageDp::new(&cm, need - 1).plan(&sk).unwrap();
                        if let Some(other) = tighter {
                            assert!(max_memory(&cm, &other.layout) < need);
                            assert!(other.bottleneck_s >= plan.bottleneck_s);
                        } else {
                            assert_eq!(need, smallest);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn optimal_by_brute_force() {
        let hw = hardware();
        let mut mixed_beats_uniform = 0;
        let mut cases = 0;
        for (layers, pp, schedule, zero1) in [
            (4, 2, ScheduleKind::OneFOneB, false),
            (4, 3, ScheduleKind::GPipe, true),
            (5, 3, ScheduleKind::OneFOneB, true),
            (5, 4, ScheduleKind::TwoBw, false),
            (6, 2, ScheduleKind::ShiftedCriticalPath, false),
            (6, 3, ScheduleKind::OneFOneB, false),
            (6, 4, ScheduleKind::OneFOneB, true),
        ] {
            let model = model(layers);
            let cm = CostModel::new(&model, &hw);
            let sk = skeleton(pp, schedule, zero1);
            let points = brute_force(&cm, &sk);
            let mut memories: Vec<u64> = points.iter().map(|p| p.memory).collect();
            memories.sort_unstable();
            memories.dedup();
            assert_eq!(
                StageDp::new(&cm, 0).min_memory(&sk).unwrap(),
                memories[0],
                "{sk:?}"
            );
            // Budgets from the tightest to none, so some choices are infeasible.
            let n = memories.len();
            let mut budgets: Vec<u64> = (0..=10).map(|q| memories[(n - 1) * q / 10]).collect();
            budgets.push(memories[0] - 1);
            budgets.push(memories[n / 3] + 1);
            for budget in budgets {
                cases += 1;
                let fits: Vec<&Point> = points.iter().filter(|p| p.memory <= budget).collect();
                let plan = StageDp::new(&cm, budget).plan(&sk).unwrap();
                let Some(plan) = plan else {
                    assert!(fits.is_empty(), "{sk:?} {budget}: DP found nothing");
                    continue;
                };
                let best = fits
                    .iter()
                    .map(|p| p.bottleneck)
                    .fold(f64::INFINITY, f64::min);
                assert_eq!(plan.bottleneck_s, best, "{sk:?} budget {budget}");
                // The DP's numbers are the cost model's numbers for its layout.
                let times = cm.stage_times(&plan.layout).unwrap();
                assert_eq!(plan.bottleneck_s, times.iter().copied().fold(0.0, f64::max));
                let need = max_memory(&cm, &plan.layout);
                assert!(need <= budget);
                assert_eq!(need, plan.max_memory_bytes);
                // Ties: the smallest total among the optimal bottlenecks, then the smallest
                // memory.
                let tied: Vec<&&Point> = fits.iter().filter(|p| p.bottleneck == best).collect();
                let total = tied.iter().map(|p| p.total).fold(f64::INFINITY, f64::min);
                let total_sum: f64 = times.iter().sum();
                assert!(
                    (plan.total_s - total).abs() <= 1e-12 * total
                        && (total_sum - total).abs() <= 1e-12 * total,
                    "{sk:?} budget {budget}: total {} vs {total}",
                    plan.total_s
                );
                // With the totals added in the DP's order, the ties are exact.
                assert_eq!(plan.total_s, total, "{sk:?} budget {budget}");
                let exact = tied
                    .iter()
                    .filter(|p| p.total == total)
                    .map(|p| p.memory)
                    .min();
                assert_eq!(Some(plan.max_memory_bytes), exact, "{sk:?} budget {budget}");
                // What uniform recomputation (any partition) could reach.
                let uniform = fits
                    .iter()
                    .filter(|p| p.modes.iter().all(|&m| m == p.modes[0]))
                    .map(|p| p.bottleneck)
                    .fold(f64::INFINITY, f64::min);
                assert!(plan.bottleneck_s <= uniform);
                let modes = &plan.layout.recompute;
                if plan.bottleneck_s < uniform {
                    assert!(modes.iter().any(|&m| m != modes[0]), "{modes:?}");
                    mixed_beats_uniform += 1;
                }
            }
        }
        assert!(cases > 50);
        // The budget forces a mix of modes in some cases: uniform recomputation would fail.
        assert!(
            mixed_beats_uniform >= 3,
            "only {mixed_beats_uniform} cases need mixed modes"
        );
    }

    #[test]
    fn mixed_modes_where_the_first_stage_holds_more_micro_batches() {
        // 1F1B: stage 0 holds pp micro-batches, the last stage one. With a budget between what
        // the all-full and the all-none cut need, the first stage recomputes and the last not.
        let model = model(8);
        let hw = hardware();
        let cm = CostModel::new(&model, &hw);
        let sk = skeleton(4, ScheduleKind::OneFOneB, false);
        let none = StageDp::new(&cm, u64::MAX).plan(&sk).unwrap().unwrap();
        let smallest = StageDp::new(&cm, 0).min_memory(&sk).unwrap();
        let budget = smallest + (none.max_memory_bytes - smallest) / 3;
        let plan = StageDp::new(&cm, budget).plan(&sk).unwrap().unwrap();
        let modes = &plan.layout.recompute;
        assert_ne!(modes[0], RecomputeMode::None, "{modes:?}");
        assert_eq!(modes[3], RecomputeMode::None, "{modes:?}");
        assert!(max_memory(&cm, &plan.layout) <= budget);
        assert!(plan.bottleneck_s >= none.bottleneck_s);
    }

    #[test]
    fn answers_are_cached_and_deterministic() {
        let model = model(6);
        let hw = hardware();
        let cm = CostModel::new(&model, &hw);
        let sk = skeleton(3, ScheduleKind::OneFOneB, false);
        let budget = StageDp::new(&cm, 0).min_memory(&sk).unwrap() + 200_000_000;
        let mut dp = StageDp::new(&cm, budget);
        let first = dp.plan(&sk).unwrap();
        assert_eq!(dp.plan(&sk).unwrap(), first);
        assert_eq!(StageDp::new(&cm, budget).plan(&sk).unwrap(), first);
        assert_eq!(dp.plans.len(), 1);
        assert_eq!(dp.tables.len(), 1);
        // ShiftedCriticalPath has 1F1B's in-flight counts: the same answer from the cache.
        let mut scp = sk;
        scp.schedule = ScheduleKind::ShiftedCriticalPath;
        let other = dp.plan(&scp).unwrap();
        if cm
            .in_flight(ScheduleKind::ShiftedCriticalPath, 3, 1, 8)
            .unwrap()
            == cm.in_flight(ScheduleKind::OneFOneB, 3, 1, 8).unwrap()
        {
            assert_eq!(dp.plans.len(), 1);
            assert_eq!(
                other.map(|p| p.layout.recompute),
                first.map(|p| p.layout.recompute)
            );
        }
        // A different budget is a different planner; the tables are per (tp, b).
        let mut b4 = sk;
        b4.micro_batch = 4;
        dp.plan(&b4).unwrap();
        assert_eq!(dp.tables.len(), 2);
    }
}
