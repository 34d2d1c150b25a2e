//! Pretrained BERT weights from a Hugging Face `BertForMaskedLM` safetensors file, as the
//! full-size parameters of a merak BERT (what `merak train --init-from` starts from).
//!
//! The file is what `BertForMaskedLM.save_pretrained` or `merak export` writes: tensors named
//! `bert.*` and `cls.predictions.*` (`BertModel` names without `bert.`, and the legacy
//! `LayerNorm.gamma` / `LayerNorm.beta` of the original checkpoints, are accepted), in F32,
//! F16, BF16 or F64 (converted to f32), with the model's `config.json` next to it. The
//! config is required: the head count, the activation and the LayerNorm epsilon are not in
//! the weights.
//!
//! Everything is checked before anything is returned, and every refusal is an error naming
//! the file and the tensor (or `config.json` key):
//!
//! - the file's layout: the header length, each tensor's offsets and element count are
//!   checked (with checked arithmetic) against the file's real size before the safetensors
//!   crate reads them, so a truncated or hostile file allocates nothing of the size it claims;
//! - `config.json`: the sizes must be the model's (the vocabulary may be smaller, padded with
//!   zero rows; the position table longer, its first `model.seq_len` rows used), and the
//!   computation merak's (exact `"gelu"`, `layer_norm_eps` equal to `model.layer_norm_eps`,
//!   absolute positions, an encoder without cross-attention);
//! - the tensors: an unknown, missing, duplicated or misshapen tensor, an unsupported dtype,
//!   a NaN or an infinity;
//! - what merak's BERT lacks (see [`crate::hf`]): the output bias must be all zeros and the
//!   decoder (when the file holds one) the word embeddings; the token type table's row 0 is
//!   folded into the position table (exact for token type ids 0), its other rows dropped with a
//!   note; a pooler or next-sentence head is skipped with a note.
//!
//! The padding that tensor parallelism adds to the token table is not the business of this
//! module: the full tensors have `model.vocab_size` rows, and cutting them for a TP rank pads
//! them.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use merak_burn::hf_files::{self, HfFileError};
use safetensors::tensor::TensorView;
use thiserror::Error;

use crate::BertConfig;
use crate::hf::{
    DECODER_BIAS, DECODER_WEIGHT, OUTPUT_BIAS, POSITION_EMBEDDINGS, TOKEN_TYPE_EMBEDDINGS,
    WORD_EMBEDDINGS, describe, hf_bert_shapes, specs, to_ours,
};

pub use merak_burn::entry::FullParams;

/// The pretrained weights of a `BertForMaskedLM` safetensors file, checked against a model
/// config.
#[derive(Clone, Debug)]
pub struct HfBertWeights {
    /// Every parameter of the model (all pipeline stages, at full size, without the tied
    /// head copy), by merak name.
    pub params: FullParams,
    /// Differences that do not stop the import but that the user should know about (the token
    /// table padded, the position table cut, the token type table folded or cut, a pooler
    /// skipped).
    pub notes: Vec<String>,
}

/// A `BertForMaskedLM` file that does not fit the model; every variant names the file.
#[derive(Debug, Error)]
pub enum HfBertImportError {
    /// The file cannot be read, is not a valid safetensors file, or holds a tensor of an
    /// element type that is not converted (F32, F16, BF16 and F64 are) or a NaN or an
    /// infinity; or `config.json` is absent, not a regular file or not a JSON object.
    #[error(transparent)]
    File(#[from] HfFileError),
    /// `config.json` describes another model.
    #[error("{}: `{key}` is {file}, but the model has {model}", path.display())]
    Config {
        /// The `config.json`.
        path: PathBuf,
        /// The key in `config.json`.
        key: String,
        /// Its value in the file.
        file: String,
        /// What the model needs, with the setting that holds it.
        model: String,
    },
    /// A tensor has another shape than the model's parameter.
    #[error(
        "{}: tensor {tensor} has shape {file:?}, but the model ({model}) expects {expected:?}",
        path.display()
    )]
    Shape {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Its shape in the file.
        file: Vec<usize>,
        /// The shape the model needs.
        expected: Vec<usize>,
        /// The model's sizes.
        model: String,
    },
    /// A parameter of the model has no tensor in the file.
    #[error("{}: tensor {tensor} is missing ({needed})", path.display())]
    Missing {
        /// The `BertForMaskedLM` name of the missing tensor.
        tensor: String,
        /// The file.
        path: PathBuf,
        /// Why it is needed (the model's sizes).
        needed: String,
    },
    /// A tensor the model cannot take.
    #[error("{}: tensor {tensor}: {reason}", path.display())]
    Unexpected {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Why it cannot be loaded.
        reason: String,
    },
}

/// What `config.json` says about the sizes that may differ from the model's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfBertFileConfig {
    /// `vocab_size`: rows of the word table (at most `model.vocab_size`).
    pub vocab: usize,
    /// `max_position_embeddings`: rows of the position table (at least `model.seq_len`).
    pub positions: usize,
    /// `type_vocab_size`: rows of the token type table (at least 1).
    pub type_vocab: usize,
    /// `tie_word_embeddings`: whether the decoder is the word table (then the file need not
    /// hold it).
    pub tied: bool,
}

