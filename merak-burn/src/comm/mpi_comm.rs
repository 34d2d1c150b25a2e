//! MPI communicators (crate `mpi`), on host buffers.

use std::os::raw::c_int;

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::raw::AsRaw;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Root, Source};

use super::abort::{abort_world, report_line};
use super::{
    CommError, Communicator, Pending, ReduceOp, check_counts, check_len, check_rank, watchdog,
};
use crate::rank_env::Launch;
use std::sync::Arc;

/// The largest element count one MPI call can describe (MPI counts are C `int`).
const MAX_COUNT: usize = i32::MAX as usize;

fn check_count(op: &'static str, len: usize) -> Result<c_int, CommError> {
    c_int::try_from(len).map_err(|_| CommError::TooLarge {
        op,
        len,
        max: MAX_COUNT,
    })
}

/// Whether this process is one rank of an MPI job, so that MPI should be initialised: started
/// by `mpirun`/`mpiexec` (Open MPI, MPICH), a PMIx launcher, or `srun` (a Slurm job step of
/// several tasks or with PMIx/PMI), as [`Launch::starts_mpi`] reads the environment. An
/// environment that does not add up also answers `true`, so that [`MpiWorld::init`] reports it.
pub fn launched_by_mpirun() -> bool {
    Launch::from_env().map_or(true, |l| l.starts_mpi())
}

/// The launcher's description of this process, checked before MPI starts.
fn launch_env() -> Result<Launch, CommError> {
    Ok(Launch::from_env()?)
}

/// MPI's world against the launcher's (see [`Launch::check_world`]).
fn check_world(launch: &Launch, universe: &Universe) -> Result<(), CommError> {
    let world = universe.world();
    Ok(launch.check_world(world.rank() as usize, world.size() as usize)?)
}

/// The MPI environment of this process: initialises MPI once and finalises it when dropped.
///
/// Creating it also installs a panic hook that reports the failing rank and aborts the whole
/// MPI job, so that no other rank is left waiting for a message that will never come: a
/// [`RankFailure`](super::RankFailure) as `merak: rank R failed: ...` with exit status 1, any
/// other panic as `merak: rank R panicked: ...` with 101.
pub struct MpiWorld {
    /// Finalises MPI when dropped (after `Drop for MpiWorld` has freed the registered groups).
    universe: Universe,
}

impl MpiWorld {
    /// Initialises MPI. Fails if MPI was already initialised in this process, if the
    /// launcher's environment does not add up, or if MPI's world is one process where the
    /// launcher started several (`srun` without `--mpi=pmix`).
    pub fn init() -> Result<Self, CommError> {
        let launch = launch_env()?;
        let universe = mpi::initialize().ok_or(CommError::MpiInit)?;
        check_world(&launch, &universe)?;
        let rank = universe.world().rank();
        install_abort_on_panic(rank as usize);
        Ok(Self { universe })
    }

    /// Initialises MPI with `MPI_THREAD_MULTIPLE` (any thread may call MPI, as a
    /// [`ProgressThreadComm`](super::ProgressThreadComm) needs). Fails where
    /// [`init`](Self::init) fails, or if the library does not provide that level.
    pub fn init_thread_multiple() -> Result<Self, CommError> {
        let launch = launch_env()?;
        let (universe, level) =
            mpi::initialize_with_threading(mpi::Threading::Multiple).ok_or(CommError::MpiInit)?;
        check_world(&launch, &universe)?;
        if level != mpi::Threading::Multiple {
            return Err(CommError::Mpi {
                op: "MPI_Init_thread (MPI_THREAD_MULTIPLE not provided)",
                code: -1,
            });
        }
        let rank = universe.world().rank();
        install_abort_on_panic(rank as usize);
        Ok(Self { universe })
    }

    /// A communicator over every process of the job.
    pub fn world(&self) -> MpiCommunicator {
        MpiCommunicator::new(self.universe.world())
    }

