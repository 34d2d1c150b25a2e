//! End-to-end tests of checkpoints: resuming reproduces the uninterrupted run, a checkpoint
//! loads under another layout, damage is named, a killed job resumes from its last checkpoint,
//! and `merak export` / `merak generate` use a checkpoint outside training.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::{Checkpoint, shard_file};
use merak_tests::{Run, mpirun, rel_err, run_with_deadline};

mod common;
use common::*;

/// `merak train` (tiny GPT, synthetic data) on `np` ranks writing into `out`; `extra` goes last.
fn run_train(np: usize, out: &Path, steps: usize, extra: &[&str]) -> Run {
    let mut cmd = merak(np);
    train_args(&mut cmd, out, &["--set", &format!("train.steps={steps}")]);
    cmd.args(extra);
    run_with_deadline(cmd, Duration::from_secs(300))
}

/// `merak train --resume <checkpoint>` on `np` ranks writing into `out`.
fn run_resume(np: usize, checkpoint: &Path, out: &Path, extra: &[&str]) -> Run {
    let mut cmd = resume_cmd(np, checkpoint, out);
    cmd.args(extra);
    run_with_deadline(cmd, Duration::from_secs(300))
}

/// Asserts that `got`'s steps equal the same steps of `want`, bitwise (`tol == 0`) or within a
/// relative tolerance.
fn assert_steps_match(name: &str, got: &[serde_json::Value], want: &[serde_json::Value], tol: f64) {
    assert!(!got.is_empty(), "{name}: no steps");
    for g in got {
        let step = g["step"].as_u64().expect("step") as usize;
        let w = &want[step - 1];
        for key in ["loss", "grad_norm"] {
            let (a, b) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            if tol == 0.0 {
                assert_eq!(a, b, "{name}: {key} at step {step}");
            } else {
                let e = rel_err(&[a as f32], &[b as f32]);
                assert!(
                    e <= tol,
                    "{name}: {key} at step {step}: {a} vs {b} (rel {e:e})"
                );
            }
        }
    }
}

const STATEFUL: [&str; 8] = [
    "--set",
    "model.dropout=0.1",
    "--set",
    "parallel.zero=1",
    "--set",
    "checkpoint.every=3",
    "--set",
    "train.warmup_steps=2",
];

