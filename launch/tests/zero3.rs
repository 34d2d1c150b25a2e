//! ZeRO-3 (`parallel.zero = 3`) under real `mpirun`: each data-parallel rank stores only its
//! slices of the parameters, gathers a unit's parameters just before the unit runs (forward,
//! and again for its recomputed backward), reduce-scatters the gradients and steps its slices.
//! It gives one process's losses, gradient norms and parameters under dp 2 and 4, small
//! buckets, dp 2 × tp 2, hybrid sharding (dp 4 as two copies of two; dp 2 as two copies of
//! one), accumulation, pp 2, interleaved pp 2, tp 2 with sub-pipelined overlap and dp 2 × pp 2
//! (the tied embedding's copies on two stages), with and without prefetch, for AdamW, SGD with momentum and RMSProp (clipping
//! active); its checkpoints resume under other layouts and stages, one-process checkpoints
//! resume under it, and the schedules it cannot run are refused before training.

use std::path::Path;
use std::time::Duration;

use merak_burn::checkpoint::Checkpoint;
use merak_tests::run_with_deadline;

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
const Z3: [&str; 2] = ["--set", "parallel.zero=3"];

#[test]
fn zero3_equals_one_process_under_dp_tp_pp_and_accumulation() {
    for (name, opt) in [
        ("adamw", &[][..]),
        ("sgd", &SGD[..]),
        ("rmsprop", &RMSPROP[..]),
    ] {
        let single = train_dir_opt(0, &format!("z3-{name}-single"), opt, &[]);
        let layouts: Vec<(usize, &str, Vec<&str>)> = vec![
            (2, "dp2", vec!["--dp", "2"]),
            // No prefetch: every gather waits where it is needed.
            (
                2,
                "dp2-noprefetch",
                vec!["--dp", "2", "--set", "parallel.prefetch=0"],
            ),
            // Buckets of 0.05 MiB: a unit's parameters in several buckets, chunks spanning
            // parameters; two units gathered ahead.
            (
                4,
                "dp4-buckets",
                vec![
                    "--dp",
                    "4",
                    "--set",
                    "parallel.bucket_mb=0.05",
                    "--set",
                    "parallel.prefetch=2",
                ],
            ),
            (4, "dp2-tp2", vec!["--dp", "2", "--tp", "2"]),
            // Hybrid sharding: two copies, each sharded over two ranks; and one rank per
            // shard group (every rank holds everything, the copies summed).
            (
                4,
                "dp4-shard2",
                vec!["--dp", "4", "--set", "parallel.shard=2"],
            ),
            (
                2,
                "dp2-shard1",
                vec!["--dp", "2", "--set", "parallel.shard=1"],
            ),
            // Two micro-batches per rank: the buckets accumulate, then reduce-scatter once.
            (
                2,
                "dp2-accumulate",
                vec!["--dp", "2", "--set", "train.micro_batch=2"],
            ),
            // The tied embedding's copies on two stages, each alone in its bucket.
            (2, "pp2", vec!["--pp", "2", "--set", "train.micro_batch=2"]),
            // Two stages per rank: the gathers follow the interleaved order.
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
                    "--set",
                    "train.micro_batch=2",
                ],
            ),
            // Sub-pipelined tensor parallelism inside each gathered unit.
            (
                2,
                "tp2-overlap",
                vec!["--tp", "2", "--set", "parallel.tp_overlap=2"],
            ),
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
            extra.extend_from_slice(&Z3);
            let what = format!("{name} {layout} zero3");
            let got = train_dir_opt(np, &format!("z3-{name}-{layout}"), opt, &extra);
            assert_same_losses(&what, &got, &single);
            assert_same_params(&what, &got, &single);
        }
    }
}

