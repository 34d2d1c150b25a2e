//! `merak plan` and `merak simulate` on the command line.

use std::process::Command;
use std::time::Duration;

use merak_tests::run_with_deadline;

mod common;
use common::assert_refused;

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

/// Issue 50: `merak plan --ep` on a dense model was ignored and `--cp 3`/`--ep 3` failed
/// without naming their flag; a flag that cannot apply is refused, naming it and the numbers,
/// and the folder `--output` would have been written into is not left behind.
#[test]
fn plan_flags_that_cannot_apply_are_refused_naming_them() {
    let folder = merak_tests::fresh_folder("plan-refused-flags");
    let output = folder.join("new/plan.json");
    let output = output.to_str().unwrap();
    for (args, text) in [
        (
            &["--model", "gpt2", "--gpus", "4", "--ep", "2"][..],
            "--ep 2: --model \"gpt2\" is dense (no model.moe)",
        ),
        (
            &["--model", "moe-tiny", "--gpus", "4", "--ep", "3"],
            "--ep 3 does not divide the 4 experts (model.moe.experts) of --model \"moe-tiny\"",
        ),
        (
            &["--model", "gpt2", "--gpus", "4", "--cp", "3"],
            "--cp 3 does not divide --gpus 4",
        ),
        (
            &["--model", "gpt2", "--gpus", "1", "--tp-overlap", "2"],
            "--tp-overlap 2: sub-pipelining splits tensor parallelism's all-reduces",
        ),
        (
            &["--model", "gpt2", "--gpus", "4", "--memory-gib", "0.01"],
            "--model \"gpt2\" on --gpus 4 with --global-batch 8 and --memory-gib 0.01: no plan \
             fits",
        ),
    ] {
        let mut all = vec!["plan", "--global-batch", "8", "--output", output];
        all.extend_from_slice(args);
        assert_refused(&merak(&all), text);
        assert!(!folder.join("new").exists(), "{args:?} left its folder");
    }
}

/// Issue 50: `merak simulate --plan` took a layout with `zero: 7` and dropped a shard group
/// that divides nothing; every field is checked naming it, and an unknown one is refused.
#[test]
fn simulate_refuses_a_plan_file_with_a_bad_field_naming_it() {
    let folder = merak_tests::fresh_folder("simulate-bad-plan");
    let path = folder.join("plan.json");
    let job = [
        "--model",
        "tiny",
        "--gpus",
        "4",
        "--hardware",
        "local-cpu",
        "--global-batch",
        "8",
    ];
    let mut plan_args = vec!["plan", "--output", path.to_str().unwrap()];
    plan_args.extend_from_slice(&job);
    merak(&plan_args).assert_success();
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("a plan");
    let dp = plan["plan"]["layout"]["dp"].as_u64().unwrap();
    let mut simulate_args = vec!["simulate", "--plan", path.to_str().unwrap()];
    simulate_args.extend_from_slice(&job);
    merak(&simulate_args).assert_success();
    let bad_shard = format!(
        "plan.layout.shard = {}: must divide plan.layout.dp = {dp}",
        dp + 1
    );
    for (key, value, text) in [
        (
            "zero",
            7.into(),
            "plan.layout.zero = 7: not a supported ZeRO stage (0, 1, 2 or 3)",
        ),
        ("shard", (dp + 1).into(), bad_shard.as_str()),
        ("speed", 1.into(), "plan.layout: unknown field `speed`"),
    ] {
        let mut bad = plan.clone();
        bad["plan"]["layout"][key] = value;
        std::fs::write(&path, serde_json::to_vec_pretty(&bad).unwrap()).unwrap();
        let run = merak(&simulate_args);
        assert_refused(&run, text);
        assert!(run.stderr.contains("plan.json"), "{}", run.stderr);
    }
}
