//! PipeDream-2BW's weight versions ([`WeightVersions`]): the weights from before the previous
//! update, on which a step's passes run, and the next step's forwards that ran ahead during
//! the last one.

use crate::pipeline::{MicroBatch, RanAhead, TrainBackend};

/// The weight versions a step's passes run on. Under PipeDream-2BW a step's gradients are
/// computed on the weights from before the previous update (V_t = V_{t-1} - lr *
/// grad(V_{t-2})), and with the overlap the next step's first forwards run during this step's
/// last backwards; under every other schedule there is one version, the current weights.
pub(crate) struct WeightVersions<B: TrainBackend, M> {
    /// Whether the schedule keeps two versions (PipeDream-2BW).
    two: bool,
    /// The weights from before the previous update (under 2BW, once a step has updated).
    pub stale: Option<M>,
    /// The forwards of the next step that ran ahead during the last one.
    pub ran_ahead: RanAhead<B>,
    /// The micro-batches of those forwards' step.
    next_batches: Option<Vec<MicroBatch>>,
}

impl<B: TrainBackend, M: Clone> WeightVersions<B, M> {
    /// One version, or two when `two` (PipeDream-2BW).
    pub fn new(two: bool) -> Self {
        Self {
            two,
            stale: None,
            ran_ahead: RanAhead::default(),
            next_batches: None,
        }
    }

    /// Before an update (or a step skipped as a zero update): under 2BW, `current` becomes
    /// the version the next step's passes run on (the next step's forwards may already run
    /// on it).
    pub fn advance(&mut self, current: &M) {
        if self.two {
            self.stale = Some(current.clone());
        }
    }

    /// The weights versions held: 1, or 2 under 2BW once a step has updated.
    pub fn count(&self) -> u64 {
        1 + u64::from(self.stale.is_some())
    }

    /// The micro-batches of step `step` when its first forwards ran ahead during the last step.
    pub fn batches_ahead(&mut self, step: usize) -> Option<Vec<MicroBatch>> {
        match self.next_batches.take() {
            Some(b) if self.ran_ahead.step() == Some(step) => Some(b),
            _ => None,
        }
    }

    /// Keeps `next`, the micro-batches of the next step whose forwards ran ahead.
    pub fn set_batches_ahead(&mut self, next: Option<Vec<MicroBatch>>) {
        self.next_batches = next;
    }
}
