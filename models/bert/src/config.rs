//! BERT shapes and presets.

use merak_burn::bounds::{Bounds, OutOfBounds, RealKey, out_of_bounds};
use merak_burn::planner::{ModelKind, TransformerShape};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The shape of a BERT model.
///
/// There is no `type_vocab_size`: the model sees a single segment and has no token-type
/// embeddings (see the crate documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BertConfig {
    /// Vocabulary size including the `[MASK]` token (GPT-2 BPE + `[MASK]`: 50,258). Need not be
    /// divisible by tp: the table is padded.
    pub vocab_size: usize,
    /// Number of encoder layers.
    pub layers: usize,
    /// Attention heads per layer.
    pub heads: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Maximum sequence length (size of the position table).
    pub seq_len: usize,
    /// Dropout probability on the embeddings and on each residual branch (0 disables it), in
    /// [0, 1): at 1 every activation would be dropped.
    #[serde(default)]
    pub dropout: f64,
    /// LayerNorm epsilon (BERT: 1e-12), in (0, 1]: it only keeps the LayerNorm of a constant
    /// row finite; above 1 it would outweigh the variance of rows of unit variance.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Standard deviation of the normal initialization of every weight matrix (BERT: 0.02), in
    /// (0, 1]: at 1 the attention's softmax is already saturated.
    #[serde(default = "default_std")]
    pub init_std: f64,
    /// The id of the `[MASK]` token, below `vocab_size` (with the GPT-2 BPE: 50,257, the id
    /// right after the BPE vocabulary).
    pub mask_token_id: usize,
}

fn default_eps() -> f64 {
    1e-12
}

fn default_std() -> f64 {
    0.02
}

/// An invalid BERT shape.
#[derive(Debug, Error, PartialEq)]
pub enum BertConfigError {
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
    /// A real-valued key outside its bounds ([`BertConfig::REAL_KEYS`]).
    #[error(transparent)]
    OutOfRange(#[from] OutOfBounds),
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
    /// The `[MASK]` id is not a token of the vocabulary.
    #[error("model.mask_token_id = {id} must be below model.vocab_size = {vocab}")]
    MaskToken {
        /// The `[MASK]` id.
        id: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The vocabulary holds nothing but `[MASK]`, so masking has no token to substitute.
    #[error("model.vocab_size = {0} leaves no token besides [MASK]; it must be at least 2")]
    VocabTooSmall(usize),
    /// An unknown preset name.
    #[error("unknown BERT preset {name:?}; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The known names.
        known: String,
    },
}

impl BertConfig {
    /// The real-valued keys and their bounds (the reasons are in the fields' docs).
    pub const REAL_KEYS: [RealKey<BertConfig>; 3] = [
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
    ];

    /// A BERT preset by name (see [`merak_burn::planner::PRESETS`]), without dropout.
    pub fn preset(name: &str) -> Result<BertConfig, BertConfigError> {
        TransformerShape::preset_of(ModelKind::Bert, name)
            .map(|s| BertConfig::from_shape(&s))
            .ok_or_else(|| BertConfigError::UnknownPreset {
                name: name.to_string(),
                known: TransformerShape::preset_names(ModelKind::Bert),
            })
    }

    /// A BERT of shape `s` whose `[MASK]` token is the last id of the vocabulary: no dropout,
    /// LayerNorm epsilon 1e-12, initialization std 0.02.
    pub fn from_shape(s: &TransformerShape) -> BertConfig {
        BertConfig {
            vocab_size: s.vocab,
            layers: s.layers,
            heads: s.heads,
            hidden: s.hidden,
            seq_len: s.seq,
            dropout: 0.0,
            layer_norm_eps: 1e-12,
            init_std: 0.02,
            mask_token_id: s.vocab - 1,
        }
    }

