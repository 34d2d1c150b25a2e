//! Writing a checkpoint, crash-consistently: the shards and the manifest go into a hidden
//! partial folder, every file and folder is synced, the folder is renamed into place, then
//! `latest` is switched atomically, and only then are old checkpoints of the same lineage
//! pruned. A job killed at any moment leaves a loadable checkpoint wherever one was before.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::root::{prune, remove_unfinished, sync_dir};
use super::{
    CheckpointError, FORMAT, FileEntry, LATEST, MANIFEST, Manifest, PIECE_MARK, ParamEntry,
    RankState, RunId, TensorRef, fault, sha256_file, shard_file, step_dir_name,
};
use crate::grid::ProcessGrid;

/// Writes `bytes` to `path` and flushes them to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(CheckpointError::io(path))?;
    f.write_all(bytes).map_err(CheckpointError::io(path))?;
    f.sync_all().map_err(CheckpointError::io(path))
}

/// Replaces `path` atomically by a file holding `bytes`: a hidden temporary file beside it,
/// synced, renamed over it, and the folder synced. On failure the temporary file is removed
/// and `path` is as it was.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = folder.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = write_synced(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path).map_err(CheckpointError::io(path)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    sync_dir(&folder)
}

fn shard_file_name(tp: usize, dp: usize, pp: usize) -> String {
    format!("tp{tp:02}-dp{dp:03}-pp{pp:02}.safetensors")
}

/// Writes a checkpoint of `state` after `step` steps of the run `run` into
/// `root/step-NNNNNNNN`, collectively over the whole grid, and keeps the newest `keep`
/// checkpoints of that run (0 keeps all; other runs' checkpoints are never touched). Every
/// rank of the grid must call it; `root` must be visible to every rank (one host or a shared
/// file system). Returns the checkpoint folder.
#[allow(clippy::too_many_arguments)]
pub fn save(
    root: &Path,
    run: &RunId,
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
            remove_unfinished(&tmp_dir)?;
        }
        std::fs::create_dir_all(&tmp_dir).map_err(CheckpointError::io(&tmp_dir))?;
        fault::reached("save:begun")?;
    }
    world.barrier()?;
    let written = write_rank_files(&tmp_dir, state, grid);
    discard_on_error(&written, &tmp_dir, grid.rank);
    written?;
    world.barrier()?;
    if grid.rank == 0 {
        fault::reached("save:shards")?;
        let sealed = seal(&tmp_dir, run, step, grid.layout, extra);
        discard_on_error(&sealed, &tmp_dir, grid.rank);
        sealed?;
        fault::reached("save:manifest")?;
        put_in_place(root, &tmp_dir, &final_dir)?;
        prune(root, run, &final_dir, keep)?;
    }
    world.barrier()?;
    Ok(final_dir)
}

/// Writes the manifest of the files every rank wrote into `tmp_dir`, and syncs the folder.
fn seal(
    tmp_dir: &Path,
    run: &RunId,
    step: usize,
    layout: crate::grid::Layout,
    extra: serde_json::Value,
) -> Result<(), CheckpointError> {
    let manifest = gather_manifest(tmp_dir, run, step, layout, extra)?;
    let text = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
    write_synced(&tmp_dir.join(MANIFEST), &text)?;
    sync_dir(tmp_dir)
}

/// After a failed write into the partial folder (a full disk, say), rank 0 removes it, so
/// that the space is free again; the previous checkpoints are untouched. A test's injected
/// crash leaves it, as a real crash would.
fn discard_on_error<T>(result: &Result<T, CheckpointError>, tmp_dir: &Path, rank: usize) {
    if let Err(e) = result
        && rank == 0
        && !matches!(e, CheckpointError::Injected { .. })
    {
        let _ = std::fs::remove_dir_all(tmp_dir);
    }
}

/// Renames the complete folder `tmp_dir` to `final_dir` and points `latest` at it. A
/// same-step folder already there is replaced without a moment in which `latest` names no
/// complete checkpoint: `latest` names the new folder under its hidden name while the old
/// one is removed.
fn put_in_place(root: &Path, tmp_dir: &Path, final_dir: &Path) -> Result<(), CheckpointError> {
    let name = |dir: &Path| {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    if final_dir.exists() {
        write_file_atomically(&root.join(LATEST), name(tmp_dir).as_bytes())?;
        fault::reached("save:pointed")?;
        super::root::remove_checkpoint(root, final_dir)?;
        fault::reached("save:replaced")?;
    }
    std::fs::rename(tmp_dir, final_dir).map_err(CheckpointError::io(final_dir))?;
    sync_dir(root)?;
    fault::reached("save:renamed")?;
    write_file_atomically(&root.join(LATEST), name(final_dir).as_bytes())?;
    fault::reached("save:latest")
}

/// Writes this rank's shard (parameters on the first DP replica, moments wherever held) and
/// its parameter list into `tmp_dir`.
fn write_rank_files(
    tmp_dir: &Path,
    state: &RankState,
    grid: &ProcessGrid,
) -> Result<(), CheckpointError> {
    let c = grid.coords;
    // Names first, then borrowed views of the values: no copy of the state is made.
    let mut named: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
    // Under expert parallelism the other ranks of the first expert-parallel group write the
    // experts they hold.
    let experts_only = c.dp != 0 && c.dp < grid.ep.size();
    let keep = |name: &str| c.dp == 0 || (experts_only && crate::moe::is_expert_param(name));
    if c.dp == 0 || experts_only {
        // Under ZeRO-3 the parameters' values travel as slices.
        let whole = (state.params.iter()).filter(|p| !p.values.is_empty() && keep(&p.name));
        named.extend(whole.map(|p| (format!("param/{}", p.name), p.shape.clone(), &p.values[..])));
    }
    let mut times = BTreeMap::new();
    for s in &state.pieces {
        let name = format!("{}/{}{PIECE_MARK}{}", s.kind, s.name, s.start);
        named.push((name, vec![s.values.len()], &s.values[..]));
        if s.kind != "param" {
            times.insert(s.name.clone(), s.time);
        }
    }
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
            named.push((format!("{kind}/{name}"), shape.clone(), &values[..]));
        }
        times.insert(name.clone(), m.time);
    }
    write_shard(tmp_dir, &named, &times, grid)?;
    // Every rank of the first DP replica names its parameters (pipeline stages hold different
    // ones); rank 0 lists their union in the manifest.
    if c.dp == 0 || experts_only {
        write_param_list(tmp_dir, state, grid, experts_only, keep)?;
    }
    Ok(())
}

