//! Blockwise self-attention backward from each query's log-sum-exp, on a fused Q/K/V buffer:
//! no `[seq, seq]` probabilities, no float atomics.
//!
//! With `p = exp(q·k · scale − lse)` rebuilt from the forward pass's log-sum-exp and
//! `Δ_i = Σ_e dctx_ie · ctx_ie` (one small kernel, `delta_kernel`), each visible (query `i`,
//! key `j`) pair gives `ds = p (dctx_i·v_j − Δ_i)`, and
//! - `dq_i = scale · Σ_j ds k_j`: one thread per query, walking the keys and values in
//!   shared-memory tiles, as the forward kernel does (`query_grads_kernel`);
//! - `dk_j = scale · Σ_i ds q_i` and `dv_j = Σ_i p dctx_i`: one thread per key, walking the
//!   queries, their context gradients, log-sum-exps and `Δ` in tiles (`key_grads_kernel`).
//!
//! Each thread owns the rows it writes, so the sums run in a fixed order: deterministic. A
//! causal key cube starts at its first key's query; a causal query cube stops at its last
//! query's key. Keys of another segment (packed documents) are skipped, as in the forward pass.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::attention::{QUERIES, TILE_ELEMS};
use super::{Launch, contiguous, empty_typed};
use crate::kernels::AttentionSpec;

/// `delta[(b, head), i] = Σ_e dctx · ctx` over query `i`'s head row.
#[cube(launch)]
fn delta_kernel<F: Float>(
    ctx: &Tensor<F>,
    dctx: &Tensor<F>,
    delta: &mut Tensor<F>,
    seq: u32,
    heads: u32,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (s, h) = (seq as usize, heads as usize);
    let at = ABSOLUTE_POS;
    if at < delta.len() {
        let (pair, i) = (at / s, at % s);
        let (b, head) = (pair / h, pair % h);
        let row = (b * s + i) * h * head_dim + head * head_dim;
        let mut sum = 0.0f32;
        for e in 0..head_dim {
            sum += f32::cast_from(dctx[row + e]) * f32::cast_from(ctx[row + e]);
        }
        delta[at] = F::cast_from(sum);
    }
}

/// The query gradients `dq` of one cube of [`QUERIES`] queries of one (sequence, head),
/// written into `dqkv`'s query columns.
#[cube(launch)]
fn query_grads_kernel<F: Float, I: Int>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    segments: &Tensor<I>,
    dqkv: &mut Tensor<F>,
    seq: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (s, h) = (seq as usize, heads as usize);
    let (width, hd) = (3 * h * head_dim, h * head_dim);
    let pair = CUBE_POS_Y as usize;
    let (b, head) = (pair / h, pair % h);
    let first = CUBE_POS_X as usize * comptime!(QUERIES as usize);
    let wanted = first + UNIT_POS_X as usize;
    // Threads past the last query redo it: every thread reaches every barrier.
    let i = min(wanted, s - 1);
    let rows = b * s;
    let mut q = Array::<f32>::new(head_dim);
    let mut g = Array::<f32>::new(head_dim);
    let mut dq = Array::<f32>::new(head_dim);
    for e in 0..head_dim {
        q[e] = f32::cast_from(qkv[(rows + i) * width + head * head_dim + e]) * scale;
        g[e] = f32::cast_from(dctx[(rows + i) * hd + head * head_dim + e]);
        dq[e] = 0.0;
    }
    let (lse, delta) = (
        f32::cast_from(lse[pair * s + i]),
        f32::cast_from(delta[pair * s + i]),
    );
    let mut keys = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut values = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut key_segments = SharedMemory::<i32>::new(tile);
    let mut mine = 0i32;
    if segmented {
        mine = i32::cast_from(segments[rows + i]);
    }
    let mut end = s;
    if causal {
        end = min(first + comptime!(QUERIES as usize), s);
    }
    let mut start = 0usize;
    while start < end {
        let mut at = UNIT_POS_X as usize;
        while at < comptime!(tile * head_dim) {
            let j = min(start + at / head_dim, s - 1);
            let column = head * head_dim + at % head_dim;
            keys[at] = f32::cast_from(qkv[(rows + j) * width + hd + column]);
            values[at] = f32::cast_from(qkv[(rows + j) * width + 2 * hd + column]);
            at += comptime!(QUERIES as usize);
        }
        if segmented {
            let mut r = UNIT_POS_X as usize;
            while r < tile {
                key_segments[r] = i32::cast_from(segments[rows + min(start + r, s - 1)]);
                r += comptime!(QUERIES as usize);
            }
        }
        sync_cube();
        let mut limit = min(start + tile, s);
        if causal {
            limit = min(limit, i + 1);
        }
        let mut j = start;
        while j < limit {
            let mut visible = true;
            if segmented {
                visible = key_segments[j - start] == mine;
            }
            if visible {
                let row = (j - start) * head_dim;
                let mut score = 0.0f32;
                let mut dp = 0.0f32;
                for e in 0..head_dim {
                    score += q[e] * keys[row + e];
                    dp += g[e] * values[row + e];
                }
                let ds = f32::exp(score - lse) * (dp - delta);
                for e in 0..head_dim {
                    dq[e] += ds * keys[row + e];
                }
            }
            j += 1;
        }
        sync_cube();
        start += tile;
    }
    if wanted < s {
        for e in 0..head_dim {
            dqkv[(rows + i) * width + head * head_dim + e] = F::cast_from(dq[e] * scale);
        }
    }
}

