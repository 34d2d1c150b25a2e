//! One shard file: f32 tensors in the safetensors format, plus a string metadata map.

use std::collections::HashMap;
use std::path::Path;

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

/// Encodes tensors and metadata as a safetensors file (little-endian f32).
pub fn encode(
    tensors: &[NamedTensor],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            TensorView::new(Dtype::F32, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| format!("tensor {}: {e}", t.name))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize(views, metadata).map_err(|e| e.to_string())
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
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| corrupt(e.to_string()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(e.to_string()))?;
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
}
