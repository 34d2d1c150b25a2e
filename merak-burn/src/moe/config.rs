//! The settings of a mixture-of-experts feed-forward block (`[model.moe]`).

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bounds::{Bounds, OutOfBounds, RealKey, out_of_bounds};

/// The experts' feed-forward network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertActivation {
    /// `fc2(gelu(fc1 x + b1)) + b2` (GPT-2's MLP at the expert's width).
    #[default]
    Gelu,
    /// `down(silu(gate x) * up x)`, no biases (Mixtral, DeepSeek, Llama).
    Swiglu,
}

/// How the router turns its logits into scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterScore {
    /// Softmax over the experts (Switch, Mixtral).
    #[default]
    Softmax,
    /// A sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// The routing group over which the balancing statistics (the Switch loss's loads and mean
/// scores, the z-loss's mean) and the capacities are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Balance {
    /// Each sequence is a group (DeepSeek-V3's sequence-wise balance): no layout splits a
    /// sequence over data-parallel ranks or micro-batches, and where tensor (sequence) or
    /// context parallelism splits its tokens the counts are summed over those ranks, so the
    /// statistics, the drops and the trained model do not depend on the layout.
    #[default]
    Sequence,
    /// Each micro-batch is a group (Switch Transformer, GShard): its statistics change with
    /// `train.micro_batch`, which by default (0) is a rank's whole share and so changes with
    /// the data-parallel and pipeline degrees.
    MicroBatch,
}

impl Balance {
    /// The config value (`"sequence"`, `"micro-batch"`).
    pub fn name(self) -> &'static str {
        match self {
            Balance::Sequence => "sequence",
            Balance::MicroBatch => "micro-batch",
        }
    }
}

/// A mixture-of-experts feed-forward block: a router picks `top_k` of `experts` feed-forward
/// networks per token; optional shared experts see every token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Routed experts `E` per MoE layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// The hidden width of one expert's feed-forward network.
    pub expert_hidden: usize,
    /// Shared experts (DeepSeek): feed-forward networks of width `expert_hidden` that every
    /// token passes through, added to the routed experts' output.
    #[serde(default)]
    pub shared_experts: usize,
    /// The experts' network.
    #[serde(default)]
    pub activation: ExpertActivation,
    /// The router's scores.
    #[serde(default)]
    pub score: RouterScore,
    /// Divide the top-k scores by their sum before weighting the experts' outputs.
    #[serde(default = "yes")]
    pub renormalize: bool,
    /// Weight of the Switch load-balancing loss `E Σ_i f_i P_i` (0: off), in [0, 1]: Switch
    /// and ST-MoE use 0.01 and DeepSeek 0.001-0.003; at 1 the balancing term (1 for a balanced
    /// router, up to E) already outweighs the language-modelling loss it serves.
    #[serde(default = "default_aux")]
    pub aux_loss: f64,
    /// Weight of the router z-loss `mean(logsumexp(logits)²)` (0: off), in [0, 1]: ST-MoE
    /// uses 0.001; above 1 the penalty on the logits' size outweighs the language-modelling
    /// loss.
    #[serde(default)]
    pub z_loss: f64,
    /// The routing group of the balancing statistics (the Switch loss, the z-loss) and of the
    /// capacities: `"sequence"`, each sequence, the same on every layout; or `"micro-batch"`,
    /// each micro-batch, which changes with the layout unless `train.micro_batch` is set.
    #[serde(default)]
    pub balance: Balance,
    /// Capacity factor: each expert takes at most `ceil(factor × tokens × top_k / E)` tokens of
    /// a routing group (`balance`), the later ones (by global token index) dropped. Absent:
    /// dropless. In (0, inf) and at most `experts / top_k`, where an expert's capacity already
    /// holds every token (typical: 1 to 2).
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    /// DeepSeek's auxiliary-loss-free balancing: every expert has a selection bias, added to
    /// its score for the top-k choice only (not to the gates), which after each step moves by
    /// this rate towards balance (`+rate` for an expert below the mean load of the layer,
    /// `-rate` above it), from the loads of the whole step, so every rank agrees; it is kept in
    /// checkpoints with the parameters (0: off). In [0, 1]: DeepSeek-V3 uses 0.001, and the
    /// scores lie in [0, 1], so a rate of 1 already moves a bias across their whole range in
    /// one step.
    #[serde(default)]
    pub bias_update_rate: f64,
    /// The stated bound on the token rows an expert-parallel rank receives in a micro-batch,
    /// in multiples of the mean (the `tokens × top_k` rows each rank sends): the memory check
    /// counts the experts' activations at it, and a dropless run whose routing exceeds it
    /// fails (exit status 1) naming the layer and the counts. Only `ep > 1` has a bound (at
    /// ep = 1 a rank computes its own rows however they are routed). A bound on memory, not
    /// part of the model: a resumed run may change it.
    #[serde(default = "default_max_load")]
    pub max_load: usize,
    /// The load the planner expects on the busiest expert-parallel rank, in percent of the
    /// mean (100 to 6400; `merak plan` and `merak simulate` time and size the experts at it):
    /// a planning input, not a bound (`max_load` is the bound). Default
    /// [`EXPERT_IMBALANCE_PCT`](crate::planner::EXPERT_IMBALANCE_PCT).
    #[serde(default = "default_imbalance_pct")]
    pub imbalance_pct: usize,
    /// A mixture of experts in every `every`-th block (blocks `every - 1`, `2 every - 1`,
    /// ...; the others keep their dense MLP); 1: every block.
    #[serde(default = "one")]
    pub every: usize,
    /// Under expert parallelism, compute the shared experts while the routed tokens travel to
    /// their experts' ranks (the forward pass's dispatch), instead of before it.
    #[serde(default = "yes")]
    pub shared_overlap: bool,
}

