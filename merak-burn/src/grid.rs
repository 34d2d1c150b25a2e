//! The process grid: `world = dp * cp * tp * pp`, TP innermost, then CP, then DP, then PP.
//!
//! Rank `r` has coordinates `tp = r % tp`, `cp = (r / tp) % cp`, `dp = (r / (tp cp)) % dp`,
//! `pp = r / (tp cp dp)`, so the ranks of one TP group are neighbours (on a real cluster they
//! share a node).
//!
//! **Context parallelism is folded into data parallelism** for everything that concerns the
//! parameters: the `dp × cp` ranks of a stage hold the same parameters, so their gradients are
//! summed, their optimizer state sharded (ZeRO) and their checkpoints written over one group,
//! [`ProcessGrid::dp`], in which a rank's index is [`Coords::dp`] `= data index × cp + cp
//! index`. Only the data differs: the `cp` ranks of one data-parallel replica read the same
//! samples ([`ProcessGrid::data_rank`]) and each keeps its share of every sequence.

use std::rc::Rc;

use thiserror::Error;

use crate::comm::{CommError, Communicator, Group, LocalCommunicator, MpiCommunicator, Transport};
pub use merak_plan::grid::{Coords, Layout, LayoutError};

/// The grid as seen from one rank: its coordinates and one communicator per axis.
#[derive(Debug)]
pub struct ProcessGrid {
    /// The layout.
    pub layout: Layout,
    /// This process's world rank.
    pub rank: usize,
    /// This process's coordinates.
    pub coords: Coords,
    /// All ranks.
    pub world: Group,
    /// The ranks that differ from this one only in their TP index.
    pub tp: Group,
    /// The ranks that hold the same parameters: those that differ only in their data- or
    /// context-parallel index (`dp × cp` ranks).
    pub dp: Group,
    /// The ranks that differ only in their context-parallel index (the parts of the same
    /// sequences).
    pub cp: Group,
    /// The ranks that differ only in their pipeline stage.
    pub pp: Group,
    /// The expert-parallel group: the `ep` consecutive ranks of [`dp`](Self::dp) that split a
    /// mixture of experts' experts and exchange tokens ([`with_expert_parallel`](Self::with_expert_parallel);
    /// one rank until then).
    pub ep: Group,
    /// The ranks that hold the same experts, whose expert gradients are summed: every TP rank
    /// and every expert-parallel group of the stage (`tp × dp × cp / ep` ranks; [`dp`](Self::dp)
    /// until [`with_expert_parallel`](Self::with_expert_parallel)).
    pub experts: Group,
}

/// The grid could not be built.
#[derive(Debug, Error)]
pub enum GridError {
    /// The layout is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Splitting the communicator failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl ProcessGrid {
    /// The grid of a single process (no MPI).
    pub fn single() -> ProcessGrid {
        let g = Group::local();
        ProcessGrid {
            layout: Layout::SINGLE,
            rank: 0,
            coords: Coords {
                dp: 0,
                cp: 0,
                pp: 0,
                tp: 0,
            },
            world: g,
            tp: g,
            dp: g,
            cp: g,
            pp: g,
            ep: g,
            experts: g,
        }
    }

    /// The same grid with the expert groups of a mixture of experts split `ep` ways
    /// ([`ep`](Self::ep), [`experts`](Self::experts); every rank must call it, `ep` dividing
    /// `dp × cp`, which configurations check first). Rank `i` of [`dp`](Self::dp) is rank
    /// `i % ep` of expert-parallel group `i / ep`.
    pub fn with_expert_parallel(mut self, ep: usize) -> Result<Self, GridError> {
        let (l, c) = (self.layout, self.coords);
        let ep = ep.max(1);
        if !l.replicas().is_multiple_of(ep) {
            return Err(GridError::Comm(CommError::BadRank {
                op: "expert-parallel groups (parallel.ep must divide dp x cp)",
                rank: ep,
                size: l.replicas(),
            }));
        }
        if self.world.size() == 1 {
            return Ok(self);
        }
        let world = self.world.comm()?;
        let groups = l.replicas() / ep;
        let color = (c.pp * l.tp + c.tp) * groups + c.dp / ep;
        self.ep = Group::register(world.split(color, c.dp % ep)?);
        let key = (c.dp / ep) * l.tp + c.tp;
        self.experts = Group::register(world.split(c.pp * ep + c.dp % ep, key)?);
        Ok(self)
    }

