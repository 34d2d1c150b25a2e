//! What the validator's machine and the simulator time: each action's cost, and an action as
//! it ran.

use serde::{Deserialize, Serialize};

use super::schedule::Action;

/// The time of every action, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// Forward pass of one micro-batch, per global stage.
    pub forward: Vec<f64>,
    /// Backward pass of one micro-batch, per global stage (without recomputation).
    pub backward: Vec<f64>,
    /// Recomputation of the forward pass of one micro-batch, per global stage. Paid by an
    /// explicit [`Action::Recompute`], or added to the [`Action::Backward`] of a recomputing
    /// stage that has none.
    pub recompute: Vec<f64>,
    /// Transfer time of one activation message.
    pub send_activation: f64,
    /// Transfer time of one gradient message.
    pub send_grad: f64,
    /// One optimizer step of one rank.
    pub optimizer: f64,
    /// The share of each backward that is the weight gradients (W), in `[0, 1]`: in a schedule
    /// that splits the backward, [`Action::Backward`] (B) costs `backward * (1 - weight_share)`
    /// and [`Action::BackwardWeight`] (W) `backward * weight_share`. A transformer's backward
    /// does two matrix products per forward product, one for each, so 0.5.
    pub weight_share: f64,
    /// Per global stage, the seconds of a forward pass that wait for its expert all-to-alls
    /// (included in `forward`; empty for none). The forward of a DualPipeV pair computes the
    /// weight gradients of the W that follows the pair while it waits, so that W costs up to
    /// this much less.
    #[serde(default)]
    pub forward_comm: Vec<f64>,
}

impl Costs {
    /// The same `forward` and `backward` time on each of `stages` stages; recomputation costs
    /// one forward; messages, all-to-alls and the optimizer are free.
    pub fn uniform(stages: usize, forward: f64, backward: f64) -> Costs {
        Costs {
            forward: vec![forward; stages],
            backward: vec![backward; stages],
            recompute: vec![forward; stages],
            weight_share: 0.5,
            forward_comm: vec![0.0; stages],
            send_activation: 0.0,
            send_grad: 0.0,
            optimizer: 0.0,
        }
    }
}

/// One action as it ran in the simulation.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimedAction {
    /// The action (its `mb` is the micro-batch within its step).
    pub action: Action,
    /// The training step it belongs to (`0..steps`).
    pub step: usize,
    /// When it started, in seconds. For a receive: when the message was there to be received
    /// (the later of the rank reaching the receive and the send), so the wait before is idle.
    pub start: f64,
    /// When it ended, in seconds.
    pub end: f64,
}

impl TimedAction {
    /// `end - start`.
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }
}
