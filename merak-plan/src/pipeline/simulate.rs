//! Predicting a schedule's time: a discrete-event simulation of its action lists.
//!
//! Every rank runs its actions in order; an action starts when the rank is free and its inputs
//! are there. Compute actions take their [`Costs`]; sends take no time on the sender (they are
//! buffered); a message's transfer time is paid by its receive, which completes at
//! `max(rank free, send time + transfer)`. The rank is idle while it waits.
//!
//! Steps: each rank runs its lists of steps `0..steps` one after the other, and every step
//! ends with its `OptimizerStep`, a barrier over all ranks (the global gradient norm before it
//! is a collective), as in the trainer. For the flushing schedules (all but 2BW) a step's list
//! is the schedule's. For [`ScheduleKind::TwoBw`] they are the overlapping lists of
//! [`two_bw::continuous`](super::two_bw::continuous) that the executor runs: every step but the
//! last runs the next step's warm-up forwards during its own cool-down.

use serde::{Deserialize, Serialize};

use super::schedule::{Action, Schedule, ScheduleKind};
use super::timing::{Costs, TimedAction};
use super::trace::{
    CATEGORY_BACKWARD, CATEGORY_FORWARD, CATEGORY_IDLE, CATEGORY_OPTIMIZER, CATEGORY_PAIR,
    CATEGORY_RECOMPUTE, CATEGORY_RECV, CATEGORY_SEND, CATEGORY_WEIGHT, TraceEvent,
};
use super::validate::{ValidationError, execute, validate};

/// The result of [`simulate`]: every rank's timed actions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// Pipeline ranks.
    pub ranks: usize,
    /// Simulated training steps.
    pub steps: usize,
    /// Per rank, its actions in the order they ran, with their times.
    pub events: Vec<Vec<TimedAction>>,
}

impl Simulation {
    /// When the last action of all ranks ends (the simulation starts at 0).
    pub fn makespan(&self) -> f64 {
        self.events
            .iter()
            .flatten()
            .map(|e| e.end)
            .fold(0.0, f64::max)
    }

    /// The mean time of one step: [`makespan`](Self::makespan) / steps.
    pub fn step_time(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        self.makespan() / self.steps as f64
    }

    /// The compute time of `rank`: its forwards, recomputations, backwards and optimizer steps
    /// (messages and waits excluded).
    pub fn busy(&self, rank: usize) -> f64 {
        self.events.get(rank).map_or(0.0, |events| {
            events
                .iter()
                .filter(|e| e.action.is_compute())
                .map(TimedAction::duration)
                .sum()
        })
    }

    /// The largest [`busy`](Self::busy) time of any rank.
    pub fn max_busy(&self) -> f64 {
        (0..self.ranks).map(|r| self.busy(r)).fold(0.0, f64::max)
    }

    /// The pipeline bubble: `(makespan - max busy) / max busy`, the time lost to the pipeline
    /// relative to the busiest rank's compute. For GPipe and 1F1B with uniform stages and free
    /// messages this is `(p - 1) / m`; for the interleaved schedule `(p - 1) / (v m)`.
    pub fn bubble_fraction(&self) -> f64 {
        let busy = self.max_busy();
        if busy <= 0.0 {
            return 0.0;
        }
        (self.makespan() - busy) / busy
    }

    /// The timeline as trace events (see [`trace`](super::trace)): one per action, named like
    /// `Forward(mb=0, stage=1) [step 0]`, plus an `idle` event for every gap in which a rank
    /// waits, up to the makespan.
    pub fn trace_events(&self) -> Vec<TraceEvent> {
        let makespan = self.makespan();
        let eps = 1e-12 * makespan.max(1.0);
        let mut out = Vec::new();
        let idle = |rank: usize, from: f64, to: f64| TraceEvent {
            rank,
            name: "idle".to_string(),
            category: CATEGORY_IDLE.to_string(),
            start_s: from,
            dur_s: to - from,
        };
        for (rank, events) in self.events.iter().enumerate() {
            let mut clock = 0.0;
            for e in events {
                if e.start - clock > eps {
                    out.push(idle(rank, clock, e.start));
                }
                out.push(TraceEvent {
                    rank,
                    name: format!("{} [step {}]", e.action, e.step),
                    category: category(e.action).to_string(),
                    start_s: e.start,
                    dur_s: e.duration(),
                });
                clock = clock.max(e.end);
            }
            if makespan - clock > eps {
                out.push(idle(rank, clock, makespan));
            }
        }
        out
    }
}

