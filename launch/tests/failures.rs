//! Faults under real `mpirun`: a rank that stalls (SIGSTOP, alive but silent) is named by the
//! others' watchdog, which ends the job instead of letting it hang; a preemption signal stops
//! every rank after the same step with a checkpoint that resumes exactly.

use merak_tests::mpirun;

mod common;
use common::*;

#[test]
fn a_stalled_rank_is_named_by_the_watchdog_and_the_job_ends() {
    let out = out_dir("stalled-rank");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(
        &mut cmd,
        &out,
        &[
            "--dp",
            "2",
            "--set",
            "train.steps=100000",
            "--set",
            "train.comm_timeout_s=2",
            "--set",
            "checkpoint.at_end=false",
        ],
    );
    let metrics = out.join("metrics.jsonl");
    let run = signal_last_rank_when(cmd, &out, "-STOP", || {
        std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 3)
    });
    // Rank 0 waits for rank 1 in a data-parallel or world collective and says so, once.
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains("stuck for"))
        .unwrap_or_else(|| panic!("no watchdog report in {}", run.stderr));
    assert!(line.starts_with("merak: rank 0 stuck for"), "{line}");
    assert!(line.contains("world ranks [0, 1]"), "{line}");
    assert!(line.contains("train.comm_timeout_s"), "{line}");
}

/// A constant learning rate, so that a run can be continued with fewer total steps.
const CONSTANT_LR: [&str; 6] = [
    "--set",
    "train.min_lr=3e-3",
    "--set",
    "train.warmup_steps=0",
    "--set",
    "data.kind=synthetic",
];

#[test]
fn a_preemption_signal_stops_every_rank_after_one_step_with_a_checkpoint_that_resumes_exactly() {
    let out = out_dir("preempted");
    let k = preempt(&out, &["--dp", "2"]);
    assert_resumes_exactly(&out, k, "preempted-reference");
}

/// Resumed for two more steps, the run stopped after step `k` in `out` equals a run that was
/// never stopped (trained into the folder `reference`).
fn assert_resumes_exactly(out: &std::path::Path, k: usize, reference: &str) {
    let steps = format!("train.steps={}", k + 2);
    let mut cmd = resume_cmd(2, &out.join("checkpoints"), out);
    cmd.args(["--set", &steps]);
    merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(120)).assert_success();
    let reference = out_dir(reference);
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(&mut cmd, &reference, &["--dp", "2", "--set", &steps]);
    cmd.args(CONSTANT_LR);
    merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(120)).assert_success();
    let (got, want) = (read_metrics(out), read_metrics(&reference));
    assert_eq!(got.len(), k + 2);
    for key in ["loss", "grad_norm"] {
        assert_eq!(series(&got, key), series(&want, key), "{key}");
    }
}

/// A stop signal while asynchronous saves are in flight (a save every 2 steps): the stop's own
/// save waits for the one in flight, the job exits 75 with the stop's step as `latest`, and
/// resumed it equals a run that was never stopped.
#[test]
fn a_preemption_signal_with_asynchronous_saves_in_flight_resumes_exactly() {
    let out = out_dir("preempted-async");
    let saves = [
        "--set",
        "checkpoint.async=true",
        "--set",
        "checkpoint.every=2",
    ];
    let k = preempt(&out, &[&["--dp", "2"][..], &saves].concat());
    assert!(
        std::fs::read_to_string(out.join("job.err")).is_ok_and(|e| e.contains("writer thread")),
        "the saves were asynchronous"
    );
    assert_resumes_exactly(&out, k, "preempted-async-reference");
}

/// How a preemption test starts its job and which signal the scheduler sends.
#[derive(Clone, Copy)]
enum Launch {
    /// `mpirun -np 2 merak train ...`, SIGUSR1 to mpirun (the README's recipe).
    Mpirun,
    /// `merak train --np 2 ...`, SIGTERM to merak (what a scheduler or `kill` sends).
    OwnLauncher,
}

/// Starts a long 2-rank run with `layout`, sends mpirun SIGUSR1 after five steps and checks
/// that the job stops with status 75, every rank after the same step, that step checkpointed;
/// returns the steps done.
fn preempt(out: &std::path::Path, layout: &[&str]) -> usize {
    preempt_with(out, layout, Launch::Mpirun)
}

/// Like [`preempt`], launched and signalled as `launch` says.
fn preempt_with(out: &std::path::Path, layout: &[&str], launch: Launch) -> usize {
    let (cmd, signal, layout) = match launch {
        Launch::Mpirun => {
            let mut cmd = mpirun(2);
            cmd.arg(MERAK);
            (cmd, "-USR1", layout.to_vec())
        }
        // `--np` is an argument of `train`: it follows it, as the layout does.
        Launch::OwnLauncher => (
            std::process::Command::new(MERAK),
            "-TERM",
            [&["--np", "2"][..], layout].concat(),
        ),
    };
    preempt_started(out, &layout, cmd, signal)
}

