//! The output folder: checked before any work, temporary files no user file can collide with,
//! and the data set put in place by renames that never replace a file; what the command made
//! is removed again on failure.

use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;

use merak_burn::data::{DataError, Meta, io};
use tempfile::NamedTempFile;

use super::stream::check_stop;
use super::{CHUNK_BYTES, PrepareError};

/// The files of a data set: `prepare-data` never writes into a folder holding one of them.
pub const DATA_SET_FILES: [&str; 3] = ["train.bin", "val.bin", "meta.json"];

/// Refuses an `output` that is not a folder, or a folder that holds a data set already.
pub(super) fn check_output(output: &Path) -> Result<(), PrepareError> {
    match std::fs::metadata(output) {
        Ok(m) if !m.is_dir() => Err(PrepareError::OutputNotAFolder(output.display().to_string())),
        Ok(_) => {
            for name in DATA_SET_FILES {
                let file = output.join(name);
                match file.symlink_metadata() {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    _ => {
                        return Err(PrepareError::OutputHoldsDataSet {
                            path: output.display().to_string(),
                            file: name.into(),
                        });
                    }
                }
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(output)(e).into()),
    }
}

/// Refuses inputs that are missing or folders; the total size when all are regular files (a
/// FIFO's is unknown).
pub(super) fn check_inputs(inputs: &[PathBuf]) -> Result<Option<u64>, PrepareError> {
    let mut total = Some(0u64);
    for path in inputs {
        let m = std::fs::metadata(path).map_err(io(path))?;
        if m.is_dir() {
            return Err(PrepareError::InputIsAFolder(path.display().to_string()));
        }
        total = total
            .filter(|_| m.is_file())
            .and_then(|t| t.checked_add(m.len()));
    }
    Ok(total)
}

/// Makes the `output` folder; returns the folders it made, deepest first.
pub(super) fn create_output(output: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut made = Vec::new();
    let mut dir = output;
    while !dir.as_os_str().is_empty()
        && matches!(dir.symlink_metadata(), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    {
        made.push(dir.to_path_buf());
        match dir.parent() {
            Some(parent) => dir = parent,
            None => break,
        }
    }
    std::fs::create_dir_all(output).map_err(io(output))?;
    Ok(made)
}

/// A new temporary file in `dir`, with a random hidden name no user file has, removed when
/// dropped (unless persisted).
pub(super) fn temp_file(dir: &Path) -> Result<NamedTempFile, DataError> {
    #[cfg(unix)]
    let mode = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o666);
    let mut b = tempfile::Builder::new();
    b.prefix(".merak-prepare-").suffix(".tmp");
    // As `File::create` makes files: readable by others unless the umask says otherwise.
    #[cfg(unix)]
    b.permissions(mode);
    b.tempfile_in(dir).map_err(io(dir))
}

/// Moves the tokens from `split` on out of `all` into a new temporary file in `dir` (copied in
/// chunks, looking at `stop`), and cuts `all` there. Both are synced.
pub(super) fn split_tail(
    all: &mut NamedTempFile,
    split: u64,
    dir: &Path,
    stop: &AtomicUsize,
) -> Result<NamedTempFile, PrepareError> {
    let val = temp_file(dir)?;
    let (from, to) = (all.path().to_path_buf(), val.path().to_path_buf());
    let file = all.as_file_mut();
    file.seek(SeekFrom::Start(split * 2)).map_err(io(&from))?;
    let mut out = BufWriter::new(val.as_file());
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        check_stop(stop)?;
        let n = file.read(&mut buf).map_err(io(&from))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).map_err(io(&to))?;
    }
    out.flush().map_err(io(&to))?;
    drop(out);
    file.set_len(split * 2).map_err(io(&from))?;
    file.sync_all().map_err(io(&from))?;
    val.as_file().sync_all().map_err(io(&to))?;
    Ok(val)
}

/// Paths this command made, removed again when dropped (also by a panic) unless
/// [`Undo::keep`] is called: files, or folders (deepest first; a folder that is not empty
/// stays, and so do the ones above it).
pub(super) struct Undo {
    pub(super) paths: Vec<PathBuf>,
    pub(super) folders: bool,
}

impl Undo {
    /// Keeps the paths.
    pub(super) fn keep(mut self) {
        self.paths.clear();
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        for path in &self.paths {
            let removed = match self.folders {
                true => std::fs::remove_dir(path),
                false => std::fs::remove_file(path),
            };
            if removed.is_err() && self.folders {
                break;
            }
        }
    }
}

/// Renames `tmp` to `path`, failing if `path` exists (it is never replaced), and adds it to
/// `done`.
pub(super) fn persist(tmp: NamedTempFile, path: PathBuf, done: &mut Undo) -> Result<(), DataError> {
    tmp.persist_noclobber(&path)
        .map_err(|e| io(&path)(e.error))?;
    done.paths.push(path);
    Ok(())
}

/// Renames the token files into `output` and writes `meta.json` last; on failure, what was
/// renamed is removed again.
pub(super) fn publish(
    output: &Path,
    train: NamedTempFile,
    val: NamedTempFile,
    meta: &Meta,
) -> Result<(), DataError> {
    let meta_path = output.join("meta.json");
    let json = serde_json::to_vec_pretty(meta).map_err(|e| DataError::Meta {
        path: meta_path.display().to_string(),
        msg: e.to_string(),
    })?;
    let mut tmp = temp_file(output)?;
    tmp.write_all(&json).map_err(io(tmp.path()))?;
    tmp.as_file().sync_all().map_err(io(tmp.path()))?;
    let mut done = Undo {
        paths: Vec::new(),
        folders: false,
    };
    persist(train, output.join("train.bin"), &mut done)?;
    persist(val, output.join("val.bin"), &mut done)?;
    persist(tmp, meta_path, &mut done)?;
    done.keep();
    Ok(())
}
