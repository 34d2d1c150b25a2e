//! A run's output folder when none is given: the folder of the run a resumed checkpoint
//! belongs to, or a new folder `runs/<UTC date>-<time>` that no earlier run used (`merak
//! train` without `--out`, and [`merak_burn::run`](crate::run) without
//! [`RunOptions::out`](crate::entry::RunOptions::out)).

use std::path::{Path, PathBuf};

use crate::checkpoint::Checkpoint;
use crate::comm::{CommError, Communicator};

/// The folder new runs go to when `--out` is not given.
pub const RUNS: &str = "runs";

/// The output folder: `out` when given; else, resuming `checkpoint`, the folder whose
/// `run.json` names the checkpoint's run and whose `checkpoints/` holds it; else a new
/// folder under [`RUNS`] named by rank 0's clock (every rank gets the same name).
pub fn output_folder(
    out: Option<&Path>,
    checkpoint: Option<&Checkpoint>,
    world: Option<&dyn Communicator>,
) -> Result<PathBuf, CommError> {
    if let Some(out) = out {
        return Ok(out.to_path_buf());
    }
    if let Some(folder) = checkpoint.and_then(run_folder_of) {
        return Ok(folder);
    }
    let stamp = new_folder_name(Path::new(RUNS));
    let name = match world {
        Some(w) => w.broadcast_text(&stamp, 64, 0)?,
        None => stamp,
    };
    Ok(Path::new(RUNS).join(name))
}

/// The folders among `paths` and their parents that do not exist yet, deepest first: what
/// making `paths` will create.
pub fn missing_folders(paths: &[&Path]) -> Vec<PathBuf> {
    let mut missing = Vec::new();
    for path in paths {
        let mut dir = Some(*path);
        while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
            if d.symlink_metadata().is_ok() {
                break;
            }
            missing.push(d.to_path_buf());
            dir = d.parent();
        }
    }
    missing.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    missing.dedup();
    missing
}

/// Removes the folders of `made` (deepest first, as [`missing_folders`] lists them) that are
/// empty: a run refused before training leaves no folder it made behind. A folder someone
/// wrote into meanwhile stays.
pub fn remove_if_empty(made: &[PathBuf]) {
    for dir in made {
        let _ = std::fs::remove_dir(dir);
    }
}

/// The run folder holding `checkpoint` (`<run>/checkpoints/step-*`), when its run record
/// names the checkpoint's lineage.
fn run_folder_of(checkpoint: &Checkpoint) -> Option<PathBuf> {
    let lineage = checkpoint.manifest.run.as_ref()?;
    let root = checkpoint.dir.parent()?;
    if root.file_name()? != "checkpoints" {
        return None;
    }
    let folder = root.parent()?;
    let run = super::run_of(folder).ok()??;
    (run == *lineage).then(|| folder.to_path_buf())
}

/// `YYYYMMDD-HHMMSS` of now (UTC), with `-2`, `-3`, ... when `parent` already has it.
fn new_folder_name(parent: &Path) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let stamp = utc_stamp(secs);
    (1..)
        .map(|n| match n {
            1 => stamp.clone(),
            n => format!("{stamp}-{n}"),
        })
        .find(|name| parent.join(name).symlink_metadata().is_err())
        .unwrap_or(stamp)
}

/// `YYYYMMDD-HHMMSS` of a Unix time (UTC).
fn utc_stamp(secs: u64) -> String {
    let [year, month, day, h, m, s] = civil_utc(secs);
    format!("{year:04}{month:02}{day:02}-{h:02}{m:02}{s:02}")
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time: when a run took its folder's lock, in messages.
pub fn utc_time(secs: u64) -> String {
    let [year, month, day, h, m, s] = civil_utc(secs);
    format!("{year:04}-{month:02}-{day:02} {h:02}:{m:02}:{s:02} UTC")
}

/// Year, month, day, hour, minute and second of a Unix time (the proleptic Gregorian
/// calendar, UTC).
fn civil_utc(secs: u64) -> [i64; 6] {
    let days = (secs / 86_400) as i64;
    let rest = (secs % 86_400) as i64;
    // Days to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    [year, month, day, rest / 3600, rest / 60 % 60, rest % 60]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc_calendar_dates() {
        assert_eq!(utc_stamp(0), "19700101-000000");
        // 2026-11-25 19:45:30 UTC.
        assert_eq!(utc_stamp(1_795_635_930), "20261125-194530");
        // 2024-02-29 23:59:59 UTC (a leap day).
        assert_eq!(utc_stamp(1_709_251_199), "20240229-235959");
        assert_eq!(utc_time(1_795_635_930), "2026-11-25 19:45:30 UTC");
    }

    #[test]
    fn a_refused_run_removes_the_empty_folders_it_made_and_nothing_else() {
        let parent = tempfile::tempdir().expect("temp folder");
        let out = parent.path().join("runs/new");
        let root = out.join("checkpoints");
        let elsewhere = parent.path().join("kept");
        std::fs::create_dir(&elsewhere).expect("made");
        let made = missing_folders(&[&out, &root, &elsewhere]);
        assert_eq!(
            made,
            vec![root.clone(), out.clone(), parent.path().join("runs")]
        );
        std::fs::create_dir_all(&root).expect("made");
        std::fs::write(out.join("notes.txt"), "someone's").expect("written");
        remove_if_empty(&made);
        // `out` holds a file now: it and its parents stay; the empty root goes.
        assert!(!root.exists() && out.join("notes.txt").exists() && elsewhere.exists());
        std::fs::remove_file(out.join("notes.txt")).expect("removed");
        remove_if_empty(&made);
        assert!(!parent.path().join("runs").exists() && elsewhere.exists());
    }

    #[test]
    fn a_taken_name_gets_a_suffix() {
        let parent = tempfile::tempdir().expect("temp folder");
        let first = new_folder_name(parent.path());
        std::fs::create_dir(parent.path().join(&first)).expect("made");
        let second = new_folder_name(parent.path());
        assert_ne!(first, second);
        assert!(!parent.path().join(&second).exists(), "{second}");
    }
}
