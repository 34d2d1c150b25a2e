//! `merak probe`, `merak profile`, and their use by `merak plan`, `merak simulate` and
//! `merak train --plan auto`, on 2 ranks with the tiny GPT.

use std::path::Path;
use std::time::Duration;

use merak_burn::planner::{Calibration, HardwareSpec, TransformerShape, UnitKind};
use merak_tests::run_with_deadline;

mod common;
use common::*;

const TINY: &str = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512";

fn run(mut cmd: std::process::Command) -> merak_tests::Run {
    cmd.env("RAYON_NUM_THREADS", "1");
    run_with_deadline(cmd, Duration::from_secs(300))
}

/// Probes and profiles on 2 ranks into `dir`; returns (hardware.toml, calibration.json).
fn probe_and_profile(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let hw = dir.join("hardware.toml");
    let mut cmd = merak(2);
    cmd.args(["probe", "--reps", "2", "--out"]).arg(&hw);
    let probed = run(cmd);
    probed.assert_success();
    // The overlap of the runtime's chunked products is measured at k = 2 and 4.
    for k in [2, 4] {
        let line = format!("tp overlap k={k}:");
        assert!(probed.stdout.contains(&line), "{}", probed.stdout);
    }
    let cal = dir.join("calibration.json");
    // A folder the user owns next to the output is left alone (the profile's training runs
    // once used, and then removed, `<out>.train-run`).
    let neighbour = dir.join("calibration.train-run");
    std::fs::create_dir_all(&neighbour).unwrap();
    std::fs::write(neighbour.join("keep.txt"), b"mine").unwrap();
    let mut cmd = merak(2);
    cmd.arg("profile")
        .arg("--config")
        .arg(config())
        .args([
            "--micro-batches",
            "1,2",
            "--reps",
            "2",
            "--train-steps",
            "3",
            "--tp-overlap",
            "1,2",
            "--out",
        ])
        .arg(&cal);
    let profiled = run(cmd);
    profiled.assert_success();
    for line in ["tp=2 micro_batch=2", "tp=2 tp_overlap=2 micro_batch=2"] {
        assert!(profiled.stdout.contains(line), "{}", profiled.stdout);
    }
    assert!(neighbour.join("keep.txt").exists());
    (hw, cal)
}

#[test]
fn probe_and_profile_feed_plan_simulate_and_train_plan_auto() {
    let dir = out_dir("probe-profile");
    let (hw_path, cal_path) = probe_and_profile(&dir);

    // The spec: one node of 2 ranks sharing this machine's cores, measured rates.
    let hw = HardwareSpec::load(&hw_path.display().to_string()).unwrap();
    assert_eq!((hw.devices_per_node, hw.nodes), (2, 1));
    assert!(hw.compute_units_per_node >= 1);
    assert!(
        hw.peak_flops_fp32 > 1e8 && hw.intra_node_bandwidth > 1e6,
        "{hw:?}"
    );
    // Two ranks can sub-pipeline tensor parallelism; its measured cost is a fraction.
    assert_eq!(hw.max_tp_overlap, 4);
    assert!((0.0..=1.0).contains(&hw.tp_overlap_slowdown), "{hw:?}");

    // The calibration: every unit kind at tp 1 and 2 and micro-batches 1 and 2, positive.
    let shape: TransformerShape = TINY.parse().unwrap();
    let cal = Calibration::read(&cal_path, &shape).unwrap();
    assert_eq!(cal.ranks, 2);
    for kind in [UnitKind::Embedding, UnitKind::Layer, UnitKind::Head] {
        for tp in [1, 2] {
            let (f, b) = cal.unit_time(kind, tp, 2).unwrap();
            assert!(f > 0.0 && b > 0.0, "{kind:?} tp={tp}: {f} {b}");
        }
    }
    assert!(cal.optimizer_s_per_param > 0.0);
    // The layer was also timed sub-pipelined over 2 chunks at tp = 2, and only there.
    let overlapped: Vec<_> = cal.timings.iter().filter(|t| t.tp_overlap == 2).collect();
    assert!(
        overlapped
            .iter()
            .any(|t| t.unit == UnitKind::Layer && t.tp == 2 && t.forward_s > 0.0),
        "{:?}",
        cal.timings
    );
    assert!(overlapped.iter().all(|t| t.tp == 2), "{overlapped:?}");

    // plan and simulate take them.
    let target = |cmd: &mut std::process::Command| {
        cmd.args([
            "--model",
            TINY,
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--hardware",
        ])
        .arg(&hw_path)
        .arg("--calibration")
        .arg(&cal_path);
    };
    let mut cmd = merak(0);
    cmd.args(["plan", "--json"]);
    target(&mut cmd);
    let planned = run(cmd);
    planned.assert_success();
    let v: serde_json::Value = serde_json::from_str(&planned.stdout).unwrap();
    assert!(v["best"]["prediction"]["step_time_s"].as_f64().unwrap() > 0.0);

    let trace = dir.join("trace.json");
    let mut cmd = merak(0);
    cmd.args([
        "simulate",
        "--layout",
        "dp=1,pp=2,mbs=2,schedule=1f1b",
        "--trace",
    ])
    .arg(&trace);
    target(&mut cmd);
    let simulated = run(cmd);
    simulated.assert_success();
    assert!(
        simulated.stdout.contains("step time"),
        "{}",
        simulated.stdout
    );
    let events: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let spans = events
        .as_array()
        .or_else(|| events["traceEvents"].as_array())
        .expect("a list of trace events")
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    // 4 micro-batches, forward and backward on each of 2 stages, plus messages.
    assert!(spans >= 16, "{spans} spans");

    // An overlapped layout is predicted from the layer timed with its degree.
    let mut cmd = merak(0);
    cmd.args(["simulate", "--json", "--layout", "tp=2,mbs=2,overlap=2"]);
    target(&mut cmd);
    let overlapped = run(cmd);
    overlapped.assert_success();
    let v: serde_json::Value = serde_json::from_str(&overlapped.stdout).unwrap();
    assert_eq!(v["layout"]["tp_overlap"], 2, "{v}");
    let step = v["prediction"]["step_time_s"].as_f64().unwrap_or(0.0);
    assert!(step > 0.0, "{v}");

    // A calibration of another model is refused, naming both.
    let mut cmd = merak(0);
    cmd.args([
        "plan",
        "--model",
        "gpt:layers=3,hidden=64,heads=4,seq=32,vocab=512",
    ])
    .args(["--gpus", "2", "--global-batch", "8", "--calibration"])
    .arg(&cal_path);
    let refused = run(cmd);
    assert_eq!(refused.code, Some(2));
    assert!(
        refused.stderr.contains("was measured for"),
        "{}",
        refused.stderr
    );

    // train --plan auto: plans for its 2 ranks and trains like one process.
    let want = train(0, "auto-one-process", &[]);
    let out = out_dir("auto-plan");
    let mut cmd = merak(2);
    train_args(&mut cmd, &out, &["--plan", "auto", "--calibration"]);
    cmd.arg(&cal_path);
    let trained = run(cmd);
    trained.assert_success();
    assert!(trained.stderr.contains("plan: dp="), "{}", trained.stderr);
    assert_same_run("--plan auto", &read_metrics(&out), &want);
}
