//! `bench-vs-pytorch`: `merak train` against the same GPT and training step in PyTorch eager
//! (`benches/pytorch/gpt_train.py`), side by side in one run.
//!
//! Both sides build the same model from the same initial values (the PyTorch script
//! re-implements merak's initializer and synthetic data), train it with the same step (AdamW
//! in two groups, clipping to 1.0, warm-up then cosine decay, fp32) on one compute thread per
//! process, and write one JSON line per step. For each comparison the two run in alternating
//! repetitions (the order flips every repetition, because this machine is shared and noisy);
//! a run's speed is the median tokens/s of its steps after the warm-up steps, and the table
//! gives the medians over repetitions and the median of the paired ratios.
//!
//! Comparisons: two shapes (`tiny`: the `gpt-tiny` config; `4layer`: 4 layers, hidden 256,
//! 4 heads, sequence 128, vocabulary 8192), each on one process and on two (merak dp=2 against
//! `DistributedDataParallel` over gloo), both launched by `mpirun`. It also reports page faults
//! per step, peak resident memory, the first losses of both (they start from the same values,
//! so they agree) and the speed-up of two processes over one. `--baseline-merak` adds an
//! earlier `merak` build as a third variant (the previous version).
//!
//! `--zero 0,2,3` compares sharded data parallelism on more than one process: merak's
//! `parallel.zero = 2` and `3` against PyTorch's `fully_shard` (FSDP2, each block and the root a
//! unit) without and with `reshard_after_forward`, also over gloo, whose reduce-scatter is an
//! all-reduce underneath (so the PyTorch side measures gloo as much as FSDP). For merak it also
//! prints rank 0's counted model state (`memory.json`) next to the fp32 recipe's formula.
//!
//! `--moe` compares the mixture-of-experts version of each shape (`moe-tiny`: 4 experts of
//! width 128, `moe-4layer`: 8 experts of width 512; top-2, GELU, dropless, the Switch loss at
//! 0.01, every block's MLP replaced), against the script's MoE twin (`--moe-experts` ...: the
//! same router, top-k, gates, experts, initial values and auxiliary losses, each expert a
//! Python loop iteration over the tokens routed to it). On one process merak against PyTorch;
//! on more, merak's data parallelism with expert parallelism (`merak (ep)`: `parallel.ep` = the
//! process count, each rank holding `E / ep` experts and exchanging tokens by all-to-all) and
//! without (`merak`: ep = 1), against DDP. It adds the first auxiliary losses of both sides,
//! each rank's parameters (`memory.json`; PyTorch's counted by the script) next to the count,
//! and the share of rank 0's step time in the token all-to-alls (`moe_exchange_s`).
//!
//! ```text
//! cargo build --release -p merak-launch -p merak-benches
//! bash scripts/bench-venv.sh          # PyTorch (CPU) in .venv-bench
//! target/release/bench-vs-pytorch     # --shapes tiny,4layer --procs 1,2 --reps 3 --curve-steps 0
//! target/release/bench-vs-pytorch --shapes 4layer --procs 1,2,4 --zero 0,2,3
//! target/release/bench-vs-pytorch --moe --lr 1e-4 --min-lr 1e-5   # moe-tiny, moe-4layer
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::Value;

