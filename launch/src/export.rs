//! `merak export` (and what `merak generate` shares with it): using a trained checkpoint outside training.
//!
//! Both run in one process on the CPU and read the checkpoint whatever layout wrote it: the
//! shards are put back together at full size (see [`merak_burn::checkpoint`]). `export`
//! writes a GPT as Hugging Face `GPT2LMHeadModel` and a BERT as `BertForMaskedLM`
//! ([`merak_bert::hf`] says what is done with the pieces merak's BERT lacks); `generate`
//! takes GPT checkpoints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use merak_bert::hf::{hf_bert_config, to_hf_bert};
use merak_bert::{Bert, BertConfig};
use merak_burn::backend::Cpu;
use merak_burn::checkpoint::{Checkpoint, NamedTensor, state, write_file_atomically};
use merak_burn::entry::FullParams;
use merak_burn::grid::ProcessGrid;
use merak_burn::hf_files;
use merak_burn::tensor_parallel::Shard;
use merak_gpt::hf::{hf_gpt2_config, hf_gpt2_name, hf_gpt2_shapes};
use merak_gpt::{Gpt, GptConfig};

use crate::config::{self, Config};

/// Arguments of `merak export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint: a `step-*` folder, or a checkpoint folder whose `latest` names one.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The safetensors file to write; `config.json` is written next to it, so that
    /// `GPT2LMHeadModel.from_pretrained(<its folder>)` (a GPT) or
    /// `BertForMaskedLM.from_pretrained(<its folder>)` (a BERT) loads it.
    #[arg(long)]
    pub output: PathBuf,
    /// Also write the checkpoint's logits (merak's, one process) for `--logits-ids` as JSON
    /// (`{"ids", "shape", "logits"}`), to compare the export with transformers
    /// (`scripts/check-export.sh`).
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// The token ids of `--logits-out`, comma-separated (at most `model.seq_len`); default:
    /// 16 fixed ids (fewer for a shorter context), for a BERT every fifth one `[MASK]`.
    #[arg(long, value_delimiter = ',', requires = "logits_out")]
    pub logits_ids: Option<Vec<i64>>,
}

/// The training config stored in a checkpoint.
fn config_of(ck: &Checkpoint) -> Result<Config> {
    let text = crate::resolve::stored_config(ck)?;
    Ok(config::load_text(
        Some((text, "the checkpoint's config")),
        &[],
    )?)
}

/// The training config stored in a checkpoint; it must be a GPT.
pub(crate) fn gpt_of(ck: &Checkpoint) -> Result<Config> {
    let cfg = config_of(ck)?;
    if cfg.model.kind != "gpt" {
        bail!(
            "{}: model.kind = {:?}; generate takes GPT checkpoints",
            ck.dir.display(),
            cfg.model.kind
        );
    }
    Ok(cfg)
}

/// Writes the checkpoint as one Hugging Face safetensors file plus `config.json`: GPT-2 for a
/// GPT, `BertForMaskedLM` for a BERT. Everything is read and checked before the output
/// folders are made, so a refused export leaves nothing behind.
pub fn export(args: &ExportArgs) -> Result<()> {
    not_a_folder(&args.output, "--output")?;
    if let Some(path) = &args.logits_out {
        not_a_folder(path, "--logits-out")?;
    }
    let ck = Checkpoint::open(&args.checkpoint)?;
    let cfg = config_of(&ck)?;
    refuse_experts(&ck, &cfg)?;
    let ids = match &args.logits_out {
        Some(_) => Some(logits_ids(args.logits_ids.as_deref(), &cfg)?),
        None => None,
    };
    let params = full_params(&ck)?;
    let (tensors, config) = match cfg.model.kind.as_str() {
        "gpt" => (gpt2_tensors(&cfg, params)?, hf_gpt2_config(&cfg.model.gpt)),
        "bert" => (
            bert_tensors(&ck, &cfg, &params)?,
            hf_bert_config(&cfg.bert()),
        ),
        other => bail!(
            "{}: model.kind = {other:?}; export takes GPT and BERT checkpoints",
            ck.dir.display()
        ),
    };
    let bytes = hf_files::encode(&tensors).map_err(anyhow::Error::msg)?;
    let logits = match ids {
        Some(ids) => Some(checkpoint_logits(&ck, &cfg, &ids)?),
        None => None,
    };
    // Everything is checked: only now is anything made.
    crate::output_file(&args.output, "--output")?;
    let folder = hf_files::folder_of(&args.output);
    write_file_atomically(&args.output, &bytes)?;
    write_file_atomically(
        &folder.join("config.json"),
        &serde_json::to_vec_pretty(&config)?,
    )?;
    println!(
        "wrote {} ({} tensors, step {}) and {}",
        args.output.display(),
        tensors.len(),
        ck.manifest.step,
        folder.join("config.json").display()
    );
    if let (Some(path), Some((json, n))) = (&args.logits_out, logits) {
        crate::output_file(path, "--logits-out")?;
        write_file_atomically(path, &json)?;
        println!("wrote {} (logits of {n} ids)", path.display());
    }
    Ok(())
}

