//! `merak train`'s config: the file (or the checkpoint's), the command line's degrees and
//! `--set` overrides, a plan (`--plan FILE|auto`), checked against the job before anything is
//! built.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use merak_burn::comm::{Communicator, MpiCommunicator};
use merak_burn::pipeline::PipelinePlan;
use merak_burn::plan::ParallelPlan;
use merak_burn::planner::PlanFile;

use crate::config::{self, Config};
use crate::plan_cmd;
use crate::train::Resume;
use crate::train_args::TrainArgs;

/// A training job's resolved config, its plan file (when `--plan` gave one) and its pipeline
/// plan, built once.
pub struct Resolved {
    /// The config with every override and the plan applied.
    pub cfg: Config,
    /// The plan file applied, if any.
    pub plan_file: Option<PlanFile>,
    /// The parallel plan of the config.
    pub parallel: ParallelPlan,
    /// The validated pipeline plan.
    pub pipeline: PipelinePlan,
}

/// Loads the config (the checkpoint's when resuming without --config), applies the
/// command-line degrees and the plan, and checks the layout against the `world` ranks.
pub fn resolve_config(
    args: &TrainArgs,
    world: Option<&MpiCommunicator>,
    size: usize,
    resume: Option<&Resume>,
) -> Result<Resolved> {
    let mut sets = args.sets.clone();
    for (key, v) in [
        ("dp", args.dp),
        ("tp", args.tp),
        ("cp", args.cp),
        ("ep", args.ep),
        ("pp", args.pp),
    ] {
        if let Some(v) = v {
            sets.push(format!("parallel.{key}={v}"));
        }
    }
    let mut cfg = match (resume, &args.config) {
        (Some(r), None) => {
            let text = checkpoint_config(r)?;
            let origin = r.checkpoint.dir.join("manifest.json");
            let mut cfg = config::load_text(Some((&text, &origin.display().to_string())), &sets)?;
            // The checkpoint folder stored in the checkpoint is history: a resumed run writes
            // under its --out, or where this command line says.
            if !sets.iter().any(|s| set_key(s) == "checkpoint.dir") {
                cfg.checkpoint.dir.clear();
            }
            if args.plan.is_none() && !sets.iter().any(|s| sets_layout(s)) {
                fit_layout_to_launch(&mut cfg, size);
                cfg.validate()?;
            }
            cfg
        }
        _ => config::load(args.config.as_deref(), &sets)?,
    };
    let plan_file = match args.plan.as_deref() {
        Some(spec) => Some(apply_plan(args, spec, &mut cfg, world, size)?),
        None => None,
    };
    if let Some(r) = resume {
        let text = checkpoint_config(r)?;
        let saved = config::load_text(Some((&text, "the checkpoint")), &[])?;
        check_resumable(&cfg, &saved)?;
        // Another optimizer than the checkpoint's is a config error (exit 2), found here.
        let optimizer = cfg.train_settings().optimizer;
        optimizer
            .check_checkpoint(&r.checkpoint.manifest)
            .map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
    }
    let (parallel, shape) = (cfg.parallel_plan(), cfg.shape()?);
    parallel.layout().validate(size, &shape)?;
    // Before anything per layer is built (model.layers = 100000000 is refused at once).
    crate::admission::check_shape(&cfg, &parallel)?;
    // Built here, so that a bad schedule stops every rank at once.
    let pipeline = parallel.pipeline(&shape, cfg.train.global_batch)?;
    if world.is_none_or(|w| w.rank() == 0) {
        cfg.warn_idle_settings();
    }
    Ok(Resolved {
        cfg,
        plan_file,
        parallel,
        pipeline,
    })
}

/// The key of the `--set` override `set` (`key=value`).
fn set_key(set: &str) -> &str {
    set.split_once('=').map_or(set, |(k, _)| k).trim()
}

/// Whether the `--set` override `set` chooses a layout degree.
fn sets_layout(set: &str) -> bool {
    matches!(
        set_key(set),
        "parallel.dp" | "parallel.tp" | "parallel.cp" | "parallel.ep" | "parallel.pp"
    )
}

/// A checkpoint's stored layout that does not fit the ranks of the launch (resuming a
/// dp=2 x tp=2 run on one process, with no degree given): the launch wins, as plain data
/// parallelism over its ranks, without the stored pipeline's stages; a micro-batch that no
/// longer divides a rank's share becomes the default, and a hybrid shard group that no longer
/// divides dp the whole data-parallel group.
fn fit_layout_to_launch(cfg: &mut Config, size: usize) {
    let p = &cfg.parallel;
    if p.dp * p.cp * p.tp * p.pp == size {
        return;
    }
    tracing::info!(
        "the checkpoint was written under dp={} cp={} tp={} pp={}; resuming on {size} rank(s) as \
         dp={size} (give --dp/--cp/--tp/--pp to choose)",
        p.dp,
        p.cp,
        p.tp,
        p.pp
    );
    let p = &mut cfg.parallel;
    (p.dp, p.cp, p.tp, p.pp, p.virtual_stages) = (size, 1, 1, 1, 1);
    p.ep = 1;
    if p.shard != 0 && !size.is_multiple_of(p.shard) {
        p.shard = 0;
    }
    p.sequence_parallel = false;
    p.stage_layers.clear();
    p.stage_recompute.clear();
    if p.schedule.uses_virtual_stages() {
        p.schedule = merak_burn::pipeline::ScheduleKind::OneFOneB;
    }
    let share = cfg.train.global_batch / size.max(1);
    if cfg.train.micro_batch > 0 && !share.is_multiple_of(cfg.train.micro_batch) {
        cfg.train.micro_batch = 0;
    }
}

/// Reads `--plan spec` (a file, or `auto`: planned for this job), checks it fits the job and
/// sets the config to run it.
fn apply_plan(
    args: &TrainArgs,
    spec: &str,
    cfg: &mut Config,
    world: Option<&MpiCommunicator>,
    size: usize,
) -> Result<PlanFile> {
    let degrees = [args.dp, args.tp, args.cp, args.ep, args.pp];
    if degrees.iter().any(Option::is_some) {
        bail!("--plan {spec} sets the layout: drop --dp, --tp, --cp, --ep and --pp");
    }
    let planned = |s: &String| plan_cmd::PLANNED_KEYS.contains(&set_key(s));
    if let Some(s) = args.sets.iter().find(|s| planned(s)) {
        bail!("--plan {spec} sets this key: drop --set {s}");
    }
    let (path, file) = if spec == "auto" {
        let file = plan_cmd::auto_plan(cfg, world, args.calibration.as_deref())?;
        (PathBuf::from("(automatic plan)"), file)
    } else {
        let path = PathBuf::from(spec);
        let file = PlanFile::read(&path)?;
        (path, file)
    };
    file.check_job(&path, &cfg.shape()?, size, cfg.train.global_batch)?;
    cfg.apply_plan(&ParallelPlan::from_planned(&file.plan.layout));
    cfg.validate()
        .with_context(|| format!("applying the plan {}", path.display()))?;
    Ok(file)
}

/// Opens and verifies the checkpoint to resume from.
pub fn open_resume(path: &Path) -> Result<Resume> {
    let checkpoint = merak_burn::checkpoint::Checkpoint::open(path)?;
    let state = checkpoint.read_full()?;
    Ok(Resume { checkpoint, state })
}

/// The config stored in a checkpoint's manifest.
fn checkpoint_config(r: &Resume) -> Result<String> {
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
fn check_resumable(cfg: &Config, saved: &Config) -> Result<()> {
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
