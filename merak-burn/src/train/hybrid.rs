//! Hybrid sharding (`parallel.shard`): the data-parallel group cut into shard groups of
//! `shard` consecutive data-parallel replicas with their context-parallel ranks (`shard x cp`
//! ranks, as the planner's accounting counts a copy), each holding one copy's chunks (ZeRO-2
//! or 3 within it), and replicate groups of the ranks holding the same chunk in every copy
//! (torchtitan's `dp_shard` × `dp_replicate`).
//!
//! Routed experts held apart (expert or tensor parallelism, [`experts_apart`]) are sharded
//! within the copy too: their chunks are cut over the *expert-shard group*, the ranks of the
//! expert group ([`ProcessGrid::experts`]) in this rank's shard group, `(shard x cp / ep) × tp`
//! ranks, and each chunk is all-reduced over the same replicate group as the dense chunks.
//! That group holds the same expert chunk in every copy: with `c = shard x cp` its ranks share
//! the pipeline stage, the TP index and `i % c` (`i` the rank's index in the data-parallel
//! group), hence (`ep` dividing `c`) `i % ep`, which picks the experts, and `(i % c) / ep`,
//! which with the TP index is the rank's place in its expert-shard group (the expert group's
//! key order, `(i / ep) × tp + tp`, kept). A startup check confirms it on every hybrid run.

use crate::comm::{Communicator, Group};
use crate::data_parallel::HybridSharding;
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::train::experts::experts_apart;
use crate::train::{InvalidSetting, TrainError};

/// This rank's groups for ZeRO's chunks ([`shard_groups`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShardGroups {
    /// The ranks sharing one copy's dense chunks: the data-parallel group, or under hybrid
    /// sharding this rank's shard group.
    pub shard: Group,
    /// Under hybrid sharding: the ranks holding the same chunks in the other copies.
    pub replicate: Option<Group>,
    /// The ranks the chunks of routed experts held apart are cut over: the expert group, or
    /// under hybrid sharding its ranks in this rank's shard group (the expert-shard group).
    pub experts: Group,
}

/// This rank's shard group, replicate group and expert-shard group: `(dp, None, experts)`
/// without hybrid sharding (`parallel.shard` 0 or dp). Refuses a degree that does not divide
/// dp, hybrid sharding without ZeRO, and expert parallelism whose degree does not divide the
/// shard groups' size.
pub(crate) fn shard_groups(
    grid: &ProcessGrid,
    parallel: &ParallelPlan,
) -> Result<ShardGroups, TrainError> {
    // The data-parallel group holds `dp x cp` ranks, the cp ranks of a replica consecutive: a
    // copy is `shard` replicas with their context-parallel ranks.
    let cp = grid.layout.cp.max(1);
    let (dp, shard) = (grid.dp.size() / cp, parallel.shard);
    if shard == 0 || shard == dp {
        return Ok(ShardGroups {
            shard: grid.dp,
            replicate: None,
            experts: grid.experts,
        });
    }
    check_hybrid(dp, cp, parallel)?;
    let (me, comm, copy) = (grid.coords.dp, grid.dp.comm()?, shard * cp);
    let shard_comm = comm.split(me / copy, me % copy)?;
    let replicate = comm.split(me % copy, me / copy)?;
    let experts = match experts_apart(grid) {
        true => {
            let all = grid.experts.comm()?;
            let experts = all.split(me / copy, all.rank())?;
            same_expert_chunks(grid, &*replicate, &*experts)?;
            Group::register(experts)
        }
        false => grid.experts,
    };
    Ok(ShardGroups {
        shard: Group::register(shard_comm),
        replicate: Some(Group::register(replicate)),
        experts,
    })
}

/// Checks, once, what the module docs reason: the ranks of this rank's replicate group hold
/// the same experts (expert-parallel index) at the same place of expert-shard groups of the
/// same size (`experts`), so that the all-reduce over the copies sums the same expert chunk.
fn same_expert_chunks(
    grid: &ProcessGrid,
    replicate: &dyn Communicator,
    experts: &dyn Communicator,
) -> Result<(), TrainError> {
    let mine = [
        grid.ep.size(),
        grid.ep.rank(),
        experts.size(),
        experts.rank(),
    ]
    .map(|x| x as f32);
    let mut all = vec![0.0; mine.len() * replicate.size()];
    replicate.all_gather(&mine, &mut all)?;
    match all.chunks(mine.len()).all(|c| c == mine) {
        true => Ok(()),
        false => Err(TrainError::ZeroValues(format!(
            "hybrid sharding: the copies' ranks of one replicate group hold different expert \
             chunks (expert-parallel size, rank, expert-shard size, rank by copy: {all:?})"
        ))),
    }
}

/// Hybrid sharding's settings: `parallel.shard` dividing the `dp` data-parallel ranks, ZeRO
/// on, and `parallel.ep` dividing a copy's `shard x cp` ranks (each copy holds every expert).
fn check_hybrid(dp: usize, cp: usize, parallel: &ParallelPlan) -> Result<(), InvalidSetting> {
    let hybrid = HybridSharding {
        dp,
        cp,
        ep: parallel.ep,
        zero: parallel.zero,
        shard: parallel.shard,
    };
    match hybrid.problem(&|f| format!("parallel.{f}")) {
        Some(reason) => Err(InvalidSetting {
            key: "parallel.shard".into(),
            value: parallel.shard.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(zero: u8, shard: usize, ep: usize) -> ParallelPlan {
        ParallelPlan {
            dp: 4,
            zero,
            shard,
            ep,
            ..ParallelPlan::default()
        }
    }

    /// Expert parallelism under hybrid sharding needs `ep` to divide the shard groups' size;
    /// the refusal names both settings with their values.
    #[test]
    fn hybrid_sharding_refuses_an_ep_that_does_not_divide_the_shard_groups() {
        let e = check_hybrid(4, 1, &plan(1, 2, 4)).expect_err("ep 4 does not divide shard 2");
        assert_eq!(e.key, "parallel.shard");
        assert_eq!(e.value, "2");
        assert!(
            e.reason.contains("parallel.ep = 4") && e.reason.contains("parallel.cp = 1"),
            "{e}"
        );
        for (zero, shard, ep) in [(1, 2, 2), (2, 2, 1), (3, 4, 2), (3, 2, 2)] {
            check_hybrid(4, 1, &plan(zero, shard, ep)).expect("ep divides shard");
        }
        let e = check_hybrid(4, 1, &plan(0, 2, 1)).expect_err("no ZeRO");
        assert!(e.reason.contains("parallel.zero"), "{e}");
        let e = check_hybrid(4, 1, &plan(1, 3, 1)).expect_err("3 does not divide 4");
        assert!(e.reason.contains("divide parallel.dp = 4"), "{e}");
    }
}
