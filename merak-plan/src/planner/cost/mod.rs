//! The cost model: predicted step time and per-rank memory of a 3D-parallel [`Layout`].
//!
//! Time. For every global pipeline stage the forward, backward and recomputation times of one
//! micro-batch are its FLOPs on one tensor-parallel rank divided by the matrix products'
//! achievable FLOP/s ([`HardwareSpec::achievable_flops`]), plus the bytes its memory-bound
//! operations move ([`UnitProfile::forward_memory_bytes`](super::model::UnitProfile), twice
//! that backward) over the sustained memory bandwidth, so a layer's share of peak grows with
//! its size, plus its tensor-parallel
//! all-reduces (ring: `2 (t-1)/t * bytes / bandwidth + latency` each, on the intra-node link
//! when the `t` ranks fit in a node), of which sub-pipelined tensor parallelism
//! ([`Layout::tp_overlap`]) hides part behind compute (see `tp_exposed`). These costs and the
//! point-to-point message time drive a discrete-event simulation of the actual schedule
//! ([`pipeline::simulate`](crate::pipeline::simulate())), so the bubble is what the schedule
//! really does with unequal stages, recomputation and messages. Large micro-batch counts are
//! simulated at two smaller counts in the steady state and extrapolated linearly (exact for
//! equal stages); simulations are cached. After the pipeline drains, each rank pays the part
//! of its data-parallel gradient all-reduce (`2 (d-1)/d` of its 16-bit gradients) that its last
//! micro-batch's backward pass could not hide, the optimizer step (memory-bound: 28 bytes per
//! local parameter) and, with ZeRO-1, the all-gather of the updated parameters.
//!
//! Context parallelism (`cp`) gives each rank `s/cp` tokens of every sequence: its compute,
//! memory-bound work, TP all-reduces, activations and pipeline messages are `1/cp` of a whole
//! sequence's, and its attention's keys and values travel around a ring of the `cp` ranks,
//! each hop hidden behind the attention of one block as far as it lasts (see `ring_exposed`);
//! for the parameters it is data parallelism (gradients all-reduced and ZeRO sharded over
//! `dp * cp` ranks). Sequence parallelism splits what tensor parallelism leaves whole (the
//! LayerNorms' and dropouts' activations, memory-bound work and the pipeline messages) over the
//! `t` ranks; its reduce-scatters and all-gathers move the bytes of the all-reduces they
//! replace, so they cost the same ([`RankSplit`](super::RankSplit)).
//!
//! Mixture of experts (`ep`, see [`MoeShape`](super::MoeShape)): a MoE block's compute is its
//! attention, router and the `top_k` (plus shared) experts' MLPs a token uses, the routed
//! experts' matrix products [`EXPERT_IMBALANCE`] times longer under expert parallelism (the
//! busiest rank sets the pace); per micro-batch it adds two all-to-alls forward (dispatch,
//! combine), two backward and two more when full recomputation repeats the forward pass, each
//! moving `top_k b s h / (cp t)` 16-bit values per rank of which `(ep - 1)/ep` leave it (see
//! `alltoall`). A rank holds `E / ep` routed experts per MoE block whole (tensor parallelism
//! does not split them); their gradients are reduced over the `dp cp / ep` ranks that hold the
//! same experts with their `tp` peers, and ZeRO shards their states over the `dp cp / ep`.
//!
//! Memory. Per pipeline rank: model states by the one accounting of
//! [`memory`](super::memory) (mixed-precision Adam: 16 bytes per parameter, `4 + 12/d` with
//! ZeRO-1, `16/d` with ZeRO-3 reduce-scattering every micro-batch; an fp32 calibration
//! counts fp32 states),
//! for each of its stages the activations of one micro-batch (per the stage's
//! [`RecomputeMode`](super::RecomputeMode)) times the most micro-batches that stage holds at once
//! ([`Schedule::max_in_flight`](crate::pipeline::Schedule::max_in_flight)), a second 16-bit
//! weight version under PipeDream-2BW, plus a workspace: the largest unit's full activations
//! (rebuilt during its backward pass) and [`FRAMEWORK_BYTES`].
//!
//! The code by concern: `layout` (the [`Layout`] and its checks against the model),
//! `collectives` (the communication terms), `rank_memory` (per-rank memory, named apart from
//! the sibling [`memory`](super::memory) module, which holds the one accounting of model
//! states that it takes its bytes per parameter from),
//! `time` (per-unit and per-stage terms, the simulated pipeline, [`Prediction`] and
//! [`Estimate`]); `tests` holds their unit tests.