/// Reads the `BertForMaskedLM` safetensors file at `path` and the `config.json` in its folder
/// and checks them against `cfg`: the full-size parameters of the model, by merak name.
pub fn read_hf_bert(path: &Path, cfg: &BertConfig) -> Result<HfBertWeights, HfBertImportError> {
    let mut notes = Vec::new();
    let config_path = hf_files::folder_of(path).join("config.json");
    let Some(json) = hf_files::read_config(&config_path)? else {
        let reason = format!(
            "missing: a BertForMaskedLM file ({}) needs its config.json next to it (the head \
             count, activation and LayerNorm epsilon are not in the weights)",
            path.display()
        );
        return Err(HfFileError::format(&config_path, reason).into());
    };
    let file = check_hf_bert_config(&json, &config_path, cfg)?;
    let bytes = hf_files::read_weights(path)?;
    let params = decode_hf_bert(&bytes, path, cfg, &file, &mut notes)?;
    Ok(HfBertWeights { params, notes })
}

/// A `config.json` being checked (at `path`, for messages): its values with `BertConfig`'s
/// defaults for absent or null keys, and the refusal naming a key.
struct ConfigJson<'a> {
    /// The parsed file.
    json: &'a serde_json::Value,
    /// The file, for messages.
    path: &'a Path,
}

impl ConfigJson<'_> {
    /// The refusal of `key`: the file's value (or `default`, said to be the default) against
    /// what the `model` needs.
    fn refuse(&self, key: &str, default: &str, model: String) -> HfBertImportError {
        let file = self
            .json
            .get(key)
            .map_or_else(|| format!("{default} (the default)"), |v| v.to_string());
        HfBertImportError::Config {
            path: self.path.to_path_buf(),
            key: key.into(),
            file,
            model,
        }
    }

    /// `key` as a string, `default` when absent or null, `None` when not a string.
    fn text(&self, key: &str, default: &'static str) -> Option<String> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Some(default.into()),
            Some(v) => v.as_str().map(str::to_string),
        }
    }

    /// `key` as an unsigned integer, `default` when absent or null, `None` when not one.
    fn int(&self, key: &str, default: u64) -> Option<u64> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Some(default),
            Some(v) => v.as_u64(),
        }
    }

    /// `key` as a boolean, `default` when absent or null, `None` when not one.
    fn flag(&self, key: &str, default: bool) -> Option<bool> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Some(default),
            Some(v) => v.as_bool(),
        }
    }
}

/// The sizes `config.json` must agree on: `(key, BertConfig's default, what the model needs,
/// its setting, how they may differ)`.
fn size_checks(cfg: &BertConfig) -> [(&'static str, u64, u64, &'static str, Ordering); 6] {
    let h = cfg.hidden as u64;
    [
        ("hidden_size", 768, h, "model.hidden", Ordering::Equal),
        (
            "num_hidden_layers",
            12,
            cfg.layers as u64,
            "model.layers",
            Ordering::Equal,
        ),
        (
            "num_attention_heads",
            12,
            cfg.heads as u64,
            "model.heads",
            Ordering::Equal,
        ),
        (
            "intermediate_size",
            3072,
            h.saturating_mul(4),
            "an MLP of width 4 * model.hidden =",
            Ordering::Equal,
        ),
        (
            "vocab_size",
            30522,
            cfg.vocab_size as u64,
            "model.vocab_size",
            Ordering::Less,
        ),
        (
            "max_position_embeddings",
            512,
            cfg.seq_len as u64,
            "model.seq_len",
            Ordering::Greater,
        ),
    ]
}

/// Checks the sizes of [`size_checks`] in order, refusing the first that does not fit: the
/// file's values, by key.
fn check_sizes(
    c: &ConfigJson<'_>,
    cfg: &BertConfig,
) -> Result<HashMap<&'static str, u64>, HfBertImportError> {
    let mut values = HashMap::new();
    for (key, default, model, setting, may) in size_checks(cfg) {
        let file = c.int(key, default);
        if let Some(f) = file
            && (f == model || f.cmp(&model) == may)
            && (f > 0)
        {
            values.insert(key, f);
            continue;
        }
        let bound = match may {
            Ordering::Less => " (the file's vocabulary may be smaller, not larger)",
            Ordering::Greater => " (the file may have more positions, not fewer)",
            Ordering::Equal => "",
        };
        let eq = if setting.ends_with('=') { " " } else { " = " };
        return Err(c.refuse(
            key,
            &default.to_string(),
            format!("{setting}{eq}{model}{bound}"),
        ));
    }
    Ok(values)
}

