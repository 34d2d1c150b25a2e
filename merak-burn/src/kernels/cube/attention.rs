//! Blockwise self-attention forward with each query's log-sum-exp, on a fused Q/K/V buffer.
//!
//! One cube per block of [`Tiles::queries`] queries of one (sequence, head). The cube loads
//! its queries into shared memory once, then walks the keys tile by tile: its threads load a
//! tile of keys, values and segment ids into shared memory together; the scores of the block
//! against the tile come from one tile product ([`tile_scores`]); one thread per query folds
//! its row into its online softmax (running maximum, running sum, context rescaled when the
//! maximum grows) and writes the tile's probabilities; the context gains `P V` from the second
//! tile product ([`tile_accumulate`]). No `[seq, seq]` scores exist anywhere; a causal cube
//! stops at its last query's key. With segment ids (documents packed into one sequence), a
//! key of another segment is masked. The products are either form of [`TileProduct`]: tensor
//! cores for bf16 and f16 on CUDA, dot products in `f32` everywhere else, the same tiling.
//! The log-sum-exp is `f32` whatever the input type, and lets the backward pass rebuild the
//! probabilities as `exp(scores - lse)` instead of a softmax.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::ir::features::MmaConfig;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use burn::tensor::DType;

use super::attention_tiles::{PLANE, ROWS, TileProduct, Tiles, round_bf16};
use super::attention_tiles::{tile_accumulate, tile_scores};
use super::{contiguous, empty_typed};
use crate::kernels::AttentionSpec;

/// The environment variable that picks how a bf16 or f16 attention runs: `cmma` for the tiled
/// kernel on tensor cores where the device has them (else its scalar form), `scalar` for the
/// tiled kernel's `f32` dot products; unset or empty: Burn's attention operation, as before
/// these kernels, until a GPU run has measured them. An `f32` attention always takes the
/// scalar form.
pub const ATTENTION_PRODUCT_VAR: &str = "MERAK_ATTENTION_PRODUCT";

/// Blocks of 16 queries per cube of the cmma form: a plane each.
const CMMA_BLOCKS: usize = 4;

/// Keys per tile of the cmma form.
const CMMA_KEYS: usize = 64;

/// Threads per cube of the scalar form, for its one block of 16 queries.
const SCALAR_UNITS: usize = 64;

/// The most keys per tile of the scalar form.
const SCALAR_KEYS: usize = 64;

/// The cube's shared memory: its queries, the tile of keys and values, the tile's scores and
/// probabilities, the context, two statistics per query (its running maximum, then its running
/// sum) and the segment ids of the queries and of the tile's keys. The tile products' operands
/// are in the input's type, aligned for tensor cores; the rest is `f32`.
#[derive(CubeType)]
struct Block<F: Float> {
    queries: SharedMemory<F>,
    keys: SharedMemory<F>,
    values: SharedMemory<F>,
    scores: SharedMemory<f32>,
    probs: SharedMemory<F>,
    out: SharedMemory<f32>,
    stats: SharedMemory<f32>,
    query_segments: SharedMemory<i32>,
    key_segments: SharedMemory<i32>,
}

#[cube]
impl<F: Float> Block<F> {
    /// The shared memory of a cube with `tiles`.
    fn new(#[comptime] tiles: Tiles) -> Block<F> {
        let qn = comptime!(tiles.queries());
        let (d, bk) = (tiles.head_dim, tiles.keys);
        Block::<F> {
            queries: SharedMemory::<F>::new_aligned(comptime!(qn * d), 128usize),
            keys: SharedMemory::<F>::new_aligned(comptime!(bk * d), 128usize),
            values: SharedMemory::<F>::new_aligned(comptime!(bk * d), 128usize),
            scores: SharedMemory::<f32>::new_aligned(comptime!(qn * bk), 128usize),
            probs: SharedMemory::<F>::new_aligned(comptime!(qn * bk), 128usize),
            out: SharedMemory::<f32>::new_aligned(comptime!(qn * d), 128usize),
            stats: SharedMemory::<f32>::new(comptime!(2 * qn)),
            query_segments: SharedMemory::<i32>::new(qn),
            key_segments: SharedMemory::<i32>::new(bk),
        }
    }
}

