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

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use thiserror::Error;

use crate::GptConfig;
use crate::hf::{hf_gpt2_shapes, merak_gpt_name};

pub use merak_burn::session::FullParams;

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
    /// Reading the file failed.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// The file is not a valid safetensors file (or `config.json` not valid JSON).
    #[error("{}: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
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
    /// A tensor of an element type that is not converted.
    #[error(
        "{}: tensor {tensor} is {dtype}; F32, F16, BF16 and F64 tensors can be loaded",
        path.display()
    )]
    Dtype {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Its element type.
        dtype: String,
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
    let mut notes = Vec::new();
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let config_path = folder.join("config.json");
    match read_config(&config_path)? {
        Some(json) => notes.extend(check_hf_gpt2_config(&json, &config_path, cfg)?),
        None => notes.push(format!(
            "no config.json next to {}: the head count (model.heads = {}) cannot be checked against the file",
            path.display(),
            cfg.heads
        )),
    }
    regular_file(path, u64::MAX)?;
    let bytes = std::fs::read(path).map_err(io(path))?;
    let params = decode_hf_gpt2(&bytes, path, cfg, &mut notes)?;
    Ok(HfGpt2Weights { params, notes })
}

/// The error of an I/O failure on `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HfImportError {
    let path = path.to_path_buf();
    move |error| HfImportError::Io { path, error }
}

/// The largest `config.json` read (GPT-2's is under 1 KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest safetensors header read (the safetensors crate's limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The size of `path` if it is a regular file (or a link to one) of at most `max` bytes:
/// anything else (a FIFO, a device, a folder) is refused before it is opened.
fn regular_file(path: &Path, max: u64) -> Result<u64, HfImportError> {
    let m = std::fs::metadata(path).map_err(io(path))?;
    let reason = if !m.is_file() {
        "not a regular file (a folder, a FIFO or a device?)".to_string()
    } else if m.len() > max {
        format!("{} bytes, more than the {max} read", m.len())
    } else {
        return Ok(m.len());
    };
    Err(HfImportError::Format {
        path: path.to_path_buf(),
        reason,
    })
}

/// `config.json` at `path` as JSON, `None` if there is none.
fn read_config(path: &Path) -> Result<Option<serde_json::Value>, HfImportError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(path)(e)),
        Ok(_) => {}
    }
    regular_file(path, MAX_CONFIG_BYTES)?;
    let text = std::fs::read(path).map_err(io(path))?;
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| HfImportError::Format {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// Checks the numbers of a safetensors file's header against the file's size before the
/// safetensors crate uses them: the header length, and each tensor's data offsets and element
/// count (the crate adds the last offset to the header length unchecked).
fn check_layout(bytes: &[u8], path: &Path) -> Result<(), HfImportError> {
    let bad = |reason: String| HfImportError::Format {
        path: path.to_path_buf(),
        reason: format!("not a valid safetensors file: {reason}"),
    };
    let file = bytes.len() as u64;
    let Some(length) = bytes.first_chunk::<8>() else {
        return Err(bad(format!(
            "{file} bytes, too short for a safetensors file (it starts with an 8-byte header length)"
        )));
    };
    let n = u64::from_le_bytes(*length);
    let room = file - 8;
    if n > room || n > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "the header claims {n} bytes, but {room} follow its 8-byte length (at most \
             {MAX_HEADER_BYTES} are read): cut short or not a safetensors file"
        )));
    }
    let header = &bytes[8..8 + n as usize];
    // A header that is not a JSON object is named by the safetensors crate.
    let Ok(tensors) = serde_json::from_slice::<HashMap<String, serde_json::Value>>(header) else {
        return Ok(());
    };
    let data = room - n;
    for (name, info) in tensors.iter().filter(|(name, _)| *name != "__metadata__") {
        check_tensor_layout(name, info, data).map_err(bad)?;
    }
    Ok(())
}

