//! End-to-end tests of the optimizers besides AdamW and of the learning-rate schedules under
//! `merak train`: SGD with Nesterov momentum and Burn's RMSProp give the same losses and
//! parameters under dp = 2 with ZeRO-1, tp = 2 and pp = 2 as in one process; an SGD checkpoint
//! resumes under other layouts and refuses another optimizer; an AdamW checkpoint from before
//! the optimizer was recorded still resumes; Muon (the blocks' matrices) with AdamW (the rest)
//! gives the same losses and parameters under dp = 2, tp = 2, pp = 2 and all three, and under
//! ZeRO-1, 2 and 3 and hybrid sharding, as in one process and resumes under another layout;
//! bad settings are refused before training.

use std::path::{Path, PathBuf};
use std::time::Duration;

use merak_burn::checkpoint::Checkpoint;
use merak_tests::{Run, rel_err, run_with_deadline};

mod common;
use common::*;

/// SGD, Nesterov momentum 0.9, L2 weight decay (the config's 0.01), one warm-up step, then
/// warm-up-stable-decay with the last 2 of 5 steps decaying.
const SGD: [&str; 16] = [
    "--set",
    "optimizer.kind=sgd",
    "--set",
    "optimizer.momentum=0.9",
    "--set",
    "optimizer.nesterov=true",
    "--set",
    "train.lr=0.5",
    "--set",
    "train.min_lr=0.05",
    "--set",
    "train.warmup_steps=1",
    "--set",
    "optimizer.schedule=wsd",
    "--set",
    "optimizer.decay_steps=2",
];

/// Burn's RMSProp with momentum, linear decay after one warm-up step.
const RMSPROP: [&str; 14] = [
    "--set",
    "optimizer.kind=rmsprop",
    "--set",
    "optimizer.momentum=0.5",
    "--set",
    "optimizer.alpha=0.9",
    "--set",
    "train.lr=1e-3",
    "--set",
    "train.min_lr=1e-4",
    "--set",
    "train.warmup_steps=1",
    "--set",
    "optimizer.schedule=linear",
];

/// Muon at its defaults (Nesterov momentum 0.95, five Newton-Schulz steps, the update scaled
/// to AdamW's RMS) on the blocks' matrices, AdamW on the rest, the config's learning rate.
const MUON: [&str; 2] = ["--set", "optimizer.kind=muon"];

/// `merak train` (tiny GPT, synthetic data, 5 steps) on `np` ranks with `opt` then `extra`;
/// returns the output folder (its end-of-run checkpoint under `checkpoints`).
fn run(np: usize, name: &str, opt: &[&str], extra: &[&str]) -> PathBuf {
    train_dir_opt(np, name, opt, extra)
}

/// The optimizer entry of the newest checkpoint under `out`.
fn saved_optimizer(out: &Path) -> serde_json::Value {
    let c = Checkpoint::open(&out.join("checkpoints")).expect("a checkpoint");
    c.manifest.extra["optimizer"].clone()
}

#[test]
fn sgd_and_rmsprop_equal_one_process_under_dp_zero1_tp_and_pp() {
    for (name, opt, state) in [
        ("sgd", &SGD[..], vec!["momentum buffer", "-"]),
        (
            "rmsprop",
            &RMSPROP[..],
            vec!["squared-gradient average", "momentum buffer"],
        ),
    ] {
        let single = run(0, &format!("opt-{name}-single"), opt, &[]);
        let entry = saved_optimizer(&single);
        assert_eq!(entry["kind"], name, "{entry}");
        assert_eq!(entry["state"], serde_json::json!(state), "{entry}");
        let m = read_metrics(&single);
        let losses = series(&m, "loss");
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
        for (np, layout, extra) in [
            (
                2,
                "dp2-zero1",
                vec!["--dp", "2", "--set", "parallel.zero=1"],
            ),
            (2, "tp2", vec!["--tp", "2"]),
            // The tied embedding's two copies, on two stages, each stepped with its own state.
            (2, "pp2", vec!["--pp", "2", "--set", "train.micro_batch=2"]),
        ] {
            let what = format!("{name} {layout}");
            let got = run(np, &format!("opt-{name}-{layout}"), opt, &extra);
            assert_same_losses(&what, &got, &single);
            assert_same_params(&what, &got, &single);
        }
    }
}

