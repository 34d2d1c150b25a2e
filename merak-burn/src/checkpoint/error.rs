//! What can go wrong with a checkpoint.

use std::path::PathBuf;

use thiserror::Error;

use crate::comm::CommError;

/// A checkpoint that cannot be written or read; every variant names the file or parameter.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The folder has no `manifest.json` (and no `latest` pointer to a folder that has one).
    #[error(
        "{dir}: no manifest.json here, so this is not a complete checkpoint (a checkpoint that was being written when the job died has none; use an earlier step-* folder)"
    )]
    MissingManifest {
        /// The folder.
        dir: PathBuf,
    },
    /// `manifest.json` is not valid.
    #[error("{path}: unreadable manifest: {reason}")]
    BadManifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A shard listed in the manifest does not exist.
    #[error("{file}: shard listed in the manifest is missing")]
    MissingShard {
        /// The shard.
        file: PathBuf,
    },
    /// A shard is shorter or longer than the manifest says.
    #[error("{file}: truncated shard: the manifest says {expected} bytes, the file has {got}")]
    Truncated {
        /// The shard.
        file: PathBuf,
        /// Bytes in the manifest.
        expected: u64,
        /// Bytes on disk.
        got: u64,
    },
    /// A shard's content does not match its checksum.
    #[error(
        "{file}: checksum mismatch (SHA-256 {got}, the manifest says {expected}): the shard was altered or damaged"
    )]
    Checksum {
        /// The shard.
        file: PathBuf,
        /// SHA-256 in the manifest.
        expected: String,
        /// SHA-256 of the file.
        got: String,
    },
    /// A shard's content cannot be decoded.
    #[error("{file}: not a valid shard: {reason}")]
    Corrupt {
        /// The shard.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint and the model disagree on a parameter.
    #[error("parameter {name}: {reason}")]
    Mismatch {
        /// The parameter's name (its path in the module tree).
        name: String,
        /// What differs.
        reason: String,
    },
    /// The checkpoint holds parameters the model lacks, or lacks parameters the model has
    /// (each list names a few and counts them all).
    #[error("{}", unmatched(extra, missing))]
    Unmatched {
        /// The checkpoint's parameters that the model does not have.
        extra: Vec<String>,
        /// The model's parameters that the checkpoint does not hold.
        missing: Vec<String>,
    },
    /// A checkpoint root holds no complete checkpoint.
    #[error("{root}: no checkpoint yet: {reason}")]
    NoCheckpoint {
        /// The checkpoint root.
        root: PathBuf,
        /// What it holds instead.
        reason: String,
    },
    /// A parameter or optimizer moment holds a NaN or an infinity.
    #[error(
        "{}: tensor {name} holds {value} at index {index}: the checkpoint is not usable (written by a run that diverged?)",
        file.display()
    )]
    NonFinite {
        /// The shard file holding the tensor.
        file: PathBuf,
        /// The tensor's name in the shard (`param/...`, `m1/...`, `m2/...`).
        name: String,
        /// The position of the first such value.
        index: usize,
        /// The value.
        value: f32,
    },
    /// An optimizer state that no run can reach: a negative value in a tensor that sums or
    /// averages squares (Adam's second moment, AdaGrad's and RMSprop's squared gradients).
    #[error(
        "{}: tensor {name} holds {value} at index {index}: {reason}, so the checkpoint is not usable (altered or damaged?)",
        file.display()
    )]
    Impossible {
        /// The shard file holding the tensor (the checkpoint's folder when the tensor is put
        /// together from several files).
        file: PathBuf,
        /// The tensor's name in the shard (`m1/...`, `m2/...`).
        name: String,
        /// The position of the first such value in the tensor as stored.
        index: usize,
        /// The value.
        value: f32,
        /// Why no run writes it.
        reason: String,
    },
    /// A test's crash point was reached ([`fault::inject_error`](super::fault::inject_error)).
    #[error("injected failure at {point}")]
    Injected {
        /// The point.
        point: &'static str,
    },
    /// Another rank failed its part of a save: every rank stops together, and that rank's
    /// own error (in its log) names the cause.
    #[error(
        "{}: rank {rank} failed to {what} (its own error names the cause); the checkpoint was not saved",
        dir.display()
    )]
    OtherRank {
        /// The rank that failed first.
        rank: usize,
        /// The checkpoint's partial folder, or its final one.
        dir: PathBuf,
        /// What it failed to do.
        what: &'static str,
    },
    /// The writer thread of an asynchronous save panicked.
    #[error("{}: the checkpoint's writer thread panicked: {message}", dir.display())]
    WriterPanicked {
        /// The checkpoint's partial folder.
        dir: PathBuf,
        /// The panic's message.
        message: String,
    },
    /// A collective operation failed while saving.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// At most this many names are listed in a message; the rest are counted.
const LISTED: usize = 4;

/// `names` for a message: the first few and how many more (`a, b, c, d and 6 more`).
pub fn few_names(names: &[String]) -> String {
    let shown = names[..names.len().min(LISTED)].join(", ");
    match names.len().saturating_sub(LISTED) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// The message of [`CheckpointError::Unmatched`].
fn unmatched(extra: &[String], missing: &[String]) -> String {
    let mut parts = Vec::new();
    if !extra.is_empty() {
        parts.push(format!(
            "the checkpoint holds {} parameter(s) the model lacks ({})",
            extra.len(),
            few_names(extra)
        ));
    }
    if !missing.is_empty() {
        parts.push(format!(
            "the model has {} parameter(s) the checkpoint lacks ({})",
            missing.len(),
            few_names(missing)
        ));
    }
    format!("{}: a different model?", parts.join("; "))
}

impl CheckpointError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| CheckpointError::Io { path, source }
    }
}
