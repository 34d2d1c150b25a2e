//! Parallelism for a Burn user's own model, by describing it instead of rewriting it.
//!
//! A model written with Burn's modules becomes data-, tensor- and pipeline-parallel in three
//! descriptions:
//!
//! - **Which linear layers tensor parallelism splits**, by field path: a [`TpPlan`] maps
//!   patterns such as `"attn.wq"` to [`TpStyle::Column`] or [`TpStyle::Row`], the way a
//!   tensor-parallel plan maps module names to styles. [`shard_module`] cuts each matching
//!   layer's full weights for this rank. Those layers are [`Linear`]: a `burn::nn::Linear` inside
//!   (built with Burn's `LinearConfig`, `.into()`), whose forward adds the collectives its split
//!   needs (Megatron's *f* before a column-parallel layer, *g* after a row-parallel one). Every
//!   other module stays Burn's own.
//! - **Which sub-modules are the pipeline units**: an embedding ([`EmbedUnit`]), the blocks
//!   ([`LayerUnit`], a `Vec` of them) and a head with the loss ([`HeadUnit`], which returns a
//!   [`LossSum`]). [`Units`] holds
//!   a pipeline rank's share of them and implements
//!   [`PipelineModel`](crate::pipeline::PipelineModel), so the
//!   [`Trainer`](crate::train::Trainer) runs it under any dp x tp x pp layout.
//! - **How the units cost**, for the partition: [`Units::unit_costs`] times them on the
//!   backend that trains, and
//!   [`ParallelPlan::pipeline_with_costs`](crate::parallel_plan::ParallelPlan::pipeline_with_costs)
//!   cuts the stages by those times. For the planner, [`Units::measure`] also counts each
//!   unit's parameters and split layers, and
//!   [`MeasuredModel`](crate::planner::MeasuredModel) makes them a model proxy that
//!   [`planner::search`](crate::planner::search()) plans.
//!
//! A cut [`Linear`] declares its split in its [`Split`](crate::tensor_parallel::Split) field,
//! which [`ParamSplits::of`](crate::tensor_parallel::ParamSplits::of) reads for checkpoints and
//! the gradient norm.

mod linear;
mod loss;
mod styles;
mod units;

pub use linear::Linear;
pub use loss::LossSum;
pub use styles::{TpPlan, TpPlanError, TpStyle, shard_module};
pub(crate) use units::initialized;
pub use units::{EmbedUnit, HeadUnit, LayerUnit, NoTokenTable, Units};
