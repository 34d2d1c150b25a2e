//! What [`merak_burn::run`](crate::run) does besides training: where it writes, when it
//! checkpoints, what it resumes or starts from, and whether it stops on signals.

use std::collections::HashMap;
use std::path::PathBuf;

use std::sync::Arc;

use crate::train::{ExistingRun, ParamGroup, ParamInfo, RunFile};

/// Every parameter of a model at full size by checkpoint name, `(shape, values)`: pretrained
/// weights to start from (for example read from a Hugging Face checkpoint).
pub type FullParams = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Pretrained weights and where they came from (named in errors).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InitWeights {
    /// The file or folder they were read from.
    pub source: String,
    /// The weights.
    pub params: FullParams,
}

/// A rule giving each parameter its optimizer group (weight decay, learning-rate scale) by
/// its name and full shape ([`Trainer::with_param_groups`](crate::train::Trainer::with_param_groups)).
#[derive(Clone)]
pub struct ParamGroups(pub Arc<dyn Fn(&ParamInfo<'_>) -> ParamGroup + Send + Sync>);

impl std::fmt::Debug for ParamGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ParamGroups(..)")
    }
}

impl PartialEq for ParamGroups {
    /// The same rule (the same closure), not rules that happen to agree.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The options of a run. `RunOptions::default()` writes to a new `runs/<UTC date-time>`,
/// checkpoints at the end keeping the newest two, shows progress, refuses a folder holding
/// another run, installs no signal handlers and gives up on a rank silent for 300 s.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOptions {
    /// The output folder: `metrics.jsonl`, `run.json`, `memory.json` and `checkpoints/`.
    /// `None`: the resumed run's folder, or a new `runs/<UTC date-time>`.
    pub out: Option<PathBuf>,
    /// Where checkpoints go; `None`: `checkpoints/` in the output folder.
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: usize,
    /// Save a checkpoint after the last step (and when stopped by a signal).
    pub checkpoint_at_end: bool,
    /// Keep the newest this many checkpoints of the run (0 keeps all).
    pub keep_checkpoints: usize,
    /// Write checkpoints on a writer thread while training goes on
    /// ([`CheckpointPolicy::asynchronous`](crate::train::CheckpointPolicy::asynchronous)).
    pub checkpoint_async: bool,
    /// Stored in every checkpoint's manifest (for example the model's name and config).
    pub manifest_extra: serde_json::Value,
    /// Continue from this checkpoint (a `step-*` folder or a checkpoint root) under any layout.
    pub resume: Option<PathBuf>,
    /// Start from these weights instead of the model's initialization.
    pub init: Option<InitWeights>,
    /// Stop after the current step on SIGTERM, SIGINT or SIGUSR1, checkpoint, and report
    /// [`Summary::stopped`](crate::train::Summary::stopped) (a second signal ends the
    /// process). Off by default: the signal handlers are the program's, not the library's.
    pub signals: bool,
    /// A progress bar (tokens/s, ETA) on rank 0 when stderr is a terminal, else a log line per
    /// step.
    pub progress: bool,
    /// What to do with an output folder that holds another run ([`ExistingRun`]).
    pub existing: ExistingRun,
    /// Under `mpirun`, abort the job when a rank waits longer than this many seconds for
    /// another (0: wait forever).
    pub comm_timeout_s: f64,
    /// Write a Chrome trace of every rank's actions here.
    pub trace: Option<PathBuf>,
    /// The program's own files in the output folder (a config, a plot drawn at the end): the
    /// run claims them with the folder ([`RunOutput::files`](crate::train::RunOutput)).
    pub files: Vec<RunFile>,
    /// The optimizer's parameter groups; `None`: the default rule (matrices decay, vectors
    /// such as biases and norm gains do not).
    pub param_groups: Option<ParamGroups>,
    /// After training, sum the head's metrics
    /// ([`HeadUnit::metrics`](crate::parallelize::HeadUnit::metrics)) over this many global
    /// batches of held-out samples (0: no evaluation).
    pub eval_batches: usize,
    /// After training, gather the head's outputs
    /// ([`HeadUnit::predict`](crate::parallelize::HeadUnit::predict)) for this many global
    /// batches of held-out samples (0: none).
    pub predict_batches: usize,
    /// When rank 0 names a rank slower than the others in the log
    /// ([`StragglerRule`](crate::train::StragglerRule)).
    pub stragglers: crate::train::StragglerRule,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            out: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            checkpoint_at_end: true,
            keep_checkpoints: 2,
            checkpoint_async: false,
            manifest_extra: serde_json::Value::Object(Default::default()),
            resume: None,
            init: None,
            signals: false,
            progress: true,
            existing: ExistingRun::Refuse,
            comm_timeout_s: 300.0,
            trace: None,
            files: Vec::new(),
            param_groups: None,
            eval_batches: 0,
            predict_batches: 0,
            stragglers: Default::default(),
        }
    }
}

impl RunOptions {
    /// These options writing to `out`.
    #[must_use]
    pub fn with_out(mut self, out: impl Into<PathBuf>) -> Self {
        self.out = Some(out.into());
        self
    }

    /// These options resuming `checkpoint` (`None`: a fresh run).
    #[must_use]
    pub fn with_resume(mut self, checkpoint: Option<PathBuf>) -> Self {
        self.resume = checkpoint;
        self
    }

    /// These options starting from `init` (`None`: the model's own initialization).
    #[must_use]
    pub fn with_init(mut self, init: Option<InitWeights>) -> Self {
        self.init = init;
        self
    }

    /// These options checkpointing every `every` steps (0: only at the end), keeping `keep`.
    #[must_use]
    pub fn with_checkpoints(mut self, every: usize, keep: usize) -> Self {
        (self.checkpoint_every, self.keep_checkpoints) = (every, keep);
        self
    }

    /// These options with signal handlers installed (see [`signals`](Self::signals)).
    #[must_use]
    pub fn with_signals(mut self, signals: bool) -> Self {
        self.signals = signals;
        self
    }

    /// These options giving each parameter the optimizer group `rule` returns.
    #[must_use]
    pub fn with_param_groups(
        mut self,
        rule: impl Fn(&ParamInfo<'_>) -> ParamGroup + Send + Sync + 'static,
    ) -> Self {
        self.param_groups = Some(ParamGroups(Arc::new(rule)));
        self
    }

    /// These options with `extra` in every manifest.
    #[must_use]
    pub fn with_manifest_extra(mut self, extra: serde_json::Value) -> Self {
        self.manifest_extra = extra;
        self
    }
}
