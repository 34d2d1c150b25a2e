//! What ZeRO does not yet do with a mixture of experts' state: one rule, which the trainer
//! enforces and the planner searches within.
//!
//! ZeRO at `ep = tp = 1` keeps the routed experts with the dense parameters. When the experts
//! are held apart (expert parallelism, or tensor-parallel ranks routing different tokens), ZeRO-1
//! and 2 cut the experts' buckets over the ranks holding the same experts (TP ranks included;
//! a checkpoint joins an expert's slices over them), and ZeRO-3 also gathers them over those
//! ranks. Under hybrid sharding only the first shard group writes its slices, and ZeRO-3 at
//! tp > 1 fails after a few steps (an MPI message of the wrong size): both are refused.

/// A ZeRO setting that does not yet shard a mixture of experts' state held apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertZeroLimit {
    /// Hybrid sharding (a shard group smaller than the data-parallel group).
    Hybrid,
    /// ZeRO-3 at tp > 1.
    Zero3,
}

impl ExpertZeroLimit {
    /// The limit `zero` meets, if any: `apart` when the experts are held apart from the
    /// data-parallel group (`ep > 1` or `tp > 1` on more than one rank), `tp` the
    /// tensor-parallel degree, `hybrid` under hybrid sharding.
    pub fn of(zero: u8, apart: bool, tp: usize, hybrid: bool) -> Option<Self> {
        if zero == 0 || !apart {
            None
        } else if hybrid {
            Some(Self::Hybrid)
        } else if zero == 3 && tp > 1 {
            Some(Self::Zero3)
        } else {
            None
        }
    }

    /// The configuration key to change.
    pub fn key(self) -> &'static str {
        match self {
            Self::Hybrid => "parallel.shard",
            Self::Zero3 => "parallel.zero",
        }
    }

    /// What the setting is, in words.
    pub fn what(self) -> &'static str {
        match self {
            Self::Hybrid => "hybrid sharding",
            Self::Zero3 => "ZeRO-3 at parallel.tp > 1",
        }
    }

    /// What to set instead (besides `parallel.zero = 0`).
    pub fn fix(self) -> &'static str {
        match self {
            Self::Hybrid => "parallel.shard = 0 (the whole data-parallel group)",
            Self::Zero3 => "parallel.zero = 1 or 2, or parallel.tp = 1",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_experts_held_apart_meet_a_limit() {
        use ExpertZeroLimit as L;
        assert_eq!(L::of(3, false, 1, true), None);
        assert_eq!(L::of(0, true, 2, true), None);
        assert_eq!(L::of(2, true, 2, false), None);
        assert_eq!(L::of(3, true, 1, false), None);
        assert_eq!(L::of(2, true, 1, true), Some(L::Hybrid));
        assert_eq!(L::of(3, true, 2, false), Some(L::Zero3));
    }
}
