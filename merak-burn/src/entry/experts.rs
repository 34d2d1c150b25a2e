//! Expert parallelism for a model described unit by unit: what a run checks before it splits
//! the grid's expert groups, and that the blocks it built hold only their share of the routed
//! experts.

use std::collections::{BTreeMap, BTreeSet};

use super::RunError;
use crate::checkpoint::state::ParamShape;
use crate::parallel_plan::ParallelPlan;

/// Refuses expert parallelism (`plan.ep > 1`) that a unit model cannot take: a model that
/// declares no experts (`experts`: [`UnitModel::experts`](super::UnitModel::experts)), an
/// expert count that `ep` does not divide, or tensor parallelism (a unit model's blocks see
/// whole sequences on every TP rank, which would then route the same tokens twice).
pub(crate) fn check_plan(
    experts: Option<(usize, usize)>,
    plan: &ParallelPlan,
) -> Result<(), RunError> {
    let ep = plan.ep.max(1);
    if ep == 1 {
        return Ok(());
    }
    let refuse = |reason: String| Err(RunError::ExpertParallel { ep, reason });
    let Some((_, count)) = experts else {
        return refuse(
            "the model declares no mixture of experts (UnitModel::experts); use parallel.ep = 1"
                .into(),
        );
    };
    if !count.is_multiple_of(ep) {
        return refuse(format!(
            "it must divide the {count} routed experts of each layer"
        ));
    }
    if plan.tp > 1 {
        return refuse(format!(
            "the mixtures of experts of a model trained through merak_burn::run see whole \
             sequences on every tensor-parallel rank, so its parallel.tp = {} ranks would route \
             the same tokens; use parallel.tp = 1 with expert parallelism (or parallel.ep = 1)",
            plan.tp
        ));
    }
    Ok(())
}

/// Refuses built units (`shapes`: their parameters) whose mixtures of experts hold other than
/// `experts / ep` of their routed experts (`….experts.{e}.…`) on this rank: blocks built
/// without [`UnitPlace::moe`](super::UnitPlace::moe).
pub(crate) fn check_split(
    shapes: &[ParamShape],
    experts: usize,
    ep: usize,
) -> Result<(), RunError> {
    let want = experts / ep.max(1);
    for (layer, held) in held_experts(shapes) {
        if held.len() != want {
            return Err(RunError::ExpertParallel {
                ep,
                reason: format!(
                    "`{layer}` holds {} of its {experts} routed experts on this rank, not \
                     {experts} / {ep} = {want}: build its MoeLayer with the place \
                     UnitPlace::moe gives (override UnitModel::layer_on)",
                    held.len()
                ),
            });
        }
    }
    Ok(())
}

/// The routed experts each mixture of experts holds, by the path before `.experts.`.
fn held_experts(shapes: &[ParamShape]) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut held: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for p in shapes {
        if let Some((layer, rest)) = p.name.split_once(".experts.") {
            let expert = rest.split('.').next().unwrap_or(rest);
            held.entry(layer).or_default().insert(expert);
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;

    use super::*;
    use crate::tensor_parallel::ShardKind;

    fn shapes(names: &[&str]) -> Vec<ParamShape> {
        (names.iter())
            .map(|n| ParamShape {
                name: (*n).into(),
                id: ParamId::new(),
                shape: vec![2],
                split: ShardKind::Replicated,
            })
            .collect()
    }

    #[test]
    fn blocks_holding_their_share_pass_and_blocks_holding_all_are_refused() {
        let half = shapes(&[
            "layers.0.moe.router",
            "layers.0.moe.experts.2.w_in",
            "layers.0.moe.experts.2.w_out",
            "layers.0.moe.experts.3.w_in",
            "layers.1.moe.experts.2.w_in",
            "layers.1.moe.experts.3.w_in",
        ]);
        assert!(check_split(&half, 4, 2).is_ok());
        let err = check_split(&half, 4, 1).expect_err("two of four at ep 1");
        let msg = err.to_string();
        assert!(msg.contains("parallel.ep = 1"), "{msg}");
        assert!(msg.contains("`layers.0.moe` holds 2 of its 4"), "{msg}");
        let all = shapes(&["layers.0.moe.experts.0.w", "layers.0.moe.experts.1.w"]);
        let msg = check_split(&all, 2, 2)
            .expect_err("all at ep 2")
            .to_string();
        assert!(msg.contains("UnitModel::layer_on"), "{msg}");
    }

    #[test]
    fn expert_parallelism_is_refused_without_experts_uneven_or_with_tp() {
        let plan = |ep, tp| ParallelPlan {
            dp: 4,
            tp,
            ep,
            ..ParallelPlan::default()
        };
        assert!(check_plan(None, &plan(1, 2)).is_ok());
        assert!(check_plan(Some((2, 8)), &plan(4, 1)).is_ok());
        let refused =
            |experts, p: ParallelPlan| check_plan(experts, &p).expect_err("refused").to_string();
        assert!(refused(None, plan(2, 1)).contains("declares no mixture"));
        assert!(refused(Some((2, 6)), plan(4, 1)).contains("divide the 6 routed"));
        assert!(refused(Some((2, 8)), plan(2, 2)).contains("parallel.tp = 2"));
    }
}
