//! A model laid out as embedding -> layers -> head, of which a pipeline rank may hold only some
//! units: the model supplies the units, the library runs unit ranges and handles a tied
//! embedding (a blanket [`PipelineModel`] implementation).

use std::ops::Range;

use burn::module::{Module, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::pipeline::{EvalOutput, Evaluate, PipelineModel, StageInput, StageOutput};

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

    /// Unit 0: `[batch, seq]` ids to `[batch, seq, hidden]`.
    fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3>;

    /// Unit `index + 1`: layer `index` (0-based).
    fn layer(&self, index: usize, x: Tensor<B, 3>) -> Tensor<B, 3>;

    /// Unit `L + 1`: the mean loss of `x` against `targets` (negative targets not counted).
    fn head_loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1>;

    /// Unit `L + 1` in an evaluation pass: what `what` asks of `x` against `targets`
    /// ([`Evaluate`]); `None` (the default) when the head does not provide it.
    fn head_eval(
        &self,
        x: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
        what: Evaluate,
    ) -> Option<Tensor<B, 2>> {
        let _ = (x, targets, what);
        None
    }

    /// The tied embedding, when the head projects onto the token table.
    fn tied(&self) -> Option<TiedTable> {
        None
    }
}

/// The hidden states after the units of `range` below the head.
fn through_layers<B: Backend, T: UnitStack<B>>(
    stack: &T,
    range: &Range<usize>,
    input: StageInput<B>,
) -> Tensor<B, 3> {
    let last = stack.layer_count() + 1;
    let mut x = match input {
        StageInput::Tokens(ids) => stack.embed(ids),
        StageInput::Hidden(x) => x,
    };
    for unit in range.start.max(1)..range.end.min(last) {
        x = stack.layer(unit - 1, x);
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

    fn run_units(
        &self,
        range: Range<usize>,
        input: StageInput<B>,
        targets: Option<Tensor<B, 2, Int>>,
    ) -> StageOutput<B> {
        let last = self.layer_count() + 1;
        let x = through_layers(self, &range, input);
        if range.end <= last {
            return StageOutput::Hidden(x);
        }
        let targets = targets.unwrap_or_else(|| panic!("the head (unit {last}) needs targets"));
        StageOutput::Loss(self.head_loss(x, targets))
    }

    fn eval_units(
        &self,
        range: Range<usize>,
        input: StageInput<B>,
        targets: Option<Tensor<B, 2, Int>>,
        what: Evaluate,
    ) -> Option<EvalOutput<B>> {
        let last = self.layer_count() + 1;
        let x = through_layers(self, &range, input);
        if range.end <= last {
            return Some(EvalOutput::Hidden(x));
        }
        let targets = targets.unwrap_or_else(|| panic!("the head (unit {last}) needs targets"));
        self.head_eval(x, targets, what).map(EvalOutput::Values)
    }

    fn tied_embedding(&self) -> Option<ParamId> {
        let t = self.tied()?;
        match (t.embedding, t.head_copy) {
            (Some(e), None) if !t.holds_head => Some(e),
            (None, Some(c)) => Some(c),
            _ => None,
        }
    }

    fn tied_names(&self) -> Vec<(String, String)> {
        self.tied()
            .map(|t| vec![(t.copy_name, t.original_name)])
            .unwrap_or_default()
    }
}