fn one() -> usize {
    1
}

fn default_max_load() -> usize {
    crate::planner::EXPERT_LOAD_BOUND
}

fn default_imbalance_pct() -> usize {
    crate::planner::EXPERT_IMBALANCE_PCT
}

fn yes() -> bool {
    true
}

fn default_aux() -> f64 {
    0.01
}

/// An invalid `[model.moe]` table.
#[derive(Debug, Error, PartialEq)]
pub enum MoeConfigError {
    /// A count that must be positive is zero.
    #[error("model.moe.{0} must be at least 1")]
    Zero(&'static str),
    /// More experts per token than there are.
    #[error("model.moe.top_k = {top_k} is more than model.moe.experts = {experts}")]
    TopK {
        /// Experts per token.
        top_k: usize,
        /// Experts.
        experts: usize,
    },
    /// A real-valued key outside its bounds ([`MoeConfig::REAL_KEYS`]).
    #[error(transparent)]
    OutOfRange(#[from] OutOfBounds),
    /// A capacity factor so large that an expert's capacity holds every token: none is ever
    /// dropped.
    #[error(
        "model.moe.capacity_factor = {factor} is more than model.moe.experts / model.moe.top_k \
         = {experts} / {top_k}: an expert's capacity would hold every token of its routing \
         group, so none is ever dropped; leave it unset for dropless routing"
    )]
    Capacity {
        /// The capacity factor.
        factor: f64,
        /// Experts.
        experts: usize,
        /// Experts per token.
        top_k: usize,
    },
    /// An expected imbalance below the mean or beyond 64 times it.
    #[error(
        "model.moe.imbalance_pct = {0} must be between 100 and 6400 (the load the planner \
         expects on the busiest expert-parallel rank, in percent of the mean)"
    )]
    Imbalance(usize),
    /// The expert-parallel degree does not divide the experts.
    #[error(
        "parallel.ep = {ep} does not divide model.moe.experts = {experts}: each of the ep ranks \
         holds experts / ep experts"
    )]
    Experts {
        /// The expert-parallel degree.
        ep: usize,
        /// Experts.
        experts: usize,
    },
}

impl MoeConfigError {
    /// The config key the error refuses (`model.moe.top_k`, `parallel.ep`).
    pub fn key(&self) -> String {
        let field = match self {
            MoeConfigError::Zero(name) => name,
            MoeConfigError::TopK { .. } => "top_k",
            MoeConfigError::OutOfRange(e) => return e.key.clone(),
            MoeConfigError::Capacity { .. } => "capacity_factor",
            MoeConfigError::Imbalance(_) => "imbalance_pct",
            MoeConfigError::Experts { .. } => return "parallel.ep".into(),
        };
        format!("model.moe.{field}")
    }
}

impl MoeConfig {
    /// The real-valued keys and their bounds (the reasons are in the fields' docs); the
    /// capacity factor is also at most `experts / top_k` ([`MoeConfigError::Capacity`]).
    pub const REAL_KEYS: [RealKey<MoeConfig>; 4] = [
        RealKey {
            key: "aux_loss",
            get: |c| Some(c.aux_loss),
            bounds: Bounds::closed(0.0, 1.0),
        },
        RealKey {
            key: "z_loss",
            get: |c| Some(c.z_loss),
            bounds: Bounds::closed(0.0, 1.0),
        },
        RealKey {
            key: "bias_update_rate",
            get: |c| Some(c.bias_update_rate),
            bounds: Bounds::closed(0.0, 1.0),
        },
        RealKey {
            key: "capacity_factor",
            get: |c| c.capacity_factor,
            bounds: Bounds::above(0.0, f64::INFINITY),
        },
    ];

