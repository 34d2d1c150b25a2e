//! Sequence and context parallelism for a model described unit by unit: what a run checks
//! before it builds the units, and the share of every sequence a context-parallel rank's
//! blocks are built with.

use burn::tensor::backend::Backend;

use super::{RunError, UnitModel};
use crate::context_parallel::{ContextShare, ZigZag};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;

/// Refuses sequence parallelism (`plan.sequence_parallel` at `plan.tp > 1`) that a unit
/// model cannot take: sequences of `positions` that tp does not divide, or blocks holding
/// mixtures of experts (`experts`, whose routing would see only this rank's positions).
pub(crate) fn check_sequence_parallel(
    experts: Option<(usize, usize)>,
    plan: &ParallelPlan,
    positions: usize,
) -> Result<(), RunError> {
    let tp = plan.tp;
    if !plan.sequence_parallel || tp <= 1 {
        return Ok(());
    }
    let refuse = |reason: String| Err(RunError::SequenceParallel { tp, reason });
    if !positions.is_multiple_of(tp) {
        return refuse(format!(
            "each rank holds seq / tp positions between the blocks, but the first unit \
             returns {positions} positions per sample, which {tp} does not divide"
        ));
    }
    if experts.is_some() {
        return refuse(
            "a model of your own with mixtures of experts has no sequence parallelism yet; \
             set parallel.sequence_parallel = false"
                .into(),
        );
    }
    Ok(())
}

/// Refuses context parallelism (`plan.cp > 1`) for a model whose blocks do not declare it
/// ([`UnitModel::context_parallel`](super::UnitModel::context_parallel)): their attention
/// would see only each rank's share of the sequences.
pub(crate) fn check_context_parallel<B: Backend, M: UnitModel<B>>(
    model: &M,
    plan: &ParallelPlan,
) -> Result<(), RunError> {
    if plan.cp <= 1 || model.context_parallel() {
        return Ok(());
    }
    Err(RunError::ContextParallel {
        cp: plan.cp,
        reason: "the model's blocks do not attend over the context-parallel ranks: build their \
                 attention on UnitPlace::context (ContextShare::attention) and declare \
                 UnitModel::context_parallel, or use parallel.cp = 1"
            .into(),
    })
}

/// This rank's share of every sequence of `seq` positions under the plan's context
/// parallelism (`None` for cp = 1).
pub(crate) fn context_share(
    plan: &ParallelPlan,
    grid: &ProcessGrid,
    seq: usize,
) -> Result<Option<ContextShare>, RunError> {
    if grid.cp.size() <= 1 {
        return Ok(None);
    }
    let zigzag = ZigZag::new(seq, grid.cp.size(), grid.cp.rank()).map_err(|e| {
        RunError::ContextParallel {
            cp: grid.cp.size(),
            reason: e.to_string(),
        }
    })?;
    Ok(Some(ContextShare {
        group: grid.cp,
        zigzag,
        exchange: plan.cp_attention,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_parallelism_is_refused_on_uneven_sequences_or_with_experts() {
        let plan = |tp, sequence_parallel| ParallelPlan {
            tp,
            sequence_parallel,
            ..ParallelPlan::default()
        };
        assert!(check_sequence_parallel(None, &plan(2, true), 32).is_ok());
        // Off, or one TP rank: nothing to check.
        assert!(check_sequence_parallel(Some((2, 4)), &plan(2, false), 33).is_ok());
        assert!(check_sequence_parallel(Some((2, 4)), &plan(1, true), 33).is_ok());
        let refused = |experts, p: ParallelPlan, seq| {
            (check_sequence_parallel(experts, &p, seq))
                .expect_err("refused")
                .to_string()
        };
        let msg = refused(None, plan(2, true), 33);
        assert!(
            msg.contains("parallel.sequence_parallel at parallel.tp = 2"),
            "{msg}"
        );
        assert!(msg.contains("returns 33 positions"), "{msg}");
        let msg = refused(Some((2, 4)), plan(2, true), 32);
        assert!(msg.contains("mixtures of experts"), "{msg}");
    }
}
