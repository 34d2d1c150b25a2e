//! One shard file: f32 tensors in the safetensors format, plus a string metadata map.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensorError;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::CheckpointError;

/// A named f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// Name in the file.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// A named f32 tensor borrowed for writing ([`write_refs`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorRef<'a> {
    /// Name in the file.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// Values, row-major.
    pub values: &'a [f32],
}

/// Encodes tensors and metadata as a safetensors file (little-endian f32).
pub fn encode(
    tensors: &[NamedTensor],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let refs: Vec<TensorRef<'_>> = (tensors.iter())
        .map(|t| TensorRef {
            name: &t.name,
            shape: &t.shape,
            values: &t.values,
        })
        .collect();
    encode_refs(&refs, metadata)
}

/// [`encode`] from borrowed values: on a little-endian machine the file is built straight from
/// the tensors' buffers.
fn encode_refs(
    tensors: &[TensorRef<'_>],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let bytes: Vec<Cow<'_, [u8]>> = tensors.iter().map(|t| le_bytes(t.values)).collect();
    let views = views(tensors, &bytes)?;
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize(views, metadata).map_err(|e| e.to_string())
}

/// Writes the file [`encode`] would encode to `path`, streamed from the tensors' buffers (no
/// copy of the file in memory), and syncs it.
pub fn write_refs(
    path: &Path,
    tensors: &[TensorRef<'_>],
    metadata: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: path.to_path_buf(),
        reason,
    };
    let bytes: Vec<Cow<'_, [u8]>> = tensors.iter().map(|t| le_bytes(t.values)).collect();
    let views = views(tensors, &bytes).map_err(corrupt)?;
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize_to_file(views, metadata, path).map_err(|e| match e {
        SafeTensorError::IoError(e) => CheckpointError::io(path)(e),
        e => corrupt(e.to_string()),
    })?;
    let file = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    file.sync_all().map_err(CheckpointError::io(path))
}

/// Safetensors views of `tensors` over their little-endian `bytes`.
fn views<'a>(
    tensors: &[TensorRef<'_>],
    bytes: &'a [Cow<'_, [u8]>],
) -> Result<Vec<(String, TensorView<'a>)>, String> {
    (tensors.iter().zip(bytes))
        .map(|(t, b)| {
            TensorView::new(Dtype::F32, t.shape.to_vec(), b)
                .map(|v| (t.name.to_string(), v))
                .map_err(|e| format!("tensor {}: {e}", t.name))
        })
        .collect()
}

/// `values` as little-endian bytes: the buffer itself on a little-endian machine.
fn le_bytes(values: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Decodes a safetensors file of f32 tensors; `file` names it in errors.
pub fn decode(
    bytes: &[u8],
    file: &Path,
) -> Result<(Vec<NamedTensor>, HashMap<String, String>), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: file.to_path_buf(),
        reason,
    };
    // The safetensors reader's errors do not name the tensor: find it in the header.
    let refuse = |e: SafeTensorError| corrupt(bad_tensor(bytes).unwrap_or_else(|| e.to_string()));
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(refuse)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(bytes).map_err(refuse)?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(corrupt(format!(
                "tensor {name} is {:?}, expected F32",
                view.dtype()
            )));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            values,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((out, metadata))
}

/// The first tensor of the safetensors file `bytes` whose header entry is not an F32 tensor
/// of its shape's size, and why; `None` when the header cannot be read as a list of tensors
/// or every entry is fine (the file is then wrong in another way).
fn bad_tensor(bytes: &[u8]) -> Option<String> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = usize::try_from(len).ok()?.checked_add(8)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..end)?).ok()?;
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let info = &header[name];
        let dtype = info["dtype"].as_str().unwrap_or("(none)");
        if dtype != "F32" {
            return Some(format!("tensor {name} is {dtype}, expected F32"));
        }
        let shape: Option<Vec<u64>> = (info["shape"].as_array())
            .and_then(|dims| dims.iter().map(serde_json::Value::as_u64).collect());
        let offsets: Option<Vec<u64>> = (info["data_offsets"].as_array())
            .and_then(|o| o.iter().map(serde_json::Value::as_u64).collect());
        let (Some(shape), Some([start, stop])) = (shape, offsets.as_deref()) else {
            return Some(format!(
                "tensor {name}: its shape or data offsets are not lists of whole numbers"
            ));
        };
        let need = (shape.iter()).try_fold(4u64, |n, &d| n.checked_mul(d));
        let span = stop.checked_sub(*start);
        if need.is_some() && need == span {
            return None;
        }
        let need = need.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
        Some(format!(
            "tensor {name}: shape {shape:?} of F32 needs {need} bytes, its data offsets \
             {start}..{stop} do not hold that"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let t = vec![
            NamedTensor {
                name: "b".into(),
                shape: vec![2, 3],
                values: (0..6).map(|i| i as f32 * 0.5).collect(),
            },
            NamedTensor {
                name: "a".into(),
                shape: vec![1],
                values: vec![-1.25],
            },
        ];
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        let bytes = encode(&t, meta.clone()).unwrap();
        let (back, m) = decode(&bytes, Path::new("x")).unwrap();
        assert_eq!(m, meta);
        assert_eq!(back, vec![t[1].clone(), t[0].clone()]);
        let err = decode(&bytes[..bytes.len() - 4], Path::new("x")).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn a_tensor_of_another_dtype_is_named() {
        let t = [NamedTensor {
            name: "m2/blocks.0.ln_1.gamma".into(),
            shape: vec![2, 3],
            values: vec![0.5; 6],
        }];
        let bytes = encode(&t, HashMap::new()).unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        // F16 of the same bytes (the sizes disagree), I32 (they agree) and no such dtype.
        for dtype in ["F16", "I32", "F17"] {
            let edited = text.replacen("\"F32\"", &format!("\"{dtype}\""), 1);
            assert_eq!(edited.len(), text.len());
            let e = decode(edited.as_bytes(), Path::new("shard.safetensors"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("shard.safetensors")
                    && e.contains(&format!(
                        "tensor m2/blocks.0.ln_1.gamma is {dtype}, expected F32"
                    )),
                "{dtype}: {e}"
            );
        }
    }

    #[test]
    fn a_streamed_file_equals_the_encoded_bytes_and_a_bad_folder_is_an_io_error() {
        let values: Vec<f32> = (0..1000).map(|i| (i as f32).sin()).collect();
        let refs = [
            TensorRef {
                name: "param/w",
                shape: &[10, 100],
                values: &values,
            },
            TensorRef {
                name: "m1/w",
                shape: &[3],
                values: &values[..3],
            },
        ];
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.safetensors");
        write_refs(&path, &refs, meta.clone()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes, encode_refs(&refs, meta.clone()).unwrap());
        let (back, _) = decode(&bytes, &path).unwrap();
        assert_eq!(back[1].values, values);
        let missing = dir.path().join("no-such-folder").join("shard.safetensors");
        let err = write_refs(&missing, &refs, meta).unwrap_err();
        assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    }
}
