//! A model described unit by unit, so that each rank builds only the units it holds.

use burn::tensor::backend::Backend;

use crate::comm::Group;
use crate::context_parallel::ContextShare;
use crate::moe::MoePlace;
use crate::parallelize::{EmbedUnit, HeadUnit, LayerUnit, NoTokenTable, TpPlan, Units};
use crate::planner::TransformerShape;
use crate::rng::splitmix64;

/// The sizes of a model that the planner and the pipeline need to know before anything is
/// built: how many blocks there are and how wide the hidden states between units are; and, when
/// the model has them, its attention heads and the width of its last unit's output per
/// position. Build it with [`ModelDims::new`] and the `with_*` setters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelDims {
    /// Repeated middle units (blocks).
    pub layers: usize,
    /// Width of the hidden states between units.
    pub hidden: usize,
    /// Attention heads of a block, when its blocks attend: the planner searches the
    /// tensor-parallel degrees that divide them and sizes the attention scores' activations by
    /// them. `None`: the blocks do not attend; the planner searches the degrees that divide
    /// `hidden` and counts no scores.
    pub attention_heads: Option<usize>,
    /// The width of the last unit's output per position (a vocabulary's logits, the classes
    /// of a classifier), for the planner's activation sizes. `None`: small next to `hidden`.
    pub outputs: Option<usize>,
}

impl ModelDims {
    /// `layers` blocks passing hidden states `hidden` wide, without attention heads or a wide
    /// output.
    pub fn new(layers: usize, hidden: usize) -> Self {
        Self {
            layers,
            hidden,
            attention_heads: None,
            outputs: None,
        }
    }

    /// These sizes with blocks attending with `heads` heads.
    pub fn with_attention_heads(mut self, heads: usize) -> Self {
        self.attention_heads = Some(heads);
        self
    }

    /// These sizes with a last unit `outputs` wide per position (vocabulary, classes).
    pub fn with_outputs(mut self, outputs: usize) -> Self {
        self.outputs = Some(outputs);
        self
    }

    /// The transformer shape the planner sizes activations and messages by, at sequences of
    /// `seq` positions: one head and one output where the model has none (no attention
    /// scores, no logits to speak of).
    pub fn shape(&self, seq: usize) -> TransformerShape {
        let heads = self.attention_heads.unwrap_or(1);
        TransformerShape::gpt(
            self.layers,
            self.hidden,
            heads,
            seq,
            self.outputs.unwrap_or(1),
        )
    }

    /// What the tensor-parallel degree must divide: the attention heads, or without them the
    /// hidden width.
    pub fn tp_divisible(&self) -> usize {
        self.attention_heads.unwrap_or(self.hidden)
    }
}

/// A model that [`merak_burn::run`](crate::run) trains: three Burn modules (a first unit, a
/// repeated block, a last unit with the loss), each built by its own constructor, and a tensor
/// parallel plan naming the linear layers it splits.
///
/// The library calls a constructor only for the units a rank holds, after seeding the
/// backend's generator with the unit's own seed ([`unit_seed`]), and initializes the unit's
/// parameters at once: a rank that builds blocks 5 to 8 gets the weights one process gets.
pub trait UnitModel<B: Backend> {
    /// Unit 0: inputs to hidden states.
    type Embed: EmbedUnit<B>;
    /// Units `1..=layers`: hidden states to hidden states.
    type Layer: LayerUnit<B>;
    /// Unit `layers + 1`: hidden states and targets to the loss.
    type Head: HeadUnit<B>;

    /// The model's sizes.
    fn dims(&self) -> ModelDims;

    /// Builds the first unit.
    fn embed(&self, device: &B::Device) -> Self::Embed;

    /// Builds block `index` (0-based).
    fn layer(&self, index: usize, device: &B::Device) -> Self::Layer;

    /// Builds block `index` (0-based) for a rank at `place`: a model whose blocks hold
    /// mixtures of experts builds each [`MoeLayer`](crate::moe::MoeLayer) with
    /// [`UnitPlace::moe`], so that under expert parallelism it holds only its share of the
    /// routed experts. The library builds blocks with this; the default ignores `place` and
    /// calls [`layer`](Self::layer), which is all a dense model needs (a run with
    /// `parallel.ep > 1` refuses blocks that hold every routed expert).
    fn layer_on(&self, index: usize, place: &UnitPlace, device: &B::Device) -> Self::Layer {
        let _ = place;
        self.layer(index, device)
    }

    /// Builds the last unit.
    fn head(&self, device: &B::Device) -> Self::Head;

    /// Which linear layers tensor parallelism splits, by sub-module path.
    fn tp_plan(&self) -> TpPlan;

    /// Whether the head projects with the first unit's token table
    /// ([`EmbedUnit::table`]) instead of a weight of its own: declared here, the library keeps
    /// a copy on the last pipeline stage and sums the two copies' gradients.
    fn tie_embeddings(&self) -> bool {
        false
    }

    /// `(MoE layers, experts per layer)` when the blocks hold mixtures of experts
    /// ([`crate::moe::MoeLayer`], expert parallelism 1): declared here, the trainer gives an
    /// expert that the tokens of only some data-parallel ranks chose its summed gradient on
    /// every rank, as one process steps it, and logs the routing (`aux_loss`,
    /// `expert_tokens`). Its blocks move their balancing biases (`bias_update_rate`) in
    /// [`LayerUnit::balance_experts`](crate::parallelize::LayerUnit::balance_experts).
    fn experts(&self) -> Option<(usize, usize)> {
        None
    }

