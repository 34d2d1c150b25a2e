//! ZeRO-2 (`parallel.zero = 2`) under real `mpirun`: the gradients reduce-scattered, each
//! data-parallel rank stepping its slices, the new values all-gathered. It gives one process's
//! losses, gradient norms and parameters under dp 2 and 4, dp 2 × tp 2, pp 2 and dp 2 × pp 2
//! (the tied embedding's copies on two stages) and with gradient accumulation, for AdamW, SGD
//! with momentum and RMSProp (clipping active: the tiny GPT's gradient norm starts above
//! `train.grad_clip`); its checkpoints resume under other layouts and stages, and one-process
//! checkpoints resume under it. ZeRO-1 under hybrid sharding equals one process too, and so do
//! ZeRO-2 and 3 reduce-scattering every micro-batch (`parallel.reduce_scatter = "micro-batch"`).

use std::path::PathBuf;

mod common;
use common::*;

const SGD: [&str; 4] = [
    "--set",
    "optimizer.kind=sgd",
    "--set",
    "optimizer.momentum=0.9",
];
const RMSPROP: [&str; 6] = [
    "--set",
    "optimizer.kind=rmsprop",
    "--set",
    "optimizer.momentum=0.5",
    "--set",
    "train.lr=1e-3",
];

/// `merak train` (tiny GPT, synthetic data, 5 steps) on `np` ranks with `opt` then `extra`;
/// returns the output folder (its end-of-run checkpoint under `checkpoints`).
fn run(np: usize, name: &str, opt: &[&str], extra: &[&str]) -> PathBuf {
    train_dir_opt(np, name, opt, extra)
}

#[test]
fn zero2_equals_one_process_under_dp_tp_pp_and_accumulation() {
    for (name, opt) in [
        ("adamw", &[][..]),
        ("sgd", &SGD[..]),
        ("rmsprop", &RMSPROP[..]),
    ] {
        let single = run(0, &format!("z2-{name}-single"), opt, &[]);
        let z2 = ["--set", "parallel.zero=2"];
        let layouts: Vec<(usize, &str, Vec<&str>)> = vec![
            (2, "dp2", vec!["--dp", "2"]),
            // Buckets of 0.05 MiB: a dozen, chunks spanning parameters, every rank holding
            // pieces of several.
            (
                2,
                "dp2-buckets",
                vec!["--dp", "2", "--set", "parallel.bucket_mb=0.05"],
            ),
            (
                4,
                "dp4-buckets",
                vec!["--dp", "4", "--set", "parallel.bucket_mb=0.05"],
            ),
            (4, "dp4", vec!["--dp", "4"]),
            (4, "dp2-tp2", vec!["--dp", "2", "--tp", "2"]),
            // Hybrid sharding: two copies, each sharded over two ranks.
            (
                4,
                "dp4-shard2",
                vec!["--dp", "4", "--set", "parallel.shard=2"],
            ),
            // Two micro-batches per rank: the buckets accumulate, then reduce-scatter once.
            (
                2,
                "dp2-accumulate",
                vec!["--dp", "2", "--set", "train.micro_batch=2"],
            ),
            // The tied embedding's copies on two stages, each alone in its bucket, their
            // chunks summed across the stages.
            (2, "pp2", vec!["--pp", "2", "--set", "train.micro_batch=2"]),
            (
                4,
                "dp2-pp2",
                vec!["--dp", "2", "--pp", "2", "--set", "train.micro_batch=2"],
            ),
        ];
        for (np, layout, mut extra) in layouts {
            if name != "adamw" && np == 4 {
                continue;
            }
            extra.extend_from_slice(&z2);
            let what = format!("{name} {layout} zero2");
            let got = run(np, &format!("z2-{name}-{layout}"), opt, &extra);
            assert_same_losses(&what, &got, &single);
            assert_same_params(&what, &got, &single);
        }
    }
}

