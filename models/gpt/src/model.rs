//! The GPT module.

use merak_burn::batch::{
    Batch, BatchError, DropoutPosition, POSITIONS, SEGMENTS, Samples, TARGETS, TOKENS,
};
use std::ops::Range;

use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::{Int, Tensor, backend::Backend};
use merak_burn::comm::Group;
use merak_burn::context_parallel::{CpAttention, ZigZagError};
use merak_burn::moe::{ExpertInit, MoeLayer, MoePlace};
use merak_burn::pipeline::{PipelineModel, TiedTable, param_ids};
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, InitRng, LayerNorm, MlpWeights, ParallelBackend, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout, SequenceSplit, TpError, TpOverlap,
    VocabParallelEmbedding, param_from_values, vocab_parallel_cross_entropy,
};

use crate::GptConfig;

pub mod mtp;

use mtp::MtpDepth;
use mtp::targets::{COUNTS, DepthBatch, with_depth_fields};

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// LayerNorm before attention.
    pub ln_1: LayerNorm<B>,
    /// Causal self-attention, heads split across TP.
    pub attn: ParallelSelfAttention<B>,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// The MLP, split across TP (`None` in a mixture-of-experts block).
    pub mlp: Option<ParallelMlp<B>>,
    /// The mixture of experts in place of the MLP (`model.moe`).
    pub moe: Option<MoeLayer<B>>,
    /// Dropout on both residual branches.
    pub dropout: ReplicatedDropout,
}

impl<B: ParallelBackend> Block<B> {
    /// `[batch, seq, hidden] -> [batch, seq, hidden]`, its dropout masks those of the pass at
    /// `at`.
    pub fn forward(&self, x: Tensor<B, 3>, at: &DropoutPosition) -> Tensor<B, 3> {
        self.forward_in_segments(x, None, at)
    }

    /// [`forward`](Self::forward) with the attention kept within `segments` (`[batch, seq]`
    /// document ids, when given).
    pub fn forward_in_segments(
        &self,
        x: Tensor<B, 3>,
        segments: Option<Tensor<B, 2, Int>>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        let attn = self
            .attn
            .forward_in_segments(self.ln_1.forward(x.clone()), segments);
        let x = x + self.dropout.forward(attn, at, 0);
        let mlp = self.feed_forward(self.ln_2.forward(x.clone()));
        x + self.dropout.forward(mlp, at, 1)
    }

