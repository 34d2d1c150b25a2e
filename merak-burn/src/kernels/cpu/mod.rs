//! The CPU kernels behind [`FusedOps`](super::FusedOps) on burn-flex: plain functions over
//! `f32` slices, vectorized through [`math::simd`], tested against definitions in `f64`.

pub mod adamw;
pub mod blockwise;
pub mod embedding;
pub mod gelu;
pub mod gemm;
pub mod linear;
pub mod math;
pub mod norm;
pub mod xent;
