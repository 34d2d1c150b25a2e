//! One typed plan of a parallel run ([`ParallelPlan`]): the layout, how the model is cut into
//! pipeline stages, the schedule, recomputation, micro-batching, ZeRO-1 and the
//! tensor-parallel overlap degree. A config file and the planner both produce it; the trainer
//! runs what [`ParallelPlan::pipeline`] builds from it.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::context_parallel::CpAttention;
use crate::data_parallel::{GradientBuffers, ReduceScatter};
use crate::grid::Layout;
use crate::pipeline::{
    PartitionError, PipelinePlan, Recompute, RecomputeMode, ScheduleError, ScheduleKind,
    ValidationError, activation_bytes_per_layer, balanced_partition, build_schedule,
    explicit_partition, kept_bytes_per_layer, stage_aware_recompute, unit_costs_gpt, validate,
};
use crate::planner::TransformerShape;

/// A plan that cannot be built; every message names the plan's key (as `parallel.<key>` in a
/// merak config) and the numbers.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum PlanError {
    /// The stages cannot be cut.
    #[error("parallel.pp = {pp} x parallel.virtual_stages = {virtual_stages}: {source}")]
    Balance {
        /// Pipeline ranks.
        pp: usize,
        /// Stages per rank.
        virtual_stages: usize,
        /// Why.
        source: PartitionError,
    },
    /// `stage_units` has the wrong number of entries.
    #[error(
        "parallel.stage_layers has {given} entries for {stages} stages (pp = {pp} x virtual_stages = {virtual_stages})"
    )]
    StageCount {
        /// Entries given.
        given: usize,
        /// Stages of the plan.
        stages: usize,
        /// Pipeline ranks.
        pp: usize,
        /// Stages per rank.
        virtual_stages: usize,
    },
    /// `stage_units` does not cover the model.
    #[error(
        "parallel.stage_layers = {sizes:?} (units: embedding + {layers} layers + head = {units}): {source}"
    )]
    Explicit {
        /// The sizes given.
        sizes: Vec<usize>,
        /// Transformer layers.
        layers: usize,
        /// Units of the model.
        units: usize,
        /// Why.
        source: PartitionError,
    },
    /// `stage_recompute` has the wrong number of entries.
    #[error("parallel.stage_recompute has {given} entries for {stages} stages")]
    RecomputeCount {
        /// Entries given.
        given: usize,
        /// Stages of the plan.
        stages: usize,
    },
    /// The schedule cannot be built.
    #[error("parallel.schedule = {kind:?}: {source}")]
    Schedule {
        /// The schedule.
        kind: String,
        /// Why.
        source: ScheduleError,
    },
    /// Stage-aware recomputation was asked of a model known only by its unit costs.
    #[error(
        "parallel.recompute = \"stage-aware\" needs a transformer's shape (activation sizes); choose \"full\", \"selective\" or per-stage modes"
    )]
    StageAwareNeedsShape,
    /// A stage-aware budget that not even full recomputation fits.
    #[error(
        "parallel.memory_budget_mb = {budget_mb} is below what full recomputation needs on \
         stage {stage} ({need_mb:.3} MiB: its inputs for {held} micro-batches in flight); \
         give at least {need_mb:.3}, or 0 for the last stage's need"
    )]
    BudgetTooSmall {
        /// The budget given.
        budget_mb: f64,
        /// The stage that cannot fit.
        stage: usize,
        /// What it needs with every unit recomputed.
        need_mb: f64,
        /// Its micro-batches in flight.
        held: usize,
    },
    /// The schedule was built but is not runnable (a bug: reported, never run).
    #[error("the {kind} schedule is invalid: {source}")]
    Invalid {
        /// The schedule.
        kind: String,
        /// Why.
        source: ValidationError,
    },
}

