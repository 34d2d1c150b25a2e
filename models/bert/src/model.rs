//! The BERT module.

use merak_burn::batch::{Batch, DropoutPosition, POSITIONS, TARGETS, TOKENS};
use std::ops::Range;

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::gelu;
use burn::tensor::{Int, Tensor, backend::Backend};
use merak_burn::comm::Group;
use merak_burn::context_parallel::{CpAttention, ZigZagError};
use merak_burn::kernels::{bias_gelu, linear};
use merak_burn::pipeline::{PipelineModel, TiedTable, param_ids};
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, InitRng, LayerNorm, MlpWeights, ParallelBackend, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout, SequenceSplit, TpError, TpOverlap,
    VocabParallelEmbedding, param_from_values, sp_param, vocab_parallel_cross_entropy,
};

use crate::BertConfig;

/// One post-LayerNorm encoder layer:
/// `x = LN1(x + drop(attn(x)))`, then `x = LN2(x + drop(mlp(x)))`.
#[derive(Module, Debug)]
pub struct EncoderLayer<B: Backend> {
    /// Bidirectional self-attention, heads split across TP.
    pub attention: ParallelSelfAttention<B>,
    /// LayerNorm after the attention residual.
    pub ln_1: LayerNorm<B>,
    /// The GELU MLP (width 4h), split across TP.
    pub mlp: ParallelMlp<B>,
    /// LayerNorm after the MLP residual.
    pub ln_2: LayerNorm<B>,
    /// Dropout on both residual branches.
    pub dropout: ReplicatedDropout,
}

impl<B: ParallelBackend> EncoderLayer<B> {
    /// Encoder layer `i` of a BERT of shape `cfg`, this TP rank's shard, initialized from
    /// `rng` (weights N(0, `init_std`²), zero biases) with its dropout seeded from `seed`.
    fn init(
        cfg: &BertConfig,
        rng: &InitRng,
        i: usize,
        seed: u64,
        tp: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        let h = cfg.hidden;
        let std = cfg.init_std as f32;
        let ln = || LayerNorm::new(h, cfg.layer_norm_eps, device);
        let name = |p: &str| format!("bert.layer.{i}.{p}");
        let attn = AttentionWeights {
            qkv_weight: rng.normal(&name("attention.qkv.weight"), h * 3 * h, std),
            qkv_bias: vec![0.0; 3 * h],
            proj_weight: rng.normal(&name("attention.output.weight"), h * h, std),
            proj_bias: vec![0.0; h],
        };
        let mlp = MlpWeights {
            fc_weight: rng.normal(&name("intermediate.weight"), h * 4 * h, std),
            fc_bias: vec![0.0; 4 * h],
            proj_weight: rng.normal(&name("output.weight"), 4 * h * h, std),
            proj_bias: vec![0.0; h],
        };
        Ok(Self {
            attention: ParallelSelfAttention::from_full(
                &attn,
                h,
                cfg.heads,
                AttentionMask::Bidirectional,
                tp,
                device,
            )?,
            ln_1: ln(),
            mlp: ParallelMlp::from_full(&mlp, h, 4 * h, tp, device)?,
            ln_2: ln(),
            dropout: ReplicatedDropout::new(cfg.dropout, seed.wrapping_add(i as u64 + 1)),
        })
    }

    /// `[batch, seq, hidden] -> [batch, seq, hidden]`, its dropout masks those of the pass at
    /// `at`.
    pub fn forward(&self, x: Tensor<B, 3>, at: &DropoutPosition) -> Tensor<B, 3> {
        let attention = self
            .dropout
            .forward(self.attention.forward(x.clone()), at, 0);
        let x = self.ln_1.forward(x + attention);
        let mlp = self.dropout.forward(self.mlp.forward(x.clone()), at, 1);
        self.ln_2.forward(x + mlp)
    }
}

/// The masked-language-model transform: dense h → h, GELU, LayerNorm (replicated). The
/// projection onto the vocabulary is the tied token embedding ([`Bert::logits`]).
#[derive(Module, Debug)]
pub struct MlmHead<B: Backend> {
    /// Dense layer, `[hidden, hidden]` with bias.
    pub dense: Linear<B>,
    /// LayerNorm after the GELU.
    pub ln: LayerNorm<B>,
    /// The TP group under sequence parallelism (the input is this rank's slice of every
    /// sequence: the dense layer's gradients are summed over it), `None` otherwise.
    #[module(skip)]
    sequence_parallel: Option<Group>,
}