#[cube(launch)]
fn attention_forward_kernel<F: Float, I: Int>(
    qkv: &Tensor<F>,
    segments: &Tensor<I>,
    ctx: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    seq: u32,
    heads: u32,
    scale: f32,
    #[comptime] tiles: Tiles,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (s, h) = (seq as usize, heads as usize);
    let d = tiles.head_dim;
    let qn = comptime!(tiles.queries());
    let pair = CUBE_POS_Y as usize;
    let (b, head) = (pair / h, pair % h);
    let first = CUBE_POS_X as usize * qn;
    let rows = b * s;
    let mut block = Block::<F>::new(tiles);
    load_queries(
        qkv, segments, &mut block, rows, first, s, head, h, tiles, segmented,
    );
    sync_cube();
    let mut end = s;
    if causal {
        end = min(first + qn, s);
    }
    let mut start = 0usize;
    while start < end {
        load_keys(
            qkv,
            segments,
            &mut block.keys,
            &mut block.values,
            &mut block.key_segments,
            rows,
            start,
            s,
            head,
            h,
            d,
            tiles.keys,
            tiles.units,
            segmented,
            tiles.round,
        );
        sync_cube();
        tile_scores(&block.queries, &block.keys, &mut block.scores, tiles);
        sync_cube();
        fold_softmax(&mut block, first, start, s, scale, tiles, causal, segmented);
        sync_cube();
        tile_accumulate(&block.probs, &block.values, &mut block.out, tiles);
        sync_cube();
        start += tiles.keys;
    }
    let mut at = UNIT_POS_X as usize;
    while at < comptime!(qn * tiles.head_dim) {
        let (r, e) = (at / d, at % d);
        let i = first + r;
        if i < s {
            let value = block.out[at] / block.stats[qn + r];
            ctx[(rows + i) * h * d + head * d + e] = F::cast_from(value);
        }
        at += tiles.units;
    }
    let r = UNIT_POS_X as usize;
    if r < qn && first + r < s {
        lse[pair * s + first + r] = block.stats[r] + f32::ln(block.stats[qn + r]);
    }
}

/// Loads the cube's queries (rows `first..first + queries` of sequence `rows / s`, head
/// `head`; past the last query, the last again), zeroes the context, starts each query's
/// statistics (maximum below every score, sum 0) and, `segmented`, loads the queries' segment
/// ids.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_queries<F: Float, I: Int>(
    qkv: &Tensor<F>,
    segments: &Tensor<I>,
    block: &mut Block<F>,
    rows: usize,
    first: usize,
    s: usize,
    head: usize,
    h: usize,
    #[comptime] tiles: Tiles,
    #[comptime] segmented: bool,
) {
    let d = tiles.head_dim;
    let qn = comptime!(tiles.queries());
    let span = Span::new(rows, first, s, 3 * h * d);
    load_rows(
        qkv,
        &mut block.queries,
        span,
        head * d,
        d,
        qn,
        tiles.units,
        tiles.round,
    );
    let mut at = UNIT_POS_X as usize;
    while at < comptime!(qn * tiles.head_dim) {
        block.out[at] = 0.0;
        at += tiles.units;
    }
    let r = UNIT_POS_X as usize;
    if r < qn {
        // Below every score: the first visible key replaces it (exp of the difference is 0).
        block.stats[r] = -3.0e38;
        block.stats[qn + r] = 0.0;
        if segmented {
            block.query_segments[r] = i32::cast_from(segments[rows + min(first + r, s - 1)]);
        }
    }
}

