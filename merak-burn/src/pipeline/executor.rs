//! The pipeline executor: runs one rank's action list with real point-to-point messages.
//!
//! Activations travel forward and gradients backward between neighbouring stages as `f32`
//! messages of the agreed shape `[micro_batch, seq, hidden]`. Within a stage's TP group every
//! rank holds the same activation, so each TP rank sends only its `1/tp` slice to the matching
//! TP rank of the next stage, which all-gathers the slices (Megatron's scatter-gather). Under
//! sequence parallelism the TP ranks hold different slices of the sequence (`seq` is then the
//! slice's length): each sends its whole message to its counterpart. Sends
//! are non-blocking and completed at the end of the step; receives block. A backward pass starts
//! from an upstream gradient `g` of a stage output `y` as `(y * g).sum().backward()`, and the
//! gradient of the stage input is read from the input marked `require_grad`.
//!
//! Recomputation: the first `recompute_units[stage]` units of a stage run forward without
//! keeping their autodiff graph (only the stage input is kept); they run again, with the graph,
//! at the schedule's `Recompute` action or at the start of the `Backward`. Dropout masks are keyed
//! by step and sample, so the recomputed forward pass equals the first one.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use thiserror::Error;

use super::schedule::{Action, ScheduleKind};
use super::stage::{EvalOutput, Evaluate, PipelineModel, StageInput, StageOutput};
use super::stage::{TrainBackend, TrainModel};
use super::trace::TraceEvent;
use super::two_bw;
use crate::batch::{Batch, DropoutPosition, Samples};
use crate::comm::{CommError, Group, Pending};
use crate::data_parallel::{DataParallel, Shards};
use crate::kernels::deferred;
use crate::precision::autocast;
use crate::tensor_parallel::ParallelBackend;
use merak_plan::pipeline::PipelinePlan;

mod gathered;
mod losses;
mod stage_run;
mod step;
mod work;

pub use losses::StepLosses;
use step::StepRun;
pub use work::{RanAhead, StepWork};

/// A failure while running a pipeline step.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// A message or collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The schedule asked for something that was not there (a schedule that passed
    /// [`validate`](fn@super::validate) never does).
    #[error("pipeline rank {rank}: {action:?} needs {what}, which is not there")]
    Missing {
        /// The pipeline rank.
        rank: usize,
        /// The action.
        action: Action,
        /// What was missing.
        what: &'static str,
    },
    /// A tensor could not be read back.
    #[error("reading a tensor: {0}")]
    Tensor(String),
    /// The forwards this rank ran ahead belong to another step than the one asked for (2BW's
    /// overlap: the step after an overlapping step must be the next one).
    #[error(
        "pipeline rank {rank}: step {step} asked for, but the forwards of step {carried} ran ahead"
    )]
    OutOfStep {
        /// The pipeline rank.
        rank: usize,
        /// The 0-based step asked for.
        step: usize,
        /// The 0-based step whose first forwards ran ahead.
        carried: usize,
    },
    /// A forward-only pass while the forwards of the next step are in flight (2BW's overlap).
    #[error(
        "pipeline rank {rank}: the forwards of step {step} ran ahead; run that step before a \
         forward-only pass"
    )]
    AheadInFlight {
        /// The pipeline rank.
        rank: usize,
        /// The 1-based step whose forwards ran ahead.
        step: usize,
    },
    /// A split backward's weight gradients that no `BackwardWeight` computed (a schedule that
    /// passed [`validate`](fn@super::validate) never leaves any).
    #[error("pipeline rank {rank}: {undone} deferred weight gradients were never computed")]
    WeightsNotRun {
        /// The pipeline rank.
        rank: usize,
        /// How many.
        undone: usize,
    },
    /// An evaluation pass asked the head for what it does not provide
    /// ([`HeadUnit::metrics`](crate::parallelize::HeadUnit::metrics) or
    /// [`HeadUnit::predict`](crate::parallelize::HeadUnit::predict) returned `None`).
    #[error(
        "pipeline rank {rank}: the model's head provides no {what:?} (implement HeadUnit::metrics or HeadUnit::predict)"
    )]
    NoEvaluation {
        /// The pipeline rank.
        rank: usize,
        /// What was asked for.
        what: Evaluate,
    },
}

