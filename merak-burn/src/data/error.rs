//! Why a data set cannot be prepared or read.

use thiserror::Error;

/// A data set error; each names the file or the numbers.
#[derive(Debug, Error)]
pub enum DataError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An input text has no tokens.
    #[error("{0}: the input is empty (no text to tokenize)")]
    EmptyInput(String),
    /// An unknown tokenizer name.
    #[error("unknown tokenizer {0:?} (known: gpt2)")]
    Tokenizer(String),
    /// The tokenizer could not be loaded.
    #[error("loading the {name} tokenizer failed: {msg}")]
    TokenizerLoad {
        /// The tokenizer.
        name: String,
        /// What failed.
        msg: String,
    },
    /// A bad split fraction.
    #[error("--val-fraction {0} must be in (0, 0.5]")]
    ValFraction(f64),
    /// `meta.json` is missing or unreadable.
    #[error("{path}: not a merak data set ({msg}); create one with `merak prepare-data`")]
    Meta {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// A value of `meta.json` that no data set can have.
    #[error("{path}: `{key}` is {value}; {why}")]
    MetaValue {
        /// The `meta.json`.
        path: String,
        /// The key.
        key: &'static str,
        /// Its value, as written.
        value: String,
        /// What it must be.
        why: String,
    },
    /// A path of the data set that is not a regular file (nor a link to one).
    #[error(
        "{path}: is {what}, not a regular file (a data set's files must be files or links to files)"
    )]
    NotAFile {
        /// The path.
        path: String,
        /// What it is ("a folder", "a FIFO", ...).
        what: &'static str,
    },
    /// A token file does not hold what `meta.json` says.
    #[error(
        "{path}: holds {bytes} bytes ({got} tokens of 2 bytes) but meta.json says {expected} \
         tokens (truncated or altered?)"
    )]
    Size {
        /// The file.
        path: String,
        /// Tokens from meta.json.
        expected: u64,
        /// Tokens found.
        got: u64,
        /// The file's size in bytes.
        bytes: u64,
    },
    /// A sequence length of zero tokens.
    #[error("model.seq_len is 0: a sequence needs at least one token")]
    ZeroSeqLen,
    /// The data's vocabulary does not fit the model.
    #[error(
        "data.path {path}: tokenized with {tokenizer} (vocabulary {data_vocab}) but model.vocab_size is {model_vocab}; \
         use a model with model.vocab_size >= {data_vocab}"
    )]
    Vocab {
        /// The data folder.
        path: String,
        /// The tokenizer.
        tokenizer: String,
        /// The data's vocabulary size.
        data_vocab: usize,
        /// The model's vocabulary size.
        model_vocab: usize,
    },
    /// A token id the model's embedding does not have.
    #[error(
        "{path}: token {offset} has id {id}, outside the model's vocabulary (model.vocab_size = \
         {model_vocab}; meta.json says the data's vocabulary is {data_vocab}): the data set is \
         damaged or was made with another tokenizer"
    )]
    TokenId {
        /// The token file.
        path: String,
        /// The token's index in the file.
        offset: u64,
        /// Its id.
        id: usize,
        /// The model's vocabulary size.
        model_vocab: usize,
        /// The vocabulary size `meta.json` claims.
        data_vocab: usize,
    },
    /// Too few tokens for one sequence.
    #[error("{path}: {tokens} tokens are too few for one sequence of {need} (model.seq_len + 1)")]
    TooSmall {
        /// The file.
        path: String,
        /// Tokens in the split.
        tokens: u64,
        /// Tokens one sample needs.
        need: u64,
    },
}