/// Checks that tensor `name` of a header (`info`) lies within the `data` bytes after it:
/// offsets in order and inside, no more elements than bits.
fn check_tensor_layout(name: &str, info: &serde_json::Value, data: u64) -> Result<(), String> {
    let numbers = |key: &str| -> Option<Vec<u64>> {
        let list = info.get(key)?.as_array()?;
        list.iter().map(serde_json::Value::as_u64).collect()
    };
    if let Some([start, end]) = numbers("data_offsets").as_deref()
        && (start > end || *end > data)
    {
        return Err(format!(
            "tensor {name}: data_offsets [{start}, {end}] lie outside the {data} bytes of data after the header"
        ));
    }
    if let Some(shape) = numbers("shape") {
        let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if elements.is_none_or(|n| n / 8 > data) {
            return Err(format!(
                "tensor {name}: shape {shape:?} has more elements than the {data} bytes of data after the header hold"
            ));
        }
    }
    Ok(())
}

/// A `config.json` value as an integer; absent keys take `GPT2Config`'s defaults.
fn int_of(json: &serde_json::Value, key: &str, default: u64) -> Option<u64> {
    match json.get(key) {
        None | Some(serde_json::Value::Null) => Some(default),
        Some(v) => v.as_u64(),
    }
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
    let mismatch = |key: &str, file: String, model: String| HfImportError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        file,
        model,
    };
    if let Some(kind) = json.get("model_type").and_then(serde_json::Value::as_str)
        && kind != "gpt2"
    {
        return Err(mismatch(
            "model_type",
            format!("{kind:?}"),
            "\"gpt2\" (merak's GPT is GPT-2)".into(),
        ));
    }
    let h = cfg.hidden as u64;
    // (key, GPT2Config's default, what the model needs, its setting, how they may differ)
    let checks = [
        ("n_embd", 768, h, "model.hidden", Ordering::Equal),
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
    ];
    for (key, default, model, setting, may) in checks {
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
        return Err(mismatch(key, shown, format!("{setting} = {model}{bound}")));
    }
    let width = h.saturating_mul(4);
    if let Some(inner) = json.get("n_inner").filter(|v| !v.is_null())
        && inner.as_u64() != Some(width)
    {
        return Err(mismatch(
            "n_inner",
            inner.to_string(),
            format!("an MLP of width 4 * model.hidden = {width}"),
        ));
    }
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
    Ok(notes)
}

/// Whether `name` (with the `transformer.` prefix) is one of GPT-2's attention mask buffers.
fn is_mask_buffer(name: &str) -> bool {
    name.strip_prefix("transformer.h.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(layer, rest)| {
            layer.parse::<usize>().is_ok() && (rest == "attn.bias" || rest == "attn.masked_bias")
        })
}

