//! `merak train`'s config: the file (or the checkpoint's), the command line's degrees and
//! `--set` overrides, a plan (`--plan FILE|auto`), checked against the job before anything is
//! built.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use merak_burn::checkpoint::Checkpoint;
use merak_burn::comm::{Communicator, MpiCommunicator};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::PipelinePlan;
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
    resume: Option<&Checkpoint>,
) -> Result<Resolved> {
    let mut cfg = load_config(args, size, resume)?;
    let micro_batch_from_layout = cfg.train.micro_batch == 0 || args.plan.is_some();
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
            .check_checkpoint(&r.manifest)
            .map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
    }
    let (parallel, shape) = (cfg.parallel_plan(), cfg.shape()?);
    parallel.layout().validate(size, &shape)?;
    // Before anything per layer is built (model.layers = 100000000 is refused at once).
    crate::admission::check_shape(&cfg, &parallel)?;
    // Built here, so that a bad schedule stops every rank at once.
    let pipeline = parallel.pipeline(&shape, cfg.train.global_batch)?;
    // What the trainer would refuse before building anything, refused before any folder.
    merak_burn::train::check_plan(&parallel, &pipeline, &cfg.train_settings(), parallel.dp)?;
    if world.is_none_or(|w| w.rank() == 0) {
        cfg.warn_idle_settings();
        if let Some(w) = cfg.layout_dependent_balance(micro_batch_from_layout) {
            tracing::warn!("{w}");
        }
    }
    if let Some(r) = resume {
        // The checkpoint's tensors against the model this config builds, before any folder.
        crate::model_params::check_checkpoint(&cfg, r)
            .with_context(|| format!("--resume {}", r.dir.display()))?;
    }
    Ok(Resolved {
        cfg,
        plan_file,
        parallel,
        pipeline,
    })
}

/// The config of a job before its plan: the file (or, resuming without --config, the
/// checkpoint's, fitted to the `size` ranks of the launch), the command line's degrees and
/// `--set` overrides. Enough to know the folders the job writes (`merak train --np` locks
/// them before it starts the ranks).
pub fn load_config(args: &TrainArgs, size: usize, resume: Option<&Checkpoint>) -> Result<Config> {
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
    let Some(r) = resume.filter(|_| args.config.is_none()) else {
        return Ok(config::load(args.config.as_deref(), &sets)?);
    };
    let text = checkpoint_config(r)?;
    let origin = r.dir.join("manifest.json");
    let mut cfg = config::load_text(Some((&text, &origin.display().to_string())), &sets)?;
    // The checkpoint folder stored in the checkpoint is history: a resumed run writes under
    // its --out, or where this command line says.
    if !sets.iter().any(|s| set_key(s) == "checkpoint.dir") {
        cfg.checkpoint.dir.clear();
    }
    if args.plan.is_none() && !sets.iter().any(|s| sets_layout(s)) {
        fit_layout_to_launch(&mut cfg, size);
        cfg.validate()?;
    }
    Ok(cfg)
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

/// Reads and verifies every tensor of the opened `checkpoint` to resume from.
pub fn read_resume(checkpoint: Checkpoint) -> Result<Resume> {
    let state = checkpoint.read_full()?;
    Ok(Resume { checkpoint, state })
}

/// The config stored in a checkpoint's manifest, with what the run trained with where a key
/// came after it ([`with_former_defaults`]).
fn checkpoint_config(r: &Checkpoint) -> Result<String> {
    Ok(with_former_defaults(stored_config(r)?))
}

/// A stored config `text` with the keys added since it was written set to what that run
/// trained with: a mixture of experts without `model.moe.balance` balanced per micro-batch
/// (the only form before the key existed), so a resume keeps training the same model. Text
/// that does not parse as TOML is returned as it is, for the config reader to refuse.
fn with_former_defaults(text: &str) -> String {
    let Ok(mut doc) = text.parse::<toml::Table>() else {
        return text.to_string();
    };
    let moe = (doc.get_mut("model"))
        .and_then(toml::Value::as_table_mut)
        .and_then(|m| m.get_mut("moe"))
        .and_then(toml::Value::as_table_mut);
    match moe {
        Some(moe) if !moe.contains_key("balance") => {
            moe.insert("balance".into(), "micro-batch".into());
            doc.to_string()
        }
        _ => text.to_string(),
    }
}

/// The keys `merak train` writes into a manifest's `extra`, besides the trainer's own.
pub const EXTRA_KEYS: [&str; 1] = ["config"];

/// The training config (TOML) stored in the manifest of a checkpoint `merak train` wrote;
/// a key of `extra` that neither `merak train` nor the trainer writes is refused, naming it.
pub fn stored_config(ck: &Checkpoint) -> Result<&str> {
    ck.manifest
        .check_extra(&ck.dir.join(merak_burn::checkpoint::MANIFEST), &EXTRA_KEYS)?;
    ck.manifest
        .extra
        .get("config")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: the manifest holds no config (not written by merak train)",
                ck.dir.display()
            )
        })
}

