//! Tensors read into host `f32` vectors and written back, for the communicators that work on
//! host buffers (MPI) and the checks that compare values.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorData};

use super::CommError;
use crate::precision::like_dtype;

/// Reads a tensor into a host `f32` vector.
pub(crate) fn tensor_to_vec<B: Backend, const D: usize>(
    t: Tensor<B, D>,
) -> Result<Vec<f32>, CommError> {
    crate::host_read::floats(t).map_err(|e| CommError::TensorRead(e.0))
}

/// Writes a host `f32` vector into a tensor of `shape` on `device`, of element type `dtype`
/// (the communicated tensor's: bf16 activations travel as `f32` and come back bf16).
pub(crate) fn vec_to_tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: Shape,
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, D> {
    like_dtype(
        Tensor::from_data(TensorData::new(values, shape), device),
        dtype,
    )
}
