//! What a model provides so that the pipeline executor can run it stage by stage.

use std::ops::Range;

use burn::module::{AutodiffModule, Module, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::stack::TiedTable;
use crate::batch::{Batch, BatchError, Samples};
use crate::tensor_parallel::ParallelBackend;

/// The input of a stage: the micro-batch's fields for the stage holding the first unit, hidden
/// states otherwise.
#[derive(Clone, Debug)]
pub enum StageInput<B: Backend> {
    /// The first unit reads its inputs from the micro-batch ([`Batch`]).
    Data,
    /// `[batch, positions, hidden]` hidden states from the previous stage.
    Hidden(Tensor<B, 3>),
}

/// The output of a stage: hidden states for the next stage, or the loss of the last one.
#[derive(Clone, Debug)]
pub enum StageOutput<B: Backend> {
    /// `[batch, seq, hidden]`.
    Hidden(Tensor<B, 3>),
    /// The summed loss of the micro-batch ([`HeadUnit::loss`](crate::parallelize::HeadUnit::loss)),
    /// then its logged parts without a graph ([`PipelineModel::loss_parts`]): `[1 + parts]`.
    Loss(Tensor<B, 1>),
}

/// The loss to differentiate in a stage's loss output `[1 + parts]` ([`StageOutput::Loss`]):
/// its first element (the parts, logged only, carry no graph).
pub(crate) fn differentiated<B: Backend>(loss: Tensor<B, 1>) -> Tensor<B, 1> {
    match loss.dims()[0] {
        1 => loss,
        _ => loss.narrow(0, 0, 1),
    }
}

/// What the last unit returns in an evaluation pass ([`PipelineModel::eval_units`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Evaluate {
    /// Sums of the head's metrics over the micro-batch (for example the summed loss, the
    /// correct predictions and the count), `[1, k]`: summed over micro-batches and ranks.
    Metrics,
    /// One row of outputs per sample (for example class scores), `[batch, k]`.
    Predictions,
}

/// The output of a stage in an evaluation pass: hidden states for the next stage, or what the
/// last unit was asked for.
#[derive(Clone, Debug)]
pub enum EvalOutput<B: Backend> {
    /// `[batch, seq, hidden]`.
    Hidden(Tensor<B, 3>),
    /// `[1, k]` metric sums or `[batch, k]` predictions ([`Evaluate`]).
    Values(Tensor<B, 2>),
}

/// The names of a head's default metric sums: the summed loss and its terms
/// ([`HeadUnit::METRICS`](crate::parallelize::HeadUnit::METRICS)).
pub const DEFAULT_METRICS: [&str; 2] = ["loss", "loss_terms"];

/// A model cut into *units* for pipelining: unit 0 is the embedding, units `1..=L` the
/// blocks, unit `L + 1` the head with the loss. A pipeline rank builds the model with only the
/// units of its stages (the others are absent), and the executor runs contiguous unit ranges
/// ([`run_units`](Self::run_units)); it asks a rank only for the units it holds.
///
/// A model described unit by unit ([`Units`](crate::parallelize::Units), what
/// [`merak_burn::run`](crate::run) builds from a [`UnitModel`](crate::entry::UnitModel))
/// implements it, and so do GPT and BERT. An implementation supplies the units (`embed`,
/// `layer`, `head_loss`, and `head_eval` for evaluation) and says what the trainer must know
/// about them; running ranges of them is provided.
pub trait PipelineModel<B: Backend>: Module<B> {
    /// The number of blocks `L` (the units are `L + 2`).
    fn layer_count(&self) -> usize;

    /// The width of the hidden states that pass between units and stages
    /// (`[batch, positions, hidden]`).
    fn hidden_size(&self) -> usize;

