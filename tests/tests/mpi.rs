//! Multi-rank tests: each spawns `mpirun` on the `mpi-worker` binary and checks that every rank
//! reports success. The worker compares each parallel result with a serial computation.

use std::time::Duration;

use merak_tests::{Run, mpirun, run_with_deadline};

fn worker(np: usize, scenario: &str) -> Run {
    let mut cmd = mpirun(np);
    cmd.arg(env!("CARGO_BIN_EXE_mpi-worker")).arg(scenario);
    run_with_deadline(cmd, Duration::from_secs(120))
}

fn assert_all_ranks_ok(np: usize, scenario: &str) {
    worker(np, scenario).assert_all_ranks_ok(np, scenario);
}

#[test]
fn communicator_matches_serial_on_1_2_3_4_ranks() {
    for np in 1..=4 {
        assert_all_ranks_ok(np, "comm");
    }
}

#[test]
fn grid_groups_hold_the_right_ranks() {
    for np in [2, 4, 8] {
        assert_all_ranks_ok(np, "grid");
    }
}

#[test]
fn tensor_parallel_layers_equal_serial_for_tp_1_2_4() {
    for np in [1, 2, 4] {
        assert_all_ranks_ok(np, "layers");
    }
}

#[test]
fn overlapped_tensor_parallel_products_equal_serial_for_tp_1_2_4() {
    for np in [1, 2, 4] {
        assert_all_ranks_ok(np, "overlap");
    }
}

#[test]
fn a_sequence_parallel_block_equals_one_rank_for_tp_1_2_4() {
    for np in [1, 2, 4] {
        assert_all_ranks_ok(np, "sequence");
    }
}

#[test]
fn a_communication_thread_gives_the_same_collectives_and_overlapped_layers() {
    for np in [1, 2, 4] {
        assert_all_ranks_ok(np, "thread");
    }
}

/// ZeRO-2's reduce-scattered chunks, ZeRO-1's chunks of the all-reduced buckets and (at
/// dp = 4) hybrid sharding's chunks are each rank's pieces of the all-reduced gradients.
#[test]
fn reduce_scattered_gradients_are_each_ranks_pieces_of_the_all_reduced_ones() {
    for np in [1, 2, 3, 4] {
        assert_all_ranks_ok(np, "scatter");
    }
}

#[test]
fn a_panicking_rank_ends_the_job_promptly_and_is_named() {
    let run = worker(3, "panic");
    assert!(!run.timed_out, "the job hung: {run:?}");
    assert!(
        run.elapsed < Duration::from_secs(30),
        "took {:?}",
        run.elapsed
    );
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        run.stderr.contains("rank 1 panicked: deliberate failure"),
        "stderr does not name the rank and cause:\n{}",
        run.stderr
    );
}
