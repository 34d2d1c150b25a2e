//! What ZeRO does not yet do with a mixture of experts' state: one rule, which the trainer
//! enforces and the planner searches within.
//!
//! ZeRO at `ep = tp = 1` keeps the routed experts with the dense parameters. When the experts
//! are held apart (expert parallelism, or tensor-parallel ranks routing different tokens), ZeRO
//! cuts the experts' buckets over the ranks holding the same experts (TP ranks included; a
//! checkpoint joins an expert's slices over them), and ZeRO-3 also gathers them over those
//! ranks. Under hybrid sharding only the first shard group would write its slices: refused.

/// Whether ZeRO stage `zero` shards a mixture of experts' state: always, but under hybrid
/// sharding (`hybrid`: a shard group smaller than the data-parallel group) when the experts
/// are held apart from the data-parallel group (`apart`: `ep > 1` or `tp > 1` on more than one
/// rank).
pub fn zero_shards_experts(zero: u8, apart: bool, hybrid: bool) -> bool {
    zero == 0 || !apart || !hybrid
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hybrid_sharding_of_experts_held_apart_is_refused() {
        assert!(zero_shards_experts(3, false, true));
        assert!(zero_shards_experts(0, true, true));
        assert!(zero_shards_experts(3, true, false));
        assert!(!zero_shards_experts(2, true, true));
    }
}