/// The key and value gradients `dk`, `dv` of one cube of [`QUERIES`] keys of one (sequence,
/// head), written into `dqkv`'s key and value columns.
#[cube(launch)]
fn key_grads_kernel<F: Float, I: Int>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    segments: &Tensor<I>,
    dqkv: &mut Tensor<F>,
    seq: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (s, h) = (seq as usize, heads as usize);
    let (width, hd) = (3 * h * head_dim, h * head_dim);
    let pair = CUBE_POS_Y as usize;
    let (b, head) = (pair / h, pair % h);
    let first = CUBE_POS_X as usize * comptime!(QUERIES as usize);
    let wanted = first + UNIT_POS_X as usize;
    // Threads past the last key redo it: every thread reaches every barrier.
    let j = min(wanted, s - 1);
    let rows = b * s;
    let mut k = Array::<f32>::new(head_dim);
    let mut v = Array::<f32>::new(head_dim);
    let mut dk = Array::<f32>::new(head_dim);
    let mut dv = Array::<f32>::new(head_dim);
    for e in 0..head_dim {
        k[e] = f32::cast_from(qkv[(rows + j) * width + hd + head * head_dim + e]);
        v[e] = f32::cast_from(qkv[(rows + j) * width + 2 * hd + head * head_dim + e]);
        dk[e] = 0.0;
        dv[e] = 0.0;
    }
    // Each query's scaled row and context gradient, then its log-sum-exp, Δ and segment.
    let mut queries = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut grads = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut query_lse = SharedMemory::<f32>::new(tile);
    let mut query_delta = SharedMemory::<f32>::new(tile);
    let mut query_segments = SharedMemory::<i32>::new(tile);
    let mut mine = 0i32;
    if segmented {
        mine = i32::cast_from(segments[rows + j]);
    }
    // A causal key is seen by its own query and the later ones only.
    let mut start = 0usize;
    if causal {
        start = first;
    }
    while start < s {
        let mut at = UNIT_POS_X as usize;
        while at < comptime!(tile * head_dim) {
            let i = min(start + at / head_dim, s - 1);
            let column = head * head_dim + at % head_dim;
            queries[at] = f32::cast_from(qkv[(rows + i) * width + column]) * scale;
            grads[at] = f32::cast_from(dctx[(rows + i) * hd + column]);
            at += comptime!(QUERIES as usize);
        }
        let mut r = UNIT_POS_X as usize;
        while r < tile {
            let i = min(start + r, s - 1);
            query_lse[r] = f32::cast_from(lse[pair * s + i]);
            query_delta[r] = f32::cast_from(delta[pair * s + i]);
            if segmented {
                query_segments[r] = i32::cast_from(segments[rows + i]);
            }
            r += comptime!(QUERIES as usize);
        }
        sync_cube();
        let limit = min(start + tile, s);
        let mut i = start;
        if causal && j > start {
            i = j;
        }
        while i < limit {
            let mut visible = true;
            if segmented {
                visible = query_segments[i - start] == mine;
            }
            if visible {
                let row = (i - start) * head_dim;
                let mut score = 0.0f32;
                let mut dp = 0.0f32;
                for e in 0..head_dim {
                    score += queries[row + e] * k[e];
                    dp += grads[row + e] * v[e];
                }
                let p = f32::exp(score - query_lse[i - start]);
                let ds = p * (dp - query_delta[i - start]);
                // `queries` holds q · scale: ds q scale, as dk wants.
                for e in 0..head_dim {
                    dv[e] += p * grads[row + e];
                    dk[e] += ds * queries[row + e];
                }
            }
            i += 1;
        }
        sync_cube();
        start += tile;
    }
    if wanted < s {
        for e in 0..head_dim {
            let column = head * head_dim + e;
            dqkv[(rows + j) * width + hd + column] = F::cast_from(dk[e]);
            dqkv[(rows + j) * width + 2 * hd + column] = F::cast_from(dv[e]);
        }
    }
}

