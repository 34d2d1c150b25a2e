//! `[model]`: the model's kind and shape; the GPT, BERT and planner shapes it gives.

use merak_burn::planner::TransformerShape;
use merak_gpt::GptConfig;
use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, bad};

/// `[model]`: which model and its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model family: "gpt" (causal LM) or "bert" (masked LM).
    pub kind: String,
    /// BERT only: the id of the [MASK] token; 0 means the last id (`vocab_size - 1`).
    pub mask_token_id: usize,
    /// A preset name (`merak models` lists them) giving the shape; the keys below override it.
    /// Empty: the keys below are the whole shape.
    pub preset: String,
    /// The shape.
    #[serde(flatten)]
    pub gpt: GptConfig,
}

impl Config {
    /// `[model]`: a known kind and a consistent shape.
    pub(super) fn validate_model(&self) -> Result<(), ConfigError> {
        match self.model.kind.as_str() {
            "gpt" => {}
            "bert" if self.model.gpt.moe.is_some() => {
                return bad(
                    "model.moe",
                    "a mixture of experts is built for GPT models only (model.kind = \"gpt\")"
                        .into(),
                );
            }
            "bert" if self.model.gpt.mtp_depth > 0 => {
                return bad(
                    "model.mtp_depth",
                    "multi-token prediction is built for GPT models only (model.kind = \"gpt\")"
                        .into(),
                );
            }
            "bert" => {
                if let Err(e) = self.bert().validate() {
                    return bad("model", e.to_string());
                }
            }
            other => {
                return bad(
                    "model.kind",
                    format!("`{other}` is not a known model (known: gpt, bert)"),
                );
            }
        }
        if let Err(e) = self.model.gpt.validate() {
            return bad(&e.key(), e.to_string());
        }
        Ok(())
    }

    /// Why this config's mixture of experts, balanced per micro-batch
    /// (`model.moe.balance = "micro-batch"`), trains another model under another layout: its
    /// micro-batch was not fixed by the user (`from_layout`: `train.micro_batch = 0`, a rank's
    /// whole share, or chosen by a plan). `None` when the balancing does not depend on the
    /// layout. Rank 0 warns with it before training.
    pub fn layout_dependent_balance(&self, from_layout: bool) -> Option<String> {
        let moe = self.model.gpt.moe.as_ref()?;
        if moe.balance != merak_burn::moe::Balance::MicroBatch || !from_layout {
            return None;
        }
        Some(format!(
            "model.moe.balance = \"micro-batch\" computes the experts' balancing losses and \
             capacities per micro-batch, and train.micro_batch = {} here is not set but follows \
             the layout (0 in the config: a rank's whole share; or the plan's choice), so it \
             changes with parallel.dp and parallel.pp, and with it the model trained: set \
             train.micro_batch, or model.moe.balance = \"sequence\" (the default), which does \
             not depend on the layout",
            self.micro_batch()
        ))
    }

    /// The BERT shape of `[model]` (for `model.kind = "bert"`).
    pub fn bert(&self) -> merak_bert::BertConfig {
        let g = &self.model.gpt;
        merak_bert::BertConfig {
            vocab_size: g.vocab_size,
            layers: g.layers,
            heads: g.heads,
            hidden: g.hidden,
            seq_len: g.seq_len,
            dropout: g.dropout,
            layer_norm_eps: g.layer_norm_eps,
            init_std: g.init_std,
            mask_token_id: match self.model.mask_token_id {
                0 => g.vocab_size.saturating_sub(1),
                id => id,
            },
        }
    }

    /// The planner's shape of `[model]`.
    pub fn shape(&self) -> Result<TransformerShape, ConfigError> {
        match self.model.kind.as_str() {
            "gpt" => Ok(self.model.gpt.shape()),
            "bert" => Ok(self.bert().shape()),
            other => Err(ConfigError::BadValue {
                key: "model.kind".into(),
                msg: format!("{other:?} is not \"gpt\" or \"bert\""),
            }),
        }
    }
}
