//! Section 5 of the pipeline benchmark: DualPipeV against ZB-V at pp = 2 and m = 8 per
//! data-parallel rank, for the dense benchmark GPT on 2 ranks and for a mixture of experts
//! (4 experts, top 2, dp 2 x ep 2 x pp 2 on 4 ranks), the two schedules run in turn
//! `--rounds` times. It prints the median step times and their ratio; the simulator's ratio
//! from DualPipeV's measured pass times (free messages); per rank and step, the milliseconds
//! each schedule's ranks waited at receives (DualPipeV's pairs post theirs ahead and wait
//! after the forward); and how many weight-gradient products DualPipeV's forwards computed
//! while their all-to-alls waited.

use std::path::Path;

use anyhow::{Context, Result};
use merak_burn::pipeline::{ScheduleKind, simulate};

use super::{Args, common, measured_costs, schedule_of, step_of, step_time, train_with};

/// Micro-batches per data-parallel rank.
const M: usize = 8;

/// Runs the comparison and prints its table.
pub fn compare(a: &Args) -> Result<()> {
    println!("\n## 5. DualPipeV against ZB-V, pp = 2, m = {M} per data-parallel rank");
    println!(
        "{:<8} {:>8} {:>11} {:>8} {:>10} {:>13} {:>13} {:>6}",
        "model",
        "zb-v s",
        "dualpipev s",
        "ratio",
        "simulated",
        "zb-v wait ms",
        "dpv wait ms",
        "fills"
    );
    let moe = [
        "parallel.ep=2",
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "model.moe.expert_hidden=256",
    ];
    for (label, dp, extra) in [("dense", 1, &[][..]), ("moe ep2", 2, &moe[..])] {
        let kinds = [ScheduleKind::ZbV, ScheduleKind::DualPipeV];
        let mut times = [Vec::new(), Vec::new()];
        let mut outs = [Default::default(), Default::default()];
        for _ in 0..a.rounds.max(1) {
            for (i, kind) in kinds.into_iter().enumerate() {
                let schedule = format!("parallel.schedule={kind}");
                let sets: Vec<&str> = std::iter::once(schedule.as_str())
                    .chain(extra.iter().copied())
                    .collect();
                let name = format!("dpv-{}-{kind}", label.replace(' ', "-"));
                outs[i] = train_with(a, &name, [2, dp], M, &sets, true)?;
                times[i].push(step_time(&outs[i])?);
            }
        }
        let [zb_v, dual] = times.map(|mut t| common::median(&mut t));
        let costs = measured_costs(&outs[1], ScheduleKind::DualPipeV, 4)?;
        let sim = |kind| -> Result<f64> {
            Ok(simulate(&schedule_of(kind, 2, M, 2)?, &costs, 1)?.makespan())
        };
        let simulated = sim(ScheduleKind::DualPipeV)? / sim(ScheduleKind::ZbV)?;
        let [(zw, _), (dw, fills)] = [trace_waits(&outs[0])?, trace_waits(&outs[1])?];
        println!(
            "{label:<8} {zb_v:>8.3} {dual:>11.3} {:>8.3} {simulated:>10.3} {zw:>13.2} {dw:>13.2} {fills:>6}",
            dual / zb_v
        );
    }
    Ok(())
}

/// From a run's trace, over every step but the first: the mean milliseconds per rank and step
/// spent at receives (blocking ones, and the waits of receives posted ahead), and the
/// weight-gradient products computed while all-to-alls waited (all steps).
fn trace_waits(out: &Path) -> Result<(f64, usize)> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("trace.json"))?)?;
    let events = json["traceEvents"].as_array().context("traceEvents")?;
    let (mut wait_us, mut fills) = (0.0, 0usize);
    let mut ranks_steps = std::collections::BTreeSet::new();
    for e in events {
        let (Some(name), Some(cat), Some(dur), Some(tid)) = (
            e["name"].as_str(),
            e["cat"].as_str(),
            e["dur"].as_f64(),
            e["tid"].as_u64(),
        ) else {
            continue;
        };
        if cat == "weight" && name.contains("exchanges") {
            fills += name
                .split(": ")
                .nth(1)
                .and_then(|n| n.split(' ').next()?.parse::<usize>().ok())
                .unwrap_or(0);
        }
        let Some(step) = step_of(name).filter(|&s| s > 0) else {
            continue;
        };
        ranks_steps.insert((tid, step));
        if cat == "recv" && !name.starts_with("post ") {
            wait_us += dur;
        }
    }
    Ok((wait_us / 1e3 / ranks_steps.len().max(1) as f64, fills))
}
