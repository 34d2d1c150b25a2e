//! Sharded checkpoints that load under any dp/tp layout.
//!
//! A checkpoint is a folder `step-NNNNNNNN` holding one safetensors shard per rank that has
//! something to write, and a `manifest.json` listing every shard with its size and SHA-256, the
//! layout it was written under, every parameter's full shape and split ([`ShardKind`]), and the
//! caller's own state (config, data position, ...). Parameters are written by the ranks of the
//! first DP replica; AdamW moments by every rank that holds some (with ZeRO-1 each DP rank
//! holds its own part).
//!
//! Writing is atomic: the shards go into a hidden temporary folder, the manifest is written
//! last, and the folder is renamed into place; a job that dies mid-write leaves the previous
//! checkpoint as it was. The file `latest` in the checkpoint root names the newest one.
//!
//! Reading checks every shard's size and checksum, puts every tensor back together at full
//! size, and cuts this rank's piece for the layout of the new run. Each rank reads every
//! shard: simple, and fine for the model sizes one host trains; a large multi-node run would
//! read only the shards that overlap its own.

mod error;
pub mod shard_file;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use error::CheckpointError;
pub use shard_file::NamedTensor;
pub use state::{AdamWRecords, LocalParam, Moments};

use crate::grid::{Layout, ProcessGrid};
use crate::tensor_parallel::{Shard, ShardKind};
use state::ParamShape;

/// The format tag written into every manifest.
pub const FORMAT: &str = "merak-checkpoint/1";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The file in a checkpoint root naming the newest checkpoint folder.
pub const LATEST: &str = "latest";

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
}

/// Whether `name` is one plain file or folder name: no separator, not `.` or `..`, not
/// absolute, so that joining it to a folder stays inside that folder.
fn plain_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(n)), None) if n == name
    )
}

/// What a rank contributes to a checkpoint.
pub struct RankState {
    /// This rank's parameter shards (written by the first DP replica only).
    pub params: Vec<LocalParam>,
    /// This rank's AdamW moments, by parameter name (possibly a ZeRO-1 part).
    pub moments: state::NamedMoments,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `bytes` to `path` and flushes them to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(CheckpointError::io(path))?;
    f.write_all(bytes).map_err(CheckpointError::io(path))?;
    f.sync_all().map_err(CheckpointError::io(path))
}

/// Replaces `path` atomically by a file holding `bytes` (write a temporary file, rename).
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    write_synced(&tmp, bytes)?;
    std::fs::rename(&tmp, path).map_err(CheckpointError::io(path))
}

/// The folder name of the checkpoint after `step` steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn shard_file_name(tp: usize, dp: usize, pp: usize) -> String {
    format!("tp{tp:02}-dp{dp:03}-pp{pp:02}.safetensors")
}

