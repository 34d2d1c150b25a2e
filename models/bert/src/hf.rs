//! The tensors of Hugging Face's `BertForMaskedLM` and how merak's BERT parameters map onto
//! them, for exporting a trained model ([`to_hf_bert`], [`hf_bert_config`]) and importing
//! pretrained weights ([`crate::hf_import`]).
//!
//! merak's BERT is `BertForMaskedLM` with the same computation (post-LayerNorm layers, exact
//! erf GELU in the MLP and in the MLM transform, LayerNorm epsilon `model.layer_norm_eps`,
//! absolute learned positions, the decoder tied to the word embeddings), laid out differently:
//!
//! | merak | `BertForMaskedLM` | layout |
//! |---|---|---|
//! | `wte.embedding.weight` `[V, h]` | `bert.embeddings.word_embeddings.weight` | same |
//! | `wpe.weight` `[s, h]` | `bert.embeddings.position_embeddings.weight` | same (see below) |
//! | `ln_emb.gamma` / `beta` | `bert.embeddings.LayerNorm.weight` / `bias` | same |
//! | `layers.N.attention.qkv.linear.weight` `[h, 3h]` | `bert.encoder.layer.N.attention.self.{query,key,value}.weight` `[h, h]` each | stacked, transposed |
//! | `layers.N.attention.qkv.linear.bias` `[3h]` | `...self.{query,key,value}.bias` | concatenated |
//! | `layers.N.attention.proj.linear.weight` `[h, h]` | `...attention.output.dense.weight` | transposed |
//! | `layers.N.attention.proj.bias` | `...attention.output.dense.bias` | same |
//! | `layers.N.ln_1.gamma` / `beta` | `...attention.output.LayerNorm.weight` / `bias` | same |
//! | `layers.N.mlp.fc.linear.weight` `[h, 4h]` | `...intermediate.dense.weight` `[4h, h]` | transposed |
//! | `layers.N.mlp.fc.linear.bias` | `...intermediate.dense.bias` | same |
//! | `layers.N.mlp.proj.linear.weight` `[4h, h]` | `...output.dense.weight` `[h, 4h]` | transposed |
//! | `layers.N.mlp.proj.bias` | `...output.dense.bias` | same |
//! | `layers.N.ln_2.gamma` / `beta` | `...output.LayerNorm.weight` / `bias` | same |
//! | `head.dense.weight` `[h, h]` | `cls.predictions.transform.dense.weight` | transposed |
//! | `head.dense.bias` | `cls.predictions.transform.dense.bias` | same |
//! | `head.ln.gamma` / `beta` | `cls.predictions.transform.LayerNorm.weight` / `bias` | same |
//!
//! Burn's linear weights are `[in, out]` and torch's `[out, in]`, hence the transposes; the
//! fused Q/K/V projection holds the Q, K then V columns (each head-major, as BERT reshapes
//! them). `cls.predictions.decoder.weight` is the word embedding table (tied; transformers
//! does not save it).
//!
//! Two pieces of `BertForMaskedLM` have no counterpart in merak's BERT, which sees one segment
//! and has no output bias:
//!
//! - `bert.embeddings.token_type_embeddings.weight` `[type_vocab_size, h]`: exported as zeros
//!   (so every token type id gives merak's output). On import, its row 0 (the segment every
//!   merak sequence is) is added to every position embedding, which is exactly what BERT
//!   computes for token type ids 0; the other rows are dropped with a note.
//! - `cls.predictions.bias` `[V]` (also `cls.predictions.decoder.bias`): exported as zeros;
//!   a file whose bias is not all zeros is refused on import (merak's tied head has no bias,
//!   and dropping it would change every logit).
//!
//! The pooler (`bert.pooler.*`) and the next-sentence head (`cls.seq_relationship.*`) of
//! `BertForPreTraining` or `BertModel` files are not used by the masked-LM logits and are
//! skipped on import with a note; they are not exported (`BertForMaskedLM` has neither).

