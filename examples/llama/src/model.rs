//! The model: nothing in it knows about parallelism but the type of its linear layers (and
//! which key/value heads a rank's query heads use, when tensor parallelism shares them).

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::parallelize::{EmbedUnit, HeadUnit, LayerUnit, Linear, TpPlan, TpStyle};
use merak_burn::tensor_parallel::{ParallelBackend, SPLIT_CONTAINER};
use thiserror::Error;

pub use merak_burn::session::FullParams;

/// Llama 3's rotary frequency adjustment (transformers' `rope_type = "llama3"`): frequencies
/// whose wavelength is longer than `original_max_position_embeddings / low_freq_factor` are
/// divided by `factor`, those shorter than `original_max_position_embeddings /
/// high_freq_factor` kept, and those between interpolated smoothly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    /// The division of the low frequencies (8 in Llama 3.1).
    pub factor: f64,
    /// 1 in Llama 3.1.
    pub low_freq_factor: f64,
    /// 4 in Llama 3.1.
    pub high_freq_factor: f64,
    /// The context length of pretraining (8192 in Llama 3.1).
    pub original_max_position_embeddings: usize,
}

/// The shape of a Llama-style decoder.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Width of the hidden states.
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads, a divisor of `heads` (grouped-query attention: each key/value head
    /// serves `heads / kv_heads` consecutive query heads); `heads` for multi-head attention.
    pub kv_heads: usize,
    /// Width of the SwiGLU MLP.
    pub ffn: usize,
    /// Longest sequence (the rotary table's length).
    pub max_seq: usize,
    /// The base of the rotary frequencies.
    pub rope_theta: f64,
    /// Llama 3's adjustment of the rotary frequencies, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// The epsilon of the RMS norms.
    pub rms_norm_eps: f64,
    /// Project onto the vocabulary with the token embedding's table (no output layer).
    pub tie_embeddings: bool,
}

/// A [`LlamaConfig`] that describes no model.
#[derive(Clone, Debug, Error, PartialEq)]
#[error("Llama config: {0}")]
pub struct InvalidConfig(pub String);

