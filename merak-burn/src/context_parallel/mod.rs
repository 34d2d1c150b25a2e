//! Context parallelism: each sequence is cut across the ranks of a cp group.
//!
//! - [`ZigZag`]: which tokens a rank holds (chunks `r` and `2 cp - 1 - r` of `2 cp`, for an
//!   even causal load), and cutting buffers and tensors into shards and back.
//! - [`Ring`]: ring attention on host `f32` buffers with a
//!   [`Communicator`](crate::comm::Communicator): each rank's queries against the keys and
//!   values of every rank, which travel around the ring while the blockwise partial results
//!   merge through their log-sum-exp, forward and backward.

mod host;
mod zigzag;

pub use host::{Ring, RingError};
pub use zigzag::{ZigZag, ZigZagError};
