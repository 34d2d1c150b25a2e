//! Multi-token prediction (`model.mtp_depth`, DeepSeek-V3's MTP): after the main model, `D`
//! sequential depths, depth `k` predicting the token `k + 1` places ahead. At position `i`,
//! depth `k` joins the previous depth's hidden state (the last block's output for `k = 1`) and
//! the embedding of token `t(i + k)`, each LayerNormed, concatenated `[embedding, hidden]` and
//! projected back to the hidden size (`proj`, `[2 h, h]`, no bias), runs one transformer
//! block, and predicts `t(i + k + 1)` through its own final LayerNorm and the shared output
//! head. The embedding and the head are the model's tied token table, so they train from every
//! depth, on the head's pipeline stage through its copy of the table as the head does.
//!
//! Depth `k`'s inputs and targets are the main targets shifted left by `k - 1` and `k`
//! positions, added to the samples while the sequences are whole ([`targets`], which is what
//! lets them cross the chunks of context parallelism); the last `k` positions of a sequence
//! have no target and are left out of its loss (their inputs, from past the end, are looked
//! up as token 0: causal attention keeps them from every counted position). The training loss
//! is the main loss plus `model.mtp_loss_weight / D` times the sum of the depths' (each a mean
//! over its counted targets in the micro-batch); evaluation and generation use the main head
//! only.

use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use merak_burn::batch::DropoutPosition;
use merak_burn::comm::Group;
use merak_burn::precision::autocast;
use merak_burn::tensor_parallel::{
    InitRng, LayerNorm, ParallelBackend, TpError, TpOverlap, param_from_values, sp_param,
};

use super::Block;
use crate::GptConfig;

pub mod targets;

/// One depth of multi-token prediction (see the [module](self)).
#[derive(Module, Debug)]
pub struct MtpDepth<B: Backend> {
    /// LayerNorm of the next token's embedding.
    pub enorm: LayerNorm<B>,
    /// LayerNorm of the previous depth's hidden states.
    pub hnorm: LayerNorm<B>,
    /// `[2 hidden, hidden]`: the concatenated inputs projected to the hidden size (whole on
    /// every tensor-parallel rank).
    pub proj: Param<Tensor<B, 2>>,
    /// The depth's transformer block (a dense MLP, also in a mixture-of-experts model), split
    /// over the tensor-parallel ranks as the main blocks are.
    pub block: Block<B>,
    /// LayerNorm before the shared output head.
    pub norm: LayerNorm<B>,
    /// The tensor-parallel group under sequence parallelism (`proj`'s gradient, from this
    /// rank's positions only, is summed over it).
    #[module(skip)]
    sequence_parallel: Option<Group>,
}

impl<B: ParallelBackend> MtpDepth<B> {
    /// Depth `k` (0-based) of a GPT of shape `cfg`, this rank's TP shard (`tp`), initialized
    /// from `rng` as the blocks are (its projection N(0, `init_std`²), named `mtp.{k}.*`), its
    /// dropout seeded after the blocks'.
    pub(crate) fn new(
        cfg: &GptConfig,
        rng: &InitRng,
        (k, seed): (usize, u64),
        tp: Group,
        device: &B::Device,
    ) -> Result<Self, TpError> {
        let h = cfg.hidden;
        let prefix = format!("mtp.{k}");
        let ln = || LayerNorm::new(h, cfg.layer_norm_eps, device);
        let proj = rng.normal(&format!("{prefix}.proj"), 2 * h * h, cfg.init_std as f32);
        let dropout_seed = seed.wrapping_add((cfg.layers + 1 + k) as u64 + 1);
        Ok(Self {
            enorm: ln(),
            hnorm: ln(),
            proj: param_from_values(proj, [2 * h, h], device),
            block: Block::dense(
                cfg,
                rng,
                (&format!("{prefix}.block"), dropout_seed),
                tp,
                device,
            )?,
            norm: ln(),
            sequence_parallel: None,
        })
    }

    /// The depth's hidden states from the previous depth's `hidden` and the `embedded` tokens
    /// one place further ahead (`[batch, seq, hidden]` each, this rank's positions), attending
    /// within `segments` when given, the dropout masks those of the pass at `at`.
    pub(crate) fn forward(
        &self,
        (hidden, embedded): (Tensor<B, 3>, Tensor<B, 3>),
        segments: Option<Tensor<B, 2, Int>>,
        at: &DropoutPosition,
    ) -> Tensor<B, 3> {
        let x = Tensor::cat(
            vec![self.enorm.forward(embedded), self.hnorm.forward(hidden)],
            2,
        );
        let w = autocast(sp_param(self.proj.val(), self.sequence_parallel));
        let x = x.matmul(w.unsqueeze());
        self.block.forward_in_segments(x, segments, at)
    }

    /// The depth's final LayerNorm.
    pub(crate) fn final_norm(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.norm.forward(x)
    }

    /// Sequence parallelism on (`on`) or off, over the tensor-parallel `group` of the
    /// LayerNorms (`None`: off or one rank), as the blocks have it.
    pub(crate) fn set_sequence_parallel(&mut self, group: Option<Group>, on: bool) {
        for ln in [&mut self.enorm, &mut self.hnorm, &mut self.norm] {
            ln.set_sequence_parallel(group);
        }
        self.sequence_parallel = group;
        self.block.set_sequence_parallel(group, on);
    }

    /// The block's tensor-parallel products sub-pipelined over `overlap` token chunks.
    pub(crate) fn set_overlap(&mut self, overlap: TpOverlap) {
        self.block.set_overlap(overlap);
    }
}

/// Whether the parameter `name` belongs to a multi-token-prediction depth (`mtp.{k}.*`): what
/// GPT-2 files do not hold, the export leaves out and `--init-from` leaves initialized.
pub fn is_depth_param(name: &str) -> bool {
    name.starts_with("mtp.")
}
