//! The sum of squares of a tensor, for gradient norms: each cube sums the squares of one chunk
//! in `f32` (a fixed tree, so the same on every run), and the host adds the chunks' sums in
//! `f64`.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::rows::cube_sum;
use burn::tensor::DType;

use super::{BLOCK, Launch, contiguous, empty_typed};

/// Elements per thread in one chunk.
const PER_THREAD: usize = 16;

#[cube(launch)]
fn chunk_squares_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<f32>,
    n: u32,
    chunks: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    // Cubes past the last row redo it (the same values): no thread leaves before a barrier,
    // which WGSL requires to be reached by the whole workgroup.
    let chunk = min(CUBE_POS, chunks as usize - 1);
    let size = comptime!(block as usize * PER_THREAD);
    let end = min((chunk + 1) * size, n as usize);
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    let mut s = 0.0f32;
    let mut i = chunk * size + UNIT_POS_X as usize;
    while i < end {
        let v = f32::cast_from(x[i]);
        s += v * v;
        i += comptime!(block as usize);
    }
    let total = cube_sum(&mut partial, s, block);
    if UNIT_POS_X == 0 {
        out[chunk] = total;
    }
}

/// The sums of squares of `x`'s chunks (`f32`, one per chunk of `BLOCK * PER_THREAD`
/// elements), left on the device.
pub fn chunk_sums<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let x = contiguous(x);
    let n = x.meta.shape().num_elements();
    let chunks = n.div_ceil(BLOCK as usize * PER_THREAD).max(1);
    let out = empty_typed(&x, [chunks], DType::F32);
    let launch = Launch::per_row(chunks);
    chunk_squares_kernel::launch::<R>(
        &x.client,
        launch.count,
        launch.dim,
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        n as u32,
        chunks as u32,
        BLOCK,
        x.dtype.into(),
    );
    out
}
