//! `merak train --np N --max-restarts K`: when a rank dies or the watchdog ends a stalled job,
//! the launcher starts the ranks again from the newest complete checkpoint of the run, at most
//! K times, logging each failure (rank, host, signal or exit status, step) and the steps lost.
//!
//! What is not restarted, and why:
//! - a job that ended by itself: done (0), refused before training (2: a restart would be
//!   refused the same way), stopped on a signal after its checkpoint (75: someone asked it to
//!   stop), or ended at once by a second signal (130);
//! - a failure before the run's first checkpoint: there is nothing to continue from;
//! - a second failure in a row in the same step, or more than K failures since the run last
//!   ended by itself ([`restart_verdict`]): the run itself most likely fails there (its data,
//!   a non-finite value, memory), and a restart would repeat it.
//!
//! The launcher holds the run folder's locks across the restarts, so no other run can take the
//! folder between them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use merak_burn::checkpoint::root::{list, step_of_name};
use merak_burn::train::attempts::{self, AttemptEvent, Attempts, NotRestarted, restart_verdict};

use crate::train_args::STOPPED;

/// How one start of the ranks ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Ended {
    /// The status the launcher would exit with.
    pub status: u8,
    /// Whether the launcher stopped the job on a signal it was sent.
    pub signalled: bool,
    /// What ended the ranks, as mpirun told it ([`FailureScan`]).
    pub cause: Option<String>,
}

/// What to do after a start of the ranks.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Exit with this status.
    Exit(u8),
    /// Start the ranks again continuing from this checkpoint (a checkpoint root or folder).
    Restart(PathBuf),
}

/// The statuses a restart cannot mend: done, refused, stopped on a signal, ended at once.
const FINAL: [u8; 4] = [0, 2, STOPPED, 130];

/// What follows `ended` for the run writing into `out` and checkpointing into `root`, started
/// with `--resume resumed` (if it was) under `--max-restarts max`. A failure to be restarted is
/// recorded in the run's `attempts.jsonl` with its cause, and logged.
pub fn next(ended: &Ended, out: &Path, root: &Path, resumed: Option<&Path>, max: usize) -> Next {
    if ended.signalled || FINAL.contains(&ended.status) {
        return Next::Exit(ended.status);
    }
    // Open MPI's own account may be missing (its help messages fail under load): the status
    // still says what merak's ranks ended with.
    let cause = (ended.cause.clone()).unwrap_or_else(|| {
        let status = ended.status;
        format!(
            "the job ended with status {status}{}",
            meaning(&status.to_string())
        )
    });
    let (from, step) = match (newest_step(root), resumed) {
        (Some(step), _) => (root.to_path_buf(), step),
        (None, Some(resumed)) => (resumed.to_path_buf(), 0),
        (None, None) => {
            let e = NotRestarted::NoCheckpoint {
                out: out.to_path_buf(),
            };
            eprintln!("merak: {cause}; {e}");
            return Next::Exit(ended.status);
        }
    };
    let recorded = attempts::record_failure(out, step, Some(cause.clone()));
    let (failed_in, lost) = match &recorded {
        Ok(Some(AttemptEvent::Failed {
            step, lost_steps, ..
        })) => (step.to_string(), *lost_steps),
        Ok(_) => ("an unknown step".to_string(), 0),
        Err(e) => {
            eprintln!(
                "merak: {cause}; not restarted: recording the failure in {}: {e}",
                out.display()
            );
            return Next::Exit(ended.status);
        }
    };
    let attempts = Attempts::read(out).unwrap_or_default();
    let failures = attempts.recent_failures();
    if let Err(e) = restart_verdict(&failures, max) {
        eprintln!("merak: {cause} in step {failed_in}; {e}");
        // Out of restarts, but the run can continue from its folder: say so with 75.
        let resumable = matches!(e, NotRestarted::TooMany { .. });
        return Next::Exit(if resumable { STOPPED } else { ended.status });
    }
    let restart = failures.len();
    eprintln!(
        "merak: {cause} in step {failed_in}; restarting from the checkpoint of step {step} in \
         {} ({lost} steps lost): restart {restart} of {max} (--max-restarts)",
        from.display()
    );
    Next::Restart(from)
}

