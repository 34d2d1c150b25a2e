//! A run owns its lineage: the output folder and the checkpoint root a run writes are checked
//! before the first step, so that a run never overwrites, prunes or removes what another run
//! wrote, and a resumed run never silently forks its own history.
//!
//! - A fresh run gets a new [`RunId`], recorded in `run.json` in its output folder and in every
//!   checkpoint manifest. It refuses folders that hold another run's files, unless asked to
//!   replace them ([`ExistingRun::Replace`]), which removes only files merak writes and says
//!   which.
//! - A resumed run continues the lineage of its checkpoint. It refuses folders of another
//!   lineage, and a checkpoint older than others of its lineage in the checkpoint root, unless
//!   asked to branch ([`ExistingRun::Branch`]): the later checkpoints are then moved aside into
//!   `branch-N`, never deleted.
//!
//! [`claim`] only reads (every rank may call it, and gets the same answer); [`Claim::apply`]
//! makes the changes (one rank).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::root::{self, RootListing, step_of_name};
use crate::checkpoint::{
    Checkpoint, CheckpointError, LATEST, MAX_SMALL_FILE_BYTES, RunId, read_regular,
    write_file_atomically,
};

/// The file in a run's output folder that names its lineage.
pub const RUN_FILE: &str = "run.json";
/// The files the trainer itself writes into a run's output folder.
pub const TRAINER_FILES: [&str; 4] = [
    RUN_FILE,
    "metrics.jsonl",
    "memory.json",
    super::attempts::ATTEMPTS_FILE,
];
const RUN_FORMAT: &str = "merak-run/1";

/// What to do when a run's folders hold what another run (or an earlier part of this run's
/// lineage) wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExistingRun {
    /// Refuse to start (the default).
    #[default]
    Refuse,
    /// Remove the other run's files (only files merak writes: its checkpoints, metrics, run
    /// record and the caller's declared files) and start here.
    Replace,
    /// A resumed run only: move the checkpoints of its lineage that are later than the one it
    /// resumes aside into a `branch-N` folder of the checkpoint root (nothing is deleted).
    Branch,
}

/// The checkpoint a run resumes: its lineage, step and folder.
#[derive(Clone, Debug, PartialEq)]
pub struct Origin {
    /// The lineage of the run that wrote it (`None`: written before runs had ids).
    pub run: Option<RunId>,
    /// Its step.
    pub step: usize,
    /// Its folder.
    pub dir: PathBuf,
}

/// A run's place in its lineage: the checkpoint it resumed and the lineage it writes.
#[derive(Clone, Debug, Default)]
pub struct Lineage {
    /// The checkpoint this run resumed, if any.
    pub origin: Option<Origin>,
    /// The lineage this run writes, once its folders are claimed.
    pub run: Option<RunId>,
}

impl Lineage {
    /// The lineage a checkpoint saved now belongs to: the claimed one, else the resumed
    /// checkpoint's (`None` before either is known).
    pub fn written(&self) -> Option<RunId> {
        (self.run.clone()).or_else(|| self.origin.as_ref().and_then(|o| o.run.clone()))
    }
}

impl Origin {
    /// The origin of an opened checkpoint.
    pub fn of(checkpoint: &Checkpoint) -> Self {
        Self {
            run: checkpoint.manifest.run.clone(),
            step: checkpoint.manifest.step,
            dir: checkpoint.dir.clone(),
        }
    }
}

/// `run.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunRecord {
    format: String,
    run: RunId,
}

