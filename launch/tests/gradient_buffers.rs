//! `parallel.gradient_buffers = "device"`: gradients kept as the backend's tensors (summed over
//! the micro-batches there, each bucket all-reduced as one tensor after the backward pass)
//! train as the host buckets do, under every way a gradient reaches the reducer: micro-batches
//! adding up, data and tensor parallelism, a tied embedding summed over pipeline stages, and
//! zero-bubble's weight gradients delivered after the backward pass. On the CPU both are host
//! memory; on a GPU the same code keeps them in device memory.

mod common;
use common::*;

/// The device path on top of `extra`.
fn device(extra: &[&'static str]) -> Vec<&'static str> {
    [&["--set", "parallel.gradient_buffers=device"][..], extra].concat()
}

#[test]
fn device_gradient_buffers_train_as_one_process_with_host_buckets() {
    let single = out_dir("gb-host-single");
    run_pp(0, &single, &["--set", "parallel.gradient_buffers=host"]).assert_success();
    // One process: the same sums in the same order, so the same bits.
    let one = out_dir("gb-device-single");
    run_pp(0, &one, &device(&[])).assert_success();
    assert_eq!(
        series_of(&one, "loss"),
        series_of(&single, "loss"),
        "one process, device buffers"
    );
    assert_same_params("one process, device buffers", &one, &single);
    for (np, name, extra) in [
        (2, "gb-device-dp2", vec!["--dp", "2"]),
        (2, "gb-device-tp2", vec!["--tp", "2"]),
        // A tied embedding summed over the stages, and W passes delivering weight gradients
        // after the backward pass, under data parallelism.
        (
            4,
            "gb-device-dp2-pp2-zb",
            vec!["--dp", "2", "--pp", "2", "--set", "parallel.schedule=zb-h1"],
        ),
    ] {
        let out = out_dir(name);
        run_pp(np, &out, &device(&extra)).assert_success();
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
}

/// Under ZeRO the reducers keep their slices in host memory: "device" has no effect there, and
/// the run trains with one warning naming the key and why (as every setting idle in its layout).
#[test]
fn device_gradient_buffers_under_zero_train_with_a_warning_naming_the_key() {
    let out = out_dir("gb-device-zero1");
    let run = run_pp(0, &out, &device(&["--set", "parallel.zero=1"]));
    run.assert_success();
    let warned = "parallel.gradient_buffers = \"device\" has no effect in this layout \
                  (parallel.zero = 1: ZeRO's reducers keep their slices in host memory)";
    assert_eq!(run.stderr.matches(warned).count(), 1, "{}", run.stderr);
}
