//! The passes of one (micro-batch, stage): a forward pass that keeps what its backward pass
//! needs, the recomputation of its first units, and the backward pass, for the three ways a
//! stage runs — plain (every unit with its graph), recomputing (the first units without a
//! graph, run again before the backward pass) and gathered (ZeRO-3: unit by unit on parameters
//! gathered just before it, [`super::gathered`]).

use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::{PipelineError, read};
use crate::batch::{Batch, DropoutPosition};
use crate::data_parallel::{DataParallel, Shards};
use crate::pipeline::executor::{MicroBatch, gathered};
use crate::pipeline::schedule::Action;
use crate::pipeline::stage::{
    PipelineModel, StageInput, StageOutput, TrainBackend, TrainModel, differentiated,
};

/// What the forward pass of one (micro-batch, stage) keeps for its backward pass.
pub(crate) struct Held<B: AutodiffBackend> {
    /// The stage input: ids (stage 0) or hidden values (kept for recomputation).
    input: StageInput<B::InnerBackend>,
    /// The stage input as an autodiff leaf (stages > 0), once the graph over it exists.
    input_leaf: Option<Tensor<B, 3>>,
    /// The recomputed part's output with its graph, once recomputed.
    recomputed: Option<StageOutput<B>>,
    /// The leaf between the recomputed and the kept part (when both exist).
    boundary: Option<Tensor<B, 3>>,
    /// The kept part's output with its graph (the weighted loss on the last stage).
    output: Option<StageOutput<B>>,
    /// Under ZeRO-3: each unit's input, for its recomputation in the backward pass.
    unit_inputs: Vec<StageInput<B::InnerBackend>>,
}

impl<B: AutodiffBackend> Held<B> {
    fn new(input: StageInput<B::InnerBackend>) -> Self {
        Self {
            input,
            input_leaf: None,
            recomputed: None,
            boundary: None,
            output: None,
            unit_inputs: Vec::new(),
        }
    }
}

/// What a stage's forward pass hands on: its hidden states (to the next stage), or, on the
/// last stage, the micro-batch's weighted loss, left on the device.
pub(super) enum Produced<C: Backend> {
    /// The output activation, as sent.
    Hidden(Vec<f32>),
    /// The loss: the micro-batch's weighted loss is `value * factor` (the factor is applied in
    /// `f64` once read: the weight of a loss computed without a graph, 1 for one weighted on
    /// the device).
    Loss {
        /// The loss, one element.
        value: Tensor<C, 1>,
        /// Its factor.
        factor: f64,
    },
}

/// One (micro-batch, stage) of a step: what its passes run on.
pub(super) struct StageRun<'a, B: TrainBackend, M> {
    /// The weights of the micro-batch's step.
    pub(super) model: &'a M,
    /// The data-parallel reducer, whose hooked copies collect the gradients.
    pub(super) reducer: &'a DataParallel,
    /// Under ZeRO-3: this rank's parameter shards.
    pub(super) shards: Option<&'a Shards>,
    /// The stage's units.
    pub(super) units: Range<usize>,
    /// How many of its first units are recomputed.
    pub(super) recomputed: usize,
    pub(super) batch: &'a MicroBatch,
    /// The micro-batch's 0-based step.
    pub(super) step: usize,
    /// The micro-batch's number within its step.
    pub(super) mb_in_step: usize,
    pub(super) device: &'a B::Device,
    /// The pipeline rank and the action (for errors).
    pub(super) rank: usize,
    pub(super) action: Action,
}