    /// Unit 0: the micro-batch's inputs to `[batch, positions, hidden]`.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// Unit `index + 1`: block `index` (0-based), with the micro-batch's side inputs.
    fn layer(&self, index: usize, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// Unit `L + 1`: the summed loss of `x` against the micro-batch's targets
    /// ([`HeadUnit::loss`](crate::parallelize::HeadUnit::loss)), followed by the sums of its
    /// logged parts ([`loss_parts`](Self::loss_parts)) without a graph: `[1 + parts]`.
    fn head_loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 1>;

    /// Unit `L + 1` in an evaluation pass: what `what` asks of `x` against the micro-batch's
    /// targets ([`Evaluate`]); `None` (the default) when the head does not provide it.
    fn head_eval(
        &self,
        x: Tensor<B, 3>,
        batch: &Batch<'_, B>,
        what: Evaluate,
    ) -> Option<Tensor<B, 2>> {
        let _ = (x, batch, what);
        None
    }

    /// The parts each sequence of the hidden states between stages is cut into (cp, times tp
    /// under sequence parallelism: a message holds `seq / parts` positions); 1 (the default):
    /// whole sequences.
    fn sequence_parts(&self) -> usize {
        1
    }

    /// The mixture-of-experts layers of the whole model and their routed experts
    /// (`(layers, experts)`, the same on every rank), for the routing metrics; `None` (the
    /// default): a dense model.
    fn experts(&self) -> Option<(usize, usize)> {
        None
    }

    /// After a step, moves the mixture-of-experts layers' balancing biases given the step's
    /// `loads` (assignments per expert, per MoE layer, over the whole grid); the default does
    /// nothing.
    fn balance_experts(&mut self, loads: &[Vec<u64>]) {
        let _ = loads;
    }

    /// The micro-batch's `samples` (whole sequences, as the data source gave them) with the
    /// fields the model derives from them: the trainer calls it before it cuts the sequences
    /// over the context-parallel group, so a field may look across the cut (GPT's
    /// multi-token-prediction targets, the main targets several positions ahead). The
    /// default adds nothing.
    fn prepare_samples(&self, samples: Samples) -> Result<Samples, BatchError> {
        Ok(samples)
    }

    /// Parameters of the head unit that belong to transformer blocks (GPT's
    /// multi-token-prediction depths): Muon steps their matrices as it steps the blocks'
    /// (`optimizer.kind = "muon"`), where the rest of the head goes to AdamW. Empty (the
    /// default): none.
    fn head_block_params(&self) -> Vec<ParamId> {
        Vec::new()
    }

    /// The names of the loss's parts that a training step logs beside the loss (each a sum
    /// over the micro-batch like the loss, so divided as it is: for example the
    /// multi-token-prediction depths' losses); [`head_loss`](Self::head_loss) returns them
    /// after the loss. Empty (the default): the loss alone.
    fn loss_parts(&self) -> Vec<String> {
        Vec::new()
    }

    /// The names of the metric sums [`head_eval`](Self::head_eval) returns for
    /// [`Evaluate::Metrics`], in order; the default, [`DEFAULT_METRICS`], names a head's
    /// default metrics.
    fn metric_names(&self) -> Vec<&'static str> {
        DEFAULT_METRICS.to_vec()
    }

    /// The tied embedding, when the head projects onto the token table: which copies of it
    /// this rank holds ([`TiedTable`]). `None` (the default): untied.
    fn tied(&self) -> Option<TiedTable> {
        None
    }

    /// The parameters unit `unit` (held by this rank) reads, a tied head's table included:
    /// what ZeRO-3 gathers before running the unit ([`param_ids`](super::param_ids) of its
    /// modules). `None` (the default) when the model does not say; ZeRO-3 then refuses it.
    fn unit_params(&self, unit: usize) -> Option<Vec<ParamId>> {
        let _ = unit;
        None
    }

    /// The number of units, `L + 2`.
    fn units(&self) -> usize {
        self.layer_count() + 2
    }

