//! Multi-node launch on one machine: a `merak train` job whose messages go over TCP alone
//! (`--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo`, the transport between
//! nodes without InfiniBand) trains exactly like the same job over shared memory, and so does
//! one spread over two emulated hosts, where ranks 2 and 3 have local ranks 0 and 1.
//!
//! The two hosts: a hostfile names `localhost` and a name that resolves nowhere, and
//! `plm_rsh_agent` is a script that, in place of ssh, runs Open MPI's daemon for that host on
//! this machine. Open MPI then maps, numbers and wires the ranks exactly as over two machines
//! (`OMPI_COMM_WORLD_LOCAL_RANK` restarts at 0 on the second host, and the ranks of different
//! hosts reach each other over TCP only).
//!
//! With Slurm installed (`slurmctld`, `slurmd`, `srun` with the PMIx plugin; Debian's
//! `slurm-wlm`) and run as root, a private Slurm cluster of two emulated nodes (two `slurmd`
//! on this machine, no munge: `auth/none`) runs `scripts/slurm/merak.sbatch`: its ranks read
//! their places from `srun`'s variables, a SIGUSR1 to the job's steps checkpoints and exits 75,
//! and submitting the script again continues to the same losses and parameters as one
//! uninterrupted `mpirun` job. Without Slurm that test says so and passes
//! (`MERAK_REQUIRE_SLURM=1` makes it fail instead).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{
    MERAK, assert_same_losses, assert_same_params, config, out_dir, read_metrics, series,
    series_of, train_args,
};
use merak_burn::checkpoint::Checkpoint;
use merak_tests::{Run, mpirun, rel_err, run_with_deadline};

/// Open MPI's flags for TCP as the only transport, on the loopback interface.
const TCP_ONLY: [&str; 9] = [
    "--mca",
    "pml",
    "ob1",
    "--mca",
    "btl",
    "tcp,self",
    "--mca",
    "btl_tcp_if_include",
    "lo",
];

/// The jobs of this file, one at a time (each is four ranks on a small machine).
static ONE_JOB_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `merak train` (tiny GPT, synthetic data, 5 steps, micro-batches of 2) on 4 ranks with
/// `layout`, under `mpirun` with `flags`.
fn job(flags: &[&str], out: &Path, layout: &[&str]) -> Run {
    let mut cmd = mpirun(4);
    cmd.args(flags).arg(MERAK);
    train_args(&mut cmd, out, &["--set", "train.micro_batch=2"]);
    cmd.args(layout);
    let start = Instant::now();
    let run = run_with_deadline(cmd, Duration::from_secs(300));
    eprintln!("{}: {:.1?}", out.display(), start.elapsed());
    run
}

/// Whether two runs wrote bit-identical losses and final parameters (reported, not asserted:
/// the assertions allow the tolerance of the other multi-rank tests).
fn bitwise_same(a: &Path, b: &Path) -> bool {
    let losses = |p: &Path| -> Vec<u32> {
        read_metrics(p)
            .iter()
            .map(|r| (r["loss"].as_f64().unwrap_or(f64::NAN) as f32).to_bits())
            .collect()
    };
    let params = |p: &Path| {
        Checkpoint::open(&p.join("checkpoints"))
            .unwrap()
            .read_full()
            .unwrap()
            .params
    };
    losses(a) == losses(b) && params(a) == params(b)
}

#[test]
fn tcp_only_equals_shared_memory() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let layout = ["--dp", "2", "--tp", "2"];
    let shm = out_dir("multinode-shm-dp2-tp2");
    job(&[], &shm, &layout).assert_success();
    let tcp = out_dir("multinode-tcp-dp2-tp2");
    job(&TCP_ONLY, &tcp, &layout).assert_success();
    assert_same_losses("TCP only", &tcp, &shm);
    assert_same_params("TCP only", &tcp, &shm);
    eprintln!("TCP only, bit-identical: {}", bitwise_same(&tcp, &shm));
}

