//! `merak plan` and `merak simulate`: the planner on the command line (pure computation, no MPI).

mod flags;
mod plan;
mod simulate;
#[cfg(test)]
mod tests;

use anyhow::{Context, Result, bail};
use merak_burn::planner::Calibration;
use merak_burn::planner::{
    HardwareSpec, Kernels, ModelProxy, ModelSpecError, Plan, Prediction, TransformerShape,
};

pub use plan::{PLANNED_KEYS, PlanArgs, auto_plan, plan};
#[cfg(test)]
pub(crate) use simulate::parse_layout;
pub use simulate::{SimulateArgs, simulate};

/// The model and machines both commands take.
#[derive(clap::Args, Debug)]
pub struct Target {
    /// A preset (`gpt-8.3b`, `gpt2`, ...) or an inline shape such as
    /// `gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200`.
    #[arg(long)]
    pub model: String,
    /// Override the model's sequence length (or give it: an inline shape may then leave out
    /// `seq=`).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Devices.
    #[arg(long)]
    pub gpus: usize,
    /// A hardware preset (a100-80g, h100-80g, h200-141g, local-cpu) or a TOML file.
    #[arg(long, default_value = "a100-80g")]
    pub hardware: String,
    /// Whose kernels to predict: `spec` (the hardware's own efficiency: on the GPU presets the
    /// published Megatron runs they are fitted to) or `merak-cuda` (merak's CUDA kernels as
    /// last measured on a GPU).
    #[arg(long, default_value = "spec")]
    pub kernels: String,
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

/// The model, hardware and calibration of `t`, refusing (before the per-unit proxy is built)
/// a model of more than `max_units` units.
pub(super) fn resolve(
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
    if t.gpus == 0 {
        bail!("--gpus 0: must be at least 1");
    }
    if t.global_batch == 0 {
        bail!("--global-batch 0: must be at least 1 sequence per step");
    }
    if t.seq == Some(0) {
        bail!("--seq 0: must be at least 1 token");
    }
    let named = || match t.seq {
        Some(seq) => format!("--model {:?} with --seq {seq}", t.model),
        None => format!("--model {:?}", t.model),
    };
    let mut shape = parse_shape(&t.model, t.seq).with_context(named)?;
    if let Some(seq) = t.seq {
        shape.seq = seq;
    }
    shape.validate().with_context(named)?;
    let units = shape.layers.saturating_add(2);
    if units > max_units {
        bail!(
            "--model {:?}: {units} units (layers + embedding + head), the limit is {max_units}",
            t.model
        );
    }
    let kernels =
        Kernels::load(&t.kernels).with_context(|| format!("--kernels {:?}", t.kernels))?;
    let hw = HardwareSpec::load(&t.hardware)
        .with_context(|| format!("--hardware {:?}", t.hardware))?
        .with_devices(t.gpus);
    let hw = kernels.apply(&hw);
    let cal = t
        .calibration
        .as_deref()
        .map(|path| Calibration::read(path, &shape))
        .transpose()?;
    Ok((shape, ModelProxy::from_shape(shape), hw, cal))
}

/// Checks that the file of `flag` (when given) can be written, which makes its missing
/// folders, then runs `command`; when the command fails, the folders the check made are
/// removed again (those still empty), so that a refused command leaves nothing behind.
pub(super) fn with_output(
    path: Option<&std::path::Path>,
    flag: &str,
    command: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let Some(path) = path else {
        return command();
    };
    // The missing folders above the file, deepest first.
    let missing: Vec<std::path::PathBuf> = path
        .ancestors()
        .skip(1)
        .filter(|dir| !dir.as_os_str().is_empty())
        .take_while(|dir| !dir.exists())
        .map(std::path::Path::to_path_buf)
        .collect();
    let result = crate::output_file(path, flag).and_then(|()| command());
    if result.is_err() {
        for dir in &missing {
            // Only an empty folder goes: anything written there since is kept.
            let _ = std::fs::remove_dir(dir);
        }
    }
    result
}

/// Parses `--model`; an inline shape without `seq=` takes `--seq` when it is given.
fn parse_shape(spec: &str, seq: Option<usize>) -> Result<TransformerShape, ModelSpecError> {
    match (spec.parse(), seq) {
        (Err(ModelSpecError::Missing { field: "seq" }), Some(seq)) => {
            format!("{},seq={seq}", spec.trim().trim_end_matches(',')).parse()
        }
        (parsed, _) => parsed,
    }
}

pub(super) fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// One line describing a plan.
pub(super) fn describe(p: &Plan) -> String {
    let l = &p.layout;
    format!(
        "{} v={} mbs={} m={} {} recompute={} {} overlap={}",
        degrees(l),
        l.virtual_stages,
        l.micro_batch,
        l.micro_batches,
        l.schedule,
        p.policy,
        l.zero_label(),
        l.tp_overlap
    )
}

/// `dp=.. tp=.. pp=..`, with `cp=..` and `sp` (sequence parallelism) when on.
pub(super) fn degrees(l: &merak_burn::planner::Layout) -> String {
    let mut text = format!("dp={} tp={} pp={}", l.dp, l.tp, l.pp);
    let sequence = l.sequence_label();
    if !sequence.is_empty() {
        text = format!("{text} {sequence}");
    }
    text
}

pub(super) fn print_prediction(p: &Prediction) {
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
