//! The TOML configuration of a training job, with `--set key=value` overrides.
//!
//! Every key has a default, so a config file only states what differs. Unknown keys and bad
//! values are errors that name the key.

mod bounds;
mod data;
mod error;
mod idle;
mod load;
mod model;
mod parallel;
mod train;

#[cfg(test)]
mod tests;

use merak_burn::data_parallel::GradientBuffers;
use merak_burn::pipeline::{Recompute, ScheduleKind};
use merak_gpt::GptConfig;
use serde::{Deserialize, Serialize};

pub use data::DataSection;
pub use error::ConfigError;
pub use load::{load, load_text};
pub use model::ModelSection;
pub use parallel::ParallelSection;
pub use train::TrainSection;

/// `[checkpoint]`: when and where training state is saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many steps; 0: only at the end (when `at_end`).
    pub every: usize,
    /// Save after the last step.
    pub at_end: bool,
    /// Folder of the checkpoints; empty: `<out>/checkpoints`.
    pub dir: String,
    /// Keep the newest this many checkpoints (0 keeps all).
    pub keep: usize,
    /// Write each rank's checkpoint files on a writer thread while training goes on: the
    /// step only copies the rank's own state (its shards) to host memory. The save is
    /// completed (sealed and put in place) once every rank's writer is done, and at the latest
    /// before the next save, on a stop and at the end of the run; crash consistency is the
    /// same as a synchronous save's. Costs one more host copy of the rank's state while the
    /// writer runs.
    #[serde(rename = "async")]
    pub asynchronous: bool,
}

/// A whole training configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The model.
    pub model: ModelSection,
    /// The layout.
    pub parallel: ParallelSection,
    /// Optimization.
    pub train: TrainSection,
    /// `[optimizer]`: which optimizer, its own hyperparameters (`momentum`, `dampening`,
    /// `nesterov`, `alpha`, `centered`, `lr_decay`; Muon's `muon_momentum`, `muon_nesterov`,
    /// `ns_steps`, `ns_coefficients`, `muon_scale`) and the shape of the learning-rate
    /// schedule (`schedule`, `decay_steps`); the shared ones (`lr`, `min_lr`, `warmup_steps`,
    /// `weight_decay`, `beta1`, `beta2`, `eps`) stay in `[train]`. A kind-specific key set for
    /// a kind that does not use it is refused.
    #[serde(default)]
    pub optimizer: merak_burn::train::OptimizerSettings,
    /// Data.
    pub data: DataSection,
    /// Checkpoints.
    pub checkpoint: CheckpointSection,
}

impl Default for Config {
    /// The built-in default: the tiny GPT on synthetic data, one process.
    fn default() -> Self {
        let gpt = GptConfig::preset("tiny").expect("the tiny preset exists");
        Config {
            model: ModelSection {
                kind: "gpt".into(),
                mask_token_id: 0,
                preset: String::new(),
                gpt,
            },
            parallel: ParallelSection {
                dp: 1,
                tp: 1,
                cp: 1,
                cp_attention: merak_burn::context_parallel::CpAttention::Ring,
                ep: 1,
                pp: 1,
                zero: 0,
                prefetch: 1,
                shard: 0,
                reduce_scatter: None,
                reshard_after_forward: true,
                bucket_mb: 1.0,
                gradient_buffers: GradientBuffers::Auto,
                schedule: ScheduleKind::OneFOneB,
                virtual_stages: 1,
                stage_layers: Vec::new(),
                recompute: Recompute::None,
                stage_recompute: Vec::new(),
                memory_budget_mb: 0.0,
                tp_overlap: 1,
                sequence_parallel: false,
            },
            train: TrainSection {
                steps: 200,
                global_batch: 8,
                micro_batch: 0,
                lr: 3e-3,
                min_lr: 3e-4,
                warmup_steps: 10,
                weight_decay: 0.01,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                grad_clip: 1.0,
                skip_nonfinite: false,
                sample_tokens: 0,
                sample_temperature: 0.0,
                seed: 1234,
                device: "cpu".into(),
                precision: merak_burn::precision::Precision::Fp32,
                comm: merak_burn::comm::TransportRequest::Auto,
                cuda_device: None,
                comm_timeout_s: 300.0,
                straggler_fraction: merak_burn::train::StragglerRule::default().fraction,
                straggler_steps: merak_burn::train::StragglerRule::default().steps,
            },
            optimizer: merak_burn::train::OptimizerSettings::default(),
            data: DataSection {
                kind: "synthetic".into(),
                path: String::new(),
                val_every: 0,
                val_batches: 2,
                document_mask: false,
            },
            checkpoint: CheckpointSection {
                every: 0,
                at_end: true,
                dir: String::new(),
                keep: 3,
                asynchronous: false,
            },
        }
    }
}

impl Config {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_bounds()?;
        self.validate_model()?;
        self.validate_data()?;
        self.validate_train()?;
        self.validate_optimizer()?;
        self.validate_batch()?;
        self.validate_parallel()?;
        self.validate_checkpoint()
    }

    /// `[checkpoint]`: saves that select no step are refused (a period longer than the run
    /// without the save at the end).
    fn validate_checkpoint(&self) -> Result<(), ConfigError> {
        let (every, steps) = (self.checkpoint.every, self.train.steps);
        if every > steps && !self.checkpoint.at_end {
            return bad(
                "checkpoint.every",
                format!(
                    "{every} is more than train.steps = {steps} and checkpoint.at_end = false: \
                     no checkpoint would be saved (set checkpoint.at_end = true, or \
                     checkpoint.every = 0 to save none)"
                ),
            );
        }
        Ok(())
    }
}

pub(crate) use merak_burn::bounds::shown;

/// The largest `train.comm_timeout_s`: a year, in seconds.
pub const MAX_COMM_TIMEOUT_S: f64 = 365.0 * 24.0 * 3600.0;

/// The most sequences a validation pass over synthetic data reads (`data.val_batches x
/// train.global_batch`): far beyond any useful estimate of a loss, far below a pass that never
/// ends.
pub const MAX_SYNTHETIC_VAL_SEQUENCES: usize = 1 << 16;

/// `Err(BadValue)` naming `key`.
pub(crate) fn bad(key: &str, msg: String) -> Result<(), ConfigError> {
    Err(ConfigError::BadValue {
        key: key.into(),
        msg,
    })
}
