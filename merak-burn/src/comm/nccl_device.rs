//! NCCL collectives on CUDA tensors where they live: no copy to the host and back.
//!
//! [`TensorComm`](super::TensorComm) hands a tensor here when its communicator is NCCL and its
//! backend is `Cuda<f32>` (the inner backend the tensor-parallel operations run on). The
//! tensor's buffer, owned by Burn's CUDA runtime (CubeCL, on the device's primary context, as
//! `cudarc` uses), is lent to NCCL as a raw device pointer:
//!
//! 1. the tensor is cast to `f32` (bf16 activations reduce in `f32`, as on the host path) and
//!    flattened, which makes it contiguous;
//! 2. Burn's stream is synchronised, so the kernels that wrote the input have finished;
//! 3. NCCL runs on the communicator's stream from the input into a fresh output tensor (never
//!    in place: Burn may share the input's buffer, for example with a saved autodiff state);
//! 4. the communicator's stream is synchronised before the output is handed back to Burn.
//!
//! [`self_check`] (`merak probe --nccl`) checks this path against exact values on a GPU.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::nccl::NcclCommunicator;
use super::{CommError, Communicator, ReduceOp};
use crate::precision::{like_dtype, to_f32};

/// The CUDA backend whose tensors NCCL reads and writes in place.
type Cuda = burn_cuda::Cuda<f32>;

/// A tensor's device memory lent to NCCL for one call. The tensor it came from must outlive
/// the call and the stream synchronisation after it.
struct Lent {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<f32> for Lent {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<f32> for Lent {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for Lent {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The device address of a contiguous `f32` tensor's first element, for a call that ends
/// before `t` is dropped.
fn device_address(t: &Tensor<Cuda, 1>) -> Result<CUdeviceptr, CommError> {
    let prim = t.clone().into_primitive().tensor();
    let resource = prim
        .client
        .get_resource(prim.handle.clone())
        .map_err(|e| CommError::Nccl {
            op: "device buffer",
            msg: format!("CUDA runtime: {e:?}"),
        })?;
    Ok(resource.resource().ptr)
}

/// Waits for the kernels Burn has queued on `device`.
fn sync_burn(device: &burn_cuda::CudaDevice, op: &'static str) -> Result<(), CommError> {
    Cuda::sync(device).map_err(|e| CommError::Nccl {
        op,
        msg: format!("CUDA runtime: {e:?}"),
    })
}

impl NcclCommunicator {
    /// Lends `input` and `output` to `run` as device buffers on this communicator's stream,
    /// after Burn's work on them has finished, and waits for NCCL before returning.
    fn on_device(
        &self,
        op: &'static str,
        input: &Tensor<Cuda, 1>,
        output: &Tensor<Cuda, 1>,
        run: impl FnOnce(&Lent, &mut Lent) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        sync_burn(&input.device(), op)?;
        let stream = self.stream().clone();
        let src = Lent {
            ptr: device_address(input)?,
            len: input.dims()[0],
            stream: stream.clone(),
        };
        let mut dst = Lent {
            ptr: device_address(output)?,
            len: output.dims()[0],
            stream,
        };
        self.bind(op)?;
        run(&src, &mut dst)?;
        self.sync(op)
    }

    /// All-reduce of a CUDA tensor in device memory; the result has the input's shape and
    /// element type.
    pub fn all_reduce_device<const D: usize>(
        &self,
        t: Tensor<Cuda, D>,
        op: ReduceOp,
    ) -> Result<Tensor<Cuda, D>, CommError> {
        const OP: &str = "all_reduce (device)";
        let (shape, dtype, device) = (t.shape(), t.dtype(), t.device());
        let n = shape.num_elements();
        let input = to_f32(t).reshape([n]);
        let output = Tensor::<Cuda, 1>::empty([n], &device);
        self.on_device(OP, &input, &output, |src, dst| {
            self.raw()
                .all_reduce(src, dst, &super::nccl::nccl_op(op))
                .map(|_| ())
                .map_err(super::nccl::nccl_err(OP))
        })?;
        let mut out = output.reshape(shape);
        if op == ReduceOp::Mean {
            out = out / self.size() as f32;
        }
        Ok(like_dtype(out, dtype))
    }