/// The step of the newest complete checkpoint in `root`, the one `--resume root` continues
/// from ([`RootListing::newest`](merak_burn::checkpoint::root::RootListing::newest)).
fn newest_step(root: &Path) -> Option<usize> {
    let dir = list(root).ok()?.newest(root)?;
    step_of_name(dir.file_name()?.to_str()?)
}

/// `args` for a restart: without the flags that choose what the run starts from (`--resume`,
/// `--init-from`, `--replace`, `--branch`), with `--resume from`.
pub fn restart_args(args: &[OsString], from: &Path) -> Vec<OsString> {
    let with_value = ["--resume", "--init-from"];
    let mut out = super::without_flags(
        args.iter().cloned(),
        &with_value,
        &["--replace", "--branch"],
    );
    out.extend([OsString::from("--resume"), from.as_os_str().to_owned()]);
    out
}

/// Reads what mpirun says of a failed job, line by line: the first rank that died (with its
/// host and signal), aborted (with its status), or exited with a failing status.
#[derive(Debug, Default)]
pub struct FailureScan {
    cause: Option<String>,
    /// A rank named by the line before (`MPI_ABORT was invoked on rank R`, `Process name:`).
    pending_rank: Option<String>,
}

impl FailureScan {
    /// Reads one line of mpirun's (or a rank's) error output.
    pub fn line(&mut self, line: &str) {
        if self.cause.is_some() {
            return;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        // "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed)."
        if let Some(i) = words.windows(2).position(|w| w == ["process", "rank"])
            && let (Some(rank), Some(node), Some(signal)) = (
                words.get(i + 2),
                after(&words, "node"),
                after(&words, "signal"),
            )
        {
            let name = line
                .split_once('(')
                .map_or("", |(_, n)| n.trim_end_matches(['.', ')']));
            self.cause = Some(format!(
                "rank {rank} (host {node}) ended by signal {signal} ({name})"
            ));
            return;
        }
        // "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD" / "with errorcode 124."
        if line.contains("MPI_ABORT was invoked on rank") {
            self.pending_rank = after(&words, "rank").map(str::to_string);
            return;
        }
        if let (Some(rank), Some(code)) = (&self.pending_rank, after(&words, "errorcode")) {
            let code = code.trim_end_matches('.');
            let what = meaning(code);
            self.cause = Some(format!(
                "rank {rank} aborted the job with status {code}{what}"
            ));
            return;
        }
        // "Process name: [[31224,1],1]" / "Exit code: 2"
        if let Some(name) = line.trim().strip_prefix("Process name:") {
            let rank = name.trim().trim_end_matches(']').rsplit(',').next();
            self.pending_rank = rank.map(str::to_string);
            return;
        }
        if let (Some(rank), Some(code)) =
            (&self.pending_rank, line.trim().strip_prefix("Exit code:"))
        {
            self.cause = Some(format!("rank {rank} exited with status {}", code.trim()));
        }
    }

    /// The cause found, if any.
    pub fn cause(self) -> Option<String> {
        self.cause
    }
}

/// What an abort status of merak's ranks means, as words to add after it (124: the watchdog).
fn meaning(status: &str) -> &'static str {
    match status {
        "124" => " (the watchdog found a stalled rank)",
        _ => "",
    }
}

