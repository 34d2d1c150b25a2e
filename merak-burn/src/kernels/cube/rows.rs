//! Kernels over the rows of a `[rows, d]` matrix: LayerNorm (its scale and shift gradients are
//! column reductions, in [`super::columns`]) and the vocabulary-parallel cross-entropy.
//!
//! A row is reduced by one cube of [`BLOCK`] threads: each thread sums a strided share of the
//! row, then a tree in shared memory adds the shares in a fixed order. No float atomics (core
//! WGSL has none), and every sum has the same order on every run.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::{BLOCK, Launch, contiguous, empty, empty_like};

/// The sum of `value` over the cube's threads, every thread getting it (`partial` holds
/// [`BLOCK`] values; a power of two).
#[cube]
pub(super) fn cube_sum(partial: &mut SharedMemory<f32>, value: f32, #[comptime] block: u32) -> f32 {
    let t = UNIT_POS_X as usize;
    partial[t] = value;
    sync_cube();
    for level in 0..comptime!(block.trailing_zeros()) {
        let stride = (comptime!(block / 2) >> level) as usize;
        if t < stride {
            partial[t] = partial[t] + partial[t + stride];
        }
        sync_cube();
    }
    let total = partial[0];
    sync_cube();
    total
}

#[cube(launch)]
fn layer_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    mean_out: &mut Tensor<F>,
    rstd_out: &mut Tensor<F>,
    eps: f32,
    rows: u32,
    d: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    // Cubes past the last row redo it (the same values): no thread leaves before a barrier,
    // which WGSL requires to be reached by the whole workgroup.
    let row = min(CUBE_POS, rows as usize - 1);
    let base = row * d;
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    let mut s = 0.0f32;
    let mut c = UNIT_POS_X as usize;
    while c < d {
        s += f32::cast_from(x[base + c]);
        c += comptime!(block as usize);
    }
    let mean = cube_sum(&mut partial, s, block) / f32::cast_from(d);
    let mut q = 0.0f32;
    let mut c = UNIT_POS_X as usize;
    while c < d {
        let e = f32::cast_from(x[base + c]) - mean;
        q += e * e;
        c += comptime!(block as usize);
    }
    let var = cube_sum(&mut partial, q, block) / f32::cast_from(d);
    let rstd = 1.0 / f32::sqrt(var + eps);
    let mut c = UNIT_POS_X as usize;
    while c < d {
        let xhat = (f32::cast_from(x[base + c]) - mean) * rstd;
        y[base + c] = F::cast_from(xhat * f32::cast_from(gamma[c]) + f32::cast_from(beta[c]));
        c += comptime!(block as usize);
    }
    if UNIT_POS_X == 0 {
        mean_out[row] = F::cast_from(mean);
        rstd_out[row] = F::cast_from(rstd);
    }
}

/// LayerNorm over the last dimension of `x`: the output and each row's mean and `1 / std`.
pub fn layer_norm_forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: CubeTensor<R>,
    eps: f64,
) -> (CubeTensor<R>, (CubeTensor<R>, CubeTensor<R>)) {
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let d = gamma.meta.shape()[0];
    let rows = x.meta.shape().num_elements() / d.max(1);
    let (y, mean, rstd) = (empty_like(&x), empty(&x, [rows]), empty(&x, [rows]));
    let launch = Launch::per_row(rows);
    layer_norm_forward_kernel::launch::<R>(
        &x.client,
        launch.count,
        launch.dim,
        x.clone().into_tensor_arg(),
        gamma.into_tensor_arg(),
        beta.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        eps as f32,
        rows as u32,
        d as u32,
        BLOCK,
        x.dtype.into(),
    );
    (y, (mean, rstd))
}

#[cube(launch)]
fn layer_norm_backward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    rows: u32,
    d: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    // Cubes past the last row redo it (the same values): no thread leaves before a barrier,
    // which WGSL requires to be reached by the whole workgroup.
    let row = min(CUBE_POS, rows as usize - 1);
    let base = row * d;
    let (mu, r) = (f32::cast_from(mean[row]), f32::cast_from(rstd[row]));
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    let mut sg = 0.0f32;
    let mut sgx = 0.0f32;
    let mut c = UNIT_POS_X as usize;
    while c < d {
        let g = f32::cast_from(dy[base + c]) * f32::cast_from(gamma[c]);
        sg += g;
        sgx += g * (f32::cast_from(x[base + c]) - mu) * r;
        c += comptime!(block as usize);
    }
    let mg = cube_sum(&mut partial, sg, block) / f32::cast_from(d);
    let mgx = cube_sum(&mut partial, sgx, block) / f32::cast_from(d);
    let mut c = UNIT_POS_X as usize;
    while c < d {
        let g = f32::cast_from(dy[base + c]) * f32::cast_from(gamma[c]);
        let xhat = (f32::cast_from(x[base + c]) - mu) * r;
        dx[base + c] = F::cast_from((g - mg - xhat * mgx) * r);
        c += comptime!(block as usize);
    }
}

/// LayerNorm's backward pass: the gradients of `x`, `gamma` and `beta`.
pub fn layer_norm_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    stats: (CubeTensor<R>, CubeTensor<R>),
    dy: CubeTensor<R>,
) -> [CubeTensor<R>; 3] {
    let (x, gamma, dy) = (contiguous(x), contiguous(gamma), contiguous(dy));
    let (mean, rstd) = (contiguous(stats.0), contiguous(stats.1));
    let d = gamma.meta.shape()[0];
    let rows = mean.meta.shape()[0];
    let dx = empty_like(&x);
    let launch = Launch::per_row(rows);
    layer_norm_backward_kernel::launch::<R>(
        &x.client,
        launch.count,
        launch.dim,
        x.clone().into_tensor_arg(),
        gamma.into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        BLOCK,
        x.dtype.into(),
    );
    let [dgamma, dbeta] = super::columns::layer_norm_params(&x, (mean, rstd), dy, d);
    [dx, dgamma, dbeta]
}
