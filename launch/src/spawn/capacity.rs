//! How many ranks `merak train --np N` can start on this machine: checked before mpirun
//! starts, so that an impossible count is refused with the numbers instead of hanging mpirun
//! (`--np 100000` never returned; 40 ranks under a low open-files limit hung it).

use std::fmt;

/// Ranks per core at most: beyond it each rank gets under 1/32 of a core, and ranks that
/// poll for messages (as Open MPI's do) barely progress.
pub const RANKS_PER_CORE: usize = 32;
/// Open files mpirun needs per local rank (its ranks' output pipes and control channels;
/// Open MPI 4.1 measured here held 72 files at 16 ranks and 156 at 40, and hung when its limit
/// was below that).
pub const FILES_PER_RANK: u64 = 4;
/// Open files mpirun needs besides its ranks' (27 measured at one rank, rounded up).
pub const FILES_BASE: u64 = 64;
/// The least memory a rank of the smallest run takes (about 48 MiB resident measured for the
/// built-in tiny GPT, rounded up).
pub const RANK_BYTES: u64 = 64 << 20;

/// What this machine offers for starting ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// Cores available to this process.
    pub cores: usize,
    /// The open-files limit mpirun gets (the soft limit, raised to the hard one).
    pub open_files: u64,
    /// The hard open-files limit.
    pub open_files_hard: u64,
    /// Available memory (`MemAvailable`), when known.
    pub available_bytes: Option<u64>,
}

/// A `--np` this machine cannot start, with the numbers.
#[derive(Debug, PartialEq)]
pub enum TooMany {
    /// More ranks than the cores allow.
    Cores {
        /// The ranks asked for.
        np: usize,
        /// The cores.
        cores: usize,
    },
    /// More ranks than mpirun can open files for.
    OpenFiles {
        /// The ranks asked for.
        np: usize,
        /// The files they need.
        need: u64,
        /// The limit.
        limit: u64,
    },
    /// More ranks than the available memory holds.
    Memory {
        /// The ranks asked for.
        np: usize,
        /// The available memory.
        available: u64,
    },
}

impl fmt::Display for TooMany {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        match *self {
            TooMany::Cores { np, cores } => write!(
                f,
                "--np {np}: this machine has {cores} core(s), and merak starts at most \
                 {RANKS_PER_CORE} ranks per core ({} here): more ranks would each get under \
                 1/{RANKS_PER_CORE} of a core. Use fewer ranks, or start them on several \
                 machines (mpirun with a host file, or Slurm)",
                cores * RANKS_PER_CORE
            ),
            TooMany::OpenFiles { np, need, limit } => write!(
                f,
                "--np {np}: mpirun needs about {need} open files for {np} ranks \
                 ({FILES_PER_RANK} per rank + {FILES_BASE}), but this process may open \
                 {limit} (`ulimit -n`, raised to its hard limit). Raise the hard limit \
                 (`ulimit -Hn`, /etc/security/limits.conf) or use at most {} ranks",
                limit.saturating_sub(FILES_BASE) / FILES_PER_RANK
            ),
            TooMany::Memory { np, available } => write!(
                f,
                "--np {np}: {np} ranks need at least {:.1} GiB ({} MiB each, the smallest \
                 run's), but {:.1} GiB is available (MemAvailable). Use at most {} ranks",
                gib(RANK_BYTES.saturating_mul(np as u64)),
                RANK_BYTES >> 20,
                gib(available),
                available / RANK_BYTES
            ),
        }
    }
}

impl Machine {
    /// This machine, with the open-files soft limit raised to the hard limit first (mpirun
    /// inherits it).
    pub fn here() -> Self {
        let (open_files, open_files_hard) = raise_open_files();
        Self {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            open_files,
            open_files_hard,
            available_bytes: merak_burn::admission::meminfo_bytes("MemAvailable"),
        }
    }

    /// Whether `np` ranks can start here.
    pub fn check(&self, np: usize) -> Result<(), TooMany> {
        if np > self.cores.saturating_mul(RANKS_PER_CORE) {
            return Err(TooMany::Cores {
                np,
                cores: self.cores,
            });
        }
        let need = FILES_BASE.saturating_add(FILES_PER_RANK.saturating_mul(np as u64));
        if need > self.open_files {
            return Err(TooMany::OpenFiles {
                np,
                need,
                limit: self.open_files,
            });
        }
        if let Some(available) = self.available_bytes
            && RANK_BYTES.saturating_mul(np as u64) > available
        {
            return Err(TooMany::Memory { np, available });
        }
        Ok(())
    }
}

/// Raises this process's open-files soft limit to its hard limit; returns (soft, hard)
/// afterwards (`u64::MAX` for unlimited).
fn raise_open_files() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return (u64::MAX, u64::MAX);
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    let value = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            v
        }
    };
    (value(lim.rlim_cur), value(lim.rlim_max))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn laptop() -> Machine {
        Machine {
            cores: 2,
            open_files: 1024,
            open_files_hard: 1024,
            available_bytes: Some(16 << 30),
        }
    }

    #[test]
    fn counts_the_machine_can_start_pass_and_others_name_the_numbers() {
        let m = laptop();
        for np in [1, 8, 64] {
            assert_eq!(m.check(np), Ok(()), "{np}");
        }
        let e = m.check(100_000).expect_err("too many for the cores");
        assert!(e.to_string().contains("2 core(s)") && e.to_string().contains("64 here"));
        let low = Machine {
            open_files: 128,
            ..m
        };
        let e = low.check(40).expect_err("too many for the open files");
        let msg = e.to_string();
        assert!(
            msg.contains("224 open files") && msg.contains("128"),
            "{msg}"
        );
        assert!(msg.contains("at most 16 ranks"), "{msg}");
        assert_eq!(low.check(16), Ok(()));
        let small = Machine {
            cores: 64,
            available_bytes: Some(1 << 30),
            ..m
        };
        let msg = small
            .check(20)
            .expect_err("too many for the memory")
            .to_string();
        assert!(
            msg.contains("MemAvailable") && msg.contains("at most 16 ranks"),
            "{msg}"
        );
    }

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        let m = Machine::here();
        assert_eq!(m.open_files, m.open_files_hard);
        assert!(m.cores >= 1);
    }
}
