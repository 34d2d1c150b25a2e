//! Blockwise self-attention backward from each query's log-sum-exp, on a fused Q/K/V buffer:
//! no `[seq, seq]` probabilities, no float atomics.
//!
//! With `p = exp(q·k · scale − lse)` rebuilt from the forward pass's log-sum-exp and
//! `Δ_i = Σ_e dctx_ie · ctx_ie` (one small kernel, `delta_kernel`), each visible (query `i`,
//! key `j`) pair gives `ds = p (dctx_i·v_j − Δ_i)`, and
//! - `dq_i = scale · Σ_j ds k_j`: one thread per query, walking the keys and values in
//!   shared-memory tiles, as the forward kernel does;
//! - `dk_j = scale · Σ_i ds q_i` and `dv_j = Σ_i p dctx_i`: one thread per key, walking the
//!   queries, their context gradients, log-sum-exps and `Δ` in tiles.
//!
//! One kernel (`grads_kernel`) does both, launched twice: its `per_key` flag, known when it is
//! compiled, picks the side.
//!
//! Each thread owns the rows it writes, so the sums run in a fixed order: deterministic. A
//! causal key cube starts at its first key's query; a causal query cube stops at its last
//! query's key. Keys of another segment (packed documents) are skipped, as in the forward pass.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::attention::load_keys;
use super::{Launch, contiguous, empty_typed};
use crate::kernels::AttentionSpec;

/// Rows (queries or keys) per cube: one thread each.
const QUERIES: u32 = 64;

/// Half a tile's shared memory, in 4-byte words: a tile of `TILE_ELEMS / (head_dim + 2)` rows
/// holds two rows of `head_dim` words each and three words more (a segment id, a log-sum-exp,
/// Δ), under 2 × 2,048 words, 16 KiB, the least workgroup memory WebGPU guarantees.
const TILE_ELEMS: usize = 2048;

/// `delta[(b, head), i] = Σ_e dctx · ctx` over query `i`'s head row.
#[cube(launch)]
fn delta_kernel<F: Float>(
    ctx: &Tensor<F>,
    dctx: &Tensor<F>,
    delta: &mut Tensor<f32>,
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
        delta[at] = sum;
    }
}

