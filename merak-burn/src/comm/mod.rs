//! Communication between ranks.
//!
//! [`Communicator`] is the one interface every parallel feature talks to. It works on plain
//! `f32` slices; [`TensorComm`] adds the same operations on Burn tensors of any backend (the
//! tensor is read to host memory, communicated, and written back to its device).
//!
//! Implementations:
//! - [`LocalCommunicator`]: a world of one process, no MPI needed.
//! - [`MpiCommunicator`]: MPI through the `mpi` crate, host buffers, any backend.
//! - `NcclCommunicator` (feature `cuda`): NCCL through `cudarc`, unique id broadcast over MPI.

mod abort;
mod error;
mod group;
pub(crate) mod host;
mod local;
mod mpi_comm;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nccl_device;
mod progress_thread;
pub(crate) mod tensor;
pub mod transport;
pub mod watchdog;

pub use abort::{RankFailure, catch_failure, fail, failure_of, report_line};
pub use error::CommError;
pub use group::Group;
pub use local::LocalCommunicator;
pub use mpi_comm::{MpiCommunicator, MpiWorld, PendingMpi, launched_by_mpirun};
pub use progress_thread::ProgressThreadComm;
pub use tensor::{RowsInFlight, TensorComm};
pub use transport::{Transport, TransportRequest};

/// The reduction applied by all-reduce and reduce-scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise mean over ranks (sum divided by the group size).
    Mean,
    /// Element-wise maximum over ranks.
    Max,
}

/// A non-blocking operation in flight. The caller drives it with [`Pending::test`] between
/// compute chunks (MPI only moves a non-blocking collective while the process calls into MPI)
/// and collects the result with [`Pending::wait`].
pub trait Pending {
    /// Gives the library a chance to progress the operation; returns `true` once it is complete.
    fn test(&mut self) -> Result<bool, CommError>;
    /// Blocks until the operation completes and returns the reduced buffer.
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CommError>;
}

/// Collective and point-to-point communication within a group of ranks.
///
/// All buffers are host `f32` slices. Collectives must be called by every rank of the group in
/// the same order with buffers of the same length, as in MPI.
pub trait Communicator {
    /// This process's rank within the group, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn size(&self) -> usize;
    /// A short name of the implementation, for logs ("local", "mpi", "nccl").
    fn kind(&self) -> &'static str;

    /// The ranks of this group that give the same `color`, ordered by `key`, as a group of
    /// their own (`MPI_Comm_split`; every rank must call it). Refused by an implementation that
    /// cannot split (NCCL).
    fn split(&self, color: usize, key: usize) -> Result<std::rc::Rc<dyn Communicator>, CommError> {
        let _ = (color, key);
        Err(CommError::CannotSplit(self.kind()))
    }

    /// The NCCL communicator behind this one, whose tensor operations stay in device memory.
    #[cfg(feature = "cuda")]
    fn as_nccl(&self) -> Option<&nccl::NcclCommunicator> {
        None
    }

    /// Reduces `buf` element-wise over all ranks; every rank receives the result in `buf`.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;

