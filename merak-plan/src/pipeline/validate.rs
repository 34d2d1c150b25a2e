//! Proof that a schedule is complete and free of deadlock, before anything runs it.
//!
//! [`validate`] checks a [`Schedule`] in two passes:
//!
//! 1. Completeness, statically: every (micro-batch, stage) has exactly one `Forward` and one
//!    `Backward`, on the stage's rank; there is exactly one send and one receive per
//!    cross-rank edge (none when `p = 1`), on the right ranks; at most one `Recompute` per
//!    (micro-batch, stage), only for recomputing stages, between its forward and its backward;
//!    and every rank ends with exactly one `OptimizerStep`.
//! 2. Dependencies and deadlock freedom, by running all ranks' lists in an abstract machine
//!    where sends enqueue messages (never blocking) and a receive runs only once its message
//!    has been sent. A compute action whose local input is not there yet (say a forward before
//!    the receive of its activation) is [`ValidationError::NotReady`]; if no rank can advance
//!    while some are unfinished, every blocked rank and the receive it waits at is reported as
//!    [`ValidationError::Deadlock`].
//!
//! The same machine, with costs, times the simulator ([`simulate`](super::simulate::simulate)).

use hashbrown::{HashMap, HashSet};
use std::fmt::Write as _;

use super::pairs::{posted_ahead_of_pair, weight_after_pair};
use super::schedule::{Action, Schedule, ScheduleKind, rank_of_stage};
use super::timing::{Costs, TimedAction};

/// Why a schedule is not valid.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ValidationError {
    /// The schedule's own numbers do not fit together (zero ranks, a wrong number of lists...).
    #[error("malformed schedule: {what}")]
    Malformed {
        /// What is wrong.
        what: String,
    },
    /// An action names a micro-batch or a stage that does not exist.
    #[error(
        "rank {rank}: {action} is out of range ({micro_batches} micro-batches, {stages} stages)"
    )]
    OutOfRange {
        /// The rank whose list holds the action.
        rank: usize,
        /// The action.
        action: Action,
        /// Micro-batches per step.
        micro_batches: usize,
        /// Global stages.
        stages: usize,
    },
    /// A needed action is absent.
    #[error("rank {rank} is missing {action}")]
    Missing {
        /// The rank that should run it.
        rank: usize,
        /// The absent action.
        action: Action,
    },
    /// An action appears more than once.
    #[error("rank {rank}: {action} appears more than once")]
    Duplicate {
        /// The rank of the second occurrence.
        rank: usize,
        /// The repeated action.
        action: Action,
    },
    /// An action is in the list of a rank that does not hold its stage.
    #[error("rank {rank}: {action} belongs to rank {expected}")]
    WrongRank {
        /// The rank whose list holds it.
        rank: usize,
        /// The action.
        action: Action,
        /// The rank of its stage.
        expected: usize,
    },
    /// A send or receive that no edge of the pipeline needs.
    #[error("rank {rank}: unexpected message {action}: {reason}")]
    UnexpectedMessage {
        /// The rank whose list holds it.
        rank: usize,
        /// The message.
        action: Action,
        /// Why no edge needs it.
        reason: String,
    },
    /// A `Recompute` for a stage that does not recompute, or not between its forward and its
    /// backward.
    #[error("rank {rank}: {action} is misplaced: {reason}")]
    RecomputeMisplaced {
        /// The rank whose list holds it.
        rank: usize,
        /// The recompute action.
        action: Action,
        /// What is wrong with it.
        reason: String,
    },
    /// An `OptimizerStep` that is not the last action of its rank.
    #[error(
        "rank {rank}: OptimizerStep at position {position} of {len} actions, it must be the last"
    )]
    OptimizerStepMisplaced {
        /// The rank.
        rank: usize,
        /// Its position in the rank's list.
        position: usize,
        /// The length of the rank's list.
        len: usize,
    },
    /// A rank reaches an action whose local input is not there (and never will be: it would
    /// have to come from earlier in the same list).
    #[error("rank {rank}: {action} is not ready, it needs {needs}")]
    NotReady {
        /// The rank.
        rank: usize,
        /// The action it cannot run.
        action: Action,
        /// What it lacks.
        needs: String,
    },
    /// No rank can advance while some are unfinished: each listed rank waits at a receive whose
    /// message is never sent.
    #[error("deadlock: {}", describe_blocked(.blocked))]
    Deadlock {
        /// Every blocked rank and the action it waits at.
        blocked: Vec<(usize, Action)>,
    },
    /// The simulator's costs do not have one entry per stage.
    #[error("costs: `{field}` has {len} entries, the schedule has {stages} stages")]
    CostLength {
        /// The cost vector.
        field: &'static str,
        /// Its length.
        len: usize,
        /// Global stages.
        stages: usize,
    },
    /// A weight-gradient pass in a schedule whose backward is not split.
    #[error(
        "rank {rank}: {action} in a {kind} schedule, whose backward computes the weight \
         gradients itself"
    )]
    Unsplit {
        /// The rank.
        rank: usize,
        /// The action.
        action: Action,
        /// The schedule's kind.
        kind: ScheduleKind,
    },
    /// A [`Action::ForwardBackward`] pair in a schedule whose kind runs its passes apart.
    #[error(
        "rank {rank}: {action} is an overlapped pair, which only the dualpipev schedule runs, not {kind}"
    )]
    Unpaired {
        /// The rank.
        rank: usize,
        /// The action.
        action: Action,
        /// The schedule's kind.
        kind: ScheduleKind,
    },
    /// The simulator was asked for zero steps.
    #[error("simulate needs at least one step")]
    ZeroSteps,
    /// The simulator was asked for more actions than it simulates at once.
    #[error(
        "simulating {steps} steps of {actions} actions each is too large (at most {max}          actions in all): simulate fewer steps"
    )]
    TooManySteps {
        /// Steps asked for.
        steps: usize,
        /// Actions per step.
        actions: usize,
        /// The most actions simulated at once.
        max: usize,
    },
    /// A cost that is negative or not a number.
    #[error("costs: `{field}` of stage {stage} is {value}; costs must be finite and >= 0")]
    BadCost {
        /// The cost vector.
        field: &'static str,
        /// The stage.
        stage: usize,
        /// The value.
        value: f64,
    },
}

