//! End-to-end tests of `merak train --init-from`: a model exported from a checkpoint starts
//! training under tp = 2 x pp = 2 (and dp = 2 x pp = 2) exactly where one process and the
//! checkpoint itself are, and a bad file is refused on every rank before training, naming it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::{Checkpoint, NamedTensor, shard_file};
use merak_tests::{Run, WEIGHTS_HELD, assert_close, rel_err, run_with_deadline};

mod common;
use common::*;

/// A mixture of experts in every block of the tiny GPT.
const MOE: [&str; 6] = [
    "--set",
    "model.moe.experts=4",
    "--set",
    "model.moe.top_k=2",
    "--set",
    "model.moe.expert_hidden=16",
];

/// An odd vocabulary, so that tp = 2 pads the token table.
const VOCAB: [&str; 2] = ["--set", "model.vocab_size=509"];

/// Trains the tiny GPT (vocabulary 509) for `steps` steps in one process and exports its
/// checkpoint: the safetensors file (with `config.json` beside it) and the checkpoint folder.
fn exported(name: &str, steps: usize) -> (PathBuf, PathBuf) {
    let out = out_dir(name);
    let mut cmd = merak(0);
    let steps = format!("train.steps={steps}");
    train_args(&mut cmd, &out, &["--set", &steps]);
    cmd.args(VOCAB);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    let checkpoints = out.join("checkpoints");
    let file = out.join("hf/model.safetensors");
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(&checkpoints)
        .arg("--output")
        .arg(&file);
    run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
    (file, checkpoints)
}

/// `merak train` (tiny GPT, synthetic data, vocabulary 509) on `np` ranks (0: no mpirun)
/// writing into `out`; `extra` goes last.
fn train_run(np: usize, out: &Path, extra: &[&str]) -> Run {
    let mut cmd = merak(np);
    train_args(&mut cmd, out, &VOCAB);
    cmd.args(extra);
    run_with_deadline(cmd, Duration::from_secs(120))
}

/// `merak train --init-from file` with the weights held fixed; its metrics.
fn init_from(np: usize, file: &Path, name: &str, layout: &[&str]) -> Vec<serde_json::Value> {
    let out = out_dir(name);
    let mut extra = vec!["--init-from", file.to_str().unwrap()];
    extra.extend(WEIGHTS_HELD);
    extra.extend(layout);
    let run = train_run(np, &out, &extra);
    run.assert_success();
    assert!(
        run.stderr.contains("init: 28 parameters from"),
        "{}",
        run.stderr
    );
    read_metrics(&out)
}

