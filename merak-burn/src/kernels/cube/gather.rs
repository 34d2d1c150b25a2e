//! The embedding: one thread per output element forward; backward one thread per column,
//! walking the tokens in order (no atomics: a column belongs to one thread).

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::{Launch, contiguous, empty};

#[cube(launch)]
fn gather_forward_kernel<F: Float, I: Int>(
    table: &Tensor<F>,
    ids: &Tensor<I>,
    out: &mut Tensor<F>,
    start: i32,
    n: u32,
    rows: u32,
    d: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    let (rows, d) = (rows as usize, d as usize);
    if i >= n as usize * d {
        terminate!();
    }
    let local = i32::cast_from(ids[i / d]) - start;
    let mut v = F::new(0.0);
    if local >= 0 && local < rows as i32 {
        v = table[local as usize * d + i % d];
    }
    out[i] = v;
}

#[cube(launch)]
fn gather_backward_kernel<F: Float, I: Int>(
    ids: &Tensor<I>,
    dy: &Tensor<F>,
    grad: &mut Tensor<F>,
    start: i32,
    n: u32,
    rows: u32,
    d: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let c = ABSOLUTE_POS;
    let (n, rows, d) = (n as usize, rows as usize, d as usize);
    if c >= d {
        terminate!();
    }
    for r in 0..rows {
        grad[r * d + c] = F::new(0.0);
    }
    for t in 0..n {
        let local = i32::cast_from(ids[t]) - start;
        if local >= 0 && local < rows as i32 {
            let at = local as usize * d + c;
            grad[at] = F::cast_from(f32::cast_from(grad[at]) + f32::cast_from(dy[t * d + c]));
        }
    }
}

/// The rows of `table` (`[rows, d]`, global rows `start..start + rows`) for `ids` (`[n]`), zeros
/// for ids held elsewhere: `[n, d]`.
pub fn forward<R: CubeRuntime>(
    table: CubeTensor<R>,
    ids: CubeTensor<R>,
    start: usize,
) -> CubeTensor<R> {
    let (table, ids) = (contiguous(table), contiguous(ids));
    let (n, d) = (ids.meta.shape()[0], table.meta.shape()[1]);
    let out = empty(&table, [n, d]);
    let launch = Launch::elementwise(&out);
    gather_forward_kernel::launch::<R>(
        &table.client,
        launch.count,
        launch.dim,
        table.clone().into_tensor_arg(),
        ids.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        start as i32,
        n as u32,
        table.meta.shape()[0] as u32,
        d as u32,
        [table.dtype.into(), ids.dtype.into()],
    );
    out
}

/// The table shard's gradient (`[rows, d]`): each row of `dy` (`[n, d]`) added to its id's row.
pub fn backward<R: CubeRuntime>(
    ids: CubeTensor<R>,
    dy: CubeTensor<R>,
    rows: usize,
    start: usize,
) -> CubeTensor<R> {
    let (ids, dy) = (contiguous(ids), contiguous(dy));
    let d = dy.meta.shape()[1];
    let grad = empty(&dy, [rows, d]);
    let launch = Launch::elements(&dy.client, d);
    gather_backward_kernel::launch::<R>(
        &dy.client,
        launch.count,
        launch.dim,
        ids.clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        start as i32,
        ids.meta.shape()[0] as u32,
        rows as u32,
        d as u32,
        [dy.dtype.into(), ids.dtype.into()],
    );
    grad
}
