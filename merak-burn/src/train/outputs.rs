//! The paths a training run will write, checked before the first step: a folder that cannot
//! be made or written, or a file path that is a folder, fails at once with the path named,
//! instead of after the last step.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// A path the run cannot write; each names what the path is for and the path.
#[derive(Debug, Error)]
pub enum OutputError {
    /// A folder's path names a file.
    #[error("{what} {} is a file, not a folder", path.display())]
    IsAFile {
        /// What the folder is for (for example "checkpoint folder").
        what: String,
        /// The path.
        path: PathBuf,
    },
    /// A file's path names a folder.
    #[error("{what} {} is a folder; give a file path", path.display())]
    IsAFolder {
        /// What the file is for (for example "trace file").
        what: String,
        /// The path.
        path: PathBuf,
    },
    /// The folder cannot be made, or this process cannot write in it.
    #[error("cannot {action} the {what} {}: {source}", path.display())]
    Unwritable {
        /// "create" or "write in".
        action: &'static str,
        /// What the folder is for.
        what: String,
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Makes `dir` (and its parents) and checks that this process can write in it, with a probe
/// file named after `rank` that is removed again.
pub fn writable_dir(dir: &Path, what: &str, rank: usize) -> Result<(), OutputError> {
    let fail = |action| {
        move |source| OutputError::Unwritable {
            action,
            what: what.to_string(),
            path: dir.to_path_buf(),
            source,
        }
    };
    not_a_file(dir, what)?;
    std::fs::create_dir_all(dir).map_err(fail("create"))?;
    // One byte, not an empty file: a full disk still makes empty files.
    let probe = dir.join(format!(".merak-write-probe-{rank}"));
    let written = std::fs::write(&probe, b"m");
    // Removing the probe can only fail if someone else removed it first.
    let _ = std::fs::remove_file(&probe);
    written.map_err(fail("write in"))
}

/// Refuses a file (or anything but a folder) at `dir`, where a folder is wanted; creates
/// nothing (a missing folder is fine).
pub fn not_a_file(dir: &Path, what: &str) -> Result<(), OutputError> {
    if dir.exists() && !dir.is_dir() {
        return Err(OutputError::IsAFile {
            what: what.to_string(),
            path: dir.to_path_buf(),
        });
    }
    Ok(())
}

/// Checks that the file `path` can be written: not a folder, its folder writable.
pub fn writable_file(path: &Path, what: &str, rank: usize) -> Result<(), OutputError> {
    if path.is_dir() {
        return Err(OutputError::IsAFolder {
            what: what.to_string(),
            path: path.to_path_buf(),
        });
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    writable_dir(&parent, &format!("folder of the {what}"), rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_folders_and_impossible_paths_are_named() {
        let root = std::env::temp_dir().join(format!("merak-outputs-{}", std::process::id()));
        let file = root.join("a-file");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(&file, b"x").unwrap();
        let e = writable_dir(&file, "output folder", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a-file") && e.contains("is a file"), "{e}");
        let e = writable_dir(&file.join("below"), "output folder", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a-file/below"), "{e}");
        let e = writable_file(&root, "trace", 0).unwrap_err().to_string();
        assert!(e.contains("is a folder"), "{e}");
        writable_dir(&root.join("new/deeper"), "output folder", 0).unwrap();
        writable_file(&root.join("new/trace.json"), "trace", 0).unwrap();
        assert!(!root.join("new/.merak-write-probe-0").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