#[test]
fn muon_equals_one_process_under_dp_tp_cp_and_pp_and_resumes_under_another_layout() {
    let every2 = ["--set", "checkpoint.every=2"];
    let single = run(0, "opt-muon-single", &MUON, &every2);
    let entry = saved_optimizer(&single);
    assert_eq!(entry["kind"], "muon", "{entry}");
    let state = ["first moment or momentum buffer", "second moment"];
    assert_eq!(entry["state"], serde_json::json!(state), "{entry}");
    // It is not AdamW: the same run under AdamW takes other steps after the first.
    let adamw = series(
        &read_metrics(&run(0, "opt-muon-adamw", &[], &every2)),
        "loss",
    );
    let losses = series(&read_metrics(&single), "loss");
    assert_eq!(losses[0], adamw[0], "the first loss is before any step");
    assert!(
        losses[1..].iter().zip(&adamw[1..]).all(|(a, b)| a != b),
        "{losses:?} vs {adamw:?}"
    );
    for (np, layout, extra) in [
        (2, "dp2", vec!["--dp", "2"]),
        // Each split matrix's update gathered over the TP ranks (a fused Q/K/V projection
        // among them), its piece of the orthogonalized whole kept.
        (2, "tp2", vec!["--tp", "2"]),
        // The tied embedding's two copies, on two stages, each stepped by AdamW.
        (2, "pp2", vec!["--pp", "2", "--set", "train.micro_batch=2"]),
        // Each rank's gradients from its chunks of the sequences, summed before the step.
        (2, "cp2", vec!["--cp", "2"]),
        (
            8,
            "dp2-tp2-pp2-sp",
            vec![
                "--dp",
                "2",
                "--tp",
                "2",
                "--pp",
                "2",
                "--set",
                "parallel.sequence_parallel=true",
                "--set",
                "train.micro_batch=2",
            ],
        ),
    ] {
        let what = format!("muon {layout}");
        let got = run(np, &format!("opt-muon-{layout}"), &MUON, &extra);
        assert_same_losses(&what, &got, &single);
        assert_same_params(&what, &got, &single);
    }
    // Its momentum buffers and AdamW's moments continue under pp = 2.
    let step2 = single.join("checkpoints/step-00000002");
    let (r, out) = resume(
        2,
        &step2,
        "opt-muon-resumed-pp2",
        &["--pp", "2", "--set", "train.micro_batch=2"],
    );
    r.assert_success();
    let resumed = read_metrics(&out);
    assert_steps("muon resumed", &resumed, &read_metrics(&single), 1e-5);
    assert_same_params("muon resumed", &out, &single);
}

/// Muon under ZeRO: each matrix's pieces (a chunk may cut a matrix anywhere, and a rank
/// holds pieces of several) are sent to the matrix's owner, orthogonalized whole there and
/// returned; with ZeRO-1, 2 and 3, hybrid sharding, and with tensor parallelism (the owners
/// gathering a split matrix over the TP group) and a pipeline. A ZeRO-2 checkpoint (its
/// momentum written piece by piece) resumes in one process and under ZeRO-3.
#[test]
fn muon_under_zero_equals_one_process_and_resumes_across_stages() {
    let every2 = ["--set", "checkpoint.every=2"];
    let single = run(0, "opt-muon-zero-single", &MUON, &every2);
    let zero = |z: &'static str| ["--set", z];
    let mb2 = ["--set", "train.micro_batch=2"];
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let layouts: [(usize, &str, Vec<&str>); 6] = [
        (
            2,
            "dp2-zero1",
            [&["--dp", "2"][..], &zero("parallel.zero=1")].concat(),
        ),
        (
            2,
            "dp2-zero2",
            [&["--dp", "2"][..], &zero("parallel.zero=2"), &every2].concat(),
        ),
        (
            2,
            "dp2-zero3",
            [&["--dp", "2"][..], &zero("parallel.zero=3")].concat(),
        ),
        (
            4,
            "dp4-hybrid-zero3",
            [
                &["--dp", "4"][..],
                &zero("parallel.zero=3"),
                &zero("parallel.shard=2"),
            ]
            .concat(),
        ),
        (
            4,
            "dp2-tp2-sp-zero2",
            [
                &["--dp", "2", "--tp", "2"][..],
                &zero("parallel.zero=2"),
                &sp,
            ]
            .concat(),
        ),
        (
            4,
            "dp2-pp2-zero1",
            [
                &["--dp", "2", "--pp", "2"][..],
                &zero("parallel.zero=1"),
                &mb2,
            ]
            .concat(),
        ),
    ];
    let mut zero2 = None;
    for (np, layout, extra) in &layouts {
        let what = format!("muon {layout}");
        let got = run(*np, &format!("opt-muon-{layout}"), &MUON, extra);
        assert_same_losses(&what, &got, &single);
        assert_same_params(&what, &got, &single);
        if *layout == "dp2-zero2" {
            zero2 = Some(got);
        }
    }
    let step2 = zero2
        .expect("the ZeRO-2 run")
        .join("checkpoints/step-00000002");
    for (np, name, extra) in [
        (0, "opt-muon-zero2-resumed-single", vec![]),
        (
            2,
            "opt-muon-zero2-resumed-zero3",
            vec!["--dp", "2", "--set", "parallel.zero=3"],
        ),
    ] {
        let (r, out) = resume(np, &step2, name, &extra);
        r.assert_success();
        assert_steps(name, &read_metrics(&out), &read_metrics(&single), 1e-5);
        assert_same_params(name, &out, &single);
    }
}

