//! Mixed precision: the element type a training step computes in.
//!
//! Parameters, their gradients, the optimizer state, the data-parallel reduction and the
//! checkpoints stay `f32`. Under [`Precision::Bf16`] the layers cast their parameters to bf16
//! where they use them ([`autocast`]), activations are bf16, and the loss is computed in `f32`
//! ([`to_f32`]); Burn's autodiff casts each gradient back to its parameter's `f32`. The setting
//! is per thread (Burn runs the backward pass on the thread that calls it), like the dropout
//! position.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// The element type of a step's computation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in `f32`.
    #[default]
    Fp32,
    /// bf16 compute and activations, `f32` master weights, gradients and optimizer state.
    Bf16,
}

impl Precision {
    /// The configuration's name: `fp32` or `bf16`.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not a precision.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision `{0}`, expected fp32 or bf16")]
pub struct ParsePrecisionError(String);

impl FromStr for Precision {
    type Err = ParsePrecisionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(ParsePrecisionError(other.to_string())),
        }
    }
}

thread_local! {
    static PRECISION: Cell<Precision> = const { Cell::new(Precision::Fp32) };
}

/// Sets this thread's compute precision (the trainer sets it before each step).
pub fn set_precision(p: Precision) {
    PRECISION.with(|c| c.set(p));
}

/// This thread's compute precision.
pub fn precision() -> Precision {
    PRECISION.with(Cell::get)
}

/// `t` in the compute precision: a parameter or an `f32` input cast where it is used.
pub fn autocast<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    like_dtype(t, precision().dtype())
}

/// `t` in `f32` (the loss, and values leaving for communication).
pub fn to_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    like_dtype(t, DType::F32)
}

/// `t` cast to `dtype` unless it has it.
pub fn like_dtype<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CpuAutodiff, CpuDevice};
    use burn::tensor::TensorData;

    #[test]
    fn autocast_follows_the_thread_setting_and_gradients_come_back_in_f32() {
        let d = CpuDevice::default();
        let w = Tensor::<CpuAutodiff, 2>::from_data(
            TensorData::new(vec![0.5f32, 1.0, -1.0, 2.0], [2, 2]),
            &d,
        )
        .require_grad();
        set_precision(Precision::Bf16);
        let y = autocast(w.clone()).matmul(autocast(w.clone()));
        assert_eq!(y.dtype(), DType::BF16);
        let grads = to_f32(y).sum().backward();
        let g = w.grad(&grads).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        set_precision(Precision::Fp32);
        assert_eq!(autocast(w).dtype(), DType::F32);
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert!("fp16".parse::<Precision>().is_err());
    }
}
