//! The start-up self-test of a GPU backend (CUDA, wgpu): CubeCL compiles its kernels when they
//! are first used, so a driver that cannot compile or run one, or a kernel that computes
//! something else there, would otherwise show in the middle of the first step, after the data
//! and the model are loaded, as a panic deep inside the runtime or as a wrong loss.
//! [`self_test`] runs the operations of a training step (embedding, LayerNorm, linear layers,
//! bias-GELU, causal attention, cross-entropy, and their backward passes; the AdamW step and
//! the sum of squares of the gradient norm) on tiny, ragged shapes and compares them with the
//! CPU backend, before training.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use thiserror::Error;

use crate::backend::Cpu;
use crate::comm::Group;
use crate::kernels::{
    AdamWStep, AttentionSpec, FusedOps, attention, bias_gelu, embedding, layer_norm, linear,
};
use crate::tensor_parallel::{ParallelBackend, vocab_parallel_cross_entropy};

/// The self-test's bound on the relative difference from the CPU backend (the largest
/// difference over the largest magnitude of each result) on wgpu. It catches a kernel that
/// computes something else, not rounding: measured on llvmpipe, every result is within 8.5e-7
/// of the CPU's; other drivers round differently (fused multiply-adds, their own `exp`).
pub const SELF_TEST_TOLERANCE: f32 = 1e-3;

/// The bound on CUDA: on an H100 the embedding's gradient, at the end of the step's chain of
/// matrix products, came out 1.4e-3 from the CPU's (2026-11-27), while kernels without
/// products agree to 1e-6; consistent with CubeCL's tensor-core products rounding f32 to TF32
/// (10 mantissa bits). A kernel that scrambles its output
/// is off by far more.
pub const CUDA_SELF_TEST_TOLERANCE: f32 = 1e-2;

/// What the self-test compared: each operation's largest relative difference from the CPU.
#[derive(Clone, Debug, PartialEq)]
pub struct SelfTest {
    /// `(operation, relative difference)`, in the order they ran.
    pub differences: Vec<(String, f32)>,
}

impl SelfTest {
    /// The largest relative difference from the CPU over every operation.
    pub fn largest_difference(&self) -> f32 {
        self.differences.iter().map(|d| d.1).fold(0.0, f32::max)
    }
}

/// An operation of the self-test that failed to compile or run, or gave wrong values.
#[derive(Clone, Debug, Error, PartialEq)]
#[error("the self-test of {check} failed: {reason}")]
pub struct SelfTestFailure {
    /// The operation.
    pub check: String,
    /// What went wrong.
    pub reason: String,
}

/// Runs every operation of a training step on `device` of backend `B` (tiny shapes, forward
/// and backward) and compares the results with the CPU backend within `tolerance`
/// ([`SELF_TEST_TOLERANCE`], [`CUDA_SELF_TEST_TOLERANCE`]). A kernel that fails to compile or
/// run panics inside CubeCL: the panic is caught (and kept from the panic hook, which would
/// end the job) and becomes the error.
pub fn self_test<B>(device: &B::Device, tolerance: f32) -> Result<SelfTest, SelfTestFailure>
where
    B: FusedOps + ParallelBackend,
    Autodiff<B>: FusedOps + ParallelBackend + Backend<Device = B::Device>,
{
    let fail = |check: &str, reason: String| SelfTestFailure {
        check: check.to_string(),
        reason,
    };
    let results = |device: &B::Device| {
        let mut r = step_results::<Autodiff<B>>(device);
        r.extend(optimizer_results::<B>(device));
        r
    };
    let mut want = step_results::<Autodiff<Cpu>>(&Default::default());
    want.extend(optimizer_results::<Cpu>(&Default::default()));
    let got = quietly(|| results(device)).map_err(|reason| fail("the first kernels", reason))?;
    let mut differences = Vec::new();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let diff = relative_difference(g, w);
        if diff.is_nan() || diff > tolerance {
            let reason = format!("relative difference {diff:e} from the CPU backend");
            return Err(fail(name, reason));
        }
        differences.push((name.to_string(), diff));
    }
    Ok(SelfTest { differences })
}

/// Runs `f`, turning a panic into its message, without the panic hook (which under `mpirun`
/// aborts the job) seeing it.
fn quietly<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.map_err(|payload| {
        (payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// The largest difference of `got` from `want` over the largest magnitude of `want` (infinite
/// for different lengths or a non-finite value).
fn relative_difference(got: &[f32], want: &[f32]) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(
            0.0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    diff / scale
}

/// Fixed, varied values for a tensor of `n` elements (`k` picks the sequence).
fn values(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 37 + k * 101) % 61) as f32 / 61.0 - 0.5) * 0.8)
        .collect()
}

