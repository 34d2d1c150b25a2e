//! End-to-end tests of pipeline parallelism under real `mpirun`: every schedule and
//! recomputation mode trains the same model as one process, also in 3D (dp x tp x pp); 2BW
//! equals one-process 2BW and learns; checkpoints move across pipeline layouts; traces are
//! written; a dying stage ends the job; bad pipeline configs are named.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_tests::{mpirun, run_with_deadline};

mod common;
use common::*;

#[test]
fn every_schedule_and_recomputation_equals_one_process() {
    let single = out_dir("pp-single");
    run_pp(0, &single, &[]).assert_success();
    let cases: Vec<(usize, &str, Vec<&str>)> = vec![
        (
            2,
            "pp2-gpipe",
            vec!["--pp", "2", "--set", "parallel.schedule=gpipe"],
        ),
        (2, "pp2-1f1b", vec!["--pp", "2"]),
        (
            2,
            "pp2-interleaved",
            vec![
                "--pp",
                "2",
                "--set",
                "parallel.schedule=interleaved",
                "--set",
                "parallel.virtual_stages=2",
            ],
        ),
        (
            2,
            "pp2-scp",
            vec![
                "--pp",
                "2",
                "--set",
                "parallel.schedule=shifted-critical-path",
                "--set",
                "parallel.recompute=stage-aware",
            ],
        ),
        (
            4,
            "pp4-gpipe",
            vec!["--pp", "4", "--set", "parallel.schedule=gpipe"],
        ),
        (4, "pp4-1f1b", vec!["--pp", "4"]),
        // 8 graphs in flight per stage (it once broke Burn's graph cleanup).
        (
            4,
            "pp4-gpipe-m8",
            vec![
                "--pp",
                "4",
                "--set",
                "parallel.schedule=gpipe",
                "--set",
                "train.micro_batch=1",
            ],
        ),
        (
            4,
            "pp4-interleaved",
            vec![
                "--pp",
                "2",
                "--tp",
                "2",
                "--set",
                "parallel.schedule=interleaved",
                "--set",
                "parallel.virtual_stages=2",
            ],
        ),
        (
            4,
            "pp4-scp",
            vec![
                "--pp",
                "4",
                "--set",
                "parallel.schedule=shifted-critical-path",
                "--set",
                "parallel.recompute=full",
            ],
        ),
        // Recomputation changes no result.
        (
            2,
            "pp2-full",
            vec!["--pp", "2", "--set", "parallel.recompute=full"],
        ),
        (
            2,
            "pp2-selective",
            vec!["--pp", "2", "--set", "parallel.recompute=selective"],
        ),
        (
            4,
            "pp4-stage-aware",
            vec!["--pp", "4", "--set", "parallel.recompute=stage-aware"],
        ),
        (
            4,
            "pp4-uneven",
            vec![
                "--pp",
                "2",
                "--dp",
                "2",
                "--set",
                "parallel.stage_layers=[3, 1]",
            ],
        ),
    ];
    for (np, name, extra) in cases {
        let out = out_dir(name);
        run_pp(np, &out, &extra).assert_success();
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
}

#[test]
fn eight_ranks_in_3d_equal_one_process() {
    let drop = ["--set", "model.dropout=0.1", "--set", "parallel.zero=1"];
    let single = out_dir("3d-single");
    run_pp(0, &single, &drop).assert_success();
    let out = out_dir("3d-dp2-tp2-pp2");
    let layout = ["--dp", "2", "--tp", "2", "--pp", "2"];
    run_pp(8, &out, &[&layout[..], &drop].concat()).assert_success();
    assert_same_losses("dp2 x tp2 x pp2", &out, &single);
    assert_same_params("dp2 x tp2 x pp2", &out, &single);
    // Recomputed forward passes draw the same dropout masks.
    let out = out_dir("3d-dp2-pp2-stage-aware");
    let layout = [
        "--dp",
        "2",
        "--pp",
        "2",
        "--set",
        "parallel.schedule=shifted-critical-path",
        "--set",
        "parallel.recompute=stage-aware",
        "--set",
        "parallel.memory_budget_mb=0.07",
    ];
    run_pp(4, &out, &[&layout[..], &drop].concat()).assert_success();
    assert_same_losses("dp2 x pp2 stage-aware", &out, &single);
    assert_same_params("dp2 x pp2 stage-aware", &out, &single);
}

#[test]
fn bert_in_a_pipeline_equals_one_process() {
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml");
    let run = |np: usize, name: &str, extra: &[&str]| {
        let micro = ["--set", "train.micro_batch=4"];
        train_dir_with(&bert, np, name, &[&micro[..], extra].concat())
    };
    let single = run(0, "bert-pp-single", &[]);
    for (np, name, layout) in [
        (2, "bert-pp2", vec!["--pp", "2"]),
        (
            4,
            "bert-pp2-tp2-scp",
            vec![
                "--pp",
                "2",
                "--tp",
                "2",
                "--set",
                "parallel.schedule=shifted-critical-path",
                "--set",
                "parallel.recompute=full",
            ],
        ),
    ] {
        let out = run(np, name, &layout);
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
}

#[test]
fn two_bw_in_a_pipeline_equals_one_process_two_bw() {
    let bw = ["--set", "parallel.schedule=2bw"];
    let single = out_dir("2bw-single");
    run_pp(0, &single, &bw).assert_success();
    for (np, name, layout) in [
        (2, "2bw-pp2", vec!["--pp", "2"]),
        (4, "2bw-pp4", vec!["--pp", "4"]),
        // The forwards that run ahead keep only their input; their recomputation runs in the
        // next step's call, on the weights they ran on.
        (
            2,
            "2bw-pp2-full",
            vec!["--pp", "2", "--set", "parallel.recompute=full"],
        ),
    ] {
        let out = out_dir(name);
        run_pp(np, &out, &[&layout[..], &bw].concat()).assert_success();
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
}

/// 2BW's overlap (the next step's forwards during this step's cool-down) in 3D, with dropout
/// (masks keyed by the step the forward belongs to), ZeRO-1 and a validation pass after step 3
/// (before which no step runs ahead): the same losses, validation losses and parameters as
/// one-process 2BW.
#[test]
fn two_bw_overlap_in_3d_with_dropout_and_validation_equals_one_process_two_bw() {
    let base = [
        "--set",
        "parallel.schedule=2bw",
        "--set",
        "model.dropout=0.1",
        "--set",
        "parallel.zero=1",
        "--set",
        "data.val_every=3",
    ];
    let single = out_dir("2bw-3d-single");
    run_pp(0, &single, &base).assert_success();
    let name = "2bw-dp2tp2pp2";
    let out = out_dir(name);
    let layout = ["--dp", "2", "--tp", "2", "--pp", "2"];
    run_pp(8, &out, &[&layout[..], &base].concat()).assert_success();
    assert_same_losses(name, &out, &single);
    assert_same_params(name, &out, &single);
    let val = |dir: &Path| -> Vec<f64> {
        let m = read_metrics(dir);
        m.iter().filter_map(|r| r["val_loss"].as_f64()).collect()
    };
    let (a, b) = (val(&out), val(&single));
    assert_eq!(a.len(), 2, "{name}: validation after steps 3 and 5");
    assert_eq!(b.len(), 2);
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{name}: val loss {x} vs {y}"
        );
    }
}

/// A small data set prepared from real text (this repository's README, four times over).
fn real_text(name: &str) -> PathBuf {
    let raw = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.txt"));
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = std::fs::read_to_string(readme).unwrap();
    std::fs::write(&raw, text.repeat(4)).unwrap();
    let out = out_dir(name);
    let mut cmd = Command::new(MERAK);
    cmd.arg("prepare-data")
        .arg("--input")
        .arg(&raw)
        .arg("--output")
        .arg(&out);
    run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
    out
}

#[test]
fn two_bw_learns_on_real_text() {
    let data = real_text("2bw-text");
    let out = out_dir("2bw-text-run");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK)
        .arg("train")
        .arg("--config")
        .arg(config())
        .args([
            "--pp",
            "2",
            "--set",
            "parallel.schedule=2bw",
            "--set",
            "data.kind=tokens",
            "--set",
            "model.vocab_size=50257",
            "--set",
            "train.steps=40",
            "--set",
            "train.micro_batch=2",
            "--set",
            "train.warmup_steps=5",
            "--set",
        ])
        .arg(format!("data.path={}", data.display()))
        .arg("--out")
        .arg(&out);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    let losses = series(&read_metrics(&out), "loss");
    let head: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let tail: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(tail < head - 1.0, "2BW loss did not fall: {head} -> {tail}");
}