fn value(record: &serde_json::Value, key: &str) -> f32 {
    record[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {record}")) as f32
}

/// The tensors of a safetensors file written by `merak export`, by name.
fn read_tensors(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("export written");
    let (tensors, _) = shard_file::decode(&bytes, path).expect("valid safetensors");
    tensors
        .into_iter()
        .map(|t| (t.name, (t.shape, t.values)))
        .collect()
}

#[test]
fn init_from_an_export_starts_where_the_checkpoint_is_under_any_layout() {
    let (file, checkpoints) = exported("init-src", 20);

    let single = init_from(0, &file, "init-1", &[]);
    assert_eq!(single.len(), 2);
    for (name, layout) in [
        ("init-tp2-pp2", ["--tp", "2", "--pp", "2"]),
        ("init-dp2-pp2", ["--dp", "2", "--pp", "2"]),
    ] {
        let m = init_from(4, &file, name, &layout);
        assert_eq!(m.len(), 2, "{name}");
        for (g, w) in m.iter().zip(&single) {
            for key in ["loss", "grad_norm", "val_loss"] {
                let step = &g["step"];
                assert_close(
                    &format!("{name}: {key} at step {step}"),
                    value(g, key),
                    value(w, key),
                );
            }
        }
    }

    // The checkpoint the file was exported from gives the same held-out loss (a resumed run
    // with the weights held fixed: its training batches are later ones, the held-out ones
    // the same).
    let resumed = out_dir("init-resumed");
    let mut cmd = resume_cmd(0, &checkpoints, &resumed);
    cmd.args(WEIGHTS_HELD).args(["--set", "train.steps=21"]);
    run_with_deadline(cmd, Duration::from_secs(120)).assert_success();
    let resumed = read_metrics(&resumed);
    let step21 = resumed
        .iter()
        .find(|r| r["step"] == 21)
        .expect("step 21 in the resumed run");
    assert_close(
        "held-out loss: the checkpoint vs --init-from its export",
        value(&single[0], "val_loss"),
        value(step21, "val_loss"),
    );

    // Without --init-from the same run starts elsewhere: the weights did come from the file.
    let fresh = out_dir("init-none");
    train_run(0, &fresh, &WEIGHTS_HELD).assert_success();
    let (a, b) = (
        value(&read_metrics(&fresh)[0], "loss"),
        value(&single[0], "loss"),
    );
    assert!((a - b).abs() > 1e-2 * b, "fresh {a} vs loaded {b}");

    // What the tp = 2 x pp = 2 ranks loaded (and saved, two steps later) is the file,
    // the padded vocabulary rows cut off again.
    let saved = Checkpoint::open(&out_dir_path("init-tp2-pp2").join("checkpoints"))
        .expect("the tp2 x pp2 run saved")
        .read_full()
        .expect("its checkpoint reads");
    let tensors = read_tensors(&file);
    assert_eq!(saved.params.len(), tensors.len());
    for (name, values) in &saved.params {
        let hf = merak_gpt::hf::hf_gpt2_name(name).unwrap();
        let e = rel_err(values, &tensors[&hf].1);
        assert!(e <= 1e-5, "{name}: rel {e:e} from the file's {hf}");
    }
    mtp_depths_keep_their_initial_values(&file, &tensors);
}

/// A model with a multi-token-prediction depth (`model.mtp_depth = 1`) starts from the GPT-2
/// file (at tp = 2 x pp = 2, the depth on the last stage): its main model takes the file's
/// weights, its depth (which the file cannot hold) the values it starts with without the file.
fn mtp_depths_keep_their_initial_values(
    file: &Path,
    tensors: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) {
    let mtp = ["--set", "model.mtp_depth=1"];
    let saved = |name: &str, extra: &[&str]| {
        let out = out_dir(name);
        train_run(4, &out, &[&WEIGHTS_HELD[..], &mtp, extra].concat()).assert_success();
        let c = Checkpoint::open(&out.join("checkpoints")).expect("a checkpoint");
        c.read_full().expect("it reads").params
    };
    let layout = ["--tp", "2", "--pp", "2"];
    let path = file.to_str().expect("a UTF-8 path");
    let loaded = saved("init-mtp", &[&layout[..], &["--init-from", path]].concat());
    let fresh = saved("init-mtp-none", &layout);
    for (name, values) in &loaded {
        let want = match merak_gpt::hf::hf_gpt2_name(name) {
            Some(hf) => &tensors[&hf].1,
            None => &fresh[name],
        };
        // Held weights move by about the learning rate (1e-12): near zero, compare absolutely.
        let worst = (values.iter().zip(want)).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-6, "{name}: differs by {worst:e}");
    }
    assert!(loaded.contains_key("mtp.0.proj"), "the depth is saved");
}

/// The folder `out_dir(name)` names, without emptying it.
fn out_dir_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Writes `tensors` and the `config.json` of `like`'s folder into `dir/model.safetensors`.
fn write_variant(dir: &Path, like: &Path, tensors: &[NamedTensor]) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let config = like.parent().unwrap().join("config.json");
    std::fs::copy(config, dir.join("config.json")).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, shard_file::encode(tensors, HashMap::new()).unwrap()).unwrap();
    path
}

