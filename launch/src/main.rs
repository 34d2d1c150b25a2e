//! `merak`: train GPT models across MPI ranks with data, tensor and pipeline parallelism.

mod admission;
mod alloc;
mod config;
mod data;
mod describe;
mod export;
mod generate;
mod generate_cmd;
mod init_from;
mod model_params;
#[cfg(test)]
mod parsers_never_panic;
mod plan_cmd;
mod plot;
mod prepare_data;
mod probe;
mod reference;
mod resolve;
mod spawn;
mod train;
mod train_args;
mod train_cmd;
mod transport;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

use clap::{Parser, Subcommand};
use merak_burn::comm::{MpiWorld, launched_by_mpirun};

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
    Train(train_cmd::TrainArgs),
    /// List the model presets with their parameter counts.
    Models,
    /// Tokenize text files into a data set for `data.kind = "tokens"`.
    PrepareData(prepare_data::PrepareArgs),
    /// Write a GPT checkpoint as one Hugging Face GPT-2 safetensors file (+ config.json).
    Export(export::ExportArgs),
    /// Continue a prompt with a GPT checkpoint.
    Generate(generate_cmd::GenerateArgs),
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
    /// Print the built-in default config as TOML (generates the book's config reference).
    #[command(hide = true)]
    ConfigReference,
}

#[derive(clap::Args, Debug)]
struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, shifted-critical-path, 2bw, zb-h1, zb-v or dualpipev.
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
    /// Simulated transfer time of one message (activation or gradient) relative to a forward
    /// pass (0: free messages).
    #[arg(long, default_value_t = 0.0)]
    message_cost: f64,
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
    // ZB-V always runs two stages per rank.
    let virtual_stages = if kind.v_shaped() { 2 } else { a.virtual_stages };
    if let Some(path) = &a.trace {
        output_file(path, "--trace")?;
    }
    let stages = a.pp * virtual_stages;
    let recompute: Vec<bool> = (0..stages).map(|s| a.recompute && s + 1 < stages).collect();
    let schedule = build_schedule(kind, a.pp, a.micro_batches, virtual_stages, &recompute)?;
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
        if kind == ScheduleKind::TwoBw {
            print_two_bw_middle(&schedule);
        }
    }
    let v = virtual_stages as f64;
    let mut costs = Costs::uniform(stages, 1.0 / v, a.backward_ratio / v);
    if !a.recompute {
        costs.recompute = vec![0.0; stages];
    }
    costs.send_activation = a.message_cost / v;
    costs.send_grad = a.message_cost / v;
    let sim = simulate(&schedule, &costs, a.steps)?;
    let one_f_one_b = (a.pp as f64 - 1.0) / (v * a.micro_batches as f64);
    // B and W each take `weight_share` of the backward: ZB-H1's tail idles F + B - W.
    let (f, w) = (1.0, a.backward_ratio * costs.weight_share);
    let zb_h1 = (a.pp as f64 - 1.0) / a.micro_batches as f64 * (f + a.backward_ratio - 2.0 * w)
        / (f + a.backward_ratio);
    let formula = match kind {
        ScheduleKind::ZbV | ScheduleKind::DualPipeV => {
            format!("none for {kind}; zb-h1 would have {zb_h1:.4}")
        }
        ScheduleKind::ZbH1 => format!("(p-1)(F+B-W)/(m(F+B+W)) = {zb_h1:.4}"),
        ScheduleKind::TwoBw => format!(
            "(p-1)/m = {one_f_one_b:.4} in a step that drains, (p-1)B/(m(F+B)) = {:.4} in a steady step",
            one_f_one_b * a.backward_ratio / (1.0 + a.backward_ratio)
        ),
        _ => format!("(p-1)/(v*m) = {one_f_one_b:.4}"),
    };
    println!(
        "simulated (forward 1, backward {}, message {}): step time {:.3}, bubble {:.4} (formula {formula})",
        a.backward_ratio,
        a.message_cost,
        sim.step_time(),
        sim.bubble_fraction()
    );
    if kind == ScheduleKind::TwoBw {
        println!(
            "2bw steady step (3 overlapping steps less 2): {:.3}",
            merak_burn::pipeline::steady_step_time(&schedule, &costs)?
        );
    }
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

