//! One training step as an interpreter: the state a step's actions read and write (held
//! forward passes, mailboxes, pending sends, losses) and one method per schedule action.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use burn::tensor::Tensor;

use super::stage_run::{Held, Produced, StageRun};
use super::work::{Key, RanAhead, StepWork, next_step_part};
use super::{Executor, PipelineError, Posted, StepLosses, StepReport, hidden, now_s, read};
use crate::comm::Pending;
use crate::data_parallel::DataParallel;
use crate::kernels::deferred;
use crate::pipeline::pairs;
use crate::pipeline::schedule::Action;
use crate::pipeline::stage::{StageInput, TrainBackend, TrainModel};

/// Which of a rank's mailboxes a message value waits in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mailbox {
    /// A stage's input activation: received, or handed over by this rank's previous stage.
    ActivationIn,
    /// A stage's output activation, waiting for its send.
    ActivationOut,
    /// The gradient of a stage's output: received, or handed over by this rank's next stage.
    GradIn,
    /// The gradient of a stage's input, waiting for its send.
    GradOut,
}

/// What the actions of one step read and write.
struct StepState<B: TrainBackend> {
    /// What each forward pass keeps for its backward pass.
    held: HashMap<Key, Held<B>>,
    /// Message values between the action that makes them and the one that uses them.
    mail: HashMap<(Mailbox, Key), Vec<f32>>,
    /// Receives posted ahead of a pair, waited for when its pass starts.
    posted: HashMap<(Mailbox, Key), Posted>,
    /// Forward outputs of pairs whose send started before the pair's backward ran; their
    /// `SendActivation` finds them gone.
    sent_early: HashSet<Key>,
    /// Sends of this step, completed when it ends.
    pending: Vec<Box<dyn Pending>>,
    /// Sends of the next step's forwards that ran ahead (2BW), completed in the next call.
    pending_next: Vec<Box<dyn Pending>>,
    /// The losses of the next step's forwards that run ahead in this call (2BW), carried to
    /// the next call on the device.
    next_losses: StepLosses<B::InnerBackend>,
    /// The step's times and its losses (those that ran ahead in the previous call first).
    report: StepReport<B::InnerBackend>,
}

/// When an action started: wall-clock seconds (for the trace) and an instant.
#[derive(Clone, Copy)]
struct Clock {
    start: f64,
    t0: Instant,
}

impl Clock {
    /// Now.
    fn now() -> Self {
        Clock {
            start: now_s(),
            t0: Instant::now(),
        }
    }
}

/// What an action's time counts as in the [`StepReport`].
enum Spent {
    Compute,
    Wait,
    /// Sends: counted in neither.
    Neither,
}

/// One call of [`Executor::run_step`]: the step's fixed inputs and its state.
pub(super) struct StepRun<'a, B: TrainBackend, M> {
    exec: &'a mut Executor,
    work: StepWork<'a, M>,
    reducer: &'a DataParallel,
    shape: [usize; 3],
    device: &'a B::Device,
    /// Per stage: the micro-batch of its last backward pass and of its last W pass, after
    /// which its gradients are final.
    final_backward: HashMap<usize, usize>,
    final_weight: HashMap<usize, usize>,
    /// Whether the schedule splits the backward pass (B now, W later).
    split: bool,
    /// The receives to post without waiting: those ahead of a pair.
    to_post: HashSet<(Mailbox, Key)>,
    /// By a pair's forward: the W that follows the pair, whose weight-gradient products the
    /// forward's expert exchanges compute while they wait.
    fills: HashMap<Key, Key>,
    state: StepState<B>,
}

