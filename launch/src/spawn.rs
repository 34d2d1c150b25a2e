//! `merak train --np N` outside mpirun: starts the N ranks itself, the way torchrun does.

use std::ffi::OsString;
use std::process::{Command, ExitCode};

/// `--np np`: refused under mpirun (mpirun sets the ranks) and for 0 ranks; otherwise the
/// ranks are started with [`relaunch`].
pub fn launch(np: usize) -> ExitCode {
    if merak_burn::comm::launched_by_mpirun() {
        eprintln!(
            "error: --np {np} starts mpirun itself: drop --np under mpirun (mpirun -np sets the ranks)"
        );
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
    .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    match cmd.status() {
        Ok(status) => ExitCode::from(status.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            eprintln!(
                "error: --np {np}: cannot start mpirun ({e}); install Open MPI (`apt-get install openmpi-bin`) or drop --np"
            );
            ExitCode::from(2)
        }
    }
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
