//! The model: nothing in it knows about parallelism but the type of its linear layers.

use burn::module::{Module, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use merak_burn::parallelize::{EmbedUnit, HeadUnit, LayerUnit, Linear, TpPlan, TpStyle};
use merak_burn::tensor_parallel::ParallelBackend;

/// The shape of a Llama-style decoder.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Width of the hidden states.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of the SwiGLU MLP.
    pub ffn: usize,
    /// Longest sequence (the rotary table's length).
    pub max_seq: usize,
    /// Project onto the vocabulary with the token embedding's table (no output layer).
    pub tie_embeddings: bool,
}

impl LlamaConfig {
    /// A tiny decoder for CPUs and tests: 4 blocks, hidden 64, 4 heads, vocabulary 256.
    pub fn tiny() -> Self {
        Self {
            vocab: 256,
            layers: 4,
            hidden: 64,
            heads: 4,
            ffn: 128,
            max_seq: 64,
            tie_embeddings: false,
        }
    }
}

/// Token embedding.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    /// The table, `[vocab, hidden]`.
    pub tokens: Embedding<B>,
}

/// Causal self-attention with rotary position embedding.
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
    /// Rotary position embedding over one head.
    pub rope: RotaryEncoding<B>,
    /// Width of one head.
    #[module(skip)]
    head_dim: usize,
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

impl<B: Backend> Llama<B> {
    /// A decoder of shape `c` initialized by Burn's default initializers from the backend's
    /// random generator (seed it with `B::seed` first for the same weights on every rank).
    pub fn new(c: &LlamaConfig, device: &B::Device) -> Self {
        let linear = |i, o| Linear::from(LinearConfig::new(i, o).with_bias(false).init(device));
        let norm = || RmsNormConfig::new(c.hidden).init(device);
        let head_dim = c.hidden / c.heads;
        let block = || Block {
            attn_norm: norm(),
            attn: Attention {
                wq: linear(c.hidden, c.hidden),
                wk: linear(c.hidden, c.hidden),
                wv: linear(c.hidden, c.hidden),
                wo: linear(c.hidden, c.hidden),
                rope: RotaryEncodingConfig::new(c.max_seq, head_dim).init(device),
                head_dim,
            },
            mlp_norm: norm(),
            mlp: Mlp {
                w1: linear(c.hidden, c.ffn),
                w2: linear(c.ffn, c.hidden),
                w3: linear(c.hidden, c.ffn),
            },
        };
        Self {
            embed: Embed {
                tokens: EmbeddingConfig::new(c.vocab, c.hidden).init(device),
            },
            blocks: (0..c.layers).map(|_| block()).collect(),
            head: Head {
                norm: norm(),
                output: (!c.tie_embeddings).then(|| linear(c.hidden, c.vocab)),
            },
        }
    }
}

/// Which linear layers tensor parallelism splits: Megatron's pairs, column then row.
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

impl<B: ParallelBackend> Attention<B> {
    /// `[batch, seq, hidden]` to `[batch, seq, hidden]`. The number of heads comes from the
    /// width of the projections, so a tensor-parallel rank runs its share of the heads.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let split = |t: Tensor<B, 3>| {
            let heads = t.dims()[2] / self.head_dim;
            t.reshape([b, s, heads, self.head_dim]).swap_dims(1, 2)
        };
        let q = self.rope.forward(split(self.wq.forward(x.clone())));
        let k = self.rope.forward(split(self.wk.forward(x.clone())));
        let v = split(self.wv.forward(x));
        let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f64).sqrt();
        let mask = generate_autoregressive_mask::<B>(b, s, &scores.device()).unsqueeze_dim(1);
        let weights = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        let ctx = weights.matmul(v).swap_dims(1, 2);
        let width = ctx.dims()[2] * self.head_dim;
        self.wo.forward(ctx.reshape([b, s, width]))
    }
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
    /// Mean cross-entropy of `logits` (`[batch, seq, vocab]`) against `targets`.
    fn cross_entropy(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [b, s, vocab] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.reshape([b * s, vocab]), targets.reshape([b * s]))
    }
}

impl<B: ParallelBackend> HeadUnit<B> for Head<B> {
    fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let output = self
            .output
            .as_ref()
            .expect("an untied head has an output layer");
        Self::cross_entropy(output.forward(self.norm.forward(x)), targets)
    }

    fn tied_loss(
        &self,
        x: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
        table: Tensor<B, 2>,
    ) -> Tensor<B, 1> {
        let logits = self.norm.forward(x).matmul(table.transpose().unsqueeze());
        Self::cross_entropy(logits, targets)
    }
}
