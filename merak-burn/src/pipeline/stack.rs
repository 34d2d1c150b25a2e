//! A model laid out as embedding -> layers -> head, of which a pipeline rank may hold only some
//! units: the model supplies the units, the library runs unit ranges and handles a tied
//! embedding (a blanket [`PipelineModel`] implementation).

use std::ops::Range;

use burn::module::{Module, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::batch::Batch;

use crate::pipeline::{
    DEFAULT_METRICS, EvalOutput, Evaluate, PipelineModel, StageInput, StageOutput,
};

/// The two copies of an embedding table tied to the output projection, as a rank holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct TiedTable {
    /// The embedding's table, on the rank that holds the embedding unit.
    pub embedding: Option<ParamId>,
    /// The head's own copy of the table, on a rank that holds the head but not the embedding.
    pub head_copy: Option<ParamId>,
    /// Whether this rank holds the head unit.
    pub holds_head: bool,
    /// The parameter name of the head's copy (stored in checkpoints under `original`).
    pub copy_name: String,
    /// The parameter name of the embedding's table.
    pub original_name: String,
}

/// A model cut into units: unit 0 the embedding, units `1..=L` the layers, unit `L + 1` the
/// head with the loss. The executor only asks a rank for the units it holds.
pub trait UnitStack<B: Backend>: Module<B> {
    /// The number of layers `L`.
    fn layer_count(&self) -> usize;

    /// The width of the hidden states between units.
    fn width(&self) -> usize;

    /// The parts each sequence of the hidden states between units is cut into (tp under
    /// sequence parallelism: each TP rank holds `seq / parts` positions); 1 (the default):
    /// whole sequences.
    fn sequence_parts(&self) -> usize {
        1
    }

    /// The mixture-of-experts layers and their routed experts ([`PipelineModel::experts`]);
    /// `None` (the default): dense.
    fn experts(&self) -> Option<(usize, usize)> {
        None
    }

    /// Moves the balancing biases after a step ([`PipelineModel::balance_experts`]); the
    /// default does nothing.
    fn balance_experts(&mut self, loads: &[Vec<u64>]) {
        let _ = loads;
    }

    /// Unit 0: the micro-batch's inputs to `[batch, positions, hidden]`.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// Unit `index + 1`: layer `index` (0-based), with the micro-batch's side inputs.
    fn layer(&self, index: usize, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3>;

    /// Unit `L + 1`: the summed loss of `x` against the micro-batch's targets
    /// ([`HeadUnit::loss`](crate::parallelize::HeadUnit::loss)).
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

    /// The names of the metric sums [`head_eval`](Self::head_eval) returns
    /// ([`PipelineModel::metric_names`]).
    fn metric_names(&self) -> Vec<&'static str> {
        DEFAULT_METRICS.to_vec()
    }

    /// The tied embedding, when the head projects onto the token table.
    fn tied(&self) -> Option<TiedTable> {
        None
    }

    /// The parameters unit `unit` (held by this rank) reads, a tied head's table included:
    /// what ZeRO-3 gathers before running the unit ([`param_ids`] of its modules). `None` (the
    /// default) when the model does not say; ZeRO-3 then refuses it.
    fn unit_params(&self, unit: usize) -> Option<Vec<ParamId>> {
        let _ = unit;
        None
    }
}

/// The ids of every float parameter of `module`, in visit order (`None`: none).
pub fn param_ids<B: Backend, M: Module<B>>(module: Option<&M>) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    if let Some(m) = module {
        m.visit(&mut ids);
    }
    ids.0
}

/// The hidden states after the units of `range` below the head.
fn through_layers<B: Backend, T: UnitStack<B>>(
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

impl<B: Backend, T: UnitStack<B>> PipelineModel<B> for T {
    fn units(&self) -> usize {
        self.layer_count() + 2
    }

    fn hidden_size(&self) -> usize {
        self.width()
    }

    fn sequence_parts(&self) -> usize {
        UnitStack::sequence_parts(self)
    }

    fn experts(&self) -> Option<(usize, usize)> {
        UnitStack::experts(self)
    }

    fn metric_names(&self) -> Vec<&'static str> {
        UnitStack::metric_names(self)
    }

    fn balance_experts(&mut self, loads: &[Vec<u64>]) {
        UnitStack::balance_experts(self, loads)
    }

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

    fn tied_embedding(&self) -> Option<ParamId> {
        let t = self.tied()?;
        match (t.embedding, t.head_copy) {
            (Some(e), None) if !t.holds_head => Some(e),
            (None, Some(c)) => Some(c),
            _ => None,
        }
    }

    fn unit_params(&self, unit: usize) -> Option<Vec<ParamId>> {
        UnitStack::unit_params(self, unit)
    }

    fn tied_names(&self) -> Vec<(String, String)> {
        self.tied()
            .map(|t| vec![(t.copy_name, t.original_name)])
            .unwrap_or_default()
    }
}