/// Command-line options.
#[derive(Parser, Debug)]
#[command(about = "merak train against PyTorch eager: the same GPT and step, side by side")]
struct Args {
    /// Shapes to compare: `tiny`, `4layer`, and their mixture-of-experts versions `moe-tiny`,
    /// `moe-4layer`.
    #[arg(long, value_delimiter = ',', default_value = "tiny,4layer")]
    shapes: Vec<String>,
    /// Compare the mixture-of-experts version of each of `--shapes` (`tiny` becomes
    /// `moe-tiny`): on more than one process merak also runs expert parallelism (`parallel.ep`
    /// = the process count) next to plain data parallelism.
    #[arg(long)]
    moe: bool,
    /// Process counts: 1 (one process each) and/or 2 (merak dp=2 against DDP over gloo).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    procs: Vec<usize>,
    /// Repetitions of each variant (alternating order).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Steps not counted at the start of each run.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Python with torch (default: .venv-bench/bin/python if present, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The merak binary (default: `merak` next to this benchmark).
    #[arg(long)]
    merak: Option<PathBuf>,
    /// An earlier merak build to measure as a third variant.
    #[arg(long)]
    baseline_merak: Option<PathBuf>,
    /// Also train each shape this many steps on one process with both (0: skip) and print
    /// the two loss curves side by side.
    #[arg(long, default_value_t = 0)]
    curve_steps: usize,
    /// ZeRO stages to compare on more than one process: 0 (merak's all-reduce against
    /// `DistributedDataParallel`), 2 and 3 (merak's `parallel.zero` against PyTorch's
    /// `fully_shard` without and with resharding after forward).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    zero: Vec<u8>,
    /// Peak learning rate of both sides (merak's default). At this rate the routers of
    /// `moe-4layer` collapse within about ten steps (one or two experts take every token of a
    /// layer); `--lr 1e-4 --min-lr 1e-5` keeps its routing near its initial balance.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Final learning rate of the cosine decay (merak's default).
    #[arg(long, default_value_t = 3e-4)]
    min_lr: f64,
    /// Folder for the runs' outputs.
    #[arg(long, default_value = "target/bench-vs-pytorch")]
    out: PathBuf,
}

/// A model shape and its run length.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    vocab: usize,
    layers: usize,
    heads: usize,
    hidden: usize,
    seq: usize,
    batch: usize,
    steps: usize,
    /// A mixture of experts in place of every block's MLP (`model.moe`).
    moe: Option<Moe>,
}

/// The mixture-of-experts settings of a shape (GELU experts, no shared expert, the Switch loss
/// at merak's default weight 0.01, dropless).
#[derive(Clone, Copy)]
struct Moe {
    experts: usize,
    top_k: usize,
    expert_hidden: usize,
}

const TINY: Shape = Shape {
    name: "tiny",
    vocab: 512,
    layers: 2,
    heads: 4,
    hidden: 64,
    seq: 32,
    batch: 8,
    steps: 120,
    moe: None,
};

const FOUR_LAYER: Shape = Shape {
    name: "4layer",
    vocab: 8192,
    layers: 4,
    heads: 4,
    hidden: 256,
    seq: 128,
    batch: 8,
    steps: 15,
    moe: None,
};

/// The dense shapes and their MoE versions: top-2 of `E` experts of width `2 hidden` (the
/// active expert width per token is the dense MLP's `4 hidden`, so a step computes about as
/// much as the dense shape's), `E / 2` times the dense MLP's parameters.
const SHAPES: [Shape; 4] = [
    TINY,
    FOUR_LAYER,
    Shape {
        name: "moe-tiny",
        moe: Some(Moe {
            experts: 4,
            top_k: 2,
            expert_hidden: 128,
        }),
        ..TINY
    },
    Shape {
        name: "moe-4layer",
        moe: Some(Moe {
            experts: 8,
            top_k: 2,
            expert_hidden: 512,
        }),
        ..FOUR_LAYER
    },
];

/// The warm-up steps both sides use (merak's default).
const WARMUP: &str = "10";

/// What one run measured.
#[derive(Clone, Debug)]
struct RunResult {
    tokens_per_s: f64,
    faults_per_step: f64,
    peak_rss_mib: f64,
    losses: Vec<f64>,
    /// merak's model state on rank 0 from `memory.json`: parameters, gradient buckets,
    /// optimizer state and the allocator's high-water mark, MiB.
    state_mib: Option<[f64; 4]>,
    /// The routers' auxiliary loss per step (MoE shapes).
    aux_losses: Vec<f64>,
    /// The median share of rank 0's step time spent in the expert-parallel exchanges
    /// (`moe_exchange_s / step_time_s`, merak at ep > 1).
    exchange_share: Option<f64>,
    /// Each rank's parameters, MiB (merak: `memory.json`; PyTorch: the same on every rank).
    rank_param_mib: Vec<f64>,
    /// The median over the timed steps of merak's `expert_max_load` (the most loaded expert
    /// over the mean, worst layer).
    max_load: Option<f64>,
}

