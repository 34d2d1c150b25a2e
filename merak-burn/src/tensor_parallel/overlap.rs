//! Sub-pipelined tensor parallelism: the all-reduce of a tensor-parallel linear layer overlapped
//! with its chunked matrix products.
//!
//! The rows of the layer's input (the micro-batch's tokens, `[tokens, features]`) are cut into
//! `chunks` equal parts. Linear layers act on each token alone, so chunking their rows changes
//! nothing but the order of work; attention, which mixes the tokens of a sequence, is not
//! inside these operations and keeps whole sequences.
//!
//! - **Row-parallel, forward** ([`row_linear`]): the partial product of chunk `i + 1` is
//!   computed while the all-reduce of chunk `i` is in flight. Its backward pass has no
//!   communication (the *g* operator's backward is the identity).
//! - **Column-parallel, backward** ([`column_linear`]): the input gradient of chunk `i + 1` is
//!   computed while the all-reduce of chunk `i` is in flight, and the weight-gradient product
//!   runs while the last ones are. Its forward pass has no communication.
//!
//! Open MPI moves a non-blocking collective only while the process is inside MPI, so every
//! outstanding all-reduce is tested between two chunk products.
//!
//! With one chunk, or a group of one rank, both are the serial layer.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::comm::host::tensor_to_vec;
use crate::comm::{Communicator, Group, Pending, ReduceOp};
use crate::kernels::FusedOps;

use super::backend::ParallelBackend;
use super::init::TpError;

/// The overlap degree of a tensor-parallel layer: the token chunks its all-reduce is cut into
/// (`parallel.tp_overlap`). One chunk (the default) is the serial layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpOverlap(usize);

impl Default for TpOverlap {
    /// No overlap: one chunk.
    fn default() -> Self {
        Self(1)
    }
}

impl TpOverlap {
    /// `chunks` token chunks per micro-batch.
    ///
    /// # Errors
    ///
    /// [`TpError::ZeroOverlap`] when `chunks` is 0.
    pub fn new(chunks: usize) -> Result<Self, TpError> {
        if chunks == 0 {
            return Err(TpError::ZeroOverlap);
        }
        Ok(Self(chunks))
    }

    /// Checks that the chunks divide the `tokens` of a micro-batch (batch x sequence length),
    /// as training needs: a plan must fail before training starts, not fall back silently.
    ///
    /// # Errors
    ///
    /// [`TpError::Overlap`] naming both numbers.
    pub fn check_tokens(self, tokens: usize) -> Result<(), TpError> {
        if tokens.is_multiple_of(self.0) {
            Ok(())
        } else {
            Err(TpError::Overlap {
                chunks: self.0,
                tokens,
            })
        }
    }

    /// The chunks of this degree.
    pub fn chunks(self) -> usize {
        self.0
    }

    /// Whether the layer runs serially (one chunk).
    pub fn is_serial(self) -> bool {
        self.0 == 1
    }

    /// The chunks a product over `rows` tokens is cut into: the degree where it divides them
    /// (training checks that it does, see [`TpOverlap::check_tokens`]), otherwise their greatest
    /// common divisor (a sample or an evaluation of another shape), which changes the order of
    /// the work but not the result.
    pub fn chunks_for(self, rows: usize) -> usize {
        let (mut a, mut b) = (self.0, rows);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a.max(1)
    }
}

/// Communication failures inside a forward or backward pass cannot be returned through Burn's
/// operator signatures; they are fatal for the job (the panic hook aborts it and names the
/// rank).
pub(super) fn fatal(e: impl std::fmt::Display) -> ! {
    panic!("tensor-parallel communication failed: {e}")
}

/// The collectives in flight (all-reduces or reduce-scatters), tested between chunk products
/// so that MPI moves them.
#[derive(Default)]
pub(super) struct RanAhead {
    /// Each collective with the shape and element type of its result.
    pending: Vec<(Box<dyn Pending>, Shape, burn::tensor::DType)>,
}

/// `x` flattened into a host buffer, with its element type.
fn to_host<B: FusedOps>(x: FloatTensor<B>) -> (Vec<f32>, burn::tensor::DType) {
    let (n, dtype) = (x.shape().num_elements(), x.dtype());
    let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x));
    (
        tensor_to_vec(t.reshape([n])).unwrap_or_else(|e| fatal(e)),
        dtype,
    )
}

impl RanAhead {
    /// Starts the all-reduce (sum) of `x` over `group`.
    pub(super) fn start<B: FusedOps>(&mut self, x: FloatTensor<B>, comm: &dyn Communicator) {
        let shape = x.shape();
        let (host, dtype) = to_host::<B>(x);
        let pending = comm
            .all_reduce_start(host, ReduceOp::Sum)
            .unwrap_or_else(|e| fatal(e));
        self.pending.push((pending, shape, dtype));
    }

    /// Starts the reduce-scatter (sum) of `x`, `[group size, ...]`: this rank receives the sum
    /// of the blocks at its index, of shape `x.shape()[1..]`.
    pub(super) fn start_scatter<B: FusedOps>(
        &mut self,
        x: FloatTensor<B>,
        comm: &dyn Communicator,
    ) {
        let shape = Shape::from(x.shape().as_slice()[1..].to_vec());
        let (host, dtype) = to_host::<B>(x);
        let pending = comm
            .reduce_scatter_start(host, ReduceOp::Sum)
            .unwrap_or_else(|e| fatal(e));
        self.pending.push((pending, shape, dtype));
    }

