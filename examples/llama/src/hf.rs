//! Hugging Face `LlamaForCausalLM` and `MixtralForCausalLM` checkpoints in and out:
//! [`read_hf_llama`] reads a folder as `save_pretrained` writes it (`config.json`, and
//! `model.safetensors` or the files of `model.safetensors.index.json`) into a [`LlamaConfig`]
//! and the full-size parameters by merak name; [`write_hf_llama`] writes them back in the same
//! form. `config.json`'s `model_type` tells them apart (`"llama"` or `"mixtral"`; without one,
//! `architectures`): a Mixtral is this decoder with [`LlamaConfig::moe`] set, its blocks'
//! MLPs replaced by mixtures of experts.
//!
//! The layouts differ in these ways, converted both ways:
//! - torch's `nn.Linear` weight is `[out, in]`, Burn's `[in, out]`: every projection is
//!   transposed (the token table and the norms are not);
//! - transformers rotates the two halves of each query/key head (`rotate_half`: feature `i`
//!   with `i + head_dim / 2`), Burn's `RotaryEncoding` interleaved pairs (`2i` with `2i + 1`):
//!   feature `2i` of each of our query/key heads is transformers' feature `i`, feature `2i + 1`
//!   its feature `i + head_dim / 2` (the same attention scores, since queries and keys are
//!   permuted alike);
//! - a Mixtral expert's gate (`w1`) and up (`w3`) projections are two tensors there, the
//!   two halves of the columns of one input projection here (`moe.experts.{e}.w_in`,
//!   `[hidden, 2 ffn]`, the gate's first), each transposed; its down projection (`w2`) and
//!   the router (`block_sparse_moe.gate`) are transposed.
//!
//! Files are untrusted: every size in a safetensors header is checked against the file's real
//! size before anything is allocated from it, every tensor's name and shape against
//! `config.json`, its values must be finite, and whatever does not fit is an error naming the
//! file, the tensor (or key) and both shapes; nothing panics.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use merak_burn::checkpoint::NamedTensor;
use merak_burn::hf_files::{self, HfFileError};
use serde_json::{Value, json};
use thiserror::Error;

use crate::{FullParams, InvalidConfig, LlamaConfig, RopeScaling, SparseMoe};

/// The model's config file.
pub const CONFIG_FILE: &str = "config.json";
/// The weights in one file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of weights in several files.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest index read (a 405B Llama's is about 100 KiB).
const MAX_INDEX_BYTES: u64 = 64 << 20;
/// The most positions taken from `max_position_embeddings` (the rotary table of the model
/// holds `max_seq x head_dim x 2` floats).
pub const MAX_POSITIONS: usize = 1 << 20;

/// A Hugging Face Llama or Mixtral read by [`read_hf_llama`].
#[derive(Clone, Debug)]
pub struct HfLlama {
    /// The model's shape from `config.json` (`max_seq` is `max_position_embeddings`, or a
    /// Mixtral's `sliding_window` when smaller; a run on shorter sequences may lower it, it
    /// only sizes the rotary table).
    pub config: LlamaConfig,
    /// Every parameter at full size, by merak name, in merak's layouts.
    pub params: FullParams,
    /// What was read but not used (rotary frequency buffers, a tied head's copy of the token
    /// table, a Mixtral's router noise).
    pub notes: Vec<String>,
    /// A Mixtral's `sliding_window`: transformers lets each position attend to the previous
    /// `sliding_window` positions only, this model to all of them, so the two compute the same
    /// on sequences of at most that many tokens, which [`pretrained_or`](crate::pretrained_or)
    /// holds runs to.
    pub sliding_window: Option<usize>,
}

