//! The model proxy: a per-unit description of a transformer that the cost model reads instead
//! of the model itself.
//!
//! Units follow [`pipeline::partition`](crate::pipeline::partition): unit 0 is the embedding,
//! units `1..=L` are the transformer blocks and unit `L + 1` is the head. Every unit is described
//! by a [`UnitProfile`]: its parameters, its FLOPs and activation bytes per sequence (linear in
//! the micro-batch size `b`), and its tensor-parallel all-reduces. A [`ModelProxy`] is the list
//! of profiles plus the few global numbers the planner needs (heads, the size of the message
//! between pipeline stages). It is built from a [`TransformerShape`] (GPT or BERT, from a preset
//! or an inline spec such as `gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200`), or from
//! any [`LayerCosts`] implementation, so that a Burn user's own model can be planned too.
//!
//! FLOPs follow the Megatron-LM count (Narayanan et al., SC'21): a multiply-add is 2 FLOPs, only
//! the GEMMs count, the backward pass costs twice the forward pass. For a GPT block
//! `forward = 24 s h² + 4 s² h` per sequence; for the head `2 s h V`; the embedding is a lookup
//! (0 FLOPs). Summed over units and a global batch `B` this is exactly
//! `72 B s l h² (1 + s/(6h) + V/(12 l h))`, and with full recomputation of the blocks (the head
//! is not recomputed) `96 B s l h² (1 + s/(6h) + V/(16 l h))`. The book's architecture page
//! (`docs/src/contributing/architecture.md`) gives these formulas, MFU and the activation
//! memory below for a reader of the benchmarks.
//!
//! Activations follow Korthikanti et al. (2022) with 16-bit values: a block keeps
//! `s b h (10 + 24/t + 5 a s/(h t))` bytes without recomputation, the same without the
//! `5 a s/(h t)` attention term under selective recomputation, and its input `2 s b h` under
//! full recomputation. Sequence parallelism splits the `10 s b h` that tensor parallelism
//! leaves whole (`34/t`), context parallelism every term (`1/cp`: each rank holds `s/cp`
//! tokens, its attention blockwise); see [`RankSplit`].
//!
//! A shape with a [`MoeShape`] has mixture-of-experts blocks (see [`MoeShape`]): their routed
//! experts are split by expert parallelism (`RankSplit::ep`), not by tensor parallelism.

mod moe;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::pipeline::RecomputeMode;
pub use moe::{EXPERT_IMBALANCE, EXPERT_IMBALANCE_PCT, EXPERT_LOAD_BOUND, MoeShape};
use thiserror::Error;

/// Bytes of one 16-bit value (activations, messages, gradients in mixed precision).
pub const BYTES_16BIT: f64 = 2.0;

/// How the ranks that run one micro-batch of a unit together split it: `tp`-way tensor
/// parallelism (optionally with sequence parallelism), `cp`-way context parallelism and
/// `ep`-way expert parallelism.
///
/// - Tensor parallelism splits the unit's weights and the work on them; what it leaves whole
///   (LayerNorms, dropouts, residuals: `act_replicated`, `memory_replicated`) is split too
///   under `sequence_parallel`, each TP rank holding `s/tp` positions there (Megatron's
///   sequence parallelism: `34/t` instead of `10 + 24/t`).
/// - Context parallelism gives each rank `s/cp` tokens of every sequence (two zigzag chunks);
///   every per-sequence term is divided by `cp`. Its attention is a ring of blockwise passes,
///   so with `cp > 1` no `a s²` scores are kept or moved, whatever the hardware's
///   `flash_attention` says.
/// - Expert parallelism gives each of `ep` data-parallel ranks `1/ep` of a MoE layer's routed
///   experts; it splits no token (every rank routes its own), only the experts' parameters,
///   and the tokens travel to their experts and back with all-to-alls.
///
/// A plain `usize` converts to tensor parallelism alone (`RankSplit::from(t)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankSplit {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Context-parallel degree.
    pub cp: usize,
    /// Sequence parallelism between the tensor-parallel blocks.
    pub sequence_parallel: bool,
    /// Expert-parallel degree (1: every rank holds every expert).
    pub ep: usize,
}

impl From<usize> for RankSplit {
    /// Tensor parallelism of degree `tp` alone.
    fn from(tp: usize) -> Self {
        RankSplit::new(tp, 1, false)
    }
}

impl RankSplit {
    /// Tensor, context and sequence parallelism without expert parallelism (`ep = 1`).
    pub const fn new(tp: usize, cp: usize, sequence_parallel: bool) -> Self {
        RankSplit {
            tp,
            cp,
            sequence_parallel,
            ep: 1,
        }
    }

    /// The same split with expert-parallel degree `ep`.
    pub const fn with_ep(self, ep: usize) -> Self {
        RankSplit { ep, ..self }
    }

    /// The tensor-parallel degree as a divisor (at least 1).
    fn t(&self) -> f64 {
        self.tp.max(1) as f64
    }

    /// The context-parallel degree as a divisor (at least 1).
    fn c(&self) -> f64 {
        self.cp.max(1) as f64
    }

    /// What divides the terms tensor parallelism leaves whole: `tp` under sequence
    /// parallelism, else 1.
    pub fn replicated_divisor(&self) -> f64 {
        if self.sequence_parallel {
            self.t()
        } else {
            1.0
        }
    }

    /// Whether the attention runs blockwise: the hardware's `flash_attention`, or a ring
    /// (`cp > 1`), which never forms the whole scores either.
    pub fn blockwise(&self, flash_attention: bool) -> bool {
        flash_attention || self.cp > 1
    }
}

/// The description of one pipeline unit. FLOPs, activation bytes and all-reduce sizes are per
/// *sequence*: a micro-batch of `b` sequences costs `b` times as much. Quantities that tensor
/// parallelism of degree `t` splits are divided by `t` by the accessors.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnitProfile {
    /// Parameters that tensor parallelism shards (each TP rank holds `1/t`).
    pub params_split: u64,
    /// Parameters every TP rank holds whole (LayerNorms, some biases, position table).
    pub params_replicated: u64,
    /// Routed experts' parameters (all of them, [`MoeShape`]): expert parallelism gives each
    /// rank `1/ep` of them, tensor parallelism does not split them.
    #[serde(default)]
    pub params_expert: u64,
    /// Parameters of another unit that this unit also holds when it is on a different pipeline
    /// stage (the tied output layer holds the token embedding). Split by TP; not counted in the
    /// model's parameter total.
    pub params_tied: u64,
    /// Forward FLOPs per sequence (all TP ranks together).
    pub forward_flops: f64,
    /// Backward FLOPs per sequence (all TP ranks together).
    pub backward_flops: f64,
    /// Extra FLOPs per sequence of selective recomputation (the attention scores GEMM).
    pub selective_recompute_flops: f64,
    /// Whether full recomputation applies to this unit (transformer blocks; not the embedding or
    /// the head).
    pub recomputable: bool,
    /// Activation bytes per sequence that every TP rank keeps whole.
    pub act_replicated: f64,
    /// Activation bytes per sequence split by TP (all ranks together).
    pub act_split: f64,
    /// Activation bytes per sequence of the attention core, split by TP, dropped by selective
    /// recomputation.
    pub act_attention: f64,
    /// Bytes per sequence kept under full recomputation (the unit's input).
    pub act_full: f64,
    /// TP all-reduces in the forward pass, each of
    /// [`tp_allreduce_elements`](Self::tp_allreduce_elements).
    pub tp_forward_allreduces: u32,
    /// TP all-reduces in the backward pass.
    pub tp_backward_allreduces: u32,
    /// Elements per sequence of each TP all-reduce (`s h` for a transformer).
    pub tp_allreduce_elements: f64,
    /// Bytes per sequence that the forward pass's memory-bound operations (LayerNorm,
    /// bias-dropout-add, residuals) read and write on every TP rank. Their time is these bytes
    /// over the memory bandwidth: a cost that grows like `s h` while the matrix products grow
    /// like `s h²`, which is why large models run at a higher share of peak than small ones.
    #[serde(default)]
    pub memory_replicated: f64,
    /// Bytes per sequence of memory-bound operations split by TP (all ranks together): the
    /// MLP's activation function.
    #[serde(default)]
    pub memory_split: f64,
    /// Bytes per sequence of the attention core's memory-bound work, split by TP (the scores'
    /// scaling, mask, softmax and dropout, written and read by the two batched products),
    /// repeated by selective recomputation.
    #[serde(default)]
    pub memory_attention: f64,
    /// Forward FLOPs per sequence of the attention core (`4 s² h` for a transformer block,
    /// included in [`forward_flops`](Self::forward_flops)): the compute that context
    /// parallelism's ring exchange hides behind.
    #[serde(default)]
    pub attention_flops: f64,
    /// Elements per sequence of the keys and values that context parallelism's ring passes
    /// around (`2 s h` for a block; 0 for a unit without attention).
    #[serde(default)]
    pub kv_elements: f64,
    /// Forward FLOPs per sequence of the routed experts (included in
    /// [`forward_flops`](Self::forward_flops)): under expert parallelism the busiest rank
    /// computes [`EXPERT_IMBALANCE`] times its share.
    #[serde(default)]
    pub expert_flops: f64,
    /// Activation bytes per sequence of the routed experts with every expert equally loaded
    /// (the tokens dispatched to them, their MLPs and outputs), kept whole by a TP rank
    /// (divided by TP under sequence parallelism), not counted in
    /// [`activation_bytes`](Self::activation_bytes): see
    /// [`expert_activation_bytes`](Self::expert_activation_bytes).
    #[serde(default)]
    pub act_expert: f64,
    /// The part of [`act_expert`](Self::act_expert) that selective recomputation does not
    /// keep: the routed experts' activation-function outputs (SiLU and its product with the up
    /// projection for SwiGLU, GeLU's output), recomputed from the kept first product in the
    /// backward pass as the runtime's selective checkpointing recomputes every memory-bound
    /// operation (Megatron-Core's `--recompute-modules moe_act`). The dispatched tokens, the
    /// first product and the outputs stay.
    #[serde(default)]
    pub act_expert_selective: f64,
    /// Elements per sequence that each of a MoE layer's all-to-alls (dispatch, combine) moves
    /// (`top_k s h`; 0 for a unit without routed experts).
    #[serde(default)]
    pub a2a_elements: f64,
    /// Seconds of the unit's forward pass that do not grow with the micro-batch (a measured
    /// model's framework and per-operation overheads; 0 for the formulas), paid on every rank
    /// per micro-batch and again by full recomputation.
    #[serde(default)]
    pub fixed_forward_s: f64,
    /// The same of its backward pass.
    #[serde(default)]
    pub fixed_backward_s: f64,
}

