//! `[parallel]`: the layout, pipeline, recomputation, ZeRO-1 and overlap; the
//! [`ParallelPlan`] and [`PipelinePlan`] they give.

use merak_burn::context_parallel::{CpAttention, ulysses_heads_per_rank};
use merak_burn::data_parallel::{GradientBuffers, HybridSharding, ReduceScatter};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::{Recompute, RecomputeMode, ScheduleKind};
use merak_burn::tensor_parallel::TpOverlap;
use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, bad};

/// `[parallel]`: the layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Context-parallel degree: each sequence is cut into `2 cp` chunks, rank `i` of the group
    /// holding chunks `i` and `2 cp - 1 - i` (zigzag), and the attention's keys and values
    /// travel around the ring of the group. GPT and BERT; 2 cp must divide the sequence.
    pub cp: usize,
    /// How the context-parallel attention sees the other ranks' tokens: "ring" (keys and values
    /// travel around the cp ranks; any head count) or "all-to-all" (DeepSpeed-Ulysses: two
    /// all-to-alls trade the sequence for the heads; cp must divide the heads per TP rank).
    pub cp_attention: CpAttention,
    /// Expert-parallel degree (a mixture of experts, `[model.moe]`): each group of `ep`
    /// consecutive data-parallel ranks splits the experts (experts / ep each) and sends every
    /// token to its experts' ranks with an all-to-all; ep divides dp x cp and the experts.
    pub ep: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// ZeRO stage: 0 (every DP rank keeps the whole optimizer state), 1 (each DP rank keeps
    /// and updates the state of its chunk of every gradient bucket, then the new values are
    /// all-gathered), 2
    /// (the gradients are reduce-scattered too: each DP rank keeps its chunk of every gradient
    /// bucket and the optimizer state of that chunk, and the new values are all-gathered) or 3
    /// (the parameters are sharded too: each DP rank stores only its chunks, and a unit's
    /// parameters are all-gathered just before it runs, forward and again backward).
    pub zero: u8,
    /// Under ZeRO-3: units whose parameters are gathered ahead of the one running (0: none).
    pub prefetch: usize,
    /// Under ZeRO-2 and 3: "step" (the micro-batches add up in whole gradient buckets,
    /// reduce-scattered once, after the last) or "micro-batch" (each bucket reduce-scattered as
    /// soon as a micro-batch completes it, only this rank's chunks adding up: less memory, one
    /// reduce-scatter per micro-batch). Unset: "micro-batch" under ZeRO-3 (which then holds no
    /// whole gradients, as FSDP), "step" under ZeRO-2.
    pub reduce_scatter: Option<ReduceScatter>,
    /// Under ZeRO-3: true (each unit's gathered parameters freed after its forward pass and
    /// gathered again, its forward recomputed, for its backward pass) or false (the rank's
    /// parameters gathered once per step and kept until the update: nothing recomputed, the
    /// whole parameters held during the step).
    pub reshard_after_forward: bool,
    /// Hybrid sharding under ZeRO: the data-parallel ranks that share one copy's chunks (a
    /// divisor of dp; 0: all dp ranks); the dp / shard groups hold copies, and each chunk's
    /// gradient is summed over them after the reduce-scatter.
    pub shard: usize,
    /// Size of a data-parallel gradient bucket in MiB; a bucket's all-reduce starts as soon as
    /// all its gradients are final. In (0, 4096]: PyTorch uses 25; an MPI message counts at
    /// most 2^31 - 1 elements (8 GiB of f32), and a bucket of GiBs overlaps nothing.
    pub bucket_mb: f64,
    /// Where the gradients wait for their all-reduce: "host" (copied to host memory as the
    /// backward pass finishes each, buckets all-reduced during the backward pass), "device"
    /// (left where they were computed, in GPU memory on a GPU, and all-reduced after the
    /// backward pass; zero = 0 only) or "auto" (device when the data-parallel ranks are one or
    /// talk NCCL and zero = 0; host otherwise).
    pub gradient_buffers: GradientBuffers,
    /// Pipeline schedule: "gpipe", "1f1b", "interleaved", "shifted-critical-path", "2bw",
    /// "zb-h1", "zb-v" or "dualpipev" (at least 2 micro-batches per pipeline rank).
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved schedule only; 1 otherwise).
    pub virtual_stages: usize,
    /// Units per pipeline stage (the embedding counts as the first unit and the head as the
    /// last, so they sum to layers + 2); empty: balanced automatically by cost.
    pub stage_layers: Vec<usize>,
    /// Activation recomputation: "none", "full", "selective" or "stage-aware".
    pub recompute: Recompute,
    /// Recomputation per stage ("none", "selective" or "full", one per pipeline stage, as a
    /// plan from `merak plan` gives it); when set it replaces `recompute`. A pipeline rank
    /// whose stages include a selective one runs all of them with selective recomputation.
    pub stage_recompute: Vec<RecomputeMode>,
    /// Stage-aware recomputation: activation memory per stage in MiB; 0: what the last stage
    /// needs without recomputation. In [0, 1048576] (1 TiB, beyond every device's memory).
    pub memory_budget_mb: f64,
    /// Sub-pipelined tensor parallelism: token chunks per micro-batch (1: none). Each
    /// tensor-parallel all-reduce is cut into this many chunks, each overlapped with the next
    /// chunk's matrix product; it must divide micro-batch x sequence length.
    pub tp_overlap: usize,
    /// Sequence parallelism (needs tp > 1): between the tensor-parallel blocks (LayerNorms,
    /// dropout, residual adds) each TP rank holds `seq_len / tp` positions of every sequence
    /// instead of all of them; the all-reduces become reduce-scatters and all-gathers.
    pub sequence_parallel: bool,
}

