//! What running unit ranges needs besides the units: the tied table's copies and the
//! parameters of a module.

use burn::module::{Module, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

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