/// One thread per query row `r` of the cube folds the tile's scores (keys `start..start +
/// keys`) into its online softmax: the new maximum over the visible keys (in sequence, not
/// past the query where `causal`, of its segment where `segmented`), the context's row and the
/// running sum rescaled to it, and the tile's probabilities written for the second product (0
/// where a key is masked; rounded to bf16 where the tiles say so).
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_softmax<F: Float>(
    block: &mut Block<F>,
    first: usize,
    start: usize,
    s: usize,
    scale: f32,
    #[comptime] tiles: Tiles,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
) {
    let qn = comptime!(tiles.queries());
    let (bk, d) = (tiles.keys, tiles.head_dim);
    let r = UNIT_POS_X as usize;
    if r < qn {
        let i = first + r;
        let old = block.stats[r];
        let mut top = old;
        // Each row starts at its own column (`(k + r) % bk`): the threads of a plane read
        // different banks of shared memory, not one bank 32 times (rows are `bk` apart).
        for k in 0..bk {
            let c = (k + r) % bk;
            if visible(
                &block.query_segments,
                &block.key_segments,
                r,
                c,
                i,
                start + c,
                s,
                causal,
                segmented,
            ) {
                top = max(top, block.scores[r * bk + c] * scale);
            }
        }
        let alpha = f32::exp(old - top);
        let mut sum = 0.0f32;
        for k in 0..bk {
            let c = (k + r) % bk;
            let mut p = 0.0f32;
            if visible(
                &block.query_segments,
                &block.key_segments,
                r,
                c,
                i,
                start + c,
                s,
                causal,
                segmented,
            ) {
                p = f32::exp(block.scores[r * bk + c] * scale - top);
            }
            sum += p;
            let mut rounded = p;
            if tiles.round {
                rounded = round_bf16(p);
            }
            block.probs[r * bk + c] = F::cast_from(rounded);
        }
        block.stats[r] = top;
        block.stats[qn + r] = block.stats[qn + r] * alpha + sum;
        for k in 0..d {
            let e = (k + r) % d;
            block.out[r * d + e] *= alpha;
        }
    }
}

/// Whether query `i` sees key `j`: both in the sequence of `s`, the key not after the query
/// where `causal`, and where `segmented` the same segment id for the query (`queries[r]`) and
/// the key (`keys[c]`). The forward and backward kernels' one mask.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn visible(
    queries: &SharedMemory<i32>,
    keys: &SharedMemory<i32>,
    r: usize,
    c: usize,
    i: usize,
    j: usize,
    s: usize,
    #[comptime] causal: bool,
    #[comptime] segmented: bool,
) -> bool {
    let mut seen = i < s && j < s;
    if causal {
        seen = seen && j <= i;
    }
    if segmented {
        seen = seen && keys[c] == queries[r];
    }
    seen
}

/// Loads the tile of keys `start..start + tile` of sequence `rows / s`, head `head` (of `h`),
/// into `keys` and `values` (`tile × head_dim` each, rounded to bf16 with `round`) and,
/// `segmented`, their segment ids: each of the cube's `units` threads a strided share. Past
/// the last key, the last key again. The caller waits for the whole cube (`sync_cube`) before
/// reading it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_keys<F: Float, I: Int>(
    qkv: &Tensor<F>,
    segments: &Tensor<I>,
    keys: &mut SharedMemory<F>,
    values: &mut SharedMemory<F>,
    key_segments: &mut SharedMemory<i32>,
    rows: usize,
    start: usize,
    s: usize,
    head: usize,
    h: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] segmented: bool,
    #[comptime] round: bool,
) {
    let span = Span::new(rows, start, s, 3 * h * head_dim);
    load_key_values(
        qkv, keys, values, span, head, h, head_dim, tile, units, round,
    );
    if segmented {
        load_segments(segments, key_segments, rows, start, s, tile, units);
    }
}

/// Loads `count` keys of head `head` (of `h`) from the span's rows of `qkv` into `keys` and
/// their values into `values` (rounded to bf16 with `round`): the forward's key tiles and the
/// backward's key rows.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_key_values<F: Float>(
    qkv: &Tensor<F>,
    keys: &mut SharedMemory<F>,
    values: &mut SharedMemory<F>,
    span: Span,
    head: usize,
    h: usize,
    #[comptime] head_dim: usize,
    #[comptime] count: usize,
    #[comptime] units: usize,
    #[comptime] round: bool,
) {
    let hd = h * head_dim;
    let key = hd + head * head_dim;
    load_rows(qkv, keys, span, key, head_dim, count, units, round);
    load_rows(qkv, values, span, key + hd, head_dim, count, units, round);
}

