//! The per-rank memory of the cost model: each pipeline rank's model states, activations of
//! the micro-batches in flight and workspace ([`RankMemory`]). The bytes per parameter come
//! from the one accounting of model states in [`planner::memory`](crate::planner::memory)
//! (a sibling of `cost`, not this file).

use super::{CostError, CostModel, FRAMEWORK_BYTES, Layout};
use crate::pipeline::{ScheduleKind, build_schedule};
use crate::planner::memory::{StateFormat, StateSharding, model_states};
use crate::planner::model::RecomputeMode;

/// The memory-relevant terms of one stage (model chunk) of a pipeline rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChunkMemory {
    /// Parameters held, tied copies included, routed experts excluded.
    pub params: f64,
    /// Routed experts' parameters held.
    pub expert_params: f64,
    /// Activation bytes of one micro-batch.
    pub activation_bytes: f64,
    /// The most micro-batches the stage holds at once.
    pub in_flight: usize,
    /// How the stage treats its activations.
    pub mode: RecomputeMode,
    /// The largest unit's activation bytes without recomputation.
    pub largest_activation_bytes: f64,
}

/// Memory of one pipeline rank, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RankMemory {
    /// Parameters held (all chunks), routed experts excluded.
    pub params: f64,
    /// Routed experts' parameters held (all chunks).
    pub expert_params: f64,
    /// Model states (weights, gradients, optimizer states, a second 2BW weight version).
    pub states: f64,
    /// Activations of the micro-batches in flight.
    pub activations: f64,
    /// Workspace and framework memory.
    pub workspace: f64,
}

/// Bytes of model states per parameter held ([`CostModel::state_bytes`]): of the
/// dense parameters (sharded over the `dp x cp` replicas, or a shard group) and of the routed
/// experts (sharded over the `dp x cp / ep` ranks that hold the same experts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct StateBytes {
    /// Per dense parameter.
    pub dense: f64,
    /// Per routed expert's parameter.
    pub expert: f64,
}

impl StateBytes {
    /// Per dense and per expert parameter under `sharding`, in `format`.
    pub(crate) fn of(sharding: &StateSharding, format: &StateFormat) -> Self {
        Self {
            dense: model_states(1.0, 0.0, sharding, format).total(),
            expert: model_states(0.0, 1.0, sharding, format).total(),
        }
    }
}

impl RankMemory {
    /// The peak: states + activations + workspace, rounded up.
    pub(crate) fn peak_bytes(&self) -> u64 {
        (self.states + self.activations + self.workspace).ceil() as u64
    }
}

impl<'a> CostModel<'a> {
    /// The micro-batches each global stage holds when its rank holds the most at once
    /// ([`Schedule::in_flight_at_peak`](crate::pipeline::Schedule::in_flight_at_peak)): with
    /// several stages per rank (interleaved, ZB-V) their own maxima fall at different times.
    pub(crate) fn in_flight(
        &self,
        kind: ScheduleKind,
        p: usize,
        v: usize,
        m: usize,
    ) -> Result<Vec<usize>, CostError> {
        if kind == ScheduleKind::GPipe {
            return Ok(vec![m; p * v]);
        }
        // Beyond 4p micro-batches the warm-up (at most 2(p-1) + (v-1)p forwards) is unchanged.
        let m_small = m.min(4 * p);
        let key = (kind, p, v, m_small);
        if let Some(found) = self.in_flight.borrow().get(&key) {
            return Ok(found.clone());
        }
        let schedule = build_schedule(kind, p, m_small, v, &vec![false; p * v])?;
        let counts = schedule.in_flight_at_peak();
        self.in_flight.borrow_mut().insert(key, counts.clone());
        Ok(counts)
    }

    /// The memory of a pipeline rank holding `chunks` (its stages, in chunk order), with
    /// `state_bytes` per dense and per expert parameter from
    /// [`state_bytes`](Self::state_bytes): model states, each chunk's
    /// activations times its micro-batches in flight, and a workspace ([`FRAMEWORK_BYTES`]
    /// plus, when a chunk recomputes, the largest unit's full activations).
    pub(crate) fn rank_memory(
        chunks: impl IntoIterator<Item = ChunkMemory>,
        state_bytes: StateBytes,
    ) -> RankMemory {
        let mut memory = RankMemory::default();
        let mut recomputes = false;
        let mut largest_unit = 0.0f64;
        for chunk in chunks {
            memory.params += chunk.params;
            memory.expert_params += chunk.expert_params;
            memory.activations += chunk.in_flight as f64 * chunk.activation_bytes;
            recomputes |= chunk.mode != RecomputeMode::None;
            largest_unit = largest_unit.max(chunk.largest_activation_bytes);
        }
        memory.states =
            memory.params * state_bytes.dense + memory.expert_params * state_bytes.expert;
        memory.workspace = FRAMEWORK_BYTES + if recomputes { largest_unit } else { 0.0 };
        memory
    }

    /// Model-state bytes per dense and per expert parameter under `sharding`, in this model's
    /// [`StateFormat`], by the one accounting of [`memory`](crate::planner::memory).
    pub(crate) fn state_bytes(&self, sharding: &StateSharding) -> StateBytes {
        StateBytes::of(sharding, &self.state_format)
    }

    /// Bytes of model states per parameter under `layout` (dense and routed experts).
    pub(super) fn layout_state_bytes(&self, layout: &Layout) -> StateBytes {
        self.state_bytes(&layout.state_sharding())
    }
}
