//! Blockwise self-attention backward from each query's `f32` log-sum-exp, on a fused Q/K/V
//! buffer, tiled like the forward kernel: no `[seq, seq]` probabilities, no float atomics.
//!
//! With `p = exp(q·k · scale − lse)` rebuilt from the forward pass's log-sum-exp and
//! `Δ_i = Σ_e dctx_ie · ctx_ie` (one small kernel, `delta_kernel`), each visible (query `i`,
//! key `j`) pair gives `ds = p (dctx_i·v_j − Δ_i)`, and
//! - `dq_i = scale · Σ_j ds k_j`: a cube per block of queries, walking tiles of keys and values;
//! - `dk_j = scale · Σ_i ds q_i` and `dv_j = Σ_i p dctx_i`: a cube per block of keys, walking
//!   tiles of queries, their context gradients, log-sum-exps and `Δ`.
//!
//! One kernel (`grads_kernel`) does both, launched twice: its `per_key` flag, known when it is
//! compiled, picks the side. Each side is the forward's two tile products again
//! ([`tile_scores`], [`tile_accumulate`]): the scores and `dctx·v` of the block against the tile
//! (transposed on the key side: its rows are keys), `p` and `ds` element by element, then `ds`
//! (and `p`) times the tile's rows. So the backward runs on tensor cores where the forward does.
//!
//! Each cube owns the rows it writes, so the sums run in a fixed order: deterministic. A
//! causal key cube starts at its first key's query; a causal query cube stops at its last
//! query's key. Pairs across segments (packed documents) are masked, as in the forward pass.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::attention::{Span, choose_tiles, load_key_values, load_rows, load_segments, visible};
use super::attention_tiles::{TileProduct, Tiles, round_bf16, tile_accumulate, tile_scores};
use super::{Launch, contiguous, empty_typed};
use crate::kernels::AttentionSpec;

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

/// A cube's shared memory: its own rows (queries and their context gradients, or keys and
/// values), the tile's rows (keys and values, or queries and their context gradients), the
/// scores and `dctx·v` of the two, `ds` (and on the key side `p`) for the second products, the
/// gradients of the own rows, each query's log-sum-exp and `Δ` (the own rows' or the tile's)
/// and both sides' segment ids.
#[derive(CubeType)]
struct Grads<F: Float> {
    own_a: SharedMemory<F>,
    own_b: SharedMemory<F>,
    tile_a: SharedMemory<F>,
    tile_b: SharedMemory<F>,
    scores: SharedMemory<f32>,
    dprobs: SharedMemory<f32>,
    probs: SharedMemory<F>,
    dscores: SharedMemory<F>,
    grad_a: SharedMemory<f32>,
    grad_b: SharedMemory<f32>,
    stats: SharedMemory<f32>,
    own_segments: SharedMemory<i32>,
    tile_segments: SharedMemory<i32>,
}

#[cube]
impl<F: Float> Grads<F> {
    /// The shared memory of a cube with `tiles`; the query side has no `p` and one gradient.
    fn new(#[comptime] tiles: Tiles, #[comptime] per_key: bool) -> Grads<F> {
        let qn = comptime!(tiles.queries());
        let (d, bk) = (tiles.head_dim, tiles.keys);
        let pairs = comptime!(if per_key { qn * bk } else { 1 });
        let second = comptime!(if per_key { qn * d } else { 1 });
        Grads::<F> {
            own_a: SharedMemory::<F>::new_aligned(comptime!(qn * d), 128usize),
            own_b: SharedMemory::<F>::new_aligned(comptime!(qn * d), 128usize),
            tile_a: SharedMemory::<F>::new_aligned(comptime!(bk * d), 128usize),
            tile_b: SharedMemory::<F>::new_aligned(comptime!(bk * d), 128usize),
            scores: SharedMemory::<f32>::new_aligned(comptime!(qn * bk), 128usize),
            dprobs: SharedMemory::<f32>::new_aligned(comptime!(qn * bk), 128usize),
            probs: SharedMemory::<F>::new_aligned(pairs, 128usize),
            dscores: SharedMemory::<F>::new_aligned(comptime!(qn * bk), 128usize),
            grad_a: SharedMemory::<f32>::new_aligned(comptime!(qn * d), 128usize),
            grad_b: SharedMemory::<f32>::new_aligned(second, 128usize),
            stats: SharedMemory::<f32>::new(comptime!(2 * Ord::max(qn, bk))),
            own_segments: SharedMemory::<i32>::new(qn),
            tile_segments: SharedMemory::<i32>::new(bk),
        }
    }
}

