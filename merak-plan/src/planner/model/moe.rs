//! Mixture-of-experts layers in the model proxy (issue 32): the shape of a MoE layer
//! ([`MoeShape`]), its parameter counts and its unit profile.
//!
//! A MoE block is a transformer block whose MLP is replaced by a router (`h × E`, no bias) that
//! sends each token to its `top_k` of `E` routed experts, plus `shared_experts` that every token
//! goes through (DeepSeek's), each expert an MLP of width `expert_hidden` (`f`): two matrices
//! with biases (`2 h f + f + h` parameters, GeLU) or three without (`3 h f`, SwiGLU). Per token
//! it computes the attention as a dense block does, the router and `top_k + shared_experts`
//! experts' MLPs.
//!
//! Expert parallelism (`ep`, [`RankSplit::ep`](super::RankSplit::ep)) is folded into data
//! parallelism: each group of `ep` data-parallel ranks splits the routed experts (`E / ep` per
//! rank) and exchanges tokens with two all-to-alls (dispatch, combine). Tensor parallelism does
//! not split the experts: under `tp > 1` (with sequence parallelism) every TP rank holds its EP
//! rank's experts, the shared experts and the router whole and routes its own `s / tp`
//! positions, so the MoE part of a block is counted with the terms sequence parallelism
//! divides (`act_replicated`, `memory_replicated`, `params_replicated`), the routed experts in
//! their own fields ([`UnitProfile::params_expert`], [`UnitProfile::act_expert`],
//! [`UnitProfile::expert_flops`], [`UnitProfile::a2a_elements`]).

use serde::{Deserialize, Serialize};

use super::{BYTES_16BIT, ModelSpecError, UnitProfile};

/// The default expected load of the busiest rank of an expert-parallel group over the mean
/// (`ep > 1`), in percent ([`MoeShape::imbalance_pct`], the spec's `imbalance=`): the rank
/// that holds the most-routed experts sets the pace of the all-to-all that follows, so the
/// routed experts' matrix products take this factor longer, and their activations (tokens
/// received) this factor more memory. At `ep = 1` a rank computes exactly its own tokens'
/// `top_k` choices, whatever their distribution (factor 1). The default, 120, is the value with
/// which the planner reproduces Megatron-Core's published Mixtral 8x7B row (dropless,
/// auxiliary-loss balancing with coefficient 0.01; see
/// [`MEGATRON_MOE`](crate::planner::reference::MEGATRON_MOE)), not an independent measurement.
pub const EXPERT_IMBALANCE_PCT: usize = 120;

/// [`EXPERT_IMBALANCE_PCT`] as a factor.
pub const EXPERT_IMBALANCE: f64 = EXPERT_IMBALANCE_PCT as f64 / 100.0;

/// The largest [`MoeShape::imbalance_pct`] accepted, as a factor.
const MAX_IMBALANCE: usize = 64;

/// The default stated bound on the token rows an expert-parallel rank receives, over its mean
/// share (the `tokens × top_k` rows every rank sends), that the admission check counts
/// activations for (`ep > 1`; [`MoeShape::max_load`], `model.moe.max_load`). Dropless routing
/// has no bound of its own (its worst case is every token of the group choosing this rank's
/// experts, `min(ep, experts / top_k)` times the mean); the runtime stops with an error naming
/// the layer and the counts when routing exceeds the bound.
pub const EXPERT_LOAD_BOUND: usize = 4;

/// The mixture-of-experts part of a [`TransformerShape`](super::TransformerShape).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeShape {
    /// Routed experts `E` of a MoE layer.
    pub experts: usize,
    /// Routed experts each token goes to (`k`, at most `experts`).
    pub top_k: usize,
    /// The MLP width `f` of one expert.
    pub expert_hidden: usize,
    /// Shared experts every token goes through (DeepSeek style), each of width `expert_hidden`.
    #[serde(default)]
    pub shared_experts: usize,
    /// SwiGLU experts (three matrices, no biases) instead of GeLU (two matrices with biases).
    #[serde(default)]
    pub swiglu: bool,
    /// A MoE layer every `every` layers (layers `every - 1`, `2 every - 1`, ...; 1: all).
    #[serde(default = "crate::planner::one")]
    pub every: usize,
    /// The stated bound on the rows an expert-parallel rank receives, in multiples of its mean
    /// share ([`EXPERT_LOAD_BOUND`] unless set).
    #[serde(default = "default_max_load")]
    pub max_load: usize,
    /// The expected load of the busiest expert-parallel rank over the mean, in percent (at
    /// least 100; [`EXPERT_IMBALANCE_PCT`] unless set): what the planner's time and memory
    /// assume, where `max_load` is the bound the admission check counts.
    #[serde(default = "default_imbalance_pct")]
    pub imbalance_pct: usize,
}

fn default_max_load() -> usize {
    EXPERT_LOAD_BOUND
}

fn default_imbalance_pct() -> usize {
    EXPERT_IMBALANCE_PCT
}

