//! A training program run on some ranks and compared with its one-process run: the losses of
//! every step (`metrics.jsonl`) and the final parameters at full size (its checkpoint), what
//! the examples' equivalence tests check for every layout.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::{Checkpoint, FullState};

use crate::{mpirun, rel_err, run_with_deadline};

/// What a finished training run left: its losses, its final parameters and its output.
#[derive(Debug)]
pub struct TrainingRun {
    /// The loss of every step, from `metrics.jsonl`.
    pub losses: Vec<f64>,
    /// The newest checkpoint's tensors at full size.
    pub state: FullState,
    /// Standard output of all ranks.
    pub stdout: String,
}

/// Runs `bin` with `args` and `--out out` alone (`np = 1`) or under `mpirun -np np`, within
/// `deadline`; panics with its output unless it succeeds, and reads what it wrote into `out`.
pub fn run_training(
    bin: &str,
    np: usize,
    out: &Path,
    args: &[&str],
    deadline: Duration,
) -> TrainingRun {
    let mut cmd = if np == 1 {
        Command::new(bin)
    } else {
        let mut c = mpirun(np);
        c.arg(bin);
        c
    };
    cmd.args(args).arg("--out").arg(out);
    let run = run_with_deadline(cmd, deadline);
    run.assert_success();
    let state = Checkpoint::open(&out.join("checkpoints"))
        .and_then(|c| c.read_full())
        .unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    TrainingRun {
        losses: read_losses(&out.join("metrics.jsonl")),
        state,
        stdout: run.stdout,
    }
}

/// The `loss` of every line of a `metrics.jsonl`.
pub fn read_losses(path: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["loss"].as_f64().expect("a loss")
        })
        .collect()
}

/// Asserts that the losses of every step and every final parameter of `got` equal those of
/// `want` within the relative tolerance `tol`, naming the run `name`, the step or parameter.
pub fn assert_same_training(
    name: &str,
    (losses, state): (&[f64], &FullState),
    (want_losses, want_state): (&[f64], &FullState),
    tol: f64,
) {
    assert_eq!(losses.len(), want_losses.len(), "{name}");
    for (step, (a, b)) in losses.iter().zip(want_losses).enumerate() {
        let err = (a - b).abs() / b.abs();
        assert!(
            err <= tol,
            "{name} step {}: {a} vs {b} ({err:.2e})",
            step + 1
        );
    }
    assert_eq!(state.params.len(), want_state.params.len(), "{name}");
    for (pname, want) in &want_state.params {
        let got = (state.params.get(pname)).unwrap_or_else(|| panic!("{name}: no {pname}"));
        let err = rel_err(got, want);
        assert!(err <= tol, "{name}: {pname} differs by {err:.2e}");
    }
}
