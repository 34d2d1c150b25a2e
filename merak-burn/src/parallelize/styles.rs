//! A tensor-parallel plan: which linear layers are split, and how, by field path.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::comm::Group;
use crate::tensor_parallel::{SPLIT_CONTAINER, Shard, ShardKind, replace_split};

/// How a [`Linear`](super::Linear) is split across the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpStyle {
    /// Each rank holds a slice of the output features (weight columns and bias); the input is
    /// replicated. Megatron's first layer of a pair (Q/K/V, the MLP's expansion).
    Column,
    /// Each rank holds a slice of the input features (weight rows); the partial outputs are
    /// summed and the full bias added once. The second layer of a pair (the attention output,
    /// the MLP's projection).
    Row,
    /// Every rank holds the whole layer and computes its whole output from the replicated
    /// input, but uses only part of that output; the gradients of the input and of the
    /// weights are summed over the group (each rank's share of them comes from the part it
    /// used). For the key and value projections of grouped-query attention with more TP ranks
    /// than key/value heads: each rank takes the key/value heads its query heads use. The
    /// parameters stay whole, so checkpoints hold them as replicated.
    Shared,
    /// The key or value projection of grouped-query attention, whose output is `heads` whole
    /// key/value heads: [`Column`](Self::Column) when the TP degree divides `heads` (each rank
    /// its own heads), [`Shared`](Self::Shared) when it is a multiple of `heads` (the ranks
    /// whose query heads use a key/value head share it). Any other degree is refused.
    KvHeads {
        /// Key/value heads of the whole layer.
        heads: usize,
    },
}

impl TpStyle {
    /// The style a layer of this style takes over `tp` ranks ([`KvHeads`](Self::KvHeads)
    /// becomes column-parallel or shared; it stays itself over a degree it cannot take).
    pub fn over(self, tp: usize) -> TpStyle {
        match self {
            TpStyle::KvHeads { heads } if tp > 0 && heads.is_multiple_of(tp) => TpStyle::Column,
            TpStyle::KvHeads { heads } if heads > 0 && tp.is_multiple_of(heads) => TpStyle::Shared,
            style => style,
        }
    }
}

/// A layer the plan cannot split, or a pattern that names no layer.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TpPlanError {
    /// The split dimension is not a multiple of the TP degree.
    #[error(
        "{path}: {style:?}-parallel over tp = {tp} needs {what} = {size} to be a multiple of {tp}"
    )]
    NotDivisible {
        /// The layer's path.
        path: String,
        /// Its style.
        style: TpStyle,
        /// The split dimension.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The TP degree.
        tp: usize,
    },
    /// Key/value heads that a TP degree neither divides nor is a multiple of.
    #[error(
        "{path}: tp = {tp} and {heads} key/value heads: the TP degree must divide the \
         key/value heads or be a multiple of them"
    )]
    KvHeads {
        /// The layer's path.
        path: String,
        /// Its key/value heads.
        heads: usize,
        /// The TP degree.
        tp: usize,
    },
    /// A pattern of the plan matched no linear layer of the model.
    #[error(
        "tensor-parallel plan: `{pattern}` matches no linear layer (paths end in e.g. {example})"
    )]
    Unmatched {
        /// The pattern.
        pattern: String,
        /// A path of the model, for comparison.
        example: String,
    },
}

/// Field-path patterns of [`Linear`](super::Linear) layers and how each is split. A pattern is
/// dotted segments (`*` matches any one segment) matched against the end of a layer's path,
/// e.g. `"attn.wq"` or `"layers.*.mlp.w2"`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TpPlan {
    /// `(pattern, style)` pairs; the first that matches a layer decides.
    pub rules: Vec<(String, TpStyle)>,
    /// Sequence parallelism: between the split layers (outside a column-parallel layer's
    /// input and a row-parallel layer's output) each rank holds `seq / tp` positions of every
    /// sequence, so a column-parallel layer all-gathers its input along the sequence and a
    /// row-parallel one reduce-scatters its output; the hidden states between the units are
    /// cut by [`Units::with_sequence_parallel`](super::Units::with_sequence_parallel).
    #[serde(default)]
    pub sequence_parallel: bool,
}

