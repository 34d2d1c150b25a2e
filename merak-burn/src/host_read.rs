//! Reads of tensors into host memory, counted.
//!
//! On a GPU a read waits for every kernel queued before it, and the GPU idles while the host
//! prepares what follows, so a training step should read as little as it can. The library's
//! reads of tensors into host vectors go through [`floats`], [`ints`] and [`together`], which
//! count them ([`count`]). The trainer logs each step's count as `host_reads` in
//! `metrics.jsonl`. At one rank a step reads once: its losses (all micro-batches) and the
//! gradient norm's sums of squares (all parameters) together, at the step's end. On the CPU
//! backend the sums are already host values (its kernels read host memory directly,
//! uncounted), so the one read holds the losses only.
//!
//! The count is one number for the whole process: a diagnostic, like a profiler's counter.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

static READS: AtomicU64 = AtomicU64::new(0);

/// A tensor that could not be read into host memory.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot read a tensor into host memory: {0}")]
pub struct ReadError(pub String);

/// Reads of tensors into host memory this process has made so far.
pub fn count() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// Reads `t` into a host vector of `f32`, row-major (one counted read).
pub fn floats<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, ReadError> {
    data(t.try_into_data())?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| ReadError(format!("{e:?}")))
}

/// Reads the integer tensor `t` into a host vector of `i64`, row-major (one counted read).
pub fn ints<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Result<Vec<i64>, ReadError> {
    data(t.try_into_data())?
        .convert::<i64>()
        .into_vec::<i64>()
        .map_err(|e| ReadError(format!("{e:?}")))
}

/// Reads the one-dimensional tensors that are there in one read (each cast to `f32` and all
/// concatenated on the device): each one's values, in order, empty for `None`. Nothing is
/// read when every entry is `None`.
pub fn together<B: Backend, const N: usize>(
    tensors: [Option<Tensor<B, 1>>; N],
) -> Result<[Vec<f32>; N], ReadError> {
    let lens = tensors
        .each_ref()
        .map(|t| t.as_ref().map_or(0, |t| t.dims()[0]));
    let present: Vec<Tensor<B, 1>> = (tensors.into_iter().flatten())
        .map(crate::precision::to_f32)
        .collect();
    let all = match present.is_empty() {
        true => Vec::new(),
        false => floats(Tensor::cat(present, 0))?,
    };
    let mut all = all.into_iter();
    Ok(lens.map(|n| all.by_ref().take(n).collect()))
}

/// Counts one read and hands its data on.
fn data<E: std::fmt::Debug>(read: Result<TensorData, E>) -> Result<TensorData, ReadError> {
    READS.fetch_add(1, Ordering::Relaxed);
    read.map_err(|e| ReadError(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    #[test]
    fn every_read_is_counted_and_keeps_the_values() {
        let device = Default::default();
        let before = count();
        let x = Tensor::<Cpu, 2>::from_floats([[1.0, 2.0], [3.0, 4.5]], &device);
        assert_eq!(floats(x).unwrap(), vec![1.0, 2.0, 3.0, 4.5]);
        let i = Tensor::<Cpu, 1, Int>::from_ints([7, -2], &device);
        assert_eq!(ints(i).unwrap(), vec![7, -2]);
        // Other tests may read at the same time: at least these two.
        assert!(count() >= before + 2);
    }

    #[test]
    fn together_splits_one_read_in_order_and_skips_the_absent() {
        let device = Default::default();
        let a = Tensor::<Cpu, 1>::from_floats([1.0, 2.0], &device);
        let b = Tensor::<Cpu, 1>::from_floats([3.5], &device);
        let [x, none, y] = together([Some(a), None, Some(b)]).unwrap();
        assert_eq!((x, none, y), (vec![1.0, 2.0], vec![], vec![3.5]));
        let [only] = together::<Cpu, 1>([None]).unwrap();
        assert!(only.is_empty());
    }
}
