//! merak's BERT against transformers' `BertForMaskedLM`, through the committed fixture of
//! `scripts/hf-bert-fixture.py` (CI has no PyTorch): the imported model computes the masked-LM
//! logits transformers computed, and export then import gives the parameters back.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use merak_bert::hf::{
    POSITION_EMBEDDINGS, TOKEN_TYPE_EMBEDDINGS, hf_bert_config, hf_bert_shapes, to_hf_bert,
};
use merak_bert::hf_import::{FullParams, read_hf_bert};
use merak_bert::{Bert, BertConfig};
use merak_burn::backend::Cpu;
use merak_burn::checkpoint::{NamedTensor, cut_full_params, shard_file, state};
use merak_burn::comm::Group;
use merak_burn::pipeline::PipelineModel;
use merak_burn::tensor_parallel::Shard;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert-hf")
}

/// The merak BERT of the fixture's shape (its config.json).
fn config() -> BertConfig {
    let shape = "bert:layers=2,hidden=32,heads=4,seq=16,vocab=101".parse();
    BertConfig::from_shape(&shape.unwrap())
}

/// A one-process model (built from another seed) holding `params`.
fn model_of(cfg: &BertConfig, params: &FullParams) -> Bert<Cpu> {
    let model = Bert::<Cpu>::new(cfg, 7, Group::local(), &Default::default()).unwrap();
    let shapes = state::param_shapes(&model);
    let local = cut_full_params(params, &shapes, Shard::FULL, &model.tied_names()).unwrap();
    state::assign_params(model, local).unwrap()
}

/// One batch of expected.json: ids `[batch][seq]`, the logits' shape and values.
type Case = (Vec<Vec<i64>>, Vec<usize>, Vec<f32>);

/// Every case of expected.json.
fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = serde_json::from_value(c["ids"].clone()).unwrap();
            let shape = serde_json::from_value(c["shape"].clone()).unwrap();
            let logits: Vec<f64> = serde_json::from_value(c["logits"].clone()).unwrap();
            (ids, shape, logits.into_iter().map(|x| x as f32).collect())
        })
        .collect()
}

/// The largest absolute difference between the model's logits and every case's.
fn worst_error(model: &Bert<Cpu>) -> f32 {
    let mut worst = 0.0f32;
    for (ids, shape, want) in cases() {
        let (b, s) = (ids.len(), ids[0].len());
        let flat: Vec<i64> = ids.into_iter().flatten().collect();
        let x =
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(flat, [b, s]), &Default::default());
        let logits = model.logits(x);
        assert_eq!(logits.dims().to_vec(), shape);
        let got = logits.into_data().into_vec::<f32>().unwrap();
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - w).abs());
        }
    }
    worst
}

#[test]
fn imported_weights_give_the_logits_of_transformers() {
    let cfg = config();
    let w = read_hf_bert(&fixture().join("model.safetensors"), &cfg).unwrap();
    // The fixture's token types are random: type 0 is folded into the positions, type 1
    // dropped, both with a note.
    assert_eq!(w.notes.len(), 2, "{:?}", w.notes);
    let model = model_of(&cfg, &w.params);
    let worst = worst_error(&model);
    eprintln!("largest |merak - transformers| logit difference: {worst:e}");
    assert!(worst <= 1e-4, "logits differ by up to {worst}");

    // A model that did not load the file is far from it (the comparison can fail).
    let fresh = Bert::<Cpu>::new(&cfg, 7, Group::local(), &Default::default()).unwrap();
    assert!(worst_error(&fresh) > 0.1);
}

/// Writes `tensors` with the config of `cfg` into `dir`.
fn write(dir: &Path, cfg: &BertConfig, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let named: Vec<NamedTensor> = tensors
        .iter()
        .map(|(name, shape, values)| NamedTensor {
            name: name.clone(),
            shape: shape.clone(),
            values: values.clone(),
        })
        .collect();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, shard_file::encode(&named, HashMap::new()).unwrap()).unwrap();
    let config = serde_json::to_vec_pretty(&hf_bert_config(cfg)).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    path
}

#[test]
fn export_then_import_gives_the_same_parameters_and_logits() {
    let cfg = config();
    let fixture_file = fixture().join("model.safetensors");
    let imported = read_hf_bert(&fixture_file, &cfg).unwrap().params;
    let exported = to_hf_bert(&cfg, &imported).unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bert-hf-roundtrip");
    let path = write(&dir, &cfg, &exported);
    let again = read_hf_bert(&path, &cfg).unwrap();
    assert!(again.notes.is_empty(), "{:?}", again.notes);
    assert_eq!(again.params, imported);
    assert!(worst_error(&model_of(&cfg, &again.params)) <= 1e-4);

    // The export is the fixture's file but for what merak folds: every tensor bit for bit,
    // the positions plus token type 0, the token types zero.
    let bytes = std::fs::read(&fixture_file).unwrap();
    let (original, _) = shard_file::decode(&bytes, &fixture_file).unwrap();
    let original: HashMap<String, NamedTensor> =
        original.into_iter().map(|t| (t.name.clone(), t)).collect();
    assert_eq!(original.len(), hf_bert_shapes(&cfg, 2).len());
    let h = cfg.hidden;
    let type0 = &original[TOKEN_TYPE_EMBEDDINGS].values[..h];
    for (name, shape, values) in &exported {
        let o = &original[name];
        assert_eq!(&o.shape, shape, "{name}");
        match name.as_str() {
            TOKEN_TYPE_EMBEDDINGS => assert!(values.iter().all(|&x| x == 0.0)),
            POSITION_EMBEDDINGS => {
                for (i, v) in values.iter().enumerate() {
                    assert_eq!(*v, o.values[i] + type0[i % h], "{name}[{i}]");
                }
            }
            _ => assert_eq!(values, &o.values, "{name}"),
        }
    }
}
