//! The communication operations on Burn tensors of any backend.
//!
//! Tensors travel through host memory as `f32`: the tensor is read from its device, the host
//! buffer is communicated, and the result is written back to the same device with the same
//! element type. This works for every backend. With an NCCL communicator, the all-reduce and
//! all-gather of `Cuda<f32>` tensors stay in device memory instead.

use burn::tensor::{DType, Shape, Tensor, backend::Backend};

use super::host::{tensor_to_vec, vec_to_tensor};
use super::{CommError, Communicator, ReduceOp};

/// Rows on their way ([`TensorComm::all_to_all_rows_start`]).
pub struct RowsInFlight<B: Backend> {
    pending: Box<dyn super::Pending>,
    shape: Shape,
    device: B::Device,
    dtype: DType,
}

impl<B: Backend> RowsInFlight<B> {
    /// Lets the library move the exchange on; `true` once it is complete.
    ///
    /// # Errors
    ///
    /// The communicator's, when the exchange failed.
    pub fn test(&mut self) -> Result<bool, CommError> {
        self.pending.test()
    }

    /// Waits for the exchange: the rows received (`[rows, width]`, in the sent tensor's
    /// element type).
    ///
    /// # Errors
    ///
    /// The communicator's, when the exchange failed.
    pub fn finish(self) -> Result<Tensor<B, 2>, CommError> {
        let recv = self.pending.wait()?;
        Ok(vec_to_tensor(recv, self.shape, &self.device, self.dtype))
    }
}

/// Communication on Burn tensors, available on every [`Communicator`].
pub trait TensorComm {
    /// All-reduce of a tensor (same shape on every rank).
    fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError>;

    /// All-gather: concatenates every rank's tensor along `dim`, in rank order.
    fn all_gather_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
    ) -> Result<Tensor<B, D>, CommError>;

    /// Reduce-scatter: reduces the tensors over ranks and keeps this rank's equal chunk along
    /// `dim` (which the group size must divide).
    fn reduce_scatter_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError>;

    /// All-to-all along `dim` (which the group size must divide): the `j`-th of the group
    /// size's equal chunks of `t` along `dim` goes to rank `j`, and the result (the shape of
    /// `t`) holds along `dim` the chunks received from ranks `0, 1, ..` in order.
    fn all_to_all_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
    ) -> Result<Tensor<B, D>, CommError>;

    /// All-to-all of rows with counts: rows of `t` (`[rows, width]`) go to the ranks in
    /// blocks of `send_rows` (rank order), and the result holds the `recv_rows` rows received
    /// from each rank, in rank order, in `t`'s element type.
    fn all_to_all_rows<B: Backend>(
        &self,
        t: Tensor<B, 2>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor<B, 2>, CommError>;

    /// Starts [`all_to_all_rows`](Self::all_to_all_rows) without waiting for it (the rows of
    /// `t` are read at once): [`RowsInFlight::finish`] waits and returns the rows received.
    fn all_to_all_rows_start<B: Backend>(
        &self,
        t: Tensor<B, 2>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<RowsInFlight<B>, CommError>;

    /// Broadcast of rank `root`'s tensor; every rank passes a tensor of the same shape.
    fn broadcast_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        root: usize,
    ) -> Result<Tensor<B, D>, CommError>;

    /// Sends a tensor to `dest`.
    fn send_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dest: usize,
        tag: u16,
    ) -> Result<(), CommError>;

    /// Receives a tensor of a known `shape` from `src` onto `device`.
    fn recv_tensor<B: Backend, const D: usize>(
        &self,
        shape: [usize; D],
        src: usize,
        tag: u16,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, CommError>;
}