impl<B: TrainBackend, M: TrainModel<B>> StageRun<'_, B, M> {
    /// The forward pass: what it hands on and what it keeps.
    pub(super) fn forward(
        &self,
        input: StageInput<B::InnerBackend>,
    ) -> Result<(Produced<B::InnerBackend>, Held<B>), PipelineError> {
        if let Some(shards) = self.shards {
            self.forward_gathered(shards, input)
        } else if self.recomputed == 0 {
            self.forward_plain(input)
        } else {
            self.forward_recomputing(input)
        }
    }

    /// ZeRO-3: every unit on its gathered parameters without a graph, each unit's input kept.
    fn forward_gathered(
        &self,
        shards: &Shards,
        input: StageInput<B::InnerBackend>,
    ) -> Result<(Produced<B::InnerBackend>, Held<B>), PipelineError> {
        let mut held = Held::new(input.clone());
        let (out, inputs) = gathered::forward_units(
            &self.model.valid(),
            shards,
            self.units.clone(),
            input,
            self.batch,
            self.step,
            self.device,
        )?;
        held.unit_inputs = inputs;
        Ok((self.unweighted(out)?, held))
    }

    /// Every unit with its graph, on a fresh hooked copy of the model (fresh parameter leaves
    /// per forward pass: the graphs of micro-batches in flight share no node).
    fn forward_plain(
        &self,
        input: StageInput<B::InnerBackend>,
    ) -> Result<(Produced<B::InnerBackend>, Held<B>), PipelineError> {
        let mut held = Held::new(input.clone());
        let input = match input {
            StageInput::Data => StageInput::Data,
            StageInput::Hidden(h) => {
                let leaf = Tensor::<B, 3>::from_inner(h).require_grad();
                held.input_leaf = Some(leaf.clone());
                StageInput::Hidden(leaf)
            }
        };
        let out = self.run_hooked(self.units.clone(), input);
        let produced = produced(&out)?;
        held.output = Some(out);
        Ok((produced, held))
    }

    /// The recomputed first units without autodiff (no graph is kept), with the dropout masks
    /// the recomputation will draw again; then the kept units with their graph.
    fn forward_recomputing(
        &self,
        input: StageInput<B::InnerBackend>,
    ) -> Result<(Produced<B::InnerBackend>, Held<B>), PipelineError> {
        let mut held = Held::new(input.clone());
        let units = self.units.clone();
        let first = units.start..units.start + self.recomputed;
        // Dropout draws its masks now as the recomputation will with its graph.
        let batch = self.samples().at(DropoutPosition {
            forced: true,
            ..self.dropout_position()
        });
        let tmp = self.model.valid().run_units(first, input, &batch);
        let x = match tmp {
            StageOutput::Hidden(x) if self.recomputed < units.len() => x,
            out => return Ok((self.unweighted(out)?, held)),
        };
        let leaf = Tensor::<B, 3>::from_inner(x).require_grad();
        held.boundary = Some(leaf.clone());
        let kept = units.start + self.recomputed..units.end;
        let out = self.run_hooked(kept, StageInput::Hidden(leaf));
        let produced = produced(&out)?;
        held.output = Some(out);
        Ok((produced, held))
    }

    /// Reruns the recomputed first units with their graph.
    pub(super) fn recompute(&self, held: &mut Held<B>) {
        let input = match &held.input {
            StageInput::Data => StageInput::Data,
            StageInput::Hidden(x) => {
                let leaf = Tensor::<B, 3>::from_inner(x.clone()).require_grad();
                held.input_leaf = Some(leaf.clone());
                StageInput::Hidden(leaf)
            }
        };
        let first = self.units.start..self.units.start + self.recomputed;
        held.recomputed = Some(self.run_hooked(first, input));
    }

    /// Whether the backward pass must recompute first (not yet done by a `Recompute` action).
    pub(super) fn needs_recompute(&self, held: &Held<B>) -> bool {
        self.recomputed > 0 && held.recomputed.is_none() && self.shards.is_none()
    }

    /// The backward pass from the gradient `upstream` of the stage's output (`None` on the
    /// last stage): through the kept part, then the recomputed part, then (ZeRO-3) unit by
    /// unit. Returns the gradient of the stage's input (`None` on the first stage).
    pub(super) fn backward(
        &self,
        mut held: Held<B>,
        upstream: Option<Tensor<B, 3>>,
    ) -> Result<Option<Tensor<B, 3>>, PipelineError> {
        let mut g = upstream;
        if let Some(out) = held.output.take() {
            let leaf = if self.recomputed > 0 {
                held.boundary.as_ref()
            } else {
                held.input_leaf.as_ref()
            };
            g = self.grad_at(out, g, leaf)?;
        }
        if let Some(out) = held.recomputed.take() {
            g = self.grad_at(out, g, held.input_leaf.as_ref())?;
        }
        if let Some(shards) = self.shards {
            g = gathered::backward_units(
                self.model,
                shards,
                self.reducer,
                self.units.clone(),
                std::mem::take(&mut held.unit_inputs),
                g,
                self.batch,
                self.step,
                self.device,
            )?;
        }
        Ok(g)
    }

    /// Runs the backward pass of `out` from `upstream` and returns the gradient at `leaf`.
    fn grad_at(
        &self,
        out: StageOutput<B>,
        upstream: Option<Tensor<B, 3>>,
        leaf: Option<&Tensor<B, 3>>,
    ) -> Result<Option<Tensor<B, 3>>, PipelineError> {
        let grads = match (out, upstream) {
            (StageOutput::Loss(l), _) => differentiated(l).backward(),
            (StageOutput::Hidden(y), Some(g)) => (y * g).sum().backward(),
            (StageOutput::Hidden(_), None) => {
                return Err(PipelineError::Missing {
                    rank: self.rank,
                    action: self.action,
                    what: "an upstream gradient",
                });
            }
        };
        Ok(leaf.and_then(|l| l.grad(&grads)).map(Tensor::from_inner))
    }

    /// Units `range` on a copy of the model hooked by the reducer, the loss weighted.
    fn run_hooked(&self, range: Range<usize>, input: StageInput<B>) -> StageOutput<B> {
        let hooked = self.reducer.hooked(self.model.clone());
        match hooked.run_units(range, input, &self.samples()) {
            StageOutput::Loss(l) => StageOutput::Loss(l * self.batch.weight),
            h => h,
        }
    }

    /// What a pass without a graph hands on, its loss to be weighted once read (in `f64`).
    fn unweighted(
        &self,
        out: StageOutput<B::InnerBackend>,
    ) -> Result<Produced<B::InnerBackend>, PipelineError> {
        Ok(match out {
            StageOutput::Loss(value) => Produced::Loss {
                value,
                factor: f64::from(self.batch.weight),
            },
            StageOutput::Hidden(x) => Produced::Hidden(read(x)?),
        })
    }

    /// The micro-batch's samples as tensors on the device, at the pass's dropout position.
    fn samples<C: burn::tensor::backend::Backend<Device = B::Device>>(&self) -> Batch<'_, C> {
        Batch::new(&self.batch.samples, self.device).at(self.dropout_position())
    }

    /// The step and the micro-batch's first sample: what keys the pass's dropout masks.
    fn dropout_position(&self) -> DropoutPosition {
        self.batch.dropout_position(self.step)
    }
}

/// What a pass with its graph hands on (its loss already weighted, without its graph).
fn produced<B: AutodiffBackend>(
    out: &StageOutput<B>,
) -> Result<Produced<B::InnerBackend>, PipelineError> {
    Ok(match out {
        StageOutput::Hidden(x) => Produced::Hidden(read(x.clone().inner())?),
        StageOutput::Loss(l) => Produced::Loss {
            value: l.clone().inner(),
            factor: 1.0,
        },
    })
}
