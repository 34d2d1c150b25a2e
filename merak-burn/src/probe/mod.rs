//! Probing the machine a run trains on (`merak probe`): the backend's matrix-product rate with
//! every rank multiplying at once, memory bandwidth, the MPI latency and bandwidth between two
//! ranks, and how much of a tensor-parallel all-reduce the chunked products hide. What it
//! measures is a [`HardwareSpec`](crate::planner::HardwareSpec) for the planner, which itself
//! stays free of MPI and tensors. Profiling a model (`merak profile`): its units' passes, the
//! time a rank needs when its peers wait and the optimizer step ([`time_units`] and the rest).

use crate::comm::CommError;
use crate::planner::HardwareError;

mod agree;
mod hardware;
mod overlap;
mod units;

pub use agree::{barrier, fastest, from_rank0, mean_over_ranks, median, total_memory_bytes};
pub use hardware::{measure, measure_with_overlap};
pub use overlap::{DEGREES, OverlapSample, slowdown};
pub use units::{PassTimes, UnitPasses, alone_fraction, time_optimizer, time_units, whole_pass};

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A message between the ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The measured hardware spec is not usable (a rate of zero, say).
    #[error("the measured hardware spec: {0}")]
    Spec(#[from] HardwareError),
    /// A profiled unit returned the wrong kind of output.
    #[error("{unit} returned the wrong output: expected {expected}")]
    UnitOutput {
        /// The unit (or "the model").
        unit: &'static str,
        /// What it should have returned.
        expected: &'static str,
    },
}