impl Config {
    /// `[parallel]`: ZeRO stage, stages, recomputation and sizes consistent.
    pub(super) fn validate_parallel(&self) -> Result<(), ConfigError> {
        if self.parallel.zero > 3 {
            return bad(
                "parallel.zero",
                format!(
                    "{} is not a supported ZeRO stage (0, 1, 2 or 3)",
                    self.parallel.zero
                ),
            );
        }
        // Hybrid sharding groups ZeRO's ranks; without ZeRO it is idle (config/idle.rs).
        let p = &self.parallel;
        let hybrid = HybridSharding {
            dp: p.dp,
            cp: p.cp,
            ep: p.ep,
            zero: p.zero,
            shard: p.shard,
        };
        if let (1.., Some(reason)) = (p.zero, hybrid.problem(&|f| format!("parallel.{f}"))) {
            return bad("parallel.shard", format!("{} ({reason})", p.shard));
        }
        if self.parallel.prefetch > 8 {
            return bad(
                "parallel.prefetch",
                format!(
                    "{} units gathered ahead: at most 8 (each holds its parameters)",
                    self.parallel.prefetch
                ),
            );
        }
        if self.parallel.virtual_stages == 0 {
            return bad("parallel.virtual_stages", "must be at least 1".into());
        }
        self.validate_degrees()?;
        let stages = self.stages();
        if !self.parallel.stage_recompute.is_empty()
            && self.parallel.stage_recompute.len() != stages
        {
            return bad(
                "parallel.stage_recompute",
                format!(
                    "has {} entries for {stages} stages (parallel.pp = {} x parallel.virtual_stages = {})",
                    self.parallel.stage_recompute.len(),
                    self.parallel.pp,
                    self.parallel.virtual_stages
                ),
            );
        }
        self.validate_overlap()?;
        self.validate_context_parallel()?;
        self.validate_sequence_parallel()?;
        self.validate_experts()
    }

    /// `parallel.ep` and `[model.moe]`: ep at least 1, dividing dp x cp and the experts, and
    /// only with a mixture of experts; MoE at tp > 1 only with sequence parallelism (otherwise
    /// every TP rank would route the same tokens).
    pub(super) fn validate_experts(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        let (ep, replicas) = (p.ep, p.dp * p.cp);
        if ep == 0 {
            return bad("parallel.ep", "0: every degree must be at least 1".into());
        }
        let Some(moe) = self
            .model
            .gpt
            .moe
            .as_ref()
            .filter(|_| self.model.kind != "bert")
        else {
            if ep > 1 {
                return bad(
                    "parallel.ep",
                    format!("{ep} needs a mixture of experts ([model.moe]); this model is dense"),
                );
            }
            return Ok(());
        };
        if !replicas.is_multiple_of(ep) {
            return bad(
                "parallel.ep",
                format!(
                    "{ep} does not divide parallel.dp x parallel.cp = {} x {} = {replicas}: the \
                     expert-parallel groups are made of data-parallel ranks",
                    p.dp, p.cp
                ),
            );
        }
        if let Err(e) = moe.check_ep(ep) {
            return bad("parallel.ep", e.to_string());
        }
        if p.tp > 1 && !p.sequence_parallel {
            return bad(
                "parallel.sequence_parallel",
                format!(
                    "false, but a mixture of experts at parallel.tp = {} needs it: each TP rank \
                     routes its own part of the sequence (set parallel.sequence_parallel = true)",
                    p.tp
                ),
            );
        }
        Ok(())
    }

