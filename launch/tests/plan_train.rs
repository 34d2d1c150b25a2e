//! A plan on disk drives `merak train`: plan -> JSON -> `merak train --plan` on 4 ranks gives
//! the losses of one process; plans that do not fit the job are refused before training.

use std::path::{Path, PathBuf};
use std::time::Duration;

use merak_tests::run_with_deadline;

mod common;
use common::*;

/// The tiny GPT of `configs/gpt-tiny.toml` as the planner writes it.
const TINY: &str = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512";

/// `merak plan` for the tiny GPT on 4 local devices, written to `path`; returns the JSON.
fn plan_to(path: &Path) -> serde_json::Value {
    let mut cmd = merak(0);
    cmd.args([
        "plan",
        "--model",
        TINY,
        "--gpus",
        "4",
        "--hardware",
        "local-cpu",
        "--global-batch",
        "8",
        "--output",
    ])
    .arg(path);
    run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
    serde_json::from_slice(&std::fs::read(path).expect("plan written")).expect("plan is JSON")
}

/// `merak train --plan plan` of the tiny GPT for 5 steps; the run and its output folder.
fn train_plan(np: usize, name: &str, plan: &Path, extra: &[&str]) -> (merak_tests::Run, PathBuf) {
    let out = out_dir(name);
    let mut cmd = merak(np);
    train_args(&mut cmd, &out, extra);
    cmd.arg("--plan").arg(plan);
    (run_with_deadline(cmd, Duration::from_secs(300)), out)
}

#[test]
fn saved_plans_train_like_one_process() {
    let dir = out_dir("plan-files");
    std::fs::create_dir_all(&dir).unwrap();
    let searched = dir.join("searched.json");
    let mut plan = plan_to(&searched);
    let want = train(0, "plan-one-process", &[]);

    // The planner's own choice.
    let (run, out) = train_plan(4, "plan-searched", &searched, &[]);
    run.assert_success();
    let got = read_metrics(&out);
    assert_same_run("searched plan", &got, &want);

    // A hand-edited plan with a pipeline, sub-pipelined tensor parallelism, an uneven
    // partition and a different recomputation per stage (selective on the first rank, full on
    // the second).
    let layout = &mut plan["plan"]["layout"];
    layout["dp"] = 1.into();
    layout["tp"] = 2.into();
    layout["pp"] = 2.into();
    layout["virtual_stages"] = 1.into();
    layout["micro_batch"] = 2.into();
    layout["micro_batches"] = 4.into();
    layout["schedule"] = "1f1b".into();
    layout["zero"] = 0.into();
    layout["reduce_scatter"] = "step".into();
    layout["tp_overlap"] = 2.into();
    layout["recompute"] = serde_json::json!(["selective", "full"]);
    layout["partition"] =
        serde_json::json!({"ranges": [{"start": 0, "end": 1}, {"start": 1, "end": 4}]});
    let edited = dir.join("edited.json");
    std::fs::write(&edited, serde_json::to_vec_pretty(&plan).unwrap()).unwrap();
    let (run, out) = train_plan(4, "plan-edited", &edited, &[]);
    run.assert_success();
    assert_same_run("edited plan", &read_metrics(&out), &want);
    // The resolved config records what the plan set.
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    for line in [
        "pp = 2",
        "tp = 2",
        "stage_layers = [1, 3]",
        "stage_recompute = [\"selective\", \"full\"]",
        "micro_batch = 2",
        "tp_overlap = 2",
    ] {
        assert!(
            config.contains(line),
            "config.toml lacks `{line}`:\n{config}"
        );
    }
}

#[test]
fn plans_that_do_not_fit_the_job_are_refused() {
    let dir = out_dir("plan-refused");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plan.json");
    let plan = plan_to(&path);

    // Made for 4 devices, launched on 2.
    let (run, _) = train_plan(2, "plan-wrong-world", &path, &[]);
    assert_refused(&run, "devices = 4, but the job has 2");

    // Made for another model.
    let (run, _) = train_plan(4, "plan-wrong-model", &path, &["--set", "model.layers=3"]);
    assert_refused(&run, "layers=2");

    // A layout flag together with a plan.
    let (run, _) = train_plan(4, "plan-and-dp", &path, &["--dp", "4"]);
    assert_refused(&run, "drop --dp");

    // An overlap degree that does not divide the tokens of the plan's micro-batch.
    let mut overlapped = plan.clone();
    overlapped["plan"]["layout"]["tp_overlap"] = 3.into();
    std::fs::write(&path, serde_json::to_vec(&overlapped).unwrap()).unwrap();
    let (run, _) = train_plan(4, "plan-overlapped", &path, &[]);
    assert_refused(
        &run,
        "plan.layout.tp_overlap = 3: does not divide the 16 tokens",
    );

    // Issue 50: a ZeRO stage that does not exist, named as the plan file's field.
    let mut zero = plan.clone();
    zero["plan"]["layout"]["zero"] = 7.into();
    std::fs::write(&path, serde_json::to_vec(&zero).unwrap()).unwrap();
    let (run, out) = train_plan(4, "plan-zero-7", &path, &[]);
    assert_refused(&run, "plan.layout.zero = 7: not a supported ZeRO stage");
    assert!(!out.exists(), "a refused run left {}", out.display());

    // A partition with a hole.
    let mut broken = plan.clone();
    broken["plan"]["layout"]["partition"] = serde_json::json!({"ranges": [{"start": 1, "end": 4}]});
    std::fs::write(&path, serde_json::to_vec(&broken).unwrap()).unwrap();
    let (run, _) = train_plan(4, "plan-broken", &path, &[]);
    assert_refused(&run, "stage 0 starts at unit 1");
}
