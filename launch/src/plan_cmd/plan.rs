//! `merak plan`: the planner's search for a model on a cluster, and `merak train --plan auto`.

use anyhow::{Context, Result, bail};
use merak_burn::pipeline::ScheduleKind;
use merak_burn::planner::Calibration;
use merak_burn::planner::{
    HardwareSpec, MAX_SEARCH_UNITS, ModelProxy, PlanFile, SearchOptions, SearchProgress,
    SearchResult, search_calibrated, search_with_progress,
};

use super::flags::{
    Job, SequenceParallel, check_context_parallel, check_expert_parallel, check_overlaps,
    check_schedules, check_sequence_parallel,
};
use super::*;

/// Arguments of `merak plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    target: Target,
    /// Also print the Pareto set of (step time, peak memory).
    #[arg(long)]
    pareto: bool,
    /// Write the best plan as JSON here.
    #[arg(long)]
    output: Option<std::path::PathBuf>,
    /// Sub-pipelining degrees of tensor parallelism to search (comma-separated), within the
    /// hardware's `max_tp_overlap`. Default: 1,2,4 (those the hardware allows)
    #[arg(long, value_delimiter = ',')]
    tp_overlap: Option<Vec<usize>>,
    /// Pipeline schedules to search (comma-separated). Default: every schedule that trains like
    /// one process (gpipe,1f1b,interleaved,shifted-critical-path,zb-h1,zb-v,dualpipev); add `2bw` to
    /// search PipeDream-2BW, whose delayed update changes the training
    #[arg(long, value_delimiter = ',')]
    schedules: Option<Vec<ScheduleKind>>,
    /// Context-parallel degrees to search (comma-separated; each dividing --gpus, with 2 cp
    /// dividing the sequence). By default every divisor of --gpus that leaves each rank at
    /// least 2048 tokens of a sequence.
    #[arg(long, value_delimiter = ',')]
    cp: Vec<usize>,
    /// Expert-parallel degrees to search for a mixture of experts (comma-separated; each
    /// dividing the experts and --gpus, used where it divides dp x cp): only these (add 1 to
    /// compare with no expert parallelism). By default every divisor of the experts whose group
    /// fits in a node (tp x ep at most the devices per node), 1 included.
    #[arg(long, value_delimiter = ',')]
    ep: Vec<usize>,
    /// Sequence parallelism with tensor parallelism: `on` wherever it applies (the default: it
    /// never costs time in the cost model and holds less memory), `both` (with and without:
    /// twice the tensor-parallel layouts), `off`.
    #[arg(long, value_enum, value_name = "MODE")]
    sequence_parallel: Option<SequenceParallel>,
    /// The optimizer the run steps with: `adamw` (element-wise, the default) or `muon` (the
    /// blocks' matrices orthogonalized with the default 5 Newton-Schulz steps, priced with
    /// their communication)
    #[arg(long, value_enum, default_value = "adamw")]
    optimizer: PlannedOptimizer,
}

/// The optimizers `merak plan --optimizer` prices.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum PlannedOptimizer {
    /// AdamW (or another element-wise optimizer).
    Adamw,
    /// Muon at its default Newton-Schulz steps.
    Muon,
}

impl PlannedOptimizer {
    /// The cost model's view of it.
    fn cost(self) -> merak_burn::planner::OptimizerCost {
        match self {
            Self::Adamw => merak_burn::planner::OptimizerCost::ElementWise,
            Self::Muon => merak_burn::planner::OptimizerCost::Muon {
                ns_steps: merak_burn::train::OptimizerSettings::default().ns_steps,
            },
        }
    }
}

/// The search, with a progress bar on stderr when it is a terminal (shown after a second, so
/// quick searches print nothing). Ctrl-C stops it (the default SIGINT: `merak plan` holds no
/// state).
pub(super) fn search_shown(
    model: &ModelProxy,
    hw: &HardwareSpec,
    cal: Option<&Calibration>,
    options: &SearchOptions,
) -> Result<SearchResult> {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return Ok(search_calibrated(model, hw, cal, options)?);
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    if let Ok(style) = ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} ({elapsed})") {
        bar.set_style(style);
    }
    let start = std::time::Instant::now();
    let mut phase = "";
    let mut show = |p: SearchProgress| {
        if bar.is_hidden() && start.elapsed().as_secs_f64() > 1.0 {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        if p.phase != phase {
            phase = p.phase;
            bar.set_length(p.total as u64);
            bar.set_message(p.phase);
        }
        bar.set_position(p.done as u64);
    };
    let result = search_with_progress(model, hw, cal, options, &mut show);
    bar.finish_and_clear();
    Ok(result?)
}