/// One micro-batch of a step, as every rank sees it.
#[derive(Clone, Debug)]
pub struct MicroBatch {
    /// Its samples: the fields every unit may read (inputs, targets, side inputs).
    pub samples: Samples,
    /// The factor of its summed loss: one over the global batch's loss terms (validation:
    /// one), so that the micro-batches' weighted sums add up to the global mean.
    pub weight: f32,
    /// Global index of its first sample in the step (keys the dropout masks).
    pub first_sample: usize,
}

impl MicroBatch {
    /// Where a training pass of it in 0-based step `step` stands: what keys its dropout masks.
    pub fn dropout_position(&self, step: usize) -> DropoutPosition {
        DropoutPosition {
            step: step as u64,
            first_sample: self.first_sample as u64,
            forced: false,
        }
    }
}

/// What the last unit returned for one micro-batch in an evaluation pass
/// ([`Executor::forward_eval`]).
#[derive(Clone, Debug, PartialEq)]
pub struct EvalValues {
    /// The micro-batch's index in the pass.
    pub mb: usize,
    /// `[1, k]` metric sums or `[micro, k]` predictions.
    pub shape: [usize; 2],
    /// The values, row-major.
    pub values: Vec<f32>,
}

/// What a step reports on one rank.
#[derive(Clone, Debug)]
pub struct StepReport<C: Backend> {
    /// The losses of the micro-batches whose last stage is on this rank (none elsewhere),
    /// still on the device: read with the gradient norm's sums in the step's one read.
    pub losses: StepLosses<C>,
    /// Seconds computing (forward, backward, recomputation).
    pub compute_s: f64,
    /// Seconds waiting in receives.
    pub wait_s: f64,
    /// The most micro-batches whose activations this rank held at once.
    pub max_in_flight: usize,
}

impl<C: Backend> StepReport<C> {
    /// A report of no time and no losses but `losses`.
    fn new(losses: StepLosses<C>) -> Self {
        Self {
            losses,
            compute_s: 0.0,
            wait_s: 0.0,
            max_in_flight: 0,
        }
    }
}

/// Tag of the message carrying (`mb`, `stage`)'s input (kind 0) or output gradient (kind 1).
fn tag(mb: usize, stage: usize, stages: usize, kind: usize) -> u16 {
    ((2 * (mb * stages + stage) + kind) % 32_768) as u16
}

/// A receive posted ahead of the pass that needs it (DualPipeV's pairs): this tensor-parallel
/// rank's part, gathered over the group when it waits if the message travels in parts.
pub(super) struct Posted {
    part: Box<dyn Pending>,
    gathered_len: Option<usize>,
}

impl Posted {
    /// Waits for the message and returns all of it.
    pub(super) fn wait(self, tp: &Group) -> Result<Vec<f32>, PipelineError> {
        gathered(tp, self.part.wait()?, self.gathered_len)
    }
}

/// A received message: `part` itself, or when it travelled in tensor-parallel parts
/// (`gathered_len`), every TP rank's part gathered over `tp` into its `gathered_len` values.
fn gathered(
    tp: &Group,
    part: Vec<f32>,
    gathered_len: Option<usize>,
) -> Result<Vec<f32>, PipelineError> {
    let Some(len) = gathered_len else {
        return Ok(part);
    };
    let mut full = vec![0.0; len];
    tp.comm()?.all_gather(&part, &mut full)?;
    Ok(full)
}

/// Runs the action lists of one pipeline rank (see the module docs).
pub struct Executor {
    plan: PipelinePlan,
    pp: Group,
    tp: Group,
    rank: usize,
    trace_row: usize,
    trace: Option<Vec<TraceEvent>>,
    /// Whether the TP ranks of a stage hold the same messages (scatter-gather applies).
    replicated: bool,
    /// The most micro-batches this rank has held at once in any step so far.
    peak_in_flight: usize,
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn read<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, PipelineError> {
    crate::host_read::floats(t).map_err(|e| PipelineError::Tensor(e.0))
}

/// A message's values as a stage input `[micro, seq, hidden]` on `device`, in the step's
/// precision (messages travel as `f32`).
fn hidden<B: Backend>(values: Vec<f32>, shape: [usize; 3], device: &B::Device) -> Tensor<B, 3> {
    autocast(Tensor::from_data(TensorData::new(values, shape), device))
}

impl Executor {
    /// An executor for this rank (`pp.rank()` is its pipeline rank); with `trace = Some(row)`,
    /// every action is recorded with its wall-clock time under that row (the world rank).
    pub fn new(plan: PipelinePlan, pp: Group, tp: Group, trace: Option<usize>) -> Self {
        let rank = pp.rank();
        Self {
            plan,
            pp,
            tp,
            rank,
            trace_row: trace.unwrap_or(0),
            trace: trace.map(|_| Vec::new()),
            replicated: true,
            peak_in_flight: 0,
        }
    }

