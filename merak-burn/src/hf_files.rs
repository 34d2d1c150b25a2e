//! Hugging Face checkpoint files (safetensors weights, `config.json`, index files) read as
//! untrusted input: the one layer under every importer of pretrained weights (merak-gpt's
//! GPT-2, merak-bert's `BertForMaskedLM`, the Llama example's `LlamaForCausalLM`), which keep
//! only their model's names, shapes and layouts.
//!
//! A file given to an importer may be truncated, hostile or not a file at all; nothing here
//! trusts it before checking it, and nothing panics:
//!
//! - [`regular_file`]: a FIFO, a device or a folder is refused before it is opened (opening a
//!   FIFO blocks), and so is a file larger than the caller reads;
//! - [`read_json`], [`read_config`]: a JSON file of bounded size;
//! - [`tensor_views`]: a safetensors file's header length, and each tensor's data offsets and
//!   element count, are checked with checked arithmetic against the file's real size
//!   ([`check_layout`]) before the safetensors crate uses them, so a hostile header allocates
//!   nothing of the size it claims and overflows nothing;
//! - [`to_f32`], [`finite_f32`]: F32, F16, BF16 and F64 tensors as f32, any other element type
//!   named; [`finite_f32`] refuses a NaN or an infinity, naming its index.
//!
//! Every error names the file ([`HfFileError`]); the importers wrap it in their own error
//! types, whose other variants name the model's tensors, keys and shapes. [`encode`] goes the
//! other way: f32 tensors as the safetensors file transformers saves.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use thiserror::Error;

use crate::checkpoint::shard_file::{self, NamedTensor};

/// The largest `config.json` [`read_config`] reads (a model's is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest safetensors header read (the safetensors crate's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A Hugging Face file that cannot be read or is not what it should be; every variant names
/// the file.
#[derive(Debug, Error)]
pub enum HfFileError {
    /// Reading (or writing) the file failed.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// Not a regular file, larger than what is read, or not a valid safetensors or JSON file
    /// (or not what the importer's format needs there).
    #[error("{}: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
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
    /// A tensor holding a NaN or an infinity.
    #[error(
        "{}: tensor {tensor} holds {value} at index {index}: a model with non-finite weights is not loaded",
        path.display()
    )]
    NonFinite {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// The first non-finite value.
        value: f32,
        /// Its flat index (row-major, in the file's layout).
        index: usize,
    },
}

impl HfFileError {
    /// The error of an I/O failure on `path`, for `map_err`.
    pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HfFileError {
        let path = path.to_path_buf();
        move |error| HfFileError::Io { path, error }
    }

