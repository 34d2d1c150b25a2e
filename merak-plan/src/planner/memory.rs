//! The one accounting of a rank's model states: which of the weights, gradients, master
//! weights and optimizer state a rank keeps whole and which it keeps a shard of, under every
//! ZeRO stage, hybrid sharding, expert parallelism (the routed experts' own holders) and
//! context parallelism (which shards like data parallelism), in the element sizes a run keeps
//! them in ([`StateFormat`]).
//!
//! Under ZeRO-3 a rank also holds whole the parameters it has gathered ([`gathered_bytes`]):
//! the unit running and those gathered ahead, or, without resharding after the forward pass,
//! all of its own through the step.
//!
//! The planner's cost model prices its layouts with it ([`StateFormat::MIXED_ADAM`], the
//! 16-bit training the published figures use), the admission check admits a run with it and
//! every run's `memory.json` states it beside what each rank counted it kept
//! ([`StateFormat::f32`], what `merak train` keeps in fp32 and bf16 alike). The rules, with
//! `d` the ranks sharing a shard:
//!
//! | state | ZeRO 0 | ZeRO 1 | ZeRO 2 | ZeRO 3 |
//! |---|---|---|---|---|
//! | weights | whole (twice under PipeDream-2BW) | whole | whole | `1/d` |
//! | gradients | whole | whole | `1/d` reduce-scattered every micro-batch, else whole | as ZeRO 2 |
//! | master weights, optimizer state | whole | `1/d` | `1/d` | `1/d` |
//!
//! Gradients reduce-scattered once per step ([`ReduceScatter::Step`]) add up in whole buckets
//! during the step, whatever the number of micro-batches; the routed experts' gradients add
//! up whole in either mode (an expert may get no token in a micro-batch on some ranks, so its
//! bucket is reduce-scattered at the end of the step). A rank's dense states are shared by the
//! `dp x cp` ranks (or a hybrid shard group of `shard x cp`), its routed experts' by the ranks
//! that hold the same experts.
//!
//! ```
//! use merak_plan::data_parallel::ReduceScatter;
//! use merak_plan::planner::memory::{StateFormat, StateSharding, model_states};
//!
//! // 1,000 f32 parameters with AdamW at ZeRO-3 over 4 ranks, reduce-scattered every micro-batch.
//! let sharding = StateSharding {
//!     zero: 3,
//!     shard: 4,
//!     expert_shard: 4,
//!     reduce_scatter: ReduceScatter::MicroBatch,
//!     versions: 1,
//! };
//! let states = model_states(1000.0, 0.0, &sharding, &StateFormat::f32(2));
//! assert_eq!((states.params, states.grads, states.optimizer), (1000.0, 1000.0, 2000.0));
//! ```

use super::model::RankSplit;
use crate::data_parallel::ReduceScatter;

/// Bytes per parameter of each kind of state a run keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StateFormat {
    /// The weights the passes read.
    pub weight: f64,
    /// The gradients.
    pub grad: f64,
    /// A master copy of the weights the optimizer updates (0 where the weights are it).
    pub master: f64,
    /// The optimizer's state, all its tensors together (AdamW: two moments).
    pub optimizer: f64,
}

impl StateFormat {
    /// Mixed-precision training with Adam: 16-bit weights and gradients, fp32 master weights
    /// and two fp32 moments (16 bytes per parameter), what the published figures train with.
    pub const MIXED_ADAM: Self = Self {
        weight: 2.0,
        grad: 2.0,
        master: 4.0,
        optimizer: 8.0,
    };

    /// fp32 weights and gradients (no master copy) and an optimizer of `tensors` fp32 state
    /// tensors per parameter (AdamW 2, SGD with momentum 1): what `merak train` keeps, under
    /// `train.precision = "bf16"` too (it casts where it computes).
    pub fn f32(tensors: usize) -> Self {
        Self {
            weight: 4.0,
            grad: 4.0,
            master: 0.0,
            optimizer: 4.0 * tensors as f64,
        }
    }

