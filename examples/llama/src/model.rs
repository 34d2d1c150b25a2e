//! The model: nothing in it knows about parallelism but the type of its linear layers, which
//! key/value heads a rank's query heads use (when tensor parallelism shares them), and, under
//! context parallelism, the share of each sequence its attention and rotary embedding run on
//! ([`ContextShare`]). A Mixtral's blocks hold merak-burn's mixture-of-experts layer in place
//! of the MLP.

use burn::module::{Module, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use merak_burn::moe::{ExpertInit, MoeLayer, MoePlace};
use merak_burn::prelude::*;
use merak_burn::rng::InitRng;

use crate::config::LlamaConfig;

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
    /// Under context parallelism: this rank's share of every sequence and the attention over
    /// the whole sequences (from the block's [`UnitPlace`]).
    #[module(skip)]
    context: Option<ContextShare>,
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
    /// Norm before the MLP (or the mixture of experts).
    pub mlp_norm: RmsNorm<B>,
    /// MLP (`None` in a mixture-of-experts block).
    pub mlp: Option<Mlp<B>>,
    /// The mixture of experts in place of the MLP ([`LlamaConfig::moe`]): its router is
    /// `moe.router` (`[hidden, experts]`), expert `e`'s gate and up projections are the
    /// columns of `moe.experts.{e}.w_in` (`[hidden, 2 ffn]`, the gate's first), its down
    /// projection `moe.experts.{e}.w_out` (`[ffn, hidden]`).
    pub moe: Option<MoeLayer<B>>,
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

/// A seed drawn from the backend's random generator (48 bits), so that what is drawn from it
/// follows the generator's seed as Burn's own initializers do.
fn drawn_seed<B: Backend>(device: &B::Device) -> u64 {
    let draws = Tensor::<B, 1>::random([2], Distribution::Uniform(0.0, 1.0), device);
    let values = draws.into_data().convert::<f32>().into_vec::<f32>();
    (values.unwrap_or_default().iter()).fold(0, |seed, &v| (seed << 24) ^ (v * 16_777_216.0) as u64)
}

/// The mixture of experts of a block of `c` at `place` (`None` without [`LlamaConfig::moe`]):
/// the routed experts of its expert-parallel rank. Its parameters are drawn with the
/// standard deviations of Burn's initializer of a linear layer (uniform in
/// `±1 / sqrt(fan_in)`) from a seed drawn from the backend's generator.
fn experts<B: ParallelBackend>(
    c: &LlamaConfig,
    place: MoePlace,
    device: &B::Device,
) -> Option<MoeLayer<B>> {
    let moe = c.moe_config()?;
    let rng = InitRng::new(drawn_seed::<B>(device));
    let std_of = |fan_in: usize| (3.0 * fan_in as f32).sqrt().recip();
    let init = ExpertInit {
        rng: &rng,
        std: std_of(c.hidden),
        out_std: std_of(c.ffn),
    };
    Some(MoeLayer::new(&moe, c.hidden, "moe", init, place, device))
}

impl<B: ParallelBackend> Block<B> {
    /// Block `layer` (0-based) of a decoder of shape `c`, with its own rotary table
    /// (`max_seq x head_dim x 2` floats: keep `max_seq` to the sequences trained on).
    ///
    /// # Panics
    ///
    /// If `c` is not valid ([`LlamaConfig::validate`]).
    pub fn new(c: &LlamaConfig, layer: usize, device: &B::Device) -> Self {
        Self::on(c, layer, &UnitPlace::single(), device)
    }

    /// Block `layer` of a decoder of shape `c` for a rank at `place`: under expert
    /// parallelism its mixture of experts holds that rank's share of the routed experts.
    ///
    /// # Panics
    ///
    /// If `c` is not valid ([`LlamaConfig::validate`]).
    pub fn on(c: &LlamaConfig, layer: usize, place: &UnitPlace, device: &B::Device) -> Self {
        check(c);
        Self::with_rope(c, layer, rotary(c, device), place, device)
    }

    /// Block `layer` of a decoder of shape `c` at `place`, using `rope`.
    fn with_rope(
        c: &LlamaConfig,
        layer: usize,
        rope: RotaryEncoding<B>,
        place: &UnitPlace,
        device: &B::Device,
    ) -> Self {
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
                context: place.context,
            },
            mlp_norm: norm(c, device),
            mlp: c.moe.is_none().then(|| Mlp {
                w1: linear(c.hidden, c.ffn, device),
                w2: linear(c.ffn, c.hidden, device),
                w3: linear(c.hidden, c.ffn, device),
            }),
            moe: experts(c, place.moe(layer, c.max_seq), device),
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

impl<B: ParallelBackend> Llama<B> {
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
                .map(|l| Block::with_rope(c, l, rope.clone(), &UnitPlace::single(), device))
                .collect(),
            head: Head::new(c, device),
        }
    }
}