/// Where a cube reads rows: the first row of its sequence (`rows`), the first it wants
/// (`start`, within the sequence), the sequence's length and the row stride of the tensor.
#[derive(CubeType, Clone, Copy)]
pub(super) struct Span {
    rows: usize,
    start: usize,
    s: usize,
    width: usize,
}

#[cube]
impl Span {
    /// The span of sequence rows from `rows`, `start` the first wanted, `s` long, each row
    /// `width` wide.
    pub(super) fn new(rows: usize, start: usize, s: usize, width: usize) -> Span {
        Span {
            rows,
            start,
            s,
            width,
        }
    }
}

/// Loads `count` rows of `head_dim` elements from `src` (rows `start..start + count` of the
/// span's sequence, past its end the last row again; columns from `column`) into `dst`
/// (`count × head_dim`, row-major), rounded to bf16 with `round`: each of the cube's `units`
/// threads a strided share.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows<F: Float, S: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<S>,
    span: Span,
    column: usize,
    #[comptime] head_dim: usize,
    #[comptime] count: usize,
    #[comptime] units: usize,
    #[comptime] round: bool,
) {
    let mut at = UNIT_POS_X as usize;
    while at < comptime!(count * head_dim) {
        let row = min(span.start + at / head_dim, span.s - 1);
        let mut x = f32::cast_from(src[(span.rows + row) * span.width + column + at % head_dim]);
        if round {
            x = round_bf16(x);
        }
        dst[at] = S::cast_from(x);
        at += units;
    }
}

/// Loads the segment ids of rows `start..start + count` of sequence `rows / s` (past its end,
/// the last row's) into `dst`: each of the cube's `units` threads a strided share.
#[cube]
pub(super) fn load_segments<I: Int>(
    segments: &Tensor<I>,
    dst: &mut SharedMemory<i32>,
    rows: usize,
    start: usize,
    s: usize,
    #[comptime] count: usize,
    #[comptime] units: usize,
) {
    let mut r = UNIT_POS_X as usize;
    while r < count {
        dst[r] = i32::cast_from(segments[rows + min(start + r, s - 1)]);
        r += units;
    }
}

/// The tiling of the forward kernel for `qkv` (`[batch, seq, 3 * heads * head_dim]`) on its
/// device with the `wanted` product, or `None` where even the smallest tile does not fit the
/// device's shared memory. Tensor cores ([`TileProduct::Cmma`]) only for bf16 and f16 where the
/// device has 16 × 16 × 16 tiles of that type with `f32` accumulators and 32-thread planes, and
/// the head is a multiple of 16; else [`TileProduct::Scalar`] with the most keys per tile that
/// fit.
pub fn tiles_for<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    spec: AttentionSpec,
    wanted: TileProduct,
) -> Option<Tiles> {
    choose_tiles(qkv, spec, wanted, Tiles::shared_bytes)
}

/// [`tiles_for`] for a kernel that declares `bytes(tiles, elem)` bytes of shared memory.
pub(super) fn choose_tiles<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    spec: AttentionSpec,
    wanted: TileProduct,
    bytes: fn(&Tiles, usize) -> usize,
) -> Option<Tiles> {
    let dims = qkv.meta.shape();
    let d = dims[2] / (3 * spec.heads.max(1));
    let properties = qkv.client.properties();
    let limit = properties.hardware.max_shared_memory_size;
    let elem = qkv.dtype.size();
    let half = matches!(qkv.dtype, DType::BF16 | DType::F16);
    let tensor_cores = properties.features.matmul.cmma.contains(&MmaConfig {
        a_type: qkv.dtype.into(),
        b_type: qkv.dtype.into(),
        cd_type: DType::F32.into(),
        m: ROWS as u32,
        n: ROWS as u32,
        k: ROWS as u32,
    });
    let planes = properties.hardware.plane_size_min == PLANE as u32
        && properties.hardware.plane_size_max == PLANE as u32;
    if half
        && tensor_cores
        && planes
        && d.is_multiple_of(ROWS)
        && d > 0
        && wanted == TileProduct::Cmma
    {
        let tiles = Tiles {
            product: TileProduct::Cmma,
            blocks: CMMA_BLOCKS,
            units: CMMA_BLOCKS * PLANE,
            keys: CMMA_KEYS,
            head_dim: d,
            round: false,
        };
        if fits(&tiles, elem, limit, bytes) {
            return Some(tiles);
        }
    }
    scalar_tiles(d, elem, limit, false, bytes)
}

