//! The decoder described to `merak_burn::run` unit by unit.

use merak_burn::prelude::*;

use crate::{Block, Embed, Head, LlamaConfig, tp_plan_of};

impl<B: ParallelBackend> UnitModel<B> for LlamaConfig {
    type Embed = Embed<B>;
    type Layer = Block<B>;
    type Head = Head<B>;

    fn dims(&self) -> ModelDims {
        ModelDims::new(self.layers, self.hidden)
            .with_attention_heads(self.heads)
            .with_outputs(self.vocab)
    }

    fn embed(&self, device: &B::Device) -> Embed<B> {
        Embed::new(self, device)
    }

    fn layer(&self, index: usize, device: &B::Device) -> Block<B> {
        Block::new(self, index, device)
    }

    fn layer_on(&self, index: usize, place: &UnitPlace, device: &B::Device) -> Block<B> {
        Block::on(self, index, place, device)
    }

    fn head(&self, device: &B::Device) -> Head<B> {
        Head::new(self, device)
    }

    fn tp_plan(&self) -> TpPlan {
        tp_plan_of(self)
    }

    fn tie_embeddings(&self) -> bool {
        self.tie_embeddings
    }

    /// The blocks attend through `UnitPlace::context` and rotate at its positions.
    fn context_parallel(&self) -> bool {
        true
    }

    fn experts(&self) -> Option<(usize, usize)> {
        self.moe.map(|m| (self.layers, m.experts))
    }
}