/// Decodes a GPT-2 safetensors file (`bytes`, read from `path`) and checks every tensor
/// against `cfg`; differences that are bridged are added to `notes`.
pub fn decode_hf_gpt2(
    bytes: &[u8],
    path: &Path,
    cfg: &GptConfig,
    notes: &mut Vec<String>,
) -> Result<FullParams, HfImportError> {
    check_layout(bytes, path)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| HfImportError::Format {
        path: path.to_path_buf(),
        reason: format!("not a valid safetensors file: {e}"),
    })?;
    let unexpected = |tensor: &str, reason: String| HfImportError::Unexpected {
        path: path.to_path_buf(),
        tensor: tensor.into(),
        reason,
    };
    let expected = hf_gpt2_shapes(cfg);
    let mut found: HashMap<String, (String, TensorView<'_>)> = HashMap::new();
    let mut lm_head = None;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in tensors {
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
            return Err(unexpected(&name, reason));
        }
        if let Some((first, _)) = found.insert(canonical, (name.clone(), view)) {
            return Err(unexpected(
                &name,
                format!("the file also holds {first}: the same tensor twice"),
            ));
        }
    }
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
        let mut values = to_f32(view, path, name)?;
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
        let ours = merak_gpt_name(hf).ok_or_else(|| unexpected(name, "no merak name".into()))?;
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
    if to_f32(head, path, NAME)? != values {
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

/// An IEEE half-precision number as f32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let frac = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if frac == 0 => sign,
        0 => {
            // Subnormal: frac * 2^-24.
            let v = frac as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        0x1f => sign | 0x7f80_0000 | (frac << 13),
        _ => sign | ((exp + 112) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// The values of `view` (the tensor `name` of `path`) as f32.
fn to_f32(view: &TensorView<'_>, path: &Path, name: &str) -> Result<Vec<f32>, HfImportError> {
    let d = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        other => {
            return Err(HfImportError::Dtype {
                path: path.to_path_buf(),
                tensor: name.into(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::hf_gpt2_config;

    fn tiny() -> GptConfig {
        GptConfig::preset("tiny").unwrap()
    }

    /// A fresh folder for one test.
    fn folder(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("merak-hf-import-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

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

    /// Writes `tensors` as `dtype` (F32, F16 or BF16 from the f32 values) into `dir`.
    fn write(dir: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype) -> PathBuf {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| match dtype {
                Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Dtype::BF16 => v
                    .iter()
                    .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
                Dtype::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
                _ => unreachable!(),
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
            .collect();
        let path = dir.join("model.safetensors");
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
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
        let path = write(&dir, &t, Dtype::F32);
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
        let path = write(&dir, &t, Dtype::F32);
        let w = read_hf_gpt2(&path, &cfg).unwrap();
        assert_eq!(w.params["wte.embedding.weight"].1, wte.2);

        // An untied head is refused.
        let last = t.len() - 2;
        t[last].2[0] += 1.0;
        let path = write(&dir, &t, Dtype::F32);
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight") && e.contains("tied"), "{e}");
    }

    #[test]
    fn bf16_and_f16_are_converted_and_other_dtypes_named() {
        let cfg = tiny();
        let dir = folder("dtypes");
        let t = tensors(&cfg);
        let path = write(&dir, &t, Dtype::BF16);
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
        assert!(e < 1e-2, "bf16 relative error {e}");

        for (bits, want) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x0001, 5.960_464_5e-8),
            (0x7bff, 65504.0),
            (0x0000, 0.0),
        ] {
            assert_eq!(f16_to_f32(bits), want, "{bits:#06x}");
        }
        assert!(f16_to_f32(0x7c00).is_infinite() && f16_to_f32(0x7e00).is_nan());

        let path = write(&dir, &t, Dtype::I32);
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
        let path = write(&dir, &t, Dtype::F32);
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
        let path = write(&dir, &t, Dtype::F32);
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
        let path = write(&dir, &tensors(&three), Dtype::F32);
        let e = read_hf_gpt2(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("transformer.h.2.") && e.contains("2 blocks"),
            "{e}"
        );

        // config.json of another head count: the shapes agree, the key is named.
        let path = write(&dir, &tensors(&cfg), Dtype::F32);
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
        let path = write(&dir, &t, Dtype::F32);
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

    /// Numbers at the edges of what a header's sizes can hold.
    const EXTREMES: [u64; 11] = [
        0,
        1,
        2,
        8,
        64,
        u32::MAX as u64,
        1 << 32,
        1 << 62,
        1 << 63,
        u64::MAX - 4,
        u64::MAX,
    ];

    /// A safetensors file of `header` (its length as written unless `length` is given) and
    /// `data` bytes.
    fn raw(header: &str, length: Option<u64>, data: usize) -> Vec<u8> {
        let n = length.unwrap_or(header.len() as u64);
        [&n.to_le_bytes()[..], header.as_bytes(), &vec![0u8; data]].concat()
    }

    /// The error of reading `path` as the tiny GPT's file, within 20 s (a FIFO opened for
    /// reading would block forever).
    fn refused_at_once(path: PathBuf) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_hf_gpt2(&path, &tiny()).err().map(|e| e.to_string()));
        });
        let e = rx.recv_timeout(std::time::Duration::from_secs(20));
        e.expect("answered at once").expect("refused")
    }

    /// The error of reading `bytes` as the tiny GPT's file (in folder `name`).
    fn refusal(name: &str, bytes: Vec<u8>) -> String {
        let path = folder(name).join("model.safetensors");
        std::fs::write(&path, bytes).unwrap();
        refused_at_once(path)
    }

    #[test]
    fn header_lengths_beyond_the_file_are_refused_with_the_numbers() {
        let header = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        for claimed in [u64::MAX, 1 << 63, 4_000_000_000, header.len() as u64 + 9] {
            let e = refusal("header-length", raw(header, Some(claimed), 8));
            assert!(
                e.contains("model.safetensors")
                    && e.contains(&format!("claims {claimed} bytes"))
                    && e.contains(&format!("{} follow", header.len() + 8)),
                "{e}"
            );
        }
        let e = refusal("header-length", vec![1, 2, 3]);
        assert!(e.contains("3 bytes, too short"), "{e}");
    }

    #[test]
    fn offsets_and_shapes_beyond_the_data_are_refused_with_the_numbers() {
        let end = u64::MAX - 4;
        let cases = [
            // Offsets whose end, added to the header length, overflows (a panic in a build
            // with overflow checks).
            format!(r#"{{"w":{{"dtype":"U8","shape":[{end}],"data_offsets":[0,{end}]}}}}"#),
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#.into(),
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#.into(),
            // Shapes whose element count overflows, or exceeds the data.
            r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#.into(),
            r#"{"w":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,8]}}"#.into(),
            r#"{"w":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,8]}}"#.into(),
        ];
        let wants = [
            format!("data_offsets [0, {end}]"),
            "data_offsets [8, 0]".into(),
            "data_offsets [0, 16]".into(),
            "shape [4294967296, 4294967296, 4294967296]".into(),
            "shape [18446744073709551615, 2]".into(),
            "shape [1099511627776]".into(),
        ];
        for (header, want) in cases.iter().zip(&wants) {
            let e = refusal("layout", raw(header, None, 8));
            assert!(
                e.contains("model.safetensors")
                    && e.contains("tensor w")
                    && e.contains(want)
                    && e.contains("8 bytes of data"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_fifo_as_weights_or_config_is_refused_before_opening() {
        let dir = folder("fifo");
        let fifo = |p: &Path| {
            let ok = std::process::Command::new("mkfifo")
                .arg(p)
                .status()
                .unwrap();
            assert!(ok.success(), "mkfifo");
        };
        fifo(&dir.join("config.json"));
        let path = write(&dir, &tensors(&tiny()), Dtype::F32);
        let e = refused_at_once(path.clone());
        assert!(
            e.contains("config.json") && e.contains("not a regular file"),
            "{e}"
        );
        std::fs::remove_file(dir.join("config.json")).unwrap();
        std::fs::remove_file(&path).unwrap();
        fifo(&path);
        let e = refused_at_once(path);
        assert!(
            e.contains("model.safetensors") && e.contains("not a regular file"),
            "{e}"
        );
    }

    /// The unit tests' allocator: the system's, refusing any single allocation above 256 MiB
    /// and more than 2 GiB live in all. An allocation sized by a number from a hostile file
    /// then aborts the test instead of passing by overcommit.
    #[global_allocator]
    static GLOBAL: merak_tests::CappedAlloc<std::alloc::System> =
        merak_tests::CappedAlloc::new(std::alloc::System);

    #[test]
    fn a_single_allocation_above_the_cap_is_refused() {
        merak_tests::assert_capped();
    }

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
            let valid = std::fs::read(write(&dir, &tensors(&cfg), Dtype::F32)).unwrap();
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

        /// Headers with extreme numbers (header lengths, offsets, shapes, dtypes) give an error
        /// naming the file, never a panic or an allocation of their size.
        #[test]
        fn headers_with_extreme_numbers_give_an_error(
            length in proptest::sample::select(vec![None, Some(0), Some(1), Some(u64::MAX), Some(1 << 63), Some(100_000_001)]),
            dims in proptest::collection::vec(proptest::sample::select(EXTREMES.to_vec()), 0..4),
            start in proptest::sample::select(EXTREMES.to_vec()),
            end in proptest::sample::select(EXTREMES.to_vec()),
            dtype in proptest::sample::select(vec!["F32", "F16", "BF16", "F64", "U8", "BOOL", "F4", "I64"]),
            data in 0usize..64,
        ) {
            let shape: Vec<String> = dims.iter().map(u64::to_string).collect();
            let header = format!(
                r#"{{"transformer.wte.weight":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{start},{end}]}}}}"#,
                shape.join(",")
            );
            let dir = folder("proptest-header");
            let path = dir.join("model.safetensors");
            std::fs::write(&path, raw(&header, length, data)).unwrap();
            let e = read_hf_gpt2(&path, &tiny());
            proptest::prop_assert!(e.is_err_and(|e| e.to_string().contains("model.safetensors")));
        }
    }
}
