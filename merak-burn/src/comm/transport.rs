//! Which library carries the messages between ranks (`train.comm`).
//!
//! MPI works for every backend and lets ranks share a GPU; NCCL needs CUDA and one GPU per
//! rank (it refuses two ranks on one device), and keeps CUDA tensors in device memory.
//! [`resolve`] turns a request and this rank's situation into the transport, or an error that
//! names the key and the numbers; the ranks must then agree ([`agree`]), since a
//! communicator is built collectively.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{CommError, Communicator, ReduceOp};

/// The transport a configuration asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportRequest {
    /// NCCL where every rank trains on a GPU of its own, MPI otherwise.
    #[default]
    Auto,
    /// NCCL, or an error where it cannot run.
    Nccl,
    /// MPI on host buffers.
    Mpi,
}

impl TransportRequest {
    /// The name as written in a configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportRequest::Auto => "auto",
            TransportRequest::Nccl => "nccl",
            TransportRequest::Mpi => "mpi",
        }
    }
}

/// The transport the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// MPI for every axis.
    Mpi,
    /// NCCL on CUDA device `device` for the tensor- and data-parallel axes (see
    /// [`ProcessGrid::from_mpi_with`](crate::grid::ProcessGrid::from_mpi_with)).
    Nccl {
        /// This rank's CUDA device.
        device: usize,
    },
}

/// What a rank knows when choosing its transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSituation {
    /// Whether this build has the CUDA backend and NCCL (`--features cuda`).
    pub cuda_build: bool,
    /// This rank's CUDA device and how many ranks of its node use it; `None` when the rank
    /// trains on the CPU.
    pub device: Option<crate::device::DeviceChoice>,
    /// Ranks in the job.
    pub world_size: usize,
}

/// NCCL was asked for where it cannot run.
#[derive(Debug, Error)]
pub enum TransportError {
    /// NCCL needs the CUDA backend.
    #[error(
        "train.comm = \"nccl\" needs train.device = \"cuda\" (NCCL moves GPU memory); use \
         train.comm = \"mpi\" or \"auto\" on the CPU"
    )]
    NotOnCuda,
    /// The build has no CUDA.
    #[error(
        "train.comm = \"nccl\" needs a build with CUDA (cargo build --release --features cuda)"
    )]
    NotBuilt,
    /// Ranks share a GPU, which NCCL refuses.
    #[error(
        "train.comm = \"nccl\" needs one GPU per rank, but {ranks} ranks of this node use CUDA \
         device {device}: start at most one rank per GPU, or set train.comm = \"mpi\" (MPI lets \
         ranks share a GPU)"
    )]
    SharedDevice {
        /// The shared device.
        device: usize,
        /// Ranks on it.
        ranks: usize,
    },
    /// Another rank cannot use NCCL.
    #[error(
        "train.comm = \"nccl\": another rank cannot use NCCL (its error says why); set \
         train.comm = \"mpi\" or fix that rank's devices"
    )]
    OtherRank,
    /// The ranks could not agree.
    #[error("agreeing on the transport: {0}")]
    Comm(#[from] CommError),
}

/// This rank's transport, before the ranks agree. One process needs no transport: it gets MPI
/// (which it never uses) unless NCCL was asked for, so that a request that could not work
/// with more ranks fails with one too.
pub fn resolve(
    request: TransportRequest,
    rank: RankSituation,
) -> Result<Transport, TransportError> {
    let own_gpu = match rank.device {
        Some(choice) if choice.ranks_on_device == 1 => Ok(choice.ordinal),
        Some(choice) => Err(TransportError::SharedDevice {
            device: choice.ordinal,
            ranks: choice.ranks_on_device,
        }),
        None if rank.cuda_build => Err(TransportError::NotOnCuda),
        None => Err(TransportError::NotBuilt),
    };
    match request {
        TransportRequest::Mpi => Ok(Transport::Mpi),
        TransportRequest::Auto if rank.world_size == 1 => Ok(Transport::Mpi),
        TransportRequest::Auto => {
            Ok(own_gpu.map_or(Transport::Mpi, |device| Transport::Nccl { device }))
        }
        TransportRequest::Nccl => own_gpu.map(|device| Transport::Nccl { device }),
    }
}