    /// All-gather of a CUDA tensor in device memory: the ranks' flattened tensors one after
    /// the other (`[size * n]`), in the input's element type.
    pub fn all_gather_device<const D: usize>(
        &self,
        t: Tensor<Cuda, D>,
    ) -> Result<Tensor<Cuda, 1>, CommError> {
        const OP: &str = "all_gather (device)";
        let (n, dtype, device) = (t.shape().num_elements(), t.dtype(), t.device());
        let input = to_f32(t).reshape([n]);
        let output = Tensor::<Cuda, 1>::empty([n * self.size()], &device);
        self.on_device(OP, &input, &output, |src, dst| {
            self.raw()
                .all_gather(src, dst)
                .map(|_| ())
                .map_err(super::nccl::nccl_err(OP))
        })?;
        Ok(like_dtype(output, dtype))
    }
}

/// `t` as a tensor of the backend `To` when `From` is `To` (a type check, no conversion).
fn same_backend<From: Backend, To: Backend, const D: usize>(
    t: Tensor<From, D>,
) -> Result<Tensor<To, D>, Tensor<From, D>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<Tensor<To, D>>() {
        Ok(t) => Ok(*t),
        Err(boxed) => Err(*boxed
            .downcast::<Tensor<From, D>>()
            .expect("the box holds the tensor it was made from")),
    }
}

/// Runs `device_op` on `t` when `comm` is NCCL and `t` a `Cuda<f32>` tensor; otherwise hands
/// `t` back for the host path.
pub(crate) fn try_on_device<C, B, const D: usize, const E: usize>(
    comm: &C,
    t: Tensor<B, D>,
    device_op: impl FnOnce(&NcclCommunicator, Tensor<Cuda, D>) -> Result<Tensor<Cuda, E>, CommError>,
) -> Result<Result<Tensor<B, E>, CommError>, Tensor<B, D>>
where
    C: Communicator + ?Sized,
    B: Backend,
{
    let Some(nccl) = comm.as_nccl() else {
        return Err(t);
    };
    let t = same_backend::<B, Cuda, D>(t)?;
    Ok(device_op(nccl, t).map(|out| {
        same_backend::<Cuda, B, E>(out)
            .unwrap_or_else(|_| unreachable!("B is Cuda: the tensor came from a B"))
    }))
}

/// What [`self_check`] found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NcclCheck {
    /// Ranks in the communicator.
    pub ranks: usize,
    /// Elements per rank of each checked tensor.
    pub elements: usize,
    /// The largest difference of a device all-reduce (f32, then bf16) from the exact sums.
    pub all_reduce_error: f32,
    /// The largest difference of a device all-gather from the ranks' tensors.
    pub all_gather_error: f32,
    /// The largest difference of a host-buffer all-reduce from the exact sums.
    pub host_all_reduce_error: f32,
    /// Whether the inputs kept their values (the device operations never write in place).
    pub inputs_unchanged: bool,
    /// The largest difference of the grouped send/receive exchange of expert parallelism
    /// (uneven counts, the rank itself among the peers) from the rows sent.
    pub all_to_all_v_error: f32,
}

impl NcclCheck {
    /// Whether every result is exact (the values are small integers, exact in bf16 too).
    pub fn passed(&self) -> bool {
        self.all_reduce_error == 0.0
            && self.all_gather_error == 0.0
            && self.host_all_reduce_error == 0.0
            && self.all_to_all_v_error == 0.0
            && self.inputs_unchanged
    }
}

/// Builds an NCCL communicator over `mpi` on CUDA device `device` and checks its device
/// all-reduce (f32 and bf16) and all-gather of Burn tensors, and its host all-reduce, against
/// exact values. Collective over `mpi`; each rank needs its own GPU. With one rank the
/// collectives still run through NCCL, which checks how Burn's buffers are lent to it.
pub fn self_check(mpi: &super::MpiCommunicator, device: usize) -> Result<NcclCheck, CommError> {
    let nccl = NcclCommunicator::new(mpi, device)?;
    let (rank, ranks) = (nccl.rank(), nccl.size());
    let dev = burn_cuda::CudaDevice::new(device);
    let elements = 1031;
    let pattern = |i: usize| (i % 17) as f32;
    let mine: Vec<f32> = (0..elements)
        .map(|i| (rank + 1) as f32 * pattern(i))
        .collect();
    let total = (ranks * (ranks + 1) / 2) as f32;
    let sums: Vec<f32> = (0..elements).map(|i| total * pattern(i)).collect();
    let input = Tensor::<Cuda, 1>::from_floats(mine.as_slice(), &dev);

    let mut all_reduce_error = 0.0f32;
    for dtype in [DType::F32, DType::BF16] {
        let out = nccl.all_reduce_device(like_dtype(input.clone(), dtype), ReduceOp::Sum)?;
        all_reduce_error = all_reduce_error.max(max_difference(out, &sums)?);
    }
    let gathered = nccl.all_gather_device(input.clone())?;
    let expected: Vec<f32> = (0..ranks)
        .flat_map(|r| (0..elements).map(move |i| (r + 1) as f32 * pattern(i)))
        .collect();
    let all_gather_error = max_difference(gathered, &expected)?;
    let mut host = mine.clone();
    nccl.all_reduce(&mut host, ReduceOp::Sum)?;
    let host_all_reduce_error = max_abs_difference(&host, &sums);
    let inputs_unchanged = max_difference(input, &mine)? == 0.0;
    let all_to_all_v_error = exchange_error(&nccl)?;
    Ok(NcclCheck {
        ranks,
        elements,
        all_reduce_error,
        all_gather_error,
        host_all_reduce_error,
        inputs_unchanged,
        all_to_all_v_error,
    })
}

/// Runs the grouped exchange of [`NcclCommunicator::all_to_all_v`] (through NCCL even on one
/// rank) with uneven counts, rank `r` sending `(r + j) % 3 + 1` values `100 r + 10 j + i` to
/// rank `j`, and returns the largest difference from what the peers sent.
fn exchange_error(nccl: &NcclCommunicator) -> Result<f32, CommError> {
    let (rank, ranks) = (nccl.rank(), nccl.size());
    let count = |from: usize, to: usize| (from + to) % 3 + 1;
    let rows = |from: usize, to: usize| {
        (0..count(from, to)).map(move |i| (100 * from + 10 * to + i) as f32)
    };
    let send: Vec<f32> = (0..ranks).flat_map(|j| rows(rank, j)).collect();
    let want: Vec<f32> = (0..ranks).flat_map(|j| rows(j, rank)).collect();
    let send_counts: Vec<usize> = (0..ranks).map(|j| count(rank, j)).collect();
    let recv_counts: Vec<usize> = (0..ranks).map(|j| count(j, rank)).collect();
    let mut got = vec![-1.0; want.len()];
    nccl.exchange_grouped(&send, &send_counts, &mut got, &recv_counts)?;
    Ok(max_abs_difference(&got, &want))
}

/// The largest absolute difference between `t` (read back as `f32`) and `want`.
fn max_difference(t: Tensor<Cuda, 1>, want: &[f32]) -> Result<f32, CommError> {
    let got = super::host::tensor_to_vec(t)?;
    if got.len() != want.len() {
        return Err(CommError::BufferSize {
            op: "NCCL self-check",
            expected: want.len(),
            got: got.len(),
        });
    }
    Ok(max_abs_difference(&got, want))
}

/// The largest absolute element-wise difference of two equally long slices.
fn max_abs_difference(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}
