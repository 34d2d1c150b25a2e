//! The arguments of `merak train`.

use std::path::PathBuf;

/// The exit status of a run stopped by a signal after checkpointing (`EX_TEMPFAIL`: try again,
/// that is, resume), and of `--np --max-restarts` out of restarts with a checkpoint to continue
/// from.
pub const STOPPED: u8 = 75;

/// Arguments of `merak train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// TOML config file; without it the built-in default (tiny GPT, synthetic data) is used.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Data-parallel degree (overrides parallel.dp).
    #[arg(long)]
    pub dp: Option<usize>,
    /// Tensor-parallel degree (overrides parallel.tp).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Context-parallel degree (overrides parallel.cp).
    #[arg(long)]
    pub cp: Option<usize>,
    /// Expert-parallel degree of a mixture of experts (overrides parallel.ep; divides dp x cp).
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pipeline-parallel degree (overrides parallel.pp).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Override any config key, e.g. --set train.steps=5 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Output folder: metrics.jsonl, the resolved config, the run record (run.json) and, by
    /// default, the checkpoints. Default: a new folder runs/<date>-<time> (UTC), or with
    /// --resume the folder of the run the checkpoint belongs to. A folder that holds another
    /// run is refused (see --replace), and so is one whose run is still going (its run.lock
    /// names the holder).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Replace the run that the output or checkpoint folder holds: remove that run's files
    /// (only what merak writes: checkpoints, metrics, config, run record, charts), say which,
    /// and start here.
    #[arg(long, conflicts_with = "branch")]
    pub replace: bool,
    /// With --resume of a checkpoint older than others of its run in the checkpoint folder:
    /// move the later ones aside into branch-N (nothing is deleted) and continue from the
    /// older one.
    #[arg(long, requires = "resume")]
    pub branch: bool,
    /// Continue from a checkpoint: a `step-*` folder, or a checkpoint folder whose `latest`
    /// names one. Its config is the base (then --config's model must match it), and any
    /// dp/tp layout may load it.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from pretrained weights: a Hugging Face `GPT2LMHeadModel` (model.kind = "gpt") or
    /// `BertForMaskedLM` (model.kind = "bert", `config.json` next to it required) safetensors
    /// file, or one `merak export` wrote, checked against the model (and against the
    /// `config.json` next to it) before anything is built; any dp/tp/pp layout.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// Write a Chrome trace (JSON, open in Perfetto) of every rank's forward, backward,
    /// send, receive and idle time.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Take the layout, partition, schedule, recomputation and micro-batch size from a plan:
    /// a file written by `merak plan --output`, or `auto` to plan for the launched world size
    /// with a quick probe of this machine (and the calibration of `--calibration`).
    #[arg(long, value_name = "FILE|auto")]
    pub plan: Option<String>,
    /// With `--plan auto`: a calibration written by `merak profile` for this model.
    #[arg(long, requires = "plan")]
    pub calibration: Option<PathBuf>,
    /// Start this many ranks on this machine (runs `mpirun -np N` with the flags a local run
    /// needs and passes every other argument through); not under mpirun. At most what this
    /// machine can start (32 ranks per core, its open-files limit, its available memory).
    /// This launcher holds the run folder's lock until the job ends; if it dies, mpirun and
    /// the ranks end too.
    #[arg(long, value_name = "N")]
    pub np: Option<usize>,
    /// Restart a failed run (a rank died, or the watchdog ended a stalled job) from its
    /// newest complete checkpoint, at most K times in a row. With --np the launcher restarts
    /// the ranks itself and exits 75 when out of restarts with a checkpoint to continue from;
    /// under mpirun or srun, give it to every start of a requeue loop: a restart that should
    /// not happen (the same step failed twice in a row, more than K failures, no checkpoint
    /// yet) is refused with exit status 2.
    #[arg(long, value_name = "K")]
    pub max_restarts: Option<usize>,
}