/// How a run is parallelized: the layout, stages, schedule, recomputation, micro-batching,
/// ZeRO-1 and overlap. Every key has a default (one process, 1F1B, no recomputation), so a
/// plan file states only what differs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelPlan {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Context-parallel degree: the ranks each sequence is cut across (ring attention over a
    /// zigzag split); folded into data parallelism for the parameters.
    pub cp: usize,
    /// How the context-parallel attention exchanges its inputs: `ring` or `all-to-all`.
    pub cp_attention: CpAttention,
    /// Sequence parallelism (tp > 1): between the tensor-parallel blocks each TP rank holds
    /// `1 / tp` of the sequence.
    pub sequence_parallel: bool,
    /// Expert-parallel degree (a mixture of experts): each group of `ep` data-parallel ranks
    /// splits the experts; divides `dp × cp`.
    pub ep: usize,
    /// Pipeline ranks.
    pub pp: usize,
    /// Model stages per pipeline rank (interleaved schedule; 1 otherwise).
    pub virtual_stages: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Units per stage (the embedding is the first unit, the head the last); empty: balanced
    /// by cost.
    pub stage_units: Vec<usize>,
    /// The recomputation policy (used when `stage_recompute` is empty).
    pub recompute: Recompute,
    /// Recomputation per stage; when set it replaces `recompute`.
    pub stage_recompute: Vec<RecomputeMode>,
    /// Stage-aware recomputation: activation memory per stage in MiB; 0: what the last stage
    /// needs without recomputation.
    pub memory_budget_mb: f64,
    /// The ZeRO stage over the data-parallel ranks: 0 none; 1 the optimizer state sharded by
    /// chunks (the gradients all-reduced, each rank stepping its chunks, the new parameters
    /// all-gathered); 2 the gradients too (reduce-scattered); 3 the parameters too (each
    /// unit's gathered just before it runs).
    pub zero: u8,
    /// Size of a data-parallel gradient bucket in MiB; a bucket's all-reduce starts as soon as
    /// all its gradients are final.
    pub bucket_mb: f64,
    /// Sub-pipelined tensor parallelism: token chunks per micro-batch (1: no overlap).
    pub tp_overlap: usize,
    /// Under ZeRO-3: units whose parameters are gathered ahead of the one running (0: each
    /// unit's gather waits for nothing but blocks it).
    pub prefetch: usize,
    /// Hybrid sharding under ZeRO: the data-parallel ranks that share one replica's
    /// chunks (a divisor of `dp`; 0 or `dp`: all of them), the others holding copies.
    pub shard: usize,
    /// Under ZeRO-2 and 3: reduce-scatter the gradients once per step or every micro-batch.
    pub reduce_scatter: ReduceScatter,
    /// Under ZeRO-3: free each unit's gathered parameters after its forward pass and gather
    /// them again for its (recomputed) backward pass (`true`, the default); `false` gathers
    /// the rank's parameters once per step and keeps them until the update, so nothing is
    /// recomputed (ZeRO-2's parameter memory during the step, sharded between steps).
    pub reshard_after_forward: bool,
    /// Where the data-parallel reducer keeps a step's gradients: in host memory, on the
    /// device, or (`auto`) on the device where that saves copies.
    pub gradient_buffers: GradientBuffers,
}

impl Default for ParallelPlan {
    /// One process, one micro-batch of one sequence, 1F1B, no recomputation, no ZeRO.
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            cp: 1,
            cp_attention: CpAttention::Ring,
            sequence_parallel: false,
            ep: 1,
            pp: 1,
            virtual_stages: 1,
            micro_batch: 1,
            schedule: ScheduleKind::OneFOneB,
            stage_units: Vec::new(),
            recompute: Recompute::None,
            stage_recompute: Vec::new(),
            memory_budget_mb: 0.0,
            zero: 0,
            bucket_mb: 1.0,
            tp_overlap: 1,
            prefetch: 1,
            shard: 0,
            reduce_scatter: ReduceScatter::Step,
            reshard_after_forward: true,
            gradient_buffers: GradientBuffers::Auto,
        }
    }
}

