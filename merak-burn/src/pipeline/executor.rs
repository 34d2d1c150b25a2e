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
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use thiserror::Error;

use super::partition::Partition;
use super::schedule::{Action, Schedule, ScheduleKind};
use super::stage::{EvalOutput, Evaluate, PipelineModel, StageInput, StageOutput};
use super::stage::{TrainBackend, TrainModel};
use super::trace::TraceEvent;
use super::two_bw;
use crate::batch::{Batch, Samples};
use crate::comm::{CommError, Group, Pending};
use crate::data_parallel::{DataParallel, Shards};
use crate::kernels::deferred;
use crate::precision::autocast;
use crate::tensor_parallel::{ParallelBackend, force_dropout, set_dropout_position};

mod gathered;

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

/// How a model is cut and run: the schedule, the stages and the recomputation per stage.
#[derive(Clone, Debug)]
pub struct PipelinePlan {
    /// The validated schedule.
    pub schedule: Schedule,
    /// The units of every global stage.
    pub partition: Partition,
    /// Per global stage: how many of its first units are recomputed (0: none; all of its
    /// units: full recomputation).
    pub recompute_units: Vec<usize>,
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
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The weighted loss of the micro-batches whose last stage is on this rank (0 elsewhere).
    pub loss: f64,
    /// Seconds computing (forward, backward, recomputation).
    pub compute_s: f64,
    /// Seconds waiting in receives.
    pub wait_s: f64,
    /// The most micro-batches whose activations this rank held at once.
    pub max_in_flight: usize,
}

/// Tag of the message carrying (`mb`, `stage`)'s input (kind 0) or output gradient (kind 1).
fn tag(mb: usize, stage: usize, stages: usize, kind: usize) -> u16 {
    ((2 * (mb * stages + stage) + kind) % 32_768) as u16
}

/// What one call of [`Executor::run_step`] works on.
pub struct StepWork<'a, M> {
    /// The weights of this step's forward passes (under 2BW, the version before the last
    /// update).
    pub model: &'a M,
    /// This step's micro-batches.
    pub batches: &'a [MicroBatch],
    /// The 0-based step (keys the dropout masks).
    pub step: usize,
    /// Under 2BW: the next step's weights and micro-batches, to run its first forwards during
    /// this step's last backwards ([`super::two_bw`]). Other schedules ignore it.
    pub next: Option<(&'a M, &'a [MicroBatch])>,
    /// Under ZeRO-3: this rank's parameter shards; `model` then holds empty parameters and
    /// every unit runs on its gathered ones, recomputed for its backward pass.
    pub shards: Option<&'a Shards>,
}

/// A micro-batch of a call: `mb < m` is this step's, `mb >= m` the next step's `mb - m`.
struct Picked<'a, M> {
    batch: &'a MicroBatch,
    model: &'a M,
    step: usize,
    /// The micro-batch within its step.
    mb: usize,
}

impl<'a, M> StepWork<'a, M> {
    fn pick(&self, mb: usize) -> Option<Picked<'a, M>> {
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
    fn tag(&self, mb: usize, stage: usize, stages: usize, kind: usize) -> u16 {
        let (step, local) = self.step_of(mb);
        tag(local + (step % 2) * self.batches.len(), stage, stages, kind)
    }

    /// The trace name of a message of `mb`: "`what` `mb` s`stage` t`step`" as its step counts.
    fn message_name(&self, what: &str, mb: usize, stage: usize) -> String {
        let (step, local) = self.step_of(mb);
        format!("{what} {local} s{stage} t{step}")
    }
}

/// The forward passes (and messages) of a step that ran ahead during the previous step, kept
/// between two calls of [`Executor::run_step`] (PipeDream-2BW without a flush). Empty for every
/// other schedule.
pub struct InFlight<B: AutodiffBackend> {
    /// The 0-based step whose forwards ran ahead.
    step: Option<usize>,
    /// Their graphs (a received activation is used, an output sent, right away: no message
    /// value waits between calls).
    held: HashMap<(usize, usize), Held<B>>,
    pending: Vec<Box<dyn Pending>>,
    /// Loss of that step's micro-batches already run (on the last stage).
    loss: f64,
}

