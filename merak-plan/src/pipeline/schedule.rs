//! Pipeline schedules as data: per rank, an ordered list of actions.
//!
//! [`build_schedule`] turns a [`ScheduleKind`] and the pipeline shape (ranks, micro-batches,
//! virtual stages, which stages recompute) into a [`Schedule`]: for every pipeline rank the
//! ordered list of [`Action`]s it runs in one training step.
//!
//! Every schedule is built the same way: first the order of the compute actions (forward and
//! backward passes) on each rank, then every forward and backward is wrapped in the messages it
//! needs: the receive of its input right before it, the send of its output right after it.
//! Sends are buffered and never block, so a receive waits only for a send that comes earlier
//! in the sender's list, and the schedules below are deadlock-free by construction (the
//! validator, [`validate`](super::validate::validate), proves it for every built schedule).
//! With one pipeline rank (`p = 1`) consecutive stages hand over locally and no message is
//! emitted.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::dual_pipe_v::dual_pipe_v_order;
use super::order::Op;
use super::zero_bubble::zb_h1_order;

/// One thing a pipeline rank does. `stage` is the global model stage (`0..p*v`), `mb` the
/// micro-batch of the step (`0..m`).
///
/// Messages: `SendActivation { mb, stage: s }` sends the output of stage `s` to the rank of stage
/// `s + 1`, where `RecvActivation { mb, stage: s + 1 }` receives it. `SendGrad { mb, stage: s }`
/// sends the gradient of the input of stage `s` to the rank of stage `s - 1`, where
/// `RecvGrad { mb, stage: s - 1 }` receives it. Sends never block (they are buffered); receives
/// block until the message is there. Consecutive stages on the same rank (only when `p = 1`)
/// hand over locally, without messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    /// Forward pass of micro-batch `mb` through stage `stage`. Needs the input: the received
    /// activation (or the local forward of `stage - 1`, or the data for stage 0).
    Forward {
        /// Micro-batch.
        mb: usize,
        /// Global stage.
        stage: usize,
    },
    /// Recomputation of the forward pass of (`mb`, `stage`) ahead of its backward pass (the
    /// shifted-critical-path schedule places it before the gradient arrives). Without an explicit
    /// `Recompute`, a recomputing stage recomputes inside `Backward`.
    Recompute {
        /// Micro-batch.
        mb: usize,
        /// Global stage.
        stage: usize,
    },
    /// Backward pass of (`mb`, `stage`). Needs its forward and the gradient of its output (the
    /// received gradient, the local backward of `stage + 1`, or the loss for the last stage).
    /// In a schedule that splits the backward ([`ScheduleKind::splits_backward`]) this is only
    /// **B**, the gradient of the stage's input (what the previous stage waits for); the weight
    /// gradients come later in [`Action::BackwardWeight`].
    Backward {
        /// Micro-batch.
        mb: usize,
        /// Global stage.
        stage: usize,
    },
    /// **W**: the weight gradients of (`mb`, `stage`), from what its [`Action::Backward`] kept
    /// (the inputs and output gradients of the stage's linear layers). Nobody waits for it, so a
    /// zero-bubble schedule places it where the rank would idle. Needs that `Backward` earlier
    /// on the same rank; only schedules that split the backward have it.
    BackwardWeight {
        /// Micro-batch.
        mb: usize,
        /// Global stage.
        stage: usize,
    },
    /// Send the output activation of (`mb`, `stage`) to the rank of `stage + 1`.
    SendActivation {
        /// Micro-batch.
        mb: usize,
        /// Global stage whose output is sent.
        stage: usize,
    },
    /// Receive the input activation of (`mb`, `stage`) from the rank of `stage - 1`.
    RecvActivation {
        /// Micro-batch.
        mb: usize,
        /// Global stage whose input is received.
        stage: usize,
    },
    /// Send the input gradient of (`mb`, `stage`) to the rank of `stage - 1`.
    SendGrad {
        /// Micro-batch.
        mb: usize,
        /// Global stage whose input gradient is sent.
        stage: usize,
    },
    /// Receive the output gradient of (`mb`, `stage`) from the rank of `stage + 1`.
    RecvGrad {
        /// Micro-batch.
        mb: usize,
        /// Global stage whose output gradient is received.
        stage: usize,
    },
    /// DualPipeV's overlapped pair ([`ScheduleKind::DualPipeV`]): the forward pass of
    /// (`forward_mb`, `forward_stage`) and the backward pass (B) of (`backward_mb`,
    /// `backward_stage`), two stages of one rank, run as one action so that the messages of
    /// each travel while the other computes. It counts as its [`Action::Forward`] followed by
    /// its [`Action::Backward`] (see [`Action::parts`]). The receives of both inputs come
    /// before it in the list and the sends of both outputs after it; a rank posts those
    /// receives without waiting, waits for the backward's gradient only once the forward is
    /// done, and starts the forward's send before the backward runs (which only moves
    /// messages earlier than the list says, so the list's proof of deadlock freedom holds).
    ForwardBackward {
        /// Micro-batch of the forward pass.
        forward_mb: usize,
        /// Global stage of the forward pass.
        forward_stage: usize,
        /// Micro-batch of the backward pass.
        backward_mb: usize,
        /// Global stage of the backward pass.
        backward_stage: usize,
    },
    /// Apply the optimizer to this rank's parameters (the end of a step).
    OptimizerStep,
}
impl Action {
    /// The passes this action runs, in order: a [`Action::ForwardBackward`] pair's forward and
    /// backward, any other action itself.
    pub fn parts(self) -> impl Iterator<Item = Action> {
        let (first, second) = match self {
            Action::ForwardBackward {
                forward_mb,
                forward_stage,
                backward_mb,
                backward_stage,
            } => (
                Action::Forward {
                    mb: forward_mb,
                    stage: forward_stage,
                },
                Some(Action::Backward {
                    mb: backward_mb,
                    stage: backward_stage,
                }),
            ),
            action => (action, None),
        };
        std::iter::once(first).chain(second)
    }

