//! Multi-token prediction (`model.mtp_depth`) under `merak train`: two depths on the tiny GPT
//! give the same losses (each depth's logged loss too) and parameters under dp = 2, tp = 2
//! (with and without sequence parallelism), pp = 2 (the depths on the last stage, reading its
//! copy of the tied table, with and without full recomputation), ZeRO-3, all three with
//! ZeRO-1, context parallelism (with tp and sequence parallelism, pp, documents), and with
//! Muon under ZeRO-2 and tensor parallelism, as in one process; the logged depths' losses are
//! what the loss adds; the export leaves the depths out; bad settings are refused before
//! training, naming the key.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::{Checkpoint, shard_file};
use merak_tests::run_with_deadline;

mod common;
use common::*;

/// Two depths, their losses weighted 0.3 (so that they move the parameters visibly).
const MTP: [&str; 4] = [
    "--set",
    "model.mtp_depth=2",
    "--set",
    "model.mtp_loss_weight=0.3",
];

/// `merak train` (tiny GPT, synthetic data, 5 steps) on `np` ranks with `opt` then `extra`.
fn run(np: usize, name: &str, opt: &[&str], extra: &[&str]) -> PathBuf {
    train_dir_opt(np, name, opt, extra)
}

#[test]
fn mtp_equals_one_process_under_dp_tp_sp_and_pp() {
    let single = run(0, "mtp-single", &MTP, &[]);
    let params = Checkpoint::open(&single.join("checkpoints"))
        .and_then(|c| c.read_full())
        .expect("a checkpoint");
    assert!(
        params.params.contains_key("mtp.1.proj"),
        "the depths are saved"
    );
    // The depths add to the loss from the first step, and train the shared table after.
    let plain = series(&read_metrics(&run(0, "mtp-none", &[], &[])), "loss");
    let losses = series(&read_metrics(&single), "loss");
    assert!(
        losses.iter().zip(&plain).all(|(a, b)| a > b),
        "{losses:?} vs {plain:?}"
    );
    // Each depth's logged loss is what it adds: at step 1 (the same main weights) the loss
    // less 0.3 / 2 of the depths' is the plain model's.
    let depths = depth_losses(&single);
    assert!(
        depths.iter().all(|d| d.is_finite() && *d > 1.0),
        "{depths:?}"
    );
    let main = losses[0] - 0.15 * (depths[0] + depths[1]);
    assert!(
        max_relative(&[main], &plain[..1]) <= 1e-5,
        "{main} vs {}",
        plain[0]
    );
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let mb2 = ["--set", "train.micro_batch=2"];
    for (np, layout, extra) in [
        (2, "dp2", vec!["--dp", "2"]),
        (2, "tp2", vec!["--tp", "2"]),
        (2, "tp2-sp", [&["--tp", "2"][..], &sp].concat()),
        (2, "pp2", [&["--pp", "2"][..], &mb2].concat()),
        // ZeRO-3 gathers the depths with the head unit; under it, and under full
        // recomputation, the loss comes from a forward pass without autodiff.
        (
            2,
            "dp2-zero3",
            vec!["--dp", "2", "--set", "parallel.zero=3"],
        ),
        (
            2,
            "pp2-recompute",
            [&["--pp", "2", "--set", "parallel.recompute=full"][..], &mb2].concat(),
        ),
        (
            8,
            "dp2-tp2-pp2-sp-zero1",
            [
                &["--dp", "2", "--tp", "2", "--pp", "2"][..],
                &sp,
                &mb2,
                &["--set", "parallel.zero=1"],
            ]
            .concat(),
        ),
    ] {
        let got = run(np, &format!("mtp-{layout}"), &MTP, &extra);
        assert_same_training(&format!("mtp {layout}"), &got, &single);
    }
    // GPT-2 has no place for the depths: the export leaves them out.
    let file = single.join("export/model.safetensors");
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(single.join("checkpoints"))
        .arg("--output")
        .arg(&file);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    let names = tensor_names(&file);
    assert!(names.iter().all(|n| !n.contains("mtp")), "{names:?}");
    assert!(names.iter().any(|n| n.contains("h.1.mlp")), "{names:?}");
}

/// The same losses, depths' losses and parameters in `got` as in `single`.
fn assert_same_training(what: &str, got: &std::path::Path, single: &std::path::Path) {
    assert_same_losses(what, got, single);
    let (a, b) = (depth_losses(got), depth_losses(single));
    assert!(
        max_relative(&a, &b) <= 1e-5,
        "{what}: the depths' losses {a:?} vs {b:?}"
    );
    assert_same_params(what, got, single);
}