/// A Hugging Face Llama or Mixtral folder that cannot be read, or parameters that cannot be
/// written; every variant reading a file names it.
#[derive(Debug, Error)]
pub enum HfLlamaError {
    /// Reading or writing a file failed; not a valid safetensors file, JSON file or folder; a
    /// tensor of an element type that is not converted (F32, F16, BF16 and F64 are), or
    /// holding a NaN or an infinity.
    #[error(transparent)]
    File(#[from] HfFileError),
    /// A value of `config.json` this model cannot take.
    #[error("{}: `{key}` = {value}: {reason}", path.display())]
    Config {
        /// The `config.json`.
        path: PathBuf,
        /// The key.
        key: String,
        /// Its value in the file (`absent` if missing).
        value: String,
        /// Why it cannot be taken.
        reason: String,
    },
    /// A tensor of another shape than `config.json` gives.
    #[error(
        "{}: tensor {tensor} has shape {file:?}, but config.json ({model}) gives {expected:?}",
        path.display()
    )]
    Shape {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Its shape in the file.
        file: Vec<usize>,
        /// The shape `config.json` gives.
        expected: Vec<usize>,
        /// The sizes of `config.json`.
        model: String,
    },
    /// A tensor of the model is in no file.
    #[error("{}: tensor {tensor} is missing (config.json: {model})", path.display())]
    Missing {
        /// The file that should hold it (the one the index names, or `model.safetensors`).
        path: PathBuf,
        /// Its `LlamaForCausalLM` (or `MixtralForCausalLM`) name.
        tensor: String,
        /// The sizes of `config.json`.
        model: String,
    },
    /// A tensor the model cannot take.
    #[error("{}: tensor {tensor}: {reason}", path.display())]
    Unexpected {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// Writing: the config describes no model.
    #[error(transparent)]
    Invalid(#[from] InvalidConfig),
    /// Writing: the parameters do not fit the config.
    #[error("parameter {name}: {reason}")]
    Params {
        /// The merak name.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

/// How a tensor's layout differs between the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// The same (token table, norms).
    Same,
    /// Transposed (a projection).
    Transposed,
    /// Transposed, and each head's output features permuted between half-split and
    /// interleaved rotary order (query and key projections).
    Rotary,
    /// Transposed into the first half of the columns of an expert's input projection (a
    /// Mixtral expert's gate projection, `w1`).
    Gate,
    /// Transposed into the second half of the columns of an expert's input projection (a
    /// Mixtral expert's up projection, `w3`).
    Up,
}

impl Layout {
    /// Which half of an expert's input projection's columns the tensor fills, if it fills one.
    fn half(self) -> Option<usize> {
        match self {
            Layout::Gate => Some(0),
            Layout::Up => Some(1),
            _ => None,
        }
    }
}

/// One tensor of `LlamaForCausalLM` (or `MixtralForCausalLM`).
#[derive(Clone, Debug)]
struct Spec {
    /// Its transformers name.
    hf: String,
    /// Its merak name (of the parameter it fills half of, for [`Layout::Gate`] and
    /// [`Layout::Up`]).
    merak: String,
    /// Its transformers shape.
    shape: Vec<usize>,
    layout: Layout,
}

impl Spec {
    /// The shape of the merak parameter it fills.
    fn ours(&self) -> Vec<usize> {
        match (self.layout, &self.shape[..]) {
            (Layout::Same, _) => self.shape.clone(),
            (Layout::Gate | Layout::Up, &[width, hidden]) => vec![hidden, 2 * width],
            _ => self.shape.iter().rev().copied().collect(),
        }
    }
}

/// The tensors of a `LlamaForCausalLM` (or `MixtralForCausalLM`) of shape `c` (without the head of a tied one), in
/// module order.
fn specs(c: &LlamaConfig) -> Vec<Spec> {
    let h = c.hidden;
    let spec = |hf: String, merak: String, shape: Vec<usize>, layout| Spec {
        hf,
        merak,
        shape,
        layout,
    };
    let mut out = vec![spec(
        "model.embed_tokens.weight".into(),
        "embed.tokens.weight".into(),
        vec![c.vocab, h],
        Layout::Same,
    )];
    for l in 0..c.layers {
        let per_layer = attention_specs(c)
            .map(|(hf, merak, shape, layout)| (hf.into(), merak.into(), shape, layout));
        for (hf, merak, shape, layout) in per_layer.into_iter().chain(feed_forward_specs(c)) {
            out.push(spec(
                format!("model.layers.{l}.{hf}"),
                format!("layers.{l}.{merak}"),
                shape,
                layout,
            ));
        }
    }
    out.push(spec(
        "model.norm.weight".into(),
        "head.norm.gamma".into(),
        vec![h],
        Layout::Same,
    ));
    if !c.tie_embeddings {
        out.push(spec(
            "lm_head.weight".into(),
            "head.output.linear.weight".into(),
            vec![c.vocab, h],
            Layout::Transposed,
        ));
    }
    out
}

/// One block's attention and norm tensors: the transformers name and the merak name within
/// the block, the transformers shape, the layout.
fn attention_specs(c: &LlamaConfig) -> [(&'static str, &'static str, Vec<usize>, Layout); 6] {
    let (h, hd) = (c.hidden, c.head_dim());
    let (q, kv) = (c.heads * hd, c.kv_heads * hd);
    [
        (
            "input_layernorm.weight",
            "attn_norm.gamma",
            vec![h],
            Layout::Same,
        ),
        (
            "self_attn.q_proj.weight",
            "attn.wq.linear.weight",
            vec![q, h],
            Layout::Rotary,
        ),
        (
            "self_attn.k_proj.weight",
            "attn.wk.linear.weight",
            vec![kv, h],
            Layout::Rotary,
        ),
        (
            "self_attn.v_proj.weight",
            "attn.wv.linear.weight",
            vec![kv, h],
            Layout::Transposed,
        ),
        (
            "self_attn.o_proj.weight",
            "attn.wo.linear.weight",
            vec![h, q],
            Layout::Transposed,
        ),
        (
            "post_attention_layernorm.weight",
            "mlp_norm.gamma",
            vec![h],
            Layout::Same,
        ),
    ]
}

/// One block's MLP (`LlamaForCausalLM`) or mixture of experts (`MixtralForCausalLM`): the
/// transformers name and the merak name within the block, the transformers shape, the layout.
fn feed_forward_specs(c: &LlamaConfig) -> Vec<(String, String, Vec<usize>, Layout)> {
    let (h, f) = (c.hidden, c.ffn);
    let Some(moe) = c.moe else {
        let mlp = [
            ("gate_proj", "w1", vec![f, h]),
            ("down_proj", "w2", vec![h, f]),
            ("up_proj", "w3", vec![f, h]),
        ];
        return (mlp.into_iter())
            .map(|(theirs, ours, shape)| {
                let (theirs, ours) = (
                    format!("mlp.{theirs}.weight"),
                    format!("mlp.{ours}.linear.weight"),
                );
                (theirs, ours, shape, Layout::Transposed)
            })
            .collect();
    };
    let router = ("block_sparse_moe.gate.weight".into(), "moe.router".into());
    let mut out = vec![(router.0, router.1, vec![moe.experts, h], Layout::Transposed)];
    for e in 0..moe.experts {
        let expert = [
            ("w1", "w_in", vec![f, h], Layout::Gate),
            ("w2", "w_out", vec![h, f], Layout::Transposed),
            ("w3", "w_in", vec![f, h], Layout::Up),
        ];
        out.extend(expert.map(|(theirs, ours, shape, layout)| {
            let theirs = format!("block_sparse_moe.experts.{e}.{theirs}.weight");
            (theirs, format!("moe.experts.{e}.{ours}"), shape, layout)
        }));
    }
    out
}

/// The transformers output feature of our output feature `o` of a query/key projection with
/// heads `hd` wide: within each head, our `2i` is their `i` and our `2i + 1` their
/// `i + hd / 2`.
fn rotary_source(o: usize, hd: usize) -> usize {
    let (head, k) = (o / hd, o % hd);
    head * hd + k / 2 + (k % 2) * (hd / 2)
}

/// Our values of a transformers tensor `[out, in]` (`hf`), for `layout`; `hd` the head width.
/// For [`Layout::Gate`] and [`Layout::Up`], the transposed half (`[in, out]`) that
/// [`place`] puts into its expert's input projection.
fn to_ours(layout: Layout, shape: &[usize], hf: Vec<f32>, hd: usize) -> (Vec<usize>, Vec<f32>) {
    let [out, inp] = match (layout, shape) {
        (Layout::Same, _) | (_, [_]) => return (shape.to_vec(), hf),
        (_, &[out, inp]) => [out, inp],
        _ => return (shape.to_vec(), hf),
    };
    let mut ours = vec![0.0; hf.len()];
    for o in 0..out {
        let src = if layout == Layout::Rotary {
            rotary_source(o, hd)
        } else {
            o
        };
        for i in 0..inp {
            ours[i * out + o] = hf[src * inp + i];
        }
    }
    (vec![inp, out], ours)
}

/// Puts our values `(shape, values)` of the tensor `spec` into `params`: as the parameter,
/// or, for [`Layout::Gate`] and [`Layout::Up`] (`[hidden, ffn]`), as its half of the columns
/// of the expert's input projection (`[hidden, 2 ffn]`).
fn place(params: &mut FullParams, spec: &Spec, (shape, values): (Vec<usize>, Vec<f32>)) {
    let (Some(half), &[rows, cols]) = (spec.layout.half(), &shape[..]) else {
        params.insert(spec.merak.clone(), (shape, values));
        return;
    };
    let (_, whole) = (params.entry(spec.merak.clone()))
        .or_insert_with(|| (vec![rows, 2 * cols], vec![0.0; rows * 2 * cols]));
    for (r, row) in values.chunks_exact(cols).enumerate() {
        let at = r * 2 * cols + half * cols;
        if let Some(dst) = whole.get_mut(at..at + cols) {
            dst.copy_from_slice(row);
        }
    }
}

/// The transformers values (`[out, in]`) of our tensor `[in, out]` (`shape`): the inverse of
/// [`to_ours`] (and of [`place`]: the gate's or up projection's half of an expert's input
/// projection, for [`Layout::Gate`] and [`Layout::Up`]).
fn to_hf(layout: Layout, shape: &[usize], ours: &[f32], hd: usize) -> Vec<f32> {
    // Our columns are `offset..offset + out` of rows `stride` wide.
    let (inp, out, stride, offset) = match (layout.half(), shape) {
        (_, [_]) => return ours.to_vec(),
        _ if layout == Layout::Same => return ours.to_vec(),
        (Some(half), &[inp, cols]) => (inp, cols / 2, cols, half * (cols / 2)),
        (None, &[inp, out]) => (inp, out, out, 0),
        _ => return ours.to_vec(),
    };
    let mut hf = vec![0.0; inp * out];
    for o in 0..out {
        let dst = if layout == Layout::Rotary {
            rotary_source(o, hd)
        } else {
            o
        };
        for i in 0..inp {
            hf[dst * inp + i] = ours[i * stride + offset + o];
        }
    }
    hf
}

/// The sizes of `c` as `config.json` names them, for messages.
fn describe(c: &LlamaConfig) -> String {
    let experts = c.moe.map_or_else(String::new, |m| {
        format!(
            ", num_local_experts = {}, num_experts_per_tok = {}",
            m.experts, m.top_k
        )
    });
    format!(
        "vocab_size = {}, hidden_size = {}, num_hidden_layers = {}, num_attention_heads = {}, \
         num_key_value_heads = {}, intermediate_size = {}, tie_word_embeddings = {}{experts}",
        c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.tie_embeddings
    )
}

/// The transformers class of a model of shape `c`.
fn architecture(c: &LlamaConfig) -> &'static str {
    match c.moe {
        Some(_) => "MixtralForCausalLM",
        None => "LlamaForCausalLM",
    }
}

/// The keys of a `config.json` (`json`, read from `path`), read with errors naming the file,
/// the key and its value.
#[derive(Clone, Copy)]
struct Keys<'a> {
    json: &'a Value,
    path: &'a Path,
}

