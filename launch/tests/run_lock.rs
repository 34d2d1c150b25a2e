//! A run folder belongs to one running run: a second command into a folder whose run is still
//! going is refused with exit status 2 naming the holder, whatever it asks (resume, replace,
//! branch); of two runs started at the same instant exactly one trains; `merak train --np`'s
//! launcher holds the lock for its ranks, never leaves mpirun behind, and is bounded by what
//! the machine can start.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{MERAK, merak, out_dir, read_metrics, train_args};
use merak_tests::{Run, run_with_deadline};

/// `merak train` of the tiny GPT on synthetic data into `out` for `steps` steps at a constant
/// learning rate, on one process or (`np` > 0) through `--np np --dp np`.
fn train_cmd(out: &Path, steps: usize, np: usize, extra: &[&str]) -> Command {
    let mut cmd = merak(0);
    let steps = format!("train.steps={steps}");
    let mut args = vec!["--set", &steps, "--set", "train.min_lr=3e-3"];
    let np = np.to_string();
    if np != "0" {
        args.extend(["--np", &np, "--dp", &np]);
    }
    args.extend_from_slice(extra);
    train_args(&mut cmd, out, &args);
    cmd
}

/// Starts `cmd` with its stderr in `log`.
fn start(mut cmd: Command, log: &Path) -> Child {
    let err = std::fs::File::create(log).expect("a log file");
    cmd.stdout(Stdio::null()).stderr(err);
    cmd.spawn().expect("merak starts")
}

/// Waits (at most 60 s) until `ready()`.
fn wait_until(what: &str, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < Duration::from_secs(60), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits at most `secs` for `child` to end; its exit status.
fn wait_for(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return status;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("the command did not end within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn metric_lines(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

fn signal(pid: u32, sig: &str) {
    let sent = Command::new("kill").args([sig, &pid.to_string()]).status();
    assert!(sent.is_ok_and(|s| s.success()), "kill {sig} {pid}");
}

/// Asserts that a second command was refused because the folder is in use by `pid`.
fn assert_refused_by(run: &Run, pid: u32, what: &str) {
    assert_eq!(run.code, Some(2), "{what}: {run:?}");
    let e = &run.stderr;
    assert!(
        e.contains("in use by another run") && e.contains(&format!("pid {pid} on host")),
        "{what}: {e}"
    );
}

/// The steps of the records of `out/metrics.jsonl`.
fn steps(out: &Path) -> Vec<u64> {
    read_metrics(out)
        .iter()
        .map(|r| r["step"].as_u64().expect("a step"))
        .collect()
}

#[test]
fn a_running_runs_folder_refuses_resume_replace_and_branch_and_keeps_its_history() {
    let out = out_dir("lock-running");
    let logs = out_dir("lock-running-logs");
    std::fs::create_dir_all(&logs).expect("made");
    let every = ["--set", "checkpoint.every=5", "--set", "checkpoint.keep=0"];
    let mut first = start(
        train_cmd(&out, 1_000_000, 0, &every),
        &logs.join("first.err"),
    );
    wait_until("the first run did not reach step 6", || {
        metric_lines(&out) >= 6
    });
    let lock = std::fs::read_to_string(out.join("run.lock")).expect("the run's lock file");
    assert!(lock.contains(&format!("\"pid\": {}", first.id())), "{lock}");
    let run_record = std::fs::read(out.join("run.json")).expect("the run record");

    let root = out.join("checkpoints");
    let mut resume = merak(0);
    resume.arg("train").arg("--resume").arg(&root);
    resume.args(["--set", "train.lr=0.02"]);
    let run = run_with_deadline(resume, Duration::from_secs(60));
    assert_refused_by(&run, first.id(), "--resume into the running run's folder");
    let run = run_with_deadline(
        train_cmd(&out, 2, 0, &["--replace"]),
        Duration::from_secs(60),
    );
    assert_refused_by(&run, first.id(), "--replace of the running run");
    let mut branch = merak(0);
    branch
        .arg("train")
        .arg("--resume")
        .arg(root.join("step-00000005"));
    branch.arg("--branch");
    let run = run_with_deadline(branch, Duration::from_secs(60));
    assert_refused_by(&run, first.id(), "--branch of the running run");

    // The first run goes on undisturbed and stops cleanly.
    signal(first.id(), "-TERM");
    let status = wait_for(&mut first, 60);
    let log = std::fs::read_to_string(logs.join("first.err")).unwrap_or_default();
    assert_eq!(status.code(), Some(75), "{log}");
    let k = metric_lines(&out);
    assert_eq!(steps(&out), (1..=k as u64).collect::<Vec<_>>());
    assert_eq!(
        std::fs::read(out.join("run.json")).expect("kept"),
        run_record
    );
    let latest = std::fs::read_to_string(root.join("latest")).expect("latest");
    assert_eq!(latest.trim(), format!("step-{k:08}"));
    assert!(!root.join("branch-1").exists());
    assert!(!out.join("run.lock").exists(), "released at the end");
}

/// Two runs into one folder started together, `rounds` times: exactly one trains (every step
/// once in its metrics), the other exits 2.
fn one_of_two_wins(name: &str, np: usize) {
    let out = out_dir(name);
    let logs = out_dir(&format!("{name}-logs"));
    std::fs::create_dir_all(&logs).expect("made");
    let mut a = start(train_cmd(&out, 30, np, &[]), &logs.join("a.err"));
    let mut b = start(train_cmd(&out, 30, np, &[]), &logs.join("b.err"));
    let mut codes = [wait_for(&mut a, 120).code(), wait_for(&mut b, 120).code()];
    codes.sort();
    let log = |n: &str| std::fs::read_to_string(logs.join(n)).unwrap_or_default();
    let both = format!("a: {}\nb: {}", log("a.err"), log("b.err"));
    assert_eq!(codes, [Some(0), Some(2)], "{both}");
    assert!(
        both.contains("in use by another run") || both.contains("holds another run"),
        "{both}"
    );
    assert_eq!(steps(&out), (1..=30).collect::<Vec<_>>(), "{both}");
}

#[test]
fn of_two_runs_started_at_the_same_instant_exactly_one_trains_and_the_other_exits_2() {
    one_of_two_wins("lock-race-one", 0);
    one_of_two_wins("lock-race-np", 2);
}

/// The processes whose command line names `needle`.
fn processes_naming(needle: &str) -> Vec<String> {
    let out = Command::new("pgrep")
        .args(["-a", "-f", needle])
        .output()
        .expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains("pgrep"))
        .map(str::to_string)
        .collect()
}

#[test]
fn np_holds_the_lock_for_its_ranks_and_a_killed_launcher_leaves_nothing_running() {
    let out = out_dir("lock-np-killed");
    let logs = out_dir("lock-np-killed-logs");
    std::fs::create_dir_all(&logs).expect("made");
    let every = ["--set", "checkpoint.every=2"];
    let mut launcher = start(train_cmd(&out, 1_000_000, 2, &every), &logs.join("np.err"));
    wait_until("the ranks did not train", || metric_lines(&out) >= 3);
    // The launcher holds the folder: its ranks joined, a second command is refused.
    let run = run_with_deadline(train_cmd(&out, 2, 0, &[]), Duration::from_secs(60));
    assert_refused_by(&run, launcher.id(), "a second run beside `--np`'s ranks");
    signal(launcher.id(), "-KILL");
    let _ = wait_for(&mut launcher, 10);
    let needle = out.display().to_string();
    let start = Instant::now();
    while !processes_naming(&needle).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "left running after the launcher died: {:?}",
            processes_naming(&needle)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its lock file stays behind, naming a process that is gone: the next run takes it over.
    assert!(out.join("run.lock").exists());
    let steps = format!("train.steps={}", metric_lines(&out) + 2);
    let mut resume = merak(0);
    resume
        .arg("train")
        .arg("--resume")
        .arg(out.join("checkpoints"));
    resume.args(["--set", &steps]);
    let run = run_with_deadline(resume, Duration::from_secs(120));
    run.assert_success();
    assert!(
        run.stderr.contains("taking over the lock"),
        "{}",
        run.stderr
    );
}

/// A stand-in for mpirun on `PATH`: writes its pid, ignores SIGUSR1 (a job that does not
/// stop) and sleeps until it is killed.
fn fake_mpirun(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).expect("made");
    let script = dir.join("mpirun");
    let pid_file = dir.join("mpirun.pid");
    let text = format!(
        "#!/bin/sh\ntrap '' USR1\necho $$ > {}\nexec sleep 1000\n",
        pid_file.display()
    );
    std::fs::write(&script, text).expect("written");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    pid_file
}

fn with_path(cmd: &mut Command, dir: &Path) {
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("{}:{path}", dir.display()));
}

