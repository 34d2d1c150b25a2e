//! What a training run is asked to do besides its model and plan: the optimizer, the batch,
//! validation and checkpoints.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::train::LrSchedule;

/// The settings of a [`Trainer`](crate::train::Trainer): optimization, batch, validation. How
/// the batch is split (micro-batches, data-parallel ranks) is the
/// [`ParallelPlan`](crate::parallel_plan::ParallelPlan)'s: every layout given the same settings trains
/// on the same global batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    /// Optimizer steps of the whole run.
    pub steps: usize,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay of the matrices (vectors such as biases and norms never
    /// decay).
    pub weight_decay: f64,
    /// AdamW beta 1.
    pub beta1: f64,
    /// AdamW beta 2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip gradients to this global norm (0 disables clipping).
    pub grad_clip: f64,
    /// On a NaN or infinite loss, skip the step (true) instead of stopping (false).
    pub skip_nonfinite: bool,
    /// Seed of the data order and of dropout and masking streams.
    pub seed: u64,
    /// Measure the validation loss every this many steps (and after the last); 0 never.
    pub val_every: usize,
    /// Global batches of held-out sequences per validation.
    pub val_batches: usize,
    /// The compute precision ([`Precision`](crate::precision::Precision)): bf16 computes
    /// and keeps activations in bf16 over f32 master weights, gradients and optimizer state.
    #[serde(default)]
    pub precision: crate::precision::Precision,
    /// The optimizer (AdamW by default), its own hyperparameters and the shape of the
    /// learning-rate schedule ([`OptimizerSettings`](crate::train::optimizer_settings::OptimizerSettings)).
    #[serde(default)]
    pub optimizer: crate::train::optimizer_settings::OptimizerSettings,
}

impl Default for TrainSettings {
    /// A short run with the usual small-model optimizer settings: 100 steps of 8 sequences of
    /// 128 tokens, AdamW at peak lr 3e-4 (10 warm-up steps, cosine to 3e-5), betas 0.9/0.95,
    /// weight decay 0.1, clipping at 1.0, seed 0, no validation, fp32.
    fn default() -> Self {
        Self {
            steps: 100,
            global_batch: 8,
            seq_len: 128,
            lr: 3e-4,
            min_lr: 3e-5,
            warmup_steps: 10,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            skip_nonfinite: false,
            seed: 0,
            val_every: 0,
            val_batches: 0,
            precision: crate::precision::Precision::Fp32,
            optimizer: crate::train::optimizer_settings::OptimizerSettings::default(),
        }
    }
}

/// Chainable setters `with_<field>` for each field, in the style of Burn's configs:
/// `TrainSettings::default().with_steps(10).with_lr(1e-3)`.
macro_rules! setters {
    ($($field:ident: $ty:ty => $setter:ident),* $(,)?) => {
        impl TrainSettings {
            $(
                #[doc = concat!("These settings with `", stringify!($field), "` set.")]
                #[must_use]
                pub fn $setter(mut self, $field: $ty) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}

setters! {
    steps: usize => with_steps,
    global_batch: usize => with_global_batch,
    seq_len: usize => with_seq_len,
    lr: f64 => with_lr,
    min_lr: f64 => with_min_lr,
    warmup_steps: usize => with_warmup_steps,
    weight_decay: f64 => with_weight_decay,
    beta1: f64 => with_beta1,
    beta2: f64 => with_beta2,
    eps: f64 => with_eps,
    grad_clip: f64 => with_grad_clip,
    skip_nonfinite: bool => with_skip_nonfinite,
    seed: u64 => with_seed,
    val_every: usize => with_val_every,
    val_batches: usize => with_val_batches,
    precision: crate::precision::Precision => with_precision,
    optimizer: crate::train::optimizer_settings::OptimizerSettings => with_optimizer,
}

impl TrainSettings {
    /// The learning-rate schedule: linear warm-up, then the shape `optimizer.schedule` names
    /// (cosine decay to `min_lr` by default).
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.lr,
            min: self.min_lr,
            warmup: self.warmup_steps,
            total: self.steps,
        }
    }

    /// Tokens of one global batch.
    pub fn tokens_per_step(&self) -> usize {
        self.global_batch * self.seq_len
    }

    /// Whether validation runs after step `step` (1-based).
    pub fn validates_after(&self, step: usize) -> bool {
        self.val_every > 0 && (step.is_multiple_of(self.val_every) || step == self.steps)
    }
}

/// When and where [`Trainer::fit`](crate::train::Trainer::fit) saves checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointPolicy {
    /// The folder that holds the `step-*` checkpoints and `latest`.
    pub dir: PathBuf,
    /// Save every this many steps; 0: only at the end (when `at_end`).
    pub every: usize,
    /// Save after the last step.
    pub at_end: bool,
    /// Keep the newest this many checkpoints (0 keeps all).
    pub keep: usize,
    /// Stored in every manifest under its keys (for example the config that made the run).
    pub extra: serde_json::Value,
    /// Write each rank's files on a writer thread while training goes on: the step only
    /// copies this rank's state to host memory; the save is completed (sealed, renamed,
    /// `latest` switched) once every rank's writer is done, at the latest before the next
    /// save, on a stop and at the end of the run.
    #[serde(default)]
    pub asynchronous: bool,
}

