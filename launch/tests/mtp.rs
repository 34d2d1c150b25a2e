//! Multi-token prediction (`model.mtp_depth`) under `merak train`: two depths on the tiny GPT
//! give the same losses and parameters under dp = 2, tp = 2 (with and without sequence
//! parallelism), pp = 2 (the depths on the last stage, reading its copy of the tied table,
//! with and without full recomputation), ZeRO-3, all three with ZeRO-1, and with Muon under
//! ZeRO-2 and tensor parallelism, as in one process; the depths change the training; the
//! export leaves them out; bad settings are refused before training, naming the key.

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
        let what = format!("mtp {layout}");
        let got = run(np, &format!("mtp-{layout}"), &MTP, &extra);
        assert_same_losses(&what, &got, &single);
        assert_same_params(&what, &got, &single);
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

/// The tensor names of the safetensors file at `path`.
fn tensor_names(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("the export");
    let (tensors, _) = shard_file::decode(&bytes, path).expect("valid safetensors");
    tensors.into_iter().map(|t| t.name).collect()
}

/// Muon on the blocks' matrices (AdamW on the depths') with the depths, under ZeRO-2 and
/// tensor parallelism, as in one process.
#[test]
fn mtp_with_muon_equals_one_process_under_zero() {
    let muon = [&MTP[..], &["--set", "optimizer.kind=muon"]].concat();
    let single = run(0, "mtp-muon-single", &muon, &[]);
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
            vec!["--set", "model.mtp_depth=1", "--set", "parallel.cp=2"],
            "`parallel.cp`",
        ),
        (
            vec!["--set", "model.mtp_depth=1", "--set", "model.kind=\"bert\""],
            "`model.mtp_depth`",
        ),
    ] {
        assert_train_refused("mtp-refused", &extra, needle);
    }
}
