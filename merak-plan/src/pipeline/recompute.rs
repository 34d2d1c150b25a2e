//! Activation recomputation: which activations a pipeline stage keeps between a micro-batch's
//! forward and backward pass, and which it recomputes.
//!
//! A stage keeps the activations of every micro-batch it holds *in flight* (forward done,
//! backward not yet). Under 1F1B, rank `r` of `p` holds `min(p - r, m)` of the `m` micro-batches
//! at its peak ([`in_flight_1f1b`]); under GPipe every rank holds all `m` ([`in_flight_gpipe`]).
//! [`activation_bytes_per_layer`] and [`kept_bytes_per_layer`] estimate the bytes per layer and
//! micro-batch without and with full recomputation, and [`stage_aware_recompute`] picks, per
//! stage, how many layers to recompute to fit a memory budget.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// An activation recomputation policy (`parallel.recompute` in the configuration), written
/// `"none"`, `"full"`, `"selective"` or `"stage-aware"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Recompute {
    /// Keep every activation the backward pass needs; recompute nothing. Fastest, most memory.
    #[default]
    #[serde(rename = "none")]
    None,
    /// Keep only each stage's input per micro-batch and rerun the stage's forward pass just
    /// before its backward pass. Least memory, about one extra forward pass of compute.
    #[serde(rename = "full")]
    Full,
    /// Keep the outputs of the GEMMs (the expensive part to recompute) and recompute the
    /// memory-heavy, cheap element-wise parts (attention softmax, GELU, dropout, norms) during
    /// the backward pass.
    #[serde(rename = "selective")]
    Selective,
    /// Per stage, fully recompute just enough layers to fit the memory budget given the
    /// micro-batches that stage holds in flight ([`stage_aware_recompute`]). Under 1F1B the first
    /// stages hold the most, so they recompute the most and the last stage typically none.
    #[serde(rename = "stage-aware")]
    StageAware,
}

impl Recompute {
    /// Every policy, in the order of their documentation.
    pub const ALL: [Recompute; 4] = [
        Recompute::None,
        Recompute::Full,
        Recompute::Selective,
        Recompute::StageAware,
    ];

    /// The configuration string: `"none"`, `"full"`, `"selective"` or `"stage-aware"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Full => "full",
            Recompute::Selective => "selective",
            Recompute::StageAware => "stage-aware",
        }
    }
}

impl fmt::Display for Recompute {
    /// Writes the configuration string ([`Recompute::as_str`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one stage treats its activations between forward and backward: what a [`Recompute`]
/// policy decides per stage (the planner's and a plan's per-stage setting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RecomputeMode {
    /// Keep every activation.
    #[serde(rename = "none")]
    None,
    /// Keep the GEMM outputs, recompute the attention core (scores, softmax, dropout).
    #[serde(rename = "selective")]
    Selective,
    /// Keep only each block's input; rerun the forward pass before the backward pass.
    #[serde(rename = "full")]
    Full,
}

impl RecomputeMode {
    /// All modes, from most memory to least.
    pub const ALL: [RecomputeMode; 3] = [
        RecomputeMode::None,
        RecomputeMode::Selective,
        RecomputeMode::Full,
    ];

    /// `"none"`, `"selective"` or `"full"`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecomputeMode::None => "none",
            RecomputeMode::Selective => "selective",
            RecomputeMode::Full => "full",
        }
    }
}

impl fmt::Display for RecomputeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no [`Recompute`] policy.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error(
    "unknown recompute policy {given:?}: expected one of \"none\", \"full\", \"selective\", \
     \"stage-aware\""
)]
pub struct ParseRecomputeError {
    /// The string that was given.
    pub given: String,
}

impl FromStr for Recompute {
    type Err = ParseRecomputeError;

    /// Parses exactly `"none"`, `"full"`, `"selective"` or `"stage-aware"`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Recompute::ALL
            .into_iter()
            .find(|policy| policy.as_str() == s)
            .ok_or_else(|| ParseRecomputeError {
                given: s.to_owned(),
            })
    }
}

/// How many layers each stage recomputes under [`Recompute::StageAware`].
///
/// Stage `i` holds `in_flight[i]` micro-batches and `layers[i]` layers. A layer keeps `act_bytes`
/// of activations per micro-batch without recomputation and `kept_bytes` (< `act_bytes`) with
/// full recomputation. Recomputing `k` of the stage's `L = layers[i]` layers needs
///
/// ```text
/// memory(k) = in_flight[i] * (k * kept_bytes + (L - k) * act_bytes)
/// ```
///
/// and the stage recomputes the smallest `k` in `0..=L` with `memory(k) <= budget_bytes`, or all
/// `L` layers when even that does not fit (the budget is then exceeded, which the caller can
/// report). Fewer layers recomputed means less extra compute, so this is the cheapest `k` that
/// fits.
///
/// # Panics
///
/// If `in_flight` and `layers` differ in length (one entry per stage each).
pub fn stage_aware_recompute(
    in_flight: &[usize],
    layers: &[usize],
    act_bytes: f64,
    kept_bytes: f64,
    budget_bytes: f64,
) -> Vec<usize> {
    assert_eq!(
        in_flight.len(),
        layers.len(),
        "stage_aware_recompute: {} in-flight counts but {} layer counts (one per stage each)",
        in_flight.len(),
        layers.len()
    );
    in_flight
        .iter()
        .zip(layers)
        .map(|(&held, &stage_layers)| {
            let memory = |k: usize| {
                held as f64 * (k as f64 * kept_bytes + (stage_layers - k) as f64 * act_bytes)
            };
            (0..=stage_layers)
                .find(|&k| memory(k) <= budget_bytes)
                .unwrap_or(stage_layers)
        })
        .collect()
}

