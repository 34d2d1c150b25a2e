//! The cost model: predicted step time and per-rank memory of a 3D-parallel [`Layout`].
//!
//! Time. For every global pipeline stage the forward, backward and recomputation times of one
//! micro-batch are its FLOPs on one tensor-parallel rank divided by the achievable FLOP/s
//! ([`HardwareSpec::achievable_flops`], the one efficiency constant), plus its tensor-parallel
//! all-reduces (ring: `2 (t-1)/t * bytes / bandwidth + latency` each, on the intra-node link
//! when the `t` ranks fit in a node). These costs and the point-to-point message time drive a
//! discrete-event simulation of the actual schedule
//! ([`pipeline::simulate`](crate::pipeline::simulate())), so the bubble is what the schedule
//! really does with unequal stages, recomputation and messages. Large micro-batch counts are
//! simulated at two smaller counts in the steady state and extrapolated linearly (exact for
//! equal stages); simulations are cached. After the pipeline drains, each rank pays the part
//! of its data-parallel gradient all-reduce (`2 (d-1)/d` of its 16-bit gradients) that its last
//! micro-batch's backward pass could not hide, the optimizer step (memory-bound: 28 bytes per
//! local parameter) and, with ZeRO-1, the all-gather of the updated parameters.
//!
//! Memory. Per pipeline rank: model states (16 bytes per parameter, `4 + 12/d` with ZeRO-1),
//! for each of its stages the activations of one micro-batch (per the stage's
//! [`RecomputeMode`]) times the most micro-batches that stage holds at once
//! ([`Schedule::max_in_flight`](crate::pipeline::Schedule::max_in_flight)), a second 16-bit
//! weight version under PipeDream-2BW, plus a workspace: the largest unit's full activations
//! (rebuilt during its backward pass) and [`FRAMEWORK_BYTES`].

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use thiserror::Error;

use super::hardware::HardwareSpec;
use super::model::{BYTES_16BIT, ModelProxy, RecomputeMode};
use crate::pipeline::{
    Costs, Partition, ScheduleError, ScheduleKind, ValidationError, build_schedule, simulate,
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
    /// The schedule cannot be built.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The simulation failed.
    #[error(transparent)]
    Simulation(#[from] ValidationError),
}

/// A 3D-parallel training layout: everything the cost model needs to predict it.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
    /// Shard the optimizer states over data parallelism (ZeRO-1).
    pub zero1: bool,
    /// The model's units cut into `pp * virtual_stages` stages.
    pub partition: Partition,
}

