//! Hostile input is refused at once: unknown keys at any depth, floats that are not finite,
//! keys given twice, out-of-range layout values, and sizes beyond any machine or search are
//! errors with exit status 2 that name the key (and the numbers), in well under two seconds,
//! instead of training on NaN, panicking, or running out of memory or time.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use merak_tests::run_with_deadline;

mod common;
use common::*;

/// Runs `merak args` and asserts exit status 2 within two seconds, with every part of `parts`
/// in stderr.
fn refused(args: &[&str], parts: &[&str]) {
    let mut cmd = Command::new(MERAK);
    cmd.args(args);
    let run = run_with_deadline(cmd, Duration::from_secs(30));
    assert_eq!(run.code, Some(2), "{args:?}: {run:?}");
    assert!(
        run.elapsed < Duration::from_secs(2),
        "{args:?} took {:?}",
        run.elapsed
    );
    for part in parts {
        assert!(
            run.stderr.contains(part),
            "{args:?}: {part:?} not in {}",
            run.stderr
        );
    }
}

/// `merak train --out <scratch> --set k=v ...`.
fn train_refused(name: &str, sets: &[&str], parts: &[&str]) {
    let out = out_dir(name);
    let out = out.to_str().expect("utf-8 path");
    let mut args = vec!["train", "--out", out];
    for s in sets {
        args.extend(["--set", s]);
    }
    refused(&args, parts);
}

#[test]
fn config_keys_are_refused_generically() {
    train_refused("limits-kind-x", &["model.kind.x=1"], &["`model.kind.x`"]);
    train_refused("limits-min-lr", &["train.min_lr=nan"], &["`train.min_lr`"]);
    train_refused("limits-inf", &["train.lr=1e309"], &["`train.lr`", "finite"]);
    train_refused(
        "limits-timeout",
        &["train.comm_timeout_s=1e300"],
        &["`train.comm_timeout_s`", "1e300", "31536000"],
    );
}

#[test]
fn a_config_file_with_a_bad_float_or_a_key_twice_names_the_key_and_the_file() {
    let dir = out_dir("limits-files");
    std::fs::create_dir_all(&dir).expect("scratch folder");
    for (name, text, key) in [
        ("nan.toml", "[train]\nmin_lr = nan\n", "`train.min_lr`"),
        ("huge.toml", "[train]\nlr = 1e309\n", "`train.lr`"),
        (
            "twice.toml",
            "[train]\nsteps = 1\nsteps = 2\n",
            "`train.steps`",
        ),
        ("deep.toml", "[model.kind]\nx = 1\n", "`model.kind.x`"),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("config written");
        let out = dir.join("out");
        let shown = path.display().to_string();
        let parts = [key, shown.as_str()];
        refused(
            &[
                "train",
                "--config",
                &shown,
                "--out",
                out.to_str().expect("utf-8"),
            ],
            &parts,
        );
    }
}

#[test]
fn sizes_beyond_the_machine_are_refused_in_milliseconds() {
    train_refused(
        "limits-layers",
        &["model.layers=100000000", "train.steps=1"],
        &["model.layers = 100000000", "GiB", "available host memory"],
    );
    train_refused(
        "limits-val",
        &["data.val_every=1", "data.val_batches=1000000000"],
        &["`data.val_batches`", "8000000000 sequences", "65536"],
    );
}

#[test]
fn a_validation_pass_beyond_the_validation_windows_of_a_data_set_is_refused() {
    let dir = out_dir("limits-tokens");
    std::fs::create_dir_all(&dir).expect("scratch folder");
    let words = ["the", "whale", "sea", "ship", "captain", "of"];
    let text: Vec<&str> = (0..3000)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect();
    std::fs::write(dir.join("book.txt"), text.join(" ")).expect("text written");
    let mut cmd = Command::new(MERAK);
    cmd.args(["prepare-data", "--input"])
        .arg(dir.join("book.txt"))
        .arg("--output")
        .arg(dir.join("data"));
    run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
    let path = format!("data.path={}", dir.join("data").display());
    train_refused(
        "limits-tokens-out",
        &[
            "data.kind=tokens",
            &path,
            "model.vocab_size=50257",
            "data.val_every=1",
            "data.val_batches=1000",
        ],
        &["`data.val_batches`", "8000 sequences", "validation windows"],
    );
}

#[test]
fn the_planner_refuses_searches_beyond_its_bounds_at_once() {
    let tiny = "gpt:layers=1000000,hidden=64,heads=4,seq=32,vocab=100";
    refused(
        &[
            "plan",
            "--model",
            tiny,
            "--gpus",
            "8",
            "--global-batch",
            "8",
        ],
        &["1000002 units", "the limit is 514"],
    );
    refused(
        &[
            "plan",
            "--model",
            "gpt2",
            "--gpus",
            "1000000000000",
            "--global-batch",
            "8",
        ],
        &["1000000000000 devices"],
    );
    let wide = "gpt:layers=256,hidden=64,heads=4,seq=32,vocab=100";
    refused(
        &[
            "plan",
            "--model",
            wide,
            "--gpus",
            "720720",
            "--global-batch",
            "720720",
        ],
        &[
            "720720 devices",
            "cut by the stage planner",
            "steps of work",
            "the limit is 2^30 steps",
        ],
    );
}

#[test]
fn inline_specs_refuse_a_key_twice_and_out_of_range_values() {
    let twice = "gpt:layers=2,layers=4,hidden=64,heads=4,seq=32,vocab=100";
    refused(
        &[
            "plan",
            "--model",
            twice,
            "--gpus",
            "8",
            "--global-batch",
            "8",
        ],
        &["`layers` is given twice"],
    );
    let simulate = |layout: &str, parts: &[&str]| {
        refused(
            &[
                "simulate",
                "--model",
                "gpt2",
                "--gpus",
                "8",
                "--global-batch",
                "8",
                "--layout",
                layout,
            ],
            parts,
        );
    };
    simulate("dp=2,dp=4", &["`dp` is given twice"]);
    simulate("dp=8,zero=5", &["zero=5", "(0 to 3)"]);
    simulate("dp=8,mbs=0", &["mbs=0"]);
}

/// The shipped config still loads with these checks (a control for the refusals above).
#[test]
fn a_valid_plan_still_runs() {
    let mut cmd = Command::new(MERAK);
    cmd.args([
        "plan",
        "--model",
        "gpt2",
        "--gpus",
        "8",
        "--global-batch",
        "16",
    ]);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    run.assert_success();
    assert!(run.stdout.contains("best:"), "{}", run.stdout);
    assert!(Path::new(&config()).exists());
}