/// Writes a checkpoint of `state` after `step` steps into `root/step-NNNNNNNN`, collectively
/// over the whole grid, and keeps the newest `keep` checkpoints (0 keeps all). Every rank of
/// the grid must call it; `root` must be visible to every rank (one host or a shared file
/// system). Returns the checkpoint folder.
pub fn save(
    root: &Path,
    step: usize,
    keep: usize,
    state: &RankState,
    extra: serde_json::Value,
    grid: &ProcessGrid,
) -> Result<PathBuf, CheckpointError> {
    let world = grid.world.comm()?;
    let final_dir = root.join(step_dir_name(step));
    let tmp_dir = root.join(format!(".{}.partial", step_dir_name(step)));
    if grid.rank == 0 {
        if tmp_dir.exists() {
            std::fs::remove_dir_all(&tmp_dir).map_err(CheckpointError::io(&tmp_dir))?;
        }
        std::fs::create_dir_all(&tmp_dir).map_err(CheckpointError::io(&tmp_dir))?;
    }
    world.barrier()?;

    let c = grid.coords;
    let mut tensors = Vec::new();
    if c.dp == 0 {
        tensors.extend(state.params.iter().map(|p| NamedTensor {
            name: format!("param/{}", p.name),
            shape: p.shape.clone(),
            values: p.values.clone(),
        }));
    }
    let mut times = BTreeMap::new();
    let shapes: HashMap<&str, &[usize]> = state
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    for (name, m) in &state.moments {
        let shape = shapes
            .get(name.as_str())
            .map(|s| s.to_vec())
            .ok_or_else(|| CheckpointError::Mismatch {
                name: name.clone(),
                reason: "optimizer state for a parameter the model does not have".into(),
            })?;
        for (kind, values) in [("m1", &m.m1), ("m2", &m.m2)] {
            tensors.push(NamedTensor {
                name: format!("{kind}/{name}"),
                shape: shape.clone(),
                values: values.clone(),
            });
        }
        times.insert(name.clone(), m.time);
    }
    if !tensors.is_empty() {
        let file = shard_file_name(c.tp, c.dp, c.pp);
        let meta = HashMap::from([(
            "adamw_time".to_string(),
            serde_json::to_string(&times).unwrap_or_default(),
        )]);
        let bytes =
            shard_file::encode(&tensors, meta).map_err(|reason| CheckpointError::Corrupt {
                file: tmp_dir.join(&file),
                reason,
            })?;
        write_synced(&tmp_dir.join(&file), &bytes)?;
        let entry = FileEntry {
            file: file.clone(),
            bytes: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
            tp: c.tp,
            dp: c.dp,
        };
        let sum = tmp_dir.join(format!("{file}.entry.json"));
        write_synced(&sum, &serde_json::to_vec(&entry).unwrap_or_default())?;
    }
    // Every rank of the first DP replica names its parameters (pipeline stages hold different
    // ones); rank 0 lists their union in the manifest.
    if c.dp == 0 {
        let tp = grid.layout.tp;
        let entries: Vec<ParamEntry> = state
            .params
            .iter()
            .map(|p| {
                let kind = p.split;
                ParamEntry {
                    name: p.name.clone(),
                    shape: kind.full_shape(&p.shape, tp),
                    shard: kind,
                }
            })
            .collect();
        let path = tmp_dir.join(format!("params-tp{:02}-pp{:02}.json", c.tp, c.pp));
        write_synced(&path, &serde_json::to_vec(&entries).unwrap_or_default())?;
    }
    world.barrier()?;

    if grid.rank == 0 {
        let mut files = Vec::new();
        let mut param_lists: Vec<(PathBuf, Vec<ParamEntry>)> = Vec::new();
        let listing = std::fs::read_dir(&tmp_dir).map_err(CheckpointError::io(&tmp_dir))?;
        for item in listing {
            let path = item.map_err(CheckpointError::io(&tmp_dir))?.path();
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if name.starts_with("params-") && name.ends_with(".json") {
                let text = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
                let list: Vec<ParamEntry> =
                    serde_json::from_slice(&text).map_err(|e| CheckpointError::BadManifest {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                std::fs::remove_file(&path).map_err(CheckpointError::io(&path))?;
                param_lists.push((path, list));
            } else if name.ends_with(".entry.json") {
                let text = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
                let entry: FileEntry =
                    serde_json::from_slice(&text).map_err(|e| CheckpointError::BadManifest {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                files.push(entry);
                std::fs::remove_file(&path).map_err(CheckpointError::io(&path))?;
            }
        }
        files.sort_by(|a, b| a.file.cmp(&b.file));
        // tp00 before tp01 and pp00 before pp01: the union in stage order, each name once.
        param_lists.sort_by(|a, b| a.0.cmp(&b.0));
        let mut params: Vec<ParamEntry> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (_, list) in param_lists {
            for p in list {
                if seen.insert(p.name.clone()) {
                    params.push(p);
                }
            }
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            step,
            layout: grid.layout,
            params,
            files,
            extra,
        };
        let text = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
        write_synced(&tmp_dir.join(MANIFEST), &text)?;
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir).map_err(CheckpointError::io(&final_dir))?;
        }
        std::fs::rename(&tmp_dir, &final_dir).map_err(CheckpointError::io(&final_dir))?;
        write_file_atomically(&root.join(LATEST), step_dir_name(step).as_bytes())?;
        prune(root, keep)?;
    }
    world.barrier()?;
    Ok(final_dir)
}

/// Removes all but the newest `keep` complete checkpoints (and any abandoned partial ones).
fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let mut steps = Vec::new();
    for item in std::fs::read_dir(root).map_err(CheckpointError::io(root))? {
        let path = item.map_err(CheckpointError::io(root))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with(".step-") && name.ends_with(".partial") {
            std::fs::remove_dir_all(&path).map_err(CheckpointError::io(&path))?;
        } else if name.starts_with("step-") && path.join(MANIFEST).exists() {
            steps.push(path);
        }
    }
    steps.sort();
    if keep > 0 && steps.len() > keep {
        for old in &steps[..steps.len() - keep] {
            std::fs::remove_dir_all(old).map_err(CheckpointError::io(old))?;
        }
    }
    Ok(())
}

/// A checkpoint on disk whose manifest has been read.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

/// A rank's pieces of a checkpoint: parameters and AdamW moments by the model's names.
pub type LocalPieces = (HashMap<String, Vec<f32>>, HashMap<String, Moments>);

/// Every tensor of a checkpoint at full size.
#[derive(Clone, Debug, Default)]
pub struct FullState {
    /// Parameters by name.
    pub params: HashMap<String, Vec<f32>>,
    /// AdamW moments by name (absent for parameters never stepped).
    pub moments: HashMap<String, Moments>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a `step-*` folder, or a checkpoint root whose `latest`
    /// file names one.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let mut dir = path.to_path_buf();
        if !dir.join(MANIFEST).exists() && dir.join(LATEST).exists() {
            let latest = dir.join(LATEST);
            let name = std::fs::read_to_string(&latest).map_err(CheckpointError::io(&latest))?;
            if !plain_name(name.trim()) {
                return Err(CheckpointError::BadManifest {
                    path: latest,
                    reason: format!("names {:?}, not a checkpoint folder beside it", name.trim()),
                });
            }
            dir = dir.join(name.trim());
        }
        let manifest_path = dir.join(MANIFEST);
        if !dir.is_dir() {
            return Err(CheckpointError::Io {
                path: dir,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such folder"),
            });
        }
        if !manifest_path.exists() {
            return Err(CheckpointError::MissingManifest { dir });
        }
        let bad = |reason: String| CheckpointError::BadManifest {
            path: manifest_path.clone(),
            reason,
        };
        let text = std::fs::read(&manifest_path).map_err(CheckpointError::io(&manifest_path))?;
        let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        if manifest.format != FORMAT {
            return Err(bad(format!(
                "format {:?}, this merak reads {FORMAT:?}",
                manifest.format
            )));
        }
        // The manifest is untrusted input: a shard is a file of this folder, nothing else.
        if let Some(f) = manifest.files.iter().find(|f| !plain_name(&f.file)) {
            return Err(bad(format!(
                "shard name {:?} is not a file name inside the checkpoint folder",
                f.file
            )));
        }
        let ckpt = Checkpoint { dir, manifest };
        // Cheap checks first, so a damaged checkpoint is reported before anything is built.
        for f in &ckpt.manifest.files {
            let path = ckpt.dir.join(&f.file);
            let meta = std::fs::metadata(&path)
                .map_err(|_| CheckpointError::MissingShard { file: path.clone() })?;
            if meta.len() != f.bytes {
                return Err(CheckpointError::Truncated {
                    file: path,
                    expected: f.bytes,
                    got: meta.len(),
                });
            }
        }
        Ok(ckpt)
    }

    /// Reads and verifies every shard and puts every tensor back together at full size.
    pub fn read_full(&self) -> Result<FullState, CheckpointError> {
        let m = &self.manifest;
        let tp = m.layout.tp;
        // pieces[name][tp rank]
        let mut params: HashMap<String, Vec<Option<Vec<f32>>>> = HashMap::new();
        let mut m1: HashMap<String, Vec<Option<Vec<f32>>>> = HashMap::new();
        let mut m2: HashMap<String, Vec<Option<Vec<f32>>>> = HashMap::new();
        let mut times: HashMap<String, usize> = HashMap::new();
        for f in &m.files {
            let path = self.dir.join(&f.file);
            let bytes = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
            if bytes.len() as u64 != f.bytes {
                return Err(CheckpointError::Truncated {
                    file: path,
                    expected: f.bytes,
                    got: bytes.len() as u64,
                });
            }
            let sum = sha256_hex(&bytes);
            if sum != f.sha256 {
                return Err(CheckpointError::Checksum {
                    file: path,
                    expected: f.sha256.clone(),
                    got: sum,
                });
            }
            if f.tp >= tp {
                return Err(CheckpointError::Corrupt {
                    file: path,
                    reason: format!("tp rank {} in a checkpoint with tp = {tp}", f.tp),
                });
            }
            let (tensors, meta) = shard_file::decode(&bytes, &path)?;
            if let Some(t) = meta.get("adamw_time") {
                let t: BTreeMap<String, usize> =
                    serde_json::from_str(t).map_err(|e| CheckpointError::Corrupt {
                        file: path.clone(),
                        reason: format!("adamw_time: {e}"),
                    })?;
                times.extend(t);
            }
            for t in tensors {
                let (map, name) = if let Some(n) = t.name.strip_prefix("param/") {
                    (&mut params, n)
                } else if let Some(n) = t.name.strip_prefix("m1/") {
                    (&mut m1, n)
                } else if let Some(n) = t.name.strip_prefix("m2/") {
                    (&mut m2, n)
                } else {
                    continue;
                };
                map.entry(name.to_string())
                    .or_insert_with(|| vec![None; tp])[f.tp] = Some(t.values);
            }
        }
        let mut full = FullState::default();
        for p in &m.params {
            let merge = |pieces: Option<&Vec<Option<Vec<f32>>>>, what: &str| {
                let missing = || CheckpointError::Mismatch {
                    name: p.name.clone(),
                    reason: format!("{what} missing from the shards"),
                };
                let pieces = pieces
                    .ok_or_else(missing)?
                    .iter()
                    .map(|x| x.clone().ok_or_else(missing))
                    .collect::<Result<Vec<_>, _>>()?;
                let values = p.shard.merge(&pieces, &p.shape);
                if values.len() != p.shape.iter().product::<usize>() {
                    return Err(CheckpointError::Mismatch {
                        name: p.name.clone(),
                        reason: format!(
                            "{what}: {} values for the shape {:?}",
                            values.len(),
                            p.shape
                        ),
                    });
                }
                Ok(values)
            };
            full.params
                .insert(p.name.clone(), merge(params.get(&p.name), "the parameter")?);
            if m1.contains_key(&p.name) {
                let moments = Moments {
                    time: times.get(&p.name).copied().unwrap_or(0),
                    m1: merge(m1.get(&p.name), "the first moment")?,
                    m2: merge(m2.get(&p.name), "the second moment")?,
                };
                full.moments.insert(p.name.clone(), moments);
            }
        }
        Ok(full)
    }
}

