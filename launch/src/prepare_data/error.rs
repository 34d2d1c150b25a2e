//! Why `prepare-data` wrote no data set, and its exit status.

use merak_burn::data::DataError;
use thiserror::Error;

use super::{MAX_UNCUT_BYTES, MAX_WHITESPACE_RUN};

/// Why `prepare-data` wrote no data set.
#[derive(Debug, Error)]
pub enum PrepareError {
    /// A data set error (I/O, tokenizer, empty input, `--val-fraction`).
    #[error(transparent)]
    Data(#[from] DataError),
    /// `--output` names something that is not a folder.
    #[error("--output {0}: is a file, not a folder; name a new folder for the data set")]
    OutputNotAFolder(String),
    /// `--output` already holds a data set.
    #[error(
        "--output {path}: already holds a data set ({file}); prepare-data never overwrites one: \
         name another folder"
    )]
    OutputHoldsDataSet {
        /// The folder.
        path: String,
        /// The data set file found in it.
        file: String,
    },
    /// An input is a folder.
    #[error("--input {0}: is a folder; name the text files in it")]
    InputIsAFolder(String),
    /// An input is not UTF-8.
    #[error("{path}: not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 {
        /// The input.
        path: String,
        /// The offset of the first invalid byte.
        offset: u64,
    },
    /// An input holds a long stretch with no place to cut it.
    #[error(
        "{path}: the {bytes} bytes from offset {offset} hold no place to cut the text (no \
         whitespace after a word, no digit next to a non-digit); prepare-data holds at most \
         {max} such bytes at once: is this text?",
        max = MAX_UNCUT_BYTES
    )]
    NoCut {
        /// The input.
        path: String,
        /// Where the stretch starts.
        offset: u64,
        /// Its length so far.
        bytes: usize,
    },
    /// An input holds a run of whitespace too long for the tokenizer.
    #[error(
        "{path}: a run of more than {max} whitespace characters at offset {offset}, longer than \
         GPT-2's tokenizer takes: is this text?",
        max = MAX_WHITESPACE_RUN
    )]
    LongWhitespace {
        /// The input.
        path: String,
        /// Where the run starts.
        offset: u64,
    },
    /// A signal stopped the command.
    #[error(
        "stopped by {}: the temporary files were removed and no data set was written",
        signal_name(*signal)
    )]
    Interrupted {
        /// The signal's number.
        signal: usize,
    },
}

impl PrepareError {
    /// The exit status: 128 + the signal's number when stopped by one, 2 (bad input) otherwise.
    pub fn exit_status(&self) -> u8 {
        match self {
            PrepareError::Interrupted { signal } => u8::try_from(128 + signal).unwrap_or(u8::MAX),
            _ => 2,
        }
    }
}

/// A signal's name.
pub(super) fn signal_name(signal: usize) -> String {
    match i32::try_from(signal) {
        Ok(signal_hook::consts::SIGINT) => "SIGINT".into(),
        Ok(signal_hook::consts::SIGTERM) => "SIGTERM".into(),
        _ => format!("signal {signal}"),
    }
}
