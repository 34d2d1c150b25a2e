//! Fused operations: one pass over memory where Burn's composition of operators makes several.
//!
//! [`FusedOps`] is a backend extension trait, like
//! [`ParallelBackend`](crate::tensor_parallel::ParallelBackend). Each fused operation has a
//! forward and a backward *kernel* and a differentiable *operation*:
//!
//! - On a plain backend the operation is the forward kernel.
//! - On `Autodiff<B>` the operation records one graph node whose backward pass calls `B`'s
//!   backward kernel, instead of the dozen nodes (and intermediate tensors) of the composition.
//! - The kernels' default implementations compose Burn's own operators ([`composed`]), so
//!   every backend has them; the CPU backend (burn-flex) overrides them with vectorized
//!   single-pass kernels on its buffers ([`cpu`]), and the CubeCL backends (CUDA, wgpu) with
//!   CubeCL kernels (`cube`, with the `cuda` or `wgpu` feature).
//!
//! The fused operations:
//!
//! | operation | forward | backward |
//! | --- | --- | --- |
//! | [`vocab_parallel_cross_entropy`](crate::tensor_parallel::vocab_parallel_cross_entropy) | one pass: row max, sum of exponentials, target logit; two small all-reduces across TP | the gradient written over the logits' own buffer |
//! | [`embedding`] | one row copy per token, zeros for ids of other TP shards (no mask tensors) | the rows summed into a table-sized gradient |
//! | [`linear`] | the bias written, the product accumulated onto it (`gemm`, strided weights) | two products over all rows and a column sum, only for the inputs that need a gradient |
//! | [`LayerNorm`](crate::tensor_parallel::LayerNorm) | one pass per row; keeps each row's mean and `1 / std` | one pass per row, written over the upstream gradient |
//! | [`bias_gelu`] | `gelu(x + b)` (exact GELU, vectorized `erfc`) | one pass, over the upstream gradient |
//! | [`attention`] | blockwise ([`cpu::blockwise`]): per head, blocks of query rows against blocks of keys with an online softmax (key blocks the causal mask or the segment ids hide are skipped); Q, K and V read in place; keeps only each row's log-sum-exp (`[batch, heads, seq]`), no `[seq, seq]` matrix | per block, the probabilities recomputed from the log-sum-exp and five products, the Q/K/V gradient written in the fused layout |
//!
//! Besides, [`FusedOps::adamw_step`] (behind [`FusedAdamW`](crate::train::FusedAdamW)) updates a
//! parameter and its moments in one in-place pass, [`FusedOps::sum_of_squares`] accumulates a
//! gradient's squared norm in `f64`, and [`FusedOps::into_host_vec`] hands a tensor's buffer to
//! the data-parallel reducer without a copy.

mod autodiff;
pub mod deferred;
pub mod grad_sink;
pub(crate) use autodiff::{LinearState, linear_backward, linear_node};
pub mod composed;
pub mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod cube;
mod flex;
#[cfg(test)]
mod tests;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

use crate::comm::Group;

/// Which columns of the (padded) vocabulary a rank's logits hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    /// The global token id of the first local column.
    pub start: usize,
    /// The local columns `0..valid` are real tokens; the rest (vocabulary padding) is kept out
    /// of the softmax and gets no gradient.
    pub valid: usize,
}

/// The shape arguments of the fused attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSpec {
    /// Heads held by this rank.
    pub heads: usize,
    /// Whether a token attends only to itself and earlier tokens (GPT), or to all (BERT).
    pub causal: bool,
}

pub use cpu::adamw::Step as AdamWStep;

/// A parameter and its two AdamW moments.
pub type AdamWTensors<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// The saved state of a fused LayerNorm's forward pass: each row's mean and `1 / std`.
pub type NormStats<B> = (FloatTensor<B>, FloatTensor<B>);