#[test]
fn resuming_reproduces_the_uninterrupted_run_under_any_layout() {
    // dp=2 x tp=2 with ZeRO-1 and dropout: parameters, sharded optimizer state and the random
    // streams all have to come back.
    let full = out_dir("ckpt-full");
    run_train(
        4,
        &full,
        6,
        &[&["--dp", "2", "--tp", "2"][..], &STATEFUL].concat(),
    )
    .assert_success();
    let uninterrupted = read_metrics(&full);
    assert_eq!(uninterrupted.len(), 6);
    let step3 = full.join("checkpoints/step-00000003");
    let manifest = Checkpoint::open(&step3).expect("step 3 saved").manifest;
    assert_eq!(manifest.step, 3);
    assert_eq!((manifest.layout.dp, manifest.layout.tp), (2, 2));
    // With ZeRO-1 every rank writes its slices of the moments (the DP-slice split).
    assert_eq!(manifest.files.len(), 4, "{:?}", manifest.files);

    // Same layout: exactly the same numbers.
    let same = out_dir("ckpt-resume-same");
    run_resume(4, &step3, &same, &[]).assert_success();
    let resumed = read_metrics(&same);
    assert_eq!(
        resumed
            .iter()
            .map(|r| r["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![4, 5, 6]
    );
    assert_steps_match("resume dp2 tp2", &resumed, &uninterrupted, 0.0);

    // Other layouts (without ZeRO, and one rank): the same within float rounding.
    for (np, name, layout) in [
        (0, "ckpt-resume-1", vec!["--dp", "1", "--tp", "1"]),
        // No layout given: the launch's single rank wins over the stored dp=2 x tp=2.
        (0, "ckpt-resume-1-implicit", vec![]),
        (4, "ckpt-resume-tp4", vec!["--dp", "1", "--tp", "4"]),
        (2, "ckpt-resume-dp2", vec!["--dp", "2", "--tp", "1"]),
    ] {
        let out = out_dir(name);
        let mut extra = layout.clone();
        extra.extend(["--set", "parallel.zero=0"]);
        run_resume(np, &step3, &out, &extra).assert_success();
        assert_steps_match(name, &read_metrics(&out), &uninterrupted, 1e-5);
    }
}

/// A finished one-process run with a checkpoint after step 2.
fn small_checkpoint(name: &str) -> PathBuf {
    let out = out_dir(name);
    run_train(0, &out, 2, &[]).assert_success();
    out.join("checkpoints/step-00000002")
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn shard_of(dir: &Path) -> PathBuf {
    dir.join("tp00-dp000-pp00.safetensors")
}

/// Sets the first value of the first parameter of the checkpoint `dir` to NaN, and its
/// manifest's size and checksum to match (a checkpoint written by a run that diverged).
fn poison_first_param(dir: &Path) {
    rewrite_shard(dir, |tensors| {
        let t = tensors
            .iter_mut()
            .find(|t| t.name.starts_with("param/"))
            .unwrap();
        t.values[0] = f32::NAN;
    });
}

/// Rewrites the shard of the one-rank checkpoint `dir` with `edit`, and its manifest's size
/// and checksum to match (a shard altered on purpose).
fn rewrite_shard(dir: &Path, edit: impl FnOnce(&mut Vec<shard_file::NamedTensor>)) {
    use sha2::{Digest, Sha256};
    let path = shard_of(dir);
    let bytes = std::fs::read(&path).unwrap();
    let (mut tensors, meta) = shard_file::decode(&bytes, &path).unwrap();
    edit(&mut tensors);
    let bytes = shard_file::encode(&tensors, meta).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let sum: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    edit_manifest(dir, |m| {
        m["files"][0]["bytes"] = bytes.len().into();
        m["files"][0]["sha256"] = sum.into();
    });
}

/// Edits the manifest of the checkpoint `dir` with `edit`.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let manifest_path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(&manifest_path, m.to_string()).unwrap();
}

/// Replaces, in the config stored in the manifest of `dir`, each `(from, to)` text.
fn edit_stored_config(dir: &Path, changes: &[(&str, &str)]) {
    edit_manifest(dir, |m| {
        let mut config = m["extra"]["config"].as_str().unwrap().to_string();
        for (from, to) in changes {
            assert!(config.contains(from), "{from} in {config}");
            config = config.replace(from, to);
        }
        m["extra"]["config"] = config.into();
    });
}

/// Resumes from a damaged checkpoint and returns stderr; the run must fail before training.
fn resume_fails(checkpoint: &Path, name: &str) -> String {
    let out = out_dir(name);
    let run = run_resume(0, checkpoint, &out, &["--set", "train.steps=4"]);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        !out.join("metrics.jsonl").exists(),
        "training started from a damaged checkpoint"
    );
    run.stderr
}

#[test]
fn damaged_checkpoints_are_named_before_training() {
    let good = small_checkpoint("ckpt-good");
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));

    let truncated = root.join("ckpt-truncated");
    copy_dir(&good, &truncated);
    let bytes = std::fs::read(shard_of(&truncated)).unwrap();
    std::fs::write(shard_of(&truncated), &bytes[..bytes.len() / 2]).unwrap();
    let e = resume_fails(&truncated, "ckpt-truncated-run");
    assert!(
        e.contains("truncated shard") && e.contains("tp00-dp000-pp00.safetensors"),
        "{e}"
    );

    let altered = root.join("ckpt-altered");
    copy_dir(&good, &altered);
    let mut bytes = std::fs::read(shard_of(&altered)).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(shard_of(&altered), &bytes).unwrap();
    let e = resume_fails(&altered, "ckpt-altered-run");
    assert!(
        e.contains("checksum mismatch") && e.contains("tp00-dp000-pp00.safetensors"),
        "{e}"
    );

    let no_manifest = root.join("ckpt-no-manifest");
    copy_dir(&good, &no_manifest);
    std::fs::remove_file(no_manifest.join("manifest.json")).unwrap();
    let e = resume_fails(&no_manifest, "ckpt-no-manifest-run");
    assert!(e.contains("no manifest.json"), "{e}");

    // A manifest is untrusted: a shard name that leaves the folder is refused, even when the
    // file it names exists and is the right one.
    let escaping = root.join("ckpt-escaping");
    copy_dir(&good, &escaping);
    let manifest_path = escaping.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path).unwrap();
    let moved = text.replace(
        "\"tp00-dp000-pp00.safetensors\"",
        "\"../ckpt-good/tp00-dp000-pp00.safetensors\"",
    );
    assert_ne!(text, moved, "the manifest names the shard");
    std::fs::write(&manifest_path, moved).unwrap();
    let e = resume_fails(&escaping, "ckpt-escaping-run");
    assert!(
        e.contains("shard name") && e.contains("../ckpt-good"),
        "{e}"
    );

    // A different model cannot continue the checkpoint; the message names the key.
    let out = out_dir("ckpt-other-model");
    let run = run_resume(
        0,
        &good,
        &out,
        &["--set", "model.hidden=32", "--set", "train.steps=4"],
    );
    assert_ne!(run.code, Some(0), "{run:?}");
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr
            .contains("model.hidden is 64 in the checkpoint but 32 in this run"),
        "{}",
        run.stderr
    );

    // A checkpoint of a run that diverged: NaN weights are refused by every command that
    // loads them, naming the tensor (generate printed token ids and exited 0 before).
    let nan = root.join("ckpt-nan");
    copy_dir(&good, &nan);
    poison_first_param(&nan);
    let e = resume_fails(&nan, "ckpt-nan-run");
    assert!(e.contains("NaN") && e.contains("param/"), "{e}");
    let g = generate(
        &nan,
        &[
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
            "--print-ids",
        ],
    );
    assert_eq!(g.code, Some(2), "{g:?}");
    assert!(g.stderr.contains("NaN") && g.stdout.is_empty(), "{g:?}");
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(&nan)
        .arg("--output")
        .arg(root.join("ckpt-nan-export/model.safetensors"));
    let e = refused_leaving_nothing(cmd, &root.join("ckpt-nan-export"));
    assert!(e.contains("NaN"), "{e}");

    // A key merak does not write, in the manifest or in `extra`: named with the file.
    for (name, key, path) in [
        ("ckpt-unknown-key", "bogus", "/layout"),
        ("ckpt-unknown-extra", "zzz", "/extra"),
    ] {
        let dir = root.join(name);
        copy_dir(&good, &dir);
        edit_manifest(&dir, |m| {
            m.pointer_mut(path).unwrap()[key] = 1.into();
        });
        let e = resume_fails(&dir, &format!("{name}-run"));
        let shown = format!("{}.{key}`", &path[1..]);
        assert!(e.contains(&shown) && e.contains("manifest.json"), "{e}");
    }

    // A negative second moment: the file, the tensor, the index and the value.
    let negative = root.join("ckpt-negative");
    copy_dir(&good, &negative);
    rewrite_shard(&negative, |t| {
        let m2 = t.iter_mut().find(|t| t.name == "m2/ln_f.gamma").unwrap();
        m2.values[5] = -0.5;
    });
    let e = resume_fails(&negative, "ckpt-negative-run");
    let file = shard_of(&negative);
    assert!(
        e.contains(&format!(
            "{}: tensor m2/ln_f.gamma holds -0.5 at index 5",
            file.display()
        )),
        "{e}"
    );

    // The undamaged one still resumes.
    let out = out_dir("ckpt-good-run");
    run_resume(0, &good, &out, &["--set", "train.steps=3"]).assert_success();
}