#[test]
fn checkpoints_move_across_pipeline_layouts() {
    let full = out_dir("pp-ckpt-full");
    let save = [
        "--pp",
        "2",
        "--tp",
        "2",
        "--set",
        "checkpoint.every=3",
        "--set",
        "train.steps=6",
    ];
    run_pp(4, &full, &save).assert_success();
    let step3 = full.join("checkpoints/step-00000003");
    for (np, name, layout) in [
        (0, "pp-ckpt-1", vec!["--pp", "1", "--tp", "1"]),
        (4, "pp-ckpt-pp4", vec!["--pp", "4", "--tp", "1"]),
        (
            2,
            "pp-ckpt-dp2",
            vec!["--pp", "1", "--tp", "1", "--dp", "2"],
        ),
    ] {
        let out = out_dir(name);
        let mut cmd = resume_cmd(np, &step3, &out);
        cmd.args(&layout);
        run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
        let got = read_metrics(&out);
        let want = read_metrics(&full);
        assert_eq!(got.len(), 3, "{name}: steps 4..=6");
        for g in &got {
            let step = g["step"].as_u64().unwrap() as usize;
            let (a, b) = (
                g["loss"].as_f64().unwrap(),
                want[step - 1]["loss"].as_f64().unwrap(),
            );
            assert!(
                ((a - b) / b).abs() <= 1e-5,
                "{name}: step {step}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn trace_shows_every_rank_and_action() {
    let out = out_dir("pp-trace");
    let trace = out.join("trace.json");
    let extra = [
        "--pp",
        "2",
        "--set",
        "train.steps=2",
        "--trace",
        trace.to_str().unwrap(),
    ];
    run_pp(2, &out, &extra).assert_success();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    for cat in ["forward", "backward", "send", "recv", "idle"] {
        for rank in 0..2 {
            assert!(
                events
                    .iter()
                    .any(|e| e["cat"] == cat && e["tid"].as_u64() == Some(rank)),
                "no {cat} event for rank {rank}"
            );
        }
    }
}

#[test]
fn a_dying_stage_ends_the_job_promptly() {
    let out = out_dir("pp-kill");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(
        &mut cmd,
        &out,
        &[
            "--pp",
            "2",
            "--set",
            "train.steps=100000",
            "--set",
            "train.micro_batch=2",
        ],
    );
    // Kill the last stage: the first stage then waits for gradients that never come.
    let metrics = out.join("metrics.jsonl");
    kill_last_rank_when(cmd, &out, || {
        std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 3)
    });
}

#[test]
fn bad_pipeline_configs_are_named() {
    for (np, extra, key) in [
        (
            2,
            vec!["--pp", "2", "--set", "parallel.stage_layers=[1, 1]"],
            "parallel.stage_layers",
        ),
        (
            2,
            vec!["--pp", "2", "--set", "parallel.schedule=zigzag"],
            "parallel.schedule",
        ),
        (
            2,
            vec!["--pp", "2", "--set", "parallel.recompute=sometimes"],
            "parallel.recompute",
        ),
        (
            2,
            vec![
                "--pp",
                "2",
                "--set",
                "parallel.schedule=interleaved",
                "--set",
                "parallel.virtual_stages=3",
            ],
            "stages",
        ),
        // A stage-aware budget below what full recomputation needs.
        (
            2,
            vec![
                "--pp",
                "2",
                "--set",
                "parallel.recompute=stage-aware",
                "--set",
                "parallel.memory_budget_mb=0.01",
            ],
            "parallel.memory_budget_mb = 0.01 is below",
        ),
    ] {
        let out = out_dir("pp-bad");
        let run = run_pp(np, &out, &extra);
        assert_eq!(run.code, Some(2), "{extra:?}: {run:?}");
        assert!(run.stderr.contains(key), "{extra:?}: {}", run.stderr);
    }
}
