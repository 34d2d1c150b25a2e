//! Column reductions of a `[rows, d]` matrix (a bias's gradient, LayerNorm's scale and shift
//! gradients) in two passes, so that a tall matrix keeps the GPU busy:
//!
//! 1. a cube of [`BLOCK`] threads per block of columns and chunk of rows: each thread sums its
//!    column over the chunk's rows (neighbouring threads read neighbouring columns of a row:
//!    coalesced), into an `f32` partial `[chunks, d]`;
//! 2. one thread per column adds the chunks' partials in order (`chunk_totals_kernel`).
//!
//! One thread per column over every row (the first version) ran `d` threads for the whole
//! reduction: 768 threads on a GPU that holds over 100,000. Both passes sum in a fixed order,
//! so the result is the same on every run; no float atomics.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::{BLOCK, Launch, elements, empty, empty_typed};

/// Rows a thread of the first pass sums (more when the rows would need more than
/// [`MAX_CHUNKS`] chunks).
const ROW_CHUNK: usize = 64;

/// The most chunks of rows: the largest second grid dimension CUDA and WebGPU launch.
const MAX_CHUNKS: usize = 65_535;

/// The chunks of rows of a first pass over `rows` rows, and the rows per chunk.
fn chunking(rows: usize) -> (usize, usize) {
    let per = ROW_CHUNK.max(rows.div_ceil(MAX_CHUNKS));
    (rows.div_ceil(per).max(1), per)
}

/// Where the first pass runs: a cube per block of columns and chunk of rows.
fn first_pass(d: usize, chunks: usize) -> (CubeCount, CubeDim) {
    let blocks = d.div_ceil(BLOCK as usize) as u32;
    (
        CubeCount::Static(blocks, chunks as u32, 1),
        CubeDim::new_1d(BLOCK),
    )
}

/// `partials[chunk, c]`: column `c` of `x` summed over the chunk's rows.
#[cube(launch)]
fn column_partials_kernel<F: Float>(
    x: &Tensor<F>,
    partials: &mut Tensor<f32>,
    rows: u32,
    d: u32,
    per: u32,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    let c = CUBE_POS_X as usize * comptime!(BLOCK as usize) + UNIT_POS_X as usize;
    if c >= d {
        terminate!();
    }
    let chunk = CUBE_POS_Y as usize;
    let start = chunk * per as usize;
    let end = min(start + per as usize, rows as usize);
    let mut s = 0.0f32;
    for r in start..end {
        s += f32::cast_from(x[r * d + c]);
    }
    partials[chunk * d + c] = s;
}

/// `out[c]`: the chunks' partials of column `c` added in chunk order.
#[cube(launch)]
fn chunk_totals_kernel<F: Float>(
    partials: &Tensor<f32>,
    out: &mut Tensor<F>,
    chunks: u32,
    d: u32,
    #[define(F)] _dtype: StorageType,
) {
    let (c, d) = (ABSOLUTE_POS, d as usize);
    if c >= d {
        terminate!();
    }
    let mut s = 0.0f32;
    for k in 0..chunks as usize {
        s += partials[k * d + c];
    }
    out[c] = F::cast_from(s);
}

/// The second pass: `[d]` in `like`'s type from the `[chunks, d]` partials.
fn totals<R: CubeRuntime>(like: &CubeTensor<R>, partials: CubeTensor<R>) -> CubeTensor<R> {
    let dims = partials.meta.shape().clone();
    let (chunks, d) = (dims[0], dims[1]);
    let out = empty(like, [d]);
    let launch = Launch::elementwise(&out);
    chunk_totals_kernel::launch::<R>(
        &like.client,
        launch.count,
        launch.dim,
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        chunks as u32,
        d as u32,
        like.dtype.into(),
    );
    out
}

/// The sums of the columns of `x` (contiguous) seen as `[len / d, d]`: `[d]`.
pub fn column_sums<R: CubeRuntime>(x: &CubeTensor<R>, d: usize) -> CubeTensor<R> {
    let rows = (elements(x) as usize) / d.max(1);
    let (chunks, per) = chunking(rows);
    let partials = empty_typed(x, [chunks, d], DType::F32);
    let (count, dim) = first_pass(d, chunks);
    column_partials_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        per as u32,
        x.dtype.into(),
    );
    totals(x, partials)
}

/// Per chunk of rows: `Σ dy · xhat` (gamma's gradient) and `Σ dy` (beta's) of each column.
#[cube(launch)]
fn layer_norm_partials_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    dgamma: &mut Tensor<f32>,
    dbeta: &mut Tensor<f32>,
    rows: u32,
    d: u32,
    per: u32,
    #[define(F)] _dtype: StorageType,
) {
    let d = d as usize;
    let c = CUBE_POS_X as usize * comptime!(BLOCK as usize) + UNIT_POS_X as usize;
    if c >= d {
        terminate!();
    }
    let chunk = CUBE_POS_Y as usize;
    let start = chunk * per as usize;
    let end = min(start + per as usize, rows as usize);
    let mut sg = 0.0f32;
    let mut sb = 0.0f32;
    for r in start..end {
        let g = f32::cast_from(dy[r * d + c]);
        let xhat =
            (f32::cast_from(x[r * d + c]) - f32::cast_from(mean[r])) * f32::cast_from(rstd[r]);
        sg += g * xhat;
        sb += g;
    }
    dgamma[chunk * d + c] = sg;
    dbeta[chunk * d + c] = sb;
}

/// LayerNorm's scale and shift gradients `[d]` from `x`, its rows' `mean` and `rstd`, and `dy`
/// (all contiguous).
pub fn layer_norm_params<R: CubeRuntime>(
    x: &CubeTensor<R>,
    (mean, rstd): (CubeTensor<R>, CubeTensor<R>),
    dy: CubeTensor<R>,
    d: usize,
) -> [CubeTensor<R>; 2] {
    let rows = mean.meta.shape()[0];
    let (chunks, per) = chunking(rows);
    let gamma = empty_typed(x, [chunks, d], DType::F32);
    let beta = empty_typed(x, [chunks, d], DType::F32);
    let (count, dim) = first_pass(d, chunks);
    layer_norm_partials_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        mean.into_tensor_arg(),
        rstd.into_tensor_arg(),
        dy.into_tensor_arg(),
        gamma.clone().into_tensor_arg(),
        beta.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        per as u32,
        x.dtype.into(),
    );
    [totals(x, gamma), totals(x, beta)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_cut_into_chunks_the_launch_allows() {
        assert_eq!(chunking(0), (1, ROW_CHUNK));
        assert_eq!(chunking(1), (1, ROW_CHUNK));
        assert_eq!(chunking(65), (2, ROW_CHUNK));
        let (chunks, per) = chunking(10_000_000);
        assert!(chunks <= MAX_CHUNKS && chunks * per >= 10_000_000);
    }
}