impl MoeShape {
    /// `experts` routed experts of width `expert_hidden`, `top_k` per token, GeLU, no shared
    /// expert, in every layer.
    pub const fn new(experts: usize, top_k: usize, expert_hidden: usize) -> Self {
        MoeShape {
            experts,
            top_k,
            expert_hidden,
            shared_experts: 0,
            swiglu: false,
            every: 1,
            max_load: EXPERT_LOAD_BOUND,
            imbalance_pct: EXPERT_IMBALANCE_PCT,
        }
    }

    /// The same with the busiest expert-parallel rank expected at `pct` percent of the mean.
    pub const fn with_imbalance_pct(self, pct: usize) -> Self {
        MoeShape {
            imbalance_pct: pct,
            ..self
        }
    }

    /// [`imbalance_pct`](Self::imbalance_pct) as a factor (at least 1).
    pub fn imbalance(&self) -> f64 {
        self.imbalance_pct.max(100) as f64 / 100.0
    }

    /// The same with `shared` shared experts.
    pub const fn with_shared(self, shared: usize) -> Self {
        MoeShape {
            shared_experts: shared,
            ..self
        }
    }

    /// The same with SwiGLU experts.
    pub const fn with_swiglu(self) -> Self {
        MoeShape {
            swiglu: true,
            ..self
        }
    }

    /// The same with a MoE layer every `every` layers.
    pub const fn with_every(self, every: usize) -> Self {
        MoeShape { every, ..self }
    }

