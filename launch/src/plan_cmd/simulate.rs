//! `merak simulate`: one layout's predicted step, and the layout strings both commands read.

use anyhow::{Context, Result, bail};
use merak_burn::data_parallel::{GradientBuffers, ReduceScatter};
use merak_burn::pipeline::{ScheduleKind, balanced_partition, build_schedule};
use merak_burn::planner::{CostModel, Layout, ModelProxy, PlanFile, RecomputeMode};

use super::*;

/// Arguments of `merak simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    #[command(flatten)]
    target: Target,
    /// The layout, e.g. `dp=32,tp=8,pp=2,v=1,mbs=4,recompute=full,schedule=1f1b,zero=0,overlap=1`
    /// (with `zero=2` or `3`, also `reduce_scatter=step` or `micro-batch`, by default
    /// `micro-batch` under ZeRO-3; with `zero=3`, `reshard=off` to gather the parameters once
    /// per step and keep them; with any zero above 0, `shard=S` for hybrid sharding; `cp=C` for context parallelism, `sp=on` for sequence
    /// parallelism, `ep=E` for expert parallelism of a mixture of experts;
    /// `gradient_buffers=auto`, `host` or `device` where merak's reducer keeps the gradients,
    /// which costs something on merak's runtimes only: `--kernels merak-cuda`, `local-cpu`, a
    /// probed spec).
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
/// model proxy takes about 140 bytes per unit (a plan file's bound).
pub(super) const MAX_SIMULATED_UNITS: usize = merak_burn::planner::MAX_PLAN_UNITS;

/// The keys of `--layout`, in the order of its help.
pub(super) const LAYOUT_KEYS: [&str; 16] = [
    "dp",
    "tp",
    "cp",
    "sp",
    "ep",
    "pp",
    "v",
    "mbs",
    "schedule",
    "recompute",
    "zero",
    "reduce_scatter",
    "reshard",
    "shard",
    "overlap",
    "gradient_buffers",
];