    /// The micro-batch this action works on (a pair's forward's; `None` for
    /// [`Action::OptimizerStep`]).
    pub fn micro_batch(&self) -> Option<usize> {
        match *self {
            Action::ForwardBackward { forward_mb, .. } => Some(forward_mb),
            Action::Forward { mb, .. }
            | Action::Recompute { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGrad { mb, .. }
            | Action::RecvGrad { mb, .. } => Some(mb),
            Action::OptimizerStep => None,
        }
    }

    /// The global stage this action belongs to (a pair's forward's; `None` for
    /// [`Action::OptimizerStep`]).
    pub fn stage(&self) -> Option<usize> {
        match *self {
            Action::ForwardBackward { forward_stage, .. } => Some(forward_stage),
            Action::Forward { stage, .. }
            | Action::Recompute { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardWeight { stage, .. }
            | Action::SendActivation { stage, .. }
            | Action::RecvActivation { stage, .. }
            | Action::SendGrad { stage, .. }
            | Action::RecvGrad { stage, .. } => Some(stage),
            Action::OptimizerStep => None,
        }
    }

    /// Whether this is a point-to-point message (a send or a receive).
    pub fn is_message(&self) -> bool {
        matches!(
            self,
            Action::SendActivation { .. }
                | Action::RecvActivation { .. }
                | Action::SendGrad { .. }
                | Action::RecvGrad { .. }
        )
    }

    /// Whether this is computation (forward, recompute, backward, weight gradients or the
    /// optimizer step).
    pub fn is_compute(&self) -> bool {
        !self.is_message()
    }

    /// The same action for another micro-batch (the optimizer step is returned unchanged; a
    /// pair's backward moves by as much as its forward).
    pub fn with_micro_batch(self, new_mb: usize) -> Action {
        match self {
            Action::ForwardBackward {
                forward_mb,
                forward_stage,
                backward_mb,
                backward_stage,
            } => Action::ForwardBackward {
                forward_mb: new_mb,
                forward_stage,
                backward_mb: (backward_mb + new_mb).saturating_sub(forward_mb),
                backward_stage,
            },
            Action::Forward { stage, .. } => Action::Forward { mb: new_mb, stage },
            Action::Recompute { stage, .. } => Action::Recompute { mb: new_mb, stage },
            Action::Backward { stage, .. } => Action::Backward { mb: new_mb, stage },
            Action::BackwardWeight { stage, .. } => Action::BackwardWeight { mb: new_mb, stage },
            Action::SendActivation { stage, .. } => Action::SendActivation { mb: new_mb, stage },
            Action::RecvActivation { stage, .. } => Action::RecvActivation { mb: new_mb, stage },
            Action::SendGrad { stage, .. } => Action::SendGrad { mb: new_mb, stage },
            Action::RecvGrad { stage, .. } => Action::RecvGrad { mb: new_mb, stage },
            Action::OptimizerStep => Action::OptimizerStep,
        }
    }
}

/// Formats as `Forward(mb=3, stage=1)`, `OptimizerStep`, ...
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, mb, stage) = match *self {
            Action::Forward { mb, stage } => ("Forward", mb, stage),
            Action::Recompute { mb, stage } => ("Recompute", mb, stage),
            Action::Backward { mb, stage } => ("Backward", mb, stage),
            Action::BackwardWeight { mb, stage } => ("BackwardWeight", mb, stage),
            Action::SendActivation { mb, stage } => ("SendActivation", mb, stage),
            Action::RecvActivation { mb, stage } => ("RecvActivation", mb, stage),
            Action::SendGrad { mb, stage } => ("SendGrad", mb, stage),
            Action::RecvGrad { mb, stage } => ("RecvGrad", mb, stage),
            Action::ForwardBackward {
                forward_mb,
                forward_stage,
                backward_mb,
                backward_stage,
            } => {
                return write!(
                    f,
                    "ForwardBackward(forward mb={forward_mb}, stage={forward_stage}; \
                     backward mb={backward_mb}, stage={backward_stage})"
                );
            }
            Action::OptimizerStep => return f.write_str("OptimizerStep"),
        };
        write!(f, "{name}(mb={mb}, stage={stage})")
    }
}

/// Which pipeline schedule to run. The names (serde, [`FromStr`], [`Display`](fmt::Display))
/// are `gpipe`, `1f1b`, `interleaved`, `shifted-critical-path`, `2bw`, `zb-h1`, `zb-v` and
/// `dualpipev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// GPipe: every forward of the step, then every backward (a flush at the end of the step).
    /// Holds the activations of all `m` micro-batches at once.
    #[serde(rename = "gpipe")]
    GPipe,
    /// 1F1B (PipeDream-Flush): a short warm-up of forwards, then one forward / one backward in
    /// turn, then the cool-down backwards. Same bubble as GPipe, but rank `r` holds at most
    /// `p - r` micro-batches of activations.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B: `v` model chunks (virtual stages) per rank, which cuts the
    /// bubble by `v` at the price of `v` times more messages.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Merak's shifted critical path: 1F1B where a recomputing stage recomputes its forward
    /// before waiting for the gradient, instead of after it arrives.
    #[serde(rename = "shifted-critical-path")]
    ShiftedCriticalPath,
    /// PipeDream-2BW: 1F1B without the flush between steps (two weight versions); per step the
    /// same action list as 1F1B.
    #[serde(rename = "2bw")]
    TwoBw,
    /// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
    /// B (input gradient) and W (weight gradients). Rank `r` postpones its first `r` W passes
    /// to the end of the step, where 1F1B leaves it idle, so the bubble shrinks from
    /// `(p-1)(F+B+W)` to about `(p-1)(F+B-W)` (a third when F = B = W) at 1F1B's peak
    /// activation memory (at most `p` micro-batches in flight on a rank).
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// ZB-V (Qi et al.): two stages per rank in a V (rank `r` holds stages `r` and `2p-1-r`),
    /// with the split backward; the order is found by a unit-time run that prefers B, then
    /// forwards within 1F1B's peak activation memory, then W (`zero_bubble::zb_v_orders`).
    /// Needs `virtual_stages = 2`; the bubble is about zero when F = B = W.
    #[serde(rename = "zb-v")]
    ZbV,
    /// DualPipeV (DeepSeek's DualPipe cut to one V): ZB-V's placement (rank `r` holds stages
    /// `r` and `2p-1-r`) and split backward, in an order whose steady state runs the forward of
    /// one stage and the backward of the other as one overlapped
    /// [`Action::ForwardBackward`] pair, so that each pass's messages travel while the other
    /// computes (`dual_pipe_v::dual_pipe_v_order`). Needs `virtual_stages = 2` and at least
    /// `2p` micro-batches.
    #[serde(rename = "dualpipev")]
    DualPipeV,
}