impl UnitProfile {
    /// All parameters of the unit (without tied copies), routed experts included.
    pub fn params(&self) -> u64 {
        self.params_split
            .saturating_add(self.params_replicated)
            .saturating_add(self.params_expert)
    }

    /// Parameters one TP rank of `t` holds, tied copies and routed experts excluded.
    pub fn params_per_rank(&self, t: usize) -> f64 {
        self.params_split as f64 / t.max(1) as f64 + self.params_replicated as f64
    }

    /// Forward FLOPs of a micro-batch of `b` sequences (all TP ranks together).
    pub fn forward_flops(&self, b: usize) -> f64 {
        self.forward_flops * b as f64
    }

    /// Backward FLOPs of a micro-batch of `b` sequences (all TP ranks together).
    pub fn backward_flops(&self, b: usize) -> f64 {
        self.backward_flops * b as f64
    }

    /// Recomputation FLOPs of a micro-batch of `b` sequences under `mode`.
    pub fn recompute_flops(&self, b: usize, mode: RecomputeMode) -> f64 {
        let per_seq = match mode {
            RecomputeMode::None => 0.0,
            RecomputeMode::Selective => self.selective_recompute_flops,
            RecomputeMode::Full if self.recomputable => self.forward_flops,
            RecomputeMode::Full => 0.0,
        };
        per_seq * b as f64
    }

    /// Activation bytes one rank of `split` (a tensor-parallel degree, or a [`RankSplit`])
    /// keeps for a micro-batch of `b` sequences under `mode`; with blockwise attention
    /// ([`RankSplit::blockwise`]: `flash_attention`, or a context-parallel ring) the attention
    /// core keeps no scores or probabilities (only a log-sum-exp per row, a few bytes a token,
    /// left out).
    pub fn activation_bytes(
        &self,
        b: usize,
        split: impl Into<RankSplit>,
        mode: RecomputeMode,
        flash_attention: bool,
    ) -> f64 {
        let split = split.into();
        let (t, r) = (split.t(), split.replicated_divisor());
        let attention = if split.blockwise(flash_attention) {
            0.0
        } else {
            self.act_attention
        };
        let kept = self.act_replicated / r + self.act_split / t;
        let per_seq = match mode {
            RecomputeMode::None => kept + attention / t,
            RecomputeMode::Selective => kept,
            // The unit's input, split over TP under sequence parallelism.
            RecomputeMode::Full if self.recomputable => self.act_full / r,
            RecomputeMode::Full => kept + attention / t,
        };
        per_seq * b as f64 / split.c()
    }

    /// Activation bytes of the routed experts one rank of `split` keeps for a micro-batch of `b`
    /// sequences under `mode`, with the busiest rank of an expert-parallel group receiving
    /// `load` times its share of tokens (`ep > 1`; 1 otherwise): none under full
    /// recomputation, all but [`act_expert_selective`](Self::act_expert_selective) under
    /// selective.
    pub fn expert_activation_bytes(
        &self,
        b: usize,
        split: RankSplit,
        mode: RecomputeMode,
        load: f64,
    ) -> f64 {
        let kept = match mode {
            RecomputeMode::Full if self.recomputable => return 0.0,
            RecomputeMode::Selective => self.act_expert - self.act_expert_selective,
            _ => self.act_expert,
        };
        let load = if split.ep > 1 { load } else { 1.0 };
        kept * load * b as f64 / (split.c() * split.replicated_divisor())
    }

    /// Bytes the forward pass's memory-bound operations move on one rank of `split` for a
    /// micro-batch of `b` sequences (the backward pass moves twice as much); with blockwise
    /// attention the attention core's scores stay on chip.
    pub fn forward_memory_bytes(
        &self,
        b: usize,
        split: impl Into<RankSplit>,
        flash_attention: bool,
    ) -> f64 {
        let split = split.into();
        let attention = if split.blockwise(flash_attention) {
            0.0
        } else {
            self.memory_attention
        };
        let per_seq = self.memory_replicated / split.replicated_divisor()
            + (self.memory_split + attention) / split.t();
        per_seq * b as f64 / split.c()
    }

    /// The bytes of memory-bound work that recomputation under `mode` repeats on one rank of
    /// `split`.
    pub fn recompute_memory_bytes(
        &self,
        b: usize,
        split: impl Into<RankSplit>,
        mode: RecomputeMode,
        flash_attention: bool,
    ) -> f64 {
        let split = split.into();
        // The routed experts' activation functions, recomputed under selective: read the
        // kept first product and write the outputs (about twice the outputs' bytes).
        let experts =
            2.0 * self.act_expert_selective * b as f64 / (split.c() * split.replicated_divisor());
        match mode {
            RecomputeMode::None => 0.0,
            RecomputeMode::Selective if split.blockwise(flash_attention) => experts,
            RecomputeMode::Selective => {
                self.memory_attention / split.t() * b as f64 / split.c() + experts
            }
            RecomputeMode::Full if self.recomputable => {
                self.forward_memory_bytes(b, split, flash_attention)
            }
            RecomputeMode::Full => 0.0,
        }
    }

    /// Elements all-reduced across TP per micro-batch of `b` sequences (forward and backward,
    /// without recomputation).
    pub fn tp_comm_elements(&self, b: usize) -> f64 {
        (self.tp_forward_allreduces + self.tp_backward_allreduces) as f64
            * self.tp_allreduce_elements
            * b as f64
    }
}

/// A model the planner can plan: its per-unit description. Implement it for your own Burn model
/// to plan it like the built-in GPT and BERT shapes.
pub trait LayerCosts {
    /// A short name for reports.
    fn name(&self) -> String;
    /// One profile per pipeline unit, in order (embedding, blocks, head for a transformer).
    fn unit_profiles(&self) -> Vec<UnitProfile>;
    /// Attention heads: the tensor-parallel degree must divide them.
    fn heads(&self) -> usize;
    /// Elements per sequence of the activation sent between pipeline stages (`s h`).
    fn pp_message_elements(&self) -> f64;
}

/// Which transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ModelKind {
    /// Decoder-only GPT: learned positions, final LayerNorm, output layer tied to the embedding.
    #[serde(rename = "gpt")]
    Gpt,
    /// BERT masked LM: embedding LayerNorm, MLM head (dense + LayerNorm), tied output layer.
    #[serde(rename = "bert")]
    Bert,
}

impl fmt::Display for ModelKind {
    /// `gpt` or `bert`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModelKind::Gpt => "gpt",
            ModelKind::Bert => "bert",
        })
    }
}

