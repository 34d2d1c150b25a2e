//! A Llama-style decoder (RMSNorm, rotary position embedding, SwiGLU MLP, causal attention)
//! written with Burn's own modules, and the three descriptions that make it dp x tp x pp
//! parallel with merak-burn: which linear layers tensor parallelism splits ([`tp_plan`]), which
//! sub-modules are the pipeline units (the `impl`s of `EmbedUnit`, `LayerUnit` and `HeadUnit`),
//! and nothing else. The model code is what a Burn user writes anyway; its linear layers are
//! `merak_burn::parallelize::Linear` (a `burn::nn::Linear` inside, built with Burn's
//! `LinearConfig`).

mod model;

pub use model::{Block, Embed, Head, Llama, LlamaConfig, tp_plan};