    /// The error of a file `path` that is not what it should be, for `reason`.
    pub fn format(path: &Path, reason: impl Into<String>) -> HfFileError {
        HfFileError::Format {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// The size of `path` if it is a regular file (or a link to one) of at most `max` bytes:
/// anything else (a FIFO, a device, a folder) is refused before it is opened.
pub fn regular_file(path: &Path, max: u64) -> Result<u64, HfFileError> {
    let m = std::fs::metadata(path).map_err(HfFileError::io(path))?;
    if !m.is_file() {
        return Err(HfFileError::format(
            path,
            "not a regular file (a folder, a FIFO or a device?)",
        ));
    }
    if m.len() > max {
        return Err(HfFileError::format(
            path,
            format!("{} bytes, more than the {max} read", m.len()),
        ));
    }
    Ok(m.len())
}

/// The folder of the file `path`, where its `config.json` is (`.` for a bare file name).
pub fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Whether `path` exists, as anything (a link to nothing, a FIFO: what it is is checked when
/// it is read).
pub fn exists(path: &Path) -> Result<bool, HfFileError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(HfFileError::io(path)(e)),
    }
}

/// The JSON file at `path`, a regular file of at most `max` bytes.
pub fn read_json(path: &Path, max: u64) -> Result<serde_json::Value, HfFileError> {
    regular_file(path, max)?;
    let text = std::fs::read(path).map_err(HfFileError::io(path))?;
    serde_json::from_slice(&text)
        .map_err(|e| HfFileError::format(path, format!("not valid JSON: {e}")))
}

/// The `config.json` at `path` (at most [`MAX_CONFIG_BYTES`]), `None` if there is none.
pub fn read_config(path: &Path) -> Result<Option<serde_json::Value>, HfFileError> {
    if !exists(path)? {
        return Ok(None);
    }
    read_json(path, MAX_CONFIG_BYTES).map(Some)
}

/// The bytes of the weights file at `path`, a regular file (see [`regular_file`]).
pub fn read_weights(path: &Path) -> Result<Vec<u8>, HfFileError> {
    regular_file(path, u64::MAX)?;
    std::fs::read(path).map_err(HfFileError::io(path))
}

/// Checks the numbers of a safetensors file's header (`bytes`, read from `path`) against the
/// file's size before the safetensors crate uses them: the header length, and each tensor's
/// data offsets and element count (the crate adds the last offset to the header length
/// unchecked). Tensors are checked in name order, so the one named is always the same.
pub fn check_layout(bytes: &[u8], path: &Path) -> Result<(), HfFileError> {
    let bad = |reason: String| {
        HfFileError::format(path, format!("not a valid safetensors file: {reason}"))
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
    let mut names: Vec<&String> = tensors.keys().filter(|n| *n != "__metadata__").collect();
    names.sort();
    for name in names {
        check_tensor_layout(name, &tensors[name], data).map_err(bad)?;
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

/// Every tensor of the safetensors file `bytes` (read from `path`), sorted by name, once its
/// layout is checked ([`check_layout`]) and the safetensors crate has validated it.
pub fn tensor_views<'a>(
    bytes: &'a [u8],
    path: &Path,
) -> Result<Vec<(String, TensorView<'a>)>, HfFileError> {
    check_layout(bytes, path)?;
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| HfFileError::format(path, format!("not a valid safetensors file: {e}")))?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

/// An IEEE half-precision number as f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
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

/// The values of `view` (the tensor `name` of `path`) as f32: F32, F16 and BF16 exactly, F64
/// rounded; another element type is an error naming it.
pub fn to_f32(view: &TensorView<'_>, path: &Path, name: &str) -> Result<Vec<f32>, HfFileError> {
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
            return Err(HfFileError::Dtype {
                path: path.to_path_buf(),
                tensor: name.into(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// [`to_f32`], refused if a value is a NaN or an infinity (the first is named with its index).
pub fn finite_f32(view: &TensorView<'_>, path: &Path, name: &str) -> Result<Vec<f32>, HfFileError> {
    let values = to_f32(view, path, name)?;
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(values),
        Some(index) => Err(HfFileError::NonFinite {
            path: path.to_path_buf(),
            tensor: name.into(),
            value: values[index],
            index,
        }),
    }
}

/// `tensors` as a safetensors file of little-endian f32, as transformers saves one (metadata
/// `format = pt`, which `from_pretrained` looks for). Fails naming a tensor whose values do
/// not fill its shape.
pub fn encode(tensors: &[NamedTensor]) -> Result<Vec<u8>, String> {
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    shard_file::encode(tensors, metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `header` (its length as written unless `length` is given) and
    /// `data` bytes.
    fn raw(header: &str, length: Option<u64>, data: usize) -> Vec<u8> {
        let n = length.unwrap_or(header.len() as u64);
        [&n.to_le_bytes()[..], header.as_bytes(), &vec![0u8; data]].concat()
    }

    /// The error of reading `bytes` as a safetensors file named `model.safetensors`.
    fn refusal(bytes: &[u8]) -> String {
        let path = Path::new("some/model.safetensors");
        tensor_views(bytes, path).unwrap_err().to_string()
    }

    #[test]
    fn header_lengths_beyond_the_file_are_refused_with_the_numbers() {
        let header = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        for claimed in [u64::MAX, 1 << 63, 4_000_000_000, header.len() as u64 + 9] {
            let e = refusal(&raw(header, Some(claimed), 8));
            assert!(
                e.contains("model.safetensors")
                    && e.contains(&format!("claims {claimed} bytes"))
                    && e.contains(&format!("{} follow", header.len() + 8)),
                "{e}"
            );
        }
        let e = refusal(&[1, 2, 3]);
        assert!(e.contains("3 bytes, too short"), "{e}");
        assert!(tensor_views(&raw(header, None, 8), Path::new("x")).is_ok());
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
            let e = refusal(&raw(header, None, 8));
            assert!(
                e.contains("model.safetensors")
                    && e.contains("tensor w")
                    && e.contains(want)
                    && e.contains("8 bytes of data"),
                "{e}"
            );
        }
        // Of two bad tensors, the first by name is named.
        let two = r#"{"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        assert!(refusal(&raw(two, None, 8)).contains("tensor a:"));
    }

    #[test]
    fn tensors_come_sorted_as_f32_and_other_dtypes_or_non_finite_values_are_named() {
        let path = Path::new("dir/model.safetensors");
        let f16: Vec<u8> = [0x3c00u16, 0x7c00]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let bf16: Vec<u8> = [0x3f80u16, 0xc000]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let f64s: Vec<u8> = [0.5f64, -3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let ints: Vec<u8> = [7i32, 8].iter().flat_map(|x| x.to_le_bytes()).collect();
        let views = [
            ("z", Dtype::F16, &f16),
            ("b", Dtype::BF16, &bf16),
            ("c", Dtype::F64, &f64s),
            ("a", Dtype::I32, &ints),
        ]
        .map(|(n, d, b)| (n, TensorView::new(d, vec![2], b).unwrap()));
        let bytes = safetensors::serialize(views, None).unwrap();
        let tensors = tensor_views(&bytes, path).unwrap();
        let names: Vec<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "z"]);
        let [(_, a), (_, b), (_, c), (_, z)] = &tensors[..] else {
            unreachable!()
        };
        assert_eq!(to_f32(b, path, "b").unwrap(), [1.0, -2.0]);
        assert_eq!(finite_f32(c, path, "c").unwrap(), [0.5, -3.0]);
        assert_eq!(to_f32(z, path, "z").unwrap(), [1.0, f32::INFINITY]);
        let e = finite_f32(z, path, "z").unwrap_err().to_string();
        assert_eq!(
            e,
            "dir/model.safetensors: tensor z holds inf at index 1: a model with non-finite weights is not loaded"
        );
        let e = to_f32(a, path, "a").unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("tensor a is I32"),
            "{e}"
        );

        let file = NamedTensor {
            name: "w".into(),
            shape: vec![2],
            values: vec![1.5, -0.25],
        };
        let bytes = encode(std::slice::from_ref(&file)).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["format"], "pt");
        let back = tensor_views(&bytes, path).unwrap();
        assert_eq!(to_f32(&back[0].1, path, "w").unwrap(), file.values);
    }

    #[test]
    fn f16_values_convert_exactly() {
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
    }

    /// The error of `read` on `path`, within 20 s (a FIFO opened for reading would block
    /// forever).
    fn refused_at_once(path: PathBuf, read: fn(&Path) -> Result<(), HfFileError>) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read(&path).err().map(|e| e.to_string()));
        });
        let e = rx.recv_timeout(std::time::Duration::from_secs(20));
        e.expect("answered at once").expect("refused")
    }