    /// Block `i` of a GPT of shape `cfg`, this rank's TP shard (`tp`) and, in a
    /// mixture-of-experts layer, its experts of the expert-parallel group `ep`, initialized from
    /// `rng` (GPT-2's: weights N(0, `init_std`²), the output projections scaled by
    /// 1/√(2·layers), zero biases), its dropout seeded from `seed`.
    fn init(
        cfg: &GptConfig,
        rng: &InitRng,
        (i, seed): (usize, u64),
        (tp, ep): (Group, Group),
        device: &B::Device,
    ) -> Result<Self, TpError> {
        let prefix = format!("h.{i}");
        let dropout_seed = seed.wrapping_add(i as u64 + 1);
        let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_moe_layer(i)) else {
            return Self::dense(cfg, rng, (&prefix, dropout_seed), tp, device);
        };
        let std = cfg.init_std as f32;
        let init = ExpertInit {
            rng,
            std,
            out_std: std / (2.0 * cfg.layers as f32).sqrt(),
        };
        let place = MoePlace {
            ep,
            ..MoePlace::single(i, cfg.seq_len)
        };
        let name = format!("{prefix}.moe");
        let layer = MoeLayer::new(moe, cfg.hidden, &name, init, place, device);
        Self::with_feed_forward(
            cfg,
            rng,
            (&prefix, dropout_seed),
            (None, Some(layer)),
            tp,
            device,
        )
    }

    /// A block of `cfg`'s shape with a dense MLP, its parameters drawn from the streams named
    /// `{prefix}.*`, its dropout seeded from `dropout_seed` (a main block's, or a
    /// multi-token-prediction depth's).
    pub(crate) fn dense(
        cfg: &GptConfig,
        rng: &InitRng,
        (prefix, dropout_seed): (&str, u64),
        tp: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        let h = cfg.hidden;
        let w = Draw::new(cfg, rng, prefix);
        let mlp = MlpWeights {
            fc_weight: w.weight("mlp.c_fc.weight", h * 4 * h),
            fc_bias: vec![0.0; 4 * h],
            proj_weight: w.output("mlp.c_proj.weight", 4 * h * h),
            proj_bias: vec![0.0; h],
        };
        let mlp = ParallelMlp::from_full(&mlp, h, 4 * h, tp, device)?;
        Self::with_feed_forward(
            cfg,
            rng,
            (prefix, dropout_seed),
            (Some(mlp), None),
            tp,
            device,
        )
    }

    /// The block with the attention drawn from the streams `{prefix}.attn.*` and the feed
    /// forward given (an MLP or a mixture of experts).
    fn with_feed_forward(
        cfg: &GptConfig,
        rng: &InitRng,
        (prefix, dropout_seed): (&str, u64),
        (mlp, moe): (Option<ParallelMlp<B>>, Option<MoeLayer<B>>),
        tp: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        let h = cfg.hidden;
        let w = Draw::new(cfg, rng, prefix);
        let attn = AttentionWeights {
            qkv_weight: w.weight("attn.c_attn.weight", h * 3 * h),
            qkv_bias: vec![0.0; 3 * h],
            proj_weight: w.output("attn.c_proj.weight", h * h),
            proj_bias: vec![0.0; h],
        };
        let ln = || LayerNorm::new(h, cfg.layer_norm_eps, device);
        let mask = AttentionMask::Causal;
        Ok(Block {
            ln_1: ln(),
            attn: ParallelSelfAttention::from_full(&attn, h, cfg.heads, mask, tp, device)?,
            ln_2: ln(),
            mlp,
            moe,
            dropout: ReplicatedDropout::new(cfg.dropout, dropout_seed),
        })
    }

    /// Sequence parallelism on (`on`) or off, the LayerNorms' gradients summed over `group`.
    pub(crate) fn set_sequence_parallel(&mut self, group: Option<Group>, on: bool) {
        self.ln_1.set_sequence_parallel(group);
        self.ln_2.set_sequence_parallel(group);
        self.attn.set_sequence_parallel(on);
        if let Some(mlp) = &mut self.mlp {
            mlp.set_sequence_parallel(on);
        }
    }

    /// The tensor-parallel products sub-pipelined over `overlap` token chunks.
    pub(crate) fn set_overlap(&mut self, overlap: TpOverlap) {
        self.attn.set_overlap(overlap);
        if let Some(mlp) = &mut self.mlp {
            mlp.set_overlap(overlap);
        }
    }

    /// The MLP, or the mixture of experts.
    fn feed_forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match (&self.mlp, &self.moe) {
            (Some(mlp), _) => mlp.forward(x),
            (None, Some(moe)) => moe.forward(x),
            (None, None) => unreachable!("a block has an MLP or a mixture of experts"),
        }
    }
}

/// The initial weights of one block: the streams `{prefix}.*` of an [`InitRng`], GPT-2's
/// N(0, `init_std`²), and for the residual branches' output projections N(0, (`init_std` /
/// √(2·layers))²).
struct Draw<'a> {
    rng: &'a InitRng,
    prefix: &'a str,
    std: f32,
    out_std: f32,
}

impl<'a> Draw<'a> {
    /// The draws of `cfg`'s blocks from `rng` under `prefix`.
    fn new(cfg: &GptConfig, rng: &'a InitRng, prefix: &'a str) -> Self {
        let std = cfg.init_std as f32;
        Self {
            rng,
            prefix,
            std,
            out_std: std / (2.0 * cfg.layers as f32).sqrt(),
        }
    }

    /// `len` values of the weight `{prefix}.{name}`.
    fn weight(&self, name: &str, len: usize) -> Vec<f32> {
        (self.rng).normal(&format!("{}.{name}", self.prefix), len, self.std)
    }

    /// `len` values of the output projection `{prefix}.{name}`.
    fn output(&self, name: &str, len: usize) -> Vec<f32> {
        (self.rng).normal(&format!("{}.{name}", self.prefix), len, self.out_std)
    }
}

