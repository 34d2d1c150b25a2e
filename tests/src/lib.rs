//! Helpers for tests that run several MPI ranks: spawning `mpirun` with a deadline, and
//! comparing numbers with a relative tolerance; a training program's runs compared with its
//! one-process run ([`run_training`], [`assert_same_training`]); and a capped global allocator for the tests of
//! parsers of untrusted input ([`CappedAlloc`]).

mod capped_alloc;
mod training_runs;

pub use capped_alloc::{CappedAlloc, MAX_LIVE, MAX_ONE, assert_capped};
pub use training_runs::{TrainingRun, assert_same_training, read_losses, run_training};

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a finished (or killed) `mpirun` left behind.
#[derive(Debug)]
pub struct Run {
    /// Exit code; `None` if it was killed by a signal or by the deadline.
    pub code: Option<i32>,
    /// Standard output of all ranks.
    pub stdout: String,
    /// Standard error of all ranks.
    pub stderr: String,
    /// Wall time.
    pub elapsed: Duration,
    /// Whether the deadline killed it.
    pub timed_out: bool,
}

impl Run {
    /// Panics with both streams unless the run exited with status 0.
    pub fn assert_success(&self) {
        assert!(
            self.code == Some(0),
            "exit {:?} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.elapsed,
            self.stdout,
            self.stderr
        );
    }

    /// Panics unless the run succeeded and each of its `np` ranks printed
    /// `rank R: {scenario} ok` (what the worker binaries print after their checks).
    pub fn assert_all_ranks_ok(&self, np: usize, scenario: &str) {
        self.assert_success();
        for r in 0..np {
            let line = format!("rank {r}: {scenario} ok");
            assert!(
                self.stdout.contains(&line),
                "missing `{line}` in\n{}",
                self.stdout
            );
        }
    }
}

/// The `mpirun` command for `np` ranks: oversubscription allowed (tests run more ranks than
/// cores), no core binding, and running as root allowed (CI containers run as root).
pub fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &np.to_string(),
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
    .env("RAYON_NUM_THREADS", "1");
    c
}

/// Runs `cmd`, killing it after `deadline`.
pub fn run_with_deadline(mut cmd: Command, deadline: Duration) -> Run {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e} (is Open MPI installed?)"));
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break Some(status);
        }
        if start.elapsed() > deadline {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Run {
        code: status.and_then(|s| s.code()),
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
        elapsed: start.elapsed(),
        timed_out,
    }
}

/// `||a - b|| / max(||b||, tiny)`, the relative error of `a` against the reference `b`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
    diff / norm.max(1e-30)
}

/// Puts this test binary under [`CappedAlloc`] (any single allocation above [`MAX_ONE`] and
/// more than [`MAX_LIVE`] live refused, so that an allocation sized by a number read from a
/// hostile file aborts the test instead of passing by overcommit), with the test
/// `a_single_allocation_above_the_cap_is_refused` that shows the cap holds. Invoke it once, at
/// the crate root of an integration test or in the `tests` module of a crate's unit tests.
#[macro_export]
macro_rules! cap_allocations {
    () => {
        #[global_allocator]
        static GLOBAL: $crate::CappedAlloc<std::alloc::System> =
            $crate::CappedAlloc::new(std::alloc::System);

        #[test]
        fn a_single_allocation_above_the_cap_is_refused() {
            $crate::assert_capped();
        }
    };
}

/// A fresh, empty folder `merak-test-<pid>-<name>` in the temporary folder, for one test.
pub fn fresh_folder(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("merak-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("a temporary folder");
    d
}

/// A safetensors file of `tensors` (name, shape, f32 values), its values stored as `dtype`:
/// `"F32"`, `"F16"` (rounded to the nearest), `"BF16"` (truncated) or `"I32"` (truncated), for
/// tests of importers. Names are written as Rust escapes them, which is JSON for plain names.
pub fn safetensors_file(tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: &str) -> Vec<u8> {
    let (mut header, mut data) = (Vec::new(), Vec::<u8>::new());
    for (name, shape, values) in tensors {
        let start = data.len();
        for &x in values {
            match dtype {
                "F32" => data.extend(x.to_le_bytes()),
                "F16" => data.extend(f32_to_f16(x).to_le_bytes()),
                "BF16" => data.extend(((x.to_bits() >> 16) as u16).to_le_bytes()),
                "I32" => data.extend((x as i32).to_le_bytes()),
                other => panic!("{other}: not a dtype safetensors_file writes"),
            }
        }
        let end = data.len();
        header.push(format!(
            r#"{name:?}:{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}"#
        ));
    }
    let header = format!("{{{}}}", header.join(","));
    let length = (header.len() as u64).to_le_bytes();
    [&length[..], header.as_bytes(), &data].concat()
}

/// The nearest half-precision number of a normal `x` of modest size (round to nearest even;
/// values below 2^-14 are flushed to zero).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    let mant = b & 0x7f_ffff;
    let mut h = (u32::from(sign) | ((exp as u32) << 10) | (mant >> 13)) as u16;
    let rest = mant & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    h
}

/// `merak train` settings for two steps that leave the weights where they start (a learning
/// rate of 1e-12 moves no weight by a relative 1e-9; it must be positive), with the held-out
/// loss after each: runs started from the same weights under different layouts then report
/// the same numbers.
pub const WEIGHTS_HELD: [&str; 14] = [
    "--set",
    "train.steps=2",
    "--set",
    "train.lr=1e-12",
    "--set",
    "train.min_lr=0",
    "--set",
    "train.warmup_steps=0",
    "--set",
    "train.weight_decay=0",
    "--set",
    "data.val_every=1",
    "--set",
    "data.val_batches=2",
];

/// Asserts that `a` is within a relative 1e-5 of `b`, naming `what`.
pub fn assert_close(what: &str, a: f32, b: f32) {
    let e = rel_err(&[a], &[b]);
    assert!(e <= 1e-5, "{what}: {a} vs {b} (rel {e:e})");
}
