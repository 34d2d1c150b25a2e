//! DualPipeV built, validated and simulated: valid for every shape it takes, its pairs where
//! the steady state runs, and what the pairs hide of the pipeline messages.

use crate::pipeline::{Action, Costs, Schedule, ScheduleKind, build_schedule, simulate, validate};

fn dual(p: usize, m: usize, recompute: bool) -> Schedule {
    build_schedule(ScheduleKind::DualPipeV, p, m, 2, &vec![recompute; 2 * p]).unwrap()
}

/// The most stage micro-batches a rank holds between a forward and its W.
fn held_at_most(list: &[Action]) -> usize {
    let (mut held, mut max) = (0usize, 0usize);
    for a in list.iter().flat_map(|a| a.parts()) {
        match a {
            Action::Forward { .. } => held += 1,
            Action::BackwardWeight { .. } => held -= 1,
            _ => {}
        }
        max = max.max(held);
    }
    max
}

/// `s` with every pair run as its forward then its backward, messages where they were.
fn unpaired(s: &Schedule) -> Schedule {
    let mut out = s.clone();
    for list in &mut out.actions {
        *list = list.iter().flat_map(|a| a.parts()).collect();
    }
    out
}

fn pairs(list: &[Action]) -> usize {
    (list.iter())
        .filter(|a| matches!(a, Action::ForwardBackward { .. }))
        .count()
}

#[test]
fn dualpipev_is_valid_for_every_shape_it_takes_within_2p_plus_2_stage_micro_batches() {
    for p in 1..=8 {
        for m in 2 * p..=4 * p + 3 {
            for recompute in [false, true] {
                let s = dual(p, m, recompute);
                validate(&s).unwrap_or_else(|e| panic!("p={p} m={m}: {e}"));
            }
            let s = dual(p, m, false);
            for (r, list) in s.actions.iter().enumerate() {
                // One stage micro-batch (half a micro-batch of the rank's share of the model)
                // more than 1F1B's p micro-batches of that share (ZB-V's bound, 2p stage
                // micro-batches), and one more for the W a pair keeps until after the next.
                let held = held_at_most(list);
                assert!(
                    held == 2 * p + 2 || (held, m) == (2 * p + 1, 2 * p),
                    "p={p} m={m} r={r}: {held}"
                );
                // Two pairs per steady-state round, one per round of phase 5, less the last
                // rank's first.
                let expect = 2 * (m + r + 1 - 2 * p) + (p - r - 1) - usize::from(r + 1 == p);
                assert_eq!(pairs(list), expect, "p={p} m={m} r={r}");
                // Each stage runs its forwards and its backwards in micro-batch order.
                for stage in s.stages_on(r) {
                    let order = |forward: bool| -> Vec<usize> {
                        (list.iter().flat_map(|a| a.parts()))
                            .filter_map(|a| match a {
                                Action::Forward { mb, stage: s } if forward && s == stage => {
                                    Some(mb)
                                }
                                Action::Backward { mb, stage: s } if !forward && s == stage => {
                                    Some(mb)
                                }
                                _ => None,
                            })
                            .collect()
                    };
                    let all: Vec<usize> = (0..m).collect();
                    assert_eq!((order(true), order(false)), (all.clone(), all));
                }
            }
        }
    }
}

#[test]
fn fewer_than_2p_micro_batches_and_pairs_elsewhere_are_refused() {
    let e = build_schedule(ScheduleKind::DualPipeV, 4, 7, 2, &[false; 8]).unwrap_err();
    assert!(
        e.to_string()
            .contains("dualpipev schedule needs at least 8 micro-batches for 4 pipeline ranks"),
        "{e}"
    );
    let e = build_schedule(ScheduleKind::DualPipeV, 2, 4, 3, &[false; 6]).unwrap_err();
    assert!(
        e.to_string().contains("dualpipev schedule runs two stages"),
        "{e}"
    );
    // A DualPipeV list relabelled ZB-V: its pairs are refused.
    let mut s = dual(2, 4, false);
    s.kind = ScheduleKind::ZbV;
    let e = validate(&s).unwrap_err().to_string();
    assert!(
        e.contains("only the dualpipev schedule runs, not zb-v"),
        "{e}"
    );
}

/// Forward 0.5, backward 1 (B and W 0.5 each) per stage, messages of `message` seconds.
fn costs(p: usize, message: f64) -> Costs {
    let mut costs = Costs::uniform(2 * p, 0.5, 1.0);
    costs.send_activation = message;
    costs.send_grad = message;
    costs
}