/// Sizes at most 2^31: the model's dimensions, far above any Llama's or Mixtral's.
const BIG: usize = 1 << 31;

impl Keys<'_> {
    /// The value of `key` (`None` when absent or null).
    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// The error refusing `value` of `key` (`None`: absent) for `reason`.
    fn refuse(&self, key: &str, value: Option<&Value>, reason: String) -> HfLlamaError {
        HfLlamaError::Config {
            path: self.path.to_path_buf(),
            key: key.into(),
            value: value.map_or_else(|| "absent".into(), Value::to_string),
            reason,
        }
    }

    /// A whole number from 1 to `max`; `default` when absent (`None`: required).
    fn size(&self, key: &str, default: Option<usize>, max: usize) -> Result<usize, HfLlamaError> {
        let Some(v) = self.get(key) else {
            return default.ok_or_else(|| self.refuse(key, None, "required".into()));
        };
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n >= 1 && n <= max => Ok(n),
            _ => Err(self.refuse(
                key,
                Some(v),
                format!("must be a whole number from 1 to {max}"),
            )),
        }
    }

    /// `true` or `false`; `default` when absent.
    fn flag(&self, key: &str, default: bool) -> Result<bool, HfLlamaError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.refuse(key, Some(v), "must be true or false".into())),
        }
    }

    /// A finite number of at least 0; `default` when absent.
    fn non_negative(&self, key: &str, default: f64) -> Result<f64, HfLlamaError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(f) if f.is_finite() && f >= 0.0 => Ok(f),
                _ => Err(self.refuse(key, Some(v), "must be a number of at least 0".into())),
            },
        }
    }

    /// A finite number above 0, `value` of `key` (`None` or null: `default`).
    fn positive(
        &self,
        key: &str,
        value: Option<&Value>,
        default: f64,
    ) -> Result<f64, HfLlamaError> {
        match value.filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f),
                _ => Err(self.refuse(key, Some(x), "must be a positive number".into())),
            },
        }
    }

    /// Whether the file describes a `MixtralForCausalLM` (`model_type` `"mixtral"`, or, without
    /// a `model_type`, `architectures` naming it) rather than a `LlamaForCausalLM`
    /// (`"llama"`); another `model_type` is refused.
    fn is_mixtral(&self) -> Result<bool, HfLlamaError> {
        match self.get("model_type") {
            None => Ok((self.get("architectures").and_then(Value::as_array))
                .is_some_and(|a| a.iter().any(|v| v.as_str() == Some("MixtralForCausalLM")))),
            Some(v) if v.as_str() == Some("llama") => Ok(false),
            Some(v) if v.as_str() == Some("mixtral") => Ok(true),
            Some(v) => Err(self.refuse(
                "model_type",
                Some(v),
                "a LlamaForCausalLM has \"llama\", a MixtralForCausalLM \"mixtral\"".into(),
            )),
        }
    }
}

/// What a `config.json` says beyond the model's shape.
#[derive(Clone, Debug, Default)]
struct Extras {
    /// A Mixtral's sliding window ([`HfLlama::sliding_window`]).
    sliding_window: Option<usize>,
    /// Settings read but not applied.
    notes: Vec<String>,
}