    /// `parallel.cp`: at least 1, and `2 cp` dividing the sequence length (the zigzag's
    /// chunks).
    pub(super) fn validate_context_parallel(&self) -> Result<(), ConfigError> {
        let (cp, seq) = (self.parallel.cp, self.model.gpt.seq_len);
        if cp == 0 {
            return bad("parallel.cp", "0: every degree must be at least 1".into());
        }
        if cp > 1 && self.parallel.cp_attention == CpAttention::AllToAll {
            let heads = self.model.gpt.heads / self.parallel.tp.max(1);
            if let Err(e) = ulysses_heads_per_rank(heads, cp) {
                return bad(
                    "parallel.cp_attention",
                    format!(
                        "\"all-to-all\": {e} (model.heads = {}, parallel.tp = {}); use \"ring\"",
                        self.model.gpt.heads, self.parallel.tp
                    ),
                );
            }
        }
        if cp > 1 && !seq.is_multiple_of(2 * cp) {
            return bad(
                "parallel.cp",
                format!(
                    "2 x parallel.cp = {} does not divide model.seq_len = {seq}: each sequence is \
                     cut into 2 cp chunks, rank i holding chunks i and 2 cp - 1 - i",
                    2 * cp
                ),
            );
        }
        Ok(())
    }

    /// `parallel.sequence_parallel`: tp > 1, and tp dividing the positions a rank holds
    /// (`seq_len / cp`).
    pub(super) fn validate_sequence_parallel(&self) -> Result<(), ConfigError> {
        // At tp = 1 the setting is idle (config/idle.rs).
        if !self.parallel.sequence_parallel || self.parallel.tp < 2 {
            return Ok(());
        }
        let (tp, cp) = (self.parallel.tp, self.parallel.cp.max(1));
        let seq = self.model.gpt.seq_len / cp;
        if !seq.is_multiple_of(tp) {
            return bad(
                "parallel.sequence_parallel",
                format!(
                    "parallel.tp = {tp} does not divide the {seq} positions of a sequence a rank \
                     holds (model.seq_len = {} / parallel.cp = {cp}): each TP rank holds 1 / tp \
                     of them",
                    self.model.gpt.seq_len
                ),
            );
        }
        let chunks = self.parallel.tp_overlap;
        if chunks > 1 && !(seq / tp).is_multiple_of(chunks) {
            return bad(
                "parallel.tp_overlap",
                format!(
                    "{chunks} chunks do not divide the {} positions a TP rank holds under \
                     parallel.sequence_parallel (model.seq_len / parallel.cp = {seq}, / \
                     parallel.tp = {tp}): choose a divisor of {}",
                    seq / tp,
                    seq / tp
                ),
            );
        }
        Ok(())
    }

    /// Products of the degrees fit in a `usize`: the ranks `dp x cp x tp x pp`, the stages
    /// `pp x virtual_stages` and the tokens `micro_batch x seq_len`.
    pub(super) fn validate_degrees(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        let products = [
            (
                "parallel.dp",
                "parallel.dp x parallel.cp x parallel.tp x parallel.pp",
                [p.dp, p.cp, p.tp, p.pp],
            ),
            (
                "parallel.virtual_stages",
                "parallel.pp x parallel.virtual_stages",
                [p.pp, self.virtual_stages(), 1, 1],
            ),
            (
                "train.micro_batch",
                "train.micro_batch x model.seq_len",
                [self.micro_batch(), self.model.gpt.seq_len, 1, 1],
            ),
        ];
        for (key, what, factors) in products {
            if factors
                .iter()
                .try_fold(1usize, |a, &f| a.checked_mul(f))
                .is_none()
            {
                return bad(key, format!("{what} = {factors:?} overflows"));
            }
        }
        Ok(())
    }

    /// Pipeline stages: `parallel.pp x` [`virtual_stages`](Self::virtual_stages) (saturating;
    /// validation refuses an overflow).
    pub fn stages(&self) -> usize {
        self.parallel.pp.saturating_mul(self.virtual_stages())
    }