/// A model spec that cannot be parsed or is not a valid shape. Messages name the field.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ModelSpecError {
    /// The spec is neither a preset nor `kind:key=value,...`.
    #[error(
        "unknown model `{spec}`: expected a preset ({known}) or \
         `gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..`"
    )]
    Unknown {
        /// The spec given.
        spec: String,
        /// The known presets.
        known: String,
    },
    /// The kind before `:` is not `gpt` or `bert`.
    #[error("unknown model kind `{kind}` (expected gpt or bert)")]
    Kind {
        /// The kind given.
        kind: String,
    },
    /// A `key=value` item without `=`.
    #[error("model spec item `{item}` is not key=value")]
    Item {
        /// The item.
        item: String,
    },
    /// A key that is not a field.
    #[error(
        "unknown model field `{field}` (fields: layers, hidden, heads, seq, vocab; mixture of \
         experts: experts, top_k, expert_hidden, shared, swiglu, moe_every, imbalance; \
         multi-token prediction: mtp)"
    )]
    UnknownField {
        /// The key.
        field: String,
    },
    /// A value that is not a positive integer.
    #[error("model field `{field}` = `{value}` is not a positive integer")]
    BadValue {
        /// The key.
        field: String,
        /// The value.
        value: String,
    },
    /// A field missing from the spec.
    #[error("model field `{field}` is missing")]
    Missing {
        /// The key.
        field: &'static str,
    },
    /// Heads do not divide the hidden size.
    #[error("model field `hidden` = {hidden} is not divisible by `heads` = {heads}")]
    HeadsDoNotDivide {
        /// Hidden size.
        hidden: usize,
        /// Heads.
        heads: usize,
    },
    /// A field given twice in one spec.
    #[error("model field `{field}` is given twice (`{first}` and `{second}`)")]
    Duplicate {
        /// The key.
        field: String,
        /// The first value.
        first: String,
        /// The second value.
        second: String,
    },
    /// A mixture-of-experts field out of its range.
    #[error("model field `{field}` = {value} {rule}")]
    Moe {
        /// The key.
        field: &'static str,
        /// The value.
        value: usize,
        /// What it must be.
        rule: String,
    },
    /// More multi-token-prediction depths than a GPT takes (`mtp`).
    #[error(
        "model field `mtp` = {depth} must be at most {most} (8, and fewer than seq = {seq}: depth \
         k predicts the token k + 1 places ahead)"
    )]
    Mtp {
        /// The depths given.
        depth: usize,
        /// The most allowed.
        most: usize,
        /// The sequence length.
        seq: usize,
    },
    /// A shape whose parameter count does not fit in 64 bits.
    #[error(
        "model `{shape}` has more than 2^64 parameters (12 x layers x hidden² + (vocab + seq) x \
         hidden overflows): lower `layers`, `hidden`, `vocab` or `seq`"
    )]
    TooLarge {
        /// The shape, as a spec.
        shape: String,
    },
}

/// The shape of a GPT or BERT model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformerShape {
    /// GPT or BERT.
    pub kind: ModelKind,
    /// Transformer layers `l`.
    pub layers: usize,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Attention heads `a`.
    pub heads: usize,
    /// Sequence length `s`.
    pub seq: usize,
    /// Vocabulary size `V`.
    pub vocab: usize,
    /// Mixture-of-experts layers (`None`: a dense model). Absent in plan files of earlier
    /// versions and of dense models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeShape>,
    /// Multi-token-prediction depths after the last block (GPT's `model.mtp_depth`; 0: none),
    /// on the head's unit. Absent in plan files of earlier versions and of models without.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_depth: usize,
}

/// Whether `v` is 0 (a field left out of plan files).
fn is_zero(v: &usize) -> bool {
    *v == 0
}

/// The GPT-2 BPE vocabulary plus BERT's `[MASK]` token (always the last id).
const BPE_VOCAB_WITH_MASK: usize = 50257 + 1;

/// The one table of model presets (`merak models` lists it; the GPT and BERT crates build
/// their configs from it): tiny CPU sizes, the GPT-2 family, Megatron-LM's large GPTs, and
/// BERT's base and large shapes (on the GPT-2 BPE vocabulary plus `[MASK]`), and
/// mixture-of-experts GPTs: two tiny ones for tests, Mixtral 8x7B's and DeepSeekMoE 16B's
/// sizes (with this GPT's attention: no grouped-query attention, learned positions, a tied
/// output layer, so their counts differ from the published 46.7B and 16.4B). A name may exist
/// for both kinds (`tiny`, `mini`).
pub const PRESETS: &[(&str, TransformerShape)] = &[
    ("tiny", TransformerShape::gpt(2, 64, 4, 32, 512)),
    ("mini", TransformerShape::gpt(4, 128, 4, 128, 50257)),
    ("gpt2", TransformerShape::gpt(12, 768, 12, 1024, 50257)),
    (
        "gpt2-medium",
        TransformerShape::gpt(24, 1024, 16, 1024, 50257),
    ),
    (
        "gpt2-large",
        TransformerShape::gpt(36, 1280, 20, 1024, 50257),
    ),
    ("gpt2-xl", TransformerShape::gpt(48, 1600, 25, 1024, 50257)),
    ("gpt-1.5b", TransformerShape::gpt(48, 1600, 32, 1024, 51200)),
    ("gpt-2.5b", TransformerShape::gpt(54, 1920, 20, 1024, 51200)),
    ("gpt-8.3b", TransformerShape::gpt(72, 3072, 32, 1024, 51200)),
    ("gpt-20b", TransformerShape::gpt(44, 6144, 64, 2048, 51200)),
    (
        "moe-tiny",
        TransformerShape::gpt(2, 64, 4, 32, 512).with_moe(MoeShape::new(4, 2, 128)),
    ),
    (
        "moe-tiny-shared",
        TransformerShape::gpt(2, 64, 4, 32, 512).with_moe(MoeShape::new(8, 2, 64).with_shared(1)),
    ),
    (
        "mixtral-8x7b",
        TransformerShape::gpt(32, 4096, 32, 4096, 32000)
            .with_moe(MoeShape::new(8, 2, 14336).with_swiglu()),
    ),
    (
        "deepseek-moe-16b",
        TransformerShape::gpt(28, 2048, 16, 4096, 102400)
            .with_moe(MoeShape::new(64, 6, 1408).with_shared(2).with_swiglu()),
    ),
    ("tiny", TransformerShape::bert(2, 64, 4, 32, 512)),
    (
        "mini",
        TransformerShape::bert(4, 128, 4, 128, BPE_VOCAB_WITH_MASK),
    ),
    (
        "bert-base",
        TransformerShape::bert(12, 768, 12, 512, BPE_VOCAB_WITH_MASK),
    ),
    (
        "bert-large",
        TransformerShape::bert(24, 1024, 16, 512, BPE_VOCAB_WITH_MASK),
    ),
];

impl TransformerShape {
    /// A GPT shape.
    pub const fn gpt(layers: usize, hidden: usize, heads: usize, seq: usize, vocab: usize) -> Self {
        TransformerShape {
            kind: ModelKind::Gpt,
            layers,
            hidden,
            heads,
            seq,
            vocab,
            moe: None,
            mtp_depth: 0,
        }
    }

    /// A BERT shape.
    pub const fn bert(
        layers: usize,
        hidden: usize,
        heads: usize,
        seq: usize,
        vocab: usize,
    ) -> Self {
        TransformerShape {
            kind: ModelKind::Bert,
            layers,
            hidden,
            heads,
            seq,
            vocab,
            moe: None,
            mtp_depth: 0,
        }
    }

    /// The same shape with mixture-of-experts layers `moe`.
    pub const fn with_moe(self, moe: MoeShape) -> Self {
        TransformerShape {
            moe: Some(moe),
            ..self
        }
    }

    /// The same shape with `depth` multi-token-prediction depths.
    pub const fn with_mtp(self, depth: usize) -> Self {
        TransformerShape {
            mtp_depth: depth,
            ..self
        }
    }

    /// A preset by name (see [`PRESETS`]); the GPT one where both kinds have the name.
    pub fn preset(name: &str) -> Option<Self> {
        PRESETS.iter().find(|p| p.0 == name).map(|p| p.1)
    }

    /// The preset `name` of kind `kind`.
    pub fn preset_of(kind: ModelKind, name: &str) -> Option<Self> {
        PRESETS
            .iter()
            .find(|p| p.0 == name && p.1.kind == kind)
            .map(|p| p.1)
    }

    /// The preset names of kind `kind`, comma-separated (for error messages).
    pub fn preset_names(kind: ModelKind) -> String {
        let names: Vec<&str> = PRESETS
            .iter()
            .filter(|p| p.1.kind == kind)
            .map(|p| p.0)
            .collect();
        names.join(", ")
    }