/// The mixture of experts of a `MixtralForCausalLM`'s `config.json` and what else it says:
/// `num_local_experts` and `num_experts_per_tok` (the experts' width is
/// `intermediate_size`), the load-balancing loss (`router_aux_loss_coef` when
/// `output_router_logits`, as transformers trains), the sliding window; absent keys take
/// transformers' defaults (8 experts, 2 per token, no loss, no window). Router noise
/// (`router_jitter_noise`), which transformers applies in training only, is not applied: a
/// note says so.
fn mixtral_keys(keys: &Keys<'_>) -> Result<(SparseMoe, Extras), HfLlamaError> {
    let experts = keys.size("num_local_experts", Some(8), BIG)?;
    let top_k = keys.size("num_experts_per_tok", Some(2), BIG)?;
    if top_k > experts {
        return Err(keys.refuse(
            "num_experts_per_tok",
            keys.get("num_experts_per_tok"),
            format!("must be at most num_local_experts = {experts}"),
        ));
    }
    let coef = keys.non_negative("router_aux_loss_coef", 0.001)?;
    let aux_loss = match keys.flag("output_router_logits", false)? {
        true => coef,
        false => 0.0,
    };
    let jitter = keys.non_negative("router_jitter_noise", 0.0)?;
    let sliding_window = match keys.get("sliding_window") {
        None => None,
        Some(_) => Some(keys.size("sliding_window", None, BIG)?),
    };
    let mut notes = Vec::new();
    if jitter > 0.0 {
        notes.push(format!(
            "router_jitter_noise = {jitter} not applied: transformers multiplies the routers' \
             inputs by noise in training only; the routing here is noiseless"
        ));
    }
    let moe = SparseMoe {
        experts,
        top_k,
        aux_loss,
        bias_update_rate: 0.0,
    };
    Ok((
        moe,
        Extras {
            sliding_window,
            notes,
        },
    ))
}

/// Reads the `config.json` of a `LlamaForCausalLM` or a `MixtralForCausalLM` (`json`, read
/// from `path`) into our config. Sizes and flags the model cannot reproduce are refused:
/// biases (`attention_bias`, `mlp_bias`), an activation other than SiLU, a `head_dim` other
/// than `hidden_size / num_attention_heads`, partial rotary embedding, rotary types other than
/// the default and `llama3`. Both the `rope_theta` + `rope_scaling` keys of transformers 4 and
/// the `rope_parameters` of transformers 5 are read. A Mixtral's keys are read as
/// [`read_hf_llama`] says; its sliding window, if smaller than `max_position_embeddings`,
/// becomes `max_seq`.
pub fn llama_config_from_hf(json: &Value, path: &Path) -> Result<LlamaConfig, HfLlamaError> {
    config_from_hf(json, path).map(|(config, _)| config)
}

/// [`llama_config_from_hf`], with what else the file says.
fn config_from_hf(json: &Value, path: &Path) -> Result<(LlamaConfig, Extras), HfLlamaError> {
    let keys = Keys { json, path };
    if !json.is_object() {
        return Err(HfFileError::format(path, "not a JSON object").into());
    }
    let mixtral = keys.is_mixtral()?;
    let size = |key: &str, default: Option<usize>, max: usize| keys.size(key, default, max);
    let vocab = size("vocab_size", None, BIG)?;
    let hidden = size("hidden_size", None, BIG)?;
    let layers = size("num_hidden_layers", None, BIG)?;
    let heads = size("num_attention_heads", None, BIG)?;
    let ffn = size("intermediate_size", None, BIG)?;
    let kv_heads = size("num_key_value_heads", Some(heads), BIG)?;
    let max_seq = size("max_position_embeddings", Some(2048), MAX_POSITIONS)?;
    check_heads(&keys, hidden, heads, kv_heads)?;
    refuse_biases_and_other_activations(&keys)?;
    let tie_embeddings = keys.flag("tie_word_embeddings", false)?;
    let rms_norm_eps = keys.positive("rms_norm_eps", keys.get("rms_norm_eps"), 1e-6)?;
    let (rope_theta, rope_scaling) = rope_settings(&keys, mixtral, max_seq)?;
    let (moe, extras) = match mixtral {
        true => mixtral_keys(&keys).map(|(moe, extras)| (Some(moe), extras))?,
        false => (None, Extras::default()),
    };
    let config = LlamaConfig {
        vocab,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn,
        max_seq: extras.sliding_window.map_or(max_seq, |w| w.min(max_seq)),
        rope_theta,
        rope_scaling,
        rms_norm_eps,
        tie_embeddings,
        moe,
    };
    config
        .validate()
        .map_err(|e| HfFileError::format(path, e.to_string()))?;
    Ok((config, extras))
}

/// Checks the heads of a `config.json`: `num_attention_heads` divides `hidden_size`,
/// `head_dim` (if given) is their quotient and even (rotary embedding), and
/// `num_key_value_heads` divides `num_attention_heads`.
fn check_heads(
    keys: &Keys<'_>,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
) -> Result<(), HfLlamaError> {
    if !hidden.is_multiple_of(heads) {
        return Err(keys.refuse(
            "num_attention_heads",
            keys.get("num_attention_heads"),
            format!("must divide hidden_size = {hidden}"),
        ));
    }
    let head_dim = hidden / heads;
    if let Some(v) = keys.get("head_dim")
        && v.as_u64() != Some(head_dim as u64)
    {
        return Err(keys.refuse(
            "head_dim",
            Some(v),
            format!("the model's heads are hidden_size / num_attention_heads = {head_dim} wide"),
        ));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(keys.refuse(
            "hidden_size",
            keys.get("hidden_size"),
            format!("heads of {head_dim} features: rotary position embedding needs an even width"),
        ));
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(keys.refuse(
            "num_key_value_heads",
            keys.get("num_key_value_heads"),
            format!("must divide num_attention_heads = {heads}"),
        ));
    }
    Ok(())
}

