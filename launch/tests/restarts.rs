//! Runs that heal (issue 54): a rank killed (`kill -9`, injected with `MERAK_INJECT`) or
//! stalled under `merak train --np 2 --max-restarts K` is restarted from the run's newest
//! checkpoint and the job finishes by itself with the same losses and parameters as an
//! uninterrupted run; what must not be restarted is not; the requeue loop for a bare `mpirun`
//! (`scripts/restart-loop.sh`) does the same; a slow rank is named as a straggler.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use merak_tests::{Run, run_with_deadline};

/// `merak train --np 2 --dp 2` of the tiny GPT for 10 steps, a checkpoint every 3, into
/// `out`, with `extra` and the environment `env`.
fn job(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(MERAK);
    let mut args = vec!["--np", "2", "--dp", "2"];
    args.extend_from_slice(&["--set", "train.steps=10", "--set", "checkpoint.every=3"]);
    args.extend_from_slice(extra);
    train_args(&mut cmd, out, &args);
    cmd.env("RAYON_NUM_THREADS", "1").envs(env.iter().copied());
    run_with_deadline(cmd, Duration::from_secs(300))
}

/// The uninterrupted run the others are compared with (once per test binary).
fn uninterrupted() -> PathBuf {
    static ONCE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let out = out_dir("restart-whole");
        job(&out, &[], &[]).assert_success();
        out
    })
    .clone()
}

/// The losses of every step, bit for bit.
fn losses(out: &Path) -> Vec<f64> {
    (read_metrics(out).iter())
        .map(|m| m["loss"].as_f64().expect("a loss"))
        .collect()
}

/// The run's `attempts.jsonl`, one value per line.
fn attempts(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("attempts.jsonl")).expect("attempts.jsonl");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect()
}

/// Rank 1 killed with SIGKILL when step 8 begins: the launcher names the rank, its host and
/// the signal, restarts from the checkpoint of step 6 (one step lost) and the job ends with
/// exit 0, its losses and parameters those of the uninterrupted run, bit for bit.
#[test]
fn a_killed_rank_is_restarted_and_the_run_equals_an_uninterrupted_one() {
    let out = out_dir("restart-killed");
    let run = job(
        &out,
        &["--max-restarts", "2"],
        &[("MERAK_INJECT", "kill@1:8")],
    );
    run.assert_success();
    let err = &run.stderr;
    assert!(
        err.contains("rank 1 (host ") && err.contains("ended by signal 9 (Killed) in step 8"),
        "{err}"
    );
    assert!(
        err.contains("restarting from the checkpoint of step 6")
            && err.contains("(1 steps lost): restart 1 of 2"),
        "{err}"
    );
    let whole = uninterrupted();
    assert_eq!(losses(&out), losses(&whole), "losses bit for bit");
    assert_same_params("restarted", &out, &whole);
    let events = attempts(&out);
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["started", "failed", "started", "ended"],
        "{events:?}"
    );
    assert_eq!(events[1]["step"], 8);
    assert_eq!(events[1]["lost_steps"], 1);
    assert_eq!(events[2]["from_step"], 6);
    assert!(
        err.contains("goodput ") && err.contains("2 attempts, 1 failure (1 steps lost)"),
        "{err}"
    );
}

/// A stalled rank: the watchdog ends the job (status 124) and the launcher restarts it; the
/// run again equals the uninterrupted one.
#[test]
fn a_stalled_job_is_restarted() {
    let out = out_dir("restart-stalled");
    // The watchdog's limit is short so the test is quick; two restarts allowed, since on a
    // loaded machine a restarted start may also wait that long once.
    let extra = ["--max-restarts", "2", "--set", "train.comm_timeout_s=4"];
    let run = job(&out, &extra, &[("MERAK_INJECT", "stall@1:5")]);
    run.assert_success();
    assert!(
        run.stderr.contains("the watchdog found a stalled rank")
            && run
                .stderr
                .contains("restarting from the checkpoint of step 3"),
        "{}",
        run.stderr
    );
    assert_eq!(losses(&out), losses(&uninterrupted()));
}

