//! `merak plan` and `merak simulate` on the command line.

use std::process::Command;
use std::time::Duration;

use merak_tests::run_with_deadline;

const MERAK: &str = env!("CARGO_BIN_EXE_merak");

fn merak(args: &[&str]) -> merak_tests::Run {
    let mut cmd = Command::new(MERAK);
    cmd.args(args);
    run_with_deadline(cmd, Duration::from_secs(60))
}

#[test]
fn plan_prints_json_with_time_throughput_and_memory_per_stage() {
    let run = merak(&[
        "plan",
        "--model",
        "gpt-8.3b",
        "--gpus",
        "64",
        "--hardware",
        "a100-80g",
        "--global-batch",
        "512",
        "--seq",
        "2048",
        "--json",
    ]);
    run.assert_success();
    let v: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let best = &v["best"];
    let p = &best["prediction"];
    assert!(p["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(p["tflops_per_gpu"].as_f64().unwrap() > 0.0);
    let mem = p["peak_memory_bytes"].as_array().unwrap();
    assert_eq!(mem.len(), best["layout"]["pp"].as_u64().unwrap() as usize);
    let l = &best["layout"];
    let gpus = l["dp"].as_u64().unwrap() * l["tp"].as_u64().unwrap() * l["pp"].as_u64().unwrap();
    assert_eq!(gpus, 64);
    // Nothing in the Pareto set is slower and bigger than another member.
    let pareto = v["pareto"].as_array().unwrap();
    assert!(!pareto.is_empty());
    let point = |p: &serde_json::Value| {
        let pr = &p["prediction"];
        let m = pr["peak_memory_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .max()
            .unwrap();
        (pr["step_time_s"].as_f64().unwrap(), m)
    };
    for a in pareto {
        for b in pareto {
            let (pa, pb) = (point(a), point(b));
            assert!(!(pb.0 < pa.0 && pb.1 < pa.1), "{pa:?} dominated by {pb:?}");
        }
    }
}

#[test]
fn a_budget_nothing_fits_names_the_smallest_memory() {
    let run = merak(&[
        "plan",
        "--model",
        "gpt-20b",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--memory-gib",
        "1",
    ]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("smallest plan needs"), "{}", run.stderr);
}

#[test]
fn simulate_reproduces_a_published_megatron_row() {
    // Megatron-LM SC'21: 39.1B on 512 A100s, tp 8, pp 2: 138 TFLOP/s per GPU.
    let run = merak(&[
        "simulate",
        "--model",
        "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200",
        "--gpus",
        "512",
        "--global-batch",
        "1536",
        "--layout",
        "dp=32,tp=8,pp=2,v=1,mbs=1,recompute=full,schedule=1f1b",
        "--json",
    ]);
    run.assert_success();
    let v: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let tflops = v["prediction"]["tflops_per_gpu"].as_f64().unwrap();
    assert!((tflops - 138.0).abs() / 138.0 <= 0.15, "{tflops}");
    let bad = merak(&[
        "simulate",
        "--model",
        "gpt2",
        "--gpus",
        "4",
        "--global-batch",
        "8",
        "--layout",
        "dp=2,tp=3",
    ]);
    assert_eq!(bad.code, Some(2));
}

/// Issue 31's acceptance row: a Llama-3-8B-like GPT at 32k tokens on 8 H100s (the shape
/// without `seq=`, given by `--seq`) has context-parallel plans in its Pareto set, each with
/// `dp x cp x tp x pp = 8`, and sequence parallelism wherever tp > 1.
#[test]
fn plan_at_32k_tokens_puts_context_parallelism_on_the_pareto_set() {
    let run = merak(&[
        "plan",
        "--model",
        "gpt:layers=32,hidden=4096,heads=32,vocab=128256",
        "--seq",
        "32768",
        "--hardware",
        "h100-80g",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--json",
    ]);
    run.assert_success();
    let v: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let pareto = v["pareto"].as_array().unwrap();
    let degree = |l: &serde_json::Value, key: &str| l[key].as_u64().unwrap();
    let mut with_cp = 0;
    for p in pareto {
        let l = &p["layout"];
        let gpus: u64 = ["dp", "cp", "tp", "pp"]
            .iter()
            .map(|k| degree(l, k))
            .product();
        assert_eq!(gpus, 8, "{l}");
        assert_eq!(
            l["sequence_parallel"].as_bool(),
            Some(degree(l, "tp") > 1),
            "{l}"
        );
        if degree(l, "cp") > 1 {
            with_cp += 1;
            assert!(p["prediction"]["breakdown"]["cp_comm_s"].as_f64().unwrap() >= 0.0);
        }
    }
    assert!(with_cp >= 2, "{}", run.stdout);
    // The table names the degrees.
    let text = merak(&[
        "plan",
        "--model",
        "gpt:layers=32,hidden=4096,heads=32,vocab=128256,seq=32768",
        "--hardware",
        "h100-80g",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--pareto",
        "--cp",
        "1,8",
    ]);
    text.assert_success();
    assert!(text.stdout.contains(" cp=8 "), "{}", text.stdout);
    assert!(!text.stdout.contains(" cp=4 "), "{}", text.stdout);
}

/// Issue 32: `merak plan` for Mixtral 8x7B on 64 H100s names its active parameters and puts
/// expert-parallel plans on the Pareto set (`--ep` names the degrees); `merak simulate` takes
/// `ep=8` for Megatron-Core's layout and reports the all-to-alls.
#[test]
fn plan_and_simulate_a_mixture_of_experts() {
    let run = merak(&[
        "plan",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        "h100-80g",
        "--gpus",
        "64",
        "--global-batch",
        "256",
        "--pareto",
        "--ep",
        "1,8",
    ]);
    run.assert_success();
    assert!(
        run.stdout.contains("(47.39B parameters, 13.57B active)"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains(" ep=8 "), "{}", run.stdout);
    assert!(!run.stdout.contains(" ep=4 "), "{}", run.stdout);
    let sim = merak(&[
        "simulate",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        "h100-80g",
        "--gpus",
        "64",
        "--global-batch",
        "256",
        "--layout",
        "dp=16,pp=4,v=8,mbs=1,schedule=interleaved,zero=1,ep=8",
    ]);
    sim.assert_success();
    assert!(sim.stdout.contains("ep_comm_s"), "{}", sim.stdout);
    let bad = merak(&[
        "plan",
        "--model",
        "moe-tiny",
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--ep",
        "0",
    ]);
    assert_eq!(bad.code, Some(2), "{bad:?}");
    assert!(
        bad.stderr.contains("--ep: degrees must be at least 1"),
        "{}",
        bad.stderr
    );
}
