//! merak's fused operations as CubeCL kernels, for every CubeCL backend (CUDA, wgpu):
//! [`FusedOps`] on `burn_cubecl::CubeBackend`.
//!
//! | operation | kernels |
//! | --- | --- |
//! | bias-GELU ([`pointwise`]) | one thread per element; the bias gradient by column sums ([`columns`]) |
//! | linear layer's bias gradient | column sums ([`columns`]); the products by [`matmul`]'s table |
//! | LayerNorm ([`rows`]) | a cube per row (mean, variance, output); backward a cube per row for `dx`; `dgamma` and `dbeta` by two-pass column sums ([`columns`]: a cube per block of columns and chunk of 64 rows, then a thread per column over the chunks) |
//! | cross-entropy ([`xent`]) | a cube per row for the maximum, then for the sum of exponentials and the target logit (the tensor-parallel all-reduces between them), one cube for the mean; the gradient one thread per logit |
//! | embedding ([`gather`]) | one thread per output element; backward a thread per column |
//! | AdamW ([`pointwise`]) | one thread per element, the new parameter and moments |
//! | sum of squares ([`squares`]) | a cube per chunk in `f32`, the chunks added on the host in `f64` |
//! | attention forward ([`attention`]) | a cube per block of queries of one (sequence, head), the queries and then tiles of keys, values and segment ids in shared memory, the tile's scores and context by a tile product ([`attention_tiles`]: `f32` dot products, or tensor cores for bf16 and f16), an online softmax per query; its log-sum-exp in `f32` for the backward pass |
//! | attention backward ([`attention_backward`]) | the probabilities rebuilt from the log-sum-exp with the forward's tile products: a cube per block of queries for their gradients (keys and values in tiles), a cube per block of keys for theirs and the values' (queries, their gradients and statistics in tiles) |
//!
//! Reductions never use float atomics (core WGSL has none): a row is reduced by a tree in
//! shared memory, a column by chunks of rows then over the chunks (the embedding's gradient
//! still by one thread per column), so results are the same on every run. Kernels read
//! and write the tensors' own float type and compute in `f32`. A bf16 or f16 attention takes
//! Burn's attention operation (no log-sum-exp) unless `MERAK_ATTENTION_PRODUCT` names a tile
//! product ([`attention::ATTENTION_PRODUCT_VAR`]).

pub mod attention;
pub mod attention_backward;
pub mod attention_tiles;
pub mod columns;
pub mod cublaslt;
pub mod gather;
pub mod matmul;
pub mod pointwise;
pub mod rows;
pub mod squares;
pub mod xent;

use burn::tensor::DType;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Shape, Tensor};
use burn_cubecl::cubecl::prelude::{CubeCount, CubeDim};
use burn_cubecl::cubecl::{calculate_cube_count_elemwise, client::ComputeClient};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{AdamWStep, AdamWTensors, AttentionSpec, FusedOps, NormStats, Squares, VocabShard};
use super::{composed, lift, prim};
use crate::comm::{Group, ReduceOp};

/// Threads per cube of the row and chunk reductions (a power of two).
pub const BLOCK: u32 = 256;

/// Where a kernel runs: its cubes and their threads.
pub(crate) struct Launch {
    count: CubeCount,
    dim: CubeDim,
}

impl Launch {
    /// One thread per element of `n`.
    fn elements<R: CubeRuntime>(client: &ComputeClient<R>, n: usize) -> Self {
        let dim = CubeDim::new_1d(BLOCK);
        let count = calculate_cube_count_elemwise(client, n.max(1), dim);
        Self { count, dim }
    }

    /// One thread per element of `x`.
    fn elementwise<R: CubeRuntime>(x: &CubeTensor<R>) -> Self {
        Self::elements(&x.client, x.meta.shape().num_elements())
    }

    /// One cube of [`BLOCK`] threads per row (`CUBE_POS`), over two dimensions past 65,535
    /// rows.
    fn per_row(rows: usize) -> Self {
        let x = rows.clamp(1, 65_535);
        let y = rows.div_ceil(x).max(1);
        Self {
            count: CubeCount::Static(x as u32, y as u32, 1),
            dim: CubeDim::new_1d(BLOCK),
        }
    }
}