/// One side of a comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Merak,
    /// merak with expert parallelism over all its processes (MoE shapes, more than one).
    MerakEp,
    Baseline,
    Torch,
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Merak => "merak",
            Variant::MerakEp => "merak (ep)",
            Variant::Baseline => "merak (baseline)",
            Variant::Torch => "PyTorch eager",
        }
    }

    /// The variant whose one-process run a run of this one scales from.
    fn one_process(self) -> Variant {
        match self {
            Variant::MerakEp => Variant::Merak,
            v => v,
        }
    }
}

/// The programs a run starts, and the learning rates both sides use.
struct Tools {
    merak: PathBuf,
    baseline: Option<PathBuf>,
    python: PathBuf,
    script: PathBuf,
    mpirun: bool,
    lr: String,
    min_lr: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let tools = tools(&args)?;
    std::fs::create_dir_all(&args.out)?;
    println!(
        "# merak train vs PyTorch eager ({}): same GPT, same initial values and data, AdamW + clip 1.0 + warm-up/cosine, fp32, one compute thread per process",
        torch_version(&tools)?
    );
    println!(
        "# {} repetitions per variant in alternating order; a run's speed is the median tokens/s of its steps after the first {}; page faults and losses from rank 0\n",
        args.reps, args.warmup
    );
    let mut one_proc: Vec<(String, Variant, f64)> = Vec::new();
    for shape in selected(&args)? {
        for &np in &args.procs {
            if np > 1 && !tools.mpirun {
                bail!("--procs {np} needs mpirun on PATH");
            }
            let stages: &[u8] = if np > 1 { &args.zero } else { &[0] };
            for &zero in stages {
                if !matches!(zero, 0 | 2 | 3) {
                    bail!("--zero {zero}: compare stage 0, 2 or 3");
                }
                if zero != 0 && shape.moe.is_some() {
                    bail!("--zero {zero}: the MoE shapes are compared without ZeRO");
                }
                let results = compare(&args, &tools, shape, np, zero)?;
                report(shape, np, zero, &results, args.warmup);
                if zero == 0 {
                    for (v, runs) in &results {
                        let mut t: Vec<f64> = runs.iter().map(|r| r.tokens_per_s).collect();
                        one_proc.push((format!("{}/{np}", shape.name), *v, median(&mut t)));
                    }
                }
            }
        }
    }
    scaling(&one_proc);
    if args.curve_steps > 0 {
        for shape in selected(&args)? {
            curves(&args, &tools, shape)?;
        }
    }
    Ok(())
}

/// The shapes `--shapes` names (their MoE versions under `--moe`), in the table's order.
fn selected(args: &Args) -> Result<Vec<&'static Shape>> {
    let names: Vec<String> = (args.shapes.iter())
        .map(|n| match args.moe && !n.starts_with("moe-") {
            true => format!("moe-{n}"),
            false => n.clone(),
        })
        .collect();
    if let Some(bad) = names.iter().find(|n| SHAPES.iter().all(|s| s.name != *n)) {
        let known: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        bail!("unknown shape {bad}: choose from {}", known.join(", "));
    }
    Ok(SHAPES
        .iter()
        .filter(|s| names.iter().any(|n| n == s.name))
        .collect())
}