/// The tiling of the backward kernels for `qkv` with the `wanted` product, as
/// [`super::attention::tiles_for`] chooses the forward's, or `None` where no tile fits.
pub fn tiles_for<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    spec: AttentionSpec,
    wanted: TileProduct,
) -> Option<Tiles> {
    choose_tiles(qkv, spec, wanted, shared_bytes)
}

/// The bytes of shared memory [`Grads`] declares for `tiles` with `elem`-byte operands (the key
/// side's, the larger).
pub fn shared_bytes(tiles: &Tiles, elem: usize) -> usize {
    let (q, k, d) = (tiles.queries(), tiles.keys, tiles.head_dim);
    (2 * q * d + 2 * k * d + 2 * q * k) * elem
        + (2 * q * k + 2 * q * d + 2 * q.max(k)) * 4
        + (q + k) * 4
}

/// The gradients of one cube of [`Tiles::queries`] rows of one (sequence, head): with
/// `per_key`, of keys (`dk`, `dv`, walking tiles of queries), else of queries (`dq`, walking
/// tiles of keys and values), written into their columns of `dqkv`.
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
    #[comptime] tiles: Tiles,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[comptime] per_key: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (s, h) = (seq as usize, heads as usize);
    let (d, qn) = (tiles.head_dim, comptime!(tiles.queries()));
    let pair = CUBE_POS_Y as usize;
    let head = pair % h;
    let first = CUBE_POS_X as usize * qn;
    let rows = (pair / h) * s;
    let at = Rows::new(rows, s, h, head, pair);
    let mut g = Grads::<F>::new(tiles, per_key);
    load_own(
        qkv, dctx, lse, delta, segments, &mut g, at, first, tiles, segmented, per_key,
    );
    sync_cube();
    // Causal: a key is seen by its own query and later ones, a query sees keys up to itself.
    let mut start = 0usize;
    let mut end = s;
    if causal && per_key {
        start = first;
    }
    if causal && !per_key {
        end = min(first + qn, s);
    }
    while start < end {
        load_tile(
            qkv, dctx, lse, delta, segments, &mut g, at, start, tiles, segmented, per_key,
        );
        sync_cube();
        tile_scores(&g.own_a, &g.tile_a, &mut g.scores, tiles);
        tile_scores(&g.own_b, &g.tile_b, &mut g.dprobs, tiles);
        sync_cube();
        pair_grads(
            &mut g, first, start, s, scale, tiles, causal, segmented, per_key,
        );
        sync_cube();
        if per_key {
            tile_accumulate(&g.probs, &g.tile_b, &mut g.grad_b, tiles);
        }
        tile_accumulate(&g.dscores, &g.tile_a, &mut g.grad_a, tiles);
        sync_cube();
        start += tiles.keys;
    }
    let width = 3 * h * d;
    let mut e = UNIT_POS_X as usize;
    while e < comptime!(qn * tiles.head_dim) {
        let own = first + e / d;
        if own < s {
            let column = (rows + own) * width + head * d + e % d;
            if per_key {
                dqkv[column + h * d] = F::cast_from(g.grad_a[e] * scale);
                dqkv[column + 2 * h * d] = F::cast_from(g.grad_b[e]);
            } else {
                dqkv[column] = F::cast_from(g.grad_a[e] * scale);
            }
        }
        e += tiles.units;
    }
}

