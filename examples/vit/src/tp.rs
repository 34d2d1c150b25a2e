//! Which linear layers tensor parallelism splits.

use merak_burn::prelude::*;

/// Megatron's pairs, column then row: the query, key and value projections split by output
/// features (each rank its own heads) and the output projection by input features; the MLP's
/// expansion by output features and its projection by input features. The patch projection,
/// the norms and the classifier stay whole on every rank. Suits TP degrees that divide the
/// heads and the MLP width ([`VitConfig::check_tp`](crate::VitConfig::check_tp)).
pub fn tp_plan() -> TpPlan {
    TpPlan::new([
        ("attn.wq", TpStyle::Column),
        ("attn.wk", TpStyle::Column),
        ("attn.wv", TpStyle::Column),
        ("attn.wo", TpStyle::Row),
        ("mlp.fc1", TpStyle::Column),
        ("mlp.fc2", TpStyle::Row),
    ])
}