/// GPT-2: token and position embeddings, blocks, final LayerNorm, head tied to the token
/// embedding.
///
/// A pipeline rank holds only some *units* (0: the embeddings, `1..=L`: the blocks, `L + 1`:
/// the final LayerNorm and the head); the others are `None`, and blocks keep their global index
/// so that parameter names do not depend on the layout. A rank that holds the head but not the
/// embedding keeps its own copy of the tied table in `head`.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    /// Token embedding (split over the vocabulary), also the output head.
    pub wte: Option<VocabParallelEmbedding<B>>,
    /// Position embedding (replicated).
    pub wpe: Option<Embedding<B>>,
    /// The transformer blocks (`None` for blocks on other pipeline stages).
    pub blocks: Vec<Option<Block<B>>>,
    /// Final LayerNorm.
    pub ln_f: Option<LayerNorm<B>>,
    /// The output head's copy of the token embedding, on a pipeline rank without `wte`.
    pub head: Option<VocabParallelEmbedding<B>>,
    /// The multi-token-prediction depths (`model.mtp_depth`; on the head's rank, else empty).
    pub mtp: Vec<MtpDepth<B>>,
    /// Dropout on the summed embeddings.
    pub dropout: ReplicatedDropout,
    /// Width of the hidden states (what passes between pipeline stages).
    pub hidden: usize,
    /// How the sequences are split between the tensor-parallel blocks (sequence and context
    /// parallelism).
    #[module(skip)]
    split: SequenceSplit,
    /// Under a mixture of experts: the layers and the routed experts of each.
    #[module(skip)]
    experts: Option<(usize, usize)>,
    /// The multi-token-prediction depths of the whole model (`model.mtp_depth`, also on ranks
    /// without the head) and the weight of their losses (`model.mtp_loss_weight`).
    #[module(skip)]
    mtp_settings: (usize, f64),
}

impl<B: ParallelBackend> Gpt<B> {
    /// Builds this TP rank's shard of the model initialized from `seed` (GPT-2 scheme:
    /// N(0, 0.02²) weights, residual output projections scaled by `1/sqrt(2 l)`, zero biases,
    /// unit LayerNorm gains). Validate the layout first; this fails only on shapes `tp` does not
    /// divide.
    pub fn new(cfg: &GptConfig, seed: u64, tp: Group, device: &B::Device) -> Result<Self, TpError> {
        Self::new_units(cfg, seed, tp, device, &|_| true)
    }

    /// Like [`Gpt::new`], with only the units for which `holds(unit)` is true (a pipeline
    /// rank's stages). Every parameter is drawn from a stream named after it, so a unit is the
    /// same wherever it is built.
    pub fn new_units(
        cfg: &GptConfig,
        seed: u64,
        tp: Group,
        device: &B::Device,
        holds: &dyn Fn(usize) -> bool,
    ) -> Result<Self, TpError> {
        Self::new_expert_parallel(cfg, seed, tp, Group::local(), device, holds)
    }

    /// Like [`Gpt::new_units`], with the experts of a mixture-of-experts model split over the
    /// expert-parallel group `ep` (`parallel.ep`): this rank builds only its `experts / ep`
    /// ([`MoeConfig::check_ep`] must pass for the group's size).
    pub fn new_expert_parallel(
        cfg: &GptConfig,
        seed: u64,
        tp: Group,
        ep: Group,
        device: &B::Device,
        holds: &dyn Fn(usize) -> bool,
    ) -> Result<Self, TpError> {
        let rng = InitRng::new(seed);
        let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
        let std = cfg.init_std as f32;
        let ln = || LayerNorm::new(h, cfg.layer_norm_eps, device);
        let head_unit = cfg.layers + 1;
        let table =
            || VocabParallelEmbedding::from_full(&rng.normal("wte", v * h, std), v, h, tp, device);
        let wte = holds(0).then(table).transpose()?;
        let head = (holds(head_unit) && !holds(0)).then(table).transpose()?;
        let wpe = holds(0).then(|| Embedding {
            weight: param_from_values(rng.normal("wpe", s * h, std), [s, h], device),
        });
        let blocks = (0..cfg.layers)
            .map(|i| {
                (holds(i + 1))
                    .then(|| Block::init(cfg, &rng, (i, seed), (tp, ep), device))
                    .transpose()
            })
            .collect::<Result<Vec<_>, TpError>>()?;
        let depths = if holds(head_unit) { cfg.mtp_depth } else { 0 };
        let mtp = (0..depths)
            .map(|k| MtpDepth::new(cfg, &rng, (k, seed), tp, device))
            .collect::<Result<Vec<_>, TpError>>()?;
        Ok(Self {
            wte,
            wpe,
            blocks,
            ln_f: holds(head_unit).then(ln),
            head,
            mtp,
            mtp_settings: (cfg.mtp_depth, cfg.mtp_loss_weight),
            dropout: ReplicatedDropout::new(cfg.dropout, seed),
            hidden: cfg.hidden,
            split: SequenceSplit::new(tp, cfg.seq_len),
            experts: cfg.moe.as_ref().map(|m| (cfg.layers, m.experts)),
        })
    }

