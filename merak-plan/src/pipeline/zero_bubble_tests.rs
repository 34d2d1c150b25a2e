//! The zero-bubble schedules built, validated and simulated: ZB-H1 cuts 1F1B's bubble to a
//! third at 1F1B's peak memory, ZB-V is valid and beats ZB-H1 (the schedule builder, the
//! validator and the simulator together).

use crate::pipeline::{Action, Costs, Schedule, ScheduleKind, build_schedule, simulate, validate};

#[test]
fn zb_h1_cuts_the_1f1b_bubble_to_a_third_at_1f1b_peak_memory() {
    for p in [2, 3, 4, 6] {
        for m in [p, 2 * p, 3 * p + 1] {
            let zb = build_schedule(ScheduleKind::ZbH1, p, m, 1, &vec![false; p]).unwrap();
            let one = build_schedule(ScheduleKind::OneFOneB, p, m, 1, &vec![false; p]).unwrap();
            // F = B = W = 1: 1F1B idles (p-1)(F+B+W) per rank, ZB-H1 (p-1)(F+B-W).
            let costs = Costs::uniform(p, 1.0, 2.0);
            let idle = |s: &Schedule| {
                let sim = simulate(s, &costs, 1).unwrap();
                sim.makespan() - sim.busy(0)
            };
            let (z, o) = (idle(&zb), idle(&one));
            assert!(
                (o - 3.0 * (p - 1) as f64).abs() < 1e-9,
                "p={p} m={m}: 1f1b {o}"
            );
            assert!((z - (p - 1) as f64).abs() < 1e-9, "p={p} m={m}: zb-h1 {z}");
            // Rank r holds at most p micro-batches between F and W; stage 0 as in 1F1B.
            for stage in 0..p {
                assert!(zb.max_in_flight(stage) <= p.min(m), "p={p} m={m} s={stage}");
            }
            assert_eq!(zb.max_in_flight(0), one.max_in_flight(0));
        }
    }
}

#[test]
fn a_message_between_stages_on_one_rank_is_refused() {
    let mut s = build_schedule(ScheduleKind::ZbV, 2, 2, 2, &[false; 4]).unwrap();
    // Stages 1 and 2 share rank 1 in the V.
    let send = Action::SendActivation { mb: 0, stage: 1 };
    assert!(!s.actions[1].contains(&send));
    s.actions[1].insert(2, send);
    let e = validate(&s).unwrap_err().to_string();
    assert!(e.contains("stages 1 and 2 share rank 1"), "{e}");
}

#[test]
fn zb_v_is_valid_within_1f1b_peak_and_beats_zb_h1() {
    for p in 1..=6 {
        for m in 1..=12 {
            let s = build_schedule(ScheduleKind::ZbV, p, m, 2, &vec![false; 2 * p]).unwrap();
            validate(&s).unwrap_or_else(|e| panic!("p={p} m={m}: {e}"));
            // Stage 0 and the last stage share rank 0, the middle two rank p-1.
            assert_eq!((s.rank_of(0), s.rank_of(2 * p - 1)), (0, 0));
            assert_eq!((s.rank_of(p - 1), s.rank_of(p)), (p - 1, p - 1));
            // A rank holds at most 2p stage micro-batches between a forward and its W:
            // 1F1B's p micro-batches of its whole share of the model.
            for list in &s.actions {
                let mut held: usize = 0;
                for a in list {
                    match a {
                        Action::Forward { .. } => held += 1,
                        Action::BackwardWeight { .. } => held -= 1,
                        _ => {}
                    }
                    assert!(held <= 2 * p, "p={p} m={m}: {held}");
                }
            }
            if p < 2 || m < p {
                continue;
            }
            // F = B = W: each chunk forward 0.5, backward 1 (ZB-H1's stages are twice as
            // large).
            let time = |kind: ScheduleKind, v: usize| {
                let s = build_schedule(kind, p, m, v, &vec![false; p * v]).unwrap();
                let costs = Costs::uniform(p * v, 1.0 / v as f64, 2.0 / v as f64);
                simulate(&s, &costs, 1).unwrap().makespan()
            };
            let (v, h) = (time(ScheduleKind::ZbV, 2), time(ScheduleKind::ZbH1, 1));
            assert!(v <= h, "p={p} m={m}: zb-v {v} > zb-h1 {h}");
        }
    }
}