/// A mixture of experts with shared experts and balancing biases in every block.
const MOE_EXTRA: [&str; 10] = [
    "--set",
    "model.moe.experts=4",
    "--set",
    "model.moe.top_k=2",
    "--set",
    "model.moe.expert_hidden=16",
    "--set",
    "model.moe.shared_experts=1",
    "--set",
    "model.moe.bias_update_rate=0.01",
];

/// Runs `cmd`, which must be refused with exit 2 without making `made` (a folder it would
/// write); returns stderr.
fn refused_leaving_nothing(cmd: Command, made: &Path) -> String {
    let _ = std::fs::remove_dir_all(made);
    let run = run_with_deadline(cmd, Duration::from_secs(120));
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(!made.exists(), "a refused command left {}", made.display());
    run.stderr
}

#[test]
fn a_checkpoint_its_model_cannot_take_is_refused_before_any_folder() {
    let moe = out_dir("ckpt-moe-extra");
    run_train(0, &moe, 2, &MOE_EXTRA).assert_success();
    let step = moe.join("checkpoints/step-00000002");
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));

    // Its stored config edited to have no shared experts and no balancing biases: the
    // tensors of both are named and counted, with the keys, not dropped.
    let edited = root.join("ckpt-moe-edited");
    copy_dir(&step, &edited);
    let without = [
        ("shared_experts = 1", "shared_experts = 0"),
        ("bias_update_rate = 0.01", "bias_update_rate = 0.0"),
    ];
    edit_stored_config(&edited, &without);
    let out = root.join("ckpt-moe-edited-run");
    let mut cmd = resume_cmd(0, &edited, &out);
    cmd.args(["--set", "train.steps=3"]);
    let e = refused_leaving_nothing(cmd, &out);
    assert!(
        e.contains("holds 10 parameter(s) the model lacks (blocks.0.moe.shared.w_in")
            && e.contains("model.moe.bias_update_rate, model.moe.shared_experts"),
        "{e}"
    );

    // A stored model shape the files disagree with: the tensor and both shapes.
    let narrow = root.join("ckpt-moe-narrow");
    copy_dir(&step, &narrow);
    edit_stored_config(&narrow, &[("hidden = 64", "hidden = 32")]);
    let out = root.join("ckpt-moe-narrow-run");
    let mut cmd = resume_cmd(0, &narrow, &out);
    cmd.args(["--set", "train.steps=3"]);
    let e = refused_leaving_nothing(cmd, &out);
    assert!(
        e.contains(
            "wte.embedding.weight: shape [512, 64] in the checkpoint, [512, 32] in the model"
        ) && e.contains("model.hidden = 32"),
        "{e}"
    );

    // A mixture of experts has no GPT-2 form: said before the output folder is made.
    let folder = root.join("ckpt-moe-export");
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(&step)
        .arg("--output")
        .arg(folder.join("model.safetensors"));
    let e = refused_leaving_nothing(cmd, &folder);
    assert!(
        e.contains("mixture of experts (model.moe") && e.contains("no GPT-2 form"),
        "{e}"
    );
    // Nor does `generate --logits-out` make its folder for a checkpoint it refuses.
    let folder = root.join("ckpt-moe-logits");
    let mut cmd = Command::new(MERAK);
    cmd.args(["generate", "--prompt-ids", "1,2", "--checkpoint"])
        .arg(&narrow)
        .arg("--logits-out")
        .arg(folder.join("logits.json"));
    let e = refused_leaving_nothing(cmd, &folder);
    assert!(e.contains("wte.embedding.weight"), "{e}");
}