#[test]
fn the_pairs_hide_pipeline_messages_and_dualpipev_beats_zb_v_when_they_cost() {
    for p in 2..=6 {
        for m in [2 * p, 3 * p + 1] {
            let s = dual(p, m, false);
            let zb_v = build_schedule(ScheduleKind::ZbV, p, m, 2, &vec![false; 2 * p]).unwrap();
            let time =
                |s: &Schedule, message: f64| simulate(s, &costs(p, message), 1).unwrap().makespan();
            // Free messages: nothing to hide, the pair is its forward then its backward.
            assert!((time(&s, 0.0) - time(&unpaired(&s), 0.0)).abs() < 1e-9);
            assert!(time(&s, 0.0) <= time(&zb_v, 0.0) + 1e-9, "p={p} m={m}");
            // Costly messages: the pair waits for its backward's gradient while its forward
            // runs, and sends its forward's output before its backward.
            let (paired, apart) = (time(&s, 0.25), time(&unpaired(&s), 0.25));
            if p > 2 {
                assert!(
                    paired < apart - 0.4,
                    "p={p} m={m}: {paired} against {apart}"
                );
            } else {
                assert!(
                    paired <= apart + 1e-9,
                    "p={p} m={m}: {paired} against {apart}"
                );
            }
            let v = time(&zb_v, 0.25);
            assert!(paired < v, "p={p} m={m}: dualpipev {paired}, zb-v {v}");
        }
    }
}

/// The simulator's pair: posted receives take no time where they stand, the forward starts
/// when its input is there, the backward when its gradient is, the forward's send leaves when
/// the forward ends.
#[test]
fn a_pair_waits_for_each_input_only_when_its_pass_starts() {
    let s = dual(3, 6, false);
    let sim = simulate(&s, &costs(3, 0.25), 1).unwrap();
    let mut seen = 0;
    for (rank, events) in sim.events.iter().enumerate() {
        for (i, e) in events.iter().enumerate() {
            let Action::ForwardBackward { .. } = e.action else {
                continue;
            };
            seen += 1;
            // The receives just before the pair ended where they were posted.
            for before in events[..i].iter().rev().take_while(|b| {
                matches!(
                    b.action,
                    Action::RecvActivation { .. } | Action::RecvGrad { .. }
                )
            }) {
                assert_eq!(before.start, before.end, "rank {rank}: {:?}", before.action);
            }
            // At least the forward and the backward's B (0.5 + 0.5).
            assert!(e.duration() >= 1.0 - 1e-9, "rank {rank}: {e:?}");
        }
    }
    assert!(seen > 0);
}

/// The forwards of pairs compute the W after them while their all-to-alls wait: with a
/// quarter of each forward waiting, DualPipeV's step shrinks; ZB-V, without pairs, does not
/// change.
#[test]
fn a_pairs_forward_fills_its_all_to_all_waits_with_the_next_weight_gradients() {
    for p in [2, 4] {
        let m = 3 * p;
        let s = dual(p, m, false);
        let zb_v = build_schedule(ScheduleKind::ZbV, p, m, 2, &vec![false; 2 * p]).unwrap();
        let mut waiting = costs(p, 0.0);
        waiting.forward_comm = vec![0.125; 2 * p];
        let time = |s: &Schedule, c: &Costs| simulate(s, c, 1).unwrap().makespan();
        let (filled, plain) = (time(&s, &waiting), time(&s, &costs(p, 0.0)));
        assert!(filled < plain - 0.5, "p={p}: {filled} against {plain}");
        assert_eq!(time(&zb_v, &waiting), time(&zb_v, &costs(p, 0.0)));
        // A W right after a pair is shorter by the waits, never below nothing.
        let sim = simulate(&s, &waiting, 1).unwrap();
        let short = (sim.events.iter().flatten())
            .filter(|e| matches!(e.action, Action::BackwardWeight { .. }))
            .filter(|e| (e.duration() - 0.375).abs() < 1e-9)
            .count();
        assert!(short > 0, "p={p}");
        waiting.forward_comm = vec![10.0; 2 * p];
        let sim = simulate(&s, &waiting, 1).unwrap();
        assert!(sim.events.iter().flatten().all(|e| e.duration() >= 0.0));
    }
}