/// Not restarted: the same step failing twice in a row (the failure's status is kept), a
/// failure before the first checkpoint, and a refused config (exit 2, started once).
#[test]
fn what_cannot_be_mended_is_not_restarted() {
    let out = out_dir("restart-repeated");
    let run = job(
        &out,
        &["--max-restarts", "3"],
        &[("MERAK_INJECT", "kill@1:5:always")],
    );
    assert_eq!(run.code, Some(137), "{}", run.stderr);
    assert!(
        run.stderr.contains("restart 1 of 3")
            && run.stderr.contains("failed twice in a row in step 5"),
        "{}",
        run.stderr
    );
    let out = out_dir("restart-early");
    let run = job(
        &out,
        &["--max-restarts", "3"],
        &[("MERAK_INJECT", "kill@1:2")],
    );
    assert_eq!(run.code, Some(137), "{}", run.stderr);
    assert!(
        run.stderr.contains("failed before its first checkpoint")
            && !run.stderr.contains("restarting"),
        "{}",
        run.stderr
    );
    let out = out_dir("restart-refused");
    let run = job(&out, &["--max-restarts", "3", "--set", "train.lr=-1"], &[]);
    assert_refused(&run, "train.lr");
    assert!(!run.stderr.contains("restarting"), "{}", run.stderr);
}

/// The requeue loop for a bare mpirun: each start gets `--max-restarts`; a killed rank ends
/// the job (mpirun's status 137), the loop starts it again with `--resume`, and the run ends
/// equal to the uninterrupted one. A second failure in the same step is refused by the ranks
/// (exit 2), which ends the loop.
#[test]
fn the_requeue_loop_continues_a_bare_mpirun_job() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/restart-loop.sh");
    let looped = |name: &str, inject: &str| {
        let out = out_dir(name);
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .args([
                "mpirun",
                "--oversubscribe",
                "--bind-to",
                "none",
                "-np",
                "2",
                MERAK,
            ])
            .args(["train", "--config"])
            .arg(config())
            .args(["--set", "data.kind=synthetic", "--set", "train.steps=10"])
            .args(["--set", "checkpoint.every=3", "--dp", "2"])
            .env("OUT", &out)
            .env("MAX_RESTARTS", "2")
            .env("MERAK_INJECT", inject)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("RAYON_NUM_THREADS", "1");
        (run_with_deadline(cmd, Duration::from_secs(300)), out)
    };
    let (run, out) = looped("requeue-killed", "kill@1:8");
    run.assert_success();
    assert!(run.stderr.contains("status 137"), "{}", run.stderr);
    assert_eq!(losses(&out), losses(&uninterrupted()));
    let (run, _) = looped("requeue-repeated", "kill@1:5:always");
    assert_refused(&run, "failed twice in a row in step 5");
}

/// An injected delay on rank 1 makes it a straggler: named in the log with its host, and
/// every step's record has both ranks' step and communication times (rank 0 waits for rank 1).
#[test]
fn a_slow_rank_is_named() {
    let out = out_dir("straggler");
    let mut cmd = merak(2);
    train_args(
        &mut cmd,
        &out,
        &[
            "--dp",
            "2",
            "--set",
            "train.steps=6",
            "--set",
            "train.straggler_steps=3",
        ],
    );
    cmd.env("MERAK_INJECT", "delay@1:80");
    let run = run_with_deadline(cmd, Duration::from_secs(300));
    run.assert_success();
    assert!(
        run.stderr.contains("straggler: rank 1 (host ")
            && !run.stderr.contains("straggler: rank 0"),
        "{}",
        run.stderr
    );
    for m in read_metrics(&out) {
        let step = m["rank_step_s"].as_array().expect("every rank's step time");
        let wait = m["rank_comm_wait_s"].as_array().expect("every rank's wait");
        assert_eq!((step.len(), wait.len()), (2, 2), "{m}");
        let rank0_wait = wait[0].as_f64().unwrap();
        assert!(rank0_wait >= 0.05, "rank 0 waits for the delayed rank: {m}");
    }
}
