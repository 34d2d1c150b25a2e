//! Dropout whose mask is the same on every rank of a TP group (and for every tp).

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData, backend::Backend};

use crate::batch::DropoutPosition;
use crate::rng::InitRng;

/// Dropout on activations that are replicated across the TP group (embeddings, residual
/// branches). Burn's dropout draws from the backend's RNG, whose state differs between ranks;
/// here the mask of sample `i` (dimension 0 is the batch) comes from a host stream keyed by the
/// seed, the step, the sample's global index (the pass's [`DropoutPosition`], which every unit
/// gets in its [`Batch`](crate::batch::Batch)) and the branch (which use of this layer in the
/// pass). Every TP rank drops the same elements and a run equals the one-process run under any
/// layout. Active only when the backend records gradients (training), or when the position is
/// [`forced`](DropoutPosition::forced).
#[derive(Module, Clone, Debug)]
pub struct ReplicatedDropout {
    #[module(skip)]
    prob: f64,
    #[module(skip)]
    rng: InitRng,
    /// The positions of every sequence its inputs' rows hold, in order (sequence and context
    /// parallelism); `None`: the whole sequences.
    #[module(skip)]
    rows: Option<Arc<Vec<usize>>>,
}

impl ReplicatedDropout {
    /// Dropout with probability `prob`, masks drawn from `seed`.
    pub fn new(prob: f64, seed: u64) -> Self {
        Self {
            prob,
            rng: InitRng::new(seed ^ 0xD50D_50D5),
            rows: None,
        }
    }

    /// Under sequence or context parallelism: the inputs (`[batch, rows.len(), ...]`) hold
    /// positions `rows` of every sequence, and each sample's mask is those rows of the mask
    /// the whole sequence gets, so that the dropped elements do not depend on the layout.
    /// `None`: whole sequences.
    pub fn set_sequence_rows(&mut self, rows: Option<Vec<usize>>) {
        self.rows = rows.map(Arc::new);
    }

    /// Applies dropout when training and `prob > 0`, the identity otherwise: the mask of the
    /// pass at `at` for `branch` (0 for the layer's first use in a pass, 1 for its second: two
    /// residual branches sharing one layer draw different masks).
    pub fn forward<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        at: &DropoutPosition,
        branch: u64,
    ) -> Tensor<B, D> {
        let training = B::ad_enabled(&x.device()) || at.forced;
        if self.prob <= 0.0 || !training {
            return x;
        }
        let (step, first, call) = (at.step, at.first_sample, branch);
        let shape = x.shape();
        let samples = shape[0].max(1);
        let per_sample = shape.num_elements() / samples;
        let keep = 1.0 - self.prob as f32;
        let mut mask = Vec::with_capacity(shape.num_elements());
        for i in 0..samples as u64 {
            let stream = format!("dropout/{step}/{}/{call}", first + i);
            let draws = match &self.rows {
                Some(rows) => {
                    let width = per_sample / rows.len().max(1);
                    self.rng.uniform_rows(&stream, rows, width)
                }
                None => self.rng.uniform(&stream, per_sample),
            };
            mask.extend(
                draws
                    .into_iter()
                    .map(|u| if u < keep { 1.0 / keep } else { 0.0 }),
            );
        }
        let mask = Tensor::<B, D>::from_data(TensorData::new(mask, shape), &x.device());
        let mask = crate::precision::like_dtype(mask, x.dtype());
        x * mask
    }
}