    #[test]
    fn a_fifo_a_folder_or_a_large_file_is_refused_before_opening() {
        let dir = merak_tests::fresh_folder("hf-files-fifo");
        let config = dir.join("config.json");
        let weights = dir.join("model.safetensors");
        for path in [&config, &weights] {
            let made = std::process::Command::new("mkfifo").arg(path).status();
            assert!(made.unwrap().success(), "mkfifo");
        }
        let e = refused_at_once(config.clone(), |p| read_config(p).map(drop));
        assert!(
            e.contains("config.json") && e.contains("not a regular file"),
            "{e}"
        );
        let e = refused_at_once(weights, |p| read_weights(p).map(drop));
        assert!(
            e.contains("model.safetensors") && e.contains("not a regular file"),
            "{e}"
        );
        let e = read_json(&dir, 10).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");

        // A config too large, one that is not JSON, and none.
        std::fs::remove_file(&config).unwrap();
        std::fs::write(&config, vec![b' '; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let e = read_config(&config).unwrap_err().to_string();
        assert!(
            e.contains(&format!("more than the {MAX_CONFIG_BYTES} read")),
            "{e}"
        );
        std::fs::write(&config, "{\"hidden_size\": 3").unwrap();
        let e = read_config(&config).unwrap_err().to_string();
        assert!(e.contains("config.json: not valid JSON"), "{e}");
        std::fs::write(&config, "{\"hidden_size\": 3}").unwrap();
        assert_eq!(read_config(&config).unwrap().unwrap()["hidden_size"], 3);
        std::fs::remove_file(&config).unwrap();
        assert!(read_config(&config).unwrap().is_none());
        let e = read_weights(&config).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        assert_eq!(folder_of(&config), dir);
        assert_eq!(folder_of(Path::new("model.safetensors")), Path::new("."));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