    /// Checks the shape (not the parallel layout; see `merak_burn::grid::Layout::validate`).
    pub fn validate(&self) -> Result<(), BertConfigError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("layers", self.layers),
            ("heads", self.heads),
            ("hidden", self.hidden),
            ("seq_len", self.seq_len),
        ] {
            if v == 0 {
                return Err(BertConfigError::Zero(name));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(BertConfigError::HeadDim {
                hidden: self.hidden,
                heads: self.heads,
            });
        }
        if let Some(e) = out_of_bounds(self, &Self::REAL_KEYS, "model.") {
            return Err(e.into());
        }
        if self.shape().checked_params().is_none() {
            return Err(BertConfigError::TooLarge {
                layers: self.layers,
                hidden: self.hidden,
                vocab: self.vocab_size,
                seq: self.seq_len,
            });
        }
        if self.mask_token_id >= self.vocab_size {
            return Err(BertConfigError::MaskToken {
                id: self.mask_token_id,
                vocab: self.vocab_size,
            });
        }
        if self.vocab_size < 2 {
            return Err(BertConfigError::VocabTooSmall(self.vocab_size));
        }
        Ok(())
    }

    /// The planner's shape of this BERT.
    pub fn shape(&self) -> TransformerShape {
        TransformerShape::bert(
            self.layers,
            self.hidden,
            self.heads,
            self.seq_len,
            self.vocab_size,
        )
    }

    /// The exact number of parameters, from the shape ([`TransformerShape::params`]:
    /// `12 l h² + 13 l h + (V + s) h + h² + 5 h`).
    pub fn num_params(&self) -> u64 {
        self.shape().params()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_report_their_size() {
        let berts = merak_burn::planner::PRESETS
            .iter()
            .filter(|p| p.1.kind == ModelKind::Bert);
        for (name, _) in berts {
            let c = BertConfig::preset(name).unwrap();
            c.validate().unwrap();
            assert_eq!(c.mask_token_id, c.vocab_size - 1);
        }
        let base = BertConfig::preset("bert-base").unwrap();
        assert_eq!(base.vocab_size, 50258);
        assert_eq!(base.mask_token_id, 50257);
        // 12·12·768² + 13·12·768 + (50258 + 512)·768 + 768² + 5·768.
        assert_eq!(base.num_params(), 124_639_488);
        assert_eq!(
            BertConfig::preset("bert-large").unwrap().num_params(),
            355_351_552
        );
    }

    #[test]
    fn an_absurd_real_value_is_refused_naming_the_key_the_value_and_the_range() {
        for (set, want) in [
            (
                (|c: &mut BertConfig| c.layer_norm_eps = 1e30) as fn(&mut BertConfig),
                "model.layer_norm_eps = 1e30 must be in (0, 1]",
            ),
            (|c| c.init_std = 0.0, "model.init_std = 0 must be in (0, 1]"),
            (|c| c.dropout = 1.0, "model.dropout = 1 must be in [0, 1)"),
        ] {
            let mut c = BertConfig::preset("tiny").unwrap();
            set(&mut c);
            assert_eq!(c.validate().unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn a_shape_of_more_than_2_pow_64_parameters_is_refused_naming_the_keys() {
        let mut c = BertConfig::preset("tiny").unwrap();
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
        let mut c = BertConfig::preset("tiny").unwrap();
        c.heads = 3;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "model.hidden = 64 is not divisible by model.heads = 3"
        );
        let mut c = BertConfig::preset("tiny").unwrap();
        c.mask_token_id = 512;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "model.mask_token_id = 512 must be below model.vocab_size = 512"
        );
        let mut c = BertConfig::preset("tiny").unwrap();
        c.vocab_size = 1;
        c.mask_token_id = 0;
        assert_eq!(c.validate().unwrap_err(), BertConfigError::VocabTooSmall(1));
        assert!(
            BertConfig::preset("nope")
                .unwrap_err()
                .to_string()
                .contains("bert-base")
        );
    }
}
