//! A Llama-style decoder (RMSNorm, rotary position embedding, SwiGLU MLP, causal attention
//! with grouped key/value heads) written with Burn's own modules, and the three descriptions
//! that make it dp x tp x pp parallel with merak-burn: which linear layers tensor parallelism
//! splits ([`tp_plan`], [`tp_plan_of`]), which sub-modules are the pipeline units (the
//! `impl`s of `EmbedUnit`, `LayerUnit` and `HeadUnit`), and nothing else. The model code is
//! what a Burn user writes anyway; its linear layers are `merak_burn::parallelize::Linear` (a
//! `burn::nn::Linear` inside, built with Burn's `LinearConfig`).
//!
//! With [`LlamaConfig::moe`] every block's MLP is merak-burn's mixture-of-experts layer
//! (`merak_burn::moe::MoeLayer`): the decoder is a Mixtral.
//!
//! [`hf`] reads and writes Hugging Face `LlamaForCausalLM` and `MixtralForCausalLM`
//! checkpoints as the model's full-size parameters ([`FullParams`]), which a run of any layout
//! cuts for its ranks.

mod config;
mod data;
pub mod hf;
mod model;
mod params;
mod pretrained;
mod tp;
mod units;

pub use config::{InvalidConfig, LlamaConfig, RopeScaling, SparseMoe};
pub use data::Counting;
pub use hf::{HfLlama, HfLlamaError, read_hf_llama, write_hf_llama};
pub use model::{Attention, Block, Embed, Head, Llama, Mlp};
pub use params::{FullParams, ParamsError};
pub use pretrained::{ExportError, export_checkpoint, manifest_extra, pretrained_or};
pub use tp::{TpLayoutError, tp_plan, tp_plan_for, tp_plan_of};
