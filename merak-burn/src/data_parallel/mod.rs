//! Data parallelism: gradients averaged over the DP group in buckets that start their
//! all-reduce as soon as they are final, overlapping the rest of the backward pass; gradient
//! accumulation over micro-batches; ZeRO's chunks and ZeRO-3's parameter shards.
//!
//! How it works: [`DataParallel::hooked`] wraps every parameter of a model in a gradient hook
//! (an identity autodiff operation). When the backward pass reaches a parameter, its hook takes
//! the gradient into its bucket's host buffer (on the CPU backend a parameter alone in its
//! bucket hands over its buffer without a copy; others are copied on the step's first
//! micro-batch and added on later ones). On the last
//! micro-batch of a step, a bucket whose parameters have all reported starts a non-blocking
//! all-reduce at once, and every later hook call progresses the ones in flight, so the
//! communication runs while the backward pass computes the remaining gradients.
//! A bucket's buffer is moved into its all-reduce and back, not copied.
//! [`DataParallel::finish`] waits for what is left and returns the averaged gradients.
//! Buckets start strictly in order, so every rank issues the collectives in the same order.
//!
//! The gradients can instead stay where the backend computed them ([`GradientBuffers`],
//! [`Collective::AllReduceOnDevice`]; on a GPU, in device memory): each parameter's gradient is
//! summed over the micro-batches there, and after the backward pass each bucket is
//! concatenated and all-reduced as one tensor (device to device under NCCL); with one
//! data-parallel rank nothing is copied at all. This is the default at one data-parallel rank
//! and under NCCL.
//!
//! Under ZeRO-2 and 3 with several micro-batches, [`ReduceScatter`] says when the buckets are
//! reduce-scattered: once per step (the default), or every micro-batch, as soon as that
//! micro-batch's backward pass completes a bucket (every rank reaches the same gradient of the
//! same backward pass, so the collectives still start in the same order).

pub mod chunks;
mod collective;
pub mod gather;
mod reducer;

pub use collective::{Collective, Sharding};
pub use gather::{Shards, all_gather_each, emptied};
pub use reducer::{DataParallel, DpStats};

use crate::comm::Communicator;

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
    /// Whether the gradients stay the backend's tensors, under ZeRO stage `zero` with the
    /// data-parallel group `dp` (for `auto`: ZeRO off, and `dp` one rank or over NCCL).
    pub fn on_device(self, zero: u8, dp: &dyn Communicator) -> bool {
        match self {
            Self::Auto => zero == 0 && (dp.size() == 1 || dp.kind() == "nccl"),
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