    /// All four per parameter held whole.
    pub fn per_param(&self) -> f64 {
        self.weight + self.grad + self.master + self.optimizer
    }
}

/// How ZeRO and the parallel groups cut one rank's model states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSharding {
    /// The ZeRO stage (0 to 3).
    pub zero: u8,
    /// Ranks sharing the dense parameters' shards: `dp x cp`, or a hybrid shard group's
    /// `shard x cp`.
    pub shard: usize,
    /// Ranks sharing the routed experts' shards (the ranks holding the same experts, tensor
    /// parallel peers included: they hold their experts whole; under hybrid sharding those of
    /// one shard group).
    pub expert_shard: usize,
    /// When ZeRO-2 and 3 reduce-scatter the gradients.
    pub reduce_scatter: ReduceScatter,
    /// Weight versions kept (2 under PipeDream-2BW, else 1); ZeRO-3 keeps one shard.
    pub versions: usize,
}

impl StateSharding {
    /// ZeRO stage `zero` over `dp` data-parallel ranks, of which `shard` share one copy's
    /// shards (hybrid sharding; 0, `dp` or a value that does not divide it: all of them), with
    /// `split`'s context parallelism (sharding like data parallelism) and expert parallelism
    /// (the experts' holders are the `dp x cp / ep` ranks with the same experts and their
    /// tensor-parallel peers, under hybrid sharding those of one copy: `shard x cp / ep`),
    /// reduce-scattering per `reduce_scatter`, keeping `versions` weight versions.
    pub fn of(
        zero: u8,
        dp: usize,
        shard: usize,
        split: RankSplit,
        reduce_scatter: ReduceScatter,
        versions: usize,
    ) -> Self {
        let dp = dp.max(1);
        let copy = match shard {
            s if zero == 0 || s == 0 || s >= dp || !dp.is_multiple_of(s) => dp,
            s => s,
        };
        let cp = split.cp.max(1);
        Self {
            zero,
            shard: copy * cp,
            expert_shard: (copy * cp / split.ep.max(1)).max(1) * split.tp.max(1),
            reduce_scatter,
            versions,
        }
    }
}

/// Bytes of model states one rank keeps, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ModelStates {
    /// Weights (every version kept).
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Master weights.
    pub master: f64,
    /// Optimizer state.
    pub optimizer: f64,
}

impl ModelStates {
    /// All of them.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.master + self.optimizer
    }

    fn add(self, o: Self) -> Self {
        Self {
            params: self.params + o.params,
            grads: self.grads + o.grads,
            master: self.master + o.master,
            optimizer: self.optimizer + o.optimizer,
        }
    }
}

/// The model states of a rank holding `dense` parameters (its units' whole, tensor-parallel
/// shards and tied copies included) and `expert` routed experts' parameters, cut by
/// `sharding`, in `format`.
pub fn model_states(
    dense: f64,
    expert: f64,
    sharding: &StateSharding,
    format: &StateFormat,
) -> ModelStates {
    let dense = kept(dense, sharding.shard, sharding, format, false);
    let expert = kept(expert, sharding.expert_shard, sharding, format, true);
    dense.add(expert)
}

/// `n` parameters of one kind (routed experts' or not) whose shards `d` ranks share.
fn kept(
    n: f64,
    d: usize,
    sharding: &StateSharding,
    format: &StateFormat,
    expert: bool,
) -> ModelStates {
    let share = n / d.max(1) as f64;
    let zero = sharding.zero;
    let params = match zero {
        3 => share,
        _ => n * sharding.versions.max(1) as f64,
    };
    let chunked_grads =
        zero >= 2 && sharding.reduce_scatter == ReduceScatter::MicroBatch && !expert;
    let states = if zero >= 1 { share } else { n };
    ModelStates {
        params: params * format.weight,
        grads: if chunked_grads { share } else { n } * format.grad,
        master: states * format.master,
        optimizer: states * format.optimizer,
    }
}

