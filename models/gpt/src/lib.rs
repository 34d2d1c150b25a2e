//! GPT-2 built from merak-burn tensor-parallel layers.
//!
//! Learned position embeddings, pre-LayerNorm blocks, GELU MLP of width 4h, and the output head
//! tied to the (vocabulary-parallel) token embedding. A model built with tp = N holds exactly
//! the shards of the model built with tp = 1 from the same seed.

mod config;
pub mod hf;
pub mod hf_import;
mod model;
#[cfg(test)]
mod mtp_tests;
mod run;

pub use config::{GptConfig, GptConfigError, preset_names};
pub use model::{Block, Gpt, mtp};
