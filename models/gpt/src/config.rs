//! GPT shapes and presets.

use merak_burn::bounds::{Bounds, OutOfBounds, RealKey, out_of_bounds};
use merak_burn::moe::{ExpertActivation, MoeConfig, MoeConfigError};
use merak_burn::planner::model::MAX_MTP_DEPTH;
use merak_burn::planner::{ModelKind, MoeShape, TransformerShape};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The shape of a GPT model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size (GPT-2: 50,257). Need not be divisible by tp: the table is padded.
    pub vocab_size: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Maximum sequence length (size of the position table).
    pub seq_len: usize,
    /// Dropout probability on the embeddings and on each residual branch (0 disables it), in
    /// [0, 1): at 1 every activation would be dropped.
    #[serde(default)]
    pub dropout: f64,
    /// LayerNorm epsilon, in (0, 1]: it only keeps the LayerNorm of a constant row finite
    /// (GPT-2: 1e-5, BERT: 1e-12); above 1 it would outweigh the variance of rows of unit
    /// variance.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Standard deviation of the normal initialization (GPT-2: 0.02), in (0, 1]: at 1 the
    /// attention's softmax is already saturated. Output projections of residual branches are
    /// scaled by `1 / sqrt(2 * layers)`.
    #[serde(default = "default_std")]
    pub init_std: f64,
    /// A mixture of experts in place of every block's MLP (`[model.moe]`; absent: dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// Multi-token prediction: extra depths after the last block, depth `k` predicting the
    /// token `k + 1` places ahead (DeepSeek-V3's MTP, [`crate::mtp`]); 0 (the default) for
    /// none, at most 8 and fewer than `seq_len`.
    #[serde(default)]
    pub mtp_depth: usize,
    /// The weight of the multi-token-prediction losses in the training loss (their mean over
    /// the depths times it), in [0, 10]; 0.1 by default (Megatron-Core's; DeepSeek-V3 trained
    /// with 0.3, then 0.1).
    #[serde(default = "default_mtp_weight")]
    pub mtp_loss_weight: f64,
}

fn default_mtp_weight() -> f64 {
    0.1
}

fn default_eps() -> f64 {
    1e-5
}

fn default_std() -> f64 {
    0.02
}

/// An invalid GPT shape.
#[derive(Debug, Error, PartialEq)]
pub enum GptConfigError {
    /// An invalid `[model.moe]` table.
    #[error(transparent)]
    Moe(#[from] MoeConfigError),
    /// A size that must be positive is zero.
    #[error("model.{0} must be at least 1")]
    Zero(&'static str),
    /// The hidden size is not a multiple of the head count.
    #[error("model.hidden = {hidden} is not divisible by model.heads = {heads}")]
    HeadDim {
        /// Hidden size.
        hidden: usize,
        /// Head count.
        heads: usize,
    },
    /// A shape whose parameter count does not fit in 64 bits.
    #[error(
        "model.layers = {layers}, model.hidden = {hidden}, model.vocab_size = {vocab} and \
         model.seq_len = {seq} make more than 2^64 parameters"
    )]
    TooLarge {
        /// Layers.
        layers: usize,
        /// Hidden size.
        hidden: usize,
        /// Vocabulary size.
        vocab: usize,
        /// Sequence length.
        seq: usize,
    },
    /// A real-valued key outside its bounds ([`GptConfig::REAL_KEYS`]).
    #[error(transparent)]
    OutOfRange(#[from] OutOfBounds),
    /// A mixture of experts every `every`-th block of a model with fewer blocks: none would
    /// have it.
    #[error(
        "model.moe.every = {every} is more than model.layers = {layers}: no block would have \
         the mixture of experts (it replaces the MLP of blocks every - 1, 2 every - 1, ...); \
         lower model.moe.every or leave out [model.moe] for a dense model"
    )]
    MoeEvery {
        /// `model.moe.every`.
        every: usize,
        /// `model.layers`.
        layers: usize,
    },
    /// An unknown preset name.
    #[error("unknown GPT preset {name:?}; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The known names.
        known: String,
    },
    /// More multi-token-prediction depths than allowed.
    #[error(
        "model.mtp_depth = {depth}: at most {most} (8, and fewer than model.seq_len = {seq}: \
         depth k predicts the token k + 1 places ahead)"
    )]
    MtpDepth {
        /// The depths asked for.
        depth: usize,
        /// The most allowed.
        most: usize,
        /// The sequence length.
        seq: usize,
    },
}