use std::cell::RefCell;
use std::collections::HashMap;

use thiserror::Error;

use super::calibration::Calibration;
use super::hardware::HardwareSpec;
use super::memory::StateFormat;
use super::model::{BYTES_16BIT, EXPERT_IMBALANCE, ModelProxy};
use crate::pipeline::{ScheduleError, ScheduleKind, ValidationError};

mod collectives;
mod layout;
mod muon;
mod rank_memory;
#[cfg(test)]
mod tests;
mod time;

pub use layout::Layout;
pub use muon::{MuonTerms, OptimizerCost};
pub(crate) use rank_memory::{ChunkMemory, RankMemory, StateBytes};
pub(crate) use time::StageTerms;
pub use time::{Estimate, Prediction};

/// Memory every rank needs besides model states and activations: CUDA context, communication
/// buffers, allocator slack.
pub const FRAMEWORK_BYTES: f64 = 1.0 * 1024.0 * 1024.0 * 1024.0;

/// Bytes the optimizer step reads and writes per parameter (mixed-precision Adam: fp32 master
/// weight, two moments, 16-bit gradient read; the same written back with the 16-bit weight).
const OPTIMIZER_BYTES_PER_PARAM: f64 = 28.0;

/// A layout that cannot be costed.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum CostError {
    /// A degree or count of zero.
    #[error("layout field `{field}` must be at least 1, got 0")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// The partition does not match the model or the pipeline.
    #[error(
        "the partition has {stages} stages over {units} units, but the layout needs \
         {expected_stages} stages (pp x virtual_stages) over the model's {expected_units} units"
    )]
    Partition {
        /// Stages of the partition.
        stages: usize,
        /// Units of the partition.
        units: usize,
        /// `pp * virtual_stages`.
        expected_stages: usize,
        /// The model's units.
        expected_units: usize,
    },
    /// `recompute` does not have one entry per stage.
    #[error("recompute has {got} entries for {stages} stages")]
    RecomputeLength {
        /// Entries.
        got: usize,
        /// Stages.
        stages: usize,
    },
    /// The overlap degree does not divide the tokens of a micro-batch.
    #[error(
        "tp_overlap = {overlap} does not divide the {tokens} tokens of a micro-batch \
         (micro_batch x sequence length / cp; under sequence parallelism the sequence length \
         / (cp x tp))"
    )]
    Overlap {
        /// The overlap degree.
        overlap: usize,
        /// Tokens per micro-batch.
        tokens: usize,
    },
    /// Context parallelism's zigzag split does not cut the sequence.
    #[error(
        "cp = {cp}: 2 x cp must divide the sequence length {seq} (each rank of the ring holds \
         two zigzag chunks)"
    )]
    ContextSplit {
        /// The context-parallel degree.
        cp: usize,
        /// The sequence length.
        seq: usize,
    },
    /// Sequence parallelism without tensor parallelism, or not dividing a rank's tokens.
    #[error(
        "sequence parallelism needs tp > 1 dividing the {tokens} tokens of a sequence that a \
         rank holds (sequence length / cp); tp = {tp}"
    )]
    SequenceParallel {
        /// The tensor-parallel degree.
        tp: usize,
        /// Tokens per sequence per rank.
        tokens: usize,
    },
    /// An expert-parallel degree that does not divide the ranks holding the same parameters or
    /// the experts (or `ep > 1` for a model without experts).
    #[error(
        "ep = {ep} must divide dp x cp = {replicas} and the model's {experts} experts (expert \
         parallelism splits the experts over data-parallel ranks)"
    )]
    ExpertParallel {
        /// The expert-parallel degree.
        ep: usize,
        /// `dp * cp`.
        replicas: usize,
        /// Routed experts of a MoE layer (0 for a dense model).
        experts: usize,
    },
    /// Tensor parallelism of a mixture of experts without sequence parallelism.
    #[error(
        "tp = {tp} with a mixture of experts needs sequence parallelism (each tensor-parallel \
         rank routes its own positions to whole experts)"
    )]
    ExpertsNeedSequenceParallel {
        /// The tensor-parallel degree.
        tp: usize,
    },
    /// Context or sequence parallelism for a model whose sequence length is unknown (a proxy
    /// without a transformer shape).
    #[error(
        "cp > 1 and sequence parallelism need the model's sequence length; this model has no \
         transformer shape"
    )]
    UnknownSequence,
    /// The schedule cannot be built.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The simulation failed.
    #[error(transparent)]
    Simulation(#[from] ValidationError),
}