impl CheckpointPolicy {
    /// Whether a checkpoint is due after `step` (1-based) of a `steps`-step run.
    pub fn due(&self, step: usize, steps: usize) -> bool {
        (self.every > 0 && step.is_multiple_of(self.every)) || (self.at_end && step == steps)
    }
}

/// Where [`Trainer::fit`](crate::train::Trainer::fit) writes what it reports.
#[derive(Clone, Debug, Default)]
pub struct RunOutput {
    /// Rank 0 writes `metrics.jsonl` and `memory.json` here.
    pub dir: PathBuf,
    /// Checkpoints (none when `None`).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Write a Chrome trace of every rank's actions here.
    pub trace: Option<PathBuf>,
    /// Show a progress bar on rank 0 when stderr is a terminal (otherwise a log line per step).
    pub progress: bool,
    /// Stop after the current step when this is requested on any rank (and checkpoint, when
    /// `checkpoints` is set); `None`: run every step.
    pub stop: Option<super::StopRequest>,
    /// What to do when `dir` or the checkpoint folder holds another run's files, or later
    /// checkpoints of the resumed run ([`claim`](mod@super::claim)): refuse by default.
    pub existing: super::ExistingRun,
    /// The caller's own files in `dir` (a config, a plot): written once the folders are
    /// claimed, and counted as this run's (another run replacing it removes them).
    pub files: Vec<RunFile>,
    /// When rank 0 names a rank slower than the others in the log.
    pub stragglers: super::StragglerRule,
}

/// A file of the caller's in a run's output folder.
#[derive(Clone, Debug, PartialEq)]
pub struct RunFile {
    /// Its name in the output folder (one plain name).
    pub name: String,
    /// Its contents, written by rank 0 (atomically) before the first step; `None`: the caller
    /// writes it later (a plot at the end), but it is still this run's.
    pub contents: Option<Vec<u8>>,
}

impl RunOutput {
    /// The names of the caller's files ([`RunOutput::files`]).
    pub fn own_files(&self) -> Vec<String> {
        self.files.iter().map(|f| f.name.clone()).collect()
    }

    /// The folders this run writes, for [`claim`](mod@super::claim).
    pub fn folders<'a>(&'a self, own_files: &'a [String]) -> super::RunFolders<'a> {
        super::RunFolders {
            out: &self.dir,
            checkpoints: self.checkpoints.as_ref().map(|c| c.dir.as_path()),
            own_files,
        }
    }

    /// Checks every path the run will write (the output folder, the checkpoint folder, the
    /// trace file) on rank `rank`: [`Trainer::fit`](super::Trainer::fit) does this before its
    /// first step, so a path that cannot be written fails at once, named.
    pub fn check(&self, rank: usize) -> Result<(), super::OutputError> {
        super::writable_dir(&self.dir, "output folder", rank)?;
        if let Some(c) = &self.checkpoints {
            super::writable_dir(&c.dir, "checkpoint folder", rank)?;
        }
        if let Some(trace) = &self.trace {
            super::writable_file(trace, "trace file", rank)?;
        }
        Ok(())
    }
}
