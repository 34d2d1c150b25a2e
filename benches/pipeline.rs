//! Pipeline benchmark: runs `merak train` under `mpirun` for several schedules, side by side in
//! one invocation, and reports
//!
//! 1. the measured bubble of GPipe, 1F1B, interleaved 1F1B (v = 2) and ZB-H1, from `--trace`
//!    (per step and rank: (step wall time - the rank's compute time) / compute time, averaged
//!    over ranks and over every step but the first), next to the simulator's prediction for
//!    the same schedule from the measured mean forward, backward (B) and weight-gradient (W)
//!    times of each stage, and to the textbook formula;
//! 2. the step time of the shifted-critical-path schedule against 1F1B with the same (full)
//!    recomputation;
//! 3. the peak resident memory of every pipeline stage under GPipe, 1F1B and 1F1B with
//!    stage-aware recomputation (`memory.json`);
//! 4. the step time of PipeDream-2BW, whose next step's warm-up runs during this step's
//!    cool-down, against 1F1B, next to the simulator's prediction from the measured forward
//!    and backward times;
//! 5. the step time of DualPipeV against ZB-V, dense and with experts, with what its pairs
//!    overlapped ([`dual_pipe_v`]).
//!
//! Run from the repository root after `cargo build --release --workspace`:
//! `target/release/bench-pipeline` (it starts the ranks itself, through `merak train --np`,
//! which also allows running as root).

mod common;
#[path = "pipeline/dual_pipe_v.rs"]
mod dual_pipe_v;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Parser;
use merak_burn::pipeline::{
    Costs, Schedule, ScheduleKind, build_schedule, simulate, steady_step_time,
};

/// Pipeline schedules measured side by side.
#[derive(Parser, Debug)]
struct Args {
    /// Hidden size of the benchmark GPT (8 heads, 8 layers, sequence 128, vocabulary 512).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 2)]
    micro_batch: usize,
    /// Steps per run (the first is not measured).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Micro-batch counts for the bubble measurement.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    micro_batches: Vec<usize>,
    /// Which sections to run (1: bubble, 2: shifted critical path, 3: memory, 4: 2BW, 5:
    /// DualPipeV).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,5")]
    sections: Vec<usize>,
    /// Open MPI transports of the runs (`OMPI_MCA_btl`), e.g. `self,tcp` to send the pipeline's
    /// messages over loopback TCP instead of shared memory (default: Open MPI's choice).
    #[arg(long)]
    btl: Option<String>,
    /// Sections 4 and 5 run their two schedules this many times in turn and report the median
    /// step times (the runs are short and this machine is shared).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Where runs write their output.
    #[arg(long, default_value = "runs/bench-pipeline")]
    out: PathBuf,
}

/// The `merak` binary next to this one.
fn merak() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name("merak");
    if !path.exists() {
        bail!(
            "{} not found: build it with cargo build --release -p merak-launch",
            path.display()
        );
    }
    Ok(path)
}

/// Runs `merak train` on `pp` ranks (pp = dp... = 1 otherwise) with `sets`; returns its folder.
fn train(a: &Args, name: &str, pp: usize, m: usize, sets: &[&str], trace: bool) -> Result<PathBuf> {
    train_with(a, name, [pp, 1], m, sets, trace)
}

