//! The two matrix products of the attention's tiles, in shared memory, by either tile product
//! ([`TileProduct`]): `S = A Bᵀ` of a cube's block of rows against a tile of rows (the forward's
//! scores `Q Kᵀ`; the backward's `Q Kᵀ`, `dO Vᵀ` and their transposes), and `O += P V` (the
//! forward's context; the backward's `dQ += dS K`, `dK += dSᵀ Q`, `dV += Pᵀ dO`).
//!
//! - [`TileProduct::Scalar`]: every thread of the cube a strided share of the result's
//!   elements, each a dot product in `f32`. It runs everywhere (llvmpipe, any GPU), in any
//!   float type.
//! - [`TileProduct::Cmma`]: tensor cores through `cubecl::cmma`, 16 × 16 × 16 tiles, `f16` or
//!   `bf16` operands and `f32` accumulators. Each plane (32 threads) owns 16 rows of queries.
//!
//! Both read the same buffers, so the kernel around them is one: the scalar form is the cmma
//! form's reference where a device has no tensor cores. With `round`, the scalar form rounds
//! its operands to bf16 as they are loaded ([`round_bf16`]), which is what the cmma form's
//! operand type does: llvmpipe has no bf16, so its test emulates the rounding.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use burn_cubecl::cubecl::prelude::*;

/// Rows (queries) of a block: the cmma tile's `m`, and the unit of the key tile and the head.
pub const ROWS: usize = 16;

/// Threads of a CUDA plane (warp), which the cmma form needs.
pub const PLANE: usize = 32;

/// How the tile's products are computed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum TileProduct {
    /// Dot products in `f32` by every thread of the cube.
    Scalar,
    /// `cubecl::cmma` 16 × 16 × 16 tiles, a plane per 16 rows of queries.
    Cmma,
}

/// The forward kernel's tiling, fixed when it is compiled.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Tiles {
    /// The products' form.
    pub product: TileProduct,
    /// Blocks of [`ROWS`] queries per cube (keys on the backward's key side).
    pub blocks: usize,
    /// Threads per cube.
    pub units: usize,
    /// Keys per tile, a multiple of [`ROWS`] (queries on the backward's key side).
    pub keys: usize,
    /// The head's size (a multiple of [`ROWS`] for cmma).
    pub head_dim: usize,
    /// Round the operands to bf16 as they are loaded (the scalar form's emulation of cmma's
    /// bf16 operands).
    pub round: bool,
}

impl Tiles {
    /// Queries per cube.
    pub fn queries(&self) -> usize {
        self.blocks * ROWS
    }

    /// The bytes of shared memory the kernel declares with `elem` bytes per operand.
    pub fn shared_bytes(&self, elem: usize) -> usize {
        let (q, k, d) = (self.queries(), self.keys, self.head_dim);
        // Queries, keys and values, probabilities in the operand type; scores and the context
        // in f32; two statistics per query; a segment id per query and per key.
        (q * d + 2 * k * d + q * k) * elem + (q * k + q * d + 2 * q) * 4 + (q + k) * 4
    }
}

/// `x` rounded to the nearest bf16 (ties to even), in `f32`: the top 16 bits of its pattern.
#[cube]
pub(super) fn round_bf16(x: f32) -> f32 {
    let bits = u32::reinterpret(x);
    let lsb = (bits >> 16u32) & 1u32;
    f32::reinterpret((bits + 0x7fffu32 + lsb) & 0xffff_0000u32)
}

