//! A communicator whose non-blocking all-reduces run on a communication thread: the other way
//! (beside `test()` between chunk products) to make MPI move a collective while the compute
//! thread multiplies.
//!
//! The thread owns a duplicate of the communicator and runs each all-reduce it is handed as a
//! blocking `MPI_Allreduce`, in the order they were started (the same on every rank, as MPI
//! requires); every other operation runs on the calling thread on the original communicator.
//! This needs MPI initialised with `MPI_THREAD_MULTIPLE` ([`MpiWorld::init_thread_multiple`]).
//!
//! Measured against `test()` progress in `bench-tp-layer --progress thread` (see
//! benches/README.md): on a CPU machine whose cores all compute, the thread competes with the
//! computation (Open MPI polls while it waits), so the runtime keeps `test()`.
//!
//! [`MpiWorld::init_thread_multiple`]: super::MpiWorld::init_thread_multiple

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use mpi::collective::SystemOperation;
use mpi::raw::FromRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::CommunicatorCollectives;

use super::{CommError, Communicator, MpiCommunicator, Pending, ReduceOp};

/// An all-reduce handed to the thread, and where its result goes.
struct Job {
    buf: Vec<f32>,
    op: ReduceOp,
    done: Sender<Result<Vec<f32>, CommError>>,
}

/// The raw handle of the duplicated communicator, moved once to the thread that alone uses it.
struct RawComm(mpi::ffi::MPI_Comm);

// SAFETY: the handle is used by the communication thread only (MPI_THREAD_MULTIPLE allows
// any thread to call MPI; the handle is an opaque pointer into the MPI library).
unsafe impl Send for RawComm {}

/// [`MpiCommunicator`] with a communication thread for non-blocking all-reduces.
pub struct ProgressThreadComm {
    main: MpiCommunicator,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressThreadComm {
    /// Wraps `main` and starts the thread on a duplicate of it. Collective: every rank of
    /// `main` must call it.
    ///
    /// # Errors
    ///
    /// [`CommError::Mpi`] when MPI was not initialised with `MPI_THREAD_MULTIPLE`.
    pub fn new(main: MpiCommunicator) -> Result<Self, CommError> {
        if mpi::environment::threading_support() != mpi::Threading::Multiple {
            return Err(CommError::Mpi {
                op: "communication thread (needs MpiWorld::init_thread_multiple)",
                code: -1,
            });
        }
        let raw = RawComm(main.duplicate_raw());
        let (jobs, rx) = channel::<Job>();
        let thread = std::thread::spawn(move || serve(raw, rx));
        Ok(Self {
            main,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }
}

/// The communication thread: runs each job's all-reduce until the sender is dropped, then
/// frees the communicator.
fn serve(raw: RawComm, rx: Receiver<Job>) {
    // SAFETY: `raw` is a valid communicator made by `MPI_Comm_dup`, owned by this thread from
    // here on; dropping the `SimpleCommunicator` frees it.
    let comm = unsafe { SimpleCommunicator::from_raw(raw.0) };
    for job in rx {
        let mut recv = vec![0.0f32; job.buf.len()];
        let op = match job.op {
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
        };
        comm.all_reduce_into(&job.buf[..], &mut recv[..], op);
        if job.op == ReduceOp::Mean {
            let n = comm_size(&comm) as f32;
            recv.iter_mut().for_each(|v| *v /= n);
        }
        // The caller may have given up (dropped its handle); nothing to report then.
        let _ = job.done.send(Ok(recv));
    }
}

fn comm_size(comm: &SimpleCommunicator) -> usize {
    mpi::traits::Communicator::size(comm) as usize
}

impl Drop for ProgressThreadComm {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An all-reduce running on the communication thread.
struct PendingThreaded {
    rx: Receiver<Result<Vec<f32>, CommError>>,
    result: Option<Result<Vec<f32>, CommError>>,
}

/// The error of a communication thread that ended before answering.
fn thread_gone() -> CommError {
    CommError::Mpi {
        op: "communication thread",
        code: -1,
    }
}

impl Pending for PendingThreaded {
    fn test(&mut self) -> Result<bool, CommError> {
        if self.result.is_some() {
            return Ok(true);
        }
        match self.rx.try_recv() {
            Ok(r) => {
                self.result = Some(r);
                Ok(true)
            }
            Err(TryRecvError::Empty) => Ok(false),
            Err(TryRecvError::Disconnected) => Err(thread_gone()),
        }
    }

    fn wait(self: Box<Self>) -> Result<Vec<f32>, CommError> {
        match self.result {
            Some(r) => r,
            None => self.rx.recv().map_err(|_| thread_gone())?,
        }
    }
}

impl Communicator for ProgressThreadComm {
    fn rank(&self) -> usize {
        self.main.rank()
    }
    fn split(&self, color: usize, key: usize) -> Result<std::rc::Rc<dyn Communicator>, CommError> {
        Communicator::split(&self.main, color, key)
    }
    fn size(&self) -> usize {
        self.main.size()
    }
    fn kind(&self) -> &'static str {
        "mpi+thread"
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.main.all_reduce(buf, op)
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.main.all_gather(send, recv)
    }
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.main.reduce_scatter(send, recv, op)
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.main.all_to_all(send, recv)
    }
    fn all_to_all_v(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.main.all_to_all_v(send, send_counts, recv, recv_counts)
    }
    fn all_to_all_v_start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn Pending>, CommError> {
        self.main.all_to_all_v_start(send, send_counts, recv_counts)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.main.broadcast(buf, root)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.main.broadcast_bytes(buf, root)
    }
    fn send(&self, buf: &[f32], dest: usize, tag: u16) -> Result<(), CommError> {
        self.main.send(buf, dest, tag)
    }
    fn recv(&self, buf: &mut [f32], src: usize, tag: u16) -> Result<(), CommError> {
        self.main.recv(buf, src, tag)
    }
    fn recv_start(&self, len: usize, src: usize, tag: u16) -> Result<Box<dyn Pending>, CommError> {
        self.main.recv_start(len, src, tag)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.main.barrier()
    }
    fn all_reduce_start(&self, buf: Vec<f32>, op: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        let (done, rx) = channel();
        let jobs = self.jobs.as_ref().ok_or_else(thread_gone)?;
        jobs.send(Job { buf, op, done })
            .map_err(|_| thread_gone())?;
        Ok(Box::new(PendingThreaded { rx, result: None }))
    }
}