/// Refuses a folder where the file of `flag` goes, before any work (nothing is made here:
/// the file's folder is made once everything is checked).
pub(crate) fn not_a_folder(path: &Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        return Err(merak_burn::train::OutputError::IsAFolder {
            what: flag.to_string(),
            path: path.to_path_buf(),
        }
        .into());
    }
    Ok(())
}

/// Refuses a mixture-of-experts GPT (`model.moe`): GPT-2's format has dense MLPs only.
fn refuse_experts(ck: &Checkpoint, cfg: &Config) -> Result<()> {
    match (&cfg.model.gpt.moe, cfg.model.kind.as_str()) {
        (Some(moe), "gpt") => bail!(
            "{}: the model is a mixture of experts (model.moe: {} experts, top-{}), and GPT-2's \
             format (GPT2LMHeadModel) has dense MLPs only, so it has no GPT-2 form; the \
             checkpoint still serves `merak generate` and `merak train --resume`",
            ck.dir.display(),
            moe.experts,
            moe.top_k
        ),
        _ => Ok(()),
    }
}

/// The checkpoint's logits for `ids` as `--logits-out` JSON, and the number of ids.
fn checkpoint_logits(ck: &Checkpoint, cfg: &Config, ids: &[i64]) -> Result<(Vec<u8>, usize)> {
    let seed = cfg.train.seed;
    let (logits, vocab) = match cfg.model.kind.as_str() {
        "bert" => {
            let b = cfg.bert();
            (
                load_bert(ck, &b, seed)?.logits(ids_tensor(ids)),
                b.vocab_size,
            )
        }
        _ => {
            let g = &cfg.model.gpt;
            (load_gpt(ck, g, seed)?.logits(ids_tensor(ids)), g.vocab_size)
        }
    };
    Ok((logits_json(logits, ids, vocab)?, ids.len()))
}

/// The ids of `--logits-out`: `given`, checked against the model, or 16 fixed ones.
fn logits_ids(given: Option<&[i64]>, cfg: &Config) -> Result<Vec<i64>> {
    let (vocab, seq) = (cfg.model.gpt.vocab_size, cfg.model.gpt.seq_len);
    let ids = match given {
        Some(ids) => ids.to_vec(),
        None => {
            let mask = (cfg.model.kind == "bert").then(|| cfg.bert().mask_token_id as i64);
            (0..16.min(seq) as i64)
                .map(|i| match mask {
                    Some(m) if i % 5 == 2 => m,
                    _ => (i * 31 + 7) % vocab as i64,
                })
                .collect()
        }
    };
    if ids.is_empty() || ids.len() > seq {
        bail!(
            "--logits-ids: {} ids; give 1 to model.seq_len = {seq}",
            ids.len()
        );
    }
    if let Some(bad) = ids.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        bail!("--logits-ids: token {bad} is outside the model's vocabulary (0..{vocab})");
    }
    Ok(ids)
}

/// `ids` as a batch of one sequence.
pub(crate) fn ids_tensor(ids: &[i64]) -> burn::tensor::Tensor<Cpu, 2, burn::tensor::Int> {
    burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(ids.to_vec(), [1, ids.len()]),
        &Default::default(),
    )
}