/// Prints each rank's 2BW list for a step between two others: the next step's warm-up forwards
/// run before this step's last backwards.
fn print_two_bw_middle(schedule: &merak_burn::pipeline::Schedule) {
    let m = schedule.micro_batches;
    println!("a step between two others (next: marks the next step's micro-batches):");
    for r in 0..schedule.ranks {
        let text: Vec<String> = merak_burn::pipeline::two_bw::segment(schedule, r, true, true)
            .into_iter()
            .map(|a| match a.micro_batch() {
                Some(mb) if mb >= m => format!("next:{}", a.with_micro_batch(mb - m)),
                _ => a.to_string(),
            })
            .collect();
        println!("rank {r}: {} OptimizerStep", text.join(" "));
    }
}

fn main() -> ExitCode {
    alloc::keep_freed_memory();
    let cli = Cli::parse();
    match cli.command {
        Command::Models => {
            list_models();
            ExitCode::SUCCESS
        }
        Command::Train(args) => train_cmd::run_train(args),
        Command::Export(a) => report(export::export(&a)),
        Command::Generate(a) => report(generate_cmd::generate(&a)),
        Command::Schedule(a) => report(run_schedule(&a)),
        Command::Plan(a) => report(plan_cmd::plan(&a)),
        Command::Simulate(a) => report(plan_cmd::simulate(&a)),
        Command::Probe(a) => with_mpi(|w| probe::probe(&a, w.map(|w| w.world()).as_ref())),
        Command::Profile(a) => with_mpi(|w| probe::profile(&a, w)),
        Command::PrepareData(a) => prepare_data::run(&a),
        Command::ConfigReference => report(reference::print_default_config()),
    }
}

/// Checks, before any work, that the file a command's flag `flag` names can be written: not a
/// folder, its folder made and writable (the error names the flag and the path).
fn output_file(path: &std::path::Path, flag: &str) -> Result<()> {
    Ok(merak_burn::train::writable_file(path, flag, 0)?)
}

/// `merak models`: the preset table with parameter counts (all, and those a token uses: fewer
/// for a mixture of experts, whose experts the last column describes).
fn list_models() {
    println!(
        "{:<16} {:>5} {:>7} {:>6} {:>6} {:>7} {:>6} {:>16} {:>16}  experts",
        "preset", "kind", "layers", "heads", "hidden", "vocab", "seq", "parameters", "active"
    );
    for (name, s) in merak_burn::planner::PRESETS {
        let experts = s.moe.map_or_else(String::new, |m| {
            let mut text = format!("{} top-{} x {}", m.experts, m.top_k, m.expert_hidden);
            if m.shared_experts > 0 {
                text += &format!(" +{} shared", m.shared_experts);
            }
            if m.swiglu {
                text += " swiglu";
            }
            text
        });
        let line = format!(
            "{:<16} {:>5} {:>7} {:>6} {:>6} {:>7} {:>6} {:>16} {:>16}  {experts}",
            name,
            s.kind,
            s.layers,
            s.heads,
            s.hidden,
            s.vocab,
            s.seq,
            s.params(),
            s.active_params()
        );
        println!("{}", line.trim_end());
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
        Err(e) => mpi.abort(2, &describe::describe(&e)),
    }
}

/// Exit status of a single-process command: 0, or 2 with the error on stderr.
fn report(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", describe::describe(&e));
            ExitCode::from(2)
        }
    }
}

/// Logs to stderr with the rank in every line.
fn init_logging(rank: usize) {
    init_subscriber();
    // Every line carries the rank through this span, which stays entered for the whole run.
    let span = tracing::info_span!("rank", r = rank);
    std::mem::forget(span.entered());
}

/// Logging for `merak train --np`'s launcher: its lines carry `launcher` instead of a rank.
fn init_launcher_logging() {
    init_subscriber();
    std::mem::forget(tracing::info_span!("launcher").entered());
}

/// The log subscriber: `RUST_LOG` or `info`, to stderr, colours only on a terminal.
fn init_subscriber() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // Colour codes only on a terminal, not in log files or pipes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}