impl std::fmt::Display for ParallelPlan {
    /// `dp=2 tp=2 pp=2 micro_batch=2 schedule=1f1b stages=[..]` (the ZeRO stage and overlap
    /// when on).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dp={} tp={} pp={} micro_batch={} schedule={} stages={:?}",
            self.dp, self.tp, self.pp, self.micro_batch, self.schedule, self.stage_units
        )?;
        if self.cp > 1 {
            write!(f, " cp={} ({})", self.cp, self.cp_attention)?;
        }
        if self.sequence_parallel {
            write!(f, " sequence_parallel")?;
        }
        if self.ep > 1 {
            write!(f, " ep={}", self.ep)?;
        }
        if self.zero > 0 {
            write!(f, " zero{}", self.zero)?;
        }
        if self.zero >= 2 && self.reduce_scatter == ReduceScatter::MicroBatch {
            write!(f, " reduce_scatter={}", self.reduce_scatter)?;
        }
        if self.tp_overlap > 1 {
            write!(f, " tp_overlap={}", self.tp_overlap)?;
        }
        Ok(())
    }
}

impl ParallelPlan {
    /// The process layout `dp x cp x tp x pp`.
    pub fn layout(&self) -> Layout {
        Layout {
            dp: self.dp,
            tp: self.tp,
            cp: self.cp,
            pp: self.pp,
        }
    }

    /// Sequences per step on one data-parallel rank, of a global batch of `global_batch`.
    pub fn local_batch(&self, global_batch: usize) -> usize {
        global_batch / self.dp.max(1)
    }

    /// Micro-batches per step on one data-parallel rank, of a global batch of `global_batch`.
    pub fn micro_batches(&self, global_batch: usize) -> usize {
        self.local_batch(global_batch) / self.micro_batch.max(1)
    }

    /// The pipeline rank of global stage `stage` under this plan's schedule.
    pub fn rank_of(&self, stage: usize) -> usize {
        crate::pipeline::schedule::rank_of_stage(self.schedule, self.pp.max(1), stage)
    }

    /// Global pipeline stages, `pp * virtual_stages`.
    pub fn stages(&self) -> usize {
        self.pp * self.virtual_stages
    }

    /// The plan a planned layout describes.
    pub fn from_planned(l: &crate::planner::Layout) -> Self {
        Self {
            dp: l.dp,
            tp: l.tp,
            cp: l.cp,
            cp_attention: CpAttention::Ring,
            sequence_parallel: l.sequence_parallel,
            ep: l.ep,
            pp: l.pp,
            virtual_stages: l.virtual_stages,
            micro_batch: l.micro_batch,
            schedule: l.schedule,
            stage_units: l.partition.sizes(),
            recompute: Recompute::None,
            stage_recompute: l.recompute.clone(),
            memory_budget_mb: 0.0,
            zero: l.zero,
            bucket_mb: 1.0,
            tp_overlap: l.tp_overlap,
            prefetch: 1,
            shard: l.shard,
            reduce_scatter: l.reduce_scatter,
            reshard_after_forward: l.reshard_after_forward,
            gradient_buffers: l.gradient_buffers,
        }
    }

    /// How ZeRO cuts a rank's model states under this plan
    /// ([`StateSharding::of`](crate::planner::StateSharding::of)), what the planner, the
    /// admission check and `memory.json` count.
    pub fn state_sharding(&self) -> crate::planner::StateSharding {
        let split = crate::planner::RankSplit::new(self.tp, self.cp, self.sequence_parallel)
            .with_ep(self.ep);
        crate::planner::StateSharding::of(
            self.zero,
            self.dp,
            self.shard,
            split,
            self.reduce_scatter,
            self.schedule.weight_versions(),
        )
    }