/// `merak plan`: the fastest plan, the runner-ups and optionally the Pareto set.
pub fn plan(a: &PlanArgs) -> Result<()> {
    with_output(a.output.as_deref(), "--output", || search_and_print(a))
}

/// `merak plan` once `--output` is known to be writable.
fn search_and_print(a: &PlanArgs) -> Result<()> {
    let (shape, model, hw, cal) = resolve(&a.target, MAX_SEARCH_UNITS)?;
    let job = Job {
        shape: &shape,
        hw: &hw,
        gpus: a.target.gpus,
        model: &a.target.model,
        hardware: &a.target.hardware,
        seq_flag: a.target.seq.is_some(),
    };
    let mut options = SearchOptions::new(a.target.gpus, a.target.global_batch);
    check_context_parallel(&a.cp, &job)?;
    check_expert_parallel(&a.ep, &job)?;
    if let Some(overlaps) = &a.tp_overlap {
        check_overlaps(overlaps, &job)?;
        options.tp_overlap.clone_from(overlaps);
    }
    if let Some(schedules) = &a.schedules {
        check_schedules(schedules, &job)?;
        options.schedules.clone_from(schedules);
    }
    if let Some(mode) = a.sequence_parallel {
        check_sequence_parallel(mode, &job)?;
        options.sequence_parallel = mode.settings();
    }
    options.cp.clone_from(&a.cp);
    options.ep.clone_from(&a.ep);
    options.optimizer = a.optimizer.cost();
    options.memory_budget_bytes = a
        .target
        .memory_gib
        .map(|g| (g * (1u64 << 30) as f64) as u64);
    let t0 = std::time::Instant::now();
    let result =
        search_shown(&model, &hw, cal.as_ref(), &options).with_context(|| searched(a, &hw))?;
    let secs = t0.elapsed().as_secs_f64();
    if let Some(path) = &a.output {
        PlanFile::new(
            shape,
            &a.target.hardware,
            a.target.gpus,
            result.best.clone(),
        )
        .write(path)?;
    }
    if a.target.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
        return Ok(());
    }
    print_plans(a, &model, &shape, &result, secs);
    Ok(())
}

/// The tables of `merak plan`: the job, the best plan with its prediction, the runner-ups and
/// with `--pareto` the Pareto set.
fn print_plans(
    a: &PlanArgs,
    model: &ModelProxy,
    shape: &merak_burn::planner::TransformerShape,
    result: &SearchResult,
    secs: f64,
) {
    println!(
        "{} ({}) on {} x {}, global batch {}: {} layouts considered, {} fit, {} simulated, in {secs:.2} s",
        model.name,
        parameters(shape),
        a.target.gpus,
        a.target.hardware,
        a.target.global_batch,
        result.considered,
        result.feasible,
        result.predicted
    );
    println!("best: {}", describe(&result.best));
    print_prediction(&result.best.prediction);
    println!("runner-ups:");
    for p in &result.runner_ups {
        println!(
            "  {:>8.3} s {:>7.1} TFLOP/s {:>7.1} GiB  {}",
            p.prediction.step_time_s,
            p.prediction.tflops_per_gpu,
            gib(p.prediction.max_memory_bytes()),
            describe(p)
        );
    }
    if a.pareto {
        println!("Pareto set (step time, peak memory per device):");
        for p in &result.pareto {
            println!(
                "  {:>8.3} s {:>7.1} GiB  {}",
                p.prediction.step_time_s,
                gib(p.prediction.max_memory_bytes()),
                describe(p)
            );
        }
    }
}