/// Units ZeRO-3 gathers ahead of the one running (`parallel.prefetch`'s default), which the
/// planner assumes.
pub const GATHERED_AHEAD: usize = 1;

/// Bytes of whole parameters ZeRO-3 holds gathered beside its shards at its peak: resharding
/// after each forward pass (`reshard`), the unit running and the `ahead` units gathered
/// before they run, `largest_unit` parameters each; without, all the rank's `params` from the
/// step's first gather to the update. Zero is what ZeRO 0 to 2 gather (they hold the weights
/// whole, see [`model_states`]).
pub fn gathered_bytes(
    reshard: bool,
    ahead: usize,
    largest_unit: f64,
    params: f64,
    format: &StateFormat,
) -> f64 {
    let whole = if reshard {
        (1 + ahead) as f64 * largest_unit
    } else {
        params
    };
    whole * format.weight
}

/// `zero` over `d` ranks, dense and experts alike, one weight version: a test's sharding.
#[cfg(test)]
pub(crate) fn sharded(zero: u8, d: usize, reduce_scatter: ReduceScatter) -> StateSharding {
    StateSharding {
        zero,
        shard: d,
        expert_shard: d,
        reduce_scatter,
        versions: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes per parameter of mixed-precision Adam at `d = 8`: 16, `4 + 12/d`, `2 + 14/d`
    /// (ZeRO-2 every micro-batch, and ZeRO-3 once a step), `16/d`.
    #[test]
    fn mixed_precision_bytes_per_parameter() {
        let (step, each) = (ReduceScatter::Step, ReduceScatter::MicroBatch);
        let per = |zero, rs| {
            model_states(1.0, 0.0, &sharded(zero, 8, rs), &StateFormat::MIXED_ADAM).total()
        };
        assert_eq!(per(0, step), 16.0);
        assert_eq!(per(1, step), 4.0 + 12.0 / 8.0);
        assert_eq!(per(2, step), 4.0 + 12.0 / 8.0);
        assert_eq!(per(2, each), 2.0 + 14.0 / 8.0);
        assert_eq!(per(3, step), 2.0 + 14.0 / 8.0);
        assert_eq!(per(3, each), 16.0 / 8.0);
    }

    /// What `merak train` counts for the tiny GPT (134,912 f32 parameters, AdamW) at dp 2
    /// (`launch/tests/train.rs` checks the runs): the same numbers.
    #[test]
    fn f32_states_of_the_tiny_gpt_at_dp_2() {
        let n = 134_912.0;
        let f = StateFormat::f32(2);
        let (step, each) = (ReduceScatter::Step, ReduceScatter::MicroBatch);
        let at = |zero, rs| model_states(n, 0.0, &sharded(zero, 2, rs), &f);
        let bytes = |s: ModelStates| [s.params, s.grads, s.master, s.optimizer];
        assert_eq!(bytes(at(0, step)), [4.0 * n, 4.0 * n, 0.0, 8.0 * n]);
        assert_eq!(bytes(at(1, step)), [4.0 * n, 4.0 * n, 0.0, 4.0 * n]);
        assert_eq!(bytes(at(2, step)), [4.0 * n, 4.0 * n, 0.0, 4.0 * n]);
        assert_eq!(bytes(at(2, each)), [4.0 * n, 2.0 * n, 0.0, 4.0 * n]);
        assert_eq!(bytes(at(3, step)), [2.0 * n, 4.0 * n, 0.0, 4.0 * n]);
        assert_eq!(bytes(at(3, each)), [2.0 * n, 2.0 * n, 0.0, 4.0 * n]);
    }

    /// The routed experts' gradients add up whole even when the dense ones are
    /// reduce-scattered every micro-batch, and their shards are their holders'.
    #[test]
    fn experts_are_sharded_over_their_holders() {
        let s = StateSharding {
            zero: 3,
            shard: 4,
            expert_shard: 2,
            reduce_scatter: ReduceScatter::MicroBatch,
            versions: 1,
        };
        let e = model_states(0.0, 100.0, &s, &StateFormat::f32(2));
        assert_eq!([e.params, e.grads, e.optimizer], [200.0, 400.0, 400.0]);
        let d = model_states(100.0, 0.0, &s, &StateFormat::f32(2));
        assert_eq!([d.params, d.grads, d.optimizer], [100.0, 100.0, 200.0]);
    }

    /// The groups of a layout: hybrid shard groups with their context-parallel peers, the
    /// experts' holders with their tensor-parallel peers, within the hybrid group.
    #[test]
    fn the_groups_of_a_layout() {
        let split = RankSplit::new(2, 2, true).with_ep(2);
        let rs = ReduceScatter::Step;
        let s = StateSharding::of(1, 4, 0, split, rs, 1);
        assert_eq!((s.shard, s.expert_shard), (8, 8));
        let s = StateSharding::of(1, 4, 2, split, rs, 1);
        assert_eq!((s.shard, s.expert_shard), (4, 4));
        // Not a divisor, or no ZeRO: all of dp.
        assert_eq!(StateSharding::of(1, 4, 3, split, rs, 1).shard, 8);
        assert_eq!(StateSharding::of(0, 4, 2, split, rs, 1).shard, 8);
    }

    /// Hybrid sharding with expert parallelism shards the experts' states within the copy:
    /// dp 4, ep 2, shard 2 holds each expert on one rank of each copy (twice what sharding
    /// over both copies' two holders gave), and with tp 2 on that rank's two TP ranks.
    #[test]
    fn hybrid_sharding_shards_the_experts_within_the_copy() {
        let rs = ReduceScatter::Step;
        let split = RankSplit::new(1, 1, false).with_ep(2);
        let s = StateSharding::of(1, 4, 2, split, rs, 1);
        assert_eq!((s.shard, s.expert_shard), (2, 1));
        let whole = StateSharding::of(1, 4, 0, split, rs, 1);
        assert_eq!((whole.shard, whole.expert_shard), (4, 2));
        let f = StateFormat::f32(2);
        let e = model_states(0.0, 100.0, &s, &f);
        assert_eq!([e.params, e.grads, e.optimizer], [400.0, 400.0, 800.0]);
        let e = model_states(0.0, 100.0, &whole, &f);
        assert_eq!(e.optimizer, 400.0);
        let d = model_states(100.0, 0.0, &s, &f);
        assert_eq!(d.optimizer, 400.0);
        let tp = RankSplit::new(2, 1, true).with_ep(2);
        let s = StateSharding::of(3, 8, 4, tp, rs, 1);
        assert_eq!((s.shard, s.expert_shard), (4, 4));
        let e = model_states(0.0, 100.0, &s, &f);
        assert_eq!([e.params, e.optimizer], [100.0, 200.0]);
    }

    /// ZeRO-3 holds the unit running and the one gathered ahead whole, or without resharding
    /// every parameter of the rank.
    #[test]
    fn zero_3_gathers_units_or_everything() {
        let f = StateFormat::MIXED_ADAM;
        assert_eq!(gathered_bytes(true, GATHERED_AHEAD, 10.0, 100.0, &f), 40.0);
        assert_eq!(gathered_bytes(true, 3, 10.0, 100.0, &f), 80.0);
        assert_eq!(
            gathered_bytes(false, GATHERED_AHEAD, 10.0, 100.0, &f),
            200.0
        );
    }

    /// PipeDream-2BW keeps a second version of the weights, except under ZeRO-3.
    #[test]
    fn two_versions_of_the_weights() {
        let mut s = sharded(1, 2, ReduceScatter::Step);
        s.versions = 2;
        let m = model_states(10.0, 0.0, &s, &StateFormat::MIXED_ADAM);
        assert_eq!(m.params, 40.0);
        s.zero = 3;
        let m = model_states(10.0, 0.0, &s, &StateFormat::MIXED_ADAM);
        assert_eq!(m.params, 10.0);
    }
}