impl LlamaConfig {
    /// A tiny decoder for CPUs and tests: 4 blocks, hidden 64, 4 heads, vocabulary 256.
    pub fn tiny() -> Self {
        Self {
            vocab: 256,
            layers: 4,
            hidden: 64,
            heads: 4,
            kv_heads: 4,
            ffn: 128,
            max_seq: 64,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_embeddings: false,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Checks that the sizes fit together: every size positive, `heads` dividing `hidden`
    /// into heads of even width, `kv_heads` dividing `heads`, positive finite rotary base and
    /// norm epsilon, and a rotary scaling whose high-frequency factor exceeds its
    /// low-frequency one.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |m: String| Err(InvalidConfig(m));
        for (name, v) in [
            ("vocab", self.vocab),
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("max_seq", self.max_seq),
        ] {
            if v == 0 {
                return bad(format!("{name} = 0"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(format!(
                "hidden = {} is not a multiple of heads = {}",
                self.hidden, self.heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "the heads are {} wide (hidden / heads); rotary position embedding needs an even width",
                self.head_dim()
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "kv_heads = {} does not divide heads = {}",
                self.kv_heads, self.heads
            ));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.rope_theta) {
            return bad(format!(
                "rope_theta = {} (must be positive)",
                self.rope_theta
            ));
        }
        if !positive(self.rms_norm_eps) {
            return bad(format!(
                "rms_norm_eps = {} (must be positive)",
                self.rms_norm_eps
            ));
        }
        if let Some(s) = self.rope_scaling {
            if !positive(s.factor) || !positive(s.low_freq_factor) {
                return bad(format!(
                    "rope scaling factor = {}, low_freq_factor = {} (must be positive)",
                    s.factor, s.low_freq_factor
                ));
            }
            if !(s.high_freq_factor.is_finite() && s.high_freq_factor > s.low_freq_factor) {
                return bad(format!(
                    "rope scaling high_freq_factor = {} must exceed low_freq_factor = {}",
                    s.high_freq_factor, s.low_freq_factor
                ));
            }
            if s.original_max_position_embeddings == 0 {
                return bad("rope scaling original_max_position_embeddings = 0".into());
            }
        }
        Ok(())
    }

    /// Every parameter of the model at full size, by merak name, in module order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd) = (self.hidden, self.head_dim());
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut shapes = vec![("embed.tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let blocks = [
                ("attn_norm.gamma", vec![h]),
                ("attn.wq.linear.weight", vec![h, q]),
                ("attn.wk.linear.weight", vec![h, kv]),
                ("attn.wv.linear.weight", vec![h, kv]),
                ("attn.wo.linear.weight", vec![q, h]),
                ("mlp_norm.gamma", vec![h]),
                ("mlp.w1.linear.weight", vec![h, self.ffn]),
                ("mlp.w2.linear.weight", vec![self.ffn, h]),
                ("mlp.w3.linear.weight", vec![h, self.ffn]),
            ];
            shapes.extend(blocks.map(|(n, s)| (format!("layers.{l}.{n}"), s)));
        }
        shapes.push(("head.norm.gamma".into(), vec![h]));
        if !self.tie_embeddings {
            shapes.push(("head.output.linear.weight".into(), vec![h, self.vocab]));
        }
        shapes
    }

    /// The rotary frequencies of one head (`head_dim / 2` of them), computed in f32 as
    /// transformers computes them (`_compute_default_rope_parameters`, and
    /// `_compute_llama3_parameters` with [`rope_scaling`](Self::rope_scaling)).
    pub fn rope_frequencies(&self) -> Vec<f32> {
        let dim = self.head_dim();
        let base = self.rope_theta as f32;
        let inv = (0..dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / dim as f32));
        let Some(s) = self.rope_scaling else {
            return inv.collect();
        };
        let old = s.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (
            (old / s.low_freq_factor) as f32,
            (old / s.high_freq_factor) as f32,
        );
        let (factor, low, high) = (
            s.factor as f32,
            s.low_freq_factor as f32,
            s.high_freq_factor as f32,
        );
        let two_pi = std::f64::consts::TAU as f32;
        inv.map(|f| {
            // torch's `scalar / tensor` is `tensor.reciprocal() * scalar`.
            let wavelen = f.recip() * two_pi;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            if wavelen < high_wavelen || wavelen > low_wavelen {
                return scaled;
            }
            let smooth = (wavelen.recip() * old as f32 - low) / (high - low);
            (1.0 - smooth) * scaled / factor + smooth * scaled
        })
        .collect()
    }
}

/// Token embedding.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    /// The table, `[vocab, hidden]`.
    pub tokens: Embedding<B>,
}

/// Causal self-attention with rotary position embedding and grouped key/value heads.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection.
    pub wq: Linear<B>,
    /// Key projection.
    pub wk: Linear<B>,
    /// Value projection.
    pub wv: Linear<B>,
    /// Output projection.
    pub wo: Linear<B>,
    /// Rotary position embedding over one head. Its features rotate in interleaved pairs
    /// (`2i`, `2i + 1`), where transformers rotates the halves (`i`, `i + head_dim / 2`):
    /// the import and export of Hugging Face weights permute the query and key projections'
    /// output features accordingly.
    pub rope: RotaryEncoding<B>,
    /// Width of one head.
    #[module(skip)]
    head_dim: usize,
    /// Query heads of the whole model.
    #[module(skip)]
    heads: usize,
    /// Key/value heads of the whole model.
    #[module(skip)]
    kv_heads: usize,
}

/// The SwiGLU MLP: `w2(silu(w1 x) * w3 x)`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection.
    pub w1: Linear<B>,
    /// Down projection.
    pub w2: Linear<B>,
    /// Up projection.
    pub w3: Linear<B>,
}

/// A pre-norm decoder block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub attn_norm: RmsNorm<B>,
    /// Attention.
    pub attn: Attention<B>,
    /// Norm before the MLP.
    pub mlp_norm: RmsNorm<B>,
    /// MLP.
    pub mlp: Mlp<B>,
}

/// Final norm, output projection and the next-token loss.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    /// The final norm.
    pub norm: RmsNorm<B>,
    /// Hidden states to logits; `None` when tied to the token embedding.
    pub output: Option<Linear<B>>,
}

/// The whole decoder.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// Token embedding.
    pub embed: Embed<B>,
    /// Decoder blocks.
    pub blocks: Vec<Block<B>>,
    /// Norm, output and loss.
    pub head: Head<B>,
}