use std::collections::HashMap;

use thiserror::Error;

use crate::BertConfig;

/// The token type rows of an exported `bert.embeddings.token_type_embeddings.weight` (BERT's
/// two segments; all zeros).
pub const EXPORT_TYPE_VOCAB: usize = 2;

/// `BertForMaskedLM`'s word embedding table.
pub const WORD_EMBEDDINGS: &str = "bert.embeddings.word_embeddings.weight";
/// `BertForMaskedLM`'s position table.
pub const POSITION_EMBEDDINGS: &str = "bert.embeddings.position_embeddings.weight";
/// `BertForMaskedLM`'s token type (segment) table, which merak's BERT lacks.
pub const TOKEN_TYPE_EMBEDDINGS: &str = "bert.embeddings.token_type_embeddings.weight";
/// `BertForMaskedLM`'s output bias, which merak's BERT lacks.
pub const OUTPUT_BIAS: &str = "cls.predictions.bias";
/// `BertForMaskedLM`'s decoder weight (tied to the word embeddings).
pub const DECODER_WEIGHT: &str = "cls.predictions.decoder.weight";
/// `BertForMaskedLM`'s decoder bias (the same parameter as [`OUTPUT_BIAS`]).
pub const DECODER_BIAS: &str = "cls.predictions.decoder.bias";

/// A Hugging Face tensor: name, shape, row-major values.
pub type HfTensor = (String, Vec<usize>, Vec<f32>);

/// How a merak parameter is laid out relative to its Hugging Face tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The same values and shape.
    Copy,
    /// A torch linear weight `[out, in]` stored by Burn as `[in, out]`.
    Transpose,
    /// Several torch weights `[out, in]` stacked on `out` and transposed: merak's fused
    /// Q/K/V weight `[in, 3 out]`.
    StackTranspose,
    /// Several vectors back to back (the fused Q/K/V bias).
    Concat,
}

/// One merak parameter and the `BertForMaskedLM` tensors it is made of.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// merak's name (its path in the module tree).
    pub ours: String,
    /// merak's full shape.
    pub shape: Vec<usize>,
    /// The Hugging Face tensors, `(name, shape)`, in order.
    pub hf: Vec<(String, Vec<usize>)>,
    /// How the values are rearranged.
    pub layout: Layout,
}

/// The spec of a merak parameter made of one `BertForMaskedLM` tensor (of the transposed
/// shape when `layout` is [`Layout::Transpose`]).
fn single(ours: &str, hf: &str, shape: Vec<usize>, layout: Layout) -> Spec {
    let hf_shape = match layout {
        Layout::Transpose => vec![shape[1], shape[0]],
        _ => shape.clone(),
    };
    Spec {
        ours: ours.into(),
        shape,
        hf: vec![(hf.into(), hf_shape)],
        layout,
    }
}

/// The specs of the embeddings: the word and position tables and their LayerNorm.
fn embedding_specs(cfg: &BertConfig) -> Vec<Spec> {
    let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
    vec![
        single(
            "wte.embedding.weight",
            WORD_EMBEDDINGS,
            vec![v, h],
            Layout::Copy,
        ),
        single("wpe.weight", POSITION_EMBEDDINGS, vec![s, h], Layout::Copy),
        single(
            "ln_emb.gamma",
            "bert.embeddings.LayerNorm.weight",
            vec![h],
            Layout::Copy,
        ),
        single(
            "ln_emb.beta",
            "bert.embeddings.LayerNorm.bias",
            vec![h],
            Layout::Copy,
        ),
    ]
}

