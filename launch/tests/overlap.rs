//! End-to-end tests of sub-pipelined tensor parallelism (`parallel.tp_overlap`) under real
//! `mpirun`: tp = 2 and 4 with 2 and 4 token chunks, and dp x tp x pp = 2 x 2 x 2 with 2
//! chunks (with dropout, ZeRO-1, recomputation and other schedules), train the same model as
//! one process; an overlap that does not divide the tokens fails before training.

use merak_tests::Run;

mod common;
use common::*;

/// Runs `merak train` with `layout` on `np` ranks into `name` and checks its losses and final
/// parameters against `single`.
fn assert_equals_one_process(single: &std::path::Path, np: usize, name: &str, layout: &[&str]) {
    let out = out_dir(name);
    let run: Run = run_pp(np, &out, &[&DROPOUT[..], layout].concat());
    run.assert_success();
    assert_same_losses(name, &out, single);
    assert_same_params(name, &out, single);
}

/// Dropout on, so that masks drawn inside overlapped blocks are checked too.
const DROPOUT: [&str; 2] = ["--set", "model.dropout=0.1"];

#[test]
fn sub_pipelined_tensor_parallelism_equals_one_process() {
    let single = out_dir("overlap-single");
    run_pp(0, &single, &DROPOUT).assert_success();
    for (np, name, layout) in [
        (
            2,
            "overlap-tp2-k2",
            vec!["--tp", "2", "--set", "parallel.tp_overlap=2"],
        ),
        (
            2,
            "overlap-tp2-k4",
            vec!["--tp", "2", "--set", "parallel.tp_overlap=4"],
        ),
        (
            4,
            "overlap-tp4-k2",
            vec!["--tp", "4", "--set", "parallel.tp_overlap=2"],
        ),
        (
            4,
            "overlap-tp4-k4",
            vec!["--tp", "4", "--set", "parallel.tp_overlap=4"],
        ),
    ] {
        assert_equals_one_process(&single, np, name, &layout);
    }
}

#[test]
fn sub_pipelined_tensor_parallelism_in_3d_equals_one_process() {
    let single = out_dir("overlap-3d-single");
    run_pp(0, &single, &DROPOUT).assert_success();
    let overlap = ["--set", "parallel.tp_overlap=2"];
    let cases: [(usize, &str, Vec<&str>); 3] = [
        (
            8,
            "overlap-dp2-tp2-pp2-k2",
            vec![
                "--dp",
                "2",
                "--tp",
                "2",
                "--pp",
                "2",
                "--set",
                "parallel.zero=1",
            ],
        ),
        // Recomputed forward passes run the overlapped products again.
        (
            4,
            "overlap-tp2-pp2-k2-stage-aware",
            vec![
                "--tp",
                "2",
                "--pp",
                "2",
                "--set",
                "parallel.schedule=shifted-critical-path",
                "--set",
                "parallel.recompute=stage-aware",
                "--set",
                "parallel.memory_budget_mb=0.07",
            ],
        ),
        (
            4,
            "overlap-tp2-pp2-k2-interleaved-selective",
            vec![
                "--tp",
                "2",
                "--pp",
                "2",
                "--set",
                "parallel.schedule=interleaved",
                "--set",
                "parallel.virtual_stages=2",
                "--set",
                "parallel.recompute=selective",
            ],
        ),
    ];
    for (np, name, layout) in cases {
        assert_equals_one_process(&single, np, name, &[&layout[..], &overlap].concat());
    }
}

#[test]
fn an_overlap_that_does_not_divide_the_tokens_fails_before_training() {
    let out = out_dir("overlap-bad");
    // 2 sequences of 32 tokens per micro-batch: 3 chunks do not divide 64 tokens.
    let run = run_pp(2, &out, &["--tp", "2", "--set", "parallel.tp_overlap=3"]);
    assert_ne!(run.code, Some(0), "{run:?}");
    for part in ["parallel.tp_overlap", "tp_overlap = 3", "64 tokens"] {
        assert!(run.stderr.contains(part), "{part} missing: {}", run.stderr);
    }
    assert!(!out.join("metrics.jsonl").exists(), "training started");
    let run = run_pp(0, &out, &["--set", "parallel.tp_overlap=0"]);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(run.stderr.contains("at least 1"), "{}", run.stderr);
}
