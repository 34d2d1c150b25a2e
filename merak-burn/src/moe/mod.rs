//! Mixture of experts with expert parallelism.
//!
//! A [`MoeLayer`] replaces a transformer block's MLP: a router (computed in f32) scores the
//! `E` experts for every token and picks its top `k` (ties to the lower expert index); each
//! token goes through its experts' feed-forward networks, weighted by their gates, and through
//! the shared experts if any. Routing is **dropless** by default; a capacity factor drops the
//! assignments past each expert's capacity in global token order.
//!
//! **Routing groups.** The load-balancing loss, the z-loss and the capacities are computed
//! per routing group ([`MoeConfig::balance`]): by default each sequence (its tokens, split
//! over the TP ranks under sequence parallelism and over the context-parallel ranks, are
//! counted together: the loads are all-reduced over those groups, the capacity's drop order is
//! all-gathered), so results do not depend on the layout; or each micro-batch, whose size
//! changes with the layout unless `train.micro_batch` is fixed. A layer's auxiliary loss is the
//! mean over its micro-batch's groups; each rank adds its part of it to the backward pass at
//! the layer ([`crate::expert_ops::aux`]), weighted by the micro-batch's share of the step, so
//! the step trains the mean over the global batch's groups.
//!
//! **Expert parallelism** (`parallel.ep`) is folded into data parallelism: of the `dp × cp`
//! ranks that hold a stage's dense parameters, each group of `ep` consecutive ranks splits the
//! experts (`E / ep` each). A layer sends each kept assignment's row to the rank of its expert
//! ([`crate::expert_ops::exchange()`]: an all-to-all with counts, exchanged first), computes its local experts one
//! matrix product loop each, and sends the results back; the backward pass runs both exchanges
//! in reverse. An expert's gradient is summed over the ranks holding the same expert (the
//! data-parallel reducer's expert group: every TP rank, and the `dp × cp / ep` expert-parallel
//! groups), a dense parameter's over `dp × cp` as before.
//!
//! Experts are not split by tensor parallelism: every TP rank holds its expert-parallel rank's
//! experts whole and routes its own sequence slice (sequence parallelism is required at
//! tp > 1).

pub mod config;
pub mod dispatch;
pub mod expert;
pub mod layer;
pub mod routing;

pub use crate::expert_ops::{
    ExchangeCounts, RoutingRecord, aux_scale, exchange_rows, set_aux_scale, take_exchange_seconds,
    take_records, with_aux_loss,
};
pub use config::{Balance, ExpertActivation, MoeConfig, MoeConfigError, RouterScore};
pub use expert::{Expert, ExpertInit};
pub use layer::{MoeLayer, MoePlace};

/// Whether the parameter named `name` (as checkpoints name it) is a routed expert's: held by
/// one expert-parallel rank, its gradient summed over the expert group.
pub fn is_expert_param(name: &str) -> bool {
    name.contains(".experts.")
}

#[cfg(test)]
mod tests;
