//! NCCL communicators (crate `cudarc`).
//!
//! The [`Communicator`] operations take host `f32` buffers: each copies its buffer to the
//! device on the communicator's own CUDA stream, runs the NCCL collective there, synchronises
//! the stream and copies the result back. CUDA tensors skip the host: [`TensorComm`]'s
//! all-reduce and all-gather hand them to NCCL in device memory (`nccl_device`). The NCCL
//! unique id is created by rank 0 and shared over MPI.
//!
//! [`TensorComm`]: super::TensorComm
//!
//! `cudarc` loads `libcuda` and `libnccl` at run time and panics when one is missing; with an
//! [`MpiWorld`](super::MpiWorld) alive a panic aborts the whole job. [`nccl_available`] and
//! [`cuda_available`] therefore check both libraries before `cudarc` is touched, and
//! [`NcclCommunicator::new`] returns [`CommError::NcclUnavailable`] instead of panicking.

use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, DriverError};
use cudarc::driver::{ValidAsZeroBits, sys::CUevent_flags};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, NcclType};

use super::{CommError, Communicator, MpiCommunicator, Pending, ReduceOp, check_len, check_rank};

/// The size of an NCCL unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// Checks that the NCCL shared library can be loaded the way `cudarc` loads it.
///
/// `cudarc` looks for `libnccl.so` (not the versioned `libnccl.so.2` that NCCL runtime
/// packages install), so a system with only `libnccl.so.2` gets an error that explains how to
/// add the symlink. Never panics.
pub fn nccl_available() -> Result<(), CommError> {
    // SAFETY: loading NCCL runs only its library initialisers; the handle is closed at once.
    let plain = unsafe { libloading::Library::new("libnccl.so") };
    let plain_err = match plain {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    // SAFETY: as above; this tries every name `cudarc` would try (it also closes the handles).
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    // SAFETY: as above.
    match unsafe { libloading::Library::new("libnccl.so.2") } {
        Ok(_) => Err(CommError::NcclUnavailable(
            "libnccl.so.2 is installed but libnccl.so, the name cudarc loads, is not found: \
             create the symlink (`ln -s libnccl.so.2 libnccl.so` in the NCCL lib directory, or in \
             a directory of your own) and make sure that directory is on LD_LIBRARY_PATH \
             (installing the NCCL development package also provides it)"
                .to_string(),
        )),
        Err(versioned_err) => Err(CommError::NcclUnavailable(format!(
            "NCCL is not installed (neither libnccl.so nor libnccl.so.2 could be loaded from {}: \
             {plain_err}; {versioned_err}); install NCCL (for example the nvidia-nccl-cu13 \
             Python package) and put its lib directory on LD_LIBRARY_PATH, or set \
             train.comm = \"mpi\"",
            searched()
        ))),
    }
}

/// Where the dynamic loader looks for a library, for error messages.
fn searched() -> String {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    if path.is_empty() {
        "the system's library directories (LD_LIBRARY_PATH is not set)".to_string()
    } else {
        format!("LD_LIBRARY_PATH={path} and the system's library directories")
    }
}

/// Checks that NVRTC, which compiles Burn's CUDA kernels at run time, can be loaded. Never
/// panics.
pub fn nvrtc_available() -> Result<(), CommError> {
    // SAFETY: tries to open the library under the names `cudarc` uses, then closes it.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CommError::NcclUnavailable(format!(
            "NVRTC (libnvrtc.so), which compiles the CUDA kernels at run time, could not be \
             loaded from {}: install the CUDA runtime compiler (for example the \
             nvidia-cuda-nvrtc Python package) and put its lib directory on LD_LIBRARY_PATH",
            searched()
        )))
    }
}

