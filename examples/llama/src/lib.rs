//! A Llama-style decoder (RMSNorm, rotary position embedding, SwiGLU MLP, causal attention
//! with grouped key/value heads) written with Burn's own modules, and the three descriptions
//! that make it dp x tp x pp parallel with merak-burn: which linear layers tensor parallelism
//! splits ([`tp_plan`], [`tp_plan_of`]), which sub-modules are the pipeline units (the
//! `impl`s of `EmbedUnit`, `LayerUnit` and `HeadUnit`), and nothing else. The model code is
//! what a Burn user writes anyway; its linear layers are `merak_burn::parallelize::Linear` (a
//! `burn::nn::Linear` inside, built with Burn's `LinearConfig`).
//!
//! [`hf`] reads and writes Hugging Face `LlamaForCausalLM` checkpoints as the model's
//! full-size parameters ([`FullParams`]), which a run of any layout cuts for its ranks.

mod data;
pub mod hf;
mod model;
mod pretrained;
mod units;

pub use data::Counting;
pub use hf::{HfLlama, HfLlamaError, read_hf_llama, write_hf_llama};
pub use model::{
    Attention, Block, Embed, FullParams, Head, InvalidConfig, Llama, LlamaConfig, Mlp, ParamsError,
    RopeScaling, TpLayoutError, tp_plan, tp_plan_for, tp_plan_of,
};
pub use pretrained::{ExportError, export_checkpoint, manifest_extra, pretrained_or};