    /// The same model with every block's tensor-parallel products sub-pipelined over `overlap`
    /// token chunks (`parallel.tp_overlap`, see [`merak_burn::tensor_parallel::overlap`]).
    pub fn with_tp_overlap(mut self, overlap: TpOverlap) -> Self {
        for block in self.blocks.iter_mut().flatten() {
            block.set_overlap(overlap);
        }
        for depth in &mut self.mtp {
            depth.set_overlap(overlap);
        }
        self
    }

    /// The same model with sequence parallelism on or off (`parallel.sequence_parallel`; no
    /// effect at tp = 1): between the tensor-parallel blocks each TP rank holds positions
    /// `r seq / tp .. (r + 1) seq / tp` of every sequence
    /// ([`merak_burn::tensor_parallel::sequence`]), which tp must divide. The hidden states
    /// of [`hidden`](Self::hidden) and between pipeline stages are then this rank's slice.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.split = self.split.with_sequence_parallel(on);
        let on = self.split.sequence_parallel();
        let (group, _) = self.split.region();
        for table in [&mut self.wte, &mut self.head].into_iter().flatten() {
            table.set_sequence_parallel(on);
        }
        for block in self.blocks.iter_mut().flatten() {
            block.set_sequence_parallel(group, on);
        }
        for depth in &mut self.mtp {
            depth.set_sequence_parallel(group, on);
        }
        if let Some(ln) = &mut self.ln_f {
            ln.set_sequence_parallel(group);
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
        let depth_blocks = self.mtp.iter_mut().map(|d| &mut d.block);
        for block in self.blocks.iter_mut().flatten().chain(depth_blocks) {
            block
                .attn
                .set_context_parallel(self.split.context_parallel(), exchange);
        }
        self.apply_rows();
        Ok(self)
    }

    /// Tells every dropout which positions its inputs' rows hold.
    fn apply_rows(&mut self) {
        let rows = self.split.held().rows();
        let (sp, _) = self.split.region();
        for depth in &mut self.mtp {
            depth.block.dropout.set_sequence_rows(rows.clone());
        }
        for block in self.blocks.iter_mut().flatten() {
            block.dropout.set_sequence_rows(rows.clone());
            if let Some(moe) = &mut block.moe {
                moe.set_place(MoePlace {
                    sp,
                    cp: self.split.context_parallel(),
                    rows: rows.clone(),
                    ..moe.place().clone()
                });
            }
        }
        self.dropout.set_sequence_rows(rows);
    }

    /// The token table this rank uses for the output head.
    fn head_table(&self) -> &VocabParallelEmbedding<B> {
        self.head
            .as_ref()
            .or(self.wte.as_ref())
            .expect("the head unit is built with a token table")
    }

    /// Units 0: `[batch, seq]` ids to the summed, dropped-out embeddings (the masks of the
    /// pass at `at`); `positions` (`[batch, seq]`, each token's position in its document) pick
    /// the position embeddings, `0..seq` for every sequence without them.
    fn embed(
        &self,
        ids: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        let (Some(wte), Some(wpe)) = (&self.wte, &self.wpe) else {
            panic!("the embedding unit is not on this pipeline rank");
        };
        // Under sequence parallelism this rank's positions only (`wte` scatters its sum).
        let seq = ids.dims()[1];
        let pos = (self.split).position_embeddings(wpe.weight.val(), seq, positions);
        let pos = merak_burn::precision::autocast(pos);
        self.dropout.forward(wte.forward(ids) + pos, at, 0)
    }

