//! `merak train --np N` starts its own ranks (mpirun with the flags a local run needs) and
//! trains exactly like the same layout under an explicit mpirun.

mod common;

use std::time::Duration;

use common::{assert_same_run, merak, out_dir, read_metrics, train, train_args};
use merak_tests::run_with_deadline;

#[test]
fn np_starts_the_ranks_and_equals_one_process() {
    let single = train(0, "np-single", &[]);
    let out = out_dir("np-2");
    let mut cmd = merak(0);
    // No mpirun flags and no root variables from the test: `--np` supplies them.
    for var in ["OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] {
        cmd.env_remove(var);
    }
    train_args(&mut cmd, &out, &["--np", "2", "--dp", "2"]);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    assert_same_run("--np 2 --dp 2", &read_metrics(&out), &single);
}

#[test]
fn np_under_mpirun_or_zero_is_refused() {
    let mut cmd = merak(2);
    train_args(&mut cmd, &out_dir("np-nested"), &["--np", "2", "--dp", "2"]);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("drop --np under mpirun"),
        "{}",
        run.stderr
    );

    let mut cmd = merak(0);
    train_args(&mut cmd, &out_dir("np-zero"), &["--np", "0"]);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("--np 0"), "{}", run.stderr);
}