/// Each step's logged depth losses (`loss_parts.mtp_1`, `loss_parts.mtp_2`) of the run in
/// `dir`, in order.
fn depth_losses(dir: &std::path::Path) -> Vec<f32> {
    let records = read_metrics(dir);
    let part = |r: &serde_json::Value, k: &str| {
        (r["loss_parts"][k].as_f64()).unwrap_or_else(|| panic!("loss_parts.{k} missing in {r}"))
    };
    (records.iter())
        .flat_map(|r| [part(r, "mtp_1") as f32, part(r, "mtp_2") as f32])
        .collect()
}

/// Context parallelism: each depth's targets come from the whole sequence (they cross the
/// chunks) and its mean from the whole micro-batch's counts, so cp 2 alone, with tp 2 and
/// sequence parallelism, with pp 2, and with a document mask trains as one process does.
#[test]
fn mtp_equals_one_process_under_context_parallelism() {
    let single = run(0, "mtp-cp-single", &MTP, &[]);
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let mb2 = ["--set", "train.micro_batch=2"];
    for (np, layout, extra) in [
        (2, "cp2", vec!["--cp", "2"]),
        (
            4,
            "cp2-tp2-sp",
            [&["--cp", "2", "--tp", "2"][..], &sp].concat(),
        ),
        (
            4,
            "cp2-pp2",
            [&["--cp", "2", "--pp", "2"][..], &mb2].concat(),
        ),
    ] {
        let got = run(np, &format!("mtp-{layout}"), &MTP, &extra);
        assert_same_training(&format!("mtp {layout}"), &got, &single);
    }
    let docs = [
        "--set",
        "model.vocab_size=64",
        "--set",
        "data.document_mask=true",
    ];
    let single = run(0, "mtp-cp-docs-single", &MTP, &docs);
    let got = run(
        2,
        "mtp-cp2-docs",
        &MTP,
        &[&docs[..], &["--cp", "2"]].concat(),
    );
    assert_same_training("mtp cp2 docs", &got, &single);
}

/// The tensor names of the safetensors file at `path`.
fn tensor_names(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("the export");
    let (tensors, _) = shard_file::decode(&bytes, path).expect("valid safetensors");
    tensors.into_iter().map(|t| t.name).collect()
}

/// Muon on the blocks' and the depths' matrices (AdamW on the depths' LayerNorms), under
/// ZeRO-2 and tensor parallelism, as in one process.
#[test]
fn mtp_with_muon_equals_one_process_under_zero() {
    let muon = [&MTP[..], &["--set", "optimizer.kind=muon"]].concat();
    let single = run(0, "mtp-muon-single", &muon, &[]);
    // The depths' matrices are Muon's (one state tensor: the second is zeros), their
    // LayerNorms AdamW's.
    let moments = Checkpoint::open(&single.join("checkpoints"))
        .and_then(|c| c.read_full())
        .expect("a checkpoint")
        .moments;
    let one_tensor = |k: &str| moments[k].m2.iter().all(|v| *v == 0.0);
    assert!(one_tensor("mtp.1.proj"), "mtp.1.proj is AdamW's");
    let norms: Vec<&String> = (moments.keys())
        .filter(|k| k.starts_with("mtp.1.") && k.contains("norm"))
        .collect();
    assert!(
        !norms.is_empty() && norms.iter().all(|k| !one_tensor(k)),
        "{norms:?}"
    );
    let extra = ["--dp", "2", "--tp", "2", "--set", "parallel.zero=2"];
    let got = run(4, "mtp-muon-dp2-tp2-zero2", &muon, &extra);
    assert_same_losses("mtp muon dp2 tp2 zero2", &got, &single);
    assert_same_params("mtp muon dp2 tp2 zero2", &got, &single);
}

#[test]
fn bad_mtp_settings_are_refused_before_training_naming_the_key() {
    for (extra, needle) in [
        (vec!["--set", "model.mtp_depth=9"], "model.mtp_depth = 9"),
        (
            vec![
                "--set",
                "model.mtp_depth=1",
                "--set",
                "model.mtp_loss_weight=-1",
            ],
            "`model.mtp_loss_weight`",
        ),
        (
            vec!["--set", "model.mtp_depth=1", "--set", "model.kind=\"bert\""],
            "`model.mtp_depth`",
        ),
    ] {
        assert_train_refused("mtp-refused", &extra, needle);
    }
}
