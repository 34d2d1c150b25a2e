//! Dropout whose mask is the same on every rank of a TP group (and for every tp).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::Module;
use burn::tensor::{Tensor, TensorData, backend::Backend};

use super::init::InitRng;

/// Dropout on activations that are replicated across the TP group (embeddings, residual
/// branches). Burn's dropout draws from the backend's RNG, whose state differs between ranks;
/// here the mask comes from a host stream keyed by the seed and a call counter, so every TP
/// rank drops the same elements and a tp = N run equals the tp = 1 run. Active only when the
/// backend records gradients (training).
#[derive(Module, Clone, Debug)]
pub struct ReplicatedDropout {
    #[module(skip)]
    prob: f64,
    #[module(skip)]
    rng: InitRng,
    #[module(skip)]
    calls: Arc<AtomicU64>,
}

impl ReplicatedDropout {
    /// Dropout with probability `prob`, masks drawn from `seed`.
    pub fn new(prob: f64, seed: u64) -> Self {
        Self {
            prob,
            rng: InitRng::new(seed ^ 0xD50D_50D5),
            calls: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Applies dropout when training and `prob > 0`; the identity otherwise.
    pub fn forward<B: Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.prob <= 0.0 || !B::ad_enabled(&x.device()) {
            return x;
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let shape = x.shape();
        let keep = 1.0 - self.prob as f32;
        let mask: Vec<f32> = self
            .rng
            .uniform(&format!("dropout/{call}"), shape.num_elements())
            .into_iter()
            .map(|u| if u < keep { 1.0 / keep } else { 0.0 })
            .collect();
        let mask = Tensor::<B, D>::from_data(TensorData::new(mask, shape), &x.device());
        x * mask
    }
}