/// Runs `merak train` on `pp x dp` ranks with `m` micro-batches per data-parallel rank and
/// `sets`; returns its folder.
fn train_with(
    a: &Args,
    name: &str,
    [pp, dp]: [usize; 2],
    m: usize,
    sets: &[&str],
    trace: bool,
) -> Result<PathBuf> {
    let out = a.out.join(name);
    let _ = std::fs::remove_dir_all(&out);
    // `merak train --np` starts the ranks under mpirun with the flags a local run needs.
    let mut cmd = Command::new(merak()?);
    let (np, pp, dp) = ((pp * dp).to_string(), pp.to_string(), dp.to_string());
    cmd.arg("train")
        .args(["--np", &np, "--pp", &pp, "--dp", &dp]);
    let shape = [
        format!("model.hidden={}", a.hidden),
        "model.heads=8".into(),
        "model.layers=8".into(),
        "model.seq_len=128".into(),
        "model.vocab_size=512".into(),
        format!("train.micro_batch={}", a.micro_batch),
        format!(
            "train.global_batch={}",
            a.micro_batch * m * dp.parse::<usize>()?
        ),
        format!("train.steps={}", a.steps),
        "checkpoint.at_end=false".into(),
    ];
    for s in shape.iter().map(String::as_str).chain(sets.iter().copied()) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out").arg(&out);
    if let Some(btl) = &a.btl {
        cmd.env("OMPI_MCA_btl", btl);
    }
    if trace {
        cmd.arg("--trace").arg(out.join("trace.json"));
    }
    let o = cmd.output().context("running merak train --np")?;
    if !o.status.success() {
        bail!("{name} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(out)
}

/// Mean over ranks and over steps 2.. of (step wall - rank compute) / rank compute.
fn measured_bubble(out: &Path) -> Result<f64> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("trace.json"))?)?;
    let events = json["traceEvents"].as_array().context("traceEvents")?;
    // step -> (first start, last end, compute per rank)
    let mut steps: BTreeMap<usize, (f64, f64, BTreeMap<u64, f64>)> = BTreeMap::new();
    for e in events {
        let (Some(name), Some(cat), Some(ts), Some(dur), Some(tid)) = (
            e["name"].as_str(),
            e["cat"].as_str(),
            e["ts"].as_f64(),
            e["dur"].as_f64(),
            e["tid"].as_u64(),
        ) else {
            continue;
        };
        let Some(step) = step_of(name) else {
            continue;
        };
        let entry = steps
            .entry(step)
            .or_insert((f64::INFINITY, 0.0, BTreeMap::new()));
        entry.0 = entry.0.min(ts);
        entry.1 = entry.1.max(ts + dur);
        if matches!(cat, "forward" | "backward" | "weight" | "recompute") {
            *entry.2.entry(tid).or_insert(0.0) += dur;
        }
    }
    let mut values = Vec::new();
    for (step, (start, end, busy)) in &steps {
        if *step == 0 {
            continue;
        }
        for b in busy.values() {
            values.push((end - start - b) / b);
        }
    }
    if values.is_empty() {
        bail!("no measured steps in {}", out.display());
    }
    Ok(values.iter().sum::<f64>() / values.len() as f64)
}

/// The step of a trace event from its name's last word (`… t3`).
fn step_of(name: &str) -> Option<usize> {
    name.rsplit(' ').next()?.strip_prefix('t')?.parse().ok()
}

/// Median step time over steps 2.. (rank 0's metrics).
fn step_time(out: &Path) -> Result<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut t: Vec<f64> = text
        .lines()
        .skip(1)
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step_time_s"].as_f64())
        .collect();
    Ok(common::median(&mut t))
}

/// Peak resident MiB and micro-batches in flight per pipeline rank.
fn memory(out: &Path) -> Result<Vec<(f64, u64)>> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("memory.json"))?)?;
    Ok(json["ranks"]
        .as_array()
        .context("ranks")?
        .iter()
        .map(|r| {
            (
                r["peak_rss_mib"].as_f64().unwrap_or(0.0),
                r["max_in_flight"].as_u64().unwrap_or(0),
            )
        })
        .collect())
}

fn main() -> Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.out)?;
    println!(
        "# GPT hidden {}, 8 layers, 8 heads, seq 128, micro-batch {}, {} steps per run (first not measured), transports {}",
        a.hidden,
        a.micro_batch,
        a.steps,
        a.btl.as_deref().unwrap_or("Open MPI's default")
    );

    if a.sections.contains(&1) {
        bubble(&a)?;
    }
    if a.sections.contains(&2) {
        critical_path(&a)?;
    }
    if a.sections.contains(&3) {
        peak_memory(&a)?;
    }
    if a.sections.contains(&4) {
        two_bw(&a)?;
    }
    if a.sections.contains(&5) {
        dual_pipe_v::compare(&a)?;
    }
    Ok(())
}