fn describe_blocked(blocked: &[(usize, Action)]) -> String {
    let mut out = String::new();
    for (i, (rank, action)) in blocked.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "rank {rank} waits at {action}");
    }
    out
}

/// Checks that `s` is complete (every needed action once, on the right rank, nothing extra) and
/// that running all ranks' lists with buffered sends and blocking receives finishes, every
/// action finding its inputs ready. See the [module docs](self).
pub fn validate(s: &Schedule) -> Result<(), ValidationError> {
    check_complete(s)?;
    let lists: Vec<Vec<(usize, Action)>> = s
        .actions
        .iter()
        .map(|list| list.iter().map(|&a| (0, a)).collect())
        .collect();
    execute(s.kind, s.ranks, s.stages(), &s.recompute, &lists, None)?;
    Ok(())
}

/// The messages rank-crossing edges need, as (rank, action).
fn needed_messages(s: &Schedule) -> Vec<(usize, Action)> {
    let stages = s.stages();
    let mut out = Vec::new();
    if s.ranks < 2 {
        return out;
    }
    for mb in 0..s.micro_batches {
        for stage in 0..stages {
            let rank = s.rank_of(stage);
            if stage > 0 && s.rank_of(stage - 1) != rank {
                out.push((rank, Action::RecvActivation { mb, stage }));
                out.push((rank, Action::SendGrad { mb, stage }));
            }
            if stage + 1 < stages && s.rank_of(stage + 1) != rank {
                out.push((rank, Action::SendActivation { mb, stage }));
                out.push((rank, Action::RecvGrad { mb, stage }));
            }
        }
    }
    out
}

/// Why `action` (a message) is not needed by any edge, if it is not.
fn unexpected_reason(s: &Schedule, action: Action) -> Option<String> {
    if !action.is_message() {
        return None;
    }
    if s.ranks < 2 {
        return Some("a one-rank pipeline hands over locally, without messages".to_string());
    }
    let last = s.stages() - 1;
    let stage = action.stage().unwrap_or(0);
    let peer = match action {
        Action::SendActivation { .. } | Action::RecvGrad { .. } => Some(stage + 1),
        _ => stage.checked_sub(1),
    };
    if let Some(peer) = peer.filter(|&p| p <= last && s.rank_of(p) == s.rank_of(stage)) {
        return Some(format!(
            "stages {stage} and {peer} share rank {}, which hands over locally",
            s.rank_of(stage)
        ));
    }
    match action {
        Action::SendActivation { stage, .. } if stage == last => Some(format!(
            "stage {stage} is the last stage, its output is the loss"
        )),
        Action::RecvGrad { stage, .. } if stage == last => Some(format!(
            "stage {stage} is the last stage, its output gradient is the loss's"
        )),
        Action::RecvActivation { stage: 0, .. } => {
            Some("stage 0 reads the data, it receives no activation".to_string())
        }
        Action::SendGrad { stage: 0, .. } => {
            Some("stage 0 has no previous stage to send a gradient to".to_string())
        }
        _ => None,
    }
}