/// Writes this rank's shard file of the `named` values (`name`, shape, values) with the
/// optimizer's step count of each parameter, and its entry (size and hash) beside it; nothing
/// when the rank holds nothing to write.
fn write_shard(
    tmp_dir: &Path,
    named: &[(String, Vec<usize>, &[f32])],
    times: &BTreeMap<String, usize>,
    grid: &ProcessGrid,
) -> Result<(), CheckpointError> {
    let c = grid.coords;
    let tensors: Vec<TensorRef<'_>> = (named.iter())
        .map(|(name, shape, values)| TensorRef {
            name,
            shape,
            values,
        })
        .collect();
    if tensors.is_empty() {
        return Ok(());
    }
    let file = shard_file_name(c.tp, c.dp, c.pp);
    let meta = HashMap::from([(
        "adamw_time".to_string(),
        serde_json::to_string(times).unwrap_or_default(),
    )]);
    let path = tmp_dir.join(&file);
    shard_file::write_refs(&path, &tensors, meta)?;
    let (bytes, sha256) = sha256_file(&path)?;
    let entry = FileEntry {
        file: file.clone(),
        bytes,
        sha256,
        tp: c.tp,
        dp: c.dp,
    };
    let sum = tmp_dir.join(format!("{file}.entry.json"));
    write_synced(&sum, &serde_json::to_vec(&entry).unwrap_or_default())
}

/// Writes the list of the parameters this rank names (those `keep` accepts: all of its stage's
/// on the first DP replica, its experts on the other ranks of the first expert-parallel
/// group, `experts_only`) with their full shapes and splits.
fn write_param_list(
    tmp_dir: &Path,
    state: &RankState,
    grid: &ProcessGrid,
    experts_only: bool,
    keep: impl Fn(&str) -> bool,
) -> Result<(), CheckpointError> {
    let c = grid.coords;
    let tp = grid.layout.tp;
    let entries: Vec<ParamEntry> = (state.params.iter())
        .filter(|p| keep(&p.name))
        .map(|p| ParamEntry {
            name: p.name.clone(),
            shape: p.split.full_shape(&p.shape, tp),
            shard: p.split,
        })
        .collect();
    // An expert-parallel rank's list sorts after its stage's (`~` after `.`).
    let ep = match experts_only {
        true => format!("~ep{:02}", c.dp),
        false => String::new(),
    };
    let path = tmp_dir.join(format!("params-tp{:02}-pp{:02}{ep}.json", c.tp, c.pp));
    write_synced(&path, &serde_json::to_vec(&entries).unwrap_or_default())
}

/// Rank 0: the manifest of the files every rank wrote into `tmp_dir` (their entry and
/// parameter lists are read and removed).
fn gather_manifest(
    tmp_dir: &Path,
    run: &RunId,
    step: usize,
    layout: crate::grid::Layout,
    extra: serde_json::Value,
) -> Result<Manifest, CheckpointError> {
    let mut files = Vec::new();
    let mut param_lists: Vec<(PathBuf, Vec<ParamEntry>)> = Vec::new();
    let listing = std::fs::read_dir(tmp_dir).map_err(CheckpointError::io(tmp_dir))?;
    for item in listing {
        let path = item.map_err(CheckpointError::io(tmp_dir))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let is_params = name.starts_with("params-") && name.ends_with(".json");
        if !is_params && !name.ends_with(".entry.json") {
            continue;
        }
        let text = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
        let bad = |e: serde_json::Error| CheckpointError::BadManifest {
            path: path.clone(),
            reason: e.to_string(),
        };
        if is_params {
            param_lists.push((path.clone(), serde_json::from_slice(&text).map_err(bad)?));
        } else {
            files.push(serde_json::from_slice::<FileEntry>(&text).map_err(bad)?);
        }
        std::fs::remove_file(&path).map_err(CheckpointError::io(&path))?;
    }
    files.sort_by(|a, b| a.file.cmp(&b.file));
    // tp00 before tp01 and pp00 before pp01: the union in stage order, each name once.
    param_lists.sort_by(|a, b| a.0.cmp(&b.0));
    let mut params: Vec<ParamEntry> = Vec::new();
    let mut seen = HashSet::new();
    for (_, list) in param_lists {
        for p in list {
            if seen.insert(p.name.clone()) {
                params.push(p);
            }
        }
    }
    Ok(Manifest {
        format: FORMAT.into(),
        run: Some(run.clone()),
        step,
        layout,
        params,
        files,
        extra,
    })
}