    /// Ends the whole job at once (every rank) with `code`, after printing `message` tagged
    /// with this rank. Used when one rank hits an error the others cannot know about.
    pub fn abort(&self, code: i32, message: &str) -> ! {
        let rank = self.universe.world().rank();
        report_line(&format!("merak: rank {rank} failed: {message}"));
        abort_world(code)
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        // Sub-communicators held by group handles must be freed before MPI_Finalize, which
        // runs when `universe` is dropped right after this.
        super::Group::release_all();
    }
}

fn install_abort_on_panic(rank: usize) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // A failure raised where no `Result` can carry it (`fail`): a failed rank, not a panic.
        if let Some(failure) = super::failure_of(info.payload()) {
            report_line(&format!("merak: rank {rank} failed: {failure}"));
            abort_world(1);
        }
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".to_string());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        report_line(&format!(
            "merak: rank {rank} panicked: {msg}{at}; aborting the job"
        ));
        // Let the default hook print a backtrace when RUST_BACKTRACE asks for it.
        if std::env::var_os("RUST_BACKTRACE").is_some() {
            default(info);
        }
        abort_world(101);
    }));
}

/// A group of MPI processes (the world or a sub-communicator made with [`MpiCommunicator::split`]).
pub struct MpiCommunicator {
    comm: SimpleCommunicator,
    /// Send-side copy for all-reduce. The safe `mpi` API has no `MPI_IN_PLACE`, so the input is
    /// copied here first; keeping the buffer avoids a fresh allocation (and its page faults)
    /// on every call.
    scratch: std::cell::RefCell<Vec<f32>>,
    /// Spare buffers for non-blocking all-reduces: a finished operation returns its send
    /// buffer here and the next one takes its receive buffer from here.
    pool: BufferPool,
    /// What the watchdog calls this group ("world", "tensor-parallel", ...).
    name: Arc<str>,
    /// The world ranks of the group, in group order (for the watchdog's report).
    members: Arc<[usize]>,
}

/// The world ranks of the members of `comm`, in its rank order.
fn world_ranks(comm: &SimpleCommunicator) -> Vec<usize> {
    use mpi::topology::Group as _;
    let ranks: Vec<i32> = (0..comm.size()).collect();
    let world = SimpleCommunicator::world().group();
    (comm.group().translate_ranks(&ranks, &world).into_iter())
        .enumerate()
        .map(|(i, r)| r.map_or(i, |r| r as usize))
        .collect()
}

/// A few spare host buffers shared by a communicator and its operations in flight.
type BufferPool = std::rc::Rc<std::cell::RefCell<Vec<Vec<f32>>>>;

/// How many spare buffers a communicator keeps.
const POOL_SIZE: usize = 4;

impl MpiCommunicator {
    fn new(comm: SimpleCommunicator) -> Self {
        let members = world_ranks(&comm);
        let world = SimpleCommunicator::world().size() as usize;
        let name = if members.len() == world {
            "world"
        } else {
            "mpi"
        };
        Self {
            comm,
            scratch: std::cell::RefCell::new(Vec::new()),
            pool: BufferPool::default(),
            name: Arc::from(name),
            members: members.into(),
        }
    }

