//! A model as pipeline units: an embedding, a stack of layers and a head with the loss.

use std::collections::HashSet;
use std::marker::PhantomData;
use std::time::Instant;

use burn::module::{Module, ModuleDisplay, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::batch::{Batch, BatchError, Samples};
use crate::comm::Group;
use crate::context_parallel::ZigZag;
use crate::parallelize::LossSum;

use crate::pipeline::{Evaluate, PipelineModel, TiedTable, param_ids};
use crate::planner::MeasuredUnit;
use crate::tensor_parallel::ops::{gather_from_tp, split_to_tp};
use crate::tensor_parallel::{ParallelBackend, ParamSplits, copy_to_tp};

/// The first pipeline unit: a micro-batch's input fields to hidden states.
pub trait EmbedUnit<B: Backend>: Module<B> + ModuleDisplay {
    /// The micro-batch's inputs (for a token model its [`TOKENS`](crate::batch::TOKENS),
    /// `[batch, seq]` ids) to `[batch, positions, hidden]`.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// The token table `[vocab, hidden]` and its path inside the unit (e.g.
    /// `"tokens.weight"`), for a head tied to it
    /// ([`UnitModel::tie_embeddings`](crate::entry::UnitModel::tie_embeddings), which reads
    /// it as [`Batch::tied_table`]); `None` by default.
    fn table(&self) -> Option<(&Param<Tensor<B, 2>>, &'static str)> {
        None
    }
}

/// A middle pipeline unit (a transformer block): hidden states to hidden states.
pub trait LayerUnit<B: Backend>: Module<B> + ModuleDisplay {
    /// `[batch, positions, hidden]` to `[batch, positions, hidden]`; `batch` holds the
    /// micro-batch's fields, for side inputs every block needs (an attention mask, position
    /// or segment ids).
    fn forward(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// Moves the balancing biases of the block's mixture of experts after a step, given its
    /// `loads` (assignments per expert over the whole step, the same on every rank): a block
    /// holding a [`MoeLayer`](crate::moe::MoeLayer) calls its
    /// [`balance`](crate::moe::MoeLayer::balance). The default does nothing (a dense block).
    fn balance_experts(&mut self, loads: &[u64]) {
        let _ = loads;
    }
}

/// The last pipeline unit: hidden states and the micro-batch's targets to the loss.
pub trait HeadUnit<B: Backend>: Module<B> + ModuleDisplay {
    /// The **sum** of the micro-batch's loss terms with their count ([`LossSum`]; a mean goes
    /// in through [`LossSum::from_mean`]): the trainer divides the sum by the global batch's
    /// loss terms ([`Samples::loss_terms`](crate::batch::Samples)), so every layout computes
    /// the mean one process computes, and `run` refuses, before training, a head whose count
    /// differs from the micro-batch's ([`Batch::loss_terms`]). `x` is `[batch, positions,
    /// hidden]`, the targets are fields of `batch` (for a token model its
    /// [`TARGETS`](crate::batch::TARGETS), negative ids not counted). A head tied to the first
    /// unit's token table
    /// ([`UnitModel::tie_embeddings`](crate::entry::UnitModel::tie_embeddings)) projects
    /// with [`Batch::tied_table`] instead of a weight of its own.
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B>;

    /// The names of the sums [`metrics`](Self::metrics) returns, in its order: a run reports
    /// them by these names ([`MetricSums`](crate::entry::MetricSums)), and refuses, before
    /// training, a head whose metrics have another length. The default names the default
    /// metrics, `["loss", "loss_terms"]`.
    const METRICS: &'static [&'static str] = &["loss", "loss_terms"];

    /// The names of the loss's logged parts ([`LossSum::with_part_mean`]), in the order
    /// [`loss`](Self::loss) adds them: a training step logs each beside the loss (for
    /// example each multi-token-prediction depth's loss of a head with extra depths), and
    /// `run` refuses, before training, a head that adds another number of parts. Empty (the
    /// default): the loss alone.
    const LOSS_PARTS: &'static [&'static str] = &[];

    /// The micro-batch's `samples` (whole sequences) with fields this head derives from them
    /// before context parallelism cuts the sequences over its ranks, for example the targets
    /// several positions ahead that extra prediction depths read; called on the rank that
    /// holds the head, before the cut (and on the sample micro-batch `run` checks first).
    /// The default adds nothing.
    fn prepare_samples(&self, samples: Samples) -> Result<Samples, BatchError> {
        Ok(samples)
    }

    /// Sums of evaluation metrics of `x` against the targets over the micro-batch, one per
    /// name of [`METRICS`](Self::METRICS) (for example `[summed loss, correct predictions,
    /// counted targets]`): the evaluation pass sums them over micro-batches and ranks. The
    /// default is `[summed loss, loss terms]` from [`loss`](Self::loss) and
    /// [`Batch::loss_terms`]: the held-out loss is their quotient. `None`: the head has no
    /// metrics.
    fn metrics(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Option<Tensor<B, 1>> {
        let loss = self.loss(x, batch);
        let terms = loss.terms() as f32;
        let loss = loss.into_sum();
        let terms = Tensor::<B, 1>::from_floats([terms], &loss.device());
        Some(Tensor::cat(vec![loss.cast(terms.dtype()), terms], 0))
    }

    /// One row of outputs per sample, `[batch, k]` (for example class scores, or the logits
    /// of the last position). `None` (the default): the head predicts nothing.
    fn predict(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Option<Tensor<B, 2>> {
        let _ = (x, batch);
        None
    }
}

/// [`Units::tied`] on an embedding unit whose [`EmbedUnit::table`] is `None` (or on units
/// already cut without the embedding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Units::tied: the embedding unit names no token table (implement EmbedUnit::table)")]
pub struct NoTokenTable;

/// A model cut into units, unit 0 the embedding, units `1..=L` the layers, unit `L + 1` the
/// head; a pipeline rank keeps only the units of its stages ([`retain`](Self::retain)). Its
/// parameters are named `embed.*`, `layers.<i>.*` and `head.*` whatever the rank holds, so
/// checkpoints move between layouts. It implements
/// [`PipelineModel`].
#[derive(Module, Debug)]
pub struct Units<B: Backend, E: Module<B>, L: Module<B>, H: Module<B>> {
    /// The embedding (on the first stage's rank).
    pub embed: Option<E>,
    /// The layers (`None` for layers on other pipeline ranks).
    pub layers: Vec<Option<L>>,
    /// The head (on the last stage's rank).
    pub head: Option<H>,
    /// A tied head's own copy of the token table, on a rank that holds the head but not the
    /// embedding; the trainer sums the two copies' gradients.
    pub tied_table: Option<Param<Tensor<B, 2>>>,
    /// Whether the head is tied to the embedding's table.
    #[module(skip)]
    tied: bool,
    /// The table's path inside the embedding unit (known on every rank).
    #[module(skip)]
    table_name: &'static str,
    /// Width of the hidden states between units.
    #[module(skip)]
    hidden: usize,
    /// `(MoE layers, experts per layer)` when the blocks hold mixtures of experts
    /// ([`with_experts`](Self::with_experts)).
    #[module(skip)]
    experts: Option<(usize, usize)>,
    /// The tensor-parallel group the hidden states between the units are split over along
    /// the sequence ([`with_sequence_parallel`](Self::with_sequence_parallel)).
    #[module(skip)]
    sequence: Option<Group>,
    /// The context-parallel group the sequences are cut across
    /// ([`with_context_parallel`](Self::with_context_parallel)).
    #[module(skip)]
    context: Option<Group>,
    #[module(skip)]
    backend: PhantomData<B>,
}

impl<B, E, L, H> Units<B, E, L, H>
where
    B: Backend,
    E: EmbedUnit<B>,
    L: LayerUnit<B>,
    H: HeadUnit<B>,
{
    /// All units of a model whose hidden states are `hidden` wide. Every parameter Burn has not
    /// initialized yet (it initializes a parameter on first use, drawing from the backend's
    /// random generator then) is initialized here, in module order: every rank then holds the
    /// same weights whatever units it later keeps, and clones hold the same values.
    pub fn new(embed: E, layers: Vec<L>, head: H, hidden: usize) -> Self {
        let layers = layers.into_iter().map(Some).collect();
        Self::from_parts(Some(embed), layers, Some(head), hidden)
    }

    /// The units a rank built, `None` for those it does not hold (unit 0 `embed`, units
    /// `1..=L` `layers`, unit `L + 1` `head`), with hidden states `hidden` wide. Parameters not
    /// yet initialized are initialized here, in module order; to get the same weights on every
    /// layout, build and initialize each unit from its own seed first, as
    /// [`build_units`](crate::entry::build_units) does.
    pub fn from_parts(
        embed: Option<E>,
        layers: Vec<Option<L>>,
        head: Option<H>,
        hidden: usize,
    ) -> Self {
        Self {
            embed: embed.map(initialized),
            layers: layers.into_iter().map(|l| l.map(initialized)).collect(),
            head: head.map(initialized),
            tied_table: None,
            tied: false,
            table_name: "",
            hidden,
            experts: None,
            sequence: None,
            context: None,
            backend: PhantomData,
        }
    }

    /// These units under sequence parallelism over the tensor-parallel group `tp` (no effect
    /// for one rank): between the units each rank holds positions `r seq / tp .. (r + 1) seq
    /// / tp` of every sequence. The first unit runs on whole sequences and this rank keeps its
    /// part of its output; the last unit gets whole sequences back (all-gathered), so the
    /// loss and the metrics are those without it. Inside each block the linear layers the
    /// [`TpPlan`](super::TpPlan) splits gather and scatter the positions (cut them with
    /// [`TpPlan::with_sequence_parallel`](super::TpPlan::with_sequence_parallel)), and every
    /// parameter the block holds whole (its norms, a row-parallel bias) sees this rank's
    /// positions only, so its gradient is summed over `tp`. A block must treat positions
    /// independently outside its split layers (norms, residual adds, an MLP between a column-
    /// and a row-parallel layer, attention between them): the sequence length must be a
    /// multiple of `tp`.
    pub fn with_sequence_parallel(mut self, tp: Group) -> Self {
        self.sequence = (tp.size() > 1).then_some(tp);
        self
    }

    /// These units under context parallelism over `cp` (no effect for one rank): each rank's
    /// micro-batches hold its zigzag share of every sequence
    /// ([`shard_samples`](crate::context_parallel::shard_samples)), so every unit runs on
    /// those positions, the blocks attending over the whole sequences through their
    /// [`UnitPlace::context`](crate::entry::UnitPlace::context), and the head's loss and
    /// metrics count this rank's positions (the trainer sums them over the group). Its
    /// per-sample outputs ([`HeadUnit::predict`]) are computed from the whole sequences,
    /// all-gathered.
    pub fn with_context_parallel(mut self, cp: Group) -> Self {
        self.context = (cp.size() > 1).then_some(cp);
        self
    }

    /// These units, declared to hold `experts` = `(MoE layers, experts per layer)`
    /// ([`crate::moe::MoeLayer`]s whose routed experts' parameters are named `….experts.…`):
    /// the trainer then sums each expert's gradient as one process would, whichever ranks'
    /// tokens chose it, and logs the routing.
    pub fn with_experts(mut self, experts: Option<(usize, usize)>) -> Self {
        self.experts = experts;
        self
    }

    /// Ties the head to the embedding's token table ([`EmbedUnit::table`]): the head reads it
    /// as [`Batch::tied_table`], and under pipeline parallelism the last stage keeps a
    /// copy whose gradient is summed with the embedding's. Call it before
    /// [`retain`](Self::retain). Fails when the embedding names no table.
    pub fn tied(mut self) -> Result<Self, NoTokenTable> {
        let (_, name) = (self.embed.as_ref())
            .and_then(|e| e.table())
            .ok_or(NoTokenTable)?;
        self.table_name = name;
        self.tied = true;
        Ok(self)
    }

    /// Drops the units for which `holds(unit)` is false (another pipeline rank's).
    pub fn retain(self, holds: impl Fn(usize) -> bool) -> Self {
        let last = self.layers.len() + 1;
        let copy = self.tied && holds(last) && !holds(0);
        let tied_table = match (&self.embed, copy) {
            (Some(e), true) => e.table().map(|(t, _)| t.clone()),
            _ => self.tied_table,
        };
        Self {
            tied_table,
            tied: self.tied,
            table_name: self.table_name,
            embed: self.embed.filter(|_| holds(0)),
            layers: (self.layers.into_iter().enumerate())
                .map(|(i, l)| l.filter(|_| holds(i + 1)))
                .collect(),
            head: self.head.filter(|_| holds(last)),
            hidden: self.hidden,
            experts: self.experts,
            sequence: self.sequence,
            context: self.context,
            backend: PhantomData,
        }
    }
}

impl<B, E, L, H> Units<B, E, L, H>
where
    B: AutodiffBackend + ParallelBackend,
    E: EmbedUnit<B>,
    L: LayerUnit<B>,
    H: HeadUnit<B>,
{
    /// Seconds of one forward and one backward pass of each unit on the micro-batch `batch`,
    /// the fastest of `reps`: the costs to cut the pipeline by, measured on the backend that
    /// trains. Needs every unit (call it before [`retain`](Self::retain)).
    pub fn unit_costs(&self, batch: &Batch<'_, B>, reps: usize) -> Vec<f64> {
        (self.measure(batch, reps).iter())
            .map(|u| u.forward_s + u.backward_s)
            .collect()
    }

    /// Each unit measured for the planner ([`MeasuredModel`](crate::planner::MeasuredModel)):
    /// its forward and backward seconds on the micro-batch `batch` (the fastest of `reps`),
    /// its parameters split and replicated as its layers declare them (cut it with
    /// [`shard_module`](super::shard_module) first, at tp = 1 for a plan), and its row- and
    /// column-parallel layers. Needs every unit.
    pub fn measure(&self, batch: &Batch<'_, B>, reps: usize) -> Vec<MeasuredUnit> {
        let layers = self.layers.len();
        let mut units = vec![MeasuredUnit::default(); layers + 2];
        for u in units.iter_mut() {
            (u.forward_s, u.backward_s) = (f64::INFINITY, f64::INFINITY);
        }
        for _ in 0..reps.max(1) {
            let mut x = time_unit(&mut units[0], || self.embed(batch));
            for (i, unit) in units[1..=layers].iter_mut().enumerate() {
                let input = x.detach().require_grad();
                x = time_unit(unit, || self.layer(i, input.clone(), batch));
            }
            let input = x.detach().require_grad();
            time_unit(&mut units[layers + 1], || {
                self.head_loss(input.clone(), batch)
            });
        }
        self.count_params(&mut units);
        units
    }

    /// Fills in each unit's parameters and split layers.
    fn count_params(&self, units: &mut [MeasuredUnit]) {
        let count = |u: &mut MeasuredUnit, splits: ParamSplits| {
            (u.params_split, u.params_replicated) = splits.elements();
            (u.row_layers, u.column_layers) = splits.split_layers();
        };
        if let Some(e) = &self.embed {
            count(&mut units[0], ParamSplits::of(e));
        }
        for (u, layer) in units[1..].iter_mut().zip(&self.layers) {
            if let Some(l) = layer {
                count(u, ParamSplits::of(l));
            }
        }
        let last = units.len() - 1;
        if let Some(h) = &self.head {
            count(&mut units[last], ParamSplits::of(h));
        }
        if self.tied {
            let table = (self.embed.as_ref()).and_then(|e| e.table());
            units[last].params_tied =
                table.map_or(0, |(t, _)| t.val().shape().num_elements()) as u64;
        }
    }
}

impl<B, E, L, H> Units<B, E, L, H>
where
    B: Backend,
    E: EmbedUnit<B>,
    L: LayerUnit<B>,
    H: HeadUnit<B>,
{
    /// The token table a tied head projects with (its copy on a rank without the embedding);
    /// `None` for an untied head.
    fn table(&self) -> Option<Tensor<B, 2>> {
        if !self.tied {
            return None;
        }
        let table = (self.tied_table.as_ref())
            .or_else(|| self.embed.as_ref().and_then(|e| e.table().map(|(t, _)| t)))
            .unwrap_or_else(|| panic!("a tied head needs EmbedUnit::table"));
        Some(table.val())
    }
}

impl<B, E, L, H> Units<B, E, L, H>
where
    B: ParallelBackend,
    E: EmbedUnit<B>,
    L: LayerUnit<B>,
    H: HeadUnit<B>,
{
    /// The head's loss of `x` against the micro-batch's targets, with its count of terms
    /// (on the rank holding the head).
    pub fn head_loss_sum(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let head = held(&self.head, self.layers.len() + 1);
        head.loss(self.whole_sequences(x), &self.for_head(batch))
    }

    /// `batch` as the head sees it: with the token table of a tied head.
    fn for_head<'a>(&self, batch: &Batch<'a, B>) -> Batch<'a, B> {
        batch.clone().with_tied_table(self.table())
    }

    /// The hidden states of whole sequences under context parallelism: every rank's zigzag
    /// share all-gathered and put in sequence order (for evaluation; the gradient's own part
    /// is kept backward).
    fn whole_context(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let Some(cp) = self.context else {
            return x;
        };
        let local = x.dims()[1];
        let shards = gather_from_tp(x, 1, cp).chunk(cp.size(), 1);
        debug_assert!(shards.iter().all(|s| s.dims()[1] == local));
        ZigZag::unshard_tensor(shards)
            .unwrap_or_else(|e| panic!("the context-parallel shards of {local} positions: {e}"))
    }

    /// The hidden states of whole sequences, all-gathered under sequence parallelism (the
    /// gradient's own part kept backward).
    fn whole_sequences(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self.sequence {
            Some(tp) => gather_from_tp(x, 1, tp),
            None => x,
        }
    }
}

