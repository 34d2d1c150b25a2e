//! The trainer's side of a mixture of experts: which parameters are routed experts' (their
//! gradients summed over the expert group, their squares over the expert-parallel group), and
//! the step's routing statistics over the grid.

use std::collections::HashSet;

use burn::module::ParamId;
use serde::Serialize;

use crate::checkpoint::state::ParamShape;
use crate::comm::{CommError, Group, ReduceOp};
use crate::grid::ProcessGrid;
use crate::moe::{RoutingRecord, is_expert_param};

/// The routed experts' parameters among `shapes`.
pub(crate) fn expert_ids(shapes: &[ParamShape]) -> HashSet<ParamId> {
    (shapes.iter())
        .filter(|p| is_expert_param(&p.name))
        .map(|p| p.id)
        .collect()
}

/// Whether the ranks holding the same experts are not the data-parallel group: expert
/// parallelism, or TP ranks that route different tokens.
pub(crate) fn experts_apart(grid: &ProcessGrid) -> bool {
    grid.experts.size() != grid.dp.size() || grid.ep.size() > 1
}

/// The routing of one step over the whole grid: what one process would log.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoutingStats {
    /// The routers' auxiliary losses (load balancing and z-loss, weighted), summed over the
    /// layers and averaged over the micro-batches.
    pub aux_loss: f64,
    /// Assignments of the step's tokens to each expert, per MoE layer (before drops).
    pub expert_tokens: Vec<Vec<u64>>,
    /// Assignments dropped by the capacity.
    pub dropped: u64,
    /// The smallest gap between a token's `k`-th and `k + 1`-th router score over the step
    /// (how far its routing is from a tie that rounding could flip).
    pub router_margin: f64,
    /// Seconds this rank spent in the step's expert-parallel exchanges (the all-to-alls of
    /// rows and of counts, forward and backward; the rows' host copies and waiting for other
    /// ranks included).
    pub exchange_s: f64,
}

impl RoutingStats {
    /// The most loaded expert's assignments over the mean, worst layer (1: balanced).
    pub fn max_load(&self) -> f64 {
        (self.expert_tokens.iter())
            .map(|l| {
                let total: u64 = l.iter().sum();
                let mean = total as f64 / l.len().max(1) as f64;
                l.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9)
            })
            .fold(0.0, f64::max)
    }
}

/// Sums this rank's `records` of the step over the world (`layers × experts` loads).
pub(crate) fn gather_routing(
    records: Vec<RoutingRecord>,
    (layers, experts): (usize, usize),
    world: Group,
) -> Result<RoutingStats, CommError> {
    let mut buf = vec![0.0f64; 2 + layers * experts];
    for r in &records {
        buf[0] += r.aux_loss;
        buf[1] += r.dropped as f64;
        for (e, &n) in r.loads.iter().enumerate().take(experts) {
            buf[2 + r.layer * experts + e] += n as f64;
        }
    }
    let margin = records
        .iter()
        .map(|r| r.margin)
        .fold(f32::INFINITY, f32::min);
    let mut values: Vec<f32> = buf.iter().map(|&v| v as f32).collect();
    // The smallest margin, as the largest of its negation (a rank without a MoE layer: -inf).
    let mut least = [-margin.min(f32::MAX)];
    if world.size() > 1 {
        let comm = world.comm()?;
        comm.all_reduce(&mut values, ReduceOp::Sum)?;
        comm.all_reduce(&mut least, ReduceOp::Max)?;
    }
    Ok(RoutingStats {
        aux_loss: f64::from(values[0]),
        dropped: values[1] as u64,
        router_margin: f64::from(-least[0]),
        exchange_s: crate::moe::take_exchange_seconds(),
        expert_tokens: values[2..]
            .chunks(experts.max(1))
            .map(|l| l.iter().map(|&v| v as u64).collect())
            .collect(),
    })
}