/// Trains with `cmd` (`merak` or `mpirun ... merak`) and `layout`, sends `signal` to the
/// process started after five steps and checks the stop (see [`preempt`]).
fn preempt_started(
    out: &std::path::Path,
    layout: &[&str],
    mut cmd: std::process::Command,
    signal: &str,
) -> usize {
    train_args(
        &mut cmd,
        out,
        &[layout, &["--set", "train.steps=100000"]].concat(),
    );
    // The job's output goes to files: a pipe nobody reads before the end would fill up.
    std::fs::create_dir_all(out).unwrap();
    let log = |name: &str| std::fs::File::create(out.join(name)).expect("log file");
    cmd.args(CONSTANT_LR)
        .stdout(log("job.out"))
        .stderr(log("job.err"));
    let mut child = cmd.spawn().expect("mpirun starts");
    let metrics = out.join("metrics.jsonl");
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 5) {
        assert!(start.elapsed().as_secs() < 60, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SIGUSR1 to mpirun, which forwards it to every rank (as a scheduler's warning signal),
    // or SIGTERM to merak's own launcher, which passes it on as SIGUSR1.
    let pid = child.id().to_string();
    let sent = std::process::Command::new("kill")
        .args([signal, &pid])
        .status();
    assert!(sent.is_ok_and(|s| s.success()));
    let status = wait_at_most(&mut child, 60);
    let stderr = std::fs::read_to_string(out.join("job.err")).unwrap_or_default();
    assert_eq!(status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("stopped on a signal after step"),
        "{stderr}"
    );
    // Every rank stopped after the same step, and that step was checkpointed.
    let k = read_metrics(out).len();
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{k:08}"));

    k
}

/// `merak train --np 2` turns SIGTERM (a scheduler's, or `kill`'s default) into the
/// checkpoint-and-stop path on every rank and exits 75 itself (a bare mpirun exits 1 on
/// SIGTERM, after killing the ranks a second later); the checkpoint resumes exactly.
#[test]
fn merak_np_turns_sigterm_into_a_checkpoint_and_exit_75() {
    let out = out_dir("preempted-np");
    let k = preempt_with(&out, &["--dp", "2"], Launch::OwnLauncher);
    let steps = format!("train.steps={}", k + 1);
    let mut cmd = resume_cmd(2, &out.join("checkpoints"), &out);
    cmd.args(["--set", &steps]);
    merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(120)).assert_success();
    assert_eq!(read_metrics(&out).len(), k + 1);
}

/// Under 2BW a step runs the next one's first forwards: the stop is agreed before a step, so
/// that none runs ahead of it, and the job ends without a hang.
#[test]
fn a_preemption_signal_stops_an_overlapping_2bw_pipeline() {
    let out = out_dir("preempted-2bw");
    preempt(&out, &["--pp", "2", "--set", "parallel.schedule=2bw"]);
}

/// Waits for `child` at most `secs` seconds (killing it after that) and returns its status.
fn wait_at_most(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let start = std::time::Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return status;
        }
        if start.elapsed().as_secs() > secs {
            let _ = child.kill();
            panic!("the job did not end within {secs} s of the signal");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A long validation pass honours the stop signals: the ranks agree batch by batch, abandon
/// the pass, checkpoint the step and exit 75 (a pass of 8192 batches ran on, deaf to signals,
/// before).
#[test]
fn a_preemption_signal_stops_a_long_validation_pass() {
    let out = out_dir("preempted-validation");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(
        &mut cmd,
        &out,
        &[
            "--dp",
            "2",
            "--set",
            "train.steps=4",
            "--set",
            "data.val_every=2",
            "--set",
            "data.val_batches=8192",
        ],
    );
    std::fs::create_dir_all(&out).unwrap();
    let log = |name: &str| std::fs::File::create(out.join(name)).expect("log file");
    cmd.stdout(log("job.out")).stderr(log("job.err"));
    let mut child = cmd.spawn().expect("mpirun starts");
    let metrics = out.join("metrics.jsonl");
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 1) {
        assert!(start.elapsed().as_secs() < 60, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Step 2 takes milliseconds; its validation pass, seconds.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let sent = std::process::Command::new("kill")
        .args(["-USR1", &child.id().to_string()])
        .status();
    assert!(sent.is_ok_and(|s| s.success()));
    let status = wait_at_most(&mut child, 60);
    let stderr = std::fs::read_to_string(out.join("job.err")).unwrap_or_default();
    assert_eq!(status.code(), Some(75), "{stderr}");
    let m = read_metrics(&out);
    assert_eq!(m.len(), 2, "stopped after step 2: {m:?}");
    assert!(
        m[1].get("val_loss").is_none(),
        "the pass was abandoned: {:?}",
        m[1]
    );
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-00000002");
}