/// The parameters of an encoder layer of hidden size `h` made of one tensor each: `(merak
/// name, name in the layer of BertForMaskedLM, merak's shape, layout)`.
fn layer_tensors(h: usize) -> [(&'static str, &'static str, Vec<usize>, Layout); 10] {
    [
        (
            "attention.proj.linear.weight",
            "attention.output.dense.weight",
            vec![h, h],
            Layout::Transpose,
        ),
        (
            "attention.proj.bias",
            "attention.output.dense.bias",
            vec![h],
            Layout::Copy,
        ),
        (
            "ln_1.gamma",
            "attention.output.LayerNorm.weight",
            vec![h],
            Layout::Copy,
        ),
        (
            "ln_1.beta",
            "attention.output.LayerNorm.bias",
            vec![h],
            Layout::Copy,
        ),
        (
            "mlp.fc.linear.weight",
            "intermediate.dense.weight",
            vec![h, 4 * h],
            Layout::Transpose,
        ),
        (
            "mlp.fc.linear.bias",
            "intermediate.dense.bias",
            vec![4 * h],
            Layout::Copy,
        ),
        (
            "mlp.proj.linear.weight",
            "output.dense.weight",
            vec![4 * h, h],
            Layout::Transpose,
        ),
        ("mlp.proj.bias", "output.dense.bias", vec![h], Layout::Copy),
        (
            "ln_2.gamma",
            "output.LayerNorm.weight",
            vec![h],
            Layout::Copy,
        ),
        ("ln_2.beta", "output.LayerNorm.bias", vec![h], Layout::Copy),
    ]
}

/// The specs of encoder layer `i`: the fused Q/K/V projection, then [`layer_tensors`].
fn layer_specs(cfg: &BertConfig, i: usize) -> Vec<Spec> {
    let h = cfg.hidden;
    let o = |p: &str| format!("layers.{i}.{p}");
    let t = |p: &str| format!("bert.encoder.layer.{i}.{p}");
    let qkv = |what: &str| -> Vec<(String, Vec<usize>)> {
        ["query", "key", "value"]
            .iter()
            .map(|part| {
                let shape = if what == "weight" {
                    vec![h, h]
                } else {
                    vec![h]
                };
                (t(&format!("attention.self.{part}.{what}")), shape)
            })
            .collect()
    };
    let mut out = vec![
        Spec {
            ours: o("attention.qkv.linear.weight"),
            shape: vec![h, 3 * h],
            hf: qkv("weight"),
            layout: Layout::StackTranspose,
        },
        Spec {
            ours: o("attention.qkv.linear.bias"),
            shape: vec![3 * h],
            hf: qkv("bias"),
            layout: Layout::Concat,
        },
    ];
    for (ours, hf, shape, layout) in layer_tensors(h) {
        out.push(single(&o(ours), &t(hf), shape, layout));
    }
    out
}

/// The specs of the MLM head's transform (its decoder is the tied word table).
fn head_specs(cfg: &BertConfig) -> [Spec; 4] {
    let h = cfg.hidden;
    [
        single(
            "head.dense.weight",
            "cls.predictions.transform.dense.weight",
            vec![h, h],
            Layout::Transpose,
        ),
        single(
            "head.dense.bias",
            "cls.predictions.transform.dense.bias",
            vec![h],
            Layout::Copy,
        ),
        single(
            "head.ln.gamma",
            "cls.predictions.transform.LayerNorm.weight",
            vec![h],
            Layout::Copy,
        ),
        single(
            "head.ln.beta",
            "cls.predictions.transform.LayerNorm.bias",
            vec![h],
            Layout::Copy,
        ),
    ]
}

/// Every merak parameter of a BERT of shape `cfg` (every unit, without the head's tied copy
/// of the token table) with its `BertForMaskedLM` tensors.
pub fn specs(cfg: &BertConfig) -> Vec<Spec> {
    let mut out = embedding_specs(cfg);
    for i in 0..cfg.layers {
        out.extend(layer_specs(cfg, i));
    }
    out.extend(head_specs(cfg));
    out
}

