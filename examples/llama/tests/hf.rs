//! Hugging Face `LlamaForCausalLM` and `MixtralForCausalLM` in and out: the logits and greedy
//! continuation of the imported fixtures equal what transformers computed
//! (scripts/hf-llama-fixture.py), an export reads back as it was written, damaged and hostile
//! folders are refused naming the file and the tensor (never a panic), and grouped-query
//! attention (and a mixture of experts) under tensor parallelism (tp dividing kv_heads, and tp
//! a multiple of kv_heads) equals one process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::backend::{Cpu, CpuAutodiff};
use merak_burn::hf_files::{tensor_views, to_f32};
use merak_burn::tensor_parallel::{ParamSplits, SPLIT_CONTAINER, Shard, ShardKind};
use merak_example_llama::hf::{hf_config_json, llama_config_from_hf};
use merak_example_llama::{
    FullParams, HfLlama, Llama, LlamaConfig, SparseMoe, TpLayoutError, pretrained_or,
    read_hf_llama, tp_plan_for, write_hf_llama,
};
use serde_json::Value;

merak_tests::cap_allocations!();

/// Absolute tolerance on fp32 logits.
const TOL: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// What transformers computed for a fixture.
struct Expected {
    ids: Vec<Vec<i64>>,
    shape: Vec<usize>,
    logits: Vec<f32>,
    generated: Vec<Vec<i64>>,
    gaps: Vec<Vec<f32>>,
}

fn expected(name: &str) -> Expected {
    let path = fixture(name).join("expected.json");
    let text = std::fs::read(&path).unwrap();
    let v: Value = serde_json::from_slice(&text).unwrap();
    let ints = |v: &Value| -> Vec<Vec<i64>> {
        (v.as_array().unwrap().iter())
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect()
            })
            .collect()
    };
    let floats = |v: &Value| -> Vec<f32> {
        (v.as_array().unwrap().iter())
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    Expected {
        ids: ints(&v["input_ids"]),
        shape: (v["logits_shape"].as_array().unwrap().iter())
            .map(|x| x.as_u64().unwrap() as usize)
            .collect(),
        logits: floats(&v["logits"]),
        generated: ints(&v["generated"]),
        gaps: (v["gaps"].as_array().unwrap().iter()).map(floats).collect(),
    }
}

