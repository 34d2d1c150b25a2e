//! A model proxy measured on the real backend: for a Burn user's own model, the planner takes
//! each unit's compute from timing it (Merak's proxy-based partitioner) and its parameters from
//! counting them, instead of from GPT formulas.
//!
//! A measured unit's seconds become FLOPs at the rate of the hardware the plan is made for
//! ([`HardwareSpec::achievable_flops`]), so on that hardware the cost model predicts exactly the
//! measured time at tp = 1 and divides it by the tensor-parallel degree above. Tensor-parallel
//! all-reduces are counted from the layers' declared splits (one forward all-reduce per
//! row-parallel layer, one backward all-reduce per column-parallel layer). Activation memory
//! cannot be measured through Burn; it comes from the [`TransformerShape`] the model resembles
//! (its hidden width, heads, sequence and vocabulary), as do the sizes of the messages.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::hardware::HardwareSpec;
use super::model::{LayerCosts, TransformerShape, UnitProfile};

/// What was measured of one pipeline unit at a micro-batch of `micro_batch` sequences on one
/// rank (tp = 1).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeasuredUnit {
    /// Seconds of one forward pass.
    pub forward_s: f64,
    /// Seconds of one backward pass.
    pub backward_s: f64,
    /// Parameters its layers declare split across the TP group.
    pub params_split: u64,
    /// Parameters every TP rank holds whole.
    pub params_replicated: u64,
    /// Parameters of another unit it holds a copy of on another stage (a tied head's table).
    pub params_tied: u64,
    /// Row-parallel layers (one all-reduce each in the forward pass).
    pub row_layers: u32,
    /// Column-parallel layers (one all-reduce each in the backward pass).
    pub column_layers: u32,
    /// Of [`forward_s`](Self::forward_s), the seconds that do not grow with the micro-batch
    /// (found by timing it at two sizes, [`with_fixed_costs`]; 0: all of it grows).
    #[serde(default)]
    pub fixed_forward_s: f64,
    /// The same of [`backward_s`](Self::backward_s).
    #[serde(default)]
    pub fixed_backward_s: f64,
}

/// `at` (units timed at `b` sequences) with the part of each time that does not grow with
/// the micro-batch, from the same units timed at `small` sequences (`small_b`): a time
/// `t(n) = fixed + n x per_sequence` through both, the slope at least 0 and the fixed part
/// between 0 and the time at `b` (timing noise never makes either negative).
pub fn with_fixed_costs(
    at: Vec<MeasuredUnit>,
    b: usize,
    small: &[MeasuredUnit],
    small_b: usize,
) -> Vec<MeasuredUnit> {
    let fixed = |t_b: f64, t_s: f64| {
        if b == small_b {
            return 0.0;
        }
        let slope = ((t_b - t_s) / (b as f64 - small_b as f64)).max(0.0);
        (t_b - slope * b as f64).clamp(0.0, t_b)
    };
    (at.into_iter().zip(small))
        .map(|(u, s)| MeasuredUnit {
            fixed_forward_s: fixed(u.forward_s, s.forward_s),
            fixed_backward_s: fixed(u.backward_s, s.backward_s),
            ..u
        })
        .collect()
}

/// Measurements that do not describe the shape they are paired with.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum MeasuredError {
    /// One measurement per unit is needed.
    #[error("{measured} measured units for a model of {units} units ({shape})")]
    Units {
        /// Units measured.
        measured: usize,
        /// Units of the shape (layers + 2).
        units: usize,
        /// The shape (boxed: a MoE shape makes it large).
        shape: Box<TransformerShape>,
    },
    /// A time that is not a positive number, or a micro-batch of zero.
    #[error("unit {unit}: measured {what} = {value} is not a positive number")]
    NotPositive {
        /// The unit.
        unit: usize,
        /// Which measurement.
        what: &'static str,
        /// Its value.
        value: f64,
    },
}

/// A model proxy from measured units ([`LayerCosts`]; plan it with
/// [`ModelProxy::from_costs`](super::ModelProxy::from_costs)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredModel {
    /// The transformer the model resembles: activations, messages and heads.
    pub shape: TransformerShape,
    /// Sequences per micro-batch of the measurements.
    pub micro_batch: usize,
    /// One measurement per unit: embedding, layers, head.
    pub units: Vec<MeasuredUnit>,
    /// FLOP/s that one measured second stands for (the planned hardware's achievable rate).
    pub flops_per_s: f64,
    /// What the tensor-parallel degree must divide, when not the shape's heads: for a model
    /// whose blocks do not attend, its hidden width
    /// ([`with_tp_divisible`](Self::with_tp_divisible)).
    #[serde(default)]
    pub tp_divisible: Option<usize>,
}

