//! The vocabulary-parallel cross-entropy: a cube per row for the row's maximum, another for its
//! sum of exponentials and target logit (the two all-reduces over the tensor-parallel group go
//! between them, on the host), one cube for the mean loss, and one thread per logit for the
//! gradient.
//!
//! Scalar arguments are `u32` and `i32`: the sizes of a 32-bit index space.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::rows::cube_sum;
use super::{BLOCK, Launch, contiguous, empty, empty_like};

#[cube(launch)]
fn row_max_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<F>,
    n: u32,
    cols: u32,
    valid: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let (n, cols) = (n as usize, cols as usize);
    // Cubes past the last row redo it (the same values): no thread leaves before a barrier,
    // which WGSL requires to be reached by the whole workgroup.
    let row = min(CUBE_POS, n - 1);
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    // Below every logit: the maximum of a shard that holds only padding.
    let mut m = f32::new(-3.0e38);
    let mut c = UNIT_POS_X as usize;
    while c < valid as usize {
        let v = f32::cast_from(logits[row * cols + c]);
        if v > m {
            m = v;
        }
        c += comptime!(block as usize);
    }
    let t = UNIT_POS_X as usize;
    partial[t] = m;
    sync_cube();
    for level in 0..comptime!(block.trailing_zeros()) {
        let stride = (comptime!(block / 2) >> level) as usize;
        // Two `if`s, not `&&`: CubeCL evaluates both sides of `&&`, so the threads past
        // `stride` would read past the shared memory (an illegal address on CUDA; Vulkan's
        // robust access clamps it).
        if t < stride {
            let other = partial[t + stride];
            if other > partial[t] {
                partial[t] = other;
            }
        }
        sync_cube();
    }
    if t == 0 {
        out[row] = F::cast_from(partial[0]);
    }
}

/// Each row's `sum(exp(x - max))` over the valid columns (`sums[row]`) and its target's logit
/// when this shard holds the target, else 0 (`sums[rows + row]`).
#[cube(launch)]
fn row_sums_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    maxes: &Tensor<F>,
    targets: &Tensor<I>,
    sums: &mut Tensor<F>,
    n: u32,
    cols: u32,
    valid: u32,
    start: i32,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (n, cols) = (n as usize, cols as usize);
    // Cubes past the last row redo it (the same values): no thread leaves before a barrier,
    // which WGSL requires to be reached by the whole workgroup.
    let row = min(CUBE_POS, n - 1);
    let m = f32::cast_from(maxes[row]);
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    let mut s = 0.0f32;
    let mut c = UNIT_POS_X as usize;
    while c < valid as usize {
        s += f32::exp(f32::cast_from(logits[row * cols + c]) - m);
        c += comptime!(block as usize);
    }
    let total = cube_sum(&mut partial, s, block);
    if UNIT_POS_X == 0 {
        let local = i32::cast_from(targets[row]) - start;
        let mut picked = 0.0f32;
        if local >= 0 && local < valid as i32 {
            picked = f32::cast_from(logits[row * cols + local as usize]);
        }
        sums[row] = F::cast_from(total);
        sums[n + row] = F::cast_from(picked);
    }
}

/// The mean of `max - target logit + ln(sum)` over the rows with a target (`loss[0]`), and the
/// statistics `[rows, 2]` (max, sum) the backward pass reads.
#[cube(launch)]
fn mean_loss_kernel<F: Float, I: Int>(
    maxes: &Tensor<F>,
    sums: &Tensor<F>,
    targets: &Tensor<I>,
    loss: &mut Tensor<F>,
    stats: &mut Tensor<F>,
    n: u32,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let n = n as usize;
    let mut partial = SharedMemory::<f32>::new(comptime!(block as usize));
    let mut total = 0.0f32;
    let mut count = 0.0f32;
    let mut r = UNIT_POS_X as usize;
    while r < n {
        let m = f32::cast_from(maxes[r]);
        let s = f32::cast_from(sums[r]);
        stats[2 * r] = maxes[r];
        stats[2 * r + 1] = sums[r];
        if i32::cast_from(targets[r]) >= 0 {
            total += m - f32::cast_from(sums[n + r]) + f32::ln(s);
            count += 1.0;
        }
        r += comptime!(block as usize);
    }
    let total = cube_sum(&mut partial, total, block);
    let count = cube_sum(&mut partial, count, block);
    if UNIT_POS_X == 0 {
        let mut count = count;
        if count < 1.0 {
            count = 1.0;
        }
        loss[0] = F::cast_from(total / count);
    }
}