impl GptConfigError {
    /// The config key the error refuses (`model.hidden`, `model.moe.every`).
    pub fn key(&self) -> String {
        let field = match self {
            GptConfigError::Moe(e) => return e.key(),
            GptConfigError::Zero(name) => name,
            GptConfigError::HeadDim { .. } => "hidden",
            GptConfigError::TooLarge { .. } => "layers",
            GptConfigError::OutOfRange(e) => return e.key.clone(),
            GptConfigError::MoeEvery { .. } => "moe.every",
            GptConfigError::UnknownPreset { .. } => "preset",
            GptConfigError::MtpDepth { .. } => "mtp_depth",
        };
        format!("model.{field}")
    }
}

/// The names of the GPT presets (the shapes of [`merak_burn::planner::PRESETS`]).
pub fn preset_names() -> String {
    TransformerShape::preset_names(ModelKind::Gpt)
}

impl GptConfig {
    /// The real-valued keys and their bounds (the reasons are in the fields' docs).
    pub const REAL_KEYS: [RealKey<GptConfig>; 4] = [
        RealKey {
            key: "dropout",
            get: |c| Some(c.dropout),
            bounds: Bounds::below(0.0, 1.0),
        },
        RealKey {
            key: "layer_norm_eps",
            get: |c| Some(c.layer_norm_eps),
            bounds: Bounds::above(0.0, 1.0),
        },
        RealKey {
            key: "init_std",
            get: |c| Some(c.init_std),
            bounds: Bounds::above(0.0, 1.0),
        },
        RealKey {
            key: "mtp_loss_weight",
            get: |c| Some(c.mtp_loss_weight),
            bounds: Bounds::closed(0.0, 10.0),
        },
    ];

    /// A GPT preset by name (see [`merak_burn::planner::PRESETS`]), without dropout.
    pub fn preset(name: &str) -> Result<GptConfig, GptConfigError> {
        TransformerShape::preset_of(ModelKind::Gpt, name)
            .map(|s| GptConfig::from_shape(&s))
            .ok_or_else(|| GptConfigError::UnknownPreset {
                name: name.to_string(),
                known: preset_names(),
            })
    }

    /// A GPT of shape `s`: no dropout, LayerNorm epsilon 1e-5, initialization std 0.02.
    pub fn from_shape(s: &TransformerShape) -> GptConfig {
        GptConfig {
            vocab_size: s.vocab,
            layers: s.layers,
            heads: s.heads,
            hidden: s.hidden,
            seq_len: s.seq,
            dropout: 0.0,
            layer_norm_eps: 1e-5,
            init_std: 0.02,
            moe: s.moe.map(|m| MoeConfig {
                shared_experts: m.shared_experts,
                activation: match m.swiglu {
                    true => ExpertActivation::Swiglu,
                    false => ExpertActivation::Gelu,
                },
                every: m.every,
                max_load: m.max_load,
                ..MoeConfig::new(m.experts, m.top_k, m.expert_hidden)
            }),
            mtp_depth: 0,
            mtp_loss_weight: default_mtp_weight(),
        }
    }

