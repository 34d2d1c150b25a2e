//! Who started this process, read from the environment the launcher gives every rank: its rank
//! and the job's size, its *local rank* (its place among the ranks of its node, which picks its
//! GPU) and the node's rank count, and the node's name.
//!
//! | launcher | rank, size | local rank, local size | node |
//! |---|---|---|---|
//! | Open MPI's `mpirun` | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | `PMIX_HOSTNAME` |
//! | Slurm's `srun` (a job step) | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (`SLURM_NTASKS`) | `SLURM_LOCALID`, the entry `SLURM_NODEID` of `SLURM_STEP_TASKS_PER_NODE` (`SLURM_TASKS_PER_NODE`) | `SLURMD_NODENAME` |
//! | MPICH/Hydra `mpiexec` | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | — |
//! | another PMIx launcher | `PMIX_RANK` | — | `PMIX_HOSTNAME` |
//!
//! The first row that applies wins: `mpirun` inside a Slurm allocation is Open MPI's (its ranks
//! inherit the allocation's `SLURM_*` variables), and a Slurm batch script itself, which has
//! `SLURM_PROCID` but is no job step (no `SLURM_STEP_ID`), is no launch.
//!
//! MPI itself is initialised through the `mpi` crate whatever the launcher; under `srun` that
//! needs a process-management interface the MPI library speaks (`srun --mpi=pmix` for Open
//! MPI), which [`MpiWorld::init`](crate::comm::MpiWorld::init) checks (see [`Launch::check_world`]).

use thiserror::Error;

/// A launcher environment that does not add up; the message names the variable and its value.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum LauncherError {
    /// A variable that should hold a count or a rank.
    #[error("the launcher's environment variable {name} = {value:?} is not a number")]
    NotANumber {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// A rank outside its range (a rank not below the size it belongs to).
    #[error(
        "the launcher's environment is inconsistent: {rank_name} = {rank} is not below \
         {size_name} = {size}"
    )]
    OutOfRange {
        /// The rank's variable.
        rank_name: &'static str,
        /// The rank.
        rank: usize,
        /// The size's variable.
        size_name: &'static str,
        /// The size.
        size: usize,
    },
    /// More ranks on this node than in the whole job.
    #[error(
        "the launcher's environment is inconsistent: {local_name} = {local} ranks on this node \
         but {size_name} = {size} in the job"
    )]
    MoreLocalThanAll {
        /// The local size's variable.
        local_name: &'static str,
        /// The ranks on this node.
        local: usize,
        /// The size's variable.
        size_name: &'static str,
        /// The ranks in the job.
        size: usize,
    },
    /// A Slurm task count per node (`2(x3),1`) that does not parse.
    #[error(
        "the launcher's environment variable {name} = {value:?} is not a Slurm task count per \
         node (like \"2(x3),1\")"
    )]
    BadTasksPerNode {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// MPI's world disagrees with the launcher: the ranks did not find each other.
    #[error(
        "{launcher} started {size} ranks, but MPI sees a world of {world} on rank {rank}: the MPI \
         library did not join the launcher's ranks{hint}"
    )]
    WorldMismatch {
        /// The launcher.
        launcher: LauncherKind,
        /// The ranks the launcher started.
        size: usize,
        /// The size of MPI's world.
        world: usize,
        /// This process's rank in MPI's world.
        rank: usize,
        /// What to change.
        hint: &'static str,
    },
}

/// The program that started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherKind {
    /// Open MPI's `mpirun`/`mpiexec` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's `srun`, one task of a job step (`SLURM_PROCID` with `SLURM_STEP_ID`).
    Slurm,
    /// MPICH's Hydra `mpiexec` or another PMI-1/PMI-2 launcher (`PMI_RANK`, `PMI_SIZE`,
    /// `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`).
    Hydra,
    /// A PMIx launcher that sets no other variables (`PMIX_RANK`).
    Pmix,
    /// No launcher: a process started by hand, alone.
    None,
}

impl std::fmt::Display for LauncherKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LauncherKind::OpenMpi => "Open MPI's mpirun",
            LauncherKind::Slurm => "srun",
            LauncherKind::Hydra => "mpiexec (PMI)",
            LauncherKind::Pmix => "a PMIx launcher",
            LauncherKind::None => "no launcher",
        })
    }
}

