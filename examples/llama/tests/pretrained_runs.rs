//! Runs that start from a Hugging Face `LlamaForCausalLM` or `MixtralForCausalLM` (the
//! committed fixtures, made by `scripts/hf-llama-fixture.py`) under any layout, and
//! checkpoints exported back.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::{Checkpoint, FullState};
use merak_example_llama::read_hf_llama;
use merak_tests::{mpirun, rel_err, run_with_deadline};

const BIN: &str = env!("CARGO_BIN_EXE_llama-train");
const EXPORT: &str = env!("CARGO_BIN_EXE_llama-export");
const TOL: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("merak-llama-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `llama-train --init-from <fixture>` for 3 steps on `np` ranks with `args`, into `out`:
/// its losses and final parameters.
fn train_from(fixture: &Path, np: usize, out: &Path, args: &[&str]) -> (Vec<f64>, FullState) {
    let mut cmd = if np == 1 {
        Command::new(BIN)
    } else {
        let mut c = mpirun(np);
        c.arg(BIN);
        c
    };
    cmd.args(["--steps", "3", "--seq", "16", "--init-from"])
        .arg(fixture)
        .args(args)
        .arg("--out")
        .arg(out);
    let run = run_with_deadline(cmd, Duration::from_secs(240));
    run.assert_success();
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    let losses = (text.lines())
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"]
                .as_f64()
                .expect("a loss")
        })
        .collect();
    let state = Checkpoint::open(&out.join("checkpoints")).and_then(|c| c.read_full());
    (
        losses,
        state.unwrap_or_else(|e| panic!("{}: {e}", out.display())),
    )
}

/// The loss of the pretrained model in `dir` on the first global batch `llama-train` trains on
/// (seed 7, 8 sequences of 16 tokens), computed here in one process with Burn's operators.
fn pretrained_loss(dir: &Path) -> f64 {
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::tensor::{Int, Tensor, TensorData};
    use merak_burn::backend::Cpu;
    use merak_burn::train::{TokenSource, TrainSettings};
    use merak_example_llama::{Counting, Llama, LlamaConfig};

    let hf = read_hf_llama(dir).expect("the fixture");
    let cfg = LlamaConfig {
        max_seq: 16,
        ..hf.config
    };
    let device = Default::default();
    let model = Llama::<Cpu>::from_full_params(&cfg, &hf.params, &device).expect("loaded");
    let settings = TrainSettings::default()
        .with_seq_len(16)
        .with_global_batch(8)
        .with_seed(7);
    let w = Counting::new(cfg.vocab, &settings)
        .train_windows(0, 0, 8)
        .expect("data");
    let ids = |v: Vec<i64>| Tensor::<Cpu, 2, Int>::from_data(TensorData::new(v, [8, 16]), &device);
    let logits = model.logits(ids(w.inputs)).reshape([8 * 16, cfg.vocab]);
    let loss = CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits, ids(w.targets).reshape([8 * 16]));
    f64::from(loss.into_scalar())
}

fn assert_close(name: &str, got: &(Vec<f64>, FullState), want: &(Vec<f64>, FullState)) {
    assert_eq!(got.0.len(), want.0.len(), "{name}");
    for (a, b) in got.0.iter().zip(&want.0) {
        assert!((a - b).abs() <= TOL * b.abs(), "{name}: loss {a} vs {b}");
    }
    assert_eq!(got.1.params.len(), want.1.params.len(), "{name}");
    for (p, w) in &want.1.params {
        let g = got
            .1
            .params
            .get(p)
            .unwrap_or_else(|| panic!("{name}: no {p}"));
        assert!(
            rel_err(g, w) <= TOL,
            "{name}: {p} differs by {:.2e}",
            rel_err(g, w)
        );
    }
}