/// The number of elements of `x`, for a kernel's bounds. Kernels take their sizes as
/// arguments, never from a buffer's `len()` (a buffer's length may be its allocation's).
fn elements<R: CubeRuntime>(x: &CubeTensor<R>) -> u32 {
    x.meta.shape().num_elements() as u32
}

/// `x` with a contiguous row-major layout (no copy when it has one).
fn contiguous<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    burn_cubecl::kernel::into_contiguous(x)
}

/// An uninitialized contiguous tensor of `x`'s shape, type and device.
fn empty_like<R: CubeRuntime>(x: &CubeTensor<R>) -> CubeTensor<R> {
    empty_shaped(x, x.meta.shape().clone(), x.dtype)
}

/// An uninitialized tensor on `x`'s device, contiguous row-major as every kernel here indexes
/// it. Not Burn's `empty_device_dtype`: on CUDA that pitches the rows of a tensor of two or more
/// dimensions (each row padded to an alignment), so a kernel's `out[row * cols + c]` landed
/// in the padding; wgpu does not pitch, which hid it on llvmpipe.
fn empty_shaped<R: CubeRuntime>(x: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        shape,
        dtype,
    )
}

/// Zeros of `x`'s shape, type and device, contiguous (Burn's zeros are pitched on CUDA, as
/// [`empty_shaped`] says).
fn zeros_like<R: CubeRuntime>(x: &CubeTensor<R>) -> CubeTensor<R> {
    let zeros = burn_cubecl::ops::numeric::zeros_client(
        x.client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    contiguous(zeros)
}

/// An uninitialized contiguous tensor of `x`'s type and device.
fn empty<R: CubeRuntime, const D: usize>(x: &CubeTensor<R>, dims: [usize; D]) -> CubeTensor<R> {
    empty_typed(x, dims, x.dtype)
}

/// An uninitialized contiguous tensor on `x`'s device.
fn empty_typed<R: CubeRuntime, const D: usize>(
    x: &CubeTensor<R>,
    dims: [usize; D],
    dtype: DType,
) -> CubeTensor<R> {
    empty_shaped(x, dims.into(), dtype)
}

/// The environment variable that names the kernels to replace by Burn's composed operators
/// (comma-separated: `attention`, `gelu`, `norm`, `xent`, `embedding`, `adamw`, `squares`,
/// `matmul` (CubeCL's default product kernel instead of [`matmul`]'s table, and Burn's
/// reduction for a linear layer's bias gradient), `bias` (Burn's reduction for a linear layer's
/// bias gradient instead of [`columns`]' column sums), or `all`; unset or
/// empty: none): for measuring the fused kernels against the composition, and for telling which
/// kernel a driver fails on.
pub const COMPOSED_KERNELS_VAR: &str = "MERAK_COMPOSED_KERNELS";

/// The names [`COMPOSED_KERNELS_VAR`] knows.
const KERNEL_NAMES: [&str; 10] = [
    "attention",
    "gelu",
    "norm",
    "xent",
    "embedding",
    "adamw",
    "squares",
    "matmul",
    "bias",
    "all",
];

/// Whether the kernel `name` runs composed, as [`COMPOSED_KERNELS_VAR`] says.
fn composed_kernel(name: &str) -> bool {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        let list = std::env::var(COMPOSED_KERNELS_VAR).unwrap_or_default();
        let names: Vec<String> = list.split(',').map(|s| s.trim().to_lowercase()).collect();
        for unknown in names
            .iter()
            .filter(|k| !k.is_empty() && !KERNEL_NAMES.contains(&k.as_str()))
        {
            tracing::warn!(
                "{COMPOSED_KERNELS_VAR}: unknown kernel \"{unknown}\" ignored (known: {})",
                KERNEL_NAMES.join(", ")
            );
        }
        names
    });
    names.iter().any(|k| k == name || k == "all")
}

