//! The manifest of a checkpoint (`manifest.json`) and the checks that make it safe to act on:
//! it is untrusted input, so every name must stay inside its folder and every number must fit
//! the files it describes before anything is allocated from it.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::state::ParamShape;
use super::{CheckpointError, RunId, plain_name};
use crate::grid::Layout;
use crate::tensor_parallel::ShardKind;

/// The format tag written into every manifest.
pub const FORMAT: &str = "merak-checkpoint/1";

/// The largest degree of any axis a manifest may claim (far beyond any machine).
pub const MAX_DEGREE: usize = 1 << 20;
/// The largest step a manifest may claim (keeps every product with a batch size in range).
pub const MAX_STEP: usize = 1 << 40;

/// The keys merak writes into a manifest, outside `extra`. Manifests of earlier versions lack
/// some (`run`, `layout.cp`), which is fine; any other key is refused by
/// [`Manifest::check_keys`].
const TOP_KEYS: &[&str] = &[
    "format", "run", "step", "layout", "params", "files", "extra",
];
/// The keys of `layout`.
const LAYOUT_KEYS: &[&str] = &["dp", "tp", "cp", "pp"];
/// The keys of each entry of `params`.
const PARAM_KEYS: &[&str] = &["name", "shape", "shard"];
/// The keys of each entry of `files`.
const FILE_KEYS: &[&str] = &["file", "bytes", "sha256", "tp", "dp"];
/// The keys of `extra.optimizer`, which the trainer writes into every manifest (absent in
/// manifests written before optimizers other than AdamW).
const OPTIMIZER_KEYS: &[&str] = &["kind", "state"];
/// The keys the trainer writes into `extra` besides its caller's ([`Manifest::check_extra`]),
/// with the keys of each.
pub const TRAINER_EXTRA_KEYS: [(&str, &[&str]); 3] = [
    ("data", &["samples_consumed", "order"]),
    ("rng", &["seed", "note"]),
    ("optimizer", OPTIMIZER_KEYS),
];

/// The keys of a parameter's split (`shard`), by its kind.
fn shard_keys(kind: Option<&str>) -> &'static [&'static str] {
    match kind {
        Some("columns") => &["kind", "segments"],
        Some("vocab_rows") => &["kind", "vocab"],
        _ => &["kind"],
    }
}

/// The first key of the object `value` (at `path` in the manifest) that is not one of
/// `known`, as the reason to refuse it; nothing when `value` is not an object.
fn unknown_in(value: &serde_json::Value, path: &str, known: &[&str]) -> Result<(), String> {
    let Some(object) = value.as_object() else {
        return Ok(());
    };
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(format!(
            "unknown key `{path}{key}`: merak writes {} there (a manifest of another version, or edited?)",
            known.join(", ")
        )),
        None => Ok(()),
    }
}

/// Checks that the stored parameters `stored` are exactly `names`, naming a few of those on
/// either side and counting them.
fn same_names(stored: &[ParamEntry], names: &[String]) -> Result<(), CheckpointError> {
    let model: HashSet<&str> = names.iter().map(String::as_str).collect();
    let held: HashSet<&str> = stored.iter().map(|p| p.name.as_str()).collect();
    let extra: Vec<String> = (stored.iter())
        .filter(|p| !model.contains(p.name.as_str()))
        .map(|p| p.name.clone())
        .collect();
    let missing: Vec<String> = (names.iter())
        .filter(|n| !held.contains(n.as_str()))
        .cloned()
        .collect();
    match extra.is_empty() && missing.is_empty() {
        true => Ok(()),
        false => Err(CheckpointError::Unmatched { extra, missing }),
    }
}

/// Checks stored parameters (`stored`: a checkpoint's, or pretrained weights' with the
/// model's splits) against a whole model built in one process (`model`: every parameter at
/// full size with its split, all stages, without tied copies): the same names, and for each
/// the same full shape and split. The error names the first parameter that differs with
/// both values, and counts the others.
pub fn check_model(stored: &[ParamEntry], model: &[ParamShape]) -> Result<(), CheckpointError> {
    let names: Vec<String> = model.iter().map(|p| p.name.clone()).collect();
    same_names(stored, &names)?;
    let shapes: std::collections::HashMap<&str, &ParamShape> =
        model.iter().map(|p| (p.name.as_str(), p)).collect();
    let differ = |entry: &&ParamEntry| {
        let p = shapes.get(entry.name.as_str())?;
        if p.shape != entry.shape {
            Some(format!(
                "shape {:?} in the checkpoint, {:?} in the model",
                entry.shape, p.shape
            ))
        } else if p.split != entry.shard {
            Some(format!(
                "split {:?} in the checkpoint, {:?} in the model",
                entry.shard, p.split
            ))
        } else {
            None
        }
    };
    let mut differing = stored.iter().filter(|e| differ(e).is_some());
    let Some(first) = differing.next() else {
        return Ok(());
    };
    let more = match differing.count() {
        0 => String::new(),
        n => format!("; {n} more parameters differ too"),
    };
    Err(CheckpointError::Mismatch {
        name: first.name.clone(),
        reason: format!("{}{more}", differ(&first).unwrap_or_default()),
    })
}