    /// Gathers `send` from every rank into `recv`, ordered by rank:
    /// `recv.len() == send.len() * size()`.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Reduces `send` element-wise over all ranks and scatters the result: rank `r` receives
    /// elements `r*n..(r+1)*n` where `n = recv.len()` and `send.len() == n * size()`.
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp)
    -> Result<(), CommError>;

    /// Exchanges equal blocks between all ranks (`MPI_Alltoall`): `send` and `recv` hold
    /// `size()` blocks of equal length, rank-major; block `j` of `send` goes to rank `j`, and
    /// block `i` of `recv` is what rank `i` sent to this one. The default all-gathers every
    /// rank's whole `send` (`size()` times the traffic, but no point-to-point ordering to get
    /// wrong) and keeps this rank's blocks.
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let n = self.size().max(1);
        check_len("all_to_all", send.len(), recv.len())?;
        check_len("all_to_all", send.len() / n * n, send.len())?;
        let block = send.len() / n;
        let mut all = vec![0.0; send.len() * n];
        self.all_gather(send, &mut all)?;
        let rank = self.rank();
        for (src, out) in recv.chunks_exact_mut(block.max(1)).enumerate() {
            let from = src * send.len() + rank * block;
            out.copy_from_slice(&all[from..from + block]);
        }
        Ok(())
    }

    /// Exchanges blocks of any length between all ranks (`MPI_Alltoallv`): `send` holds
    /// `send_counts[j]` values for rank `j`, rank after rank, and `recv` receives
    /// `recv_counts[i]` values from rank `i`, rank after rank (what rank `i` sends this one, so
    /// both sides must agree on the counts, exchanged beforehand). The default pads every block
    /// to the largest count of the group (an all-reduce of the maximum first) and runs
    /// [`all_to_all`](Self::all_to_all).
    fn all_to_all_v(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let n = self.size().max(1);
        check_counts(n, (send, send_counts), (recv, recv_counts))?;
        let local = send_counts.iter().chain(recv_counts).copied().max();
        let mut block = [local.unwrap_or(0) as f32];
        self.all_reduce(&mut block, ReduceOp::Max)?;
        let block = block[0] as usize;
        let mut padded = vec![0.0; block * n];
        let mut at = 0;
        for (j, &c) in send_counts.iter().enumerate() {
            padded[j * block..j * block + c].copy_from_slice(&send[at..at + c]);
            at += c;
        }
        let mut got = vec![0.0; block * n];
        self.all_to_all(&padded, &mut got)?;
        let mut at = 0;
        for (i, &c) in recv_counts.iter().enumerate() {
            recv[at..at + c].copy_from_slice(&got[i * block..i * block + c]);
            at += c;
        }
        Ok(())
    }

    /// Copies `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;

    /// Copies the bytes `buf` of rank `root` into `buf` of every rank.
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError>;

    /// Rank `root`'s `text` (its first `max_bytes` bytes) on every rank; the other ranks'
    /// `text` is not read. Every rank passes the same `max_bytes`.
    fn broadcast_text(
        &self,
        text: &str,
        max_bytes: usize,
        root: usize,
    ) -> Result<String, CommError> {
        let mut buf = vec![0u8; 8 + max_bytes];
        if self.rank() == root {
            let n = text.len().min(max_bytes);
            buf[..8].copy_from_slice(&(n as u64).to_le_bytes());
            buf[8..8 + n].copy_from_slice(&text.as_bytes()[..n]);
        }
        self.broadcast_bytes(&mut buf, root)?;
        let mut len = [0u8; 8];
        len.copy_from_slice(&buf[..8]);
        let n = usize::try_from(u64::from_le_bytes(len)).map_or(max_bytes, |n| n.min(max_bytes));
        Ok(String::from_utf8_lossy(&buf[8..8 + n]).into_owned())
    }

    /// Sends `buf` to rank `dest` with a message `tag`.
    fn send(&self, buf: &[f32], dest: usize, tag: u16) -> Result<(), CommError>;

    /// Starts sending `buf` to rank `dest` with a message `tag` without waiting for the
    /// receiver; [`Pending::wait`] completes it and hands the buffer back. The default sends
    /// synchronously.
    fn send_start(
        &self,
        buf: Vec<f32>,
        dest: usize,
        tag: u16,
    ) -> Result<Box<dyn Pending>, CommError> {
        self.send(&buf, dest, tag)?;
        Ok(Box::new(Done(buf)))
    }

    /// Receives exactly `buf.len()` values from rank `src` with a message `tag`.
    fn recv(&self, buf: &mut [f32], src: usize, tag: u16) -> Result<(), CommError>;

    /// Posts the receive of exactly `len` values from rank `src` with a message `tag` without
    /// waiting for them; [`Pending::wait`] returns them. The default receives synchronously.
    fn recv_start(&self, len: usize, src: usize, tag: u16) -> Result<Box<dyn Pending>, CommError> {
        let mut buf = vec![0.0; len];
        self.recv(&mut buf, src, tag)?;
        Ok(Box::new(Done(buf)))
    }

    /// Waits until every rank of the group has called `barrier`.
    fn barrier(&self) -> Result<(), CommError>;

    /// Starts a non-blocking all-reduce of `buf`; progress it with [`Pending::test`].
    fn all_reduce_start(&self, buf: Vec<f32>, op: ReduceOp) -> Result<Box<dyn Pending>, CommError>;

    /// Starts a non-blocking reduce-scatter of `send` (`size()` equal blocks, rank-major):
    /// [`Pending::wait`] returns this rank's block, reduced over the ranks. The default runs
    /// [`reduce_scatter`](Self::reduce_scatter) at once.
    fn reduce_scatter_start(
        &self,
        send: Vec<f32>,
        op: ReduceOp,
    ) -> Result<Box<dyn Pending>, CommError> {
        let block = send.len() / self.size().max(1);
        check_len("reduce_scatter_start", block * self.size(), send.len())?;
        let mut recv = vec![0.0; block];
        self.reduce_scatter(&send, &mut recv, op)?;
        Ok(Box::new(Done(recv)))
    }

    /// Starts a non-blocking all-gather of `send`: [`Pending::wait`] returns every rank's
    /// `send`, ordered by rank. The default runs [`all_gather`](Self::all_gather) at once.
    fn all_gather_start(&self, send: Vec<f32>) -> Result<Box<dyn Pending>, CommError> {
        let mut recv = vec![0.0; send.len() * self.size()];
        self.all_gather(&send, &mut recv)?;
        Ok(Box::new(Done(recv)))
    }

    /// Starts a non-blocking exchange of blocks of any length
    /// ([`all_to_all_v`](Self::all_to_all_v)): [`Pending::wait`] returns the `recv_counts`
    /// values received from each rank, rank after rank. The default runs
    /// [`all_to_all_v`](Self::all_to_all_v) at once.
    fn all_to_all_v_start(
        &self,
        send: Vec<f32>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Box<dyn Pending>, CommError> {
        let mut recv = vec![0.0; recv_counts.iter().sum()];
        self.all_to_all_v(&send, send_counts, &mut recv, recv_counts)?;
        Ok(Box::new(Done(recv)))
    }
}