    /// The executor for a model whose TP ranks hold different slices of each sequence between
    /// stages (`parts > 1`, sequence parallelism): messages travel whole, TP rank to TP rank,
    /// without the scatter-gather of replicated activations.
    pub fn with_sequence_parts(mut self, parts: usize) -> Self {
        self.replicated = parts <= 1;
        self
    }

    /// The plan.
    pub fn plan(&self) -> &PipelinePlan {
        &self.plan
    }

    /// The most micro-batches this rank has held at once (forwards whose backward had not
    /// run) in any step so far.
    pub fn max_in_flight(&self) -> usize {
        self.peak_in_flight
    }

    /// The recorded actions (with `trace`), wall-clock seconds since the Unix epoch.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn units(&self, stage: usize) -> Range<usize> {
        self.plan.partition.range(stage)
    }

    fn record(&mut self, category: &str, name: String, start: f64) {
        if let Some(t) = self.trace.as_mut() {
            let end = now_s();
            t.push(TraceEvent {
                rank: self.trace_row,
                name,
                category: category.to_string(),
                start_s: start,
                dur_s: (end - start).max(0.0),
            });
        }
    }

    /// Sends `values` (a replicated activation or gradient) to the matching TP rank of pipeline
    /// rank `dest`: this TP rank's slice when the TP degree divides it.
    fn send(
        &self,
        values: Vec<f32>,
        dest: usize,
        tag: u16,
    ) -> Result<Box<dyn Pending>, PipelineError> {
        let part = match self.part_len(values.len()) {
            Some(n) => values[self.tp.rank() * n..(self.tp.rank() + 1) * n].to_vec(),
            None => values,
        };
        Ok(self.pp.comm()?.send_start(part, dest, tag)?)
    }

    /// The length of this TP rank's part when a message of `len` values travels in
    /// tensor-parallel parts (a replicated value, split when the TP degree divides it); `None`
    /// when it travels whole.
    fn part_len(&self, len: usize) -> Option<usize> {
        let t = self.tp.size();
        (self.replicated && t > 1 && len.is_multiple_of(t)).then(|| len / t)
    }

    /// Receives `len` values sent by [`Executor::send`] from pipeline rank `src`.
    fn recv(&self, len: usize, src: usize, tag: u16) -> Result<Vec<f32>, PipelineError> {
        let part_len = self.part_len(len);
        let mut part = vec![0.0; part_len.unwrap_or(len)];
        self.pp.comm()?.recv(&mut part, src, tag)?;
        gathered(&self.tp, part, part_len.map(|_| len))
    }

    /// Posts the receive of `len` values sent by [`Executor::send`] from pipeline rank `src`
    /// without waiting for them ([`Posted::wait`] returns them).
    fn recv_start(&self, len: usize, src: usize, tag: u16) -> Result<Posted, PipelineError> {
        let part_len = self.part_len(len);
        Ok(Posted {
            part: (self.pp.comm()?).recv_start(part_len.unwrap_or(len), src, tag)?,
            gathered_len: part_len.map(|_| len),
        })
    }

    /// Runs units `range` of `model` on `input`, every unit seeing the micro-batch's `samples`
    /// as tensors on `device`.
    fn run_units<B: Backend, M: PipelineModel<B>>(
        model: &M,
        range: Range<usize>,
        input: StageInput<B>,
        samples: &Samples,
        device: &B::Device,
    ) -> StageOutput<B> {
        model.run_units(range, input, &Batch::new(samples, device))
    }