/// This process's place in its job, as its launcher describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Who started the process.
    pub kind: LauncherKind,
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Ranks in the job; `None` where the launcher does not say (a bare PMIx launcher).
    pub size: Option<usize>,
    /// This process's rank among the ranks of its node; `None` where the launcher does not say.
    pub local_rank: Option<usize>,
    /// Ranks of the job on this node; `None` where the launcher does not say.
    pub local_size: Option<usize>,
    /// The node's name, where the launcher gives it.
    pub node: Option<String>,
    /// Whether a process-management interface for MPI is in the environment (PMIx or PMI);
    /// always true under `mpirun`.
    pub pmi: bool,
}

impl Launch {
    /// The launch of this process, from its environment.
    pub fn from_env() -> Result<Self, LauncherError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading each variable through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, LauncherError> {
        let vars = Vars(&get);
        let pmi = ["PMIX_RANK", "PMI_RANK", "PMI_FD", "PMI_SIZE"]
            .iter()
            .any(|v| get(v).is_some());
        let open_mpi = [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ];
        let launch = if open_mpi.iter().any(|v| vars.has(v)) {
            Launch {
                kind: LauncherKind::OpenMpi,
                rank: vars.number("OMPI_COMM_WORLD_RANK")?.unwrap_or(0),
                size: vars.number("OMPI_COMM_WORLD_SIZE")?,
                local_rank: vars.number("OMPI_COMM_WORLD_LOCAL_RANK")?,
                local_size: vars.number("OMPI_COMM_WORLD_LOCAL_SIZE")?,
                node: vars.text("PMIX_HOSTNAME"),
                pmi: true,
            }
        } else if vars.has("SLURM_PROCID")
            && (vars.has("SLURM_STEP_ID") || vars.has("SLURM_STEPID"))
        {
            Launch {
                kind: LauncherKind::Slurm,
                rank: vars.number("SLURM_PROCID")?.unwrap_or(0),
                size: match vars.number("SLURM_STEP_NUM_TASKS")? {
                    Some(n) => Some(n),
                    None => vars.number("SLURM_NTASKS")?,
                },
                local_rank: vars.number("SLURM_LOCALID")?,
                local_size: slurm_local_size(&vars)?,
                node: vars.text("SLURMD_NODENAME"),
                pmi,
            }
        } else if ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"]
            .iter()
            .any(|v| vars.has(v))
        {
            Launch {
                kind: LauncherKind::Hydra,
                rank: vars.number("PMI_RANK")?.unwrap_or(0),
                size: vars.number("PMI_SIZE")?,
                local_rank: vars.number("MPI_LOCALRANKID")?,
                local_size: vars.number("MPI_LOCALNRANKS")?,
                node: None,
                pmi: true,
            }
        } else if vars.has("PMIX_RANK") {
            Launch {
                kind: LauncherKind::Pmix,
                rank: vars.number("PMIX_RANK")?.unwrap_or(0),
                size: None,
                local_rank: None,
                local_size: None,
                node: vars.text("PMIX_HOSTNAME"),
                pmi: true,
            }
        } else {
            Launch::alone()
        };
        launch.check(&vars)?;
        Ok(launch)
    }

    /// A process started by hand: rank 0 of 1, alone on its node.
    pub fn alone() -> Self {
        Launch {
            kind: LauncherKind::None,
            rank: 0,
            size: Some(1),
            local_rank: Some(0),
            local_size: Some(1),
            node: None,
            pmi: false,
        }
    }

    /// Whether this process is one rank of an MPI job, so that MPI should be initialised:
    /// always under `mpirun`/`mpiexec` or a PMIx launcher, and under `srun` where the step has
    /// several tasks or an MPI interface (a one-task step without one, like the shell of
    /// `salloc`'s interactive step, is a process alone).
    pub fn starts_mpi(&self) -> bool {
        match self.kind {
            LauncherKind::None => false,
            LauncherKind::Slurm => self.pmi || self.size.is_some_and(|n| n > 1),
            LauncherKind::OpenMpi | LauncherKind::Hydra | LauncherKind::Pmix => true,
        }
    }

