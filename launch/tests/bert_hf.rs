//! End-to-end tests of Hugging Face `BertForMaskedLM` in and out of `merak`: `merak train
//! --init-from` of the committed transformers fixture (models/bert/tests/fixtures/bert-hf, from
//! `scripts/hf-bert-fixture.py`) starts under tp = 2 and pp = 2 exactly where one process
//! does, with the file's weights; `merak export` of a BERT checkpoint gives a file that imports
//! back to the checkpoint's parameters and logits; bad files are refused on every rank before
//! training, naming the file and the tensor or key.
//!
//! With `MERAK_HF_PYTHON` set to a Python with torch and transformers (e.g.
//! `/work/.venv-hf/bin/python`), the export is also loaded by transformers and its logits
//! compared with merak's (skipped otherwise: CI has no PyTorch).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_bert::hf_import::read_hf_bert;
use merak_bert::{Bert, BertConfig};
use merak_burn::backend::Cpu;
use merak_burn::checkpoint::{Checkpoint, NamedTensor, cut_full_params, shard_file, state};
use merak_burn::comm::Group;
use merak_burn::pipeline::PipelineModel;
use merak_burn::tensor_parallel::Shard;
use merak_tests::{Run, WEIGHTS_HELD, assert_close, rel_err, run_with_deadline};

mod common;
use common::*;

/// The committed `BertForMaskedLM` fixture.
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/bert/tests/fixtures/bert-hf")
}

fn bert_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml")
}

/// The fixture's shape over configs/bert-tiny.toml (2 layers, 4 heads): vocabulary 101 (odd,
/// so tp = 2 pads it), hidden 32, 16 positions; synthetic data.
const SHAPE: [&str; 8] = [
    "--set",
    "model.vocab_size=101",
    "--set",
    "model.hidden=32",
    "--set",
    "model.seq_len=16",
    "--set",
    "data.kind=synthetic",
];

/// The merak BERT of [`SHAPE`].
fn shape() -> BertConfig {
    let shape = "bert:layers=2,hidden=32,heads=4,seq=16,vocab=101".parse();
    BertConfig::from_shape(&shape.unwrap())
}

/// `merak train` of the tiny BERT of [`SHAPE`] on `np` ranks (0: no mpirun) into `out`;
/// `extra` goes last.
fn bert_run(np: usize, out: &Path, extra: &[&str]) -> Run {
    let mut cmd = merak(np);
    cmd.arg("train")
        .arg("--config")
        .arg(bert_config())
        .arg("--out")
        .arg(out)
        .args(SHAPE)
        .args(extra);
    run_with_deadline(cmd, Duration::from_secs(180))
}