    /// Checks that every field is positive, that `heads` divides `hidden` and that the
    /// parameter count fits in 64 bits (so no count derived from the shape overflows).
    pub fn validate(&self) -> Result<(), ModelSpecError> {
        for (field, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("seq", self.seq),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(ModelSpecError::BadValue {
                    field: field.to_string(),
                    value: "0".to_string(),
                });
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(ModelSpecError::HeadsDoNotDivide {
                hidden: self.hidden,
                heads: self.heads,
            });
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.layers)?;
        }
        let most = MAX_MTP_DEPTH.min(self.seq.saturating_sub(1));
        if self.mtp_depth > most {
            return Err(ModelSpecError::Mtp {
                depth: self.mtp_depth,
                most,
                seq: self.seq,
            });
        }
        if self.checked_params().is_none() {
            return Err(ModelSpecError::TooLarge {
                shape: self.to_string(),
            });
        }
        Ok(())
    }

    /// The exact parameter count (saturating at `u64::MAX`; see
    /// [`checked_params`](Self::checked_params)). GPT: `12 l h² + 13 l h + (V + s) h + 2 h`;
    /// BERT: `12 l h² + 13 l h + (V + s) h + h² + 5 h`; a MoE block instead of a dense one:
    /// `4 h² + 8 h + h E + (E + S) P_e` (`P_e` the parameters of one expert,
    /// [`MoeShape::checked_expert_params`]).
    pub fn params(&self) -> u64 {
        self.checked_params().unwrap_or(u64::MAX)
    }

    /// The parameters a token uses (saturating): those of [`params`](Self::params) with `top_k`
    /// routed experts per MoE block instead of all of them (the same for a dense model).
    pub fn active_params(&self) -> u64 {
        self.counted_params(true).unwrap_or(u64::MAX)
    }

    /// The exact parameter count, `None` when it does not fit in a `u64`. Every per-unit count
    /// of the planner (a block's `12 h² + 13 h`, the embedding's `(V + s) h`) is at most this,
    /// so a shape that passes [`validate`](Self::validate) overflows none of them.
    pub fn checked_params(&self) -> Option<u64> {
        self.counted_params(false)
    }

    /// The parameters of the model, with only the `top_k` routed experts of a MoE block when
    /// `active`; `None` beyond 64 bits.
    fn counted_params(&self, active: bool) -> Option<u64> {
        let (l, h, v, s) = (
            self.layers as u64,
            self.hidden as u64,
            self.vocab as u64,
            self.seq as u64,
        );
        let h2 = h.checked_mul(h)?;
        let block = h2.checked_mul(12)?.checked_add(h.checked_mul(13)?)?;
        let table = v.checked_add(s)?.checked_mul(h)?;
        let extra = match self.kind {
            ModelKind::Gpt => h.checked_mul(2)?,
            ModelKind::Bert => h2.checked_add(h.checked_mul(5)?)?,
        };
        let blocks = match &self.moe {
            None => l.checked_mul(block)?,
            Some(moe) => {
                let moe_layers = moe.moe_layers(self.layers) as u64;
                let used = if active { moe.top_k } else { moe.experts };
                let moe_blocks = moe_layers.checked_mul(moe.checked_block_params(h, used)?)?;
                (l - moe_layers)
                    .checked_mul(block)?
                    .checked_add(moe_blocks)?
            }
        };
        // Each multi-token-prediction depth: a block, the `[2h, h]` projection, three
        // LayerNorms.
        let depth = h2.checked_mul(14)?.checked_add(h.checked_mul(19)?)?;
        let mtp = (self.mtp_depth as u64).checked_mul(depth)?;
        blocks
            .checked_add(table)?
            .checked_add(extra)?
            .checked_add(mtp)
    }

    /// The Megatron-LM FLOPs of one iteration of `global_batch` sequences (Narayanan et al.):
    /// `96 B s l h² (1 + s/(6h) + V/(16 l h))` with full recomputation, otherwise
    /// `72 B s l h² (1 + s/(6h) + V/(12 l h))`.
    pub fn megatron_flops(&self, global_batch: usize, full_recompute: bool) -> f64 {
        let (b, s, l, h, v) = (
            global_batch as f64,
            self.seq as f64,
            self.layers as f64,
            self.hidden as f64,
            self.vocab as f64,
        );
        if full_recompute {
            96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
        } else {
            72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
        }
    }
}

impl fmt::Display for TransformerShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ModelKind::Gpt => "gpt",
            ModelKind::Bert => "bert",
        };
        write!(
            f,
            "{kind}:layers={},hidden={},heads={},seq={},vocab={}",
            self.layers, self.hidden, self.heads, self.seq, self.vocab
        )?;
        if let Some(moe) = &self.moe {
            f.write_str(&moe.spec_fields())?;
        }
        match self.mtp_depth {
            0 => Ok(()),
            depth => write!(f, ",mtp={depth}"),
        }
    }
}

/// The names a model spec resolves, each once (a name both kinds have is the GPT preset).
fn preset_spec_names() -> String {
    let mut names: Vec<&str> = Vec::new();
    for (name, _) in PRESETS {
        if !names.contains(name) {
            names.push(name);
        }
    }
    names.join(", ")
}

impl FromStr for TransformerShape {
    type Err = ModelSpecError;

    /// Parses a preset name or `gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..` (or `bert:`).
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let spec = spec.trim();
        if let Some(shape) = TransformerShape::preset(spec) {
            return Ok(shape);
        }
        let Some((kind, fields)) = spec.split_once(':') else {
            return Err(ModelSpecError::Unknown {
                spec: spec.to_string(),
                known: preset_spec_names(),
            });
        };
        let kind = match kind.trim() {
            "gpt" => ModelKind::Gpt,
            "bert" => ModelKind::Bert,
            other => {
                return Err(ModelSpecError::Kind {
                    kind: other.to_string(),
                });
            }
        };
        let values = spec_values(fields)?;
        const NAMES: [&str; SPEC_FIELDS.len()] = SPEC_FIELDS;
        let get = |i: usize| {
            values[i]
                .map(|(v, _)| v)
                .ok_or(ModelSpecError::Missing { field: NAMES[i] })
        };
        let shape = TransformerShape {
            kind,
            layers: get(0)?,
            hidden: get(1)?,
            heads: get(2)?,
            seq: get(3)?,
            vocab: get(4)?,
            moe: None,
            mtp_depth: 0,
        };
        let optional = |i: usize, default: usize| values[i].map_or(default, |(v, _)| v);
        let shape = shape.with_mtp(optional(MTP_FIELD, 0));
        let moe_given = values[5..MTP_FIELD].iter().any(Option::is_some);
        if !moe_given {
            shape.validate()?;
            return Ok(shape);
        }
        let swiglu = optional(9, 0);
        if swiglu > 1 {
            return Err(ModelSpecError::Moe {
                field: "swiglu",
                value: swiglu,
                rule: "must be 0 or 1".into(),
            });
        }
        let moe = MoeShape {
            experts: get(5)?,
            top_k: get(6)?,
            expert_hidden: get(7)?,
            shared_experts: optional(8, 0),
            swiglu: swiglu == 1,
            every: optional(10, 1),
            max_load: super::EXPERT_LOAD_BOUND,
            imbalance_pct: optional(11, super::EXPERT_IMBALANCE_PCT),
        };
        let shape = shape.with_moe(moe);
        shape.validate()?;
        Ok(shape)
    }
}

/// The values of an inline spec's `key=value` items, by their place in [`SPEC_FIELDS`], each
/// with its text; refused: an item without `=`, an unknown or repeated field, a value that is
/// not a count (0 only for the optional fields).
fn spec_values(fields: &str) -> Result<[Option<(usize, &str)>; SPEC_FIELDS.len()], ModelSpecError> {
    let mut values: [Option<(usize, &str)>; SPEC_FIELDS.len()] = [None; SPEC_FIELDS.len()];
    for item in fields.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            return Err(ModelSpecError::Item {
                item: item.to_string(),
            });
        };
        let key = key.trim();
        let Some(index) = SPEC_FIELDS.iter().position(|n| *n == key) else {
            return Err(ModelSpecError::UnknownField {
                field: key.to_string(),
            });
        };
        let parsed = value
            .trim()
            .replace('_', "")
            .parse::<usize>()
            .ok()
            .filter(|&v| v > 0 || index >= FIRST_ZERO_FIELD)
            .ok_or_else(|| ModelSpecError::BadValue {
                field: key.to_string(),
                value: value.trim().to_string(),
            })?;
        if let Some((_, first)) = values[index] {
            return Err(ModelSpecError::Duplicate {
                field: key.to_string(),
                first: first.trim().to_string(),
                second: value.trim().to_string(),
            });
        }
        values[index] = Some((parsed, value));
    }
    Ok(values)
}

/// The fields of an inline model spec: the shape's, then the mixture of experts' (`experts`,
/// `top_k` and `expert_hidden` given together; `shared`, `swiglu`, `moe_every` and `imbalance`,
/// the busiest expert-parallel rank's expected load in percent of the mean, optional), then
/// the multi-token-prediction depths (`mtp`, optional, 0 by default).
const SPEC_FIELDS: [&str; 13] = [
    "layers",
    "hidden",
    "heads",
    "seq",
    "vocab",
    "experts",
    "top_k",
    "expert_hidden",
    "shared",
    "swiglu",
    "moe_every",
    "imbalance",
    "mtp",
];

/// The place of `mtp` in [`SPEC_FIELDS`].
const MTP_FIELD: usize = 12;

/// The most multi-token-prediction depths a GPT takes (`model.mtp_depth`).
pub const MAX_MTP_DEPTH: usize = 8;

/// The first of [`SPEC_FIELDS`] that may be 0 (`shared`, `swiglu`).
const FIRST_ZERO_FIELD: usize = 8;

impl LayerCosts for TransformerShape {
    fn name(&self) -> String {
        self.to_string()
    }

    fn unit_profiles(&self) -> Vec<UnitProfile> {
        let [embedding, block, head] = self.distinct_units();
        let mut units = Vec::with_capacity(self.layers + 2);
        units.push(embedding);
        match (&self.moe, self.moe_block()) {
            (Some(moe), Some(moe_block)) => units.extend((0..self.layers).map(|layer| {
                if moe.is_moe_layer(layer) {
                    moe_block.clone()
                } else {
                    block.clone()
                }
            })),
            _ => units.extend(std::iter::repeat_n(block, self.layers)),
        }
        units.push(head);
        units
    }

