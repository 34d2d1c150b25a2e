//! What a DualPipeV pair ([`Action::ForwardBackward`]) changes around it in a rank's list, for
//! the executor and the simulator alike: the receives it posts ahead, and the W whose weight
//! gradients its forward computes while its all-to-alls wait.
//!
//! Both read a rank's list through `at`: the action at an index, `None` past the end.

use super::schedule::Action;

/// Whether action `i` is a receive posted ahead of a pair: only receives stand between it and
/// the next [`Action::ForwardBackward`].
pub fn posted_ahead_of_pair(at: impl Fn(usize) -> Option<Action>, i: usize) -> bool {
    let receive = |a: &Action| matches!(a, Action::RecvActivation { .. } | Action::RecvGrad { .. });
    at(i).is_some_and(|a| receive(&a))
        && (i..)
            .map_while(&at)
            .find(|a| !receive(a))
            .is_some_and(|a| matches!(a, Action::ForwardBackward { .. }))
}

/// The W (micro-batch, stage) that follows the pair at `i` (only messages between them), when
/// it is another backward pass's: the pair's forward computes that W's weight gradients while
/// its all-to-alls wait.
pub fn weight_after_pair(at: impl Fn(usize) -> Option<Action>, i: usize) -> Option<(usize, usize)> {
    let Some(Action::ForwardBackward {
        backward_mb,
        backward_stage,
        ..
    }) = at(i)
    else {
        return None;
    };
    match (i + 1..).map_while(&at).find(Action::is_compute) {
        Some(Action::BackwardWeight { mb, stage })
            if (mb, stage) != (backward_mb, backward_stage) =>
        {
            Some((mb, stage))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{ScheduleKind, build_schedule};

    #[test]
    fn receives_ahead_of_pairs_and_the_w_after_them() {
        let s = build_schedule(ScheduleKind::DualPipeV, 3, 6, 2, &[false; 6]).unwrap();
        let (mut posted, mut fills) = (0, 0);
        for list in &s.actions {
            let at = |j: usize| list.get(j).copied();
            for (i, a) in list.iter().enumerate() {
                if posted_ahead_of_pair(at, i) {
                    posted += 1;
                    assert!(matches!(
                        a,
                        Action::RecvActivation { .. } | Action::RecvGrad { .. }
                    ));
                }
                if let Some((mb, stage)) = weight_after_pair(at, i) {
                    fills += 1;
                    assert!(list[i + 1..].contains(&Action::BackwardWeight { mb, stage }));
                }
            }
            // Nothing but pairs has either.
            let last = list.len() - 1;
            assert!(!posted_ahead_of_pair(at, last) && weight_after_pair(at, last).is_none());
        }
        assert!(posted > 0 && fills > 0, "{posted} {fills}");
        let one = build_schedule(ScheduleKind::OneFOneB, 3, 6, 1, &[false; 3]).unwrap();
        let at = |j: usize| one.actions[1].get(j).copied();
        assert!((0..one.actions[1].len()).all(|i| !posted_ahead_of_pair(at, i)));
    }
}