/// The gradient `[batch, seq, 3 * heads * head_dim]` of the Q/K/V buffer `qkv` of the
/// attention whose context `ctx` and log-sum-exp `lse` (`[batch, heads, seq]`) the forward
/// kernel ([`super::attention::forward`]) gave, from the context's gradient `dctx`.
pub fn backward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    ctx: CubeTensor<R>,
    lse: CubeTensor<R>,
    dctx: CubeTensor<R>,
    spec: AttentionSpec,
    segments: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    let (qkv, ctx, lse, dctx) = (
        contiguous(qkv),
        contiguous(ctx),
        contiguous(lse),
        contiguous(dctx),
    );
    let dims = qkv.meta.shape().clone();
    let (b, s, width) = (dims[0], dims[1], dims[2]);
    let h = spec.heads.max(1);
    let d = width / (3 * h);
    let dqkv = empty_typed(&qkv, [b, s, width], qkv.dtype);
    if b * s * d == 0 {
        return dqkv;
    }
    let delta = empty_typed(&qkv, [b, h, s], qkv.dtype);
    let launch = Launch::elements(&qkv.client, b * h * s);
    delta_kernel::launch::<R>(
        &qkv.client,
        launch.count,
        launch.dim,
        ctx.into_tensor_arg(),
        dctx.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        s as u32,
        h as u32,
        d,
        qkv.dtype.into(),
    );
    let segmented = segments.is_some();
    // Without segments the kernels read none: one unused id stands in for them.
    let segments = segments
        .map(contiguous)
        .unwrap_or_else(|| empty_typed(&qkv, [1], DType::I32));
    let count = CubeCount::Static(s.div_ceil(QUERIES as usize) as u32, (b * h) as u32, 1);
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let dtypes = [qkv.dtype.into(), segments.dtype.into()];
    query_grads_kernel::launch::<R>(
        &qkv.client,
        count.clone(),
        CubeDim::new_1d(QUERIES),
        qkv.clone().into_tensor_arg(),
        dctx.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        segments.clone().into_tensor_arg(),
        dqkv.clone().into_tensor_arg(),
        s as u32,
        h as u32,
        scale,
        d,
        (TILE_ELEMS / (d + 1)).max(1),
        spec.causal,
        segmented,
        dtypes,
    );
    key_grads_kernel::launch::<R>(
        &qkv.client,
        count,
        CubeDim::new_1d(QUERIES),
        qkv.clone().into_tensor_arg(),
        dctx.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        segments.into_tensor_arg(),
        dqkv.clone().into_tensor_arg(),
        s as u32,
        h as u32,
        scale,
        d,
        (TILE_ELEMS / (d + 2)).max(1),
        spec.causal,
        segmented,
        dtypes,
    );
    dqkv
}