impl<'a, B: TrainBackend, M: TrainModel<B>> StepRun<'a, B, M> {
    /// A step over `actions`, resuming the forwards in `ran_ahead`.
    pub(super) fn new(
        exec: &'a mut Executor,
        work: StepWork<'a, M>,
        reducer: &'a DataParallel,
        shape: [usize; 3],
        device: &'a B::Device,
        actions: &[Action],
        ran_ahead: &mut RanAhead<B>,
    ) -> Self {
        let final_backward = exec.final_backwards(actions);
        let split = exec.plan.schedule.kind.splits_backward();
        let state = StepState {
            held: std::mem::take(&mut ran_ahead.held),
            mail: HashMap::new(),
            posted: HashMap::new(),
            sent_early: HashSet::new(),
            pending: std::mem::take(&mut ran_ahead.pending),
            pending_next: Vec::new(),
            next_losses: StepLosses::default(),
            report: StepReport::new(std::mem::take(&mut ran_ahead.loss)),
        };
        Self {
            exec,
            work,
            reducer,
            shape,
            device,
            final_backward,
            final_weight: final_micro_batches(actions, true),
            split,
            to_post: posted_ahead_of_pairs(actions),
            fills: weights_after_pairs(actions),
            state,
        }
    }

    /// Runs `action`; `false` at the step's `OptimizerStep` (the end of its actions).
    pub(super) fn act(&mut self, action: Action) -> Result<bool, PipelineError> {
        let clock = Clock::now();
        match action {
            Action::Forward { mb, stage } => self.forward(action, mb, stage, clock)?,
            // ZeRO-3 recomputes every unit in its backward pass.
            Action::Recompute { .. } if self.work.shards.is_some() => {}
            Action::Recompute { mb, stage } => self.recompute(action, mb, stage, clock)?,
            Action::Backward { mb, stage } => self.backward(action, mb, stage, clock)?,
            Action::SendActivation { mb, stage } => {
                self.send(Mailbox::ActivationOut, (action, mb, stage), clock)?
            }
            Action::RecvActivation { mb, stage } => {
                self.recv(Mailbox::ActivationIn, mb, stage, clock)?
            }
            Action::SendGrad { mb, stage } => {
                self.send(Mailbox::GradOut, (action, mb, stage), clock)?
            }
            Action::RecvGrad { mb, stage } => self.recv(Mailbox::GradIn, mb, stage, clock)?,
            Action::BackwardWeight { mb, stage } => self.backward_weight(mb, stage, clock),
            Action::ForwardBackward { .. } => self.pair(action)?,
            Action::OptimizerStep => return Ok(false),
        }
        Ok(true)
    }

    /// Completes the step's sends, keeps what ran ahead in `ran_ahead` (`overlap`: the next
    /// step's forwards did) and reports; fails when a split backward left weight gradients.
    pub(super) fn finish(
        self,
        ran_ahead: &mut RanAhead<B>,
        overlap: bool,
    ) -> Result<StepReport<B::InnerBackend>, PipelineError> {
        let state = self.state;
        for p in state.pending {
            p.wait()?;
        }
        ran_ahead.step = overlap.then_some(self.work.step + 1);
        ran_ahead.held = next_step_part(state.held, self.work.batches.len());
        ran_ahead.pending = state.pending_next;
        ran_ahead.loss = state.next_losses;
        let undone = deferred::pending();
        deferred::enable(false);
        if undone > 0 {
            return Err(PipelineError::WeightsNotRun {
                rank: self.exec.rank,
                undone,
            });
        }
        Ok(state.report)
    }

    fn forward(
        &mut self,
        action: Action,
        mb: usize,
        stage: usize,
        clock: Clock,
    ) -> Result<(), PipelineError> {
        let input = if stage == 0 {
            StageInput::Data
        } else {
            let v = self.take(
                Mailbox::ActivationIn,
                (mb, stage),
                action,
                "its input activation",
            )?;
            StageInput::Hidden(hidden(v, self.shape, self.device))
        };
        let run = self.stage_run(action, mb, stage)?;
        let (its_step, its_mb) = (run.step, run.mb_in_step);
        let (produced, held) = run.forward(input)?;
        match produced {
            Produced::Loss { value, factor } => match self.work.is_next(mb) {
                true => self.state.next_losses.push(value, factor),
                false => self.state.report.losses.push(value, factor),
            },
            Produced::Hidden(v) => {
                let last = self.exec.plan.schedule.stages() - 1;
                if stage < last && self.exec.plan.schedule.rank_of(stage + 1) == self.exec.rank {
                    self.post(Mailbox::ActivationIn, (mb, stage + 1), v);
                } else {
                    self.post(Mailbox::ActivationOut, (mb, stage), v);
                }
            }
        }
        self.state.held.insert((mb, stage), held);
        // A split backward holds what its W needs until W runs.
        let in_flight = self.state.held.len() + deferred::pending_backwards();
        let report = &mut self.state.report;
        report.max_in_flight = report.max_in_flight.max(in_flight);
        self.done(
            clock,
            Spent::Compute,
            "forward",
            format!("F{its_mb} s{stage} t{its_step}"),
        );
        Ok(())
    }