/// `merak train --init-from file` with the weights held fixed; its metrics.
fn init_from(np: usize, file: &Path, name: &str, layout: &[&str]) -> Vec<serde_json::Value> {
    let out = out_dir(name);
    let mut extra = vec!["--init-from", file.to_str().unwrap()];
    extra.extend(WEIGHTS_HELD);
    extra.extend(layout);
    let run = bert_run(np, &out, &extra);
    run.assert_success();
    assert!(
        run.stderr.contains("init: 32 parameters from"),
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

#[test]
fn init_from_transformers_weights_starts_where_one_process_does_under_tp_and_pp() {
    let file = fixture().join("model.safetensors");
    let single = init_from(0, &file, "bert-init-1", &[]);
    assert_eq!(single.len(), 2);
    for (name, layout) in [
        ("bert-init-tp2", ["--tp", "2"]),
        ("bert-init-pp2", ["--pp", "2"]),
    ] {
        let m = init_from(2, &file, name, &layout);
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

    // Without --init-from the same run starts elsewhere: the weights did come from the file.
    let fresh = out_dir("bert-init-none");
    bert_run(0, &fresh, &WEIGHTS_HELD).assert_success();
    let (a, b) = (
        value(&read_metrics(&fresh)[0], "loss"),
        value(&single[0], "loss"),
    );
    assert!((a - b).abs() > 1e-2 * b, "fresh {a} vs loaded {b}");

    // What the tp = 2 ranks loaded (and saved, two steps later) is the file, the padded
    // vocabulary row cut off again.
    let want = read_hf_bert(&file, &shape()).unwrap().params;
    for name in ["bert-init-tp2", "bert-init-pp2"] {
        let saved = Checkpoint::open(&out_dir_path(name).join("checkpoints"))
            .expect("the run saved")
            .read_full()
            .expect("its checkpoint reads");
        assert_eq!(saved.params.len(), want.len(), "{name}");
        for (param, values) in &saved.params {
            let e = rel_err(values, &want[param].1);
            assert!(e <= 1e-5, "{name}: {param}: rel {e:e} from the file");
        }
    }

    // The tp = 2 run's checkpoint, exported, is the fixture again for transformers: its
    // logits are the fixture's (when a Python with transformers is named).
    if let Ok(python) = std::env::var("MERAK_HF_PYTHON")
        && !python.is_empty()
    {
        let dir = out_dir_path("bert-init-tp2").join("hf");
        let mut cmd = Command::new(MERAK);
        cmd.arg("export")
            .arg("--checkpoint")
            .arg(out_dir_path("bert-init-tp2").join("checkpoints"))
            .arg("--output")
            .arg(dir.join("model.safetensors"));
        run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hf-bert-fixture.py");
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .arg("--check")
            .arg(&dir)
            .arg("--expected")
            .arg(fixture().join("expected.json"));
        let run = run_with_deadline(cmd, Duration::from_secs(300));
        eprintln!("{}", run.stdout);
        run.assert_success();
    }
}

/// The folder `out_dir(name)` names, without emptying it.
fn out_dir_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// A `--logits-out` file: the ids, the logits' shape and values.
type Logits = (Vec<i64>, Vec<usize>, Vec<f32>);

/// Reads a `--logits-out` file.
fn read_logits(path: &Path) -> Logits {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).expect("logits written")).unwrap();
    let get = |key: &str| json[key].clone();
    let logits: Vec<f64> = serde_json::from_value(get("logits")).unwrap();
    (
        serde_json::from_value(get("ids")).unwrap(),
        serde_json::from_value(get("shape")).unwrap(),
        logits.into_iter().map(|x| x as f32).collect(),
    )
}

#[test]
fn a_bert_checkpoint_exports_to_bert_for_masked_lm_and_imports_back() {
    // Five steps at the config's learning rate: weights away from their initialization.
    let out = out_dir("bert-export-src");
    bert_run(0, &out, &["--set", "train.steps=5"]).assert_success();
    let checkpoints = out.join("checkpoints");
    let dir = out.join("hf");
    let file = dir.join("model.safetensors");
    let logits_file = out.join("logits.json");
    let mut cmd = Command::new(MERAK);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(&checkpoints)
        .arg("--output")
        .arg(&file)
        .arg("--logits-out")
        .arg(&logits_file);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    run.assert_success();
    assert!(run.stdout.contains("42 tensors"), "{}", run.stdout);

    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    for (key, want) in [
        ("model_type", serde_json::json!("bert")),
        ("architectures", serde_json::json!(["BertForMaskedLM"])),
        ("hidden_act", serde_json::json!("gelu")),
        ("layer_norm_eps", serde_json::json!(1e-12)),
        ("vocab_size", serde_json::json!(101)),
        ("intermediate_size", serde_json::json!(128)),
        ("max_position_embeddings", serde_json::json!(16)),
        ("tie_word_embeddings", serde_json::json!(true)),
    ] {
        assert_eq!(config[key], want, "{key}");
    }

    // The export imports back to the checkpoint's parameters, bit for bit.
    let saved = Checkpoint::open(&checkpoints).unwrap().read_full().unwrap();
    let w = read_hf_bert(&file, &shape()).unwrap();
    assert!(w.notes.is_empty(), "{:?}", w.notes);
    assert_eq!(w.params.len(), saved.params.len());
    for (name, values) in &saved.params {
        assert_eq!(&w.params[name].1, values, "{name}");
    }

    // merak's logits of the checkpoint (written by export) are those of the imported file.
    let (ids, dims, want) = read_logits(&logits_file);
    assert_eq!(dims, vec![16, 101]);
    assert!(ids.contains(&100), "[MASK] among the default ids: {ids:?}");
    let model = Bert::<Cpu>::new(&shape(), 3, Group::local(), &Default::default()).unwrap();
    let shapes = state::param_shapes(&model);
    let local = cut_full_params(&w.params, &shapes, Shard::FULL, &model.tied_names()).unwrap();
    let model = state::assign_params(model, local).unwrap();
    let x = burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(ids.clone(), [1, ids.len()]),
        &Default::default(),
    );
    let got = model.logits(x).into_data().into_vec::<f32>().unwrap();
    let e = rel_err(&got, &want);
    assert!(e <= 1e-6, "logits rel {e:e}");

    // transformers loads the export and computes merak's logits (when a Python with it is
    // named).
    match std::env::var("MERAK_HF_PYTHON") {
        Ok(python) if !python.is_empty() => {
            let script =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hf-bert-fixture.py");
            let mut cmd = Command::new(python);
            cmd.arg(script)
                .arg("--check")
                .arg(&dir)
                .arg("--expected")
                .arg(&logits_file);
            let run = run_with_deadline(cmd, Duration::from_secs(300));
            eprintln!("{}", run.stdout);
            run.assert_success();
        }
        _ => eprintln!("MERAK_HF_PYTHON not set: the export is not loaded by transformers"),
    }
}

/// Writes `tensors` into `dir/model.safetensors`, with the fixture's config.json edited by
/// `config`.
fn write_variant(
    dir: &Path,
    tensors: &[NamedTensor],
    config: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    config(&mut json);
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, shard_file::encode(tensors, HashMap::new()).unwrap()).unwrap();
    path
}

