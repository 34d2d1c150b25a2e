//! `merak config-reference` (hidden): the built-in default config as TOML, from which the book's
//! configuration reference (`docs/src/reference/config.md`) is generated and checked by
//! `launch/tests/docs_reference.rs`; the keys' meanings come from the doc comments of the
//! config types.

use anyhow::Result;

/// Prints the built-in default config (every key that has a default) as TOML.
pub fn print_default_config() -> Result<()> {
    print!("{}", toml::to_string(&crate::config::Config::default())?);
    Ok(())
}