    fn recompute(
        &mut self,
        action: Action,
        mb: usize,
        stage: usize,
        clock: Clock,
    ) -> Result<(), PipelineError> {
        let run = self.stage_run(action, mb, stage)?;
        let held = (self.state.held.get_mut(&(mb, stage)))
            .ok_or_else(|| missing(self.exec.rank, action, "its forward pass"))?;
        run.recompute(held);
        let step = self.work.step;
        self.done(
            clock,
            Spent::Compute,
            "recompute",
            format!("R{mb} s{stage} t{step}"),
        );
        Ok(())
    }

    fn backward(
        &mut self,
        action: Action,
        mb: usize,
        stage: usize,
        clock: Clock,
    ) -> Result<(), PipelineError> {
        let run = self.stage_run(action, mb, stage)?;
        let mut held = (self.state.held.remove(&(mb, stage)))
            .ok_or_else(|| missing(self.exec.rank, action, "its forward pass"))?;
        if run.needs_recompute(&held) {
            run.recompute(&mut held);
        }
        let upstream = if stage == self.exec.plan.schedule.stages() - 1 {
            None
        } else {
            let g = self.take(Mailbox::GradIn, (mb, stage), action, "its output gradient")?;
            Some(Tensor::from_inner(hidden(g, self.shape, self.device)))
        };
        let reducer = self.reducer;
        reducer.set_last_micro_batch(self.final_backward.get(&stage) == Some(&mb));
        // B of a split backward: linear weight gradients wait for W.
        let _open = self.split.then(|| deferred::open((mb, stage)));
        let g = run.backward(held, upstream)?;
        if stage > 0 {
            let g =
                g.ok_or_else(|| missing(self.exec.rank, action, "the gradient of its input"))?;
            let v = read(g.inner())?;
            if self.exec.plan.schedule.rank_of(stage - 1) == self.exec.rank {
                self.post(Mailbox::GradIn, (mb, stage - 1), v);
            } else {
                self.post(Mailbox::GradOut, (mb, stage), v);
            }
        }
        let step = self.work.step;
        self.done(
            clock,
            Spent::Compute,
            "backward",
            format!("B{mb} s{stage} t{step}"),
        );
        Ok(())
    }

    /// DualPipeV's overlapped pair: waits for the forward's input (its receive was posted
    /// ahead), runs the forward, starts its output's send, then waits for the backward's
    /// gradient, which travelled while the forward ran, and runs the backward.
    fn pair(&mut self, action: Action) -> Result<(), PipelineError> {
        let Action::ForwardBackward {
            forward_mb: mb,
            forward_stage: stage,
            backward_mb: b_mb,
            backward_stage: b_stage,
        } = action
        else {
            return Err(missing(self.exec.rank, action, "a forward and a backward"));
        };
        let forward = Action::Forward { mb, stage };
        let backward = Action::Backward {
            mb: b_mb,
            stage: b_stage,
        };
        self.await_posted(Mailbox::ActivationIn, (mb, stage))?;
        let clock = Clock::now();
        let fill = self.fills.get(&(mb, stage)).copied();
        let guard = fill.map(|(w_mb, w_stage)| {
            // No gradient reaches the reducer in a forward pass but those of the filling W.
            let last = self.final_weight.get(&w_stage) == Some(&w_mb);
            self.reducer.set_last_micro_batch(last);
            deferred::fill_with((w_mb, w_stage))
        });
        self.forward(forward, mb, stage, clock)?;
        drop(guard);
        let filled = deferred::take_filled();
        if let Some((w_mb, w_stage)) = fill.filter(|_| filled > 0) {
            let step = self.work.step;
            let name = format!("W{w_mb} s{w_stage} t{step}: {filled} in F{mb}'s exchanges");
            self.exec.record("weight", name, clock.start);
        }
        if self
            .state
            .mail
            .contains_key(&(Mailbox::ActivationOut, (mb, stage)))
        {
            self.send(Mailbox::ActivationOut, (forward, mb, stage), Clock::now())?;
            self.state.sent_early.insert((mb, stage));
        }
        self.await_posted(Mailbox::GradIn, (b_mb, b_stage))?;
        self.backward(backward, b_mb, b_stage, Clock::now())
    }