    /// The same communicator under `name` in the watchdog's reports (the grid names its axes).
    pub fn named(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// The name the watchdog reports this communicator under ("world", "tensor-parallel", ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The watchdog's name and world ranks of this group, for a communicator built over it.
    #[cfg(feature = "cuda")]
    pub(crate) fn watch_identity(&self) -> (Arc<str>, Arc<[usize]>) {
        (self.name.clone(), self.members.clone())
    }

    /// Marks a blocking call for the watchdog ([`super::watchdog`]).
    fn watch(&self, op: &'static str, values: usize) -> watchdog::Guard {
        watchdog::watch(op, values, &self.name, &self.members)
    }

    /// A buffer of `len` elements whose contents will be overwritten, from the pool if one is
    /// large enough.
    fn buffer(&self, len: usize) -> Vec<f32> {
        let mut pool = self.pool.borrow_mut();
        let mut buf = match pool.iter().position(|b| b.capacity() >= len) {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        buf.clear();
        buf.resize(len, 0.0);
        buf
    }
}

impl MpiCommunicator {
    /// Splits the group: ranks passing the same `color` form one new group, ordered by `key`.
    pub fn split(&self, color: u32, key: u32) -> Result<MpiCommunicator, CommError> {
        let color = Color::with_value(check_count("split", color as usize)?);
        let key = check_count("split", key as usize)?;
        self.comm
            .split_by_color_with_key(color, key)
            .map(MpiCommunicator::new)
            .ok_or(CommError::Mpi {
                op: "split",
                code: -1,
            })
    }

    /// A copy of this communicator with its own message space (`MPI_Comm_dup`), for example
    /// for a communication thread that must not match messages of the main thread.
    pub fn duplicate(&self) -> MpiCommunicator {
        MpiCommunicator::new(self.comm.duplicate())
    }

    /// A new raw communicator handle over the same group (`MPI_Comm_dup`), owned by the caller,
    /// who must free it (a thread that uses it alone).
    pub(crate) fn duplicate_raw(&self) -> mpi::ffi::MPI_Comm {
        let dup = self.comm.duplicate();
        let raw = dup.as_raw();
        // The handle now belongs to the caller; forgetting the wrapper does not free it.
        std::mem::forget(dup);
        raw
    }

    fn op(op: ReduceOp) -> SystemOperation {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
        }
    }

    fn finish_mean(&self, buf: &mut [f32], op: ReduceOp) {
        if op == ReduceOp::Mean {
            let n = self.size() as f32;
            buf.iter_mut().for_each(|x| *x /= n);
        }
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn split(&self, color: usize, key: usize) -> Result<std::rc::Rc<dyn Communicator>, CommError> {
        let comm = MpiCommunicator::split(self, check_count("split", color)? as u32, key as u32)?;
        Ok(if comm.size() == 1 {
            std::rc::Rc::new(super::LocalCommunicator)
        } else {
            std::rc::Rc::new(comm)
        })
    }
    fn size(&self) -> usize {
        self.comm.size() as usize
    }
    fn kind(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        check_count("all_reduce", buf.len())?;
        if self.size() == 1 {
            return Ok(());
        }
        let mut send = self.scratch.borrow_mut();
        send.clear();
        send.extend_from_slice(buf);
        let _watch = self.watch("all_reduce", buf.len());
        self.comm.all_reduce_into(&send[..], buf, Self::op(op));
        self.finish_mean(buf, op);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        check_len("all_gather", send.len() * self.size(), recv.len())?;
        check_count("all_gather", recv.len())?;
        let _watch = self.watch("all_gather", recv.len());
        self.comm.all_gather_into(send, recv);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        check_len("reduce_scatter", recv.len() * self.size(), send.len())?;
        check_count("reduce_scatter", send.len())?;
        let _watch = self.watch("reduce_scatter", send.len());
        self.comm
            .reduce_scatter_block_into(send, recv, Self::op(op));
        self.finish_mean(recv, op);
        Ok(())
    }

    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        check_len("all_to_all", send.len(), recv.len())?;
        check_len(
            "all_to_all",
            send.len() / self.size() * self.size(),
            send.len(),
        )?;
        check_count("all_to_all", send.len())?;
        if self.size() == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let _watch = self.watch("all_to_all", send.len());
        self.comm.all_to_all_into(send, recv);
        Ok(())
    }

    fn all_to_all_v(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let n = self.size();
        check_counts(n, (send, send_counts), (recv, recv_counts))?;
        check_count("all_to_all_v", send.len().max(recv.len()))?;
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let [sc, sd, rc, rd] = counts_and_displacements(send_counts, recv_counts);
        let _watch = self.watch("all_to_all_v", send.len());
        let sp = mpi::datatype::Partition::new(send, &sc[..], &sd[..]);
        let mut rp = mpi::datatype::PartitionMut::new(recv, &rc[..], &rd[..]);
        self.comm.all_to_all_varcount_into(&sp, &mut rp);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", root, self.size())?;
        check_count("broadcast", buf.len())?;
        let _watch = self.watch("broadcast", buf.len());
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", root, self.size())?;
        check_count("broadcast", buf.len())?;
        let _watch = self.watch("broadcast", buf.len() / 4);
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    fn send(&self, buf: &[f32], dest: usize, tag: u16) -> Result<(), CommError> {
        check_rank("send", dest, self.size())?;
        check_count("send", buf.len())?;
        let _watch = self.watch("send", buf.len());
        self.comm
            .process_at_rank(dest as i32)
            .send_with_tag(buf, i32::from(tag));
        Ok(())
    }

    fn recv(&self, buf: &mut [f32], src: usize, tag: u16) -> Result<(), CommError> {
        check_rank("recv", src, self.size())?;
        check_count("recv", buf.len())?;
        let _watch = self.watch("recv", buf.len());
        let status = self
            .comm
            .process_at_rank(src as i32)
            .receive_into_with_tag(buf, i32::from(tag));
        let got = status.count(f32::equivalent_datatype()) as usize;
        if got != buf.len() {
            return Err(CommError::MessageSize {
                src,
                expected: buf.len(),
                got,
            });
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let _watch = self.watch("barrier", 0);
        self.comm.barrier();
        Ok(())
    }

    fn send_start(
        &self,
        buf: Vec<f32>,
        dest: usize,
        tag: u16,
    ) -> Result<Box<dyn Pending>, CommError> {
        check_rank("send", dest, self.size())?;
        let count = check_count("send", buf.len())?;
        let request = Request::new("send (non-blocking)", buf.len(), self);
        let mut pending = PendingMpiSend { buf, request };
        // SAFETY: the buffer is owned by `pending`, lives on the heap and is not freed before
        // the request completes (`wait` and `Drop` complete it first).
        let code = unsafe {
            mpi::ffi::MPI_Isend(
                pending.buf.as_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                dest as c_int,
                c_int::from(tag),
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        pending.request.started("MPI_Isend", code)?;
        Ok(Box::new(pending))
    }

    fn recv_start(&self, len: usize, src: usize, tag: u16) -> Result<Box<dyn Pending>, CommError> {
        check_rank("recv", src, self.size())?;
        let count = check_count("recv", len)?;
        let request = Request::new("recv (non-blocking)", len, self);
        let mut pending = PendingMpiRecv {
            buf: vec![0.0; len],
            src,
            request,
        };
        // SAFETY: the buffer is owned by `pending`, lives on the heap and is neither read nor
        // freed before the request completes (`wait` and `Drop` complete it first).
        let code = unsafe {
            mpi::ffi::MPI_Irecv(
                pending.buf.as_mut_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                src as c_int,
                c_int::from(tag),
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        pending.request.started("MPI_Irecv", code)?;
        Ok(Box::new(pending))
    }

    fn all_reduce_start(&self, buf: Vec<f32>, op: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        let count = check_count("all_reduce_start", buf.len())?;
        let mut pending = self.pending("all_reduce (non-blocking)", buf, count as usize, op);
        let mpi_op = mpi_op(op);
        // SAFETY: both buffers are owned by `pending`, live on the heap (their addresses do not
        // move when `pending` moves) and are neither read nor freed before the request
        // completes: `wait` and `Drop` complete it first.
        let code = unsafe {
            mpi::ffi::MPI_Iallreduce(
                pending.send.as_ptr().cast(),
                pending.recv.as_mut_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                mpi_op,
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        self.started(pending, "MPI_Iallreduce", code)
    }

    fn reduce_scatter_start(
        &self,
        send: Vec<f32>,
        op: ReduceOp,
    ) -> Result<Box<dyn Pending>, CommError> {
        let block = send.len() / self.size().max(1);
        check_len("reduce_scatter_start", block * self.size(), send.len())?;
        let count = check_count("reduce_scatter_start", block)?;
        let mut pending = self.pending("reduce_scatter (non-blocking)", send, block, op);
        // SAFETY: as in `all_reduce_start`: the buffers are owned by `pending`, on the heap,
        // and untouched until the request completes (`wait` and `Drop` complete it first).
        let code = unsafe {
            mpi::ffi::MPI_Ireduce_scatter_block(
                pending.send.as_ptr().cast(),
                pending.recv.as_mut_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                mpi_op(op),
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        self.started(pending, "MPI_Ireduce_scatter_block", code)
    }

    fn all_gather_start(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, CommError> {
        let count = check_count("all_gather_start", send.len())?;
        let total = send.len() * self.size();
        check_count("all_gather_start", total)?;
        let mut pending = self.pending("all_gather (non-blocking)", send, total, ReduceOp::Sum);
        // SAFETY: as in `all_reduce_start`.
        let code = unsafe {
            mpi::ffi::MPI_Iallgather(
                pending.send.as_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                pending.recv.as_mut_ptr().cast(),
                count,
                mpi::ffi::RSMPI_FLOAT,
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        self.started(pending, "MPI_Iallgather", code)
    }

    fn all_to_all_v_start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn Pending>, CommError> {
        let n = self.size();
        let total = recv_counts.iter().sum();
        let mut pending = self.pending("all_to_all_v (non-blocking)", send, total, ReduceOp::Sum);
        let checked = check_counts(
            n,
            (&pending.send, send_counts),
            (&pending.recv, recv_counts),
        )
        .and_then(|_| check_count("all_to_all_v_start", pending.send.len().max(total)));
        if let Err(e) = checked {
            pending.request.complete = true;
            return Err(e);
        }
        pending.counts = counts_and_displacements(send_counts, recv_counts);
        let [sc, sd, rc, rd] = &pending.counts;
        // SAFETY: as in `all_reduce_start`; the counts and displacements are owned by
        // `pending` too, on the heap, and unchanged until the request completes.
        let code = unsafe {
            mpi::ffi::MPI_Ialltoallv(
                pending.send.as_ptr().cast(),
                sc.as_ptr(),
                sd.as_ptr(),
                mpi::ffi::RSMPI_FLOAT,
                pending.recv.as_mut_ptr().cast(),
                rc.as_ptr(),
                rd.as_ptr(),
                mpi::ffi::RSMPI_FLOAT,
                self.comm.as_raw(),
                &mut pending.request.raw,
            )
        };
        self.started(pending, "MPI_Ialltoallv", code)
    }
}

/// MPI's counts and displacements of an exchange with counts: those sent, then received.
fn counts_and_displacements(send_counts: &[usize], recv_counts: &[usize]) -> [Vec<c_int>; 4] {
    let counts = |c: &[usize]| c.iter().map(|&x| x as c_int).collect::<Vec<_>>();
    let displs = |c: &[c_int]| {
        c.iter()
            .scan(0, |at, &x| {
                let d = *at;
                *at += x;
                Some(d)
            })
            .collect::<Vec<_>>()
    };
    let (sc, rc) = (counts(send_counts), counts(recv_counts));
    let (sd, rd) = (displs(&sc), displs(&rc));
    [sc, sd, rc, rd]
}

impl MpiCommunicator {
    /// A non-blocking collective's buffers: `send`, and `recv_len` values to receive (from the
    /// pool); a mean divides the result by the group size.
    fn pending(
        &self,
        what: &'static str,
        send: Vec<f32>,
        recv_len: usize,
        op: ReduceOp,
    ) -> PendingMpi {
        PendingMpi {
            recv: self.buffer(recv_len),
            counts: Default::default(),
            request: Request::new(what, send.len(), self),
            send,
            pool: self.pool.clone(),
            divide_by: (op == ReduceOp::Mean).then_some(self.size() as f32),
        }
    }

    /// The started collective, or the MPI error `code` of `op` (the request never started).
    fn started(
        &self,
        mut pending: PendingMpi,
        op: &'static str,
        code: c_int,
    ) -> Result<Box<dyn Pending>, CommError> {
        pending.request.started(op, code)?;
        Ok(Box::new(pending))
    }
}

/// MPI's operation for `op` (a mean is a sum, divided afterwards).
fn mpi_op(op: ReduceOp) -> mpi::ffi::MPI_Op {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => unsafe { mpi::ffi::RSMPI_SUM },
        ReduceOp::Max => unsafe { mpi::ffi::RSMPI_MAX },
    }
}

use mpi::datatype::Equivalence;

/// An MPI request in flight and whether it has completed.
struct Request {
    raw: mpi::ffi::MPI_Request,
    complete: bool,
    /// What the watchdog reports while `wait` blocks: the operation, its values, the group's
    /// name and members.
    watch: (&'static str, usize, Arc<str>, Arc<[usize]>),
}

impl Request {
    /// A request of `op` on `values` floats over `comm`.
    fn new(op: &'static str, values: usize, comm: &MpiCommunicator) -> Self {
        Self {
            // SAFETY: reading an MPI constant.
            raw: unsafe { mpi::ffi::RSMPI_REQUEST_NULL },
            complete: false,
            watch: (op, values, comm.name.clone(), comm.members.clone()),
        }
    }

    /// The request's start by `op` returned `code`: an error (the request marked complete,
    /// as it never started) unless 0.
    fn started(&mut self, op: &'static str, code: c_int) -> Result<(), CommError> {
        if code != 0 {
            self.complete = true;
            return Err(CommError::Mpi { op, code });
        }
        Ok(())
    }

    /// Blocks until the request completes (once).
    fn wait(&mut self) -> Result<(), CommError> {
        self.wait_into(None)
    }

    /// [`Request::wait`], MPI writing the completion's status into `status` when given (left
    /// as it is when the request had completed before).
    fn wait_into(&mut self, status: Option<&mut mpi::ffi::MPI_Status>) -> Result<(), CommError> {
        if self.complete {
            return Ok(());
        }
        let (op, values, name, members) = &self.watch;
        let _watch = watchdog::watch(op, *values, name, members);
        let status = status.map_or(unsafe { mpi::ffi::RSMPI_STATUS_IGNORE }, |s| s as *mut _);
        // SAFETY: `raw` came from a non-blocking MPI call and has not completed yet; `status`
        // is MPI's "ignore" or a status to write into.
        let code = unsafe { mpi::ffi::MPI_Wait(&mut self.raw, status) };
        self.complete = true;
        if code != 0 {
            return Err(CommError::Mpi {
                op: "MPI_Wait",
                code,
            });
        }
        Ok(())
    }

    /// Lets MPI progress the request; `true` once it is complete.
    fn test(&mut self) -> Result<bool, CommError> {
        self.test_into(None)
    }

    /// [`Request::test`], MPI writing the completion's status into `status` when this call
    /// completes the request.
    fn test_into(&mut self, status: Option<&mut mpi::ffi::MPI_Status>) -> Result<bool, CommError> {
        if self.complete {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        let status = status.map_or(unsafe { mpi::ffi::RSMPI_STATUS_IGNORE }, |s| s as *mut _);
        // SAFETY: `raw` came from a non-blocking MPI call and has not completed yet; `status`
        // is MPI's "ignore" or a status to write into.
        let code = unsafe { mpi::ffi::MPI_Test(&mut self.raw, &mut flag, status) };
        if code != 0 {
            return Err(CommError::Mpi {
                op: "MPI_Test",
                code,
            });
        }
        self.complete = flag != 0;
        Ok(self.complete)
    }
}

/// A non-blocking MPI send (`MPI_Isend`) that owns its buffer.
pub struct PendingMpiSend {
    buf: Vec<f32>,
    request: Request,
}

impl Pending for PendingMpiSend {
    fn test(&mut self) -> Result<bool, CommError> {
        self.request.test()
    }

    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, CommError> {
        self.request.wait()?;
        Ok(std::mem::take(&mut self.buf))
    }
}

impl Drop for PendingMpiSend {
    fn drop(&mut self) {
        // The buffer must outlive the request: complete it before it is freed.
        let _ = self.request.wait();
    }
}

/// A non-blocking MPI receive (`MPI_Irecv`) that owns its buffer.
pub struct PendingMpiRecv {
    buf: Vec<f32>,
    src: usize,
    request: Request,
}

impl Pending for PendingMpiRecv {
    fn test(&mut self) -> Result<bool, CommError> {
        if self.request.complete {
            return Ok(true);
        }
        // SAFETY: a zeroed status is a valid value for MPI to write into.
        let mut status: mpi::ffi::MPI_Status = unsafe { std::mem::zeroed() };
        let done = self.request.test_into(Some(&mut status))?;
        if done {
            self.check_size(&status)?;
        }
        Ok(done)
    }

    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, CommError> {
        if !self.request.complete {
            // SAFETY: a zeroed status is a valid value for MPI to write into.
            let mut status: mpi::ffi::MPI_Status = unsafe { std::mem::zeroed() };
            self.request.wait_into(Some(&mut status))?;
            self.check_size(&status)?;
        }
        Ok(std::mem::take(&mut self.buf))
    }
}

impl PendingMpiRecv {
    /// Fails when the message that arrived is shorter than the buffer (a longer one is MPI's
    /// truncation error).
    fn check_size(&self, status: &mpi::ffi::MPI_Status) -> Result<(), CommError> {
        let mut got: c_int = 0;
        // SAFETY: `status` was filled by the completed receive.
        unsafe { mpi::ffi::MPI_Get_count(status, mpi::ffi::RSMPI_FLOAT, &mut got) };
        if got as usize != self.buf.len() {
            return Err(CommError::MessageSize {
                src: self.src,
                expected: self.buf.len(),
                got: got as usize,
            });
        }
        Ok(())
    }
}

impl Drop for PendingMpiRecv {
    fn drop(&mut self) {
        // A receive nobody waits for (a step that failed) is cancelled, so that dropping it
        // does not wait for a message that may never come; the buffer must outlive the
        // request, so the cancelled request is completed before it is freed.
        if !self.request.complete {
            // SAFETY: `raw` came from `MPI_Irecv` and has not completed yet.
            unsafe { mpi::ffi::MPI_Cancel(&mut self.request.raw) };
        }
        let _ = self.request.wait();
    }
}

/// A non-blocking MPI collective (`MPI_Iallreduce`, `MPI_Ireduce_scatter_block`,
/// `MPI_Iallgather`, `MPI_Ialltoallv`) that owns its buffers.
pub struct PendingMpi {
    send: Vec<f32>,
    recv: Vec<f32>,
    /// An exchange's counts and displacements (sent, then received), kept until it completes.
    counts: [Vec<c_int>; 4],
    request: Request,
    divide_by: Option<f32>,
    pool: BufferPool,
}

impl PendingMpi {
    fn finish(&mut self) -> Vec<f32> {
        let mut pool = self.pool.borrow_mut();
        if pool.len() < POOL_SIZE {
            pool.push(std::mem::take(&mut self.send));
        }
        let mut out = std::mem::take(&mut self.recv);
        if let Some(n) = self.divide_by {
            out.iter_mut().for_each(|x| *x /= n);
        }
        out
    }
}

impl Pending for PendingMpi {
    fn test(&mut self) -> Result<bool, CommError> {
        self.request.test()
    }

    fn wait(mut self: Box<Self>) -> Result<Vec<f32>, CommError> {
        self.request.wait()?;
        Ok(self.finish())
    }
}

impl Drop for PendingMpi {
    fn drop(&mut self) {
        // The buffers must outlive the request: complete it before they are freed.
        let _ = self.request.wait();
    }
}
