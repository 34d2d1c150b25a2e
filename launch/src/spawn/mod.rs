//! `merak train --np N` outside mpirun: starts the N ranks itself, the way torchrun does,
//! after checking that this machine can start them, and holding the run folders' locks for
//! the whole job.

mod capacity;
mod restart;
mod signals;

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use merak_burn::checkpoint::Checkpoint;
use merak_burn::train::run_folder::{missing_folders, output_folder, remove_if_empty};
use merak_burn::train::run_lock::LOCK_TOKEN_ENV;
use merak_burn::train::{RunLocks, not_a_file};

use crate::describe::describe;
use crate::train_args::TrainArgs;
pub use capacity::Machine;
use restart::Ended;

/// `--np np`: refused under mpirun or srun (they set the ranks), for 0 ranks and for more
/// than this machine can start ([`Machine::check`]); otherwise the run's folders are locked
/// (this launcher holds the locks until the job ends, and its ranks join them) and the ranks
/// are started with [`relaunch`].
pub fn launch(np: usize, args: &TrainArgs) -> ExitCode {
    if let Err(e) = check_np(np) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    crate::init_launcher_logging();
    let job = match Job::prepare(args, np) {
        Ok(job) => job,
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            return ExitCode::from(2);
        }
    };
    let made = missing_folders(&[&job.out, &job.root]);
    let locks = match RunLocks::acquire(&[&job.out, &job.root]) {
        Ok(locks) => locks,
        Err(e) => {
            eprintln!("error: {e}");
            remove_if_empty(&made);
            return ExitCode::from(2);
        }
    };
    let token = locks.token().unwrap_or_default().to_string();
    let code = supervise(np, &job, &token, args);
    drop(locks);
    // A job refused by its ranks leaves no folder it made (nor one this launcher made).
    remove_if_empty(&made);
    code
}

/// Starts the ranks ([`relaunch`]) and, under `--max-restarts`, again after each failure that
/// [`restart::next`] restarts; the last start's exit status.
fn supervise(np: usize, job: &Job, token: &str, train: &TrainArgs) -> ExitCode {
    let mut args = without_launcher_flags(std::env::args_os().skip(1));
    if job.chose_out {
        args.extend([OsString::from("--out"), job.out.clone().into_os_string()]);
    }
    let original = args.clone();
    // Registered before mpirun starts, so no signal is missed, and kept across restarts.
    let signals = match signals::Forwarder::register() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --np {np}: installing the signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    loop {
        let ended = match relaunch(np, job, (token, &signals), &args) {
            Ok(ended) => ended,
            Err(code) => return code,
        };
        let Some(max) = train.max_restarts else {
            return ExitCode::from(ended.status);
        };
        let resumed = train.resume.as_deref();
        match restart::next(&ended, &job.out, &job.root, resumed, max) {
            restart::Next::Exit(status) => return ExitCode::from(status),
            restart::Next::Restart(from) => args = restart::restart_args(&original, &from),
        }
    }
}

/// `--np np` outside mpirun and srun, at least one rank, and no more than this machine can
/// start.
fn check_np(np: usize) -> Result<(), String> {
    if merak_burn::comm::launched_by_mpirun() {
        let srun = merak_burn::rank_env::Launch::from_env()
            .is_ok_and(|l| l.kind == merak_burn::rank_env::LauncherKind::Slurm);
        return Err(match srun {
            true => format!(
                "--np {np} starts mpirun itself: drop --np under srun (srun -n sets the ranks)"
            ),
            false => format!(
                "--np {np} starts mpirun itself: drop --np under mpirun (mpirun -np sets the ranks)"
            ),
        });
    }
    if np == 0 {
        return Err("--np 0: at least one rank is needed".into());
    }
    Machine::here().check(np).map_err(|e| e.to_string())
}

/// What the launcher knows of the job before it starts the ranks.
struct Job {
    /// The output folder.
    out: PathBuf,
    /// The checkpoint folder.
    root: PathBuf,
    /// Whether the launcher chose the output folder (no `--out`): the ranks get it as `--out`.
    chose_out: bool,
    /// How long the ranks may take to stop after the first stop signal
    /// (`train.comm_timeout_s`).
    stop_grace: Duration,
}

impl Job {
    /// Reads the config (with the checkpoint's manifest when resuming) far enough to know the
    /// folders the job writes; bad input here is what the ranks would refuse too.
    fn prepare(args: &TrainArgs, np: usize) -> anyhow::Result<Self> {
        let checkpoint = args.resume.as_deref().map(Checkpoint::open).transpose()?;
        let cfg = crate::resolve::load_config(args, np, checkpoint.as_ref())?;
        let out = output_folder(args.out.as_deref(), checkpoint.as_ref(), None)?;
        let root = crate::train::checkpoint_root(&cfg, &out);
        not_a_file(&out, "output folder (--out)")?;
        not_a_file(&root, "checkpoint folder (checkpoint.dir)")?;
        Ok(Self {
            chose_out: args.out.is_none(),
            out,
            root,
            stop_grace: merak_burn::comm::watchdog::saturating_duration(cfg.train.comm_timeout_s),
        })
    }
}