impl TpPlan {
    /// A plan from `(pattern, style)` pairs.
    pub fn new<'a>(rules: impl IntoIterator<Item = (&'a str, TpStyle)>) -> Self {
        Self {
            rules: rules.into_iter().map(|(p, s)| (p.to_string(), s)).collect(),
            sequence_parallel: false,
        }
    }

    /// The same plan with sequence parallelism on or off
    /// ([`sequence_parallel`](Self::sequence_parallel)).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The style of the layer at `path` and the index of the rule that gave it.
    fn style_of(&self, path: &[String]) -> Option<(usize, TpStyle)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, (pattern, _))| matches(pattern, path))
            .map(|(i, (_, s))| (i, *s))
    }
}

/// Whether `pattern` matches the last segments of `path`.
fn matches(pattern: &str, path: &[String]) -> bool {
    let parts: Vec<&str> = pattern.split('.').collect();
    parts.len() <= path.len()
        && (parts.iter().rev())
            .zip(path.iter().rev())
            .all(|(p, s)| *p == "*" || p == s)
}

/// Cuts every [`Linear`](super::Linear) of `module` that `plan` names from its full weights to
/// this rank's slice over `tp` (a no-op split for tp = 1, still recorded), so that the model
/// computes what the unsplit model computes. Every pattern must match a layer.
pub fn shard_module<B: Backend, M: Module<B>>(
    module: M,
    plan: &TpPlan,
    tp: Group,
) -> Result<M, TpPlanError> {
    let mut cutter = Cutter {
        plan,
        tp,
        path: Vec::new(),
        used: vec![false; plan.rules.len()],
        error: None,
        example: String::new(),
    };
    let module = module.map(&mut cutter);
    if let Some(e) = cutter.error {
        return Err(e);
    }
    if let Some(i) = cutter.used.iter().position(|u| !u) {
        return Err(TpPlanError::Unmatched {
            pattern: plan.rules[i].0.clone(),
            example: cutter.example,
        });
    }
    Ok(module)
}

/// The mapper behind [`shard_module`].
struct Cutter<'a> {
    plan: &'a TpPlan,
    tp: Group,
    path: Vec<String>,
    used: Vec<bool>,
    error: Option<TpPlanError>,
    /// The path of some linear layer, for the error of an unmatched pattern.
    example: String,
}

impl Cutter<'_> {
    /// The split of the parameter at the current path: `Some((layer path, style, is weight))`
    /// for the weight or bias of a [`Linear`](super::Linear) the plan names.
    fn target(&mut self) -> Option<(String, TpStyle, bool)> {
        let n = self.path.len();
        if n < 3 || self.path[n - 2] != "linear" {
            return None;
        }
        let weight = match self.path[n - 1].as_str() {
            "weight" => true,
            "bias" => false,
            _ => return None,
        };
        let layer = &self.path[..n - 2];
        self.example = layer.join(".");
        let (rule, style) = self.plan.style_of(layer)?;
        self.used[rule] = true;
        Some((layer.join("."), style.over(self.tp.size()), weight))
    }

    /// This rank's slice of `full` (`[rows, cols]`, one row for a bias) for `style`, or why
    /// it cannot be cut.
    fn cut(
        &self,
        path: &str,
        style: TpStyle,
        full: &[f32],
        [rows, cols]: [usize; 2],
        weight: bool,
    ) -> Result<Option<Vec<f32>>, TpPlanError> {
        let shard = Shard {
            rank: self.tp.rank(),
            size: self.tp.size(),
        };
        let (what, size) = match style {
            TpStyle::Column => ("output features", cols),
            TpStyle::Row => ("input features", rows),
            // Nothing is cut.
            TpStyle::Shared => return Ok(None),
            // Not resolved by `over`: neither divides the other.
            TpStyle::KvHeads { heads } => {
                return Err(TpPlanError::KvHeads {
                    path: path.to_string(),
                    heads,
                    tp: shard.size,
                });
            }
        };
        if style == TpStyle::Row && !weight {
            // A row-parallel bias is added once, after the sum: every rank keeps it whole.
            return Ok(None);
        }
        if !size.is_multiple_of(shard.size) {
            return Err(TpPlanError::NotDivisible {
                path: path.to_string(),
                style,
                what,
                size,
                tp: shard.size,
            });
        }
        Ok(match style {
            TpStyle::Column => Some(shard.columns(full, rows, cols, 1)),
            TpStyle::Row => Some(shard.rows(full, rows, cols)),
            TpStyle::Shared | TpStyle::KvHeads { .. } => None,
        })
    }
}