    /// Waits for the posted receive of `key` into `mailbox`, if there is one.
    fn await_posted(&mut self, mailbox: Mailbox, key: Key) -> Result<(), PipelineError> {
        let Some(posted) = self.state.posted.remove(&(mailbox, key)) else {
            return Ok(());
        };
        let clock = Clock::now();
        let v = posted.wait(&self.exec.tp)?;
        self.post(mailbox, key, v);
        let what = match mailbox {
            Mailbox::ActivationIn => "wait act",
            _ => "wait grad",
        };
        let name = self.work.message_name(what, key.0, key.1);
        self.done(clock, Spent::Wait, "recv", name);
        Ok(())
    }

    /// Sends the message value of (`mb`, `stage`) from `mailbox` (an activation to the next
    /// stage or a gradient to the previous one); a send of the next step's forwards (2BW)
    /// completes with that step. A pair's forward output already on its way is not sent again.
    fn send(
        &mut self,
        mailbox: Mailbox,
        (action, mb, stage): (Action, usize, usize),
        clock: Clock,
    ) -> Result<(), PipelineError> {
        if mailbox == Mailbox::ActivationOut && self.state.sent_early.remove(&(mb, stage)) {
            return Ok(());
        }
        let (to, kind, what, label) = match mailbox {
            Mailbox::ActivationOut => (stage + 1, 0, "its forward output", "send act"),
            _ => (stage - 1, 1, "its input gradient", "send grad"),
        };
        let v = self.take(mailbox, (mb, stage), action, what)?;
        let schedule = &self.exec.plan.schedule;
        let (dest, tag) = (
            schedule.rank_of(to),
            self.work.tag(mb, to, schedule.stages(), kind),
        );
        let sent = self.exec.send(v, dest, tag)?;
        if self.work.is_next(mb) {
            self.state.pending_next.push(sent);
        } else {
            self.state.pending.push(sent);
        }
        let name = self.work.message_name(label, mb, stage);
        self.done(clock, Spent::Neither, "send", name);
        Ok(())
    }

    /// Receives into `mailbox` (an activation from the previous stage or a gradient from the
    /// next one) the message value of (`mb`, `stage`).
    fn recv(
        &mut self,
        mailbox: Mailbox,
        mb: usize,
        stage: usize,
        clock: Clock,
    ) -> Result<(), PipelineError> {
        let schedule = &self.exec.plan.schedule;
        let (src, kind, what) = match mailbox {
            Mailbox::ActivationIn => (schedule.rank_of(stage - 1), 0, "recv act"),
            _ => (schedule.rank_of(stage + 1), 1, "recv grad"),
        };
        let [micro, seq, hidden] = self.shape;
        let tag = self.work.tag(mb, stage, schedule.stages(), kind);
        let len = micro * seq * hidden;
        let name = self.work.message_name(what, mb, stage);
        if self.to_post.contains(&(mailbox, (mb, stage))) {
            let posted = self.exec.recv_start(len, src, tag)?;
            self.state.posted.insert((mailbox, (mb, stage)), posted);
            self.done(clock, Spent::Neither, "recv", format!("post {name}"));
            return Ok(());
        }
        let v = self.exec.recv(len, src, tag)?;
        self.post(mailbox, (mb, stage), v);
        self.done(clock, Spent::Wait, "recv", name);
        Ok(())
    }