/// Refuses what the model's projections and MLP lack: biases (`attention_bias`, `mlp_bias`)
/// and an activation other than SiLU (`hidden_act`).
fn refuse_biases_and_other_activations(keys: &Keys<'_>) -> Result<(), HfLlamaError> {
    for key in ["attention_bias", "mlp_bias"] {
        if keys.flag(key, false)? {
            return Err(keys.refuse(
                key,
                keys.get(key),
                "the model's projections have no biases".into(),
            ));
        }
    }
    if let Some(v) = keys.get("hidden_act")
        && v.as_str() != Some("silu")
    {
        return Err(keys.refuse(
            "hidden_act",
            Some(v),
            "the model's MLP is SwiGLU (\"silu\")".into(),
        ));
    }
    Ok(())
}

/// The section of a `config.json` that holds the rotary settings: `rope_parameters`
/// (transformers 5) or `rope_scaling` (transformers 4), and its value when present.
struct RopeSection<'a> {
    /// The section's key.
    name: &'static str,
    /// Its value (`None` when absent or null).
    value: Option<&'a Value>,
}

impl<'a> RopeSection<'a> {
    /// The value of `name` in the section (`None` when absent or null).
    fn field(&self, name: &str) -> Option<&'a Value> {
        self.value
            .and_then(|r| r.get(name))
            .filter(|v| !v.is_null())
    }

    /// The full key of `name` in the section, for messages.
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.name)
    }
}

/// The rotary base and scaling of a `config.json` (a `model.max_seq` of `max_seq` is the
/// default original length of `llama3` scaling): partial rotation and rotary types other than
/// the default and `llama3` are refused.
fn rope_settings(
    keys: &Keys<'_>,
    mixtral: bool,
    max_seq: usize,
) -> Result<(f64, Option<RopeScaling>), HfLlamaError> {
    let get = |key: &str| keys.get(key);
    // transformers 5 keeps the rotary settings in `rope_parameters`, 4 in `rope_theta` and
    // `rope_scaling`.
    let (name, value) = match (get("rope_parameters"), get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(s)) => ("rope_scaling", Some(s)),
        (None, None) => ("rope_scaling", None),
    };
    let rope = RopeSection { name, value };
    if let Some(r) = rope.value
        && !r.is_object()
    {
        return Err(keys.refuse(rope.name, Some(r), "must be an object".into()));
    }
    let theta_value = rope.field("rope_theta").or_else(|| get("rope_theta"));
    // transformers' default base: 10000 for Llama, 1e6 for Mixtral.
    let default_theta = if mixtral { 1e6 } else { 10000.0 };
    let rope_theta = keys.positive("rope_theta", theta_value, default_theta)?;
    let partial = (rope.field("partial_rotary_factor")).or_else(|| get("partial_rotary_factor"));
    if partial.is_some_and(|v| v.as_f64() != Some(1.0)) {
        return Err(keys.refuse(
            "partial_rotary_factor",
            partial,
            "the model rotates whole heads (1.0)".into(),
        ));
    }
    let kind_value = rope.field("rope_type").or_else(|| rope.field("type"));
    let kind = match kind_value {
        None => "default",
        Some(v) => v.as_str().ok_or_else(|| {
            keys.refuse(&rope.key("rope_type"), Some(v), "must be a string".into())
        })?,
    };
    let rope_scaling = match kind {
        "default" => None,
        "llama3" => Some(llama3_scaling(keys, &rope, max_seq)?),
        other => {
            return Err(keys.refuse(
                &rope.key("rope_type"),
                kind_value,
                format!("rotary type {other:?}: the default and \"llama3\" are supported"),
            ));
        }
    };
    Ok((rope_theta, rope_scaling))
}

/// The `llama3` rotary scaling of the section `rope` (its original length `max_seq` when
/// absent): the factors are required and positive, the high one above the low one.
fn llama3_scaling(
    keys: &Keys<'_>,
    rope: &RopeSection<'_>,
    max_seq: usize,
) -> Result<RopeScaling, HfLlamaError> {
    let factor = |name: &str| -> Result<f64, HfLlamaError> {
        match rope.field(name) {
            None => Err(keys.refuse(&rope.key(name), None, "required by llama3".into())),
            v => keys.positive(&rope.key(name), v, 0.0),
        }
    };
    let scaling = RopeScaling {
        factor: factor("factor")?,
        low_freq_factor: factor("low_freq_factor")?,
        high_freq_factor: factor("high_freq_factor")?,
        original_max_position_embeddings: match rope.field("original_max_position_embeddings") {
            None => max_seq,
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) if n >= 1 => n,
                _ => {
                    return Err(keys.refuse(
                        &rope.key("original_max_position_embeddings"),
                        Some(v),
                        "must be a positive whole number".into(),
                    ));
                }
            },
        },
    };
    if scaling.high_freq_factor <= scaling.low_freq_factor {
        return Err(keys.refuse(
            &rope.key("high_freq_factor"),
            rope.field("high_freq_factor"),
            format!("must exceed low_freq_factor = {}", scaling.low_freq_factor),
        ));
    }
    Ok(scaling)
}

/// The `config.json` of a `LlamaForCausalLM` of shape `c` (as transformers 4 writes it; 5
/// reads it too), or of a `MixtralForCausalLM` when `c` has a mixture of experts (without a
/// sliding window: this model attends to every earlier position).
pub fn hf_config_json(c: &LlamaConfig) -> Value {
    let scaling = c.rope_scaling.map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        })
    });
    let mut config = json!({
        "architectures": [architecture(c)],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim(),
        "max_position_embeddings": c.max_seq,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    });
    let specific = match c.moe {
        None => json!({ "model_type": "llama", "attention_bias": false, "mlp_bias": false }),
        Some(m) => json!({
            "model_type": "mixtral",
            "num_local_experts": m.experts,
            "num_experts_per_tok": m.top_k,
            "output_router_logits": m.aux_loss > 0.0,
            "router_aux_loss_coef": m.aux_loss,
            "router_jitter_noise": 0.0,
            "sliding_window": null,
        }),
    };
    if let (Some(all), Value::Object(more)) = (config.as_object_mut(), specific) {
        all.extend(more);
    }
    config
}

/// Whether `name` is a plain file name (no folder, not `.` or `..`): joined to the model's
/// folder it stays inside.
fn plain_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(n)), None) if n == name
    ) && !name.contains('\\')
}

/// An index file and its file of each tensor.
type Index = (PathBuf, BTreeMap<String, String>);

