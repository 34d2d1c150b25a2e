//! Probing the machine a run trains on (`merak probe`): the backend's matrix-product rate with
//! every rank multiplying at once, memory bandwidth, the MPI latency and bandwidth between two
//! ranks, and how much of a tensor-parallel all-reduce the chunked products hide. What it
//! measures is a [`HardwareSpec`](crate::planner::HardwareSpec) for the planner, which itself
//! stays free of MPI and tensors.

use crate::comm::CommError;
use crate::planner::HardwareError;

mod agree;
mod hardware;
mod overlap;

pub use agree::{barrier, fastest, from_rank0, mean_over_ranks, median, total_memory_bytes};
pub use hardware::{measure, measure_with_overlap};
pub use overlap::{DEGREES, OverlapSample, slowdown};

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A message between the ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The measured hardware spec is not usable (a rate of zero, say).
    #[error("the measured hardware spec: {0}")]
    Spec(#[from] HardwareError),
}
