//! Which accelerator each rank trains on: one GPU per rank of a node, found from the rank's
//! place on its node (its *local rank*, which `mpirun` puts in the environment), or the
//! devices a configuration names.
//!
//! More ranks than GPUs on a node share the GPUs round-robin. That works while the messages go
//! through MPI on host buffers; NCCL refuses two ranks on one GPU, so `train.comm`
//! ([`comm::transport`](crate::comm::transport)) uses NCCL only where each rank has its own,
//! and `sharing_allowed = false` refuses sharing outright.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A failure to choose a device; the message names the setting or the variable to change.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DeviceError {
    /// The machine has no device of the kind asked for.
    #[error("no CUDA device is visible to rank {local_rank} on this node (CUDA_VISIBLE_DEVICES?)")]
    NoDevice {
        /// The rank's local rank.
        local_rank: usize,
    },
    /// A device number beyond the node's devices.
    #[error(
        "train.cuda_device asks local rank {local_rank} to use CUDA device {ordinal}, but this \
         node has {devices} (0..{devices})"
    )]
    NoSuchDevice {
        /// The rank's local rank.
        local_rank: usize,
        /// The device asked for.
        ordinal: usize,
        /// Devices on the node.
        devices: usize,
    },
    /// A per-rank list shorter than the ranks of the node.
    #[error(
        "train.cuda_device lists {len} devices, one per local rank, but {local_ranks} ranks run on \
         this node"
    )]
    ListTooShort {
        /// Entries of the list.
        len: usize,
        /// Ranks on the node.
        local_ranks: usize,
    },
    /// More ranks than devices where each rank needs its own.
    #[error(
        "{local_ranks} ranks run on this node but it has {devices} CUDA devices: each rank needs \
         its own (start at most {devices} ranks per node, or use MPI, which lets ranks share)"
    )]
    MoreRanksThanDevices {
        /// Ranks on the node.
        local_ranks: usize,
        /// Devices on the node.
        devices: usize,
    },
    /// The launcher's environment does not add up (see [`crate::rank_env`]).
    #[error(transparent)]
    Launcher(#[from] crate::rank_env::LauncherError),
    /// The CUDA driver could not be asked.
    #[error("counting the CUDA devices: {0}")]
    Driver(String),
}

/// A rank's place among the ranks of its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRank {
    /// `0..size`.
    pub rank: usize,
    /// Ranks on this node.
    pub size: usize,
}

impl LocalRank {
    /// From the environment `mpirun` (Open MPI or MPICH) or `srun` gives each process (see
    /// [`Launch`](crate::rank_env::Launch)); a process started without a launcher is alone on its
    /// node.
    pub fn from_env() -> Result<Self, DeviceError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, DeviceError> {
        let (rank, size) = crate::rank_env::Launch::from_vars(get)?.local();
        Ok(LocalRank { rank, size })
    }
}

/// The devices a configuration asks for (`train.cuda_device`): one device for every rank of a
/// node, or a list indexed by local rank. Without it, local rank `r` uses device `r`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a device number or a list of device numbers"
)]
pub enum DeviceRequest {
    /// Every rank of the node uses this device.
    Same(usize),
    /// Local rank `r` uses entry `r`.
    PerLocalRank(Vec<usize>),
}

/// The device chosen for a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceChoice {
    /// The device number (CUDA ordinal).
    pub ordinal: usize,
    /// How many ranks of the node use this device, this one included.
    pub ranks_on_device: usize,
}