/// One long run of merak and of PyTorch on one process: their losses side by side.
fn curves(args: &Args, tools: &Tools, shape: &Shape) -> Result<()> {
    let long = Shape {
        steps: args.curve_steps,
        ..*shape
    };
    let mut losses = Vec::new();
    for v in [Variant::Merak, Variant::Torch] {
        let out = args.out.join(format!(
            "{}-curve-{}",
            shape.name,
            v.label().replace(' ', "")
        ));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out)?;
        losses.push(run(tools, v, &long, 1, 0, &out, args.warmup)?.losses);
    }
    println!(
        "\n## loss curves, {}: {} steps on one process (ln V = {:.4})",
        shape.name,
        long.steps,
        (shape.vocab as f64).ln()
    );
    println!("{:>6} {:>12} {:>12}", "step", "merak", "PyTorch");
    let n = losses[0].len().min(losses[1].len());
    let every = (n / 10).max(1);
    for i in (0..n).filter(|i| i % every == 0 || *i + 1 == n) {
        println!("{:>6} {:>12.6} {:>12.6}", i + 1, losses[0][i], losses[1][i]);
    }
    Ok(())
}

fn tools(args: &Args) -> Result<Tools> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the benchmark's folder")?;
    let merak = args.merak.clone().unwrap_or_else(|| dir.join("merak"));
    if !merak.exists() {
        bail!(
            "{} not found: build it with `cargo build --release -p merak-launch`",
            merak.display()
        );
    }
    let venv = PathBuf::from(".venv-bench/bin/python");
    let python = args.python.clone().unwrap_or_else(|| {
        if venv.exists() {
            venv
        } else {
            PathBuf::from("python3")
        }
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pytorch/gpt_train.py");
    let mpirun = Command::new("mpirun").arg("--version").output().is_ok();
    Ok(Tools {
        merak,
        baseline: args.baseline_merak.clone(),
        python,
        script,
        mpirun,
        lr: args.lr.to_string(),
        min_lr: args.min_lr.to_string(),
    })
}

fn torch_version(tools: &Tools) -> Result<String> {
    let out = Command::new(&tools.python)
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()
        .with_context(|| format!("running {}", tools.python.display()))?;
    if !out.status.success() {
        bail!(
            "{} cannot import torch; run `bash scripts/bench-venv.sh` or pass --python",
            tools.python.display()
        );
    }
    Ok(format!(
        "PyTorch {}",
        String::from_utf8_lossy(&out.stdout).trim()
    ))
}

/// Runs every variant `reps` times in alternating order.
fn compare(
    args: &Args,
    tools: &Tools,
    shape: &Shape,
    np: usize,
    zero: u8,
) -> Result<Vec<(Variant, Vec<RunResult>)>> {
    let mut variants = vec![Variant::Merak, Variant::Torch];
    if shape.moe.is_some() && np > 1 {
        variants.insert(1, Variant::MerakEp);
    }
    if tools.baseline.is_some() {
        variants.push(Variant::Baseline);
    }
    let mut results: Vec<(Variant, Vec<RunResult>)> =
        variants.iter().map(|&v| (v, Vec::new())).collect();
    for rep in 0..args.reps {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        order.rotate_left(rep % variants.len());
        for i in order {
            let v = variants[i];
            let out = args.out.join(format!(
                "{}-np{np}-zero{zero}-{}-{rep}",
                shape.name,
                v.label().replace([' ', '(', ')'], "")
            ));
            let _ = std::fs::remove_dir_all(&out);
            std::fs::create_dir_all(&out)?;
            let r = run(tools, v, shape, np, zero, &out, args.warmup).with_context(|| {
                format!("{} on {} with {np} process(es)", v.label(), shape.name)
            })?;
            results[i].1.push(r);
        }
    }
    Ok(results)
}

/// The launcher: the program itself for one process, `mpirun -np N` otherwise.
fn launcher(np: usize, program: &Path) -> Command {
    if np == 1 {
        return Command::new(program);
    }
    let mut c = Command::new("mpirun");
    c.args(["-np", &np.to_string(), "--oversubscribe"])
        .arg(program);
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

fn run(
    tools: &Tools,
    v: Variant,
    shape: &Shape,
    np: usize,
    zero: u8,
    out: &Path,
    warmup: usize,
) -> Result<RunResult> {
    let mut cmd = match v {
        Variant::Merak | Variant::MerakEp | Variant::Baseline => {
            let bin = if v == Variant::Baseline {
                tools.baseline.as_ref().context("baseline binary")?
            } else {
                &tools.merak
            };
            let mut c = launcher(np, bin);
            c.arg("train");
            let sets = [
                format!("model.vocab_size={}", shape.vocab),
                format!("model.layers={}", shape.layers),
                format!("model.heads={}", shape.heads),
                format!("model.hidden={}", shape.hidden),
                format!("model.seq_len={}", shape.seq),
                format!("train.global_batch={}", shape.batch),
                format!("train.steps={}", shape.steps),
                format!("train.lr={}", tools.lr),
                format!("train.min_lr={}", tools.min_lr),
                format!("train.warmup_steps={WARMUP}"),
                format!("parallel.dp={np}"),
                format!("parallel.zero={zero}"),
                "checkpoint.at_end=false".to_string(),
            ];
            let ep = if v == Variant::MerakEp { np } else { 1 };
            for s in sets.into_iter().chain(merak_moe_sets(shape, ep)) {
                c.args(["--set", &s]);
            }
            c.arg("--out").arg(out);
            c.env("RAYON_NUM_THREADS", "1");
            c
        }
        Variant::Torch => {
            let mut c = launcher(np, &tools.python);
            c.arg(&tools.script);
            for (k, val) in [
                ("vocab", shape.vocab),
                ("layers", shape.layers),
                ("heads", shape.heads),
                ("hidden", shape.hidden),
                ("seq", shape.seq),
                ("batch", shape.batch),
                ("steps", shape.steps),
            ] {
                c.arg(format!("--{k}")).arg(val.to_string());
            }
            c.args([
                "--lr",
                &tools.lr,
                "--min-lr",
                &tools.min_lr,
                "--warmup",
                WARMUP,
            ]);
            if let Some(m) = shape.moe {
                for (k, val) in [
                    ("experts", m.experts),
                    ("top-k", m.top_k),
                    ("expert-hidden", m.expert_hidden),
                ] {
                    c.arg(format!("--moe-{k}")).arg(val.to_string());
                }
            }
            c.arg("--fsdp").arg(zero.to_string());
            c.arg("--out").arg(out.join("metrics.jsonl"));
            c.env("OMP_NUM_THREADS", "1").env("MKL_NUM_THREADS", "1");
            c.env(
                "MASTER_PORT",
                (29500 + std::process::id() % 500).to_string(),
            );
            c
        }
    };
    let output = cmd.output().context("starting the run")?;
    if !output.status.success() {
        bail!(
            "the run failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse(out, v, np, warmup)
}

/// merak's `model.moe.*` settings of `shape` (none for a dense one), with `parallel.ep`.
fn merak_moe_sets(shape: &Shape, ep: usize) -> Vec<String> {
    let Some(m) = shape.moe else {
        return Vec::new();
    };
    vec![
        format!("model.moe.experts={}", m.experts),
        format!("model.moe.top_k={}", m.top_k),
        format!("model.moe.expert_hidden={}", m.expert_hidden),
        format!("parallel.ep={ep}"),
    ]
}

/// Reads a run's `metrics.jsonl` (and merak's `memory.json`).
fn parse(out: &Path, v: Variant, np: usize, warmup: usize) -> Result<RunResult> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let records: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let steps: Vec<&Value> = records.iter().filter(|r| r.get("step").is_some()).collect();
    let field = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64);
    let mut tps: Vec<f64> = steps
        .iter()
        .skip(warmup)
        .filter_map(|r| field(r, "tokens_per_s"))
        .collect();
    let mut faults: Vec<f64> = steps
        .iter()
        .skip(warmup)
        .filter_map(|r| field(r, "minor_faults"))
        .collect();
    let losses = steps.iter().filter_map(|r| field(r, "loss")).collect();
    let aux_losses = steps.iter().filter_map(|r| field(r, "aux_loss")).collect();
    let mut shares: Vec<f64> = (steps.iter().skip(warmup))
        .filter_map(|r| Some(field(r, "moe_exchange_s")? / field(r, "step_time_s")?))
        .collect();
    let mut loads: Vec<f64> = (steps.iter().skip(warmup))
        .filter_map(|r| field(r, "expert_max_load"))
        .collect();
    let summary = |k: &str| records.iter().find_map(|r| field(r, k));
    let (peak_rss_mib, state_mib, rank_param_mib) = match v {
        Variant::Torch => (
            summary("peak_rss_mib").unwrap_or(f64::NAN),
            None,
            summary("param_mib").map_or_else(Vec::new, |p| vec![p; np]),
        ),
        _ => (
            merak_peak_rss(out).unwrap_or(f64::NAN),
            merak_state(out),
            merak_rank_params(out).unwrap_or_default(),
        ),
    };
    if tps.is_empty() {
        bail!("no timed steps in {}", out.display());
    }
    Ok(RunResult {
        tokens_per_s: median(&mut tps),
        faults_per_step: if faults.is_empty() {
            f64::NAN
        } else {
            median(&mut faults)
        },
        peak_rss_mib,
        losses,
        state_mib,
        aux_losses,
        exchange_share: (!shares.is_empty()).then(|| median(&mut shares)),
        rank_param_mib,
        max_load: (!loads.is_empty()).then(|| median(&mut loads)),
    })
}

/// The ranks' records in merak's `memory.json`.
fn memory_ranks(out: &Path) -> Option<Vec<Value>> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("memory.json")).ok()?).ok()?;
    v.get("ranks")?.as_array().cloned()
}

