//! `merak train --init-from`: start training from pretrained GPT-2 weights (a Hugging Face
//! `GPT2LMHeadModel` safetensors file, or one `merak export` wrote).
//!
//! Every rank reads and checks the whole file against the config before anything is built
//! ([`merak_gpt::hf_import`]), so a bad file stops every rank at once, naming the file; once
//! the model is built, each rank cuts its TP shard of the units it holds from the full tensors
//! with the checkpoint code ([`merak_burn::checkpoint::cut_full_params`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use merak_burn::checkpoint::{cut_full_params, state};
use merak_burn::grid::ProcessGrid;
use merak_burn::pipeline::PipelineModel;
use merak_burn::tensor_parallel::{ParallelBackend, Shard};
use merak_gpt::Gpt;
use merak_gpt::hf_import::{FullParams, read_hf_gpt2};

use crate::config::Config;

/// Pretrained weights, read and checked against the run's model.
pub struct Pretrained {
    /// The safetensors file.
    pub path: PathBuf,
    /// Every parameter at full size, by merak name.
    pub params: FullParams,
}

/// Reads `path` (and the `config.json` next to it) and checks it against the model of `cfg`;
/// rank 0 (`log`) reports what differs without stopping the import.
pub fn open(path: &Path, cfg: &Config, log: bool) -> Result<Pretrained> {
    if cfg.model.kind != "gpt" {
        bail!(
            "--init-from {}: model.kind = {:?}, but --init-from loads GPT-2 weights into a GPT (model.kind = \"gpt\")",
            path.display(),
            cfg.model.kind
        );
    }
    let weights = read_hf_gpt2(path, &cfg.model.gpt)
        .with_context(|| format!("--init-from {}", path.display()))?;
    if log {
        for note in &weights.notes {
            tracing::warn!("--init-from: {note}");
        }
        tracing::info!(
            "init: {} parameters from {}",
            weights.params.len(),
            path.display()
        );
    }
    Ok(Pretrained {
        path: path.to_path_buf(),
        params: weights.params,
    })
}

/// Replaces this rank's parameters of `model` (the units it holds, its TP shard, the head's
/// copy of the token table included) by its pieces of the pretrained weights.
pub fn apply<B: ParallelBackend>(
    model: Gpt<B>,
    pretrained: &Pretrained,
    grid: &ProcessGrid,
) -> Result<Gpt<B>> {
    let context = || format!("--init-from {}", pretrained.path.display());
    let shapes = state::param_shapes(&model);
    let shard = Shard {
        rank: grid.coords.tp,
        size: grid.layout.tp,
    };
    let copies = model.tied_names();
    let params =
        cut_full_params(&pretrained.params, &shapes, shard, &copies).with_context(context)?;
    state::assign_params(model, params).with_context(context)
}