/// The peak number of micro-batches pipeline rank `rank` (0-based) of `ranks` holds in flight
/// under 1F1B with `micro_batches` micro-batches: `min(p - r, m)`. The first rank holds the
/// most, the last holds one. A `rank` outside `0..ranks` holds none.
pub fn in_flight_1f1b(ranks: usize, micro_batches: usize, rank: usize) -> usize {
    ranks.saturating_sub(rank).min(micro_batches)
}

/// The peak number of micro-batches any rank holds in flight under GPipe: all `m` of them (every
/// forward pass runs before the first backward pass).
pub fn in_flight_gpipe(micro_batches: usize) -> usize {
    micro_batches
}

/// Activation bytes of one transformer layer for one micro-batch without recomputation,
/// following Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
/// Models" (2022), with tensor parallelism of degree `t` and no sequence parallelism:
///
/// ```text
/// s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * bytes_per_value / 2
/// ```
///
/// with `s = seq`, `b = micro_batch`, `h = hidden`, `a = heads`. The formula counts bytes for
/// 16-bit values (and 1-byte dropout masks), hence the scaling by `bytes_per_value / 2` (`2.0`
/// for fp16/bf16 gives the formula itself, `4.0` for fp32 doubles it). The `5as/(ht)` term is the
/// attention scores, softmax and its dropout; `24/t` the tensor-parallel parts; `10` the
/// replicated norms, residual inputs and dropout masks. `tp = 0` counts as 1.
pub fn activation_bytes_per_layer(
    seq: usize,
    micro_batch: usize,
    hidden: usize,
    heads: usize,
    tp: usize,
    bytes_per_value: f64,
) -> f64 {
    let (s, b, h, a) = (seq as f64, micro_batch as f64, hidden as f64, heads as f64);
    let t = tp.max(1) as f64;
    // s*b*h * 5as/(ht) = s*b * 5as/t: written without dividing by h, so h = 0 gives 0.
    s * b * (h * (10.0 + 24.0 / t) + 5.0 * a * s / t) * bytes_per_value / 2.0
}