/// The job and the flags that narrowed the search, for a search's error: `--model "gpt2" on
/// --gpus 8 with --global-batch 16 and --memory-gib 4, searching only --cp 2`.
fn searched(a: &PlanArgs, hw: &HardwareSpec) -> String {
    let t = &a.target;
    let memory = match t.memory_gib {
        Some(g) => format!("--memory-gib {g}"),
        None => format!(
            "the {:.1} GiB per device of --hardware {}",
            gib(hw.memory_bytes),
            t.hardware
        ),
    };
    let mut text = format!(
        "--model {:?} on --gpus {} with --global-batch {} and {memory}",
        t.model, t.gpus, t.global_batch
    );
    let list = |values: &[String]| values.join(",");
    let numbers = |values: &[usize]| list(&values.iter().map(usize::to_string).collect::<Vec<_>>());
    let mut narrowed = Vec::new();
    if !a.cp.is_empty() {
        narrowed.push(format!("--cp {}", numbers(&a.cp)));
    }
    if !a.ep.is_empty() {
        narrowed.push(format!("--ep {}", numbers(&a.ep)));
    }
    if let Some(k) = &a.tp_overlap {
        narrowed.push(format!("--tp-overlap {}", numbers(k)));
    }
    if let Some(s) = &a.schedules {
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        narrowed.push(format!("--schedules {}", list(&names)));
    }
    if let Some(mode) = a.sequence_parallel {
        narrowed.push(format!("--sequence-parallel {}", mode.name()));
    }
    if !narrowed.is_empty() {
        text += &format!(", searching only {}", narrowed.join(" "));
    }
    text
}

/// `12.34B parameters`, and for a mixture of experts `, 2.34B active` (those a token uses).
fn parameters(shape: &merak_burn::planner::TransformerShape) -> String {
    let all = format!("{:.2}B parameters", shape.params() as f64 / 1e9);
    match shape.moe {
        Some(_) => format!("{all}, {:.2}B active", shape.active_params() as f64 / 1e9),
        None => all,
    }
}

/// The config keys a plan sets.
pub const PLANNED_KEYS: [&str; 17] = [
    "train.micro_batch",
    "parallel.dp",
    "parallel.tp",
    "parallel.cp",
    "parallel.cp_attention",
    "parallel.sequence_parallel",
    "parallel.ep",
    "parallel.pp",
    "parallel.virtual_stages",
    "parallel.schedule",
    "parallel.stage_layers",
    "parallel.stage_recompute",
    "parallel.zero",
    "parallel.reduce_scatter",
    "parallel.reshard_after_forward",
    "parallel.shard",
    "parallel.tp_overlap",
];

/// `merak train --plan auto`: probes this machine with every rank of the launch (a quick
/// [`crate::probe::measure`]), reads the calibration if one is given, and searches the plans of
/// `cfg`'s model for the launched world size and global batch. Every rank computes the same
/// plan (the probe's numbers are agreed between ranks).
pub fn auto_plan(
    cfg: &crate::config::Config,
    world: Option<&merak_burn::comm::MpiCommunicator>,
    calibration: Option<&std::path::Path>,
) -> Result<PlanFile> {
    use merak_burn::comm::Communicator;
    let gpus = world.map_or(1, |w| w.size());
    let shape = cfg.shape()?;
    if shape.layers.saturating_add(2) > MAX_SEARCH_UNITS {
        bail!(
            "model.layers = {}: --plan auto searches models of at most {} layers (the planner's \
             limit of {MAX_SEARCH_UNITS} units)",
            shape.layers,
            MAX_SEARCH_UNITS - 2
        );
    }
    let hw = crate::probe::measure(world, 3)?;
    let cal = calibration
        .map(|path| Calibration::read(path, &shape))
        .transpose()?;
    let model = ModelProxy::from_shape(shape);
    let options = SearchOptions {
        optimizer: cfg.optimizer.cost(),
        ..SearchOptions::new(gpus, cfg.train.global_batch)
    };
    let result = search_calibrated(&model, &hw, cal.as_ref(), &options)
        .with_context(|| format!("planning {shape} on {gpus} ranks of this machine"))?;
    Ok(PlanFile::new(shape, &hw.name, gpus, result.best))
}