impl ScheduleKind {
    /// Every schedule kind.
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ShiftedCriticalPath,
        ScheduleKind::TwoBw,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
    ];

    /// The name used in configuration files and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ShiftedCriticalPath => "shifted-critical-path",
            ScheduleKind::TwoBw => "2bw",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipev",
        }
    }

    /// Whether the backward is split into B ([`Action::Backward`]) and W
    /// ([`Action::BackwardWeight`]).
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            ScheduleKind::ZbH1 | ScheduleKind::ZbV | ScheduleKind::DualPipeV
        )
    }

    /// Whether the lists hold [`Action::ForwardBackward`] pairs ([`ScheduleKind::DualPipeV`]).
    pub fn pairs_passes(self) -> bool {
        self == ScheduleKind::DualPipeV
    }

    /// The fewest micro-batches a step of this kind runs over `ranks` pipeline ranks: `2p`
    /// for [`ScheduleKind::DualPipeV`], whose steady state needs both ends of the V busy; 1
    /// otherwise.
    pub fn min_micro_batches(self, ranks: usize) -> usize {
        if self == ScheduleKind::DualPipeV {
            2 * ranks
        } else {
            1
        }
    }

    /// Versions of the weights a rank keeps: 2 under [`ScheduleKind::TwoBw`] (the previous
    /// one for the micro-batches still in flight), 1 otherwise.
    pub fn weight_versions(self) -> usize {
        if self == ScheduleKind::TwoBw { 2 } else { 1 }
    }

    /// Whether stages sit on the ranks in a V ([`ScheduleKind::ZbV`],
    /// [`ScheduleKind::DualPipeV`]) rather than round-robin.
    pub fn v_shaped(self) -> bool {
        matches!(self, ScheduleKind::ZbV | ScheduleKind::DualPipeV)
    }

    /// Whether this kind runs several virtual stages per rank ([`ScheduleKind::Interleaved`],
    /// and the V-shaped kinds with exactly two).
    pub fn uses_virtual_stages(self) -> bool {
        self == ScheduleKind::Interleaved || self.v_shaped()
    }

    /// Whether the pipeline drains (flushes) at the end of every step. All kinds but
    /// [`ScheduleKind::TwoBw`] do.
    pub fn flushes(self) -> bool {
        self != ScheduleKind::TwoBw
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ScheduleError::UnknownKind {
                name: s.to_string(),
            })
    }
}

/// The most (stage, micro-batch) pairs of one step a schedule is built for: far beyond any
/// training run (64 stages of 4,096 micro-batches is a quarter of it), and small enough that
/// building, validating and simulating it stays within memory.
pub const MAX_STAGE_MICRO_BATCHES: usize = 1 << 20;

/// Why a schedule cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// More (stage, micro-batch) pairs than [`MAX_STAGE_MICRO_BATCHES`].
    #[error(
        "{ranks} ranks x {virtual_stages} virtual stages x {micro_batches} micro-batches is          too large a schedule (at most {max} stage micro-batches per step)"
    )]
    TooLarge {
        /// Pipeline ranks.
        ranks: usize,
        /// Virtual stages per rank.
        virtual_stages: usize,
        /// Micro-batches per step.
        micro_batches: usize,
        /// [`MAX_STAGE_MICRO_BATCHES`].
        max: usize,
    },
    /// `ranks == 0`.
    #[error("a pipeline needs at least one rank, got ranks = 0")]
    ZeroRanks,
    /// `micro_batches == 0`.
    #[error("a step needs at least one micro-batch, got micro_batches = 0")]
    ZeroMicroBatches,
    /// A kind without virtual stages was asked for `virtual_stages != 1`.
    #[error(
        "the {kind} schedule runs one stage per rank (virtual_stages = 1), \
         got virtual_stages = {virtual_stages}"
    )]
    VirtualStagesNotOne {
        /// The schedule kind.
        kind: ScheduleKind,
        /// The virtual stages asked for.
        virtual_stages: usize,
    },
    /// The interleaved schedule was asked for fewer than two virtual stages.
    #[error(
        "the interleaved schedule needs virtual_stages >= 2, got virtual_stages = \
         {virtual_stages} (use 1f1b for one stage per rank)"
    )]
    TooFewVirtualStages {
        /// The virtual stages asked for.
        virtual_stages: usize,
    },
    /// A V-shaped kind (ZB-V, DualPipeV) was asked for other than two stages per rank.
    #[error(
        "the {kind} schedule runs two stages per rank in a V: virtual_stages = 2, got {virtual_stages}"
    )]
    VShapeNeedsTwo {
        /// The schedule kind.
        kind: ScheduleKind,
        /// The virtual stages asked for.
        virtual_stages: usize,
    },
    /// Fewer micro-batches than the kind needs ([`ScheduleKind::min_micro_batches`]).
    #[error(
        "the {kind} schedule needs at least {needed} micro-batches for {ranks} pipeline ranks \
         (2 per rank), got {micro_batches}"
    )]
    TooFewMicroBatches {
        /// The schedule kind.
        kind: ScheduleKind,
        /// Micro-batches per step.
        micro_batches: usize,
        /// Pipeline ranks.
        ranks: usize,
        /// The fewest it runs.
        needed: usize,
    },
    /// The ZB-V run found no order (not seen for any shape).
    #[error("no zb-v order found for {ranks} ranks and {micro_batches} micro-batches")]
    NoOrder {
        /// Pipeline ranks.
        ranks: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
    /// The interleaved schedule needs the micro-batches to come in groups of `ranks`.
    #[error(
        "the interleaved schedule needs micro_batches divisible by ranks, \
         got {micro_batches} micro-batches for {ranks} ranks"
    )]
    MicroBatchesNotDivisible {
        /// Micro-batches per step.
        micro_batches: usize,
        /// Pipeline ranks.
        ranks: usize,
    },
    /// `recompute` does not have one entry per global stage.
    #[error(
        "recompute has {got} entries but the pipeline has {stages} stages \
         ({ranks} ranks x {virtual_stages} virtual stages)"
    )]
    RecomputeLength {
        /// Entries given.
        got: usize,
        /// Global stages (`ranks * virtual_stages`).
        stages: usize,
        /// Pipeline ranks.
        ranks: usize,
        /// Virtual stages per rank.
        virtual_stages: usize,
    },
    /// An unknown schedule name was parsed.
    #[error(
        "unknown schedule `{name}`, expected one of: gpipe, 1f1b, interleaved, \
         shifted-critical-path, 2bw, zb-h1, zb-v, dualpipev"
    )]
    UnknownKind {
        /// The name that was given.
        name: String,
    },
}

