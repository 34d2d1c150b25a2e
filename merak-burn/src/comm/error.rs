//! Errors of the communication layer.

use thiserror::Error;

/// An error raised by a [`Communicator`](super::Communicator) operation.
#[derive(Debug, Error)]
pub enum CommError {
    /// A buffer's length does not match what the collective needs.
    #[error("{op}: buffer holds {got} elements, expected {expected}")]
    BufferSize {
        /// The operation.
        op: &'static str,
        /// The length the operation needs.
        expected: usize,
        /// The length it was given.
        got: usize,
    },
    /// A peer or root rank outside the group.
    #[error("{op}: rank {rank} is outside the group of {size} ranks")]
    BadRank {
        /// The operation.
        op: &'static str,
        /// The rank asked for.
        rank: usize,
        /// The group size.
        size: usize,
    },
    /// A message larger than the communication library can describe.
    #[error("{op}: {len} elements exceed the library's limit of {max} per message")]
    TooLarge {
        /// The operation.
        op: &'static str,
        /// The message length.
        len: usize,
        /// The largest allowed.
        max: usize,
    },
    /// The MPI library could not be initialised.
    #[error("MPI could not be initialised (was it already initialised in this process?)")]
    MpiInit,
    /// The launcher's environment does not add up, or MPI's world disagrees with it.
    #[error(transparent)]
    Launcher(#[from] crate::rank_env::LauncherError),
    /// The MPI library returned an error code.
    #[error("{op}: MPI error code {code}")]
    Mpi {
        /// The operation.
        op: &'static str,
        /// The MPI return code.
        code: i32,
    },
    /// A receive got a message of the wrong size.
    #[error("recv from rank {src}: expected {expected} values, got {got}")]
    MessageSize {
        /// The sending rank.
        src: usize,
        /// The expected count.
        expected: usize,
        /// The received count.
        got: usize,
    },
    /// A [`Group`](super::Group) handle that names no communicator on this thread.
    #[error("communication group {0} is not registered on this thread")]
    UnknownGroup(u64),
    /// NCCL is not usable on this machine.
    #[error("NCCL unavailable: {0}")]
    NcclUnavailable(String),
    /// NCCL returned an error.
    #[error("NCCL {op} failed: {msg}")]
    Nccl {
        /// The operation.
        op: &'static str,
        /// The library's message.
        msg: String,
    },
    /// The communicator cannot be split into smaller groups.
    #[error(
        "a {0} communicator cannot be split into smaller groups (hybrid sharding needs MPI data-parallel groups)"
    )]
    CannotSplit(&'static str),
    /// A tensor could not be read back from its device.
    #[error("reading a tensor from its device failed: {0}")]
    TensorRead(String),
}