impl<B: AutodiffBackend> Default for InFlight<B> {
    fn default() -> Self {
        Self {
            step: None,
            held: HashMap::new(),
            pending: Vec::new(),
            loss: 0.0,
        }
    }
}

impl<B: AutodiffBackend> InFlight<B> {
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
fn next_step_part<V>(map: HashMap<(usize, usize), V>, m: usize) -> HashMap<(usize, usize), V> {
    map.into_iter()
        .filter(|((mb, _), _)| *mb >= m)
        .map(|((mb, stage), v)| ((mb - m, stage), v))
        .collect()
}

/// What the forward pass of one (micro-batch, stage) keeps for its backward pass.
struct Held<B: AutodiffBackend> {
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
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn read<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, PipelineError> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| PipelineError::Tensor(format!("{e:?}")))
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

    /// The recorded actions (with `trace`), wall-clock seconds since the Unix epoch.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn units(&self, stage: usize) -> Range<usize> {
        self.plan.partition.range(stage)
    }

    fn last_stage(&self) -> usize {
        self.plan.schedule.stages() - 1
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
        let t = self.tp.size();
        let part = if self.replicated && t > 1 && values.len().is_multiple_of(t) {
            let n = values.len() / t;
            values[self.tp.rank() * n..(self.tp.rank() + 1) * n].to_vec()
        } else {
            values
        };
        Ok(self.pp.comm()?.send_start(part, dest, tag)?)
    }

    /// Receives `len` values sent by [`Executor::send`] from pipeline rank `src`.
    fn recv(&self, len: usize, src: usize, tag: u16) -> Result<Vec<f32>, PipelineError> {
        let t = self.tp.size();
        if self.replicated && t > 1 && len.is_multiple_of(t) {
            let mut part = vec![0.0; len / t];
            self.pp.comm()?.recv(&mut part, src, tag)?;
            let mut full = vec![0.0; len];
            self.tp.comm()?.all_gather(&part, &mut full)?;
            Ok(full)
        } else {
            let mut full = vec![0.0; len];
            self.pp.comm()?.recv(&mut full, src, tag)?;
            Ok(full)
        }
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
    /// backwards and stay in `in_flight` for the next call, which must be that step's.
    pub fn run_step<B, M>(
        &mut self,
        work: StepWork<'_, M>,
        reducer: &DataParallel,
        shape: [usize; 3],
        device: &B::Device,
        in_flight: &mut InFlight<B>,
    ) -> Result<StepReport, PipelineError>
    where
        B: TrainBackend,
        M: TrainModel<B>,
    {
        let step = work.step;
        let m = work.batches.len();
        let carried_in = match in_flight.step {
            None => false,
            Some(carried) if carried == step => true,
            Some(carried) => {
                return Err(PipelineError::OutOfStep {
                    rank: self.rank,
                    step,
                    carried,
                });
            }
        };
        let two_bw = self.plan.schedule.kind == ScheduleKind::TwoBw;
        let overlap = two_bw && work.next.is_some();
        let actions = if two_bw {
            let mut list = two_bw::segment(&self.plan.schedule, self.rank, carried_in, overlap);
            list.push(Action::OptimizerStep);
            list
        } else {
            self.plan.schedule.actions[self.rank].clone()
        };
        // The DP reducer starts a bucket's all-reduce once its gradients are final: after the
        // last backward pass of each stage in this rank's order (not necessarily the last
        // micro-batch: GPipe runs them in reverse).
        // A split backward's weight gradients are final after its last W pass.
        let mut final_backward = final_micro_batches(&actions, false);
        let final_weight = final_micro_batches(&actions, true);
        // A rank holding both ends of the model (ZB-V's rank 0) delivers the tied table's
        // gradient from two stages: the last stage's final backward must not mark it final;
        // what it leaves unmarked is reduced when the step finishes.
        let schedule = &self.plan.schedule;
        if schedule.stages() > 1 && schedule.rank_of(0) == schedule.rank_of(schedule.stages() - 1) {
            final_backward.remove(&(schedule.stages() - 1));
        }
        if let Some(shards) = work.shards {
            let passes = actions.iter().filter_map(|a| match *a {
                Action::Forward { stage, .. } => Some((self.units(stage), false)),
                Action::Backward { stage, .. } => Some((self.units(stage), true)),
                _ => None,
            });
            shards.begin(gathered::gather_order(passes))?;
        }
        let split = self.plan.schedule.kind.splits_backward();
        deferred::enable(split);
        let stages = self.plan.schedule.stages();
        let last = self.last_stage();
        let [micro, seq, hidden] = shape;
        let act_len = micro * seq * hidden;
        let mut report = StepReport::default();
        // The loss of this step's micro-batches and of the next step's that run ahead.
        let mut losses = [std::mem::take(&mut in_flight.loss), 0.0];
        let mut held = std::mem::take(&mut in_flight.held);
        let mut inbox_act: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut inbox_grad: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut outbox_act: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        let mut outbox_grad: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        // Sends of this step, and sends of the next step's forwards that ran ahead.
        let mut pending: Vec<Box<dyn Pending>> = std::mem::take(&mut in_flight.pending);
        let mut pending_next: Vec<Box<dyn Pending>> = Vec::new();
        // Messages travel as f32; a stage computes in the step's precision.
        let hidden_of = |v: Vec<f32>| -> Tensor<B::InnerBackend, 3> {
            autocast(Tensor::from_data(
                TensorData::new(v, [micro, seq, hidden]),
                device,
            ))
        };
        let me = self.rank;
        let missing = move |action: Action, what: &'static str| PipelineError::Missing {
            rank: me,
            action,
            what,
        };

        // The micro-batch of an action, with its weights and step.
        let pick = |mb: usize, action: Action| {
            work.pick(mb)
                .ok_or_else(|| missing(action, "its micro-batch"))
        };
        for action in actions {
            let start = now_s();
            let t0 = Instant::now();
            match action {
                Action::Forward { mb, stage } => {
                    let Picked {
                        batch,
                        model,
                        step: its_step,
                        mb: its_mb,
                    } = pick(mb, action)?;
                    set_dropout_position(its_step as u64, batch.first_sample as u64);
                    let input: StageInput<B::InnerBackend> = if stage == 0 {
                        StageInput::Data
                    } else {
                        let v = inbox_act
                            .remove(&(mb, stage))
                            .ok_or_else(|| missing(action, "its input activation"))?;
                        StageInput::Hidden(hidden_of(v))
                    };
                    let units = self.units(stage);
                    let k = self.plan.recompute_units[stage].min(units.len());
                    let samples = &batch.samples;
                    let to_autodiff = |i: &StageInput<B::InnerBackend>, grad: bool| match i {
                        StageInput::Data => StageInput::Data,
                        StageInput::Hidden(h) => {
                            let t = Tensor::<B, 3>::from_inner(h.clone());
                            StageInput::Hidden(if grad { t.require_grad() } else { t })
                        }
                    };
                    let weight = batch.weight;
                    let weigh = |o: StageOutput<B>| match o {
                        StageOutput::Loss(l) => StageOutput::Loss(l * weight),
                        h => h,
                    };
                    let mut h = Held {
                        input: input.clone(),
                        input_leaf: None,
                        recomputed: None,
                        boundary: None,
                        output: None,
                        unit_inputs: Vec::new(),
                    };
                    let out_values: Option<Vec<f32>>;
                    if let Some(shards) = work.shards {
                        let (out, inputs) = gathered::forward_units(
                            &model.valid(),
                            shards,
                            units.clone(),
                            input.clone(),
                            batch,
                            its_step,
                            device,
                        )?;
                        h.unit_inputs = inputs;
                        out_values = match out {
                            StageOutput::Loss(l) => {
                                losses[usize::from(mb >= m)] +=
                                    f64::from(l.into_scalar().elem::<f32>()) * f64::from(weight);
                                None
                            }
                            StageOutput::Hidden(x) => Some(read(x)?),
                        };
                    } else if k == 0 {
                        let inp = to_autodiff(&input, stage > 0);
                        if let StageInput::Hidden(leaf) = &inp {
                            h.input_leaf = Some(leaf.clone());
                        }
                        // A fresh hooked copy (fresh parameter leaves) per forward pass: the
                        // graphs of micro-batches in flight share no node.
                        let out = weigh(Self::run_units(
                            &reducer.hooked(model.clone()),
                            units.clone(),
                            inp,
                            samples,
                            device,
                        ));
                        out_values = hidden_or_loss(&out, &mut losses[usize::from(mb >= m)])?;
                        h.output = Some(out);
                    } else {
                        // The recomputed part runs now without autodiff (no graph is kept), with
                        // the dropout masks the recomputation will draw again.
                        let first = units.start..units.start + k;
                        force_dropout(true);
                        let tmp =
                            Self::run_units(&model.valid(), first, input.clone(), samples, device);
                        force_dropout(false);
                        match tmp {
                            StageOutput::Loss(l) => {
                                losses[usize::from(mb >= m)] +=
                                    f64::from(l.into_scalar().elem::<f32>()) * f64::from(weight);
                                out_values = None;
                            }
                            StageOutput::Hidden(x) if k == units.len() => {
                                out_values = Some(read(x)?);
                            }
                            StageOutput::Hidden(x) => {
                                let leaf = Tensor::<B, 3>::from_inner(x).require_grad();
                                h.boundary = Some(leaf.clone());
                                let out = weigh(Self::run_units(
                                    &reducer.hooked(model.clone()),
                                    units.start + k..units.end,
                                    StageInput::Hidden(leaf),
                                    samples,
                                    device,
                                ));
                                out_values =
                                    hidden_or_loss(&out, &mut losses[usize::from(mb >= m)])?;
                                h.output = Some(out);
                            }
                        }
                    }
                    if let Some(v) = out_values {
                        if stage < last && self.plan.schedule.rank_of(stage + 1) == self.rank {
                            inbox_act.insert((mb, stage + 1), v);
                        } else {
                            outbox_act.insert((mb, stage), v);
                        }
                    }
                    held.insert((mb, stage), h);
                    // A split backward holds what its W needs until W runs.
                    let in_flight = held.len() + deferred::pending_backwards();
                    report.max_in_flight = report.max_in_flight.max(in_flight);
                    report.compute_s += t0.elapsed().as_secs_f64();
                    self.record("forward", format!("F{its_mb} s{stage} t{its_step}"), start);
                }
                // ZeRO-3 recomputes every unit in its backward pass.
                Action::Recompute { .. } if work.shards.is_some() => {}
                Action::Recompute { mb, stage } => {
                    let Picked {
                        batch,
                        model,
                        step: its_step,
                        ..
                    } = pick(mb, action)?;
                    let h = held
                        .get_mut(&(mb, stage))
                        .ok_or_else(|| missing(action, "its forward pass"))?;
                    let units = self.units(stage);
                    let k = self.plan.recompute_units[stage].min(units.len());
                    Self::recompute(
                        &reducer.hooked(model.clone()),
                        h,
                        units,
                        k,
                        batch,
                        its_step,
                        device,
                    );
                    report.compute_s += t0.elapsed().as_secs_f64();
                    self.record("recompute", format!("R{mb} s{stage} t{step}"), start);
                }
                Action::Backward { mb, stage } => {
                    let Picked {
                        batch,
                        model,
                        step: its_step,
                        ..
                    } = pick(mb, action)?;
                    let mut h = held
                        .remove(&(mb, stage))
                        .ok_or_else(|| missing(action, "its forward pass"))?;
                    let units = self.units(stage);
                    let k = self.plan.recompute_units[stage].min(units.len());
                    if k > 0 && h.recomputed.is_none() && work.shards.is_none() {
                        Self::recompute(
                            &reducer.hooked(model.clone()),
                            &mut h,
                            units.clone(),
                            k,
                            batch,
                            its_step,
                            device,
                        );
                    }
                    let upstream: Option<Tensor<B, 3>> = if stage == last {
                        None
                    } else {
                        let g = inbox_grad
                            .remove(&(mb, stage))
                            .ok_or_else(|| missing(action, "its output gradient"))?;
                        Some(Tensor::from_inner(hidden_of(g)))
                    };
                    reducer.set_last_micro_batch(final_backward.get(&stage) == Some(&mb));
                    // B of a split backward: linear weight gradients wait for W.
                    let _open = split.then(|| deferred::open((mb, stage)));
                    // Backward through the kept part, then through the recomputed part.
                    let grad_at =
                        |out: StageOutput<B>,
                         upstream: Option<Tensor<B, 3>>,
                         leaf: Option<&Tensor<B, 3>>|
                         -> Result<Option<Tensor<B, 3>>, PipelineError> {
                            let grads = match (out, upstream) {
                                (StageOutput::Loss(l), _) => l.backward(),
                                (StageOutput::Hidden(y), Some(g)) => (y * g).sum().backward(),
                                (StageOutput::Hidden(_), None) => {
                                    return Err(missing(action, "an upstream gradient"));
                                }
                            };
                            Ok(leaf.and_then(|l| l.grad(&grads)).map(Tensor::from_inner))
                        };
                    let mut g = upstream;
                    if let Some(out) = h.output.take() {
                        let leaf = if k > 0 {
                            h.boundary.as_ref()
                        } else {
                            h.input_leaf.as_ref()
                        };
                        g = grad_at(out, g, leaf)?;
                    }
                    if let Some(out) = h.recomputed.take() {
                        g = grad_at(out, g, h.input_leaf.as_ref())?;
                    }
                    if let Some(shards) = work.shards {
                        g = gathered::backward_units(
                            model,
                            shards,
                            reducer,
                            units.clone(),
                            std::mem::take(&mut h.unit_inputs),
                            g,
                            batch,
                            its_step,
                            device,
                        )?;
                    }
                    if stage > 0 {
                        let g = g.ok_or_else(|| missing(action, "the gradient of its input"))?;
                        let v = read(g.inner())?;
                        if self.plan.schedule.rank_of(stage - 1) == self.rank {
                            inbox_grad.insert((mb, stage - 1), v);
                        } else {
                            outbox_grad.insert((mb, stage), v);
                        }
                    }
                    report.compute_s += t0.elapsed().as_secs_f64();
                    self.record("backward", format!("B{mb} s{stage} t{step}"), start);
                }
                Action::SendActivation { mb, stage } => {
                    let v = outbox_act
                        .remove(&(mb, stage))
                        .ok_or_else(|| missing(action, "its forward output"))?;
                    let dest = self.plan.schedule.rank_of(stage + 1);
                    let sent = self.send(v, dest, work.tag(mb, stage + 1, stages, 0))?;
                    if mb < m {
                        pending.push(sent);
                    } else {
                        pending_next.push(sent);
                    }
                    self.record("send", work.message_name("send act", mb, stage), start);
                }
                Action::RecvActivation { mb, stage } => {
                    let src = self.plan.schedule.rank_of(stage - 1);
                    let v = self.recv(act_len, src, work.tag(mb, stage, stages, 0))?;
                    inbox_act.insert((mb, stage), v);
                    report.wait_s += t0.elapsed().as_secs_f64();
                    self.record("recv", work.message_name("recv act", mb, stage), start);
                }
                Action::SendGrad { mb, stage } => {
                    let v = outbox_grad
                        .remove(&(mb, stage))
                        .ok_or_else(|| missing(action, "its input gradient"))?;
                    let dest = self.plan.schedule.rank_of(stage - 1);
                    pending.push(self.send(v, dest, work.tag(mb, stage - 1, stages, 1))?);
                    self.record("send", work.message_name("send grad", mb, stage), start);
                }
                Action::RecvGrad { mb, stage } => {
                    let src = self.plan.schedule.rank_of(stage + 1);
                    let v = self.recv(act_len, src, work.tag(mb, stage, stages, 1))?;
                    inbox_grad.insert((mb, stage), v);
                    report.wait_s += t0.elapsed().as_secs_f64();
                    self.record("recv", work.message_name("recv grad", mb, stage), start);
                }
                Action::BackwardWeight { mb, stage } => {
                    reducer.set_last_micro_batch(final_weight.get(&stage) == Some(&mb));
                    deferred::run((mb, stage));
                    report.compute_s += t0.elapsed().as_secs_f64();
                    self.record("weight", format!("W{mb} s{stage} t{step}"), start);
                }
                Action::OptimizerStep => break,
            }
        }
        for p in pending {
            p.wait()?;
        }
        in_flight.step = overlap.then_some(step + 1);
        in_flight.held = next_step_part(held, m);
        in_flight.pending = pending_next;
        report.loss = losses[0];
        in_flight.loss = losses[1];
        let undone = deferred::pending();
        deferred::enable(false);
        if undone > 0 {
            return Err(PipelineError::WeightsNotRun {
                rank: self.rank,
                undone,
            });
        }
        Ok(report)
    }

    /// Reruns the recomputed first `k` units of a stage with their graph.
    fn recompute<B, M>(
        model: &M,
        h: &mut Held<B>,
        units: Range<usize>,
        k: usize,
        batch: &MicroBatch,
        step: usize,
        device: &B::Device,
    ) where
        B: AutodiffBackend + ParallelBackend,
        M: PipelineModel<B> + AutodiffModule<B>,
    {
        set_dropout_position(step as u64, batch.first_sample as u64);
        let input = match &h.input {
            StageInput::Data => StageInput::Data,
            StageInput::Hidden(x) => {
                let leaf = Tensor::<B, 3>::from_inner(x.clone()).require_grad();
                h.input_leaf = Some(leaf.clone());
                StageInput::Hidden(leaf)
            }
        };
        let end = units.start + k;
        let out = Self::run_units(model, units.start..end, input, &batch.samples, device);
        h.recomputed = Some(match out {
            StageOutput::Loss(l) => StageOutput::Loss(l * batch.weight),
            o => o,
        });
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
        let [micro, seq, hidden] = shape;
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
                            micro * seq * hidden,
                            self.plan.schedule.rank_of(s - 1),
                            tag(mb, s, stages, 0),
                        )?,
                    };
                    StageInput::Hidden(autocast(Tensor::from_data(
                        TensorData::new(v, [micro, seq, hidden]),
                        device,
                    )))
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

/// The values of a stage's output to send on (hidden states), or `None` for the last stage's
/// loss, which is added to `loss` instead.
fn hidden_or_loss<B: AutodiffBackend>(
    out: &StageOutput<B>,
    loss: &mut f64,
) -> Result<Option<Vec<f32>>, PipelineError> {
    match out {
        StageOutput::Hidden(x) => Ok(Some(read(x.clone().inner())?)),
        StageOutput::Loss(l) => {
            *loss += f64::from(l.clone().into_scalar().elem::<f32>());
            Ok(None)
        }
    }
}

/// The micro-batch of each stage's last backward pass in `actions` (its last W pass with
/// `weight`): after it the stage's gradients are final.
fn final_micro_batches(actions: &[Action], weight: bool) -> HashMap<usize, usize> {
    let mut last = HashMap::new();
    for a in actions {
        match (*a, weight) {
            (Action::Backward { mb, stage }, false)
            | (Action::BackwardWeight { mb, stage }, true) => {
                last.insert(stage, mb);
            }
            _ => {}
        }
    }
    last
}