/// One parameter in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Path in the module tree.
    pub name: String,
    /// The full (single-process) shape.
    pub shape: Vec<usize>,
    /// How it was split across the TP group.
    pub shard: ShardKind,
}

/// One shard file in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint folder.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the content, lowercase hex.
    pub sha256: String,
    /// TP rank of the writer.
    pub tp: usize,
    /// DP rank of the writer.
    pub dp: usize,
}

/// The manifest of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// The lineage of the run that wrote it (absent in checkpoints written before runs had
    /// ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// Optimizer steps completed.
    pub step: usize,
    /// The layout the checkpoint was written under.
    pub layout: Layout,
    /// Every parameter, in the model's visit order.
    pub params: Vec<ParamEntry>,
    /// Every shard file.
    pub files: Vec<FileEntry>,
    /// The caller's state (for `merak train`: the config, data position, RNG seed).
    pub extra: serde_json::Value,
}

impl Manifest {
    /// Parses the text of a manifest (read from `path`), refusing any key merak does not
    /// write (see [`check_keys`](Self::check_keys)).
    pub fn parse(text: &[u8], path: &Path) -> Result<Manifest, CheckpointError> {
        let bad = |reason: String| CheckpointError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
        Self::check_keys(&value).map_err(bad)?;
        serde_json::from_value(value).map_err(|e| bad(e.to_string()))
    }

    /// Refuses a key of a parsed manifest that merak does not write, naming its path
    /// (`layout.ep`, `params[3].dtype`): a key this version does not know may hold something
    /// it would silently ignore. `extra` belongs to the writer's caller, except
    /// `extra.optimizer` (see [`check_extra`](Self::check_extra) for the rest).
    pub fn check_keys(value: &serde_json::Value) -> Result<(), String> {
        unknown_in(value, "", TOP_KEYS)?;
        unknown_in(&value["layout"], "layout.", LAYOUT_KEYS)?;
        let list = |key: &str| value[key].as_array().map_or(&[][..], Vec::as_slice);
        for (i, p) in list("params").iter().enumerate() {
            unknown_in(p, &format!("params[{i}]."), PARAM_KEYS)?;
            let shard = &p["shard"];
            let kind = shard["kind"].as_str();
            unknown_in(shard, &format!("params[{i}].shard."), shard_keys(kind))?;
        }
        for (i, f) in list("files").iter().enumerate() {
            unknown_in(f, &format!("files[{i}]."), FILE_KEYS)?;
        }
        unknown_in(
            &value["extra"]["optimizer"],
            "extra.optimizer.",
            OPTIMIZER_KEYS,
        )
    }

    /// Refuses a key of `extra` that neither the trainer ([`TRAINER_EXTRA_KEYS`], whose own
    /// keys are checked too) nor the caller (`caller`: the keys its
    /// [`CheckpointPolicy::extra`](crate::train::CheckpointPolicy::extra) writes) writes;
    /// `path` names the manifest. `merak train` passes `["config"]`.
    pub fn check_extra(&self, path: &Path, caller: &[&str]) -> Result<(), CheckpointError> {
        let bad = |reason: String| CheckpointError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        let Some(extra) = self.extra.as_object() else {
            return match self.extra.is_null() {
                true => Ok(()),
                false => Err(bad("`extra` is not a map of keys".into())),
            };
        };
        let trainer = TRAINER_EXTRA_KEYS.map(|(k, _)| k);
        let known: Vec<&str> = caller.iter().copied().chain(trainer).collect();
        unknown_in(&self.extra, "extra.", &known).map_err(bad)?;
        for (key, keys) in TRAINER_EXTRA_KEYS {
            if let Some(v) = extra.get(key).filter(|_| !caller.contains(&key)) {
                unknown_in(v, &format!("extra.{key}."), keys).map_err(bad)?;
            }
        }
        Ok(())
    }