/// Pass 1: completeness.
fn check_complete(s: &Schedule) -> Result<(), ValidationError> {
    check_shape(s)?;
    // Position of every action in its rank's list.
    let mut seen: HashMap<Action, usize> = HashMap::new();
    for (rank, list) in s.actions.iter().enumerate() {
        for (position, &action) in list.iter().enumerate() {
            if matches!(action, Action::ForwardBackward { .. }) && !s.kind.pairs_passes() {
                let kind = s.kind;
                return Err(ValidationError::Unpaired { rank, action, kind });
            }
            // A pair is checked as its forward and its backward at its position.
            for part in action.parts() {
                check_action(s, rank, position, part, list.len(), &mut seen)?;
            }
        }
        // `seen` holds one OptimizerStep per rank at most: reset it for the next rank.
        if seen.remove(&Action::OptimizerStep).is_none() {
            return Err(ValidationError::Missing {
                rank,
                action: Action::OptimizerStep,
            });
        }
    }
    check_all_present(s, &seen)?;
    check_recompute_order(s, &seen)
}

/// The schedule's sizes: at least one rank, micro-batch and stage per rank, one action list
/// per rank and one recompute flag per stage.
fn check_shape(s: &Schedule) -> Result<(), ValidationError> {
    if s.ranks == 0 || s.micro_batches == 0 || s.virtual_stages == 0 {
        return Err(ValidationError::Malformed {
            what: format!(
                "ranks = {}, micro_batches = {}, virtual_stages = {} (all must be >= 1)",
                s.ranks, s.micro_batches, s.virtual_stages
            ),
        });
    }
    if s.actions.len() != s.ranks {
        return Err(ValidationError::Malformed {
            what: format!("{} action lists for {} ranks", s.actions.len(), s.ranks),
        });
    }
    let stages = s.stages();
    if s.recompute.len() != stages {
        return Err(ValidationError::Malformed {
            what: format!(
                "recompute has {} entries for {stages} stages",
                s.recompute.len()
            ),
        });
    }
    Ok(())
}

/// One action at `position` of `rank`'s list of `len`: in range, on its stage's rank, allowed
/// by the schedule's kind, not seen before (noted in `seen`); the optimizer step last.
fn check_action(
    s: &Schedule,
    rank: usize,
    position: usize,
    action: Action,
    len: usize,
    seen: &mut HashMap<Action, usize>,
) -> Result<(), ValidationError> {
    let (Some(mb), Some(stage)) = (action.micro_batch(), action.stage()) else {
        // The optimizer step.
        if seen.contains_key(&action) {
            return Err(ValidationError::Duplicate { rank, action });
        }
        if position + 1 != len {
            return Err(ValidationError::OptimizerStepMisplaced {
                rank,
                position,
                len,
            });
        }
        seen.insert(action, position);
        return Ok(());
    };
    let stages = s.stages();
    if mb >= s.micro_batches || stage >= stages {
        return Err(ValidationError::OutOfRange {
            rank,
            action,
            micro_batches: s.micro_batches,
            stages,
        });
    }
    if let Some(reason) = unexpected_reason(s, action) {
        return Err(ValidationError::UnexpectedMessage {
            rank,
            action,
            reason,
        });
    }
    if matches!(action, Action::BackwardWeight { .. }) && !s.kind.splits_backward() {
        return Err(ValidationError::Unsplit {
            rank,
            action,
            kind: s.kind,
        });
    }
    if matches!(action, Action::Recompute { .. }) && !s.recompute[stage] {
        return Err(ValidationError::RecomputeMisplaced {
            rank,
            action,
            reason: format!("stage {stage} does not recompute"),
        });
    }
    let expected = s.rank_of(stage);
    if rank != expected {
        return Err(ValidationError::WrongRank {
            rank,
            action,
            expected,
        });
    }
    if seen.insert(action, position).is_some() {
        return Err(ValidationError::Duplicate { rank, action });
    }
    Ok(())
}

/// Every (micro-batch, stage) has its forward and backward pass (and W pass when the backward
/// is split), and every message the stages' placement needs is sent and received.
fn check_all_present(s: &Schedule, seen: &HashMap<Action, usize>) -> Result<(), ValidationError> {
    for mb in 0..s.micro_batches {
        for stage in 0..s.stages() {
            let rank = s.rank_of(stage);
            for action in [
                Action::Forward { mb, stage },
                Action::Backward { mb, stage },
            ] {
                if !seen.contains_key(&action) {
                    return Err(ValidationError::Missing { rank, action });
                }
            }
            let action = Action::BackwardWeight { mb, stage };
            if s.kind.splits_backward() && !seen.contains_key(&action) {
                return Err(ValidationError::Missing { rank, action });
            }
        }
    }
    for (rank, action) in needed_messages(s) {
        if !seen.contains_key(&action) {
            return Err(ValidationError::Missing { rank, action });
        }
    }
    Ok(())
}