/// The grouped-query fixture (4 heads, 2 key/value heads, Llama-3 rope scaling) trained from
/// its pretrained weights under tp=2 (the key/value heads split), tp=4 (each key/value head
/// shared by two ranks), pp=2 and dp=2 x pp=2 equals one process; the first step's loss is
/// the pretrained model's.
#[test]
fn a_pretrained_llama_trains_under_every_layout_as_one_process() {
    assert_layouts_equal_one_process(
        "gqa",
        &[
            (2, "tp2", &["--tp", "2"]),
            (4, "tp4", &["--tp", "4"]),
            (2, "pp2", &["--pp", "2"]),
            (4, "dp2pp2", &["--dp", "2", "--pp", "2"]),
        ],
    );
}

/// The Mixtral fixture (4 experts, 2 per token, the routers' load-balancing loss on) trained
/// from its pretrained weights under dp=2 (the experts' gradients summed over the ranks),
/// tp=2 (every rank holds the experts whole), pp=2, dp=2 x pp=2 and ep=2 (each rank imports
/// and trains two of the experts) equals one process, with
/// finite losses; the first step's loss is the pretrained model's.
#[test]
fn a_pretrained_mixtral_trains_under_every_layout_as_one_process() {
    let losses = assert_layouts_equal_one_process(
        "mixtral",
        &[
            (2, "dp2", &["--dp", "2"]),
            (2, "tp2", &["--tp", "2"]),
            (2, "pp2", &["--pp", "2"]),
            (4, "dp2pp2", &["--dp", "2", "--pp", "2"]),
            (2, "ep2", &["--dp", "2", "--ep", "2"]),
        ],
    );
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// `llama-train --init-from <fixture name>` under each of `layouts` (ranks, name, arguments)
/// equals one process; the first step's loss is the pretrained model's. Returns the one
/// process's losses.
fn assert_layouts_equal_one_process(name: &str, layouts: &[(usize, &str, &[&str])]) -> Vec<f64> {
    let pretrained = fixture(name);
    let dir = scratch(&format!("layouts-{name}"));
    let want = train_from(&pretrained, 1, &dir.join("single"), &[]);
    let first = pretrained_loss(&pretrained);
    assert!(
        (want.0[0] - first).abs() <= TOL * first,
        "{name}: step 1's loss {} is the pretrained model's {first}",
        want.0[0]
    );
    for &(np, layout, args) in layouts {
        let got = train_from(&pretrained, np, &dir.join(layout), args);
        assert_close(&format!("{name} {layout}"), &got, &want);
    }
    let _ = std::fs::remove_dir_all(&dir);
    want.0
}

/// A checkpoint of a tp=2 run from the tied multi-file fixture, exported by `llama-export`,
/// reads back (as transformers would load it) with every parameter the checkpoint holds, and
/// a split export reads back the same.
#[test]
fn a_checkpoint_exported_reads_back_as_the_checkpoint() {
    let dir = scratch("export");
    let (_, state) = train_from(&fixture("tied"), 2, &dir.join("run"), &["--tp", "2"]);
    for (name, extra) in [("one", vec![]), ("split", vec!["--shard-mib", "0"])] {
        let out = dir.join(name);
        let mut cmd = Command::new(EXPORT);
        cmd.arg(dir.join("run/checkpoints")).arg(&out).args(&extra);
        run_with_deadline(cmd, Duration::from_secs(60)).assert_success();
        let back = read_hf_llama(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(back.config.tie_embeddings && back.config.kv_heads == 1);
        assert_eq!(back.params.len(), state.params.len(), "{name}");
        for (p, values) in &state.params {
            let got = &back
                .params
                .get(p)
                .unwrap_or_else(|| panic!("{name}: no {p}"))
                .1;
            assert_eq!(got, values, "{name}: {p}");
        }
    }
    // A folder that is not a llama-train checkpoint is refused, naming it.
    let mut cmd = Command::new(EXPORT);
    cmd.arg(dir.join("one")).arg(dir.join("again"));
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_ne!(run.code, Some(0));
    assert!(run.stderr.contains("one"), "{}", run.stderr);
    assert!(!dir.join("again").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
