//! What the optimizer adds to a step beyond its element-wise update ([`OptimizerCost`]):
//! nothing for AdamW and the other element-wise optimizers, and for Muon the Newton-Schulz
//! orthogonalization of every block's weight matrices with the communication that brings each
//! matrix together ([`MuonTerms`]).
//!
//! Muon orthogonalizes each matrix whole, in fp32 (at the hardware's achievable fp32 rate).
//! One iteration on a matrix of sides `r <= c` takes `4 r² c + 2 r³` FLOPs (the Gram matrix,
//! its square, and the product with the matrix); a transformer block's four dense matrices
//! (`h × 3h`, `h × h`, `h × 4h`, `4h × h`) average `14 h / 3` FLOPs per element per iteration,
//! a routed expert's `h × f` matrices `4 r + 2 r² / c` with `r, c` the smaller and larger of
//! `h` and `f`. A model without a transformer shape is priced as blocks of its units'
//! parameter counts with a transformer's geometry (`h = sqrt(params / 12)`).
//!
//! Where it runs, per pipeline rank (`t` tensor-parallel ranks, `s` ranks sharing a ZeRO
//! shard, `n` the matrices' elements):
//!
//! | | ZeRO 0 | ZeRO 1-3 (hybrid too) |
//! |---|---|---|
//! | orthogonalizations | every rank computes all its matrices whole | each matrix on one owner: `1/s` of them |
//! | tensor-parallel all-gather (fp32) | `(t-1)/t · 4 n` bytes | `1/s` of that (the owners') |
//! | pieces to owners and back (fp32) | none | `2 (s-1)/s² · 4 n / t` bytes |
//!
//! The routed experts are held whole (no tensor-parallel gather) and shared among the ranks
//! holding the same experts. None of it overlaps the pipeline: it is part of the optimizer's
//! time after the pipeline drains.

use serde::Serialize;

use super::{CostModel, Layout};
use crate::planner::memory::model_states;

/// The optimizer a run steps with, as the cost model prices it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum OptimizerCost {
    /// AdamW or another element-wise optimizer: a memory-bound update, nothing more.
    #[default]
    ElementWise,
    /// Muon on the blocks' weight matrices (AdamW on the rest), with `ns_steps` Newton-Schulz
    /// iterations per matrix.
    Muon {
        /// Newton-Schulz iterations per matrix and step.
        ns_steps: usize,
    },
}

/// One pipeline rank's Muon work per step ([`CostModel::muon_terms`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MuonTerms {
    /// FLOPs of the orthogonalizations this rank runs.
    pub flops: f64,
    /// Bytes this rank receives in the tensor-parallel all-gathers of split matrices.
    pub tp_gather_bytes: f64,
    /// Bytes this rank sends (and receives) taking pieces to their owners and back, under ZeRO.
    pub exchange_bytes: f64,
    /// Seconds of all of it.
    pub seconds: f64,
}

/// FLOPs per element and Newton-Schulz iteration of a transformer block's dense matrices, over
/// the hidden size: `h×3h`, `h×h`, `h×4h` and `4h×h` take `14 h³`, `6 h³`, `18 h³` and `18 h³`
/// over their `12 h²` elements, `14 h / 3` each.
const DENSE_FLOPS_PER_ELEMENT_PER_H: f64 = 14.0 / 3.0;

/// Bytes of an fp32 value: Muon's updates travel in fp32.
const F32: f64 = 4.0;

