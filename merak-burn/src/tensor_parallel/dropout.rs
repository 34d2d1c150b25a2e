//! Dropout whose mask is the same on every rank of a TP group (and for every tp).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::{Tensor, TensorData, backend::Backend};

use crate::rng::InitRng;

static STEP: AtomicU64 = AtomicU64::new(0);
static FIRST_SAMPLE: AtomicU64 = AtomicU64::new(0);
static GENERATION: AtomicU64 = AtomicU64::new(0);
static FORCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes dropout active also on a backend without autodiff (`true`), as during a forward pass
/// that is run without its graph and recomputed with it later: both must drop the same
/// elements. Off by default (inference).
pub fn force_dropout(on: bool) {
    FORCED.store(on, Ordering::SeqCst);
}

/// Tells every [`ReplicatedDropout`] which global samples the next forward pass holds: the
/// training step and the global index of the micro-batch's first sample. Masks are keyed by
/// them, so they depend neither on the layout (dp, micro-batching) nor on history (a resumed
/// run, a recomputed forward pass draw the same masks).
pub fn set_dropout_position(step: u64, first_sample: u64) {
    STEP.store(step, Ordering::SeqCst);
    FIRST_SAMPLE.store(first_sample, Ordering::SeqCst);
    GENERATION.fetch_add(1, Ordering::SeqCst);
}

/// Dropout on activations that are replicated across the TP group (embeddings, residual
/// branches). Burn's dropout draws from the backend's RNG, whose state differs between ranks;
/// here the mask of sample `i` (dimension 0 is the batch) comes from a host stream keyed by the
/// seed, the step, the sample's global index (see [`set_dropout_position`]) and how many times
/// this layer ran in the current forward pass. Every TP rank drops the same elements and a run
/// equals the one-process run under any layout. Active only when the backend records gradients
/// (training), or when [`force_dropout`] says so.
#[derive(Module, Clone, Debug)]
pub struct ReplicatedDropout {
    #[module(skip)]
    prob: f64,
    #[module(skip)]
    rng: InitRng,
    /// (generation of the position it was last used in, calls in that position).
    #[module(skip)]
    calls: Arc<Mutex<(u64, u64)>>,
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
            calls: Arc::new(Mutex::new((u64::MAX, 0))),
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

    /// Applies dropout when training and `prob > 0`; the identity otherwise.
    pub fn forward<B: Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let training = B::ad_enabled(&x.device()) || FORCED.load(Ordering::SeqCst);
        if self.prob <= 0.0 || !training {
            return x;
        }
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let generation = GENERATION.load(Ordering::SeqCst);
            if calls.0 != generation {
                *calls = (generation, 0);
            }
            calls.1 += 1;
            calls.1 - 1
        };
        let step = STEP.load(Ordering::SeqCst);
        let first = FIRST_SAMPLE.load(Ordering::SeqCst);
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