impl TpStyle {
    /// The split of a weight and a bias of this style.
    fn kinds(self) -> (ShardKind, ShardKind) {
        match self {
            TpStyle::Column => {
                let columns = ShardKind::Columns { segments: 1 };
                (columns, columns)
            }
            // A row-parallel bias is added once, after the sum: every rank keeps it whole.
            TpStyle::Row => (ShardKind::Rows, ShardKind::Replicated),
            // Whole on every rank: the split declares the group only, which the layer's
            // forward pass reads as this style. (An unresolved `KvHeads` is refused by the
            // cut.)
            TpStyle::Shared | TpStyle::KvHeads { .. } => {
                (ShardKind::Replicated, ShardKind::Replicated)
            }
        }
    }
}

impl Cutter<'_> {
    /// At the [`Split`] of a [`Linear`](super::Linear) the plan names: declares its split.
    fn declare(&mut self) {
        let n = self.path.len();
        if n < 2 || self.path[n - 1] != "split" {
            return;
        }
        if let Some((_, style)) = self.plan.style_of(&self.path[..n - 1]) {
            let (weight, bias) = style.over(self.tp.size()).kinds();
            let params = [("linear.weight", weight), ("linear.bias", bias)];
            replace_split(self.tp, params, self.plan.sequence_parallel);
        }
    }
}