#[test]
fn two_emulated_hosts_equal_one_host() {
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let layout = ["--dp", "2", "--pp", "2"];
    let shm = out_dir("multinode-shm-dp2-pp2");
    job(&[], &shm, &layout).assert_success();

    let hosts = out_dir("multinode-hosts");
    std::fs::create_dir_all(&hosts).unwrap();
    let hostfile = hosts.join("hostfile");
    std::fs::write(
        &hostfile,
        "localhost slots=2\nmerak-emulated-host slots=2\n",
    )
    .unwrap();
    // In place of `ssh host command`: skip ssh's options and the host, run the command here.
    let agent = hosts.join("fake-ssh");
    std::fs::write(
        &agent,
        "#!/bin/sh\n\
         while [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n\
         shift\n\
         exec /bin/sh -c \"$*\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (hostfile, agent) = (hostfile.display().to_string(), agent.display().to_string());
    let mut flags = vec![
        "--hostfile",
        &hostfile,
        "--mca",
        "plm_rsh_agent",
        &agent,
        // Open MPI's own daemons also talk over loopback only.
        "--mca",
        "oob_tcp_if_include",
        "lo",
    ];
    flags.extend_from_slice(&TCP_ONLY);
    let two = out_dir("multinode-two-hosts-dp2-pp2");
    let run = job(&flags, &two, &layout);
    run.assert_success();
    // Each rank logs its place: the second host's ranks count from 0 again.
    for (rank, local) in [(0, 0), (1, 1), (2, 0), (3, 1)] {
        let line = format!("rank {rank}: local rank {local} of 2 on node");
        assert!(
            run.stderr.contains(&line),
            "{line:?} missing:\n{}",
            run.stderr
        );
    }
    assert_same_losses("two emulated hosts", &two, &shm);
    assert_same_params("two emulated hosts", &two, &shm);
    eprintln!(
        "two emulated hosts, bit-identical: {}",
        bitwise_same(&two, &shm)
    );
}

/// A Slurm cluster of its own: `slurmctld` and two `slurmd` (nodes `n1` and `n2`, both this
/// machine) on free ports, everything under `dir`; stopped when dropped.
struct Slurm {
    dir: PathBuf,
    daemons: Vec<Child>,
}

/// Why this machine cannot run [`Slurm`], if it cannot.
fn slurm_missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("slurmd runs jobs as root only here: not root".into());
    }
    for (tool, arg) in [
        ("slurmctld", "-V"),
        ("slurmd", "-V"),
        ("sbatch", "--version"),
        ("squeue", "--version"),
        ("scancel", "--version"),
        ("scontrol", "--version"),
        ("sinfo", "--version"),
    ] {
        if Command::new(tool).arg(arg).output().is_err() {
            return Some(format!(
                "{tool} not found (Debian: apt-get install slurm-wlm)"
            ));
        }
    }
    // srun reads a configuration even to list its plugins: a minimal one of its own (where no
    // /etc/slurm/slurm.conf exists, srun would look for a controller in DNS and fail).
    let conf = tempfile::tempdir().ok()?;
    let conf_file = conf.path().join("slurm.conf");
    let minimal = "ClusterName=probe\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n\
                   PartitionName=p Nodes=localhost\n";
    std::fs::write(&conf_file, minimal).ok()?;
    let plugins = Command::new("srun")
        .arg("--mpi=list")
        .env("SLURM_CONF", &conf_file)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&plugins.stdout) + String::from_utf8_lossy(&plugins.stderr);
    (!text.contains("pmix")).then(|| format!("srun has no PMIx plugin: {text}"))
}

/// A TCP port nothing listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().unwrap().port()
}

