//! `bench-planner-local`: the planner against measured `merak train` step times on this
//! machine (issue 5's local validation).
//!
//! 1. `mpirun -np N merak probe` writes the hardware spec and `mpirun -np N merak profile`
//!    the calibration (layer times of the model at every TP degree and micro-batch size).
//! 2. For each of a list of layouts (at least six, over dp, tp, pp, micro-batch size, schedule,
//!    recomputation and the tensor-parallel overlap degree), the cost model predicts the step time, the layout is written as a
//!    plan file, and `mpirun -np N merak train --plan FILE` runs it; the measured step time is
//!    the median over the steps after the first two.
//! 3. The planner searches the whole space with the same spec and calibration; its plan is
//!    trained too and compared with the fastest measured layout.
//!
//! Everything runs in one invocation: `--rounds` rounds over all layouts, each layout's time
//! being its fastest round (other work on a shared machine only ever adds time). Run from the workspace root after a release build:
//!
//! ```text
//! cargo build --release -p merak-launch -p merak-benches
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 target/release/bench-planner-local
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Parser;
use merak_burn::pipeline::{Recompute, ScheduleKind, balanced_partition, unit_costs_gpt};
use merak_burn::planner::{
    Calibration, CostModel, HardwareSpec, Layout, ModelProxy, Plan, PlanFile, RecomputeMode,
    SearchOptions, TransformerShape, search_calibrated,
};

/// Command-line options.
#[derive(Parser, Debug)]
#[command(about = "Predicted vs measured merak train step times for several layouts")]
struct Args {
    /// Ranks.
    #[arg(long, default_value_t = 4)]
    np: usize,
    /// Training steps per layout (the first two are not counted).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Layers of the GPT.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Vocabulary.
    #[arg(long, default_value_t = 1024)]
    vocab: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    global_batch: usize,
    /// Rounds over all layouts (each layout's fastest round counts).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Work folder.
    #[arg(long, default_value = "runs/bench-planner-local")]
    work: PathBuf,
}

/// One layout to measure: dp, tp, pp, micro-batch size, schedule, recomputation, tensor-parallel
/// overlap degree.
type Spec = (
    usize,
    usize,
    usize,
    usize,
    ScheduleKind,
    RecomputeMode,
    usize,
);

fn merak_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("merak");
    if !bin.exists() {
        bail!(
            "{} not found: build it with cargo build --release -p merak-launch",
            bin.display()
        );
    }
    Ok(bin)
}

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "-np",
        &np.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .env("RAYON_NUM_THREADS", "1");
    c
}

fn run(mut cmd: Command, what: &str) -> Result<String> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn model_sets(a: &Args) -> Vec<String> {
    [
        format!("model.layers={}", a.layers),
        format!("model.hidden={}", a.hidden),
        format!("model.heads={}", a.heads),
        format!("model.seq_len={}", a.seq),
        format!("model.vocab_size={}", a.vocab),
        "model.dropout=0.0".to_string(),
        format!("train.global_batch={}", a.global_batch),
        "data.kind=\"synthetic\"".to_string(),
        "data.val_every=0".to_string(),
        "checkpoint.at_end=false".to_string(),
        "train.sample_tokens=0".to_string(),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

/// Median step time of `merak train --plan plan` (steps after the first two).
fn measure(a: &Args, merak: &Path, plan: &Path, out: &Path) -> Result<f64> {
    let mut cmd = mpirun(a.np);
    cmd.arg(merak)
        .arg("train")
        .args(model_sets(a))
        .args(["--set", &format!("train.steps={}", a.steps), "--plan"])
        .arg(plan)
        .arg("--out")
        .arg(out);
    run(cmd, &format!("merak train --plan {}", plan.display()))?;
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut times: Vec<f64> = text
        .lines()
        .skip(2)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            v["step_time_s"].as_f64().context("step_time_s")
        })
        .collect::<Result<_>>()?;
    if times.is_empty() {
        bail!("no steps measured in {}", out.display());
    }
    Ok(median(&mut times))
}

fn describe(l: &Layout) -> String {
    let modes: Vec<&str> = l.recompute.iter().map(|m| m.as_str()).collect();
    format!(
        "dp={} tp={} pp={} mbs={} m={} {} recompute={} zero={} overlap={}",
        l.dp,
        l.tp,
        l.pp,
        l.micro_batch,
        l.micro_batches,
        l.schedule,
        modes.join("/"),
        l.zero,
        l.tp_overlap
    )
}