    /// This rank's data-parallel replica and the number of replicas: which share of each
    /// global batch it reads (the context-parallel ranks of a replica read the same samples).
    pub fn data_rank(&self) -> (usize, usize) {
        (self.coords.dp / self.layout.cp, self.layout.dp)
    }

    /// Splits the MPI world into per-axis groups. Call on every rank, after
    /// [`Layout::validate`]; checks the world size again.
    pub fn from_mpi(world: MpiCommunicator, layout: Layout) -> Result<ProcessGrid, GridError> {
        Self::from_mpi_with(world, layout, Transport::Mpi)
    }

    /// Like [`from_mpi`](Self::from_mpi), with the tensor- and data-parallel groups on
    /// `transport`. Under NCCL, those groups (each rank on its own GPU) get NCCL communicators,
    /// built over their MPI groups, which carry the unique id. The pipeline group and the world
    /// stay on MPI: pipeline messages are matched by tag and sent without waiting for the
    /// receiver, which NCCL's ordered, blocking point-to-point does not give, and the world
    /// carries only small agreements.
    pub fn from_mpi_with(
        world: MpiCommunicator,
        layout: Layout,
        transport: Transport,
    ) -> Result<ProcessGrid, GridError> {
        layout.check_world(world.size())?;
        let rank = world.rank();
        let c = layout.coords(rank);
        let replicas = layout.replicas();
        let tp =
            (world.split((c.pp * replicas + c.dp) as u32, c.tp as u32)?).named("tensor-parallel");
        let dp =
            (world.split((c.pp * layout.tp + c.tp) as u32, c.dp as u32)?).named("data-parallel");
        // The cp ranks of one replica: same stage, TP index and data index.
        let replica = c.dp / layout.cp;
        let cp_color = (c.pp * layout.dp + replica) * layout.tp + c.tp;
        let cp = (world.split(cp_color as u32, c.cp as u32)?).named("context-parallel");
        let pp = (world.split((c.dp * layout.tp + c.tp) as u32, c.pp as u32)?).named("pipeline");
        let wrap = |comm: MpiCommunicator| -> Group {
            if comm.size() == 1 {
                Group::register(Rc::new(LocalCommunicator))
            } else {
                Group::register(Rc::new(comm))
            }
        };
        let dp_group = on_transport(dp, transport, wrap)?;
        Ok(ProcessGrid {
            layout,
            rank,
            coords: c,
            tp: on_transport(tp, transport, wrap)?,
            dp: dp_group,
            cp: wrap(cp),
            ep: Group::local(),
            experts: dp_group,
            world: wrap(world),
            pp: wrap(pp),
        })
    }
}

/// The group of `comm` on `transport`: its MPI communicator wrapped by `wrap`, or an NCCL
/// communicator over it (collective over `comm`'s ranks).
fn on_transport(
    comm: MpiCommunicator,
    transport: Transport,
    wrap: impl Fn(MpiCommunicator) -> Group,
) -> Result<Group, GridError> {
    match transport {
        Transport::Nccl { .. } if comm.size() == 1 => Ok(wrap(comm)),
        Transport::Mpi => Ok(wrap(comm)),
        #[cfg(feature = "cuda")]
        Transport::Nccl { device } => {
            let nccl = crate::comm::nccl::NcclCommunicator::new(&comm, device)?;
            tracing::info!(
                "{} group of {} ranks on NCCL, CUDA device {device}",
                comm.name(),
                comm.size()
            );
            Ok(Group::register(Rc::new(nccl)))
        }
        #[cfg(not(feature = "cuda"))]
        Transport::Nccl { .. } => Err(GridError::Comm(CommError::NcclUnavailable(
            "this build has no CUDA (rebuild with --features cuda)".to_string(),
        ))),
    }
}