/// A pipeline schedule: for every pipeline rank, the ordered actions of one training step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Which schedule this is.
    pub kind: ScheduleKind,
    /// Pipeline ranks `p`.
    pub ranks: usize,
    /// Micro-batches per step `m`.
    pub micro_batches: usize,
    /// Virtual stages (model chunks) per rank `v`.
    pub virtual_stages: usize,
    /// Per global stage: whether it recomputes its forward pass in the backward pass
    /// (activation checkpointing).
    pub recompute: Vec<bool>,
    /// Per rank, the actions of one step in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Global stages `p * v`.
    pub fn stages(&self) -> usize {
        self.ranks * self.virtual_stages
    }

    /// The rank that runs global stage `stage` (`stage % p`; in a V, see
    /// [`ScheduleKind::ZbV`]).
    pub fn rank_of(&self, stage: usize) -> usize {
        rank_of_stage(self.kind, self.ranks, stage)
    }

    /// The chunk (virtual stage index on its rank) of global stage `stage` (`stage / p`).
    pub fn chunk_of(&self, stage: usize) -> usize {
        stage.checked_div(self.ranks).unwrap_or(0)
    }

    /// The global stages on `rank`, in chunk order (`rank, rank + p, rank + 2p, ...`); empty for
    /// a rank outside the pipeline.
    pub fn stages_on(&self, rank: usize) -> Vec<usize> {
        if rank >= self.ranks {
            return Vec::new();
        }
        (0..self.virtual_stages)
            .map(|chunk| stage_of_chunk(self.kind, self.ranks, rank, chunk))
            .collect()
    }

    /// The most micro-batches whose activations `stage` holds at once: the maximum, over its
    /// rank's action list, of forwards done minus backwards done for that stage (minus W
    /// passes done, in a schedule that splits the backward).
    pub fn max_in_flight(&self, stage: usize) -> usize {
        let Some(list) = self.actions.get(self.rank_of(stage)) else {
            return 0;
        };
        // A split backward keeps what W needs until W runs.
        let split = self.kind.splits_backward();
        let mut held = 0usize;
        let mut max = 0usize;
        for action in list.iter().flat_map(|a| a.parts()) {
            match action {
                Action::Forward { stage: s, .. } if s == stage => {
                    held += 1;
                    max = max.max(held);
                }
                Action::Backward { stage: s, .. } if s == stage && !split => {
                    held = held.saturating_sub(1)
                }
                Action::BackwardWeight { stage: s, .. } if s == stage => {
                    held = held.saturating_sub(1)
                }
                _ => {}
            }
        }
        max
    }

    /// For each global stage, the micro-batches it holds at the moment its rank holds the most
    /// in all its stages together (the first such moment): what a rank's activation memory
    /// peaks at when its stages keep alike amounts per micro-batch. With one stage per rank
    /// this is [`max_in_flight`](Self::max_in_flight); with several (interleaved, ZB-V) the
    /// sum of their own maxima would count micro-batches that are never held at once.
    pub fn in_flight_at_peak(&self) -> Vec<usize> {
        let stages = self.ranks * self.virtual_stages;
        let split = self.kind.splits_backward();
        let mut counts = vec![0usize; stages];
        for rank in 0..self.ranks {
            let mut held = vec![0usize; stages];
            let (mut total, mut best) = (0usize, 0usize);
            for action in self.actions[rank].iter().flat_map(|a| a.parts()) {
                match action {
                    Action::Forward { stage, .. } if stage < stages => {
                        held[stage] += 1;
                        total += 1;
                        if total > best {
                            best = total;
                            for s in (0..stages).filter(|&s| self.rank_of(s) == rank) {
                                counts[s] = held[s];
                            }
                        }
                    }
                    Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. }
                        if stage < stages
                            && held[stage] > 0
                            && (split == matches!(action, Action::BackwardWeight { .. })) =>
                    {
                        held[stage] -= 1;
                        total -= 1;
                    }
                    _ => {}
                }
            }
        }
        counts
    }

    /// The number of actions of each rank.
    pub fn len_per_rank(&self) -> Vec<usize> {
        self.actions.iter().map(Vec::len).collect()
    }
}

/// The rank of global stage `stage` of a `kind` pipeline over `ranks` ranks: `stage % ranks`,
/// or the V of [`ScheduleKind::ZbV`].
pub fn rank_of_stage(kind: ScheduleKind, ranks: usize, stage: usize) -> usize {
    if kind.v_shaped() {
        super::zero_bubble::v_rank_of(ranks, stage)
    } else {
        stage.checked_rem(ranks).unwrap_or(0)
    }
}