    /// Checks MPI's world (this process's `rank` of `world` ranks, after MPI is initialised)
    /// against the launcher: a launcher that started several ranks whose MPI world is one
    /// process means the ranks did not find each other (`srun` without `--mpi=pmix`) and would
    /// each train alone.
    pub fn check_world(&self, rank: usize, world: usize) -> Result<(), LauncherError> {
        let Some(size) = self.size else {
            return Ok(());
        };
        if size > 1 && world == 1 {
            return Err(LauncherError::WorldMismatch {
                launcher: self.kind,
                size,
                world,
                rank,
                hint: match self.kind {
                    LauncherKind::Slurm if !self.pmi => {
                        " (srun gave it no PMIx/PMI: run `srun --mpi=pmix`, or set \
                         MpiDefault=pmix in slurm.conf)"
                    }
                    LauncherKind::Slurm => {
                        " (is this program's MPI library the one srun's --mpi plugin serves?)"
                    }
                    _ => "",
                },
            });
        }
        Ok(())
    }

    /// The rank's place on its node for device placement: its local rank and the node's rank
    /// count. A launcher that does not say makes the process the only rank of its node; a local
    /// size it does not give is taken as just enough for the local rank.
    pub fn local(&self) -> (usize, usize) {
        let rank = self.local_rank.unwrap_or(0);
        let size = self.local_size.unwrap_or(rank + 1).max(rank + 1);
        (rank, size)
    }

    /// Rank and local rank against their sizes.
    fn check(&self, vars: &Vars<'_>) -> Result<(), LauncherError> {
        let names = match self.kind {
            LauncherKind::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            LauncherKind::Slurm => [
                "SLURM_PROCID",
                if vars.has("SLURM_STEP_NUM_TASKS") {
                    "SLURM_STEP_NUM_TASKS"
                } else {
                    "SLURM_NTASKS"
                },
                "SLURM_LOCALID",
                if vars.has("SLURM_STEP_TASKS_PER_NODE") {
                    "SLURM_STEP_TASKS_PER_NODE"
                } else if vars.has("SLURM_TASKS_PER_NODE") {
                    "SLURM_TASKS_PER_NODE"
                } else {
                    "SLURM_NTASKS_PER_NODE"
                },
            ],
            LauncherKind::Hydra => ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            LauncherKind::Pmix | LauncherKind::None => return Ok(()),
        };
        let pairs = [
            (Some(self.rank), self.size, names[0], names[1]),
            (self.local_rank, self.local_size, names[2], names[3]),
        ];
        for (rank, size, rank_name, size_name) in pairs {
            if let (Some(rank), Some(size)) = (rank, size)
                && rank >= size
            {
                return Err(LauncherError::OutOfRange {
                    rank_name,
                    rank,
                    size_name,
                    size,
                });
            }
        }
        if let (Some(local), Some(size)) = (self.local_size, self.size)
            && local > size
        {
            return Err(LauncherError::MoreLocalThanAll {
                local_name: names[3],
                local,
                size_name: names[1],
                size,
            });
        }
        Ok(())
    }
}

/// The environment, read through a lookup.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn has(&self, name: &str) -> bool {
        (self.0)(name).is_some()
    }

    fn text(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.is_empty())
    }

    fn number(&self, name: &'static str) -> Result<Option<usize>, LauncherError> {
        (self.0)(name)
            .map(|value| {
                value
                    .trim()
                    .parse()
                    .map_err(|_| LauncherError::NotANumber { name, value })
            })
            .transpose()
    }
}

/// The tasks of a Slurm step on this node: entry `SLURM_NODEID` of the step's task counts per
/// node, or of the job's, or `SLURM_NTASKS_PER_NODE` (set only with `--ntasks-per-node`).
fn slurm_local_size(vars: &Vars<'_>) -> Result<Option<usize>, LauncherError> {
    for name in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"] {
        let Some(value) = vars.text(name) else {
            continue;
        };
        let counts =
            parse_tasks_per_node(&value).ok_or_else(|| LauncherError::BadTasksPerNode {
                name,
                value: value.clone(),
            })?;
        let node = vars.number("SLURM_NODEID")?.unwrap_or(0);
        return match counts.get(node) {
            Some(&n) => Ok(Some(n)),
            None => Err(LauncherError::OutOfRange {
                rank_name: "SLURM_NODEID",
                rank: node,
                size_name: name,
                size: counts.len(),
            }),
        };
    }
    vars.number("SLURM_NTASKS_PER_NODE")
}