/// The rotary position embedding of `c`, one table shared by every block: Burn's own
/// frequencies without a rotary scaling (those of transformers up to rounding), else
/// [`LlamaConfig::rope_frequencies`].
fn rotary<B: Backend>(c: &LlamaConfig, device: &B::Device) -> RotaryEncoding<B> {
    let config = RotaryEncodingConfig::new(c.max_seq, c.head_dim()).with_theta(c.rope_theta as f32);
    if c.rope_scaling.is_none() {
        return config.init(device);
    }
    let freqs = c.rope_frequencies();
    let n = freqs.len();
    config.init_with_frequency_scaling(
        move |theta: Tensor<B, 1>| {
            Tensor::from_data(TensorData::new(freqs.clone(), [n]), &theta.device())
        },
        device,
    )
}

/// A linear layer without bias, `[i, o]`.
fn linear<B: Backend>(i: usize, o: usize, device: &B::Device) -> Linear<B> {
    Linear::from(LinearConfig::new(i, o).with_bias(false).init(device))
}

/// An RMS norm over the hidden states of `c`.
fn norm<B: Backend>(c: &LlamaConfig, device: &B::Device) -> RmsNorm<B> {
    RmsNormConfig::new(c.hidden)
        .with_epsilon(c.rms_norm_eps)
        .init(device)
}

/// Panics with the problem of an invalid `c`.
fn check(c: &LlamaConfig) {
    if let Err(e) = c.validate() {
        panic!("{e}");
    }
}

impl<B: Backend> Embed<B> {
    /// The token embedding of a decoder of shape `c` (Burn's initializer, drawing from the
    /// backend's random generator on first use).
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        Self {
            tokens: EmbeddingConfig::new(c.vocab, c.hidden).init(device),
        }
    }
}

impl<B: Backend> Block<B> {
    /// A decoder block of shape `c` with its own rotary table (`max_seq x head_dim x 2`
    /// floats: keep `max_seq` to the sequences trained on).
    ///
    /// # Panics
    ///
    /// If `c` is not valid ([`LlamaConfig::validate`]).
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        check(c);
        Self::with_rope(c, rotary(c, device), device)
    }

    /// A decoder block of shape `c` using `rope`.
    fn with_rope(c: &LlamaConfig, rope: RotaryEncoding<B>, device: &B::Device) -> Self {
        let head_dim = c.head_dim();
        let kv = c.kv_heads * head_dim;
        Self {
            attn_norm: norm(c, device),
            attn: Attention {
                wq: linear(c.hidden, c.hidden, device),
                wk: linear(c.hidden, kv, device),
                wv: linear(c.hidden, kv, device),
                wo: linear(c.hidden, c.hidden, device),
                rope,
                head_dim,
                heads: c.heads,
                kv_heads: c.kv_heads,
            },
            mlp_norm: norm(c, device),
            mlp: Mlp {
                w1: linear(c.hidden, c.ffn, device),
                w2: linear(c.ffn, c.hidden, device),
                w3: linear(c.hidden, c.ffn, device),
            },
        }
    }
}

impl<B: Backend> Head<B> {
    /// The final norm and, unless tied, the output layer of a decoder of shape `c`.
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        Self {
            norm: norm(c, device),
            output: (!c.tie_embeddings).then(|| linear(c.hidden, c.vocab, device)),
        }
    }
}

impl<B: Backend> Llama<B> {
    /// A decoder of shape `c` initialized by Burn's default initializers from the backend's
    /// random generator (seed it with `B::seed` first for the same weights on every rank).
    /// Its blocks share one rotary table.
    ///
    /// # Panics
    ///
    /// If `c` is not valid ([`LlamaConfig::validate`]).
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        check(c);
        let rope = rotary::<B>(c, device);
        Self {
            embed: Embed::new(c, device),
            blocks: (0..c.layers)
                .map(|_| Block::with_rope(c, rope.clone(), device))
                .collect(),
            head: Head::new(c, device),
        }
    }

    /// A decoder of shape `c` holding `params` (full size, by merak name, e.g. from
    /// [`read_hf_llama`](crate::read_hf_llama) or a checkpoint).
    pub fn from_full_params(
        c: &LlamaConfig,
        params: &FullParams,
        device: &B::Device,
    ) -> Result<Self, ParamsError> {
        c.validate().map_err(ParamsError::Config)?;
        Self::new(c, device).load_full_params(params)
    }

    /// This model with its parameters replaced by `params` (full size, by merak name): every
    /// parameter must be there with its shape, and nothing else.
    pub fn load_full_params(self, params: &FullParams) -> Result<Self, ParamsError> {
        let mut load = Load {
            path: Vec::new(),
            params,
            seen: HashSet::new(),
            error: None,
        };
        let model = self.map(&mut load);
        if let Some(e) = load.error {
            return Err(e);
        }
        let mut extra: Vec<&String> = (params.keys())
            .filter(|k| !load.seen.contains(*k))
            .collect();
        extra.sort();
        match extra.first() {
            Some(name) => Err(ParamsError::Unexpected {
                name: (*name).clone(),
            }),
            None => Ok(model),
        }
    }

    /// Every parameter at full size by merak name (of an unsplit model).
    pub fn full_params(&self) -> FullParams {
        let mut collect = Collect {
            path: Vec::new(),
            params: FullParams::new(),
        };
        self.visit(&mut collect);
        collect.params
    }
}

