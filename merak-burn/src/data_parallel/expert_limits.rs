//! What ZeRO does not yet do with a mixture of experts' state: one rule, which the trainer
//! enforces and the planner searches within.
//!
//! ZeRO at `ep = tp = 1` keeps the routed experts with the dense parameters. When the experts
//! are held apart (expert parallelism, or tensor-parallel ranks routing different tokens), ZeRO
//! cuts the experts' buckets over the ranks holding the same experts (TP ranks included; a
//! checkpoint joins an expert's slices over them), and ZeRO-3 also gathers them over those
//! ranks. Under hybrid sharding only the first shard group would write its slices: refused.

/// A ZeRO setting that does not yet shard a mixture of experts' state held apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertZeroLimit {
    /// Hybrid sharding (a shard group smaller than the data-parallel group).
    Hybrid,
}

impl ExpertZeroLimit {
    /// The limit `zero` meets, if any: `apart` when the experts are held apart from the
    /// data-parallel group (`ep > 1` or `tp > 1` on more than one rank), `hybrid` under hybrid
    /// sharding.
    pub fn of(zero: u8, apart: bool, hybrid: bool) -> Option<Self> {
        (zero > 0 && apart && hybrid).then_some(Self::Hybrid)
    }

    /// The configuration key to change.
    pub fn key(self) -> &'static str {
        match self {
            Self::Hybrid => "parallel.shard",
        }
    }

    /// What the setting is, in words.
    pub fn what(self) -> &'static str {
        match self {
            Self::Hybrid => "hybrid sharding",
        }
    }

    /// What to set instead (besides `parallel.zero = 0`).
    pub fn fix(self) -> &'static str {
        match self {
            Self::Hybrid => "parallel.shard = 0 (the whole data-parallel group)",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_experts_held_apart_meet_a_limit() {
        use ExpertZeroLimit as L;
        assert_eq!(L::of(3, false, true), None);
        assert_eq!(L::of(0, true, true), None);
        assert_eq!(L::of(3, true, false), None);
        assert_eq!(L::of(2, true, true), Some(L::Hybrid));
    }
}