/// Every tensor of a `BertForMaskedLM` of shape `cfg` with `type_vocab` token types, as
/// transformers saves it (without the tied decoder weight): `(name, shape)`.
pub fn hf_bert_shapes(cfg: &BertConfig, type_vocab: usize) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = specs(cfg).into_iter().flat_map(|s| s.hf).collect();
    out.push((TOKEN_TYPE_EMBEDDINGS.into(), vec![type_vocab, cfg.hidden]));
    out.push((OUTPUT_BIAS.into(), vec![cfg.vocab_size]));
    out
}

/// `values` of a row-major `[rows, cols]` matrix, transposed.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// merak's values of a parameter of layout `layout` from its Hugging Face tensors `parts`
/// (each `(shape, values)` with the shapes [`specs`] gives).
pub fn to_ours(layout: Layout, parts: &[(&[usize], &[f32])]) -> Vec<f32> {
    match layout {
        Layout::Copy => parts[0].1.to_vec(),
        Layout::Transpose => {
            let (shape, values) = parts[0];
            transpose(values, shape[0], shape[1])
        }
        Layout::StackTranspose => {
            let rows: usize = parts.iter().map(|(s, _)| s[0]).sum();
            let cols = parts[0].0[1];
            let stacked: Vec<f32> = parts.iter().flat_map(|(_, v)| v.iter().copied()).collect();
            transpose(&stacked, rows, cols)
        }
        Layout::Concat => parts.iter().flat_map(|(_, v)| v.iter().copied()).collect(),
    }
}

/// The Hugging Face tensors of merak parameter `spec` from its values: the inverse of
/// [`to_ours`], in the order of `spec.hf`.
pub fn to_hf(spec: &Spec, values: &[f32]) -> Vec<Vec<f32>> {
    match spec.layout {
        Layout::Copy => vec![values.to_vec()],
        Layout::Transpose => vec![transpose(values, spec.shape[0], spec.shape[1])],
        Layout::StackTranspose => {
            let stacked = transpose(values, spec.shape[0], spec.shape[1]);
            let size = stacked.len() / spec.hf.len();
            stacked.chunks(size.max(1)).map(<[f32]>::to_vec).collect()
        }
        Layout::Concat => {
            let size = values.len() / spec.hf.len();
            values.chunks(size.max(1)).map(<[f32]>::to_vec).collect()
        }
    }
}

/// A parameter set that cannot be written as `BertForMaskedLM`.
#[derive(Debug, Error, PartialEq)]
pub enum HfBertExportError {
    /// A parameter of the model is not in the set.
    #[error("parameter {0} is missing (not a BERT checkpoint of this shape?)")]
    Missing(String),
    /// A parameter of another shape than the model's.
    #[error("parameter {name} has shape {got:?}, but the model ({model}) has {expected:?}")]
    Shape {
        /// merak's name.
        name: String,
        /// Its shape in the set.
        got: Vec<usize>,
        /// The model's shape.
        expected: Vec<usize>,
        /// The model's sizes.
        model: String,
    },
    /// A parameter with a NaN or an infinity.
    #[error("parameter {name} holds {value} at index {index}: a broken model is not exported")]
    NonFinite {
        /// merak's name.
        name: String,
        /// The first non-finite value.
        value: f32,
        /// Its flat index.
        index: usize,
    },
    /// A name the model does not have.
    #[error("parameter {0} is not a parameter of merak's BERT")]
    Unknown(String),
}

/// The model's sizes, for messages.
pub fn describe(cfg: &BertConfig) -> String {
    format!(
        "model.vocab_size = {}, model.layers = {}, model.heads = {}, model.hidden = {}, model.seq_len = {}",
        cfg.vocab_size, cfg.layers, cfg.heads, cfg.hidden, cfg.seq_len
    )
}