    /// Whether layer `layer` (0-based) is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.every.max(1))
    }

    /// The MoE layers among `layers`.
    pub fn moe_layers(&self, layers: usize) -> usize {
        layers / self.every.max(1)
    }

    /// Weight matrices of one expert: 3 (SwiGLU) or 2.
    fn matrices(&self) -> u64 {
        if self.swiglu { 3 } else { 2 }
    }

    /// Parameters of one expert of a model of hidden size `h`: `3 h f` (SwiGLU) or
    /// `2 h f + f + h` (GeLU, with biases); `None` beyond 64 bits.
    pub fn checked_expert_params(&self, h: u64) -> Option<u64> {
        let f = self.expert_hidden as u64;
        let weights = h.checked_mul(f)?.checked_mul(self.matrices())?;
        if self.swiglu {
            Some(weights)
        } else {
            weights.checked_add(f)?.checked_add(h)
        }
    }

    /// Parameters of one MoE block of hidden size `h`: the attention and LayerNorms
    /// (`4 h² + 8 h`), the router (`h E`), the shared experts and `experts` routed ones (all
    /// `E` for the total, `top_k` for those a token uses); `None` beyond 64 bits.
    pub(super) fn checked_block_params(&self, h: u64, experts: usize) -> Option<u64> {
        let attention = h
            .checked_mul(h)?
            .checked_mul(4)?
            .checked_add(h.checked_mul(8)?)?;
        let router = h.checked_mul(self.experts as u64)?;
        let used = (experts as u64).checked_add(self.shared_experts as u64)?;
        let ffn = used.checked_mul(self.checked_expert_params(h)?)?;
        attention.checked_add(router)?.checked_add(ffn)
    }

    /// Checks the fields: `experts`, `top_k` and `expert_hidden` at least 1, `top_k` at most
    /// `experts`, `every` between 1 and `layers`.
    pub fn validate(&self, layers: usize) -> Result<(), ModelSpecError> {
        let rule = |field: &'static str, value: usize, rule: String| {
            Err(ModelSpecError::Moe { field, value, rule })
        };
        for (field, v) in [
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("expert_hidden", self.expert_hidden),
        ] {
            if v == 0 {
                return rule(field, 0, "must be at least 1".into());
            }
        }
        if self.top_k > self.experts {
            return rule(
                "top_k",
                self.top_k,
                format!("must be at most `experts` = {}", self.experts),
            );
        }
        if !(100..=100 * MAX_IMBALANCE).contains(&self.imbalance_pct) {
            return rule(
                "imbalance",
                self.imbalance_pct,
                format!(
                    "must be between 100 and {} (percent of the mean load)",
                    100 * MAX_IMBALANCE
                ),
            );
        }
        if self.every == 0 || self.every > layers {
            return rule(
                "moe_every",
                self.every,
                format!("must be between 1 and `layers` = {layers}"),
            );
        }
        Ok(())
    }

    /// The spec fields of this MoE part, `,experts=..,top_k=..,expert_hidden=..` and the
    /// optional ones that differ from their defaults.
    pub(super) fn spec_fields(&self) -> String {
        let mut text = format!(
            ",experts={},top_k={},expert_hidden={}",
            self.experts, self.top_k, self.expert_hidden
        );
        if self.shared_experts > 0 {
            text += &format!(",shared={}", self.shared_experts);
        }
        if self.swiglu {
            text += ",swiglu=1";
        }
        if self.every != 1 {
            text += &format!(",moe_every={}", self.every);
        }
        if self.imbalance_pct != EXPERT_IMBALANCE_PCT {
            text += &format!(",imbalance={}", self.imbalance_pct);
        }
        text
    }

    /// The unit profile of a MoE block of a model with `seq`, `hidden` and `heads` (see the
    /// [module docs](self)). Per sequence (`s` tokens, `h`, `a` heads, `E`, `k`, `f`, `S`
    /// shared experts, `M` matrices per expert):
    ///
    /// - FLOPs forward: `8 s h² + 4 s² h` (attention) `+ 2 s h E` (router) `+ (k + S) 2 M s h f`;
    ///   backward twice that; the routed part `k 2 M s h f` is also
    ///   [`expert_flops`](UnitProfile::expert_flops).
    /// - Activations (16-bit): the attention's `8 s h` split by TP and `5 a s²` scores; kept
    ///   whole by a TP rank (divided by TP under sequence parallelism): `10 s h` (LayerNorm
    ///   inputs, attention and router inputs, dropout masks), the router's fp32 probabilities
    ///   `4 s E`, the `k` expert outputs returned by the combine `2 k s h`, the shared experts'
    ///   MLPs `S s A` (`A` = `4 f` for GeLU: fc1 and GeLU outputs; `8 f` for SwiGLU: gate, up,
    ///   SiLU and product); the routed experts, [`act_expert`](UnitProfile::act_expert):
    ///   `k s (4 h + A)` (dispatched input, its MLP, its output), of which selective
    ///   recomputation recomputes the activation function's outputs,
    ///   [`act_expert_selective`](UnitProfile::act_expert_selective): `k s 4 f` (SwiGLU: SiLU
    ///   and product) or `k s 2 f` (GeLU).
    /// - All-to-all: `k s h` elements each way ([`a2a_elements`](UnitProfile::a2a_elements)).
    pub(super) fn block(&self, seq: usize, hidden: usize, heads: usize) -> UnitProfile {
        let (s, h, a) = (seq as f64, hidden as f64, heads as f64);
        let (e, k, f) = (
            self.experts as f64,
            self.top_k as f64,
            self.expert_hidden as f64,
        );
        let shared = self.shared_experts as f64;
        let hu = hidden as u64;
        // Saturating, as the dense block: a validated shape overflows none of these.
        let per_expert = self.checked_expert_params(hu).unwrap_or(u64::MAX);
        let expert_flops = 2.0 * self.matrices() as f64 * h * f;
        let routed = k * s * expert_flops;
        let forward =
            8.0 * s * h * h + 4.0 * s * s * h + 2.0 * s * h * e + shared * s * expert_flops;
        let forward = forward + routed;
        // Activation bytes per token of one expert's MLP, and the bytes its activation function
        // moves (GeLU reads and writes f values; SwiGLU reads two, writes one).
        // Of the kept bytes, those of the activation function's outputs (SiLU and the product;
        // GeLU's) that selective recomputation recomputes.
        let (ffn_act, ffn_memory, ffn_recomputed) = if self.swiglu {
            (
                4.0 * BYTES_16BIT * f,
                3.0 * BYTES_16BIT * f,
                2.0 * BYTES_16BIT * f,
            )
        } else {
            (
                2.0 * BYTES_16BIT * f,
                2.0 * BYTES_16BIT * f,
                BYTES_16BIT * f,
            )
        };
        UnitProfile {
            // QKV (3h² + 3h) and the attention's output weight.
            params_split: hu
                .saturating_mul(hu)
                .saturating_mul(4)
                .saturating_add(3 * hu),
            // The attention-output bias, two LayerNorms, the router, the shared experts.
            params_replicated: hu
                .saturating_mul(5)
                .saturating_add(hu.saturating_mul(self.experts as u64))
                .saturating_add(per_expert.saturating_mul(self.shared_experts as u64)),
            params_tied: 0,
            params_expert: per_expert.saturating_mul(self.experts as u64),
            forward_flops: forward,
            backward_flops: 2.0 * forward,
            selective_recompute_flops: 2.0 * s * s * h,
            recomputable: true,
            act_replicated: 10.0 * s * h + 4.0 * s * e + 2.0 * k * s * h + shared * s * ffn_act,
            act_split: 8.0 * s * h,
            act_attention: 5.0 * a * s * s,
            act_expert: k * s * (4.0 * h + ffn_act),
            act_expert_selective: k * s * ffn_recomputed,
            act_full: BYTES_16BIT * s * h,
            tp_forward_allreduces: 1,
            tp_backward_allreduces: 1,
            tp_allreduce_elements: s * h,
            // LayerNorms and bias-dropout-adds as a dense block (11 values of s h), the
            // experts' activation functions, the dispatch's permutation (read and write k s h)
            // and the combine (read k, write one).
            memory_replicated: BYTES_16BIT * (11.0 + 2.0 * k + (k + 1.0)) * s * h
                + (k + shared) * s * ffn_memory,
            memory_split: 0.0,
            memory_attention: BYTES_16BIT * 6.5 * a * s * s,
            attention_flops: 4.0 * s * s * h,
            kv_elements: 2.0 * s * h,
            expert_flops: routed,
            a2a_elements: k * s * h,
            ..UnitProfile::default()
        }
    }
}
