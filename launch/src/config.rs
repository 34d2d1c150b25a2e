//! The TOML configuration of a training job, with `--set key=value` overrides.
//!
//! Every key has a default, so a config file only states what differs. Unknown keys and bad
//! values are errors that name the key.

use std::path::Path;

use merak_burn::pipeline::{PipelinePlan, Recompute, RecomputeMode, ScheduleKind};
use merak_burn::plan::ParallelPlan;
use merak_burn::planner::TransformerShape;
use merak_burn::tensor_parallel::TpOverlap;
use merak_gpt::GptConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use toml::Value;

/// A configuration error; every variant names the key or the file.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path} is not valid TOML: {msg}")]
    Parse {
        /// The path.
        path: String,
        /// The parser's message.
        msg: String,
    },
    /// A key that no configuration has.
    #[error("unknown config key `{key}`{hint}")]
    UnknownKey {
        /// The dotted key.
        key: String,
        /// The keys known at that level.
        hint: String,
    },
    /// A `--set` argument without `=`.
    #[error("--set expects key=value, got `{0}`")]
    SetSyntax(String),
    /// A value of the wrong type or out of range.
    #[error("config key `{key}`: {msg}")]
    BadValue {
        /// The dotted key.
        key: String,
        /// What is wrong.
        msg: String,
    },
}

/// `[model]`: which model and its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model family: "gpt" (causal LM) or "bert" (masked LM).
    pub kind: String,
    /// BERT only: the id of the [MASK] token; 0 means the last id (`vocab_size - 1`).
    pub mask_token_id: usize,
    /// A preset name (`merak models` lists them) giving the shape; the keys below override it.
    /// Empty: the keys below are the whole shape.
    pub preset: String,
    /// The shape.
    #[serde(flatten)]
    pub gpt: GptConfig,
}

/// `[parallel]`: the layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// ZeRO stage: 0 (every DP rank keeps the whole optimizer state) or 1 (each DP rank keeps
    /// and updates the state of its share of the parameters, then shares the new values).
    pub zero: u8,
    /// Size of a data-parallel gradient bucket in MiB; a bucket's all-reduce starts as soon as
    /// all its gradients are final.
    pub bucket_mb: f64,
    /// Pipeline schedule: "gpipe", "1f1b", "interleaved", "shifted-critical-path", "2bw" or
    /// "zb-h1".
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved schedule only; 1 otherwise).
    pub virtual_stages: usize,
    /// Units per pipeline stage (the embedding counts as the first unit and the head as the
    /// last, so they sum to layers + 2); empty: balanced automatically by cost.
    pub stage_layers: Vec<usize>,
    /// Activation recomputation: "none", "full", "selective" or "stage-aware".
    pub recompute: Recompute,
    /// Recomputation per stage ("none", "selective" or "full", one per pipeline stage, as a
    /// plan from `merak plan` gives it); when set it replaces `recompute`. A pipeline rank
    /// whose stages include a selective one runs all of them with selective recomputation.
    pub stage_recompute: Vec<RecomputeMode>,
    /// Stage-aware recomputation: activation memory per stage in MiB; 0: what the last stage
    /// needs without recomputation.
    pub memory_budget_mb: f64,
    /// Sub-pipelined tensor parallelism: token chunks per micro-batch (1: none). Each
    /// tensor-parallel all-reduce is cut into this many chunks, each overlapped with the next
    /// chunk's matrix product; it must divide micro-batch x sequence length.
    pub tp_overlap: usize,
}

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
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
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
    /// GPT: after training, continue a held-out prompt by this many tokens and print it
    /// (0: no sample).
    pub sample_tokens: usize,
    /// Temperature of that sample's top-40 sampling (seeded by train.seed); 0 is greedy.
    pub sample_temperature: f64,
    /// Seed of initialization, data and dropout.
    pub seed: u64,
    /// Device: "cpu" or "cuda" (needs the `cuda` build feature).
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
    /// forever.
    pub comm_timeout_s: f64,
}