/// The trace category of an action.
fn category(action: Action) -> &'static str {
    match action {
        Action::Forward { .. } => CATEGORY_FORWARD,
        Action::Recompute { .. } => CATEGORY_RECOMPUTE,
        Action::Backward { .. } => CATEGORY_BACKWARD,
        Action::BackwardWeight { .. } => CATEGORY_WEIGHT,
        Action::SendActivation { .. } | Action::SendGrad { .. } => CATEGORY_SEND,
        Action::RecvActivation { .. } | Action::RecvGrad { .. } => CATEGORY_RECV,
        Action::ForwardBackward { .. } => CATEGORY_PAIR,
        Action::OptimizerStep => CATEGORY_OPTIMIZER,
    }
}

/// The most actions [`simulate`] runs at once (all steps together).
pub const MAX_SIMULATED_ACTIONS: usize = 1 << 24;

/// Simulates `steps` training steps of `s` with `costs` (see the [module docs](self)). The
/// schedule is validated first; a 2BW schedule is simulated with its steps overlapping as the
/// executor runs them (built from its shape, not from its per-step lists).
pub fn simulate(s: &Schedule, costs: &Costs, steps: usize) -> Result<Simulation, ValidationError> {
    validate(s)?;
    if steps == 0 {
        return Err(ValidationError::ZeroSteps);
    }
    let stages = s.stages();
    for (field, v) in [
        ("forward", &costs.forward),
        ("backward", &costs.backward),
        ("recompute", &costs.recompute),
        ("forward_comm", &costs.forward_comm),
    ] {
        if v.len() != stages && !(field == "forward_comm" && v.is_empty()) {
            return Err(ValidationError::CostLength {
                field,
                len: v.len(),
                stages,
            });
        }
        if let Some((stage, &value)) = v
            .iter()
            .enumerate()
            .find(|(_, c)| !(**c >= 0.0 && c.is_finite()))
        {
            return Err(ValidationError::BadCost {
                field,
                stage,
                value,
            });
        }
    }
    for (field, value) in [
        ("send_activation", costs.send_activation),
        ("send_grad", costs.send_grad),
        ("optimizer", costs.optimizer),
    ] {
        if !(value >= 0.0 && value.is_finite()) {
            return Err(ValidationError::BadCost {
                field,
                stage: 0,
                value,
            });
        }
    }
    if !(0.0..=1.0).contains(&costs.weight_share) {
        return Err(ValidationError::BadCost {
            field: "weight_share",
            stage: 0,
            value: costs.weight_share,
        });
    }
    let actions: usize = s.actions.iter().map(Vec::len).sum();
    if steps.saturating_mul(actions) > MAX_SIMULATED_ACTIONS {
        return Err(ValidationError::TooManySteps {
            steps,
            actions,
            max: MAX_SIMULATED_ACTIONS,
        });
    }
    let lists = if s.kind == ScheduleKind::TwoBw {
        super::two_bw::continuous(s, steps)
    } else {
        s.actions
            .iter()
            .map(|list| {
                (0..steps)
                    .flat_map(|step| list.iter().map(move |&a| (step, a)))
                    .collect()
            })
            .collect()
    };
    let events = execute(s.kind, s.ranks, stages, &s.recompute, &lists, Some(costs))?;
    Ok(Simulation {
        ranks: s.ranks,
        steps,
        events,
    })
}