/// The weight files of the folder `dir`: `model.safetensors`, or the files of the index with
/// the index.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<Index>), HfLlamaError> {
    let index_path = dir.join(INDEX_FILE);
    if !hf_files::exists(&index_path)? {
        let single = dir.join(SINGLE_FILE);
        if !hf_files::exists(&single)? {
            let reason = format!("neither {SINGLE_FILE} nor {INDEX_FILE} in the folder");
            return Err(HfFileError::format(dir, reason).into());
        }
        return Ok((vec![single], None));
    }
    let index = hf_files::read_json(&index_path, MAX_INDEX_BYTES)?;
    let bad = |reason: String| HfFileError::format(&index_path, reason);
    let map = (index.get("weight_map").and_then(Value::as_object))
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut weight_map = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().filter(|f| plain_name(f)).ok_or_else(|| {
            bad(format!(
                "tensor {tensor}: {file} is not a file name in the folder"
            ))
        })?;
        weight_map.insert(tensor.clone(), file.to_string());
    }
    let files: BTreeSet<&String> = weight_map.values().collect();
    let files = files.into_iter().map(|f| dir.join(f)).collect();
    Ok((files, Some((index_path, weight_map))))
}

/// The name a `LlamaForCausalLM` gives the tensor `name` of a file (a `LlamaModel` saves its
/// tensors without the `model.` prefix).
fn canonical(name: &str) -> String {
    if name.starts_with("model.") || name == "lm_head.weight" {
        name.to_string()
    } else {
        format!("model.{name}")
    }
}

/// Why the tensor `hf` (a transformers name) is not one of a model of shape `c`.
fn unknown_tensor(hf: &str, c: &LlamaConfig) -> String {
    let rest = hf.strip_prefix("model.layers.");
    let layer = (rest.and_then(|r| r.split_once('.'))).and_then(|(l, _)| l.parse::<usize>().ok());
    let expert = (rest.and_then(|r| r.split_once(".block_sparse_moe.experts.")))
        .and_then(|(_, e)| e.split_once('.'))
        .and_then(|(e, _)| e.parse::<usize>().ok());
    match (layer, expert, c.moe) {
        (Some(l), _, _) if l >= c.layers => {
            format!("config.json has {} layers (num_hidden_layers)", c.layers)
        }
        (_, Some(e), Some(m)) if e >= m.experts => {
            format!("config.json has {} experts (num_local_experts)", m.experts)
        }
        _ if hf.contains(".mlp.experts.") || hf.contains(".mlp.gate.") => {
            "transformers 5's stacked experts are not read: save the model with \
             save_pretrained's default save_original_format = True (one tensor per expert, \
             block_sparse_moe.experts.{e}.w1/w2/w3)"
                .into()
        }
        _ => format!(
            "not a tensor of {} (biases are not supported)",
            architecture(c)
        ),
    }
}

/// What the weight files of a model gave so far.
#[derive(Default)]
struct Loaded {
    /// The parameters read, by merak name.
    params: FullParams,
    /// The file of every tensor read, by transformers name.
    found: HashMap<String, PathBuf>,
    /// A tied model's `lm_head.weight`, when saved: (file, values), compared with the table.
    tied_head: Option<(PathBuf, Vec<f32>)>,
    /// The rotary frequency buffers skipped.
    buffers: usize,
}

/// What a model's weight files must hold: the model's tensors by transformers name, and its
/// sizes for messages.
struct Expected<'a> {
    /// The model's config.
    config: &'a LlamaConfig,
    /// Its tensors, by transformers name.
    by_name: HashMap<&'a str, &'a Spec>,
    /// Its sizes ([`describe`]).
    model: String,
}

/// Refuses tensor `name` of the weight file `path` of folder `dir` when `index` (if the model
/// has one) does not list it in that file.
fn check_listed(
    name: &str,
    path: &Path,
    dir: &Path,
    index: Option<&Index>,
) -> Result<(), HfLlamaError> {
    let Some((index_path, map)) = index else {
        return Ok(());
    };
    let listed = map.get(name).map(|f| dir.join(f));
    if listed.as_deref() == Some(path) {
        return Ok(());
    }
    let reason = match listed {
        Some(other) => format!("{} puts it in {}", index_path.display(), other.display()),
        None => format!("not listed in {}", index_path.display()),
    };
    Err(HfLlamaError::Unexpected {
        path: path.to_path_buf(),
        tensor: name.into(),
        reason,
    })
}

/// Reads the weight file `path` of folder `dir` (listed in `index`, if the model has one)
/// into `loaded`, refusing a tensor that is unlisted, held twice, unknown or misshapen.
fn read_weight_file(
    path: &Path,
    dir: &Path,
    index: Option<&Index>,
    expected: &Expected<'_>,
    loaded: &mut Loaded,
) -> Result<(), HfLlamaError> {
    let config = expected.config;
    let bytes = hf_files::read_weights(path)?;
    let unexpected = |tensor: &str, reason: String| HfLlamaError::Unexpected {
        path: path.to_path_buf(),
        tensor: tensor.into(),
        reason,
    };
    let misshapen =
        |name: String, file: Vec<usize>, expected_shape: Vec<usize>| HfLlamaError::Shape {
            path: path.to_path_buf(),
            tensor: name,
            file,
            expected: expected_shape,
            model: expected.model.clone(),
        };
    let hd = config.head_dim();
    for (name, view) in hf_files::tensor_views(&bytes, path)? {
        let hf = canonical(&name);
        if hf.ends_with("rotary_emb.inv_freq") {
            loaded.buffers += 1;
            continue;
        }
        check_listed(&name, path, dir, index)?;
        if let Some(first) = loaded.found.get(&hf) {
            return Err(unexpected(
                &name,
                format!("{} holds it too: the same tensor twice", first.display()),
            ));
        }
        let shape = view.shape().to_vec();
        if hf == "lm_head.weight" && config.tie_embeddings {
            let want = vec![config.vocab, config.hidden];
            if shape != want {
                return Err(misshapen(name, shape, want));
            }
            let values = hf_files::finite_f32(&view, path, &name)?;
            loaded.tied_head = Some((path.to_path_buf(), values));
            loaded.found.insert(hf, path.to_path_buf());
            continue;
        }
        let Some(spec) = expected.by_name.get(hf.as_str()) else {
            return Err(unexpected(&name, unknown_tensor(&hf, config)));
        };
        if shape != spec.shape {
            return Err(misshapen(name, shape, spec.shape.clone()));
        }
        let values = hf_files::finite_f32(&view, path, &name)?;
        place(
            &mut loaded.params,
            spec,
            to_ours(spec.layout, &shape, values, hd),
        );
        loaded.found.insert(hf, path.to_path_buf());
    }
    Ok(())
}