/// Checks that `config.json` computes what merak's BERT computes: the exact GELU, the
/// model's LayerNorm epsilon, absolute positions, a bidirectional encoder without
/// cross-attention.
fn check_computation(c: &ConfigJson<'_>, cfg: &BertConfig) -> Result<(), HfBertImportError> {
    let act = c.text("hidden_act", "gelu");
    if !matches!(act.as_deref(), Some("gelu" | "gelu_python")) {
        return Err(c.refuse(
            "hidden_act",
            "\"gelu\"",
            "the exact (erf) GELU, \"gelu\" (merak's BERT has no other activation)".into(),
        ));
    }
    let eps = match c.json.get("layer_norm_eps") {
        None | Some(serde_json::Value::Null) => Some(1e-12),
        Some(v) => v.as_f64(),
    };
    let want = cfg.layer_norm_eps;
    if eps.is_none_or(|e| !(e.is_finite() && (e - want).abs() <= 1e-6 * want.abs())) {
        return Err(c.refuse(
            "layer_norm_eps",
            "1e-12",
            format!("model.layer_norm_eps = {want:e} (set it to the file's value)"),
        ));
    }
    if c.text("position_embedding_type", "absolute").as_deref() != Some("absolute") {
        return Err(c.refuse(
            "position_embedding_type",
            "\"absolute\"",
            "learned absolute positions (\"absolute\")".into(),
        ));
    }
    for key in ["is_decoder", "add_cross_attention"] {
        if c.flag(key, false) != Some(false) {
            return Err(c.refuse(
                key,
                "false",
                "a bidirectional encoder without cross-attention (false)".into(),
            ));
        }
    }
    Ok(())
}

/// Checks a `BertForMaskedLM` `config.json` (at `path`, for messages) against `cfg`: sizes
/// that shape the model must agree (the vocabulary may be smaller and the positions more, see
/// the module documentation), and so must the computation (activation, LayerNorm epsilon,
/// position embedding type, encoder only). Absent keys take `BertConfig`'s defaults.
pub fn check_hf_bert_config(
    json: &serde_json::Value,
    path: &Path,
    cfg: &BertConfig,
) -> Result<HfBertFileConfig, HfBertImportError> {
    if !json.is_object() {
        return Err(HfFileError::format(path, "not a JSON object").into());
    }
    let c = ConfigJson { json, path };
    if c.text("model_type", "bert").as_deref() != Some("bert") {
        return Err(c.refuse(
            "model_type",
            "\"bert\"",
            "\"bert\" (merak's BERT loads BertForMaskedLM files)".into(),
        ));
    }
    let values = check_sizes(&c, cfg)?;
    let type_vocab = match c.int("type_vocab_size", 2) {
        Some(t) if t >= 1 => t,
        _ => {
            return Err(c.refuse(
                "type_vocab_size",
                "2",
                "a token type table of at least 1 row (merak uses token type 0)".into(),
            ));
        }
    };
    check_computation(&c, cfg)?;
    let Some(tied) = c.flag("tie_word_embeddings", true) else {
        return Err(c.refuse(
            "tie_word_embeddings",
            "true",
            "a decoder tied to the word embeddings (true)".into(),
        ));
    };
    // The values fit in usize: they equal or are bounded by the model's sizes (the positions
    // only from below, so they are clamped; a larger count is only compared with the file).
    let size = |key: &str| usize::try_from(values[key]).unwrap_or(usize::MAX);
    Ok(HfBertFileConfig {
        vocab: size("vocab_size"),
        positions: size("max_position_embeddings"),
        type_vocab: usize::try_from(type_vocab).unwrap_or(usize::MAX),
        tied,
    })
}

/// The name of a tensor as `BertForMaskedLM` saves it: `BertModel`'s names get `bert.`, the
/// legacy `LayerNorm.gamma` / `beta` become `weight` / `bias`.
fn canonical(name: &str) -> String {
    let mut n = if name.starts_with("bert.") || name.starts_with("cls.") {
        name.to_string()
    } else {
        format!("bert.{name}")
    };
    for (old, new) in [
        (".LayerNorm.gamma", ".LayerNorm.weight"),
        (".LayerNorm.beta", ".LayerNorm.bias"),
    ] {
        if let Some(stem) = n.strip_suffix(old) {
            n = format!("{stem}{new}");
        }
    }
    n
}

/// The encoder layer a `BertForMaskedLM` name belongs to.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("bert.encoder.layer.")?;
    rest.split_once('.')?.0.parse().ok()
}

/// The refusal of tensor `tensor` of the file at `path`, for `reason`.
fn unexpected(path: &Path, tensor: &str, reason: String) -> HfBertImportError {
    HfBertImportError::Unexpected {
        path: path.to_path_buf(),
        tensor: tensor.into(),
        reason,
    }
}

/// The tensors of a file by canonical name: `(name in the file, view)`.
type Found<'a> = HashMap<String, (String, TensorView<'a>)>;

/// Collects the tensors of the file (`bytes`, read from `path`) by canonical name, refusing
/// an unknown tensor (not in `expected` nor the decoder) or one held twice; transformers'
/// buffers are ignored, and a pooler or next-sentence head is skipped with a note.
fn collect_tensors<'a>(
    bytes: &'a [u8],
    path: &Path,
    cfg: &BertConfig,
    expected: &[(String, Vec<usize>)],
    notes: &mut Vec<String>,
) -> Result<Found<'a>, HfBertImportError> {
    let mut found: Found<'a> = HashMap::new();
    let mut skipped = Vec::new();
    for (name, view) in hf_files::tensor_views(bytes, path)? {
        let canonical = canonical(&name);
        match canonical.as_str() {
            // Buffers of transformers' embeddings, not parameters.
            "bert.embeddings.position_ids" | "bert.embeddings.token_type_ids" => continue,
            n if n.starts_with("bert.pooler.") || n.starts_with("cls.seq_relationship.") => {
                skipped.push(name);
                continue;
            }
            _ => {}
        }
        let known = canonical == DECODER_WEIGHT
            || canonical == DECODER_BIAS
            || expected.iter().any(|(n, _)| *n == canonical);
        if !known {
            let reason = match layer_of(&canonical) {
                Some(_) => format!(
                    "the model has {} layers (model.layers), the file has more",
                    cfg.layers
                ),
                None => "not a tensor of BertForMaskedLM".into(),
            };
            return Err(unexpected(path, &name, reason));
        }
        if let Some((first, _)) = found.insert(canonical, (name.clone(), view)) {
            return Err(unexpected(
                path,
                &name,
                format!("the file also holds {first}: the same tensor twice"),
            ));
        }
    }
    if !skipped.is_empty() {
        notes.push(format!(
            "{}: {} skipped (the pooler and the next-sentence head do not take part in masked language modelling)",
            path.display(),
            skipped.join(", ")
        ));
    }
    Ok(found)
}