/// `module` with every parameter initialized, in visit order.
pub(crate) fn initialized<B: Backend, M: Module<B>>(module: M) -> M {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
    module
}

/// Runs `run` once, timing its forward pass and the backward pass of the sum of its output
/// into `unit` (keeping the fastest), and returns the output, detached.
fn time_unit<B: AutodiffBackend, const D: usize>(
    unit: &mut MeasuredUnit,
    run: impl Fn() -> Tensor<B, D>,
) -> Tensor<B, D> {
    let wait = |t: &Tensor<B, D>| {
        // Made to wait for the device by reading one value back.
        let _ = t.clone().flatten::<1>(0, D - 1).slice(0..1).into_data();
    };
    let start = Instant::now();
    let y = run();
    wait(&y);
    unit.forward_s = unit.forward_s.min(start.elapsed().as_secs_f64());
    let start = Instant::now();
    let grads = y.clone().sum().backward();
    drop(grads);
    unit.backward_s = unit.backward_s.min(start.elapsed().as_secs_f64());
    y.detach()
}

/// The unit in `slot`, which the executor only asks of the rank that holds it.
fn held<T>(slot: &Option<T>, unit: usize) -> &T {
    slot.as_ref()
        .unwrap_or_else(|| panic!("unit {unit} is not held by this pipeline rank"))
}