impl<R, F, I, BT> FusedOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn gather_forward(
        table: FloatTensor<Self>,
        ids: IntTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        if composed_kernel("embedding") {
            return composed::gather_forward::<Self>(table, ids, start);
        }
        gather::forward(table, ids, start)
    }

    fn gather_backward(
        ids: IntTensor<Self>,
        dy: FloatTensor<Self>,
        rows: usize,
        start: usize,
    ) -> FloatTensor<Self> {
        if composed_kernel("embedding") {
            return composed::gather_backward::<Self>(ids, dy, rows, start);
        }
        gather::backward(ids, dy, rows, start)
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> AdamWTensors<Self> {
        if composed_kernel("adamw") {
            return composed::adamw_step::<Self>(param, grad, moments, step);
        }
        let [p, m, v] = pointwise::adamw_step(param, grad, moments, step);
        (p, m, v)
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(usage.bytes_reserved)
    }

    fn sum_of_squares(x: FloatTensor<Self>) -> f64 {
        if composed_kernel("squares") {
            return composed::sum_of_squares::<Self>(x);
        }
        let chunks = composed::to_host::<Self>(squares::chunk_sums(x));
        chunks.iter().map(|&s| f64::from(s)).sum()
    }

    /// Each tensor's chunk sums on the device, gathered into one tensor (read once, with the
    /// step's losses), each tensor's chunks added in `f64` in order as
    /// [`FusedOps::sum_of_squares`] adds them.
    fn squares_of(xs: Vec<FloatTensor<Self>>) -> Squares<Self> {
        if composed_kernel("squares") || xs.is_empty() {
            return composed::squares_of::<Self>(xs);
        }
        let chunks: Vec<CubeTensor<R>> = xs.into_iter().map(squares::chunk_sums).collect();
        let counts: Vec<usize> = chunks.iter().map(|c| c.meta.shape()[0]).collect();
        let all = <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_cat(chunks, 0);
        Squares::Device {
            partials: lift::<Self, 1>(all),
            counts,
        }
    }

    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        group: Group,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if composed_kernel("xent") {
            return composed::cross_entropy_forward::<Self>(logits, targets, shard, group);
        }
        let all_reduce = |t: CubeTensor<R>, is_max: bool| {
            let op = if is_max { ReduceOp::Max } else { ReduceOp::Sum };
            prim(composed::all_reduce(lift::<Self, 1>(t), op, group))
        };
        let shard = xent::Shard {
            start: shard.start,
            valid: shard.valid,
            all_reduce: &all_reduce,
        };
        xent::forward(logits, targets, shard)
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        targets: IntTensor<Self>,
        shard: VocabShard,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if composed_kernel("xent") {
            return composed::cross_entropy_backward::<Self>(logits, stats, targets, shard, grad);
        }
        let count = Tensor::<Self, 1, Int>::from_primitive(targets.clone())
            .greater_equal_elem(0)
            .float()
            .sum()
            .clamp_min(1.0);
        let scale = prim(lift::<Self, 1>(grad) / count);
        xent::backward(logits, stats, targets, scale, shard.start, shard.valid)
    }

    /// The product with the kernel of [`matmul`]'s table.
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        if composed_kernel("matmul") {
            return composed::linear_forward::<Self>(x, w, bias);
        }
        if let Some(y) = cublaslt::linear(&x, &w, bias.as_ref()) {
            return y;
        }
        composed::linear_forward_with::<Self>(x, w, bias, |a, b| matmul::product(a, b, None))
    }

    /// The two products with the kernel of [`matmul`]'s table.
    fn linear_backward(
        x: Option<FloatTensor<Self>>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        want: [bool; 3],
    ) -> [Option<FloatTensor<Self>>; 3] {
        if composed_kernel("matmul") {
            return composed::linear_backward::<Self>(x, w, dy, want);
        }
        let product = |a, b| matmul::product(a, b, None);
        // The bias's gradient by the two-pass column sums in f32 ([`columns`]), unless
        // `MERAK_COMPOSED_KERNELS=bias` asks for Burn's reduction over the rows.
        let column_sums = |dy: FloatTensor<Self>| {
            if composed_kernel("bias") {
                return composed::column_sums::<Self>(dy);
            }
            let dy = contiguous(dy);
            columns::column_sums(&dy, dy.meta.shape()[1])
        };
        composed::linear_backward_with::<Self>(x, w, dy, want, product, column_sums)
    }

    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, NormStats<Self>) {
        if composed_kernel("norm") {
            return composed::layer_norm_forward::<Self>(x, gamma, beta, eps);
        }
        rows::layer_norm_forward(x, gamma, beta, eps)
    }

    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: NormStats<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        if composed_kernel("norm") {
            return composed::layer_norm_backward::<Self>(x, gamma, stats, dy);
        }
        rows::layer_norm_backward(x, gamma, stats, dy)
    }

    fn bias_gelu_forward(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        if composed_kernel("gelu") {
            return composed::bias_gelu_forward::<Self>(x, bias);
        }
        pointwise::bias_gelu_forward(x, bias)
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        if composed_kernel("gelu") {
            return composed::bias_gelu_backward::<Self>(x, bias, dy);
        }
        pointwise::bias_gelu_backward(x, bias, dy)
    }

    /// The tiled kernel with each query's log-sum-exp in `f32` ([`attention`]): its scalar form
    /// for `f32`; for bf16 and f16 the form `MERAK_ATTENTION_PRODUCT` names (tensor cores on
    /// CUDA, or the scalar form), unset Burn's attention operation. Burn's operation gives no
    /// log-sum-exp (the backward pass then recomputes the softmax); it also runs where no tile
    /// fits the device's shared memory or `MERAK_COMPOSED_KERNELS` says `attention`.
    fn attention_forward(
        qkv: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let product = match qkv.dtype {
            DType::BF16 | DType::F16 => attention::half_product(),
            _ => Some(attention_tiles::TileProduct::Scalar),
        };
        let tiles = product
            .filter(|_| !composed_kernel("attention"))
            .and_then(|product| attention::tiles_for(&qkv, spec, product));
        let Some(tiles) = tiles else {
            return composed::attention_forward_unsaved::<Self>(qkv, spec, segments);
        };
        let (ctx, lse) = attention::forward(qkv, spec, segments, tiles);
        (ctx, Some(lse))
    }

    /// The tiled backward kernels ([`attention_backward`], the forward's tile product) from the
    /// forward kernel's `f32` log-sum-exp, in the input's type; else (no log-sum-exp, or
    /// `MERAK_COMPOSED_KERNELS=attention`, or no tile fits) Burn's composed operators, which
    /// take the log-sum-exp only in the input's type and otherwise recompute the softmax.
    fn attention_backward(
        qkv: FloatTensor<Self>,
        ctx: FloatTensor<Self>,
        lse: Option<FloatTensor<Self>>,
        dctx: FloatTensor<Self>,
        spec: AttentionSpec,
        segments: Option<IntTensor<Self>>,
    ) -> FloatTensor<Self> {
        let product = match qkv.dtype {
            DType::BF16 | DType::F16 => attention::half_product(),
            _ => None,
        };
        let product = product.unwrap_or(attention_tiles::TileProduct::Scalar);
        let tiles = lse
            .as_ref()
            .filter(|lse| lse.dtype == DType::F32 && !composed_kernel("attention"))
            .and_then(|_| attention_backward::tiles_for(&qkv, spec, product));
        match (lse, tiles) {
            (Some(lse), Some(tiles)) => {
                attention_backward::backward(qkv, ctx, lse, dctx, spec, segments, tiles)
            }
            (lse, _) => {
                let lse = lse.filter(|lse| lse.dtype == qkv.dtype);
                composed::attention_backward::<Self>(qkv, ctx, lse, dctx, spec, segments)
            }
        }
    }
}

#[cfg(all(test, any(feature = "wgpu", feature = "cuda")))]
mod tests;

#[cfg(all(test, any(feature = "wgpu", feature = "cuda")))]
mod attention_tests;