/// Chooses the device of rank `local` on a node with `devices` devices (see the
/// [module docs](self)); `sharing_allowed` says whether several ranks may use one device.
pub fn choose_device(
    local: LocalRank,
    devices: usize,
    request: Option<&DeviceRequest>,
    sharing_allowed: bool,
) -> Result<DeviceChoice, DeviceError> {
    if devices == 0 {
        return Err(DeviceError::NoDevice {
            local_rank: local.rank,
        });
    }
    let ordinals: Vec<usize> = match request {
        None => {
            if local.size > devices && !sharing_allowed {
                return Err(DeviceError::MoreRanksThanDevices {
                    local_ranks: local.size,
                    devices,
                });
            }
            (0..local.size).map(|r| r % devices).collect()
        }
        Some(DeviceRequest::Same(ordinal)) => vec![*ordinal; local.size],
        Some(DeviceRequest::PerLocalRank(list)) => {
            if list.len() < local.size {
                return Err(DeviceError::ListTooShort {
                    len: list.len(),
                    local_ranks: local.size,
                });
            }
            list[..local.size].to_vec()
        }
    };
    let ordinal = ordinals[local.rank.min(ordinals.len() - 1)];
    if ordinal >= devices {
        return Err(DeviceError::NoSuchDevice {
            local_rank: local.rank,
            ordinal,
            devices,
        });
    }
    let ranks_on_device = ordinals.iter().filter(|&&o| o == ordinal).count();
    if ranks_on_device > 1 && !sharing_allowed {
        return Err(DeviceError::MoreRanksThanDevices {
            local_ranks: local.size,
            devices,
        });
    }
    Ok(DeviceChoice {
        ordinal,
        ranks_on_device,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(rank: usize, size: usize) -> LocalRank {
        LocalRank { rank, size }
    }

    #[test]
    fn each_rank_gets_its_own_device_by_default() {
        for r in 0..4 {
            let c = choose_device(local(r, 4), 8, None, false).unwrap();
            assert_eq!(c.ordinal, r);
            assert_eq!(c.ranks_on_device, 1);
        }
    }

    #[test]
    fn more_ranks_than_devices_share_only_where_allowed() {
        let err = choose_device(local(2, 4), 2, None, false).unwrap_err();
        assert_eq!(
            err,
            DeviceError::MoreRanksThanDevices {
                local_ranks: 4,
                devices: 2
            }
        );
        assert!(
            err.to_string()
                .contains("4 ranks run on this node but it has 2")
        );
        let c = choose_device(local(3, 4), 2, None, true).unwrap();
        assert_eq!((c.ordinal, c.ranks_on_device), (1, 2));
        let c = choose_device(local(0, 2), 1, None, true).unwrap();
        assert_eq!((c.ordinal, c.ranks_on_device), (0, 2));
    }

    #[test]
    fn requested_devices_are_checked_against_the_node() {
        let same = DeviceRequest::Same(1);
        let c = choose_device(local(0, 2), 2, Some(&same), true).unwrap();
        assert_eq!((c.ordinal, c.ranks_on_device), (1, 2));
        assert!(matches!(
            choose_device(local(0, 2), 2, Some(&same), false),
            Err(DeviceError::MoreRanksThanDevices { .. })
        ));
        let list = DeviceRequest::PerLocalRank(vec![3, 2]);
        assert_eq!(
            choose_device(local(1, 2), 4, Some(&list), false)
                .unwrap()
                .ordinal,
            2
        );
        let err = choose_device(local(0, 2), 3, Some(&list), false).unwrap_err();
        assert_eq!(
            err,
            DeviceError::NoSuchDevice {
                local_rank: 0,
                ordinal: 3,
                devices: 3
            }
        );
        assert!(err.to_string().contains("train.cuda_device"), "{err}");
        let short = DeviceRequest::PerLocalRank(vec![0]);
        assert!(matches!(
            choose_device(local(0, 2), 2, Some(&short), true),
            Err(DeviceError::ListTooShort {
                len: 1,
                local_ranks: 2
            })
        ));
        assert!(matches!(
            choose_device(local(0, 1), 0, None, true),
            Err(DeviceError::NoDevice { local_rank: 0 })
        ));
    }

    #[test]
    fn the_local_rank_comes_from_the_launcher() {
        fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            }
        }
        let ompi = [
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        assert_eq!(
            LocalRank::from_vars(vars(&ompi)).unwrap(),
            LocalRank { rank: 3, size: 4 }
        );
        let mpich = [("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")];
        assert_eq!(
            LocalRank::from_vars(vars(&mpich)).unwrap(),
            LocalRank { rank: 1, size: 2 }
        );
        assert_eq!(
            LocalRank::from_vars(vars(&[])).unwrap(),
            LocalRank { rank: 0, size: 1 }
        );
        let bad = [("OMPI_COMM_WORLD_LOCAL_RANK", "x")];
        let err = LocalRank::from_vars(vars(&bad)).unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_LOCAL_RANK"),
            "{err}"
        );
    }

    #[test]
    fn a_request_reads_as_a_number_or_a_list() {
        #[derive(Deserialize)]
        struct T {
            cuda_device: DeviceRequest,
        }
        let one: T = toml::from_str("cuda_device = 2").unwrap();
        assert_eq!(one.cuda_device, DeviceRequest::Same(2));
        let list: T = toml::from_str("cuda_device = [1, 0]").unwrap();
        assert_eq!(list.cuda_device, DeviceRequest::PerLocalRank(vec![1, 0]));
    }
}
