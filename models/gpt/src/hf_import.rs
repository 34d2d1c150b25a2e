//! Pretrained GPT-2 weights from a Hugging Face safetensors file, as the full-size parameters
//! of a merak GPT (what `merak train --init-from` starts from).
//!
//! The file is what `GPT2LMHeadModel.save_pretrained` or `merak export` writes: tensors named
//! `transformer.*` (or without that prefix, as `GPT2Model` saves them), in F32, F16, BF16 or
//! F64 (converted to f32), with the model's `config.json` next to it. `lm_head.weight`, when
//! present, must equal the token table (merak's head is tied to it); the attention mask
//! buffers of older files (`h.N.attn.bias`, `h.N.attn.masked_bias`) are skipped.
//!
//! Every tensor is checked against the model's config before anything is returned: an
//! unknown, missing, duplicated or misshapen tensor, an unsupported dtype or a `config.json`
//! describing another shape is an error naming the file, the tensor (or key) and both
//! shapes. Two differences in size are bridged, with a note: a token table with fewer rows
//! than `model.vocab_size` is padded with zero rows (a vocabulary rounded up, as nanoGPT's
//! 50,304), and a position table with more rows than `model.seq_len` keeps its first
//! `seq_len` rows (training on shorter sequences than the original model). The padding that
//! tensor parallelism adds to the token table is not the business of this module: the full
//! tensors have `model.vocab_size` rows, and cutting them for a TP rank pads them.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use merak_burn::hf_files::{self, HfFileError};
use safetensors::tensor::TensorView;
use thiserror::Error;

use crate::GptConfig;
use crate::hf::{hf_gpt2_shapes, merak_gpt_name};

pub use merak_burn::entry::FullParams;

/// The pretrained weights of a GPT-2 safetensors file, checked against a model config.
#[derive(Clone, Debug)]
pub struct HfGpt2Weights {
    /// Every parameter of the model (all pipeline stages, at full size, without the tied
    /// head copy), by merak name.
    pub params: FullParams,
    /// Differences that do not stop the import but that the user should know about (the token
    /// table padded, the position table cut, another activation or LayerNorm epsilon in
    /// `config.json`, no `config.json` to check the head count against).
    pub notes: Vec<String>,
}

