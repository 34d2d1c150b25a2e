//! Blockwise self-attention forward with each query's log-sum-exp, on a fused Q/K/V buffer.
//!
//! One cube of [`QUERIES`] threads per block of queries of one (sequence, head); each thread
//! holds its query and its running context. The cube walks the keys tile by tile: its threads
//! load a tile of keys and values into shared memory together, then each thread folds the tile
//! into its online softmax (running maximum, running sum, context rescaled when the maximum
//! grows). No `[seq, seq]` scores exist anywhere; a causal cube stops at its last query's key.
//! With segment ids (documents packed into one sequence), a key of another segment is skipped.
//! The log-sum-exp lets the backward pass rebuild the probabilities as `exp(scores - lse)`
//! instead of a softmax.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::{contiguous, empty_typed};
use crate::kernels::AttentionSpec;

/// Queries per cube (threads).
pub const QUERIES: u32 = 64;

/// Half a tile's shared memory, in 4-byte words. A tile of `TILE_ELEMS / (head_dim + 1)` keys
/// holds their keys and values (`head_dim` words each) and segment ids (one word each): under
/// 2 × 2,048 words, 16 KiB, the least workgroup memory WebGPU guarantees.
pub(super) const TILE_ELEMS: usize = 2048;

#[cube(launch)]
fn attention_forward_kernel<F: Float, I: Int>(
    qkv: &Tensor<F>,
    segments: &Tensor<I>,
    ctx: &mut Tensor<F>,
    lse: &mut Tensor<F>,
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
    let width = 3 * h * head_dim;
    let pair = CUBE_POS_Y as usize;
    let (b, head) = (pair / h, pair % h);
    let first = CUBE_POS_X as usize * comptime!(QUERIES as usize);
    let wanted = first + UNIT_POS_X as usize;
    // Threads past the last query redo it: every thread reaches every barrier.
    let i = min(wanted, s - 1);
    let rows = b * s;
    let mut q = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    for e in 0..head_dim {
        q[e] = f32::cast_from(qkv[(rows + i) * width + head * head_dim + e]) * scale;
        acc[e] = 0.0;
    }
    let mut keys = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut values = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut key_segments = SharedMemory::<i32>::new(tile);
    let mut mine = 0i32;
    if segmented {
        mine = i32::cast_from(segments[rows + i]);
    }
    // Below every score: the first key replaces it (exp of the difference is 0).
    let mut m = f32::new(-3.0e38);
    let mut l = 0.0f32;
    let mut end = s;
    if causal {
        end = min(first + comptime!(QUERIES as usize), s);
    }
    let mut start = 0usize;
    while start < end {
        load_keys(
            qkv,
            segments,
            &mut keys,
            &mut values,
            &mut key_segments,
            rows,
            start,
            s,
            head,
            h,
            head_dim,
            tile,
            segmented,
        );
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
                for e in 0..head_dim {
                    score += q[e] * keys[row + e];
                }
                if score > m {
                    let shrink = f32::exp(m - score);
                    l *= shrink;
                    for e in 0..head_dim {
                        acc[e] *= shrink;
                    }
                    m = score;
                }
                let p = f32::exp(score - m);
                l += p;
                for e in 0..head_dim {
                    acc[e] += p * values[row + e];
                }
            }
            j += 1;
        }
        sync_cube();
        start += tile;
    }
    if wanted < s {
        for e in 0..head_dim {
            ctx[(rows + i) * h * head_dim + head * head_dim + e] = F::cast_from(acc[e] / l);
        }
        lse[pair * s + i] = F::cast_from(m + f32::ln(l));
    }
}

/// Loads the tile of keys `start..start + tile` of sequence `rows / s`, head `head` (of `h`),
/// into `keys` and `values` (`tile × head_dim` each) and, `segmented`, their segment ids: each
/// thread of the cube a strided share. Past the last key, the last key again. The caller waits
/// for the whole cube (`sync_cube`) before reading it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_keys<F: Float, I: Int>(
    qkv: &Tensor<F>,
    segments: &Tensor<I>,
    keys: &mut SharedMemory<f32>,
    values: &mut SharedMemory<f32>,
    key_segments: &mut SharedMemory<i32>,
    rows: usize,
    start: usize,
    s: usize,
    head: usize,
    h: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] segmented: bool,
) {
    let width = 3 * h * head_dim;
    let mut at = UNIT_POS_X as usize;
    while at < comptime!(tile * head_dim) {
        let j = min(start + at / head_dim, s - 1);
        let column = head * head_dim + at % head_dim;
        keys[at] = f32::cast_from(qkv[(rows + j) * width + h * head_dim + column]);
        values[at] = f32::cast_from(qkv[(rows + j) * width + 2 * h * head_dim + column]);
        at += comptime!(QUERIES as usize);
    }
    if segmented {
        let mut r = UNIT_POS_X as usize;
        while r < tile {
            key_segments[r] = i32::cast_from(segments[rows + min(start + r, s - 1)]);
            r += comptime!(QUERIES as usize);
        }
    }
}

/// The context `[batch, seq, heads * head_dim]` and each query's log-sum-exp of its scaled
/// scores `[batch, heads, seq]`, of self-attention on `qkv` (`[batch, seq, 3 * heads *
/// head_dim]`: every query head, then the keys, then the values), a token attending only to
/// tokens of its own segment where `segments` (`[batch, seq]`) are given.
pub fn forward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    spec: AttentionSpec,
    segments: Option<CubeTensor<R>>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let qkv = contiguous(qkv);
    let dims = qkv.meta.shape().clone();
    let (b, s, width) = (dims[0], dims[1], dims[2]);
    let h = spec.heads.max(1);
    let d = width / (3 * h);
    let ctx = empty_typed(&qkv, [b, s, h * d], qkv.dtype);
    let lse = empty_typed(&qkv, [b, h, s], qkv.dtype);
    if b * s * d == 0 {
        return (ctx, lse);
    }
    let segmented = segments.is_some();
    // Without segments the kernel reads none: one unused id stands in for them.
    let segments = segments
        .map(contiguous)
        .unwrap_or_else(|| empty_typed(&qkv, [1], DType::I32));
    let count = CubeCount::Static(s.div_ceil(QUERIES as usize) as u32, (b * h) as u32, 1);
    attention_forward_kernel::launch::<R>(
        &qkv.client,
        count,
        CubeDim::new_1d(QUERIES),
        qkv.clone().into_tensor_arg(),
        segments.clone().into_tensor_arg(),
        ctx.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        s as u32,
        h as u32,
        (1.0 / (d as f64).sqrt()) as f32,
        d,
        (TILE_ELEMS / (d + 1)).max(1),
        spec.causal,
        segmented,
        [qkv.dtype.into(), segments.dtype.into()],
    );
    (ctx, lse)
}