/// `merak train --init-from file` of the tiny BERT on `np` ranks with `extra`; it must fail
/// before training, without a panic. Returns stderr.
fn refused(np: usize, file: &Path, name: &str, extra: &[&str]) -> String {
    let out = out_dir(name);
    let mut args = vec!["--init-from", file.to_str().unwrap()];
    args.extend(extra);
    let run = bert_run(np, &out, &args);
    assert_ne!(run.code, Some(0), "{run:?}");
    assert!(
        !out.join("metrics.jsonl").exists(),
        "training started: {run:?}"
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    run.stderr
}

#[test]
fn a_bad_bert_file_is_refused_on_every_rank_before_training() {
    let file = fixture().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let (tensors, _) = shard_file::decode(&bytes, &file).unwrap();
    let root = out_dir_path("bert-bad-files");
    let edited = |name: &str, edit: &dyn Fn(&mut NamedTensor)| {
        let mut t = tensors.clone();
        edit(t.iter_mut().find(|t| t.name == name).unwrap());
        t
    };

    // A tensor of another shape, refused by both tp = 2 ranks.
    let fc = "bert.encoder.layer.1.intermediate.dense.weight";
    let narrow = edited(fc, &|t| {
        t.shape = vec![64, 32];
        t.values.truncate(64 * 32);
    });
    let bad = write_variant(&root.join("narrow"), &narrow, |_| {});
    let e = refused(2, &bad, "bert-bad-narrow", &["--tp", "2"]);
    assert!(
        e.contains("narrow/model.safetensors")
            && e.contains(&format!("tensor {fc} has shape [64, 32]"))
            && e.contains("expects [128, 32]"),
        "{e}"
    );

    // A missing tensor.
    let mut missing = tensors.clone();
    let ln = "cls.predictions.transform.LayerNorm.bias";
    missing.retain(|t| t.name != ln);
    let bad = write_variant(&root.join("missing"), &missing, |_| {});
    let e = refused(0, &bad, "bert-bad-missing", &[]);
    assert!(
        e.contains("missing/model.safetensors") && e.contains(&format!("tensor {ln} is missing")),
        "{e}"
    );

    // A truncated file.
    let bad = write_variant(&root.join("truncated"), &tensors, |_| {});
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let e = refused(2, &bad, "bert-bad-truncated", &["--tp", "2"]);
    assert!(
        e.contains("truncated/model.safetensors") && e.contains("not a valid safetensors file"),
        "{e}"
    );

    // A NaN, named with the tensor and the index.
    let q = "bert.encoder.layer.0.attention.self.value.weight";
    let nan = edited(q, &|t| t.values[17] = f32::NAN);
    let bad = write_variant(&root.join("nan"), &nan, |_| {});
    let e = refused(0, &bad, "bert-bad-nan", &[]);
    assert!(
        e.contains("nan/model.safetensors")
            && e.contains(&format!("tensor {q} holds NaN at index 17")),
        "{e}"
    );

    // An output bias merak's head does not have.
    let bias = edited("cls.predictions.bias", &|t| t.values[4] = 0.5);
    let bad = write_variant(&root.join("bias"), &bias, |_| {});
    let e = refused(0, &bad, "bert-bad-bias", &[]);
    assert!(
        e.contains("bias/model.safetensors")
            && e.contains("tensor cls.predictions.bias: holds 0.5 at index 4"),
        "{e}"
    );

    // config.json: another activation, another LayerNorm epsilon, another head count.
    let bad = write_variant(&root.join("act"), &tensors, |j| {
        j["hidden_act"] = "gelu_new".into()
    });
    let e = refused(0, &bad, "bert-bad-act", &[]);
    assert!(
        e.contains("act/config.json") && e.contains("`hidden_act` is \"gelu_new\""),
        "{e}"
    );
    let e = refused(
        0,
        &file,
        "bert-bad-eps",
        &["--set", "model.layer_norm_eps=1e-5"],
    );
    assert!(
        e.contains("bert-hf/config.json")
            && e.contains("`layer_norm_eps` is 1e-12")
            && e.contains("model.layer_norm_eps = 1e-5"),
        "{e}"
    );
    let e = refused(0, &file, "bert-bad-heads", &["--set", "model.heads=2"]);
    assert!(
        e.contains("`num_attention_heads` is 4") && e.contains("model.heads = 2"),
        "{e}"
    );
    // No config.json next to the file.
    let lone = root.join("lone");
    let _ = std::fs::remove_dir_all(&lone);
    std::fs::create_dir_all(&lone).unwrap();
    std::fs::copy(&file, lone.join("model.safetensors")).unwrap();
    let e = refused(0, &lone.join("model.safetensors"), "bert-bad-lone", &[]);
    assert!(e.contains("lone/config.json: missing"), "{e}");
}