/// A GPT-2 file that does not fit the model; every variant names the file.
#[derive(Debug, Error)]
pub enum HfImportError {
    /// The file (or `config.json`) cannot be read, is not a valid safetensors (or JSON) file,
    /// or holds a tensor of an element type that is not converted (F32, F16, BF16 and F64
    /// are).
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
        /// What the model's config needs, with the setting that holds it.
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
        /// The model's sizes (`model.hidden = 64, ...`).
        model: String,
    },
    /// A parameter of the model has no tensor in the file.
    #[error("{}: tensor {tensor} is missing (the model has {model})", path.display())]
    Missing {
        /// The `GPT2LMHeadModel` name of the missing tensor.
        tensor: String,
        /// The file.
        path: PathBuf,
        /// The model's sizes.
        model: String,
    },
    /// The model has a mixture of experts (`[model.moe]`), which a GPT-2 file has no tensors
    /// for.
    #[error(
        "{}: the model is a mixture of experts (model.moe: {experts} experts in blocks {blocks}), \
         but GPT-2's format has dense MLPs only: the file holds no router and no experts for \
         those blocks; --init-from loads GPT-2 weights into a dense GPT (without [model.moe])",
        path.display()
    )]
    MixtureOfExperts {
        /// The file.
        path: PathBuf,
        /// Routed experts per mixture-of-experts block (`model.moe.experts`).
        experts: usize,
        /// The blocks with experts, listed.
        blocks: String,
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

/// The model's sizes, for error messages.
fn describe(cfg: &GptConfig) -> String {
    format!(
        "model.vocab_size = {}, model.layers = {}, model.heads = {}, model.hidden = {}, model.seq_len = {}",
        cfg.vocab_size, cfg.layers, cfg.heads, cfg.hidden, cfg.seq_len
    )
}

/// Reads the GPT-2 safetensors file at `path` (and the `config.json` in its folder, when there
/// is one) and checks it against `cfg`: the full-size parameters of the model, by merak name.
pub fn read_hf_gpt2(path: &Path, cfg: &GptConfig) -> Result<HfGpt2Weights, HfImportError> {
    refuse_experts(path, cfg)?;
    let mut notes = Vec::new();
    let config_path = hf_files::folder_of(path).join("config.json");
    match hf_files::read_config(&config_path)? {
        Some(json) => notes.extend(check_hf_gpt2_config(&json, &config_path, cfg)?),
        None => notes.push(format!(
            "no config.json next to {}: the head count (model.heads = {}) cannot be checked against the file",
            path.display(),
            cfg.heads
        )),
    }
    let bytes = hf_files::read_weights(path)?;
    let params = decode_hf_gpt2(&bytes, path, cfg, &mut notes)?;
    Ok(HfGpt2Weights { params, notes })
}

/// Refuses a model with a mixture of experts (`cfg.moe`): a GPT-2 file (`path`) has none.
fn refuse_experts(path: &Path, cfg: &GptConfig) -> Result<(), HfImportError> {
    let Some(moe) = &cfg.moe else {
        return Ok(());
    };
    let blocks: Vec<String> = (0..cfg.layers)
        .filter(|&i| moe.is_moe_layer(i))
        .map(|i| i.to_string())
        .collect();
    let mut listed = blocks[..blocks.len().min(6)].join(", ");
    if blocks.len() > 6 {
        listed += &format!(", ... ({} blocks)", blocks.len());
    }
    Err(HfImportError::MixtureOfExperts {
        path: path.to_path_buf(),
        experts: moe.experts,
        blocks: listed,
    })
}

/// A `config.json` value as an integer; absent keys take `GPT2Config`'s defaults.
fn int_of(json: &serde_json::Value, key: &str, default: u64) -> Option<u64> {
    match json.get(key) {
        None | Some(serde_json::Value::Null) => Some(default),
        Some(v) => v.as_u64(),
    }
}

/// The refusal of `key` of the `config.json` at `path`: its value in the `file` against what
/// the `model` needs.
fn mismatch(path: &Path, key: &str, file: String, model: String) -> HfImportError {
    HfImportError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        file,
        model,
    }
}

/// The sizes `config.json` must agree on: `(key, GPT2Config's default, what the model needs,
/// its setting, how they may differ)`.
fn size_checks(cfg: &GptConfig) -> [(&'static str, u64, u64, &'static str, Ordering); 5] {
    [
        (
            "n_embd",
            768,
            cfg.hidden as u64,
            "model.hidden",
            Ordering::Equal,
        ),
        (
            "n_layer",
            12,
            cfg.layers as u64,
            "model.layers",
            Ordering::Equal,
        ),
        (
            "n_head",
            12,
            cfg.heads as u64,
            "model.heads",
            Ordering::Equal,
        ),
        (
            "vocab_size",
            50257,
            cfg.vocab_size as u64,
            "model.vocab_size",
            Ordering::Less,
        ),
        (
            "n_positions",
            1024,
            cfg.seq_len as u64,
            "model.seq_len",
            Ordering::Greater,
        ),
    ]
}

/// Checks the sizes of [`size_checks`] in order, then `n_inner`, refusing the first that
/// does not fit the model.
fn check_sizes(
    json: &serde_json::Value,
    path: &Path,
    cfg: &GptConfig,
) -> Result<(), HfImportError> {
    for (key, default, model, setting, may) in size_checks(cfg) {
        let file = int_of(json, key, default);
        if file.is_some_and(|f| f.cmp(&model) == Ordering::Equal || f.cmp(&model) == may) {
            continue;
        }
        let shown = json
            .get(key)
            .map_or_else(|| format!("{default} (the default)"), |v| v.to_string());
        let bound = match may {
            Ordering::Less => " (the file's vocabulary may be smaller, not larger)",
            Ordering::Greater => " (the file may have more positions, not fewer)",
            Ordering::Equal => "",
        };
        return Err(mismatch(
            path,
            key,
            shown,
            format!("{setting} = {model}{bound}"),
        ));
    }
    let width = (cfg.hidden as u64).saturating_mul(4);
    if let Some(inner) = json.get("n_inner").filter(|v| !v.is_null())
        && inner.as_u64() != Some(width)
    {
        return Err(mismatch(
            path,
            "n_inner",
            inner.to_string(),
            format!("an MLP of width 4 * model.hidden = {width}"),
        ));
    }
    Ok(())
}