/// Every recomputation between its forward and its backward pass (on the same rank: checked
/// with each action).
fn check_recompute_order(
    s: &Schedule,
    seen: &HashMap<Action, usize>,
) -> Result<(), ValidationError> {
    for (rank, list) in s.actions.iter().enumerate() {
        for (position, &action) in list.iter().enumerate() {
            if let Action::Recompute { mb, stage } = action {
                let forward = seen.get(&Action::Forward { mb, stage }).copied();
                let backward = seen.get(&Action::Backward { mb, stage }).copied();
                let ok =
                    forward.is_some_and(|f| f < position) && backward.is_some_and(|b| position < b);
                if !ok {
                    return Err(ValidationError::RecomputeMisplaced {
                        rank,
                        action,
                        reason: "it must come after its Forward and before its Backward"
                            .to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// (step, micro-batch, stage).
type Key = (usize, usize, usize);

/// The abstract machine's state: what has been computed, sent and received.
#[derive(Default)]
struct Machine {
    forward: HashSet<Key>,
    backward: HashSet<Key>,
    weight: HashSet<Key>,
    recomputed: HashSet<Key>,
    /// Activations received, by receiving stage.
    activation_in: HashSet<Key>,
    /// Gradients received, by receiving stage.
    grad_in: HashSet<Key>,
    /// Activations sent, by sending stage, with the send time.
    activation_sent: HashMap<Key, f64>,
    /// Gradients sent, by sending stage, with the send time.
    grad_sent: HashMap<Key, f64>,
    /// Messages received by a receive posted ahead of a pair, by (activation?, receiving
    /// stage), with the time they are there; the pair waits for them.
    arrival: HashMap<(bool, Key), f64>,
    /// When the forward pass of a pair ended, by its stage: its send leaves then.
    forward_end: HashMap<Key, f64>,
    /// The part of a W that a pair's forward computed while its all-to-alls waited.
    filled: HashMap<Key, f64>,
    /// The ranks that reached each step's `OptimizerStep` (a barrier: the global gradient norm
    /// is a collective over all ranks), with the latest arrival time.
    arrived: HashMap<usize, (HashSet<usize>, f64)>,
}

/// What happened when a rank tried its next action.
enum Outcome {
    /// It ran from `.0` to `.1`.
    Ran(f64, f64),
    /// It is a receive whose message has not been sent yet.
    Blocked,
    /// Its local input is missing.
    NotReady(String),
}

/// Runs the ranks' lists of (step, action) in the abstract machine; `costs` gives the times
/// (all zero when `None`). Each rank runs its actions in order, each starting when the rank is
/// free; a receive completes at `max(rank free, send time + transfer)`. A receive posted ahead
/// of a [`Action::ForwardBackward`] pair (only receives between it and the pair) takes no time
/// where it stands: the pair's forward starts once its input is there and its backward once
/// the forward is done and its gradient is there, and the forward's send leaves when the
/// forward ends; a W right after a pair (of another backward) costs the pair's forward's
/// all-to-all waits less, down to nothing, as the forward computed that much of it while it
/// waited. Returns the timed actions of every rank.
pub(crate) fn execute(
    kind: ScheduleKind,
    ranks: usize,
    stages: usize,
    recompute: &[bool],
    lists: &[Vec<(usize, Action)>],
    costs: Option<&Costs>,
) -> Result<Vec<Vec<TimedAction>>, ValidationError> {
    let setting = Setting {
        kind,
        ranks,
        stages,
        recompute,
        costs,
    };
    let mut machine = Machine::default();
    let mut next = vec![0usize; lists.len()];
    let mut free = vec![0.0f64; lists.len()];
    let mut timed: Vec<Vec<TimedAction>> =
        lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    loop {
        let mut progressed = false;
        for (rank, list) in lists.iter().enumerate() {
            while let Some(&(step, action)) = list.get(next[rank]) {
                let at = |j: usize| list.get(j).map(|&(_, a)| a);
                let ahead = Ahead {
                    posted: posted_ahead_of_pair(at, next[rank]),
                    fill: weight_after_pair(at, next[rank]),
                };
                let at = (rank, step, free[rank]);
                let outcome = machine.try_run(&setting, at, action, ahead);
                match outcome {
                    Outcome::Ran(start, end) => {
                        timed[rank].push(TimedAction {
                            action,
                            step,
                            start,
                            end,
                        });
                        free[rank] = end;
                        next[rank] += 1;
                        progressed = true;
                    }
                    Outcome::Blocked => break,
                    Outcome::NotReady(needs) => {
                        return Err(ValidationError::NotReady {
                            rank,
                            action,
                            needs,
                        });
                    }
                }
            }
        }
        let blocked: Vec<(usize, Action)> = lists
            .iter()
            .enumerate()
            .filter_map(|(rank, list)| list.get(next[rank]).map(|&(_, a)| (rank, a)))
            .collect();
        if blocked.is_empty() {
            return Ok(timed);
        }
        if !progressed {
            return Err(ValidationError::Deadlock { blocked });
        }
    }
}

/// What a rank's next action looks like from where it stands: a receive `posted` ahead of a
/// pair, or a pair whose forward `fill`s its waits with the following W.
#[derive(Clone, Copy)]
struct Ahead {
    posted: bool,
    fill: Option<(usize, usize)>,
}

/// What every action of one run of the machine shares: the schedule's shape and the costs.
struct Setting<'a> {
    kind: ScheduleKind,
    ranks: usize,
    stages: usize,
    recompute: &'a [bool],
    costs: Option<&'a Costs>,
}

impl Setting<'_> {
    /// Whether two stages are on one rank (they hand over without a message).
    fn same_rank(&self, a: usize, b: usize) -> bool {
        rank_of_stage(self.kind, self.ranks, a) == rank_of_stage(self.kind, self.ranks, b)
    }

    /// The cost of `stage` in the list `pick` chooses (0 without costs).
    fn cost(&self, pick: fn(&Costs) -> &Vec<f64>, stage: usize) -> f64 {
        (self.costs.map(pick))
            .and_then(|v| v.get(stage))
            .copied()
            .unwrap_or(0.0)
    }

    /// The share of a backward pass a split backward's W pays (B pays the rest).
    fn weight_share(&self) -> f64 {
        self.costs.map_or(0.0, |c| c.weight_share)
    }
}

/// The outcome of an action that needs `action` to have run earlier on `rank`.
fn earlier(action: Action, rank: usize) -> Outcome {
    Outcome::NotReady(format!("{action} earlier on rank {rank}"))
}

impl Machine {
    /// Tries `action` of `step` on `rank`, which is free from `free` (`at`); a receive posted
    /// ahead of a pair only notes when its message is there (`ahead`).
    fn try_run(
        &mut self,
        set: &Setting<'_>,
        (rank, step, free): (usize, usize, f64),
        action: Action,
        ahead: Ahead,
    ) -> Outcome {
        let posted = ahead.posted;
        let compute = |duration: f64| Outcome::Ran(free, free + duration);
        match action {
            Action::Forward { mb, stage } => match self.forward(set, rank, step, mb, stage) {
                Ok(()) => compute(set.cost(|c| &c.forward, stage)),
                Err(outcome) => outcome,
            },
            Action::Recompute { mb, stage } => {
                if !self.forward.contains(&(step, mb, stage)) {
                    return earlier(Action::Forward { mb, stage }, rank);
                }
                self.recomputed.insert((step, mb, stage));
                compute(set.cost(|c| &c.recompute, stage))
            }
            Action::Backward { mb, stage } => match self.backward(set, rank, step, mb, stage) {
                Ok(duration) => compute(duration),
                Err(outcome) => outcome,
            },
            Action::BackwardWeight { mb, stage } => {
                if !self.backward.contains(&(step, mb, stage)) {
                    return earlier(Action::Backward { mb, stage }, rank);
                }
                self.weight.insert((step, mb, stage));
                let filled = self.filled.remove(&(step, mb, stage)).unwrap_or(0.0);
                compute(set.cost(|c| &c.backward, stage) * set.weight_share() - filled)
            }
            Action::SendActivation { mb, stage } => {
                if !self.forward.contains(&(step, mb, stage)) {
                    return earlier(Action::Forward { mb, stage }, rank);
                }
                let key = (step, mb, stage);
                let at = self.forward_end.remove(&key).unwrap_or(free);
                self.activation_sent.insert(key, at);
                Outcome::Ran(free, free)
            }
            Action::SendGrad { mb, stage } => {
                if !self.backward.contains(&(step, mb, stage)) {
                    return earlier(Action::Backward { mb, stage }, rank);
                }
                self.grad_sent.insert((step, mb, stage), free);
                Outcome::Ran(free, free)
            }
            Action::RecvActivation { mb, stage } => {
                let outcome = self.recv_activation(set, step, mb, stage, free);
                self.post(outcome, posted.then_some((true, (step, mb, stage))), free)
            }
            Action::RecvGrad { mb, stage } => {
                let outcome = self.recv_grad(set, step, mb, stage, free);
                self.post(outcome, posted.then_some((false, (step, mb, stage))), free)
            }
            Action::ForwardBackward { .. } => {
                let outcome = self.pair(set, (rank, step, free), action);
                if let (Outcome::Ran(..), Some((mb, stage))) = (&outcome, ahead.fill) {
                    let forward_stage = action.stage().unwrap_or(0);
                    let waits = set.cost(|c| &c.forward_comm, forward_stage);
                    let work = set.cost(|c| &c.backward, stage) * set.weight_share();
                    self.filled.insert((step, mb, stage), waits.min(work));
                }
                outcome
            }
            Action::OptimizerStep => self.optimizer_step(set, rank, step, free),
        }
    }

    /// A receive's `outcome`, or for one posted ahead of a pair (`key`) none of its time: the
    /// message's arrival is noted for the pair.
    fn post(&mut self, outcome: Outcome, key: Option<(bool, Key)>, free: f64) -> Outcome {
        match (outcome, key) {
            (Outcome::Ran(_, there), Some(key)) => {
                self.arrival.insert(key, there);
                Outcome::Ran(free, free)
            }
            (outcome, _) => outcome,
        }
    }

    /// An overlapped pair: its forward once its input is there, then its backward once its
    /// gradient is there too.
    fn pair(
        &mut self,
        set: &Setting<'_>,
        (rank, step, free): (usize, usize, f64),
        action: Action,
    ) -> Outcome {
        let Action::ForwardBackward {
            forward_mb,
            forward_stage,
            backward_mb,
            backward_stage,
        } = action
        else {
            return Outcome::NotReady(format!("{action} is not a pair"));
        };
        let f = (step, forward_mb, forward_stage);
        let b = (step, backward_mb, backward_stage);
        if let Err(outcome) = self.forward(set, rank, step, forward_mb, forward_stage) {
            return outcome;
        }
        let backward = match self.backward(set, rank, step, backward_mb, backward_stage) {
            Ok(duration) => duration,
            Err(outcome) => return outcome,
        };
        let there = |m: &mut Self, key| m.arrival.remove(&key).unwrap_or(0.0);
        let start = free.max(there(self, (true, f)));
        let forward_end = start + set.cost(|c| &c.forward, forward_stage);
        self.forward_end.insert(f, forward_end);
        let backward_start = forward_end.max(there(self, (false, b)));
        Outcome::Ran(start, backward_start + backward)
    }

    /// A forward pass, once its input is there: the data (stage 0), the previous stage's
    /// forward on this rank, or the received activation.
    fn forward(
        &mut self,
        set: &Setting<'_>,
        rank: usize,
        step: usize,
        mb: usize,
        stage: usize,
    ) -> Result<(), Outcome> {
        let local = stage > 0 && set.same_rank(stage - 1, stage);
        let input = stage == 0
            || if local {
                self.forward.contains(&(step, mb, stage - 1))
            } else {
                self.activation_in.contains(&(step, mb, stage))
            };
        if !input {
            return Err(if local {
                earlier(
                    Action::Forward {
                        mb,
                        stage: stage - 1,
                    },
                    rank,
                )
            } else {
                earlier(Action::RecvActivation { mb, stage }, rank)
            });
        }
        self.forward.insert((step, mb, stage));
        Ok(())
    }

    /// A backward pass, once its forward ran and its output gradient is there (the last stage
    /// needs none); returns its duration (with the recomputation no `Recompute` did).
    fn backward(
        &mut self,
        set: &Setting<'_>,
        rank: usize,
        step: usize,
        mb: usize,
        stage: usize,
    ) -> Result<f64, Outcome> {
        let key = (step, mb, stage);
        if !self.forward.contains(&key) {
            return Err(earlier(Action::Forward { mb, stage }, rank));
        }
        let local = stage + 1 < set.stages && set.same_rank(stage + 1, stage);
        let grad = stage + 1 >= set.stages
            || if local {
                self.backward.contains(&(step, mb, stage + 1))
            } else {
                self.grad_in.contains(&key)
            };
        if !grad {
            return Err(if local {
                earlier(
                    Action::Backward {
                        mb,
                        stage: stage + 1,
                    },
                    rank,
                )
            } else {
                earlier(Action::RecvGrad { mb, stage }, rank)
            });
        }
        self.backward.insert(key);
        // A split backward's B pays the input-gradient share, its W the rest.
        let b_share = if set.kind.splits_backward() {
            1.0 - set.weight_share()
        } else {
            1.0
        };
        let mut duration = set.cost(|c| &c.backward, stage) * b_share;
        if set.recompute.get(stage).copied().unwrap_or(false) && !self.recomputed.contains(&key) {
            duration += set.cost(|c| &c.recompute, stage);
        }
        Ok(duration)
    }

    /// Receives the activation of (`mb`, `stage`) once the previous stage has sent it.
    fn recv_activation(
        &mut self,
        set: &Setting<'_>,
        step: usize,
        mb: usize,
        stage: usize,
        free: f64,
    ) -> Outcome {
        let Some(sender) = stage.checked_sub(1) else {
            return Outcome::NotReady("a previous stage (stage 0 has none)".to_string());
        };
        let Some(&sent) = self.activation_sent.get(&(step, mb, sender)) else {
            return Outcome::Blocked;
        };
        self.activation_in.insert((step, mb, stage));
        let transfer = set.costs.map_or(0.0, |c| c.send_activation);
        Outcome::Ran(free.max(sent), free.max(sent + transfer))
    }

    /// Receives the gradient of (`mb`, `stage`)'s output once the next stage has sent it.
    fn recv_grad(
        &mut self,
        set: &Setting<'_>,
        step: usize,
        mb: usize,
        stage: usize,
        free: f64,
    ) -> Outcome {
        if stage + 1 >= set.stages {
            return Outcome::NotReady(format!("a next stage (stage {stage} is the last)"));
        }
        let Some(&sent) = self.grad_sent.get(&(step, mb, stage + 1)) else {
            return Outcome::Blocked;
        };
        self.grad_in.insert((step, mb, stage));
        let transfer = set.costs.map_or(0.0, |c| c.send_grad);
        Outcome::Ran(free.max(sent), free.max(sent + transfer))
    }

    /// The optimizer step: a barrier over all ranks (the global gradient norm).
    fn optimizer_step(
        &mut self,
        set: &Setting<'_>,
        rank: usize,
        step: usize,
        free: f64,
    ) -> Outcome {
        let (ranks_in, latest) = self.arrived.entry(step).or_default();
        ranks_in.insert(rank);
        *latest = latest.max(free);
        if ranks_in.len() < set.ranks {
            return Outcome::Blocked;
        }
        let start = *latest;
        Outcome::Ran(start, start + set.costs.map_or(0.0, |c| c.optimizer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::{ScheduleKind, build_schedule};

    fn patterns(stages: usize) -> Vec<Vec<bool>> {
        vec![
            vec![false; stages],
            vec![true; stages],
            (0..stages).map(|s| s + 1 < stages).collect(),
            (0..stages).map(|s| s % 2 == 0).collect(),
        ]
    }

    #[test]
    fn every_schedule_kind_validates() {
        let mut checked = 0;
        for kind in ScheduleKind::ALL {
            for p in 1..=4 {
                for m in kind.min_micro_batches(p)..=8usize {
                    let virtuals: Vec<usize> = if kind == ScheduleKind::Interleaved {
                        if !m.is_multiple_of(p) {
                            continue;
                        }
                        vec![2, 3]
                    } else if kind.v_shaped() {
                        vec![2]
                    } else {
                        vec![1]
                    };
                    for v in virtuals {
                        for recompute in patterns(p * v) {
                            let s = build_schedule(kind, p, m, v, &recompute).unwrap();
                            if let Err(e) = validate(&s) {
                                panic!("{kind} p={p} m={m} v={v} {recompute:?}: {e}");
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 400, "{checked}");
    }

    fn one_f_one_b(p: usize, m: usize) -> Schedule {
        build_schedule(ScheduleKind::OneFOneB, p, m, 1, &vec![false; p]).unwrap()
    }

    #[test]
    fn a_split_backward_needs_each_w_once_after_its_b_and_only_where_split() {
        let zb = build_schedule(ScheduleKind::ZbH1, 2, 4, 1, &[false; 2]).unwrap();
        validate(&zb).unwrap();
        let w = Action::BackwardWeight { mb: 1, stage: 1 };
        // Without one of its W passes.
        let mut s = zb.clone();
        s.actions[1].retain(|a| *a != w);
        assert_eq!(
            validate(&s),
            Err(ValidationError::Missing { rank: 1, action: w })
        );
        // A W before its B.
        let mut s = zb.clone();
        s.actions[1].retain(|a| *a != w);
        s.actions[1].insert(0, w);
        assert!(
            matches!(validate(&s), Err(ValidationError::NotReady { action, .. }) if action == w),
            "{:?}",
            validate(&s)
        );
        // A W in a schedule that does not split.
        let mut s = build_schedule(ScheduleKind::OneFOneB, 2, 4, 1, &[false; 2]).unwrap();
        let end = s.actions[1].len() - 1;
        s.actions[1].insert(end, w);
        assert!(
            matches!(validate(&s), Err(ValidationError::Unsplit { rank: 1, .. })),
            "{:?}",
            validate(&s)
        );
    }

    #[test]
    fn a_missing_receive_is_reported() {
        let mut s = one_f_one_b(2, 2);
        let recv = Action::RecvActivation { mb: 1, stage: 1 };
        s.actions[1].retain(|a| *a != recv);
        assert_eq!(
            validate(&s),
            Err(ValidationError::Missing {
                rank: 1,
                action: recv
            })
        );
    }

    #[test]
    fn a_receive_after_its_use_is_not_ready() {
        let mut s = one_f_one_b(2, 1);
        // Rank 1: RecvActivation, Forward, ... -> Forward, RecvActivation, ...
        s.actions[1].swap(0, 1);
        assert_eq!(
            validate(&s),
            Err(ValidationError::NotReady {
                rank: 1,
                action: Action::Forward { mb: 0, stage: 1 },
                needs: "RecvActivation(mb=0, stage=1) earlier on rank 1".to_string(),
            })
        );
    }

    #[test]
    fn a_cycle_is_a_deadlock() {
        let mut s = one_f_one_b(2, 1);
        use Action::*;
        // Rank 0 waits for the gradient before sending the activation rank 1 waits for.
        s.actions[0] = vec![
            Forward { mb: 0, stage: 0 },
            RecvGrad { mb: 0, stage: 0 },
            SendActivation { mb: 0, stage: 0 },
            Backward { mb: 0, stage: 0 },
            OptimizerStep,
        ];
        let err = validate(&s).unwrap_err();
        assert_eq!(
            err,
            ValidationError::Deadlock {
                blocked: vec![
                    (0, RecvGrad { mb: 0, stage: 0 }),
                    (1, RecvActivation { mb: 0, stage: 1 }),
                ]
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0 waits at RecvGrad(mb=0, stage=0)"),
            "{msg}"
        );
        assert!(
            msg.contains("rank 1 waits at RecvActivation(mb=0, stage=1)"),
            "{msg}"
        );
    }

    #[test]
    fn a_duplicated_forward_is_rejected() {
        let mut s = one_f_one_b(3, 4);
        let forward = Action::Forward { mb: 2, stage: 1 };
        let at = s.actions[1].iter().position(|a| *a == forward).unwrap();
        s.actions[1].insert(at, forward);
        assert_eq!(
            validate(&s),
            Err(ValidationError::Duplicate {
                rank: 1,
                action: forward
            })
        );
    }

    #[test]
    fn an_action_on_the_wrong_rank_is_rejected() {
        let mut s = one_f_one_b(2, 2);
        let backward = Action::Backward { mb: 1, stage: 1 };
        s.actions[1].retain(|a| *a != backward);
        s.actions[0].insert(0, backward);
        assert_eq!(
            validate(&s),
            Err(ValidationError::WrongRank {
                rank: 0,
                action: backward,
                expected: 1
            })
        );
    }

    #[test]
    fn extra_messages_are_rejected() {
        let mut s = build_schedule(ScheduleKind::GPipe, 1, 2, 1, &[false]).unwrap();
        let send = Action::SendActivation { mb: 0, stage: 0 };
        s.actions[0].insert(1, send);
        assert!(matches!(
            validate(&s),
            Err(ValidationError::UnexpectedMessage { rank: 0, action, .. }) if action == send
        ));

        let mut s = one_f_one_b(2, 2);
        let grad = Action::SendGrad { mb: 0, stage: 0 };
        s.actions[0].insert(2, grad);
        assert!(matches!(
            validate(&s),
            Err(ValidationError::UnexpectedMessage { rank: 0, action, .. }) if action == grad
        ));
    }

    #[test]
    fn misplaced_recompute_and_optimizer_are_rejected() {
        // Recompute on a stage that does not recompute.
        let mut s = one_f_one_b(2, 2);
        let recompute = Action::Recompute { mb: 0, stage: 0 };
        let at = s.actions[0]
            .iter()
            .position(|a| *a == Action::Backward { mb: 0, stage: 0 })
            .unwrap();
        s.actions[0].insert(at, recompute);
        assert!(matches!(
            validate(&s),
            Err(ValidationError::RecomputeMisplaced { rank: 0, action, .. }) if action == recompute
        ));

        // Recompute after its backward.
        let mut s =
            build_schedule(ScheduleKind::ShiftedCriticalPath, 2, 2, 1, &[true, true]).unwrap();
        let at = s.actions[0].iter().position(|a| *a == recompute).unwrap();
        s.actions[0].remove(at);
        let len = s.actions[0].len();
        s.actions[0].insert(len - 1, recompute);
        assert!(matches!(
            validate(&s),
            Err(ValidationError::RecomputeMisplaced { rank: 0, action, .. }) if action == recompute
        ));

        // Optimizer step not last, or missing.
        let mut s = one_f_one_b(2, 2);
        s.actions[1].rotate_right(1);
        let len = s.actions[1].len();
        assert_eq!(
            validate(&s),
            Err(ValidationError::OptimizerStepMisplaced {
                rank: 1,
                position: 0,
                len
            })
        );
        let mut s = one_f_one_b(2, 2);
        s.actions[0].pop();
        assert_eq!(
            validate(&s),
            Err(ValidationError::Missing {
                rank: 0,
                action: Action::OptimizerStep
            })
        );
    }

    #[test]
    fn out_of_range_and_malformed() {
        let mut s = one_f_one_b(2, 2);
        s.actions[0].insert(0, Action::Forward { mb: 2, stage: 0 });
        assert!(matches!(
            validate(&s),
            Err(ValidationError::OutOfRange { rank: 0, .. })
        ));
        let mut s = one_f_one_b(2, 2);
        s.actions.pop();
        assert!(matches!(
            validate(&s),
            Err(ValidationError::Malformed { .. })
        ));
    }
}
