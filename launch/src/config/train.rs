//! `[train]` and `[optimizer]`: steps, batch, learning rate, clipping, device; the library's
//! [`TrainSettings`] they give.

use merak_burn::train::TrainSettings;
use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, bad, shown};

/// `[train]`: optimization.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub global_batch: usize,
    /// Sequences per forward/backward pass on one rank; 0 means the rank's whole share
    /// (`global_batch / dp`) without a pipeline and 1 with one (pp > 1). Gradients are accumulated over the micro-batches, so every
    /// layout trains on the same global batch.
    pub micro_batch: usize,
    /// Peak learning rate, in (0, 10]: Adam's rates stay below 0.01, and SGD's, scaled
    /// linearly with batches of 8k sequences, near 3.
    pub lr: f64,
    /// Final learning rate of the schedule's decay (`optimizer.schedule`: cosine, linear or
    /// WSD; unused by constant), in [0, 10] and at most `train.lr`.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Weight decay: decoupled for AdamW, L2 (added to the gradient) for the other
    /// optimizers; norms and biases get none by default. In [0, 1]: language models use 0.1
    /// (AdamW), L2 1e-4; at 1 AdamW already shrinks the weights by `lr` a step.
    pub weight_decay: f64,
    /// Beta 1 of AdamW and Adam, in [0, 1) (at 1 the first moment never moves).
    pub beta1: f64,
    /// Beta 2 of AdamW and Adam, in [0, 1) (at 1 the second moment never moves).
    pub beta2: f64,
    /// Epsilon of AdamW, Adam, AdaGrad and RMSProp, in [1e-30, 1]: 1e-8 to 1e-10 are used;
    /// the optimizers' f32 arithmetic rounds values below about 1e-38 to 0 (no epsilon at
    /// all), and at 1 epsilon outweighs any gradient's root mean square.
    pub eps: f64,
    /// Clip gradients to this global norm (0 disables clipping), in [0, 1000000]: 1 is usual,
    /// and a norm beyond a million is a diverged run, not one to clip.
    pub grad_clip: f64,
    /// On a NaN or infinite loss, skip the step (true) instead of stopping (false).
    pub skip_nonfinite: bool,
    /// GPT: after training, continue a held-out prompt by this many tokens and print it
    /// (0: no sample).
    pub sample_tokens: usize,
    /// Temperature of that sample's top-40 sampling (seeded by train.seed); 0 is greedy. In
    /// [0, 10]: at 10 the top 40 are already drawn almost uniformly.
    pub sample_temperature: f64,
    /// Seed of initialization, data and dropout.
    pub seed: u64,
    /// Device: "cpu", "cuda" (needs the `cuda` build feature) or "wgpu" (Vulkan, Metal or DX12
    /// GPUs, and Mesa's software Vulkan driver; the `wgpu` build feature, on by default).
    pub device: String,
    /// Compute precision: "fp32", or "bf16" (bf16 compute and activations over f32 master
    /// weights, gradients, reduction, optimizer state and checkpoints).
    pub precision: merak_burn::precision::Precision,
    /// What carries messages between ranks: "auto" (NCCL on CUDA when every rank has a GPU of
    /// its own, MPI otherwise), "nccl" (an error where NCCL cannot run) or "mpi".
    pub comm: merak_burn::comm::TransportRequest,
    /// With `device = "cuda"`: a device number that every rank of a node uses, or a list of
    /// them indexed by the rank's local rank; unset, local rank `r` uses device `r` (ranks
    /// share devices round-robin when a node has fewer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_device: Option<merak_burn::device::DeviceRequest>,
    /// A rank blocked in one communication call longer than this many seconds (plus the
    /// message's time at 100 MB/s) names the call and its peers and aborts the job; 0: wait
    /// forever. In [0, 31536000] (a year).
    pub comm_timeout_s: f64,
    /// Rank 0 names a rank in the log (with its host) when its time computing in a step (its
    /// step time less its time blocked in communication) exceeds the median of the other
    /// ranks' by more than this fraction (and by 10 ms at least: a busy machine's scheduler
    /// noise) for `train.straggler_steps` steps in a row. In (0, 1000]: 0.5 is "half as slow
    /// again"; at 1000 no rank is ever named.
    #[serde(default = "default_straggler_fraction")]
    pub straggler_fraction: f64,
    /// Steps in a row a rank must be slow to be named (0: stragglers are never named).
    #[serde(default = "default_straggler_steps")]
    pub straggler_steps: usize,
}

