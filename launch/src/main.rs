//! `merak`: train GPT models across MPI ranks with data, tensor and pipeline parallelism.

mod alloc;
mod config;
mod data;
mod export;
mod generate;
mod plan_cmd;
mod plot;
mod probe;
mod spawn;
mod stages;
mod tokens;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use clap::{Parser, Subcommand};
use merak_burn::comm::{MpiWorld, launched_by_mpirun};
use merak_burn::grid::{Layout, ModelShape, ProcessGrid};

/// merak: automated 3D-parallel training of GPT models on Burn, launched with mpirun.
#[derive(Parser, Debug)]
#[command(name = "merak", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model. Run under `mpirun -np N` for N ranks, or directly for one process.
    Train(TrainArgs),
    /// List the model presets with their parameter counts.
    Models,
    /// Tokenize text files into a data set for `data.kind = "tokens"`.
    PrepareData(PrepareArgs),
    /// Write a GPT checkpoint as one Hugging Face GPT-2 safetensors file (+ config.json).
    Export(export::ExportArgs),
    /// Continue a prompt with a GPT checkpoint.
    Generate(export::GenerateArgs),
    /// Build, validate and simulate a pipeline schedule; print its action lists and bubble.
    Schedule(ScheduleArgs),
    /// Find the fastest 3D layout (and the time/memory Pareto set) for a model on a cluster.
    Plan(plan_cmd::PlanArgs),
    /// Predict the step time and memory of one layout.
    Simulate(plan_cmd::SimulateArgs),
    /// Measure this machine (matrix-product rate per rank, memory bandwidth, MPI latency and
    /// bandwidth) and write a hardware spec. Run under `mpirun -np N` with the ranks you train
    /// with.
    Probe(probe::ProbeArgs),
    /// Time the embedding, a layer and the head of a model on the real backend at each
    /// tensor-parallel degree and micro-batch size, and write the calibration `merak plan
    /// --calibration` uses. Run under `mpirun -np N`.
    Profile(probe::ProfileArgs),
}

#[derive(clap::Args, Debug)]
struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, shifted-critical-path or 2bw.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Pipeline ranks.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// Model stages per rank (interleaved).
    #[arg(long, default_value_t = 1)]
    virtual_stages: usize,
    /// Recompute on every stage but the last (places the shifted-critical-path recomputation).
    #[arg(long)]
    recompute: bool,
    /// Simulated time of a backward pass relative to a forward pass.
    #[arg(long, default_value_t = 2.0)]
    backward_ratio: f64,
    /// Simulated steps.
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// Print every rank's action list.
    #[arg(long)]
    print: bool,
    /// Write the Chrome trace of the simulated run.
    #[arg(long)]
    trace: Option<PathBuf>,
}

