//! End-to-end tests of run ownership and crash consistency: `merak train` never changes what
//! another run wrote, never forks its own history silently, and a job killed at any point of
//! a save or a prune resumes from what is on disk exactly like the run that was never killed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::Checkpoint;
use merak_burn::checkpoint::fault::{ABORT_AT, POINTS};
use merak_tests::{Run, run_with_deadline};

mod common;
use common::*;

/// `merak train` (one process, tiny GPT, synthetic data, a constant learning rate so that a
/// run can be continued to any length) for `steps` steps into `out`; `extra` goes last.
fn train_cmd(out: &Path, steps: usize, extra: &[&str]) -> Command {
    let mut cmd = merak(0);
    let steps = format!("train.steps={steps}");
    let constant = [
        "--set",
        "train.min_lr=3e-3",
        "--set",
        "train.warmup_steps=0",
    ];
    train_args(&mut cmd, out, &[&["--set", &steps][..], &constant].concat());
    cmd.args(extra);
    cmd
}

fn run(cmd: Command) -> Run {
    run_with_deadline(cmd, Duration::from_secs(120))
}

/// Every file under `dir` with its bytes (to check that nothing changed).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut all = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("readable") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                all.insert(p.clone(), std::fs::read(&p).expect("file"));
            }
        }
    }
    all
}

#[test]
fn a_fresh_run_refuses_a_folder_holding_another_run_and_replace_says_what_it_removed() {
    let out = out_dir("lineage-taken");
    let every = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=0"];
    run(train_cmd(&out, 3, &every)).assert_success();
    std::fs::write(out.join("notes.txt"), "mine").expect("a user's file");
    let before = snapshot(&out);
    let refused = run(train_cmd(&out, 2, &[]));
    assert_eq!(refused.code, Some(2), "{refused:?}");
    let e = &refused.stderr;
    assert!(
        e.contains("holds another run") && e.contains("--resume") && e.contains("--replace"),
        "{e}"
    );
    assert_eq!(snapshot(&out), before, "a refused run changed the folder");
    // A checkpoint folder of another run is refused even under a new --out.
    let elsewhere = out_dir("lineage-elsewhere");
    let root = format!("checkpoint.dir={}", out.join("checkpoints").display());
    let refused = run(train_cmd(&elsewhere, 2, &["--set", &root]));
    assert_eq!(refused.code, Some(2), "{refused:?}");
    assert_eq!(snapshot(&out), before);

    let replaced = run(train_cmd(&out, 2, &["--replace"]));
    replaced.assert_success();
    for gone in [
        "step-00000001",
        "step-00000003",
        "metrics.jsonl",
        "config.toml",
    ] {
        assert!(
            replaced.stderr.contains(&format!("{gone} (another run's)")),
            "{gone}: {}",
            replaced.stderr
        );
    }
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).expect("kept"),
        "mine"
    );
    assert_eq!(read_metrics(&out).len(), 2);
}

#[test]
fn resuming_an_older_checkpoint_is_refused_unless_branching_which_deletes_nothing() {
    let out = out_dir("lineage-older");
    let every = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=0"];
    run(train_cmd(&out, 4, &every)).assert_success();
    let step2 = out.join("checkpoints/step-00000002");
    let before = snapshot(&out);
    // The case: keep=1 would have pruned the new checkpoint and left `latest` dangling.
    let mut cmd = resume_cmd(0, &step2, &out);
    cmd.args(["--set", "train.steps=6", "--set", "checkpoint.keep=1"]);
    let refused = run(cmd);
    assert_eq!(refused.code, Some(2), "{refused:?}");
    assert!(
        refused.stderr.contains("steps 3, 4") && refused.stderr.contains("--branch"),
        "{}",
        refused.stderr
    );
    assert_eq!(snapshot(&out), before);

    let mut cmd = resume_cmd(0, &step2, &out);
    cmd.args([
        "--branch",
        "--set",
        "train.steps=6",
        "--set",
        "checkpoint.keep=1",
    ]);
    run(cmd).assert_success();
    // The later checkpoints are a branch: whole, and resumable.
    let branch = out.join("checkpoints/branch-1");
    let moved = Checkpoint::open(&branch).expect("the branch opens");
    assert_eq!(moved.manifest.step, 4);
    assert!(branch.join("step-00000003/manifest.json").exists());
    assert_eq!(
        read_metrics(&branch).len(),
        4,
        "the branch keeps its metrics"
    );
    // The new line of the run goes on from step 2.
    let latest = Checkpoint::open(&out.join("checkpoints")).expect("opens");
    assert_eq!(latest.manifest.step, 6);
    assert_eq!(latest.manifest.run, moved.manifest.run, "one lineage");
    let steps: Vec<u64> = read_metrics(&out)
        .iter()
        .map(|r| r["step"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6]);
}

/// The uninterrupted reference of the crash tests: 6 steps, a checkpoint every 2.
fn reference(name: &str) -> (PathBuf, Vec<serde_json::Value>) {
    let out = out_dir(&format!("lineage-crash-{name}reference"));
    run(train_cmd(&out, 6, &CRASH_RUN)).assert_success();
    let m = read_metrics(&out);
    (out, m)
}

const CRASH_RUN: [&str; 4] = ["--set", "checkpoint.every=2", "--set", "checkpoint.keep=1"];