/// `merak train --init-from file` on `np` ranks with `extra`; it must fail before training.
/// Returns stderr.
fn refused(np: usize, file: &Path, name: &str, extra: &[&str]) -> String {
    let out = out_dir(name);
    let mut args = vec!["--init-from", file.to_str().unwrap()];
    args.extend(extra);
    let run = train_run(np, &out, &args);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        !out.join("metrics.jsonl").exists(),
        "training started: {run:?}"
    );
    run.stderr
}

#[test]
fn a_bad_file_is_refused_on_every_rank_before_training() {
    let (file, checkpoints) = exported("init-bad-src", 2);
    let root = out_dir_path("init-bad-files");
    let bytes = std::fs::read(&file).unwrap();
    let (tensors, _) = shard_file::decode(&bytes, &file).unwrap();

    // A tensor of another shape: the file, the tensor and both shapes are named, by every
    // rank's job (tp = 2 x pp = 2 here).
    let mut narrow = tensors.clone();
    let fc = narrow
        .iter_mut()
        .find(|t| t.name == "transformer.h.1.mlp.c_fc.weight")
        .unwrap();
    fc.shape = vec![64, 128];
    fc.values.truncate(64 * 128);
    let bad = write_variant(&root.join("narrow"), &file, &narrow);
    let e = refused(4, &bad, "init-bad-narrow", &["--tp", "2", "--pp", "2"]);
    assert!(
        e.contains("narrow/model.safetensors")
            && e.contains("tensor transformer.h.1.mlp.c_fc.weight has shape [64, 128]")
            && e.contains("expects [64, 256]"),
        "{e}"
    );

    // A missing tensor.
    let mut missing = tensors.clone();
    missing.retain(|t| t.name != "transformer.ln_f.bias");
    let bad = write_variant(&root.join("missing"), &file, &missing);
    let e = refused(0, &bad, "init-bad-missing", &[]);
    assert!(
        e.contains("missing/model.safetensors")
            && e.contains("tensor transformer.ln_f.bias is missing"),
        "{e}"
    );

    // A truncated file.
    let cut = root.join("truncated");
    let bad = write_variant(&cut, &file, &tensors);
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let e = refused(2, &bad, "init-bad-truncated", &["--tp", "2"]);
    assert!(
        e.contains("truncated/model.safetensors") && e.contains("not a valid safetensors file"),
        "{e}"
    );

    // Another model than the file's: config.json names the key.
    let e = refused(0, &file, "init-bad-hidden", &["--set", "model.hidden=32"]);
    assert!(
        e.contains("config.json")
            && e.contains("`n_embd` is 64")
            && e.contains("model.hidden = 32"),
        "{e}"
    );
    // Dense GPT-2 weights into a mixture of experts: exit 2 before any folder is made,
    // naming model.moe and what the file lacks.
    let out = out_dir("init-bad-moe");
    let mut args = vec!["--init-from", file.to_str().unwrap()];
    args.extend(MOE);
    let run = train_run(0, &out, &args);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("model.moe: 4 experts in blocks 0, 1")
            && run.stderr.contains("no router and no experts"),
        "{}",
        run.stderr
    );
    assert!(!out.exists(), "a refused run left {}", out.display());
    // A file that is not there.
    let e = refused(0, &root.join("none.safetensors"), "init-bad-none", &[]);
    assert!(e.contains("none.safetensors"), "{e}");

    // GPT-2 weights into a BERT: config.json says so; not with --resume.
    let out = out_dir("init-bad-bert");
    let mut cmd = merak(0);
    cmd.arg("train")
        .arg("--config")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml"))
        .arg("--init-from")
        .arg(&file)
        .arg("--out")
        .arg(&out);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        run.stderr.contains("`model_type` is \"gpt2\"") && !out.join("metrics.jsonl").exists(),
        "{run:?}"
    );
    let e = refused(
        0,
        &file,
        "init-bad-resume",
        &["--resume", checkpoints.to_str().unwrap()],
    );
    assert!(e.contains("cannot be used with"), "{e}");
}