/// Where a cube's rows lie: its sequence's first row in the tensors, the sequence's length,
/// the number of heads, the cube's head and its (sequence, head) pair.
#[derive(CubeType, Clone, Copy)]
struct Rows {
    rows: usize,
    s: usize,
    h: usize,
    head: usize,
    pair: usize,
}

#[cube]
impl Rows {
    /// The rows of sequence `rows / s`, head `head` of `h`, pair `pair`.
    fn new(rows: usize, s: usize, h: usize, head: usize, pair: usize) -> Rows {
        Rows {
            rows,
            s,
            h,
            head,
            pair,
        }
    }
}

/// Loads the cube's own rows (from `first`: keys and values where `per_key`, else queries,
/// their context gradients and statistics), their segment ids where `segmented`, and zeroes
/// their gradients.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_own<F: Float, I: Int>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    segments: &Tensor<I>,
    g: &mut Grads<F>,
    at: Rows,
    first: usize,
    #[comptime] tiles: Tiles,
    #[comptime] segmented: bool,
    #[comptime] per_key: bool,
) {
    let qn = comptime!(tiles.queries());
    if per_key {
        load_key_rows(qkv, &mut g.own_a, &mut g.own_b, at, first, qn, tiles);
    } else {
        let (a, b, stats) = (&mut g.own_a, &mut g.own_b, &mut g.stats);
        load_query_rows(qkv, dctx, lse, delta, a, b, stats, at, first, qn, tiles);
    }
    if segmented {
        load_segments(
            segments,
            &mut g.own_segments,
            at.rows,
            first,
            at.s,
            qn,
            tiles.units,
        );
    }
    let mut e = UNIT_POS_X as usize;
    while e < comptime!(tiles.queries() * tiles.head_dim) {
        g.grad_a[e] = 0.0;
        if per_key {
            g.grad_b[e] = 0.0;
        }
        e += tiles.units;
    }
}

/// Loads the tile of rows from `start`: queries, their context gradients and statistics where
/// `per_key`, else keys and values; their segment ids where `segmented`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float, I: Int>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    segments: &Tensor<I>,
    g: &mut Grads<F>,
    at: Rows,
    start: usize,
    #[comptime] tiles: Tiles,
    #[comptime] segmented: bool,
    #[comptime] per_key: bool,
) {
    let bk = tiles.keys;
    if per_key {
        let (a, b, stats) = (&mut g.tile_a, &mut g.tile_b, &mut g.stats);
        load_query_rows(qkv, dctx, lse, delta, a, b, stats, at, start, bk, tiles);
    } else {
        load_key_rows(qkv, &mut g.tile_a, &mut g.tile_b, at, start, bk, tiles);
    }
    if segmented {
        load_segments(
            segments,
            &mut g.tile_segments,
            at.rows,
            start,
            at.s,
            bk,
            tiles.units,
        );
    }
}

/// Loads `count` queries from `start` into `q`, their context gradients into `dout`, and
/// their log-sum-exps and `Δ` into `stats` (`[lse; count]` then `[Δ; count]`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_query_rows<F: Float>(
    qkv: &Tensor<F>,
    dctx: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    q: &mut SharedMemory<F>,
    dout: &mut SharedMemory<F>,
    stats: &mut SharedMemory<f32>,
    at: Rows,
    start: usize,
    #[comptime] count: usize,
    #[comptime] tiles: Tiles,
) {
    let d = tiles.head_dim;
    let hd = at.h * d;
    let (column, units, round) = (at.head * d, tiles.units, tiles.round);
    load_rows(
        qkv,
        q,
        Span::new(at.rows, start, at.s, 3 * hd),
        column,
        d,
        count,
        units,
        round,
    );
    let in_dctx = Span::new(at.rows, start, at.s, hd);
    load_rows(dctx, dout, in_dctx, column, d, count, units, round);
    let mut r = UNIT_POS_X as usize;
    while r < count {
        let i = at.pair * at.s + min(start + r, at.s - 1);
        stats[r] = lse[i];
        stats[count + r] = delta[i];
        r += units;
    }
}