    fn heads(&self) -> usize {
        self.heads
    }

    fn pp_message_elements(&self) -> f64 {
        self.seq as f64 * self.hidden as f64
    }
}

impl TransformerShape {
    /// The profile of a MoE block of this shape (`None` for a dense model): see
    /// [`MoeShape`]'s module.
    pub fn moe_block(&self) -> Option<UnitProfile> {
        (self.moe.as_ref()).map(|moe| moe.block(self.seq, self.hidden, self.heads))
    }

    /// Each distinct unit of the shape with how many times the model has it: the embedding,
    /// the dense blocks, the MoE blocks (when there are any) and the head, in that order. Sums
    /// over the model can be taken from these without building the per-unit list.
    pub fn counted_units(&self) -> Vec<(UnitProfile, usize)> {
        let [embedding, block, head] = self.distinct_units();
        let moe_layers = self.moe.map_or(0, |moe| moe.moe_layers(self.layers));
        let mut units = vec![(embedding, 1), (block, self.layers - moe_layers)];
        units.extend(self.moe_block().map(|unit| (unit, moe_layers)));
        units.push((head, 1));
        units
    }

    /// The shape's sizes as the profiles use them (counts saturating: a shape that passed
    /// `validate` has no product near the limit, and one that did not must not panic here).
    fn dims(&self) -> Dims {
        let hu = self.hidden as u64;
        Dims {
            s: self.seq as f64,
            h: self.hidden as f64,
            a: self.heads as f64,
            v: self.vocab as f64,
            hu,
            su: self.seq as u64,
            vu: self.vocab as u64,
            hu2: hu.saturating_mul(hu),
            bert: self.kind == ModelKind::Bert,
        }
    }

    /// The three distinct units of the shape: the embedding, a transformer block (every block
    /// is the same) and the head. [`LayerCosts::unit_profiles`] is the embedding, `layers`
    /// blocks and the head; sums over a dense model can be taken from these three without
    /// building the per-unit list ([`counted_units`](Self::counted_units) adds a MoE shape's
    /// blocks, see `merak_burn::admission::estimate_shape`).
    pub fn distinct_units(&self) -> [UnitProfile; 3] {
        [
            self.embedding_profile(),
            self.block_profile(),
            self.head_profile(),
        ]
    }

    /// The embedding unit: the token table (split by TP) and the positions.
    fn embedding_profile(&self) -> UnitProfile {
        let Dims {
            s,
            h,
            hu,
            su,
            vu,
            bert,
            ..
        } = self.dims();
        UnitProfile {
            params_split: vu.saturating_mul(hu),
            params_replicated: su.saturating_mul(hu).saturating_add(if bert {
                hu.saturating_mul(2)
            } else {
                0
            }),
            // Dropout mask of the embedding output (1 byte per value).
            act_replicated: s * h,
            act_full: s * h,
            tp_forward_allreduces: 1,
            tp_allreduce_elements: s * h,
            // Position add and dropout: read two, write one 16-bit value, a 1-byte mask.
            memory_replicated: 7.0 * s * h,
            ..UnitProfile::default()
        }
    }

    /// A transformer block (attention and MLP).
    fn block_profile(&self) -> UnitProfile {
        let Dims {
            s, h, a, hu, hu2, ..
        } = self.dims();
        UnitProfile {
            // QKV (3h² + 3h), attention output weight, MLP (8h² + 4h bias of the first layer).
            params_split: hu2.saturating_mul(12).saturating_add(hu.saturating_mul(7)),
            // Attention-output and second MLP biases, two LayerNorms.
            params_replicated: hu.saturating_mul(6),
            params_tied: 0,
            forward_flops: 24.0 * s * h * h + 4.0 * s * s * h,
            backward_flops: 2.0 * (24.0 * s * h * h + 4.0 * s * s * h),
            selective_recompute_flops: 2.0 * s * s * h,
            recomputable: true,
            act_replicated: 10.0 * s * h,
            act_split: 24.0 * s * h,
            act_attention: 5.0 * a * s * s,
            act_full: BYTES_16BIT * s * h,
            tp_forward_allreduces: 2,
            tp_backward_allreduces: 2,
            tp_allreduce_elements: s * h,
            // 16-bit values: two LayerNorms (read, write) and two fused bias-dropout-adds (read
            // two, write one, a 1-byte mask): 11 values of s h.
            memory_replicated: BYTES_16BIT * 11.0 * s * h,
            // The fused bias and GeLU on the MLP's 4h: read and write.
            memory_split: BYTES_16BIT * 8.0 * s * h,
            // a s² scores: written by Q Kᵀ, fused scale-mask-softmax (read, write), dropout
            // (read, write, 1-byte mask), read by the product with V: 6.5 values each.
            memory_attention: BYTES_16BIT * 6.5 * a * s * s,
            // Q Kᵀ and the product with V.
            attention_flops: 4.0 * s * s * h,
            kv_elements: 2.0 * s * h,
            ..UnitProfile::default()
        }
    }

    /// The head: the final LayerNorm (BERT: its transform) and the output layer over the tied table.
    fn head_profile(&self) -> UnitProfile {
        self.with_mtp_depths(self.head_only_profile())
    }

    /// The head unit with the multi-token-prediction depths: each a block (kept whole: the
    /// head is not recomputed; its context-parallel ring as a block's), its `[2h, h]`
    /// projection and three LayerNorms, an embedding lookup and a pass through the shared
    /// output head.
    fn with_mtp_depths(&self, head: UnitProfile) -> UnitProfile {
        if self.mtp_depth == 0 {
            return head;
        }
        let Dims {
            s, h, v, hu, hu2, ..
        } = self.dims();
        let block = self.block_profile();
        let (n, nu) = (self.mtp_depth as f64, self.mtp_depth as u64);
        let extra_flops = 4.0 * s * h * h + 2.0 * s * h * v;
        let depth_params = block.params_replicated + 2 * hu2 + 6 * hu;
        let depths = nu as u32;
        UnitProfile {
            params_split: head.params_split + nu.saturating_mul(block.params_split),
            params_replicated: head.params_replicated + nu.saturating_mul(depth_params),
            forward_flops: head.forward_flops + n * (block.forward_flops + extra_flops),
            backward_flops: head.backward_flops + n * (block.backward_flops + 2.0 * extra_flops),
            act_replicated: head.act_replicated + n * (block.act_replicated + 8.0 * s * h),
            act_split: head.act_split + n * (block.act_split + 4.0 * s * v),
            act_attention: head.act_attention + n * block.act_attention,
            tp_forward_allreduces: head.tp_forward_allreduces
                + depths * (block.tp_forward_allreduces + 1),
            tp_backward_allreduces: head.tp_backward_allreduces
                + depths * (block.tp_backward_allreduces + 1),
            memory_replicated: head.memory_replicated + n * block.memory_replicated,
            memory_split: head.memory_split + n * (block.memory_split + 12.0 * s * v),
            memory_attention: head.memory_attention + n * block.memory_attention,
            attention_flops: head.attention_flops + n * block.attention_flops,
            // Under context parallelism each depth's attention passes its keys and values
            // around the ring as a block's does (priced as one ring of their sum).
            kv_elements: head.kv_elements + n * block.kv_elements,
            ..head
        }
    }

    /// The head unit without multi-token prediction.
    fn head_only_profile(&self) -> UnitProfile {
        let Dims {
            s,
            h,
            v,
            hu,
            vu,
            hu2,
            bert,
            ..
        } = self.dims();
        let dense = if bert { 2.0 * s * h * h } else { 0.0 };
        UnitProfile {
            params_split: 0,
            params_replicated: if bert {
                hu2.saturating_add(hu.saturating_mul(3))
            } else {
                hu.saturating_mul(2)
            },
            params_tied: vu.saturating_mul(hu),
            forward_flops: 2.0 * s * h * v + dense,
            backward_flops: 2.0 * (2.0 * s * h * v + dense),
            selective_recompute_flops: 0.0,
            recomputable: false,
            // Final LayerNorm and output-layer inputs; fp32 logits for the loss (split by TP).
            act_replicated: 4.0 * s * h,
            act_split: 4.0 * s * v,
            act_attention: 0.0,
            act_full: 0.0,
            tp_forward_allreduces: 0,
            tp_backward_allreduces: 1,
            tp_allreduce_elements: s * h,
            // The final LayerNorm (read, write); the loss reads the fp32 logits three times
            // (maximum, exponentials and sum, target).
            memory_replicated: BYTES_16BIT * 2.0 * s * h,
            memory_split: 12.0 * s * v,
            memory_attention: 0.0,
            attention_flops: 0.0,
            kv_elements: 0.0,
            ..UnitProfile::default()
        }
    }
}