    /// The planner's description of this plan cut into `pipeline` and trained on
    /// `global_batch` sequences per step, for its cost and memory model. A stage that
    /// recomputes any of its units counts as fully recomputed (so a memory estimate errs low
    /// rather than refusing a run that fits).
    pub fn planned_layout(
        &self,
        pipeline: &PipelinePlan,
        global_batch: usize,
    ) -> crate::planner::Layout {
        let partition = pipeline.partition.clone();
        let recompute = (0..self.stages())
            .map(|s| {
                let units = partition.range(s).len();
                let recomputed = pipeline.recompute_units.get(s).copied().unwrap_or(0);
                match recomputed.min(units) {
                    0 if self.selective_on_rank(self.rank_of(s)) => RecomputeMode::Selective,
                    0 => RecomputeMode::None,
                    _ => RecomputeMode::Full,
                }
            })
            .collect();
        crate::planner::Layout {
            dp: self.dp,
            tp: self.tp,
            pp: self.pp,
            virtual_stages: self.virtual_stages,
            micro_batch: self.micro_batch,
            micro_batches: self.micro_batches(global_batch),
            schedule: self.schedule,
            recompute,
            zero: self.zero,
            reduce_scatter: self.reduce_scatter,
            shard: self.shard,
            reshard_after_forward: self.reshard_after_forward,
            gradient_buffers: self.gradient_buffers,
            partition,
            tp_overlap: self.tp_overlap,
            cp: self.cp,
            sequence_parallel: self.sequence_parallel,
            ep: self.ep,
        }
    }

    /// Whether pipeline rank `pp_rank` runs with selective recomputation (Burn's balanced
    /// checkpointing): the policy says so, or one of its stages in `stage_recompute` does.
    pub fn selective_on_rank(&self, pp_rank: usize) -> bool {
        if self.stage_recompute.is_empty() {
            return self.recompute == Recompute::Selective;
        }
        self.stage_recompute
            .iter()
            .enumerate()
            .any(|(stage, &m)| self.rank_of(stage) == pp_rank && m == RecomputeMode::Selective)
    }

    /// Builds and validates the pipeline plan of `model` trained on `global_batch` sequences
    /// per step (also for pp = 1, one stage running its micro-batches one after the other).
    /// A full stage recomputes all its units; a selective one is handled by the rank's backend
    /// ([`selective_on_rank`](Self::selective_on_rank)).
    pub fn pipeline(
        &self,
        model: &TransformerShape,
        global_batch: usize,
    ) -> Result<PipelinePlan, PlanError> {
        let costs = unit_costs_gpt(model.layers, model.hidden, model.seq, model.vocab);
        self.build(&costs, Some(model), global_batch)
    }

    /// Like [`pipeline`](Self::pipeline) for a model described only by the cost of each unit
    /// (for example `merak_burn::parallelize::Units::unit_costs`, timed on the
    /// backend): stages are balanced by those costs. Stage-aware recomputation needs a
    /// transformer's activation sizes and is refused here.
    pub fn pipeline_with_costs(
        &self,
        costs: &[f64],
        global_batch: usize,
    ) -> Result<PipelinePlan, PlanError> {
        self.build(costs, None, global_batch)
    }

    /// The pipeline plan of a model whose units cost `costs` (`model`: its transformer shape,
    /// when known).
    fn build(
        &self,
        costs: &[f64],
        model: Option<&TransformerShape>,
        global_batch: usize,
    ) -> Result<PipelinePlan, PlanError> {
        let stages = self.stages();
        let partition = self.partition(costs)?;
        let m = self.micro_batches(global_batch);
        // Interleaving with one stage per rank is plain 1F1B (a model with few layers may not
        // have units for more stages per rank).
        let kind = match self.schedule {
            ScheduleKind::Interleaved if self.virtual_stages == 1 => ScheduleKind::OneFOneB,
            k => k,
        };
        let schedule_of = |flags: &[bool]| {
            build_schedule(kind, self.pp, m, self.virtual_stages, flags).map_err(|source| {
                PlanError::Schedule {
                    kind: self.schedule.to_string(),
                    source,
                }
            })
        };
        let flags = self.full_stages()?;
        let mut schedule = schedule_of(&flags)?;
        let sizes = partition.sizes();
        let recompute_units: Vec<usize> = if self.stage_aware() {
            let model = model.ok_or(PlanError::StageAwareNeedsShape)?;
            let in_flight: Vec<usize> = (0..stages).map(|s| schedule.max_in_flight(s)).collect();
            let units = self.stage_aware_units(model, &in_flight, &sizes)?;
            // Only stages that recompute something get the shifted-critical-path actions.
            let flags: Vec<bool> = units.iter().map(|&k| k > 0).collect();
            schedule = schedule_of(&flags)?;
            units
        } else {
            sizes
                .iter()
                .zip(&flags)
                .map(|(&size, &full)| if full { size } else { 0 })
                .collect()
        };
        validate(&schedule).map_err(|source| PlanError::Invalid {
            kind: kind.to_string(),
            source,
        })?;
        Ok(PipelinePlan {
            schedule,
            partition,
            recompute_units,
        })
    }

