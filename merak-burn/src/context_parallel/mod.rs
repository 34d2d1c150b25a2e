//! Context parallelism: each sequence is cut across the ranks of a cp group.
//!
//! - [`ZigZag`]: which tokens a rank holds (chunks `r` and `2 cp - 1 - r` of `2 cp`, for an
//!   even causal load), and cutting buffers and tensors into shards and back.

mod zigzag;

pub use zigzag::{ZigZag, ZigZagError};