/// Each rank's parameters in merak's `memory.json`, MiB.
fn merak_rank_params(out: &Path) -> Option<Vec<f64>> {
    (memory_ranks(out)?.iter())
        .map(|r| r.get("param_mib").and_then(Value::as_f64))
        .collect()
}

/// Rank 0's model state in merak's `memory.json`: parameters, gradient buckets, optimizer
/// state and the allocator's high-water mark (NaN when not counted), MiB.
fn merak_state(out: &Path) -> Option<[f64; 4]> {
    let ranks = memory_ranks(out)?;
    let r = ranks.first()?;
    let f = |k: &str| r.get(k).and_then(Value::as_f64);
    let alloc = f("alloc_peak_mib").unwrap_or(f64::NAN);
    Some([f("param_mib")?, f("grad_mib")?, f("optimizer_mib")?, alloc])
}

/// The largest peak resident memory over ranks in merak's `memory.json`.
fn merak_peak_rss(out: &Path) -> Option<f64> {
    memory_ranks(out)?
        .iter()
        .filter_map(|r| r.get("peak_rss_mib").and_then(Value::as_f64))
        .reduce(f64::max)
}

fn report(
    shape: &Shape,
    np: usize,
    zero: u8,
    results: &[(Variant, Vec<RunResult>)],
    warmup: usize,
) {
    let tokens = shape.batch * shape.seq;
    println!(
        "## {}: vocab {}, {} layers, {} heads, hidden {}, seq {}, batch {} ({tokens} tokens/step); {} process(es){}; {} steps per run",
        shape.name,
        shape.vocab,
        shape.layers,
        shape.heads,
        shape.hidden,
        shape.seq,
        shape.batch,
        np,
        match (np, zero) {
            (1, _) => String::new(),
            (_, 0) if shape.moe.is_some() =>
                format!(" (merak dp={np}; merak (ep): dp={np} with ep={np}; PyTorch DDP over gloo)"),
            (_, 0) => " (merak dp, PyTorch DDP over gloo)".to_string(),
            (_, z) => format!(
                " (merak dp with parallel.zero = {z}, PyTorch fully_shard over gloo, reshard_after_forward = {})",
                z == 3
            ),
        },
        shape.steps
    );
    if let Some(m) = shape.moe {
        println!(
            "mixture of experts in every block: {} GELU experts of width {}, top-{}, dropless, Switch loss 0.01",
            m.experts, m.expert_hidden, m.top_k
        );
    }
    println!(
        "{:<18} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "variant", "tokens/s", "faults/step", "peak MiB", "first loss", "last loss"
    );
    for (v, runs) in results {
        let med =
            |f: &dyn Fn(&RunResult) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        let first = runs[0].losses.first().copied().unwrap_or(f64::NAN);
        let last = runs[0].losses.last().copied().unwrap_or(f64::NAN);
        println!(
            "{:<18} {:>10.0} {:>12.0} {:>12.0} {:>12.6} {:>12.6}",
            v.label(),
            med(&|r| r.tokens_per_s),
            med(&|r| r.faults_per_step),
            med(&|r| r.peak_rss_mib),
            first,
            last
        );
    }
    let get = |v: Variant| results.iter().find(|(x, _)| *x == v).map(|(_, r)| r);
    if let Some(state) = get(Variant::Merak).and_then(|m| m[0].state_mib) {
        println!("{}", state_line(shape, np, zero, state));
    }
    let first = warmup.max(3);
    if let (Some(m), Some(t)) = (get(Variant::Merak), get(Variant::Torch)) {
        let lnv = (shape.vocab as f64).ln();
        println!(
            "merak / PyTorch tokens/s: {:.3} (median of paired repetitions); ln V = {lnv:.4}; largest |loss difference| over the first {first} steps: {:.2e}",
            paired(m, t),
            largest_difference(&m[0].losses, &t[0].losses, first)
        );
    }
    for (a, b, what) in [
        (Variant::MerakEp, Variant::Torch, "merak (ep) / PyTorch"),
        (Variant::MerakEp, Variant::Merak, "merak (ep) / merak"),
        (Variant::Merak, Variant::Baseline, "merak / baseline"),
    ] {
        if let (Some(x), Some(y)) = (get(a), get(b)) {
            println!("{what} tokens/s: {:.3}", paired(x, y));
        }
    }
    if let Some(m) = shape.moe {
        moe_report(shape, m, np, results, first);
    }
    println!();
}