    fn backward_weight(&mut self, mb: usize, stage: usize, clock: Clock) {
        self.reducer
            .set_last_micro_batch(self.final_weight.get(&stage) == Some(&mb));
        deferred::run((mb, stage));
        let step = self.work.step;
        self.done(
            clock,
            Spent::Compute,
            "weight",
            format!("W{mb} s{stage} t{step}"),
        );
    }

    /// The passes of (`mb`, `stage`): its micro-batch, weights and step, the stage's units.
    fn stage_run(
        &self,
        action: Action,
        mb: usize,
        stage: usize,
    ) -> Result<StageRun<'a, B, M>, PipelineError> {
        let rank = self.exec.rank;
        let picked =
            (self.work.pick(mb)).ok_or_else(|| missing(rank, action, "its micro-batch"))?;
        let units = self.exec.units(stage);
        let recomputed = self.exec.plan.recompute_units[stage].min(units.len());
        Ok(StageRun {
            model: picked.model,
            reducer: self.reducer,
            shards: self.work.shards,
            units,
            recomputed,
            batch: picked.batch,
            step: picked.step,
            mb_in_step: picked.mb,
            device: self.device,
            rank,
            action,
        })
    }

    fn post(&mut self, mailbox: Mailbox, key: Key, values: Vec<f32>) {
        self.state.mail.insert((mailbox, key), values);
    }

    fn take(
        &mut self,
        mailbox: Mailbox,
        key: Key,
        action: Action,
        what: &'static str,
    ) -> Result<Vec<f32>, PipelineError> {
        (self.state.mail.remove(&(mailbox, key)))
            .ok_or_else(|| missing(self.exec.rank, action, what))
    }

    /// Counts an action's time and records it in the trace.
    fn done(&mut self, clock: Clock, spent: Spent, category: &str, name: String) {
        let seconds = clock.t0.elapsed().as_secs_f64();
        let report = &mut self.state.report;
        match spent {
            Spent::Compute => report.compute_s += seconds,
            Spent::Wait => report.wait_s += seconds,
            Spent::Neither => {}
        }
        self.exec.record(category, name, clock.start);
    }
}

fn missing(rank: usize, action: Action, what: &'static str) -> PipelineError {
    PipelineError::Missing { rank, action, what }
}

/// The receives in `actions` posted ahead of a pair ([`pairs::posted_ahead_of_pair`]), by
/// mailbox and (micro-batch, stage).
fn posted_ahead_of_pairs(actions: &[Action]) -> HashSet<(Mailbox, Key)> {
    let at = |j: usize| actions.get(j).copied();
    (actions.iter().enumerate())
        .filter(|&(i, _)| pairs::posted_ahead_of_pair(at, i))
        .filter_map(|(_, a)| match *a {
            Action::RecvActivation { mb, stage } => Some((Mailbox::ActivationIn, (mb, stage))),
            Action::RecvGrad { mb, stage } => Some((Mailbox::GradIn, (mb, stage))),
            _ => None,
        })
        .collect()
}

/// By each pair's forward (micro-batch, stage): the W after the pair whose weight gradients
/// the forward computes while its all-to-alls wait ([`pairs::weight_after_pair`]).
fn weights_after_pairs(actions: &[Action]) -> HashMap<Key, Key> {
    let at = |j: usize| actions.get(j).copied();
    (actions.iter().enumerate())
        .filter_map(|(i, a)| match *a {
            Action::ForwardBackward {
                forward_mb,
                forward_stage,
                ..
            } => Some((
                (forward_mb, forward_stage),
                pairs::weight_after_pair(at, i)?,
            )),
            _ => None,
        })
        .collect()
}

/// The micro-batch of each stage's last backward pass in `actions` (its last W pass with
/// `weight`): after it the stage's gradients are final.
pub(super) fn final_micro_batches(actions: &[Action], weight: bool) -> HashMap<usize, usize> {
    let mut last = HashMap::new();
    for a in actions.iter().flat_map(|a| a.parts()) {
        match (a, weight) {
            (Action::Backward { mb, stage }, false)
            | (Action::BackwardWeight { mb, stage }, true) => {
                last.insert(stage, mb);
            }
            _ => {}
        }
    }
    last
}