/// Loads `count` keys from `start` into `k` and their values into `v`.
#[cube]
fn load_key_rows<F: Float>(
    qkv: &Tensor<F>,
    k: &mut SharedMemory<F>,
    v: &mut SharedMemory<F>,
    at: Rows,
    start: usize,
    #[comptime] count: usize,
    #[comptime] tiles: Tiles,
) {
    let d = tiles.head_dim;
    let span = Span::new(at.rows, start, at.s, 3 * at.h * d);
    let (units, round) = (tiles.units, tiles.round);
    load_key_values(qkv, k, v, span, at.head, at.h, d, count, units, round);
}

/// `p` and `ds = p (dctx·v − Δ)` of every (own row, tile row) pair, each thread a strided
/// share: 0 where the query does not see the key (past the sequence, after the query where
/// `causal`, another segment where `segmented`); rounded to bf16 where the tiles say so.
#[cube]
#[allow(clippy::too_many_arguments)]
fn pair_grads<F: Float>(
    g: &mut Grads<F>,
    first: usize,
    start: usize,
    s: usize,
    scale: f32,
    #[comptime] tiles: Tiles,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[comptime] per_key: bool,
) {
    let bk = tiles.keys;
    let mut at = UNIT_POS_X as usize;
    while at < comptime!(tiles.queries() * tiles.keys) {
        let (r, c) = (at / bk, at % bk);
        // The query and key of the pair, and where the query's statistics are (`Δ` a side's
        // length after its log-sum-exp).
        let mut i = first + r;
        let mut j = start + c;
        let mut stat = r;
        if per_key {
            i = start + c;
            j = first + r;
            stat = c;
        }
        let stats = comptime!(if per_key { tiles.keys } else { tiles.queries() });
        // The segment ids are the own rows' and the tile's, whichever side the queries are.
        let seen = visible(
            &g.own_segments,
            &g.tile_segments,
            r,
            c,
            i,
            j,
            s,
            causal,
            segmented,
        );
        let mut p = 0.0f32;
        if seen {
            p = f32::exp(g.scores[at] * scale - g.stats[stat]);
        }
        let mut ds = p * (g.dprobs[at] - g.stats[stats + stat]);
        if tiles.round {
            p = round_bf16(p);
            ds = round_bf16(ds);
        }
        if per_key {
            g.probs[at] = F::cast_from(p);
        }
        g.dscores[at] = F::cast_from(ds);
        at += tiles.units;
    }
}

/// The gradient `[batch, seq, 3 * heads * head_dim]` of the Q/K/V buffer `qkv` of the
/// attention whose context `ctx` and log-sum-exp `lse` (`[batch, heads, seq]`, `f32`) the
/// forward kernel ([`super::attention::forward`]) gave, from the context's gradient `dctx`: in
/// `qkv`'s type, computed in `f32` with `tiles` (see [`shared_bytes`]).
pub fn backward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    ctx: CubeTensor<R>,
    lse: CubeTensor<R>,
    dctx: CubeTensor<R>,
    spec: AttentionSpec,
    segments: Option<CubeTensor<R>>,
    tiles: Tiles,
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
    let d = tiles.head_dim;
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
    let count = CubeCount::Static(s.div_ceil(tiles.queries()) as u32, (b * h) as u32, 1);
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let dtypes = [qkv.dtype.into(), segments.dtype.into()];
    for per_key in [false, true] {
        grads_kernel::launch::<R>(
            &qkv.client,
            count.clone(),
            CubeDim::new_1d(tiles.units as u32),
            qkv.clone().into_tensor_arg(),
            dctx.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            segments.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            s as u32,
            h as u32,
            scale,
            tiles,
            spec.causal,
            segmented,
            per_key,
            dtypes,
        );
    }
    dqkv
}