/// Which columns of the vocabulary a shard holds, and the tensor-parallel group's all-reduce of
/// a `[k]` tensor (the identity on one rank).
pub struct Shard<'a, R: CubeRuntime> {
    /// The shard's first global column.
    pub start: usize,
    /// Its real (non-padding) columns.
    pub valid: usize,
    /// `all_reduce(tensor, max?)`: sum, or maximum when the flag is set.
    pub all_reduce: &'a dyn Fn(CubeTensor<R>, bool) -> CubeTensor<R>,
}

/// The rows (one per target) and the columns of the logits.
fn rows_and_columns<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    targets: &CubeTensor<R>,
) -> (usize, usize) {
    let n = targets.meta.shape()[0];
    (n, logits.meta.shape().num_elements() / n.max(1))
}

/// The mean cross-entropy (`[1]`) and each row's softmax statistics (`[rows, 2]`).
pub fn forward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    shard: Shard<'_, R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (logits, targets) = (contiguous(logits), contiguous(targets));
    let (n, cols) = rows_and_columns(&logits, &targets);
    let maxes = empty(&logits, [n]);
    let launch = Launch::per_row(n);
    row_max_kernel::launch::<R>(
        &logits.client,
        launch.count.clone(),
        launch.dim,
        logits.clone().into_tensor_arg(),
        maxes.clone().into_tensor_arg(),
        n as u32,
        cols as u32,
        shard.valid as u32,
        BLOCK,
        logits.dtype.into(),
    );
    let maxes = (shard.all_reduce)(maxes, true);
    let sums = empty(&logits, [2 * n]);
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    row_sums_kernel::launch::<R>(
        &logits.client,
        launch.count,
        launch.dim,
        logits.clone().into_tensor_arg(),
        maxes.clone().into_tensor_arg(),
        targets.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        n as u32,
        cols as u32,
        shard.valid as u32,
        shard.start as i32,
        BLOCK,
        dtypes,
    );
    let sums = (shard.all_reduce)(sums, false);
    let (loss, stats) = (empty(&logits, [1]), empty(&logits, [n, 2]));
    mean_loss_kernel::launch::<R>(
        &logits.client,
        CubeCount::new_single(),
        CubeDim::new_1d(BLOCK),
        maxes.into_tensor_arg(),
        sums.into_tensor_arg(),
        targets.into_tensor_arg(),
        loss.clone().into_tensor_arg(),
        stats.clone().into_tensor_arg(),
        n as u32,
        BLOCK,
        dtypes,
    );
    (loss, stats)
}

#[cube(launch)]
fn gradient_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    stats: &Tensor<F>,
    targets: &Tensor<I>,
    scale: &Tensor<F>,
    dx: &mut Tensor<F>,
    n: u32,
    cols: u32,
    valid: u32,
    start: i32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    let cols = cols as usize;
    if i >= n as usize * cols {
        terminate!();
    }
    let (row, c) = (i / cols, i % cols);
    let target = i32::cast_from(targets[row]);
    let mut g = 0.0f32;
    if c < valid as usize && target >= 0 {
        let p = f32::exp(f32::cast_from(logits[i]) - f32::cast_from(stats[2 * row]))
            / f32::cast_from(stats[2 * row + 1]);
        let mut onehot = 0.0f32;
        if target - start == c as i32 {
            onehot = 1.0;
        }
        g = (p - onehot) * f32::cast_from(scale[0]);
    }
    dx[i] = F::cast_from(g);
}

/// The gradient of the logits, `(softmax - onehot) * scale` on rows with a target (`scale`
/// `[1]`: the loss's upstream gradient over the count of rows with a target).
pub fn backward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    stats: CubeTensor<R>,
    targets: CubeTensor<R>,
    scale: CubeTensor<R>,
    start: usize,
    valid: usize,
) -> CubeTensor<R> {
    let (logits, stats, targets) = (contiguous(logits), contiguous(stats), contiguous(targets));
    let dx = empty_like(&logits);
    let (n, cols) = rows_and_columns(&logits, &targets);
    let launch = Launch::elementwise(&dx);
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    gradient_kernel::launch::<R>(
        &dx.client,
        launch.count,
        launch.dim,
        logits.into_tensor_arg(),
        stats.into_tensor_arg(),
        targets.into_tensor_arg(),
        contiguous(scale).into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        n as u32,
        cols as u32,
        valid as u32,
        start as i32,
        dtypes,
    );
    dx
}
