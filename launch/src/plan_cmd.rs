//! `merak plan` and `merak simulate`: the planner on the command line (pure computation, no MPI).

use anyhow::{Context, Result, bail};
use merak_burn::pipeline::{ScheduleKind, balanced_partition, build_schedule};
use merak_burn::planner::Calibration;
use merak_burn::planner::{
    CostModel, HardwareSpec, Layout, MAX_SEARCH_UNITS, ModelProxy, Plan, PlanFile, Prediction,
    RecomputeMode, SearchOptions, SearchProgress, SearchResult, TransformerShape,
    search_calibrated, search_with_progress,
};

/// The model and machines both commands take.
#[derive(clap::Args, Debug)]
pub struct Target {
    /// A preset (`gpt-8.3b`, `gpt2`, ...) or an inline shape such as
    /// `gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200`.
    #[arg(long)]
    pub model: String,
    /// Override the model's sequence length.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Devices.
    #[arg(long)]
    pub gpus: usize,
    /// A hardware preset (a100-80g, h100-80g, local-cpu) or a TOML file.
    #[arg(long, default_value = "a100-80g")]
    pub hardware: String,
    /// Sequences per step.
    #[arg(long)]
    pub global_batch: usize,
    /// Memory budget per device in GiB (default: the device's memory).
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Measured layer times of this model from `merak profile` (used instead of FLOPs over the
    /// hardware's rate where they apply).
    #[arg(long)]
    pub calibration: Option<std::path::PathBuf>,
}

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
    /// hardware's `max_tp_overlap`.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    tp_overlap: Vec<usize>,
    /// Pipeline schedules to search (comma-separated). By default every schedule that trains
    /// like one process; add `2bw` to search PipeDream-2BW, whose delayed update changes the
    /// training.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gpipe,1f1b,interleaved,shifted-critical-path,zb-h1,zb-v"
    )]
    schedules: Vec<ScheduleKind>,
}

/// Arguments of `merak simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    #[command(flatten)]
    target: Target,
    /// The layout, e.g. `dp=32,tp=8,pp=2,v=1,mbs=4,recompute=full,schedule=1f1b,zero=0,overlap=1`.
    #[arg(long, required_unless_present = "plan", conflicts_with = "plan")]
    layout: Option<String>,
    /// A plan written by `merak plan --output` (instead of `--layout`).
    #[arg(long)]
    plan: Option<std::path::PathBuf>,
    /// Write the Chrome trace (open in Perfetto) of one predicted pipeline step here.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

/// The most units (layers + embedding + head) `merak simulate` costs: one layout, but the
/// model proxy takes about 140 bytes per unit.
const MAX_SIMULATED_UNITS: usize = 1 << 20;