/// The scalar form's tiling for a head of `d` with `elem`-byte operands under `limit` bytes of
/// shared memory, for a kernel that declares `bytes(tiles, elem)`: the most keys per tile (a
/// multiple of 16, at most 64) that fit; `round` emulates bf16 operands.
pub(crate) fn scalar_tiles(
    d: usize,
    elem: usize,
    limit: usize,
    round: bool,
    bytes: fn(&Tiles, usize) -> usize,
) -> Option<Tiles> {
    (1..=SCALAR_KEYS / ROWS)
        .rev()
        .map(|n| Tiles {
            product: TileProduct::Scalar,
            blocks: 1,
            units: SCALAR_UNITS,
            keys: n * ROWS,
            head_dim: d,
            round,
        })
        .find(|tiles| d > 0 && fits(tiles, elem, limit, bytes))
}

/// Whether `tiles` fit `limit` bytes of shared memory, with room for the alignment of a
/// kernel's arrays (13 at most).
fn fits(tiles: &Tiles, elem: usize, limit: usize, bytes: fn(&Tiles, usize) -> usize) -> bool {
    bytes(tiles, elem) + 13 * 128 <= limit
}

/// How a bf16 or f16 attention runs, as [`ATTENTION_PRODUCT_VAR`] says (read once; an unknown
/// value is warned about and leaves the default): `None` for Burn's attention operation, else
/// the tiled kernel's product.
pub fn half_product() -> Option<TileProduct> {
    static PRODUCT: std::sync::OnceLock<Option<TileProduct>> = std::sync::OnceLock::new();
    *PRODUCT.get_or_init(|| {
        let value = std::env::var(ATTENTION_PRODUCT_VAR).unwrap_or_default();
        match value.trim().to_lowercase().as_str() {
            "" => None,
            "cmma" => Some(TileProduct::Cmma),
            "scalar" => Some(TileProduct::Scalar),
            other => {
                tracing::warn!(
                    "{ATTENTION_PRODUCT_VAR}: unknown value \"{other}\" ignored (known: cmma, scalar)"
                );
                None
            }
        }
    })
}

/// The context `[batch, seq, heads * head_dim]` (`qkv`'s type) and each query's log-sum-exp
/// of its scaled scores `[batch, heads, seq]` (`f32`), of self-attention on `qkv` (`[batch,
/// seq, 3 * heads * head_dim]`: every query head, then the keys, then the values), a token
/// attending only to tokens of its own segment where `segments` (`[batch, seq]`) are given,
/// computed with `tiles` ([`tiles_for`]).
pub fn forward<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    spec: AttentionSpec,
    segments: Option<CubeTensor<R>>,
    tiles: Tiles,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let qkv = contiguous(qkv);
    let dims = qkv.meta.shape().clone();
    let (b, s) = (dims[0], dims[1]);
    let h = spec.heads.max(1);
    let d = tiles.head_dim;
    let ctx = empty_typed(&qkv, [b, s, h * d], qkv.dtype);
    let lse = empty_typed(&qkv, [b, h, s], DType::F32);
    if b * s * d == 0 {
        return (ctx, lse);
    }
    let segmented = segments.is_some();
    // Without segments the kernel reads none: one unused id stands in for them.
    let segments = segments
        .map(contiguous)
        .unwrap_or_else(|| empty_typed(&qkv, [1], DType::I32));
    let count = CubeCount::Static(s.div_ceil(tiles.queries()) as u32, (b * h) as u32, 1);
    attention_forward_kernel::launch::<R>(
        &qkv.client,
        count,
        CubeDim::new_1d(tiles.units as u32),
        qkv.clone().into_tensor_arg(),
        segments.clone().into_tensor_arg(),
        ctx.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        s as u32,
        h as u32,
        (1.0 / (d as f64).sqrt()) as f32,
        tiles,
        spec.causal,
        segmented,
        [qkv.dtype.into(), segments.dtype.into()],
    );
    (ctx, lse)
}
