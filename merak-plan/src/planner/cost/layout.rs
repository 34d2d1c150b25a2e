//! The [`Layout`] of a training run (its degrees, schedule, recomputation, ZeRO settings and
//! partition) and its checks against the model being costed.

use serde::{Deserialize, Serialize};

use super::{CostError, CostModel};
use crate::data_parallel::{GradientBuffers, ReduceScatter};
use crate::pipeline::{Partition, ScheduleKind};
use crate::planner::memory::StateSharding;
use crate::planner::model::{RankSplit, RecomputeMode};

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
    #[serde(
        alias = "zero1",
        deserialize_with = "crate::planner::zero_stage",
        default
    )]
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
    #[serde(default = "crate::planner::yes")]
    pub reshard_after_forward: bool,
    /// Where merak's reducer keeps a step's gradients (`parallel.gradient_buffers`; `auto`,
    /// the default, and in plan files of earlier versions): what it costs depends on the
    /// hardware's [`Runtime`](crate::planner::Runtime).
    #[serde(default)]
    pub gradient_buffers: GradientBuffers,
    /// The model's units cut into `pp * virtual_stages` stages.
    pub partition: Partition,
    /// Sub-pipelined tensor parallelism (Merak, Oases): each micro-batch's tokens are split into
    /// this many chunks inside every tensor-parallel block, so the all-reduce of chunk `i` runs
    /// while chunk `i + 1` computes. 1 (the default): no overlap.
    #[serde(default = "crate::planner::one")]
    pub tp_overlap: usize,
    /// Context-parallel degree: each sequence cut over `cp` ranks (two zigzag chunks each, the
    /// keys and values passed around a ring), folded into data parallelism for the parameters
    /// (gradients reduced and ZeRO sharded over `dp x cp` ranks). 1 (the default, and in plan
    /// files of earlier versions): none.
    #[serde(default = "crate::planner::one")]
    pub cp: usize,
    /// Sequence parallelism (tp > 1): between the tensor-parallel blocks each TP rank holds
    /// `1 / tp` of the positions (false by default, and in plan files of earlier versions).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Expert-parallel degree (a mixture of experts): each group of `ep` consecutive ranks of
    /// the `dp x cp` that hold the same parameters splits every MoE layer's routed experts
    /// (a divisor of `dp x cp` and of the experts). 1 (the default, and in plan files of
    /// earlier versions): every rank holds every expert.
    #[serde(default = "crate::planner::one")]
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

impl<'a> CostModel<'a> {
    pub(super) fn check(&self, layout: &Layout) -> Result<(), CostError> {
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

    /// Hybrid sharding: ZeRO's collectives within a copy of this many consecutive DP ranks
    /// (with their context-parallel peers), spanning `s * tp` devices; each chunk summed over
    /// the `replicas / s` copies.
    pub(super) fn shard_ranks(layout: &Layout) -> usize {
        layout.shard_degree() * layout.cp.max(1)
    }
}