/// Splits `--layout` text into its `key=value` pairs, refusing an unknown or repeated key.
pub(super) fn layout_pairs(text: &str) -> Result<Vec<(&'static str, &str)>> {
    let mut pairs: Vec<(&'static str, &str)> = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (k, val) = part
            .split_once('=')
            .with_context(|| format!("--layout: `{part}` is not key=value"))?;
        let Some(&key) = LAYOUT_KEYS.iter().find(|&&known| known == k.trim()) else {
            bail!(
                "--layout: unknown key `{}` (dp, tp, cp, sp, ep, pp, v, mbs, schedule, \
                 recompute, zero, reduce_scatter, reshard, shard, overlap, gradient_buffers)",
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

/// The number of `--layout` key `key`: `dp`, `tp`, `cp`, `ep`, `pp`, `v`, `mbs`, `shard` and
/// `overlap` at least 1, `zero` 0 to 3.
pub(super) fn layout_number(key: &str, val: &str) -> Result<usize> {
    let n = val
        .parse::<usize>()
        .with_context(|| format!("--layout: {key}={val} is not a number"))?;
    match key {
        "zero" if n > 3 => bail!("--layout: zero={n} is not a supported ZeRO stage (0 to 3)"),
        "zero" => Ok(n),
        _ if n == 0 => bail!("--layout: {key}=0 must be at least 1"),
        _ => Ok(n),
    }
}

/// The values `--layout` text gives (the keys not given at their defaults), before they are
/// checked against the model and the devices.
struct LayoutValues {
    dp: usize,
    tp: usize,
    cp: usize,
    pp: usize,
    v: usize,
    mbs: usize,
    ep: usize,
    sp: bool,
    recompute: RecomputeMode,
    schedule: ScheduleKind,
    zero: u8,
    tp_overlap: usize,
    /// As given; unset: [`ReduceScatter::default_for`] the stage.
    reduce_scatter: Option<ReduceScatter>,
    reshard: bool,
    shard: usize,
    gradient_buffers: GradientBuffers,
}

/// Reads the `key=value,...` pairs of `--layout` text, refusing a value out of its key's
/// range or set; absent keys take their defaults (1, off, no recomputation, 1F1B, ZeRO 0,
/// `reduce_scatter` by the stage: `micro-batch` under ZeRO-3, else `step`; `shard=0`).
fn layout_values(text: &str) -> Result<LayoutValues> {
    let mut l = LayoutValues {
        dp: 1,
        tp: 1,
        cp: 1,
        pp: 1,
        v: 1,
        mbs: 1,
        ep: 1,
        sp: false,
        recompute: RecomputeMode::None,
        schedule: ScheduleKind::OneFOneB,
        zero: 0,
        tp_overlap: 1,
        reduce_scatter: None,
        reshard: true,
        shard: 0,
        gradient_buffers: GradientBuffers::Auto,
    };
    for (key, val) in layout_pairs(text)? {
        match key {
            "reduce_scatter" => {
                l.reduce_scatter = Some(match val {
                    "step" => ReduceScatter::Step,
                    "micro-batch" => ReduceScatter::MicroBatch,
                    other => bail!("--layout: reduce_scatter={other} (step or micro-batch)"),
                })
            }
            "gradient_buffers" => {
                l.gradient_buffers = match val {
                    "auto" => GradientBuffers::Auto,
                    "host" => GradientBuffers::Host,
                    "device" => GradientBuffers::Device,
                    other => bail!("--layout: gradient_buffers={other} (auto, host or device)"),
                }
            }
            "reshard" => {
                l.reshard = match val {
                    "on" => true,
                    "off" => false,
                    other => bail!("--layout: reshard={other} (on or off)"),
                }
            }
            "sp" => {
                l.sp = match val {
                    "on" => true,
                    "off" => false,
                    other => bail!("--layout: sp={other} (on or off)"),
                }
            }
            "schedule" => {
                l.schedule = val
                    .parse()
                    .with_context(|| format!("--layout: schedule={val}"))?
            }
            "recompute" => {
                l.recompute = match val {
                    "none" => RecomputeMode::None,
                    "selective" => RecomputeMode::Selective,
                    "full" => RecomputeMode::Full,
                    other => bail!("--layout: recompute={other} (none, selective or full)"),
                }
            }
            _ => {
                let n = layout_number(key, val)?;
                match key {
                    "dp" => l.dp = n,
                    "tp" => l.tp = n,
                    "cp" => l.cp = n,
                    "ep" => l.ep = n,
                    "pp" => l.pp = n,
                    "v" => l.v = n,
                    "mbs" => l.mbs = n,
                    "zero" => l.zero = n as u8,
                    "shard" => l.shard = n,
                    _ => l.tp_overlap = n,
                }
            }
        }
    }
    Ok(l)
}

/// Parses `key=value,...` into a layout of `model` for `global_batch` sequences on `gpus`
/// devices; every value is range-checked, as `merak train` checks `parallel.*`.
pub(crate) fn parse_layout(
    text: &str,
    model: &ModelProxy,
    gpus: usize,
    global_batch: usize,
) -> Result<Layout> {
    let LayoutValues {
        dp,
        tp,
        cp,
        pp,
        v,
        mbs,
        ep,
        sp,
        recompute,
        schedule,
        zero,
        tp_overlap,
        reduce_scatter,
        reshard,
        shard,
        gradient_buffers,
    } = layout_values(text)?;
    check_layout_fits(model, [dp, tp, cp, pp, v], gpus)?;
    let Some(sequences) = dp.checked_mul(mbs) else {
        bail!("--layout: dp * mbs = {dp} x {mbs} overflows");
    };
    if !global_batch.is_multiple_of(sequences) {
        bail!("--layout: dp * mbs = {sequences} does not divide --global-batch {global_batch}");
    }
    let stages = pp * v;
    let costs: Vec<f64> = model
        .units
        .iter()
        .map(|u| u.forward_flops + u.backward_flops)
        .collect();
    let partition = balanced_partition(&costs, stages)
        .with_context(|| format!("--layout: pp = {pp} x v = {v} stages"))?;
    let layout = Layout {
        dp,
        tp,
        pp,
        virtual_stages: v,
        micro_batch: mbs,
        micro_batches: global_batch / sequences,
        schedule,
        recompute: vec![recompute; stages],
        zero,
        reduce_scatter: reduce_scatter.unwrap_or(ReduceScatter::default_for(zero)),
        shard,
        reshard_after_forward: reshard,
        gradient_buffers,
        partition,
        tp_overlap,
        cp,
        sequence_parallel: sp,
        ep,
    };
    if let Err(mut e) = layout.check_fields(model, &layout_key) {
        if e.key == "sp" || e.key == "reshard" {
            // As `--layout` spells them.
            let on = if e.key == "sp" { sp } else { reshard };
            e.value = if on { "on" } else { "off" }.into();
        }
        bail!("--layout: {e}");
    }
    Ok(layout)
}

/// The `--layout` key of a [`Layout`] field (`micro_batches`, which `--layout` derives, as
/// the number it is).
fn layout_key(field: &'static str) -> String {
    match field {
        "virtual_stages" => "v",
        "micro_batch" => "mbs",
        "micro_batches" => "m (--global-batch / (dp x mbs))",
        "tp_overlap" => "overlap",
        "sequence_parallel" => "sp",
        "reshard_after_forward" => "reshard",
        "partition" => "the stages",
        other => other,
    }
    .to_string()
}

/// The degrees `[dp, tp, cp, pp, v]` against the devices and the model:
/// `dp x cp x tp x pp = gpus`, `tp` dividing the heads, at most as many stages `pp x v` as
/// units.
pub(super) fn check_layout_fits(
    model: &ModelProxy,
    [dp, tp, cp, pp, v]: [usize; 5],
    gpus: usize,
) -> Result<()> {
    let product = (dp.checked_mul(cp))
        .and_then(|n| n.checked_mul(tp))
        .and_then(|n| n.checked_mul(pp));
    if product != Some(gpus) {
        let shown = product.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
        bail!("--layout uses dp * cp * tp * pp = {shown} devices, --gpus is {gpus}");
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
    with_output(a.trace.as_deref(), "--trace", || simulate_checked(a))
}

/// `merak simulate` once `--trace` is known to be writable.
fn simulate_checked(a: &SimulateArgs) -> Result<()> {
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
    // --memory-gib, or the device's memory: what the prediction must fit.
    let budget = a
        .target
        .memory_gib
        .map_or(hw.memory_bytes, |g| (g * (1u64 << 30) as f64) as u64);
    let fits = prediction.max_memory_bytes() <= budget;
    if a.target.json {
        let json = serde_json::json!({
            "layout": layout,
            "prediction": prediction,
            "memory_budget_bytes": budget,
            "fits": fits,
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!(
        "{} on {} x {}: {} v={} mbs={} m={} {} {} overlap={}",
        model.name,
        a.target.gpus,
        a.target.hardware,
        degrees(&layout),
        layout.virtual_stages,
        layout.micro_batch,
        layout.micro_batches,
        layout.schedule,
        layout.zero_label(),
        layout.tp_overlap
    );
    print_prediction(&prediction);
    if !fits {
        println!(
            "  does NOT fit: {:.1} GiB needed, {:.1} GiB per device",
            gib(prediction.max_memory_bytes()),
            gib(budget)
        );
    }
    Ok(())
}