    /// Whether the blocks run under context parallelism when their [`UnitPlace::context`]
    /// says so: they attend through [`ContextShare::attention`] and encode the positions of
    /// [`ZigZag::chunks`](crate::context_parallel::ZigZag::chunks). Declared here, a run with
    /// `parallel.cp > 1` hands each rank its share of every sequence; otherwise (the default)
    /// it refuses cp > 1, since the blocks' attention would see only the rank's positions.
    fn context_parallel(&self) -> bool {
        false
    }
}

/// What the library tells a block's constructor about the rank that builds it
/// ([`UnitModel::layer_on`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitPlace {
    /// The expert-parallel group: its ranks split each mixture of experts' routed experts and
    /// exchange tokens (one rank without expert parallelism).
    pub experts: Group,
    /// Under context parallelism (`parallel.cp > 1`, for a model that declares
    /// [`UnitModel::context_parallel`]): this rank's share of every sequence and the
    /// attention over the whole sequences. `None`: whole sequences.
    pub context: Option<ContextShare>,
}

impl UnitPlace {
    /// One rank: every routed expert on it, whole sequences.
    pub fn single() -> Self {
        Self {
            experts: Group::local(),
            context: None,
        }
    }

    /// The place of the mixture of experts in block `layer` (0-based) of a model trained on
    /// sequences of at most `seq` tokens: this rank's expert-parallel group, whole sequences.
    pub fn moe(&self, layer: usize, seq: usize) -> MoePlace {
        MoePlace {
            ep: self.experts,
            ..MoePlace::single(layer, seq)
        }
    }
}

/// The units of model `M` on backend `B`, as a rank holds them.
pub type UnitsOf<B, M> =
    Units<B, <M as UnitModel<B>>::Embed, <M as UnitModel<B>>::Layer, <M as UnitModel<B>>::Head>;

/// The seed of unit `unit`'s weights in a run seeded `seed` (splitmix64 of both).
pub fn unit_seed(seed: u64, unit: usize) -> u64 {
    splitmix64(seed ^ splitmix64(unit as u64 + 1))
}

/// The units of `model` for which `holds(unit)` is true, each built from its own seed, on one
/// rank ([`UnitPlace::single`]: [`build_units_on`] at another place). A tied head needs the
/// token table's name and, on the last stage, a copy of the table: the first unit is then
/// built on every rank and dropped where it is not held.
pub fn build_units<B, M>(
    model: &M,
    seed: u64,
    device: &B::Device,
    holds: impl Fn(usize) -> bool,
) -> Result<UnitsOf<B, M>, NoTokenTable>
where
    B: Backend,
    M: UnitModel<B>,
{
    build_units_on(model, seed, device, holds, &UnitPlace::single())
}

/// [`build_units`] on a rank at `place` (its blocks built by [`UnitModel::layer_on`]).
pub fn build_units_on<B, M>(
    model: &M,
    seed: u64,
    device: &B::Device,
    holds: impl Fn(usize) -> bool,
    place: &UnitPlace,
) -> Result<UnitsOf<B, M>, NoTokenTable>
where
    B: Backend,
    M: UnitModel<B>,
{
    let dims = model.dims();
    let last = dims.layers + 1;
    let tied = model.tie_embeddings();
    let seeded = |unit: usize| B::seed(device, unit_seed(seed, unit));
    let embed = (holds(0) || tied).then(|| {
        seeded(0);
        crate::parallelize::initialized(model.embed(device))
    });
    let layers = (0..dims.layers)
        .map(|i| {
            holds(i + 1).then(|| {
                seeded(i + 1);
                crate::parallelize::initialized(model.layer_on(i, place, device))
            })
        })
        .collect();
    let head = holds(last).then(|| {
        seeded(last);
        crate::parallelize::initialized(model.head(device))
    });
    let units = Units::from_parts(embed, layers, head, dims.hidden).with_experts(model.experts());
    let units = if tied { units.tied()? } else { units };
    Ok(units.retain(holds))
}

/// The first unit, block 0 and the last unit of `model` as a one-block model (its head's
/// weights are not the run's): what [`merak_burn::run`](crate::run) times for the planner and
/// the pipeline's cut, since every block costs the same.
pub fn sample_units<B, M>(
    model: &M,
    seed: u64,
    device: &B::Device,
) -> Result<UnitsOf<B, M>, NoTokenTable>
where
    B: Backend,
    M: UnitModel<B>,
{
    struct OneBlock<'a, M>(&'a M);
    impl<B: Backend, M: UnitModel<B>> UnitModel<B> for OneBlock<'_, M> {
        type Embed = M::Embed;
        type Layer = M::Layer;
        type Head = M::Head;
        fn dims(&self) -> ModelDims {
            ModelDims {
                layers: 1,
                ..self.0.dims()
            }
        }
        fn embed(&self, device: &B::Device) -> M::Embed {
            self.0.embed(device)
        }
        fn layer(&self, index: usize, device: &B::Device) -> M::Layer {
            self.0.layer(index, device)
        }
        fn head(&self, device: &B::Device) -> M::Head {
            self.0.head(device)
        }
        fn tp_plan(&self) -> TpPlan {
            self.0.tp_plan()
        }
        fn tie_embeddings(&self) -> bool {
            self.0.tie_embeddings()
        }
    }
    build_units(&OneBlock(model), seed, device, |_| true)
}