/// Refuses weight files (`files` of folder `dir`, listed in `index` if the model has one)
/// that lack a tensor of the model (`specs`, sizes `model`) or one the index lists.
fn check_complete(
    specs: &[Spec],
    found: &HashMap<String, PathBuf>,
    dir: &Path,
    files: &[PathBuf],
    index: Option<&Index>,
    model: &str,
) -> Result<(), HfLlamaError> {
    let file_of = |hf: &str| match index {
        Some((index_path, map)) => map
            .get(hf)
            .map_or_else(|| index_path.clone(), |f| dir.join(f)),
        None => files[0].clone(),
    };
    for spec in specs {
        if !found.contains_key(&spec.hf) {
            return Err(HfLlamaError::Missing {
                path: file_of(&spec.hf),
                tensor: spec.hf.clone(),
                model: model.into(),
            });
        }
    }
    if let Some((_, map)) = index
        && let Some((tensor, file)) = map
            .iter()
            .find(|(t, _)| !found.contains_key(&canonical(t)) && !t.ends_with("inv_freq"))
    {
        return Err(HfLlamaError::Missing {
            path: dir.join(file),
            tensor: tensor.clone(),
            model: format!("{INDEX_FILE} lists it there"),
        });
    }
    Ok(())
}

/// Reads the Hugging Face `LlamaForCausalLM` or `MixtralForCausalLM` in folder `dir`: its
/// config and every parameter at full size by merak name, converted to merak's layouts and to
/// f32. A Mixtral is read as transformers' `save_pretrained` writes it by default: every
/// expert's `w1`, `w2` and `w3` and every block's router (`block_sparse_moe.gate`), by the
/// names and in the layouts of transformers 4.
pub fn read_hf_llama(dir: &Path) -> Result<HfLlama, HfLlamaError> {
    let config_path = dir.join(CONFIG_FILE);
    let json = hf_files::read_json(&config_path, hf_files::MAX_CONFIG_BYTES)?;
    let (config, extras) = config_from_hf(&json, &config_path)?;
    let (files, index) = weight_files(dir)?;
    let specs = specs(&config);
    let expected = Expected {
        config: &config,
        by_name: specs.iter().map(|s| (s.hf.as_str(), s)).collect(),
        model: describe(&config),
    };
    let mut notes = extras.notes;
    let mut loaded = Loaded::default();
    for path in &files {
        read_weight_file(path, dir, index.as_ref(), &expected, &mut loaded)?;
    }
    let Loaded {
        params,
        found,
        tied_head,
        buffers,
    } = loaded;
    if buffers > 0 {
        notes.push(format!(
            "{buffers} rotary frequency buffers (rotary_emb.inv_freq) skipped: the model computes its own"
        ));
    }
    check_complete(&specs, &found, dir, &files, index.as_ref(), &expected.model)?;
    if let Some((path, head)) = tied_head {
        let table = &params["embed.tokens.weight"].1;
        if head != *table {
            return Err(HfLlamaError::Unexpected {
                path,
                tensor: "lm_head.weight".into(),
                reason: "differs from model.embed_tokens.weight, but config.json has \
                         tie_word_embeddings = true"
                    .into(),
            });
        }
        notes.push("lm_head.weight equals the token table (tied): not loaded twice".into());
    }
    Ok(HfLlama {
        config,
        params,
        notes,
        sliding_window: extras.sliding_window,
    })
}

/// Writes `bytes` to `path` through a temporary file in the same folder, renamed into place.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HfLlamaError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(written.map_err(HfFileError::io(path))?)
}

/// Whether `name` is a shard file name of `save_pretrained` (`model-00001-of-00003.safetensors`).
fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    rest.split_once("-of-")
        .is_some_and(|(a, b)| digits(a) && digits(b))
}

/// Refuses a `dir` that holds a file of a Hugging Face model (`config.json`, weights, an
/// index): writing there would overwrite it, or leave weights that loaders read with ours.
fn refuse_a_model_folder(dir: &Path) -> Result<(), HfFileError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        // Absent (it is made), or not a folder (making it fails, naming it).
        return Ok(());
    };
    let mut taken: Vec<String> = (entries.flatten())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            [CONFIG_FILE, SINGLE_FILE, INDEX_FILE].contains(&n.as_str()) || is_shard_name(n)
        })
        .collect();
    taken.sort();
    match taken.first() {
        Some(name) => Err(HfFileError::format(
            &dir.join(name),
            "already there: export into a new or empty folder (nothing was written)",
        )),
        None => Ok(()),
    }
}

/// The transformers tensors of the model of shape `cfg` from its parameters `params` (full
/// size, by merak name), in module order; a missing, misshapen or unknown parameter is
/// refused.
fn hf_tensors(cfg: &LlamaConfig, params: &FullParams) -> Result<Vec<NamedTensor>, HfLlamaError> {
    let specs = specs(cfg);
    let hd = cfg.head_dim();
    let mut tensors: Vec<NamedTensor> = Vec::with_capacity(specs.len());
    for spec in &specs {
        let missing = || HfLlamaError::Params {
            name: spec.merak.clone(),
            reason: format!("missing (the model has {})", describe(cfg)),
        };
        let (shape, values) = params.get(&spec.merak).ok_or_else(missing)?;
        let ours = spec.ours();
        if *shape != ours || values.len() != ours.iter().product::<usize>() {
            return Err(HfLlamaError::Params {
                name: spec.merak.clone(),
                reason: format!(
                    "shape {shape:?} with {} values, the model ({}) has {ours:?}",
                    values.len(),
                    describe(cfg)
                ),
            });
        }
        tensors.push(NamedTensor {
            name: spec.hf.clone(),
            shape: spec.shape.clone(),
            values: to_hf(spec.layout, &ours, values, hd),
        });
    }
    let known: BTreeSet<&str> = specs.iter().map(|s| s.merak.as_str()).collect();
    if let Some(name) = params.keys().filter(|k| !known.contains(k.as_str())).min() {
        return Err(HfLlamaError::Params {
            name: name.clone(),
            reason: format!("not a parameter of the model ({})", describe(cfg)),
        });
    }
    Ok(tensors)
}