    /// Blocks `first..end` (0-based block indices), attending within `segments` when given.
    fn run_blocks(
        &self,
        mut x: Tensor<B, 3>,
        blocks: Range<usize>,
        segments: Option<Tensor<B, 2, Int>>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        for i in blocks {
            let block = self.blocks[i]
                .as_ref()
                .expect("the block is on this pipeline rank");
            x = block.forward_in_segments(x, segments.clone(), at);
        }
        x
    }

    /// The final LayerNorm.
    fn final_norm(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.ln_f
            .as_ref()
            .expect("the head unit is on this pipeline rank")
            .forward(x)
    }

    /// Mean cross-entropy of this rank's logit slice against `targets`.
    fn head_loss(&self, hidden: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.cross_entropy(self.final_norm(hidden), targets)
    }

    /// Mean cross-entropy of the head's logits of the normalized `hidden` against `targets`.
    fn cross_entropy(&self, normed: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let table = self.head_table();
        vocab_parallel_cross_entropy(
            table.logits(normed),
            targets,
            table.vocab_start(),
            table.vocab_size(),
            table.group(),
        )
    }

    /// The summed training loss of the head unit: the main loss of the last block's `hidden`
    /// against `targets` times `terms` (their count), plus, when training with multi-token
    /// prediction ([`crate::mtp`]) on the depths' inputs `depth`, each depth's mean loss times
    /// its factor ([`DepthBatch::factors`]) weighted by `model.mtp_loss_weight / depths`; each
    /// depth's mean too.
    pub(crate) fn training_loss(
        &self,
        (hidden, targets, terms): (Tensor<B, 3>, Tensor<B, 2, Int>, usize),
        depth: Option<&DepthBatch<B>>,
        (segments, at): (Option<Tensor<B, 2, Int>>, &DropoutPosition),
    ) -> (Tensor<B, 1>, Vec<Tensor<B, 1>>) {
        let main = self.head_loss(hidden.clone(), targets) * terms as f32;
        // Training: recording gradients, or a forward pass run without them to be recomputed
        // with them (full recomputation, ZeRO-3), which must give the same loss.
        let training = B::ad_enabled(&hidden.device()) || at.forced;
        let Some(depth) = depth.filter(|_| training && !self.mtp.is_empty()) else {
            return (main, Vec::new());
        };
        let table = self.head_table();
        let (mut h, mut means) = (hidden, Vec::new());
        for (k, d) in self.mtp.iter().enumerate() {
            let embedded = table.forward(depth.inputs[k].clone().clamp_min(0));
            h = d.forward((h, embedded), segments.clone(), at);
            means.push(self.cross_entropy(d.final_norm(h.clone()), depth.targets[k].clone()));
        }
        let weight = self.mtp_settings.1 / means.len() as f64;
        let extra = (means.iter().zip(&depth.factors))
            .map(|(m, f)| m.clone().mul_scalar(*f))
            .reduce(|a, b| a + b);
        let total = match extra {
            Some(extra) => main + extra.mul_scalar(weight),
            None => main,
        };
        (total, means)
    }

    /// Final hidden states, `[batch, seq] -> [batch, seq, hidden]` (a model with every unit;
    /// the dropout masks, when training, those of step 0's first samples).
    pub fn hidden(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.hidden_in_documents(ids, None)
    }

    /// [`hidden`](Self::hidden) under a document mask: `documents` holds each token's
    /// position in its document and its document id (`[batch, seq]` each,
    /// [`merak_burn::data::document_fields`]).
    pub fn hidden_in_documents(
        &self,
        ids: Tensor<B, 2, Int>,
        documents: Option<(Tensor<B, 2, Int>, Tensor<B, 2, Int>)>,
    ) -> Tensor<B, 3> {
        let (positions, segments) = documents.unzip();
        let at = DropoutPosition::default();
        let x = self.embed(ids, positions, &at);
        let x = self.run_blocks(x, 0..self.blocks.len(), segments, &at);
        self.final_norm(x)
    }

    /// This rank's slice of the logits, `[batch, seq, V_pad / tp]` (columns from
    /// [`VocabParallelEmbedding::vocab_start`]).
    pub fn logits(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.head_table().logits(self.hidden(ids))
    }