    /// Runs one training step: every action of this rank's list up to its `OptimizerStep`.
    /// Every forward pass runs a copy of its model hooked by the DP reducer, whose hooks collect
    /// the gradients (`reducer.begin_step()` before, `reducer.finish()` after).
    ///
    /// Under 2BW with `work.next`, the next step's first forwards run during this step's last
    /// backwards and stay in `ran_ahead` for the next call, which must be that step's.
    pub fn run_step<B, M>(
        &mut self,
        work: StepWork<'_, M>,
        reducer: &DataParallel,
        shape: [usize; 3],
        device: &B::Device,
        ran_ahead: &mut RanAhead<B>,
    ) -> Result<StepReport<B::InnerBackend>, PipelineError>
    where
        B: TrainBackend,
        M: TrainModel<B>,
    {
        let carried_in = self.carried_in(work.step, ran_ahead)?;
        let overlap = self.plan.schedule.kind == ScheduleKind::TwoBw && work.next.is_some();
        let actions = self.step_actions(carried_in, overlap);
        if let Some(shards) = work.shards {
            let passes = actions
                .iter()
                .flat_map(|a| a.parts())
                .filter_map(|a| match a {
                    Action::Forward { stage, .. } => Some((self.units(stage), false)),
                    Action::Backward { stage, .. } => Some((self.units(stage), true)),
                    _ => None,
                });
            shards.begin(gathered::gather_order(passes))?;
        }
        deferred::enable(self.plan.schedule.kind.splits_backward());
        let mut run = StepRun::new(self, work, reducer, shape, device, &actions, ran_ahead);
        for action in actions {
            if !run.act(action)? {
                break;
            }
        }
        let report = run.finish(ran_ahead, overlap)?;
        self.peak_in_flight = self.peak_in_flight.max(report.max_in_flight);
        Ok(report)
    }

    /// Whether the forwards of `step` ran ahead in the previous call (2BW); fails when those
    /// of another step did.
    fn carried_in<B: AutodiffBackend>(
        &self,
        step: usize,
        ran_ahead: &RanAhead<B>,
    ) -> Result<bool, PipelineError> {
        match ran_ahead.step {
            None => Ok(false),
            Some(carried) if carried == step => Ok(true),
            Some(carried) => Err(PipelineError::OutOfStep {
                rank: self.rank,
                step,
                carried,
            }),
        }
    }

    /// This rank's actions for one step: its schedule's list, or under 2BW the segment of the
    /// endless schedule that this call runs.
    fn step_actions(&self, carried_in: bool, overlap: bool) -> Vec<Action> {
        if self.plan.schedule.kind != ScheduleKind::TwoBw {
            return self.plan.schedule.actions[self.rank].clone();
        }
        let mut list = two_bw::segment(&self.plan.schedule, self.rank, carried_in, overlap);
        list.push(Action::OptimizerStep);
        list
    }

    /// Per stage, the micro-batch of its last backward pass in `actions`: the DP reducer
    /// starts a bucket's all-reduce once its gradients are final (not necessarily after the
    /// last micro-batch: GPipe runs them in reverse). A rank holding both ends of the model
    /// (ZB-V's rank 0) delivers the tied table's gradient from two stages: the last stage's
    /// final backward must not mark it final; what it leaves unmarked is reduced when the step
    /// finishes.
    fn final_backwards(&self, actions: &[Action]) -> HashMap<usize, usize> {
        let mut last = step::final_micro_batches(actions, false);
        let schedule = &self.plan.schedule;
        let stages = schedule.stages();
        if stages > 1 && schedule.rank_of(0) == schedule.rank_of(stages - 1) {
            last.remove(&(stages - 1));
        }
        last
    }

    /// A forward pass without gradients (validation): every micro-batch through every stage,
    /// micro-batch after micro-batch. Returns the weighted loss of the micro-batches whose last
    /// stage is on this rank (0 elsewhere). Under ZeRO-3 (`shards`; `model`'s parameters are
    /// empty) each unit runs on its gathered parameters.
    pub fn forward_only<B, M>(
        &self,
        model: &M,
        shards: Option<&Shards>,
        batches: &[MicroBatch],
        shape: [usize; 3],
        device: &B::Device,
    ) -> Result<f64, PipelineError>
    where
        B: ParallelBackend,
        M: PipelineModel<B>,
    {
        let mut loss = 0.0;
        self.forward_each(
            model,
            shards,
            batches,
            shape,
            device,
            |mb, model, units, input| {
                let batch = &batches[mb];
                if let StageOutput::Loss(l) =
                    Self::run_units(model, units, input, &batch.samples, device)
                {
                    loss += f64::from(l.into_scalar().elem::<f32>()) * f64::from(batch.weight);
                }
                Ok(())
            },
        )?;
        Ok(loss)
    }