    /// `experts` GELU experts of width `expert_hidden`, `top_k` per token, with every other key
    /// at its default (softmax, renormalized gates, dropless, Switch loss 0.01, in every
    /// block, balanced per sequence).
    pub fn new(experts: usize, top_k: usize, expert_hidden: usize) -> Self {
        Self {
            experts,
            top_k,
            expert_hidden,
            shared_experts: 0,
            activation: ExpertActivation::Gelu,
            score: RouterScore::Softmax,
            renormalize: true,
            aux_loss: default_aux(),
            z_loss: 0.0,
            balance: Balance::Sequence,
            capacity_factor: None,
            bias_update_rate: 0.0,
            max_load: default_max_load(),
            imbalance_pct: default_imbalance_pct(),
            every: 1,
            shared_overlap: true,
        }
    }

    /// Whether block `layer` (0-based) has the mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.every.max(1))
    }

    /// Checks the counts and weights (not the layout: [`MoeConfig::check_ep`]).
    pub fn validate(&self) -> Result<(), MoeConfigError> {
        for (key, v) in [
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("expert_hidden", self.expert_hidden),
            ("every", self.every),
            ("max_load", self.max_load),
        ] {
            if v == 0 {
                return Err(MoeConfigError::Zero(key));
            }
        }
        if self.top_k > self.experts {
            return Err(MoeConfigError::TopK {
                top_k: self.top_k,
                experts: self.experts,
            });
        }
        if !(100..=6400).contains(&self.imbalance_pct) {
            return Err(MoeConfigError::Imbalance(self.imbalance_pct));
        }
        if let Some(e) = out_of_bounds(self, &Self::REAL_KEYS, "model.moe.") {
            return Err(e.into());
        }
        if let Some(f) = self.capacity_factor
            && f * self.top_k as f64 > self.experts as f64
        {
            return Err(MoeConfigError::Capacity {
                factor: f,
                experts: self.experts,
                top_k: self.top_k,
            });
        }
        Ok(())
    }

    /// Checks that `ep` divides the experts.
    pub fn check_ep(&self, ep: usize) -> Result<(), MoeConfigError> {
        if ep == 0 || !self.experts.is_multiple_of(ep) {
            return Err(MoeConfigError::Experts {
                ep,
                experts: self.experts,
            });
        }
        Ok(())
    }

    /// The most tokens one expert may take of `tokens` routed tokens under the capacity factor
    /// (`ceil(factor × tokens × top_k / experts)`, never more than `tokens`); dropless: all.
    pub fn expert_limit(&self, tokens: usize) -> usize {
        let mean = tokens as f64 * self.top_k as f64 / self.experts as f64;
        let Some(factor) = self.capacity_factor else {
            return tokens;
        };
        ((factor * mean).ceil() as usize).min(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MoeConfig {
        let c: MoeConfig =
            toml::from_str("experts = 4\ntop_k = 2\nexpert_hidden = 32").expect("parses");
        assert_eq!(
            c,
            MoeConfig::new(4, 2, 32),
            "the defaults of the table and of new"
        );
        c
    }

    #[test]
    fn defaults_are_dropless_softmax_with_a_switch_loss() {
        let c = cfg();
        assert_eq!(c.capacity_factor, None);
        assert_eq!(
            (c.score, c.activation),
            (RouterScore::Softmax, ExpertActivation::Gelu)
        );
        assert!(c.renormalize && c.aux_loss == 0.01 && c.z_loss == 0.0);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.expert_limit(10), 10, "dropless");
        // 10 tokens at top-2 of 4: a mean of 5 per expert; 40 at top-2 of 64: 1.25, so 2.
        let capacity = |c: MoeConfig| MoeConfig {
            capacity_factor: Some(1.0),
            ..c
        };
        assert_eq!(capacity(cfg()).expert_limit(10), 5);
        assert_eq!(capacity(MoeConfig::new(64, 2, 8)).expert_limit(40), 2);
    }

    #[test]
    fn bad_values_name_the_key_and_the_numbers() {
        let e = MoeConfig { top_k: 5, ..cfg() }.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "model.moe.top_k = 5 is more than model.moe.experts = 4"
        );
        let e = MoeConfig {
            capacity_factor: Some(0.0),
            ..cfg()
        };
        assert!(
            e.validate()
                .unwrap_err()
                .to_string()
                .contains("capacity_factor = 0")
        );
        let e = MoeConfig {
            aux_loss: 1e30,
            ..cfg()
        };
        assert_eq!(
            e.validate().unwrap_err().to_string(),
            "model.moe.aux_loss = 1e30 must be in [0, 1]"
        );
        let e = cfg().check_ep(3).unwrap_err().to_string();
        assert!(
            e.contains("parallel.ep = 3") && e.contains("experts = 4"),
            "{e}"
        );
        let e = MoeConfig {
            imbalance_pct: 99,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key(), "model.moe.imbalance_pct");
        assert!(e.to_string().contains("imbalance_pct = 99"), "{e}");
        assert_eq!(
            MoeConfig {
                experts: 0,
                ..cfg()
            }
            .validate(),
            Err(MoeConfigError::Zero("experts"))
        );
    }
}