/// The sums of squares of several tensors ([`FusedOps::squares_of`]), perhaps still on the
/// device.
#[derive(Clone, Debug)]
pub enum Squares<B: Backend> {
    /// Host values, one per tensor (the CPU backend reads its own memory).
    Host(Vec<f64>),
    /// Partial sums on the device (`f32`): `counts[i]` of them, in order, are the `i`-th
    /// tensor's, added in `f64` once read.
    Device {
        /// Every tensor's partial sums, one after another.
        partials: Tensor<B, 1>,
        /// How many partial sums each tensor has.
        counts: Vec<usize>,
    },
}

impl<B: Backend> Squares<B> {
    /// The values to read from the device, if any.
    pub fn values(&self) -> Option<Tensor<B, 1>> {
        match self {
            Squares::Host(_) => None,
            Squares::Device { partials, .. } => Some(partials.clone()),
        }
    }

    /// Each tensor's sum of squares, given `read`, the host values of
    /// [`values`](Self::values) (ignored for host values).
    pub fn settle(&self, read: &[f32]) -> Vec<f64> {
        let counts = match self {
            Squares::Host(sums) => return sums.clone(),
            Squares::Device { counts, .. } => counts,
        };
        let mut rest = read;
        (counts.iter())
            .map(|&n| {
                let (these, tail) = rest.split_at(n.min(rest.len()));
                rest = tail;
                these.iter().map(|&s| f64::from(s)).sum()
            })
            .collect()
    }
}

/// A backend with fused kernels. Every method has a default (a composition of Burn operators),
/// so `impl FusedOps for MyBackend {}` is enough for a new backend.
pub trait FusedOps: Backend {
    /// Forward kernel of an embedding lookup in a shard of a table: `table` holds the rows
    /// `start..start + rows` of the whole table (`[rows, d]`); for each id of `ids` (`[n]`) the
    /// output (`[n, d]`) has its row, or zeros when another shard holds it.
    fn gather_forward(
        table: FloatTensor<Self>,
        ids: IntTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        composed::gather_forward::<Self>(table, ids, start)
    }

    /// Backward kernel of the embedding: the gradient of the table shard (`[rows, d]`), the
    /// rows of `dy` (`[n, d]`) summed into the rows of their ids held here.
    fn gather_backward(
        ids: IntTensor<Self>,
        dy: FloatTensor<Self>,
        rows: usize,
        start: usize,
    ) -> FloatTensor<Self> {
        composed::gather_backward::<Self>(ids, dy, rows, start)
    }

    /// The differentiable embedding lookup (see [`FusedOps::gather_forward`]).
    fn fused_embedding(
        table: FloatTensor<Self>,
        ids: IntTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        Self::gather_forward(table, ids, start)
    }

    /// The values of `x` in row-major order as a host vector: on the CPU the tensor's own
    /// buffer when nothing else holds it (no copy), a copy otherwise.
    fn into_host_vec(x: FloatTensor<Self>) -> Vec<f32> {
        composed::to_host::<Self>(x)
    }

    /// One AdamW update (Burn's formula, see [`cpu::adamw`]): the new parameter and moments,
    /// written in place where the backend can. `moments` is `None` on the first update (the
    /// moments start at zero).
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> AdamWTensors<Self> {
        composed::adamw_step::<Self>(param, grad, moments, step)
    }

    /// The sum of the squares of all elements of `x`, accumulated as precisely as the backend
    /// allows (`f64` on the CPU; the default sums in the tensor's own type), for gradient
    /// norms that do not depend on how the gradients are split across ranks.
    fn sum_of_squares(x: FloatTensor<Self>) -> f64 {
        composed::sum_of_squares::<Self>(x)
    }

    /// [`FusedOps::sum_of_squares`] of each tensor, in order, with the same result for each, as
    /// far as the backend computes them without reading the device: a GPU backend leaves its
    /// partial sums there, so that the step reads them with its losses
    /// ([`Squares::values`]). The default sums each tensor in its own element type on the
    /// device.
    fn squares_of(xs: Vec<FloatTensor<Self>>) -> Squares<Self> {
        composed::squares_of::<Self>(xs)
    }