/// The time of one step of `s` in a long run: for a flushing schedule one step from an empty to
/// an empty pipeline; for [`ScheduleKind::TwoBw`], whose steps overlap, three simulated steps
/// less two (the first fills the pipeline and the last drains it).
pub fn steady_step_time(s: &Schedule, costs: &Costs) -> Result<f64, ValidationError> {
    if s.kind.flushes() {
        return Ok(simulate(s, costs, 1)?.makespan());
    }
    Ok(simulate(s, costs, 3)?.makespan() - simulate(s, costs, 2)?.makespan())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::build_schedule;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    fn unit(stages: usize) -> Costs {
        Costs::uniform(stages, 1.0, 2.0)
    }

    #[test]
    fn bad_costs_and_too_many_steps_are_refused() {
        let s = build_schedule(ScheduleKind::OneFOneB, 2, 4, 1, &[false; 2]).unwrap();
        let mut costs = unit(2);
        costs.backward[1] = f64::NAN;
        assert!(matches!(
            simulate(&s, &costs, 1),
            Err(ValidationError::BadCost {
                field: "backward",
                stage: 1,
                ..
            })
        ));
        costs.backward[1] = -1.0;
        assert!(simulate(&s, &costs, 1).is_err());
        let mut costs = unit(2);
        costs.send_grad = f64::INFINITY;
        assert!(matches!(
            simulate(&s, &costs, 1),
            Err(ValidationError::BadCost {
                field: "send_grad",
                ..
            })
        ));
        let mut costs = unit(2);
        costs.weight_share = 1.5;
        assert!(simulate(&s, &costs, 1).is_err());
        assert!(matches!(
            simulate(&s, &unit(2), usize::MAX),
            Err(ValidationError::TooManySteps { .. })
        ));
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for p in 1..=4 {
                for m in 1..=8 {
                    let s = build_schedule(kind, p, m, 1, &vec![false; p]).unwrap();
                    let sim = simulate(&s, &unit(p), 1).unwrap();
                    let expected = (p - 1) as f64 / m as f64;
                    assert!(
                        close(sim.bubble_fraction(), expected),
                        "{kind} p={p} m={m}: {} vs {expected}",
                        sim.bubble_fraction()
                    );
                    assert!(close(sim.makespan(), 3.0 * (m + p - 1) as f64));
                    assert!(close(sim.busy(0), 3.0 * m as f64));
                }
            }
        }
    }

    #[test]
    fn interleaved_bubble_is_p_minus_1_over_v_m() {
        for p in 2..=4 {
            for v in 2..=3 {
                for m in [p, 2 * p, 3 * p] {
                    let stages = p * v;
                    let s =
                        build_schedule(ScheduleKind::Interleaved, p, m, v, &vec![false; stages])
                            .unwrap();
                    let costs = Costs::uniform(stages, 1.0 / v as f64, 2.0 / v as f64);
                    let sim = simulate(&s, &costs, 1).unwrap();
                    let expected = (p - 1) as f64 / (v * m) as f64;
                    assert!(
                        close(sim.bubble_fraction(), expected),
                        "p={p} v={v} m={m}: {} vs {expected}",
                        sim.bubble_fraction()
                    );
                }
            }
        }
    }

    fn recompute_all_but_last(p: usize) -> Vec<bool> {
        (0..p).map(|s| s + 1 < p).collect()
    }

    #[test]
    fn shifted_critical_path_is_never_slower_than_1f1b() {
        let mut strictly_faster = false;
        for p in 2..=4 {
            for m in 1..=8 {
                for message in [0.0, 0.3, 1.0] {
                    let recompute = recompute_all_but_last(p);
                    let mut costs = unit(p);
                    costs.send_activation = message;
                    costs.send_grad = message;
                    let base = build_schedule(ScheduleKind::OneFOneB, p, m, 1, &recompute).unwrap();
                    let scp =
                        build_schedule(ScheduleKind::ShiftedCriticalPath, p, m, 1, &recompute)
                            .unwrap();
                    let t_base = simulate(&base, &costs, 2).unwrap().step_time();
                    let t_scp = simulate(&scp, &costs, 2).unwrap().step_time();
                    assert!(
                        t_scp <= t_base + 1e-9,
                        "p={p} m={m} message={message}: {t_scp} > {t_base}"
                    );
                    if message > 0.0 && t_scp < t_base - 1e-9 {
                        strictly_faster = true;
                    }
                }
            }
        }
        assert!(strictly_faster);

        // One case spelled out: 4 ranks, 8 micro-batches, messages of half a forward.
        let recompute = recompute_all_but_last(4);
        let mut costs = unit(4);
        costs.send_activation = 0.5;
        costs.send_grad = 0.5;
        let base = build_schedule(ScheduleKind::OneFOneB, 4, 8, 1, &recompute).unwrap();
        let scp = build_schedule(ScheduleKind::ShiftedCriticalPath, 4, 8, 1, &recompute).unwrap();
        let t_base = simulate(&base, &costs, 1).unwrap().makespan();
        let t_scp = simulate(&scp, &costs, 1).unwrap().makespan();
        assert!(t_scp < t_base, "{t_scp} vs {t_base}");
    }

    #[test]
    fn recompute_cost_goes_into_backward_without_an_explicit_recompute() {
        let s = build_schedule(ScheduleKind::GPipe, 1, 2, 1, &[true]).unwrap();
        let sim = simulate(&s, &unit(1), 1).unwrap();
        // 2 forwards of 1, 2 backwards of 2 + 1.
        assert!(close(sim.makespan(), 8.0));
        let s = build_schedule(ScheduleKind::ShiftedCriticalPath, 1, 2, 1, &[true]).unwrap();
        let sim = simulate(&s, &unit(1), 1).unwrap();
        assert!(close(sim.makespan(), 8.0));
        let recomputes = sim.events[0]
            .iter()
            .filter(|e| matches!(e.action, Action::Recompute { .. }))
            .count();
        assert_eq!(recomputes, 2);
    }

    #[test]
    fn two_bw_overlaps_the_next_warm_up_with_the_cool_down() {
        for p in 2..=4 {
            for m in [2, 4, 8] {
                let steps = 4;
                let flush =
                    build_schedule(ScheduleKind::OneFOneB, p, m, 1, &vec![false; p]).unwrap();
                let two_bw = build_schedule(ScheduleKind::TwoBw, p, m, 1, &vec![false; p]).unwrap();
                let t_flush = simulate(&flush, &unit(p), steps).unwrap().step_time();
                let sim = simulate(&two_bw, &unit(p), steps).unwrap();
                assert!(sim.step_time() < t_flush, "p={p} m={m}");
                // Each step after the first starts on the last rank with its first forward:
                // its input was sent during the previous step.
                let last = &sim.events[p - 1];
                for step in 1..steps {
                    let barrier = last
                        .iter()
                        .find(|e| e.action == Action::OptimizerStep && e.step == step - 1)
                        .unwrap()
                        .end;
                    let first = last
                        .iter()
                        .find(|e| e.step == step && matches!(e.action, Action::Forward { .. }))
                        .unwrap();
                    assert!(close(first.start, barrier), "p={p} m={m} step={step}");
                }
                for rank in 0..p {
                    let optimizer: Vec<(usize, f64)> = sim.events[rank]
                        .iter()
                        .filter(|e| e.action == Action::OptimizerStep)
                        .map(|e| (e.step, e.start))
                        .collect();
                    assert_eq!(optimizer.len(), steps);
                    for (step, (s, start)) in optimizer.iter().enumerate() {
                        // The optimizer step is a barrier: it starts at once on every rank.
                        let on_zero = sim.events[0]
                            .iter()
                            .find(|e| e.action == Action::OptimizerStep && e.step == step)
                            .unwrap()
                            .start;
                        assert_eq!(*s, step);
                        assert!(close(*start, on_zero));
                    }
                    assert!(
                        sim.events[rank]
                            .iter()
                            .all(|e| e.action.micro_batch().is_none_or(|mb| mb < m))
                    );
                }
            }
        }
    }

    #[test]
    fn flush_steps_follow_each_other() {
        let p = 4;
        let m = 8;
        let s = build_schedule(ScheduleKind::OneFOneB, p, m, 1, &vec![false; p]).unwrap();
        let one = simulate(&s, &unit(p), 1).unwrap();
        let three = simulate(&s, &unit(p), 3).unwrap();
        assert!(close(three.step_time(), one.makespan()));
        assert!(close(three.bubble_fraction(), one.bubble_fraction()));
        assert_eq!(three.events[0].len(), 3 * s.actions[0].len());
    }

    #[test]
    fn messages_cost_their_transfer_time() {
        let s = build_schedule(ScheduleKind::GPipe, 2, 1, 1, &[false; 2]).unwrap();
        let mut costs = unit(2);
        costs.send_activation = 0.5;
        costs.send_grad = 0.25;
        costs.optimizer = 0.125;
        let sim = simulate(&s, &costs, 1).unwrap();
        // F0 [0,1], transfer to 1.5, F1 [1.5,2.5], B1 [2.5,4.5], transfer to 4.75, B0 [4.75,6.75].
        assert!(close(sim.makespan(), 6.75 + 0.125));
        let recv = sim.events[1][0];
        assert_eq!(recv.action, Action::RecvActivation { mb: 0, stage: 1 });
        assert!(close(recv.start, 1.0) && close(recv.end, 1.5));
    }

    #[test]
    fn trace_events_cover_the_timeline() {
        let p = 3;
        let s = build_schedule(ScheduleKind::OneFOneB, p, 4, 1, &vec![false; p]).unwrap();
        let sim = simulate(&s, &unit(p), 1).unwrap();
        let events = sim.trace_events();
        let makespan = sim.makespan();
        for rank in 0..p {
            let mine: Vec<_> = events.iter().filter(|e| e.rank == rank).collect();
            let mut clock = 0.0;
            for e in &mine {
                assert!(
                    close(e.start_s, clock),
                    "rank {rank}: gap before {}",
                    e.name
                );
                clock = e.start_s + e.dur_s;
            }
            assert!(close(clock, makespan));
            let idle: f64 = mine
                .iter()
                .filter(|e| e.category == "idle")
                .map(|e| e.dur_s)
                .sum();
            assert!(close(idle, makespan - sim.busy(rank)));
        }
        let categories: std::collections::BTreeSet<&str> =
            events.iter().map(|e| e.category.as_str()).collect();
        for c in ["forward", "backward", "send", "recv", "optimizer", "idle"] {
            assert!(categories.contains(c), "{c}");
        }
        let json = crate::pipeline::trace::chrome_trace(&events);
        assert!(json["traceEvents"].as_array().unwrap().len() > events.len());
    }

    #[test]
    fn bad_costs_and_steps_are_rejected() {
        let s = build_schedule(ScheduleKind::OneFOneB, 2, 2, 1, &[false; 2]).unwrap();
        assert_eq!(simulate(&s, &unit(2), 0), Err(ValidationError::ZeroSteps));
        assert_eq!(
            simulate(&s, &unit(3), 1),
            Err(ValidationError::CostLength {
                field: "forward",
                len: 3,
                stages: 2
            })
        );
    }
}