#[test]
fn a_killed_job_resumes_from_its_last_checkpoint() {
    // A constant learning rate, so that the run can be continued with fewer total steps.
    let constant = [
        "--dp",
        "2",
        "--set",
        "train.min_lr=3e-3",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "checkpoint.every=2",
    ];
    let out = out_dir("kill-9");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(&mut cmd, &out, &["--set", "train.steps=100000"]);
    cmd.args(constant);
    // Once training runs and has saved, SIGKILL one rank: the job ends promptly.
    let metrics = out.join("metrics.jsonl");
    let latest = out.join("checkpoints/latest");
    kill_last_rank_when(cmd, &out, || {
        std::fs::read_to_string(&metrics).is_ok_and(|m| m.lines().count() >= 5) && latest.exists()
    });

    // The last complete checkpoint resumes (a half-written one, if the kill hit a save, is
    // ignored), and continues exactly like a run that was never interrupted.
    let last = Checkpoint::open(&out.join("checkpoints")).expect("a complete checkpoint");
    let k = last.manifest.step;
    let steps = format!("train.steps={}", k + 2);
    // metrics.jsonl keeps the steps up to the checkpoint and continues after them.
    let mut cmd = resume_cmd(2, &out.join("checkpoints"), &out);
    cmd.args(["--set", &steps]);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    let resumed = read_metrics(&out);
    assert_eq!(resumed.len(), k + 2, "steps 1..={} in metrics.jsonl", k + 2);

    let reference = out_dir("kill-9-reference");
    let mut cmd = mpirun(2);
    cmd.arg(MERAK);
    train_args(&mut cmd, &reference, &["--set", &steps]);
    cmd.args(constant);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    assert_steps_match("after kill -9", &resumed, &read_metrics(&reference), 0.0);
}