    /// Checks the shape (not the parallel layout; see `merak_burn::grid::Layout::validate`).
    pub fn validate(&self) -> Result<(), GptConfigError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("layers", self.layers),
            ("heads", self.heads),
            ("hidden", self.hidden),
            ("seq_len", self.seq_len),
        ] {
            if v == 0 {
                return Err(GptConfigError::Zero(name));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(GptConfigError::HeadDim {
                hidden: self.hidden,
                heads: self.heads,
            });
        }
        if let Some(e) = out_of_bounds(self, &Self::REAL_KEYS, "model.") {
            return Err(e.into());
        }
        let most = MAX_MTP_DEPTH.min(self.seq_len - 1);
        if self.mtp_depth > most {
            return Err(GptConfigError::MtpDepth {
                depth: self.mtp_depth,
                most,
                seq: self.seq_len,
            });
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
            if moe.every > self.layers {
                return Err(GptConfigError::MoeEvery {
                    every: moe.every,
                    layers: self.layers,
                });
            }
        }
        if self.shape().checked_params().is_none() {
            return Err(GptConfigError::TooLarge {
                layers: self.layers,
                hidden: self.hidden,
                vocab: self.vocab_size,
                seq: self.seq_len,
            });
        }
        Ok(())
    }

    /// The planner's shape of this GPT.
    pub fn shape(&self) -> TransformerShape {
        let dense = TransformerShape::gpt(
            self.layers,
            self.hidden,
            self.heads,
            self.seq_len,
            self.vocab_size,
        );
        let shape = match &self.moe {
            Some(m) => dense.with_moe(MoeShape {
                experts: m.experts,
                top_k: m.top_k,
                expert_hidden: m.expert_hidden,
                shared_experts: m.shared_experts,
                swiglu: m.activation == ExpertActivation::Swiglu,
                every: m.every,
                max_load: m.max_load,
                imbalance_pct: m.imbalance_pct,
            }),
            None => dense,
        };
        shape.with_mtp(self.mtp_depth)
    }

    /// The exact number of parameters (without vocabulary padding), from the shape
    /// ([`TransformerShape::params`]: `12 l h² + 13 l h + (V + s) h + 2 h`, plus each
    /// multi-token-prediction depth's `14 h² + 19 h`: a block, the `[2h, h]` projection and
    /// three LayerNorms).
    pub fn num_params(&self) -> u64 {
        self.shape().params()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_parameters() {
        // Hugging Face's GPT-2 small: 124,439,808 parameters.
        assert_eq!(GptConfig::preset("gpt2").unwrap().num_params(), 124_439_808);
        // GPT-2 XL: 1,557,611,200.
        assert_eq!(
            GptConfig::preset("gpt2-xl").unwrap().num_params(),
            1_557_611_200
        );
    }

    #[test]
    fn large_presets_report_their_size() {
        let b = |n: &str| GptConfig::preset(n).unwrap().num_params() as f64 / 1e9;
        assert!((b("gpt-8.3b") - 8.3).abs() < 0.1, "{}", b("gpt-8.3b"));
        assert!((b("gpt-2.5b") - 2.5).abs() < 0.1, "{}", b("gpt-2.5b"));
        assert!((b("gpt-20b") - 20.3).abs() < 0.5, "{}", b("gpt-20b"));
        assert!((b("gpt-1.5b") - 1.56).abs() < 0.05, "{}", b("gpt-1.5b"));
        let gpts = merak_burn::planner::PRESETS
            .iter()
            .filter(|p| p.1.kind == ModelKind::Gpt);
        for (name, _) in gpts {
            let c = GptConfig::preset(name).unwrap();
            c.validate().unwrap();
        }
    }

    #[test]
    fn a_shape_of_more_than_2_pow_64_parameters_is_refused_naming_the_keys() {
        let mut c = GptConfig::preset("tiny").unwrap();
        c.hidden = 1 << 31;
        c.layers = 1 << 20;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("model.layers = 1048576") && e.contains("model.hidden = 2147483648"),
            "{e}"
        );
        c.layers = 1;
        c.hidden = 1 << 20;
        c.validate().unwrap();
    }

    #[test]
    fn bad_shapes_name_the_key() {
        let mut c = GptConfig::preset("tiny").unwrap();
        c.heads = 3;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "model.hidden = 64 is not divisible by model.heads = 3"
        );
        assert!(
            GptConfig::preset("nope")
                .unwrap_err()
                .to_string()
                .contains("tiny")
        );
        let mut c = GptConfig::preset("tiny").unwrap();
        c.layer_norm_eps = 1e30;
        let e = c.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "model.layer_norm_eps = 1e30 must be in (0, 1]"
        );
        assert_eq!(e.key(), "model.layer_norm_eps");
    }
}