/// A parameter set that does not fit the model.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ParamsError {
    /// The model's config is not valid.
    #[error(transparent)]
    Config(InvalidConfig),
    /// A parameter of the model has no values.
    #[error("parameter {name} is missing")]
    Missing {
        /// Its merak name.
        name: String,
    },
    /// Values for a parameter the model does not have.
    #[error("parameter {name} is not a parameter of the model")]
    Unexpected {
        /// Its name.
        name: String,
    },
    /// Values of another shape than the model's parameter.
    #[error("parameter {name} has shape {given:?} ({values} values), the model's is {model:?}")]
    Shape {
        /// Its merak name.
        name: String,
        /// The shape given.
        given: Vec<usize>,
        /// The number of values given.
        values: usize,
        /// The model's shape.
        model: Vec<usize>,
    },
}

/// The merak name of the parameter at module path `path` of a [`Llama`] (its blocks are the
/// pipeline's `layers`).
fn merak_name(path: &[String]) -> String {
    match path.split_first() {
        Some((first, rest)) if first == "blocks" => std::iter::once("layers")
            .chain(rest.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("."),
        _ => path.join("."),
    }
}

/// The mapper behind [`Llama::load_full_params`].
struct Load<'a> {
    path: Vec<String>,
    params: &'a FullParams,
    seen: HashSet<String>,
    error: Option<ParamsError>,
}

impl<B: Backend> ModuleMapper<B> for Load<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.pop();
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        let name = merak_name(&self.path);
        let Some((shape, values)) = self.params.get(&name) else {
            self.error = Some(ParamsError::Missing { name });
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims().to_vec();
        if *shape != dims || values.len() != dims.iter().product::<usize>() {
            self.error = Some(ParamsError::Shape {
                name,
                given: shape.clone(),
                values: values.len(),
                model: dims,
            });
            return Param::from_mapped_value(id, tensor, mapper);
        }
        self.seen.insert(name);
        let mut fresh = Tensor::<B, D>::from_data(
            TensorData::new(values.clone(), tensor.shape()),
            &tensor.device(),
        );
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// The visitor behind [`Llama::full_params`].
struct Collect {
    path: Vec<String>,
    params: FullParams,
}

impl<B: Backend> ModuleVisitor<B> for Collect {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.pop();
        }
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let shape = t.dims().to_vec();
        let values = t
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default();
        self.params.insert(merak_name(&self.path), (shape, values));
    }
}

/// Which linear layers tensor parallelism splits: Megatron's pairs, column then row. With
/// grouped-query attention this suits TP degrees that divide `kv_heads`; [`tp_plan_of`] suits
/// every degree.
pub fn tp_plan() -> TpPlan {
    TpPlan::new([
        ("attn.wq", TpStyle::Column),
        ("attn.wk", TpStyle::Column),
        ("attn.wv", TpStyle::Column),
        ("attn.wo", TpStyle::Row),
        ("mlp.w1", TpStyle::Column),
        ("mlp.w3", TpStyle::Column),
        ("mlp.w2", TpStyle::Row),
    ])
}

/// A TP degree the model's heads cannot be split over.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TpLayoutError {
    /// The query heads do not split evenly.
    #[error("tp = {tp} does not divide the {heads} attention heads")]
    Heads {
        /// The TP degree.
        tp: usize,
        /// The model's query heads.
        heads: usize,
    },
    /// Neither divides the other.
    #[error(
        "tp = {tp} and kv_heads = {kv_heads}: tensor parallelism needs tp to divide kv_heads \
         (each rank holds its own key/value heads) or to be a multiple of it (the ranks \
         share each key/value head)"
    )]
    KvHeads {
        /// The TP degree.
        tp: usize,
        /// The model's key/value heads.
        kv_heads: usize,
    },
}