/// Activation bytes one transformer layer keeps per micro-batch under full recomputation: its
/// input, `2 * s * b * h` bytes for 16-bit values, scaled by `bytes_per_value / 2` like
/// [`activation_bytes_per_layer`] (so `s * b * h * bytes_per_value`).
pub fn kept_bytes_per_layer(
    seq: usize,
    micro_batch: usize,
    hidden: usize,
    bytes_per_value: f64,
) -> f64 {
    let (s, b, h) = (seq as f64, micro_batch as f64, hidden as f64);
    2.0 * s * b * h * bytes_per_value / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_round_trip() {
        let names = ["none", "full", "selective", "stage-aware"];
        for (policy, name) in Recompute::ALL.into_iter().zip(names) {
            assert_eq!(policy.to_string(), name);
            assert_eq!(name.parse::<Recompute>().unwrap(), policy);
            let json = serde_json::to_string(&policy).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<Recompute>(&json).unwrap(), policy);
        }
        assert_eq!(Recompute::default(), Recompute::None);
        let err = "stage_aware".parse::<Recompute>().unwrap_err();
        let message = err.to_string();
        for name in names {
            assert!(message.contains(&format!("\"{name}\"")), "{message}");
        }
        assert!(message.contains("stage_aware"), "{message}");
        assert!(serde_json::from_str::<Recompute>("\"Full\"").is_err());
    }

    #[test]
    fn in_flight_counts() {
        let one_f_one_b: Vec<usize> = (0..4).map(|r| in_flight_1f1b(4, 8, r)).collect();
        assert_eq!(one_f_one_b, vec![4, 3, 2, 1]);
        let few_micro_batches: Vec<usize> = (0..4).map(|r| in_flight_1f1b(4, 2, r)).collect();
        assert_eq!(few_micro_batches, vec![2, 2, 2, 1]);
        assert_eq!(in_flight_1f1b(4, 8, 4), 0);
        assert_eq!(in_flight_gpipe(8), 8);
    }

    #[test]
    fn stage_aware_hand_computed() {
        // 4 stages of 6 layers, 1F1B with p = 4, m = 8; act 10, kept 1 per layer and
        // micro-batch; budget 60 = the last stage's need without recomputation (1 * 6 * 10).
        // Stage with f in flight: f * (60 - 9k) <= 60.
        //   f = 4: 240 - 36k <= 60 -> k >= 5     -> 5
        //   f = 3: 180 - 27k <= 60 -> k >= 4.44  -> 5
        //   f = 2: 120 - 18k <= 60 -> k >= 3.33  -> 4
        //   f = 1:  60 -  9k <= 60 -> k >= 0     -> 0
        let got = stage_aware_recompute(&[4, 3, 2, 1], &[6; 4], 10.0, 1.0, 60.0);
        assert_eq!(got, vec![5, 5, 4, 0]);
        // Budget 20: f * (60 - 9k) <= 20.
        //   f = 4: k >= 6.11, nothing fits -> all 6 (memory 24 > 20)
        //   f = 3: k >= 5.93 -> 6 (memory 18)
        //   f = 2: k >= 5.56 -> 6 (memory 12; k = 5 needs 30)
        //   f = 1: k >= 4.44 -> 5 (memory 15)
        let got = stage_aware_recompute(&[4, 3, 2, 1], &[6; 4], 10.0, 1.0, 20.0);
        assert_eq!(got, vec![6, 6, 6, 5]);
        // Far too small a budget: recompute everything everywhere.
        let got = stage_aware_recompute(&[4, 3, 2, 1], &[6; 4], 10.0, 1.0, 1.0);
        assert_eq!(got, vec![6; 4]);
        // A generous budget: nothing.
        let got = stage_aware_recompute(&[4, 3, 2, 1], &[6; 4], 10.0, 1.0, 240.0);
        assert_eq!(got, vec![0; 4]);
        // No stages, no layers, nothing in flight.
        assert!(stage_aware_recompute(&[], &[], 10.0, 1.0, 0.0).is_empty());
        assert_eq!(
            stage_aware_recompute(&[3, 0], &[0, 5], 10.0, 1.0, 0.0),
            vec![0, 0]
        );
    }

    #[test]
    fn stage_aware_is_non_increasing_under_1f1b() {
        let (act, kept) = (activation_bytes_per_layer(1024, 2, 1024, 16, 2, 2.0), 4.0e6);
        for ranks in 1..=8 {
            for micro_batches in 1..=12 {
                for layers in 1..=6 {
                    let in_flight: Vec<usize> = (0..ranks)
                        .map(|r| in_flight_1f1b(ranks, micro_batches, r))
                        .collect();
                    let per_stage = vec![layers; ranks];
                    // The last stage's need without recomputation.
                    let last_need = in_flight[ranks - 1] as f64 * layers as f64 * act;
                    for budget in [
                        0.0,
                        0.3 * last_need,
                        0.7 * last_need,
                        last_need,
                        3.0 * last_need,
                    ] {
                        let got = stage_aware_recompute(&in_flight, &per_stage, act, kept, budget);
                        assert!(
                            got.windows(2).all(|pair| pair[0] >= pair[1]),
                            "p={ranks} m={micro_batches} L={layers} budget={budget}: {got:?}"
                        );
                        if budget == last_need {
                            assert_eq!(got[ranks - 1], 0);
                        }
                        if budget == 0.0 {
                            assert_eq!(got, per_stage);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn activation_formula_values() {
        // s = 2048, b = 1, h = 4096, a = 32, t = 1, 16-bit:
        // sbh = 8_388_608; 10 + 24 + 5 * 32 * 2048 / 4096 = 114; 8_388_608 * 114 = 956_301_312.
        assert_eq!(
            activation_bytes_per_layer(2048, 1, 4096, 32, 1, 2.0),
            956_301_312.0
        );
        // t = 8: 10 + 3 + 80 / 8 = 23; 8_388_608 * 23 = 192_937_984.
        assert_eq!(
            activation_bytes_per_layer(2048, 1, 4096, 32, 8, 2.0),
            192_937_984.0
        );
        // fp32 doubles it.
        assert_eq!(
            activation_bytes_per_layer(2048, 1, 4096, 32, 8, 4.0),
            385_875_968.0
        );
        // s = 1024, b = 4, h = 1024, a = 16, t = 2: sbh = 4_194_304; 10 + 12 + 40 = 62;
        // 4_194_304 * 62 = 260_046_848.
        assert_eq!(
            activation_bytes_per_layer(1024, 4, 1024, 16, 2, 2.0),
            260_046_848.0
        );
        // tp = 0 counts as 1.
        assert_eq!(
            activation_bytes_per_layer(2048, 1, 4096, 32, 0, 2.0),
            activation_bytes_per_layer(2048, 1, 4096, 32, 1, 2.0)
        );

        // Kept: 2sbh for 16-bit values; 2 * 2048 * 1 * 4096 = 16_777_216.
        assert_eq!(kept_bytes_per_layer(2048, 1, 4096, 2.0), 16_777_216.0);
        assert_eq!(kept_bytes_per_layer(1024, 4, 1024, 4.0), 16_777_216.0);
        assert!(
            kept_bytes_per_layer(1024, 4, 1024, 2.0)
                < activation_bytes_per_layer(1024, 4, 1024, 16, 8, 2.0)
        );
    }
}
