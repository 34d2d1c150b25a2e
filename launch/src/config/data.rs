//! `[data]`: the data source and validation.

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, MAX_SYNTHETIC_VAL_SEQUENCES, bad};

/// `[data]`: where tokens come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// "synthetic": deterministic sequences generated from the seed; "tokens": a data set made
    /// by `merak prepare-data`, at `data.path`.
    pub kind: String,
    /// Folder of the prepared data set (for `kind = "tokens"`).
    pub path: String,
    /// Measure the validation loss every this many steps (and after the last); 0 never.
    pub val_every: usize,
    /// Global batches of held-out sequences per validation.
    pub val_batches: usize,
    /// Document masks (GPT): a token attends only to the tokens of its own document and its
    /// position restarts at 0 where a document starts. Documents end at the data set's
    /// end-of-text token (synthetic data: the last vocabulary id).
    pub document_mask: bool,
}

impl Config {
    /// `[data]`: a known source with what it needs.
    pub(super) fn validate_data(&self) -> Result<(), ConfigError> {
        match self.data.kind.as_str() {
            "synthetic" => {}
            "tokens" if self.data.path.is_empty() => {
                return bad(
                    "data.path",
                    "is required with data.kind = \"tokens\" (a folder made by `merak prepare-data`)".into(),
                );
            }
            "tokens" => {}
            other => {
                return bad(
                    "data.kind",
                    format!("`{other}` is not a known data source (known: synthetic, tokens)"),
                );
            }
        }
        if self.data.document_mask && self.model.kind != "gpt" {
            return bad(
                "data.document_mask",
                format!(
                    "applies to model.kind = \"gpt\" only (this config's model.kind is \"{}\")",
                    self.model.kind
                ),
            );
        }
        if self.data.val_every > 0 && self.data.val_batches == 0 {
            return bad(
                "data.val_batches",
                "must be at least 1 when data.val_every > 0".into(),
            );
        }
        if self.data.kind == "synthetic" {
            return self.validate_val_sequences(MAX_SYNTHETIC_VAL_SEQUENCES, "the synthetic cap");
        }
        Ok(())
    }

    /// `data.val_batches` against the validation windows of the data set (`data.kind =
    /// "tokens"`, [`merak_burn::data::TokenData::val_samples`]): a validation pass reads
    /// `data.val_batches x train.global_batch` windows and must not read one twice. Called
    /// once the data set is open.
    pub fn validate_val_windows(&self, windows: u64) -> Result<(), ConfigError> {
        let limit = usize::try_from(windows).unwrap_or(usize::MAX);
        self.validate_val_sequences(limit, "the validation windows of data.path")
    }

    /// A validation pass (when `data.val_every > 0`) of at most `limit` sequences (`what`).
    pub(super) fn validate_val_sequences(
        &self,
        limit: usize,
        what: &str,
    ) -> Result<(), ConfigError> {
        let (batches, global) = (self.data.val_batches, self.train.global_batch);
        let sequences = batches.checked_mul(global);
        if self.data.val_every == 0 || sequences.is_some_and(|n| n <= limit) {
            return Ok(());
        }
        let shown = sequences.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
        bad(
            "data.val_batches",
            format!(
                "{batches} batches of train.global_batch = {global} make {shown} sequences per \
                 validation, more than {what} ({limit})"
            ),
        )
    }
}