impl Slurm {
    fn start(dir: &Path) -> Slurm {
        for sub in ["state", "log", "spool/n1", "spool/n2", "tmp/n1", "tmp/n2"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        let host = host.trim().split('.').next().unwrap().to_string();
        let d = dir.display();
        let (ctld, n1, n2) = (free_port(), free_port(), free_port());
        // auth/none: no munge. config_overrides: the nodes are what this file says, whatever
        // the machine has. TmpFS and the spool per node: the two slurmd's PMIx servers would
        // otherwise share their folders.
        let conf = format!(
            "ClusterName=merak-test\n\
             SlurmctldHost={host}\n\
             SlurmctldPort={ctld}\n\
             AuthType=auth/none\n\
             CredType=cred/none\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             MpiDefault=pmix\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             SwitchType=switch/none\n\
             ReturnToService=2\n\
             SchedulerType=sched/backfill\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             AccountingStorageType=accounting_storage/none\n\
             JobCompType=jobcomp/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             SlurmdParameters=config_overrides\n\
             StateSaveLocation={d}/state\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmdSpoolDir={d}/spool/%n\n\
             SlurmdLogFile={d}/log/slurmd-%n.log\n\
             TmpFS={d}/tmp/%n\n\
             NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=2\n\
             NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs=2\n\
             PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP \
             OverSubscribe=YES\n"
        );
        std::fs::write(dir.join("slurm.conf"), conf).unwrap();
        let mut slurm = Slurm {
            dir: dir.to_path_buf(),
            daemons: Vec::new(),
        };
        let daemons: [(&str, &[&str]); 3] = [
            ("slurmctld", &["-D", "-c", "-i"]),
            ("slurmd", &["-D", "-N", "n1"]),
            ("slurmd", &["-D", "-N", "n2"]),
        ];
        for (i, (daemon, args)) in daemons.into_iter().enumerate() {
            let log = std::fs::File::create(dir.join(format!("log/daemon-{i}.out"))).unwrap();
            let child = slurm
                .cmd(daemon)
                .args(args)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {daemon}: {e}"));
            slurm.daemons.push(child);
        }
        let start = Instant::now();
        loop {
            let states = slurm.output(slurm.cmd("sinfo").args(["-h", "-N", "-o", "%T"]));
            if states.lines().filter(|s| s.trim() == "idle").count() == 2 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the Slurm cluster did not come up: sinfo says {states:?}\n{}",
                slurm.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("Slurm cluster up in {:.1?}", start.elapsed());
        slurm
    }

    /// A Slurm command for this cluster.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.dir.join("slurm.conf"));
        c
    }

    /// The command's standard output ("" if it fails).
    fn output(&self, cmd: &mut Command) -> String {
        cmd.output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// The daemons' logs, for a failure message.
    fn logs(&self) -> String {
        let mut all = String::new();
        for entry in std::fs::read_dir(self.dir.join("log"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            all += &format!("--- {}\n", entry.path().display());
            for line in tail.into_iter().rev() {
                all += line;
                all.push('\n');
            }
        }
        all
    }

    /// `sbatch` of `scripts/slurm/merak.sbatch` on both nodes, two ranks each, TCP only, with
    /// `args` for `merak train`, writing into `out`. Returns the job id.
    fn submit(&self, out: &Path, args: &[&str]) -> String {
        self.submit_with(out, args, &[])
    }

    /// [`submit`](Self::submit) with the environment variables `env` besides.
    fn submit_with(&self, out: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/slurm/merak.sbatch");
        let mut cmd = self.cmd("sbatch");
        cmd.arg("--parsable")
            // The template asks for 8 GPUs and 8 cores a rank; this cluster has neither.
            .args([
                "--nodes=2",
                "--ntasks-per-node=2",
                "--gpus-per-node=0",
                "--cpus-per-task=1",
            ])
            .arg(format!("--output={}/job-%j.out", self.dir.display()))
            .arg(script)
            .args(args)
            .env("OUT", out)
            .env("MERAK", MERAK)
            .env("RAYON_NUM_THREADS", "1")
            // Two emulated nodes on one machine: their shared-memory segments would have the
            // same names (host name, job, local rank), so the ranks talk over TCP.
            .env("OMPI_MCA_pml", "ob1")
            .env("OMPI_MCA_btl", "tcp,self")
            .env("OMPI_MCA_btl_tcp_if_include", "lo")
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        let submitted = cmd.output().expect("sbatch runs");
        let id = String::from_utf8_lossy(&submitted.stdout)
            .trim()
            .to_string();
        assert!(!id.is_empty(), "sbatch: {submitted:?}\n{}", self.logs());
        id
    }

    /// Whether job `id` is pending or running.
    fn running(&self, id: &str) -> bool {
        !self
            .output(self.cmd("squeue").args(["-h", "-j", id]))
            .trim()
            .is_empty()
    }

    /// Waits (at most `limit`) for job `id` to end; returns its exit code, `status:signal`.
    /// (`sbatch --wait` polls slowly: up to half a minute after the end.)
    fn wait(&self, id: &str, limit: Duration) -> String {
        let start = Instant::now();
        while self.running(id) {
            assert!(
                start.elapsed() < limit,
                "job {id} did not end within {limit:?}:\n{}",
                self.job_output(id)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let job = self.output(self.cmd("scontrol").args(["show", "job", id]));
        job.split_whitespace()
            .find_map(|f| f.strip_prefix("ExitCode="))
            .unwrap_or_else(|| panic!("no exit code for job {id}: {job}"))
            .to_string()
    }

    /// A job's output file.
    fn job_output(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("job-{id}.out"))).unwrap_or_default()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for child in &mut self.daemons {
            // SAFETY: kill(2) on our own child, not yet waited for.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let start = Instant::now();
        for child in &mut self.daemons {
            while child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A private Slurm cluster in the folder `name`, one job at a time (the guard); `None` when
/// Slurm cannot run here (a failure instead under `MERAK_REQUIRE_SLURM`).
fn slurm_cluster(name: &str) -> Option<(std::sync::MutexGuard<'static, ()>, Slurm)> {
    if let Some(why) = slurm_missing() {
        assert!(
            std::env::var_os("MERAK_REQUIRE_SLURM").is_none(),
            "MERAK_REQUIRE_SLURM is set but Slurm cannot run here: {why}"
        );
        eprintln!("skipped: {why}");
        return None;
    }
    let one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    Some((one, Slurm::start(&out_dir(name))))
}

/// One uninterrupted `merak train` job with `args` on 4 ranks of this host (over shared
/// memory), into the new folder `name`, which it returns.
fn one_host_job(name: &str, args: &[&str]) -> PathBuf {
    let reference = out_dir(name);
    let mut cmd = mpirun(4);
    cmd.arg(MERAK)
        .arg("train")
        .args(args)
        .arg("--out")
        .arg(&reference);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    reference
}

#[test]
fn slurm_batch_template_on_two_emulated_nodes_stops_resumes_and_equals_mpirun() {
    let Some((_one, slurm)) = slurm_cluster("multinode-slurm") else {
        return;
    };
    let test_start = Instant::now();
    let steps = "train.steps=40";
    let config = config().display().to_string();
    let args = [
        "--config",
        &config,
        "--set",
        "data.kind=synthetic",
        "--set",
        "train.micro_batch=2",
        "--set",
        steps,
        "--dp",
        "2",
        "--pp",
        "2",
    ];
    let out = out_dir("multinode-slurm-run");

    // Submit, and once training runs, signal the job's steps (as `--signal=USR1@300` does
    // ahead of the time limit).
    let id = slurm.submit(&out, &args);
    let start = Instant::now();
    while std::fs::metadata(out.join("metrics.jsonl")).map_or(true, |m| m.len() == 0) {
        assert!(
            slurm.running(&id) && start.elapsed() < Duration::from_secs(120),
            "job {id} did not start training:\n{}\n{}",
            slurm.job_output(&id),
            slurm.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("job {id} trains ({:.1?})", test_start.elapsed());
    let status = slurm
        .cmd("scancel")
        .args(["--signal=USR1", &id])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = slurm.wait(&id, Duration::from_secs(60));
    let first = slurm.job_output(&id);
    assert_eq!(exit, "75:0", "{first}");
    assert!(
        first.contains("submit this script again to continue"),
        "{first}"
    );
    // The ranks read their places from srun: ranks 2 and 3 are the second node's 0 and 1.
    for (rank, local, node) in [(0, 0, "n1"), (1, 1, "n1"), (2, 0, "n2"), (3, 1, "n2")] {
        let line = format!("rank {rank}: local rank {local} of 2 on node {node} (srun)");
        assert!(first.contains(&line), "{line:?} missing:\n{first}");
    }
    let stopped_at = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    eprintln!(
        "job {id} stopped with 75 after {} ({:.1?})",
        stopped_at.trim(),
        test_start.elapsed()
    );

    // The same submission continues the run to its end.
    let id2 = slurm.submit(&out, &args);
    let exit = slurm.wait(&id2, Duration::from_secs(300));
    let second = slurm.job_output(&id2);
    assert_eq!(exit, "0:0", "{second}\n{}", slurm.logs());
    assert!(second.contains("merak: continuing the run in"), "{second}");
    eprintln!(
        "job {id2} continued to the end ({:.1?})",
        test_start.elapsed()
    );

    // One uninterrupted job on one host, over shared memory, trains the same.
    let reference = one_host_job("multinode-slurm-reference", &args);
    let (got, want) = (read_metrics(&out), read_metrics(&reference));
    assert_eq!(got.len(), 40, "one record a step");
    for key in ["loss", "grad_norm", "lr"] {
        let (g, w) = (series(&got, key), series(&want, key));
        let e = rel_err(&g, &w);
        assert!(e <= 1e-5, "{key}: rel {e:e} against one uninterrupted job");
    }
    assert_same_params("srun, stopped and resumed", &out, &reference);
    let stop = Instant::now();
    drop(slurm);
    eprintln!("Slurm stopped in {:.1?}", stop.elapsed());
    eprintln!(
        "Slurm: bit-identical: {}; the whole test took {:.1?}",
        bitwise_same(&out, &reference),
        test_start.elapsed()
    );
}

/// A rank killed (`MERAK_INJECT=kill@1:8`, SIGKILL when step 8 begins) ends the `srun` job
/// step; the template starts a new step from the checkpoint of step 6 inside the allocation,
/// and the job ends by itself with exit 0, equal to one uninterrupted mpirun job.
#[test]
fn slurm_template_restarts_a_job_step_whose_rank_died() {
    let Some((_one, slurm)) = slurm_cluster("multinode-slurm-restart") else {
        return;
    };
    let config = config().display().to_string();
    let args = [
        "--config",
        &config,
        "--set",
        "data.kind=synthetic",
        "--set",
        "train.steps=10",
        "--set",
        "checkpoint.every=3",
        "--dp",
        "2",
        "--pp",
        "2",
    ];
    let out = out_dir("multinode-slurm-restart-run");
    let id = slurm.submit_with(&out, &args, &[("MERAK_INJECT", "kill@1:8")]);
    let exit = slurm.wait(&id, Duration::from_secs(300));
    let output = slurm.job_output(&id);
    assert_eq!(exit, "0:0", "{output}\n{}", slurm.logs());
    assert!(
        output.contains("the job step ended with status")
            && output.contains("merak: continuing the run in"),
        "{output}"
    );
    let reference = one_host_job("multinode-slurm-restart-reference", &args);
    let (got, want) = (series_of(&out, "loss"), series_of(&reference, "loss"));
    assert_eq!(got.len(), 10, "one record a step");
    assert_eq!(got, want, "losses bit for bit");
    assert_same_params(
        "srun, a rank killed and the step restarted",
        &out,
        &reference,
    );
}