/// The transport every rank uses: NCCL only where every rank resolved to it. Collective over
/// `world`. A rank whose own resolution failed returns its error after the others have been
/// told, so no rank waits for it; under `"nccl"` the others fail with
/// [`TransportError::OtherRank`], under `"auto"` every rank falls back to MPI.
pub fn agree(
    world: &dyn Communicator,
    request: TransportRequest,
    mine: Result<Transport, TransportError>,
) -> Result<Transport, TransportError> {
    let mut not_nccl = [match mine {
        Ok(Transport::Nccl { .. }) => 0.0f32,
        _ => 1.0,
    }];
    world.all_reduce(&mut not_nccl, ReduceOp::Max)?;
    match (mine?, not_nccl[0] > 0.0) {
        (Transport::Nccl { .. }, true) if request == TransportRequest::Nccl => {
            Err(TransportError::OtherRank)
        }
        (Transport::Nccl { .. }, true) => Ok(Transport::Mpi),
        (t, _) => Ok(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalCommunicator;
    use crate::device::DeviceChoice;

    fn gpu(ordinal: usize, ranks_on_device: usize) -> RankSituation {
        RankSituation {
            cuda_build: true,
            device: Some(DeviceChoice {
                ordinal,
                ranks_on_device,
            }),
            world_size: 4,
        }
    }

    const CPU: RankSituation = RankSituation {
        cuda_build: true,
        device: None,
        world_size: 4,
    };

    #[test]
    fn auto_is_nccl_only_with_a_gpu_per_rank() {
        use TransportRequest::*;
        assert!(matches!(
            resolve(Auto, gpu(1, 1)),
            Ok(Transport::Nccl { device: 1 })
        ));
        assert!(matches!(resolve(Auto, gpu(0, 2)), Ok(Transport::Mpi)));
        assert!(matches!(resolve(Auto, CPU), Ok(Transport::Mpi)));
        let alone = RankSituation {
            world_size: 1,
            ..gpu(0, 1)
        };
        assert!(matches!(resolve(Auto, alone), Ok(Transport::Mpi)));
        assert!(matches!(resolve(Mpi, gpu(0, 1)), Ok(Transport::Mpi)));
    }

    #[test]
    fn nccl_where_it_cannot_run_names_the_reason() {
        use TransportRequest::Nccl;
        assert!(matches!(
            resolve(Nccl, gpu(3, 1)),
            Ok(Transport::Nccl { device: 3 })
        ));
        let shared = resolve(Nccl, gpu(0, 2)).unwrap_err();
        assert!(matches!(
            shared,
            TransportError::SharedDevice {
                device: 0,
                ranks: 2
            }
        ));
        let text = shared.to_string();
        assert!(
            text.contains("train.comm") && text.contains("2 ranks"),
            "{text}"
        );
        assert!(matches!(resolve(Nccl, CPU), Err(TransportError::NotOnCuda)));
        let no_cuda = RankSituation {
            cuda_build: false,
            ..CPU
        };
        assert!(matches!(
            resolve(Nccl, no_cuda),
            Err(TransportError::NotBuilt)
        ));
    }

    #[test]
    fn one_rank_agrees_with_itself() {
        let world = LocalCommunicator;
        let nccl = Ok(Transport::Nccl { device: 0 });
        assert!(matches!(
            agree(&world, TransportRequest::Nccl, nccl),
            Ok(Transport::Nccl { device: 0 })
        ));
        assert!(matches!(
            agree(&world, TransportRequest::Auto, Ok(Transport::Mpi)),
            Ok(Transport::Mpi)
        ));
        assert!(matches!(
            agree(
                &world,
                TransportRequest::Nccl,
                Err(TransportError::NotOnCuda)
            ),
            Err(TransportError::NotOnCuda)
        ));
    }
}