/// The TP plan of a decoder of shape `c`, for any TP degree: [`tp_plan`] with multi-head
/// attention; with grouped-query attention (`kv_heads < heads`) its key and value projections
/// are [`TpStyle::KvHeads`]: split by column when the degree divides `kv_heads`, shared when it
/// is a multiple of `kv_heads` (whole on every rank, each rank using the key/value head of its
/// query heads, the gradients summed over the group). Checkpoints hold full-size tensors
/// either way. [`tp_plan_for`] checks a degree first.
pub fn tp_plan_of(c: &LlamaConfig) -> TpPlan {
    let mut plan = tp_plan();
    if c.kv_heads != c.heads {
        for (pattern, style) in &mut plan.rules {
            if pattern == "attn.wk" || pattern == "attn.wv" {
                *style = TpStyle::KvHeads { heads: c.kv_heads };
            }
        }
    }
    plan
}

/// [`tp_plan_of`] for `tp` ranks, once `tp` is known to split the heads: it must divide
/// `heads`, and divide `kv_heads` or be a multiple of it.
pub fn tp_plan_for(c: &LlamaConfig, tp: usize) -> Result<TpPlan, TpLayoutError> {
    if tp == 0 || !c.heads.is_multiple_of(tp) {
        return Err(TpLayoutError::Heads { tp, heads: c.heads });
    }
    if !c.kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(c.kv_heads) {
        return Err(TpLayoutError::KvHeads {
            tp,
            kv_heads: c.kv_heads,
        });
    }
    Ok(tp_plan_of(c))
}

impl<B: ParallelBackend> Attention<B> {
    /// `[batch, seq, hidden]` to `[batch, seq, hidden]`. The number of heads comes from the
    /// width of the projections, so a tensor-parallel rank runs its share of the heads.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let split = |t: Tensor<B, 3>| {
            let width = t.dims()[2];
            assert!(
                width >= self.head_dim && width.is_multiple_of(self.head_dim),
                "{width} features per rank are not whole heads of {}: tensor parallelism must \
                 divide the {} attention heads",
                self.head_dim,
                self.heads
            );
            t.reshape([b, s, width / self.head_dim, self.head_dim])
                .swap_dims(1, 2)
        };
        let q = self.rope.forward(split(self.wq.forward(x.clone())));
        let local = q.dims()[1];
        let k = self
            .rope
            .forward(self.own_kv(split(self.wk.forward(x.clone())), local));
        let v = self.own_kv(split(self.wv.forward(x)), local);
        let group = local / k.dims()[1];
        let (k, v) = (repeat_heads(k, group), repeat_heads(v, group));
        let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f64).sqrt();
        let mask = generate_autoregressive_mask::<B>(b, s, &scores.device()).unsqueeze_dim(1);
        let weights = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        let ctx = weights.matmul(v).swap_dims(1, 2);
        let width = ctx.dims()[2] * self.head_dim;
        self.wo.forward(ctx.reshape([b, s, width]))
    }

    /// The key/value heads (`[batch, kv, seq, head_dim]`) that this rank's `local` query
    /// heads use: all of `t` unless the projections are shared ([`TpStyle::Shared`], from
    /// [`TpStyle::KvHeads`]) and computed every key/value head, of which this rank takes
    /// those of its query heads.
    fn own_kv(&self, t: Tensor<B, 4>, local: usize) -> Tensor<B, 4> {
        let per_kv = self.heads / self.kv_heads;
        let needed = (local / per_kv).max(1);
        let have = t.dims()[1];
        if have == needed {
            return t;
        }
        let rank = self.wk.split.group().map_or(0, |g| g.rank());
        t.narrow(1, rank * local / per_kv, needed)
    }
}

/// Each of the `[batch, kv, seq, d]` heads repeated `times` times in place (head `g` serves
/// query heads `g * times..(g + 1) * times`), as transformers' `repeat_kv`.
fn repeat_heads<B: Backend>(t: Tensor<B, 4>, times: usize) -> Tensor<B, 4> {
    if times == 1 {
        return t;
    }
    let [b, kv, s, d] = t.dims();
    t.unsqueeze_dim::<5>(2)
        .repeat_dim(2, times)
        .reshape([b, kv * times, s, d])
}

impl<B: ParallelBackend> EmbedUnit<B> for Embed<B> {
    fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.tokens.forward(tokens)
    }

    fn table(&self) -> Option<(&Param<Tensor<B, 2>>, &'static str)> {
        Some((&self.tokens.weight, "tokens.weight"))
    }
}

