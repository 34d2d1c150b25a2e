//! The backends merak-burn trains on, named once.
//!
//! The CPU backend is [burn-flex](https://crates.io/crates/burn-flex) (pure Rust, `gemm`
//! matrix products with AVX-512 kernels selected at run time, strided zero-copy views), the
//! successor of the deprecated burn-ndarray. Models, the `merak` command, the tests and the
//! benchmarks all name these aliases, so a change of backend happens here.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;

/// The plain (inference) CPU backend.
pub type Cpu = burn_flex::Flex;

/// Its device (there is one CPU device).
pub type CpuDevice = burn_flex::FlexDevice;

/// The CPU backend with automatic differentiation: what a training step runs on.
pub type CpuAutodiff = Autodiff<Cpu>;

/// The CPU training backend with Burn's balanced checkpointing (selective recomputation:
/// matrix products are kept, memory-bound results recomputed in the backward pass).
pub type CpuAutodiffSelective = Autodiff<Cpu, BalancedCheckpointing>;

/// The wgpu GPU backend (Vulkan, Metal or DX12; WGSL kernels), without Burn's fusion and
/// autotuning: what `train.device = "wgpu"` trains on (inside [`Autodiff`]).
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_wgpu::Wgpu<f32, i32, u32>;

/// A wgpu device: the default adapter, or one picked by kind and index.
#[cfg(feature = "wgpu")]
pub type WgpuDevice = burn_wgpu::WgpuDevice;
