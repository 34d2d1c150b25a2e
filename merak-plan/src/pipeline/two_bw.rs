//! PipeDream-2BW without a flush: the action list of one step when the next step's first
//! forwards run during this step's last backwards.
//!
//! Under 2BW the gradients of step `t` are computed on the weights from before the previous
//! update, so step `t + 1`'s forwards need only the weights that exist while step `t` still runs
//! its backwards. A rank therefore runs, in the call of step `t`, the prefix of a two-step 1F1B
//! order (micro-batches `0..2m`, the second `m` being step `t + 1`'s) up to its last backward of
//! step `t`: the forwards of step `t + 1` it meets on the way (its warm-up) are *carried* into
//! the next call, whose list leaves them out. The optimizer step, whose gradient norm is a
//! collective over all ranks, stays between the calls; what disappears is the warm-up of each
//! step after the first, which fills the previous step's cool-down.
//!
//! In a segment, a micro-batch index `mb >= m` is micro-batch `mb - m` of the next step.

use std::collections::HashSet;

use super::schedule::{Action, Schedule, expand_op, one_f_one_b_order};

/// The actions of `rank` for `micro_batches` micro-batches in 1F1B order, with their messages.
fn expanded(s: &Schedule, rank: usize, micro_batches: usize) -> Vec<Action> {
    let mut out = Vec::new();
    for op in one_f_one_b_order(s.ranks, micro_batches, rank) {
        expand_op(op, &|stage| s.rank_of(stage), s.stages(), &[], &mut out);
    }
    out
}

/// The two-step prefix of `rank` that ends with its last backward of the first step (and the
/// gradient it sends).
fn overlapping_prefix(s: &Schedule, rank: usize) -> Vec<Action> {
    let m = s.micro_batches;
    let mut list = expanded(s, rank, 2 * m);
    let last_backward = list
        .iter()
        .position(|a| matches!(a, Action::Backward { mb, .. } if *mb + 1 == m))
        .unwrap_or(list.len().saturating_sub(1));
    let end = match list.get(last_backward + 1) {
        Some(Action::SendGrad { mb, .. }) if *mb + 1 == m => last_backward + 2,
        _ => last_backward + 1,
    };
    list.truncate(end);
    list
}

/// The actions of the next step that `rank` runs ahead in an overlapping call, as that step
/// numbers them (`mb - m`).
pub fn carried(s: &Schedule, rank: usize) -> HashSet<Action> {
    let m = s.micro_batches;
    overlapping_prefix(s, rank)
        .into_iter()
        .filter(|a| a.micro_batch().is_some_and(|mb| mb >= m))
        .map(|a| a.with_micro_batch(a.micro_batch().unwrap_or(0) - m))
        .collect()
}

/// The list of `rank` for one 2BW step (without its optimizer step): `carried_in` when the
/// previous call ran this step's first forwards ahead, `carry_out` when this call runs the
/// next step's first forwards ahead (their `mb` is `m + i`). With neither it is the 1F1B list.
pub fn segment(s: &Schedule, rank: usize, carried_in: bool, carry_out: bool) -> Vec<Action> {
    let base = if carry_out {
        overlapping_prefix(s, rank)
    } else {
        expanded(s, rank, s.micro_batches)
    };
    if !carried_in {
        return base;
    }
    let done = carried(s, rank);
    base.into_iter().filter(|a| !done.contains(a)).collect()
}

/// Every rank's `(step, action)` list for `steps` consecutive overlapping 2BW steps, each step
/// ending with its optimizer step: what the executor runs when no step stops the overlap.
pub fn continuous(s: &Schedule, steps: usize) -> Vec<Vec<(usize, Action)>> {
    let m = s.micro_batches;
    (0..s.ranks)
        .map(|rank| {
            let mut list = Vec::new();
            for step in 0..steps {
                for a in segment(s, rank, step > 0, step + 1 < steps) {
                    let mb = a.micro_batch().unwrap_or(0);
                    list.push(if mb >= m {
                        (step + 1, a.with_micro_batch(mb - m))
                    } else {
                        (step, a)
                    });
                }
                list.push((step, Action::OptimizerStep));
            }
            list
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::{ScheduleKind, build_schedule};
    use crate::pipeline::validate::execute;

    fn two_bw(p: usize, m: usize) -> Schedule {
        build_schedule(ScheduleKind::TwoBw, p, m, 1, &vec![false; p]).unwrap()
    }

    #[test]
    fn without_overlap_a_segment_is_the_1f1b_list() {
        for p in 1..=4 {
            for m in 1..=5 {
                let s = two_bw(p, m);
                for rank in 0..p {
                    let mut list = segment(&s, rank, false, false);
                    list.push(Action::OptimizerStep);
                    assert_eq!(list, s.actions[rank], "p={p} m={m} rank={rank}");
                }
            }
        }
    }

    #[test]
    fn overlapping_steps_run_every_action_once_without_deadlock() {
        for p in 1..=6 {
            for m in 1..=8 {
                let s = two_bw(p, m);
                for steps in 1..=3 {
                    let lists = continuous(&s, steps);
                    execute(s.kind, p, p, &[], &lists, None)
                        .unwrap_or_else(|e| panic!("p={p} m={m} steps={steps}: {e}"));
                    for (rank, list) in lists.iter().enumerate() {
                        let mut seen = HashSet::new();
                        for a in list {
                            assert!(seen.insert(*a), "p={p} m={m} rank={rank}: {a:?} twice");
                        }
                        let per_step = s.actions[rank].len();
                        assert_eq!(list.len(), steps * per_step, "p={p} m={m} rank={rank}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_next_steps_warm_up_is_carried() {
        let s = two_bw(4, 8);
        for rank in 0..4 {
            let forwards = carried(&s, rank)
                .into_iter()
                .filter(|a| matches!(a, Action::Forward { .. }))
                .count();
            assert_eq!(forwards, 3 - rank, "rank {rank}");
            // Only forwards and their messages run ahead, never a backward.
            assert!(
                carried(&s, rank)
                    .iter()
                    .all(|a| !matches!(a, Action::Backward { .. } | Action::RecvGrad { .. }))
            );
        }
    }
}
