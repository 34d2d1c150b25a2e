//! `merak train --init-from`: start training from pretrained weights: for a GPT
//! (`model.kind = "gpt"`) a Hugging Face `GPT2LMHeadModel` safetensors file, for a BERT
//! (`model.kind = "bert"`) a `BertForMaskedLM` one with its `config.json` (or a file
//! `merak export` wrote).
//!
//! Every rank reads and checks the whole file against the config before anything is built
//! ([`merak_gpt::hf_import`], [`merak_bert::hf_import`]), so a bad file stops every rank at
//! once, naming the file; the library's run then cuts, once the model is built, each rank's TP
//! shard of the units it holds from the full tensors
//! ([`RunOptions::init`](merak_burn::entry::RunOptions::init)).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use merak_gpt::hf_import::{FullParams, read_hf_gpt2};

use crate::config::Config;

/// Pretrained weights, read and checked against the run's model.
pub struct Pretrained {
    /// The safetensors file.
    pub path: PathBuf,
    /// Every parameter at full size, by merak name.
    pub params: FullParams,
}

/// Reads `path` (and the `config.json` next to it) and checks it against the model of `cfg`
/// (a GPT-2 file for a GPT, a `BertForMaskedLM` file for a BERT); rank 0 (`log`) reports
/// what differs without stopping the import.
pub fn open(path: &Path, cfg: &Config, log: bool) -> Result<Pretrained> {
    let context = || format!("--init-from {}", path.display());
    let (params, notes) = match cfg.model.kind.as_str() {
        "gpt" => {
            let w = read_hf_gpt2(path, &cfg.model.gpt).with_context(context)?;
            (w.params, w.notes)
        }
        "bert" => {
            let w = merak_bert::hf_import::read_hf_bert(path, &cfg.bert()).with_context(context)?;
            (w.params, w.notes)
        }
        other => bail!(
            "--init-from {}: model.kind = {other:?}; --init-from loads GPT-2 weights into a GPT \
             (model.kind = \"gpt\") and BertForMaskedLM weights into a BERT (model.kind = \"bert\")",
            path.display()
        ),
    };
    // The weights against the model this config builds, before any folder is made.
    crate::model_params::check_pretrained(cfg, &params).with_context(context)?;
    if log {
        for note in &notes {
            tracing::warn!("--init-from: {note}");
        }
        tracing::info!("init: {} parameters from {}", params.len(), path.display());
    }
    Ok(Pretrained {
        path: path.to_path_buf(),
        params,
    })
}
