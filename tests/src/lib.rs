//! Helpers for tests that run several MPI ranks: spawning `mpirun` with a deadline, and
//! comparing numbers with a relative tolerance; and a capped global allocator for the tests of
//! parsers of untrusted input ([`CappedAlloc`]).

mod capped_alloc;

pub use capped_alloc::{CappedAlloc, MAX_LIVE, MAX_ONE, assert_capped};

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a finished (or killed) `mpirun` left behind.
#[derive(Debug)]
pub struct Run {
    /// Exit code; `None` if it was killed by a signal or by the deadline.
    pub code: Option<i32>,
    /// Standard output of all ranks.
    pub stdout: String,
    /// Standard error of all ranks.
    pub stderr: String,
    /// Wall time.
    pub elapsed: Duration,
    /// Whether the deadline killed it.
    pub timed_out: bool,
}

impl Run {
    /// Panics with both streams unless the run exited with status 0.
    pub fn assert_success(&self) {
        assert!(
            self.code == Some(0),
            "exit {:?} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.elapsed,
            self.stdout,
            self.stderr
        );
    }
}

/// The `mpirun` command for `np` ranks: oversubscription allowed (tests run more ranks than
/// cores), no core binding, and running as root allowed (CI containers run as root).
pub fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &np.to_string(),
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
    .env("RAYON_NUM_THREADS", "1");
    c
}

/// Runs `cmd`, killing it after `deadline`.
pub fn run_with_deadline(mut cmd: Command, deadline: Duration) -> Run {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e} (is Open MPI installed?)"));
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break Some(status);
        }
        if start.elapsed() > deadline {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Run {
        code: status.and_then(|s| s.code()),
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
        elapsed: start.elapsed(),
        timed_out,
    }
}

/// `||a - b|| / max(||b||, tiny)`, the relative error of `a` against the reference `b`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
    diff / norm.max(1e-30)
}
