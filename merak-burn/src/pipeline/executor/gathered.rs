//! ZeRO-3 in the executor: a stage's units run one at a time, each on its parameters gathered
//! just before it ([`Shards::gathered`]) and dropped after it.
//!
//! The forward pass keeps no graph, only each unit's input. The backward pass walks the units
//! in reverse: it gathers a unit again, reruns its forward pass with the graph (the same
//! dropout masks: both passes start each unit at a new dropout position, and masks are keyed by
//! step, sample and each layer's calls in that position), and runs its backward pass from the
//! gradient of the unit's output, which hands the unit's parameter gradients to the reducer's
//! hooks and gives the gradient of the unit's input. At most one unit's gathered parameters
//! and graph (plus the prefetched ones) are alive at a time, for any Burn module: this is
//! full recomputation per unit, about one more forward pass of compute.

use std::ops::Range;

use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::{MicroBatch, PipelineError};
use crate::batch::{Batch, DropoutPosition};
use crate::data_parallel::{DataParallel, Shards};
use crate::pipeline::stage::{PipelineModel, StageInput, StageOutput, differentiated};
use crate::tensor_parallel::ParallelBackend;

/// The order in which a step gathers units: each forward pass's units in order, each backward
/// pass's in reverse, as the rank's actions run them (`passes`: `(stage's units, backward)`).
pub(super) fn gather_order(passes: impl Iterator<Item = (Range<usize>, bool)>) -> Vec<usize> {
    let mut order = Vec::new();
    for (units, backward) in passes {
        if backward {
            order.extend(units.rev());
        } else {
            order.extend(units);
        }
    }
    order
}

/// Runs `units` of the parameterless `model` on `input` without a graph, one unit at a time on
/// its gathered parameters; returns the stage's output and each unit's input.
pub(super) fn forward_units<B, M>(
    model: &M,
    shards: &Shards,
    units: Range<usize>,
    input: StageInput<B>,
    batch: &MicroBatch,
    step: usize,
    device: &B::Device,
) -> Result<(StageOutput<B>, Vec<StageInput<B>>), PipelineError>
where
    B: Backend,
    M: PipelineModel<B> + Clone,
{
    // Dropout draws its masks now as it will when the unit is recomputed with its graph.
    let at = DropoutPosition {
        forced: true,
        ..batch.dropout_position(step)
    };
    let samples = Batch::new(&batch.samples, device).at(at);
    let mut inputs = Vec::with_capacity(units.len());
    let mut x = input;
    for u in units {
        let unit = shards.fill(model.clone(), shards.gathered(u)?);
        inputs.push(x.clone());
        match unit.run_units(u..u + 1, x, &samples) {
            StageOutput::Hidden(h) => x = StageInput::Hidden(h),
            loss => return Ok((loss, inputs)),
        }
    }
    match x {
        StageInput::Hidden(h) => Ok((StageOutput::Hidden(h), inputs)),
        StageInput::Data => Err(PipelineError::Tensor("a stage without units".into())),
    }
}

/// Runs `units` of `model` on `input` without a graph, the last unit by `last` (given the
/// model to run it on): at once, or under ZeRO-3 (`shards`: `model`'s parameters are empty)
/// unit by unit, each on its gathered parameters (an evaluation pass; the gathers are not
/// prefetched).
pub(super) fn run_stage<B, M, T>(
    model: &M,
    shards: Option<&Shards>,
    units: Range<usize>,
    input: StageInput<B>,
    batch: &Batch<'_, B>,
    last: impl FnOnce(&M, Range<usize>, StageInput<B>) -> T,
) -> Result<T, PipelineError>
where
    B: Backend,
    M: PipelineModel<B> + Clone,
{
    let Some(shards) = shards else {
        return Ok(last(model, units, input));
    };
    let mut x = input;
    for u in units.start..units.end.saturating_sub(1) {
        let unit = shards.fill(model.clone(), shards.gathered(u)?);
        x = match unit.run_units(u..u + 1, x, batch) {
            StageOutput::Hidden(h) => StageInput::Hidden(h),
            StageOutput::Loss(_) => {
                return Err(PipelineError::Tensor(format!("unit {u} returned a loss")));
            }
        };
    }
    let u = units.end.saturating_sub(1);
    let unit = shards.fill(model.clone(), shards.gathered(u)?);
    Ok(last(&unit, u..u + 1, x))
}

/// The backward pass of `units` of the parameterless `model` from the gradient `upstream` of
/// the stage's output (`None` on the last stage, whose last unit returns the loss), unit by
/// unit in reverse from their `inputs`: each unit gathered again, recomputed with its graph
/// (parameters hooked by `reducer`) and run backward. Returns the gradient of the stage's
/// input (`None` on the first stage).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_units<B, M>(
    model: &M,
    shards: &Shards,
    reducer: &DataParallel,
    units: Range<usize>,
    inputs: Vec<StageInput<B::InnerBackend>>,
    upstream: Option<Tensor<B, 3>>,
    batch: &MicroBatch,
    step: usize,
    device: &B::Device,
) -> Result<Option<Tensor<B, 3>>, PipelineError>
where
    B: AutodiffBackend + ParallelBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
{
    let mut g = upstream;
    for (u, input) in units.zip(inputs).rev() {
        let unit = reducer.hooked(shards.fill(model.clone(), shards.gathered(u)?));
        let (input, leaf) = match input {
            StageInput::Data => (StageInput::Data, None),
            StageInput::Hidden(x) => {
                let leaf = Tensor::<B, 3>::from_inner(x).require_grad();
                (StageInput::Hidden(leaf.clone()), Some(leaf))
            }
        };
        let samples = Batch::new(&batch.samples, device).at(batch.dropout_position(step));
        let out = unit.run_units(u..u + 1, input, &samples);
        let grads = match (out, g.take()) {
            (StageOutput::Loss(l), _) => (differentiated(l) * batch.weight).backward(),
            (StageOutput::Hidden(y), Some(g)) => (y * g).sum().backward(),
            (StageOutput::Hidden(_), None) => {
                return Err(PipelineError::Tensor(format!(
                    "unit {u} has no upstream gradient"
                )));
            }
        };
        g = leaf.and_then(|l| l.grad(&grads)).map(Tensor::from_inner);
    }
    Ok(g)
}
