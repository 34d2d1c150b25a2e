//! The TOML configuration of a training job, with `--set key=value` overrides.
//!
//! Every key has a default, so a config file only states what differs. Unknown keys and bad
//! values are errors that name the key.

use merak_burn::train::TrainSettings;
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
    /// A key or value of a config file that is refused (the file named).
    #[error("config file {path}: {source}")]
    InFile {
        /// The path.
        path: String,
        /// What is wrong with the key or value.
        source: Box<ConfigError>,
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
    /// Pipeline schedule: "gpipe", "1f1b", "interleaved", "shifted-critical-path", "2bw",
    /// "zb-h1" or "zb-v".
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
    /// Final learning rate of the schedule's decay (`optimizer.schedule`: cosine, linear or
    /// WSD; unused by constant).
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Weight decay: decoupled for AdamW, L2 (added to the gradient) for the other
    /// optimizers; norms and biases get none by default.
    pub weight_decay: f64,
    /// Beta 1 of AdamW and Adam.
    pub beta1: f64,
    /// Beta 2 of AdamW and Adam.
    pub beta2: f64,
    /// Epsilon of AdamW, Adam, AdaGrad and RMSProp.
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
    /// `[optimizer]`: which optimizer, its own hyperparameters (`momentum`, `dampening`,
    /// `nesterov`, `alpha`, `centered`, `lr_decay`) and the shape of the learning-rate
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
            optimizer: merak_burn::train::OptimizerSettings::default(),
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
/// A table where `known` has a value (`model.kind.x`) is an unknown key, a value where
/// `known` has a table (`model = 3`) a bad value: keys added later are checked alike.
fn check_keys(user: &Value, known: &Value, prefix: &str) -> Result<(), ConfigError> {
    let (u, k) = match (user, known) {
        (Value::Table(u), Value::Table(k)) => (u, k),
        (Value::Table(u), _) => {
            let Some(name) = u.keys().next() else {
                return bad(prefix, "is a value, not a table".into());
            };
            return Err(ConfigError::UnknownKey {
                key: format!("{prefix}.{name}"),
                hint: format!(" (`{prefix}` is a value, not a table)"),
            });
        }
        (_, Value::Table(_)) => {
            return bad(prefix, format!("is a table ([{prefix}]), not a value"));
        }
        _ => return Ok(()),
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

/// Keys whose value may be NaN or infinite; every other float of a config must be finite.
const NON_FINITE_ALLOWED: [&str; 0] = [];

/// Refuses every float of `value` (a whole config, at dotted path `prefix`) that is NaN or
/// infinite, naming its key (`key[i]` inside an array), unless [`NON_FINITE_ALLOWED`] lists
/// the key.
fn check_finite(value: &Value, prefix: &str) -> Result<(), ConfigError> {
    let child = |name: &str| {
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    };
    match value {
        Value::Float(x) if !x.is_finite() && !NON_FINITE_ALLOWED.contains(&prefix) => bad(
            prefix,
            format!("{x} is not a finite number (nan, inf and values beyond 1.8e308 are refused)"),
        ),
        Value::Table(t) => t.iter().try_for_each(|(k, v)| check_finite(v, &child(k))),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_finite(v, &format!("{prefix}[{i}]"))),
        _ => Ok(()),
    }
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

/// Parses the text of a `--set` value: a TOML literal (number, boolean, quoted string, array),
/// a number beyond TOML's floats (`1e309`, infinite, so that it is refused as not finite) or,
/// failing those, a bare string.
fn parse_literal(text: &str) -> Value {
    toml::from_str::<toml::Table>(&format!("v = {text}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .or_else(|| {
            let numeric = text.bytes().any(|b| b.is_ascii_digit());
            let x: f64 = text.parse().ok().filter(|_| numeric)?;
            x.is_infinite().then_some(Value::Float(x))
        })
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
    let mut user = match file {
        Some((text, shown)) => read_file(text, shown, &known)?,
        None => Value::Table(Default::default()),
    };
    apply_sets(&mut user, sets, &known)?;
    // Base: the defaults, then the model preset if one is named, then the user's keys.
    let mut merged = default_value();
    if let Some(shape) = preset_shape(&user)? {
        let mut model = toml::Table::new();
        model.insert("model".into(), shape);
        merge(&mut merged, Value::Table(model));
    }
    merge(&mut merged, user);
    check_finite(&merged, "")?;
    let cfg: Config = deserialize_named(merged)?;
    cfg.validate()?;
    Ok(cfg)
}

/// The keys of a config file's `text` (from `shown`), checked against `known` and for
/// non-finite floats; errors name the file.
fn read_file(text: &str, shown: &str, known: &Value) -> Result<Value, ConfigError> {
    let user = Value::Table(toml::from_str(text).map_err(|e: toml::de::Error| {
        // Name the key of the offending line too (`lr = 1e309` under [train]).
        let key = e.span().and_then(|span| key_at(text, span.start));
        ConfigError::Parse {
            path: shown.to_string(),
            msg: match key {
                Some(key) => format!("at key `{key}`: {e}"),
                None => e.to_string(),
            },
        }
    })?);
    let in_file = |source| ConfigError::InFile {
        path: shown.to_string(),
        source: Box::new(source),
    };
    check_keys(&user, known, "").map_err(in_file)?;
    check_finite(&user, "").map_err(in_file)?;
    Ok(user)
}

/// Applies `--set key=value` overrides to `user` in order (a key set twice: the later wins),
/// checking each key, then every value, against `known`.
fn apply_sets(user: &mut Value, sets: &[String], known: &Value) -> Result<(), ConfigError> {
    for s in sets {
        let (key, text) = s
            .split_once('=')
            .ok_or_else(|| ConfigError::SetSyntax(s.clone()))?;
        let key = key.trim();
        let mut probe = Value::Table(Default::default());
        set_key(&mut probe, key, Value::Boolean(true));
        check_keys(&probe, known, "")?;
        set_key(user, key, parse_literal(text.trim()));
    }
    // The values too: `--set model.kind={x=1}` names `model.kind.x`.
    check_keys(user, known, "")
}

/// The shape of the preset `model.preset` of `user` (of `model.kind`), if one is named.
fn preset_shape(user: &Value) -> Result<Option<Value>, ConfigError> {
    let model = |key: &str| {
        user.get("model")
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
    };
    let (preset, kind) = (
        model("preset").unwrap_or(""),
        model("kind").unwrap_or("gpt"),
    );
    if preset.is_empty() {
        return Ok(None);
    }
    let bad = |msg: String| ConfigError::BadValue {
        key: "model.preset".into(),
        msg,
    };
    let shape = if kind == "bert" {
        let b = merak_bert::BertConfig::preset(preset).map_err(|e| bad(e.to_string()))?;
        Value::try_from(b).map_err(|e| bad(e.to_string()))?
    } else {
        let g = GptConfig::preset(preset).map_err(|e| bad(e.to_string()))?;
        Value::try_from(g).map_err(|e| bad(e.to_string()))?
    };
    Ok(Some(shape))
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
                let k = k.trim();
                return Some(if section.is_empty() {
                    k.to_string()
                } else {
                    format!("{section}.{k}")
                });
            }
            return (!section.is_empty()).then_some(section);
        }
        pos = end + 1;
    }
    None
}

