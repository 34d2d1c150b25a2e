//! Helpers shared by the end-to-end tests of `merak`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::Checkpoint;
use merak_tests::{Run, mpirun, rel_err, run_with_deadline};

/// The `merak` binary under test.
pub const MERAK: &str = env!("CARGO_BIN_EXE_merak");

pub fn config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt-tiny.toml")
}

pub fn out_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn train_args(cmd: &mut Command, out: &Path, extra: &[&str]) {
    cmd.arg("train")
        .arg("--config")
        .arg(config())
        .args([
            "--set",
            "data.kind=synthetic",
            "--set",
            "train.steps=5",
            "--out",
        ])
        .arg(out)
        .args(extra);
}

/// `merak` on `np` ranks under mpirun, or directly (no MPI) when `np == 0`.
pub fn merak(np: usize) -> Command {
    if np == 0 {
        return Command::new(MERAK);
    }
    let mut c = mpirun(np);
    c.arg(MERAK);
    c
}

/// `merak train --resume <checkpoint> --out <out>` on `np` ranks (without mpirun when
/// `np == 0`); the caller adds its settings and runs it.
pub fn resume_cmd(np: usize, checkpoint: &Path, out: &Path) -> Command {
    let mut cmd = merak(np);
    cmd.arg("train")
        .arg("--resume")
        .arg(checkpoint)
        .arg("--out")
        .arg(out);
    cmd
}

/// `merak train --resume checkpoint` on `np` ranks with `extra`, into the new folder `name`,
/// which it returns once the run succeeded.
pub fn resumed(np: usize, checkpoint: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = out_dir(name);
    let mut cmd = resume_cmd(np, checkpoint, &out);
    cmd.args(extra);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    out
}

/// Asserts that the records of a `resumed` run continue `whole` (the uninterrupted run's) from
/// its record `from` on: the same steps, each of `close` within 1e-5 relative, and each of
/// `equal` the same value.
pub fn assert_continues(
    resumed: &[serde_json::Value],
    whole: &[serde_json::Value],
    from: usize,
    (close, equal): (&[&str], &[&str]),
) {
    for (got, want) in resumed.iter().zip(&whole[from..]) {
        let step = &got["step"];
        assert_eq!(step, &want["step"]);
        for key in equal {
            assert_eq!(got[key], want[key], "step {step}: {key}");
        }
        for key in close {
            let (a, b) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
            assert!(((a - b) / b).abs() <= 1e-5, "step {step}: {key} {a} vs {b}");
        }
    }
}

/// Runs `merak train` with `config` for 5 steps on `np` ranks (without mpirun when `np == 0`)
/// and returns the metrics.
pub fn train_with(config: &Path, np: usize, name: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    read_metrics(&train_dir_with(config, np, name, extra))
}

/// Like [`train_with`], returning the run's output folder.
pub fn train_dir_with(config: &Path, np: usize, name: &str, extra: &[&str]) -> PathBuf {
    let out = out_dir(name);
    let mut cmd = merak(np);
    cmd.arg("train")
        .arg("--config")
        .arg(config)
        .args(["--set", "train.steps=5", "--out"])
        .arg(&out)
        .args(extra);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    out
}

/// `merak train` of the tiny GPT on synthetic data on `np` ranks (without mpirun when
/// `np == 0`) with `opt` then `extra`; 5 steps; returns the output folder.
pub fn train_dir_opt(np: usize, name: &str, opt: &[&str], extra: &[&str]) -> PathBuf {
    let mut args = vec!["--set", "data.kind=synthetic"];
    args.extend_from_slice(opt);
    args.extend_from_slice(extra);
    train_dir_with(&config(), np, name, &args)
}

/// The records of `out/metrics.jsonl`.
pub fn read_metrics(out: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl written");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

/// The tiny GPT on synthetic data.
pub fn train(np: usize, name: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["--set", "data.kind=synthetic"];
    args.extend_from_slice(extra);
    train_with(&config(), np, name, &args)
}

pub fn series(m: &[serde_json::Value], key: &str) -> Vec<f32> {
    m.iter()
        .map(|r| {
            r[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {r}")) as f32
        })
        .collect()
}

/// The series `key` of the run in `dir` (its `metrics.jsonl`).
pub fn series_of(dir: &Path, key: &str) -> Vec<f32> {
    series(&read_metrics(dir), key)
}

/// The largest relative difference of `a` from `b`, element by element (equal lengths).
pub fn max_relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-6))
        .fold(0.0, f32::max)
}

pub fn assert_same_run(name: &str, got: &[serde_json::Value], want: &[serde_json::Value]) {
    assert_eq!(got.len(), 5, "{name}: five steps");
    assert_eq!(got.len(), want.len());
    for key in ["loss", "grad_norm", "lr"] {
        let (g, w) = (series(got, key), series(want, key));
        // Per step, not only overall.
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            let e = rel_err(&[*a], &[*b]);
            assert!(
                e <= 1e-5,
                "{name}: {key} at step {} is {a}, one process has {b} (rel {e:e})",
                i + 1
            );
        }
    }
}

/// Runs `cmd` (a `merak train` job writing into `out`) in the background, waits until `ready()`
/// holds (at most 60 s), SIGKILLs the last rank process (found by its unique output folder) and
/// asserts that the whole job then ends, unsuccessfully, within 30 s. Returns the job's run.
pub fn kill_last_rank_when(cmd: Command, out: &Path, ready: impl Fn() -> bool) -> merak_tests::Run {
    signal_last_rank_when(cmd, out, "-KILL", ready)
}

