//! The products of sequence parallelism's tensor-parallel blocks, with their reduce-scatters
//! cut into token chunks and overlapped with the next chunk's product (`parallel.tp_overlap`
//! under `parallel.sequence_parallel`).
//!
//! Token order: TP rank `r` holds positions `r s / tp .. (r + 1) s / tp` of every sequence,
//! whatever the overlap. With `k` chunks, chunk `c` holds sub-block `c` of every rank's slice
//! (positions `r s / tp + c m .. r s / tp + (c + 1) m`, `m = s / (tp k)`, for every `r`), so
//! that its reduce-scatter gives each rank the next `m` positions of its own slice and the
//! slices stay in sequence order.
//!
//! - **Row-parallel, forward** ([`row_forward`]): the partial product of chunk `c + 1` is
//!   computed while the reduce-scatter of chunk `c` is in flight; backward, the output
//!   gradient is all-gathered along the sequence ([`row_backward`]).
//! - **Column-parallel, backward** ([`column_backward`]): the input is all-gathered again
//!   (the whole sequence's input is not kept between the passes), then the input gradient of
//!   chunk `c + 1` is computed while the reduce-scatter of chunk `c` is in flight, and the
//!   weight-gradient product runs while the last ones are. Forward, the input is all-gathered
//!   ([`column_forward`]).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use burn::tensor::{Tensor, TensorPrimitive};

use super::overlap::{RanAhead, fatal};
use crate::comm::{Group, TensorComm};
use crate::kernels::FusedOps;

/// `x: [b, s / tp, f]` all-gathered along the sequence over `group`: `[b, s, f]`.
fn gather_seq<B: FusedOps>(x: FloatTensor<B>, group: Group) -> FloatTensor<B> {
    if group.size() == 1 {
        return x;
    }
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let t = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(x));
    let full = comm.all_gather_tensor(t, 1).unwrap_or_else(|e| fatal(e));
    full.into_primitive().tensor()
}

/// `[b, s, f] -> [b s, f]`.
fn fold<B: FusedOps>(x: FloatTensor<B>) -> FloatTensor<B> {
    let [b, s, f] = x.shape().dims();
    B::float_reshape(x, Shape::new([b * s, f]))
}

/// The rows of chunk `c` of `chunks` of a `[b, s, f]` tensor in the canonical order, each rank's
/// sub-block after the previous rank's: `[b tp m, f]` with `m = s / (tp chunks)`.
fn chunk_rows<B: FusedOps>(
    x: &FloatTensor<B>,
    c: usize,
    chunks: usize,
    tp: usize,
) -> FloatTensor<B> {
    let [b, s, f] = x.shape().dims();
    let m = s / (tp * chunks);
    let split = B::float_reshape(x.clone(), Shape::new([b, tp, chunks, m, f]));
    let ranges = [0..b, 0..tp, c..c + 1, 0..m, 0..f].map(burn::tensor::Slice::from);
    B::float_reshape(B::float_slice(split, &ranges), Shape::new([b * tp * m, f]))
}

/// Rows `[b tp m, n]` of a chunk laid out rank-major, `[tp, b, m, n]`, for its reduce-scatter.
fn rank_major<B: FusedOps>(rows: FloatTensor<B>, b: usize, tp: usize) -> FloatTensor<B> {
    let [n_rows, n] = rows.shape().dims();
    let m = n_rows / (b * tp);
    let t = B::float_reshape(rows, Shape::new([b, tp, m, n]));
    B::float_swap_dims(t, 0, 1)
}

