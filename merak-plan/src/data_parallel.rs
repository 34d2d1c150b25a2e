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