impl<B: ParallelBackend> MlmHead<B> {
    /// The MLM transform of a BERT of shape `cfg` (replicated), its dense weight initialized
    /// from `rng` (N(0, `init_std`²)), zero bias, unit LayerNorm gain.
    fn init(cfg: &BertConfig, rng: &InitRng, device: &B::Device) -> Self {
        let h = cfg.hidden;
        let std = cfg.init_std as f32;
        Self {
            dense: Linear {
                weight: param_from_values(
                    rng.normal("cls.predictions.transform.dense.weight", h * h, std),
                    [h, h],
                    device,
                ),
                bias: Some(Param::from_tensor(Tensor::zeros([h], device))),
            },
            ln: LayerNorm::new(h, cfg.layer_norm_eps, device),
            sequence_parallel: None,
        }
    }

    /// `[batch, seq, hidden] -> [batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, h] = x.dims();
        let sp = self.sequence_parallel;
        let w = merak_burn::precision::autocast(sp_param(self.dense.weight.val(), sp));
        let y = linear(x.reshape([b * s, h]), w, None).reshape([b, s, h]);
        let y = match &self.dense.bias {
            Some(b) => bias_gelu(y, merak_burn::precision::autocast(sp_param(b.val(), sp))),
            None => gelu(y),
        };
        self.ln.forward(y)
    }
}

/// BERT for masked language modelling: token and position embeddings, embedding LayerNorm,
/// post-LayerNorm encoder layers, and the MLM head tied to the token embedding.
///
/// A pipeline rank holds only some *units* (0: the embeddings, `1..=L`: the encoder layers,
/// `L + 1`: the MLM head); the others are `None`, and layers keep their global index. A rank
/// that holds the head but not the embedding keeps its own copy of the tied table in `decoder`.
#[derive(Module, Debug)]
pub struct Bert<B: Backend> {
    /// Token embedding (split over the vocabulary), also the output projection.
    pub wte: Option<VocabParallelEmbedding<B>>,
    /// Position embedding (replicated).
    pub wpe: Option<Embedding<B>>,
    /// LayerNorm on the summed embeddings.
    pub ln_emb: Option<LayerNorm<B>>,
    /// The encoder layers (`None` for layers on other pipeline stages).
    pub layers: Vec<Option<EncoderLayer<B>>>,
    /// The MLM transform in front of the tied output projection.
    pub head: Option<MlmHead<B>>,
    /// The head's copy of the token embedding, on a pipeline rank without `wte`.
    pub decoder: Option<VocabParallelEmbedding<B>>,
    /// Dropout on the normalized embeddings.
    pub dropout: ReplicatedDropout,
    /// Width of the hidden states (what passes between pipeline stages).
    pub hidden: usize,
    /// How the sequences are split between the tensor-parallel blocks (sequence and context
    /// parallelism).
    #[module(skip)]
    split: SequenceSplit,
}

impl<B: ParallelBackend> Bert<B> {
    /// Builds this TP rank's shard of the model initialized from `seed` (BERT scheme: every
    /// weight matrix and embedding N(0, `init_std`²), zero biases, unit LayerNorm gains). Every
    /// parameter is generated at full size from a stream named after it (e.g.
    /// `"bert.layer.{i}.attention.qkv.weight"`) and then cut, so tp = N equals tp = 1.
    /// Validate the layout first; this fails only on shapes `tp` does not divide.
    pub fn new(
        cfg: &BertConfig,
        seed: u64,
        tp: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        Self::new_units(cfg, seed, tp, device, &|_| true)
    }