fn tokens<B: Backend>(ids: &[Vec<i64>], device: &B::Device) -> Tensor<B, 2, Int> {
    let flat: Vec<i64> = ids.concat();
    Tensor::from_data(TensorData::new(flat, [ids.len(), ids[0].len()]), device)
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The largest difference between the logits of the model `hf` and those transformers
/// computed (`want`).
fn logits_diff(name: &str, hf: &HfLlama, want: &Expected) -> f32 {
    let device = Default::default();
    let model = Llama::<Cpu>::from_full_params(&hf.config, &hf.params, &device).unwrap();
    let logits = model.logits(tokens(&want.ids, &device));
    assert_eq!(logits.dims().to_vec(), want.shape, "{name}");
    max_abs_diff(&values(logits), &want.logits)
}

/// The imported fixture `name` computes transformers' logits (within [`TOL`]) and greedy
/// continuation (the same tokens up to a step whose two best logits were within [`TOL`]).
fn assert_matches_transformers(name: &str) -> LlamaConfig {
    let hf = read_hf_llama(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let want = expected(name);
    let device = Default::default();
    let model = Llama::<Cpu>::from_full_params(&hf.config, &hf.params, &device).unwrap();
    let diff = logits_diff(name, &hf, &want);
    assert!(diff <= TOL, "{name}: logits differ by {diff:.3e}");
    eprintln!("{name}: the logits differ from transformers' by at most {diff:.3e}");
    let got = values::<Cpu, 2>(model.greedy(tokens(&want.ids, &device), 8).float());
    for (b, want_seq) in want.generated.iter().enumerate() {
        for (step, &w) in want_seq.iter().enumerate() {
            let g = got[b * want_seq.len() + step] as i64;
            if g != w {
                assert!(
                    want.gaps[b][step] <= TOL,
                    "{name}: sequence {b} step {step}: generated {g}, transformers {w} (gap {})",
                    want.gaps[b][step]
                );
                break;
            }
        }
    }
    hf.config
}

#[test]
fn grouped_query_attention_with_llama3_rope_scaling_equals_transformers() {
    let cfg = assert_matches_transformers("gqa");
    assert_eq!((cfg.heads, cfg.kv_heads), (4, 2));
    assert!(!cfg.tie_embeddings);
    assert_eq!(cfg.rope_theta, 500000.0);
    let s = cfg.rope_scaling.expect("llama3 rope scaling");
    assert_eq!(
        (s.factor, s.low_freq_factor, s.high_freq_factor),
        (8.0, 1.0, 8.0)
    );
    assert_eq!(s.original_max_position_embeddings, 64);
}

#[test]
fn a_tied_model_in_several_files_with_one_kv_head_equals_transformers() {
    let cfg = assert_matches_transformers("tied");
    assert_eq!((cfg.heads, cfg.kv_heads, cfg.tie_embeddings), (4, 1, true));
    assert_eq!(cfg.rms_norm_eps, 1e-6);
}

/// A MixtralForCausalLM: 4 experts, 2 per token, grouped-query attention, a sliding window of
/// 32 positions (longer than the sequences: full causal attention).
#[test]
fn a_mixtral_with_4_experts_equals_transformers() {
    let cfg = assert_matches_transformers("mixtral");
    let moe = SparseMoe {
        experts: 4,
        top_k: 2,
        aux_loss: 0.02,
        bias_update_rate: 0.0,
    };
    assert_eq!((cfg.moe, cfg.ffn, cfg.kv_heads), (Some(moe), 32, 2));
    assert_eq!((cfg.rope_theta, cfg.rope_scaling), (1e6, None));
    // max_position_embeddings is 64: the window bounds the sequences.
    assert_eq!(cfg.max_seq, 32);
    let hf = read_hf_llama(&fixture("mixtral")).unwrap();
    assert_eq!(hf.sliding_window, Some(32));
    let margin = serde_json::from_slice::<Value>(
        &std::fs::read(fixture("mixtral").join("expected.json")).unwrap(),
    )
    .unwrap()["router_margin"]
        .as_f64()
        .unwrap();
    eprintln!("mixtral: the routing is {margin:.2e} from a tie in transformers' computation");
    assert!(
        margin > 1e-4,
        "the fixture's routing is near a tie: {margin}"
    );
}

/// The test above can fail: with each expert's gate and up projections swapped (`w1` read as
/// `w3`), the logits are far from transformers'.
#[test]
fn a_mixtral_with_gate_and_up_swapped_differs_from_transformers() {
    let _cleanup = Cleanup;
    let dir = copy_of("mixtral", "mixtral-swapped");
    let mut t = tensors_of(&fixture("mixtral").join("model.safetensors"));
    for (name, _, _) in &mut t {
        let swapped = match name.strip_suffix(".w1.weight") {
            Some(stem) => format!("{stem}.w3.weight"),
            None => match name.strip_suffix(".w3.weight") {
                Some(stem) => format!("{stem}.w1.weight"),
                None => continue,
            },
        };
        *name = swapped;
    }
    write_tensors(&dir.join("model.safetensors"), &t, "F32");
    let hf = read_hf_llama(&dir).unwrap();
    let diff = logits_diff("swapped", &hf, &expected("mixtral"));
    eprintln!("mixtral with w1 and w3 swapped: the logits differ by {diff:.3e}");
    assert!(
        diff > 100.0 * TOL,
        "swapped: the logits differ by only {diff:.3e}"
    );
}

thread_local! {
    /// The folders [`folder`] made on this thread (each test runs on its own).
    static MADE: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Removes the folders its test made when dropped.
struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        for dir in MADE.with(|m| std::mem::take(&mut *m.borrow_mut())) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A fresh temporary folder, removed at the end of the test (see [`Cleanup`]).
fn folder(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("merak-llama-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    MADE.with(|m| m.borrow_mut().push(d.clone()));
    d
}

/// A copy of fixture `name` in a fresh folder.
fn copy_of(name: &str, to: &str) -> PathBuf {
    let dir = folder(to);
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    dir
}

/// Tensors as f32: (name, shape, values).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// An edit of `config.json`.
type ConfigEdit = Box<dyn Fn(&mut Value)>;

/// Every tensor of the safetensors file at `path` as f32, by name: (name, shape, values).
fn tensors_of(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    (tensor_views(&bytes, path).unwrap().into_iter())
        .map(|(name, v)| {
            let values = to_f32(&v, path, &name).unwrap();
            (name, v.shape().to_vec(), values)
        })
        .collect()
}

/// Writes `tensors` (f32 values written as `dtype`) as the safetensors file `path`.
fn write_tensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: &str) {
    std::fs::write(path, merak_tests::safetensors_file(tensors, dtype)).unwrap();
}

#[test]
fn an_export_reads_back_as_written_in_one_file_and_in_several() {
    let _cleanup = Cleanup;
    for name in ["gqa", "tied", "mixtral"] {
        let hf = read_hf_llama(&fixture(name)).unwrap();
        for shard in [None, Some(20_000)] {
            let dir = folder(&format!("export-{name}-{shard:?}"));
            let written = write_hf_llama(&dir, &hf.config, &hf.params, shard).unwrap();
            let back = read_hf_llama(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(back.config, hf.config, "{name}");
            assert_eq!(back.params, hf.params, "{name} {shard:?}");
            let files = written
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"));
            assert_eq!(files.count() > 1, shard.is_some(), "{name}: {written:?}");
            // And the tensors are transformers' own (the bf16 ones as f32).
            let ours: Vec<_> = (written.iter())
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .flat_map(|p| tensors_of(p))
                .collect();
            let mut theirs: Vec<_> = std::fs::read_dir(fixture(name))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .flat_map(|p| tensors_of(&p))
                .collect();
            theirs.sort_by(|a, b| a.0.cmp(&b.0));
            let mut ours = ours;
            ours.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(ours, theirs, "{name}");
        }
        // Writing into a folder that holds an export is refused, and nothing in it changes.
        let dir = folder(&format!("export-{name}-again"));
        write_hf_llama(&dir, &hf.config, &hf.params, None).unwrap();
        let before = |dir: &Path| -> Vec<(String, Vec<u8>)> {
            let mut files: Vec<_> = (std::fs::read_dir(dir).unwrap())
                .map(|e| e.unwrap().path())
                .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
                .collect();
            files.sort();
            files
        };
        let kept = before(&dir);
        for shard in [Some(10_000), None] {
            let e = write_hf_llama(&dir, &hf.config, &hf.params, shard)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("config.json") && e.contains("already there"),
                "{e}"
            );
            assert_eq!(before(&dir), kept, "{name} {shard:?}");
        }
    }
}

/// A dense model and a mixture of experts.
#[test]
fn a_model_built_from_params_gives_them_back_and_exports_them() {
    let dense = LlamaConfig {
        kv_heads: 2,
        tie_embeddings: true,
        ..LlamaConfig::tiny()
    };
    let moe = SparseMoe {
        experts: 4,
        top_k: 2,
        aux_loss: 0.0,
        bias_update_rate: 0.0,
    };
    built_model_round_trips(dense, "dense");
    built_model_round_trips(
        LlamaConfig {
            moe: Some(moe),
            ..dense
        },
        "moe",
    );
}

/// A model of shape `cfg` gives its parameters by the names [`LlamaConfig::param_shapes`]
/// lists, exports them, reads them back and computes the same logits; parameters that do not
/// fit are named.
fn built_model_round_trips(cfg: LlamaConfig, name: &str) {
    let _cleanup = Cleanup;
    let device = Default::default();
    Cpu::seed(&device, 3);
    let model = Llama::<Cpu>::new(&cfg, &device);
    let params: FullParams = model.full_params();
    let names: Vec<String> = cfg.param_shapes().into_iter().map(|(n, _)| n).collect();
    let mut got: Vec<String> = params.keys().cloned().collect();
    got.sort();
    let mut want = names.clone();
    want.sort();
    assert_eq!(got, want);
    for (n, shape) in cfg.param_shapes() {
        assert_eq!(params[&n].0, shape, "{n}");
    }
    let dir = folder(&format!("from-params-{name}"));
    write_hf_llama(&dir, &cfg, &params, None).unwrap();
    let back = read_hf_llama(&dir).unwrap();
    assert_eq!(back.params, params);
    let rebuilt = Llama::<Cpu>::from_full_params(&back.config, &back.params, &device).unwrap();
    let ids = vec![vec![1i64, 2, 3, 4], vec![5, 6, 7, 8]];
    let a = values(model.logits(tokens(&ids, &device)));
    let b = values(rebuilt.logits(tokens(&ids, &device)));
    assert_eq!(a, b);

    // Parameters that do not fit are named.
    let mut wrong = params.clone();
    wrong.get_mut("layers.1.attn.wk.linear.weight").unwrap().0 = vec![32, 64];
    let e = Llama::<Cpu>::from_full_params(&cfg, &wrong, &device).unwrap_err();
    assert!(
        e.to_string().contains("layers.1.attn.wk.linear.weight"),
        "{e}"
    );
    let e = write_hf_llama(&dir, &cfg, &wrong, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.1.attn.wk.linear.weight") && e.contains("[64, 32]"),
        "{e}"
    );
    let mut extra = params.clone();
    extra.insert(
        "head.output.linear.weight".into(),
        (vec![64, 256], vec![0.0; 64 * 256]),
    );
    let e = Llama::<Cpu>::from_full_params(&cfg, &extra, &device).unwrap_err();
    assert!(e.to_string().contains("head.output.linear.weight"), "{e}");
    let e = write_hf_llama(&dir, &cfg, &extra, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head.output.linear.weight"), "{e}");
    let mut missing = params;
    missing.remove("head.norm.gamma");
    let e = Llama::<Cpu>::from_full_params(&cfg, &missing, &device).unwrap_err();
    assert!(e.to_string().contains("head.norm.gamma"), "{e}");
}

#[test]
fn the_tiny_model_is_unchanged_by_the_new_settings() {
    // Grouped-query attention with as many kv heads as heads is multi-head attention, and the
    // rotary table of the default settings is Burn's: the same as before the settings.
    let cfg = LlamaConfig::tiny();
    assert_eq!(
        (cfg.kv_heads, cfg.rope_theta, cfg.rms_norm_eps),
        (4, 10000.0, 1e-5)
    );
    assert!(cfg.rope_scaling.is_none());
    let device = Default::default();
    let model = Llama::<Cpu>::new(&cfg, &device);
    let theta = values(model.blocks[0].attn.rope.theta.clone());
    let burn = burn::nn::RotaryEncodingConfig::new(64, 16).init::<Cpu>(&device);
    assert_eq!(theta, values(burn.theta));
    // Burn's frequencies are transformers' up to rounding.
    let ours = cfg.rope_frequencies();
    assert!(max_abs_diff(&theta, &ours) < 1e-6);
}

/// The error of reading `dir`.
fn refusal(dir: &Path) -> String {
    match read_hf_llama(dir) {
        Ok(_) => panic!("{}: read", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn bad_config_values_are_refused_naming_the_key() {
    let _cleanup = Cleanup;
    let cases: Vec<(&str, ConfigEdit, &str)> = vec![
        (
            "attention_bias",
            Box::new(|v| v["attention_bias"] = true.into()),
            "no biases",
        ),
        (
            "mlp_bias",
            Box::new(|v| v["mlp_bias"] = true.into()),
            "no biases",
        ),
        (
            "rope_parameters.rope_type",
            Box::new(|v| v["rope_parameters"]["rope_type"] = "yarn".into()),
            "\"yarn\"",
        ),
        (
            "num_key_value_heads",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
            "must divide num_attention_heads = 4",
        ),
        (
            "hidden_act",
            Box::new(|v| v["hidden_act"] = "gelu".into()),
            "SwiGLU",
        ),
        (
            "head_dim",
            Box::new(|v| v["head_dim"] = 32.into()),
            "16 wide",
        ),
        (
            "model_type",
            Box::new(|v| v["model_type"] = "mistral".into()),
            "llama",
        ),
        (
            "vocab_size",
            Box::new(|v| v["vocab_size"] = (-5).into()),
            "whole number",
        ),
        (
            "hidden_size",
            Box::new(|v| {
                v.as_object_mut()
                    .unwrap()
                    .remove("hidden_size")
                    .map(drop)
                    .unwrap()
            }),
            "required",
        ),
        (
            "rope_parameters.high_freq_factor",
            Box::new(|v| v["rope_parameters"]["high_freq_factor"] = 0.5.into()),
            "must exceed low_freq_factor",
        ),
        (
            "rms_norm_eps",
            Box::new(|v| v["rms_norm_eps"] = 0.into()),
            "positive",
        ),
        (
            "tie_word_embeddings",
            Box::new(|v| v["tie_word_embeddings"] = "yes".into()),
            "true or false",
        ),
    ];
    for (key, edit, why) in cases {
        let dir = copy_of("gqa", "bad-config");
        edit_config(&dir, |v| edit(v));
        let e = refusal(&dir);
        assert!(
            e.contains("config.json") && e.contains(&format!("`{key}`")) && e.contains(why),
            "{key}: {e}"
        );
    }
    // transformers 4's keys (rope_theta, rope_scaling with `type`) read the same.
    let dir = copy_of("gqa", "legacy-config");
    edit_config(&dir, |v| {
        let mut p = v["rope_parameters"].take();
        v["rope_theta"] = p["rope_theta"].take();
        p.as_object_mut().unwrap().remove("rope_theta");
        p.as_object_mut().unwrap().remove("rope_type");
        p["type"] = "llama3".into();
        v["rope_scaling"] = p;
        v.as_object_mut().unwrap().remove("rope_parameters");
    });
    assert_eq!(
        read_hf_llama(&dir).unwrap().config,
        read_hf_llama(&fixture("gqa")).unwrap().config
    );
    // What we write reads back.
    let cfg = read_hf_llama(&fixture("gqa")).unwrap().config;
    assert_eq!(
        llama_config_from_hf(&hf_config_json(&cfg), Path::new("x")).unwrap(),
        cfg
    );
}

#[test]
fn damaged_tensors_are_refused_naming_the_file_and_the_tensor() {
    let _cleanup = Cleanup;
    let single = |dir: &Path| dir.join("model.safetensors");
    let original = tensors_of(&fixture("gqa").join("model.safetensors"));
    let with = |name: &str, edit: &dyn Fn(&mut Tensors), dtype| {
        let dir = copy_of("gqa", name);
        let mut t = original.clone();
        edit(&mut t);
        write_tensors(&single(&dir), &t, dtype);
        refusal(&dir)
    };
    let find = |t: &Tensors, n: &str| t.iter().position(|x| x.0 == n).unwrap();

    // Truncated: cut anywhere, refused naming the file.
    let bytes = std::fs::read(single(&fixture("gqa"))).unwrap();
    let dir = copy_of("gqa", "truncated");
    for cut in [0, 5, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(single(&dir), &bytes[..cut]).unwrap();
        let e = refusal(&dir);
        assert!(e.contains("model.safetensors"), "cut {cut}: {e}");
    }

    // Wrong shape.
    let e = with(
        "shape",
        &|t| {
            let k = find(t, "model.layers.1.mlp.up_proj.weight");
            t[k].1 = vec![64, 96];
        },
        "F32",
    );
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.layers.1.mlp.up_proj.weight")
            && e.contains("[64, 96]")
            && e.contains("[96, 64]"),
        "{e}"
    );
    // A config of other kv heads: the file's k_proj is refused with both shapes.
    let dir = copy_of("gqa", "kv-config");
    edit_config(&dir, |v| v["num_key_value_heads"] = 4.into());
    let e = refusal(&dir);
    assert!(
        e.contains("k_proj.weight") && e.contains("[32, 64]") && e.contains("[64, 64]"),
        "{e}"
    );

    // Missing.
    let e = with(
        "missing",
        &|t| t.retain(|x| x.0 != "model.layers.0.post_attention_layernorm.weight"),
        "F32",
    );
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.layers.0.post_attention_layernorm.weight")
            && e.contains("missing"),
        "{e}"
    );

    // NaN and infinity.
    for (bad, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        let e = with(
            "nan",
            &|t| {
                let k = find(t, "model.layers.1.self_attn.v_proj.weight");
                t[k].2[37] = bad;
            },
            "F32",
        );
        assert!(
            e.contains("model.safetensors")
                && e.contains("model.layers.1.self_attn.v_proj.weight")
                && e.contains(shown)
                && e.contains("index 37"),
            "{e}"
        );
    }

    // A bias, a layer too many, an integer tensor.
    let e = with(
        "bias",
        &|t| {
            t.push((
                "model.layers.0.self_attn.q_proj.bias".into(),
                vec![64],
                vec![0.0; 64],
            ))
        },
        "F32",
    );
    assert!(
        e.contains("q_proj.bias") && e.contains("not a tensor of"),
        "{e}"
    );
    let e = with(
        "layers",
        &|t| {
            t.push((
                "model.layers.2.input_layernorm.weight".into(),
                vec![64],
                vec![1.0; 64],
            ))
        },
        "F32",
    );
    assert!(
        e.contains("model.layers.2.") && e.contains("2 layers"),
        "{e}"
    );
    let e = with("int", &|_| {}, "I32");
    assert!(e.contains("model.safetensors") && e.contains("I32"), "{e}");

    // f16 is converted (within its precision), and a LlamaModel's unprefixed names and the
    // rotary buffers of older files are taken.
    let dir = copy_of("gqa", "f16");
    let mut t = original.clone();
    for x in &mut t {
        x.0 = x.0.trim_start_matches("model.").to_string();
    }
    t.push((
        "layers.0.self_attn.rotary_emb.inv_freq".into(),
        vec![8],
        vec![1.0; 8],
    ));
    write_tensors(&single(&dir), &t, "F16");
    let hf = read_hf_llama(&dir).unwrap();
    assert!(hf.notes[0].contains("rotary"), "{:?}", hf.notes);
    let want = read_hf_llama(&fixture("gqa")).unwrap();
    for (name, (_, v)) in &want.params {
        let got = &hf.params[name].1;
        // Half precision: 11 significant bits, values below 2^-14 flushed by the writer here.
        let err =
            (got.iter().zip(v)).fold(0.0f32, |m, (a, b)| m.max((a - b).abs() / b.abs().max(1.0)));
        assert!(err < 1e-3, "{name}: {err}");
    }
}

/// A Mixtral whose tensors do not fit its `config.json` (an expert's tensor missing or of
/// another shape, a router of another expert count, an expert too many, transformers 5's
/// stacked experts): each refused naming the file and the tensor.
#[test]
fn a_mixtral_with_missing_or_misshaped_experts_is_refused() {
    let _cleanup = Cleanup;
    let original = tensors_of(&fixture("mixtral").join("model.safetensors"));
    let with = |name: &str, edit: &dyn Fn(&mut Tensors)| {
        let dir = copy_of("mixtral", name);
        let mut t = original.clone();
        edit(&mut t);
        write_tensors(&dir.join("model.safetensors"), &t, "F32");
        refusal(&dir)
    };
    let find = |t: &Tensors, n: &str| t.iter().position(|x| x.0 == n).unwrap();
    let w3 = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
    let e = with("mixtral-missing", &|t| t.retain(|x| x.0 != w3));
    assert!(
        e.contains("model.safetensors")
            && e.contains(w3)
            && e.contains("missing")
            && e.contains("num_local_experts = 4"),
        "{e}"
    );
    let e = with("mixtral-shape", &|t| {
        let k = find(t, w3);
        t[k].1 = vec![64, 32];
    });
    assert!(
        e.contains("model.safetensors")
            && e.contains(w3)
            && e.contains("[64, 32]")
            && e.contains("[32, 64]"),
        "{e}"
    );
    let gate = "model.layers.0.block_sparse_moe.gate.weight";
    let e = with("mixtral-router", &|t| {
        let k = find(t, gate);
        t[k].1 = vec![3, 64];
        t[k].2.truncate(3 * 64);
    });
    assert!(
        e.contains(gate) && e.contains("[3, 64]") && e.contains("[4, 64]"),
        "{e}"
    );
    let fifth = "model.layers.0.block_sparse_moe.experts.4.w1.weight";
    let e = with("mixtral-fifth", &|t| {
        t.push((fifth.into(), vec![32, 64], vec![0.5; 32 * 64]))
    });
    assert!(
        e.contains(fifth) && e.contains("config.json has 4 experts (num_local_experts)"),
        "{e}"
    );
    let stacked = "model.layers.0.mlp.experts.gate_up_proj";
    let e = with("mixtral-stacked", &|t| {
        t.push((stacked.into(), vec![4, 64, 64], vec![0.5; 4 * 64 * 64]))
    });
    assert!(
        e.contains(stacked) && e.contains("save_original_format"),
        "{e}"
    );
    // A config of fewer or more experts than the file holds.
    for (experts, named) in [(3, "config.json has 3 experts"), (5, "[5, 64]")] {
        let dir = copy_of("mixtral", "mixtral-experts");
        edit_config(&dir, |v| v["num_local_experts"] = experts.into());
        let e = refusal(&dir);
        assert!(
            e.contains("model.safetensors") && e.contains(named),
            "{experts}: {e}"
        );
    }
}

/// Mixtral's keys: values the model cannot take are refused naming the key; router noise is
/// noted, not applied; without a `model_type`, `architectures` decides; the sliding window
/// bounds the sequences of a run; what we write reads back.
#[test]
fn mixtral_config_values_are_read_or_refused_naming_the_key() {
    let _cleanup = Cleanup;
    let cases: Vec<(&str, ConfigEdit, &str)> = vec![
        (
            "num_experts_per_tok",
            Box::new(|v| v["num_experts_per_tok"] = 5.into()),
            "at most num_local_experts = 4",
        ),
        (
            "num_local_experts",
            Box::new(|v| v["num_local_experts"] = 0.into()),
            "whole number",
        ),
        (
            "router_aux_loss_coef",
            Box::new(|v| v["router_aux_loss_coef"] = (-1.0).into()),
            "at least 0",
        ),
        (
            "sliding_window",
            Box::new(|v| v["sliding_window"] = 0.into()),
            "whole number",
        ),
        (
            "output_router_logits",
            Box::new(|v| v["output_router_logits"] = "yes".into()),
            "true or false",
        ),
        (
            "model_type",
            Box::new(|v| v["model_type"] = "mistral".into()),
            "\"mixtral\"",
        ),
    ];
    for (key, edit, why) in cases {
        let dir = copy_of("mixtral", "mixtral-bad-config");
        edit_config(&dir, |v| edit(v));
        let e = refusal(&dir);
        assert!(
            e.contains("config.json") && e.contains(&format!("`{key}`")) && e.contains(why),
            "{key}: {e}"
        );
    }
    let want = read_hf_llama(&fixture("mixtral")).unwrap();
    let dir = copy_of("mixtral", "mixtral-config");
    edit_config(&dir, |v| {
        v["router_jitter_noise"] = 0.1.into();
        v["output_router_logits"] = false.into();
        v["sliding_window"] = Value::Null;
        v.as_object_mut().unwrap().remove("model_type");
    });
    let hf = read_hf_llama(&dir).unwrap();
    assert!(
        hf.notes.iter().any(|n| n.contains("router_jitter_noise")),
        "{:?}",
        hf.notes
    );
    let moe = hf.config.moe.expect("a Mixtral by its architectures");
    assert_eq!((moe.experts, moe.top_k, moe.aux_loss), (4, 2, 0.0));
    assert_eq!((hf.config.max_seq, hf.sliding_window), (64, None));
    assert_eq!(hf.params, want.params);

    // A run on sequences longer than the window is refused, naming it.
    let fresh = LlamaConfig::tiny();
    let e = pretrained_or(Some(&fixture("mixtral")), 40, fresh)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("`sliding_window` = 32") && e.contains("40"),
        "{e}"
    );
    let (cfg, init) = pretrained_or(Some(&fixture("mixtral")), 32, fresh).unwrap();
    assert_eq!((cfg.max_seq, cfg.moe), (32, want.config.moe));
    assert!(init.is_some());
    // What we write reads back.
    assert_eq!(
        llama_config_from_hf(&hf_config_json(&want.config), Path::new("x")).unwrap(),
        want.config
    );
}

#[test]
fn index_problems_are_refused_naming_the_index_or_the_file() {
    let _cleanup = Cleanup;
    let index = |dir: &Path| dir.join("model.safetensors.index.json");
    let edit_index = |dir: &Path, edit: &dyn Fn(&mut Value)| {
        let mut v: Value = serde_json::from_slice(&std::fs::read(index(dir)).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(index(dir), serde_json::to_vec(&v).unwrap()).unwrap();
    };
    let first = "model-00001-of-00005.safetensors";
    // A file outside the folder.
    let dir = copy_of("tied", "index-escape");
    edit_index(&dir, &|v| {
        v["weight_map"]["model.norm.weight"] = "../model.safetensors".into()
    });
    let e = refusal(&dir);
    assert!(
        e.contains("index.json") && e.contains("model.norm.weight"),
        "{e}"
    );
    // A tensor the index puts in another file.
    let dir = copy_of("tied", "index-other");
    edit_index(&dir, &|v| {
        v["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00005.safetensors".into()
    });
    let e = refusal(&dir);
    assert!(
        e.contains(first) && e.contains("model.embed_tokens.weight") && e.contains("puts it in"),
        "{e}"
    );
    // A file of the index that is not there.
    let dir = copy_of("tied", "index-gone");
    std::fs::remove_file(dir.join(first)).unwrap();
    let e = refusal(&dir);
    assert!(e.contains(first), "{e}");
    // A tensor the index names that its file lacks.
    let dir = copy_of("tied", "index-lacks");
    edit_index(&dir, &|v| {
        v["weight_map"]["model.layers.0.mlp.bias"] = first.into()
    });
    let e = refusal(&dir);
    assert!(
        e.contains(first) && e.contains("model.layers.0.mlp.bias") && e.contains("missing"),
        "{e}"
    );
    // Not JSON; no weight map.
    let dir = copy_of("tied", "index-json");
    std::fs::write(index(&dir), b"{").unwrap();
    assert!(refusal(&dir).contains("index.json"));
    std::fs::write(index(&dir), b"{}").unwrap();
    assert!(refusal(&dir).contains("weight_map"));
    // Neither weights file.
    let dir = folder("empty");
    std::fs::copy(fixture("gqa").join("config.json"), dir.join("config.json")).unwrap();
    assert!(refusal(&dir).contains("neither model.safetensors nor"));
    // No config.
    let dir = copy_of("gqa", "no-config");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(refusal(&dir).contains("config.json"));
    // A FIFO as the weights is refused before it is opened (it would block).
    let dir = copy_of("gqa", "fifo");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let ok = Command::new("mkfifo")
        .arg(dir.join("model.safetensors"))
        .status()
        .unwrap();
    assert!(ok.success());
    let e = refusal(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("not a regular file"),
        "{e}"
    );
}

/// A safetensors file of `header` (its length as written unless `length` is given) and
/// `data` bytes.
fn raw(header: &str, length: Option<u64>, data: usize) -> Vec<u8> {
    let n = length.unwrap_or(header.len() as u64);
    [&n.to_le_bytes()[..], header.as_bytes(), &vec![0u8; data]].concat()
}

#[test]
fn hostile_headers_and_damaged_bytes_give_errors_not_panics() {
    let _cleanup = Cleanup;
    let dir = copy_of("gqa", "hostile");
    let path = dir.join("model.safetensors");
    let end = u64::MAX - 4;
    let headers = [
        (r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#.to_string(), Some(u64::MAX)),
        (r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#.into(), Some(1 << 63)),
        (format!(r#"{{"w":{{"dtype":"U8","shape":[{end}],"data_offsets":[0,{end}]}}}}"#), None),
        (r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#.into(), None),
        (r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#.into(), None),
        (r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[96,64],"data_offsets":[0,8]}}"#.into(), None),
        ("[]".into(), None),
    ];
    for (header, length) in headers {
        std::fs::write(&path, raw(&header, length, 8)).unwrap();
        let e = refusal(&dir);
        assert!(e.contains("model.safetensors"), "{header}: {e}");
    }
    // Every byte of the header region changed, and cuts: an error or weights, never a panic.
    let bytes = std::fs::read(fixture("gqa").join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for (i, at) in (0..header + 64).step_by(7).enumerate() {
        let mut edited = bytes.clone();
        edited[at] = [0u8, 0xff, b'9', b'"', b'{', b'-'][i % 6];
        std::fs::write(&path, &edited).unwrap();
        let _ = read_hf_llama(&dir);
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor parallelism with grouped-query attention, on `mpirun` ranks running this test binary.

/// The environment variable that makes [`tp_child`] run (under `mpirun`).
const CHILD: &str = "MERAK_LLAMA_HF_TP_CHILD";

#[test]
fn tp_is_refused_where_heads_do_not_split() {
    let cfg = LlamaConfig {
        heads: 8,
        kv_heads: 2,
        hidden: 64,
        ..LlamaConfig::tiny()
    };
    assert!(tp_plan_for(&cfg, 2).is_ok());
    assert!(tp_plan_for(&cfg, 4).is_ok());
    assert!(tp_plan_for(&cfg, 8).is_ok());
    assert_eq!(
        tp_plan_for(&cfg, 16).unwrap_err(),
        TpLayoutError::Heads { tp: 16, heads: 8 }
    );
    let cfg = LlamaConfig {
        heads: 12,
        kv_heads: 4,
        hidden: 96,
        ..LlamaConfig::tiny()
    };
    let e = tp_plan_for(&cfg, 6).unwrap_err();
    assert_eq!(e, TpLayoutError::KvHeads { tp: 6, kv_heads: 4 });
    assert!(e.to_string().contains("tp = 6 and kv_heads = 4"), "{e}");
}

fn run_tp_children(np: usize) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = merak_tests::mpirun(np);
    cmd.arg(exe)
        .args([
            "tp_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1");
    let run = merak_tests::run_with_deadline(cmd, Duration::from_secs(240));
    run.assert_success();
    assert!(
        run.stdout.matches("tp child ok").count() == np,
        "{}\n{}",
        run.stdout,
        run.stderr
    );
}

/// tp = 2: the gqa and mixtral fixtures (2 kv heads) split their kv heads by column, the tied
/// one (1 kv head) shares it; the mixtral's experts are whole on every rank; the logits equal
/// transformers', the gradients one process's.
#[test]
fn grouped_query_attention_at_tp_2_equals_one_process() {
    run_tp_children(2);
}

/// tp = 4: every fixture shares its kv heads (2 or 1) over the ranks.
#[test]
fn kv_heads_shared_by_4_tp_ranks_equal_one_process() {
    run_tp_children(4);
}

/// Gradients of every parameter of `model` for `loss`, by module path.
fn grads_of<M: Module<CpuAutodiff>>(
    model: &M,
    grads: &<CpuAutodiff as AutodiffBackend>::Gradients,
) -> Tensors {
    struct Visit<'a> {
        path: Vec<String>,
        grads: &'a <CpuAutodiff as AutodiffBackend>::Gradients,
        out: Tensors,
    }
    impl ModuleVisitor<CpuAutodiff> for Visit<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            if container_type != SPLIT_CONTAINER {
                self.path.push(name.into());
            }
        }
        fn exit_module(&mut self, _name: &str, container_type: &str) {
            if container_type != SPLIT_CONTAINER {
                self.path.pop();
            }
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<CpuAutodiff, D>>) {
            let g = param.val().grad(self.grads).expect("a gradient");
            let shape = g.dims().to_vec();
            self.out.push((self.path.join("."), shape, values(g)));
        }
    }
    let mut v = Visit {
        path: Vec::new(),
        grads,
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

/// The loss of `model` on `ids`: cross-entropy against the next token.
fn loss(model: &Llama<CpuAutodiff>, ids: &[Vec<i64>]) -> Tensor<CpuAutodiff, 1> {
    let device = Default::default();
    let inputs: Vec<Vec<i64>> = ids.iter().map(|r| r[..r.len() - 1].to_vec()).collect();
    let targets: Vec<Vec<i64>> = ids.iter().map(|r| r[1..].to_vec()).collect();
    let logits = model.logits(tokens(&inputs, &device));
    let [b, s, v] = logits.dims();
    burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&device)
        .forward(
            logits.reshape([b * s, v]),
            tokens(&targets, &device).reshape([b * s]),
        )
}

/// Run under `mpirun` by the tests above: every rank of a tp = world-size group builds each
/// fixture whole and split by [`tp_plan_for`], and checks that the split one computes
/// transformers' logits and, for each parameter, this rank's part of the whole one's gradient.
#[test]
#[ignore = "run under mpirun by the tp tests"]
fn tp_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let mpi = merak_burn::comm::MpiWorld::init().expect("MPI");
    let world = mpi.world();
    let tp = merak_burn::comm::Communicator::size(&world);
    let layout = merak_burn::grid::Layout {
        dp: 1,
        tp,
        cp: 1,
        pp: 1,
    };
    let grid = merak_burn::grid::ProcessGrid::from_mpi(world, layout).unwrap();
    let device = Default::default();
    for name in ["gqa", "tied", "mixtral"] {
        let hf = read_hf_llama(&fixture(name)).unwrap();
        let plan = tp_plan_for(&hf.config, tp).unwrap();
        let want = expected(name);
        let whole =
            Llama::<CpuAutodiff>::from_full_params(&hf.config, &hf.params, &device).unwrap();
        let split = merak_burn::parallelize::shard_module(
            Llama::<CpuAutodiff>::from_full_params(&hf.config, &hf.params, &device).unwrap(),
            &plan,
            grid.tp,
        )
        .unwrap();
        let logits = values(split.logits(tokens(&want.ids, &device)));
        let diff = max_abs_diff(&logits, &want.logits);
        assert!(diff <= TOL, "{name} tp = {tp}: logits differ by {diff:.3e}");

        let (lw, ls) = (loss(&whole, &want.ids), loss(&split, &want.ids));
        let (vw, vs) = (values(lw.clone()), values(ls.clone()));
        assert!(
            (vw[0] - vs[0]).abs() <= 1e-5 * vw[0].abs(),
            "{name}: loss {vw:?} vs {vs:?}"
        );
        let (gw, gs) = (lw.backward(), ls.backward());
        let (gw, gs) = (grads_of(&whole, &gw), grads_of(&split, &gs));
        let splits = ParamSplits::of(&split);
        let shard = Shard {
            rank: grid.tp.rank(),
            size: tp,
        };
        assert_eq!(gw.len(), gs.len());
        let mut shared = 0;
        for ((pname, shape, full), (sname, _, part)) in gw.iter().zip(&gs) {
            assert_eq!(pname, sname);
            let kind = splits.by_name(pname);
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let mine = match kind {
                ShardKind::Replicated => full.clone(),
                ShardKind::Columns { segments } => shard.columns(full, rows, cols, segments),
                ShardKind::Rows => shard.rows(full, rows, cols),
                other => panic!("{pname}: {other:?}"),
            };
            let err = merak_tests::rel_err(part, &mine);
            assert!(
                err <= 1e-5,
                "{name} tp = {tp} rank {}: {pname} ({kind:?}) gradient differs by {err:.2e}",
                shard.rank
            );
            if kind == ShardKind::Replicated && pname.contains(".attn.wk.") {
                shared += 1;
            }
        }
        let shares = hf.config.kv_heads < tp;
        assert_eq!(
            shared > 0,
            shares,
            "{name} tp = {tp}: shared kv projections"
        );
    }
    println!("tp child ok");
}