    /// The bytes the backend's allocator holds on `device`, in use or not, where it keeps such
    /// a count (CubeCL's memory pools: `bytes_reserved`, which grows to the run's peak and stays
    /// there between cleanups, like PyTorch's `torch.cuda.memory_reserved`); `None` on the CPU.
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// [`FusedOps::squares_of`] read into host memory (at most one read for all the tensors).
    fn sums_of_squares(xs: Vec<FloatTensor<Self>>) -> Vec<f64> {
        let squares = Self::squares_of(xs);
        let read = match squares.values() {
            Some(values) => crate::host_read::floats(values)
                .unwrap_or_else(|e| crate::comm::fail(format!("the sums of squares: {e}"))),
            None => Vec::new(),
        };
        squares.settle(&read)
    }

    /// Forward kernel of the linear layer `x w (+ bias)`: `x` is `[rows, d_in]`, `w`
    /// `[d_in, d_out]` (it may be a transposed view, as for a tied output head).
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        composed::linear_forward::<Self>(x, w, bias)
    }

    /// Backward kernel of the linear layer: the gradients of `x`, `w` and the bias that `want`
    /// asks for, from the upstream gradient `dy`; `x` must be given when the gradient of `w`
    /// is wanted. The gradient of `w` has `w`'s memory layout.
    fn linear_backward(
        x: Option<FloatTensor<Self>>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        want: [bool; 3],
    ) -> [Option<FloatTensor<Self>>; 3] {
        composed::linear_backward::<Self>(x, w, dy, want)
    }

    /// The differentiable linear layer (see [`FusedOps::linear_forward`]).
    fn fused_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::linear_forward(x, w, bias)
    }

    /// Forward kernel of the mean cross-entropy over vocabulary-parallel logits
    /// (`[rows, local_vocab]`) and targets (`[rows]`, negative ids ignored): returns the loss
    /// (`[1]`, the same on every rank of `group`) and each row's softmax statistics over the
    /// whole vocabulary (`[rows, 2]`: the maximum logit and the sum of `exp(x - max)`).
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        group: Group,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        composed::cross_entropy_forward::<Self>(logits, targets, shard, group)
    }

    /// Backward kernel: the gradient of the logits, `(softmax - onehot) * grad / count`, from
    /// the forward's softmax statistics and the loss's upstream gradient `grad` (`[1]`).
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        composed::cross_entropy_backward::<Self>(logits, stats, targets, shard, grad)
    }

    /// The differentiable cross-entropy (see [`FusedOps::cross_entropy_forward`]).
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        group: Group,
    ) -> FloatTensor<Self> {
        Self::cross_entropy_forward(logits, targets, shard, group).0
    }

    /// Forward kernel of LayerNorm over the last dimension of `x`: the output and each row's
    /// mean and `1 / sqrt(var + eps)`.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, NormStats<Self>) {
        composed::layer_norm_forward::<Self>(x, gamma, beta, eps)
    }

    /// Backward kernel of LayerNorm: the gradients of `x`, `gamma` and `beta` from the upstream
    /// gradient `dy` and the forward's statistics.
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: NormStats<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        composed::layer_norm_backward::<Self>(x, gamma, stats, dy)
    }

    /// The differentiable LayerNorm (see [`FusedOps::layer_norm_forward`]).
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        Self::layer_norm_forward(x, gamma, beta, eps).0
    }

    /// Forward kernel of `gelu(x + bias)` (exact GELU; `bias` over the last dimension).
    fn bias_gelu_forward(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        composed::bias_gelu_forward::<Self>(x, bias)
    }

    /// Backward kernel of `gelu(x + bias)`: the gradients of `x` and `bias`.
    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        composed::bias_gelu_backward::<Self>(x, bias, dy)
    }

    /// The differentiable `gelu(x + bias)`.
    fn fused_bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::bias_gelu_forward(x, bias)
    }

    /// Forward kernel of scaled dot-product self-attention on a fused Q/K/V projection
    /// (`[batch, seq, 3 * heads * head_dim]`: all query heads, then keys, then values): the
    /// context `[batch, seq, heads * head_dim]` and each query's log-sum-exp of its scaled
    /// scores `[batch, heads, seq]` (natural log) for the backward pass, or `None` where the
    /// kernel does not give it (the backward pass then recomputes the softmax). `segments`
    /// (`[batch, seq]`), when given, are segment ids: a token attends only to tokens of its own
    /// segment (documents packed into one sequence).
    fn attention_forward(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        composed::attention_forward::<Self>(qkv, spec, segments)
    }

    /// Backward kernel of the attention: the gradient of the Q/K/V buffer from the context's
    /// (`dctx`), given the forward pass's context `ctx` and log-sum-exp `lse`.
    fn attention_backward(
        qkv: FloatTensor<Self>,
        ctx: FloatTensor<Self>,
        lse: Option<FloatTensor<Self>>,
        dctx: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> FloatTensor<Self> {
        composed::attention_backward::<Self>(qkv, ctx, lse, dctx, spec, segments)
    }

    /// The differentiable attention (see [`FusedOps::attention_forward`]).
    fn fused_attention(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::attention_forward(qkv, spec, segments).0
    }
}

