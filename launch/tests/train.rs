//! End-to-end tests of `merak train`: parallel layouts under real `mpirun` write the same
//! losses as one process, and bad input fails before training with a message naming it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_tests::{Run, mpirun, rel_err, run_with_deadline};

const MERAK: &str = env!("CARGO_BIN_EXE_merak");

fn config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt-tiny.toml")
}

fn out_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn train_args(cmd: &mut Command, out: &Path, extra: &[&str]) {
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

/// Runs `merak train` on `np` ranks (without mpirun when `np == 0`) and returns the metrics.
fn train(np: usize, name: &str, extra: &[&str]) -> Vec<serde_json::Value> {
    let out = out_dir(name);
    let mut cmd = if np == 0 {
        Command::new(MERAK)
    } else {
        let mut c = mpirun(np);
        c.arg(MERAK);
        c
    };
    train_args(&mut cmd, &out, extra);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl written");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

fn series(m: &[serde_json::Value], key: &str) -> Vec<f32> {
    m.iter()
        .map(|r| {
            r[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {r}")) as f32
        })
        .collect()
}

fn assert_same_run(name: &str, got: &[serde_json::Value], want: &[serde_json::Value]) {
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

#[test]
fn tensor_and_data_parallel_losses_equal_one_process() {
    let single = train(0, "single", &[]);
    for r in &single {
        for key in [
            "step",
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "step_time_s",
        ] {
            assert!(r.get(key).is_some(), "metrics.jsonl lacks {key}: {r}");
        }
    }
    let losses = series(&single, "loss");
    assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0));
    for (np, name, extra) in [
        (2, "tp2", vec!["--tp", "2"]),
        (4, "tp4", vec!["--tp", "4"]),
        (2, "dp2", vec!["--dp", "2"]),
        (4, "dp4", vec!["--dp", "4"]),
        (4, "dp2tp2", vec!["--dp", "2", "--tp", "2"]),
        // Small buckets: several all-reduces overlap the backward pass.
        (
            2,
            "dp2-buckets",
            vec!["--dp", "2", "--set", "parallel.bucket_mb=0.05"],
        ),
        (
            2,
            "dp2-zero1",
            vec!["--dp", "2", "--set", "parallel.zero=1"],
        ),
        // Gradient accumulation: 2 micro-batches of 2 sequences per rank.
        (
            4,
            "dp2tp2-micro-zero1",
            vec![
                "--dp",
                "2",
                "--tp",
                "2",
                "--set",
                "train.micro_batch=2",
                "--set",
                "parallel.zero=1",
            ],
        ),
    ] {
        let got = train(np, name, &extra);
        assert_same_run(name, &got, &single);
    }
}

#[test]
fn gradient_buckets_start_during_the_backward_pass() {
    let m = train(
        2,
        "dp2-overlap",
        &["--dp", "2", "--set", "parallel.bucket_mb=0.05"],
    );
    for r in &m {
        let buckets = r["dp_buckets"].as_u64().expect("dp_buckets");
        let early = r["dp_overlapped_buckets"]
            .as_u64()
            .expect("dp_overlapped_buckets");
        assert!(buckets > 1, "{r}");
        // Every bucket but possibly the last (the embedding, finished last) starts early.
        assert!(early + 1 >= buckets, "{r}");
        assert!(r["dp_exposed_comm_s"].as_f64().is_some(), "{r}");
    }
}

#[test]
fn dropout_masks_agree_across_tensor_parallel_ranks() {
    let drop = ["--set", "model.dropout=0.1"];
    let single = train(0, "single-dropout", &drop);
    let got = train(
        2,
        "tp2-dropout",
        &["--tp", "2", "--set", "model.dropout=0.1"],
    );
    assert_same_run("tp2 with dropout", &got, &single);
    // Dropout is really on: the losses differ from the run without it.
    let plain = train(0, "single-no-dropout", &[]);
    assert_ne!(series(&single, "loss"), series(&plain, "loss"));
}

#[test]
fn a_layout_tp_does_not_fit_fails_at_once_naming_tp_and_heads() {
    let mut cmd = mpirun(3);
    cmd.arg(MERAK)
        .arg("train")
        .arg("--config")
        .arg(config())
        .args(["--tp", "3"]);
    let run: Run = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(run.code.is_some_and(|c| c != 0), "{run:?}");
    assert!(run.elapsed < Duration::from_secs(30), "{run:?}");
    assert!(
        run.stderr.contains("tp=3") && run.stderr.contains("attention heads (4)"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_world_that_does_not_match_the_layout_is_rejected() {
    let mut cmd = mpirun(2);
    cmd.arg(MERAK)
        .arg("train")
        .arg("--config")
        .arg(config())
        .args(["--tp", "4"]);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(run.code.is_some_and(|c| c != 0), "{run:?}");
    assert!(
        run.stderr
            .contains("= 4 ranks, but the job has 2 processes"),
        "{}",
        run.stderr
    );
}

#[test]
fn config_errors_name_the_key_and_exit_non_zero() {
    for (args, needle) in [
        (vec!["--set", "train.stepz=3"], "train.stepz"),
        (vec!["--set", "train.steps=lots"], "train.steps"),
        (vec!["--set", "data.kind=books"], "data.kind"),
        (vec!["--set", "model.heads=5"], "model.heads = 5"),
    ] {
        let out = Command::new(MERAK)
            .arg("train")
            .arg("--config")
            .arg(config())
            .args(&args)
            .arg("--out")
            .arg(out_dir("bad"))
            .output()
            .expect("merak runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: `{needle}` not in {stderr}"
        );
    }
    let out = Command::new(MERAK)
        .args(["train", "--config", "/nonexistent/x.toml"])
        .output()
        .expect("merak runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.toml"));
}
