//! A configuration error names the key or the file.

use thiserror::Error;

/// A configuration error; every variant names the key or the file.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path} is not valid TOML: {msg}")]
    Parse {
        /// The path.
        path: String,
        /// The parser's message.
        msg: String,
    },
    /// A key that no configuration has.
    #[error("unknown config key `{key}`{hint}")]
    UnknownKey {
        /// The dotted key.
        key: String,
        /// The keys known at that level.
        hint: String,
    },
    /// A key or value of a config file that is refused (the file named).
    #[error("config file {path}: {source}")]
    InFile {
        /// The path.
        path: String,
        /// What is wrong with the key or value.
        source: Box<ConfigError>,
    },
    /// A `--set` argument without `=`.
    #[error("--set expects key=value, got `{0}`")]
    SetSyntax(String),
    /// A value of the wrong type or out of range.
    #[error("config key `{key}`: {msg}")]
    BadValue {
        /// The dotted key.
        key: String,
        /// What is wrong.
        msg: String,
    },
}