type SimKey = Vec<u64>;

/// Schedule kind, ranks, virtual stages, micro-batches.
type InFlightKey = (ScheduleKind, usize, usize, usize);

/// Predicts layouts of one model on one cluster, caching schedules' in-flight counts and
/// simulations.
pub struct CostModel<'a> {
    model: &'a ModelProxy,
    hardware: &'a HardwareSpec,
    calibration: Option<&'a Calibration>,
    /// The busiest expert-parallel rank's load over the mean (the model's
    /// [`MoeShape::imbalance`](super::MoeShape::imbalance), [`EXPERT_IMBALANCE`] without one).
    expert_load: f64,
    /// The element sizes of the model states ([`StateFormat::MIXED_ADAM`] unless set).
    state_format: StateFormat,
    /// The optimizer's work beyond its element-wise update ([`OptimizerCost`]).
    optimizer: OptimizerCost,
    in_flight: RefCell<HashMap<InFlightKey, Vec<usize>>>,
    simulations: RefCell<HashMap<SimKey, f64>>,
}

impl<'a> CostModel<'a> {
    /// A cost model of `model` on `hardware`.
    pub fn new(model: &'a ModelProxy, hardware: &'a HardwareSpec) -> Self {
        CostModel {
            model,
            hardware,
            calibration: None,
            expert_load: model
                .shape
                .and_then(|s| s.moe)
                .map_or(EXPERT_IMBALANCE, |m| m.imbalance()),
            state_format: StateFormat::MIXED_ADAM,
            optimizer: OptimizerCost::ElementWise,
            in_flight: RefCell::new(HashMap::new()),
            simulations: RefCell::new(HashMap::new()),
        }
    }

    /// The same cost model using measured layer times (`merak profile`) wherever they cover
    /// a unit at the layout's tensor-parallel degree: a unit's forward and backward times are
    /// then the measured ones (tensor-parallel communication included, so it is not added
    /// again), its recomputation the forward time scaled by the recomputed share of FLOPs,
    /// the optimizer the measured time per parameter, and gradients and activations have the
    /// calibration's element size. A layout with `tp_overlap = k` takes the units measured with
    /// that overlap degree where the profile timed them (those without overlap otherwise).
    /// Units or degrees it does not cover use FLOPs over the hardware's rate.
    pub fn with_calibration(mut self, calibration: &'a Calibration) -> Self {
        self.calibration = Some(calibration);
        if calibration.element_bytes >= 4.0 {
            // Profiled in fp32: the states of an fp32 run (AdamW's two moments).
            self.state_format = StateFormat::f32(2);
        }
        self
    }

    /// The same cost model with the busiest rank of an expert-parallel group computing and
    /// keeping activations for `load` times its share of the routed tokens instead of the
    /// model's expected imbalance (the admission check counts the stated bound,
    /// [`EXPERT_LOAD_BOUND`](super::EXPERT_LOAD_BOUND)).
    pub fn with_expert_load(mut self, load: f64) -> Self {
        self.expert_load = load;
        self
    }

    /// The same cost model counting model states in `format` instead of mixed-precision
    /// Adam's ([`StateFormat::MIXED_ADAM`]): what the admission check of an fp32 run uses
    /// ([`StateFormat::f32`]).
    pub fn with_state_format(mut self, format: StateFormat) -> Self {
        self.state_format = format;
        self
    }

    /// Bytes per element of gradients and pipeline messages: 2 (16-bit training), or the
    /// calibration's.
    fn element_bytes(&self) -> f64 {
        self.calibration.map_or(BYTES_16BIT, |c| c.element_bytes)
    }

    /// The model.
    pub fn model(&self) -> &ModelProxy {
        self.model
    }

    /// The hardware.
    pub fn hardware(&self) -> &HardwareSpec {
        self.hardware
    }
}