/// `layer` with every parameter it holds whole read through *f* (identity forward, the
/// gradient summed over `tp` backward), for a block that sees only this rank's positions under
/// sequence parallelism: the original parameters get the sum of every rank's part.
fn summed_over<B: ParallelBackend, M: Module<B>>(layer: &M, tp: Group) -> M {
    struct Summed {
        split: HashSet<ParamId>,
        tp: Group,
    }
    impl<B: ParallelBackend> ModuleMapper<B> for Summed {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if self.split.contains(&p.id) {
                return p;
            }
            let tp = self.tp;
            p.map(|t| copy_to_tp(t, tp))
        }
    }
    let split = ParamSplits::of(layer).sharded_ids();
    layer.clone().map(&mut Summed { split, tp })
}

impl<B, E, L, H> PipelineModel<B> for Units<B, E, L, H>
where
    B: ParallelBackend,
    E: EmbedUnit<B>,
    L: LayerUnit<B>,
    H: HeadUnit<B>,
{
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn experts(&self) -> Option<(usize, usize)> {
        self.experts
    }

    fn balance_experts(&mut self, loads: &[Vec<u64>]) {
        for (layer, loads) in self.layers.iter_mut().zip(loads) {
            if let Some(layer) = layer {
                layer.balance_experts(loads);
            }
        }
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn metric_names(&self) -> Vec<&'static str> {
        H::METRICS.to_vec()
    }

    fn sequence_parts(&self) -> usize {
        let parts = |group: Option<Group>| group.map_or(1, |g| g.size());
        parts(self.sequence) * parts(self.context)
    }

    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let x = held(&self.embed, 0).embed(batch);
        match self.sequence {
            // This rank's positions; the whole gradient (all-gathered) backward.
            Some(tp) => split_to_tp(x, 1, tp),
            None => x,
        }
    }

    fn layer(&self, index: usize, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let layer = held(&self.layers[index], index + 1);
        match self.sequence {
            Some(tp) => summed_over(layer, tp).forward(x, batch),
            None => layer.forward(x, batch),
        }
    }

    fn head_loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 1> {
        self.head_loss_sum(x, batch).into_sum_and_parts()
    }

    fn loss_parts(&self) -> Vec<String> {
        H::LOSS_PARTS.iter().map(|p| p.to_string()).collect()
    }

    /// The head's fields ([`HeadUnit::prepare_samples`]) on the rank that holds it.
    fn prepare_samples(&self, samples: Samples) -> Result<Samples, BatchError> {
        match &self.head {
            Some(head) => head.prepare_samples(samples),
            None => Ok(samples),
        }
    }

    fn head_eval(
        &self,
        x: Tensor<B, 3>,
        batch: &Batch<'_, B>,
        what: Evaluate,
    ) -> Option<Tensor<B, 2>> {
        let head = held(&self.head, self.layers.len() + 1);
        let (x, batch) = (self.whole_sequences(x), self.for_head(batch));
        match what {
            Evaluate::Metrics => (head.metrics(x, &batch)).map(|m| m.unsqueeze_dim(0)),
            Evaluate::Predictions => head.predict(self.whole_context(x), &batch),
        }
    }

    /// A tied head reads the embedding's table (or its own copy of it).
    fn unit_params(&self, unit: usize) -> Option<Vec<ParamId>> {
        let last = self.layers.len() + 1;
        let mut ids = if unit == 0 {
            param_ids(self.embed.as_ref())
        } else if unit < last {
            param_ids(self.layers.get(unit - 1)?.as_ref())
        } else {
            param_ids(self.head.as_ref())
        };
        if unit == last && self.tied {
            let table = (self.tied_table.as_ref())
                .or_else(|| self.embed.as_ref().and_then(|e| e.table().map(|(t, _)| t)));
            ids.extend(table.map(|t| t.id));
        }
        Some(ids)
    }

    fn tied(&self) -> Option<TiedTable> {
        if !self.tied {
            return None;
        }
        Some(TiedTable {
            embedding: self
                .embed
                .as_ref()
                .and_then(|e| e.table())
                .map(|(t, _)| t.id),
            head_copy: self.tied_table.as_ref().map(|t| t.id),
            holds_head: self.head.is_some(),
            copy_name: "tied_table".into(),
            original_name: format!("embed.{}", self.table_name),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuAutodiff as Cpu;
    use crate::batch::TOKENS;
    use crate::pipeline::PipelineModel;
    use crate::train::Windows;
    use burn::nn::{Embedding, EmbeddingConfig};

    #[derive(Module, Debug)]
    struct Plain<B: Backend> {
        table: Embedding<B>,
    }

    impl<B: Backend> EmbedUnit<B> for Plain<B> {
        fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
            self.table.forward(batch.int(TOKENS))
        }
    }

    impl<B: Backend> LayerUnit<B> for Plain<B> {
        fn forward(&self, x: Tensor<B, 3>, _batch: &Batch<'_, B>) -> Tensor<B, 3> {
            x
        }
    }

    impl<B: Backend> HeadUnit<B> for Plain<B> {
        fn loss(&self, x: Tensor<B, 3>, _batch: &Batch<'_, B>) -> LossSum<B> {
            let terms = x.dims()[0] * x.dims()[1];
            LossSum::new(x.sum(), terms)
        }
    }

    fn plain(device: &crate::backend::CpuDevice) -> Plain<Cpu> {
        Plain {
            table: EmbeddingConfig::new(8, 4).init(device),
        }
    }

    #[test]
    fn units_run_in_order_and_an_untabled_tie_is_refused() {
        let device = Default::default();
        let units = Units::new(plain(&device), vec![plain(&device)], plain(&device), 4);
        assert_eq!((units.units(), units.hidden_size()), (3, 4));
        let samples = Windows {
            inputs: vec![0, 0],
            targets: vec![0, 0],
        }
        .into_samples(1)
        .expect("one window");
        let batch = Batch::new(&samples, &device);
        let costs = units.unit_costs(&batch, 1);
        assert_eq!(costs.len(), 3);
        assert!(costs.iter().all(|c| c.is_finite() && *c >= 0.0));
        let measured = units.measure(&batch, 2);
        // Each unit holds one unsplit 8 x 4 table.
        assert!(
            measured
                .iter()
                .all(|u| u.params_replicated == 32 && u.params_split == 0)
        );
        assert!(measured.iter().all(|u| u.backward_s.is_finite()));
        assert_eq!(units.tied().err(), Some(NoTokenTable));
        let units = Units::new(plain(&device), vec![plain(&device)], plain(&device), 4);
        let cut = units.retain(|u| u == 2);
        assert!(cut.embed.is_none() && cut.layers[0].is_none() && cut.head.is_some());
        assert_eq!(cut.tied_embedding(), None);
    }
}
