//! The manifest of a checkpoint (`manifest.json`) and the checks that make it safe to act on:
//! it is untrusted input, so every name must stay inside its folder and every number must fit
//! the files it describes before anything is allocated from it.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{CheckpointError, RunId, plain_name};
use crate::grid::Layout;
use crate::tensor_parallel::ShardKind;

/// The format tag written into every manifest.
pub const FORMAT: &str = "merak-checkpoint/1";

/// The largest degree of any axis a manifest may claim (far beyond any machine).
pub const MAX_DEGREE: usize = 1 << 20;
/// The largest step a manifest may claim (keeps every product with a batch size in range).
pub const MAX_STEP: usize = 1 << 40;

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
    /// Checks that the checkpoint's parameters are exactly `names` (the whole model's, all
    /// stages together, without tied copies).
    pub fn check_covers(&self, names: &[String]) -> Result<(), CheckpointError> {
        if let Some(extra) = self.params.iter().find(|p| !names.contains(&p.name)) {
            return Err(CheckpointError::Mismatch {
                name: extra.name.clone(),
                reason: "the checkpoint has it, the model does not (a different model?)".into(),
            });
        }
        if let Some(missing) = names
            .iter()
            .find(|n| !self.params.iter().any(|p| &p.name == *n))
        {
            return Err(CheckpointError::Mismatch {
                name: missing.clone(),
                reason: "the model has it, the checkpoint does not (a different model?)".into(),
            });
        }
        Ok(())
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