impl MeasuredModel {
    /// The proxy of `units` measured at `micro_batch` sequences, for plans on `hardware`.
    /// Fails unless there is one measurement per unit of `shape` with positive times.
    pub fn new(
        shape: TransformerShape,
        micro_batch: usize,
        units: Vec<MeasuredUnit>,
        hardware: &HardwareSpec,
    ) -> Result<Self, MeasuredError> {
        if units.len() != shape.layers + 2 {
            return Err(MeasuredError::Units {
                measured: units.len(),
                units: shape.layers + 2,
                shape: Box::new(shape),
            });
        }
        let positive = |unit, what, value: f64| {
            if value > 0.0 && value.is_finite() {
                Ok(())
            } else {
                Err(MeasuredError::NotPositive { unit, what, value })
            }
        };
        positive(0, "micro_batch", micro_batch as f64)?;
        for (i, u) in units.iter().enumerate() {
            positive(i, "forward_s", u.forward_s)?;
            positive(i, "backward_s", u.backward_s)?;
        }
        Ok(Self {
            shape,
            micro_batch,
            units,
            flops_per_s: hardware.achievable_flops(),
            tp_divisible: None,
        })
    }

    /// The same proxy with the tensor-parallel degrees the search takes being the divisors of
    /// `size` instead of the shape's heads (a model whose blocks do not attend: its hidden
    /// width).
    pub fn with_tp_divisible(mut self, size: usize) -> Self {
        self.tp_divisible = Some(size);
        self
    }

    /// FLOPs per sequence that `seconds` per micro-batch stand for.
    fn flops(&self, seconds: f64) -> f64 {
        seconds / self.micro_batch as f64 * self.flops_per_s
    }
}

impl LayerCosts for MeasuredModel {
    fn name(&self) -> String {
        format!("measured model like {}", self.shape)
    }

    fn unit_profiles(&self) -> Vec<UnitProfile> {
        let like = self.shape.unit_profiles();
        (like.into_iter().zip(&self.units))
            .map(|(formula, m)| {
                // What grows with the micro-batch becomes FLOPs; the rest stays seconds.
                let forward_flops = self.flops(m.forward_s - m.fixed_forward_s);
                // Selective recomputation repeats the same share of the forward pass.
                let selective = if formula.forward_flops > 0.0 {
                    formula.selective_recompute_flops / formula.forward_flops * forward_flops
                } else {
                    0.0
                };
                UnitProfile {
                    params_split: m.params_split,
                    params_replicated: m.params_replicated,
                    params_tied: m.params_tied,
                    forward_flops,
                    backward_flops: self.flops(m.backward_s - m.fixed_backward_s),
                    selective_recompute_flops: selective,
                    tp_forward_allreduces: m.row_layers,
                    tp_backward_allreduces: m.column_layers,
                    // The measured times include the memory-bound work.
                    memory_replicated: 0.0,
                    memory_split: 0.0,
                    memory_attention: 0.0,
                    fixed_forward_s: m.fixed_forward_s,
                    fixed_backward_s: m.fixed_backward_s,
                    ..formula
                }
            })
            .collect()
    }

    fn heads(&self) -> usize {
        self.tp_divisible.unwrap_or(self.shape.heads)
    }

