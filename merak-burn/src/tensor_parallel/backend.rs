//! The backend extension trait the tensor-parallel operators are methods of; implemented in
//! [`ops`](super::ops) (`impl_parallel_backend!`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::comm::Group;

/// A backend on which the tensor-parallel operators are defined.
///
/// Implemented for `Flex` (the CPU backend, [`crate::backend::Cpu`]), `Cuda<f32>` (feature `cuda`) and `Autodiff` of any of them.
/// Another backend gets it with [`impl_parallel_backend!`](crate::impl_parallel_backend) and
/// `impl ContextParallelBackend for MyBackend {}` (context parallelism's ring attention) and
/// `impl ExpertBackend for MyBackend {}` (expert parallelism's exchange).
pub trait ParallelBackend:
    Backend
    + crate::kernels::FusedOps
    + crate::context_parallel::ContextParallelBackend
    + crate::expert_ops::ExpertBackend
{
    /// *f*: identity forward, all-reduce of the gradient backward.
    fn tp_copy(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self>;
    /// *g*: all-reduce forward, identity backward.
    fn tp_reduce(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self>;
    /// All-gather along `dim` forward; the gradient's own chunk backward.
    fn tp_gather(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self>;
    /// This rank's chunk along `dim` forward; all-gather of the gradient backward.
    fn tp_split(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self>;
    /// Sequence parallelism's *g*-bar in front of a column-parallel block: all-gather along
    /// `dim` forward; reduce-scatter (sum) of the gradient along `dim` backward.
    fn sp_gather(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self>;
    /// Sequence parallelism's *g* after a row-parallel block: reduce-scatter (sum) along `dim`
    /// forward; all-gather of the gradient along `dim` backward.
    fn sp_scatter(x: FloatTensor<Self>, dim: usize, group: Group) -> FloatTensor<Self>;
    /// `x w` of a row-parallel layer summed over the group, the all-reduce overlapped with the
    /// products of `chunks` token chunks ([`overlap`](super::overlap)); backward as the
    /// serial layer (no communication).
    fn tp_row_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self>;
    /// `x w` of a column-parallel layer (no communication forward); backward, the input
    /// gradient summed over the group in `chunks` token chunks, overlapped with the products.
    fn tp_column_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self>;
    /// Under sequence parallelism, `x w` of a row-parallel layer (`x: [b, s, d_in / tp]`)
    /// reduce-scattered along the sequence to this rank's slice, `[b, s / tp, d_out]`, in
    /// `chunks` token chunks overlapped with the products
    /// ([`sequence_overlap`](super::sequence_overlap)); backward, the output gradient
    /// all-gathered.
    fn sp_row_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self>;
    /// Under sequence parallelism, `x w` of a column-parallel layer whose input is this rank's
    /// slice (`[b, s / tp, d_in]`), all-gathered along the sequence first: `[b, s, d_out / tp]`;
    /// backward, the input all-gathered again and the input gradient reduce-scattered in
    /// `chunks` token chunks overlapped with the products.
    fn sp_column_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        chunks: usize,
        group: Group,
    ) -> FloatTensor<Self>;
    /// Identity forward; backward, hands the gradient to the sink installed with
    /// [`set_grad_sink`](super::ops::set_grad_sink) (the data-parallel reducer's) as gradient `hook`, as soon as it is
    /// final; the input gets none.
    fn grad_hook(x: FloatTensor<Self>, hook: usize) -> FloatTensor<Self>;
}