/// Slurm's compressed task counts per node, `2(x3),1` = `[2, 2, 2, 1]`; `None` if malformed
/// (or absurdly long).
pub fn parse_tasks_per_node(value: &str) -> Option<Vec<usize>> {
    const MAX_NODES: usize = 1 << 20;
    let mut counts = Vec::new();
    for part in value.trim().split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count: usize = count.parse().ok()?;
        if repeat == 0 || counts.len() + repeat > MAX_NODES {
            return None;
        }
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn read(pairs: &[(&str, &str)]) -> Result<Launch, LauncherError> {
        let map = env(pairs);
        Launch::from_vars(|name| map.get(name).cloned())
    }

    /// What `mpirun -np 4` over two nodes gives rank 2 (Open MPI 4.1 also sets PMIX_RANK).
    const OMPI: [(&str, &str); 6] = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_RANK", "2"),
        ("PMIX_HOSTNAME", "node1"),
    ];

    /// What `srun --mpi=pmix -N 2 -n 5` gives task 4 (a batch script's variables included).
    const SRUN: [(&str, &str); 12] = [
        ("SLURM_JOB_ID", "77"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NTASKS", "5"),
        ("SLURM_STEP_NUM_TASKS", "5"),
        ("SLURM_STEP_TASKS_PER_NODE", "3,2"),
        ("SLURM_TASKS_PER_NODE", "3,2"),
        ("SLURM_JOB_NODELIST", "gpu[01-02]"),
        ("SLURMD_NODENAME", "gpu02"),
        ("PMIX_RANK", "4"),
    ];

    #[test]
    fn open_mpi_mpirun() {
        let l = read(&OMPI).unwrap();
        assert_eq!(
            l,
            Launch {
                kind: LauncherKind::OpenMpi,
                rank: 2,
                size: Some(4),
                local_rank: Some(0),
                local_size: Some(2),
                node: Some("node1".into()),
                pmi: true,
            }
        );
        assert!(l.starts_mpi());
        assert_eq!(l.local(), (0, 2));
    }

    #[test]
    fn srun_with_pmix() {
        let l = read(&SRUN).unwrap();
        assert_eq!(
            l,
            Launch {
                kind: LauncherKind::Slurm,
                rank: 4,
                size: Some(5),
                local_rank: Some(1),
                local_size: Some(2),
                node: Some("gpu02".into()),
                pmi: true,
            }
        );
        assert!(l.starts_mpi());
        assert_eq!(l.local(), (1, 2));
    }

    #[test]
    fn srun_reads_compressed_task_counts_and_falls_back_to_the_job() {
        let mut vars = env(&SRUN);
        vars.remove("SLURM_STEP_TASKS_PER_NODE");
        vars.remove("SLURM_STEP_NUM_TASKS");
        vars.insert("SLURM_TASKS_PER_NODE".into(), "2(x2),1".into());
        vars.insert("SLURM_NODEID".into(), "2".into());
        vars.insert("SLURM_LOCALID".into(), "0".into());
        let l = Launch::from_vars(|n| vars.get(n).cloned()).unwrap();
        assert_eq!((l.size, l.local_size), (Some(5), Some(1)));
        // Only --ntasks-per-node's variable.
        let only = read(&[
            ("SLURM_STEP_ID", "3"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ])
        .unwrap();
        assert_eq!(only.local(), (1, 2));
        assert!(only.starts_mpi(), "two tasks are an MPI job");
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(parse_tasks_per_node("4"), Some(vec![4]));
        assert_eq!(parse_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(parse_tasks_per_node("1,2(x2)"), Some(vec![1, 2, 2]));
        for bad in [
            "",
            "x",
            "2(x",
            "2(x0)",
            "2(3)",
            "2(x3",
            "-1",
            "2(x99999999999)",
        ] {
            assert_eq!(parse_tasks_per_node(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_batch_script_or_a_lone_step_is_no_mpi_job() {
        // sbatch's script: SLURM_PROCID but no step.
        let batch = read(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ])
        .unwrap();
        assert_eq!(batch.kind, LauncherKind::None);
        assert!(!batch.starts_mpi());
        // salloc's interactive step: one task, no PMI.
        let shell = read(&[
            ("SLURM_STEP_ID", "interactive"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NUM_TASKS", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "1"),
        ])
        .unwrap();
        assert_eq!(shell.kind, LauncherKind::Slurm);
        assert!(!shell.starts_mpi());
        // The same with PMIx is a one-rank MPI job.
        let one = read(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "1"),
            ("PMIX_RANK", "0"),
        ])
        .unwrap();
        assert!(one.starts_mpi());
    }

    #[test]
    fn mpirun_inside_an_allocation_is_open_mpi() {
        let mut pairs = SRUN.to_vec();
        pairs.extend_from_slice(&OMPI);
        let l = read(&pairs).unwrap();
        assert_eq!(l.kind, LauncherKind::OpenMpi);
        assert_eq!((l.rank, l.local()), (2, (0, 2)));
    }

    #[test]
    fn hydra_and_bare_pmix_and_nothing() {
        let h = read(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap();
        assert_eq!(
            (h.kind, h.rank, h.size, h.local()),
            (LauncherKind::Hydra, 3, Some(4), (1, 2))
        );
        let p = read(&[("PMIX_RANK", "5"), ("PMIX_NAMESPACE", "x")]).unwrap();
        assert_eq!((p.kind, p.rank, p.size), (LauncherKind::Pmix, 5, None));
        assert!(p.starts_mpi());
        assert_eq!(p.local(), (0, 1));
        let none = read(&[]).unwrap();
        assert_eq!(none, Launch::alone());
        assert!(!none.starts_mpi());
    }

    #[test]
    fn bad_values_name_the_variable() {
        let mut pairs = OMPI.to_vec();
        pairs[2] = ("OMPI_COMM_WORLD_LOCAL_RANK", "zero");
        let err = read(&pairs).unwrap_err();
        assert_eq!(
            err,
            LauncherError::NotANumber {
                name: "OMPI_COMM_WORLD_LOCAL_RANK",
                value: "zero".into()
            }
        );
        assert!(
            err.to_string()
                .contains("OMPI_COMM_WORLD_LOCAL_RANK = \"zero\"")
        );

        pairs[2] = ("OMPI_COMM_WORLD_LOCAL_RANK", "2");
        let err = read(&pairs).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the launcher's environment is inconsistent: OMPI_COMM_WORLD_LOCAL_RANK = 2 is not \
             below OMPI_COMM_WORLD_LOCAL_SIZE = 2"
        );

        let mut pairs = SRUN.to_vec();
        pairs[2] = ("SLURM_PROCID", "5");
        let err = read(&pairs).unwrap_err();
        assert!(
            matches!(
                err,
                LauncherError::OutOfRange {
                    rank_name: "SLURM_PROCID",
                    rank: 5,
                    size_name: "SLURM_STEP_NUM_TASKS",
                    size: 5
                }
            ),
            "{err}"
        );

        let mut pairs = SRUN.to_vec();
        pairs[7] = ("SLURM_STEP_TASKS_PER_NODE", "3,two");
        let err = read(&pairs).unwrap_err();
        assert!(
            err.to_string()
                .contains("SLURM_STEP_TASKS_PER_NODE = \"3,two\"")
        );

        let mut pairs = SRUN.to_vec();
        pairs[4] = ("SLURM_NODEID", "2");
        let err = read(&pairs).unwrap_err();
        assert!(err.to_string().contains("SLURM_NODEID = 2"), "{err}");

        let mut pairs = SRUN.to_vec();
        pairs[3] = ("SLURM_LOCALID", "2");
        let err = read(&pairs).unwrap_err();
        assert!(
            err.to_string()
                .contains("SLURM_LOCALID = 2 is not below SLURM_STEP_TASKS_PER_NODE = 2"),
            "{err}"
        );

        let err = read(&[("PMI_RANK", "-1"), ("PMI_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("PMI_RANK"), "{err}");

        let err = read(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_LOCAL_SIZE = 3"),
            "{err}"
        );
    }

    #[test]
    fn a_world_of_one_under_a_launcher_of_several_is_refused() {
        let mut pairs = SRUN.to_vec();
        pairs.retain(|(k, _)| *k != "PMIX_RANK");
        let l = read(&pairs).unwrap();
        assert!(
            l.starts_mpi(),
            "five tasks without PMI are still an MPI job"
        );
        let err = l.check_world(0, 1).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("srun started 5 ranks"), "{text}");
        assert!(text.contains("--mpi=pmix"), "{text}");
        assert_eq!(l.check_world(4, 5), Ok(()));
        assert_eq!(read(&OMPI).unwrap().check_world(2, 4), Ok(()));
        assert_eq!(Launch::alone().check_world(0, 1), Ok(()));
    }
}