/// An operation that completed when it started.
struct Done(Vec<f32>);

impl Pending for Done {
    fn test(&mut self) -> Result<bool, CommError> {
        Ok(true)
    }
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CommError> {
        Ok(self.0)
    }
}

/// Checks that a collective's buffers agree with the group size; shared by the implementations.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), CommError> {
    if expected == got {
        Ok(())
    } else {
        Err(CommError::BufferSize {
            op: what,
            expected,
            got,
        })
    }
}

/// Checks an all-to-all with counts (`all_to_all_v`) over `size` ranks: one count per rank on
/// each side, adding up to its buffer's length; shared by the implementations.
pub(crate) fn check_counts(
    size: usize,
    (send, send_counts): (&[f32], &[usize]),
    (recv, recv_counts): (&[f32], &[usize]),
) -> Result<(), CommError> {
    check_len("all_to_all_v (send counts)", size, send_counts.len())?;
    check_len("all_to_all_v (receive counts)", size, recv_counts.len())?;
    check_len("all_to_all_v", send_counts.iter().sum(), send.len())?;
    check_len("all_to_all_v", recv_counts.iter().sum(), recv.len())
}

/// Validates a peer rank number.
pub(crate) fn check_rank(what: &'static str, rank: usize, size: usize) -> Result<(), CommError> {
    if rank < size {
        Ok(())
    } else {
        Err(CommError::BadRank {
            op: what,
            rank,
            size,
        })
    }
}