/// The gradients of one cube of [`QUERIES`] rows of one (sequence, head): with `per_key`, of
/// keys (`dk`, `dv`, walking tiles of queries), else of queries (`dq`, walking tiles of keys
/// and values), written into their columns of `dqkv`.
#[cube(launch)]
fn grads_kernel<F: Float, I: Int>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    segments: &Tensor<I>,
    dqkv: &mut Tensor<F>,
    seq: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[comptime] per_key: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (s, h) = (seq as usize, heads as usize);
    let (width, hd) = (3 * h * head_dim, h * head_dim);
    let pair = CUBE_POS_Y as usize;
    let (b, head) = (pair / h, pair % h);
    let first = CUBE_POS_X as usize * comptime!(QUERIES as usize);
    let wanted = first + UNIT_POS_X as usize;
    // Threads past the last row redo it: every thread reaches every barrier.
    let own = min(wanted, s - 1);
    let rows = b * s;
    // The own row's two vectors (q · scale and dctx, or k and v) and two sums (dq, or dk and
    // dv).
    let mut x = Array::<f32>::new(head_dim);
    let mut y = Array::<f32>::new(head_dim);
    let mut sx = Array::<f32>::new(head_dim);
    let mut sy = Array::<f32>::new(head_dim);
    for e in 0..head_dim {
        let column = head * head_dim + e;
        if per_key {
            x[e] = f32::cast_from(qkv[(rows + own) * width + hd + column]);
            y[e] = f32::cast_from(qkv[(rows + own) * width + 2 * hd + column]);
        } else {
            x[e] = f32::cast_from(qkv[(rows + own) * width + column]) * scale;
            y[e] = f32::cast_from(dctx[(rows + own) * hd + column]);
        }
        sx[e] = 0.0;
        sy[e] = 0.0;
    }
    // The tile: keys and values, or queries (· scale) and their context gradients; then per
    // row its segment id and, for queries, the log-sum-exp and Δ.
    let mut ta = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut tb = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut tile_segments = SharedMemory::<i32>::new(tile);
    let mut tile_lse = SharedMemory::<f32>::new(tile);
    let mut tile_delta = SharedMemory::<f32>::new(tile);
    let mut mine = 0i32;
    if segmented {
        mine = i32::cast_from(segments[rows + own]);
    }
    let mut own_lse = 0.0f32;
    let mut own_delta = 0.0f32;
    if !per_key {
        own_lse = lse[pair * s + own];
        own_delta = delta[pair * s + own];
    }
    // Causal: a key is seen by its own query and later ones, a query sees keys up to itself.
    let mut start = 0usize;
    let mut end = s;
    if causal && per_key {
        start = first;
    }
    if causal && !per_key {
        end = min(first + comptime!(QUERIES as usize), s);
    }
    while start < end {
        if per_key {
            let mut at = UNIT_POS_X as usize;
            while at < comptime!(tile * head_dim) {
                let i = min(start + at / head_dim, s - 1);
                let column = head * head_dim + at % head_dim;
                ta[at] = f32::cast_from(qkv[(rows + i) * width + column]) * scale;
                tb[at] = f32::cast_from(dctx[(rows + i) * hd + column]);
                at += comptime!(QUERIES as usize);
            }
            let mut r = UNIT_POS_X as usize;
            while r < tile {
                let i = min(start + r, s - 1);
                tile_lse[r] = lse[pair * s + i];
                tile_delta[r] = delta[pair * s + i];
                if segmented {
                    tile_segments[r] = i32::cast_from(segments[rows + i]);
                }
                r += comptime!(QUERIES as usize);
            }
        } else {
            load_keys(
                qkv,
                segments,
                &mut ta,
                &mut tb,
                &mut tile_segments,
                rows,
                start,
                s,
                head,
                h,
                head_dim,
                tile,
                comptime!(QUERIES as usize),
                segmented,
                false,
            );
        }
        sync_cube();
        let mut from = start;
        let mut limit = min(start + tile, s);
        if causal && per_key && own > start {
            from = own;
        }
        if causal && !per_key {
            limit = min(limit, own + 1);
        }
        let mut t = from;
        while t < limit {
            let mut visible = true;
            if segmented {
                visible = tile_segments[t - start] == mine;
            }
            if visible {
                let row = (t - start) * head_dim;
                // score = q · k (scaled), dp = dctx · v, whichever side the thread holds.
                let mut score = 0.0f32;
                let mut dp = 0.0f32;
                for e in 0..head_dim {
                    score += x[e] * ta[row + e];
                    if per_key {
                        dp += tb[row + e] * y[e];
                    } else {
                        dp += y[e] * tb[row + e];
                    }
                }
                if per_key {
                    let p = f32::exp(score - tile_lse[t - start]);
                    let ds = p * (dp - tile_delta[t - start]);
                    // The tile holds q · scale: ds q scale, as dk wants.
                    for e in 0..head_dim {
                        sx[e] += ds * ta[row + e];
                        sy[e] += p * tb[row + e];
                    }
                } else {
                    let ds = f32::exp(score - own_lse) * (dp - own_delta);
                    for e in 0..head_dim {
                        sx[e] += ds * ta[row + e];
                    }
                }
            }
            t += 1;
        }
        sync_cube();
        start += tile;
    }
    if wanted < s {
        for e in 0..head_dim {
            let at = (rows + own) * width + head * head_dim + e;
            if per_key {
                dqkv[at + hd] = F::cast_from(sx[e]);
                dqkv[at + 2 * hd] = F::cast_from(sy[e]);
            } else {
                dqkv[at] = F::cast_from(sx[e] * scale);
            }
        }
    }
}

/// The gradient `[batch, seq, 3 * heads * head_dim]` of the Q/K/V buffer `qkv` of the
/// attention whose context `ctx` and log-sum-exp `lse` (`[batch, heads, seq]`, `f32`) the
/// forward kernel ([`super::attention::forward`]) gave, from the context's gradient `dctx`: in
/// `qkv`'s type, computed in `f32`.
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
    let delta = empty_typed(&qkv, [b, h, s], DType::F32);
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
    for per_key in [false, true] {
        grads_kernel::launch::<R>(
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
            // Two rows of d words and three more (a segment id, a log-sum-exp, Δ) per tile
            // row: under 2 × TILE_ELEMS words.
            (TILE_ELEMS / (d + 2)).max(1),
            spec.causal,
            segmented,
            per_key,
            dtypes,
        );
    }
    dqkv
}
