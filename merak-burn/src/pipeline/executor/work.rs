//! What one call of [`Executor::run_step`](super::Executor::run_step) works on: this step's
//! micro-batches and weights, the next step's under 2BW, and the forwards that ran ahead
//! between two calls.

use std::collections::HashMap;

use burn::tensor::backend::AutodiffBackend;

use super::stage_run::Held;
use super::{MicroBatch, StepLosses};
use crate::comm::Pending;
use crate::data_parallel::Shards;

/// A forward or backward pass's key: `(micro-batch of the call, global stage)`.
pub(super) type Key = (usize, usize);

/// What one call of [`Executor::run_step`](super::Executor::run_step) works on.
pub struct StepWork<'a, M> {
    /// The weights of this step's forward passes (under 2BW, the version before the last
    /// update).
    pub model: &'a M,
    /// This step's micro-batches.
    pub batches: &'a [MicroBatch],
    /// The 0-based step (keys the dropout masks).
    pub step: usize,
    /// Under 2BW: the next step's weights and micro-batches, to run its first forwards during
    /// this step's last backwards ([`crate::pipeline::two_bw`]). Other schedules ignore it.
    pub next: Option<(&'a M, &'a [MicroBatch])>,
    /// Under ZeRO-3: this rank's parameter shards; `model` then holds empty parameters and
    /// every unit runs on its gathered ones, recomputed for its backward pass.
    pub shards: Option<&'a Shards>,
}

/// A micro-batch of a call: `mb < m` is this step's, `mb >= m` the next step's `mb - m`.
pub(super) struct Picked<'a, M> {
    pub(super) batch: &'a MicroBatch,
    pub(super) model: &'a M,
    pub(super) step: usize,
    /// The micro-batch within its step.
    pub(super) mb: usize,
}

impl<'a, M> StepWork<'a, M> {
    /// Micro-batch `mb` of this call, with its weights and step.
    pub(super) fn pick(&self, mb: usize) -> Option<Picked<'a, M>> {
        let m = self.batches.len();
        if mb < m {
            return Some(Picked {
                batch: &self.batches[mb],
                model: self.model,
                step: self.step,
                mb,
            });
        }
        let (model, batches) = self.next?;
        Some(Picked {
            batch: batches.get(mb - m)?,
            model,
            step: self.step + 1,
            mb: mb - m,
        })
    }

    /// Whether micro-batch `mb` of this call is the next step's (it ran ahead under 2BW).
    pub(super) fn is_next(&self, mb: usize) -> bool {
        mb >= self.batches.len()
    }

    /// The step of micro-batch `mb` of this call and its number within that step.
    fn step_of(&self, mb: usize) -> (usize, usize) {
        let m = self.batches.len();
        if mb < m {
            (self.step, mb)
        } else {
            (self.step + 1, mb - m)
        }
    }

    /// The message tag of (`mb`, `stage`) in this call: the step's parity keeps a step's
    /// messages apart from the next step's, which may be in flight at the same time.
    pub(super) fn tag(&self, mb: usize, stage: usize, stages: usize, kind: usize) -> u16 {
        let (step, local) = self.step_of(mb);
        super::tag(local + (step % 2) * self.batches.len(), stage, stages, kind)
    }

    /// The trace name of a message of `mb`: "`what` `mb` s`stage` t`step`" as its step counts.
    pub(super) fn message_name(&self, what: &str, mb: usize, stage: usize) -> String {
        let (step, local) = self.step_of(mb);
        format!("{what} {local} s{stage} t{step}")
    }
}

/// The forward passes (and messages) of a step that ran ahead during the previous step, kept
/// between two calls of [`Executor::run_step`](super::Executor::run_step) (PipeDream-2BW
/// without a flush). Empty for every other schedule.
pub struct RanAhead<B: AutodiffBackend> {
    /// The 0-based step whose forwards ran ahead.
    pub(super) step: Option<usize>,
    /// Their graphs (a received activation is used, an output sent, right away: no message
    /// value waits between calls).
    pub(super) held: HashMap<Key, Held<B>>,
    pub(super) pending: Vec<Box<dyn Pending>>,
    /// The losses of that step's micro-batches already run (on the last stage), on the device.
    pub(super) loss: StepLosses<B::InnerBackend>,
}

impl<B: AutodiffBackend> Default for RanAhead<B> {
    fn default() -> Self {
        Self {
            step: None,
            held: HashMap::new(),
            pending: Vec::new(),
            loss: StepLosses::default(),
        }
    }
}

impl<B: AutodiffBackend> RanAhead<B> {
    /// Whether some step's forwards ran ahead.
    pub fn is_empty(&self) -> bool {
        self.step.is_none()
    }

    /// The 0-based step whose forwards ran ahead.
    pub fn step(&self) -> Option<usize> {
        self.step
    }
}

/// The entries of `map` of the next step (`mb >= m`), renumbered as that step's.
pub(super) fn next_step_part<V>(map: HashMap<Key, V>, m: usize) -> HashMap<Key, V> {
    map.into_iter()
        .filter(|((mb, _), _)| *mb >= m)
        .map(|((mb, stage), v)| ((mb - m, stage), v))
        .collect()
}