/// The chunks the slices of a `[b, s, f]` tensor are cut into: `chunks` where it divides
/// `s / tp` (training checks that it does), otherwise their greatest common divisor.
fn chunks_for(s: usize, tp: usize, chunks: usize) -> usize {
    let (mut a, mut b) = (chunks.max(1), s / tp);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// Row-parallel forward under sequence parallelism: `x: [b, s, d_in / tp]`, `w: [d_in / tp,
/// d_out]` to this rank's slice of the sum over the group, `[b, s / tp, d_out]`, chunk
/// `c`'s reduce-scatter in flight while chunk `c + 1` multiplies.
pub fn row_forward<B: FusedOps>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    chunks: usize,
    group: Group,
) -> FloatTensor<B> {
    let [b, s, _] = x.shape().dims();
    let tp = group.size();
    if tp == 1 {
        let d_out = w.shape().dims::<2>()[1];
        return B::float_reshape(
            B::linear_forward(fold::<B>(x), w, None),
            Shape::new([b, s, d_out]),
        );
    }
    let chunks = chunks_for(s, tp, chunks);
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let mut flight = RanAhead::default();
    for c in 0..chunks {
        let y = B::linear_forward(chunk_rows::<B>(&x, c, chunks, tp), w.clone(), None);
        flight.progress();
        flight.start_scatter::<B>(rank_major::<B>(y, b, tp), comm.as_ref());
    }
    flight.finish::<B>(&B::float_device(&x), 1)
}

/// Row-parallel backward under sequence parallelism: the output gradient `dy: [b, s / tp,
/// d_out]` all-gathered along the sequence, then `[dx, dw]` (`dx: [b, s, d_in / tp]`; `dw`
/// when `x` is given).
pub fn row_backward<B: FusedOps>(
    x: Option<FloatTensor<B>>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    group: Group,
) -> [Option<FloatTensor<B>>; 2] {
    let dy = gather_seq::<B>(dy, group);
    let [b, s, _] = dy.shape().dims();
    let want_w = x.is_some();
    let [dx, dw, _] = B::linear_backward(x.map(fold::<B>), w, fold::<B>(dy), [true, want_w, false]);
    let dx = dx.map(|dx| {
        let d_in = dx.shape().dims::<2>()[1];
        B::float_reshape(dx, Shape::new([b, s, d_in]))
    });
    [dx, dw]
}

/// Column-parallel forward under sequence parallelism: this rank's slice `x: [b, s / tp,
/// d_in]` all-gathered along the sequence, times `w: [d_in, d_out / tp]`: `[b, s, d_out / tp]`.
pub fn column_forward<B: FusedOps>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    group: Group,
) -> FloatTensor<B> {
    let full = gather_seq::<B>(x, group);
    let [b, s, _] = full.shape().dims();
    let d_out = w.shape().dims::<2>()[1];
    B::float_reshape(
        B::linear_forward(fold::<B>(full), w, None),
        Shape::new([b, s, d_out]),
    )
}

/// Column-parallel backward under sequence parallelism: `x` (this rank's slice, given when the
/// weight needs its gradient) all-gathered again; the input gradient `dy wᵀ` reduce-scattered
/// to this rank's slice `[b, s / tp, d_in]` in `chunks` chunks, each in flight while the next
/// multiplies and while the weight gradient `x_fullᵀ dy` is computed. Returns `[dx, dw]`.
pub fn column_backward<B: FusedOps>(
    x: Option<FloatTensor<B>>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    chunks: usize,
    group: Group,
) -> [Option<FloatTensor<B>>; 2] {
    let [b, s, _] = dy.shape().dims();
    let (tp, device) = (group.size(), B::float_device(&dy));
    // Gathered before the reduce-scatters start: collectives keep one order on every rank.
    let full = x.map(|x| gather_seq::<B>(x, group));
    let chunks = chunks_for(s, tp, chunks);
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let mut flight = RanAhead::default();
    for c in 0..chunks {
        let dy_c = chunk_rows::<B>(&dy, c, chunks, tp);
        let [dx_c, _, _] = B::linear_backward(None, w.clone(), dy_c, [true, false, false]);
        flight.progress();
        if let Some(dx_c) = dx_c {
            flight.start_scatter::<B>(rank_major::<B>(dx_c, b, tp), comm.as_ref());
        }
    }
    let dw = full.and_then(|full| {
        B::linear_backward(
            Some(fold::<B>(full)),
            w,
            fold::<B>(dy),
            [false, true, false],
        )[1]
        .take()
    });
    flight.progress();
    [Some(flight.finish::<B>(&device, 1)), dw]
}