    /// Lets MPI progress every outstanding collective.
    pub(super) fn progress(&mut self) {
        for (p, _, _) in &mut self.pending {
            p.test().unwrap_or_else(|e| fatal(e));
        }
    }

    /// Waits for every collective and joins the results along `dim`, on `device`, in the
    /// element type each chunk had (bf16 chunks travel as `f32`).
    pub(super) fn finish<B: FusedOps>(self, device: &B::Device, dim: usize) -> FloatTensor<B> {
        let parts: Vec<FloatTensor<B>> = (self.pending.into_iter())
            .map(|(p, shape, dtype)| {
                let values = p.wait().unwrap_or_else(|e| fatal(e));
                let data = burn::tensor::TensorData::new(values, shape);
                let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_from_data(
                    data, device,
                )));
                crate::precision::like_dtype(t, dtype)
                    .into_primitive()
                    .tensor()
            })
            .collect();
        B::float_cat(parts, dim)
    }
}

/// Rows `i * n / chunks .. (i + 1) * n / chunks` of the `[n, d]` matrix `x`.
fn chunk<B: FusedOps>(x: &FloatTensor<B>, i: usize, chunks: usize) -> FloatTensor<B> {
    let [n, d] = x.shape().dims();
    let rows = n / chunks;
    B::float_slice(
        x.clone(),
        &[
            burn::tensor::Slice::from(i * rows..(i + 1) * rows),
            burn::tensor::Slice::from(0..d),
        ],
    )
}

/// Checks that `chunks` divides the rows of `x`. A caller that lets a user choose `chunks` must
/// check it before training; here it can only be a bug.
fn check_chunks<B: FusedOps>(x: &FloatTensor<B>, chunks: usize) {
    let n = x.shape().dims::<2>()[0];
    assert!(
        chunks > 0 && n.is_multiple_of(chunks),
        "tensor-parallel overlap: {chunks} chunks do not divide {n} tokens"
    );
}

/// Forward of a row-parallel layer on a plain backend: `sum over the group of x w`
/// (`x: [n, d_in / tp]`, `w: [d_in / tp, d_out]`), chunk `i`'s all-reduce in flight while
/// chunk `i + 1` multiplies.
pub fn row_forward<B: FusedOps>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    chunks: usize,
    group: Group,
) -> FloatTensor<B> {
    if group.size() == 1 {
        return B::linear_forward(x, w, None);
    }
    check_chunks::<B>(&x, chunks);
    let device = B::float_device(&x);
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let mut flight = RanAhead::default();
    for i in 0..chunks {
        let y = B::linear_forward(chunk::<B>(&x, i, chunks), w.clone(), None);
        flight.progress();
        flight.start::<B>(y, comm.as_ref());
    }
    flight.finish::<B>(&device, 0)
}

/// Backward of a column-parallel layer `y = x w` whose input is replicated over the group: the
/// input gradient `sum over the group of dy wᵀ`, its all-reduce chunked and overlapped with the
/// next chunk's product and with the weight gradient `xᵀ dy` (when `x` is given). Returns
/// `[dx, dw]`.
pub fn column_backward<B: FusedOps>(
    x: Option<FloatTensor<B>>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    chunks: usize,
    group: Group,
) -> [Option<FloatTensor<B>>; 2] {
    let want_w = x.is_some();
    if group.size() == 1 {
        let [dx, dw, _] = B::linear_backward(x, w, dy, [true, want_w, false]);
        return [dx, dw];
    }
    check_chunks::<B>(&dy, chunks);
    let device = B::float_device(&dy);
    let comm = group.comm().unwrap_or_else(|e| fatal(e));
    let mut flight = RanAhead::default();
    for i in 0..chunks {
        let dy_i = chunk::<B>(&dy, i, chunks);
        let [dx_i, _, _] = B::linear_backward(None, w.clone(), dy_i, [true, false, false]);
        flight.progress();
        if let Some(dx_i) = dx_i {
            flight.start::<B>(dx_i, comm.as_ref());
        }
    }
    let dw = match x {
        Some(x) => B::linear_backward(Some(x), w, dy, [false, true, false])[1].take(),
        None => None,
    };
    flight.progress();
    [Some(flight.finish::<B>(&device, 0)), dw]
}

/// `x w` of a row-parallel layer summed over `group` (`x: [tokens, d_in / tp]`), with the
/// all-reduce overlapped over `chunks` token chunks; the bias is added after, by the caller.
/// `chunks` must divide the tokens.
pub fn row_linear<B: ParallelBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    chunks: usize,
    group: Group,
) -> Tensor<B, 2> {
    on_primitives(B::tp_row_linear, x, w, chunks, group)
}

/// `x w` of a column-parallel layer whose input `x: [tokens, d_in]` is replicated over `group`
/// (its gradient summed over the group in the backward pass, overlapped over `chunks` token
/// chunks). `chunks` must divide the tokens.
pub fn column_linear<B: ParallelBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    chunks: usize,
    group: Group,
) -> Tensor<B, 2> {
    on_primitives(B::tp_column_linear, x, w, chunks, group)
}

/// `op` of a backend applied to the primitives of `x` and `w`.
fn on_primitives<B: ParallelBackend>(
    op: fn(FloatTensor<B>, FloatTensor<B>, usize, Group) -> FloatTensor<B>,
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    chunks: usize,
    group: Group,
) -> Tensor<B, 2> {
    let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(op(x, w, chunks, group)))
}
