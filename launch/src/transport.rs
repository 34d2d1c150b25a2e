//! This rank's CUDA device and the transport of the grid's groups (`train.cuda_device`,
//! `train.comm`), chosen before the grid is built and agreed by every rank.

use anyhow::Result;
use merak_burn::comm::transport::{self, RankSituation, TransportError};
use merak_burn::comm::{Communicator, MpiCommunicator, Transport};
use merak_burn::device::DeviceChoice;

use crate::config::Config;

/// Where this rank computes and what carries its messages.
#[derive(Clone, Copy, Debug)]
pub struct Placement {
    /// The CUDA device, with `train.device = "cuda"`.
    pub device: Option<DeviceChoice>,
    /// The tensor- and data-parallel groups' transport.
    pub transport: Transport,
}

/// This rank's CUDA device ([`merak_burn::comm::nccl::cuda_device_for_rank`]), or `None` on the
/// CPU.
fn rank_device(cfg: &Config) -> Result<Option<DeviceChoice>> {
    if cfg.train.device != "cuda" {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(Some(merak_burn::comm::nccl::cuda_device_for_rank(
            cfg.train.cuda_device.as_ref(),
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    anyhow::bail!(
        "train.device = \"cuda\" is not available in this build (rebuild with --features cuda)"
    )
}

/// Chooses this rank's device and, with every rank over `world`, the transport. A rank whose
/// device cannot be chosen still takes part in the agreement (so no rank waits for it), then
/// returns its own error.
pub fn place(cfg: &Config, world: Option<&MpiCommunicator>) -> Result<Placement> {
    let device = rank_device(cfg);
    let request = cfg.train.comm;
    let Some(world) = world else {
        let device = device?;
        let situation = situation(device, 1);
        let transport = transport::resolve(request, situation)?;
        return Ok(Placement { device, transport });
    };
    let mine = match &device {
        Ok(d) => transport::resolve(request, situation(*d, world.size())),
        Err(_) => Ok(Transport::Mpi),
    };
    let agreed = transport::agree(world, request, mine);
    let device = device?;
    let transport = agreed?;
    log_launch(world.rank());
    log(world.rank(), device, transport);
    Ok(Placement { device, transport })
}

fn situation(device: Option<DeviceChoice>, world_size: usize) -> RankSituation {
    RankSituation {
        cuda_build: cfg!(feature = "cuda"),
        device,
        world_size,
    }
}

/// Every rank logs its place as its launcher describes it (`mpirun` or `srun`; see
/// [`merak_burn::rank_env::Launch`]): its local rank, which picks its GPU, and its node.
fn log_launch(rank: usize) {
    // MPI started, so the environment was read once already and adds up.
    let Ok(launch) = merak_burn::rank_env::Launch::from_env() else {
        return;
    };
    let (local_rank, local_size) = launch.local();
    tracing::info!(
        "rank {rank}: local rank {local_rank} of {local_size} on node {} ({})",
        launch.node.as_deref().unwrap_or("?"),
        launch.kind
    );
}

/// Every rank logs its device; rank 0 logs the transport.
fn log(rank: usize, device: Option<DeviceChoice>, transport: Transport) {
    if let Some(choice) = device {
        tracing::info!("rank {rank}: CUDA device {}", choice.ordinal);
        if choice.ranks_on_device > 1 {
            tracing::warn!(
                "rank {rank}: {} ranks of this node share CUDA device {} (messages go through MPI)",
                choice.ranks_on_device,
                choice.ordinal
            );
        }
    }
    if rank == 0 {
        match transport {
            Transport::Mpi => tracing::info!("comm: MPI"),
            Transport::Nccl { .. } => tracing::info!(
                "comm: NCCL for the tensor- and data-parallel groups, MPI for the pipeline"
            ),
        }
    }
}

/// Whether `e` is this rank's own (its device, or why it cannot use NCCL), which only this
/// rank can report, rather than one every rank finds alike.
pub fn is_rank_specific(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<TransportError>(),
        Some(TransportError::SharedDevice { .. })
    ) || e
        .downcast_ref::<merak_burn::device::DeviceError>()
        .is_some()
}