    /// Like [`Bert::new`], with only the units for which `holds(unit)` is true (a pipeline
    /// rank's stages).
    pub fn new_units(
        cfg: &BertConfig,
        seed: u64,
        tp: Group,
        device: &B::Device,
        holds: &dyn Fn(usize) -> bool,
    ) -> Result<Self, TpError> {
        let rng = InitRng::new(seed);
        let head_unit = cfg.layers + 1;
        let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
        let std = cfg.init_std as f32;
        let ln = || LayerNorm::new(h, cfg.layer_norm_eps, device);
        let table = || {
            VocabParallelEmbedding::from_full(
                &rng.normal("bert.embeddings.word_embeddings.weight", v * h, std),
                v,
                h,
                tp,
                device,
            )
        };
        let wte = holds(0).then(table).transpose()?;
        let decoder = (holds(head_unit) && !holds(0)).then(table).transpose()?;
        let wpe = holds(0).then(|| Embedding {
            weight: param_from_values(
                rng.normal("bert.embeddings.position_embeddings.weight", s * h, std),
                [s, h],
                device,
            ),
        });
        let layers = (0..cfg.layers)
            .map(|i| {
                holds(i + 1)
                    .then(|| EncoderLayer::init(cfg, &rng, i, seed, tp, device))
                    .transpose()
            })
            .collect::<Result<Vec<_>, TpError>>()?;
        let head = holds(head_unit).then(|| MlmHead::init(cfg, &rng, device));
        Ok(Self {
            wte,
            wpe,
            ln_emb: holds(0).then(ln),
            layers,
            head,
            decoder,
            dropout: ReplicatedDropout::new(cfg.dropout, seed),
            hidden: cfg.hidden,
            split: SequenceSplit::new(tp, cfg.seq_len),
        })
    }

    /// The same model with every encoder layer's tensor-parallel products sub-pipelined over
    /// `overlap` token chunks (`parallel.tp_overlap`, see
    /// [`merak_burn::tensor_parallel::overlap`]).
    pub fn with_tp_overlap(mut self, overlap: TpOverlap) -> Self {
        for layer in self.layers.iter_mut().flatten() {
            layer.attention.set_overlap(overlap);
            layer.mlp.set_overlap(overlap);
        }
        self
    }

    /// The same model with sequence parallelism on or off (`parallel.sequence_parallel`; no
    /// effect at tp = 1): between the tensor-parallel blocks (the embeddings' LayerNorm, every
    /// layer's LayerNorms, dropout and residual adds, the head's transform) each TP rank holds
    /// positions `r seq / tp .. (r + 1) seq / tp` of every sequence
    /// ([`merak_burn::tensor_parallel::sequence`]), which tp must divide. The hidden states of
    /// [`hidden`](Self::hidden) and between pipeline stages are then this rank's slice.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.split = self.split.with_sequence_parallel(on);
        let on = self.split.sequence_parallel();
        let (group, _) = self.split.region();
        for table in [&mut self.wte, &mut self.decoder].into_iter().flatten() {
            table.set_sequence_parallel(on);
        }
        for layer in self.layers.iter_mut().flatten() {
            layer.ln_1.set_sequence_parallel(group);
            layer.ln_2.set_sequence_parallel(group);
            layer.attention.set_sequence_parallel(on);
            layer.mlp.set_sequence_parallel(on);
        }
        for ln in [self.ln_emb.as_mut(), self.head.as_mut().map(|h| &mut h.ln)]
            .into_iter()
            .flatten()
        {
            ln.set_sequence_parallel(group);
        }
        if let Some(head) = &mut self.head {
            head.sequence_parallel = group;
        }
        self.apply_rows();
        self
    }

    /// The same model with its sequences cut across the context-parallel group `cp`
    /// (`parallel.cp`; nothing changes for a group of one rank): this rank holds the zigzag
    /// share of every sequence ([`merak_burn::context_parallel::ZigZag`]), its samples carry the global positions
    /// ([`merak_burn::context_parallel::shard_samples`]), and the attention runs as a ring over
    /// the group or, with [`CpAttention::AllToAll`], by all-to-all exchanges (cp must divide
    /// the heads per TP rank; the config checks it). Fails unless `2 cp` divides the sequence
    /// length.
    pub fn with_context_parallel(
        mut self,
        cp: Group,
        exchange: CpAttention,
    ) -> Result<Self, ZigZagError> {
        self.split = self.split.with_context_parallel(cp)?;
        for layer in self.layers.iter_mut().flatten() {
            layer
                .attention
                .set_context_parallel(self.split.context_parallel(), exchange);
        }
        self.apply_rows();
        Ok(self)
    }

    /// Tells every dropout which positions its inputs' rows hold.
    fn apply_rows(&mut self) {
        let rows = self.split.held().rows();
        for layer in self.layers.iter_mut().flatten() {
            layer.dropout.set_sequence_rows(rows.clone());
        }
        self.dropout.set_sequence_rows(rows);
    }

    /// The token table this rank uses for the output projection.
    fn table(&self) -> &VocabParallelEmbedding<B> {
        self.decoder
            .as_ref()
            .or(self.wte.as_ref())
            .expect("the head unit is built with a token table")
    }

    /// Unit 0: ids to the normalized, dropped-out embeddings (the masks of the pass at `at`).
    fn embed(
        &self,
        ids: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        let (Some(wte), Some(wpe), Some(ln)) = (&self.wte, &self.wpe, &self.ln_emb) else {
            panic!("the embedding unit is not on this pipeline rank");
        };
        // Under sequence parallelism this rank's positions only (`wte` scatters its sum).
        let seq = ids.dims()[1];
        let pos = (self.split).position_embeddings(wpe.weight.val(), seq, positions);
        let pos = merak_burn::precision::autocast(pos);
        self.dropout
            .forward(ln.forward(wte.forward(ids) + pos), at, 0)
    }

    /// Encoder layers `layers` (0-based).
    fn run_layers(
        &self,
        mut x: Tensor<B, 3>,
        layers: Range<usize>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        for i in layers {
            x = self.layers[i]
                .as_ref()
                .expect("the layer is on this pipeline rank")
                .forward(x, at);
        }
        x
    }

    /// The MLM head and the loss.
    fn head_loss(&self, hidden: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let head = self
            .head
            .as_ref()
            .expect("the head unit is on this pipeline rank");
        let table = self.table();
        vocab_parallel_cross_entropy(
            table.logits(head.forward(hidden)),
            targets,
            table.vocab_start(),
            table.vocab_size(),
            table.group(),
        )
    }

    /// Final encoder hidden states, `[batch, seq] -> [batch, seq, hidden]` (`seq` at most
    /// `seq_len`; a model with every unit; the dropout masks, when training, those of step 0's
    /// first samples).
    pub fn hidden(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let at = DropoutPosition::default();
        let x = self.embed(ids, None, &at);
        self.run_layers(x, 0..self.layers.len(), &at)
    }

    /// This rank's slice of the MLM logits, `[batch, seq, V_pad / tp]` (columns from
    /// [`VocabParallelEmbedding::vocab_start`]); no output bias.
    pub fn logits(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let head = self
            .head
            .as_ref()
            .expect("the head unit is on this pipeline rank");
        self.table().logits(head.forward(self.hidden(ids)))
    }

    /// Mean masked-token cross-entropy of `targets` (`[batch, seq]`: the original token at
    /// the selected positions, [`IGNORE_TARGET`](crate::IGNORE_TARGET) or any negative id
    /// elsewhere, as [`mask_tokens`](crate::mask_tokens) makes them), identical on every TP
    /// rank.
    pub fn loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.head_loss(self.hidden(ids), targets)
    }
}

