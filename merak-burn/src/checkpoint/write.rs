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
use crate::comm::{Communicator, ReduceOp};
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

/// Where and what a save writes: the checkpoint root, the lineage and step, how many to keep,
/// the manifest's extra state, and the hidden partial folder the files go into first.
pub(crate) struct SaveTarget {
    root: PathBuf,
    run: RunId,
    pub(crate) step: usize,
    keep: usize,
    extra: serde_json::Value,
    layout: crate::grid::Layout,
    pub(crate) tmp_dir: PathBuf,
    pub(crate) final_dir: PathBuf,
}

impl SaveTarget {
    /// The save of the checkpoint after `step` steps of `run` under `root`, written by the
    /// ranks of `grid`.
    pub(crate) fn new(
        root: &Path,
        run: &RunId,
        step: usize,
        keep: usize,
        extra: serde_json::Value,
        grid: &ProcessGrid,
    ) -> Self {
        Self {
            root: root.to_path_buf(),
            run: run.clone(),
            step,
            keep,
            extra,
            layout: grid.layout,
            tmp_dir: root.join(format!(".{}.partial", step_dir_name(step))),
            final_dir: root.join(step_dir_name(step)),
        }
    }
}

/// What a rank's files need of the grid: its coordinates, the layout and the size of its
/// expert-parallel group. No communicator, so a writer thread can hold it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    coords: crate::grid::Coords,
    layout: crate::grid::Layout,
    ep: usize,
}

impl Place {
    /// This rank's place in `grid`.
    pub(crate) fn of(grid: &ProcessGrid) -> Self {
        Self {
            coords: grid.coords,
            layout: grid.layout,
            ep: grid.ep.size(),
        }
    }
}

/// Writes a checkpoint of `state` after `step` steps of the run `run` into
/// `root/step-NNNNNNNN`, collectively over the whole grid, and keeps the newest `keep`
/// checkpoints of that run (0 keeps all; other runs' checkpoints are never touched). Every
/// rank of the grid must call it; `root` must be visible to every rank (one host or a shared
/// file system). A rank that fails tells the others, so every rank returns an error together
/// ([`CheckpointError::OtherRank`] on the ranks that did not fail). Returns the checkpoint
/// folder.
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
    let target = SaveTarget::new(root, run, step, keep, extra, grid);
    begin(&target, grid)?;
    let written = write_rank_files(&target.tmp_dir, state, Place::of(grid));
    complete(&target, written, grid)
}

/// The first collective step of a save: rank 0 makes the empty partial folder (removing one a
/// crashed save left), and every rank learns that it is there.
pub(crate) fn begin(target: &SaveTarget, grid: &ProcessGrid) -> Result<(), CheckpointError> {
    let world = grid.world.comm()?;
    let made = match grid.rank {
        0 => make_partial(&target.tmp_dir),
        _ => Ok(()),
    };
    agree(&*world, made, &target.tmp_dir, "make the partial folder")
}

/// Rank 0: an empty partial folder at `tmp_dir`.
fn make_partial(tmp_dir: &Path) -> Result<(), CheckpointError> {
    if tmp_dir.exists() {
        remove_unfinished(tmp_dir)?;
    }
    std::fs::create_dir_all(tmp_dir).map_err(CheckpointError::io(tmp_dir))?;
    fault::reached("save:begun")
}

/// The collective end of a save once this rank's files are `written`: every rank learns
/// whether all wrote theirs; rank 0 seals the folder (manifest), renames it into place,
/// switches `latest` and prunes, and every rank learns whether that worked.
pub(crate) fn complete(
    target: &SaveTarget,
    written: Result<(), CheckpointError>,
    grid: &ProcessGrid,
) -> Result<PathBuf, CheckpointError> {
    let world = grid.world.comm()?;
    let tmp_dir = &target.tmp_dir;
    let own_crash = matches!(written, Err(CheckpointError::Injected { .. }));
    let agreed = agree(&*world, written, tmp_dir, "write its files");
    if agreed.is_err() && grid.rank == 0 && !own_crash {
        // A failed write (a full disk, say) on any rank: rank 0 frees the space; the previous
        // checkpoints are untouched. A test's injected crash leaves it, as a real crash would.
        let _ = std::fs::remove_dir_all(tmp_dir);
    }
    agreed?;
    let placed = match grid.rank {
        0 => put_together(target),
        _ => Ok(()),
    };
    agree(
        &*world,
        placed,
        &target.final_dir,
        "seal the checkpoint and put it in place",
    )?;
    Ok(target.final_dir.clone())
}

/// Rank 0, once every rank's files are in the partial folder: the manifest, the rename,
/// `latest`, and the pruning of this lineage's older checkpoints.
fn put_together(t: &SaveTarget) -> Result<(), CheckpointError> {
    fault::reached("save:shards")?;
    let sealed = seal(&t.tmp_dir, &t.run, t.step, t.layout, t.extra.clone());
    discard_on_error(&sealed, &t.tmp_dir, 0);
    sealed?;
    fault::reached("save:manifest")?;
    put_in_place(&t.root, &t.tmp_dir, &t.final_dir)?;
    prune(&t.root, &t.run, &t.final_dir, t.keep)
}

/// Tells every rank of `world` whether each rank's `mine` failed (one all-reduce of a flag per
/// rank, which every rank must call): this rank's own error when it failed, else
/// [`CheckpointError::OtherRank`] naming the first rank that failed to `what` under `dir`.
pub(crate) fn agree(
    world: &dyn Communicator,
    mine: Result<(), CheckpointError>,
    dir: &Path,
    what: &'static str,
) -> Result<(), CheckpointError> {
    let mut failed = vec![0.0f32; world.size()];
    if mine.is_err() {
        failed[world.rank()] = 1.0;
    }
    world.all_reduce(&mut failed, ReduceOp::Max)?;
    mine?;
    match failed.iter().position(|&f| f > 0.0) {
        Some(rank) => Err(CheckpointError::OtherRank {
            rank,
            dir: dir.to_path_buf(),
            what,
        }),
        None => Ok(()),
    }
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
pub(crate) fn write_rank_files(
    tmp_dir: &Path,
    state: &RankState,
    place: Place,
) -> Result<(), CheckpointError> {
    let c = place.coords;
    // Names first, then borrowed views of the values: no copy of the state is made.
    let mut named: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
    // Under expert parallelism the other ranks of the first expert-parallel group write the
    // experts they hold.
    let experts_only = c.dp != 0 && c.dp < place.ep;
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
    write_shard(tmp_dir, &named, &times, place)?;
    // Every rank of the first DP replica names its parameters (pipeline stages hold different
    // ones); rank 0 lists their union in the manifest.
    if c.dp == 0 || experts_only {
        write_param_list(tmp_dir, state, place, experts_only, keep)?;
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
    place: Place,
) -> Result<(), CheckpointError> {
    let c = place.coords;
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
    fault::reached("save:writing")?;
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
    place: Place,
    experts_only: bool,
    keep: impl Fn(&str) -> bool,
) -> Result<(), CheckpointError> {
    let c = place.coords;
    let tp = place.layout.tp;
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