/// The global stage that is chunk `chunk` of `rank` (the inverse of [`rank_of_stage`]):
/// `chunk * ranks + rank`, or in a V `rank` and then `2 ranks - 1 - rank`.
pub fn stage_of_chunk(kind: ScheduleKind, ranks: usize, rank: usize, chunk: usize) -> usize {
    if kind.v_shaped() && chunk == 1 {
        (2 * ranks).saturating_sub(rank + 1)
    } else {
        chunk * ranks + rank
    }
}

/// Builds the schedule of `kind` for `ranks` pipeline ranks, `micro_batches` micro-batches per
/// step and `virtual_stages` model chunks per rank; `recompute[s]` says whether global stage `s`
/// recomputes its forward pass (activation checkpointing).
///
/// The schedules, for rank `r` of `p`, with `m` micro-batches:
///
/// - [`ScheduleKind::GPipe`]: the forwards of micro-batches `0..m`, then the backwards in reverse
///   order `m-1..0`, then the optimizer step. Bubble `(p-1)/m`, `m` micro-batches of activations.
/// - [`ScheduleKind::OneFOneB`] (PipeDream-Flush): `min(p-r-1, m)` warm-up forwards, then in
///   steady state one forward and one backward in turn, then the cool-down backwards, then the
///   optimizer step. Backwards run in micro-batch order. Bubble `(p-1)/m` like GPipe, but at most
///   `p-r` micro-batches of activations.
/// - [`ScheduleKind::Interleaved`] (Megatron-LM): rank `r` holds the `v` chunks
///   `r, r+p, ..., r+(v-1)p`. Forward micro-step `k` runs chunk `(k mod pv) / p` on micro-batch
///   `(k / pv) * p + k mod p` (micro-batches go through each chunk in groups of `p`); backward
///   micro-step `k` runs the chunks in the reverse order. `min(2(p-r-1) + (v-1)p, mv)` warm-up
///   forwards, then one forward / one backward in turn, then the cool-down backwards. Needs
///   `v >= 2` and `m` divisible by `p`. Bubble `(p-1)/(vm)`.
/// - [`ScheduleKind::ShiftedCriticalPath`] (Merak): the 1F1B order, but each backward of a
///   recomputing stage is preceded by an explicit [`Action::Recompute`] placed *before* the
///   [`Action::RecvGrad`] of that backward (right before the backward on the last stage, which
///   receives no gradient), so the recomputation overlaps the wait for the gradient instead of
///   lengthening the critical path. Stages without recomputation get no `Recompute`.
/// - [`ScheduleKind::TwoBw`] (PipeDream-2BW): per step the same action list as 1F1B; keeping two
///   weight versions is the executor's concern. The difference that matters for time, no flush
///   between steps (the next step's warm-up overlaps this step's cool-down), is modelled by
///   [`simulate`](super::simulate::simulate), which runs several 2BW steps as one continuous
///   pipeline.
///
/// Every forward is preceded by the [`Action::RecvActivation`] of its input (when its previous
/// stage is on another rank) and followed by the [`Action::SendActivation`] of its output (when
/// its next stage is); every backward likewise by [`Action::RecvGrad`] and
/// [`Action::SendGrad`]. With `p = 1` no message is emitted. The [`Action::OptimizerStep`] is the
/// last action of every rank.
pub fn build_schedule(
    kind: ScheduleKind,
    ranks: usize,
    micro_batches: usize,
    virtual_stages: usize,
    recompute: &[bool],
) -> Result<Schedule, ScheduleError> {
    check_shape(kind, ranks, micro_batches, virtual_stages, recompute)?;
    let stages = ranks * virtual_stages;
    let explicit_recompute: &[bool] = if kind == ScheduleKind::ShiftedCriticalPath {
        recompute
    } else {
        &[]
    };
    let v_orders = if kind == ScheduleKind::ZbV {
        super::zero_bubble::zb_v_orders(ranks, micro_batches).ok_or(ScheduleError::NoOrder {
            ranks,
            micro_batches,
        })?
    } else {
        Vec::new()
    };
    let rank_of = |stage| rank_of_stage(kind, ranks, stage);
    let actions = (0..ranks)
        .map(|rank| {
            let order = match kind {
                ScheduleKind::GPipe => gpipe_order(micro_batches, rank),
                ScheduleKind::OneFOneB
                | ScheduleKind::ShiftedCriticalPath
                | ScheduleKind::TwoBw => one_f_one_b_order(ranks, micro_batches, rank),
                ScheduleKind::Interleaved => {
                    interleaved_order(ranks, micro_batches, virtual_stages, rank)
                }
                ScheduleKind::ZbH1 => zb_h1_order(ranks, micro_batches, rank),
                ScheduleKind::ZbV => v_orders[rank].clone(),
                ScheduleKind::DualPipeV => dual_pipe_v_order(ranks, micro_batches, rank),
            };
            let mut list = Vec::with_capacity(order.len() * 3 + 1);
            for op in order {
                expand_op(op, &rank_of, stages, explicit_recompute, &mut list);
            }
            list.push(Action::OptimizerStep);
            list
        })
        .collect();

    Ok(Schedule {
        kind,
        ranks,
        micro_batches,
        virtual_stages,
        recompute: recompute.to_vec(),
        actions,
    })
}