impl FullState {
    /// This rank's pieces of every tensor for a model whose parameters are `shapes` (name,
    /// local shape, split) on a TP group described by `shard`: (parameters, moments), by the model's
    /// names. `copies` lists `(copy, original)` names of tied parameters: a copy is loaded from
    /// its original. Fails naming the parameter if the model and the checkpoint disagree on a
    /// name, shape or split. A checkpoint parameter that this rank does not hold (another
    /// pipeline stage) is skipped; [`Manifest::check_covers`] checks a whole model.
    pub fn cut_for(
        &self,
        manifest: &Manifest,
        shapes: &[ParamShape],
        shard: Shard,
        copies: &[(String, String)],
    ) -> Result<LocalPieces, CheckpointError> {
        let entries: HashMap<&str, &ParamEntry> = manifest
            .params
            .iter()
            .map(|p| (p.name.as_str(), p))
            .collect();
        cut_pieces(
            &entries,
            &|name| self.params.get(name).map(Vec::as_slice),
            &self.moments,
            shapes,
            shard,
            copies,
        )
    }
}

/// The original of `name` when it is a tied copy (`copies` lists `(copy, original)`).
fn source_of<'a>(name: &'a str, copies: &'a [(String, String)]) -> &'a str {
    copies
        .iter()
        .find(|(copy, _)| copy == name)
        .map_or(name, |(_, original)| original.as_str())
}