/// The `[model]` keys a resumed run may change: they change neither the parameters nor the
/// function the model computes. `model.moe.max_load` bounds the rows an expert-parallel rank
/// receives (memory, the advice when routing exceeds it); `model.moe.shared_overlap` says when
/// the shared experts run, not what they compute; `model.moe.aux_loss` and `model.moe.z_loss`
/// weigh the auxiliary losses, hyperparameters of training like `train.weight_decay` (which a
/// resume may change too); `model.preset` is a name (the shape it gives is compared key by
/// key). Every other key stays: it shapes the parameters (`hidden`, `layers`, `moe.experts`,
/// a balancing bias with `moe.bias_update_rate`), the function (`dropout`, `layer_norm_eps`,
/// the routing: `top_k`, `score`, `renormalize`, `balance`, `capacity_factor`,
/// `bias_update_rate`) or how
/// the parameters were made (`init_std`), and BERT's objective (`mask_token_id`).
pub const RESUME_MAY_CHANGE: [&str; 5] = [
    "model.preset",
    "model.moe.max_load",
    "model.moe.shared_overlap",
    "model.moe.aux_loss",
    "model.moe.z_loss",
];

/// The keys of `cfg` that a resumed run must keep, as (dotted key, value as TOML writes it):
/// the model's but [`RESUME_MAY_CHANGE`] (and `model.mask_token_id` outside BERT, which
/// does not read it), the batch and the seed (the data position and the random streams
/// depend on them).
fn kept_on_resume(cfg: &Config) -> Vec<(String, String)> {
    fn leaves(v: &toml::Value, path: String, out: &mut Vec<(String, String)>) {
        match v {
            toml::Value::Table(t) if !t.is_empty() => {
                t.iter()
                    .for_each(|(k, v)| leaves(v, format!("{path}.{k}"), out));
            }
            other => out.push((path, other.to_string())),
        }
    }
    let mut out = Vec::new();
    if let Ok(model) = toml::Value::try_from(&cfg.model) {
        leaves(&model, "model".into(), &mut out);
    }
    out.retain(|(k, _)| {
        !RESUME_MAY_CHANGE.contains(&k.as_str())
            && (k != "model.mask_token_id" || cfg.model.kind == "bert")
    });
    out.push((
        "train.global_batch".into(),
        cfg.train.global_batch.to_string(),
    ));
    out.push(("train.seed".into(), cfg.train.seed.to_string()));
    out
}