fn bubble(a: &Args) -> Result<()> {
    println!("\n## 1. Bubble, pp = 2 (one rank per core)");
    println!(
        "{:<12} {:>3} {:>10} {:>10} {:>8} {:>10} {:>8}",
        "schedule", "m", "measured", "simulated", "error", "formula", "step s"
    );
    for &m in &a.micro_batches {
        for (kind, v) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZbH1, 1),
            (ScheduleKind::ZbV, 2),
        ] {
            let sets = [
                format!("parallel.schedule={kind}"),
                format!("parallel.virtual_stages={v}"),
            ];
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let out = train(a, &format!("bubble-{kind}-m{m}"), 2, m, &sets, true)?;
            let measured = measured_bubble(&out)?;
            let simulated = simulated_bubble(&out, kind, 2, m, v)?;
            // Textbook: (p-1)/(v m); ZB-H1 with F = B = W: a third of 1F1B's; ZB-V: about 0.
            let formula = match kind {
                ScheduleKind::ZbH1 => 1.0 / (3.0 * m as f64),
                ScheduleKind::ZbV => 0.0,
                _ => 1.0 / (v * m) as f64,
            };
            println!(
                "{:<12} {:>3} {:>10.3} {:>10.3} {:>7.0}% {:>10.3} {:>8.3}",
                kind.as_str(),
                m,
                measured,
                simulated,
                100.0 * (simulated - measured) / measured,
                formula,
                step_time(&out)?
            );
        }
    }
    Ok(())
}

/// Mean duration (seconds) of each trace category per global stage, over every step but the
/// first: `[category][stage]`, categories forward, backward (B), weight (W).
fn action_times(out: &Path, stages: usize) -> Result<[Vec<f64>; 3]> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("trace.json"))?)?;
    let events = json["traceEvents"].as_array().context("traceEvents")?;
    let mut sum = [vec![0.0; stages], vec![0.0; stages], vec![0.0; stages]];
    let mut count = sum.clone();
    for e in events {
        let (Some(name), Some(cat), Some(dur)) =
            (e["name"].as_str(), e["cat"].as_str(), e["dur"].as_f64())
        else {
            continue;
        };
        let Some(c) = ["forward", "backward", "weight"]
            .iter()
            .position(|k| *k == cat)
        else {
            continue;
        };
        let mut words = name.split(' ').skip(1);
        let stage = words
            .next()
            .and_then(|w| w.strip_prefix('s')?.parse::<usize>().ok());
        let step = words
            .next()
            .and_then(|w| w.strip_prefix('t')?.parse::<usize>().ok());
        if let (Some(stage), Some(step)) = (stage, step)
            && step > 0
            && stage < stages
        {
            sum[c][stage] += dur * 1e-6;
            count[c][stage] += 1.0;
        }
    }
    for (s, n) in sum.iter_mut().zip(&count) {
        for (v, n) in s.iter_mut().zip(n) {
            *v /= n.max(1.0);
        }
    }
    Ok(sum)
}