impl<B: ParallelBackend> LayerUnit<B> for Block<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(self.attn_norm.forward(x));
        let h = self.mlp_norm.forward(x.clone());
        let m = &self.mlp;
        x + m
            .w2
            .forward(silu(m.w1.forward(h.clone())) * m.w3.forward(h))
    }
}

impl<B: ParallelBackend> Head<B> {
    /// Hidden states `[batch, seq, hidden]` to logits `[batch, seq, vocab]`: the final norm,
    /// then the output layer, or the token `table` (`[vocab, hidden]`) of a tied head.
    ///
    /// # Panics
    ///
    /// If the head has no output layer and no table is given.
    pub fn logits(&self, x: Tensor<B, 3>, table: Option<Tensor<B, 2>>) -> Tensor<B, 3> {
        let x = self.norm.forward(x);
        match (&self.output, table) {
            (Some(output), _) => output.forward(x),
            (None, Some(table)) => x.matmul(table.transpose().unsqueeze()),
            (None, None) => panic!("a tied head needs the token table"),
        }
    }

    /// Mean cross-entropy of `logits` (`[batch, seq, vocab]`) against `targets`.
    fn cross_entropy(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [b, s, vocab] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.reshape([b * s, vocab]), targets.reshape([b * s]))
    }
}

impl<B: ParallelBackend> HeadUnit<B> for Head<B> {
    fn loss(
        &self,
        x: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
        table: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 1> {
        Self::cross_entropy(self.logits(x, table), targets)
    }

    /// `[summed next-token loss, correct next tokens, tokens]` of the micro-batch.
    fn metrics(
        &self,
        x: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
        table: Option<Tensor<B, 2>>,
    ) -> Option<Tensor<B, 1>> {
        let logits = self.logits(x, table);
        let [b, s, _] = logits.dims();
        let tokens = (b * s) as f64;
        let loss = Self::cross_entropy(logits.clone(), targets.clone()) * tokens;
        let hits = logits
            .argmax(2)
            .squeeze_dim::<2>(2)
            .equal(targets)
            .int()
            .sum();
        let count = Tensor::<B, 1>::from_floats([tokens as f32], &loss.device());
        Some(Tensor::cat(vec![loss, hits.float(), count], 0))
    }

    /// The logits of the next token after each sequence, `[batch, vocab]`.
    fn predict(&self, x: Tensor<B, 3>, table: Option<Tensor<B, 2>>) -> Option<Tensor<B, 2>> {
        let [b, s, _] = x.dims();
        let last = x.slice([0..b, s - 1..s]);
        Some(self.logits(last, table).squeeze_dim::<2>(1))
    }
}

impl<B: ParallelBackend> Llama<B> {
    /// Token ids `[batch, seq]` to the logits of the next token at every position,
    /// `[batch, seq, vocab]` (one process, or a TP rank of a model split by its plan).
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let mut x = self.embed.embed(tokens);
        for block in &self.blocks {
            x = block.forward(x);
        }
        let table = self
            .head
            .output
            .is_none()
            .then(|| self.embed.tokens.weight.val());
        self.head.logits(x, table)
    }

    /// The `new_tokens` tokens greedy decoding appends to each prompt (`[batch, seq]` ids):
    /// `[batch, new_tokens]`. Each step runs the whole sequence (no cache).
    ///
    /// # Panics
    ///
    /// If the prompt and the new tokens are longer than the rotary table (`max_seq`).
    pub fn greedy(&self, prompt: Tensor<B, 2, Int>, new_tokens: usize) -> Tensor<B, 2, Int> {
        let [b, start] = prompt.dims();
        if let Some(block) = self.blocks.first() {
            let max_seq = block.attn.rope.freq_complex.dims()[0];
            assert!(
                start + new_tokens <= max_seq,
                "{start} prompt tokens and {new_tokens} new ones exceed max_seq = {max_seq}"
            );
        }
        let mut seq = prompt;
        for _ in 0..new_tokens {
            let logits = self.logits(seq.clone());
            let [_, s, vocab] = logits.dims();
            let next = logits
                .slice([0..b, s - 1..s, 0..vocab])
                .argmax(2)
                .reshape([b, 1]);
            seq = Tensor::cat(vec![seq, next], 1);
        }
        seq.slice([0..b, start..start + new_tokens])
    }
}