/// `[data]`: where tokens come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// "synthetic": deterministic sequences generated from the seed; "tokens": a data set made
    /// by `merak prepare-data`, at `data.path`.
    pub kind: String,
    /// Folder of the prepared data set (for `kind = "tokens"`).
    pub path: String,
    /// Measure the validation loss every this many steps (and after the last); 0 never.
    pub val_every: usize,
    /// Global batches of held-out sequences per validation.
    pub val_batches: usize,
}

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
                pp: 1,
                zero: 0,
                bucket_mb: 1.0,
                schedule: ScheduleKind::OneFOneB,
                virtual_stages: 1,
                stage_layers: Vec::new(),
                recompute: Recompute::None,
                stage_recompute: Vec::new(),
                memory_budget_mb: 0.0,
                tp_overlap: 1,
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
            },
            data: DataSection {
                kind: "synthetic".into(),
                path: String::new(),
                val_every: 0,
                val_batches: 2,
            },
            checkpoint: CheckpointSection {
                every: 0,
                at_end: true,
                dir: String::new(),
                keep: 3,
            },
        }
    }
}

fn default_value() -> Value {
    Value::try_from(Config::default()).expect("the default config serializes")
}

/// Keys without a default value (absent unless set), as (section, key).
const OPTIONAL_KEYS: [(&str, &str); 1] = [("train", "cuda_device")];

/// Every key a config may set: the defaults' and the optional ones.
fn known_keys() -> Value {
    let mut known = default_value();
    for (section, key) in OPTIONAL_KEYS {
        if let Some(Value::Table(t)) = known.get_mut(section) {
            t.insert(key.into(), Value::Boolean(true));
        }
    }
    known
}