    /// Whether the stage-aware policy picks the recomputed units.
    fn stage_aware(&self) -> bool {
        self.stage_recompute.is_empty() && self.recompute == Recompute::StageAware
    }

    /// The units (costing `costs`) cut into the plan's stages.
    fn partition(&self, costs: &[f64]) -> Result<crate::pipeline::Partition, PlanError> {
        let stages = self.stages();
        let units = costs.len();
        if self.stage_units.is_empty() {
            return balanced_partition(costs, stages).map_err(|source| PlanError::Balance {
                pp: self.pp,
                virtual_stages: self.virtual_stages,
                source,
            });
        }
        if self.stage_units.len() != stages {
            return Err(PlanError::StageCount {
                given: self.stage_units.len(),
                stages,
                pp: self.pp,
                virtual_stages: self.virtual_stages,
            });
        }
        explicit_partition(&self.stage_units, units).map_err(|source| PlanError::Explicit {
            sizes: self.stage_units.clone(),
            layers: units.saturating_sub(2),
            units,
            source,
        })
    }

    /// Per stage, whether it recomputes fully (the schedule places its recomputation).
    fn full_stages(&self) -> Result<Vec<bool>, PlanError> {
        let stages = self.stages();
        if self.stage_recompute.is_empty() {
            let full = matches!(self.recompute, Recompute::Full | Recompute::StageAware);
            return Ok(vec![full; stages]);
        }
        if self.stage_recompute.len() != stages {
            return Err(PlanError::RecomputeCount {
                given: self.stage_recompute.len(),
                stages,
            });
        }
        Ok(self
            .stage_recompute
            .iter()
            .map(|&m| m == RecomputeMode::Full)
            .collect())
    }