/// A shape's sizes ([`TransformerShape::dims`]): sequence, hidden, heads and vocabulary as
/// `f64`, hidden, sequence and vocabulary as counts, the hidden size squared, and whether the
/// model is a BERT.
struct Dims {
    s: f64,
    h: f64,
    a: f64,
    v: f64,
    hu: u64,
    su: u64,
    vu: u64,
    hu2: u64,
    bert: bool,
}

/// The planner's view of a model: one [`UnitProfile`] per pipeline unit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProxy {
    /// A short name for reports.
    pub name: String,
    /// The transformer shape, when the proxy was built from one.
    pub shape: Option<TransformerShape>,
    /// Attention heads (the TP degree must divide them).
    pub heads: usize,
    /// Elements per sequence of the activation between pipeline stages.
    pub pp_message_elements: f64,
    /// One profile per unit.
    pub units: Vec<UnitProfile>,
}

impl ModelProxy {
    /// The proxy of a GPT or BERT shape.
    pub fn from_shape(shape: TransformerShape) -> Self {
        let mut proxy = ModelProxy::from_costs(&shape);
        proxy.shape = Some(shape);
        proxy
    }

    /// The proxy of any model that describes itself through [`LayerCosts`].
    pub fn from_costs(model: &dyn LayerCosts) -> Self {
        ModelProxy {
            name: model.name(),
            shape: None,
            heads: model.heads(),
            pp_message_elements: model.pp_message_elements(),
            units: model.unit_profiles(),
        }
    }

    /// Parses a preset name or inline spec (see [`TransformerShape`]'s [`FromStr`]).
    pub fn parse(spec: &str) -> Result<Self, ModelSpecError> {
        Ok(ModelProxy::from_shape(spec.parse()?))
    }

    /// Whether a micro-batch of `micro_batch` sequences splits into `chunks` equal token chunks
    /// (sub-pipelined tensor parallelism); always for a model without a transformer shape (a
    /// user's own model splits as it likes). `Err` carries the tokens per micro-batch.
    pub fn splits_tokens(&self, micro_batch: usize, chunks: usize) -> Result<(), usize> {
        self.splits_tokens_on(micro_batch, chunks, RankSplit::from(1))
    }

    /// [`splits_tokens`](Self::splits_tokens) for the tokens one rank of `split` holds: the
    /// `b s / cp` of its micro-batch, and under sequence parallelism the `s / (cp tp)`
    /// positions of each sequence a TP rank holds (what `merak train` checks). `Err` carries
    /// those tokens.
    pub fn splits_tokens_on(
        &self,
        micro_batch: usize,
        chunks: usize,
        split: RankSplit,
    ) -> Result<(), usize> {
        let Some(shape) = &self.shape else {
            return Ok(());
        };
        let per_rank = shape.seq / split.cp.max(1);
        let tokens = if split.sequence_parallel {
            per_rank / split.tp.max(1)
        } else {
            micro_batch * per_rank
        };
        if tokens.is_multiple_of(chunks) {
            Ok(())
        } else {
            Err(tokens)
        }
    }

    /// The number of units (`L + 2` for a transformer).
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// All parameters (tied copies counted once).
    pub fn params(&self) -> u64 {
        self.units
            .iter()
            .map(UnitProfile::params)
            .fold(0, u64::saturating_add)
    }

    /// Forward plus backward (plus recomputation under `mode` for every unit) FLOPs of
    /// `global_batch` sequences, summed over units.
    pub fn flops_per_iteration(&self, global_batch: usize, mode: RecomputeMode) -> f64 {
        self.units
            .iter()
            .map(|u| {
                u.forward_flops(global_batch)
                    + u.backward_flops(global_batch)
                    + u.recompute_flops(global_batch, mode)
            })
            .sum()
    }

    /// Bytes of one activation (or gradient) message between pipeline stages for a micro-batch
    /// of `b` sequences (16-bit values), whole.
    pub fn pp_message_bytes(&self, b: usize) -> f64 {
        self.pp_message_elements * b as f64 * BYTES_16BIT
    }

    /// Bytes one rank of `split` sends of that message: its `s/cp` tokens, and under sequence
    /// parallelism its `1/tp` of them (the slices travel between matching TP ranks).
    pub fn pp_message_bytes_per_rank(&self, b: usize, split: RankSplit) -> f64 {
        self.pp_message_bytes(b) / split.c() / split.replicated_divisor()
    }

    /// The sequence length, when the proxy has a transformer shape.
    pub fn seq(&self) -> Option<usize> {
        self.shape.map(|shape| shape.seq)
    }

    /// Whether `split` can cut a sequence of this model: `2 cp` divides it (two zigzag chunks
    /// per rank), and under sequence parallelism `tp > 1` divides the `s/cp` tokens a rank
    /// holds. Always for a model without a transformer shape when `cp = 1` and sequence
    /// parallelism is off; never with either for such a model (its length is unknown).
    /// `Err` carries the sequence length (0 when unknown).
    pub fn splits_sequence(&self, split: RankSplit) -> Result<(), usize> {
        let plain = split.cp <= 1 && !split.sequence_parallel;
        let Some(seq) = self.seq() else {
            return if plain { Ok(()) } else { Err(0) };
        };
        let cp = split.cp.max(1);
        let zigzag = cp == 1 || seq.is_multiple_of(2 * cp);
        let sp = !split.sequence_parallel || (split.tp > 1 && (seq / cp).is_multiple_of(split.tp));
        if zigzag && sp { Ok(()) } else { Err(seq) }
    }

    /// The routed experts of a MoE layer (`None` for a dense model or one without a shape).
    pub fn experts(&self) -> Option<usize> {
        self.shape
            .and_then(|shape| shape.moe)
            .map(|moe| moe.experts)
    }