/// Every `expected` tensor of the file, checked (present, of its shape, finite) and as f32,
/// by canonical name; `model` describes the model's sizes for messages.
fn checked_tensors<'e>(
    found: &Found<'_>,
    expected: &'e [(String, Vec<usize>)],
    path: &Path,
    model: &str,
) -> Result<HashMap<&'e str, Vec<f32>>, HfBertImportError> {
    let mut hf: HashMap<&str, Vec<f32>> = HashMap::new();
    for (canonical, want) in expected {
        let Some((name, view)) = found.get(canonical) else {
            return Err(HfBertImportError::Missing {
                tensor: canonical.clone(),
                path: path.to_path_buf(),
                needed: format!("the model has {model}"),
            });
        };
        if view.shape() != want.as_slice() {
            return Err(HfBertImportError::Shape {
                path: path.to_path_buf(),
                tensor: name.clone(),
                file: view.shape().to_vec(),
                expected: want.clone(),
                model: model.into(),
            });
        }
        hf.insert(canonical.as_str(), hf_files::finite_f32(view, path, name)?);
    }
    Ok(hf)
}

/// Checks what merak's head lacks: the decoder (when the file holds one, or must because
/// `config.json` unties it) must be the word table, and the output biases all zeros.
fn check_head(
    found: &Found<'_>,
    hf: &HashMap<&str, Vec<f32>>,
    path: &Path,
    cfg: &BertConfig,
    file: &HfBertFileConfig,
    model: &str,
) -> Result<(), HfBertImportError> {
    // The tied decoder: the word table itself.
    match found.get(DECODER_WEIGHT) {
        Some((name, view)) => {
            let table = &hf[WORD_EMBEDDINGS];
            let same = view.shape() == [file.vocab, cfg.hidden]
                && hf_files::finite_f32(view, path, name)? == *table;
            if !same {
                return Err(unexpected(
                    path,
                    name,
                    "differs from bert.embeddings.word_embeddings.weight: merak's decoder is \
                     tied to the word embeddings, so an untied decoder cannot be loaded"
                        .into(),
                ));
            }
        }
        None if !file.tied => {
            return Err(HfBertImportError::Missing {
                tensor: DECODER_WEIGHT.into(),
                path: path.to_path_buf(),
                needed: "config.json says tie_word_embeddings = false, so the decoder is not the \
                         word table; merak's decoder is, and a file of an untied decoder must \
                         hold it to show it equal"
                    .into(),
            });
        }
        None => {}
    }
    // The output bias merak's head does not have: it must be all zeros.
    let mut biases = vec![(OUTPUT_BIAS.to_string(), hf[OUTPUT_BIAS].clone())];
    if let Some((name, view)) = found.get(DECODER_BIAS) {
        if view.shape() != [file.vocab] {
            return Err(HfBertImportError::Shape {
                path: path.to_path_buf(),
                tensor: name.clone(),
                file: view.shape().to_vec(),
                expected: vec![file.vocab],
                model: model.into(),
            });
        }
        biases.push((name.clone(), hf_files::finite_f32(view, path, name)?));
    }
    for (name, values) in &biases {
        if let Some((index, value)) = values.iter().enumerate().find(|(_, v)| **v != 0.0) {
            return Err(unexpected(
                path,
                name,
                format!(
                    "holds {value} at index {index}, not 0: merak's BERT has no output bias (its \
                     decoder is the tied word embedding alone), so a non-zero bias cannot be \
                     loaded without changing every logit"
                ),
            ));
        }
    }
    Ok(())
}

