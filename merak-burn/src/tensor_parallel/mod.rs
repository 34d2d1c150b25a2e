//! Megatron-style tensor parallelism (`docs/src/concepts/tensor-parallel.md`).
//!
//! Column-parallel layers hold a slice of the output features, row-parallel layers a slice of
//! the input features followed by an all-reduce. Every shard is cut from the full-size
//! initialization a single process makes (see [`init`]), so a model built with tp = N equals
//! the model built with tp = 1. With a group of one rank the layers are plain Burn layers and
//! communicate nothing.

pub mod attention;
mod backend;
pub mod cross_entropy;
#[cfg(test)]
mod deferred_tests;
pub mod dropout;
pub mod embedding;
pub mod init;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod ops;
pub mod overlap;
pub mod sequence;
pub mod sequence_overlap;
pub mod sharding;

pub use crate::rng::InitRng;
pub use attention::{AttentionMask, AttentionWeights, ParallelSelfAttention};
pub use cross_entropy::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_unfused};
pub use dropout::ReplicatedDropout;
pub use embedding::VocabParallelEmbedding;
pub use init::{Shard, TpError};
pub use linear::{ColumnParallelLinear, RowParallelLinear, param_from_values};
pub use mlp::{MlpWeights, ParallelMlp};
pub use norm::LayerNorm;
pub use ops::{
    GradSink, HookedGrad, ParallelBackend, copy_to_tp, gather_from_sp, gather_from_tp,
    reduce_from_tp, scatter_to_sp, set_grad_sink, split_to_tp,
};
pub use overlap::TpOverlap;
pub use sequence::{HeldPositions, SeqShare, SequenceSplit, sp_param};
pub use sharding::padded_vocab;
pub(crate) use sharding::replace_split;
pub use sharding::{ParamSplits, SPLIT_CONTAINER, ShardKind, Split};
