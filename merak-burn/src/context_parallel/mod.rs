//! Context parallelism: each sequence is cut across the ranks of a cp group, and attention,
//! the one operation that mixes tokens, runs as a ring or by all-to-all exchanges.
//!
//! - [`ZigZag`]: which tokens a rank holds (chunks `r` and `2 cp - 1 - r` of `2 cp`, for an
//!   even causal load), and cutting buffers and tensors into shards and back.
//! - [`ring_attention`]: each rank's queries against the keys and values of every rank, which
//!   travel around the ring while the blockwise partial results merge through their
//!   log-sum-exp; a Burn operation with its backward pass ([`ContextParallelBackend`]).
//! - [`ulysses_attention`]: the same result by two all-to-all exchanges (DeepSpeed-Ulysses):
//!   each rank attends over the whole sequences for `heads / cp` of the heads.
//! - [`shard_samples`]: a rank's share of a micro-batch's samples, with the global positions.
//! - [`Ring`]: the same on host `f32` buffers with a
//!   [`Communicator`](crate::comm::Communicator), what the operation runs on every backend
//!   today (CUDA would want device kernels and NCCL; a later issue).

mod host;
mod ring;
mod samples;
mod share;
mod ulysses;
mod zigzag;

pub use host::{Ring, RingError};
pub use merak_plan::context_parallel::CpAttention;
pub use ring::{ContextParallelBackend, ring_attention, ulysses_attention};
pub use samples::{ShardError, shard_samples};
pub use share::ContextShare;
pub use ulysses::{UlyssesError, UlyssesSaved, ulysses_heads_per_rank};
pub use zigzag::{ZigZag, ZigZagError};