    /// The optimizer that wrote the checkpoint and what each of its two state tensors holds
    /// (`extra.optimizer`, written by the trainer; `"-"`: nothing). A checkpoint that does not
    /// name its optimizer was written by AdamW.
    pub fn stored_optimizer(&self) -> (String, Vec<String>) {
        let entry = self.extra.get("optimizer");
        let kind = entry
            .and_then(|o| o.get("kind"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("adamw")
            .to_string();
        let state = entry
            .and_then(|o| o.get("state"))
            .and_then(serde_json::Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|v| v.as_str().unwrap_or("?").to_string())
                    .collect()
            })
            .unwrap_or_else(|| vec!["first moment".into(), "second moment".into()]);
        (kind, state)
    }

    /// Checks that the checkpoint's parameters are exactly `names` (the whole model's, all
    /// stages together, without tied copies); the error names a few of those on either side
    /// and counts them.
    pub fn check_covers(&self, names: &[String]) -> Result<(), CheckpointError> {
        same_names(&self.params, names)
    }

    /// Checks the checkpoint against a whole model built in one process (see
    /// [`check_model`]): what a run checks before it builds anything.
    pub fn check_model(&self, model: &[ParamShape]) -> Result<(), CheckpointError> {
        check_model(&self.params, model)
    }

    /// Checks everything that can be checked without reading the shards: the format, the
    /// layout's degrees, file names and ranks, and every parameter's shape and split against
    /// the layout and against the bytes the files hold. `path` names the manifest in errors.
    pub fn validate(&self, path: &Path) -> Result<(), CheckpointError> {
        let bad = |reason: String| CheckpointError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        if self.format != FORMAT {
            return Err(bad(format!(
                "format {:?}, this merak reads {FORMAT:?}",
                self.format
            )));
        }
        if self.step > MAX_STEP {
            return Err(bad(format!(
                "step {} is beyond any run (at most {MAX_STEP})",
                self.step
            )));
        }
        self.validate_layout().map_err(bad)?;
        let bytes = self.validate_files().map_err(bad)?;
        self.validate_params(bytes).map_err(bad)
    }

    fn validate_layout(&self) -> Result<(), String> {
        let Layout { dp, tp, cp, pp } = self.layout;
        for (axis, d) in [("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp)] {
            if !(1..=MAX_DEGREE).contains(&d) {
                return Err(format!("layout {axis} = {d}: must be 1 to {MAX_DEGREE}"));
            }
        }
        let world = (dp.checked_mul(cp))
            .and_then(|n| n.checked_mul(tp))
            .and_then(|n| n.checked_mul(pp));
        if world.is_none_or(|w| w < self.files.len()) {
            return Err(format!(
                "{} shard files for a layout of dp = {dp} x cp = {cp} x tp = {tp} x pp = {pp} ranks",
                self.files.len()
            ));
        }
        Ok(())
    }

    /// Checks the file entries; returns the bytes they hold together.
    fn validate_files(&self) -> Result<u64, String> {
        let mut names = HashSet::new();
        let mut total = 0u64;
        for f in &self.files {
            if !plain_name(&f.file) {
                return Err(format!(
                    "shard name {:?} is not a file name inside the checkpoint folder",
                    f.file
                ));
            }
            if !names.insert(f.file.as_str()) {
                return Err(format!("shard {:?} is listed twice", f.file));
            }
            if f.tp >= self.layout.tp || f.dp >= self.layout.replicas() {
                return Err(format!(
                    "shard {:?} of tp rank {} and dp rank {} in a layout of tp = {} and dp x cp = {}",
                    f.file,
                    f.tp,
                    f.dp,
                    self.layout.tp,
                    self.layout.replicas()
                ));
            }
            total = total
                .checked_add(f.bytes)
                .ok_or_else(|| format!("shard sizes add up to more than {} bytes", u64::MAX))?;
        }
        Ok(total)
    }

    /// Checks names, shapes and splits; the parameters' values must fit in `bytes`.
    fn validate_params(&self, bytes: u64) -> Result<(), String> {
        let mut names = HashSet::new();
        let mut values = 0u64;
        for p in &self.params {
            if !names.insert(p.name.as_str()) {
                return Err(format!("parameter {} is listed twice", p.name));
            }
            let piece = p
                .shard
                .piece_len(&p.shape, self.layout.tp)
                .map_err(|e| format!("parameter {}: {e}", p.name))?;
            // Every TP rank's piece of it is stored once.
            let stored = (piece as u64).checked_mul(self.layout.tp as u64);
            values = stored
                .and_then(|s| values.checked_add(s))
                .ok_or_else(|| format!("parameter {}: its size overflows", p.name))?;
        }
        if values.checked_mul(4).is_none_or(|need| need > bytes) {
            return Err(format!(
                "its parameters need {values} f32 values, but its shards hold {bytes} bytes"
            ));
        }
        Ok(())
    }
}