    /// The FLOP count used to report TFLOP/s: the Megatron formula of the shape when there is
    /// one (full-recompute form when `full_recompute`), otherwise the proxy's own sum (and for
    /// a mixture of experts, the FLOPs of the experts a token uses).
    pub fn reported_flops(&self, global_batch: usize, full_recompute: bool) -> f64 {
        match self.shape {
            Some(shape) if shape.moe.is_none() => {
                shape.megatron_flops(global_batch, full_recompute)
            }
            _ => self.flops_per_iteration(
                global_batch,
                if full_recompute {
                    RecomputeMode::Full
                } else {
                    RecomputeMode::None
                },
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs().max(1e-300)
    }

    #[test]
    fn an_unknown_model_lists_each_preset_once() {
        let e = "xyz".parse::<TransformerShape>().unwrap_err().to_string();
        let list = e.split(['(', ')']).nth(1).unwrap_or_default();
        let names: Vec<&str> = list.split(", ").collect();
        assert_eq!(names.iter().filter(|&&n| n == "tiny").count(), 1, "{e}");
        assert!(
            names.contains(&"moe-tiny") && names.contains(&"mixtral-8x7b"),
            "{e}"
        );
        assert!(e.contains("gpt2-medium") && e.contains("bert-large"), "{e}");
    }

    #[test]
    fn preset_params_equal_the_formula() {
        let dense_gpts = PRESETS.iter().filter(|p| p.1.kind == ModelKind::Gpt);
        for &(name, shape) in dense_gpts.filter(|p| p.1.moe.is_none()) {
            let (l, h, s, v) = (shape.layers, shape.hidden, shape.seq, shape.vocab);
            let proxy = ModelProxy::parse(name).unwrap();
            let (l, h, s, v) = (l as u64, h as u64, s as u64, v as u64);
            let formula = 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h;
            assert_eq!(proxy.params(), formula, "{name}");
            assert_eq!(proxy.num_units(), l as usize + 2);
        }
        // GPT-2 small: the well-known 124M (with a 1024 position table).
        assert_eq!(ModelProxy::parse("gpt2").unwrap().params(), 124_439_808);
    }

    /// Issue 32: the mixture-of-experts presets' parameters, all of them and those a token
    /// uses. Mixtral 8x7B publishes 46.7B and 12.9B, DeepSeekMoE 16B 16.4B and 2.8B: this GPT
    /// has no grouped-query attention (more attention parameters), learned positions and a
    /// tied output layer, and DeepSeekMoE's first layer is dense.
    #[test]
    fn moe_presets_count_all_and_active_parameters() {
        for (name, total, active) in [
            ("moe-tiny", 201_856, 135_552),
            ("moe-tiny-shared", 219_520, 119_680),
            ("mixtral-8x7b", 47_394_594_816, 13_571_727_360),
            ("deepseek-moe-16b", 16_678_588_416, 2_629_767_168),
        ] {
            let shape = TransformerShape::preset(name).unwrap();
            assert!(name.contains("moe") || name.contains("mixtral"), "{name}");
            shape.validate().unwrap();
            assert_eq!(
                (shape.params(), shape.active_params()),
                (total, active),
                "{name}"
            );
            assert_eq!(ModelProxy::from_shape(shape).params(), total, "{name}");
        }
        // The formula, for moe-tiny: 2 (4h² + 8h + hE + E (2hf + f + h)) + (V + s) h + 2h.
        let (h, e, f) = (64u64, 4u64, 128u64);
        let block = 4 * h * h + 8 * h + h * e + e * (2 * h * f + f + h);
        assert_eq!(2 * block + (512 + 32) * h + 2 * h, 201_856);
        // A dense model uses all of its parameters.
        let gpt2 = TransformerShape::preset("gpt2").unwrap();
        assert_eq!(gpt2.active_params(), gpt2.params());
    }

    /// Inline specs with multi-token prediction (`mtp`): the depths reach the shape, also
    /// beside a mixture of experts, the spec printed back parses to the same shape, and too
    /// many depths are refused naming the field and the bound.
    #[test]
    fn mtp_specs_parse_print_back_and_are_bounded() {
        let base = "gpt:layers=4,hidden=128,heads=4,seq=128,vocab=50257";
        let shape: TransformerShape = format!("{base},mtp=2").parse().unwrap();
        assert_eq!(
            shape,
            TransformerShape::gpt(4, 128, 4, 128, 50257).with_mtp(2)
        );
        assert_eq!(shape.to_string(), format!("{base},mtp=2"));
        assert_eq!(
            shape.to_string().parse::<TransformerShape>().unwrap(),
            shape
        );
        let plain: TransformerShape = format!("{base},mtp=0").parse().unwrap();
        assert_eq!(plain.to_string(), base);
        let moe = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100,experts=4,top_k=1,\
                   expert_hidden=32,mtp=1";
        let moe: TransformerShape = moe.parse().unwrap();
        assert_eq!((moe.mtp_depth, moe.moe.map(|m| m.experts)), (1, Some(4)));
        let err = format!("{base},mtp=9")
            .parse::<TransformerShape>()
            .unwrap_err();
        assert!(
            err.to_string().contains("`mtp` = 9 must be at most 8"),
            "{err}"
        );
        let short = "gpt:layers=4,hidden=128,heads=4,seq=4,vocab=100,mtp=4";
        let err = short.parse::<TransformerShape>().unwrap_err();
        assert!(err.to_string().contains("at most 3"), "{err}");
    }

    /// Inline MoE specs: every `moe_every` layers a MoE block, shared experts and SwiGLU
    /// optional, the spec printed back parses to the same shape; fields out of range are
    /// refused naming them.
    #[test]
    fn moe_specs_parse_and_place_their_blocks() {
        let spec = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100,experts=4,top_k=1,\
                    expert_hidden=32,shared=1,swiglu=1,moe_every=2";
        let shape: TransformerShape = spec.parse().unwrap();
        let moe = shape.moe.unwrap();
        assert_eq!(
            moe,
            MoeShape::new(4, 1, 32)
                .with_shared(1)
                .with_swiglu()
                .with_every(2)
        );
        assert_eq!(
            shape.to_string().parse::<TransformerShape>().unwrap(),
            shape
        );
        let units = shape.unit_profiles();
        let moe_blocks: Vec<usize> = (0..units.len())
            .filter(|&i| units[i].params_expert > 0)
            .collect();
        assert_eq!(moe_blocks, vec![2, 4]);
        // 4 routed SwiGLU experts of 3 h f each in a block; the shared one is replicated.
        assert_eq!(units[2].params_expert, 4 * 3 * 64 * 32);
        let counted: u64 = (shape.counted_units().iter())
            .map(|(u, n)| u.params() * *n as u64)
            .sum();
        assert_eq!(counted, shape.params());
        assert_eq!(ModelProxy::from_shape(shape).experts(), Some(4));
        let err = |s: &str| s.parse::<TransformerShape>().unwrap_err().to_string();
        let base = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100";
        assert!(
            err(&format!("{base},experts=4,top_k=5,expert_hidden=8"))
                .contains("`top_k` = 5 must be at most `experts` = 4")
        );
        assert!(err(&format!("{base},experts=4,top_k=2")).contains("`expert_hidden`"));
        assert!(err(&format!("{base},shared=1")).contains("`experts` is missing"));
        assert!(
            err(&format!(
                "{base},experts=4,top_k=2,expert_hidden=8,swiglu=2"
            ))
            .contains("`swiglu` = 2 must be 0 or 1")
        );
        assert!(
            err(&format!(
                "{base},experts=4,top_k=2,expert_hidden=8,moe_every=5"
            ))
            .contains("`moe_every` = 5 must be between 1 and `layers` = 4")
        );
        // The expected imbalance, in percent of the mean load: at least 100; written back
        // when it is not the default.
        let e = err(&format!(
            "{base},experts=4,top_k=2,expert_hidden=8,imbalance=99"
        ));
        assert!(
            e.contains("`imbalance` = 99 must be between 100 and 6400"),
            "{e}"
        );
        let spec = format!("{base},experts=4,top_k=2,expert_hidden=8,imbalance=135");
        let shape: TransformerShape = spec.parse().unwrap();
        let moe = shape.moe.unwrap();
        assert_eq!((moe.imbalance_pct, moe.imbalance()), (135, 1.35));
        assert_eq!(
            shape.to_string().parse::<TransformerShape>().unwrap(),
            shape
        );
        let default: TransformerShape = format!("{base},experts=4,top_k=2,expert_hidden=8")
            .parse()
            .unwrap();
        assert_eq!(default.moe.unwrap().imbalance_pct, EXPERT_IMBALANCE_PCT);
        assert!(!default.to_string().contains("imbalance"));
    }

    /// A MoE block's FLOPs: attention `8 s h² + 4 s² h`, router `2 s h E`, and `(k + S)`
    /// experts' `2 M s h f` (M = 3 matrices for SwiGLU); the routed part is `expert_flops`.
    /// Its activations: the routed experts' `k s (4h + 8f)` bytes (SwiGLU) beside the rest,
    /// `load` times that for the busiest rank under expert parallelism, none under full
    /// recomputation (which keeps the block's input, `2 s h`).
    #[test]
    fn moe_blocks_count_the_experts_a_token_uses() {
        let shape = TransformerShape::preset("deepseek-moe-16b").unwrap();
        let block = shape.moe_block().unwrap();
        let (s, h, a, e, k, f, shared) = (4096.0, 2048.0, 16.0, 64.0, 6.0, 1408.0, 2.0);
        let expert = 2.0 * 3.0 * s * h * f;
        let forward = 8.0 * s * h * h + 4.0 * s * s * h + 2.0 * s * h * e + (k + shared) * expert;
        assert!(rel(block.forward_flops, forward) < 1e-12);
        assert!(rel(block.expert_flops, k * expert) < 1e-12);
        assert_eq!(block.backward_flops, 2.0 * block.forward_flops);
        assert_eq!(block.a2a_elements, k * s * h);
        let whole = RankSplit::new(1, 1, false);
        let routed = k * s * (4.0 * h + 8.0 * f);
        let at = |split, mode, load| block.expert_activation_bytes(2, split, mode, load);
        assert!(rel(at(whole, RecomputeMode::None, 1.5), 2.0 * routed) < 1e-12);
        // Under expert parallelism the busiest rank receives `load` times its share; under
        // sequence parallelism a TP rank routes its 1/tp of the positions.
        let ep4 = RankSplit::new(4, 1, true).with_ep(4);
        assert!(rel(at(ep4, RecomputeMode::None, 1.5), 2.0 * routed * 1.5 / 4.0) < 1e-12);
        // Selective recomputation recomputes the SwiGLU's SiLU and product (`k s 4 f`).
        let selective = k * s * (4.0 * h + 4.0 * f);
        assert!(
            rel(
                at(ep4, RecomputeMode::Selective, 1.5),
                2.0 * selective * 1.5 / 4.0
            ) < 1e-12
        );
        assert_eq!(at(ep4, RecomputeMode::Full, 1.5), 0.0);
        let rest = 10.0 * s * h + 4.0 * s * e + 2.0 * k * s * h + shared * s * 8.0 * f;
        let kept = block.activation_bytes(1, whole, RecomputeMode::None, false);
        assert!(rel(kept, rest + 8.0 * s * h + 5.0 * a * s * s) < 1e-12);
        let full = block.activation_bytes(1, whole, RecomputeMode::Full, false);
        assert!(rel(full, 2.0 * s * h) < 1e-12);
        // A MoE proxy reports the FLOPs its tokens use (no Megatron formula for it).
        let proxy = ModelProxy::from_shape(shape);
        let reported = proxy.reported_flops(8, false);
        assert!(rel(reported, proxy.flops_per_iteration(8, RecomputeMode::None)) < 1e-12);
    }

    #[test]
    fn bert_params_match_the_bert_crate() {
        let bert: TransformerShape = "bert:layers=12,hidden=768,heads=12,seq=512,vocab=50258"
            .parse()
            .unwrap();
        assert_eq!(ModelProxy::from_shape(bert).params(), 124_639_488);
        assert_eq!(bert.params(), 124_639_488);
    }

    #[test]
    fn flops_sum_to_the_megatron_formulas() {
        let specs = [
            "gpt-20b",
            "gpt2",
            "tiny",
            "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200",
        ];
        for spec in specs {
            let proxy = ModelProxy::parse(spec).unwrap();
            let shape = proxy.shape.unwrap();
            for batch in [1, 7, 512] {
                let none = proxy.flops_per_iteration(batch, RecomputeMode::None);
                let full = proxy.flops_per_iteration(batch, RecomputeMode::Full);
                assert!(
                    rel(none, shape.megatron_flops(batch, false)) < 1e-12,
                    "{spec}"
                );
                assert!(
                    rel(full, shape.megatron_flops(batch, true)) < 1e-12,
                    "{spec}"
                );
            }
        }
    }

    #[test]
    fn activations_follow_korthikanti() {
        let shape: TransformerShape = "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000"
            .parse()
            .unwrap();
        let proxy = ModelProxy::from_shape(shape);
        let block = &proxy.units[1];
        let (s, b, h, a) = (2048.0, 2.0, 1024.0, 16.0);
        for t in [1usize, 2, 8] {
            let tf = t as f64;
            let none = s * b * h * (10.0 + 24.0 / tf + 5.0 * a * s / (h * tf));
            let crate_value =
                crate::pipeline::activation_bytes_per_layer(2048, 2, 1024, 16, t, 2.0);
            assert!(
                rel(
                    block.activation_bytes(2, t, RecomputeMode::None, false),
                    none
                ) < 1e-12
            );
            assert!(rel(crate_value, none) < 1e-12);
            let sel = s * b * h * (10.0 + 24.0 / tf);
            assert!(
                rel(
                    block.activation_bytes(2, t, RecomputeMode::Selective, false),
                    sel
                ) < 1e-12
            );
            // Flash (blockwise) attention keeps no scores: what selective recomputation keeps.
            assert!(rel(block.activation_bytes(2, t, RecomputeMode::None, true), sel) < 1e-12);
            assert!(
                rel(
                    block.activation_bytes(2, t, RecomputeMode::Full, false),
                    2.0 * s * b * h
                ) < 1e-12
            );
        }
        assert_eq!(block.tp_comm_elements(2), 4.0 * b * s * h);
        assert_eq!(proxy.pp_message_bytes(2), 2.0 * b * s * h);
    }

    /// Megatron's sequence parallelism: `s b h 34/t` per block instead of `10 + 24/t`;
    /// context parallelism: `1/cp` of every term, the ring keeping no scores.
    #[test]
    fn sequence_and_context_parallelism_divide_the_activations() {
        let proxy =
            ModelProxy::parse("gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000").unwrap();
        let block = &proxy.units[1];
        let (s, b, h, a) = (2048.0, 2.0, 1024.0, 16.0);
        let split = |tp, cp, sequence_parallel| RankSplit::new(tp, cp, sequence_parallel);
        for t in [2usize, 4, 8] {
            let tf = t as f64;
            let sp = split(t, 1, true);
            let none = block.activation_bytes(2, sp, RecomputeMode::None, false);
            assert!(rel(none, s * b * h * (34.0 / tf + 5.0 * a * s / (h * tf))) < 1e-12);
            let sel = block.activation_bytes(2, sp, RecomputeMode::Selective, false);
            assert!(rel(sel, s * b * h * 34.0 / tf) < 1e-12);
            // Full recomputation keeps the block's input, which sequence parallelism splits.
            let full = block.activation_bytes(2, sp, RecomputeMode::Full, false);
            assert!(rel(full, 2.0 * s * b * h / tf) < 1e-12);
            for cp in [2usize, 4] {
                let cf = cp as f64;
                // The ring attends blockwise: no scores even without flash attention.
                let ring =
                    block.activation_bytes(2, split(t, cp, false), RecomputeMode::None, false);
                assert!(
                    rel(ring, s * b * h * (10.0 + 24.0 / tf) / cf) < 1e-12,
                    "{t} {cp}"
                );
                let both =
                    block.activation_bytes(2, split(t, cp, true), RecomputeMode::None, false);
                assert!(rel(both, s * b * h * 34.0 / (tf * cf)) < 1e-12, "{t} {cp}");
                // The head's fp32 logits and the embedding's mask: 1/cp too.
                for unit in [&proxy.units[0], &proxy.units[5]] {
                    let whole = unit.activation_bytes(2, t, RecomputeMode::None, false);
                    let part =
                        unit.activation_bytes(2, split(t, cp, false), RecomputeMode::None, false);
                    assert!(rel(part, whole / cf) < 1e-12);
                }
                // Pipeline messages: the rank's tokens, and 1/t of them under SP.
                let message = proxy.pp_message_bytes_per_rank(2, split(t, cp, true));
                assert!(rel(message, 2.0 * b * s * h / (cf * tf)) < 1e-12);
            }
        }
        // Sequence parallelism also splits the LayerNorms' and dropouts' memory traffic.
        let plain = block.forward_memory_bytes(1, 4, true);
        let sp = block.forward_memory_bytes(1, split(4, 1, true), true);
        assert!(rel(plain - sp, 2.0 * 11.0 * s * h * (1.0 - 0.25)) < 1e-12);
    }

    #[test]
    fn a_split_must_cut_the_sequence() {
        let proxy = ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=96,vocab=100").unwrap();
        let split = |tp, cp, sequence_parallel| RankSplit::new(tp, cp, sequence_parallel);
        // 2 cp | 96 for cp = 1, 2, 3, 4, 6, 8, 12, 16, 24, 48.
        assert!(proxy.splits_sequence(split(1, 48, false)).is_ok());
        assert_eq!(proxy.splits_sequence(split(1, 5, false)), Err(96));
        assert_eq!(proxy.splits_sequence(split(1, 32, false)), Err(96));
        // Sequence parallelism: tp > 1 dividing the 96 / cp tokens of a rank.
        assert!(proxy.splits_sequence(split(4, 3, true)).is_ok());
        assert_eq!(proxy.splits_sequence(split(1, 1, true)), Err(96));
        assert_eq!(proxy.splits_sequence(split(5, 2, true)), Err(96));
        // The overlap degree against a rank's tokens: 2 x 96 / 4 = 48 without SP, 96 / (4 x
        // 4) = 6 positions of a TP rank with it.
        assert_eq!(proxy.splits_tokens_on(2, 5, split(4, 4, false)), Err(48));
        assert_eq!(proxy.splits_tokens_on(2, 4, split(4, 4, true)), Err(6));
        assert!(proxy.splits_tokens_on(2, 3, split(4, 4, true)).is_ok());
        // A model without a shape: neither (its sequence length is unknown).
        let shapeless = ModelProxy::from_costs(&TransformerShape::gpt(2, 64, 4, 96, 100));
        assert!(shapeless.splits_sequence(split(4, 1, false)).is_ok());
        assert_eq!(shapeless.splits_sequence(split(1, 2, false)), Err(0));
        assert_eq!(shapeless.splits_sequence(split(2, 1, true)), Err(0));
    }

    #[test]
    fn a_field_given_twice_is_refused_naming_it() {
        let e = "gpt:layers=2,layers=4,hidden=64,heads=4,seq=32,vocab=100"
            .parse::<TransformerShape>()
            .unwrap_err();
        assert_eq!(
            e,
            ModelSpecError::Duplicate {
                field: "layers".into(),
                first: "2".into(),
                second: "4".into()
            }
        );
        assert!(e.to_string().contains("`layers` is given twice"), "{e}");
    }

    #[test]
    fn a_shape_of_more_than_2_pow_64_parameters_is_refused() {
        let spec = "gpt:layers=1000000000000,hidden=1000000,heads=4,seq=32,vocab=100";
        let e = spec.parse::<TransformerShape>().unwrap_err();
        assert!(matches!(e, ModelSpecError::TooLarge { .. }), "{e}");
        assert!(e.to_string().contains("layers=1000000000000"), "{e}");
        // Unvalidated shapes saturate instead of overflowing.
        let shape = TransformerShape::gpt(usize::MAX, usize::MAX, 1, usize::MAX, usize::MAX);
        assert_eq!(shape.params(), u64::MAX);
        assert_eq!(shape.checked_params(), None);
        for unit in shape.distinct_units() {
            assert_eq!(unit.params(), u64::MAX);
        }
        // The three distinct units are the proxy's units.
        let small = TransformerShape::bert(3, 64, 4, 32, 100);
        let units = small.unit_profiles();
        let [e, b, h] = small.distinct_units();
        assert_eq!(units, vec![e, b.clone(), b.clone(), b, h]);
    }

    #[test]
    fn spec_errors_name_the_field() {
        let err = |s: &str| s.parse::<TransformerShape>().unwrap_err().to_string();
        assert!(err("gpt:layers=2,hidden=64,heads=4,seq=32").contains("`vocab`"));
        assert!(err("gpt:layers=2,hidden=x,heads=4,seq=32,vocab=9").contains("`hidden`"));
        assert!(err("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=9,depth=3").contains("`depth`"));
        assert!(err("gpt:layers=2,hidden=64,heads=5,seq=32,vocab=9").contains("`heads` = 5"));
        assert!(err("llama:layers=2").contains("llama"));
        assert!(err("gpt-3").contains("gpt2-medium"));
        let parsed: TransformerShape = "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200"
            .parse()
            .unwrap();
        assert_eq!(
            parsed.to_string().parse::<TransformerShape>().unwrap(),
            parsed
        );
    }
}