/// Like [`kill_last_rank_when`], with another signal (`-STOP`: a rank that stalls without
/// dying).
pub fn signal_last_rank_when(
    cmd: Command,
    out: &Path,
    signal: &str,
    ready: impl Fn() -> bool,
) -> merak_tests::Run {
    let child = std::thread::spawn(move || run_with_deadline(cmd, Duration::from_secs(120)));
    let start = std::time::Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = last_rank_pid(out).expect("no rank process found");
    let killed_at = std::time::Instant::now();
    let status = Command::new("kill")
        .args([signal, &pid])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let run = child.join().expect("the runner thread");
    assert!(
        !run.timed_out,
        "the job hung after a rank got {signal}: {run:?}"
    );
    assert!(
        killed_at.elapsed() < Duration::from_secs(30),
        "took {:?}",
        killed_at.elapsed()
    );
    assert_ne!(run.code, Some(0), "{run:?}");
    run
}

/// The pid of the highest MPI rank of the `merak train` writing to `out`, by the rank its
/// environment names (`OMPI_COMM_WORLD_RANK`): `mpirun`'s own command line matches too, and
/// pids are not in rank order once they wrap around.
fn last_rank_pid(out: &Path) -> Option<String> {
    let pgrep = Command::new("pgrep")
        .args(["-f", &format!("{} train .*{}", MERAK, out.display())])
        .output()
        .expect("pgrep runs");
    let rank_of = |pid: &str| {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        env.split(|b| *b == 0).find_map(|entry| {
            let entry = std::str::from_utf8(entry).ok()?;
            entry
                .strip_prefix("OMPI_COMM_WORLD_RANK=")?
                .parse::<usize>()
                .ok()
        })
    };
    String::from_utf8_lossy(&pgrep.stdout)
        .split_whitespace()
        .filter_map(|pid| Some((rank_of(pid)?, pid.to_string())))
        .max_by_key(|(rank, _)| *rank)
        .map(|(_, pid)| pid)
}

/// `merak train` (tiny GPT, synthetic data, 4 micro-batches of 2 per step) on `np` ranks.
pub fn run_pp(np: usize, out: &Path, extra: &[&str]) -> Run {
    let mut cmd = merak(np);
    train_args(&mut cmd, out, &["--set", "train.micro_batch=2"]);
    cmd.args(extra);
    run_with_deadline(cmd, Duration::from_secs(300))
}

/// Asserts that the final parameters of two runs (their end-of-training checkpoints) agree:
/// all parameters together within 1e-5 relative, and each tensor within 1e-4. AdamW divides
/// by the root of the second moment, so where a gradient element is near zero, a rounding
/// difference of the reduction order becomes a relative difference of its update (seen: 2.7e-5
/// on one BERT MLP bias under tp = 2 alone). The key bias has an exactly zero gradient (softmax
/// ignores a constant added to every score): AdamW turns rounding noise into updates of about
/// 1e-6, so it is compared absolutely.
pub fn assert_same_params(name: &str, a: &Path, b: &Path) {
    let fa = Checkpoint::open(&a.join("checkpoints"))
        .unwrap()
        .read_full()
        .unwrap();
    let fb = Checkpoint::open(&b.join("checkpoints"))
        .unwrap()
        .read_full()
        .unwrap();
    assert_eq!(fa.params.len(), fb.params.len(), "{name}: parameter count");
    let (mut all_a, mut all_b) = (Vec::new(), Vec::new());
    for (n, va) in &fa.params {
        let vb = &fb.params[n];
        if n.ends_with("qkv.linear.bias") {
            let h = va.len() / 3;
            for i in h..2 * h {
                assert!((va[i] - vb[i]).abs() <= 1e-5, "{name}: {n}[{i}]");
            }
            for seg in [0..h, 2 * h..3 * h] {
                all_a.extend_from_slice(&va[seg.clone()]);
                all_b.extend_from_slice(&vb[seg.clone()]);
            }
            continue;
        }
        let e = rel_err(va, vb);
        assert!(e <= 1e-4, "{name}: {n} rel {e:e}");
        all_a.extend_from_slice(va);
        all_b.extend_from_slice(vb);
    }
    let e = rel_err(&all_a, &all_b);
    assert!(e <= 1e-5, "{name}: all parameters rel {e:e}");
}

/// Asserts that two runs wrote the same losses, gradient norms and learning rates.
pub fn assert_same_losses(name: &str, got: &Path, want: &Path) {
    assert_same_run(name, &read_metrics(got), &read_metrics(want));
}

/// Asserts that `run` was refused before training (exit status 2) with `text` in its error.
pub fn assert_refused(run: &Run, text: &str) {
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains(text),
        "wanted `{text}` in:\n{}",
        run.stderr
    );
}

/// Asserts that `merak train` (tiny GPT, one process) with `extra` is refused before training
/// (exit status 2, `text` in its error) and writes no metrics into the folder `name`.
pub fn assert_train_refused(name: &str, extra: &[&str], text: &str) {
    let out = out_dir(name);
    let mut cmd = merak(0);
    train_args(&mut cmd, &out, extra);
    let r = merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(60));
    assert_refused(&r, text);
    assert!(!out.join("metrics.jsonl").exists(), "{extra:?}: trained");
}