/// `x` as written in a message: plainly, or in scientific notation when large (`1e300`).
fn shown(x: f64) -> String {
    if x.abs() < 1e15 {
        x.to_string()
    } else {
        format!("{x:e}")
    }
}

/// The largest `train.comm_timeout_s`: a year, in seconds.
pub const MAX_COMM_TIMEOUT_S: f64 = 365.0 * 24.0 * 3600.0;

/// The most sequences a validation pass over synthetic data reads (`data.val_batches x
/// train.global_batch`): far beyond any useful estimate of a loss, far below a pass that never
/// ends.
pub const MAX_SYNTHETIC_VAL_SEQUENCES: usize = 1 << 16;

/// `Err(BadValue)` naming `key`.
fn bad(key: &str, msg: String) -> Result<(), ConfigError> {
    Err(ConfigError::BadValue {
        key: key.into(),
        msg,
    })
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

    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_model()?;
        self.validate_data()?;
        self.validate_train()?;
        self.validate_optimizer()?;
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
        if self.data.kind == "synthetic" {
            return self.validate_val_sequences(MAX_SYNTHETIC_VAL_SEQUENCES, "the synthetic cap");
        }
        Ok(())
    }

    /// `data.val_batches` against the validation windows of the data set (`data.kind =
    /// "tokens"`, [`merak_burn::data::TokenData::val_samples`]): a validation pass reads
    /// `data.val_batches x train.global_batch` windows and must not read one twice. Called
    /// once the data set is open.
    pub fn validate_val_windows(&self, windows: u64) -> Result<(), ConfigError> {
        let limit = usize::try_from(windows).unwrap_or(usize::MAX);
        self.validate_val_sequences(limit, "the validation windows of data.path")
    }

    /// A validation pass (when `data.val_every > 0`) of at most `limit` sequences (`what`).
    fn validate_val_sequences(&self, limit: usize, what: &str) -> Result<(), ConfigError> {
        let (batches, global) = (self.data.val_batches, self.train.global_batch);
        let sequences = batches.checked_mul(global);
        if self.data.val_every == 0 || sequences.is_some_and(|n| n <= limit) {
            return Ok(());
        }
        let shown = sequences.map_or_else(|| "more than 2^64".into(), |n| n.to_string());
        bad(
            "data.val_batches",
            format!(
                "{batches} batches of train.global_batch = {global} make {shown} sequences per \
                 validation, more than {what} ({limit})"
            ),
        )
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
                format!("{} must be a positive number", shown(self.train.lr)),
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
                (0.0..=MAX_COMM_TIMEOUT_S).contains(&t.comm_timeout_s),
                "in [0, 31536000] (a year; 0: no limit)",
            ),
            (
                "train.sample_temperature",
                t.sample_temperature,
                t.sample_temperature >= 0.0,
                ">= 0 (0: greedy)",
            ),
        ] {
            if !(ok && v.is_finite()) {
                return bad(key, format!("{} must be a finite number {range}", shown(v)));
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

    /// `[optimizer]` and the schedule against `[train]`: the trainer's own checks
    /// ([`merak_burn::train::check_settings`]), with the config's key named.
    fn validate_optimizer(&self) -> Result<(), ConfigError> {
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
        self.validate_degrees()?;
        let stages = self.stages();
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
                format!("{} must be >= 0", shown(self.parallel.memory_budget_mb)),
            );
        }
        if !(self.parallel.bucket_mb > 0.0 && self.parallel.bucket_mb.is_finite()) {
            return bad(
                "parallel.bucket_mb",
                format!(
                    "{} must be a positive number",
                    shown(self.parallel.bucket_mb)
                ),
            );
        }
        self.validate_overlap()
    }

    /// Products of the degrees fit in a `usize`: the ranks `dp x tp x pp`, the stages
    /// `pp x virtual_stages` and the tokens `micro_batch x seq_len`.
    fn validate_degrees(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        let products = [
            (
                "parallel.dp",
                "parallel.dp x parallel.tp x parallel.pp",
                [p.dp, p.tp, p.pp],
            ),
            (
                "parallel.virtual_stages",
                "parallel.pp x parallel.virtual_stages",
                [p.pp, self.virtual_stages(), 1],
            ),
            (
                "train.micro_batch",
                "train.micro_batch x model.seq_len",
                [self.micro_batch(), self.model.gpt.seq_len, 1],
            ),
        ];
        for (key, what, factors) in products {
            if factors
                .iter()
                .try_fold(1usize, |a, &f| a.checked_mul(f))
                .is_none()
            {
                return bad(key, format!("{what} = {factors:?} overflows"));
            }
        }
        Ok(())
    }

    /// Pipeline stages: `parallel.pp x` [`virtual_stages`](Self::virtual_stages) (saturating;
    /// validation refuses an overflow).
    pub fn stages(&self) -> usize {
        self.parallel.pp.saturating_mul(self.virtual_stages())
    }

    /// `parallel.tp_overlap`: at least 1 and a divisor of the tokens of a micro-batch.
    fn validate_overlap(&self) -> Result<(), ConfigError> {
        let tokens = self.micro_batch().saturating_mul(self.model.gpt.seq_len);
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

    /// Every leaf key of the built-in default, as (section, key, value).
    fn leaves() -> Vec<(String, String, Value)> {
        let Value::Table(root) = default_value() else {
            panic!("the default is a table");
        };
        let mut out = Vec::new();
        for (section, table) in root {
            let Value::Table(table) = table else {
                panic!("{section} is a section");
            };
            for (key, value) in table {
                out.push((section.clone(), key, value));
            }
        }
        out
    }

    #[test]
    fn a_value_used_as_a_table_is_an_unknown_key_in_every_section_by_file_and_set() {
        let e = load(None, &sets(&["model.kind.x=1"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`model.kind.x`") && e.contains("not a table"),
            "{e}"
        );
        let e = load(None, &sets(&["model.kind={x=1}"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`model.kind.x`"), "{e}");
        let leaves = leaves();
        assert!(leaves.len() > 40, "{}", leaves.len());
        for (section, key, _) in &leaves {
            let dotted = format!("{section}.{key}.x");
            let e = load(None, &[format!("{dotted}=1")])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{dotted}`")), "{e}");
            let file = format!("[{section}.{key}]\nx = 1\n");
            let e = load_text(Some((&file, "f.toml")), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{dotted}`")), "{e}");
            // A section given a value is named too.
            let e = load(None, &[format!("{section}=3")])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{section}`")), "{e}");
            let e = load_text(Some((&format!("{section} = 3"), "f.toml")), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{section}`")), "{e}");
        }
    }

    #[test]
    fn every_non_finite_float_is_refused_naming_its_key_by_file_and_set() {
        let e = load(None, &sets(&["train.min_lr=nan"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`train.min_lr`") && e.contains("finite"), "{e}");
        let floats: Vec<_> = leaves()
            .into_iter()
            .filter(|(_, _, v)| matches!(v, Value::Float(_)))
            .collect();
        assert!(floats.len() >= 14, "{}", floats.len());
        for (section, key, _) in floats {
            let dotted = format!("{section}.{key}");
            for bad in ["nan", "inf", "-inf", "+nan", "1e309", "-1e309"] {
                let e = load(None, &[format!("{dotted}={bad}")])
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(&format!("`{dotted}`")), "{bad}: {e}");
                let file = format!("[{section}]\n{key} = {bad}\n");
                let e = load_text(Some((&file, "f.toml")), &[])
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(&format!("`{dotted}`")), "{bad}: {e}");
            }
        }
        // Inside an array the element is named.
        let e = check_finite(&parse_literal("[1.0, nan]"), "a.b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`a.b[1]`"), "{e}");
    }

    #[test]
    fn a_key_twice_in_a_file_is_refused_and_the_later_set_wins() {
        for text in [
            "[train]\nsteps = 1\nsteps = 2\n",
            "[train]\nsteps = 1\n[train]\nlr = 0.1\n",
            "model = { layers = 1, layers = 2 }\n",
        ] {
            let e = load_text(Some((text, "twice.toml")), &[])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("twice.toml") && e.contains("duplicate"),
                "{text}: {e}"
            );
        }
        let c = load(None, &sets(&["train.steps=1", "train.steps=7"])).unwrap();
        assert_eq!(c.train.steps, 7);
    }

    #[test]
    fn comm_timeout_is_bounded_by_a_year() {
        let c = load(None, &sets(&["train.comm_timeout_s=31536000"])).unwrap();
        assert_eq!(c.train.comm_timeout_s, MAX_COMM_TIMEOUT_S);
        for big in ["1e300", "31536001"] {
            let e = load(None, &[format!("train.comm_timeout_s={big}")])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("`train.comm_timeout_s`") && e.contains("31536000"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_validation_pass_is_bounded_by_the_data() {
        let huge = ["data.val_every=1", "data.val_batches=1000000000"];
        let e = load(None, &sets(&huge)).unwrap_err().to_string();
        for part in ["`data.val_batches`", "8000000000 sequences", "(65536)"] {
            assert!(e.contains(part), "{part:?} not in {e}");
        }
        // Unused without validation.
        load(None, &sets(&["data.val_batches=1000000000"])).unwrap();
        let e = load(
            None,
            &sets(&["data.val_every=1", "data.val_batches=9223372036854775807"]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("more than 2^64"), "{e}");
        // Tokens: as many windows as a pass reads, not one more.
        let c = load(None, &sets(&["data.val_every=1", "data.val_batches=2"])).unwrap();
        c.validate_val_windows(16).unwrap();
        let e = c.validate_val_windows(15).unwrap_err().to_string();
        assert!(e.contains("16 sequences") && e.contains("(15)"), "{e}");
    }

    #[test]
    fn products_of_degrees_that_overflow_are_refused() {
        let e = load(
            None,
            &sets(&[
                "train.global_batch=4611686018427387904",
                "parallel.dp=4611686018427387904",
                "parallel.tp=4",
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`parallel.dp`") && e.contains("overflows"),
            "{e}"
        );
        let e = load(
            None,
            &sets(&[
                "parallel.pp=4",
                "parallel.schedule=interleaved",
                "parallel.virtual_stages=9223372036854775807",
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`parallel.virtual_stages`"), "{e}");
    }

    #[test]
    fn optimizer_keys_are_checked_and_named() {
        use merak_burn::train::{LrScheduleKind, OptimizerKind};
        let c = load(None, &[]).unwrap();
        assert_eq!(c.optimizer, merak_burn::train::OptimizerSettings::default());
        let c = load(
            None,
            &sets(&[
                "optimizer.kind=sgd",
                "optimizer.momentum=0.9",
                "optimizer.nesterov=true",
                "optimizer.schedule=wsd",
                "optimizer.decay_steps=20",
            ]),
        )
        .unwrap();
        assert_eq!(c.optimizer.kind, OptimizerKind::Sgd);
        assert_eq!(c.optimizer.schedule, LrScheduleKind::Wsd);
        let s = c.train_settings();
        assert_eq!((s.optimizer.momentum, s.optimizer.decay_steps), (0.9, 20));
        for (set, key, part) in [
            (vec!["optimizer.kind=lion"], "`optimizer.kind`", "lion"),
            (
                vec!["optimizer.kind=muon"],
                "`optimizer.kind`",
                "whole matrices",
            ),
            (
                vec!["optimizer.schedule=step"],
                "`optimizer.schedule`",
                "step",
            ),
            (
                vec!["optimizer.kind=sgd", "optimizer.momentum=1.5"],
                "`optimizer.momentum`",
                "1.5 must be in [0, 1)",
            ),
            (
                vec!["optimizer.momentum=0.9"],
                "`optimizer.momentum`",
                "does not use it",
            ),
            (
                vec!["optimizer.kind=sgd", "optimizer.nesterov=true"],
                "`optimizer.nesterov`",
                "momentum > 0",
            ),
            (
                vec!["optimizer.schedule=wsd"],
                "`optimizer.decay_steps`",
                "at least 1",
            ),
            (
                vec!["optimizer.schedule=linear", "train.warmup_steps=300"],
                "`train.warmup_steps`",
                "longer than the run",
            ),
            (
                vec!["optimizer.kind=rmsprop", "optimizer.alpha=-0.5"],
                "`optimizer.alpha`",
                "-0.5",
            ),
        ] {
            let e = load(None, &sets(&set)).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(part), "{set:?}: {e}");
        }
        let file = "[optimizer]\nkind = \"adagrad\"\nlr_decay = 0.01\n";
        let c = load_text(Some((file, "f.toml")), &[]).unwrap();
        assert_eq!(c.optimizer.kind, OptimizerKind::AdaGrad);
    }

    #[test]
    fn the_shipped_config_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt-tiny.toml");
        let c = load(Some(&path), &[]).unwrap();
        assert_eq!(c.model.gpt.heads, 4);
    }
}