/// The word after `key` in `words`.
fn after<'a>(words: &[&'a str], key: &str) -> Option<&'a str> {
    let i = words.iter().position(|w| *w == key)?;
    words.get(i + 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(text: &str) -> Option<String> {
        let mut s = FailureScan::default();
        text.lines().for_each(|l| s.line(l));
        s.cause()
    }

    /// Open MPI 4's words for a killed rank, an aborted job and a failing exit status.
    #[test]
    fn mpiruns_messages_name_the_rank_and_the_cause() {
        let killed = "-----\nmpirun noticed that process rank 1 with PID 0 on node vm exited on \
                      signal 9 (Killed).\n-----";
        assert_eq!(
            scan(killed).as_deref(),
            Some("rank 1 (host vm) ended by signal 9 (Killed)")
        );
        let aborted = "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\nwith \
                       errorcode 124.\n\nNOTE: invoking MPI_ABORT causes Open MPI to kill all";
        assert_eq!(
            scan(aborted).as_deref(),
            Some("rank 0 aborted the job with status 124 (the watchdog found a stalled rank)")
        );
        let exited = "The first process to do so was:\n\n  Process name: [[31224,1],1]\n  \
                      Exit code:    101\n";
        assert_eq!(
            scan(exited).as_deref(),
            Some("rank 1 exited with status 101")
        );
        assert_eq!(scan("INFO rank{r=0}: step 3/10 loss 2.1"), None);
    }

    #[test]
    fn a_restart_resumes_and_drops_what_chose_the_start() {
        let args: Vec<OsString> = [
            "train",
            "--replace",
            "--init-from",
            "w.safetensors",
            "--dp",
            "2",
            "--resume=x",
            "--branch",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let got = restart_args(&args, Path::new("runs/a/checkpoints"));
        assert_eq!(
            got,
            ["train", "--dp", "2", "--resume", "runs/a/checkpoints"]
                .map(OsString::from)
                .to_vec()
        );
    }

    /// A complete checkpoint of one parameter after `step` steps in `root`.
    fn save_checkpoint(root: &Path, step: usize) {
        use merak_burn::checkpoint::{LocalParam, RankState, RunId, save};
        let state = RankState {
            params: vec![LocalParam {
                name: "w".into(),
                id: burn::module::ParamId::new(),
                shape: vec![2],
                split: merak_burn::tensor_parallel::ShardKind::Replicated,
                values: vec![1.0, 2.0],
            }],
            moments: Vec::new(),
            pieces: Vec::new(),
        };
        let grid = merak_burn::grid::ProcessGrid::single();
        let extra = serde_json::Value::Null;
        save(root, &RunId::default(), step, 0, &state, extra, &grid).expect("a checkpoint");
    }

    /// Done, refused, stopped and aborted jobs are not restarted; a failure without a
    /// checkpoint is not either; one with a checkpoint is, until the same step fails twice.
    #[test]
    fn what_is_restarted() {
        let dir = tempfile::tempdir().expect("scratch");
        let (out, root) = (dir.path(), dir.path().join("checkpoints"));
        let ended = |status, cause: Option<&str>| Ended {
            status,
            signalled: false,
            cause: cause.map(str::to_string),
        };
        for status in FINAL {
            assert_eq!(
                next(&ended(status, None), out, &root, None, 3),
                Next::Exit(status)
            );
        }
        let stopped = Ended {
            signalled: true,
            ..ended(1, None)
        };
        assert_eq!(next(&stopped, out, &root, None, 3), Next::Exit(1));
        let started = |n| AttemptEvent::Started {
            attempt: n,
            at_s: 1.0,
            from_step: 0,
            ranks: 2,
        };
        attempts::append(out, &started(1)).expect("record");
        let killed = ended(137, Some("rank 1 (host h) ended by signal 9 (Killed)"));
        assert_eq!(
            next(&killed, out, &root, None, 3),
            Next::Exit(137),
            "no checkpoint"
        );
        save_checkpoint(&root, 4);
        std::fs::write(out.join("metrics.jsonl"), "{\"step\":5}\n").expect("metrics");
        assert_eq!(
            next(&killed, out, &root, None, 3),
            Next::Restart(root.clone())
        );
        attempts::append(out, &started(2)).expect("record");
        // The same step fails again: not restarted.
        assert_eq!(next(&killed, out, &root, None, 3), Next::Exit(137));
    }
}