/// Runs this program again as `np` ranks under `mpirun`, with every argument but `--np`
/// passed through (and `--out` when the launcher chose the folder), and exits with mpirun's
/// status. Oversubscription is allowed (a laptop has fewer cores than ranks), cores are not
/// bound (each rank runs one compute thread), and running as root is allowed (containers).
/// The ranks get the lock's `token` ([`LOCK_TOKEN_ENV`]) and join this launcher's locks.
///
/// Preemption works through it: mpirun runs in a process group of its own (a terminal's
/// Ctrl-C reaches only this launcher), and the first SIGTERM, SIGINT or SIGUSR1 this launcher
/// gets is passed to mpirun as SIGUSR1, which Open MPI forwards to every rank: the ranks
/// finish their step, checkpoint and exit 75, and so does this launcher. (Open MPI answers a
/// SIGTERM of its own by killing the ranks a second later, and exits 1.) A second signal, or
/// ranks still running `train.comm_timeout_s` after the first, passes SIGTERM, which ends the
/// ranks at once, and exits 130. When this launcher dies, mpirun gets SIGTERM from the kernel
/// (never left behind).
fn relaunch(
    np: usize,
    job: &Job,
    (token, signals): (&str, &signals::Forwarder),
    args: &[OsString],
) -> Result<Ended, ExitCode> {
    let exe = std::env::current_exe().map_err(|e| {
        eprintln!("error: --np {np}: cannot find this program's path to start the ranks: {e}");
        ExitCode::from(2)
    })?;
    let mut cmd = mpirun_command(np, &exe, args);
    cmd.env(LOCK_TOKEN_ENV, token).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        eprintln!(
            "error: --np {np}: cannot start mpirun ({e}); install Open MPI (`apt-get install openmpi-bin`) or drop --np"
        );
        ExitCode::from(2)
    })?;
    let scan = child.stderr.take().map(pass_on_errors);
    let forwarded = signals.forward(child.id(), job.stop_grace);
    let status = child.wait();
    let cause = scan.and_then(|s| s.join().ok()).flatten();
    match status {
        Ok(_) if forwarded.aborted() => Err(ExitCode::from(130)),
        Ok(status) => Ok(Ended {
            status: status.code().unwrap_or(1).clamp(0, 255) as u8,
            signalled: forwarded.signalled(),
            cause,
        }),
        Err(e) => {
            eprintln!("error: --np {np}: waiting for mpirun: {e}");
            Err(ExitCode::from(1))
        }
    }
}

/// Passes mpirun's error output on to this launcher's, line by line, on a thread of its own;
/// the thread returns what ended the job as mpirun told it ([`restart::FailureScan`]).
fn pass_on_errors(from: std::process::ChildStderr) -> std::thread::JoinHandle<Option<String>> {
    std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let mut scan = restart::FailureScan::default();
        let mut err = std::io::stderr();
        for line in std::io::BufReader::new(from)
            .split(b'\n')
            .map_while(Result::ok)
        {
            let _ = err.write_all(&line).and_then(|()| err.write_all(b"\n"));
            scan.line(&String::from_utf8_lossy(&line));
        }
        scan.cause()
    })
}

/// `mpirun -np np exe args` with the flags a local run needs, in a process group of its own,
/// and ended by the kernel (SIGTERM) when this launcher dies.
fn mpirun_command(np: usize, exe: &Path, args: &[OsString]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &np.to_string(),
    ])
    .arg(exe)
    .args(args)
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
    .process_group(0);
    // SAFETY: prctl and getppid are async-signal-safe, as pre_exec requires; nothing is
    // allocated.
    let parent = std::process::id() as libc::pid_t;
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before the request took effect: end at once.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the launcher has ended"));
            }
            Ok(())
        });
    }
    cmd
}

/// `args` without the launcher's own flags: `--np N` and `--max-restarts K` (either also as
/// `--flag=value`).
fn without_launcher_flags(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    without_flags(args, &["--np", "--max-restarts"], &[])
}

/// `args` without the flags `with_value` (`--flag value` or `--flag=value`) and `bare`.
fn without_flags(
    args: impl Iterator<Item = OsString>,
    with_value: &[&str],
    bare: &[&str],
) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if std::mem::take(&mut skip_next) {
            continue;
        }
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        let joined = |f: &&str| s.strip_prefix(*f).is_some_and(|rest| rest.starts_with('='));
        if with_value.contains(&s) {
            skip_next = true;
        } else if !bare.contains(&s) && !with_value.iter().any(joined) {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(args: &[&str]) -> Vec<String> {
        without_launcher_flags(args.iter().map(OsString::from))
            .into_iter()
            .map(|a| a.into_string().unwrap_or_default())
            .collect()
    }

    #[test]
    fn np_is_taken_out_and_everything_else_passes_through() {
        assert_eq!(
            strip(&["train", "--np", "4", "--dp", "2", "--set", "train.steps=3"]),
            ["train", "--dp", "2", "--set", "train.steps=3"]
        );
        assert_eq!(
            strip(&["train", "--np=2", "--tp", "2", "--max-restarts", "3"]),
            ["train", "--tp", "2"]
        );
        assert_eq!(strip(&["train", "--max-restarts=1"]), ["train"]);
    }
}