impl<B: ParallelBackend> Attention<B> {
    /// `[batch, seq, hidden]` to `[batch, seq, hidden]`. The number of heads comes from the
    /// width of the projections, so a tensor-parallel rank runs its share of the heads.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        // The positions of the projections' outputs: under sequence parallelism `x` holds
        // this rank's part of each sequence, and the projections gather the whole.
        let q = self.wq.forward(x.clone());
        let [b, s, _] = q.dims();
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
        let q = self.rotate(split(q));
        let local = q.dims()[1];
        let k = self.rotate(self.own_kv(split(self.wk.forward(x.clone())), local));
        let v = self.own_kv(split(self.wv.forward(x)), local);
        let group = local / k.dims()[1];
        let (k, v) = (repeat_heads(k, group), repeat_heads(v, group));
        let ctx = match &self.context {
            Some(share) => share.attention(q, k, v, true),
            None => {
                let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f64).sqrt();
                let mask = generate_autoregressive_mask::<B>(b, s, &scores.device());
                let masked = scores.mask_fill(mask.unsqueeze_dim(1), f32::NEG_INFINITY);
                softmax(masked, 3).matmul(v)
            }
        }
        .swap_dims(1, 2);
        let width = ctx.dims()[2] * self.head_dim;
        self.wo.forward(ctx.reshape([b, s, width]))
    }

    /// The rotary position embedding of `t` (`[batch, heads, positions, head_dim]`) at its
    /// positions: `0..positions`, or under context parallelism this rank's two chunks of
    /// each sequence.
    fn rotate(&self, t: Tensor<B, 4>) -> Tensor<B, 4> {
        let Some(share) = &self.context else {
            return self.rope.forward(t);
        };
        let mut at = 0;
        let parts = share.zigzag.chunks().map(|held| {
            let part = self
                .rope
                .apply(t.clone().narrow(2, at, held.len()), held.start);
            at += held.len();
            part
        });
        Tensor::cat(Vec::from(parts), 2)
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
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        self.tokens.forward(batch.int(TOKENS))
    }

    fn table(&self) -> Option<(&Param<Tensor<B, 2>>, &'static str)> {
        Some((&self.tokens.weight, "tokens.weight"))
    }
}

impl<B: ParallelBackend> LayerUnit<B> for Block<B> {
    fn forward(&self, x: Tensor<B, 3>, _batch: &Batch<'_, B>) -> Tensor<B, 3> {
        self.apply(x)
    }

    fn balance_experts(&mut self, loads: &[u64]) {
        if let Some(moe) = &mut self.moe {
            moe.balance(loads);
        }
    }
}

impl<B: ParallelBackend> Block<B> {
    /// `[batch, seq, hidden]` through the block (attention, then the SwiGLU MLP or the
    /// mixture of experts).
    pub fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(self.attn_norm.forward(x));
        let h = self.mlp_norm.forward(x.clone());
        x + self.feed_forward(h)
    }

    /// The SwiGLU MLP, or the mixture of experts.
    fn feed_forward(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        match (&self.mlp, &self.moe) {
            (Some(m), _) => {
                m.w2.forward(silu(m.w1.forward(h.clone())) * m.w3.forward(h))
            }
            (None, Some(moe)) => moe.forward(h),
            (None, None) => unreachable!("a block has an MLP or a mixture of experts"),
        }
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
    /// The summed next-token loss (every position has a target).
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let [b, s, _] = x.dims();
        LossSum::from_mean(
            Self::cross_entropy(self.logits(x, batch.tied_table()), batch.int(TARGETS)),
            b * s,
        )
    }

    const METRICS: &'static [&'static str] = &["loss", "correct", "tokens"];

    /// `[summed next-token loss, correct next tokens, tokens]` of the micro-batch.
    fn metrics(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Option<Tensor<B, 1>> {
        let targets = batch.int::<2>(TARGETS);
        let logits = self.logits(x, batch.tied_table());
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
    fn predict(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Option<Tensor<B, 2>> {
        let [b, s, _] = x.dims();
        let last = x.slice([0..b, s - 1..s]);
        Some(self.logits(last, batch.tied_table()).squeeze_dim::<2>(1))
    }
}

impl<B: ParallelBackend> Llama<B> {
    /// Token ids `[batch, seq]` to the logits of the next token at every position,
    /// `[batch, seq, vocab]` (one process, or a TP rank of a model split by its plan).
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let mut x = self.embed.tokens.forward(tokens);
        for block in &self.blocks {
            x = block.apply(x);
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