/// A float primitive (of any rank) as a rank-`D` tensor.
pub(crate) fn lift<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// A float tensor's primitive.
pub(crate) fn prim<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// `x w (+ bias)` for `x` `[rows, d_in]` and `w` `[d_in, d_out]` ([`FusedOps::fused_linear`]):
/// one matrix product onto the bias, its output in a buffer of its own (no zeroing and copy).
pub fn linear<B: FusedOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    lift(B::fused_linear(prim(x), prim(w), bias.map(prim)))
}

/// Rows of a shard of an embedding table (`[rows, d]`, the rows `start..start + rows` of the
/// whole table) for token ids `[batch, seq]`, zeros for ids held by other shards
/// ([`FusedOps::fused_embedding`]): `[batch, seq, d]`.
pub fn embedding<B: FusedOps>(
    table: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
    start: usize,
) -> Tensor<B, 3> {
    let [b, s] = ids.dims();
    let d = table.dims()[1];
    let ids = ids.reshape([b * s]).into_primitive();
    lift::<B, 2>(B::fused_embedding(prim(table), ids, start)).reshape([b, s, d])
}

/// LayerNorm over the last dimension, fused ([`FusedOps::fused_layer_norm`]).
pub fn layer_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    lift(B::fused_layer_norm(prim(x), prim(gamma), prim(beta), eps))
}

/// `gelu(x + bias)` with exact GELU, fused ([`FusedOps::fused_bias_gelu`]); `bias` runs over the last
/// dimension.
pub fn bias_gelu<B: FusedOps, const D: usize>(x: Tensor<B, D>, bias: Tensor<B, 1>) -> Tensor<B, D> {
    lift(B::fused_bias_gelu(prim(x), prim(bias)))
}

/// Scaled dot-product self-attention on a fused Q/K/V projection, fused
/// ([`FusedOps::fused_attention`]): `[batch, seq, 3 * heads * head_dim]` (query heads, then key
/// heads, then value heads) to the context `[batch, seq, heads * head_dim]`.
pub fn attention<B: FusedOps>(qkv: Tensor<B, 3>, spec: AttentionSpec) -> Tensor<B, 3> {
    lift(B::fused_attention(prim(qkv), spec, None))
}

/// [`attention`] within segments: `segments` (`[batch, seq]`) gives each token's segment id, and
/// a token attends only to tokens of its own segment (documents packed into one sequence; with
/// `spec.causal`, only to earlier tokens of its segment).
pub fn attention_in_segments<B: FusedOps>(
    qkv: Tensor<B, 3>,
    spec: AttentionSpec,
    segments: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    lift(B::fused_attention(
        prim(qkv),
        spec,
        Some(segments.into_primitive()),
    ))
}

/// Communication failures inside a fused operation cannot be returned through Burn's operator
/// signatures; they are fatal for the job (the panic hook aborts it and names the rank).
pub(crate) fn fatal(what: &str, e: crate::comm::CommError) -> ! {
    panic!("{what}: communication failed: {e}")
}