/// The model, hardware and calibration of `t`, refusing (before the per-unit proxy is built)
/// a model of more than `max_units` units.
fn resolve(
    t: &Target,
    max_units: usize,
) -> Result<(
    TransformerShape,
    ModelProxy,
    HardwareSpec,
    Option<Calibration>,
)> {
    if let Some(g) = t.memory_gib
        && !(g > 0.0 && g.is_finite())
    {
        bail!("--memory-gib {g}: must be a positive number of GiB per device");
    }
    let mut shape: TransformerShape = t
        .model
        .parse()
        .with_context(|| format!("--model {:?}", t.model))?;
    if let Some(seq) = t.seq {
        shape.seq = seq;
    }
    shape
        .validate()
        .with_context(|| format!("--model {:?}", t.model))?;
    let units = shape.layers.saturating_add(2);
    if units > max_units {
        bail!(
            "--model {:?}: {units} units (layers + embedding + head), the limit is {max_units}",
            t.model
        );
    }
    let hw = HardwareSpec::load(&t.hardware)
        .with_context(|| format!("--hardware {:?}", t.hardware))?
        .with_devices(t.gpus);
    if t.gpus == 0 || t.global_batch == 0 {
        bail!("--gpus and --global-batch must be at least 1");
    }
    let cal = t
        .calibration
        .as_deref()
        .map(|path| Calibration::read(path, &shape))
        .transpose()?;
    Ok((shape, ModelProxy::from_shape(shape), hw, cal))
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// One line describing a plan.
fn describe(p: &Plan) -> String {
    let l = &p.layout;
    format!(
        "dp={} tp={} pp={} v={} mbs={} m={} {} recompute={} zero1={} overlap={}",
        l.dp,
        l.tp,
        l.pp,
        l.virtual_stages,
        l.micro_batch,
        l.micro_batches,
        l.schedule,
        p.policy,
        l.zero1,
        l.tp_overlap
    )
}

fn print_prediction(p: &Prediction) {
    println!(
        "  step time {:.3} s, {:.1} TFLOP/s per device, peak memory per stage (GiB): {}",
        p.step_time_s,
        p.tflops_per_gpu,
        p.peak_memory_bytes
            .iter()
            .map(|&b| format!("{:.1}", gib(b)))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("  breakdown:");
    for (k, v) in &p.breakdown {
        if k.ends_with("_bytes") {
            println!("    {k:<22} {:>10.2} GiB", v / (1u64 << 30) as f64);
        } else {
            println!("    {k:<22} {v:>10.4} s");
        }
    }
}

/// The search, with a progress bar on stderr when it is a terminal (shown after a second, so
/// quick searches print nothing). Ctrl-C stops it (the default SIGINT: `merak plan` holds no
/// state).
fn search_shown(
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
    if let Some(path) = &a.output {
        crate::output_file(path, "--output")?;
    }
    let (shape, model, hw, cal) = resolve(&a.target, MAX_SEARCH_UNITS)?;
    let mut options = SearchOptions::new(a.target.gpus, a.target.global_batch);
    if a.tp_overlap.contains(&0) {
        bail!("--tp-overlap: degrees must be at least 1 (1: no overlap)");
    }
    options.tp_overlap.clone_from(&a.tp_overlap);
    options.schedules.clone_from(&a.schedules);
    options.memory_budget_bytes = a
        .target
        .memory_gib
        .map(|g| (g * (1u64 << 30) as f64) as u64);
    let t0 = std::time::Instant::now();
    let result = search_shown(&model, &hw, cal.as_ref(), &options)?;
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
    println!(
        "{} ({:.2}B parameters) on {} x {}, global batch {}: {} layouts considered, {} fit, {} simulated, in {secs:.2} s",
        model.name,
        model.params() as f64 / 1e9,
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
    Ok(())
}

/// The keys of `--layout`, in the order of its help.
const LAYOUT_KEYS: [&str; 9] = [
    "dp",
    "tp",
    "pp",
    "v",
    "mbs",
    "schedule",
    "recompute",
    "zero",
    "overlap",
];

/// Splits `--layout` text into its `key=value` pairs, refusing an unknown or repeated key.
fn layout_pairs(text: &str) -> Result<Vec<(&'static str, &str)>> {
    let mut pairs: Vec<(&'static str, &str)> = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (k, val) = part
            .split_once('=')
            .with_context(|| format!("--layout: `{part}` is not key=value"))?;
        let Some(&key) = LAYOUT_KEYS.iter().find(|&&known| known == k.trim()) else {
            bail!(
                "--layout: unknown key `{}` (dp, tp, pp, v, mbs, schedule, recompute, zero, \
                 overlap)",
                k.trim()
            );
        };
        if let Some((_, first)) = pairs.iter().find(|(seen, _)| *seen == key) {
            bail!("--layout: `{key}` is given twice ({key}={first} and {key}={val})");
        }
        pairs.push((key, val.trim()));
    }
    Ok(pairs)
}

/// The number of `--layout` key `key`: `dp`, `tp`, `pp`, `v`, `mbs` and `overlap` at least 1,
/// `zero` 0 or 1.
fn layout_number(key: &str, val: &str) -> Result<usize> {
    let n = val
        .parse::<usize>()
        .with_context(|| format!("--layout: {key}={val} is not a number"))?;
    match key {
        "zero" if n > 1 => bail!("--layout: zero={n} is not a supported ZeRO stage (0 or 1)"),
        "zero" => Ok(n),
        _ if n == 0 => bail!("--layout: {key}=0 must be at least 1"),
        _ => Ok(n),
    }
}

/// Parses `key=value,...` into a layout of `model` for `global_batch` sequences on `gpus`
/// devices; every value is range-checked, as `merak train` checks `parallel.*`.
pub(crate) fn parse_layout(
    text: &str,
    model: &ModelProxy,
    gpus: usize,
    global_batch: usize,
) -> Result<Layout> {
    let (mut dp, mut tp, mut pp, mut v, mut mbs) = (1, 1, 1, 1, 1);
    let mut recompute = RecomputeMode::None;
    let mut schedule = ScheduleKind::OneFOneB;
    let mut zero1 = false;
    let mut tp_overlap = 1;
    for (key, val) in layout_pairs(text)? {
        match key {
            "schedule" => {
                schedule = val
                    .parse()
                    .with_context(|| format!("--layout: schedule={val}"))?
            }
            "recompute" => {
                recompute = match val {
                    "none" => RecomputeMode::None,
                    "selective" => RecomputeMode::Selective,
                    "full" => RecomputeMode::Full,
                    other => bail!("--layout: recompute={other} (none, selective or full)"),
                }
            }
            _ => {
                let n = layout_number(key, val)?;
                match key {
                    "dp" => dp = n,
                    "tp" => tp = n,
                    "pp" => pp = n,
                    "v" => v = n,
                    "mbs" => mbs = n,
                    "zero" => zero1 = n == 1,
                    _ => tp_overlap = n,
                }
            }
        }
    }
    check_layout_fits(model, [dp, tp, pp, v], gpus)?;
    if !global_batch.is_multiple_of(dp * mbs) {
        bail!(
            "--layout: dp * mbs = {} does not divide --global-batch {global_batch}",
            dp * mbs
        );
    }
    if let Err(tokens) = model.splits_tokens(mbs, tp_overlap) {
        bail!(
            "--layout: overlap={tp_overlap} does not divide the {tokens} tokens of a micro-batch"
        );
    }
    let stages = pp * v;
    let costs: Vec<f64> = model
        .units
        .iter()
        .map(|u| u.forward_flops + u.backward_flops)
        .collect();
    let partition = balanced_partition(&costs, stages)
        .with_context(|| format!("--layout: pp = {pp} x v = {v} stages"))?;
    Ok(Layout {
        dp,
        tp,
        pp,
        virtual_stages: v,
        micro_batch: mbs,
        micro_batches: global_batch / (dp * mbs),
        schedule,
        recompute: vec![recompute; stages],
        zero1,
        partition,
        tp_overlap,
    })
}

/// The degrees `[dp, tp, pp, v]` against the devices and the model: `dp x tp x pp = gpus`,
/// `tp` dividing the heads, at most as many stages `pp x v` as units.
fn check_layout_fits(model: &ModelProxy, [dp, tp, pp, v]: [usize; 4], gpus: usize) -> Result<()> {
    let product = dp.checked_mul(tp).and_then(|n| n.checked_mul(pp));
    if product != Some(gpus) {
        let shown = product.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
        bail!("--layout uses dp * tp * pp = {shown} devices, --gpus is {gpus}");
    }
    if !model.heads.is_multiple_of(tp) {
        bail!(
            "--layout: tp={tp} does not divide the model's {} heads",
            model.heads
        );
    }
    let units = model.num_units();
    if pp.checked_mul(v).is_none_or(|stages| stages > units) {
        bail!("--layout: pp * v = {pp} x {v} stages, more than the model's {units} units");
    }
    Ok(())
}

/// `merak simulate`: the predicted time breakdown and memory of one layout.
pub fn simulate(a: &SimulateArgs) -> Result<()> {
    if let Some(path) = &a.trace {
        crate::output_file(path, "--trace")?;
    }
    let (shape, model, hw, cal) = resolve(&a.target, MAX_SIMULATED_UNITS)?;
    let layout = match (&a.layout, &a.plan) {
        (Some(text), _) => parse_layout(text, &model, a.target.gpus, a.target.global_batch)?,
        (None, Some(path)) => {
            let file = PlanFile::read(path)?;
            file.check_job(path, &shape, a.target.gpus, a.target.global_batch)?;
            file.plan.layout
        }
        (None, None) => bail!("give --layout or --plan"),
    };
    let cm = match &cal {
        Some(c) => CostModel::new(&model, &hw).with_calibration(c),
        None => CostModel::new(&model, &hw),
    };
    let prediction = cm.predict(&layout)?;
    if let Some(path) = &a.trace {
        let flags: Vec<bool> = layout
            .recompute
            .iter()
            .map(|&m| m == RecomputeMode::Full)
            .collect();
        let schedule = build_schedule(
            layout.schedule,
            layout.pp,
            layout.micro_batches,
            layout.virtual_stages,
            &flags,
        )?;
        let sim = merak_burn::pipeline::simulate(&schedule, &cm.stage_costs(&layout)?, 1)?;
        merak_burn::pipeline::write_chrome_trace(path, &sim.trace_events())?;
        if !a.target.json {
            println!("trace of one predicted step: {}", path.display());
        }
    }
    if a.target.json {
        let json = serde_json::json!({ "layout": layout, "prediction": prediction });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!(
        "{} on {} x {}: dp={} tp={} pp={} v={} mbs={} m={} {} zero1={} overlap={}",
        model.name,
        a.target.gpus,
        a.target.hardware,
        layout.dp,
        layout.tp,
        layout.pp,
        layout.virtual_stages,
        layout.micro_batch,
        layout.micro_batches,
        layout.schedule,
        layout.zero1,
        layout.tp_overlap
    );
    print_prediction(&prediction);
    let budget = a
        .target
        .memory_gib
        .map_or(hw.memory_bytes, |g| (g * (1u64 << 30) as f64) as u64);
    if prediction.max_memory_bytes() > budget {
        println!(
            "  does NOT fit: {:.1} GiB needed, {:.1} GiB per device",
            gib(prediction.max_memory_bytes()),
            gib(budget)
        );
    }
    Ok(())
}

/// The config keys a plan sets.
pub const PLANNED_KEYS: [&str; 10] = [
    "train.micro_batch",
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "parallel.virtual_stages",
    "parallel.schedule",
    "parallel.stage_layers",
    "parallel.stage_recompute",
    "parallel.zero",
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
    let options = SearchOptions::new(gpus, cfg.train.global_batch);
    let result = search_calibrated(&model, &hw, cal.as_ref(), &options)
        .with_context(|| format!("planning {shape} on {gpus} ranks of this machine"))?;
    Ok(PlanFile::new(shape, &hw.name, gpus, result.best))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> ModelProxy {
        ModelProxy::parse("gpt2").expect("preset")
    }

    fn refused(text: &str) -> String {
        parse_layout(text, &gpt2(), 8, 8)
            .expect_err(text)
            .to_string()
    }

    #[test]
    fn a_layout_key_given_twice_is_refused_naming_it() {
        let e = refused("dp=2,dp=4,tp=2");
        assert!(
            e.contains("`dp` is given twice") && e.contains("dp=4"),
            "{e}"
        );
        let e = refused("dp=8,schedule=gpipe,schedule=1f1b");
        assert!(e.contains("`schedule` is given twice"), "{e}");
    }

    #[test]
    fn every_layout_value_is_range_checked() {
        for (text, part) in [
            (
                "dp=8,zero=5",
                "zero=5 is not a supported ZeRO stage (0 or 1)",
            ),
            ("dp=8,mbs=0", "mbs=0 must be at least 1"),
            ("dp=0", "dp=0 must be at least 1"),
            ("dp=8,v=0", "v=0 must be at least 1"),
            ("dp=4,tp=2,overlap=0", "overlap=0 must be at least 1"),
            ("dp=1,tp=8", "tp=8 does not divide the model's 12 heads"),
            ("dp=1,pp=8,v=2", "more than the model's 14 units"),
            (
                "dp=2,tp=2,pp=2,v=9223372036854775807",
                "more than the model's 14 units",
            ),
            ("dp=4611686018427387904,tp=4", "more than 2^64"),
            ("dp=4,tp=2,overlap=3", "overlap=3 does not divide"),
            ("dp=8,schedule=fast", "--layout: schedule=fast"),
            ("dp=8,speed=1", "unknown key `speed`"),
        ] {
            let e = refused(text);
            assert!(e.contains(part), "{text}: {part:?} not in {e}");
        }
        let l = parse_layout("dp=4,tp=2,zero=1,overlap=2", &gpt2(), 8, 8).expect("valid");
        assert!(l.zero1 && l.tp_overlap == 2 && l.micro_batches == 2);
    }
}