/// Checks every key of `user` against `known`, recursively; `prefix` is the dotted path so far.
fn check_keys(user: &Value, known: &Value, prefix: &str) -> Result<(), ConfigError> {
    let (Value::Table(u), Value::Table(k)) = (user, known) else {
        return Ok(());
    };
    for (name, v) in u {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match k.get(name) {
            Some(kv) => check_keys(v, kv, &key)?,
            None => {
                return Err(ConfigError::UnknownKey {
                    key,
                    hint: format!(
                        " (known keys{}: {})",
                        if prefix.is_empty() {
                            String::new()
                        } else {
                            format!(" in [{prefix}]")
                        },
                        k.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Overlays `top` onto `base`, table by table.
fn merge(base: &mut Value, top: Value) {
    match (base, top) {
        (Value::Table(b), Value::Table(t)) => {
            for (k, v) in t {
                match b.get_mut(&k) {
                    Some(bv) => merge(bv, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, t) => *b = t,
    }
}

/// Parses the text of a `--set` value: a TOML literal (number, boolean, quoted string, array)
/// or, failing that, a bare string.
fn parse_literal(text: &str) -> Value {
    toml::from_str::<toml::Table>(&format!("v = {text}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(text.to_string()))
}

fn set_key(root: &mut Value, key: &str, value: Value) {
    let mut cur = root;
    let parts: Vec<&str> = key.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        let Value::Table(t) = cur else { return };
        cur = t
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Default::default()));
    }
    if let Value::Table(t) = cur {
        t.insert(parts[parts.len() - 1].to_string(), value);
    }
}

/// Reads a config file (or starts from the built-in default when `path` is `None`), applies
/// `--set` overrides, and checks every key and value.
pub fn load(path: Option<&Path>, sets: &[String]) -> Result<Config, ConfigError> {
    let file = match path {
        Some(path) => {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: shown.clone(),
                source,
            })?;
            Some((text, shown))
        }
        None => None,
    };
    load_text(file.as_ref().map(|(t, n)| (t.as_str(), n.as_str())), sets)
}

/// Like [`load`], from the text of a config (`(text, where it came from)`).
pub fn load_text(file: Option<(&str, &str)>, sets: &[String]) -> Result<Config, ConfigError> {
    let known = known_keys();
    let mut user = Value::Table(Default::default());
    if let Some((text, shown)) = file {
        user = Value::Table(toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: shown.to_string(),
            msg: e.to_string(),
        })?);
        check_keys(&user, &known, "")?;
    }
    for s in sets {
        let (key, text) = s
            .split_once('=')
            .ok_or_else(|| ConfigError::SetSyntax(s.clone()))?;
        let key = key.trim();
        let mut probe = Value::Table(Default::default());
        set_key(&mut probe, key, Value::Boolean(true));
        check_keys(&probe, &known, "")?;
        set_key(&mut user, key, parse_literal(text.trim()));
    }

    // Base: the defaults, then the model preset if one is named, then the user's keys.
    let mut merged = default_value();
    let preset = user
        .get("model")
        .and_then(|m| m.get("preset"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let kind = user
        .get("model")
        .and_then(|m| m.get("kind"))
        .and_then(Value::as_str)
        .unwrap_or("gpt")
        .to_string();
    if !preset.is_empty() {
        let bad = |msg: String| ConfigError::BadValue {
            key: "model.preset".into(),
            msg,
        };
        let shape = if kind == "bert" {
            let b = merak_bert::BertConfig::preset(&preset).map_err(|e| bad(e.to_string()))?;
            Value::try_from(b).map_err(|e| bad(e.to_string()))?
        } else {
            let g = GptConfig::preset(&preset).map_err(|e| bad(e.to_string()))?;
            Value::try_from(g).map_err(|e| bad(e.to_string()))?
        };
        let mut model = toml::Table::new();
        model.insert("model".into(), shape);
        merge(&mut merged, Value::Table(model));
    }
    merge(&mut merged, user);
    let cfg: Config = deserialize_named(merged)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Deserializes section by section so that a type error names its key.
fn deserialize_named(v: Value) -> Result<Config, ConfigError> {
    let text = toml::to_string(&v).map_err(|e| ConfigError::BadValue {
        key: "(config)".into(),
        msg: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e: toml::de::Error| {
        // Point at the key: the span of the error is inside the offending line.
        let key = e
            .span()
            .and_then(|span| key_at(&text, span.start))
            .unwrap_or_else(|| "(config)".into());
        ConfigError::BadValue {
            key,
            msg: e.message().to_string(),
        }
    })
}

/// The dotted key of the line containing byte `offset` of a serialized config.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let mut section = String::new();
    let mut pos = 0;
    for line in text.lines() {
        let end = pos + line.len();
        let t = line.trim();
        if t.starts_with('[') {
            section = t.trim_matches(|c| c == '[' || c == ']').to_string();
        }
        if offset <= end {
            if let Some((k, _)) = t.split_once('=') {
                return Some(format!("{section}.{}", k.trim()));
            }
            return (!section.is_empty()).then_some(section);
        }
        pos = end + 1;
    }
    None
}

/// `Err(BadValue)` naming `key`.
fn bad(key: &str, msg: String) -> Result<(), ConfigError> {
    Err(ConfigError::BadValue {
        key: key.into(),
        msg,
    })
}

impl Config {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_model()?;
        self.validate_data()?;
        self.validate_train()?;
        self.validate_batch()?;
        self.validate_parallel()
    }

    /// `[model]`: a known kind and a consistent shape.
    fn validate_model(&self) -> Result<(), ConfigError> {
        match self.model.kind.as_str() {
            "gpt" => {}
            "bert" => {
                if let Err(e) = self.bert().validate() {
                    return bad("model", e.to_string());
                }
            }
            other => {
                return bad(
                    "model.kind",
                    format!("`{other}` is not a known model (known: gpt, bert)"),
                );
            }
        }
        if let Err(e) = self.model.gpt.validate() {
            return bad("model", e.to_string());
        }
        Ok(())
    }

    /// `[data]`: a known source with what it needs.
    fn validate_data(&self) -> Result<(), ConfigError> {
        match self.data.kind.as_str() {
            "synthetic" => {}
            "tokens" if self.data.path.is_empty() => {
                return bad(
                    "data.path",
                    "is required with data.kind = \"tokens\" (a folder made by `merak prepare-data`)".into(),
                );
            }
            "tokens" => {}
            other => {
                return bad(
                    "data.kind",
                    format!("`{other}` is not a known data source (known: synthetic, tokens)"),
                );
            }
        }
        if self.data.val_every > 0 && self.data.val_batches == 0 {
            return bad(
                "data.val_batches",
                "must be at least 1 when data.val_every > 0".into(),
            );
        }
        Ok(())
    }

    /// `[train]`: steps, learning rates, betas, clipping and device in range.
    fn validate_train(&self) -> Result<(), ConfigError> {
        if self.train.steps == 0 {
            return bad("train.steps", "must be at least 1".into());
        }
        if self.train.global_batch == 0 {
            return bad("train.global_batch", "must be at least 1".into());
        }
        if !(self.train.lr > 0.0 && self.train.lr.is_finite()) {
            return bad(
                "train.lr",
                format!("{} must be a positive number", self.train.lr),
            );
        }
        if self.train.min_lr < 0.0 || self.train.min_lr > self.train.lr {
            return bad(
                "train.min_lr",
                format!(
                    "{} must be in [0, train.lr = {}]",
                    self.train.min_lr, self.train.lr
                ),
            );
        }
        for (key, b) in [
            ("train.beta1", self.train.beta1),
            ("train.beta2", self.train.beta2),
        ] {
            if !(0.0..1.0).contains(&b) {
                return bad(key, format!("{b} must be in [0, 1)"));
            }
        }
        let t = &self.train;
        for (key, v, ok, range) in [
            ("train.grad_clip", t.grad_clip, t.grad_clip >= 0.0, ">= 0"),
            (
                "train.weight_decay",
                t.weight_decay,
                t.weight_decay >= 0.0,
                ">= 0",
            ),
            ("train.eps", t.eps, t.eps > 0.0, "> 0"),
            (
                "train.comm_timeout_s",
                t.comm_timeout_s,
                t.comm_timeout_s >= 0.0,
                ">= 0 (0: no limit)",
            ),
            (
                "train.sample_temperature",
                t.sample_temperature,
                t.sample_temperature >= 0.0,
                ">= 0 (0: greedy)",
            ),
        ] {
            if !(ok && v.is_finite()) {
                return bad(key, format!("{v} must be a finite number {range}"));
            }
        }
        if t.sample_tokens > self.model.gpt.seq_len {
            return bad(
                "train.sample_tokens",
                format!(
                    "{} is more than the model's context (model.seq_len = {})",
                    t.sample_tokens, self.model.gpt.seq_len
                ),
            );
        }
        if !matches!(self.train.device.as_str(), "cpu" | "cuda") {
            return bad(
                "train.device",
                format!("`{}` is not a device (cpu or cuda)", self.train.device),
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
        if self.train.cuda_device.is_some() && self.train.device != "cuda" {
            return bad(
                "train.cuda_device",
                format!(
                    "is set, but train.device = \"{}\" (it chooses CUDA devices)",
                    self.train.device
                ),
            );
        }
        Ok(())
    }

    /// The batch splits over the data-parallel ranks and micro-batches.
    fn validate_batch(&self) -> Result<(), ConfigError> {
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

    /// `[parallel]`: ZeRO stage, stages, recomputation and sizes consistent.
    fn validate_parallel(&self) -> Result<(), ConfigError> {
        if self.parallel.zero > 1 {
            return bad(
                "parallel.zero",
                format!(
                    "{} is not a supported ZeRO stage (0 or 1)",
                    self.parallel.zero
                ),
            );
        }
        if self.parallel.virtual_stages == 0 {
            return bad("parallel.virtual_stages", "must be at least 1".into());
        }
        let stages = self.parallel.pp * self.virtual_stages();
        if !self.parallel.stage_recompute.is_empty()
            && self.parallel.stage_recompute.len() != stages
        {
            return bad(
                "parallel.stage_recompute",
                format!(
                    "has {} entries for {stages} stages (parallel.pp = {} x parallel.virtual_stages = {})",
                    self.parallel.stage_recompute.len(),
                    self.parallel.pp,
                    self.parallel.virtual_stages
                ),
            );
        }
        let (v, schedule) = (self.parallel.virtual_stages, self.parallel.schedule);
        if schedule == ScheduleKind::ZbV && v > 2 {
            return bad(
                "parallel.virtual_stages",
                format!("{v}: parallel.schedule = \"zb-v\" runs two stages per rank"),
            );
        }
        if v > 1 && !schedule.uses_virtual_stages() {
            return bad(
                "parallel.virtual_stages",
                format!(
                    "{v} needs parallel.schedule = \"interleaved\" or \"zb-v\" (it is \"{schedule}\")"
                ),
            );
        }
        if !(self.parallel.memory_budget_mb >= 0.0 && self.parallel.memory_budget_mb.is_finite()) {
            return bad(
                "parallel.memory_budget_mb",
                format!("{} must be >= 0", self.parallel.memory_budget_mb),
            );
        }
        if !(self.parallel.bucket_mb > 0.0 && self.parallel.bucket_mb.is_finite()) {
            return bad(
                "parallel.bucket_mb",
                format!("{} must be a positive number", self.parallel.bucket_mb),
            );
        }
        self.validate_overlap()
    }

    /// `parallel.tp_overlap`: at least 1 and a divisor of the tokens of a micro-batch.
    fn validate_overlap(&self) -> Result<(), ConfigError> {
        let tokens = self.micro_batch() * self.model.gpt.seq_len;
        let overlap = match TpOverlap::new(self.parallel.tp_overlap) {
            Ok(k) => k,
            Err(e) => return bad("parallel.tp_overlap", e.to_string()),
        };
        match overlap.check_tokens(tokens) {
            Ok(()) => Ok(()),
            Err(e) => bad(
                "parallel.tp_overlap",
                format!(
                    "{e} (train.micro_batch = {} x model.seq_len = {}): choose a divisor of {tokens}",
                    self.micro_batch(),
                    self.model.gpt.seq_len
                ),
            ),
        }
    }

    /// The BERT shape of `[model]` (for `model.kind = "bert"`).
    pub fn bert(&self) -> merak_bert::BertConfig {
        let g = &self.model.gpt;
        merak_bert::BertConfig {
            vocab_size: g.vocab_size,
            layers: g.layers,
            heads: g.heads,
            hidden: g.hidden,
            seq_len: g.seq_len,
            dropout: g.dropout,
            layer_norm_eps: g.layer_norm_eps,
            init_std: g.init_std,
            mask_token_id: match self.model.mask_token_id {
                0 => g.vocab_size.saturating_sub(1),
                id => id,
            },
        }
    }

    /// Sequences per forward/backward pass on one rank: `train.micro_batch`, or when it is 0
    /// the rank's whole share (one micro-batch) without a pipeline, and 1 sequence (as many
    /// micro-batches as possible, the smallest bubble) with one.
    pub fn micro_batch(&self) -> usize {
        match self.train.micro_batch {
            0 if self.parallel.pp > 1 => 1,
            0 => self.train.global_batch / self.parallel.dp.max(1),
            m => m,
        }
    }

    /// The planner's shape of `[model]`.
    pub fn shape(&self) -> Result<TransformerShape, ConfigError> {
        match self.model.kind.as_str() {
            "gpt" => Ok(self.model.gpt.shape()),
            "bert" => Ok(self.bert().shape()),
            other => Err(ConfigError::BadValue {
                key: "model.kind".into(),
                msg: format!("{other:?} is not \"gpt\" or \"bert\""),
            }),
        }
    }

    /// The pipeline plan of this config (stages, schedule, recomputation per stage), built and
    /// validated; errors name the `parallel.*` key.
    pub fn pipeline_plan(&self) -> anyhow::Result<PipelinePlan> {
        let shape = self.shape()?;
        Ok(self
            .parallel_plan()
            .pipeline(&shape, self.train.global_batch)?)
    }

    /// Stages per pipeline rank: `parallel.virtual_stages`, and always 2 under ZB-V.
    pub fn virtual_stages(&self) -> usize {
        match self.parallel.schedule {
            ScheduleKind::ZbV => 2,
            _ => self.parallel.virtual_stages,
        }
    }

    /// The run's parallel plan: `[parallel]` with the micro-batch size resolved.
    pub fn parallel_plan(&self) -> ParallelPlan {
        let p = &self.parallel;
        ParallelPlan {
            dp: p.dp,
            tp: p.tp,
            pp: p.pp,
            virtual_stages: self.virtual_stages(),
            micro_batch: self.micro_batch(),
            schedule: p.schedule,
            stage_units: p.stage_layers.clone(),
            recompute: p.recompute,
            stage_recompute: p.stage_recompute.clone(),
            memory_budget_mb: p.memory_budget_mb,
            zero1: p.zero == 1,
            bucket_mb: p.bucket_mb,
            tp_overlap: p.tp_overlap,
        }
    }

    /// Sets the keys a plan decides (`plan_cmd::PLANNED_KEYS`: the layout, stages, schedule,
    /// recomputation per stage, ZeRO-1 and the micro-batch size) to run `plan`; the bucket
    /// size and the recomputation policy stay the config's.
    pub fn apply_plan(&mut self, plan: &ParallelPlan) {
        let p = &mut self.parallel;
        p.dp = plan.dp;
        p.tp = plan.tp;
        p.pp = plan.pp;
        p.virtual_stages = plan.virtual_stages;
        p.schedule = plan.schedule;
        p.stage_layers = plan.stage_units.clone();
        p.stage_recompute = plan.stage_recompute.clone();
        p.zero = u8::from(plan.zero1);
        p.tp_overlap = plan.tp_overlap;
        self.train.micro_batch = plan.micro_batch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sets(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn overrides_apply_and_unknown_keys_are_named() {
        let c = load(
            None,
            &sets(&["train.steps=5", "parallel.tp=2", "data.kind=synthetic"]),
        )
        .unwrap();
        assert_eq!(c.train.steps, 5);
        assert_eq!(c.parallel.tp, 2);
        let e = load(None, &sets(&["train.stepz=5"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.stepz") && e.contains("steps"), "{e}");
        let e = load(None, &sets(&["train.steps=many"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.steps"), "{e}");
        let e = load(None, &sets(&["data.kind=books"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("data.kind"), "{e}");
        let e = load(None, &sets(&["train.steps"])).unwrap_err().to_string();
        assert!(e.contains("key=value"), "{e}");
    }

    #[test]
    fn cuda_devices_are_a_number_or_a_list_and_only_for_cuda() {
        use merak_burn::device::DeviceRequest;
        let c = load(None, &sets(&["train.device=cuda", "train.cuda_device=1"])).unwrap();
        assert_eq!(c.train.cuda_device, Some(DeviceRequest::Same(1)));
        let c = load(
            None,
            &sets(&["train.device=cuda", "train.cuda_device=[1, 0]"]),
        )
        .unwrap();
        assert_eq!(
            c.train.cuda_device,
            Some(DeviceRequest::PerLocalRank(vec![1, 0]))
        );
        assert_eq!(load(None, &[]).unwrap().train.cuda_device, None);
        let e = load(None, &sets(&["train.cuda_device=1"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.cuda_device") && e.contains("cpu"), "{e}");
        let e = load(None, &sets(&["train.device=cuda", "train.cuda_device=-1"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.cuda_device"), "{e}");
    }

    #[test]
    fn comm_is_auto_nccl_or_mpi_and_nccl_only_on_cuda() {
        use merak_burn::comm::TransportRequest;
        assert_eq!(load(None, &[]).unwrap().train.comm, TransportRequest::Auto);
        let c = load(None, &sets(&["train.comm=\"mpi\""])).unwrap();
        assert_eq!(c.train.comm, TransportRequest::Mpi);
        let c = load(None, &sets(&["train.device=cuda", "train.comm=nccl"])).unwrap();
        assert_eq!(c.train.comm, TransportRequest::Nccl);
        let e = load(None, &sets(&["train.comm=nccl"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.comm") && e.contains("cpu"), "{e}");
        let e = load(None, &sets(&["train.comm=gloo"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.comm") && e.contains("gloo"), "{e}");
    }

    #[test]
    fn presets_fill_the_shape_and_keys_override_them() {
        let c = load(None, &sets(&["model.preset=gpt2", "model.layers=2"])).unwrap();
        assert_eq!(c.model.gpt.hidden, 768);
        assert_eq!(c.model.gpt.layers, 2);
        let e = load(None, &sets(&["model.preset=gpt5"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.preset") && e.contains("gpt2-xl"), "{e}");
    }

    #[test]
    fn the_shipped_config_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt-tiny.toml");
        let c = load(Some(&path), &[]).unwrap();
        assert_eq!(c.model.gpt.heads, 4);
    }
}
