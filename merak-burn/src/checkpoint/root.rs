//! A checkpoint root: the folder of a run's `step-*` checkpoints and its `latest` file. What
//! it holds, which checkpoint is the newest, and the changes a run makes to it besides saving:
//! pruning its own old checkpoints and moving later ones aside as a branch. Nothing here
//! removes a checkpoint of another lineage.

use std::path::{Path, PathBuf};

use super::fault;
use super::{
    CheckpointError, LATEST, MANIFEST, MAX_MANIFEST_BYTES, MAX_SMALL_FILE_BYTES, Manifest, RunId,
    plain_name, read_regular,
};

/// A complete checkpoint folder directly inside a root.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// The folder.
    pub dir: PathBuf,
    /// Its step.
    pub step: usize,
    /// The lineage its manifest names (`None`: written before runs had ids, or the manifest
    /// cannot be read).
    pub run: Option<RunId>,
}

/// What a checkpoint root holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RootListing {
    /// Complete checkpoints (`step-*` folders with a readable manifest), by step.
    pub checkpoints: Vec<Stored>,
    /// `step-*` folders without a readable manifest (damaged, or not merak's).
    pub unreadable: Vec<PathBuf>,
    /// Hidden folders a save or a prune left behind (`.step-*.partial`, `.step-*.deleting`).
    pub unfinished: Vec<PathBuf>,
    /// The folder name `latest` holds, if the file exists.
    pub latest: Option<String>,
    /// Branch folders (`branch-*`) a resumed run moved later checkpoints into.
    pub branches: Vec<PathBuf>,
}

impl RootListing {
    /// Whether the root holds anything a run wrote.
    pub fn is_empty(&self) -> bool {
        self.checkpoints.is_empty()
            && self.unreadable.is_empty()
            && self.unfinished.is_empty()
            && self.latest.is_none()
            && self.branches.is_empty()
    }

    /// The lineages of its checkpoints (`None` for a checkpoint without one).
    pub fn runs(&self) -> Vec<Option<RunId>> {
        let mut runs: Vec<Option<RunId>> = self.checkpoints.iter().map(|c| c.run.clone()).collect();
        runs.sort();
        runs.dedup();
        runs
    }

    /// The folder `latest` names, when it is a complete checkpoint of this listing.
    pub fn latest_dir(&self, root: &Path) -> Option<PathBuf> {
        let name = self.latest.as_deref().filter(|n| plain_name(n))?;
        let dir = root.join(name);
        dir.join(MANIFEST).is_file().then_some(dir)
    }

    /// The checkpoint to continue from: the newest complete one, by step, between the one
    /// `latest` names and the `step-*` folders (a job killed after renaming a new checkpoint
    /// into place but before switching `latest` leaves it newer than `latest`).
    pub fn newest(&self, root: &Path) -> Option<PathBuf> {
        let by_step = self.checkpoints.last().map(|c| (c.step, c.dir.clone()));
        let latest = self.latest_dir(root).and_then(|dir| {
            let step = read_manifest(&dir).ok()?.step;
            Some((step, dir))
        });
        match (by_step, latest) {
            (Some(a), Some(b)) => Some(if b.0 >= a.0 { b.1 } else { a.1 }),
            (a, b) => a.or(b).map(|(_, dir)| dir),
        }
    }
}

/// Reads a manifest without checking its shards, for its step and lineage: a key this
/// version does not write is passed over here (a listing still sees the checkpoint, and
/// opening it names the key: [`read_checked_manifest`]).
pub(crate) fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    let text = read_regular(&path, MAX_MANIFEST_BYTES)?;
    serde_json::from_slice(&text).map_err(|e| CheckpointError::BadManifest {
        path,
        reason: e.to_string(),
    })
}

/// Reads a manifest to act on it: any key merak does not write is refused, naming it
/// ([`Manifest::parse`]).
pub(crate) fn read_checked_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    let text = read_regular(&path, MAX_MANIFEST_BYTES)?;
    Manifest::parse(&text, &path)
}

/// The step a checkpoint folder's name gives (`step-00000012` is 12).
pub fn step_of_name(name: &str) -> Option<usize> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Lists `root` (an absent root is empty).
pub fn list(root: &Path) -> Result<RootListing, CheckpointError> {
    let mut out = RootListing::default();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(CheckpointError::io(root)(e)),
    };
    for item in entries {
        let path = item.map_err(CheckpointError::io(root))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name == LATEST {
            let text = read_regular(&path, MAX_SMALL_FILE_BYTES)?;
            out.latest = Some(String::from_utf8_lossy(&text).trim().to_string());
        } else if name.starts_with(".step-")
            && (name.ends_with(".partial") || name.ends_with(".deleting"))
        {
            out.unfinished.push(path);
        } else if name.starts_with("branch-") && path.is_dir() {
            out.branches.push(path);
        } else if step_of_name(name).is_some() && path.is_dir() {
            match read_manifest(&path) {
                Ok(m) => out.checkpoints.push(Stored {
                    dir: path,
                    step: m.step,
                    run: m.run,
                }),
                Err(_) => out.unreadable.push(path),
            }
        }
    }
    out.checkpoints
        .sort_by(|a, b| (a.step, &a.dir).cmp(&(b.step, &b.dir)));
    out.unfinished.sort();
    out.branches.sort();
    Ok(out)
}

/// Syncs a folder, so that the renames and new files in it survive a power cut.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(CheckpointError::io(dir))
}

/// Removes a folder of this lineage without ever leaving a half-removed folder under a
/// checkpoint's name: it is first renamed to a hidden `.deleting` name.
pub(crate) fn remove_checkpoint(root: &Path, dir: &Path) -> Result<(), CheckpointError> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("step");
    let doomed = root.join(format!(".{name}.deleting"));
    std::fs::rename(dir, &doomed).map_err(CheckpointError::io(dir))?;
    sync_dir(root)?;
    remove_unfinished(&doomed)
}

/// Removes a hidden leftover folder (`.partial` or `.deleting`) of this lineage.
pub(crate) fn remove_unfinished(dir: &Path) -> Result<(), CheckpointError> {
    // Remove the manifest first, so that a folder cut short is never mistaken for a checkpoint.
    let _ = std::fs::remove_file(dir.join(MANIFEST));
    fault::reached("prune:removing")?;
    std::fs::remove_dir_all(dir).map_err(CheckpointError::io(dir))
}

/// After saving `written` (a checkpoint of `run`), keeps the newest `keep` checkpoints of
/// `run` in `root` (0 keeps all) and removes leftovers of interrupted saves and prunes.
/// Checkpoints of other lineages, the one just written and the one `latest` names are never
/// removed.
pub(crate) fn prune(
    root: &Path,
    run: &RunId,
    written: &Path,
    keep: usize,
) -> Result<(), CheckpointError> {
    let listing = list(root)?;
    let latest = listing.latest_dir(root);
    for dir in &listing.unfinished {
        if latest.as_deref() != Some(dir.as_path()) {
            remove_unfinished(dir)?;
        }
    }
    if keep == 0 {
        return Ok(());
    }
    let ours: Vec<&Stored> = (listing.checkpoints.iter())
        .filter(|c| c.run.as_ref() == Some(run))
        .collect();
    let old = ours.len().saturating_sub(keep);
    for c in &ours[..old] {
        if c.dir != written && latest.as_deref() != Some(c.dir.as_path()) {
            remove_checkpoint(root, &c.dir)?;
        }
    }
    Ok(())
}