/// A tensor of `shape` filled by [`values`], tracked by autodiff.
fn param<B: Backend, const D: usize>(
    shape: [usize; D],
    k: usize,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::<B, D>::from_data(TensorData::new(values(n, k), shape), device).require_grad()
}

/// One tiny GPT step on backend `B` (batch 2, sequence 5, width 8, 2 heads, vocabulary 11):
/// the loss and the gradients of every input, by name.
fn step_results<B>(device: &B::Device) -> Vec<(&'static str, Vec<f32>)>
where
    B: crate::pipeline::TrainBackend + FusedOps,
{
    let (batch, seq, width, vocab) = (2, 5, 8, 11);
    let table = param::<B, 2>([vocab, width], 1, device);
    let (gamma, beta) = (
        param::<B, 1>([width], 2, device),
        param::<B, 1>([width], 3, device),
    );
    let w_qkv = param::<B, 2>([width, 3 * width], 4, device);
    let w_up = param::<B, 2>([width, 2 * width], 5, device);
    let b_up = param::<B, 1>([2 * width], 6, device);
    let w_down = param::<B, 2>([2 * width, vocab], 7, device);
    let ids: Vec<i64> = (0..batch * seq)
        .map(|i| ((i * 7 + 3) % vocab) as i64)
        .collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), device);
    let targets = ids.clone().flip([1]);
    let x = embedding(table.clone(), ids, 0);
    let x = layer_norm(x, gamma.clone(), beta.clone(), 1e-5).reshape([batch * seq, width]);
    let qkv = linear(x, w_qkv.clone(), None).reshape([batch, seq, 3 * width]);
    let spec = AttentionSpec {
        heads: 2,
        causal: true,
    };
    let context = attention(qkv, spec).reshape([batch * seq, width]);
    let hidden = bias_gelu(linear(context, w_up.clone(), None), b_up.clone());
    let logits = linear(hidden, w_down.clone(), None).reshape([batch, seq, vocab]);
    let losses = vocab_parallel_cross_entropy(logits, targets, 0, vocab, Group::local());
    let loss = losses.mean();
    let grads = loss.backward();
    let read = |t: Tensor<B::InnerBackend, 1>| t.into_data().convert::<f32>().to_vec::<f32>();
    let grad = |p: &Tensor<B, 2>| p.grad(&grads).map(|g| g.reshape([-1])).map(read);
    let grad1 = |p: &Tensor<B, 1>| p.grad(&grads).map(read);
    let mut out = vec![(
        "the loss (forward pass)",
        read(loss.inner()).unwrap_or_default(),
    )];
    for (name, g) in [
        ("the embedding's backward pass", grad(&table)),
        ("the attention's backward pass (Q/K/V weight)", grad(&w_qkv)),
        ("the linear layers' backward pass", grad(&w_down)),
        ("the bias-GELU's backward pass", grad(&w_up)),
        ("the bias gradient", grad1(&b_up)),
        ("the LayerNorm's backward pass (scale)", grad1(&gamma)),
        ("the LayerNorm's backward pass (shift)", grad1(&beta)),
    ] {
        out.push((name, g.and_then(Result::ok).unwrap_or_default()));
    }
    out
}

/// Two AdamW updates of a ragged vector (the second with moments) and the sum of squares of
/// the result, on backend `B`: the optimizer's kernels.
fn optimizer_results<B: FusedOps>(device: &B::Device) -> Vec<(&'static str, Vec<f32>)> {
    let n = 300;
    let tensor = |k| {
        let t = Tensor::<B, 1>::from_data(TensorData::new(values(n, k), [n]), device);
        t.into_primitive().tensor()
    };
    let mut step = AdamWStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        time: 1,
    };
    let (p, m, v) = B::adamw_step(tensor(8), tensor(9), None, step);
    step.time = 2;
    let (p, _, _) = B::adamw_step(p, tensor(10), Some((m, v)), step);
    let squares = B::sum_of_squares(p.clone()) as f32;
    let p = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(p));
    let p = p
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap_or_default();
    vec![
        ("the AdamW step", p),
        ("the sum of squares (gradient norm)", vec![squares]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_differences_catch_wrong_lengths_and_nans() {
        assert_eq!(relative_difference(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((relative_difference(&[1.0, 2.1], &[1.0, 2.0]) - 0.05).abs() < 1e-6);
        assert!(relative_difference(&[1.0], &[1.0, 2.0]).is_infinite());
        assert!(relative_difference(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
    }

    #[test]
    fn a_panic_becomes_its_message() {
        let e = quietly(|| -> u8 { panic!("no kernel {}", 3) }).expect_err("panicked");
        assert_eq!(e, "no kernel 3");
        assert_eq!(quietly(|| 4), Ok(4));
    }
}