    fn pp_message_elements(&self) -> f64 {
        self.shape.pp_message_elements()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{CostModel, ModelProxy, RecomputeMode};

    fn shape() -> TransformerShape {
        TransformerShape::preset("tiny").expect("a preset")
    }

    fn unit(forward_s: f64) -> MeasuredUnit {
        MeasuredUnit {
            forward_s,
            backward_s: 2.0 * forward_s,
            params_split: 1000,
            params_replicated: 10,
            row_layers: 2,
            column_layers: 5,
            ..MeasuredUnit::default()
        }
    }

    #[test]
    fn measured_seconds_are_what_the_cost_model_predicts_at_tp1() {
        let hw = HardwareSpec::preset("local-cpu").expect("a preset");
        let s = shape();
        let mut units = vec![unit(0.001)];
        units.extend((0..s.layers).map(|i| unit(0.01 * (i + 1) as f64)));
        units.push(unit(0.004));
        let measured = MeasuredModel::new(s, 2, units, &hw).expect("valid");
        let proxy = ModelProxy::from_costs(&measured);
        let cm = CostModel::new(&proxy, &hw);
        for (i, u) in measured.units.iter().enumerate() {
            let terms = cm.unit_terms(i, 2, 1, 1, RecomputeMode::None, false);
            assert!((terms.forward_s - u.forward_s).abs() < 1e-12, "unit {i}");
            assert!((terms.backward_s - u.backward_s).abs() < 1e-12, "unit {i}");
            // Half the micro-batch, half the time; tp = 2 halves it again.
            let half = cm.unit_terms(i, 1, 2, 1, RecomputeMode::None, false);
            assert!(
                (half.forward_s - u.forward_s / 4.0).abs() < 1e-12,
                "unit {i}"
            );
            assert_eq!(terms.params, 1010.0);
        }
        let profiles = measured.unit_profiles();
        assert_eq!(profiles[1].tp_forward_allreduces, 2);
        assert_eq!(profiles[1].tp_backward_allreduces, 5);
    }

    /// A model whose blocks do not attend, planned by its hidden width: the search takes the
    /// tensor-parallel degrees that divide it, where the shape's one head allows only tp 1.
    #[test]
    fn a_model_without_attention_is_split_by_its_hidden_width() {
        let hw = HardwareSpec::preset("local-cpu")
            .expect("a preset")
            .with_devices(4);
        let s = TransformerShape::gpt(2, 8, 1, 16, 1);
        let plain = MeasuredModel::new(s, 2, vec![unit(0.001); 4], &hw).expect("valid");
        let tps = |m: &MeasuredModel| {
            let proxy = ModelProxy::from_costs(m);
            let cm = CostModel::new(&proxy, &hw);
            let options = crate::planner::SearchOptions::new(4, 8);
            let all = crate::planner::search::candidates(&cm, &options, hw.memory_bytes);
            let mut tps: Vec<usize> = (all.expect("candidates").iter())
                .map(|c| c.layout.tp)
                .collect();
            tps.sort_unstable();
            tps.dedup();
            (proxy.heads, tps)
        };
        assert_eq!(tps(&plain), (1, vec![1]));
        let mlp = plain.with_tp_divisible(8);
        // Every degree of 4 ranks within a node of the preset.
        let within: Vec<usize> = [1, 2, 4]
            .into_iter()
            .filter(|&tp| tp <= hw.devices_per_node)
            .collect();
        assert!(within.len() > 1, "{}", hw.devices_per_node);
        assert_eq!(tps(&mlp), (8, within));
    }

    /// Timed at 8 and 1 sequences, a unit of 2 ms + 1 ms per sequence: the cost model gives
    /// 2 + n ms at every micro-batch n (twice that backward), not 10/8 ms per sequence.
    #[test]
    fn fixed_costs_stay_per_micro_batch() {
        let hw = HardwareSpec::preset("local-cpu").expect("a preset");
        let s = shape();
        let at = |n: f64| MeasuredUnit {
            forward_s: 0.002 + 0.001 * n,
            backward_s: 2.0 * (0.002 + 0.001 * n),
            ..unit(0.0)
        };
        let units = |n| vec![at(n); s.layers + 2];
        let timed = with_fixed_costs(units(8.0), 8, &units(1.0), 1);
        assert!((timed[0].fixed_forward_s - 0.002).abs() < 1e-12);
        assert!((timed[0].fixed_backward_s - 0.004).abs() < 1e-12);
        let measured = MeasuredModel::new(s, 8, timed, &hw).expect("valid");
        let proxy = ModelProxy::from_costs(&measured);
        let cm = CostModel::new(&proxy, &hw);
        for n in [1usize, 2, 8, 16] {
            let terms = cm.unit_terms(1, n, 1, 1, RecomputeMode::None, false);
            let want = 0.002 + 0.001 * n as f64;
            assert!((terms.forward_s - want).abs() < 1e-12, "{n}");
            assert!((terms.backward_s - 2.0 * want).abs() < 1e-12, "{n}");
        }
        // Noise that would make the slope or the fixed part negative is clamped.
        let mut noisy = units(1.0);
        noisy[0].forward_s = 0.5;
        let timed = with_fixed_costs(units(8.0), 8, &noisy, 1);
        assert_eq!(timed[0].fixed_forward_s, at(8.0).forward_s);
        assert_eq!(
            with_fixed_costs(units(8.0), 8, &units(8.0), 8)[0].fixed_forward_s,
            0.0
        );
    }

    #[test]
    fn measurements_must_cover_every_unit_with_positive_times() {
        let hw = HardwareSpec::preset("local-cpu").expect("a preset");
        let e = MeasuredModel::new(shape(), 2, vec![unit(0.1)], &hw).unwrap_err();
        assert!(
            e.to_string().starts_with("1 measured units for a model of"),
            "{e}"
        );
        let mut units = vec![unit(0.1); shape().layers + 2];
        units[1].backward_s = f64::NAN;
        let e = MeasuredModel::new(shape(), 2, units, &hw).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unit 1: measured backward_s = NaN is not a positive number"
        );
    }
}