/// The sizes [`build_schedule`] accepts for `kind`: at least one rank and micro-batch, the
/// virtual stages the kind needs, at most [`MAX_STAGE_MICRO_BATCHES`] cells, one recompute
/// flag per stage.
fn check_shape(
    kind: ScheduleKind,
    ranks: usize,
    micro_batches: usize,
    virtual_stages: usize,
    recompute: &[bool],
) -> Result<(), ScheduleError> {
    if ranks == 0 {
        return Err(ScheduleError::ZeroRanks);
    }
    if micro_batches == 0 {
        return Err(ScheduleError::ZeroMicroBatches);
    }
    let needed = kind.min_micro_batches(ranks);
    if micro_batches < needed {
        return Err(ScheduleError::TooFewMicroBatches {
            kind,
            micro_batches,
            ranks,
            needed,
        });
    }
    if kind.v_shaped() {
        if virtual_stages != 2 {
            return Err(ScheduleError::VShapeNeedsTwo {
                kind,
                virtual_stages,
            });
        }
    } else if kind.uses_virtual_stages() {
        if virtual_stages < 2 {
            return Err(ScheduleError::TooFewVirtualStages { virtual_stages });
        }
        if !micro_batches.is_multiple_of(ranks) {
            return Err(ScheduleError::MicroBatchesNotDivisible {
                micro_batches,
                ranks,
            });
        }
    } else if virtual_stages != 1 {
        return Err(ScheduleError::VirtualStagesNotOne {
            kind,
            virtual_stages,
        });
    }
    let cells = ranks
        .checked_mul(virtual_stages)
        .and_then(|s| s.checked_mul(micro_batches));
    if cells.is_none_or(|c| c > MAX_STAGE_MICRO_BATCHES) {
        return Err(ScheduleError::TooLarge {
            ranks,
            virtual_stages,
            micro_batches,
            max: MAX_STAGE_MICRO_BATCHES,
        });
    }
    let stages = ranks * virtual_stages;
    if recompute.len() != stages {
        return Err(ScheduleError::RecomputeLength {
            got: recompute.len(),
            stages,
            ranks,
            virtual_stages,
        });
    }
    Ok(())
}

/// GPipe's compute order on `rank` (one stage per rank): all forwards, then all backwards in
/// reverse micro-batch order.
fn gpipe_order(micro_batches: usize, rank: usize) -> Vec<Op> {
    (0..micro_batches)
        .map(|mb| Op::F(mb, rank))
        .chain((0..micro_batches).rev().map(|mb| Op::B(mb, rank)))
        .collect()
}

/// The 1F1B (PipeDream-Flush) compute order on `rank` of `ranks` (one stage per rank) for
/// `micro_batches` micro-batches.
pub(crate) fn one_f_one_b_order(ranks: usize, micro_batches: usize, rank: usize) -> Vec<Op> {
    let warmup = ranks.saturating_sub(rank + 1).min(micro_batches);
    let mut order = Vec::with_capacity(2 * micro_batches);
    order.extend((0..warmup).map(|mb| Op::F(mb, rank)));
    for i in 0..micro_batches - warmup {
        order.push(Op::F(warmup + i, rank));
        order.push(Op::B(i, rank));
    }
    order.extend((micro_batches - warmup..micro_batches).map(|mb| Op::B(mb, rank)));
    order
}

