//! Runs that start from, or end as, Hugging Face `LlamaForCausalLM` (or `MixtralForCausalLM`)
//! checkpoints.

use std::path::Path;

use merak_burn::checkpoint::Checkpoint;
use merak_burn::entry::{FullParams, InitWeights};

use crate::LlamaConfig;
use crate::hf::{
    CONFIG_FILE, HfLlamaError, hf_config_json, llama_config_from_hf, read_hf_llama, write_hf_llama,
};

/// The model of a run on sequences of `seq` tokens and the weights it starts from: the
/// Hugging Face checkpoint in `init_from` (its shape, the rotary table cut to `seq`), or
/// `fresh` with its own initialization. A Mixtral with a sliding window shorter than `seq` is
/// refused: it would attend further back than transformers does
/// ([`HfLlama::sliding_window`](crate::HfLlama::sliding_window)).
pub fn pretrained_or(
    init_from: Option<&Path>,
    seq: usize,
    fresh: LlamaConfig,
) -> Result<(LlamaConfig, Option<InitWeights>), HfLlamaError> {
    let Some(dir) = init_from else {
        return Ok((fresh, None));
    };
    let hf = read_hf_llama(dir)?;
    if let Some(window) = hf.sliding_window.filter(|&w| seq > w) {
        return Err(HfLlamaError::Config {
            path: dir.join(CONFIG_FILE),
            key: "sliding_window".into(),
            value: window.to_string(),
            reason: format!(
                "sequences of {seq} tokens are longer than the window: transformers attends to \
                 the last {window} positions only, this model to every earlier one (train on \
                 at most {window} tokens)"
            ),
        });
    }
    let cfg = LlamaConfig {
        max_seq: seq.max(1),
        ..hf.config
    };
    let init = InitWeights {
        source: format!("--init-from {}", dir.display()),
        params: hf.params,
    };
    Ok((cfg, Some(init)))
}

/// What a run stores in its checkpoints' manifests: the model's name and its shape as a
/// Hugging Face `config.json`, from which [`export_checkpoint`] rebuilds it.
pub fn manifest_extra(cfg: &LlamaConfig) -> serde_json::Value {
    serde_json::json!({ "model": "llama", "config": hf_config_json(cfg) })
}

/// Why a checkpoint could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The checkpoint cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] merak_burn::checkpoint::CheckpointError),
    /// Its manifest has no Llama (or Mixtral) config (it was not written by `llama-train`).
    #[error("{}: the manifest has no `config` of a Llama model (not a llama-train checkpoint)", path.display())]
    NoConfig {
        /// The checkpoint.
        path: std::path::PathBuf,
    },
    /// The experts were balanced by selection biases (`llama-train --bias-update-rate`),
    /// which a `MixtralForCausalLM` has no place for.
    #[error(
        "{}: `{name}` holds the experts' selection biases (llama-train --bias-update-rate), \
         which MixtralForCausalLM has no place for: without them the exported model would \
         route its tokens otherwise; nothing was written",
        path.display()
    )]
    SelectionBiases {
        /// The checkpoint.
        path: std::path::PathBuf,
        /// The first parameter of biases.
        name: String,
    },
    /// The config or a parameter does not fit, or writing failed.
    #[error(transparent)]
    Hf(#[from] HfLlamaError),
}

/// Writes the checkpoint at `checkpoint` (of any layout) into folder `dir` as a Hugging Face
/// `LlamaForCausalLM`, or `MixtralForCausalLM` ([`write_hf_llama`]); returns the files
/// written.
pub fn export_checkpoint(
    checkpoint: &Path,
    dir: &Path,
    max_shard_bytes: Option<u64>,
) -> Result<Vec<std::path::PathBuf>, ExportError> {
    let opened = Checkpoint::open(checkpoint)?;
    let manifest_path = opened.dir.join("manifest.json");
    let config = (opened.manifest.extra.get("config")).ok_or_else(|| ExportError::NoConfig {
        path: opened.dir.clone(),
    })?;
    let cfg = llama_config_from_hf(config, &manifest_path)?;
    let mut state = opened.read_full()?;
    let params: FullParams = (cfg.param_shapes().into_iter())
        .filter_map(|(name, shape)| state.params.remove(&name).map(|v| (name, (shape, v))))
        .collect();
    let mut biased: Vec<&String> = (state.params.iter())
        .filter(|(name, v)| name.ends_with("moe.bias") && v.iter().any(|&b| b != 0.0))
        .map(|(name, _)| name)
        .collect();
    biased.sort();
    if let Some(name) = biased.first() {
        return Err(ExportError::SelectionBiases {
            path: opened.dir.clone(),
            name: (*name).clone(),
        });
    }
    Ok(write_hf_llama(dir, &cfg, &params, max_shard_bytes)?)
}