    /// An evaluation pass without gradients: like [`forward_only`](Self::forward_only), but
    /// the last unit returns `what` ([`Evaluate`]). Returns, for each micro-batch whose last
    /// stage is on this rank, its index and its values (`[1, k]` or `[micro, k]`, row-major)
    /// with their shape. Fails naming the rank when the model's head does not provide `what`.
    pub fn forward_eval<B, M>(
        &self,
        model: &M,
        shards: Option<&Shards>,
        batches: &[MicroBatch],
        shape: [usize; 3],
        device: &B::Device,
        what: Evaluate,
    ) -> Result<Vec<EvalValues>, PipelineError>
    where
        B: ParallelBackend,
        M: PipelineModel<B>,
    {
        let mut out = Vec::new();
        self.forward_each(
            model,
            shards,
            batches,
            shape,
            device,
            |mb, model, units, input| {
                let batch = Batch::new(&batches[mb].samples, device);
                match model.eval_units(units, input, &batch, what) {
                    Some(EvalOutput::Values(v)) => {
                        let dims = v.dims();
                        out.push(EvalValues {
                            mb,
                            shape: dims,
                            values: read(v)?,
                        });
                        Ok(())
                    }
                    _ => Err(PipelineError::NoEvaluation {
                        rank: self.rank,
                        what,
                    }),
                }
            },
        )?;
        Ok(out)
    }

    /// Every micro-batch through this rank's stages without gradients, micro-batch after
    /// micro-batch, sending and receiving the hidden states between stages; the last stage's
    /// units are run by `last` (micro-batch, the model to run them on, units, input).
    fn forward_each<B, M>(
        &self,
        model: &M,
        shards: Option<&Shards>,
        batches: &[MicroBatch],
        shape: [usize; 3],
        device: &B::Device,
        mut last: impl FnMut(usize, &M, Range<usize>, StageInput<B>) -> Result<(), PipelineError>,
    ) -> Result<(), PipelineError>
    where
        B: ParallelBackend,
        M: PipelineModel<B>,
    {
        let stages = self.plan.schedule.stages();
        let len = shape.iter().product();
        let mine: Vec<usize> = (0..stages)
            .filter(|&s| self.plan.schedule.rank_of(s) == self.rank)
            .collect();
        let mut pending = Vec::new();
        for (mb, batch) in batches.iter().enumerate() {
            let mut local: Option<Vec<f32>> = None;
            for &s in &mine {
                let input = if s == 0 {
                    StageInput::Data
                } else {
                    let v = match local.take() {
                        Some(v) if self.plan.schedule.rank_of(s - 1) == self.rank => v,
                        _ => self.recv(
                            len,
                            self.plan.schedule.rank_of(s - 1),
                            tag(mb, s, stages, 0),
                        )?,
                    };
                    StageInput::Hidden(hidden(v, shape, device))
                };
                let b = Batch::new(&batch.samples, device);
                if s == stages - 1 {
                    let run = |m: &M, u, i| last(mb, m, u, i);
                    gathered::run_stage(model, shards, self.units(s), input, &b, run)??;
                    continue;
                }
                let run = |m: &M, u, i| m.run_units(u, i, &b);
                if let StageOutput::Hidden(x) =
                    gathered::run_stage(model, shards, self.units(s), input, &b, run)?
                {
                    let v = read(x)?;
                    let next = self.plan.schedule.rank_of(s + 1);
                    if next == self.rank {
                        local = Some(v);
                    } else {
                        pending.push(self.send(v, next, tag(mb, s + 1, stages, 0))?);
                    }
                }
            }
        }
        for p in pending {
            p.wait()?;
        }
        Ok(())
    }
}