/// This rank's pieces of the full tensors described by `entries` (parameters from `param`,
/// moments from `moments`) for the model parameters `shapes`; see [`FullState::cut_for`].
fn cut_pieces<'a>(
    entries: &HashMap<&str, &ParamEntry>,
    param: &dyn Fn(&str) -> Option<&'a [f32]>,
    moments: &HashMap<String, Moments>,
    shapes: &[ParamShape],
    shard: Shard,
    copies: &[(String, String)],
) -> Result<LocalPieces, CheckpointError> {
    let mut params = HashMap::new();
    let mut local_moments = HashMap::new();
    for ParamShape {
        name,
        shape: local,
        split: kind,
        ..
    } in shapes
    {
        let kind = *kind;
        let source = source_of(name, copies);
        let entry = entries
            .get(source)
            .ok_or_else(|| CheckpointError::Mismatch {
                name: name.clone(),
                reason: "the model has it, the checkpoint does not (a different model?)".into(),
            })?;
        let full_shape = kind.full_shape(local, shard.size);
        if full_shape != entry.shape {
            return Err(CheckpointError::Mismatch {
                name: name.clone(),
                reason: format!(
                    "shape {:?} in the checkpoint, {full_shape:?} in the model",
                    entry.shape
                ),
            });
        }
        if kind != entry.shard {
            return Err(CheckpointError::Mismatch {
                name: name.clone(),
                reason: format!(
                    "split {:?} in the checkpoint, {kind:?} in the model",
                    entry.shard
                ),
            });
        }
        let cut = |v: &[f32]| kind.cut(v, &entry.shape, shard);
        if let Some(v) = param(source) {
            params.insert(name.clone(), cut(v));
        }
        if let Some(m) = moments.get(source) {
            local_moments.insert(
                name.clone(),
                Moments {
                    time: m.time,
                    m1: cut(&m.m1),
                    m2: cut(&m.m2),
                },
            );
        }
    }
    Ok((params, local_moments))
}