/// Why a run may not write where it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// A folder holds files of another run.
    #[error(
        "{folder} holds another run ({owner}: {holds}). Nothing was changed. {hint}choose another output folder (--out), or replace that run (--replace removes those files)"
    )]
    OtherRun {
        /// The folder.
        folder: PathBuf,
        /// "run ID", or a description of files without a run record.
        owner: String,
        /// What it holds.
        holds: String,
        /// How to continue that run, when it can be (ends with "; ").
        hint: String,
    },
    /// The checkpoint root holds later checkpoints of the resumed lineage.
    #[error(
        "resuming step {step}, but {root} holds later checkpoints of the same run (steps {later}). Nothing was changed: resume the newest ({newest}), or branch from step {step} (--branch moves the later ones aside into {root}/branch-N; nothing is deleted)"
    )]
    LaterCheckpoints {
        /// The resumed step.
        step: usize,
        /// The checkpoint root.
        root: PathBuf,
        /// Their steps.
        later: String,
        /// The newest of them.
        newest: PathBuf,
    },
    /// A folder named like a checkpoint whose manifest cannot be read: whose it is is unknown.
    #[error(
        "{0} is named like a checkpoint but has no readable manifest.json: merak cannot tell whose it is and changes nothing; move it away or choose another folder"
    )]
    Unreadable(PathBuf),
    /// `run.json` cannot be read.
    #[error("{path}: not a merak run record: {reason}")]
    BadRunRecord {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Branching was asked for a run that resumes nothing.
    #[error("--branch continues a checkpoint: give --resume")]
    BranchWithoutResume,
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The checkpoint root cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ClaimError + '_ {
    move |source| ClaimError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Later checkpoints moved aside into a branch folder.
#[derive(Clone, Debug, PartialEq)]
struct Branch {
    dest: PathBuf,
    moved: Vec<PathBuf>,
    /// What the root's `latest` names afterwards (`None`: removed, nothing of the lineage is
    /// left in the root).
    latest: Option<String>,
}

/// The outcome of [`claim`]: the run's lineage and what [`Claim::apply`] will change.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    /// The lineage this run writes: the resumed one, or a new one.
    pub run: RunId,
    out: PathBuf,
    root: Option<PathBuf>,
    fresh: bool,
    replace: Vec<PathBuf>,
    branch: Option<Branch>,
}

/// The folders a run writes and the caller's own files in the output folder.
#[derive(Clone, Copy, Debug)]
pub struct RunFolders<'a> {
    /// The output folder (metrics, run record, the caller's files).
    pub out: &'a Path,
    /// The checkpoint root, when the run saves checkpoints.
    pub checkpoints: Option<&'a Path>,
    /// Names of the caller's files in `out` besides the trainer's (a config, a plot).
    pub own_files: &'a [String],
}

/// What the output folder holds: its run record's lineage and the run files present.
struct OutListing {
    run: Option<RunId>,
    files: Vec<PathBuf>,
}

/// The lineage the run record (`run.json`) of the output folder `out` names; `None` when it
/// has none.
pub fn run_of(out: &Path) -> Result<Option<RunId>, ClaimError> {
    let record = out.join(RUN_FILE);
    let bad = |reason: String| ClaimError::BadRunRecord {
        path: record.clone(),
        reason,
    };
    match record.symlink_metadata() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => {
            let bytes =
                read_regular(&record, MAX_SMALL_FILE_BYTES).map_err(|e| bad(e.to_string()))?;
            let r: RunRecord = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
            Ok(Some(r.run))
        }
    }
}

fn list_out(out: &Path, own_files: &[String]) -> Result<OutListing, ClaimError> {
    let run = run_of(out)?;
    let names = TRAINER_FILES
        .iter()
        .copied()
        .chain(own_files.iter().map(String::as_str));
    let files = names
        .map(|n| out.join(n))
        .filter(|p| p.symlink_metadata().is_ok())
        .collect();
    Ok(OutListing { run, files })
}