/// The median over repetitions of `a`'s tokens/s over `b`'s, paired by repetition.
fn paired(a: &[RunResult], b: &[RunResult]) -> f64 {
    let mut r: Vec<f64> = (a.iter().zip(b))
        .map(|(x, y)| x.tokens_per_s / y.tokens_per_s)
        .collect();
    median(&mut r)
}

/// The largest `|a_i - b_i|` over the first `n` values.
fn largest_difference(a: &[f64], b: &[f64], n: usize) -> f64 {
    (a.iter().zip(b).take(n))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The MoE lines of a comparison: the auxiliary losses of merak and PyTorch, each variant's
/// parameters per rank next to the count (expert parameters split over the ep ranks), and the
/// share of the step in the expert-parallel exchanges.
fn moe_report(
    shape: &Shape,
    m: Moe,
    np: usize,
    results: &[(Variant, Vec<RunResult>)],
    first: usize,
) {
    let get = |v: Variant| results.iter().find(|(x, _)| *x == v).map(|(_, r)| r);
    if let (Some(a), Some(b)) = (get(Variant::Merak), get(Variant::Torch)) {
        let (x, y) = (&a[0].aux_losses, &b[0].aux_losses);
        println!(
            "auxiliary loss at step 1: merak {:.9}, PyTorch {:.9}; largest |difference| over the first {first} steps: {:.2e}",
            x.first().copied().unwrap_or(f64::NAN),
            y.first().copied().unwrap_or(f64::NAN),
            largest_difference(x, y, first)
        );
    }
    let mut load: Vec<f64> = (get(Variant::Merak).into_iter().flatten())
        .filter_map(|r| r.max_load)
        .collect();
    if !load.is_empty() {
        println!(
            "routing: the most loaded expert over the mean, worst layer, median over timed steps and repetitions: {:.2} (1: balanced; {}: every token to the same experts)",
            median(&mut load),
            m.experts / m.top_k
        );
    }
    let (dense, experts) = gpt_params(shape);
    for (v, runs) in results {
        let ep = if *v == Variant::MerakEp { np } else { 1 };
        let want = 4.0 * (dense + experts / ep) as f64 / (1u64 << 20) as f64;
        let got: Vec<String> = (runs[0].rank_param_mib.iter())
            .map(|p| format!("{p:.2}"))
            .collect();
        println!(
            "{:<18} parameters per rank, MiB: {} (count: {want:.2} = dense {:.2} + experts {:.2} / ep {ep})",
            v.label(),
            got.join(", "),
            4.0 * dense as f64 / (1u64 << 20) as f64,
            4.0 * experts as f64 / (1u64 << 20) as f64,
        );
    }
    if let Some(runs) = get(Variant::MerakEp) {
        let mut shares: Vec<f64> = runs.iter().filter_map(|r| r.exchange_share).collect();
        if !shares.is_empty() {
            println!(
                "merak (ep): {:.1}% of rank 0's step time in the token all-to-alls (moe_exchange_s / step_time_s, median over steps and repetitions; waiting for the other ranks included); {} experts per rank",
                100.0 * median(&mut shares),
                m.experts / np
            );
        }
    }
}

/// merak's counted model state on rank 0 next to the fp32 recipe's formula (f32 parameters,
/// gradients and two AdamW moments over `P` parameters: `4P`, `4P`, `8P` bytes; ZeRO-2 holds
/// `8P/d` of the moments and the whole gradient buckets during the step, ZeRO-3 also `4P/d`
/// of the parameters).
fn state_line(shape: &Shape, np: usize, zero: u8, [p, g, o, alloc]: [f64; 4]) -> String {
    let (dense, experts) = gpt_params(shape);
    let params = (dense + experts) as f64 / (1u64 << 20) as f64;
    let d = np as f64;
    let want = match zero {
        0 => [4.0, 4.0, 8.0],
        2 => [4.0, 4.0, 8.0 / d],
        _ => [4.0 / d, 4.0, 8.0 / d],
    }
    .map(|bytes| bytes * params);
    format!(
        "merak rank 0 state (counted / formula), MiB: parameters {p:.2} / {:.2}, gradient buckets {g:.2} / {:.2}, AdamW state {o:.2} / {:.2}; allocator high-water mark {alloc:.1}",
        want[0], want[1], want[2]
    )
}

/// The parameters of merak's GPT of `shape` (tied head; biases on every linear layer and
/// GELU expert): the dense ones (the routers' among them) and the routed experts'.
fn gpt_params(s: &Shape) -> (usize, usize) {
    let h = s.hidden;
    let attention = 4 * h + (h * 3 * h + 3 * h) + (h * h + h);
    let (ffn, experts) = match s.moe {
        None => ((h * 4 * h + 4 * h) + (4 * h * h + h), 0),
        Some(m) => {
            let f = m.expert_hidden;
            (h * m.experts, m.experts * (h * f + f + f * h + h))
        }
    };
    let dense = s.vocab * h + s.seq * h + s.layers * (attention + ffn) + 2 * h;
    (dense, s.layers * experts)
}

/// Two processes over one, per shape and variant.
fn scaling(rows: &[(String, Variant, f64)]) {
    let mut lines = Vec::new();
    for (key, v, tps) in rows.iter().filter(|(k, _, _)| k.ends_with("/2")) {
        let base = key.trim_end_matches("/2");
        if let Some((_, _, one)) = rows
            .iter()
            .find(|(k, w, _)| k == &format!("{base}/1") && *w == v.one_process())
        {
            lines.push(format!("{base:<8} {:<18} {:.2}x", v.label(), tps / one));
        }
    }
    if !lines.is_empty() {
        println!("## two processes / one process, tokens/s (ideal 2 on 2 cores)");
        for l in lines {
            println!("{l}");
        }
    }
}