    /// Stage-aware recomputation: per stage, the units to recompute so that the micro-batches
    /// it holds in flight fit the memory budget.
    fn stage_aware_units(
        &self,
        model: &TransformerShape,
        in_flight: &[usize],
        sizes: &[usize],
    ) -> Result<Vec<usize>, PlanError> {
        let (s, b, h) = (model.seq, self.micro_batch, model.hidden);
        let act = activation_bytes_per_layer(s, b, h, model.heads, self.tp, 4.0);
        let kept = kept_bytes_per_layer(s, b, h, 4.0);
        let mib = (1u64 << 20) as f64;
        let budget = if self.memory_budget_mb > 0.0 {
            self.memory_budget_mb * mib
        } else {
            let last = in_flight.len() - 1;
            in_flight[last] as f64 * sizes[last] as f64 * act
        };
        // A budget the user gave must be reachable: every stage recomputing all its units.
        let full = |stage: usize| in_flight[stage] as f64 * sizes[stage] as f64 * kept;
        if self.memory_budget_mb > 0.0
            && let Some(stage) = (0..sizes.len()).find(|&st| full(st) > budget)
        {
            return Err(PlanError::BudgetTooSmall {
                budget_mb: self.memory_budget_mb,
                stage,
                need_mb: (0..sizes.len()).map(full).fold(0.0, f64::max) / mib,
                held: in_flight[stage],
            });
        }
        Ok(stage_aware_recompute(in_flight, sizes, act, kept, budget))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> TransformerShape {
        TransformerShape::preset("tiny").expect("the tiny preset")
    }

    #[test]
    fn a_partial_plan_file_takes_the_defaults_and_builds_its_pipeline() {
        let plan: ParallelPlan = toml::from_str(
            "pp = 2\nmicro_batch = 2\nschedule = \"gpipe\"\nstage_recompute = [\"full\", \"none\"]",
        )
        .expect("a valid plan");
        assert_eq!((plan.dp, plan.tp, plan.virtual_stages), (1, 1, 1));
        let p = plan.pipeline(&tiny(), 8).expect("buildable");
        assert_eq!(p.schedule.kind, ScheduleKind::GPipe);
        assert_eq!(p.partition.sizes().iter().sum::<usize>(), 4);
        // The first stage recomputes all its units, the second none.
        assert_eq!(p.recompute_units, vec![p.partition.sizes()[0], 0]);
        // 8 sequences / 2 per micro-batch: every rank runs 4 forward passes.
        let forwards = |r: usize| {
            p.schedule.actions[r]
                .iter()
                .filter(|a| matches!(a, crate::pipeline::Action::Forward { .. }))
                .count()
        };
        assert_eq!((forwards(0), forwards(1)), (4, 4));
        assert!(toml::from_str::<ParallelPlan>("pipeline = 2").is_err());
    }

    #[test]
    fn plans_that_cannot_be_built_name_the_key_and_numbers() {
        let mut plan = ParallelPlan {
            pp: 2,
            stage_units: vec![1, 1, 2],
            ..ParallelPlan::default()
        };
        let e = plan.pipeline(&tiny(), 8).unwrap_err().to_string();
        assert!(
            e.contains("parallel.stage_layers has 3 entries for 2 stages"),
            "{e}"
        );
        plan.stage_units = vec![1, 2];
        let e = plan.pipeline(&tiny(), 8).unwrap_err().to_string();
        assert!(
            e.contains("parallel.stage_layers = [1, 2]") && e.contains("= 4"),
            "{e}"
        );
        plan.stage_units.clear();
        plan.stage_recompute = vec![RecomputeMode::Full];
        let e = plan.pipeline(&tiny(), 8).unwrap_err().to_string();
        assert!(
            e.contains("parallel.stage_recompute has 1 entries for 2 stages"),
            "{e}"
        );
    }

    /// A planned layout and the plan it describes carry context and sequence parallelism both
    /// ways.
    #[test]
    fn planned_layouts_carry_context_and_sequence_parallelism() {
        let model = TransformerShape::gpt(4, 64, 4, 128, 512);
        let plan = ParallelPlan {
            dp: 2,
            tp: 2,
            cp: 4,
            sequence_parallel: true,
            pp: 2,
            micro_batch: 2,
            ..ParallelPlan::default()
        };
        let pipeline = plan.pipeline(&model, 8).expect("pipeline");
        let layout = plan.planned_layout(&pipeline, 8);
        assert_eq!((layout.cp, layout.sequence_parallel), (4, true));
        assert_eq!(
            (layout.gpus(), layout.replicas(), layout.micro_batches),
            (32, 8, 2)
        );
        let back = ParallelPlan::from_planned(&layout);
        assert_eq!((back.dp, back.tp, back.cp, back.pp), (2, 2, 4, 2));
        assert!(back.sequence_parallel);
        assert!(
            back.to_string().contains("cp=4 (ring) sequence_parallel"),
            "{back}"
        );
    }

    #[test]
    fn selective_recomputation_is_per_pipeline_rank() {
        let plan = ParallelPlan {
            pp: 2,
            virtual_stages: 2,
            stage_recompute: vec![
                RecomputeMode::None,
                RecomputeMode::Selective,
                RecomputeMode::Full,
                RecomputeMode::None,
            ],
            ..ParallelPlan::default()
        };
        // Stages 0 and 2 are on rank 0, 1 and 3 on rank 1.
        assert!(!plan.selective_on_rank(0));
        assert!(plan.selective_on_rank(1));
    }
}
