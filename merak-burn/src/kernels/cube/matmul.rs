//! Matrix products with a chosen CubeCL kernel instead of CubeCL's default.
//!
//! Without its autotuner, burn-cubecl runs every product with one kernel
//! (`SimpleCyclicCmma`, single-stage). On an H200 the autotuner chose a TMA kernel for every
//! bf16 product of GPT-2, and `SpecializedTmaMma` was within 20% of its choice on each of them
//! and 2.2 to 7.4 times faster than the default (`benches/gpu/results/2026-11-28-h200`). But
//! tuning took 290 s in the first step. So the choice is made here from a table of shape
//! classes, with no tuning:
//!
//! | class | kernel |
//! | --- | --- |
//! | f16 or bf16, every dimension at least [`TMA_MIN_DIM`], on a device with TMA (Hopper on) | `SpecializedTmaMma` |
//! | f32 (TF32 tensor cores: not measured), a dimension under [`TMA_MIN_DIM`], or no TMA | CubeCL's default |
//!
//! A chosen kernel that cannot run on the operands (CubeCL refuses it before launching)
//! falls back to the default, so the table can only choose among kernels that run; the
//! fallback is logged once. `MERAK_COMPOSED_KERNELS=matmul` turns the table off (every product
//! takes CubeCL's default), to measure it. A build with `cuda-autotune` leaves the choice to the
//! autotuner, which times the TMA kernels among the others. On CUDA, `MERAK_CUBLASLT=1` hands
//! the two-dimensional products to cuBLASLt first ([`cublaslt`](super::cublaslt)); the table
//! takes those it does not.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl::ir::features::Tma;
use burn_cubecl::kernel::matmul::{MatmulStrategy, init_matmul_output};
use burn_cubecl::tensor::CubeTensor;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::Strategy;
use cubek::matmul::routines::BlueprintStrategy;
use cubek::std::InputBinding;

/// The smallest of `m`, `n` and `k` for which the table takes a TMA kernel: every bf16 product
/// of GPT-2 small (the smallest dimension 64, attention's head size) won with one on the H200;
/// smaller products were not measured.
pub const TMA_MIN_DIM: usize = 64;

/// The kernel a product takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// burn-cubecl's default: its one kernel, or its autotuner in a build with `cuda-autotune`.
    Default,
    /// The warp-specialised TMA kernel with `mma` tiles (`Strategy::SpecializedTmaMma`).
    SpecializedTma,
}

/// What the choice depends on: the product's sizes (`[.., m, k] x [.., k, n]`), its element
/// type and whether the device has the tensor memory accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Product {
    /// Rows of the left operand and of the result.
    pub m: usize,
    /// Columns of the right operand and of the result.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// The operands' element type.
    pub dtype: DType,
    /// Whether the device has TMA (`Tma::Base`).
    pub tma: bool,
}

/// The table: the kernel for `product`.
pub fn choose(product: Product) -> MatmulKernel {
    let half = matches!(product.dtype, DType::BF16 | DType::F16);
    let large = product.m.min(product.n).min(product.k) >= TMA_MIN_DIM;
    if product.tma && half && large {
        MatmulKernel::SpecializedTma
    } else {
        MatmulKernel::Default
    }
}

/// The product `lhs rhs` of two tensors of rank two or more (batched over the leading
/// dimensions, as Burn's `matmul`), with the kernel [`choose`] names, `force` in its place
/// when given (tests).
pub fn product<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    force: Option<MatmulKernel>,
) -> CubeTensor<R> {
    if force.is_none()
        && let Some(out) = super::cublaslt::product(&lhs, &rhs)
    {
        return out;
    }
    let dtype = lhs.dtype;
    let out = init_matmul_output(&lhs, &rhs, dtype);
    let table = || match cfg!(feature = "cuda-autotune") {
        // The autotuner measures every kernel, the TMA ones among them: it decides.
        true => MatmulKernel::Default,
        false => choose(describe(&lhs, &rhs)),
    };
    let kernel = force.unwrap_or_else(table);
    if kernel == MatmulKernel::SpecializedTma
        && launch_specialized_tma(lhs.clone(), rhs.clone(), out.clone()).is_ok()
    {
        return out;
    }
    let default = MatmulStrategy::default();
    match burn_cubecl::kernel::matmul::matmul(lhs, rhs, Some(out), default, dtype) {
        Ok(out) => out,
        // burn-cubecl's own float_matmul unwraps this result: its default kernel runs on
        // every float type and layout Burn hands it.
        Err(e) => panic!("CubeCL's default matrix product failed: {e:?}"),
    }
}

/// The sizes, type and device of the product `lhs rhs`.
fn describe<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>) -> Product {
    let (l, r) = (lhs.meta.shape(), rhs.meta.shape());
    let (lr, rr) = (l.num_dims(), r.num_dims());
    let tma = lhs.client.properties().features.tma.contains(Tma::Base);
    Product {
        m: l[lr - 2],
        k: l[lr - 1],
        n: r[rr - 1],
        dtype: lhs.dtype,
        tma,
    }
}

/// Launches `SpecializedTmaMma` on the operands; an error when CubeCL refuses it (before
/// launching anything), logged the first time.
fn launch_specialized_tma<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    out: CubeTensor<R>,
) -> Result<(), ()> {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    let client = out.client.clone();
    let (dtype, out_dtype) = (lhs.dtype, out.dtype);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: dtype.into(),
        rhs: dtype.into(),
        out: out_dtype.into(),
    });
    let strategy = Strategy::SpecializedTmaMma(BlueprintStrategy::Inferred(().into()));
    let result = cubek::matmul::launch::launch_ref(
        &strategy,
        &client,
        InputBinding::new(lhs.binding(), dtype.into()),
        InputBinding::new(rhs.binding(), dtype.into()),
        out.binding(),
        &mut dtypes,
    );
    result.map_err(|e| {
        if !LOGGED.swap(true, Ordering::Relaxed) {
            tracing::debug!("SpecializedTmaMma refused a product ({e:?}); CubeCL's default runs");
        }
    })
}
