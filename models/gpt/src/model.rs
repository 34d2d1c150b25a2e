//! The GPT module.

use burn::module::Module;
use burn::nn::{Embedding, LayerNorm, LayerNormConfig};
use burn::tensor::{Int, Tensor, backend::Backend};
use merak_burn::comm::Group;
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, InitRng, MlpWeights, ParallelBackend, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout, TpError, VocabParallelEmbedding, param_from_values,
    vocab_parallel_cross_entropy,
};

use crate::GptConfig;

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// LayerNorm before attention.
    pub ln_1: LayerNorm<B>,
    /// Causal self-attention, heads split across TP.
    pub attn: ParallelSelfAttention<B>,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// The MLP, split across TP.
    pub mlp: ParallelMlp<B>,
    /// Dropout on both residual branches.
    pub dropout: ReplicatedDropout,
}

impl<B: ParallelBackend> Block<B> {
    /// `[batch, seq, hidden] -> [batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = x.clone()
            + self
                .dropout
                .forward(self.attn.forward(self.ln_1.forward(x)));
        x.clone() + self.dropout.forward(self.mlp.forward(self.ln_2.forward(x)))
    }
}

/// GPT-2: token and position embeddings, blocks, final LayerNorm, head tied to the token
/// embedding.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    /// Token embedding (split over the vocabulary), also the output head.
    pub wte: VocabParallelEmbedding<B>,
    /// Position embedding (replicated).
    pub wpe: Embedding<B>,
    /// The transformer blocks.
    pub blocks: Vec<Block<B>>,
    /// Final LayerNorm.
    pub ln_f: LayerNorm<B>,
    /// Dropout on the summed embeddings.
    pub dropout: ReplicatedDropout,
}

impl<B: ParallelBackend> Gpt<B> {
    /// Builds this TP rank's shard of the model initialized from `seed` (GPT-2 scheme:
    /// N(0, 0.02²) weights, residual output projections scaled by `1/sqrt(2 l)`, zero biases,
    /// unit LayerNorm gains). Validate the layout first; this fails only on shapes `tp` does not
    /// divide.
    pub fn new(cfg: &GptConfig, seed: u64, tp: Group, device: &B::Device) -> Result<Self, TpError> {
        let rng = InitRng::new(seed);
        let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
        let std = cfg.init_std as f32;
        let proj_std = std / (2.0 * cfg.layers as f32).sqrt();
        let ln = || {
            LayerNormConfig::new(h)
                .with_epsilon(cfg.layer_norm_eps)
                .init(device)
        };
        let wte =
            VocabParallelEmbedding::from_full(&rng.normal("wte", v * h, std), v, h, tp, device)?;
        let wpe = Embedding {
            weight: param_from_values(rng.normal("wpe", s * h, std), [s, h], device),
        };
        let blocks = (0..cfg.layers)
            .map(|i| {
                let name = |p: &str| format!("h.{i}.{p}");
                let attn = AttentionWeights {
                    qkv_weight: rng.normal(&name("attn.c_attn.weight"), h * 3 * h, std),
                    qkv_bias: vec![0.0; 3 * h],
                    proj_weight: rng.normal(&name("attn.c_proj.weight"), h * h, proj_std),
                    proj_bias: vec![0.0; h],
                };
                let mlp = MlpWeights {
                    fc_weight: rng.normal(&name("mlp.c_fc.weight"), h * 4 * h, std),
                    fc_bias: vec![0.0; 4 * h],
                    proj_weight: rng.normal(&name("mlp.c_proj.weight"), 4 * h * h, proj_std),
                    proj_bias: vec![0.0; h],
                };
                Ok(Block {
                    ln_1: ln(),
                    attn: ParallelSelfAttention::from_full(
                        &attn,
                        h,
                        cfg.heads,
                        AttentionMask::Causal,
                        tp,
                        device,
                    )?,
                    ln_2: ln(),
                    mlp: ParallelMlp::from_full(&mlp, h, 4 * h, tp, device)?,
                    dropout: ReplicatedDropout::new(cfg.dropout, seed.wrapping_add(i as u64 + 1)),
                })
            })
            .collect::<Result<Vec<_>, TpError>>()?;
        Ok(Self {
            wte,
            wpe,
            blocks,
            ln_f: ln(),
            dropout: ReplicatedDropout::new(cfg.dropout, seed),
        })
    }

    /// Final hidden states, `[batch, seq] -> [batch, seq, hidden]`.
    pub fn hidden(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, s] = ids.dims();
        let device = ids.device();
        let pos = Tensor::<B, 1, Int>::arange(0..s as i64, &device)
            .unsqueeze::<2>()
            .expand([b, s]);
        let mut x = self
            .dropout
            .forward(self.wte.forward(ids) + self.wpe.forward(pos));
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.ln_f.forward(x)
    }

    /// This rank's slice of the logits, `[batch, seq, V_pad / tp]` (columns from
    /// [`VocabParallelEmbedding::vocab_start`]).
    pub fn logits(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.wte.logits(self.hidden(ids))
    }

    /// Mean next-token cross-entropy of `targets` (`[batch, seq]`; negative ids ignored),
    /// identical on every TP rank.
    pub fn loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let logits = self.logits(ids);
        vocab_parallel_cross_entropy(
            logits,
            targets,
            self.wte.vocab_start(),
            self.wte.vocab_size(),
            self.wte.group(),
        )
    }
}
