//! The shape of the decoder: sizes, attention heads, rotary frequencies, norms, and the
//! optional mixture of experts (Mixtral).

use merak_burn::moe::{ExpertActivation, MoeConfig, RouterScore};
use thiserror::Error;

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

/// Mixtral's sparse mixture of experts in place of every block's MLP: a router (no bias)
/// scores the `experts` SwiGLU networks of width [`LlamaConfig::ffn`] with a softmax, each
/// token goes through its `top_k` best, weighted by their scores divided by the sum of those
/// `top_k` (transformers' `MixtralSparseMoeBlock`). Routing is dropless.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseMoe {
    /// Experts per block (transformers' `num_local_experts`).
    pub experts: usize,
    /// Experts each token goes through (`num_experts_per_tok`).
    pub top_k: usize,
    /// The weight of the routers' load-balancing loss in training, as transformers'
    /// `router_aux_loss_coef` counts it (0: none, as transformers without
    /// `output_router_logits`). transformers computes one Switch loss over the tokens of every
    /// block together, each token counted `top_k` times; merak-burn computes one per block
    /// and adds them, so each block's is weighted `aux_loss * top_k / layers` (the same total
    /// when the routers are balanced).
    pub aux_loss: f64,
    /// DeepSeek's auxiliary-loss-free balancing, which Mixtral does not have (0: off, as
    /// imported): each expert's selection bias moves by this rate towards balance after every
    /// step ([`MoeConfig::bias_update_rate`]).
    pub bias_update_rate: f64,
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
    /// Width of the SwiGLU MLP (of each expert, under a mixture of experts).
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
    /// A mixture of experts in place of every block's MLP (Mixtral); `None`: the dense MLP.
    pub moe: Option<SparseMoe>,
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
            moe: None,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Checks that the sizes fit together: every size positive, `heads` dividing `hidden`
    /// into heads of even width, `kv_heads` dividing `heads`, positive finite rotary base and
    /// norm epsilon, and a rotary scaling whose high-frequency factor exceeds its
    /// low-frequency one, and a mixture of experts (if any) choosing from 1 to `experts`
    /// experts per token with a finite, non-negative load-balancing weight.
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
        if let Some(m) = self.moe {
            if m.top_k == 0 || m.top_k > m.experts {
                return bad(format!(
                    "moe: top_k = {} must be from 1 to experts = {}",
                    m.top_k, m.experts
                ));
            }
            if !(m.aux_loss.is_finite() && m.aux_loss >= 0.0) {
                return bad(format!("moe: aux_loss = {} must be >= 0", m.aux_loss));
            }
        }
        Ok(())
    }

    /// The mixture-of-experts block of every layer (`None` without [`moe`](Self::moe)):
    /// SwiGLU experts of width `ffn`, softmax scores renormalized over the `top_k` chosen,
    /// dropless, the load-balancing loss weighted as [`SparseMoe::aux_loss`] says, no z-loss.
    pub fn moe_config(&self) -> Option<MoeConfig> {
        let m = self.moe?;
        Some(MoeConfig {
            activation: ExpertActivation::Swiglu,
            score: RouterScore::Softmax,
            renormalize: true,
            aux_loss: m.aux_loss * m.top_k as f64 / self.layers.max(1) as f64,
            bias_update_rate: m.bias_update_rate,
            ..MoeConfig::new(m.experts, m.top_k, self.ffn)
        })
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
            ];
            shapes.extend(blocks.map(|(n, s)| (format!("layers.{l}.{n}"), s)));
            shapes.extend(
                (self.feed_forward_shapes().into_iter())
                    .map(|(n, s)| (format!("layers.{l}.{n}"), s)),
            );
        }
        shapes.push(("head.norm.gamma".into(), vec![h]));
        if !self.tie_embeddings {
            shapes.push(("head.output.linear.weight".into(), vec![h, self.vocab]));
        }
        shapes
    }

    /// The parameters of one block's MLP or mixture of experts, by name within the block.
    fn feed_forward_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, f) = (self.hidden, self.ffn);
        let Some(moe) = self.moe else {
            return vec![
                ("mlp.w1.linear.weight".into(), vec![h, f]),
                ("mlp.w2.linear.weight".into(), vec![f, h]),
                ("mlp.w3.linear.weight".into(), vec![h, f]),
            ];
        };
        let mut shapes = vec![("moe.router".to_string(), vec![h, moe.experts])];
        for e in 0..moe.experts {
            shapes.push((format!("moe.experts.{e}.w_in"), vec![h, 2 * f]));
            shapes.push((format!("moe.experts.{e}.w_out"), vec![f, h]));
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