impl<'a> CostModel<'a> {
    /// The same cost model pricing the optimizer `optimizer` ([`OptimizerCost`]).
    pub fn with_optimizer(mut self, optimizer: OptimizerCost) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// The Muon work per step of a pipeline rank holding the units `units` under `layout`
    /// (zero under an element-wise optimizer; see the [module](self) for the rules).
    pub fn muon_terms(&self, layout: &Layout, units: &[usize]) -> MuonTerms {
        let OptimizerCost::Muon { ns_steps } = self.optimizer else {
            return MuonTerms::default();
        };
        let (t, ep) = (layout.tp.max(1), layout.ep.max(1));
        let (s, se) = match layout.zero {
            0 => (1, 1),
            _ => (
                Self::shard_ranks(layout),
                layout.state_sharding().expert_shard.max(1),
            ),
        };
        let Matrices {
            dense,
            dense_flops,
            expert_flops,
            ..
        } = self.muon_matrices(units, ep);
        let steps = ns_steps as f64;
        let flops = steps * (dense_flops / s as f64 + expert_flops / se as f64);
        let tp_gather_bytes = match t {
            1 => 0.0,
            _ => (t - 1) as f64 / t as f64 * F32 * dense / s as f64,
        };
        let exchange_bytes = 2.0 * (s - 1) as f64 / (s * s) as f64 * F32 * dense / t as f64;
        let rate = self.hardware.peak_flops_fp32 * self.hardware.achievable_fraction;
        let (tp_bw, tp_lat) = self.hardware.link(t);
        let (dp_bw, dp_lat) = self.hardware.link(s * t);
        let mut seconds = flops / rate.max(1.0);
        if t > 1 {
            seconds += tp_gather_bytes / tp_bw + tp_lat;
        }
        if s > 1 {
            seconds += exchange_bytes / dp_bw + 2.0 * dp_lat;
        }
        MuonTerms {
            flops,
            tp_gather_bytes,
            exchange_bytes,
            seconds,
        }
    }

    /// The matrices Muon steps among `units`, with their Newton-Schulz FLOPs per iteration
    /// (routed experts over `ep` ranks).
    fn muon_matrices(&self, units: &[usize], ep: usize) -> Matrices {
        let mut m = Matrices::default();
        let last = self.model.units.len().saturating_sub(1);
        for (i, u) in units
            .iter()
            .filter_map(|&u| Some((u, self.model.units.get(u)?)))
        {
            // The blocks' matrices, and the multi-token-prediction depths' blocks on the head
            // (their `[2h, h]` projections, whole on every rank, are left out: 1/7 of a
            // depth's matrices).
            let n = match (u.recomputable, self.model.shape) {
                (true, _) => u.params_split as f64,
                (false, Some(s)) if i == last && s.mtp_depth > 0 => {
                    let block = self.model.units.get(1).map_or(0, |b| b.params_split);
                    (s.mtp_depth as u64).saturating_mul(block) as f64
                }
                _ => continue,
            };
            let h = self
                .model
                .shape
                .map_or((n / 12.0).sqrt(), |s| s.hidden as f64);
            m.dense += n;
            m.dense_flops += DENSE_FLOPS_PER_ELEMENT_PER_H * h * n;
            let experts = if u.recomputable {
                u.params_expert as f64
            } else {
                0.0
            };
            m.expert += experts;
            m.expert_flops += self.expert_flops_per_element(h) * experts / ep as f64;
        }
        m
    }

    /// Bytes of optimizer state a rank holding `units` under `layout` keeps fewer under Muon
    /// than the element-wise optimizer's states count: one state tensor (AdamW's second
    /// moment) per element of its matrices, as the state is sharded. Zero under another
    /// optimizer.
    pub(crate) fn muon_state_saving(&self, layout: &Layout, units: &[usize]) -> f64 {
        if !matches!(self.optimizer, OptimizerCost::Muon { .. }) {
            return 0.0;
        }
        let (t, ep) = (layout.tp.max(1) as f64, layout.ep.max(1));
        let m = self.muon_matrices(units, ep);
        let sharding = layout.state_sharding();
        let per_tensor = |dense: f64, expert: f64| {
            let states = model_states(dense, expert, &sharding, &self.state_format);
            states.optimizer / 2.0
        };
        per_tensor(m.dense / t, m.expert / (ep as f64 * t))
    }

    /// FLOPs per element and iteration of a routed expert's matrices (`h × f` and `f × h`).
    fn expert_flops_per_element(&self, h: f64) -> f64 {
        let f = (self.model.shape)
            .and_then(|s| s.moe)
            .map_or(h, |m| m.expert_hidden as f64);
        let (r, c) = (h.min(f), h.max(f));
        4.0 * r + 2.0 * r * r / c.max(1.0)
    }
}

/// The matrices Muon steps on a rank ([`CostModel::muon_matrices`]).
#[derive(Clone, Copy, Debug, Default)]
struct Matrices {
    /// Elements of the dense matrices (whole, before tensor parallelism splits them).
    dense: f64,
    /// Elements of the routed experts' matrices (all experts).
    expert: f64,
    /// Newton-Schulz FLOPs per iteration of the dense matrices.
    dense_flops: f64,
    /// Newton-Schulz FLOPs per iteration of this rank's experts.
    expert_flops: f64,
}
