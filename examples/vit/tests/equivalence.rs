//! The vision transformer under dp=2 (also with ZeRO-3), tp=2, pp=2 and dp x tp x pp =
//! 2 x 2 x 2 equals one process: the same losses at every step, the same final parameters (relative error <= 1e-5)
//! and the same held-out loss, accuracy and predictions. A corrupt digits file is refused,
//! naming the file and the record.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::FullState;
use merak_tests::{assert_same_training, fresh_folder, run_training, run_with_deadline};

const BIN: &str = env!("CARGO_BIN_EXE_vit-train");
const TOL: f64 = 1e-5;

/// A tiny model and a short run: 2 blocks of width 16 with 4 heads, 60 steps of 16 images in
/// micro-batches of 4 (enough to leave the initial plateau: the predictions differ).
const TINY: [&str; 14] = [
    "--layers",
    "2",
    "--hidden",
    "16",
    "--heads",
    "4",
    "--steps",
    "60",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--lr",
    "1e-2",
];

/// What a run reports: its losses, final parameters at full size, and its held-out
/// evaluation.
type Trained = (Vec<f64>, FullState, Held);

/// The held-out loss, the accuracy and the predictions, as `vit-train` prints them.
#[derive(Debug, PartialEq)]
struct Held {
    loss: f64,
    accuracy: String,
    predicted: String,
}

impl Held {
    fn parse(stdout: &str) -> Held {
        let line = |prefix: &str| {
            (stdout.lines())
                .find_map(|l| l.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("no `{prefix}` line:\n{stdout}"))
        };
        let held = line("vit: held-out loss ");
        let (loss, accuracy) = held.split_once(" accuracy ").expect("an accuracy");
        Held {
            loss: loss.parse().expect("a loss"),
            accuracy: accuracy.into(),
            predicted: line("vit: predicted ").into(),
        }
    }
}

/// Runs `vit-train` on `np` ranks (alone for 1) with the tiny model and `args`; returns its
/// losses, final parameters at full size and held-out evaluation.
fn train(np: usize, name: &str, args: &[&str]) -> Trained {
    let dir = fresh_folder(&format!("vit-{name}"));
    let trained = train_into(np, &dir.join("run"), args);
    let _ = std::fs::remove_dir_all(&dir);
    trained
}

/// [`train`] writing to `out`.
fn train_into(np: usize, out: &Path, args: &[&str]) -> Trained {
    let args: Vec<&str> = TINY.iter().chain(args).copied().collect();
    let run = run_training(BIN, np, out, &args, Duration::from_secs(300));
    (run.losses, run.state, Held::parse(&run.stdout))
}

/// Asserts that `got` (losses, parameters, held-out loss) equals the one-process run `want`
/// within [`TOL`], and that it has the same held-out accuracy and predictions.
fn assert_equal(name: &str, got: &Trained, want: &Trained) {
    let ((losses, state, held), (single, reference, held_single)) = (got, want);
    let err = (held.loss - held_single.loss).abs() / held_single.loss.abs();
    assert!(err <= TOL, "{name}: held-out {held:?} vs {held_single:?}");
    assert_eq!(
        (&held.accuracy, &held.predicted),
        (&held_single.accuracy, &held_single.predicted),
        "{name}"
    );
    assert_same_training(name, (losses, state), (single, reference), TOL);
}

#[test]
fn every_layout_equals_one_process() {
    let want = train(1, "single", &[]);
    let single = &want.0;
    assert_eq!(single.len(), 60);
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, last) = (mean(&single[..10]), mean(&single[50..]));
    assert!(last < first - 0.1, "the loss falls: {single:?}");
    // The checkpoint holds every parameter at full size.
    let size = |n: &str| want.1.params.get(n).map(Vec::len);
    assert_eq!(size("layers.1.attn.wq.linear.weight"), Some(16 * 16));
    assert_eq!(size("layers.0.mlp.fc1.linear.weight"), Some(16 * 64));
    assert_eq!(size("embed.pos"), Some(17 * 16));
    assert_eq!(size("head.classifier.weight"), Some(16 * 10));
    // Every held-out image is evaluated: 19 batches of 16, the last 4 wrapping around.
    assert!(
        want.2.accuracy.contains("of 304 images, 300 held out"),
        "{:?}",
        want.2
    );
    let layouts: [(usize, &str, &[&str]); 5] = [
        (2, "dp2", &["--dp", "2"]),
        // ZeRO-3 through the one-call API: every unit gathered from both ranks' slices.
        (2, "dp2-zero3", &["--dp", "2", "--zero", "3"]),
        (2, "tp2", &["--tp", "2"]),
        (2, "pp2", &["--pp", "2"]),
        (8, "dp2tp2pp2", &["--dp", "2", "--tp", "2", "--pp", "2"]),
    ];
    for (np, name, args) in layouts {
        assert_equal(name, &train(np, name, args), &want);
    }
}

/// A one-process run checkpointed at step 30 and resumed under tp=2 x pp=2 ends where the
/// uninterrupted run ends: the same losses of steps 31 to 60, parameters and held-out results
/// (the samples of a step depend on the step, not on what ran before).
#[test]
fn a_run_resumed_under_another_layout_equals_the_uninterrupted_run() {
    let dir = fresh_folder("vit-resume");
    let (first, second) = (dir.join("first"), dir.join("second"));
    let (losses, state, held) = train_into(1, &first, &["--checkpoint-every", "30"]);
    let want = (losses[30..].to_vec(), state, held);
    let step30 = first.join("checkpoints/step-00000030");
    let step30 = step30.to_str().expect("a UTF-8 path");
    let args = ["--tp", "2", "--pp", "2", "--resume", step30];
    assert_equal("resumed", &train_into(4, &second, &args), &want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A digits file with a record out of range, or cut short, is refused before anything trains,
/// naming the file and the record.
#[test]
fn a_corrupt_digits_file_is_refused_naming_it() {
    let dir = fresh_folder("vit-corrupt");
    let good = std::fs::read(merak_example_vit::default_digits_path()).expect("the digits");
    let record = merak_example_vit::RECORD;
    let mut bad_label = good.clone();
    bad_label[5 * record + 64] = 12;
    let mut bad_pixel = good.clone();
    bad_pixel[9 * record + 3] = 200;
    let short = good[..good.len() - 1].to_vec();
    for (file, bytes, says) in [
        ("label.bin", bad_label, "record 5: label 12"),
        ("pixel.bin", bad_pixel, "record 9: pixel 3 is 200"),
        ("short.bin", short, "not a whole number of 65-byte records"),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, bytes).expect("a scratch file");
        let out = dir.join(format!("{file}-run"));
        let mut cmd = Command::new(BIN);
        cmd.args(TINY)
            .arg("--data")
            .arg(&path)
            .arg("--out")
            .arg(&out);
        let run = run_with_deadline(cmd, Duration::from_secs(60));
        assert_eq!(run.code, Some(2), "{file}: {}", run.stderr);
        let path = path.to_str().expect("a UTF-8 path");
        assert!(run.stderr.contains(path), "{file}: {}", run.stderr);
        assert!(run.stderr.contains(says), "{file}: {}", run.stderr);
        assert!(!out.exists(), "{} was made", out.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
