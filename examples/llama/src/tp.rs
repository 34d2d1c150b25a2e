//! Which linear layers tensor parallelism splits, for any degree.

use merak_burn::prelude::*;
use thiserror::Error;

use crate::LlamaConfig;

/// Which linear layers tensor parallelism splits: Megatron's pairs, column then row. With
/// grouped-query attention this suits TP degrees that divide `kv_heads`; [`tp_plan_of`] suits
/// every degree.
pub fn tp_plan() -> TpPlan {
    TpPlan::new([
        ("attn.wq", TpStyle::Column),
        ("attn.wk", TpStyle::Column),
        ("attn.wv", TpStyle::Column),
        ("attn.wo", TpStyle::Row),
        ("mlp.w1", TpStyle::Column),
        ("mlp.w3", TpStyle::Column),
        ("mlp.w2", TpStyle::Row),
    ])
}

/// A TP degree the model's heads cannot be split over.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TpLayoutError {
    /// The query heads do not split evenly.
    #[error("tp = {tp} does not divide the {heads} attention heads")]
    Heads {
        /// The TP degree.
        tp: usize,
        /// The model's query heads.
        heads: usize,
    },
    /// Neither divides the other.
    #[error(
        "tp = {tp} and kv_heads = {kv_heads}: tensor parallelism needs tp to divide kv_heads \
         (each rank holds its own key/value heads) or to be a multiple of it (the ranks \
         share each key/value head)"
    )]
    KvHeads {
        /// The TP degree.
        tp: usize,
        /// The model's key/value heads.
        kv_heads: usize,
    },
}

/// The TP plan of a decoder of shape `c`, for any TP degree: [`tp_plan`] with multi-head
/// attention; with grouped-query attention (`kv_heads < heads`) its key and value projections
/// are [`TpStyle::KvHeads`]: split by column when the degree divides `kv_heads`, shared when it
/// is a multiple of `kv_heads` (whole on every rank, each rank using the key/value head of its
/// query heads, the gradients summed over the group). Checkpoints hold full-size tensors
/// either way. A mixture of experts ([`LlamaConfig::moe`]) is not split: every TP rank holds
/// the router and the experts whole and routes every token (the inputs of the block's
/// feed-forward part are the same on every TP rank), so the plan has no MLP rules.
/// [`tp_plan_for`] checks a degree first.
pub fn tp_plan_of(c: &LlamaConfig) -> TpPlan {
    let mut plan = tp_plan();
    if c.moe.is_some() {
        plan.rules
            .retain(|(pattern, _)| !pattern.starts_with("mlp."));
    }
    if c.kv_heads != c.heads {
        for (pattern, style) in &mut plan.rules {
            if pattern == "attn.wk" || pattern == "attn.wv" {
                *style = TpStyle::KvHeads { heads: c.kv_heads };
            }
        }
    }
    plan
}

/// [`tp_plan_of`] for `tp` ranks, once `tp` is known to split the heads: it must divide
/// `heads`, and divide `kv_heads` or be a multiple of it.
pub fn tp_plan_for(c: &LlamaConfig, tp: usize) -> Result<TpPlan, TpLayoutError> {
    if tp == 0 || !c.heads.is_multiple_of(tp) {
        return Err(TpLayoutError::Heads { tp, heads: c.heads });
    }
    if !c.kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(c.kv_heads) {
        return Err(TpLayoutError::KvHeads {
            tp,
            kv_heads: c.kv_heads,
        });
    }
    Ok(tp_plan_of(c))
}