/// The `BertForMaskedLM` tensors `(name, shape, values)` of merak BERT parameters `params`
/// (full size, by merak name, every unit: what a checkpoint holds), for a model of shape
/// `cfg`: the layers rearranged, the token type table and the output bias as zeros (exactly
/// merak's computation for any token type ids). Fails naming the parameter on a missing,
/// unknown, misshapen or non-finite one.
pub fn to_hf_bert(
    cfg: &BertConfig,
    params: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<Vec<HfTensor>, HfBertExportError> {
    let specs = specs(cfg);
    if let Some(name) = params
        .keys()
        .filter(|n| !specs.iter().any(|s| &s.ours == *n))
        .min()
    {
        return Err(HfBertExportError::Unknown(name.clone()));
    }
    let mut out = Vec::new();
    for spec in &specs {
        let (shape, values) = params
            .get(&spec.ours)
            .ok_or_else(|| HfBertExportError::Missing(spec.ours.clone()))?;
        if *shape != spec.shape || values.len() != spec.shape.iter().product::<usize>() {
            return Err(HfBertExportError::Shape {
                name: spec.ours.clone(),
                got: shape.clone(),
                expected: spec.shape.clone(),
                model: describe(cfg),
            });
        }
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(HfBertExportError::NonFinite {
                name: spec.ours.clone(),
                value,
                index,
            });
        }
        for ((name, shape), values) in spec.hf.iter().zip(to_hf(spec, values)) {
            out.push((name.clone(), shape.clone(), values));
        }
    }
    out.push((
        TOKEN_TYPE_EMBEDDINGS.into(),
        vec![EXPORT_TYPE_VOCAB, cfg.hidden],
        vec![0.0; EXPORT_TYPE_VOCAB * cfg.hidden],
    ));
    out.push((
        OUTPUT_BIAS.into(),
        vec![cfg.vocab_size],
        vec![0.0; cfg.vocab_size],
    ));
    Ok(out)
}