/// The model's position table: the file's first `model.seq_len` rows with token type 0 (the
/// only segment merak's BERT sees) added, with notes on the token types and on the tables
/// whose size differs from the model's.
fn fold_positions(
    hf: &HashMap<&str, Vec<f32>>,
    path: &Path,
    cfg: &BertConfig,
    file: &HfBertFileConfig,
    notes: &mut Vec<String>,
) -> Vec<f32> {
    let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
    // Token type 0, the only segment merak's BERT sees, joins the position embeddings.
    let types = &hf[TOKEN_TYPE_EMBEDDINGS];
    let type0 = &types[..h];
    let mut positions = hf[POSITION_EMBEDDINGS][..s * h].to_vec();
    if type0.iter().any(|&x| x != 0.0) {
        for row in positions.chunks_mut(h) {
            for (p, t) in row.iter_mut().zip(type0) {
                *p += t;
            }
        }
        notes.push(format!(
            "{}: {TOKEN_TYPE_EMBEDDINGS} row 0 (token type 0, the only segment merak's BERT \
             sees) is added to every position embedding",
            path.display()
        ));
    }
    if types.chunks(h).skip(1).any(|row| row != type0) {
        notes.push(format!(
            "{}: {TOKEN_TYPE_EMBEDDINGS} rows 1..{} are dropped: merak's BERT has no segments, \
             so it computes what BERT computes for token type ids 0",
            path.display(),
            file.type_vocab
        ));
    }
    if file.vocab < v {
        notes.push(format!(
            "{}: {WORD_EMBEDDINGS} has {} rows, padded with zero rows to model.vocab_size = {v}",
            path.display(),
            file.vocab
        ));
    }
    if file.positions > s {
        notes.push(format!(
            "{}: {POSITION_EMBEDDINGS} has {} positions, the first model.seq_len = {s} are used",
            path.display(),
            file.positions
        ));
    }
    positions
}

/// merak's parameters from the checked tensors `hf`: the word table padded to
/// `model.vocab_size` rows, `positions` as the position table, the rest laid out by [`specs`].
fn assemble(cfg: &BertConfig, hf: &HashMap<&str, Vec<f32>>, positions: Vec<f32>) -> FullParams {
    let (h, v) = (cfg.hidden, cfg.vocab_size);
    let mut params = FullParams::new();
    for spec in specs(cfg) {
        let values = match spec.ours.as_str() {
            "wte.embedding.weight" => {
                let mut table = hf[WORD_EMBEDDINGS].clone();
                table.resize(v * h, 0.0);
                table
            }
            "wpe.weight" => positions.clone(),
            _ => {
                let parts: Vec<(&[usize], &[f32])> = spec
                    .hf
                    .iter()
                    .map(|(name, shape)| (shape.as_slice(), hf[name.as_str()].as_slice()))
                    .collect();
                to_ours(spec.layout, &parts)
            }
        };
        params.insert(spec.ours, (spec.shape, values));
    }
    params
}