    /// Mean next-token cross-entropy of `targets` (`[batch, seq]`; negative ids ignored),
    /// identical on every TP rank (dropout as in [`hidden`](Self::hidden)).
    pub fn loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let at = DropoutPosition::default();
        let x = self.embed(ids, None, &at);
        let x = self.run_blocks(x, 0..self.blocks.len(), None, &at);
        self.head_loss(x, targets)
    }
}

impl<B: ParallelBackend> PipelineModel<B> for Gpt<B> {
    fn layer_count(&self) -> usize {
        self.blocks.len()
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn sequence_parts(&self) -> usize {
        self.split.held().parts()
    }

    fn experts(&self) -> Option<(usize, usize)> {
        self.experts
    }

    fn balance_experts(&mut self, loads: &[Vec<u64>]) {
        for (block, loads) in self.blocks.iter_mut().zip(loads) {
            if let Some(moe) = block.as_mut().and_then(|b| b.moe.as_mut()) {
                moe.balance(loads);
            }
        }
    }

    /// Under a document mask (the batch has [`POSITIONS`]) the positions restart per document.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let positions = batch.has(POSITIONS).then(|| batch.int(POSITIONS));
        Gpt::embed(self, batch.int(TOKENS), positions, batch.dropout())
    }

    /// Under a document mask (the batch has [`SEGMENTS`]) a token attends within its document.
    fn layer(&self, index: usize, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let segments = batch.has(SEGMENTS).then(|| batch.int(SEGMENTS));
        self.run_blocks(x, index..index + 1, segments, batch.dropout())
    }

    /// The summed loss: the mean over the counted targets times their count (with
    /// multi-token prediction, the depths' weighted shares added), then each depth's share
    /// of the summed loss, logged ([`loss_parts`](PipelineModel::loss_parts)). Samples
    /// without the depths' fields (not from the trainer) get them here.
    fn head_loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 1> {
        let segments = batch.has(SEGMENTS).then(|| batch.int(SEGMENTS));
        let main = (x, batch.int(TARGETS), batch.loss_terms());
        let at = (segments, batch.dropout());
        if self.mtp.is_empty() {
            return self.training_loss(main, None, at).0;
        }
        let prepared;
        let with_fields = match batch.has(COUNTS) {
            true => batch.clone(),
            false => {
                prepared = with_depth_fields(batch.samples().clone(), self.mtp.len())
                    .unwrap_or_else(|e| panic!("the depths' targets: {e}"));
                Batch::new(&prepared, batch.device())
            }
        };
        let depths = DepthBatch::of(&with_fields, self.mtp.len())
            .unwrap_or_else(|e| panic!("the depths' targets: {e}"));
        let (loss, means) = self.training_loss(main, Some(&depths), at);
        let parts =
            (means.into_iter().zip(&depths.factors)).map(|(m, f)| m.detach().mul_scalar(*f));
        Tensor::cat(std::iter::once(loss).chain(parts).collect(), 0)
    }

    /// With multi-token prediction, the depths' targets and counts
    /// ([`mtp::targets::with_depth_fields`]), from the whole sequences.
    fn prepare_samples(&self, samples: Samples) -> Result<Samples, BatchError> {
        with_depth_fields(samples, self.mtp_settings.0)
    }

    /// The multi-token-prediction depths' parameters (their block and projection matrices
    /// are Muon's; their LayerNorms, not matrices, stay AdamW's).
    fn head_block_params(&self) -> Vec<burn::module::ParamId> {
        self.mtp.iter().flat_map(|d| param_ids(Some(d))).collect()
    }

    /// With multi-token prediction, each depth's loss: `mtp_1`, `mtp_2`, ….
    fn loss_parts(&self) -> Vec<String> {
        (1..=self.mtp_settings.0)
            .map(|k| format!("mtp_{k}"))
            .collect()
    }

    /// The token table is read by the embedding and (tied) by the head.
    fn unit_params(&self, unit: usize) -> Option<Vec<burn::module::ParamId>> {
        let last = self.blocks.len() + 1;
        let mut ids = Vec::new();
        if unit == 0 || unit == last {
            ids.extend(param_ids(self.wte.as_ref()));
        }
        if unit == 0 {
            ids.extend(param_ids(self.wpe.as_ref()));
        } else if unit < last {
            ids.extend(param_ids(self.blocks.get(unit - 1)?.as_ref()));
        } else {
            ids.extend(param_ids(self.ln_f.as_ref()));
            ids.extend(param_ids(self.head.as_ref()));
            ids.extend(self.mtp.iter().flat_map(|d| param_ids(Some(d))));
        }
        Some(ids)
    }