/// The Hugging Face `config.json` of a `BertForMaskedLM` of shape `cfg`: exact GELU
/// (`"gelu"`), merak's LayerNorm epsilon, absolute positions, the decoder tied to the word
/// embeddings, two token types (zeros), no attention-probability dropout (merak has none),
/// and no padding id (merak's BERT has no `[PAD]`; transformers' default 0 would freeze the
/// gradient of word embedding row 0). `mask_token_id` records merak's `[MASK]` id.
pub fn hf_bert_config(cfg: &BertConfig) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": 4 * cfg.hidden,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": cfg.seq_len,
        "type_vocab_size": EXPORT_TYPE_VOCAB,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "position_embedding_type": "absolute",
        "is_decoder": false,
        "add_cross_attention": false,
        "tie_word_embeddings": true,
        "pad_token_id": null,
        "mask_token_id": cfg.mask_token_id,
        "torch_dtype": "float32"
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Bert;
    use merak_burn::backend::Cpu;
    use merak_burn::checkpoint::state::param_shapes;
    use merak_burn::comm::Group;

    /// A BERT of two layers whose vocabulary is odd (padded under tp = 2), `[MASK]` its last
    /// id: the shape of the transformers fixture (tests/fixtures/bert-hf).
    pub(crate) fn odd() -> BertConfig {
        let shape = "bert:layers=2,hidden=32,heads=4,seq=16,vocab=101".parse();
        BertConfig::from_shape(&shape.unwrap())
    }

    #[test]
    fn every_parameter_has_a_spec_of_its_shape() {
        let cfg = odd();
        let model = Bert::<Cpu>::new(&cfg, 1, Group::local(), &Default::default()).unwrap();
        let params = param_shapes(&model);
        let specs = specs(&cfg);
        assert_eq!(params.len(), specs.len());
        for (ours, shape) in params.iter().map(|p| (&p.name, &p.shape)) {
            let spec = specs
                .iter()
                .find(|s| &s.ours == ours)
                .unwrap_or_else(|| panic!("{ours} has no spec"));
            assert_eq!(&spec.shape, shape, "{ours}");
            let n: usize = spec
                .hf
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            assert_eq!(n, shape.iter().product::<usize>(), "{ours}");
        }
        // Every HF name once; 16 per layer, 8 outside, the token types and the bias.
        let hf = hf_bert_shapes(&cfg, 2);
        let unique: std::collections::HashSet<_> = hf.iter().map(|x| &x.0).collect();
        assert_eq!((hf.len(), unique.len()), (2 * 16 + 8 + 2, hf.len()));
    }

    #[test]
    fn layouts_invert_and_the_fused_qkv_is_q_k_v_columns() {
        let cfg = odd();
        let h = cfg.hidden;
        for spec in specs(&cfg) {
            let n: usize = spec.shape.iter().product();
            let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let parts = to_hf(&spec, &values);
            let views: Vec<(&[usize], &[f32])> = spec
                .hf
                .iter()
                .zip(&parts)
                .map(|((_, s), v)| (s.as_slice(), v.as_slice()))
                .collect();
            for ((name, shape), v) in spec.hf.iter().zip(&parts) {
                assert_eq!(v.len(), shape.iter().product::<usize>(), "{name}");
            }
            assert_eq!(to_ours(spec.layout, &views), values, "{}", spec.ours);
        }
        // query.weight[o][i] (torch [out, in]) is qkv[i][o], key.weight[o][i] is
        // qkv[i][h + o], value.weight[o][i] is qkv[i][2h + o].
        let spec = specs(&cfg)
            .into_iter()
            .find(|s| s.ours == "layers.1.attention.qkv.linear.weight")
            .unwrap();
        let qkv: Vec<f32> = (0..h * 3 * h).map(|i| i as f32).collect();
        let parts = to_hf(&spec, &qkv);
        assert!(spec.hf[1].0.ends_with("layer.1.attention.self.key.weight"));
        let (o, i) = (5, 7);
        assert_eq!(parts[0][o * h + i], qkv[i * 3 * h + o]);
        assert_eq!(parts[1][o * h + i], qkv[i * 3 * h + h + o]);
        assert_eq!(parts[2][o * h + i], qkv[i * 3 * h + 2 * h + o]);
    }

    #[test]
    fn export_adds_zero_token_types_and_bias_and_names_bad_parameters() {
        let cfg = odd();
        let mut params: HashMap<String, (Vec<usize>, Vec<f32>)> = specs(&cfg)
            .into_iter()
            .map(|s| {
                let n = s.shape.iter().product();
                (s.ours, (s.shape, vec![0.5; n]))
            })
            .collect();
        let out = to_hf_bert(&cfg, &params).unwrap();
        assert_eq!(out.len(), hf_bert_shapes(&cfg, 2).len());
        let tt = out.iter().find(|t| t.0 == TOKEN_TYPE_EMBEDDINGS).unwrap();
        assert_eq!(
            (&tt.1, tt.2.iter().all(|&x| x == 0.0)),
            (&vec![2, 32], true)
        );
        let bias = out.iter().find(|t| t.0 == OUTPUT_BIAS).unwrap();
        assert_eq!(bias.1, vec![101]);

        params.get_mut("layers.0.ln_2.beta").unwrap().1[3] = f32::NAN;
        let e = to_hf_bert(&cfg, &params).unwrap_err().to_string();
        assert!(e.contains("layers.0.ln_2.beta") && e.contains("NaN"), "{e}");
        params.get_mut("layers.0.ln_2.beta").unwrap().0 = vec![31];
        let e = to_hf_bert(&cfg, &params).unwrap_err().to_string();
        assert!(e.contains("[31]") && e.contains("[32]"), "{e}");
        params.remove("layers.0.ln_2.beta");
        assert_eq!(
            to_hf_bert(&cfg, &params).unwrap_err(),
            HfBertExportError::Missing("layers.0.ln_2.beta".into())
        );
        params.insert("blocks.0.x".into(), (vec![1], vec![0.0]));
        assert_eq!(
            to_hf_bert(&cfg, &params).unwrap_err(),
            HfBertExportError::Unknown("blocks.0.x".into())
        );
    }
}