impl<C: Communicator + ?Sized> TensorComm for C {
    fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        if self.size() == 1 {
            return Ok(t);
        }
        #[cfg(feature = "cuda")]
        let t = match super::nccl_device::try_on_device(self, t, |nccl, t| {
            nccl.all_reduce_device(t, op)
        }) {
            Ok(done) => return done,
            Err(t) => t,
        };
        let (shape, device, dtype) = (t.shape(), t.device(), t.dtype());
        let mut buf = tensor_to_vec(t)?;
        self.all_reduce(&mut buf, op)?;
        Ok(vec_to_tensor(buf, shape, &device, dtype))
    }

    fn all_gather_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
    ) -> Result<Tensor<B, D>, CommError> {
        if self.size() == 1 {
            return Ok(t);
        }
        let (shape, device, dtype) = (t.shape(), t.device(), t.dtype());
        #[cfg(feature = "cuda")]
        let t =
            match super::nccl_device::try_on_device(self, t, |nccl, t| nccl.all_gather_device(t)) {
                Ok(flat) => {
                    let parts = flat?
                        .chunk(self.size(), 0)
                        .into_iter()
                        .map(|c| c.reshape(shape.clone()))
                        .collect::<Vec<_>>();
                    return Ok(Tensor::cat(parts, dim));
                }
                Err(t) => t,
            };
        let send = tensor_to_vec(t)?;
        let mut recv = vec![0.0; send.len() * self.size()];
        self.all_gather(&send, &mut recv)?;
        let parts = recv
            .chunks_exact(send.len().max(1))
            .map(|c| vec_to_tensor::<B, D>(c.to_vec(), shape.clone(), &device, dtype))
            .collect::<Vec<_>>();
        Ok(Tensor::cat(parts, dim))
    }

    fn reduce_scatter_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        let n = self.size();
        let dims = t.dims();
        if !dims[dim].is_multiple_of(n) {
            return Err(CommError::BufferSize {
                op: "reduce_scatter_tensor (dimension not divisible by group size)",
                expected: dims[dim].div_ceil(n) * n,
                got: dims[dim],
            });
        }
        if n == 1 {
            return Ok(t);
        }
        let (device, dtype) = (t.device(), t.dtype());
        // Lay the chunks out rank-major so that chunk r is contiguous.
        let chunks = t.chunk(n, dim);
        let chunk_shape = chunks[0].shape();
        let send = tensor_to_vec(Tensor::cat(chunks, 0))?;
        let mut recv = vec![0.0; send.len() / n];
        self.reduce_scatter(&send, &mut recv, op)?;
        Ok(vec_to_tensor(recv, chunk_shape, &device, dtype))
    }

    fn all_to_all_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dim: usize,
    ) -> Result<Tensor<B, D>, CommError> {
        let n = self.size();
        let dims = t.dims();
        if !dims[dim].is_multiple_of(n) {
            return Err(CommError::BufferSize {
                op: "all_to_all_tensor (dimension not divisible by group size)",
                expected: dims[dim].div_ceil(n) * n,
                got: dims[dim],
            });
        }
        if n == 1 || dims.contains(&0) {
            return Ok(t);
        }
        let (device, dtype) = (t.device(), t.dtype());
        // Lay the chunks out rank-major so that the block for rank j is contiguous.
        let chunks = t.chunk(n, dim);
        let chunk_shape = chunks[0].shape();
        let send = tensor_to_vec(Tensor::cat(chunks, 0))?;
        let mut recv = vec![0.0; send.len()];
        self.all_to_all(&send, &mut recv)?;
        let parts = recv
            .chunks_exact((send.len() / n).max(1))
            .map(|c| vec_to_tensor::<B, D>(c.to_vec(), chunk_shape.clone(), &device, dtype))
            .collect::<Vec<_>>();
        Ok(Tensor::cat(parts, dim))
    }

    fn all_to_all_rows<B: Backend>(
        &self,
        t: Tensor<B, 2>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor<B, 2>, CommError> {
        self.all_to_all_rows_start(t, send_rows, recv_rows)?
            .finish()
    }

    fn all_to_all_rows_start<B: Backend>(
        &self,
        t: Tensor<B, 2>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<RowsInFlight<B>, CommError> {
        let (device, dtype, width) = (t.device(), t.dtype(), t.dims()[1]);
        let values = |rows: &[usize]| rows.iter().map(|n| n * width).collect::<Vec<_>>();
        let send = tensor_to_vec(t)?;
        let pending = self.all_to_all_v_start(send, &values(send_rows), &values(recv_rows))?;
        Ok(RowsInFlight {
            pending,
            shape: Shape::new([recv_rows.iter().sum(), width]),
            device,
            dtype,
        })
    }

    fn broadcast_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        root: usize,
    ) -> Result<Tensor<B, D>, CommError> {
        if self.size() == 1 {
            return Ok(t);
        }
        let (shape, device, dtype) = (t.shape(), t.device(), t.dtype());
        let mut buf = tensor_to_vec(t)?;
        self.broadcast(&mut buf, root)?;
        Ok(vec_to_tensor(buf, shape, &device, dtype))
    }

    fn send_tensor<B: Backend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        dest: usize,
        tag: u16,
    ) -> Result<(), CommError> {
        let buf = tensor_to_vec(t)?;
        self.send(&buf, dest, tag)
    }

    fn recv_tensor<B: Backend, const D: usize>(
        &self,
        shape: [usize; D],
        src: usize,
        tag: u16,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, CommError> {
        let mut buf = vec![0.0; shape.iter().product()];
        self.recv(&mut buf, src, tag)?;
        Ok(vec_to_tensor(buf, Shape::from(shape), device, DType::F32))
    }
}