/// `merak schedule`: the schedule as data, validated and simulated with unit costs.
fn run_schedule(a: &ScheduleArgs) -> Result<()> {
    use merak_burn::pipeline::{Costs, ScheduleKind, build_schedule, simulate, validate};
    let kind: ScheduleKind = a.schedule.parse()?;
    let stages = a.pp * a.virtual_stages;
    let recompute: Vec<bool> = (0..stages).map(|s| a.recompute && s + 1 < stages).collect();
    let schedule = build_schedule(kind, a.pp, a.micro_batches, a.virtual_stages, &recompute)?;
    validate(&schedule)?;
    println!(
        "{kind}: {} ranks, {stages} stages, {} micro-batches: valid (complete, every receive matched, no deadlock)",
        a.pp, a.micro_batches
    );
    if a.print {
        for (r, list) in schedule.actions.iter().enumerate() {
            let text: Vec<String> = list.iter().map(|x| x.to_string()).collect();
            println!("rank {r}: {}", text.join(" "));
        }
    }
    let v = a.virtual_stages as f64;
    let mut costs = Costs::uniform(stages, 1.0 / v, a.backward_ratio / v);
    if !a.recompute {
        costs.recompute = vec![0.0; stages];
    }
    let sim = simulate(&schedule, &costs, a.steps)?;
    let formula = (a.pp as f64 - 1.0) / (v * a.micro_batches as f64);
    println!(
        "simulated (forward 1, backward {}, free messages): step time {:.3}, bubble {:.4} (formula (p-1)/(v*m) = {formula:.4})",
        a.backward_ratio,
        sim.step_time(),
        sim.bubble_fraction()
    );
    for s in 0..stages {
        println!(
            "stage {s} on rank {}: at most {} micro-batches in flight",
            schedule.rank_of(s),
            schedule.max_in_flight(s)
        );
    }
    if let Some(path) = &a.trace {
        merak_burn::pipeline::write_chrome_trace(path, &sim.trace_events())?;
        println!("trace: {}", path.display());
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
struct PrepareArgs {
    /// UTF-8 text files; each becomes one document, separated by the end-of-text token.
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Output folder (train.bin, val.bin, meta.json).
    #[arg(long)]
    output: PathBuf,
    /// Tokenizer: gpt2 (GPT-2's BPE, bundled; no download).
    #[arg(long, default_value = "gpt2")]
    tokenizer: String,
    /// Fraction of the tokens held out for validation (the end of the text).
    #[arg(long, default_value_t = 0.05)]
    val_fraction: f64,
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// TOML config file; without it the built-in default (tiny GPT, synthetic data) is used.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data-parallel degree (overrides parallel.dp).
    #[arg(long)]
    dp: Option<usize>,
    /// Tensor-parallel degree (overrides parallel.tp).
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline-parallel degree (overrides parallel.pp).
    #[arg(long)]
    pp: Option<usize>,
    /// Override any config key, e.g. --set train.steps=5 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Output folder for metrics.jsonl and the resolved config.
    #[arg(long, default_value = "runs/latest")]
    out: PathBuf,
    /// Continue from a checkpoint: a `step-*` folder, or a checkpoint folder whose `latest`
    /// names one. Its config is the base (then --config's model must match it), and any
    /// dp/tp layout may load it.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write a Chrome trace (JSON, open in Perfetto) of every rank's forward, backward,
    /// send, receive and idle time.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Take the layout, partition, schedule, recomputation and micro-batch size from a plan:
    /// a file written by `merak plan --output`, or `auto` to plan for the launched world size
    /// with a quick probe of this machine (and the calibration of `--calibration`).
    #[arg(long, value_name = "FILE|auto")]
    plan: Option<String>,
    /// With `--plan auto`: a calibration written by `merak profile` for this model.
    #[arg(long, requires = "plan")]
    calibration: Option<PathBuf>,
    /// Start this many ranks on this machine (runs `mpirun -np N` with the flags a local run
    /// needs and passes every other argument through); not under mpirun.
    #[arg(long, value_name = "N")]
    np: Option<usize>,
}

fn main() -> ExitCode {
    alloc::keep_freed_memory();
    let cli = Cli::parse();
    match cli.command {
        Command::Models => {
            println!(
                "{:<14} {:>7} {:>6} {:>6} {:>7} {:>6} {:>16}",
                "preset", "layers", "heads", "hidden", "vocab", "seq", "parameters"
            );
            for (name, c) in merak_gpt::PRESETS {
                println!(
                    "{:<14} {:>7} {:>6} {:>6} {:>7} {:>6} {:>16}",
                    name,
                    c.layers,
                    c.heads,
                    c.hidden,
                    c.vocab_size,
                    c.seq_len,
                    c.num_params()
                );
            }
            ExitCode::SUCCESS
        }
        Command::Train(args) => run_train(args),
        Command::Export(a) => report(export::export(&a)),
        Command::Generate(a) => report(export::generate(&a)),
        Command::Schedule(a) => report(run_schedule(&a)),
        Command::Plan(a) => report(plan_cmd::plan(&a)),
        Command::Simulate(a) => report(plan_cmd::simulate(&a)),
        Command::Probe(a) => with_mpi(|w| probe::probe(&a, w.map(|w| w.world()).as_ref())),
        Command::Profile(a) => with_mpi(|w| probe::profile(&a, w)),
        Command::PrepareData(a) => {
            match tokens::prepare(&a.input, &a.output, &a.tokenizer, a.val_fraction) {
                Ok(m) => {
                    println!(
                        "wrote {}: {} training and {} validation tokens ({} tokenizer, vocabulary {})",
                        a.output.display(),
                        m.train_tokens,
                        m.val_tokens,
                        m.tokenizer,
                        m.vocab_size
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// Runs `f` with MPI when launched by mpirun (one thread of compute per rank), alone
/// otherwise; an error on any rank ends the whole job.
fn with_mpi(f: impl FnOnce(Option<&MpiWorld>) -> Result<()>) -> ExitCode {
    if launched_by_mpirun() && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: still single-threaded here; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    if !launched_by_mpirun() {
        return report(f(None));
    }
    let mpi = match MpiWorld::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match f(Some(&mpi)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => mpi.abort(2, &format!("{e:#}")),
    }
}

/// Exit status of a single-process command: 0, or 2 with the error on stderr.
fn report(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn init_logging(rank: usize) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
    // Every line carries the rank through this span, which stays entered for the whole run.
    let span = tracing::info_span!("rank", r = rank);
    std::mem::forget(span.entered());
}

/// Errors that every rank detects identically (config, layout): rank 0 reports, all exit 2.
fn collective_failure(rank: usize, e: &anyhow::Error) -> ExitCode {
    if rank == 0 {
        eprintln!("error: {e:#}");
    }
    ExitCode::from(2)
}

fn run_train(args: TrainArgs) -> ExitCode {
    match args.np {
        Some(np) if launched_by_mpirun() => {
            eprintln!(
                "error: --np {np} starts mpirun itself: drop --np under mpirun (mpirun -np sets the ranks)"
            );
            return ExitCode::from(2);
        }
        Some(0) => {
            eprintln!("error: --np 0: at least one rank is needed");
            return ExitCode::from(2);
        }
        Some(np) => return spawn::relaunch(np),
        None => {}
    }
    if launched_by_mpirun() && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // One compute thread per rank: ranks share the machine's cores.
        // SAFETY: still single-threaded here; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let mpi = if launched_by_mpirun() {
        match MpiWorld::init() {
            Ok(w) => Some(w),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let world = mpi.as_ref().map(|w| w.world());
    let (rank, size) = world
        .as_ref()
        .map(|w| {
            use merak_burn::comm::Communicator;
            (w.rank(), w.size())
        })
        .unwrap_or((0, 1));
    init_logging(rank);

    // A checkpoint to resume is read and verified (sizes, checksums) before anything is built.
    let resume = match args.resume.as_deref().map(open_resume).transpose() {
        Ok(r) => r,
        Err(e) => return collective_failure(rank, &e),
    };
    let auto_plan = |cfg: &config::Config| -> Result<merak_burn::planner::PlanFile> {
        plan_cmd::auto_plan(cfg, world.as_ref(), args.calibration.as_deref())
    };
    let cfg = match resolve_config(&args, size, resume.as_ref(), &auto_plan) {
        Ok((c, plan)) => {
            if let (0, Some(f)) = (rank, plan) {
                let l = &f.plan.layout;
                tracing::info!(
                    "plan: dp={} tp={} pp={} v={} micro_batch={} {} stages {:?} recompute {:?} zero1={}; predicted step {:.4} s on {}",
                    l.dp,
                    l.tp,
                    l.pp,
                    l.virtual_stages,
                    l.micro_batch,
                    l.schedule,
                    l.partition.sizes(),
                    l.recompute.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                    l.zero1,
                    f.plan.prediction.step_time_s,
                    f.hardware
                );
            }
            c
        }
        Err(e) => return collective_failure(rank, &e),
    };
    let layout = Layout {
        dp: cfg.parallel.dp,
        tp: cfg.parallel.tp,
        pp: cfg.parallel.pp,
    };
    let grid = match world {
        Some(w) => match ProcessGrid::from_mpi(w, layout) {
            Ok(g) => g,
            Err(e) => return collective_failure(rank, &e.into()),
        },
        None => ProcessGrid::single(),
    };
    // The data set is checked on every rank before anything is built.
    let data = match data::Source::open(&cfg) {
        Ok(d) => d,
        Err(e) => return collective_failure(rank, &e.into()),
    };
    if rank == 0 {
        tracing::info!("data: {}", data.describe());
    }
    let plan = match stages::build_plan(&cfg) {
        Ok(p) => p,
        Err(e) => return collective_failure(rank, &e),
    };
    let spec = train::RunSpec {
        plan: &plan,
        resume: resume.as_ref(),
        trace: args.trace.as_deref(),
    };
    let result = run(&cfg, &data, &grid, &args.out, spec);
    match (result, mpi) {
        (Ok(()), _) => ExitCode::SUCCESS,
        (Err(e), Some(mpi)) if size > 1 => mpi.abort(1, &format!("{e:#}")),
        (Err(e), _) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Builds the model of `cfg` (this rank's pipeline stages and TP shard) and trains it.
fn train_model<B>(
    cfg: &config::Config,
    data: &data::Source,
    grid: &ProcessGrid,
    out: &std::path::Path,
    device: &B::Device,
    spec: train::RunSpec<'_>,
) -> Result<train::Summary>
where
    B: burn::tensor::backend::AutodiffBackend + merak_burn::tensor_parallel::ParallelBackend,
    B::InnerBackend: merak_burn::tensor_parallel::ParallelBackend,
{
    let seed = cfg.train.seed;
    let plan = spec.plan;
    let me = grid.coords.pp;
    let holds = |unit: usize| plan.schedule.rank_of(plan.partition.stage_of(unit)) == me;
    if cfg.model.kind == "bert" {
        let bert = cfg.bert();
        let model = merak_bert::Bert::<B>::new_units(&bert, seed, grid.tp, device, &holds)?;
        let objective = train::Objective::Masked(bert);
        Ok(train::train(cfg, data, grid, out, device, model, &objective, spec)?.0)
    } else {
        let model = merak_gpt::Gpt::<B>::new_units(&cfg.model.gpt, seed, grid.tp, device, &holds)?;
        let objective = train::Objective::Causal;
        let (summary, model) = train::train(cfg, data, grid, out, device, model, &objective, spec)?;
        if cfg.train.sample_tokens > 0 {
            if grid.layout.pp > 1 {
                if grid.rank == 0 {
                    tracing::info!(
                        "no sample under pp > 1: use `merak generate --checkpoint` on the checkpoint"
                    );
                }
            } else {
                let model = burn::module::AutodiffModule::valid(&model);
                print_sample(cfg, data, grid, &model, device)?;
            }
        }
        Ok(summary)
    }
}

/// Continues the first held-out sequence's first tokens with the trained GPT and
/// prints the text (for a prepared data set) and the ids on rank 0. Every rank takes part
/// (the logits are split over the TP group).
fn print_sample<B: merak_burn::tensor_parallel::ParallelBackend>(
    cfg: &config::Config,
    data: &data::Source,
    grid: &ProcessGrid,
    model: &merak_gpt::Gpt<B>,
    device: &B::Device,
) -> Result<()> {
    let g = &cfg.model.gpt;
    let (prompt, _) = data.val_batch(0, 1, g.seq_len);
    let prompt = &prompt[..g.seq_len.min(8)];
    let new = cfg.train.sample_tokens;
    let sampling = generate::Sampling {
        temperature: cfg.train.sample_temperature,
        top_k: 40,
        seed: cfg.train.seed,
    };
    let ids = generate::generate(
        model,
        prompt,
        new,
        g.seq_len,
        g.vocab_size,
        &sampling,
        grid.tp,
        device,
    )?;
    if grid.rank == 0 {
        if let data::Source::Tokens(_) = data {
            let bpe = tiktoken_rs::r50k_base()?;
            let tokens: Vec<u32> = ids
                .iter()
                .filter_map(|&t| {
                    u32::try_from(t)
                        .ok()
                        .filter(|&t| t < tokens::GPT2_VOCAB as u32)
                })
                .collect();
            let text = String::from_utf8_lossy(&bpe.decode_bytes(&tokens)?).into_owned();
            let how = if sampling.temperature > 0.0 {
                format!("top-40 sampling at temperature {}", sampling.temperature)
            } else {
                "greedy".to_string()
            };
            println!(
                "sample ({how}, {new} tokens after a {}-token prompt):\n{text}",
                prompt.len()
            );
        }
        let ids_text = ids.iter().map(i64::to_string).collect::<Vec<_>>();
        println!("sample ids: {}", ids_text.join(","));
    }
    Ok(())
}

/// Opens and verifies the checkpoint to resume from.
fn open_resume(path: &std::path::Path) -> Result<train::Resume> {
    let checkpoint = merak_burn::checkpoint::Checkpoint::open(path)?;
    let state = checkpoint.read_full()?;
    Ok(train::Resume { checkpoint, state })
}

/// The config stored in a checkpoint's manifest.
fn checkpoint_config(r: &train::Resume) -> Result<String> {
    r.checkpoint
        .manifest
        .extra
        .get("config")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: the manifest holds no config (not written by merak train)",
                r.checkpoint.dir.display()
            )
        })
}

/// Checks that a run can continue a checkpoint: same model, batch and seed (the data position
/// and the random streams depend on them).
fn check_resumable(cfg: &config::Config, saved: &config::Config) -> Result<()> {
    let pairs = [
        (
            "model",
            format!("{:?}", (&saved.model.kind, &saved.model.gpt)),
            format!("{:?}", (&cfg.model.kind, &cfg.model.gpt)),
        ),
        (
            "train.global_batch",
            saved.train.global_batch.to_string(),
            cfg.train.global_batch.to_string(),
        ),
        (
            "train.seed",
            saved.train.seed.to_string(),
            cfg.train.seed.to_string(),
        ),
    ];
    for (key, a, b) in pairs {
        if a != b {
            bail!(
                "--resume: `{key}` is {a} in the checkpoint but {b} in this run; a resumed run must keep it"
            );
        }
    }
    Ok(())
}

/// Loads the config (the checkpoint's when resuming without --config), applies the
/// command-line degrees and checks the layout against the job.
fn resolve_config(
    args: &TrainArgs,
    world: usize,
    resume: Option<&train::Resume>,
    auto_plan: &dyn Fn(&config::Config) -> Result<merak_burn::planner::PlanFile>,
) -> Result<(config::Config, Option<merak_burn::planner::PlanFile>)> {
    let mut sets = args.sets.clone();
    for (key, v) in [("dp", args.dp), ("tp", args.tp), ("pp", args.pp)] {
        if let Some(v) = v {
            sets.push(format!("parallel.{key}={v}"));
        }
    }
    let load = |sets: &[String]| -> Result<config::Config> {
        Ok(match (resume, &args.config) {
            (Some(r), None) => {
                let text = checkpoint_config(r)?;
                let origin = r.checkpoint.dir.join("manifest.json");
                config::load_text(Some((&text, &origin.display().to_string())), sets)?
            }
            _ => config::load(args.config.as_deref(), sets)?,
        })
    };
    let mut cfg = load(&sets)?;
    let mut applied = None;
    if let Some(spec) = args.plan.as_deref() {
        if args.dp.is_some() || args.tp.is_some() || args.pp.is_some() {
            bail!("--plan {spec} sets the layout: drop --dp, --tp and --pp");
        }
        let planned = |s: &String| {
            let key = s.split_once('=').map_or(s.as_str(), |(k, _)| k).trim();
            plan_cmd::PLANNED_KEYS.contains(&key)
        };
        if let Some(s) = args.sets.iter().find(|s| planned(s)) {
            bail!("--plan {spec} sets this key: drop --set {s}");
        }
        let (path, file) = if spec == "auto" {
            (PathBuf::from("(automatic plan)"), auto_plan(&cfg)?)
        } else {
            let path = PathBuf::from(spec);
            let file = merak_burn::planner::PlanFile::read(&path)?;
            (path, file)
        };
        file.check_job(
            &path,
            &plan_cmd::shape_of(&cfg)?,
            world,
            cfg.train.global_batch,
        )?;
        file.check_runnable(&path)?;
        sets.extend(plan_cmd::plan_overrides(&file.plan));
        cfg = load(&sets).with_context(|| format!("applying the plan {}", path.display()))?;
        applied = Some(file);
    }
    if let Some(r) = resume {
        let text = checkpoint_config(r)?;
        let saved = config::load_text(Some((&text, "the checkpoint")), &[])?;
        check_resumable(&cfg, &saved)?;
    }
    let layout = Layout {
        dp: cfg.parallel.dp,
        tp: cfg.parallel.tp,
        pp: cfg.parallel.pp,
    };
    let g = &cfg.model.gpt;
    layout.validate(
        world,
        ModelShape {
            heads: g.heads,
            hidden: g.hidden,
            layers: g.layers,
        },
    )?;
    // The pipeline plan is checked here too, so that a bad schedule stops every rank at once.
    stages::build_plan(&cfg)?;
    Ok((cfg, applied))
}

fn run(
    cfg: &config::Config,
    data: &data::Source,
    grid: &ProcessGrid,
    out: &std::path::Path,
    spec: train::RunSpec<'_>,
) -> Result<()> {
    if grid.rank == 0 {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("config.toml"), toml::to_string(cfg)?)?;
    }
    // Selective recomputation is Burn's balanced checkpointing: compute-bound results (the
    // matrix products) are kept, memory-bound ones recomputed in the backward pass.
    let selective = stages::selective_on_rank(cfg, grid.coords.pp);
    let summary = match cfg.train.device.as_str() {
        "cpu" if selective => {
            type B = merak_burn::backend::CpuAutodiffSelective;
            train_model::<B>(cfg, data, grid, out, &Default::default(), spec)?
        }
        "cpu" => {
            type B = merak_burn::backend::CpuAutodiff;
            train_model::<B>(cfg, data, grid, out, &Default::default(), spec)?
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            type B = burn::backend::Autodiff<burn_cuda::Cuda<f32>>;
            train_model::<B>(cfg, data, grid, out, &burn_cuda::CudaDevice::new(0), spec)?
        }
        other => bail!(
            "train.device = {other:?} is not available in this build (rebuild with --features cuda)"
        ),
    };
    if grid.rank == 0 {
        let curve = plot::write_loss_curve(out)?;
        tracing::info!(
            "done: {} steps, final loss {:.5}, mean {:.0} tokens/s, wall {:.1}s; metrics in {}",
            summary.steps,
            summary.final_loss,
            summary.mean_tokens_per_s,
            summary.wall_s,
            out.join("metrics.jsonl").display()
        );
        tracing::info!("loss curve: {}", curve.display());
        if summary.skipped > 0 {
            tracing::warn!(
                "{} steps were skipped for a non-finite loss",
                summary.skipped
            );
        }
    }
    Ok(())
}
