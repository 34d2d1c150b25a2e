//! Building units per rank: every layout gets the weights one process gets. Burn's random
//! generator is global to the process, so these checks run in one test of their own binary
//! (a test drawing weights on another thread would change the draws).

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use merak_burn::backend::{CpuAutodiff as Cpu, CpuDevice};
use merak_burn::checkpoint::state;
use merak_burn::parallelize::{EmbedUnit, HeadUnit, LayerUnit, Linear, TpPlan, TpStyle};
use merak_burn::pipeline::PipelineModel;
use merak_burn::session::{ModelDims, UnitModel, build_units, unit_seed};

#[derive(Module, Debug)]
struct Tokens<B: Backend> {
    table: Embedding<B>,
}

#[derive(Module, Debug)]
struct Dense<B: Backend> {
    up: Linear<B>,
}

impl<B: Backend> EmbedUnit<B> for Tokens<B> {
    fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.table.forward(tokens)
    }
    fn table(&self) -> Option<(&Param<Tensor<B, 2>>, &'static str)> {
        Some((&self.table.weight, "table.weight"))
    }
}

impl<B: merak_burn::tensor_parallel::ParallelBackend> LayerUnit<B> for Dense<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        x
    }
}

impl<B: Backend> HeadUnit<B> for Dense<B> {
    fn loss(
        &self,
        x: Tensor<B, 3>,
        _targets: Tensor<B, 2, Int>,
        _table: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 1> {
        x.mean()
    }
}

struct Tiny {
    tied: bool,
}

impl<B: merak_burn::tensor_parallel::ParallelBackend> UnitModel<B> for Tiny {
    type Embed = Tokens<B>;
    type Layer = Dense<B>;
    type Head = Dense<B>;
    fn dims(&self) -> ModelDims {
        ModelDims {
            layers: 4,
            hidden: 4,
            heads: 1,
            vocab: 8,
        }
    }
    fn embed(&self, device: &B::Device) -> Tokens<B> {
        Tokens {
            table: EmbeddingConfig::new(8, 4).init(device),
        }
    }
    fn layer(&self, _index: usize, device: &B::Device) -> Dense<B> {
        Dense {
            up: LinearConfig::new(4, 4).init(device).into(),
        }
    }
    fn head(&self, device: &B::Device) -> Dense<B> {
        self.layer(0, device)
    }
    fn tp_plan(&self) -> TpPlan {
        TpPlan::new([("up", TpStyle::Column)])
    }
    fn tie_embeddings(&self) -> bool {
        self.tied
    }
}

/// The parameters of `model` by checkpoint name.
fn params<M: burn::module::AutodiffModule<Cpu>>(
    model: &M,
) -> std::collections::HashMap<String, Vec<f32>> {
    (state::local_params(model).expect("readable").into_iter())
        .map(|p| (p.name, p.values))
        .collect()
}

#[test]
fn every_rank_builds_its_units_with_the_weights_one_process_gets() {
    a_rank_that_builds_some_units_gets_the_weights_one_process_gets();
    a_tied_head_alone_on_its_rank_holds_a_copy_of_the_first_units_table();
}

fn a_rank_that_builds_some_units_gets_the_weights_one_process_gets() {
    let device = CpuDevice::default();
    let all = params(&build_units(&Tiny { tied: false }, 7, &device, |_| true).expect("built"));
    assert_eq!(all.len(), 1 + 4 * 2 + 2, "{:?}", all.keys());
    // A middle rank holding blocks 2 and 3 (units 3 and 4), another holding the head.
    for held in [vec![3, 4], vec![5], vec![0, 1]] {
        let part = build_units(&Tiny { tied: false }, 7, &device, |u| held.contains(&u));
        let part = params(&part.expect("built"));
        assert!(!part.is_empty());
        for (name, values) in &part {
            assert_eq!(
                Some(values),
                all.get(name),
                "{name} on a rank holding {held:?}"
            );
        }
        assert!(part.len() < all.len());
    }
    // Another seed, other weights; another unit, another seed.
    let other = params(&build_units(&Tiny { tied: false }, 8, &device, |_| true).expect("built"));
    assert_ne!(
        other.get("layers.0.up.linear.weight"),
        all.get("layers.0.up.linear.weight")
    );
    assert_ne!(
        all.get("layers.0.up.linear.weight"),
        all.get("layers.1.up.linear.weight")
    );
    assert_ne!(unit_seed(7, 1), unit_seed(7, 2));
}

fn a_tied_head_alone_on_its_rank_holds_a_copy_of_the_first_units_table() {
    let device = CpuDevice::default();
    let all = build_units(&Tiny { tied: true }, 3, &device, |_| true).expect("built");
    let table = params(&all)
        .remove("embed.table.weight")
        .expect("the table");
    let last = build_units(&Tiny { tied: true }, 3, &device, |u| u == 5).expect("built");
    assert!(last.embed.is_none() && last.head.is_some());
    assert_eq!(params(&last).get("tied_table"), Some(&table));
    assert!(last.tied_embedding().is_some());
    let middle =
        build_units::<Cpu, _>(&Tiny { tied: true }, 3, &device, |u| u == 2).expect("built");
    assert!(middle.embed.is_none() && middle.tied_table.is_none());
}