/// The simulator's bubble for `kind` with the measured mean action times of `out`, in the
/// measured bubble's terms: the mean over ranks of (makespan - busy) / busy.
fn simulated_bubble(out: &Path, kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<f64> {
    let costs = measured_costs(out, kind, p * v)?;
    let sim = simulate(&schedule_of(kind, p, m, v)?, &costs, 1)?;
    let per_rank: Vec<f64> = (0..p)
        .map(|r| (sim.makespan() - sim.busy(r)) / sim.busy(r))
        .collect();
    Ok(per_rank.iter().sum::<f64>() / p as f64)
}

/// The schedule of `kind` without recomputation.
fn schedule_of(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<Schedule> {
    Ok(build_schedule(kind, p, m, v, &vec![false; p * v])?)
}

/// The simulator's costs for `kind` from the measured mean forward, B and W times of each
/// stage in `out`'s trace (messages free): the backward is B + W, and a split backward's W
/// share the measured one.
fn measured_costs(out: &Path, kind: ScheduleKind, stages: usize) -> Result<Costs> {
    let [forward, b, w] = action_times(out, stages)?;
    let mut costs = Costs::uniform(stages, 0.0, 0.0);
    costs.forward = forward;
    costs.backward = b.iter().zip(&w).map(|(b, w)| b + w).collect();
    costs.recompute = vec![0.0; stages];
    let (bs, ws): (f64, f64) = (b.iter().sum(), w.iter().sum());
    costs.weight_share = if kind.splits_backward() {
        ws / (bs + ws)
    } else {
        0.5
    };
    Ok(costs)
}

fn two_bw(a: &Args) -> Result<()> {
    println!(
        "\n## 4. PipeDream-2BW (next step's warm-up in this step's cool-down) vs 1F1B, pp = 2"
    );
    println!(
        "{:>3} {:>10} {:>10} {:>14} {:>14}",
        "m", "1f1b s", "2bw s", "measured ratio", "simulated ratio"
    );
    for &m in &a.micro_batches {
        let (mut t1, mut t2) = (Vec::new(), Vec::new());
        let mut bw = PathBuf::new();
        for _ in 0..a.rounds.max(1) {
            let one = train(
                a,
                &format!("2bw-1f1b-m{m}"),
                2,
                m,
                &["parallel.schedule=1f1b"],
                true,
            )?;
            t1.push(step_time(&one)?);
            bw = train(
                a,
                &format!("2bw-m{m}"),
                2,
                m,
                &["parallel.schedule=2bw"],
                true,
            )?;
            t2.push(step_time(&bw)?);
        }
        let (t1, t2) = (common::median(&mut t1), common::median(&mut t2));
        // The simulator from 2BW's own F/B times; what it does not model (the reduction, the
        // optimizer) is the measured 1F1B step less its simulated one, the same in both.
        let costs = measured_costs(&bw, ScheduleKind::TwoBw, 2)?;
        let steady =
            |kind| -> Result<f64> { Ok(steady_step_time(&schedule_of(kind, 2, m, 1)?, &costs)?) };
        let (sim_one, sim_bw) = (
            steady(ScheduleKind::OneFOneB)?,
            steady(ScheduleKind::TwoBw)?,
        );
        let rest = (t1 - sim_one).max(0.0);
        println!(
            "{m:>3} {t1:>10.3} {t2:>10.3} {:>14.3} {:>14.3}",
            t2 / t1,
            (sim_bw + rest) / (sim_one + rest)
        );
    }
    Ok(())
}

fn critical_path(a: &Args) -> Result<()> {
    println!("\n## 2. Shifted critical path vs 1F1B, both with full recomputation, pp = 2, m = 8");
    let one = train(
        a,
        "full-1f1b",
        2,
        8,
        &["parallel.schedule=1f1b", "parallel.recompute=full"],
        true,
    )?;
    let scp = train(
        a,
        "full-scp",
        2,
        8,
        &[
            "parallel.schedule=shifted-critical-path",
            "parallel.recompute=full",
        ],
        true,
    )?;
    let (t1, t2) = (step_time(&one)?, step_time(&scp)?);
    println!(
        "step time: 1f1b {t1:.3}s, shifted-critical-path {t2:.3}s, ratio scp/1f1b {:.3}; bubble {:.3} vs {:.3}",
        t2 / t1,
        measured_bubble(&one)?,
        measured_bubble(&scp)?
    );
    Ok(())
}

fn peak_memory(a: &Args) -> Result<()> {
    println!(
        "\n## 3. Peak resident memory per stage (MiB; micro-batches in flight), pp = 4, m = 8"
    );
    let mut rows = Vec::new();
    for (name, sets) in [
        ("gpipe", vec!["parallel.schedule=gpipe"]),
        ("1f1b", vec!["parallel.schedule=1f1b"]),
        (
            "1f1b+stage-aware",
            vec!["parallel.schedule=1f1b", "parallel.recompute=stage-aware"],
        ),
    ] {
        let out = train(a, &format!("memory-{name}"), 4, 8, &sets, false)?;
        rows.push((name, memory(&out)?));
    }
    print!("{:<18}", "schedule");
    for s in 0..4 {
        print!(" {:>14}", format!("stage {s}"));
    }
    println!();
    for (name, mem) in rows {
        print!("{name:<18}");
        for (mib, inflight) in mem {
            print!(" {:>14}", format!("{mib:.0} ({inflight})"));
        }
        println!();
    }
    Ok(())
}