#[test]
fn the_schedules_give_the_learning_rates_of_their_shapes() {
    let lrs = |name: &str, opt: &[&str]| -> Vec<f64> {
        let m = read_metrics(&run(0, name, opt, &[]));
        m.iter().map(|r| r["lr"].as_f64().expect("lr")).collect()
    };
    let close = |got: &[f64], want: &[f64]| {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 1e-12 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    };
    // WSD, 5 steps, 1 warm-up, 2 decaying: stable at 0.5 until step 3 (0-based), then
    // halfway to 0.05.
    close(
        &lrs("opt-lr-wsd", &SGD),
        &[0.5, 0.5, 0.5, 0.5, 0.5 + (0.05 - 0.5) * 0.5],
    );
    // Linear from 1e-3 after the warm-up to 1e-4 at step 5.
    let lin = |s: f64| 1e-3 + (1e-4 - 1e-3) * (s - 1.0) / 4.0;
    close(
        &lrs("opt-lr-linear", &RMSPROP),
        &[1e-3, lin(1.0), lin(2.0), lin(3.0), lin(4.0)],
    );
    // Constant after two warm-up steps.
    let constant = [
        "--set",
        "optimizer.schedule=constant",
        "--set",
        "train.warmup_steps=2",
    ];
    close(
        &lrs("opt-lr-constant", &constant),
        &[1.5e-3, 3e-3, 3e-3, 3e-3, 3e-3],
    );
}

/// `merak train --resume <checkpoint>` on `np` ranks into a fresh folder `name`.
fn resume(np: usize, checkpoint: &Path, name: &str, extra: &[&str]) -> (Run, PathBuf) {
    let out = out_dir(name);
    let mut cmd = resume_cmd(np, checkpoint, &out);
    cmd.args(extra);
    (run_with_deadline(cmd, Duration::from_secs(300)), out)
}

/// Asserts that the steps of `got` equal the same steps of `want` within `tol` (0: bitwise).
fn assert_steps(name: &str, got: &[serde_json::Value], want: &[serde_json::Value], tol: f64) {
    assert!(!got.is_empty(), "{name}: no steps");
    for g in got {
        let step = g["step"].as_u64().expect("step") as usize;
        for key in ["loss", "grad_norm", "lr"] {
            let (a, b) = (
                g[key].as_f64().unwrap(),
                want[step - 1][key].as_f64().unwrap(),
            );
            let e = rel_err(&[a as f32], &[b as f32]);
            assert!(
                if tol == 0.0 { a == b } else { e <= tol },
                "{name}: {key} at step {step}: {a} vs {b} (rel {e:e})"
            );
        }
    }
}