/// `train.straggler_fraction`'s default (also for configs written before the key).
fn default_straggler_fraction() -> f64 {
    merak_burn::train::StragglerRule::default().fraction
}

/// `train.straggler_steps`'s default (also for configs written before the key).
fn default_straggler_steps() -> usize {
    merak_burn::train::StragglerRule::default().steps
}

impl Config {
    /// The library's training settings of this config.
    pub fn train_settings(&self) -> TrainSettings {
        let t = &self.train;
        TrainSettings {
            steps: t.steps,
            global_batch: t.global_batch,
            seq_len: self.model.gpt.seq_len,
            lr: t.lr,
            min_lr: t.min_lr,
            warmup_steps: t.warmup_steps,
            weight_decay: t.weight_decay,
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            grad_clip: t.grad_clip,
            skip_nonfinite: t.skip_nonfinite,
            seed: t.seed,
            val_every: self.data.val_every,
            val_batches: self.data.val_batches,
            precision: self.train.precision,
            optimizer: self.optimizer.clone(),
        }
    }

    /// `[train]`: steps, learning rates, betas, clipping and device in range.
    pub(super) fn validate_train(&self) -> Result<(), ConfigError> {
        if self.train.steps == 0 {
            return bad("train.steps", "must be at least 1".into());
        }
        if self.train.global_batch == 0 {
            return bad("train.global_batch", "must be at least 1".into());
        }
        if self.train.min_lr > self.train.lr {
            return bad(
                "train.min_lr",
                format!(
                    "{} must be in [0, train.lr = {}]",
                    shown(self.train.min_lr),
                    shown(self.train.lr)
                ),
            );
        }
        let t = &self.train;
        if t.sample_tokens > self.model.gpt.seq_len {
            return bad(
                "train.sample_tokens",
                format!(
                    "{} is more than the model's context (model.seq_len = {})",
                    t.sample_tokens, self.model.gpt.seq_len
                ),
            );
        }
        if !matches!(self.train.device.as_str(), "cpu" | "cuda" | "wgpu") {
            return bad(
                "train.device",
                format!(
                    "`{}` is not a device (cpu, cuda or wgpu)",
                    self.train.device
                ),
            );
        }
        if self.train.comm == merak_burn::comm::TransportRequest::Nccl
            && self.train.device != "cuda"
        {
            return bad(
                "train.comm",
                format!(
                    "is \"nccl\", but train.device = \"{}\" (NCCL moves GPU memory; use \"mpi\" \
                     or \"auto\")",
                    self.train.device
                ),
            );
        }
        Ok(())
    }

    /// `[optimizer]` and the schedule against `[train]`: the trainer's own checks
    /// ([`merak_burn::train::check_settings`]), with the config's key named.
    pub(super) fn validate_optimizer(&self) -> Result<(), ConfigError> {
        let Err(e) = merak_burn::train::check_settings(&self.train_settings()) else {
            return Ok(());
        };
        let key = if e.key.starts_with("optimizer.") {
            e.key.clone()
        } else {
            format!("train.{}", e.key)
        };
        let sep = if e.reason.starts_with("must") {
            ""
        } else {
            ":"
        };
        bad(&key, format!("{}{sep} {}", e.value, e.reason))
    }

    /// The batch splits over the data-parallel ranks and micro-batches.
    pub(super) fn validate_batch(&self) -> Result<(), ConfigError> {
        if !self
            .train
            .global_batch
            .is_multiple_of(self.parallel.dp.max(1))
        {
            return bad(
                "train.global_batch",
                format!(
                    "{} is not divisible by parallel.dp = {}",
                    self.train.global_batch, self.parallel.dp
                ),
            );
        }
        let local = self.train.global_batch / self.parallel.dp.max(1);
        if self.train.micro_batch > 0 && !local.is_multiple_of(self.train.micro_batch) {
            return bad(
                "train.micro_batch",
                format!(
                    "{} does not divide the per-rank batch {} (train.global_batch = {} / parallel.dp = {})",
                    self.train.micro_batch, local, self.train.global_batch, self.parallel.dp
                ),
            );
        }
        Ok(())
    }
}