/// Checks that a run can continue a checkpoint: the keys it must keep ([`kept_on_resume`])
/// are the checkpoint's; the error names each that differs, with both values.
fn check_resumable(cfg: &Config, saved: &Config) -> Result<()> {
    let moe = |c: &Config| match c.model.gpt.moe {
        Some(_) => "set",
        None => "unset (a dense model)",
    };
    if moe(cfg) != moe(saved) {
        bail!(
            "--resume: [model.moe] is {} in the checkpoint but {} in this run; a resumed run \
             must keep it",
            moe(saved),
            moe(cfg)
        );
    }
    let (ours, theirs) = (kept_on_resume(cfg), kept_on_resume(saved));
    let value = |keys: &[(String, String)], key: &str| {
        (keys.iter())
            .find(|(k, _)| k == key)
            .map_or_else(|| "unset".to_string(), |(_, v)| v.clone())
    };
    let mut seen = std::collections::BTreeSet::new();
    let changed: Vec<String> = (theirs.iter().chain(&ours))
        .map(|(k, _)| k.as_str())
        .filter(|k| seen.insert(*k))
        .filter_map(|key| {
            let (a, b) = (value(&theirs, key), value(&ours, key));
            (a != b).then(|| format!("{key} is {a} in the checkpoint but {b} in this run"))
        })
        .collect();
    match changed.len() {
        0 => Ok(()),
        1 => bail!("--resume: {}; a resumed run must keep it", changed[0]),
        _ => bail!(
            "--resume: {}; a resumed run must keep them",
            changed.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default config with `sets` applied.
    fn cfg(sets: &[&str]) -> Config {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        config::load(None, &sets).unwrap()
    }

    #[test]
    fn a_resume_names_each_changed_key_with_both_values_and_accepts_the_others() {
        const MOE: &str = "model.preset=moe-tiny";
        let saved = cfg(&[MOE]);
        let e = check_resumable(&cfg(&[MOE, "model.moe.experts=8"]), &saved)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--resume: model.moe.experts is 4 in the checkpoint but 8 in this run; a resumed \
             run must keep it"
        );
        let changed = cfg(&[MOE, "model.hidden=128", "train.seed=7"]);
        let e = check_resumable(&changed, &saved).unwrap_err().to_string();
        assert_eq!(
            e,
            "--resume: model.hidden is 64 in the checkpoint but 128 in this run, train.seed is \
             1234 in the checkpoint but 7 in this run; a resumed run must keep them"
        );
        let e = check_resumable(&cfg(&[]), &saved).unwrap_err().to_string();
        assert!(
            e.contains("[model.moe] is set in the checkpoint but unset"),
            "{e}"
        );
        // What changes neither the parameters nor the function: the advice of a failed rank
        // (raise model.moe.max_load) among them.
        let may = [
            MOE,
            "model.moe.max_load=9",
            "model.moe.shared_overlap=false",
            "model.moe.aux_loss=0.5",
            "model.moe.z_loss=0.001",
        ];
        check_resumable(&cfg(&may), &saved).unwrap();
    }

    #[test]
    fn a_checkpoint_from_before_the_balance_key_keeps_balancing_per_micro_batch() {
        use merak_burn::moe::Balance;
        let balance = |text: &str| {
            let text = with_former_defaults(text);
            let c = config::load_text(Some((&text, "the checkpoint")), &[]).unwrap();
            c.model.gpt.moe.map(|m| m.balance)
        };
        // A config as `merak train` stores it, written before the key existed.
        let stored = toml::to_string(&cfg(&["model.preset=moe-tiny"])).unwrap();
        let mut table: toml::Table = stored.parse().unwrap();
        let mut old_moe = table["model"]["moe"].as_table().unwrap().clone();
        assert!(old_moe.remove("balance").is_some());
        table["model"].as_table_mut().unwrap()["moe"] = old_moe.into();
        let old = table.to_string();
        assert_eq!(balance(&old), Some(Balance::MicroBatch));
        assert_eq!(balance(&stored), Some(Balance::Sequence));
        // A dense model gets no [model.moe]; text that is not TOML is left to the reader.
        assert_eq!(balance("[model]\nhidden = 64\n"), None);
        assert_eq!(with_former_defaults("[model"), "[model");
        // Resumed with a config of today (per sequence), the change is named.
        let saved = config::load_text(Some((&with_former_defaults(&old), "ck")), &[]).unwrap();
        let e = check_resumable(&cfg(&["model.preset=moe-tiny"]), &saved).unwrap_err();
        assert!(e.to_string().contains("model.moe.balance"), "{e}");
    }
}
