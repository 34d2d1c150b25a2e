//! CPU-side guards for the GPU benchmark (`benches/gpu`), which CI cannot run: its scripts
//! parse, its phases run dry on the CPU, its report reproduces the recorded results of the
//! first GPU run from their raw records, and CUDA builds keep CubeCL's autotuner off by default (with it on, the first GPU
//! run's 3-step tiny GPT did not finish in 150 s).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("launch/ has a parent")
        .to_path_buf()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The standard output of `python3 SCRIPT ARGS...` (script and paths from the repository root),
/// which must succeed.
fn python(script: &str, args: &[String]) -> String {
    let out = Command::new("python3")
        .arg(root().join(script))
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// Asserts that `text` holds every one of `rows` (the figures the book quotes).
fn assert_rows(text: &str, rows: &[&str]) {
    for row in rows {
        assert!(text.contains(row), "missing {row:?} in\n{text}");
    }
}

#[test]
fn the_gpu_scripts_parse() {
    for script in [
        "benches/gpu/run.sh",
        "benches/gpu/diagnose.sh",
        "benches/gpu/bundle.sh",
        "scripts/gpu-bundle.sh",
    ] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(root().join(script))
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_report_reproduces_the_recorded_gpu_results() {
    let results = "benches/gpu/results/2026-11-26-h200";
    let report = python(
        "benches/gpu/report.py",
        &[root().join(results).display().to_string()],
    );
    assert_eq!(report, read(&format!("{results}/report.md")));
    // The figures the book quotes (docs/src/benchmarks/gpu.md).
    assert_rows(
        &report,
        &[
            "| gpt2 | merak bf16 | 16 | 15,231 | 1.3% | 19609 |",
            "| gpt2 | torch eager bf16 | 16 | 217,780 | 18.8% | 14857 |",
            "| gpt2-medium | megatron-core bf16 | 16 | 54,641 | 13.4% | 60631 |",
            "| tp2 | 1.37e-06 |",
            "| pp2 | 8.59e-07 |",
            "peak 989 TFLOP/s",
        ],
    );
}

#[test]
fn the_kernel_summary_reproduces_the_recorded_profiles() {
    let results = "benches/gpu/results/2026-11-26-h200-profile";
    for build in ["untuned", "autotuned"] {
        let log = root().join(format!("{results}/{build}/cubecl-profile.log.gz"));
        let args = [log.display().to_string(), "--steps".into(), "4".into()];
        let summary = python("benches/gpu/kernel_profile.py", &args);
        assert_eq!(
            summary,
            read(&format!("{results}/{build}/kernel-profile.md"))
        );
    }
    // The figures the book quotes (docs/src/benchmarks/gpu.md).
    assert_rows(
        &read(&format!("{results}/untuned/kernel-profile.md")),
        &[
            "4620 a step; their time 806.0 ms a step",
            "| matrix product | 231 | 327.9 | 40.7% |",
            "| reduction (sum, max, mean, argmax) | 436 | 258.2 | 32.0% |",
        ],
    );
    assert_rows(
        &read(&format!("{results}/autotuned/kernel-profile.md")),
        &[
            "| element-wise | 3202 | 166.5 | 47.6% |",
            "| matrix product | 230 | 106.0 | 30.3% |",
        ],
    );
}

#[test]
fn cuda_builds_leave_autotune_off_unless_asked() {
    let workspace: toml::Table = read("Cargo.toml").parse().expect("Cargo.toml parses");
    let features = &workspace["workspace"]["dependencies"]["burn-cuda"]["features"];
    let features: Vec<&str> = features
        .as_array()
        .expect("burn-cuda lists its features")
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert!(!features.contains(&"autotune"), "{features:?}");
    let library: toml::Table = read("merak-burn/Cargo.toml").parse().expect("parses");
    let opt_in = library["features"]["cuda-autotune"]
        .as_array()
        .expect("merak-burn has the cuda-autotune feature");
    assert!(
        opt_in
            .iter()
            .any(|f| f.as_str() == Some("burn-cuda/autotune"))
    );
}

/// The dry run (`DRY_RUN=1`) runs the phases a GPU session starts with on this machine: every
/// `merak train` of `small`, `kernels` and `changes` on the CPU (so a wrong key or flag fails
/// here, not on the GPU), each Python script compiled, and the report with its table of changes
/// runs, each reading the device once a step, and its table of the kernels' tiny runs against
/// the CPU's.
#[test]
fn the_dry_run_runs_the_phases_on_the_cpu() {
    let results = tempfile::tempdir().expect("a scratch folder");
    let merak = Path::new(env!("CARGO_BIN_EXE_merak"));
    // The dry run writes only under RESULTS: no bytecode beside the scripts it compiles.
    let caches = ["benches/gpu/__pycache__", "benches/pytorch/__pycache__"].map(|d| root().join(d));
    let absent: Vec<&PathBuf> = caches.iter().filter(|d| !d.exists()).collect();
    let out = Command::new("bash")
        .arg(root().join("benches/gpu/run.sh"))
        .args(["small", "kernels", "changes", "report"])
        .env("DRY_RUN", "1")
        .env("DRY_RUN_BIN", merak.parent().expect("a folder"))
        .env("RESULTS", results.path())
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for d in absent {
        assert!(!d.exists(), "the dry run wrote {}", d.display());
    }
    let timings = std::fs::read_to_string(results.path().join("timings.txt")).expect("timings");
    let runs: Vec<&str> = timings.lines().collect();
    // small: merak bf16 and fp32, three PyTorch scripts and Megatron's; kernels: eight kernels
    // alone, the tiny GPT on the CPU, in fp32, bf16 and bf16 with each tile product, GPT-2 fused
    // and composed, PyTorch's; changes: six runs per model.
    assert_eq!(runs.len(), 6 + 16 + 12, "{timings}");
    assert!(runs.iter().all(|l| l.contains("exit   0")), "{timings}");
    for run in [
        "changes-gpt2-bf16-cublaslt",
        "changes-gpt2-bf16-attention-cmma",
        "changes-gpt2-medium-bf16-both",
        "changes-gpt2-medium-bf16-default-matmul",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("| {run} |")) && l.contains("| 1 |")),
            "{run} missing or not one read a step in\n{stdout}"
        );
    }
    for run in ["kernels-tiny-cuda-bf16-cmma", "kernels-only-bias"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("| {run} | 3 | ")) && !l.contains("failed")),
            "{run} missing from the kernels' table in\n{stdout}"
        );
    }
}