/// Checks that the CUDA driver library (`libcuda.so`) and NVRTC can be loaded, that the driver
/// initialises and that at least one GPU is visible. Never panics.
pub fn cuda_available() -> Result<(), CommError> {
    // SAFETY: tries to open the driver library under the names `cudarc` uses, then closes it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::NcclUnavailable(format!(
            "the CUDA driver library (libcuda.so) could not be loaded from {}: is an NVIDIA \
             driver installed and its library directory on LD_LIBRARY_PATH?",
            searched()
        )));
    }
    nvrtc_available()?;
    let count = guard("CUDA initialisation", || {
        cudarc::driver::result::init()?;
        cudarc::driver::result::device::get_count()
    })?
    .map_err(|e| CommError::NcclUnavailable(format!("CUDA initialisation failed: {e}")))?;
    if count < 1 {
        return Err(CommError::NcclUnavailable(
            "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".to_string(),
        ));
    }
    Ok(())
}

/// The CUDA devices this process sees (the CUDA driver's count, after
/// `CUDA_VISIBLE_DEVICES`).
pub fn cuda_device_count() -> Result<usize, crate::device::DeviceError> {
    cuda_available().map_err(|e| match e {
        CommError::NcclUnavailable(why) => crate::device::DeviceError::Driver(why),
        other => crate::device::DeviceError::Driver(other.to_string()),
    })?;
    let n = cudarc::driver::CudaContext::device_count()
        .map_err(|e| crate::device::DeviceError::Driver(format!("{e:?}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The CUDA device of this rank: its local rank from the environment, the node's devices from
/// the driver, shared by several ranks when there are more ranks than devices (MPI carries the
/// messages; see the [`crate::device`]).
pub fn cuda_device_for_rank(
    request: Option<&crate::device::DeviceRequest>,
) -> Result<crate::device::DeviceChoice, crate::device::DeviceError> {
    crate::device::choose_device(
        crate::device::LocalRank::from_env()?,
        cuda_device_count()?,
        request,
        true,
    )
}

/// Runs `f`, turning a panic inside `cudarc` (a missing library or symbol) into an error.
///
/// This is a last line of defence only: the panic hook that [`MpiWorld`](super::MpiWorld)
/// installs aborts the job before unwinding starts, which is why the libraries are checked
/// beforehand.
fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, CommError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".to_string());
        CommError::NcclUnavailable(format!("{what}: {msg}"))
    })
}

/// Formats an NCCL error with the library's own description.
fn nccl_msg(e: &NcclError) -> String {
    // SAFETY: an `NcclError` is only returned by a call into the loaded NCCL library, so the
    // library is present; ncclGetErrorString returns a static NUL-terminated string.
    let text = unsafe {
        let ptr = cudarc::nccl::sys::ncclGetErrorString(e.0);
        if ptr.is_null() {
            String::new()
        } else {
            CStr::from_ptr(ptr).to_string_lossy().into_owned()
        }
    };
    format!("{:?}: {text}", e.0)
}

pub(super) fn nccl_err(op: &'static str) -> impl FnOnce(NcclError) -> CommError {
    move |e| CommError::Nccl {
        op,
        msg: nccl_msg(&e),
    }
}

fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> CommError {
    move |e| CommError::Nccl {
        op,
        msg: format!("CUDA: {e}"),
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

fn peer(op: &'static str, rank: usize) -> Result<i32, CommError> {
    i32::try_from(rank).map_err(|_| CommError::BadRank {
        op,
        rank,
        size: i32::MAX as usize,
    })
}

/// A group of GPUs, one per MPI process, communicating through NCCL.
///
/// Buffers are host `f32` slices, as for every [`Communicator`]; each call stages them through
/// device memory on this communicator's own CUDA stream and returns once the result is back on
/// the host.
///
/// Point-to-point messages: NCCL has no tags, so the `tag` of [`Communicator::send`] and
/// [`Communicator::recv`] is ignored and messages between two ranks match in the order they
/// were posted. An NCCL send may not complete before the matching receive is posted (there is
/// no eager buffering as in MPI), so two ranks must not both send to each other first, and a
/// rank must not send to itself.
pub struct NcclCommunicator {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    /// The MPI group's name and world ranks, for the watchdog's report of a stuck call.
    watch: (Arc<str>, Arc<[usize]>),
}

impl NcclCommunicator {
    /// Creates an NCCL communicator over the ranks of `mpi`, using GPU `device_ordinal` on this
    /// process.
    ///
    /// Collective over `mpi`: every rank must call it. Each rank first checks that NCCL and the
    /// CUDA driver can be loaded and the device opened; the ranks agree (over MPI) that all
    /// succeeded, so that a failure on one rank is an error on every rank rather than a hang.
    /// Rank 0 then creates the NCCL unique id, broadcasts its 128 bytes over MPI, and every
    /// rank joins the NCCL communicator with its MPI rank and size.
    pub fn new(mpi: &MpiCommunicator, device_ordinal: usize) -> Result<Self, CommError> {
        let rank = mpi.rank();
        let size = mpi.size();
        peer("NcclCommunicator::new", rank)?;
        peer("NcclCommunicator::new", size)?;

        // Local set-up: libraries, device, stream, and (rank 0) the unique id.
        let local = Self::open_device(device_ordinal).and_then(|stream| {
            let id = if rank == 0 {
                let id = guard("ncclGetUniqueId", Id::new)?.map_err(nccl_err("ncclGetUniqueId"))?;
                Some(id)
            } else {
                None
            };
            Ok((stream, id))
        });

        // Agree on success, so that no rank waits in the broadcast or in ncclCommInitRank for
        // a rank that has already given up.
        let mut failed = [if local.is_err() { 1.0f32 } else { 0.0 }];
        mpi.all_reduce(&mut failed, ReduceOp::Max)?;
        let (stream, id) = match local {
            Err(e) => return Err(e),
            Ok(_) if failed[0] > 0.0 => {
                return Err(CommError::NcclUnavailable(
                    "another rank could not set up CUDA/NCCL (see its error)".to_string(),
                ));
            }
            Ok(v) => v,
        };

        let mut bytes = [0u8; NCCL_UNIQUE_ID_BYTES];
        if let Some(id) = &id {
            for (b, c) in bytes.iter_mut().zip(id.internal().iter()) {
                *b = c.to_ne_bytes()[0];
            }
        }
        mpi.broadcast_bytes(&mut bytes, 0)?;
        let mut internal: [c_char; NCCL_UNIQUE_ID_BYTES] = [0; NCCL_UNIQUE_ID_BYTES];
        for (c, b) in internal.iter_mut().zip(bytes.iter()) {
            *c = c_char::from_ne_bytes([*b]);
        }
        let id = Id::uninit(internal);

        // ncclCommInitRank uses the current device of the calling thread.
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("ncclCommInitRank"))?;
        let comm = guard("ncclCommInitRank", || {
            Comm::from_rank(stream.clone(), rank, size, id)
        })?
        .map_err(nccl_err("ncclCommInitRank"))?;
        tracing::debug!(rank, size, device_ordinal, "NCCL communicator ready");
        Ok(Self {
            comm,
            stream,
            rank,
            size,
            watch: mpi.watch_identity(),
        })
    }

    /// Checks the libraries and opens a stream on `device_ordinal`.
    fn open_device(device_ordinal: usize) -> Result<Arc<CudaStream>, CommError> {
        nccl_available()?;
        cuda_available()?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| CommError::NcclUnavailable(format!("CUDA device count: {e}")))?;
        if i32::try_from(device_ordinal).map_or(true, |d| d >= count) {
            return Err(CommError::NcclUnavailable(format!(
                "CUDA device {device_ordinal} does not exist ({count} visible)"
            )));
        }
        let ctx = guard("CUDA context", || CudaContext::new(device_ordinal))?.map_err(|e| {
            CommError::NcclUnavailable(format!("CUDA device {device_ordinal}: {e}"))
        })?;
        ctx.new_stream()
            .map_err(|e| CommError::NcclUnavailable(format!("CUDA stream: {e}")))
    }

    /// The CUDA stream on which this communicator runs its copies and collectives.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NCCL communicator itself.
    pub(super) fn raw(&self) -> &Comm {
        &self.comm
    }

    /// The CUDA device ordinal this communicator uses.
    pub fn device_ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    pub(super) fn bind(&self, op: &'static str) -> Result<(), CommError> {
        self.stream.context().bind_to_thread().map_err(cuda_err(op))
    }

    fn upload<T: DeviceRepr>(
        &self,
        op: &'static str,
        host: &[T],
    ) -> Result<CudaSlice<T>, CommError> {
        self.stream.clone_htod(host).map_err(cuda_err(op))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        len: usize,
    ) -> Result<CudaSlice<T>, CommError> {
        self.stream.alloc_zeros(len).map_err(cuda_err(op))
    }

    /// Waits for the stream and reports errors of earlier asynchronous work. The wait is
    /// watched ([`watchdog`](super::watchdog)): a peer that never joins aborts the job.
    pub(super) fn sync(&self, op: &'static str) -> Result<(), CommError> {
        let _watched = super::watchdog::watch(op, 0, &self.watch.0, &self.watch.1);
        self.stream.synchronize().map_err(cuda_err(op))?;
        self.stream.context().check_err().map_err(cuda_err(op))
    }

    /// Copies `dev` into `host` and waits for the copy.
    fn download<T: DeviceRepr>(
        &self,
        op: &'static str,
        dev: &CudaSlice<T>,
        host: &mut [T],
    ) -> Result<(), CommError> {
        check_len(op, dev.len(), host.len())?;
        self.stream.memcpy_dtoh(dev, host).map_err(cuda_err(op))?;
        self.sync(op)
    }

    fn finish_mean(&self, buf: &mut [f32], op: ReduceOp) {
        if op == ReduceOp::Mean {
            let n = self.size as f32;
            buf.iter_mut().for_each(|x| *x /= n);
        }
    }

    fn broadcast_any<T: DeviceRepr + ValidAsZeroBits + NcclType>(
        &self,
        op: &'static str,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        check_rank(op, root, self.size)?;
        if buf.is_empty() || self.size == 1 {
            return Ok(());
        }
        self.bind(op)?;
        let mut dev = if self.rank == root {
            self.upload(op, buf)?
        } else {
            self.zeros(op, buf.len())?
        };
        self.comm
            .broadcast_in_place(&mut dev, peer(op, root)?)
            .map_err(nccl_err(op))?;
        self.download(op, &dev, buf)
    }

    /// The grouped `ncclSend`/`ncclRecv` exchange of [`Communicator::all_to_all_v`], also
    /// with one rank (sending to itself), so that the self-check can run it on one GPU.
    /// The counts must have been checked.
    pub(super) fn exchange_grouped(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        const OP: &str = "all_to_all_v";
        self.bind(OP)?;
        let src = self.upload(OP, send)?;
        let mut dst = self.zeros::<f32>(OP, recv.len())?;
        let (mut at_send, mut at_recv) = (0, 0);
        cudarc::nccl::result::group_start().map_err(nccl_err(OP))?;
        let mut posted = Ok(());
        for j in 0..self.size {
            let (ns, nr) = (send_counts[j], recv_counts[j]);
            if ns > 0 && posted.is_ok() {
                let part = src.slice(at_send..at_send + ns);
                posted = (self.comm.send(&part, peer(OP, j)?)).map_err(nccl_err(OP));
            }
            if nr > 0 && posted.is_ok() {
                let mut part = dst.slice_mut(at_recv..at_recv + nr);
                posted = (self.comm.recv(&mut part, peer(OP, j)?))
                    .map(|_| ())
                    .map_err(nccl_err(OP));
            }
            (at_send, at_recv) = (at_send + ns, at_recv + nr);
        }
        // The group ends whatever was posted, so that NCCL is left consistent.
        cudarc::nccl::result::group_end().map_err(nccl_err(OP))?;
        posted?;
        if recv.is_empty() {
            return self.sync(OP);
        }
        self.download(OP, &dst, recv)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn kind(&self) -> &'static str {
        "nccl"
    }

    fn as_nccl(&self) -> Option<&NcclCommunicator> {
        Some(self)
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        const OP: &str = "all_reduce";
        if buf.is_empty() || self.size == 1 {
            return Ok(());
        }
        self.bind(OP)?;
        let mut dev = self.upload(OP, buf)?;
        self.comm
            .all_reduce_in_place(&mut dev, &nccl_op(op))
            .map_err(nccl_err(OP))?;
        self.download(OP, &dev, buf)?;
        self.finish_mean(buf, op);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        const OP: &str = "all_gather";
        check_len(OP, send.len() * self.size, recv.len())?;
        if send.is_empty() {
            return Ok(());
        }
        if self.size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.bind(OP)?;
        let src = self.upload(OP, send)?;
        let mut dst = self.zeros::<f32>(OP, recv.len())?;
        self.comm.all_gather(&src, &mut dst).map_err(nccl_err(OP))?;
        self.download(OP, &dst, recv)
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        const OP: &str = "reduce_scatter";
        check_len(OP, recv.len() * self.size, send.len())?;
        if recv.is_empty() {
            return Ok(());
        }
        if self.size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.bind(OP)?;
        let src = self.upload(OP, send)?;
        let mut dst = self.zeros::<f32>(OP, recv.len())?;
        self.comm
            .reduce_scatter(&src, &mut dst, &nccl_op(op))
            .map_err(nccl_err(OP))?;
        self.download(OP, &dst, recv)?;
        self.finish_mean(recv, op);
        Ok(())
    }

    /// One `ncclSend` and one `ncclRecv` per peer with rows to exchange, in one NCCL group
    /// (expert parallelism's token exchange), through device copies of the host buffers.
    fn all_to_all_v(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        super::check_counts(self.size, (send, send_counts), (recv, recv_counts))?;
        if self.size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.exchange_grouped(send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.broadcast_any("broadcast", buf, root)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.broadcast_any("broadcast_bytes", buf, root)
    }

    /// Sends `buf` to `dest` with `ncclSend` and returns once the data has left this GPU.
    /// NCCL has no message tags: `tag` is ignored and messages match in posting order.
    fn send(&self, buf: &[f32], dest: usize, _tag: u16) -> Result<(), CommError> {
        const OP: &str = "send";
        check_rank(OP, dest, self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.bind(OP)?;
        let dev = self.upload(OP, buf)?;
        self.comm
            .send(&dev, peer(OP, dest)?)
            .map_err(nccl_err(OP))?;
        self.sync(OP)
    }

    /// Receives `buf.len()` values from `src` with `ncclRecv`.
    /// NCCL has no message tags: `tag` is ignored and messages match in posting order.
    fn recv(&self, buf: &mut [f32], src: usize, _tag: u16) -> Result<(), CommError> {
        const OP: &str = "recv";
        check_rank(OP, src, self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.bind(OP)?;
        let mut dev = self.zeros::<f32>(OP, buf.len())?;
        self.comm
            .recv(&mut dev, peer(OP, src)?)
            .map_err(nccl_err(OP))?;
        self.download(OP, &dev, buf)
    }

    /// An all-reduce of one element, followed by a stream synchronisation.
    fn barrier(&self) -> Result<(), CommError> {
        const OP: &str = "barrier";
        if self.size == 1 {
            return Ok(());
        }
        self.bind(OP)?;
        let mut dev = self.upload(OP, &[0.0f32])?;
        self.comm
            .all_reduce_in_place(&mut dev, &cudarc::nccl::ReduceOp::Sum)
            .map_err(nccl_err(OP))?;
        self.sync(OP)
    }

    /// Uploads `buf`, enqueues the NCCL all-reduce on the stream and records a CUDA event
    /// after it; the returned [`PendingNcclAllReduce`] polls that event.
    fn all_reduce_start(&self, buf: Vec<f32>, op: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        const OP: &str = "all_reduce_start";
        let divide_by = (op == ReduceOp::Mean).then_some(self.size as f32);
        if buf.is_empty() || self.size == 1 {
            return Ok(Box::new(PendingNcclAllReduce {
                stream: self.stream.clone(),
                watch: self.watch.clone(),
                dev: None,
                event: None,
                host: buf,
                divide_by: None,
                complete: true,
            }));
        }
        self.bind(OP)?;
        let mut dev = self.upload(OP, &buf)?;
        self.comm
            .all_reduce_in_place(&mut dev, &nccl_op(op))
            .map_err(nccl_err(OP))?;
        let event = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(cuda_err(OP))?;
        Ok(Box::new(PendingNcclAllReduce {
            stream: self.stream.clone(),
            watch: self.watch.clone(),
            dev: Some(dev),
            event: Some(event),
            host: buf,
            divide_by,
            complete: false,
        }))
    }
}

/// A non-blocking NCCL all-reduce: the collective runs on the communicator's stream while the
/// host goes on. [`Pending::test`] queries a CUDA event recorded after the collective (no
/// blocking); [`Pending::wait`] copies the result back and synchronises the stream.
pub struct PendingNcclAllReduce {
    stream: Arc<CudaStream>,
    watch: (Arc<str>, Arc<[usize]>),
    dev: Option<CudaSlice<f32>>,
    event: Option<CudaEvent>,
    host: Vec<f32>,
    divide_by: Option<f32>,
    complete: bool,
}

impl Pending for PendingNcclAllReduce {
    fn test(&mut self) -> Result<bool, CommError> {
        if self.complete {
            return Ok(true);
        }
        let Some(event) = &self.event else {
            self.complete = true;
            return Ok(true);
        };
        self.complete = event
            .try_is_complete()
            .map_err(cuda_err("all_reduce test"))?;
        Ok(self.complete)
    }

    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, CommError> {
        const OP: &str = "all_reduce wait";
        if let Some(dev) = self.dev.take() {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(cuda_err(OP))?;
            check_len(OP, dev.len(), self.host.len())?;
            self.stream
                .memcpy_dtoh(&dev, &mut self.host[..])
                .map_err(cuda_err(OP))?;
            let _watched = super::watchdog::watch(OP, 0, &self.watch.0, &self.watch.1);
            self.stream.synchronize().map_err(cuda_err(OP))?;
            self.stream.context().check_err().map_err(cuda_err(OP))?;
        }
        let mut out = std::mem::take(&mut self.host);
        if let Some(n) = self.divide_by {
            out.iter_mut().for_each(|x| *x /= n);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loadable(name: &str) -> bool {
        // SAFETY: opening and closing a shared library; test only.
        unsafe { libloading::Library::new(name) }.is_ok()
    }

    #[test]
    fn missing_nccl_is_an_error_not_a_panic() {
        let result = nccl_available();
        // SAFETY: opens and closes the candidate libraries.
        let present = loadable("libnccl.so") || unsafe { cudarc::nccl::sys::is_culib_present() };
        if present {
            assert!(result.is_ok(), "{result:?}");
        } else {
            match result {
                Err(CommError::NcclUnavailable(msg)) => {
                    assert!(msg.contains("libnccl.so"), "{msg}");
                    if loadable("libnccl.so.2") {
                        assert!(msg.contains("symlink"), "{msg}");
                    } else {
                        assert!(msg.contains("not installed"), "{msg}");
                    }
                }
                other => panic!("expected NcclUnavailable, got {other:?}"),
            }
        }
    }

    #[test]
    fn missing_cuda_is_an_error_not_a_panic() {
        // SAFETY: opens and closes the candidate libraries.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            assert!(matches!(
                cuda_available(),
                Err(CommError::NcclUnavailable(_))
            ));
        } else {
            // A driver without a GPU is an error too; either way this must not panic.
            let _ = cuda_available();
        }
    }
}
