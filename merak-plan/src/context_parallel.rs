//! Which of the two context-parallel attentions a model runs (`parallel.cp_attention`).

use serde::{Deserialize, Serialize};

/// How the attention of context parallelism sees the other ranks' tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpAttention {
    /// Keys and values travel around the ring of the cp ranks, the blockwise results merged
    /// by their log-sum-exp (`merak_burn::context_parallel::ring_attention`): any head count,
    /// `cp - 1` exchanges of the keys and values per layer, each overlapped with a block.
    #[default]
    Ring,
    /// Two all-to-all exchanges trade the sequence for the heads (DeepSpeed-Ulysses,
    /// `merak_burn::context_parallel::ulysses_attention`): each rank attends over the whole
    /// sequences for `heads / cp` of its heads; cp must divide the heads per TP rank.
    AllToAll,
}

impl std::fmt::Display for CpAttention {
    /// `ring` or `all-to-all`, as in a config.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpAttention::Ring => "ring",
            CpAttention::AllToAll => "all-to-all",
        })
    }
}