/// The tensors of an exported safetensors file, by name.
fn read_export(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("export written");
    let (tensors, _) = shard_file::decode(&bytes, path).expect("valid safetensors");
    tensors
        .into_iter()
        .map(|t| (t.name, (t.shape, t.values)))
        .collect()
}

fn export(checkpoint: &Path, output: &Path) {
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--output")
        .arg(output);
    run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
}

#[test]
fn export_writes_the_consolidated_model_with_gpt2_names() {
    // An odd vocabulary (509) that tp = 2 pads: the export holds the real rows only.
    let odd = ["--set", "model.vocab_size=509"];
    let tp2 = out_dir("export-tp2");
    run_train(2, &tp2, 3, &[&odd[..], &["--tp", "2"]].concat()).assert_success();
    let single = out_dir("export-1");
    run_train(0, &single, 3, &odd).assert_success();

    let a = tp2.join("hf/model.safetensors");
    let b = single.join("hf/model.safetensors");
    export(&tp2.join("checkpoints"), &a);
    export(&single.join("checkpoints"), &b);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tp2.join("hf/config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["vocab_size"], 509);

    let (ta, tb) = (read_export(&a), read_export(&b));
    // GPT-2's names and layout: Conv1D weights [in, out], no separate lm_head (tied).
    let (h, v, s) = (64, 509, 32);
    let mut want = vec![
        ("transformer.wte.weight".to_string(), vec![v, h]),
        ("transformer.wpe.weight".to_string(), vec![s, h]),
        ("transformer.ln_f.weight".to_string(), vec![h]),
        ("transformer.ln_f.bias".to_string(), vec![h]),
    ];
    let layers = 2;
    for i in 0..layers {
        want.extend([
            (
                format!("transformer.h.{i}.attn.c_attn.weight"),
                vec![h, 3 * h],
            ),
            (format!("transformer.h.{i}.attn.c_attn.bias"), vec![3 * h]),
            (format!("transformer.h.{i}.attn.c_proj.weight"), vec![h, h]),
            (format!("transformer.h.{i}.mlp.c_fc.weight"), vec![h, 4 * h]),
            (
                format!("transformer.h.{i}.mlp.c_proj.weight"),
                vec![4 * h, h],
            ),
            (format!("transformer.h.{i}.ln_2.bias"), vec![h]),
        ]);
    }
    assert_eq!(ta.len(), 4 + 12 * layers, "{:?}", ta.keys());
    assert!(!ta.contains_key("lm_head.weight"));
    for (name, shape) in &want {
        assert_eq!(ta.get(name).map(|t| &t.0), Some(shape), "{name}");
    }

    // The tp = 2 export is the model one process trains.
    for (name, (shape, values)) in &tb {
        let (shape_a, values_a) = &ta[name];
        assert_eq!(shape_a, shape, "{name}");
        if name.ends_with("c_attn.bias") {
            // The key bias has an exactly zero gradient (softmax ignores a constant added to
            // every score of a query), so AdamW turns rounding noise into updates: it stays
            // near 1e-6 in both runs and is compared absolutely. Q and V relatively.
            let k = h..2 * h;
            for (i, (a, b)) in values_a.iter().zip(values).enumerate() {
                if k.contains(&i) {
                    assert!((a - b).abs() <= 1e-5, "{name}[{i}]: {a} vs {b}");
                }
            }
            for seg in [0..h, 2 * h..3 * h] {
                let e = rel_err(&values_a[seg.clone()], &values[seg.clone()]);
                assert!(e <= 1e-5, "{name}[{seg:?}]: rel {e:e}");
            }
            continue;
        }
        let e = rel_err(values_a, values);
        assert!(e <= 1e-5, "{name}: rel {e:e}");
    }
    // And exactly what the checkpoint holds.
    let ck = Checkpoint::open(&tp2.join("checkpoints")).unwrap();
    let full = ck.read_full().unwrap();
    assert_eq!(
        ta["transformer.h.0.attn.c_attn.weight"].1,
        full.params["blocks.0.attn.qkv.linear.weight"]
    );
    assert_eq!(
        ta["transformer.wte.weight"].1,
        full.params["wte.embedding.weight"]
    );
}

fn generate(checkpoint: &Path, extra: &[&str]) -> Run {
    let mut cmd = Command::new(MERAK);
    cmd.arg("generate")
        .arg("--checkpoint")
        .arg(checkpoint)
        .args(extra);
    run_with_deadline(cmd, Duration::from_secs(60))
}

#[test]
fn generate_continues_a_prompt_from_any_layout() {
    let tp2 = out_dir("generate-tp2");
    run_train(2, &tp2, 3, &["--tp", "2"]).assert_success();
    let single = out_dir("generate-1");
    run_train(0, &single, 3, &[]).assert_success();
    let args = [
        "--prompt-ids",
        "5,17,42",
        "--max-new-tokens",
        "6",
        "--print-ids",
    ];
    let a = generate(&tp2.join("checkpoints"), &args);
    a.assert_success();
    let last = a.stdout.lines().last().unwrap_or_default().to_string();
    let ids: Vec<i64> = last.split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(ids.len(), 3 + 6, "{last}");
    assert_eq!(&ids[..3], &[5, 17, 42]);
    let b = generate(&single.join("checkpoints"), &args);
    b.assert_success();
    assert_eq!(b.stdout.lines().last().unwrap_or_default(), last);
    // Seeded sampling is reproducible.
    let hot = [&args[..], &["--temperature", "1.5", "--seed", "3"]].concat();
    let (x, y) = (
        generate(&tp2.join("checkpoints"), &hot),
        generate(&tp2.join("checkpoints"), &hot),
    );
    x.assert_success();
    assert_eq!(x.stdout, y.stdout);
    // The tiny model was not trained on GPT-2 tokens: text prompts are refused with a hint.
    let text = generate(&tp2.join("checkpoints"), &["--prompt", "Hello, world"]);
    assert_ne!(text.code, Some(0));
    assert!(text.stderr.contains("--prompt-ids"), "{}", text.stderr);
    // Output is bounded by the model's context, and sampling options are checked.
    for (extra, needle) in [
        (
            ["--max-new-tokens", "18446744073709551615"],
            "context of 32 tokens",
        ),
        (["--top-k", "0"], "--top-k 0"),
        (["--temperature", "NaN"], "--temperature NaN"),
    ] {
        let run = generate(
            &tp2.join("checkpoints"),
            &[&["--prompt-ids", "5,17"][..], &extra].concat(),
        );
        assert_eq!(run.code, Some(2), "{extra:?}: {}", run.stderr);
        assert!(run.stderr.contains(needle), "{extra:?}: {}", run.stderr);
    }
}

#[test]
fn bert_checkpoints_resume_under_another_layout() {
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml");
    let full = out_dir("bert-ckpt-tp2");
    let mut cmd = merak(2);
    cmd.arg("train")
        .arg("--config")
        .arg(&bert)
        .args([
            "--tp",
            "2",
            "--set",
            "train.steps=5",
            "--set",
            "checkpoint.every=2",
        ])
        .arg("--out")
        .arg(&full);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    let out = out_dir("bert-ckpt-resume-1");
    run_resume(
        0,
        &full.join("checkpoints/step-00000002"),
        &out,
        &["--tp", "1"],
    )
    .assert_success();
    let resumed = read_metrics(&out);
    assert_eq!(resumed.len(), 3, "steps 3..=5");
    assert_steps_match("bert tp2 -> tp1", &resumed, &read_metrics(&full), 1e-5);
}

/// Every tensor of the checkpoint after `step` steps in `out` (parameters, moments), bitwise.
fn saved_tensors(out: &Path, step: usize) -> Vec<(String, Vec<u32>)> {
    let dir = out.join(format!("checkpoints/step-{step:08}"));
    let full = Checkpoint::open(&dir)
        .expect("opens")
        .read_full()
        .expect("reads");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut all: Vec<(String, Vec<u32>)> = (full.params.iter())
        .map(|(n, v)| (format!("param/{n}"), bits(v)))
        .collect();
    for (n, m) in &full.moments {
        all.push((format!("m1/{n}@{}", m.time), bits(&m.m1)));
        all.push((format!("m2/{n}@{}", m.time), bits(&m.m2)));
    }
    all.sort();
    all
}

#[test]
fn asynchronous_saves_equal_synchronous_ones_bit_for_bit() {
    // 5 steps, saves after steps 2, 4 and 5: the one after step 2 is completed by a later
    // step's poll or by the next save, the last one at the end of the run.
    for zero in ["0", "3"] {
        let mut runs = Vec::new();
        for asynchronous in ["false", "true"] {
            let out = out_dir(&format!("async-zero{zero}-{asynchronous}"));
            let extra = [
                "--dp",
                "2",
                "--set",
                &format!("parallel.zero={zero}"),
                "--set",
                "checkpoint.every=2",
                "--set",
                "checkpoint.keep=0",
                "--set",
                &format!("checkpoint.async={asynchronous}"),
            ];
            let run = run_train(2, &out, 5, &extra);
            run.assert_success();
            let how = match asynchronous {
                "true" => "on the writer thread",
                _ => "written on the training thread",
            };
            let logged = run.stderr.matches(how).count();
            assert_eq!(logged, 3, "zero {zero}: three saves {how}:\n{}", run.stderr);
            runs.push(out);
        }
        let (sync, asynchronous) = (&runs[0], &runs[1]);
        let name = format!("zero {zero}: async against sync");
        assert_steps_match(&name, &read_metrics(asynchronous), &read_metrics(sync), 0.0);
        for step in [2, 4, 5] {
            let (a, s) = (saved_tensors(asynchronous, step), saved_tensors(sync, step));
            assert_eq!(a.len(), s.len(), "{name}: tensors of step {step}");
            for ((na, va), (ns, vs)) in a.iter().zip(&s) {
                assert_eq!(na, ns, "{name}: step {step}");
                assert!(va == vs, "{name}: step {step}: {na} differs");
            }
        }
    }
}

#[test]
fn a_job_killed_while_an_asynchronous_save_is_written_resumes_exactly() {
    let settings = [
        "--dp",
        "2",
        "--set",
        "checkpoint.every=2",
        "--set",
        "checkpoint.async=true",
    ];
    // The second save's writer on rank 0 aborts the job with its shard written and its entry
    // not: step 2's checkpoint is the newest complete one.
    let out = out_dir("async-killed");
    let mut cmd = merak(2);
    train_args(&mut cmd, &out, &["--set", "train.steps=6"]);
    cmd.args(settings)
        .env(merak_burn::checkpoint::fault::ABORT_AT, "save:writing@2")
        .current_dir(out.parent().unwrap_or(&out));
    let killed = run_with_deadline(cmd, Duration::from_secs(300));
    assert_ne!(killed.code, Some(0), "{killed:?}");
    assert!(
        killed.stderr.contains("save:writing@2"),
        "{}",
        killed.stderr
    );
    let last = Checkpoint::open(&out.join("checkpoints")).expect("a complete checkpoint");
    assert_eq!(last.manifest.step, 2);
    let mut cmd = resume_cmd(2, &out.join("checkpoints"), &out);
    cmd.args(["--set", "train.steps=6"]);
    run_with_deadline(cmd, Duration::from_secs(300)).assert_success();
    let resumed = read_metrics(&out);
    assert_eq!(resumed.len(), 6, "steps 1..=6 in metrics.jsonl");
    let reference = out_dir("async-killed-reference");
    run_train(2, &reference, 6, &settings).assert_success();
    assert_steps_match("after the abort", &resumed, &read_metrics(&reference), 0.0);
    let listing = merak_burn::checkpoint::root::list(&out.join("checkpoints")).expect("listed");
    assert!(listing.unfinished.is_empty(), "{listing:?}");
    assert_eq!(saved_tensors(&out, 6), saved_tensors(&reference, 6));
}
