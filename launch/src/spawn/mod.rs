//! `merak train --np N` outside mpirun: starts the N ranks itself, the way torchrun does.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

/// `--np np`: refused under mpirun or srun (they set the ranks) and for 0 ranks; otherwise
/// the ranks are started with [`relaunch`].
pub fn launch(np: usize) -> ExitCode {
    if merak_burn::comm::launched_by_mpirun() {
        let srun = merak_burn::launcher::Launch::from_env()
            .is_ok_and(|l| l.kind == merak_burn::launcher::LauncherKind::Slurm);
        if srun {
            eprintln!(
                "error: --np {np} starts mpirun itself: drop --np under srun (srun -n sets the ranks)"
            );
        } else {
            eprintln!(
                "error: --np {np} starts mpirun itself: drop --np under mpirun (mpirun -np sets the ranks)"
            );
        }
        return ExitCode::from(2);
    }
    if np == 0 {
        eprintln!("error: --np 0: at least one rank is needed");
        return ExitCode::from(2);
    }
    relaunch(np)
}

/// Runs this program again as `np` ranks under `mpirun`, with every argument but `--np`
/// passed through, and exits with mpirun's status. Oversubscription is allowed (a laptop has
/// fewer cores than ranks), cores are not bound (each rank runs one compute thread), and
/// running as root is allowed (containers).
///
/// Preemption works through it: mpirun runs in a process group of its own (a terminal's
/// Ctrl-C reaches only this launcher), and the first SIGTERM, SIGINT or SIGUSR1 this launcher
/// gets is passed to mpirun as SIGUSR1, which Open MPI forwards to every rank: the ranks
/// finish their step, checkpoint and exit 75, and so does this launcher. (Open MPI answers a
/// SIGTERM of its own by killing the ranks a second later, and exits 1.) A second signal
/// passes SIGTERM, which ends the ranks at once, and exits 130.
pub fn relaunch(np: usize) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: --np {np}: cannot find this program's path to start the ranks: {e}");
            return ExitCode::from(2);
        }
    };
    let args = without_np(std::env::args_os().skip(1));
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
    // Registered before mpirun starts, so no signal is missed.
    let signals = match Signals::new([SIGTERM, SIGINT, SIGUSR1]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --np {np}: installing the signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!(
                "error: --np {np}: cannot start mpirun ({e}); install Open MPI (`apt-get install openmpi-bin`) or drop --np"
            );
            return ExitCode::from(2);
        }
    };
    let forwarded = forward_signals(signals, child.id());
    let status = child.wait();
    let aborted = forwarded.load(Ordering::SeqCst) > 1;
    match status {
        Ok(_) if aborted => ExitCode::from(130),
        Ok(status) => ExitCode::from(status.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("error: --np {np}: waiting for mpirun: {e}");
            ExitCode::from(1)
        }
    }
}

/// Passes the signals this launcher gets to mpirun (process `pid`) on a thread of their own:
/// the first as SIGUSR1 (checkpoint and stop), the next ones as SIGTERM (stop at once).
/// Returns the count of signals passed.
fn forward_signals(mut signals: Signals, pid: u32) -> Arc<AtomicUsize> {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for signal in signals.forever() {
            let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
            let (to, what) = if n == 1 {
                (SIGUSR1, "checkpointing and stopping after the current step")
            } else {
                (SIGTERM, "stopping at once")
            };
            eprintln!("merak: signal {signal}: {what} (signal {to} to mpirun)");
            // SAFETY: kill(2) on the pid of our own child, which we have not waited for yet
            // (the main thread reaps it only after it exits).
            unsafe { libc::kill(pid as libc::pid_t, to) };
        }
    });
    count
}

/// `args` without `--np N` / `--np=N`.
fn without_np(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in args {
        if skip_next {
            skip_next = false;
            continue;
        }
        match a.to_str() {
            Some("--np") => skip_next = true,
            Some(s) if s.starts_with("--np=") => {}
            _ => out.push(a),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(args: &[&str]) -> Vec<String> {
        without_np(args.iter().map(OsString::from))
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
            strip(&["train", "--np=2", "--tp", "2"]),
            ["train", "--tp", "2"]
        );
    }
}