fn main() -> Result<()> {
    let a = Args::parse();
    let merak = merak_binary()?;
    std::fs::create_dir_all(&a.work)?;
    let shape = TransformerShape::gpt(a.layers, a.hidden, a.heads, a.seq, a.vocab);
    shape.validate()?;

    // 1. Probe and profile with the ranks of the runs.
    let hw_path = a.work.join("hardware.toml");
    let mut cmd = mpirun(a.np);
    cmd.arg(&merak).args(["probe", "--out"]).arg(&hw_path);
    print!("{}", run(cmd, "merak probe")?);
    let cal_path = a.work.join("calibration.json");
    let mut cmd = mpirun(a.np);
    cmd.arg(&merak)
        .arg("profile")
        .args(model_sets(&a))
        .args([
            "--micro-batches",
            "1,2,4,8,16",
            "--tp-overlap",
            "1,2,4",
            "--out",
        ])
        .arg(&cal_path);
    print!("{}", run(cmd, "merak profile")?);
    let hw = HardwareSpec::load(&hw_path.display().to_string())?;
    let cal = Calibration::read(&cal_path, &shape)?;
    let model = ModelProxy::from_shape(shape);
    let cm = CostModel::new(&model, &hw).with_calibration(&cal);

    // 2. The layouts, with the partition `merak train` would choose.
    use RecomputeMode::{Full, None as Keep};
    use ScheduleKind::{GPipe, OneFOneB};
    let specs: Vec<Spec> = vec![
        (4, 1, 1, 4, OneFOneB, Keep, 1),
        (4, 1, 1, 1, OneFOneB, Keep, 1),
        (2, 2, 1, 8, OneFOneB, Keep, 1),
        (2, 2, 1, 8, OneFOneB, Keep, 2),
        (1, 4, 1, 16, OneFOneB, Keep, 1),
        (1, 4, 1, 4, OneFOneB, Keep, 1),
        (1, 4, 1, 4, OneFOneB, Keep, 4),
        (2, 1, 2, 2, OneFOneB, Keep, 1),
        (2, 1, 2, 2, OneFOneB, Full, 1),
        (1, 2, 2, 4, OneFOneB, Keep, 1),
        (1, 2, 2, 4, OneFOneB, Keep, 2),
        (1, 1, 4, 2, GPipe, Keep, 1),
        (1, 1, 4, 1, OneFOneB, Keep, 1),
    ];
    let costs = unit_costs_gpt(a.layers, a.hidden, a.seq, a.vocab);
    let mut plans: Vec<Plan> = Vec::new();
    for &(dp, tp, pp, mbs, schedule, mode, tp_overlap) in &specs {
        let layout = Layout {
            dp,
            tp,
            pp,
            virtual_stages: 1,
            micro_batch: mbs,
            micro_batches: a.global_batch / dp / mbs,
            schedule,
            recompute: vec![mode; pp],
            zero: 0,
            reduce_scatter: Default::default(),
            shard: 0,
            reshard_after_forward: true,
            gradient_buffers: Default::default(),
            partition: balanced_partition(&costs, pp)?,
            tp_overlap,
            cp: 1,
            sequence_parallel: false,
            ep: 1,
        };
        let prediction = cm.predict(&layout)?;
        let policy = if mode == Full {
            Recompute::Full
        } else {
            Recompute::None
        };
        plans.push(Plan {
            layout,
            policy,
            prediction,
        });
    }
    // 3. The planner's own choice over the whole space, measured with the others.
    let mut options = SearchOptions::new(a.np, a.global_batch);
    options.micro_batch_sizes = vec![1, 2, 4, 8, 16];
    let result = search_calibrated(&model, &hw, Some(&cal), &options)?;
    plans.push(result.best);
    let choice = plans.len() - 1;
    let mut paths = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        let path = a.work.join(format!("layout-{i}.json"));
        PlanFile::new(shape, &hw.name, a.np, plan.clone()).write(&path)?;
        paths.push(path);
    }
    // Rounds over all layouts; a layout's time is its fastest round (interference from other
    // work on the machine only ever adds time).
    let mut measured = vec![f64::INFINITY; plans.len()];
    for round in 0..a.rounds {
        for (i, path) in paths.iter().enumerate() {
            // A folder per run (a run refuses another run's folder); the bench's own folders
            // of an earlier invocation are removed first.
            let out = a.work.join(format!("run-{i}-round-{round}"));
            let _ = std::fs::remove_dir_all(&out);
            let t = measure(&a, &merak, path, &out)?;
            measured[i] = measured[i].min(t);
            eprintln!("round {round} layout {i}: {:.1} ms", t * 1e3);
        }
    }
    println!();
    println!("| layout | predicted (ms) | measured (ms) | error |\n| --- | ---: | ---: | ---: |");
    let mut worst = 0.0f64;
    for (i, plan) in plans.iter().enumerate() {
        let predicted = plan.prediction.step_time_s;
        let error = predicted / measured[i] - 1.0;
        if i != choice {
            worst = worst.max(error.abs());
        }
        println!(
            "| {}{} | {:.1} | {:.1} | {:+.1}% |",
            describe(&plan.layout),
            if i == choice {
                " (planner's choice)"
            } else {
                ""
            },
            predicted * 1e3,
            measured[i] * 1e3,
            error * 100.0
        );
    }
    let fastest = (0..choice)
        .min_by(|&x, &y| measured[x].total_cmp(&measured[y]))
        .context("no layouts")?;
    println!();
    println!(
        "largest |error| over the {} listed layouts: {:.1}%",
        choice,
        worst * 100.0
    );
    println!(
        "planner's choice: {} ({}), predicted {:.1} ms, measured {:.1} ms",
        describe(&plans[choice].layout),
        plans[choice].policy,
        plans[choice].prediction.step_time_s * 1e3,
        measured[choice] * 1e3
    );
    println!(
        "fastest measured: {}, {:.1} ms; planner's choice / fastest = {:.3}",
        describe(&plans[fastest].layout),
        measured[fastest].min(measured[choice]) * 1e3,
        measured[choice] / measured[fastest].min(measured[choice])
    );
    Ok(())
}