#[test]
fn an_sgd_checkpoint_resumes_under_other_layouts_and_refuses_another_optimizer() {
    let four = ["--set", "train.steps=4", "--set", "checkpoint.every=2"];
    let full = run(0, "opt-ckpt-sgd-full", &SGD, &four);
    let uninterrupted = read_metrics(&full);
    assert_eq!(uninterrupted.len(), 4);
    let step2 = full.join("checkpoints/step-00000002");
    for (np, name, layout) in [
        (
            2,
            "opt-ckpt-sgd-dp2-zero1",
            vec!["--dp", "2", "--set", "parallel.zero=1"],
        ),
        (2, "opt-ckpt-sgd-tp2", vec!["--tp", "2"]),
    ] {
        let (r, out) = resume(np, &step2, name, &layout);
        r.assert_success();
        let resumed = read_metrics(&out);
        let steps: Vec<u64> = resumed
            .iter()
            .map(|r| r["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![3, 4], "{name}");
        assert_steps(name, &resumed, &uninterrupted, 1e-5);
        assert_same_params(name, &out, &full);
    }
    // Another optimizer cannot take over SGD's state: refused before training, naming both.
    let (r, out) = resume(
        0,
        &step2,
        "opt-ckpt-sgd-as-adamw",
        &[
            "--set",
            "optimizer.kind=adamw",
            "--set",
            "optimizer.momentum=0",
            "--set",
            "optimizer.nesterov=false",
        ],
    );
    // Found with the config, before anything is built: a config error (exit status 2).
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(
        r.stderr.contains("`sgd` (momentum buffer)") && r.stderr.contains("`adamw`"),
        "{}",
        r.stderr
    );
    assert!(!out.join("metrics.jsonl").exists(), "training started");
}

#[test]
fn an_adamw_checkpoint_without_an_optimizer_entry_still_resumes() {
    let four = ["--set", "train.steps=4", "--set", "checkpoint.every=2"];
    let full = run(0, "opt-ckpt-adamw-full", &[], &four);
    assert_eq!(saved_optimizer(&full)["kind"], "adamw");
    // As written before checkpoints named their optimizer.
    let old = Path::new(env!("CARGO_TARGET_TMPDIR")).join("opt-ckpt-adamw-old");
    let _ = std::fs::remove_dir_all(&old);
    std::fs::create_dir_all(&old).unwrap();
    let step2 = full.join("checkpoints/step-00000002");
    for e in std::fs::read_dir(&step2).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), old.join(e.file_name())).unwrap();
    }
    let path = old.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(
        m["extra"]
            .as_object_mut()
            .unwrap()
            .remove("optimizer")
            .is_some()
    );
    std::fs::write(&path, m.to_string()).unwrap();
    let (r, out) = resume(0, &old, "opt-ckpt-adamw-resumed", &[]);
    r.assert_success();
    assert_steps("old adamw", &read_metrics(&out), &read_metrics(&full), 0.0);
    // And it is AdamW's: another optimizer is refused.
    let (r, _) = resume(
        0,
        &old,
        "opt-ckpt-adamw-as-adam",
        &["--set", "optimizer.kind=adam"],
    );
    assert!(r.code.is_some_and(|c| c != 0), "{r:?}");
    assert!(
        r.stderr.contains("`adamw` (first moment, second moment)")
            && r.stderr.contains("`adam` (first moment, second moment)"),
        "{}",
        r.stderr
    );
}

#[test]
fn bad_optimizer_settings_are_refused_before_training_naming_the_key() {
    for (sets, needle) in [
        (
            vec!["optimizer.kind=sgd", "optimizer.momentum=1.5"],
            "`optimizer.momentum`: 1.5 must be in [0, 1)",
        ),
        (
            vec![
                "optimizer.kind=sgd",
                "optimizer.momentum=0.9",
                "optimizer.dampening=0.1",
                "optimizer.nesterov=true",
            ],
            "`optimizer.nesterov`",
        ),
        (
            vec!["optimizer.kind=sgd", "optimizer.nesterov=true"],
            "`optimizer.nesterov`",
        ),
        (vec!["optimizer.kind=lion"], "`optimizer.kind`"),
        (vec!["optimizer.ns_steps=3"], "`optimizer.ns_steps`"),
        (
            vec!["optimizer.kind=muon", "optimizer.ns_steps=0"],
            "`optimizer.ns_steps`: 0",
        ),
        (vec!["optimizer.alpha=0.5"], "`optimizer.alpha`"),
        (vec!["train.beta2=1"], "`train.beta2`"),
        (vec!["train.lr=-0.1"], "`train.lr`"),
        (vec!["train.eps=0"], "`train.eps`"),
        (
            vec![
                "optimizer.schedule=wsd",
                "train.warmup_steps=0",
                "optimizer.decay_steps=6",
            ],
            "`optimizer.decay_steps`: 6",
        ),
        (
            vec!["optimizer.schedule=linear", "train.warmup_steps=6"],
            "`train.warmup_steps`: 6",
        ),
        (
            vec![
                "optimizer.kind=rmsprop",
                "optimizer.centered=true",
                "optimizer.momentum=0.9",
            ],
            "`optimizer.centered`",
        ),
    ] {
        let extra: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
        assert_train_refused("opt-refused", &extra, needle);
    }
}
