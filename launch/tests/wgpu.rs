//! End-to-end tests of the `wgpu` device (`train.device = "wgpu"`) on the machine's adapter:
//! Mesa's software Vulkan driver (llvmpipe) where there is no GPU, as in CI, which runs the
//! same WGSL kernels a GPU runs, slowly. One process on wgpu follows the CPU backend within a
//! looser bound (the kernels sum in another order); under `mpirun` (MPI on host buffers), data,
//! tensor (with sub-pipelined overlap) and pipeline parallelism on wgpu equal one wgpu process
//! at the usual 1e-5; so does one wgpu process with packed documents. A machine without an
//! adapter gets a clear error before training. One rank reads the device once a step, and logs
//! its allocator's reserved bytes.

mod common;
use common::*;

use std::process::Command;

/// The tiny GPT on wgpu, one llvmpipe thread per rank (two cores shared by up to 2 ranks).
fn on_wgpu(cmd: &mut Command, out: &std::path::Path, extra: &[&str]) {
    cmd.env("LP_NUM_THREADS", "1");
    train_args(
        cmd,
        out,
        &["--set", "train.device=wgpu", "--set", "train.micro_batch=2"],
    );
    cmd.args(extra);
}

fn run_wgpu(np: usize, out: &std::path::Path, extra: &[&str]) -> merak_tests::Run {
    let mut cmd = merak(np);
    on_wgpu(&mut cmd, out, extra);
    merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(600))
}

/// Trains one wgpu process and the CPU backend alike (`extra` added to both) into
/// `name` and `name-cpu-reference`, and asserts that their losses agree within 1e-4 (the f32
/// kernels sum in another order). Returns the wgpu run and its folder.
fn wgpu_against_cpu(name: &str, extra: &[&str]) -> (merak_tests::Run, std::path::PathBuf) {
    let wgpu = out_dir(name);
    let run = run_wgpu(0, &wgpu, extra);
    run.assert_success();
    let cpu = out_dir(&format!("{name}-cpu-reference"));
    run_pp(0, &cpu, extra).assert_success();
    let diff = max_relative(&series_of(&wgpu, "loss"), &series_of(&cpu, "loss"));
    assert!(diff < 1e-4, "{name}: wgpu against the CPU: {diff:e}");
    // One rank reads the device once a step: its losses (all micro-batches) with the
    // gradient norm's sums (all parameters); the CPU backend's sums are host values already.
    assert_host_reads(name, &wgpu, 1);
    assert_host_reads(&format!("{name} on the CPU"), &cpu, 1);
    // The allocator's reserved bytes: CubeCL's on wgpu, every step; none on the CPU.
    let reserved = |out: &std::path::Path| -> Vec<Option<u64>> {
        (read_metrics(out).iter())
            .map(|m| m["device_reserved_bytes"].as_u64())
            .collect()
    };
    let on_gpu = reserved(&wgpu);
    assert!(
        on_gpu.iter().all(|r| r.is_some_and(|b| b > 0)),
        "{name}: reserved bytes {on_gpu:?}"
    );
    assert!(reserved(&cpu).iter().all(Option::is_none), "{name}: CPU");
    (run, wgpu)
}

/// Asserts that every step of the run in `out` read tensors into host memory `want` times.
fn assert_host_reads(name: &str, out: &std::path::Path, want: u64) {
    let reads: Vec<Option<u64>> = (read_metrics(out).iter())
        .map(|m| m["host_reads"].as_u64())
        .collect();
    assert!(
        !reads.is_empty() && reads.iter().all(|&r| r == Some(want)),
        "{name}: host reads per step {reads:?}, want {want}"
    );
}

/// One wgpu process against the CPU backend (measured on llvmpipe: 3.8e-8 after 5 steps), then
/// dp 2, tp 2 with `tp_overlap = 2`, and pp 2 on wgpu against the one wgpu process.
#[test]
fn wgpu_trains_as_the_cpu_and_its_layouts_equal_one_process() {
    let (run, single) = wgpu_against_cpu("wgpu-single", &[]);
    assert!(
        run.stderr.contains("self-test passed") || run.stdout.contains("self-test passed"),
        "no self-test: {}",
        run.stderr
    );
    if run.stderr.contains("(Cpu, ") {
        assert!(
            run.stderr.contains("is a software driver on the CPU"),
            "no warning: {}",
            run.stderr
        );
    }
    for (np, name, extra) in [
        (2, "wgpu-dp2", vec!["--dp", "2"]),
        (
            2,
            "wgpu-tp2-overlap2",
            vec!["--tp", "2", "--set", "parallel.tp_overlap=2"],
        ),
        (2, "wgpu-pp2", vec!["--pp", "2"]),
    ] {
        let out = out_dir(name);
        run_wgpu(np, &out, &extra).assert_success();
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
}

/// Packed documents (`data.document_mask`; a vocabulary of 64 puts several documents in every
/// synthetic window): the attention kernel skips the keys of other documents on wgpu as the
/// CPU's blockwise kernel does, so one wgpu process follows the CPU within the same bound.
#[test]
fn wgpu_document_masks_train_as_the_cpu() {
    let masked = [
        "--set",
        "model.vocab_size=64",
        "--set",
        "data.document_mask=true",
    ];
    // Measured on llvmpipe: 5.8e-8 after 5 steps.
    wgpu_against_cpu("wgpu-docs", &masked);
}

/// Without a Vulkan driver (the loader pointed at none) the run stops before training, naming
/// the device and what to install, and writes no metrics.
#[test]
fn no_adapter_is_a_clear_error_before_training() {
    let out = out_dir("wgpu-no-adapter");
    let mut cmd = merak(0);
    cmd.env("VK_ICD_FILENAMES", "/nonexistent/none.json")
        .env("VK_DRIVER_FILES", "/nonexistent/none.json");
    on_wgpu(&mut cmd, &out, &[]);
    let run = merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(120));
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(
        run.stderr
            .contains("train.device = \"wgpu\": no GPU adapter was found")
            && run.stderr.contains("mesa-vulkan-drivers"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(!out.join("metrics.jsonl").exists());
}
