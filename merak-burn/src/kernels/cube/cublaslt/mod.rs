//! The linear layers' matrix products through NVIDIA's cuBLASLt, on CUDA, with
//! `MERAK_CUBLASLT=1`.
//!
//! CubeCL 0.10 emits no Hopper `wgmma` instructions: tuned, its products stay about 2.5 times
//! slower than cuBLAS's on an H200 (`docs/src/benchmarks/gpu.md`). With the switch on, every
//! two-dimensional product of [`matmul::product`](super::matmul::product) (the linear layers'
//! forward and backward) runs `cublasLtMatmul` instead: the operands' element type in and out
//! (bf16, f16 or f32), `f32` accumulation (no TF32 for `f32`), on the buffers CubeCL allocated.
//!
//! **Ordering without synchronisation.** cuBLASLt runs on the CUDA stream CubeCL queues the
//! calling thread's kernels on, which the vendored cubecl-cuda's one patch names
//! (`vendor/cubecl-cuda/MERAK-PATCH.md`): asking CubeCL for the operands' device pointers
//! (`ComputeClient::get_resource`) queues the waits for any other stream that wrote them and
//! returns that stream. The product is then queued after the kernels that made its operands and
//! before those that read its result, and CubeCL's allocator, whose reuse is ordered on the same
//! stream, may recycle the operands' memory afterwards.
//!
//! **Layouts.** cuBLASLt is column-major, Burn row-major: the row-major `C = A B` (`[m, k]` by
//! `[k, n]`) is the column-major `Cᵀ = Bᵀ Aᵀ`. A row-major operand (unit column stride, the row
//! stride at least the width: contiguous or pitched) is its own transpose in column-major terms;
//! a transposed view (unit row stride, as the backward's `wᵀ` and `xᵀ`) is a column-major matrix
//! that cuBLASLt transposes (`CUBLAS_OP_T`). Any other layout, a batched product, or a missing
//! `libcublasLt` leaves the product to CubeCL ([`matmul`](super::matmul)'s table); the reason is
//! logged once.
//!
//! The linear layer's forward adds its bias in the same call (cuBLASLt's bias epilogue); its
//! backward's bias gradient stays a column sum of CubeCL's.
//!
//! The algorithm is cuBLASLt's heuristic's first choice for the product's sizes, layouts, type,
//! epilogue and the operands' alignment (an offset view may be aligned to less than the 256
//! bytes the heuristic otherwise assumes), asked once and kept; the workspace is 32 MiB from
//! CubeCL's memory pool.

use std::sync::OnceLock;

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

mod layout;
#[cfg(feature = "cuda")]
mod run;

pub use layout::{Call, Operand, plan, transpose_of};
#[cfg(feature = "cuda")]
pub use run::{LtError, try_linear, try_product};

/// The environment variable that turns cuBLASLt's products on (`1`); unset, empty or `0`: off.
pub const CUBLASLT_VAR: &str = "MERAK_CUBLASLT";

/// Whether `MERAK_CUBLASLT` turns cuBLASLt on (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let value = std::env::var(CUBLASLT_VAR).unwrap_or_default();
        match value.trim() {
            "" | "0" => false,
            "1" => true,
            other => {
                tracing::warn!("{CUBLASLT_VAR}={other:?} is neither 0 nor 1: cuBLASLt stays off");
                false
            }
        }
    })
}

/// The result of `lhs rhs` through cuBLASLt, on CUDA with the switch on; `None` leaves the
/// product to CubeCL (another runtime, a build without `cuda`, the switch off, or a product
/// cuBLASLt does not take, logged once).
pub fn product<R: CubeRuntime>(lhs: &CubeTensor<R>, rhs: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    linear(lhs, rhs, None)
}

/// [`product`] with `bias` (`[n]`) added to every row by cuBLASLt's bias epilogue.
pub fn linear<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    if !enabled() {
        return None;
    }
    #[cfg(feature = "cuda")]
    return run::linear(lhs, rhs, bias);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (lhs, rhs, bias);
        None
    }
}