/// Notes on what `config.json` computes differently from merak's GPT (activation, LayerNorm
/// epsilon, attention scaling).
fn computation_notes(json: &serde_json::Value, path: &Path, cfg: &GptConfig) -> Vec<String> {
    let mut notes = Vec::new();
    let act = json
        .get("activation_function")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("gelu_new");
    if act != "gelu" {
        notes.push(format!(
            "{}: activation_function = {act:?}; merak's MLP uses the exact GELU (\"gelu\"), so the model computes slightly different outputs than the original",
            path.display()
        ));
    }
    if let Some(eps) = json
        .get("layer_norm_epsilon")
        .and_then(serde_json::Value::as_f64)
        && eps != cfg.layer_norm_eps
    {
        notes.push(format!(
            "{}: layer_norm_epsilon = {eps}, the model uses model.layer_norm_eps = {}",
            path.display(),
            cfg.layer_norm_eps
        ));
    }
    let flag = |key: &str, default: bool| {
        json.get(key)
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(default)
    };
    if !flag("scale_attn_weights", true) {
        notes.push(format!(
            "{}: scale_attn_weights = false; merak scales attention scores by 1/sqrt(head size)",
            path.display()
        ));
    }
    if flag("scale_attn_by_inverse_layer_idx", false) {
        notes.push(format!(
            "{}: scale_attn_by_inverse_layer_idx = true; merak does not scale by the layer index",
            path.display()
        ));
    }
    notes
}

/// Checks a GPT-2 `config.json` (at `path`, for messages) against `cfg`. Sizes that change
/// the model's shape must agree (the vocabulary and the positions may be smaller and larger,
/// see the module documentation); differences in computation (activation, LayerNorm epsilon,
/// attention scaling) are returned as notes.
pub fn check_hf_gpt2_config(
    json: &serde_json::Value,
    path: &Path,
    cfg: &GptConfig,
) -> Result<Vec<String>, HfImportError> {
    if let Some(kind) = json.get("model_type").and_then(serde_json::Value::as_str)
        && kind != "gpt2"
    {
        return Err(mismatch(
            path,
            "model_type",
            format!("{kind:?}"),
            "\"gpt2\" (merak's GPT is GPT-2)".into(),
        ));
    }
    check_sizes(json, path, cfg)?;
    Ok(computation_notes(json, path, cfg))
}

/// Whether `name` (with the `transformer.` prefix) is one of GPT-2's attention mask buffers.
fn is_mask_buffer(name: &str) -> bool {
    name.strip_prefix("transformer.h.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(layer, rest)| {
            layer.parse::<usize>().is_ok() && (rest == "attn.bias" || rest == "attn.masked_bias")
        })
}

/// The refusal of tensor `tensor` of the file at `path`, for `reason`.
fn unexpected(path: &Path, tensor: &str, reason: String) -> HfImportError {
    HfImportError::Unexpected {
        path: path.to_path_buf(),
        tensor: tensor.into(),
        reason,
    }
}

/// The tensors of a file by canonical name (with `transformer.`): `(name in the file, view)`.
type Found<'a> = HashMap<String, (String, TensorView<'a>)>;

