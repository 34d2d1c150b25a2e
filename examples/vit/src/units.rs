//! The vision transformer described to `merak_burn::run` unit by unit.

use merak_burn::prelude::*;

use crate::{Block, Embed, Head, VitConfig, tp_plan};

impl<B: ParallelBackend> UnitModel<B> for VitConfig {
    type Embed = Embed<B>;
    type Layer = Block<B>;
    type Head = Head<B>;

    fn dims(&self) -> ModelDims {
        ModelDims::new(self.layers, self.hidden)
            .with_attention_heads(self.heads)
            .with_outputs(self.classes)
    }

    fn embed(&self, device: &B::Device) -> Embed<B> {
        Embed::new(self, device)
    }

    fn layer(&self, _index: usize, device: &B::Device) -> Block<B> {
        Block::new(self, device)
    }

    fn head(&self, device: &B::Device) -> Head<B> {
        Head::new(self, device)
    }

    fn tp_plan(&self) -> TpPlan {
        tp_plan()
    }
}
