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

pub use merak_plan::data_parallel::{GradientBuffers, HybridSharding, ReduceScatter};