    /// The multi-token-prediction depths: GPT-2 weights have none.
    fn beyond_pretrained(&self, name: &str) -> bool {
        mtp::is_depth_param(name)
    }

    fn tied(&self) -> Option<TiedTable> {
        Some(TiedTable {
            embedding: self.wte.as_ref().map(|t| t.embedding.weight.id),
            head_copy: self.head.as_ref().map(|t| t.embedding.weight.id),
            holds_head: self.ln_f.is_some(),
            copy_name: "head.embedding.weight".into(),
            original_name: "wte.embedding.weight".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;
    use merak_burn::backend::CpuAutodiff as B;
    use merak_burn::comm::Group;
    use merak_burn::data::document_fields;

    fn ints(values: &[i64], device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(values.to_vec(), [1, values.len()]), device)
    }

    /// The MoE presets build the parameters the planner counts (routed and shared experts,
    /// router), and a MoE block every second layer keeps the other's dense MLP.
    #[test]
    fn moe_presets_build_what_the_planner_counts() {
        for name in ["moe-tiny", "moe-tiny-shared"] {
            let cfg = crate::GptConfig::preset(name).expect("a preset");
            assert!(cfg.moe.is_some(), "{name} is a mixture of experts");
            let gpt = Gpt::<B>::new(&cfg, 1, Group::local(), &Default::default()).expect("model");
            assert_eq!(gpt.num_params() as u64, cfg.num_params(), "{name}");
        }
        let mut cfg = crate::GptConfig::preset("moe-tiny").expect("a preset");
        cfg.layers = 4;
        if let Some(m) = cfg.moe.as_mut() {
            m.every = 2;
        }
        let gpt = Gpt::<B>::new(&cfg, 1, Group::local(), &Default::default()).expect("model");
        let kinds: Vec<bool> = (gpt.blocks.iter().flatten())
            .map(|b| b.moe.is_some())
            .collect();
        assert_eq!(kinds, vec![false, true, false, true]);
        assert_eq!(gpt.num_params() as u64, cfg.num_params());
    }

    /// Under a document mask, the tokens of the second document of a window get the hidden
    /// states they get alone in a window of their own (positions from 0, no earlier tokens
    /// seen), and the first document's are those of the window cut after its end-of-text.
    #[test]
    fn a_document_mask_trains_each_document_as_if_alone() {
        let cfg = crate::GptConfig {
            dropout: 0.0,
            ..crate::GptConfig::preset("tiny").expect("tiny")
        };
        let device = Default::default();
        let gpt = Gpt::<B>::new(&cfg, 7, Group::local(), &device).expect("model");
        let eot = cfg.vocab_size as i64 - 1;
        let (first, second) = ([5, 9, 2, eot], [17, 3, 40, 8, 1]);
        let window: Vec<i64> = first.iter().chain(&second).copied().collect();
        let (positions, segments) = document_fields(&window, window.len(), eot);
        let masked = gpt.hidden_in_documents(
            ints(&window, &device),
            Some((ints(&positions, &device), ints(&segments, &device))),
        );
        let close = |what: &str, a: Tensor<B, 3>, b: Tensor<B, 3>| {
            let (a, b) = (
                a.into_data().to_vec::<f32>().unwrap(),
                b.into_data().to_vec::<f32>().unwrap(),
            );
            assert_eq!(a.len(), b.len());
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "{what}: largest difference {worst}");
        };
        let n = first.len();
        close(
            "the second document",
            masked.clone().narrow(1, n, second.len()),
            gpt.hidden(ints(&second, &device)),
        );
        close(
            "the first document",
            masked.clone().narrow(1, 0, n),
            gpt.hidden(ints(&first, &device)),
        );
        // Without the mask the second document sees the first: its states differ.
        let plain = gpt
            .hidden(ints(&window, &device))
            .narrow(1, n, second.len());
        let moved = (plain - masked.narrow(1, n, second.len()))
            .abs()
            .max()
            .into_scalar();
        assert!(moved > 1e-3, "{moved}");
    }
}