#[test]
fn zero3_keeping_gathered_parameters_equals_one_process() {
    let single = train_dir_opt(0, "z3-keep-single", &[], &[]);
    let keep = ["--set", "parallel.reshard_after_forward=false"];
    let layouts: Vec<(usize, &str, Vec<&str>)> = vec![
        (
            2,
            "dp2",
            vec!["--dp", "2", "--set", "parallel.bucket_mb=0.05"],
        ),
        // Two micro-batches on the parameters gathered once.
        (
            2,
            "dp2-accumulate",
            vec!["--dp", "2", "--set", "train.micro_batch=2"],
        ),
        (4, "dp2-tp2", vec!["--dp", "2", "--tp", "2"]),
        (
            4,
            "dp2-pp2",
            vec!["--dp", "2", "--pp", "2", "--set", "train.micro_batch=2"],
        ),
        (
            4,
            "dp4-shard2",
            vec!["--dp", "4", "--set", "parallel.shard=2"],
        ),
        // Split backward passes: refused when resharding, they run on the kept parameters.
        (
            2,
            "zb-h1",
            vec![
                "--pp",
                "2",
                "--set",
                "train.micro_batch=2",
                "--set",
                "parallel.schedule=zb-h1",
            ],
        ),
        (
            4,
            "dp2-zb-v",
            vec![
                "--dp",
                "2",
                "--pp",
                "2",
                "--set",
                "train.micro_batch=1",
                "--set",
                "parallel.schedule=zb-v",
            ],
        ),
    ];
    for (np, layout, mut extra) in layouts {
        extra.extend_from_slice(&Z3);
        extra.extend_from_slice(&keep);
        let what = format!("{layout} zero3 without resharding");
        let got = train_dir_opt(np, &format!("z3-keep-{layout}"), &[], &extra);
        assert_same_losses(&what, &got, &single);
        assert_same_params(&what, &got, &single);
    }
}

#[test]
fn zero3_checkpoints_resume_under_other_layouts_and_stages() {
    let four = [
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.every=2",
        "--set",
        "data.val_every=2",
        "--set",
        "data.val_batches=2",
    ];
    let z3 = [
        "--dp",
        "2",
        "--set",
        "parallel.zero=3",
        "--set",
        "parallel.bucket_mb=0.05",
    ];
    let full = train_dir_opt(0, "z3-ckpt-full", &[], &four);
    // Written under ZeRO-3 (parameters and moments gathered from both ranks' slices), with
    // held-out losses on the gathered model; resumed elsewhere.
    let sliced = train_dir_opt(2, "z3-ckpt-dp2", &[], &[&four[..], &z3[..]].concat());
    assert_same_params("zero3 run", &sliced, &full);
    for key in ["loss", "val_loss"] {
        let of = |dir: &Path| -> Vec<f64> {
            (read_metrics(dir).iter())
                .filter_map(|r| r[key].as_f64())
                .collect()
        };
        let (got, want) = (of(&sliced), of(&full));
        assert!(
            want.len() >= 2 && got.len() == want.len(),
            "{key}: {got:?} vs {want:?}"
        );
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{key}: {got:?} vs {want:?}"
            );
        }
    }
    let step2 = sliced.join("checkpoints/step-00000002");
    // Each data-parallel rank wrote its slices of the parameters and moments (the
    // checkpoint's DP-slice split): nothing was gathered to write it.
    let files = Checkpoint::open(&step2).expect("step 2").manifest.files;
    let dps: Vec<usize> = files.iter().map(|f| f.dp).collect();
    assert_eq!(dps, [0, 1], "{files:?}");
    for (np, name, layout) in [
        (
            0,
            "z3-ckpt-to-one",
            vec!["--dp", "1", "--set", "parallel.zero=0"],
        ),
        (
            2,
            "z3-ckpt-to-zero2",
            vec!["--dp", "2", "--set", "parallel.zero=2"],
        ),
        (
            4,
            "z3-ckpt-to-dp2-pp2",
            vec!["--pp", "2", "--set", "train.micro_batch=2"],
        ),
    ] {
        let out = resumed(np, &step2, name, &layout);
        assert_eq!(read_metrics(&out).len(), 2, "{name}: steps 3 and 4");
        assert_same_params(name, &out, &full);
    }
    // A one-process checkpoint resumed under ZeRO-3 (each rank takes its slices).
    let out = resumed(
        2,
        &full.join("checkpoints/step-00000002"),
        "z3-ckpt-from-one",
        &z3,
    );
    assert_same_params("one process -> zero3", &out, &full);
}

#[test]
fn zero3_refuses_split_backward_and_two_version_schedules_before_training() {
    for schedule in ["zb-h1", "2bw"] {
        let out = out_dir(&format!("z3-refused-{schedule}"));
        let mut cmd = merak(2);
        let set = format!("parallel.schedule={schedule}");
        train_args(
            &mut cmd,
            &out,
            &["--pp", "2", "--set", &set, "--set", "parallel.zero=3"],
        );
        let run = run_with_deadline(cmd, Duration::from_secs(120));
        // Bad input, before training (exit status 2), and no folder left behind.
        assert_eq!(run.code, Some(2), "{schedule}: {}", run.stderr);
        assert!(
            run.stderr.contains("parallel.zero") && run.stderr.contains(schedule),
            "{schedule}: {}",
            run.stderr
        );
        assert!(!out.exists(), "{schedule}: left {}", out.display());
    }
}