/// The checkpoint's parameters at full size with their shapes, by merak name.
fn full_params(ck: &Checkpoint) -> Result<FullParams> {
    let shapes: HashMap<&str, &[usize]> = (ck.manifest.params.iter())
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let full = ck.read_full()?;
    Ok(full
        .params
        .into_iter()
        .map(|(name, values)| {
            let shape = shapes
                .get(name.as_str())
                .map_or_else(Vec::new, |s| s.to_vec());
            (name, (shape, values))
        })
        .collect())
}

/// A BERT checkpoint's parameters as `BertForMaskedLM` tensors.
fn bert_tensors(ck: &Checkpoint, cfg: &Config, params: &FullParams) -> Result<Vec<NamedTensor>> {
    let tensors = to_hf_bert(&cfg.bert(), params).with_context(|| ck.dir.display().to_string())?;
    Ok(tensors
        .into_iter()
        .map(|(name, shape, values)| NamedTensor {
            name,
            shape,
            values,
        })
        .collect())
}

/// A GPT checkpoint's parameters as `GPT2LMHeadModel` tensors. The multi-token-prediction
/// depths (`mtp.*`, `model.mtp_depth`) are left out: GPT-2 has no place for them, and the main
/// model predicts without them.
fn gpt2_tensors(cfg: &Config, params: FullParams) -> Result<Vec<NamedTensor>> {
    let mut by_hf: HashMap<String, NamedTensor> = HashMap::new();
    for (name, (shape, values)) in params {
        if merak_gpt::mtp::is_depth_param(&name) {
            continue;
        }
        let hf = hf_gpt2_name(&name)
            .with_context(|| format!("parameter {name} has no GPT-2 counterpart"))?;
        by_hf.insert(
            hf.clone(),
            NamedTensor {
                name: hf,
                shape,
                values,
            },
        );
    }
    let mut tensors = Vec::new();
    for (name, shape) in hf_gpt2_shapes(&cfg.model.gpt) {
        let t = by_hf
            .remove(&name)
            .with_context(|| format!("the checkpoint has no tensor for {name}"))?;
        if t.shape != shape {
            bail!(
                "{name}: shape {:?} in the checkpoint, GPT-2 expects {shape:?}",
                t.shape
            );
        }
        tensors.push(t);
    }
    Ok(tensors)
}

/// Loads a BERT checkpoint into a one-process model.
fn load_bert(ck: &Checkpoint, cfg: &BertConfig, seed: u64) -> Result<Bert<Cpu>> {
    let grid = ProcessGrid::single();
    load(
        ck,
        Bert::<Cpu>::new(cfg, seed, grid.tp, &Default::default())?,
    )
}

/// Loads a GPT checkpoint into a one-process model.
pub(crate) fn load_gpt(ck: &Checkpoint, cfg: &GptConfig, seed: u64) -> Result<Gpt<Cpu>> {
    let grid = ProcessGrid::single();
    load(
        ck,
        Gpt::<Cpu>::new(cfg, seed, grid.tp, &Default::default())?,
    )
}

/// `model` (one process) holding the checkpoint's parameters.
fn load<M: burn::module::Module<Cpu>>(ck: &Checkpoint, model: M) -> Result<M> {
    let full = ck.read_full()?;
    let shapes = state::param_shapes(&model);
    let names: Vec<String> = shapes.iter().map(|p| p.name.clone()).collect();
    ck.manifest.check_covers(&names)?;
    let (params, _) = full.cut_for(&ck.manifest, &shapes, Shard::FULL, &[])?;
    Ok(state::assign_params(model, params)?)
}

/// `logits` (`[1, ids, V_pad]` of a one-process model) of every position of `ids`, the first
/// `vocab` columns, as `--logits-out` JSON (`{"ids", "shape", "logits"}`).
pub(crate) fn logits_json(
    logits: burn::tensor::Tensor<Cpu, 3>,
    ids: &[i64],
    vocab: usize,
) -> Result<Vec<u8>> {
    let n = ids.len();
    let values = logits
        .narrow(2, 0, vocab)
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let json = serde_json::json!({ "ids": ids, "shape": [n, vocab], "logits": values });
    Ok(serde_json::to_vec(&json)?)
}