/// Checks the folders of a run starting fresh (`origin` `None`) or from `origin`, and works out
/// what [`Claim::apply`] must change. Reads only.
pub fn claim(
    folders: RunFolders<'_>,
    origin: Option<&Origin>,
    existing: ExistingRun,
) -> Result<Claim, ClaimError> {
    if existing == ExistingRun::Branch && origin.is_none() {
        return Err(ClaimError::BranchWithoutResume);
    }
    let lineage = origin.and_then(|o| o.run.clone());
    let ours = |run: &Option<RunId>| origin.is_some() && *run == lineage;
    let out = list_out(folders.out, folders.own_files)?;
    let listing = match folders.checkpoints {
        Some(r) => root::list(r)?,
        None => RootListing::default(),
    };
    if let Some(dir) = listing.unreadable.first() {
        return Err(ClaimError::Unreadable(dir.clone()));
    }
    let mut replace = Vec::new();
    let out_foreign = !out.files.is_empty() && !ours(&out.run);
    if out_foreign {
        if existing != ExistingRun::Replace {
            return Err(other_run(
                folders.out,
                &out.run,
                describe_out(&out),
                &listing,
                folders.checkpoints,
            ));
        }
        replace.extend(out.files.iter().cloned());
    }
    let root_foreign = !listing.is_empty() && !listing.runs().iter().all(ours);
    if let (true, Some(r)) = (root_foreign, folders.checkpoints) {
        if existing != ExistingRun::Replace {
            let owner = listing.runs().into_iter().find(|x| !ours(x)).flatten();
            return Err(other_run(
                r,
                &owner,
                describe_root(&listing),
                &listing,
                Some(r),
            ));
        }
        replace.extend(root_contents(r, &listing));
    }
    let branch = match (origin, folders.checkpoints) {
        (Some(o), Some(r)) if !root_foreign => later_checkpoints(r, &listing, o, existing)?,
        _ => None,
    };
    Ok(Claim {
        run: lineage.unwrap_or_default(),
        out: folders.out.to_path_buf(),
        root: folders.checkpoints.map(Path::to_path_buf),
        fresh: origin.is_none(),
        replace,
        branch,
    })
}

/// The error for a folder holding another run, with how to continue that run.
fn other_run(
    folder: &Path,
    run: &Option<RunId>,
    holds: String,
    listing: &RootListing,
    root: Option<&Path>,
) -> ClaimError {
    let owner = match run {
        Some(id) => format!("run {id}"),
        None => "files of a run with no run.json: an earlier merak, or another program".into(),
    };
    let hint = match (root, listing.checkpoints.is_empty()) {
        (Some(r), false) => format!(
            "To continue it, resume it (--resume {} --out {}); otherwise ",
            r.display(),
            folder.display()
        ),
        _ => String::new(),
    };
    ClaimError::OtherRun {
        folder: folder.to_path_buf(),
        owner,
        holds,
        hint,
    }
}

fn describe_out(out: &OutListing) -> String {
    let names: Vec<String> = (out.files.iter())
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    names.join(", ")
}

fn describe_root(listing: &RootListing) -> String {
    let mut parts = Vec::new();
    if let (Some(first), Some(last)) = (listing.checkpoints.first(), listing.checkpoints.last()) {
        parts.push(format!(
            "{} checkpoint(s), steps {} to {}",
            listing.checkpoints.len(),
            first.step,
            last.step
        ));
    }
    if !listing.unfinished.is_empty() {
        parts.push(format!("{} interrupted save(s)", listing.unfinished.len()));
    }
    if !listing.branches.is_empty() {
        parts.push(format!("{} branch folder(s)", listing.branches.len()));
    }
    if listing.latest.is_some() {
        parts.push(LATEST.to_string());
    }
    parts.join(", ")
}

/// Everything a run wrote into the checkpoint root `root`.
fn root_contents(root: &Path, listing: &RootListing) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = listing.checkpoints.iter().map(|c| c.dir.clone()).collect();
    all.extend(listing.unfinished.iter().cloned());
    all.extend(listing.branches.iter().cloned());
    if listing.latest.is_some() {
        all.push(root.join(LATEST));
    }
    all
}

/// The checkpoints of the lineage later than `origin`: refused, or moved aside as a branch.
fn later_checkpoints(
    root: &Path,
    listing: &RootListing,
    origin: &Origin,
    existing: ExistingRun,
) -> Result<Option<Branch>, ClaimError> {
    let later: Vec<&root::Stored> = (listing.checkpoints.iter())
        .filter(|c| c.step > origin.step)
        .collect();
    let Some(newest) = later.last() else {
        return Ok(None);
    };
    if existing != ExistingRun::Branch {
        let steps: Vec<String> = later.iter().map(|c| c.step.to_string()).collect();
        return Err(ClaimError::LaterCheckpoints {
            step: origin.step,
            root: root.to_path_buf(),
            later: steps.join(", "),
            newest: newest.dir.clone(),
        });
    }
    let dest = (1..)
        .map(|n| root.join(format!("branch-{n}")))
        .find(|d| d.symlink_metadata().is_err())
        .unwrap_or_else(|| root.join("branch"));
    let mut kept = listing.checkpoints.iter().filter(|c| c.step <= origin.step);
    let origin_here = origin.dir.parent() == Some(root);
    let latest = if origin_here {
        origin
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    } else {
        kept.next_back()
            .and_then(|c| c.dir.file_name())
            .map(|n| n.to_string_lossy().into_owned())
    };
    Ok(Some(Branch {
        dest,
        moved: later.iter().map(|c| c.dir.clone()).collect(),
        latest,
    }))
}