impl Layout {
    /// Devices used: `dp * tp * pp`.
    pub fn gpus(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// Sequences per step: `dp * micro_batch * micro_batches`.
    pub fn global_batch(&self) -> usize {
        self.dp * self.micro_batch * self.micro_batches
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
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds per training step.
    pub step_time_s: f64,
    /// TFLOP/s per device, with DESIGN.md §5's FLOP count (the full-recompute formula when every
    /// stage recomputes fully).
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

/// Per-layout derived costs.
struct Derived {
    costs: Costs,
    schedule_recompute: Vec<bool>,
    /// Per pipeline rank: compute-only seconds per micro-batch (all its chunks).
    compute_per_mb: Vec<f64>,
    /// Per pipeline rank: TP communication seconds per micro-batch.
    tp_per_mb: Vec<f64>,
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

type SimKey = Vec<u64>;

/// Schedule kind, ranks, virtual stages, micro-batches.
type InFlightKey = (ScheduleKind, usize, usize, usize);

/// Predicts layouts of one model on one cluster, caching schedules' in-flight counts and
/// simulations.
pub struct CostModel<'a> {
    model: &'a ModelProxy,
    hardware: &'a HardwareSpec,
    in_flight: RefCell<HashMap<InFlightKey, Vec<usize>>>,
    simulations: RefCell<HashMap<SimKey, f64>>,
}

impl<'a> CostModel<'a> {
    /// A cost model of `model` on `hardware`.
    pub fn new(model: &'a ModelProxy, hardware: &'a HardwareSpec) -> Self {
        CostModel {
            model,
            hardware,
            in_flight: RefCell::new(HashMap::new()),
            simulations: RefCell::new(HashMap::new()),
        }
    }

    /// The model.
    pub fn model(&self) -> &ModelProxy {
        self.model
    }

    /// The hardware.
    pub fn hardware(&self) -> &HardwareSpec {
        self.hardware
    }

    /// The most micro-batches each global stage holds at once.
    fn in_flight(
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
        let counts: Vec<usize> = (0..p * v).map(|s| schedule.max_in_flight(s)).collect();
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

    fn check(&self, layout: &Layout) -> Result<(), CostError> {
        for (field, v) in [
            ("dp", layout.dp),
            ("tp", layout.tp),
            ("pp", layout.pp),
            ("virtual_stages", layout.virtual_stages),
            ("micro_batch", layout.micro_batch),
            ("micro_batches", layout.micro_batches),
        ] {
            if v == 0 {
                return Err(CostError::Zero { field });
            }
        }
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

    fn derive(&self, layout: &Layout) -> Result<Derived, CostError> {
        self.check(layout)?;
        let hw = self.hardware;
        let (t, b, p, v, d) = (
            layout.tp,
            layout.micro_batch,
            layout.pp,
            layout.virtual_stages,
            layout.dp,
        );
        let stages = layout.stages();
        let flops = hw.achievable_flops() * t as f64;
        let mut costs = Costs::uniform(stages, 0.0, 0.0);
        let mut compute = vec![0.0; stages];
        let mut tp_time = vec![0.0; stages];
        let mut act = vec![0.0; stages];
        let mut params = vec![0.0; stages];
        let mut largest = vec![0.0f64; stages];
        let ranges = layout.partition.ranges();
        let head_separate = ranges.len() > 1;
        for (j, range) in ranges.iter().enumerate() {
            let mode = layout.recompute[j];
            let (mut f, mut bw, mut r) = (0.0, 0.0, 0.0);
            let (mut tf, mut tb, mut tr) = (0.0, 0.0, 0.0);
            for unit in &self.model.units[range.clone()] {
                f += unit.forward_flops(b) / flops;
                bw += unit.backward_flops(b) / flops;
                r += unit.recompute_flops(b, mode) / flops;
                let one = self.allreduce(unit.tp_allreduce_elements * b as f64 * BYTES_16BIT, t, t);
                tf += unit.tp_forward_allreduces as f64 * one;
                tb += unit.tp_backward_allreduces as f64 * one;
                if mode == RecomputeMode::Full && unit.recomputable {
                    tr += unit.tp_forward_allreduces as f64 * one;
                }
                act[j] += unit.activation_bytes(b, t, mode);
                params[j] += unit.params_per_rank(t);
                if head_separate && j > 0 {
                    params[j] += unit.params_tied as f64 / t as f64;
                }
                largest[j] = largest[j].max(unit.activation_bytes(b, t, RecomputeMode::None));
            }
            costs.forward[j] = f + tf;
            costs.backward[j] = bw + tb;
            costs.recompute[j] = r + tr;
            compute[j] = f + bw + r;
            tp_time[j] = tf + tb + tr;
        }
        let (pp_bw, pp_lat) = hw.link(if p > 1 { 2 * d * t } else { 1 });
        let message = self.model.pp_message_bytes(b) / pp_bw + pp_lat;
        if p > 1 {
            costs.send_activation = message;
            costs.send_grad = message;
        }
        let in_flight = self.in_flight(layout.schedule, p, v, layout.micro_batches)?;
        let mut derived = Derived {
            schedule_recompute: layout
                .recompute
                .iter()
                .map(|&mode| mode == RecomputeMode::Full)
                .collect(),
            compute_per_mb: vec![0.0; p],
            tp_per_mb: vec![0.0; p],
            tail: vec![0.0; p],
            pipeline_lb: 0.0,
            dp_exposed: vec![0.0; p],
            optimizer: vec![0.0; p],
            allgather: vec![0.0; p],
            states: vec![0.0; p],
            activations: vec![0.0; p],
            workspace: vec![0.0; p],
            costs,
        };
        let dp_span = d * t;
        for rank in 0..p {
            let mut rank_params = 0.0;
            let mut last_backward = 0.0;
            let mut recomputes = false;
            let mut largest_unit = 0.0f64;
            for chunk in 0..v {
                let j = chunk * p + rank;
                rank_params += params[j];
                last_backward += derived.costs.backward[j] + derived.costs.recompute[j];
                derived.compute_per_mb[rank] += compute[j];
                derived.tp_per_mb[rank] += tp_time[j];
                derived.activations[rank] += in_flight[j] as f64 * act[j];
                recomputes |= layout.recompute[j] != RecomputeMode::None;
                largest_unit = largest_unit.max(largest[j]);
            }
            let grad_bytes = rank_params * BYTES_16BIT;
            let (exposed, allgather, local_params, state_bytes) = if layout.zero1 {
                // Reduce-scatter (half a ring all-reduce) overlaps the backward pass; the
                // all-gather of the updated 16-bit parameters does not.
                let half = self.allreduce(grad_bytes, d, dp_span) / 2.0;
                (
                    (half - last_backward).max(0.0),
                    if d > 1 { half } else { 0.0 },
                    rank_params / d as f64,
                    4.0 + 12.0 / d as f64,
                )
            } else {
                let full = self.allreduce(grad_bytes, d, dp_span);
                ((full - last_backward).max(0.0), 0.0, rank_params, 16.0)
            };
            let optimizer = local_params * OPTIMIZER_BYTES_PER_PARAM / hw.memory_bandwidth;
            derived.dp_exposed[rank] = exposed;
            derived.allgather[rank] = allgather;
            derived.optimizer[rank] = optimizer;
            derived.tail[rank] = exposed + allgather + optimizer;
            // PipeDream-2BW keeps a second (16-bit) weight version.
            let versions = if layout.schedule == ScheduleKind::TwoBw {
                BYTES_16BIT
            } else {
                0.0
            };
            derived.states[rank] = rank_params * (state_bytes + versions);
            derived.workspace[rank] = FRAMEWORK_BYTES + if recomputes { largest_unit } else { 0.0 };
        }
        // Rank r cannot start before micro-batch 0 has gone forward through stages 0..r, and
        // (when the pipeline flushes) cannot be done before its last backward has gone back
        // through them; in between it works m times its per-micro-batch time.
        let m = layout.micro_batches as f64;
        let mut before = 0.0;
        let mut after = 0.0;
        for rank in 0..p {
            let busy = m * (derived.compute_per_mb[rank] + derived.tp_per_mb[rank]);
            let bound = if layout.schedule.flushes() {
                before + busy + after
            } else {
                busy
            };
            derived.pipeline_lb = derived.pipeline_lb.max(bound);
            before += derived.costs.forward[rank] + derived.costs.send_activation;
            after += derived.costs.backward[rank] + derived.costs.send_grad;
        }
        Ok(derived)
    }

    /// The lower bound of the time from derived costs: the pipeline bound plus the largest
    /// tail.
    fn lower_bound(derived: &Derived) -> f64 {
        derived.pipeline_lb + derived.tail.iter().copied().fold(0.0, f64::max)
    }

    fn memory(derived: &Derived) -> Vec<u64> {
        (0..derived.states.len())
            .map(|r| {
                (derived.states[r] + derived.activations[r] + derived.workspace[r]).ceil() as u64
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
            time_lower_bound_s: CostModel::lower_bound(&derived),
        })
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
        let time = if layout.schedule.flushes() {
            simulate(&schedule, costs, 1)?.makespan()
        } else {
            // The marginal time of a step of the continuous (no-flush) pipeline.
            let one = simulate(&schedule, costs, 1)?.makespan();
            let two = simulate(&schedule, costs, 2)?.makespan();
            two - one
        };
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
            .map(|r| m as f64 * (derived.compute_per_mb[r] + derived.tp_per_mb[r]))
            .fold(0.0, f64::max);
        let pipeline = simulated.max(derived.pipeline_lb);
        let tail = derived.tail.iter().copied().fold(0.0, f64::max);
        let step = pipeline + tail;
        let memory = CostModel::memory(&derived);
        let gpus = layout.gpus() as f64;
        let flops = self
            .model
            .reported_flops(layout.global_batch(), layout.full_recompute());
        let worst = (0..p).max_by_key(|&r| memory[r]).unwrap_or(0);
        let busiest = (0..p)
            .max_by(|&a, &c| {
                (derived.compute_per_mb[a] + derived.tp_per_mb[a])
                    .total_cmp(&(derived.compute_per_mb[c] + derived.tp_per_mb[c]))
            })
            .unwrap_or(0);
        let mut breakdown = BTreeMap::new();
        let mut put = |k: &str, v: f64| {
            breakdown.insert(k.to_string(), v);
        };
        put("pipeline_s", pipeline);
        put("compute_s", m as f64 * derived.compute_per_mb[busiest]);
        put("tp_comm_s", m as f64 * derived.tp_per_mb[busiest]);
        put("pp_message_s", derived.costs.send_activation);
        put("bubble_s", pipeline - busy);
        put(
            "dp_exposed_s",
            derived.dp_exposed.iter().copied().fold(0.0, f64::max),
        );
        put(
            "zero1_allgather_s",
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
            zero1: false,
            partition: balanced_partition(&costs, pp).unwrap(),
        }
    }

    #[test]
    fn single_device_time_is_flops_over_rate() {
        let model = ModelProxy::parse("gpt2").unwrap();
        let hw = HardwareSpec::preset("a100-80g").unwrap();
        let cm = CostModel::new(&model, &hw);
        let pred = cm.predict(&layout(&model, 1, 1, 1, 8)).unwrap();
        let flops = model.flops_per_iteration(8, RecomputeMode::Full);
        let expect = flops / hw.achievable_flops();
        let tail = pred.breakdown["optimizer_s"];
        assert!((pred.step_time_s - tail - expect).abs() < 1e-9 * expect);
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
            + model.units[1].activation_bytes(1, 8, RecomputeMode::None);
        assert!((pred.peak_memory_bytes[0] as f64 - expected).abs() < 2.0);
        let mut z = l.clone();
        z.zero1 = true;
        let zp = cm.predict(&z).unwrap();
        assert!(zp.peak_memory_bytes[0] < pred.peak_memory_bytes[0]);
        assert!(est.time_lower_bound_s <= pred.step_time_s);
    }
}