/// `scores[r * keys + c] = Σ_e queries[r * d + e] · keys[c * d + e]`, unscaled, for the cube's
/// [`Tiles::queries`] rows and [`Tiles::keys`] keys.
#[cube]
pub(super) fn tile_scores<F: Float>(
    queries: &SharedMemory<F>,
    keys: &SharedMemory<F>,
    scores: &mut SharedMemory<f32>,
    #[comptime] tiles: Tiles,
) {
    let d = tiles.head_dim;
    let bk = tiles.keys;
    match tiles.product {
        TileProduct::Scalar => {
            let mut at = UNIT_POS_X as usize;
            while at < comptime!(tiles.queries() * tiles.keys) {
                let (r, c) = (at / bk, at % bk);
                let mut sum = 0.0f32;
                // Each key starts at its own element (`(k + c) % d`): neighbouring threads
                // read different banks of shared memory, not one (keys are `d` apart).
                for k in 0..d {
                    let e = (k + c) % d;
                    sum += f32::cast_from(queries[r * d + e]) * f32::cast_from(keys[c * d + e]);
                }
                scores[at] = sum;
                at += tiles.units;
            }
        }
        TileProduct::Cmma => {
            let block = UNIT_POS_X as usize / PLANE;
            let top = block * ROWS;
            for cb in 0..comptime!(tiles.keys / ROWS) {
                let acc = Matrix::<f32>::from_value(
                    MatrixIdent::Accumulator,
                    ROWS,
                    ROWS,
                    ROWS,
                    MatrixLayout::Undefined,
                    0.0,
                );
                for kb in 0..comptime!(tiles.head_dim / ROWS) {
                    // Key `n`'s element `k` at `n * d + k`: Kᵀ column-major.
                    let (q_at, k_at) = (top * d + kb * ROWS, cb * ROWS * d + kb * ROWS);
                    mma_step(
                        queries,
                        q_at,
                        d,
                        keys,
                        k_at,
                        d,
                        &acc,
                        MatrixLayout::ColMajor,
                    );
                }
                let len = scores.len();
                cmma::store(
                    &mut scores.slice_mut(top * bk + cb * ROWS, len),
                    &acc,
                    bk as u32,
                    MatrixLayout::RowMajor,
                );
            }
        }
    }
}

/// `out[r * d + e] += Σ_c probs[r * keys + c] · values[c * d + e]` for the cube's rows.
#[cube]
pub(super) fn tile_accumulate<F: Float>(
    probs: &SharedMemory<F>,
    values: &SharedMemory<F>,
    out: &mut SharedMemory<f32>,
    #[comptime] tiles: Tiles,
) {
    let d = tiles.head_dim;
    let bk = tiles.keys;
    match tiles.product {
        TileProduct::Scalar => {
            let mut at = UNIT_POS_X as usize;
            while at < comptime!(tiles.queries() * tiles.head_dim) {
                let (r, e) = (at / d, at % d);
                let mut sum = 0.0f32;
                for c in 0..bk {
                    sum += f32::cast_from(probs[r * bk + c]) * f32::cast_from(values[c * d + e]);
                }
                out[at] += sum;
                at += tiles.units;
            }
        }
        TileProduct::Cmma => {
            let block = UNIT_POS_X as usize / PLANE;
            let top = block * ROWS;
            for eb in 0..comptime!(tiles.head_dim / ROWS) {
                let acc = unsafe {
                    Matrix::<f32>::uninitialized(
                        MatrixIdent::Accumulator,
                        ROWS,
                        ROWS,
                        ROWS,
                        MatrixLayout::Undefined,
                    )
                };
                let len = out.len();
                cmma::load_with_layout(
                    &acc,
                    &out.slice(top * d + eb * ROWS, len),
                    d as u32,
                    MatrixLayout::RowMajor,
                );
                for cb in 0..comptime!(tiles.keys / ROWS) {
                    let (p_at, v_at) = (top * bk + cb * ROWS, cb * ROWS * d + eb * ROWS);
                    mma_step(
                        probs,
                        p_at,
                        bk,
                        values,
                        v_at,
                        d,
                        &acc,
                        MatrixLayout::RowMajor,
                    );
                }
                cmma::store(
                    &mut out.slice_mut(top * d + eb * ROWS, len),
                    &acc,
                    d as u32,
                    MatrixLayout::RowMajor,
                );
            }
        }
    }
}

/// `acc += A B` for one 16 × 16 × 16 tile: `A` the row-major block of `a` from `a_at`, its
/// rows `a_stride` apart, and `B` the block of `b` from `b_at` in `b_layout`, `b_stride` apart.
/// The two tile products' one use of the tensor cores' operands.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_step<F: Float>(
    a: &SharedMemory<F>,
    a_at: usize,
    a_stride: usize,
    b: &SharedMemory<F>,
    b_at: usize,
    b_stride: usize,
    acc: &Matrix<f32>,
    b_layout: MatrixLayout,
) {
    let lhs = Matrix::<F>::from_slice(
        MatrixIdent::A,
        ROWS,
        ROWS,
        ROWS,
        MatrixLayout::RowMajor,
        &a.slice(a_at, a.len()),
        a_stride as u32,
    );
    let rhs = Matrix::<F>::from_slice(
        MatrixIdent::B,
        ROWS,
        ROWS,
        ROWS,
        b_layout,
        &b.slice(b_at, b.len()),
        b_stride as u32,
    );
    cmma::execute::<F, F, f32, f32>(&lhs, &rhs, acc, acc);
}