/// The bytes of tensor `t` in a file (f32).
fn tensor_bytes(t: &NamedTensor) -> u64 {
    4 * t.values.len() as u64
}

/// The files of `tensors`, in module order: runs of at most `max_shard_bytes` of tensor data
/// (a larger tensor alone), or one run of all without a limit.
fn shard_groups(
    tensors: &[NamedTensor],
    max_shard_bytes: Option<u64>,
) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut bytes_in_last = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let n = tensor_bytes(t);
        match (groups.last_mut(), max_shard_bytes) {
            (Some(last), Some(max)) if bytes_in_last.saturating_add(n) <= max => {
                last.end = i + 1;
                bytes_in_last += n;
            }
            (Some(last), None) => last.end = i + 1,
            _ => {
                groups.push(i..i + 1);
                bytes_in_last = n;
            }
        }
    }
    groups
}

/// Writes the model of shape `cfg` with parameters `params` (full size, by merak name, as
/// [`read_hf_llama`] returns them or a checkpoint holds them) into folder `dir` as a
/// `LlamaForCausalLM`, or a `MixtralForCausalLM` when `cfg` has a mixture of experts (its
/// experts' tensors by transformers 4's names, as `save_pretrained` writes them):
/// `config.json` and `model.safetensors` in f32, or, with
/// `max_shard_bytes`, files `model-0000i-of-0000n.safetensors` of at most that many bytes of
/// tensor data each (a larger tensor gets a file of its own) and `model.safetensors.index.json`.
/// A `dir` that already holds a model's files (`config.json`, weights or an index) is
/// refused, naming the file, before anything is written: an export never overwrites or
/// removes files it did not write. Returns the files written.
pub fn write_hf_llama(
    dir: &Path,
    cfg: &LlamaConfig,
    params: &FullParams,
    max_shard_bytes: Option<u64>,
) -> Result<Vec<PathBuf>, HfLlamaError> {
    cfg.validate()?;
    let tensors = hf_tensors(cfg, params)?;
    let groups = shard_groups(&tensors, max_shard_bytes);
    refuse_a_model_folder(dir)?;
    std::fs::create_dir_all(dir).map_err(HfFileError::io(dir))?;
    let sharded = max_shard_bytes.is_some();
    let count = groups.len();
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, group) in groups.iter().enumerate() {
        let name = if sharded {
            format!("model-{:05}-of-{count:05}.safetensors", k + 1)
        } else {
            SINGLE_FILE.to_string()
        };
        let path = dir.join(&name);
        let part = &tensors[group.clone()];
        weight_map.extend(part.iter().map(|t| (t.name.clone(), name.clone())));
        let encoded = hf_files::encode(part)
            .map_err(|e| HfFileError::format(&path, format!("encoding: {e}")))?;
        write_atomically(&path, &encoded)?;
        written.push(path);
    }
    if sharded {
        let total: u64 = tensors.iter().map(tensor_bytes).sum();
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_vec_pretty(&index)
            .map_err(|e| HfFileError::format(&path, e.to_string()))?;
        write_atomically(&path, &text)?;
        written.push(path);
    }
    let config_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_vec_pretty(&hf_config_json(cfg))
        .map_err(|e| HfFileError::format(&config_path, e.to_string()))?;
    write_atomically(&config_path, &text)?;
    written.push(config_path);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotary_permutation_is_a_permutation_and_export_inverts_import() {
        for hd in [2, 4, 8, 16] {
            let mut seen: Vec<usize> = (0..3 * hd).map(|o| rotary_source(o, hd)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..3 * hd).collect::<Vec<_>>());
        }
        // Head width 4: ours [0, 1, 2, 3] are theirs [0, 2, 1, 3].
        assert_eq!(
            (0..8).map(|o| rotary_source(o, 4)).collect::<Vec<_>>(),
            [0, 2, 1, 3, 4, 6, 5, 7]
        );
        let hf: Vec<f32> = (0..8 * 3).map(|i| i as f32).collect();
        for layout in [Layout::Same, Layout::Transposed, Layout::Rotary] {
            let (shape, ours) = to_ours(layout, &[8, 3], hf.clone(), 4);
            assert_eq!(to_hf(layout, &shape, &ours, 4), hf, "{layout:?}");
        }
        let (shape, ours) = to_ours(Layout::Transposed, &[8, 3], hf.clone(), 4);
        assert_eq!(shape, [3, 8]);
        // ours[i][o] = hf[o][i]
        assert_eq!(ours[8 + 2], hf[2 * 3 + 1]);
    }

    #[test]
    fn an_experts_gate_and_up_fill_the_halves_of_its_input_projection() {
        // w1 and w3 are [ffn = 2, hidden = 3]; ours is [3, 4], the gate's columns first.
        let w1: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let w3: Vec<f32> = (0..6).map(|i| 10.0 + i as f32).collect();
        let spec = |layout| Spec {
            hf: String::new(),
            merak: "w_in".into(),
            shape: vec![2, 3],
            layout,
        };
        let mut params = FullParams::new();
        for (layout, v) in [(Layout::Up, &w3), (Layout::Gate, &w1)] {
            place(
                &mut params,
                &spec(layout),
                to_ours(layout, &[2, 3], v.clone(), 1),
            );
        }
        let (shape, ours) = &params["w_in"];
        assert_eq!(
            (shape.clone(), spec(Layout::Up).ours()),
            (vec![3, 4], vec![3, 4])
        );
        // Row i: w1[0][i], w1[1][i], w3[0][i], w3[1][i].
        assert_eq!(ours[..4], [0.0, 3.0, 10.0, 13.0]);
        assert_eq!(ours[8..], [2.0, 5.0, 12.0, 15.0]);
        assert_eq!(to_hf(Layout::Gate, shape, ours, 1), w1);
        assert_eq!(to_hf(Layout::Up, shape, ours, 1), w3);
    }

    #[test]
    fn shard_names_are_recognized() {
        assert!(is_shard_name("model-00001-of-00003.safetensors"));
        assert!(!is_shard_name("model-1-of-3.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!plain_name("../x.safetensors"));
        assert!(!plain_name("a/b"));
        assert!(plain_name("model-00001-of-00002.safetensors"));
    }
}