#[test]
fn reduce_scattering_every_micro_batch_equals_one_process() {
    let single = run(0, "rs-each-single", &[], &[]);
    let each = ["--set", "parallel.reduce_scatter=micro-batch"];
    // Every layout runs two micro-batches per data-parallel rank.
    let two = ["--set", "train.micro_batch=2"];
    let one = ["--set", "train.micro_batch=1"];
    let layouts: Vec<(usize, &str, Vec<&str>)> = vec![
        // Two micro-batches per rank, a dozen buckets: each bucket reduce-scattered twice,
        // the chunks summed.
        (
            2,
            "dp2-z2",
            vec![
                "--dp",
                "2",
                "--set",
                "parallel.zero=2",
                "--set",
                "parallel.bucket_mb=0.05",
            ],
        ),
        // A pipeline: the two stages' backward passes interleave with the micro-batches.
        (
            4,
            "dp2-pp2-z2",
            vec!["--dp", "2", "--pp", "2", "--set", "parallel.zero=2"],
        ),
        // Hybrid sharding: the summed chunks all-reduced over the copies at the end.
        (
            4,
            "dp4-shard2-z2",
            vec![
                "--dp",
                "4",
                "--set",
                "parallel.zero=2",
                "--set",
                "parallel.shard=2",
            ],
        ),
        // ZeRO-3, unit by unit, with the tied embedding read by two units.
        (2, "dp2-z3", vec!["--dp", "2", "--set", "parallel.zero=3"]),
    ];
    for (np, layout, mut extra) in layouts {
        extra.extend_from_slice(&each);
        extra.extend_from_slice(if np == 4 && !layout.contains("pp") {
            &one
        } else {
            &two
        });
        let what = format!("{layout} reduce-scattered every micro-batch");
        let got = run(np, &format!("rs-each-{layout}"), &[], &extra);
        assert_same_losses(&what, &got, &single);
        assert_same_params(&what, &got, &single);
    }
}

#[test]
fn zero2_checkpoints_resume_under_other_layouts_and_stages() {
    let four = ["--set", "train.steps=4", "--set", "checkpoint.every=2"];
    let z2 = [
        "--dp",
        "2",
        "--set",
        "parallel.zero=2",
        "--set",
        "parallel.bucket_mb=0.05",
    ];
    let full = run(0, "z2-ckpt-full", &[], &four);
    // Written under ZeRO-2 (the moments gathered from both ranks' slices), resumed elsewhere.
    let sliced = run(2, "z2-ckpt-dp2", &[], &[&four[..], &z2[..]].concat());
    assert_same_params("zero2 run", &sliced, &full);
    let step2 = sliced.join("checkpoints/step-00000002");
    for (np, name, layout) in [
        (
            0,
            "z2-ckpt-to-one",
            vec!["--dp", "1", "--set", "parallel.zero=0"],
        ),
        (
            2,
            "z2-ckpt-to-zero1",
            vec!["--dp", "2", "--set", "parallel.zero=1"],
        ),
        (2, "z2-ckpt-to-tp2", vec!["--dp", "1", "--tp", "2"]),
    ] {
        let out = resumed(np, &step2, name, &layout);
        assert_eq!(read_metrics(&out).len(), 2, "{name}: steps 3 and 4");
        assert_same_params(name, &out, &full);
    }
    // A one-process checkpoint resumed under ZeRO-2 (each rank takes its slices).
    let out = resumed(
        2,
        &full.join("checkpoints/step-00000002"),
        "z2-ckpt-from-one",
        &z2,
    );
    assert_same_params("one process -> zero2", &out, &full);
}

/// ZeRO-1 under hybrid sharding: gradients all-reduced over all four DP ranks, each rank
/// stepping its chunk of its copy's slices; one process's losses and parameters, also with
/// context parallelism.
#[test]
fn hybrid_zero1_equals_one_process() {
    let single = run(0, "z1-hybrid-single", &[], &[]);
    let zero1 = ["--set", "parallel.zero=1"];
    // With context parallelism a copy is `shard` replicas with their cp ranks: dp 2 x cp 2,
    // shard 1, two copies of two ranks.
    for (name, layout) in [
        (
            "dp4-shard2",
            ["--dp", "4", "--set", "parallel.shard=2"].as_slice(),
        ),
        (
            "dp2-cp2-shard1",
            &["--dp", "2", "--cp", "2", "--set", "parallel.shard=1"],
        ),
    ] {
        let got = run(
            4,
            &format!("z1-hybrid-{name}"),
            &[],
            &[&zero1, layout].concat(),
        );
        assert_same_losses(&format!("zero1 {name}"), &got, &single);
        assert_same_params(&format!("zero1 {name}"), &got, &single);
    }
}
