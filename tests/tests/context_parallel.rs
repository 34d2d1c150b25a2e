//! Context parallelism across processes: `mpirun` runs the `cp-worker` binary on 1, 2, 3 and
//! 4 ranks; each rank checks its shard of the ring (or the all-to-all, Ulysses) attention's
//! context and Q/K/V gradient against its shard of the single-rank attention of the whole
//! sequences (relative error at most 1e-5; causal and bidirectional, with and without segment
//! ids) and reports success.

use std::time::Duration;

use merak_tests::{mpirun, run_with_deadline};

fn assert_all_ranks_ok(np: usize, scenario: &str) {
    let mut cmd = mpirun(np);
    cmd.arg(env!("CARGO_BIN_EXE_cp-worker")).arg(scenario);
    run_with_deadline(cmd, Duration::from_secs(180)).assert_all_ranks_ok(np, scenario);
}

#[test]
fn ring_attention_equals_the_whole_sequence_on_1_2_3_4_ranks() {
    for np in 1..=4 {
        assert_all_ranks_ok(np, "ring");
    }
}

#[test]
fn ulysses_attention_equals_the_whole_sequence_on_1_2_3_4_ranks() {
    for np in 1..=4 {
        assert_all_ranks_ok(np, "ulysses");
    }
}