/// Collects the tensors of the file (`bytes`, read from `path`) by canonical name, refusing
/// an unknown tensor (not in `expected`) or one held twice; the mask buffers are ignored, and
/// `lm_head.weight` is returned apart.
fn collect_tensors<'a>(
    bytes: &'a [u8],
    path: &Path,
    cfg: &GptConfig,
    expected: &[(String, Vec<usize>)],
) -> Result<(Found<'a>, Option<TensorView<'a>>), HfImportError> {
    let mut found: Found<'a> = HashMap::new();
    let mut lm_head = None;
    for (name, view) in hf_files::tensor_views(bytes, path)? {
        if name == "lm_head.weight" {
            lm_head = Some(view);
            continue;
        }
        let canonical = if name.starts_with("transformer.") {
            name.clone()
        } else {
            format!("transformer.{name}")
        };
        if is_mask_buffer(&canonical) {
            continue;
        }
        if !expected.iter().any(|(n, _)| *n == canonical) {
            let reason = match merak_gpt_name(&canonical) {
                Some(_) => format!(
                    "the model has {} blocks (model.layers), the file has more",
                    cfg.layers
                ),
                None => "not a tensor of GPT2LMHeadModel".into(),
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
    Ok((found, lm_head))
}

/// Decodes a GPT-2 safetensors file (`bytes`, read from `path`) and checks every tensor
/// against `cfg`; differences that are bridged are added to `notes`.
pub fn decode_hf_gpt2(
    bytes: &[u8],
    path: &Path,
    cfg: &GptConfig,
    notes: &mut Vec<String>,
) -> Result<FullParams, HfImportError> {
    refuse_experts(path, cfg)?;
    let expected = hf_gpt2_shapes(cfg);
    let (found, lm_head) = collect_tensors(bytes, path, cfg, &expected)?;
    let model = describe(cfg);
    let mut params = FullParams::new();
    for (hf, want) in &expected {
        let Some((name, view)) = found.get(hf) else {
            return Err(HfImportError::Missing {
                tensor: hf.clone(),
                path: path.to_path_buf(),
                model: model.clone(),
            });
        };
        let shape = view.shape().to_vec();
        let misshapen = || HfImportError::Shape {
            path: path.to_path_buf(),
            tensor: name.clone(),
            file: shape.clone(),
            expected: want.clone(),
            model: model.clone(),
        };
        let is_table = hf == "transformer.wte.weight";
        let is_positions = hf == "transformer.wpe.weight";
        match (shape.as_slice(), want.as_slice()) {
            ([rows, cols], [v, h]) if is_table && cols == h && rows <= v => {}
            ([rows, cols], [s, h]) if is_positions && cols == h && rows >= s => {}
            _ if shape == *want => {}
            _ => return Err(misshapen()),
        }
        let mut values = hf_files::to_f32(view, path, name)?;
        let row = want[1..].iter().product::<usize>();
        if is_table {
            if let Some(head) = &lm_head {
                check_tied_head(head, &shape, &values, path)?;
            }
            if shape[0] < want[0] {
                notes.push(format!(
                    "{}: {name} has {} rows, padded with zero rows to model.vocab_size = {}",
                    path.display(),
                    shape[0],
                    want[0]
                ));
            }
        }
        if is_positions && shape[0] > want[0] {
            notes.push(format!(
                "{}: {name} has {} positions, the first model.seq_len = {} are used",
                path.display(),
                shape[0],
                want[0]
            ));
        }
        values.resize(want[0] * row, 0.0);
        let ours =
            merak_gpt_name(hf).ok_or_else(|| unexpected(path, name, "no merak name".into()))?;
        params.insert(ours, (want.clone(), values));
    }
    Ok(params)
}

/// Checks that `lm_head.weight` (`head`) is the token table of the file (`shape`, `values`).
fn check_tied_head(
    head: &TensorView<'_>,
    shape: &[usize],
    values: &[f32],
    path: &Path,
) -> Result<(), HfImportError> {
    const NAME: &str = "lm_head.weight";
    if head.shape() != shape {
        return Err(HfImportError::Shape {
            path: path.to_path_buf(),
            tensor: NAME.into(),
            file: head.shape().to_vec(),
            expected: shape.to_vec(),
            model: "its output head is the token table".into(),
        });
    }
    if hf_files::to_f32(head, path, NAME)? != values {
        return Err(HfImportError::Unexpected {
            path: path.to_path_buf(),
            tensor: NAME.into(),
            reason: "differs from the token table: merak's output head is tied to the token \
                     embedding, so an untied head cannot be loaded"
                .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::hf_gpt2_config;

    fn tiny() -> GptConfig {
        GptConfig::preset("tiny").unwrap()
    }

    use merak_tests::fresh_folder as folder;

    /// Distinct values for every tensor of a GPT-2 of shape `cfg`: (name, shape, values).
    fn tensors(cfg: &GptConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        hf_gpt2_shapes(cfg)
            .into_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let n: usize = shape.iter().product();
                let values = (0..n).map(|i| k as f32 + i as f32 / 1024.0).collect();
                (name, shape, values)
            })
            .collect()
    }

    /// Writes `tensors` as `dtype` (F32, F16, BF16 or I32 from the f32 values) into
    /// `dir/model.safetensors`.
    fn write(dir: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: &str) -> PathBuf {
        let path = dir.join("model.safetensors");
        std::fs::write(&path, merak_tests::safetensors_file(tensors, dtype)).unwrap();
        path
    }

    fn write_config(dir: &Path, cfg: &GptConfig) {
        let json = serde_json::to_vec(&hf_gpt2_config(cfg)).unwrap();
        std::fs::write(dir.join("config.json"), json).unwrap();
    }

    #[test]
    fn every_tensor_comes_back_by_merak_name() {
        let cfg = tiny();
        let dir = folder("roundtrip");
        let t = tensors(&cfg);
        let path = write(&dir, &t, "F32");
        write_config(&dir, &cfg);
        let w = read_hf_gpt2(&path, &cfg).unwrap();
        assert!(w.notes.is_empty(), "{:?}", w.notes);
        assert_eq!(w.params.len(), t.len());
        for (hf, shape, values) in &t {
            let ours = merak_gpt_name(hf).unwrap();
            assert_eq!(w.params[&ours], (shape.clone(), values.clone()), "{hf}");
        }
        // Without config.json the head count cannot be checked: a note says so.
        std::fs::remove_file(dir.join("config.json")).unwrap();
        let w = read_hf_gpt2(&path, &cfg).unwrap();
        assert!(w.notes[0].contains("no config.json"), "{:?}", w.notes);
    }

    #[test]
    fn a_model_with_experts_is_refused_naming_model_moe_and_its_blocks() {
        let dense = tiny();
        let dir = folder("moe");
        let path = write(&dir, &tensors(&dense), "F32");
        let mut cfg = tiny();
        let moe = serde_json::json!({"experts": 4, "top_k": 2, "expert_hidden": 8, "every": 2});
        cfg.moe = Some(serde_json::from_value(moe).unwrap());
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors")
                && e.contains("model.moe: 4 experts in blocks 1)")
                && e.contains("no router"),
            "{e}"
        );
    }

    #[test]
    fn gpt2model_names_mask_buffers_and_a_tied_head_are_accepted() {
        let cfg = tiny();
        let dir = folder("gpt2model");
        let mut t: Vec<_> = tensors(&cfg)
            .into_iter()
            .map(|(n, s, v)| (n.trim_start_matches("transformer.").to_string(), s, v))
            .collect();
        let wte = t.iter().find(|x| x.0 == "wte.weight").unwrap().clone();
        t.push(("lm_head.weight".into(), wte.1.clone(), wte.2.clone()));
        t.push(("h.0.attn.bias".into(), vec![1, 1, 2, 2], vec![1.0; 4]));
        let path = write(&dir, &t, "F32");
        let w = read_hf_gpt2(&path, &cfg).unwrap();
        assert_eq!(w.params["wte.embedding.weight"].1, wte.2);

        // An untied head is refused.
        let last = t.len() - 2;
        t[last].2[0] += 1.0;
        let path = write(&dir, &t, "F32");
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight") && e.contains("tied"), "{e}");
    }

    #[test]
    fn bf16_and_f16_are_converted_and_other_dtypes_named() {
        let cfg = tiny();
        let dir = folder("dtypes");
        let t = tensors(&cfg);
        for dtype in ["BF16", "F16"] {
            let path = write(&dir, &t, dtype);
            let w = read_hf_gpt2(&path, &cfg).unwrap();
            let (_, values) = &w.params["wpe.weight"];
            let want = &t
                .iter()
                .find(|x| x.0 == "transformer.wpe.weight")
                .unwrap()
                .2;
            let e = values
                .iter()
                .zip(want)
                .map(|(a, b)| ((a - b) / b.abs().max(1e-3)).abs())
                .fold(0.0f32, f32::max);
            assert!(e < 1e-2, "{dtype} relative error {e}");
        }

        let path = write(&dir, &t, "I32");
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("I32"), "{e}");
    }

    #[test]
    fn mismatches_name_the_file_the_tensor_and_both_shapes() {
        let cfg = tiny();
        let dir = folder("mismatch");
        let mut t = tensors(&cfg);
        let k = t
            .iter()
            .position(|x| x.0 == "transformer.h.1.mlp.c_fc.weight")
            .unwrap();
        t[k].1 = vec![64, 128];
        t[k].2.truncate(64 * 128);
        let path = write(&dir, &t, "F32");
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors")
                && e.contains("transformer.h.1.mlp.c_fc.weight")
                && e.contains("[64, 128]")
                && e.contains("[64, 256]"),
            "{e}"
        );

        let mut t = tensors(&cfg);
        t.retain(|x| x.0 != "transformer.h.0.ln_2.bias");
        let path = write(&dir, &t, "F32");
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("transformer.h.0.ln_2.bias") && e.contains("missing"),
            "{e}"
        );

        // A file of three blocks for a model of two.
        let three = GptConfig {
            layers: 3,
            ..tiny()
        };
        let path = write(&dir, &tensors(&three), "F32");
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("transformer.h.2.") && e.contains("2 blocks"),
            "{e}"
        );

        // config.json of another head count: the shapes agree, the key is named.
        let path = write(&dir, &tensors(&cfg), "F32");
        write_config(&dir, &GptConfig { heads: 2, ..tiny() });
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("n_head") && e.contains("model.heads = 4"),
            "{e}"
        );

        std::fs::remove_file(dir.join("config.json")).unwrap();
        std::fs::write(&path, b"not safetensors").unwrap();
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("safetensors"),
            "{e}"
        );
    }

    #[test]
    fn a_smaller_vocabulary_is_padded_and_longer_positions_cut() {
        let file_cfg = GptConfig {
            vocab_size: 500,
            seq_len: 40,
            ..tiny()
        };
        let cfg = tiny();
        let dir = folder("sizes");
        let t = tensors(&file_cfg);
        let path = write(&dir, &t, "F32");
        let mut json = hf_gpt2_config(&file_cfg);
        json["activation_function"] = "gelu_new".into();
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        let w = read_hf_gpt2(&path, &cfg).unwrap();
        let (shape, table) = &w.params["wte.embedding.weight"];
        assert_eq!(shape, &vec![512, 64]);
        let file_table = &t[0].2;
        assert_eq!(&table[..500 * 64], &file_table[..]);
        assert!(table[500 * 64..].iter().all(|&x| x == 0.0));
        let (shape, pos) = &w.params["wpe.weight"];
        assert_eq!(shape, &vec![32, 64]);
        assert_eq!(&pos[..], &t[1].2[..32 * 64]);
        assert_eq!(w.notes.len(), 3, "{:?}", w.notes);
        assert!(w.notes.iter().any(|n| n.contains("gelu_new")));

        // A larger vocabulary than the model's is refused.
        let e = read_hf_gpt2(
            &path,
            &GptConfig {
                vocab_size: 400,
                ..tiny()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("config.json")
                && e.contains("`vocab_size` is 500")
                && e.contains("model.vocab_size = 400"),
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

        /// An imported file is untrusted: random bytes, and a valid GPT-2 file with a few bytes
        /// changed (in the header's sizes, offsets and shapes, or in the data), give weights or
        /// an error naming the file, never a panic.
        #[test]
        fn damaged_files_give_an_error_not_a_panic(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            at in 0usize..4096,
            byte in proptest::prelude::any::<u8>(),
            cut in 0usize..64,
        ) {
            let cfg = tiny();
            let dir = folder("proptest");
            let path = dir.join("model.safetensors");
            std::fs::write(&path, &noise).unwrap();
            let _ = read_hf_gpt2(&path, &cfg);
            let valid = std::fs::read(write(&dir, &tensors(&cfg), "F32")).unwrap();
            let mut edited = valid.clone();
            let i = at % edited.len();
            edited[i] = byte;
            std::fs::write(&path, &edited).unwrap();
            let _ = read_hf_gpt2(&path, &cfg);
            // A file cut short: the header claims more bytes than the file holds.
            edited.truncate(valid.len().saturating_sub(cut + 1));
            std::fs::write(&path, &edited).unwrap();
            proptest::prop_assert!(read_hf_gpt2(&path, &cfg).is_err());
        }
    }
}