impl Claim {
    /// Whether applying changes anything besides the run record.
    pub fn changes_files(&self) -> bool {
        !self.replace.is_empty() || self.branch.is_some()
    }

    /// Makes the changes: removes a replaced run's files, moves later checkpoints aside,
    /// records the lineage in `run.json`. Returns a line for each change. One rank calls it.
    pub fn apply(&self) -> Result<Vec<String>, ClaimError> {
        let mut said = Vec::new();
        for path in &self.replace {
            let is_dir = path.symlink_metadata().is_ok_and(|m| m.is_dir());
            if is_dir {
                std::fs::remove_dir_all(path).map_err(io(path))?;
            } else {
                std::fs::remove_file(path).map_err(io(path))?;
            }
            said.push(format!("removed {} (another run's)", path.display()));
        }
        if let (Some(b), Some(root)) = (&self.branch, &self.root) {
            said.extend(self.move_aside(root, b)?);
        }
        self.record()?;
        Ok(said)
    }

    /// Moves the later checkpoints of a branch into its folder and points `latest` past them.
    fn move_aside(&self, root: &Path, b: &Branch) -> Result<Vec<String>, ClaimError> {
        std::fs::create_dir_all(&b.dest).map_err(io(&b.dest))?;
        let mut said = Vec::new();
        for dir in &b.moved {
            let Some(name) = dir.file_name() else {
                continue;
            };
            let to = b.dest.join(name);
            std::fs::rename(dir, &to).map_err(io(dir))?;
            said.push(format!("moved {} to {}", dir.display(), to.display()));
        }
        let newest = b
            .moved
            .iter()
            .filter_map(|d| d.file_name())
            .filter_map(|n| n.to_str())
            .max_by_key(|n| step_of_name(n));
        if let Some(name) = newest {
            write_file_atomically(&b.dest.join(LATEST), name.as_bytes())?;
        }
        let metrics = self.out.join("metrics.jsonl");
        if metrics.is_file() {
            let to = b.dest.join("metrics.jsonl");
            std::fs::copy(&metrics, &to).map_err(io(&to))?;
            said.push(format!("copied {} to {}", metrics.display(), to.display()));
        }
        match &b.latest {
            Some(name) => write_file_atomically(&root.join(LATEST), name.as_bytes())?,
            None => {
                let latest = root.join(LATEST);
                if latest.exists() {
                    std::fs::remove_file(&latest).map_err(io(&latest))?;
                }
            }
        }
        said.push(format!(
            "the later checkpoints are a branch now: resume it with --resume {}",
            b.dest.display()
        ));
        Ok(said)
    }

    /// Writes `run.json`: for a fresh run only if no other run wrote one meanwhile.
    fn record(&self) -> Result<(), ClaimError> {
        let path = self.out.join(RUN_FILE);
        std::fs::create_dir_all(&self.out).map_err(io(&self.out))?;
        let text = serde_json::to_vec_pretty(&RunRecord {
            format: RUN_FORMAT.into(),
            run: self.run.clone(),
        })
        .unwrap_or_default();
        if !self.fresh {
            return Ok(write_file_atomically(&path, &text)?);
        }
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => ClaimError::OtherRun {
                    folder: self.out.clone(),
                    owner: "a run started at the same time".into(),
                    holds: RUN_FILE.into(),
                    hint: String::new(),
                },
                _ => io(&path)(e),
            })?;
        let written = f.write_all(&text).and_then(|()| f.sync_all());
        if written.is_err() {
            // Ours, just made: a full disk must not leave an empty run record behind.
            let _ = std::fs::remove_file(&path);
        }
        written.map_err(io(&path))
    }
}