/// Megatron's interleaved 1F1B compute order on `rank` of `ranks`, with `virtual_stages`
/// chunks per rank and `micro_batches` (a multiple of `ranks`) micro-batches.
fn interleaved_order(
    ranks: usize,
    micro_batches: usize,
    virtual_stages: usize,
    rank: usize,
) -> Vec<Op> {
    let total = micro_batches * virtual_stages;
    let group = ranks * virtual_stages;
    // Micro-step k -> (micro-batch, chunk in forward order).
    let at = |k: usize| ((k / group) * ranks + k % ranks, (k % group) / ranks);
    let forward = |k: usize| {
        let (mb, chunk) = at(k);
        Op::F(mb, chunk * ranks + rank)
    };
    let backward = |k: usize| {
        let (mb, chunk) = at(k);
        Op::B(mb, (virtual_stages - 1 - chunk) * ranks + rank)
    };
    let warmup = ((ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks).min(total);
    let mut order = Vec::with_capacity(2 * total);
    order.extend((0..warmup).map(forward));
    for i in 0..total - warmup {
        order.push(forward(warmup + i));
        order.push(backward(i));
    }
    order.extend((total - warmup..total).map(backward));
    order
}

/// Appends the compute action `op` with its messages: the receive of its input right before,
/// the send of its output right after (none between two stages on the same rank: `rank_of`
/// gives each stage's rank). When
/// `explicit_recompute[stage]` is set, a backward is preceded by a `Recompute` placed before its
/// `RecvGrad`.
pub(crate) fn expand_op(
    op: Op,
    rank_of: &dyn Fn(usize) -> usize,
    stages: usize,
    explicit_recompute: &[bool],
    out: &mut Vec<Action>,
) {
    let from_prev = |stage: usize| stage > 0 && rank_of(stage - 1) != rank_of(stage);
    let to_next = |stage: usize| stage + 1 < stages && rank_of(stage + 1) != rank_of(stage);
    match op {
        Op::F(mb, stage) => {
            if from_prev(stage) {
                out.push(Action::RecvActivation { mb, stage });
            }
            out.push(Action::Forward { mb, stage });
            if to_next(stage) {
                out.push(Action::SendActivation { mb, stage });
            }
        }
        Op::B(mb, stage) => {
            if explicit_recompute.get(stage).copied().unwrap_or(false) {
                out.push(Action::Recompute { mb, stage });
            }
            if to_next(stage) {
                out.push(Action::RecvGrad { mb, stage });
            }
            out.push(Action::Backward { mb, stage });
            if from_prev(stage) {
                out.push(Action::SendGrad { mb, stage });
            }
        }
        Op::W(mb, stage) => out.push(Action::BackwardWeight { mb, stage }),
        Op::Pair(forward, backward) => expand_pair(forward, backward, from_prev, to_next, out),
    }
}

/// A [`Action::ForwardBackward`] pair wrapped in its messages: both receives before it, both
/// sends after it.
fn expand_pair(
    (forward_mb, forward_stage): (usize, usize),
    (backward_mb, backward_stage): (usize, usize),
    from_prev: impl Fn(usize) -> bool,
    to_next: impl Fn(usize) -> bool,
    out: &mut Vec<Action>,
) {
    if from_prev(forward_stage) {
        out.push(Action::RecvActivation {
            mb: forward_mb,
            stage: forward_stage,
        });
    }
    if to_next(backward_stage) {
        out.push(Action::RecvGrad {
            mb: backward_mb,
            stage: backward_stage,
        });
    }
    out.push(Action::ForwardBackward {
        forward_mb,
        forward_stage,
        backward_mb,
        backward_stage,
    });
    if to_next(forward_stage) {
        out.push(Action::SendActivation {
            mb: forward_mb,
            stage: forward_stage,
        });
    }
    if from_prev(backward_stage) {
        out.push(Action::SendGrad {
            mb: backward_mb,
            stage: backward_stage,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_beyond_any_run_is_refused_before_it_is_built() {
        let e = build_schedule(ScheduleKind::OneFOneB, 100_000, 100_000, 1, &[]).unwrap_err();
        assert!(matches!(e, ScheduleError::TooLarge { .. }), "{e}");
        assert!(e.to_string().contains("100000 ranks"), "{e}");
        let e = build_schedule(ScheduleKind::GPipe, usize::MAX, 2, 1, &[]).unwrap_err();
        assert!(matches!(e, ScheduleError::TooLarge { .. }), "{e}");
    }

    fn compute_order(list: &[Action]) -> Vec<Action> {
        list.iter()
            .copied()
            .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. }))
            .collect()
    }

    #[test]
    fn kind_names_round_trip() {
        for kind in ScheduleKind::ALL {
            let name = kind.to_string();
            assert_eq!(name.parse::<ScheduleKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<ScheduleKind>(&json).unwrap(), kind);
        }
        let names: Vec<_> = ScheduleKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "gpipe",
                "1f1b",
                "interleaved",
                "shifted-critical-path",
                "2bw",
                "zb-h1",
                "zb-v",
                "dualpipev"
            ]
        );
        let err = "pipedream".parse::<ScheduleKind>().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("pipedream"), "{msg}");
        for name in names {
            assert!(msg.contains(name), "{msg}");
        }
    }

    #[test]
    fn action_serde_and_display() {
        let a = Action::SendGrad { mb: 2, stage: 3 };
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, r#"{"op":"send_grad","mb":2,"stage":3}"#);
        assert_eq!(serde_json::from_str::<Action>(&json).unwrap(), a);
        assert_eq!(a.to_string(), "SendGrad(mb=2, stage=3)");
        assert_eq!(Action::OptimizerStep.to_string(), "OptimizerStep");
        assert_eq!(a.with_micro_batch(5), Action::SendGrad { mb: 5, stage: 3 });
        assert_eq!(a.micro_batch(), Some(2));
        assert_eq!(a.stage(), Some(3));
        assert!(a.is_message() && !a.is_compute());
        assert_eq!(Action::OptimizerStep.stage(), None);
    }

    #[test]
    fn bad_shapes_are_rejected() {
        use ScheduleKind::*;
        assert_eq!(
            build_schedule(GPipe, 0, 4, 1, &[]),
            Err(ScheduleError::ZeroRanks)
        );
        assert_eq!(
            build_schedule(OneFOneB, 2, 0, 1, &[false; 2]),
            Err(ScheduleError::ZeroMicroBatches)
        );
        assert_eq!(
            build_schedule(OneFOneB, 2, 4, 2, &[false; 4]),
            Err(ScheduleError::VirtualStagesNotOne {
                kind: OneFOneB,
                virtual_stages: 2
            })
        );
        assert_eq!(
            build_schedule(Interleaved, 2, 4, 1, &[false; 2]),
            Err(ScheduleError::TooFewVirtualStages { virtual_stages: 1 })
        );
        let err = build_schedule(Interleaved, 4, 6, 2, &[false; 8]).unwrap_err();
        assert_eq!(
            err,
            ScheduleError::MicroBatchesNotDivisible {
                micro_batches: 6,
                ranks: 4
            }
        );
        assert!(err.to_string().contains('6') && err.to_string().contains('4'));
        assert_eq!(
            build_schedule(Interleaved, 2, 4, 2, &[false; 3]),
            Err(ScheduleError::RecomputeLength {
                got: 3,
                stages: 4,
                ranks: 2,
                virtual_stages: 2
            })
        );
    }

    #[test]
    fn stage_mapping() {
        let s = build_schedule(ScheduleKind::Interleaved, 4, 8, 3, &[false; 12]).unwrap();
        assert_eq!(s.stages(), 12);
        assert_eq!(s.rank_of(9), 1);
        assert_eq!(s.chunk_of(9), 2);
        assert_eq!(s.stages_on(1), vec![1, 5, 9]);
        assert!(s.stages_on(4).is_empty());
    }

    #[test]
    fn gpipe_runs_all_forwards_first() {
        let s = build_schedule(ScheduleKind::GPipe, 3, 4, 1, &[false; 3]).unwrap();
        for rank in 0..3 {
            let order = compute_order(&s.actions[rank]);
            let expected: Vec<_> = (0..4)
                .map(|mb| Action::Forward { mb, stage: rank })
                .chain((0..4).rev().map(|mb| Action::Backward { mb, stage: rank }))
                .collect();
            assert_eq!(order, expected);
            assert_eq!(s.max_in_flight(rank), 4);
            assert_eq!(s.actions[rank].last(), Some(&Action::OptimizerStep));
        }
    }

    #[test]
    fn one_f_one_b_warmup_and_memory() {
        for p in 1..=4 {
            for m in 1..=8 {
                let s = build_schedule(ScheduleKind::OneFOneB, p, m, 1, &vec![false; p]).unwrap();
                for rank in 0..p {
                    let order = compute_order(&s.actions[rank]);
                    let warmup = order
                        .iter()
                        .take_while(|a| matches!(a, Action::Forward { .. }))
                        .count();
                    // The warm-up forwards plus the first steady-state forward.
                    assert_eq!(
                        warmup,
                        (p - rank - 1).min(m) + usize::from(p - rank - 1 < m)
                    );
                    assert_eq!(s.max_in_flight(rank), (p - rank).min(m));
                }
            }
        }
    }

    #[test]
    fn messages_wrap_compute() {
        let s = build_schedule(ScheduleKind::OneFOneB, 2, 2, 1, &[false; 2]).unwrap();
        use Action::*;
        assert_eq!(
            s.actions[0],
            vec![
                Forward { mb: 0, stage: 0 },
                SendActivation { mb: 0, stage: 0 },
                Forward { mb: 1, stage: 0 },
                SendActivation { mb: 1, stage: 0 },
                RecvGrad { mb: 0, stage: 0 },
                Backward { mb: 0, stage: 0 },
                RecvGrad { mb: 1, stage: 0 },
                Backward { mb: 1, stage: 0 },
                OptimizerStep,
            ]
        );
        assert_eq!(
            s.actions[1],
            vec![
                RecvActivation { mb: 0, stage: 1 },
                Forward { mb: 0, stage: 1 },
                Backward { mb: 0, stage: 1 },
                SendGrad { mb: 0, stage: 1 },
                RecvActivation { mb: 1, stage: 1 },
                Forward { mb: 1, stage: 1 },
                Backward { mb: 1, stage: 1 },
                SendGrad { mb: 1, stage: 1 },
                OptimizerStep,
            ]
        );
        let single = build_schedule(ScheduleKind::GPipe, 1, 3, 1, &[true]).unwrap();
        assert!(single.actions[0].iter().all(|a| !a.is_message()));
    }

    #[test]
    fn shifted_critical_path_recomputes_before_the_gradient_arrives() {
        let s = build_schedule(
            ScheduleKind::ShiftedCriticalPath,
            3,
            4,
            1,
            &[true, false, true],
        )
        .unwrap();
        // Stage 0: Recompute right before the RecvGrad of the same micro-batch.
        for mb in 0..4 {
            let list = &s.actions[0];
            let i = list
                .iter()
                .position(|a| *a == Action::Recompute { mb, stage: 0 })
                .unwrap();
            assert_eq!(list[i + 1], Action::RecvGrad { mb, stage: 0 });
            assert_eq!(list[i + 2], Action::Backward { mb, stage: 0 });
        }
        // Stage 1 does not recompute.
        assert!(
            !s.actions[1]
                .iter()
                .any(|a| matches!(a, Action::Recompute { .. }))
        );
        // The last stage: right before the backward.
        for mb in 0..4 {
            let list = &s.actions[2];
            let i = list
                .iter()
                .position(|a| *a == Action::Recompute { mb, stage: 2 })
                .unwrap();
            assert_eq!(list[i + 1], Action::Backward { mb, stage: 2 });
        }
        // Other kinds never emit Recompute.
        for kind in [
            ScheduleKind::OneFOneB,
            ScheduleKind::GPipe,
            ScheduleKind::TwoBw,
        ] {
            let s = build_schedule(kind, 3, 4, 1, &[true; 3]).unwrap();
            assert!(
                s.actions
                    .iter()
                    .flatten()
                    .all(|a| !matches!(a, Action::Recompute { .. }))
            );
        }
    }

    #[test]
    fn two_bw_step_matches_one_f_one_b() {
        let a = build_schedule(ScheduleKind::TwoBw, 4, 8, 1, &[true; 4]).unwrap();
        let b = build_schedule(ScheduleKind::OneFOneB, 4, 8, 1, &[true; 4]).unwrap();
        assert_eq!(a.actions, b.actions);
    }

    #[test]
    fn interleaved_order_follows_megatron() {
        // p = 2, v = 2, m = 4: rank 0 holds stages 0 and 2.
        let s = build_schedule(ScheduleKind::Interleaved, 2, 4, 2, &[false; 4]).unwrap();
        let order = compute_order(&s.actions[0]);
        use Action::*;
        // Warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards: mb 0,1 on chunk 0, mb 0,1 on chunk 1.
        assert_eq!(
            &order[..4],
            &[
                Forward { mb: 0, stage: 0 },
                Forward { mb: 1, stage: 0 },
                Forward { mb: 0, stage: 2 },
                Forward { mb: 1, stage: 2 },
            ]
        );
        // Then 1F1B: the next group's first forward, the first backward (last chunk first).
        assert_eq!(
            &order[4..6],
            &[Forward { mb: 2, stage: 0 }, Backward { mb: 0, stage: 2 }]
        );
        assert_eq!(order.len(), 2 * 4 * 2);
        assert_eq!(s.max_in_flight(0), 4);
        assert_eq!(s.max_in_flight(2), 2);
    }

    /// With several stages per rank their own maxima fall at different times: on rank 0 of an
    /// interleaved pipeline of 4 ranks and 8 chunks the stages hold `2(p-1) + (v-1)p + 1 = 35`
    /// micro-batches at the peak, where the sum of their maxima is more; with one stage per
    /// rank both are the stage's maximum.
    #[test]
    fn a_rank_peaks_below_the_sum_of_its_stages_maxima() {
        use ScheduleKind::{Interleaved, OneFOneB};
        let s = build_schedule(Interleaved, 4, 16, 8, &[false; 32]).unwrap();
        let at_peak = s.in_flight_at_peak();
        let rank0 = |counts: &[usize]| {
            (0..32)
                .filter(|st| st % 4 == 0)
                .map(|st| counts[st])
                .sum::<usize>()
        };
        let maxima: Vec<usize> = (0..32).map(|st| s.max_in_flight(st)).collect();
        assert_eq!(rank0(&at_peak), 35);
        assert!(rank0(&maxima) > 35, "{maxima:?}");
        assert!(at_peak.iter().zip(&maxima).all(|(a, m)| a <= m));
        let one = build_schedule(OneFOneB, 4, 8, 1, &[false; 4]).unwrap();
        let expect: Vec<usize> = (0..4).map(|st| one.max_in_flight(st)).collect();
        assert_eq!(one.in_flight_at_peak(), expect);
    }
}
