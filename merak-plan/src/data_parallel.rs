//! How data parallelism synchronises the gradients, as a plan states it: when ZeRO-2 and 3
//! reduce-scatter them ([`ReduceScatter`]) and where the reducer keeps them
//! ([`GradientBuffers`]). The reducer itself is the runtime's (`merak_burn::data_parallel`).

use serde::{Deserialize, Serialize};

/// When ZeRO-2 and 3 reduce-scatter the gradients of a step of several micro-batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReduceScatter {
    /// Once per step: the micro-batches add up in whole gradient buckets (ZeRO-1's gradient
    /// memory during the step), each bucket reduce-scattered after the last one.
    #[default]
    Step,
    /// Every micro-batch: each bucket is reduce-scattered as soon as a micro-batch's backward
    /// pass completes it, and only this rank's chunks add up (a chunk of the gradients held,
    /// `m` times the reduce-scatter traffic).
    MicroBatch,
}

impl ReduceScatter {
    /// The default of ZeRO stage `zero` (`parallel.reduce_scatter` unset): every micro-batch
    /// under ZeRO-3, whose point is to hold no whole copy of anything between its uses (as
    /// FSDP and DeepSpeed's stage 3 do); once per step otherwise (ZeRO-2's fewer collectives).
    pub fn default_for(zero: u8) -> Self {
        if zero >= 3 {
            Self::MicroBatch
        } else {
            Self::Step
        }
    }
}

impl std::fmt::Display for ReduceScatter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Step => "step",
            Self::MicroBatch => "micro-batch",
        })
    }
}

/// Where the data-parallel reducer keeps a step's gradients (`parallel.gradient_buffers`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GradientBuffers {
    /// `device` where no host bucket's overlap pays for its copies: ZeRO off and a
    /// data-parallel group of one rank or over NCCL; `host` otherwise (MPI between ranks, ZeRO).
    #[default]
    Auto,
    /// In host memory: each gradient copied there as the backward pass finishes it, into
    /// buckets whose all-reduce starts during the backward pass.
    Host,
    /// Where the backend computed them (GPU memory; on the CPU backend, its own tensors): each
    /// gradient summed over the micro-batches there, every bucket all-reduced after the
    /// backward pass (device to device under NCCL, through host memory under MPI); ZeRO stage
    /// 0 only.
    Device,
}

impl GradientBuffers {
    /// Whether the gradients stay the backend's tensors, under ZeRO stage `zero` with a
    /// data-parallel group of `ranks` ranks that communicates over NCCL or not (for `auto`:
    /// ZeRO off, and one rank or NCCL).
    pub fn on_device(self, zero: u8, ranks: usize, nccl: bool) -> bool {
        match self {
            Self::Auto => zero == 0 && (ranks == 1 || nccl),
            Self::Host => false,
            Self::Device => zero == 0,
        }
    }
}

impl std::fmt::Display for GradientBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Device => "device",
        })
    }
}

/// The sizes hybrid sharding is checked against: `shard` of the `dp` data-parallel replicas
/// share one copy of the chunks (0 or `dp`: no hybrid sharding), under ZeRO stage `zero`,
/// with `cp` context-parallel ranks per replica and expert parallelism `ep`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridSharding {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Context-parallel ranks per replica.
    pub cp: usize,
    /// Expert-parallel degree.
    pub ep: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Replicas per copy.
    pub shard: usize,
}

impl HybridSharding {
    /// Why these sizes cannot shard hybridly, naming each setting as `name` spells it (for
    /// example `parallel.dp`, or `dp` in a layout); `None` when they can, or when `shard` asks
    /// for no hybrid sharding. A copy is `shard` replicas: `shard` divides `dp`, a ZeRO stage
    /// shards within it, and it holds one copy of every expert (`ep` divides `shard x cp`).
    pub fn problem(&self, name: &dyn Fn(&'static str) -> String) -> Option<String> {
        let Self {
            dp,
            cp,
            ep,
            zero,
            shard,
        } = *self;
        if shard == 0 || shard == dp {
            return None;
        }
        if !dp.is_multiple_of(shard) {
            return Some(format!("must divide {} = {dp}", name("dp")));
        }
        if zero == 0 {
            return Some(format!(
                "hybrid sharding needs {} = 1, 2 or 3 (it is 0)",
                name("zero")
            ));
        }
        let (cp, ep) = (cp.max(1), ep.max(1));
        (!(shard * cp).is_multiple_of(ep)).then(|| {
            format!(
                "hybrid sharding needs {} = {ep} to divide it times {} = {cp}: each copy holds \
                 every expert",
                name("ep"),
                name("cp")
            )
        })
    }
}

#[cfg(test)]
mod hybrid_tests {
    use super::*;

    #[test]
    fn hybrid_sharding_needs_a_dividing_shard_a_zero_stage_and_whole_experts_per_copy() {
        let at = |shard, zero, ep| HybridSharding {
            dp: 4,
            cp: 1,
            ep,
            zero,
            shard,
        };
        let name = |f: &'static str| format!("parallel.{f}");
        for ok in [
            at(0, 0, 1),
            at(4, 0, 1),
            at(2, 1, 2),
            at(2, 3, 1),
            at(1, 2, 1),
        ] {
            assert_eq!(ok.problem(&name), None, "{ok:?}");
        }
        let says = |h: HybridSharding| h.problem(&name).expect("a problem");
        assert_eq!(says(at(3, 1, 1)), "must divide parallel.dp = 4");
        assert!(says(at(2, 0, 1)).contains("parallel.zero = 1, 2 or 3"));
        let e = says(at(2, 1, 4));
        assert!(
            e.contains("parallel.ep = 4 to divide it times parallel.cp = 1"),
            "{e}"
        );
        let cp2 = HybridSharding {
            cp: 2,
            ..at(2, 1, 4)
        };
        assert_eq!(
            cp2.problem(&name),
            None,
            "2 x 2 ranks hold the 4 expert groups"
        );
    }
}