    /// Runs units `range` (all held by this rank) on `input` (the micro-batch's data when
    /// `range.start == 0`, hidden states otherwise); every unit sees the micro-batch `batch`
    /// (the last one its targets) and the last one returns the summed loss.
    fn run_units(
        &self,
        range: Range<usize>,
        input: StageInput<B>,
        batch: &Batch<'_, B>,
    ) -> StageOutput<B> {
        let last = self.layer_count() + 1;
        let x = through_layers(self, &range, input, batch);
        if range.end <= last {
            return StageOutput::Hidden(x);
        }
        StageOutput::Loss(self.head_loss(x, batch))
    }

    /// Like [`run_units`](Self::run_units), but the last unit returns `what` instead of the
    /// loss; `None` when the model's head does not provide it.
    fn eval_units(
        &self,
        range: Range<usize>,
        input: StageInput<B>,
        batch: &Batch<'_, B>,
        what: Evaluate,
    ) -> Option<EvalOutput<B>> {
        let last = self.layer_count() + 1;
        let x = through_layers(self, &range, input, batch);
        if range.end <= last {
            return Some(EvalOutput::Hidden(x));
        }
        self.head_eval(x, batch, what).map(EvalOutput::Values)
    }

    /// The output head's copy of the token embedding on a rank that holds the head but not the
    /// embedding, or the embedding itself on a rank that holds the embedding but not the head:
    /// the two copies of a tied embedding, whose gradients the trainer sums across the first
    /// and the last pipeline rank ([`sum_tied_grads`](crate::train::sum_tied_grads)). `None`
    /// when the rank holds both or neither, or the head is not tied.
    fn tied_embedding(&self) -> Option<ParamId> {
        let t = self.tied()?;
        match (t.embedding, t.head_copy) {
            (Some(e), None) if !t.holds_head => Some(e),
            (None, Some(c)) => Some(c),
            _ => None,
        }
    }

    /// Whether the parameter `name` is one that pretrained weights of the model's published
    /// form do not hold, and keeps its initial values when a run starts from them (`--init-from`,
    /// [`RunOptions::init`](crate::entry::RunOptions::init)): GPT's multi-token-prediction
    /// depths. The default: none (every parameter must come from the weights).
    fn beyond_pretrained(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// Parameters that are copies of others, as `(copy, original)` names (the head's copy of a
    /// tied embedding): checkpoints store the original only and load it into both.
    fn tied_names(&self) -> Vec<(String, String)> {
        self.tied()
            .map(|t| vec![(t.copy_name, t.original_name)])
            .unwrap_or_default()
    }
}

/// The backend every training entry point asks for: an autodiff backend with the parallel
/// operations, on the outside and on its inner backend (evaluation and the ZeRO copies run
/// there). Implemented for every backend that has both; it names the bound once.
pub trait TrainBackend: AutodiffBackend<InnerBackend: ParallelBackend> + ParallelBackend {}

impl<B> TrainBackend for B
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
{
}

/// A model the trainer runs on `B`: a [`PipelineModel`] with autodiff whose inner module (the
/// model without autodiff, for evaluation) is one too. Implemented for every such model.
pub trait TrainModel<B: TrainBackend>:
    PipelineModel<B> + AutodiffModule<B, InnerModule: PipelineModel<B::InnerBackend>>
{
}

impl<B, M> TrainModel<B> for M
where
    B: TrainBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
    M::InnerModule: PipelineModel<B::InnerBackend>,
{
}

/// The hidden states after the units of `range` below the head.
fn through_layers<B: Backend, T: PipelineModel<B>>(
    stack: &T,
    range: &Range<usize>,
    input: StageInput<B>,
    batch: &Batch<'_, B>,
) -> Tensor<B, 3> {
    let last = stack.layer_count() + 1;
    let mut x = match input {
        StageInput::Data => stack.embed(batch),
        StageInput::Hidden(x) => x,
    };
    for unit in range.start.max(1)..range.end.min(last) {
        x = stack.layer(unit - 1, x, batch);
    }
    x
}