/// Whether process `pid` has ended (gone, or a zombie no one reaped).
fn ended(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'))
    })
}

#[test]
fn a_job_that_ignores_the_stop_signal_is_ended_after_the_grace_and_a_dead_launcher_ends_mpirun() {
    let dir = out_dir("lock-fake-mpirun");
    let pid_file = fake_mpirun(&dir.join("bin"));
    let grace = ["--set", "train.comm_timeout_s=1"];
    let mut cmd = train_cmd(&dir.join("run"), 5, 2, &grace);
    with_path(&mut cmd, &dir.join("bin"));
    let mut launcher = start(cmd, &dir.join("launcher.err"));
    wait_until("mpirun did not start", || pid_file.exists());
    signal(launcher.id(), "-TERM");
    let status = wait_for(&mut launcher, 20);
    let log = std::fs::read_to_string(dir.join("launcher.err")).unwrap_or_default();
    assert_eq!(status.code(), Some(130), "{log}");
    assert!(log.contains("did not stop within 1 s"), "{log}");

    std::fs::remove_file(&pid_file).expect("removed");
    let mut cmd = train_cmd(&dir.join("run2"), 5, 2, &[]);
    with_path(&mut cmd, &dir.join("bin"));
    let mut launcher = start(cmd, &dir.join("launcher2.err"));
    wait_until("mpirun did not start", || pid_file.exists());
    let mpirun = std::fs::read_to_string(&pid_file).expect("its pid");
    signal(launcher.id(), "-KILL");
    let _ = wait_for(&mut launcher, 10);
    wait_until("mpirun outlived its launcher", || ended(mpirun.trim()));
}

#[test]
fn np_beyond_what_the_machine_can_start_is_refused_at_once_naming_the_numbers() {
    let out = out_dir("lock-np-huge");
    let mut cmd = Command::new(MERAK);
    train_args(&mut cmd, &out, &["--np", "100000"]);
    let run = run_with_deadline(cmd, Duration::from_secs(30));
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("--np 100000") && run.stderr.contains("core"),
        "{run:?}"
    );
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    // A low open-files limit (hard, so it cannot be raised): 40 ranks used to hang mpirun.
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(r#"ulimit -Sn 128 && ulimit -Hn 128 && exec "$@""#)
        .arg("bash")
        .arg(MERAK);
    train_args(&mut cmd, &out, &["--np", "40"]);
    let run = run_with_deadline(cmd, Duration::from_secs(30));
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("open files") && run.stderr.contains("128"),
        "{run:?}"
    );
    assert!(!out.exists(), "a refused launch made its folder");
}