    /// `parallel.tp_overlap`: at least 1 and a divisor of the tokens of a micro-batch.
    pub(super) fn validate_overlap(&self) -> Result<(), ConfigError> {
        // Under context parallelism a rank's micro-batch holds seq_len / cp positions a sequence.
        let seq = self.model.gpt.seq_len / self.parallel.cp.max(1);
        let tokens = self.micro_batch().saturating_mul(seq);
        let overlap = match TpOverlap::new(self.parallel.tp_overlap) {
            Ok(k) => k,
            Err(e) => return bad("parallel.tp_overlap", e.to_string()),
        };
        // At tp = 1 no product is cut into chunks: the setting is idle (config/idle.rs).
        if self.parallel.tp == 1 {
            return Ok(());
        }
        match overlap.check_tokens(tokens) {
            Ok(()) => Ok(()),
            Err(e) => bad(
                "parallel.tp_overlap",
                format!(
                    "{e} (train.micro_batch = {} x model.seq_len = {} / parallel.cp = {}): choose a \
                     divisor of {tokens}",
                    self.micro_batch(),
                    self.model.gpt.seq_len,
                    self.parallel.cp.max(1)
                ),
            ),
        }
    }

    /// Sequences per forward/backward pass on one rank: `train.micro_batch`, or when it is 0
    /// the rank's whole share (one micro-batch) without a pipeline, and 1 sequence (as many
    /// micro-batches as possible, the smallest bubble) with one.
    pub fn micro_batch(&self) -> usize {
        match self.train.micro_batch {
            0 if self.parallel.pp > 1 => 1,
            0 => self.train.global_batch / self.parallel.dp.max(1),
            m => m,
        }
    }

    /// Stages per pipeline rank: `parallel.virtual_stages` under the interleaved schedule,
    /// always 2 under ZB-V and DualPipeV, 1 under the others (where the key is idle:
    /// config/idle.rs).
    pub fn virtual_stages(&self) -> usize {
        match self.parallel.schedule {
            s if s.v_shaped() => 2,
            s if s.uses_virtual_stages() => self.parallel.virtual_stages,
            _ => 1,
        }
    }

    /// The run's parallel plan: `[parallel]` with the micro-batch size resolved, and the keys
    /// that are idle in this layout (config/idle.rs) at the values that take effect.
    pub fn parallel_plan(&self) -> ParallelPlan {
        let p = &self.parallel;
        let zero = p.zero;
        ParallelPlan {
            dp: p.dp,
            tp: p.tp,
            cp: p.cp,
            cp_attention: p.cp_attention,
            sequence_parallel: p.sequence_parallel && p.tp > 1,
            ep: p.ep,
            pp: p.pp,
            virtual_stages: self.virtual_stages(),
            micro_batch: self.micro_batch(),
            schedule: p.schedule,
            stage_units: match self.stages() {
                1 => Vec::new(),
                _ => p.stage_layers.clone(),
            },
            recompute: p.recompute,
            stage_recompute: p.stage_recompute.clone(),
            memory_budget_mb: p.memory_budget_mb,
            zero: p.zero,
            bucket_mb: p.bucket_mb,
            tp_overlap: if p.tp == 1 { 1 } else { p.tp_overlap },
            prefetch: p.prefetch,
            shard: if zero == 0 { 0 } else { p.shard },
            reduce_scatter: match zero {
                2 | 3 => (p.reduce_scatter).unwrap_or(ReduceScatter::default_for(zero)),
                _ => ReduceScatter::Step,
            },
            reshard_after_forward: p.reshard_after_forward || zero != 3,
            gradient_buffers: p.gradient_buffers,
        }
    }

    /// Sets the keys a plan decides (`plan_cmd::PLANNED_KEYS`: the layout, stages, schedule,
    /// recomputation per stage, the ZeRO stage, when it reduce-scatters, whether it reshards
    /// after the forward pass and its hybrid sharding, and the micro-batch size) to run `plan`; the bucket
    /// size and the recomputation policy stay the config's.
    pub fn apply_plan(&mut self, plan: &ParallelPlan) {
        let p = &mut self.parallel;
        p.dp = plan.dp;
        p.tp = plan.tp;
        p.cp = plan.cp;
        p.cp_attention = plan.cp_attention;
        p.sequence_parallel = plan.sequence_parallel;
        p.ep = plan.ep;
        p.pp = plan.pp;
        p.virtual_stages = plan.virtual_stages;
        p.schedule = plan.schedule;
        p.stage_layers = plan.stage_units.clone();
        p.stage_recompute = plan.stage_recompute.clone();
        p.zero = plan.zero;
        p.reduce_scatter = Some(plan.reduce_scatter);
        p.reshard_after_forward = plan.reshard_after_forward;
        p.shard = plan.shard;
        p.tp_overlap = plan.tp_overlap;
        self.train.micro_batch = plan.micro_batch;
    }
}