/// Decodes a `BertForMaskedLM` safetensors file (`bytes`, read from `path`) whose
/// `config.json` said `file`, and checks every tensor against `cfg`; differences that are
/// bridged are added to `notes`.
pub fn decode_hf_bert(
    bytes: &[u8],
    path: &Path,
    cfg: &BertConfig,
    file: &HfBertFileConfig,
    notes: &mut Vec<String>,
) -> Result<FullParams, HfBertImportError> {
    // The file's shapes: the model's, with the vocabulary and positions config.json gives.
    let file_shape = BertConfig {
        vocab_size: file.vocab,
        seq_len: file.positions,
        ..cfg.clone()
    };
    let expected = hf_bert_shapes(&file_shape, file.type_vocab);
    let model = format!(
        "{}; config.json: vocab_size = {}, max_position_embeddings = {}, type_vocab_size = {}",
        describe(cfg),
        file.vocab,
        file.positions,
        file.type_vocab
    );
    let found = collect_tensors(bytes, path, cfg, &expected, notes)?;
    let hf = checked_tensors(&found, &expected, path, &model)?;
    check_head(&found, &hf, path, cfg, file, &model)?;
    let positions = fold_positions(&hf, path, cfg, file, notes);
    Ok(assemble(cfg, &hf, positions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::tests::odd as tiny;
    use crate::hf::{hf_bert_config, to_hf_bert};
    use merak_tests::fresh_folder as folder;

    type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

    /// Distinct values for every tensor of a `BertForMaskedLM` of shape `cfg` (two token
    /// types, both zero; a zero output bias): (name, shape, values).
    fn tensors(cfg: &BertConfig) -> Tensors {
        hf_bert_shapes(cfg, 2)
            .into_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let n: usize = shape.iter().product();
                let zero = name == OUTPUT_BIAS || name == TOKEN_TYPE_EMBEDDINGS;
                let values = (0..n)
                    .map(|i| {
                        if zero {
                            0.0
                        } else {
                            k as f32 + i as f32 / 1024.0
                        }
                    })
                    .collect();
                (name, shape, values)
            })
            .collect()
    }

    /// Writes `tensors` as `dtype` (F32, F16, BF16 or I32 from the f32 values) into
    /// `dir/model.safetensors`.
    fn write(dir: &Path, tensors: &Tensors, dtype: &str) -> PathBuf {
        let path = dir.join("model.safetensors");
        std::fs::write(&path, merak_tests::safetensors_file(tensors, dtype)).unwrap();
        path
    }

    fn write_json(dir: &Path, json: &serde_json::Value) {
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    }

    /// A folder with the tiny BERT's `tensors` (edited by `edit`) and its config.json (edited
    /// by `config`); the error of reading it.
    fn refusal(
        name: &str,
        edit: impl FnOnce(&mut Tensors),
        config: impl FnOnce(&mut serde_json::Value),
    ) -> String {
        let dir = folder(name);
        let mut t = tensors(&tiny());
        edit(&mut t);
        let path = write(&dir, &t, "F32");
        let mut json = hf_bert_config(&tiny());
        config(&mut json);
        write_json(&dir, &json);
        read_hf_bert(&path, &tiny()).unwrap_err().to_string()
    }

    fn find<'a>(t: &'a mut Tensors, name: &str) -> &'a mut (String, Vec<usize>, Vec<f32>) {
        t.iter_mut().find(|x| x.0 == name).unwrap()
    }

    #[test]
    fn import_then_export_gives_the_file_back_and_export_then_import_the_params() {
        let cfg = tiny();
        let dir = folder("roundtrip");
        let t = tensors(&cfg);
        let path = write(&dir, &t, "F32");
        write_json(&dir, &hf_bert_config(&cfg));
        let w = read_hf_bert(&path, &cfg).unwrap();
        assert!(w.notes.is_empty(), "{:?}", w.notes);
        assert_eq!(w.params.len(), specs(&cfg).len());
        let mut back = to_hf_bert(&cfg, &w.params).unwrap();
        let mut want = t.clone();
        back.sort_by(|a, b| a.0.cmp(&b.0));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(back, want);

        // merak parameters -> file -> merak parameters, bit for bit.
        let params: FullParams = specs(&cfg)
            .into_iter()
            .enumerate()
            .map(|(k, s)| {
                let n: usize = s.shape.iter().product();
                let v = (0..n)
                    .map(|i| ((k * 7919 + i) % 1013) as f32 * 1e-3 - 0.5)
                    .collect();
                (s.ours, (s.shape, v))
            })
            .collect();
        let dir = folder("roundtrip-merak");
        let path = write(&dir, &to_hf_bert(&cfg, &params).unwrap(), "F32");
        write_json(&dir, &hf_bert_config(&cfg));
        assert_eq!(read_hf_bert(&path, &cfg).unwrap().params, params);
    }

    #[test]
    fn token_type_zero_joins_the_positions_and_the_other_types_are_noted() {
        let cfg = tiny();
        let h = cfg.hidden;
        let dir = folder("types");
        let mut t = tensors(&cfg);
        let types: Vec<f32> = (0..2 * h).map(|i| i as f32 * 0.01 - 0.3).collect();
        find(&mut t, TOKEN_TYPE_EMBEDDINGS).2 = types.clone();
        let path = write(&dir, &t, "F32");
        write_json(&dir, &hf_bert_config(&cfg));
        let w = read_hf_bert(&path, &cfg).unwrap();
        let pos = &find(&mut t, POSITION_EMBEDDINGS).2.clone();
        let (shape, got) = &w.params["wpe.weight"];
        assert_eq!(shape, &vec![16, 32]);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, pos[i] + types[i % h], "{i}");
        }
        assert_eq!(w.notes.len(), 2, "{:?}", w.notes);
        assert!(w.notes[0].contains("row 0") && w.notes[1].contains("rows 1..2 are dropped"));
    }

    #[test]
    fn legacy_and_bertmodel_names_buffers_a_pooler_and_a_tied_decoder_are_accepted() {
        let cfg = tiny();
        let dir = folder("names");
        let mut t: Tensors = tensors(&cfg)
            .into_iter()
            .map(|(n, s, v)| {
                let n = n.replace("LayerNorm.weight", "LayerNorm.gamma");
                let n = n.replace("LayerNorm.bias", "LayerNorm.beta");
                (
                    n.strip_prefix("bert.").map_or(n.clone(), str::to_string),
                    s,
                    v,
                )
            })
            .collect();
        let table = t
            .iter()
            .find(|x| x.0 == "embeddings.word_embeddings.weight")
            .unwrap();
        let table = table.clone();
        t.push((DECODER_WEIGHT.into(), table.1.clone(), table.2.clone()));
        t.push((DECODER_BIAS.into(), vec![101], vec![0.0; 101]));
        t.push(("embeddings.position_ids".into(), vec![1, 16], vec![0.0; 16]));
        t.push(("pooler.dense.weight".into(), vec![32, 32], vec![1.0; 1024]));
        t.push(("cls.seq_relationship.bias".into(), vec![2], vec![1.0; 2]));
        let path = write(&dir, &t, "F32");
        write_json(&dir, &hf_bert_config(&cfg));
        let w = read_hf_bert(&path, &cfg).unwrap();
        assert_eq!(w.params["wte.embedding.weight"].1, table.2);
        let ln = t
            .iter()
            .find(|x| x.0 == "encoder.layer.1.output.LayerNorm.beta")
            .unwrap();
        assert_eq!(w.params["layers.1.ln_2.beta"].1, ln.2);
        assert_eq!(w.notes.len(), 1, "{:?}", w.notes);
        assert!(
            w.notes[0].contains("cls.seq_relationship.bias, pooler.dense.weight skipped"),
            "{:?}",
            w.notes
        );

        // An untied decoder, a non-zero decoder bias, a name twice.
        let k = t.iter().position(|x| x.0 == DECODER_WEIGHT).unwrap();
        t[k].2[5] += 1.0;
        let path = write(&dir, &t, "F32");
        let e = read_hf_bert(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("names/model.safetensors")
                && e.contains("tensor cls.predictions.decoder.weight: differs"),
            "{e}"
        );
        t[k].2[5] -= 1.0;
        find(&mut t, DECODER_BIAS).2[7] = 0.25;
        let path = write(&dir, &t, "F32");
        let e = read_hf_bert(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("tensor cls.predictions.decoder.bias: holds 0.25 at index 7"),
            "{e}"
        );
        find(&mut t, DECODER_BIAS).2[7] = 0.0;
        t.push((
            "bert.embeddings.LayerNorm.weight".into(),
            vec![32],
            vec![1.0; 32],
        ));
        let path = write(&dir, &t, "F32");
        let e = read_hf_bert(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("the same tensor twice"), "{e}");
    }

    #[test]
    fn what_merak_lacks_is_refused_when_not_neutral() {
        let e = refusal("bias", |t| find(t, OUTPUT_BIAS).2[3] = -0.5, |_| {});
        assert!(
            e.contains("bias/model.safetensors")
                && e.contains("tensor cls.predictions.bias: holds -0.5 at index 3, not 0")
                && e.contains("no output bias"),
            "{e}"
        );
        // An untied decoder the file does not hold.
        let e = refusal(
            "untied",
            |_| {},
            |j| j["tie_word_embeddings"] = false.into(),
        );
        assert!(
            e.contains("tensor cls.predictions.decoder.weight is missing")
                && e.contains("tie_word_embeddings = false"),
            "{e}"
        );
    }

    #[test]
    fn computation_differences_in_config_json_are_refused_naming_the_key() {
        let cases: [(&str, serde_json::Value, &str); 10] = [
            ("hidden_act", "gelu_new".into(), "exact (erf) GELU"),
            (
                "layer_norm_eps",
                1e-5.into(),
                "model.layer_norm_eps = 1e-12",
            ),
            ("position_embedding_type", "relative_key".into(), "absolute"),
            ("is_decoder", true.into(), "bidirectional encoder"),
            ("model_type", "roberta".into(), "BertForMaskedLM"),
            ("num_attention_heads", 2.into(), "model.heads = 4"),
            ("intermediate_size", 64.into(), "4 * model.hidden = 128"),
            ("hidden_size", "32".into(), "model.hidden = 32"),
            (
                "vocab_size",
                200.into(),
                "model.vocab_size = 101 (the file's vocabulary may be smaller",
            ),
            ("type_vocab_size", 0.into(), "at least 1 row"),
        ];
        for (key, value, want) in cases {
            let shown = value.to_string();
            let e = refusal("config", |_| {}, |j| j[key] = value);
            assert!(
                e.contains("config/config.json")
                    && e.contains(&format!("`{key}` is {shown}"))
                    && e.contains(want),
                "{key}: {e}"
            );
        }
        // An absent key is BertConfig's default, named as such.
        let e = refusal(
            "config-default",
            |_| {},
            |j| {
                j.as_object_mut().unwrap().remove("num_hidden_layers");
            },
        );
        assert!(e.contains("`num_hidden_layers` is 12 (the default)"), "{e}");
        // gelu_python is the exact GELU too.
        let dir = folder("gelu-python");
        let path = write(&dir, &tensors(&tiny()), "F32");
        let mut json = hf_bert_config(&tiny());
        json["hidden_act"] = "gelu_python".into();
        write_json(&dir, &json);
        read_hf_bert(&path, &tiny()).unwrap();
        // Without config.json, or with one that is not JSON.
        std::fs::remove_file(dir.join("config.json")).unwrap();
        let e = read_hf_bert(&path, &tiny()).unwrap_err().to_string();
        assert!(e.contains("gelu-python/config.json: missing"), "{e}");
        std::fs::write(dir.join("config.json"), "{\"hidden_size\": 3").unwrap();
        let e = read_hf_bert(&path, &tiny()).unwrap_err().to_string();
        assert!(e.contains("config.json: not valid JSON"), "{e}");
    }

    #[test]
    fn mismatched_tensors_are_refused_naming_the_file_the_tensor_and_both_shapes() {
        let fc = "bert.encoder.layer.1.intermediate.dense.weight";
        let e = refusal(
            "shape",
            |t| {
                let x = find(t, fc);
                x.1 = vec![64, 32];
                x.2.truncate(64 * 32);
            },
            |_| {},
        );
        assert!(
            e.contains("shape/model.safetensors")
                && e.contains(&format!("tensor {fc} has shape [64, 32]"))
                && e.contains("expects [128, 32]"),
            "{e}"
        );
        let ln = "bert.encoder.layer.0.output.LayerNorm.bias";
        let e = refusal("missing", |t| t.retain(|x| x.0 != ln), |_| {});
        assert!(e.contains(&format!("tensor {ln} is missing")), "{e}");
        // A file of three layers for a model of two (config.json edited to match).
        let three = BertConfig {
            layers: 3,
            ..tiny()
        };
        let e = refusal("layers", |t| *t = tensors(&three), |_| {});
        assert!(
            e.contains("bert.encoder.layer.2.") && e.contains("2 layers"),
            "{e}"
        );
        let e = refusal(
            "unknown",
            |t| t.push(("bert.foo".into(), vec![1], vec![0.0])),
            |_| {},
        );
        assert!(
            e.contains("tensor bert.foo: not a tensor of BertForMaskedLM"),
            "{e}"
        );
        // NaN and infinity, named with the index.
        let q = "bert.encoder.layer.0.attention.self.query.bias";
        let e = refusal("nan", |t| find(t, q).2[9] = f32::NAN, |_| {});
        assert!(
            e.contains("nan/model.safetensors")
                && e.contains(&format!("tensor {q} holds NaN at index 9")),
            "{e}"
        );
        let e = refusal(
            "inf",
            |t| find(t, WORD_EMBEDDINGS).2[0] = f32::NEG_INFINITY,
            |_| {},
        );
        assert!(e.contains("holds -inf at index 0"), "{e}");
        // A truncated file.
        let dir = folder("truncated");
        let path = write(&dir, &tensors(&tiny()), "F32");
        write_json(&dir, &hf_bert_config(&tiny()));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let e = read_hf_bert(&path, &tiny()).unwrap_err().to_string();
        assert!(
            e.contains("truncated/model.safetensors: not a valid safetensors file"),
            "{e}"
        );
    }

    #[test]
    fn bf16_is_converted_and_other_dtypes_named() {
        let cfg = tiny();
        let dir = folder("dtypes");
        let t = tensors(&cfg);
        write_json(&dir, &hf_bert_config(&cfg));
        let path = write(&dir, &t, "BF16");
        let w = read_hf_bert(&path, &cfg).unwrap();
        let want = &t.iter().find(|x| x.0 == POSITION_EMBEDDINGS).unwrap().2;
        let e = w.params["wpe.weight"]
            .1
            .iter()
            .zip(want)
            .map(|(a, b)| ((a - b) / b.abs().max(1e-3)).abs())
            .fold(0.0f32, f32::max);
        assert!(e < 1e-2, "bf16 relative error {e}");
        let path = write(&dir, &t, "I32");
        let e = read_hf_bert(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("I32"), "{e}");
    }

    #[test]
    fn a_smaller_vocabulary_is_padded_and_longer_positions_cut() {
        let file_cfg = BertConfig {
            vocab_size: 90,
            seq_len: 20,
            mask_token_id: 89,
            ..tiny()
        };
        let cfg = tiny();
        let dir = folder("sizes");
        let t = tensors(&file_cfg);
        let path = write(&dir, &t, "F32");
        write_json(&dir, &hf_bert_config(&file_cfg));
        let w = read_hf_bert(&path, &cfg).unwrap();
        let (shape, table) = &w.params["wte.embedding.weight"];
        assert_eq!(shape, &vec![101, 32]);
        assert_eq!(&table[..90 * 32], &t[0].2[..]);
        assert!(table[90 * 32..].iter().all(|&x| x == 0.0));
        let (shape, pos) = &w.params["wpe.weight"];
        assert_eq!(shape, &vec![16, 32]);
        assert_eq!(&pos[..], &t[1].2[..16 * 32]);
        assert_eq!(w.notes.len(), 2, "{:?}", w.notes);
        // Fewer positions than the model's are refused.
        let e = read_hf_bert(
            &path,
            &BertConfig {
                seq_len: 24,
                ..tiny()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`max_position_embeddings` is 20") && e.contains("model.seq_len = 24"),
            "{e}"
        );
    }

    merak_tests::cap_allocations!();

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 100,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// An imported file is untrusted: random bytes, and a valid BERT file with a byte
        /// changed or cut short, give weights or an error naming the file, never a panic.
        #[test]
        fn damaged_files_give_an_error_not_a_panic(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            at in 0usize..8192,
            byte in proptest::prelude::any::<u8>(),
            cut in 0usize..64,
        ) {
            let cfg = tiny();
            let dir = folder("proptest");
            write_json(&dir, &hf_bert_config(&cfg));
            let path = dir.join("model.safetensors");
            std::fs::write(&path, &noise).unwrap();
            proptest::prop_assert!(read_hf_bert(&path, &cfg).is_err());
            let valid = std::fs::read(write(&dir, &tensors(&cfg), "F32")).unwrap();
            let mut edited = valid.clone();
            let i = at % edited.len();
            edited[i] = byte;
            std::fs::write(&path, &edited).unwrap();
            if let Err(e) = read_hf_bert(&path, &cfg) {
                proptest::prop_assert!(e.to_string().contains("model.safetensors"), "{}", e);
            }
            edited.truncate(valid.len().saturating_sub(cut + 1));
            std::fs::write(&path, &edited).unwrap();
            proptest::prop_assert!(read_hf_bert(&path, &cfg).is_err());
        }

        /// config.json values of any JSON type or size are refused naming the key, or
        /// accepted, never a panic.
        #[test]
        fn any_config_value_gives_an_answer(
            key in proptest::sample::select(vec!["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "tie_word_embeddings", "model_type", "is_decoder"]),
            value in proptest::sample::select(vec![
                serde_json::json!(null), serde_json::json!(-1), serde_json::json!(0),
                serde_json::json!(u64::MAX), serde_json::json!(1e300), serde_json::json!("x"),
                serde_json::json!([1]), serde_json::json!({"a": 1}), serde_json::json!(true),
                serde_json::json!(f64::MIN_POSITIVE),
            ]),
        ) {
            let dir = folder("proptest-config");
            let path = write(&dir, &tensors(&tiny()), "F32");
            let mut json = hf_bert_config(&tiny());
            json[key] = value;
            write_json(&dir, &json);
            if let Err(e) = read_hf_bert(&path, &tiny()) {
                proptest::prop_assert!(e.to_string().contains(key), "{}", e);
            }
        }
    }
}