impl<B: Backend> ModuleMapper<B> for Cutter<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == SPLIT_CONTAINER {
            self.declare();
        } else {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.pop();
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some((path, style, weight)) = self.target() else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let shape = if D == 1 {
            [1, dims[0]]
        } else {
            [dims[0], dims[D - 1]]
        };
        let full: Vec<f32> = tensor
            .to_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default();
        let cut = self.cut(&path, style, &full, shape, weight);
        let values = match cut {
            Ok(Some(v)) => v,
            Ok(None) => return Param::from_mapped_value(id, tensor, mapper),
            Err(e) => {
                self.error.get_or_insert(e);
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        let mut local = dims;
        match style {
            TpStyle::Column => local[D - 1] /= self.tp.size(),
            TpStyle::Row => local[0] /= self.tp.size(),
            TpStyle::Shared | TpStyle::KvHeads { .. } => {}
        }
        let mut fresh = Tensor::<B, D>::from_data(TensorData::new(values, local), &tensor.device());
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::parallelize::Linear;
    use burn::nn::LinearConfig;

    #[derive(Module, Debug)]
    struct Pair<B: Backend> {
        up: Linear<B>,
        down: Linear<B>,
    }

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(str::to_string).collect()
    }

    #[test]
    fn patterns_match_the_end_of_a_path_with_wildcards() {
        assert!(matches("attn.wq", &path("layers.3.attn.wq")));
        assert!(matches("layers.*.attn.wq", &path("layers.3.attn.wq")));
        assert!(!matches("attn.wq", &path("layers.3.attn.wk")));
        assert!(!matches("x.attn.wq", &path("attn.wq")));
    }

    #[test]
    fn an_unmatched_pattern_is_named_and_a_matched_one_is_recorded() {
        let device = Default::default();
        let pair = Pair::<Cpu> {
            up: LinearConfig::new(4, 8).init(&device).into(),
            down: LinearConfig::new(8, 4).init(&device).into(),
        };
        let plan = TpPlan::new([("up", TpStyle::Column), ("mlp.down", TpStyle::Row)]);
        let e = shard_module(pair, &plan, Group::local()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor-parallel plan: `mlp.down` matches no linear layer (paths end in e.g. down)"
        );
        let pair = Pair::<Cpu> {
            up: LinearConfig::new(4, 8).init(&device).into(),
            down: LinearConfig::new(8, 4).init(&device).into(),
        };
        let plan = TpPlan::new([("up", TpStyle::Column), ("down", TpStyle::Row)]);
        let x = Tensor::<Cpu, 2>::ones([3, 4], &device);
        let before = pair.down.forward(pair.up.forward(x.clone())).into_data();
        let pair = shard_module(pair, &plan, Group::local()).expect("a valid plan");
        let after = pair.down.forward(pair.up.forward(x)).into_data();
        // One rank: the split layers compute what the unsplit ones did.
        after.assert_approx_eq::<f32>(&before, burn::tensor::Tolerance::absolute(1e-6));
        // The cut layers declare their split; the model carries it (a clone too).
        let splits = crate::tensor_parallel::ParamSplits::of(&pair.clone());
        let columns = ShardKind::Columns { segments: 1 };
        assert_eq!(splits.by_name("up.linear.weight"), columns);
        assert_eq!(splits.by_name("up.linear.bias"), columns);
        assert_eq!(splits.by_name("down.linear.weight"), ShardKind::Rows);
        assert_eq!(splits.by_name("down.linear.bias"), ShardKind::Replicated);
        assert_eq!(pair.up.split.group().map(|g| g.size()), Some(1));
    }

    #[test]
    fn a_shared_layer_stays_whole_and_computes_what_it_did() {
        let device = Default::default();
        let pair = Pair::<Cpu> {
            up: LinearConfig::new(4, 6).init(&device).into(),
            down: LinearConfig::new(6, 4).init(&device).into(),
        };
        let x = Tensor::<Cpu, 2>::ones([3, 4], &device);
        let before = pair.down.forward(pair.up.forward(x.clone())).into_data();
        let plan = TpPlan::new([("up", TpStyle::Shared), ("down", TpStyle::Row)]);
        let pair = shard_module(pair, &plan, Group::local()).expect("a valid plan");
        let after = pair.down.forward(pair.up.forward(x)).into_data();
        after.assert_approx_eq::<f32>(&before, burn::tensor::Tolerance::absolute(1e-6));
        // Whole: declared replicated, over the group.
        assert_eq!(pair.up.linear.weight.dims(), [4, 6]);
        let splits = crate::tensor_parallel::ParamSplits::of(&pair);
        assert_eq!(splits.by_name("up.linear.weight"), ShardKind::Replicated);
        assert_eq!(splits.by_name("up.linear.bias"), ShardKind::Replicated);
        assert_eq!(pair.up.split.group().map(|g| g.size()), Some(1));
        assert_eq!(
            serde_json::to_string(&TpStyle::Shared).unwrap(),
            "\"shared\""
        );
    }

    #[test]
    fn kv_heads_split_by_column_or_share_or_are_refused() {
        let kv = TpStyle::KvHeads { heads: 2 };
        assert_eq!(kv.over(1), TpStyle::Column);
        assert_eq!(kv.over(2), TpStyle::Column);
        assert_eq!(kv.over(4), TpStyle::Shared);
        assert_eq!(kv.over(3), kv);
        assert_eq!(TpStyle::Row.over(4), TpStyle::Row);
        let device = Default::default();
        let pair = Pair::<Cpu> {
            up: LinearConfig::new(4, 6).init(&device).into(),
            down: LinearConfig::new(6, 4).init(&device).into(),
        };
        let plan = TpPlan::new([
            ("up", TpStyle::KvHeads { heads: 3 }),
            ("down", TpStyle::Row),
        ]);
        let pair = shard_module(pair, &plan, Group::local()).expect("tp = 1 divides 3");
        let splits = crate::tensor_parallel::ParamSplits::of(&pair);
        let columns = ShardKind::Columns { segments: 1 };
        assert_eq!(splits.by_name("up.linear.weight"), columns);
    }
}