/// Trains the crash run (with `extra`) with `MERAK_ABORT_AT=spec`; asserts that it was killed
/// there.
fn killed_at(out: &Path, spec: &str, extra: &[&str]) {
    let mut cmd = train_cmd(out, 6, &[&CRASH_RUN[..], extra].concat());
    // An abort may dump core where the process runs: in the test's own scratch folder.
    cmd.env(ABORT_AT, spec)
        .current_dir(out.parent().unwrap_or(out));
    let killed = run(cmd);
    assert_eq!(
        killed.code, None,
        "{spec}: the process was to abort: {killed:?}"
    );
    assert!(
        killed
            .stderr
            .contains(spec.split('@').next().unwrap_or(spec)),
        "{}",
        killed.stderr
    );
}

#[test]
fn a_job_killed_at_every_point_of_save_and_prune_resumes_like_the_uninterrupted_run() {
    killed_everywhere_resumes("", &[]);
}

/// The same with asynchronous saves: the writer thread is in flight at `save:writing`, and
/// the other points are reached when the save is completed after a later step.
#[test]
fn a_job_killed_at_every_point_of_an_asynchronous_save_resumes_like_the_uninterrupted_run() {
    killed_everywhere_resumes("async-", &["--set", "checkpoint.async=true"]);
}

/// Kills the crash run (with `extra`) at every point of its second save or first prune,
/// resumes it, and compares it with the uninterrupted run (synchronous saves).
fn killed_everywhere_resumes(name: &str, extra: &[&str]) {
    let (reference, want) = reference(name);
    let final_state = |out: &Path| {
        Checkpoint::open(&out.join("checkpoints"))
            .and_then(|c| c.read_full())
            .expect("the final checkpoint reads")
            .params
    };
    let want_params = final_state(&reference);
    for point in POINTS {
        if matches!(point, "save:pointed" | "save:replaced") {
            continue; // same-step replacement: a run never saves a step twice (library tests)
        }
        // Killed in the second save (step 4); the first prune removal happens there too.
        let spec = if point.starts_with("prune") {
            format!("{point}@1")
        } else {
            format!("{point}@2")
        };
        let out = out_dir(&format!("lineage-crash-{name}{}", point.replace(':', "-")));
        killed_at(&out, &spec, extra);
        let mut cmd = resume_cmd(0, &out.join("checkpoints"), &out);
        cmd.args(["--set", "train.steps=6"]);
        let resumed = run(cmd);
        resumed.assert_success();
        let got = read_metrics(&out);
        assert_eq!(got.len(), 6, "{point}: steps 1..=6 in metrics.jsonl");
        for key in ["loss", "grad_norm"] {
            assert_eq!(series(&got, key), series(&want, key), "{point}: {key}");
        }
        assert_eq!(final_state(&out), want_params, "{point}: final parameters");
    }
}

#[test]
fn a_first_save_killed_before_its_rename_leaves_a_clean_no_checkpoint_yet() {
    for point in ["save:begun", "save:shards", "save:manifest"] {
        let out = out_dir(&format!("lineage-first-{}", point.replace(':', "-")));
        killed_at(&out, &format!("{point}@1"), &[]);
        let mut cmd = resume_cmd(0, &out.join("checkpoints"), &out);
        cmd.args(["--set", "train.steps=6"]);
        let refused = run(cmd);
        assert_eq!(refused.code, Some(2), "{point}: {refused:?}");
        assert!(
            refused.stderr.contains("no checkpoint yet"),
            "{point}: {}",
            refused.stderr
        );
        assert!(!refused.stderr.contains("panicked"), "{}", refused.stderr);
    }
}

/// Trains into `out` with files limited to `max_bytes` each (`RLIMIT_FSIZE`, SIGXFSZ ignored:
/// a write past it fails with EFBIG, as a full disk fails with ENOSPC).
fn train_with_file_limit(out: &Path, max_bytes: u64) -> Run {
    use std::os::unix::process::CommandExt;
    let mut cmd = train_cmd(out, 2, &[]);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: max_bytes,
                rlim_max: max_bytes,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    run(cmd)
}

/// Every file under `dir` that is empty or a leftover of a write (temporary, partial, probe).
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    snapshot(dir)
        .into_iter()
        .filter(|(p, bytes)| {
            let hidden = (p.strip_prefix(dir).unwrap_or(p).components())
                .any(|c| c.as_os_str().to_string_lossy().starts_with('.'));
            bytes.is_empty() || hidden || p.extension().is_some_and(|e| e == "tmp")
        })
        .map(|(p, _)| p)
        .collect()
}

#[test]
fn a_disk_that_takes_no_more_bytes_is_named_at_start_and_leaves_no_empty_files() {
    // Not a byte: the run folder's lock, its first write, fails before anything is built.
    let out = out_dir("lineage-full-disk");
    let run = train_with_file_limit(&out, 0);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("cannot lock the run folder")
            && run
                .stderr
                .contains(&out.join("run.lock").display().to_string()),
        "{}",
        run.stderr
    );
    assert!(
        !out.exists(),
        "the refused run removes the empty folder it made"
    );
    // A byte, not a lock record: the file that fails is named, and nothing is left behind.
    let out = out_dir("lineage-nearly-full-disk");
    let run = train_with_file_limit(&out, 1);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        run.stderr.contains(&out.display().to_string()),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    // The lock record does not fit either: the refused run removes its folder again.
    assert!(!out.exists(), "{:?}", leftovers(&out));
    // Room for the run's small files but not for a checkpoint: the save fails naming the
    // shard, and its partial folder is removed again (the space is free).
    let out = out_dir("lineage-full-disk-at-save");
    let run = train_with_file_limit(&out, 4096);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        run.stderr.contains("tp00-dp000-pp00.safetensors"),
        "{}",
        run.stderr
    );
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
}