/// This rank's pieces of full-size parameters that come without a manifest (pretrained
/// weights read from another format), for a model whose parameters are `shapes` (as
/// [`state::param_shapes`] lists them) on a TP group described by `shard`.
/// `full` maps the model's names to (full shape, row-major values); each parameter is split
/// the way the model declares it split and cut like a checkpoint's
/// ([`FullState::cut_for`]), so a vocabulary-parallel token table is padded with zero rows.
/// `copies` lists `(copy, original)` names of tied parameters: a copy is cut from its
/// original. Fails naming the parameter if one of `shapes` is missing from `full` or has
/// another full shape; entries of `full` that this rank does not hold (other pipeline stages)
/// are skipped. The result goes to [`state::assign_params`].
pub fn cut_full_params(
    full: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    shapes: &[ParamShape],
    shard: Shard,
    copies: &[(String, String)],
) -> Result<HashMap<String, Vec<f32>>, CheckpointError> {
    let entries: Vec<ParamEntry> = shapes
        .iter()
        .filter_map(|p| {
            let source = source_of(&p.name, copies);
            full.get(source).map(|(shape, _)| ParamEntry {
                name: source.to_string(),
                shape: shape.clone(),
                shard: p.split,
            })
        })
        .collect();
    let entries: HashMap<&str, &ParamEntry> =
        entries.iter().map(|p| (p.name.as_str(), p)).collect();
    let (params, _) = cut_pieces(
        &entries,
        &|name| full.get(name).map(|(_, v)| v.as_slice()),
        &HashMap::new(),
        shapes,
        shard,
        copies,
    )?;
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::ParamId;

    #[test]
    fn only_plain_names_stay_inside_a_folder() {
        for ok in ["params-tp00-pp00.safetensors", "step-00000005", "a..b"] {
            assert!(plain_name(ok), "{ok}");
        }
        for bad in [
            "../../x.safetensors",
            "..",
            ".",
            "",
            "/etc/passwd",
            "sub/x.safetensors",
            "./x",
        ] {
            assert!(!plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn full_params_are_cut_the_way_the_model_splits_them() {
        // tp rank 1 of 2: a padded vocabulary table, its tied copy, column and row splits.
        let vocab = ShardKind::VocabRows { vocab: 5 };
        let shard = Shard { rank: 1, size: 2 };
        let param = |name: &str, shape: Vec<usize>, split| ParamShape {
            name: name.to_string(),
            id: ParamId::new(),
            shape,
            split,
        };
        let shapes = vec![
            param("wte", vec![3, 2], vocab),
            param("head", vec![3, 2], vocab),
            param("qkv", vec![2, 3], ShardKind::Columns { segments: 3 }),
            param("proj", vec![2, 2], ShardKind::Rows),
            param("ln", vec![2], ShardKind::Replicated),
        ];
        let values = |n: usize| (0..n).map(|i| i as f32 + 1.0).collect::<Vec<f32>>();
        let mut full = HashMap::from([
            ("wte".to_string(), (vec![5, 2], values(10))),
            ("qkv".to_string(), (vec![2, 6], values(12))),
            ("proj".to_string(), (vec![4, 2], values(8))),
            ("ln".to_string(), (vec![2], values(2))),
            ("elsewhere".to_string(), (vec![7], values(7))),
        ]);
        let copies = [("head".to_string(), "wte".to_string())];
        let cut = cut_full_params(&full, &shapes, shard, &copies).unwrap();
        // Rows 3, 4 and a zero row of padding.
        assert_eq!(cut["wte"], vec![7.0, 8.0, 9.0, 10.0, 0.0, 0.0]);
        assert_eq!(cut["head"], cut["wte"]);
        // [q0 q1 | k0 k1 | v0 v1] per row: rank 1 holds q1 k1 v1.
        assert_eq!(cut["qkv"], vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
        assert_eq!(cut["proj"], vec![5.0, 6.0, 7.0, 8.0]);
        assert_eq!(cut["ln"], vec![1.0, 2.0]);
        assert_eq!(cut.len(), 5, "parameters of other stages are skipped");

        full.get_mut("proj").unwrap().0 = vec![2, 4];
        let e = cut_full_params(&full, &shapes, shard, &copies).unwrap_err();
        assert!(e.to_string().contains("proj"), "{e}");
        full.get_mut("proj").unwrap().0 = vec![4, 2];
        full.remove("ln");
        let e = cut_full_params(&full, &shapes, shard, &copies).unwrap_err();
        assert!(e.to_string().contains("ln"), "{e}");
    }
}