impl<B: ParallelBackend> PipelineModel<B> for Bert<B> {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn sequence_parts(&self) -> usize {
        self.split.held().parts()
    }

    /// Under context parallelism (the batch has [`POSITIONS`]) the positions are the
    /// tokens' places in their whole sequences.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let positions = batch.has(POSITIONS).then(|| batch.int(POSITIONS));
        Bert::embed(self, batch.int(TOKENS), positions, batch.dropout())
    }

    fn layer(&self, index: usize, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        self.run_layers(x, index..index + 1, batch.dropout())
    }

    /// The summed loss: the mean over the counted targets times their count.
    fn head_loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 1> {
        Bert::head_loss(self, x, batch.int(TARGETS)) * batch.loss_terms() as f32
    }

    /// The token table is read by the embedding and (tied) by the head.
    fn unit_params(&self, unit: usize) -> Option<Vec<burn::module::ParamId>> {
        let last = self.layers.len() + 1;
        let mut ids = Vec::new();
        if unit == 0 || unit == last {
            ids.extend(param_ids(self.wte.as_ref()));
        }
        if unit == 0 {
            ids.extend(param_ids(self.wpe.as_ref()));
            ids.extend(param_ids(self.ln_emb.as_ref()));
        } else if unit < last {
            ids.extend(param_ids(self.layers.get(unit - 1)?.as_ref()));
        } else {
            ids.extend(param_ids(self.head.as_ref()));
            ids.extend(param_ids(self.decoder.as_ref()));
        }
        Some(ids)
    }

    fn tied(&self) -> Option<TiedTable> {
        Some(TiedTable {
            embedding: self.wte.as_ref().map(|t| t.embedding.weight.id),
            head_copy: self.decoder.as_ref().map(|t| t.embedding.weight.id),
            holds_head: self.head.is_some(),
            copy_name: "decoder.embedding.weight".into(),
            original_name: "wte.embedding.weight".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask_tokens;
    use burn::backend::Autodiff;
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use burn::tensor::TensorData;

    type Cpu = merak_burn::backend::Cpu;
    type Train = Autodiff<Cpu>;

    fn tiny() -> BertConfig {
        BertConfig::preset("tiny").unwrap()
    }

    /// A fixed masked batch of `batch` sequences: `(inputs, targets)` as `[batch, seq]`.
    fn batch<B: Backend>(
        cfg: &BertConfig,
        batch: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let s = cfg.seq_len;
        let rng = InitRng::new(3);
        let tokens: Vec<i64> = rng
            .integers("tokens", batch * s, cfg.mask_token_id as u64)
            .into_iter()
            .map(|t| t as i64)
            .collect();
        let (x, y) = mask_tokens(&tokens, s, cfg, 3, "mlm/test");
        (
            Tensor::from_data(TensorData::new(x, [batch, s]), device),
            Tensor::from_data(TensorData::new(y, [batch, s]), device),
        )
    }

    #[test]
    fn param_count_matches_the_module() {
        let cfg = tiny();
        let model = Bert::<Cpu>::new(&cfg, 0, Group::local(), &Default::default()).unwrap();
        assert_eq!(model.num_params() as u64, cfg.num_params());
        // An odd vocabulary (no padding at tp = 1) and other sizes.
        let cfg = BertConfig {
            vocab_size: 101,
            layers: 3,
            heads: 2,
            hidden: 24,
            seq_len: 10,
            mask_token_id: 100,
            ..tiny()
        };
        let model = Bert::<Cpu>::new(&cfg, 0, Group::local(), &Default::default()).unwrap();
        assert_eq!(model.num_params() as u64, cfg.num_params());
    }

    #[test]
    fn initial_loss_is_near_uniform() {
        let cfg = tiny();
        let device = Default::default();
        let model = Bert::<Cpu>::new(&cfg, 1, Group::local(), &device).unwrap();
        let (x, y) = batch::<Cpu>(&cfg, 4, &device);
        let logits = model.logits(x.clone());
        assert_eq!(logits.dims(), [4, cfg.seq_len, cfg.vocab_size]);
        let loss: f32 = model.loss(x, y).into_scalar();
        let uniform = (cfg.vocab_size as f32).ln();
        assert!(loss.is_finite(), "loss {loss}");
        eprintln!("initial loss {loss}, ln V {uniform}");
        assert!((loss - uniform).abs() < 0.5, "loss {loss}, ln V {uniform}");
    }

    #[test]
    fn same_seed_same_model_and_attention_sees_the_future() {
        let cfg = tiny();
        let device = Default::default();
        let a = Bert::<Cpu>::new(&cfg, 5, Group::local(), &device).unwrap();
        let b = Bert::<Cpu>::new(&cfg, 5, Group::local(), &device).unwrap();
        let ids: Vec<i64> = (0..cfg.seq_len as i64).collect();
        let mut changed = ids.clone();
        *changed.last_mut().unwrap() = 300;
        let t = |v: Vec<i64>| {
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(v, [1, cfg.seq_len]), &device)
        };
        let ha = a.hidden(t(ids.clone()));
        let hb = b.hidden(t(ids));
        ha.clone().into_data().assert_eq(&hb.into_data(), true);
        // Changing the last token changes the first position's output (bidirectional).
        let hc = a.hidden(t(changed));
        let first = |h: Tensor<Cpu, 3>| h.slice([0..1, 0..1, 0..cfg.hidden]);
        let diff: f32 = (first(ha) - first(hc)).abs().sum().into_scalar();
        assert!(diff > 1e-4, "first position unchanged ({diff})");
    }

    #[test]
    fn adamw_reduces_the_masked_loss() {
        let cfg = tiny();
        let device = Default::default();
        let mut model = Bert::<Train>::new(&cfg, 2, Group::local(), &device).unwrap();
        let mut optim = AdamWConfig::new()
            .with_weight_decay(0.0)
            .init::<Train, Bert<Train>>();
        let (x, y) = batch::<Train>(&cfg, 4, &device);
        let mut losses = Vec::new();
        for _ in 0..8 {
            let loss = model.loss(x.clone(), y.clone());
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
        }
        let (first, last) = (losses[0], *losses.last().unwrap());
        eprintln!("AdamW losses {losses:?}");
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
        assert!(last < first - 0.5, "loss did not fall: {losses:?}");
    }
}
