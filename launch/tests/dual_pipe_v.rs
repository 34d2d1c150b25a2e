//! DualPipeV under real `mpirun`: the overlapped forward-and-backward pairs train the same
//! model as one process at pp = 2 and 4 at the default micro-batch (one sequence, so 8
//! micro-batches a step), with the tied embedding's two ends on rank 0, with full
//! recomputation, and in 3D (dp x tp x pp) with dropout and ZeRO-1. Expert parallelism under
//! DualPipeV is in `experts.rs`. A step with fewer than 2 micro-batches per pipeline rank is
//! refused before training.

mod common;
use common::*;

const DUAL: [&str; 2] = ["--set", "parallel.schedule=dualpipev"];

/// `merak train` of the tiny GPT (synthetic data, 8 sequences a step, 5 steps) on `np` ranks
/// at the default micro-batch.
fn run_default(np: usize, out: &std::path::Path, extra: &[&str]) -> merak_tests::Run {
    let mut cmd = merak(np);
    train_args(&mut cmd, out, extra);
    merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(300))
}

#[test]
fn dualpipev_equals_one_process() {
    let single = out_dir("dpv-single");
    run_default(0, &single, &[]).assert_success();
    let six = ["--set", "model.layers=6"];
    let single6 = out_dir("dpv-single-6");
    run_default(0, &single6, &six).assert_success();
    // Two stages per rank: 4 units make 4 stages at pp = 2, 8 units (6 layers) at pp = 4.
    let cases: Vec<(usize, &str, Vec<&str>, &std::path::Path)> = vec![
        (2, "dpv-pp2", vec!["--pp", "2"], &single),
        (
            2,
            "dpv-pp2-full",
            vec!["--pp", "2", "--set", "parallel.recompute=full"],
            &single,
        ),
        (4, "dpv-pp4", [&["--pp", "4"][..], &six].concat(), &single6),
    ];
    for (np, name, layout, want) in cases {
        let out = out_dir(name);
        let trace = out.join("trace.json");
        let traced = ["--trace", trace.to_str().unwrap_or_default()];
        run_default(np, &out, &[&layout[..], &DUAL, &traced].concat()).assert_success();
        assert_same_losses(name, &out, want);
        assert_same_params(name, &out, want);
        assert_pairs_overlap(name, &trace, np);
    }
}

/// Every rank of the traced run posted the receives of its pairs ahead and waited for them
/// only when the pass that needs them started: the posts stand before the waits.
fn assert_pairs_overlap(name: &str, trace: &std::path::Path, ranks: usize) {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(trace).expect("trace written")).expect("json");
    let events = json["traceEvents"].as_array().expect("traceEvents");
    for rank in 0..ranks as u64 {
        let names: Vec<&str> = (events.iter())
            .filter(|e| e["tid"].as_u64() == Some(rank) && e["cat"] == "recv")
            .filter_map(|e| e["name"].as_str())
            .collect();
        let first = |prefix: &str| names.iter().position(|n| n.starts_with(prefix));
        let (post, wait) = (first("post recv"), first("wait "));
        assert!(
            post.is_some() && wait.is_some() && post < wait,
            "{name}: rank {rank} receives {names:?}"
        );
    }
}

#[test]
fn dualpipev_in_3d_with_dropout_and_zero1_equals_one_process() {
    let drop = ["--set", "model.dropout=0.1", "--set", "parallel.zero=1"];
    let single = out_dir("dpv-3d-single");
    run_default(0, &single, &drop).assert_success();
    // dp 2: 4 sequences a rank, 4 micro-batches of one at pp = 2.
    let out = out_dir("dpv-dp2-tp2-pp2");
    let layout = ["--dp", "2", "--tp", "2", "--pp", "2"];
    run_default(8, &out, &[&layout[..], &drop, &DUAL].concat()).assert_success();
    assert_same_losses("dualpipev dp2 x tp2 x pp2", &out, &single);
    assert_same_params("dualpipev dp2 x tp2 x pp2", &out, &single);
}

#[test]
fn too_few_micro_batches_are_refused_before_training() {
    let out = out_dir("dpv-too-few");
    // 2 micro-batches of 4 sequences at pp = 2: DualPipeV needs 4.
    let micro = ["--pp", "2", "--set", "train.micro_batch=4"];
    let run = run_default(2, &out, &[&micro[..], &DUAL].concat());
    assert_ne!(run.code, Some(0), "{}", run.stderr);
    let want = "needs at least 4 micro-batches for 2 pipeline ranks (2 per rank), got 2";
    assert!(run.stderr.contains(want), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(!out.join("metrics.jsonl").exists());
}
