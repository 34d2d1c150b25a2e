//! How each parameter is split across the TP group, so that a checkpoint written under one
//! tp degree can be put back together and cut again for another.
//!
//! Every split layer declares how its parameters are split in a [`Split`] field; a parameter
//! that no layer declares split is replicated. [`ParamSplits::of`] reads the declarations of a
//! model (no process-wide table: two models in one process, or a model loaded from a record,
//! carry their own).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::{
    AutodiffModule, Content, Devices, EmptyRecord, HasAutodiffModule, Module, ModuleDisplay,
    ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param, ParamId,
};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use serde::{Deserialize, Serialize};

use super::init::Shard;
use crate::comm::Group;

/// The vocabulary size padded up to a multiple of `tp`, so that every rank holds the same
/// number of rows. Padding rows are zero, never looked up, and kept out of the softmax.
pub fn padded_vocab(vocab: usize, tp: usize) -> usize {
    vocab.div_ceil(tp.max(1)) * tp.max(1)
}

/// The split of one parameter across the TP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ShardKind {
    /// The same full tensor on every rank.
    Replicated,
    /// The last dimension is split; it consists of `segments` equal parts (3 for a fused
    /// Q/K/V projection), each split evenly (see [`Shard::columns`]).
    Columns {
        /// Equal parts of the last dimension, each split separately.
        segments: usize,
    },
    /// The first dimension is split evenly (the weight of a row-parallel layer).
    Rows,
    /// The rows of an embedding table of `vocab` real rows, padded to a multiple of tp and
    /// split evenly; the full tensor has the `vocab` real rows only.
    VocabRows {
        /// The real (unpadded) vocabulary size.
        vocab: usize,
    },
}

/// The container type under which a [`Split`] announces its declaration to a module visitor or
/// mapper: `enter_module(declaration as JSON, SPLIT_CONTAINER)` and the matching `exit_module`,
/// with no parameter in between.
pub const SPLIT_CONTAINER: &str = "merak:Split";

/// A layer's declaration of how its parameters are split across the TP group: a field of the
/// layer (a module without parameters, so it travels with clones, `valid()`, optimizer steps
/// and records), naming each split parameter by its path inside the layer
/// (`"linear.weight"`). Parameters it does not name are replicated. [`ParamSplits::of`] reads
/// every declaration of a model.
///
/// It is generic over the backend only so that Burn's `Module` derive treats it as a module.
#[derive(Clone, Debug)]
pub struct Split<B: Backend> {
    params: Declared,
    group: Option<Group>,
    /// Whether the layer's input (column-parallel) or output (row-parallel) is split along the
    /// sequence over `group` (sequence parallelism).
    sequence_parallel: bool,
    /// `params` as announced to visitors and mappers, written once: models are visited and
    /// mapped several times per training step.
    announced: Arc<str>,
    backend: PhantomData<B>,
}

impl<B: Backend> Split<B> {
    /// Nothing split: every parameter of the layer is whole on every rank.
    pub fn none() -> Self {
        Self::declared(Vec::new(), None)
    }

    /// The parameters at `params` (paths inside the layer) split as given over `group`.
    pub fn new<'a>(group: Group, params: impl IntoIterator<Item = (&'a str, ShardKind)>) -> Self {
        Self::declared(sharded(params), Some(group))
    }

    /// The same declaration, with the hidden states outside the layer split along the
    /// sequence over its group when `on` (sequence parallelism; no effect without a group).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on && self.group.is_some();
        self
    }

    /// Whether the hidden states outside the layer are split along the sequence over its
    /// group ([`with_sequence_parallel`](Self::with_sequence_parallel)).
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The declaration of `params` over `group`, with its announcement.
    fn declared(params: Declared, group: Option<Group>) -> Self {
        let announced = serde_json::to_string(&params).unwrap_or_default().into();
        Self {
            params,
            group,
            sequence_parallel: false,
            announced,
            backend: PhantomData,
        }
    }

    /// The group the parameters are split over (`None` when nothing is split).
    pub fn group(&self) -> Option<Group> {
        self.group
    }

    /// How the parameter at `path` inside the layer is split.
    pub fn kind(&self, path: &str) -> ShardKind {
        (self.params.iter())
            .find(|(p, _)| p == path)
            .map_or(ShardKind::Replicated, |(_, kind)| *kind)
    }

    /// The same declaration on another backend.
    fn on<C: Backend>(&self) -> Split<C> {
        Split {
            params: self.params.clone(),
            group: self.group,
            sequence_parallel: self.sequence_parallel,
            announced: self.announced.clone(),
            backend: PhantomData,
        }
    }
}

/// Split parameters by their path inside the layer that declares them.
type Declared = Vec<(String, ShardKind)>;

/// The split ones of `params`, owned.
fn sharded<'a>(params: impl IntoIterator<Item = (&'a str, ShardKind)>) -> Declared {
    (params.into_iter())
        .filter(|(_, kind)| kind.is_sharded())
        .map(|(path, kind)| (path.to_string(), kind))
        .collect()
}

thread_local! {
    /// A declaration a mapper hands to the [`Split`] it is mapping (see [`replace_split`]).
    static REPLACEMENT: RefCell<Option<(Declared, Group, bool)>> = const { RefCell::new(None) };
}

/// Called by a [`ModuleMapper`] from its `enter_module` when the container is
/// [`SPLIT_CONTAINER`]: the [`Split`] being mapped becomes the declaration of `params` split
/// over `group`, its outside split along the sequence when `sequence_parallel` (Burn's mappers
/// map only parameters; this is how [`shard_module`](crate::parallelize::shard_module)
/// declares the split of the layers it cuts). The hand-over is taken before `map` returns.
pub(crate) fn replace_split<'a>(
    group: Group,
    params: impl IntoIterator<Item = (&'a str, ShardKind)>,
    sequence_parallel: bool,
) {
    let declared = sharded(params);
    REPLACEMENT.with(|r| *r.borrow_mut() = Some((declared, group, sequence_parallel)));
}

impl<B: Backend> Module<B> for Split<B> {
    type Record = EmptyRecord;

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        visitor.enter_module(&self.announced, SPLIT_CONTAINER);
        visitor.exit_module(&self.announced, SPLIT_CONTAINER);
    }

    fn map<M: ModuleMapper<B>>(self, mapper: &mut M) -> Self {
        REPLACEMENT.with(|r| r.borrow_mut().take());
        mapper.enter_module(&self.announced, SPLIT_CONTAINER);
        mapper.exit_module(&self.announced, SPLIT_CONTAINER);
        match REPLACEMENT.with(|r| r.borrow_mut().take()) {
            Some((params, group, sp)) => {
                Self::declared(params, Some(group)).with_sequence_parallel(sp)
            }
            None => self,
        }
    }

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }

    fn into_record(self) -> Self::Record {
        EmptyRecord::new()
    }

    fn to_device(self, _device: &B::Device) -> Self {
        self
    }

    fn fork(self, _device: &B::Device) -> Self {
        self
    }

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        devices
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for Split<B> {
    type InnerModule = Split<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        self.on()
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        module.on()
    }
}

impl<B: AutodiffBackend> HasAutodiffModule<B> for Split<B::InnerBackend> {
    type TrainModule = Split<B>;
}

impl<B: Backend> ModuleDisplayDefault for Split<B> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&self.announced).optional()
    }
}

impl<B: Backend> ModuleDisplay for Split<B> {}

/// The split of every parameter of one model, read from the [`Split`] declarations of its
/// layers (a parameter no layer declares is replicated).
#[derive(Clone, Debug, Default)]
pub struct ParamSplits {
    by_name: HashMap<String, ShardKind>,
    by_id: HashMap<ParamId, ShardKind>,
    split_elements: u64,
    replicated_elements: u64,
    row_layers: u32,
    column_layers: u32,
}

impl ParamSplits {
    /// Walks `module` twice: once for the declarations (by the path of the layer that holds
    /// them), once for the parameters, each taking the declaration of its innermost layer.
    pub fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        let mut declarations = Declarations::default();
        module.visit(&mut declarations);
        let declared = |kind: fn(&ShardKind) -> bool| {
            (declarations.found.iter())
                .filter(|(_, params)| params.iter().any(|(_, k)| kind(k)))
                .count() as u32
        };
        let splits = Self {
            row_layers: declared(|k| *k == ShardKind::Rows),
            column_layers: declared(|k| matches!(k, ShardKind::Columns { .. })),
            ..Self::default()
        };
        let mut params = Params {
            declarations: declarations.found,
            path: Vec::new(),
            splits,
        };
        module.visit(&mut params);
        params.splits
    }

    /// Elements of the parameters split across the TP group, and of the replicated ones.
    pub fn elements(&self) -> (u64, u64) {
        (self.split_elements, self.replicated_elements)
    }

    /// Layers declaring a row split (each sums its partial outputs over the TP group in the
    /// forward pass) and a column split (each sums its input's gradient in the backward
    /// pass).
    pub fn split_layers(&self) -> (u32, u32) {
        (self.row_layers, self.column_layers)
    }

    /// The split of the parameter named `name` (its path in the module tree).
    pub fn by_name(&self, name: &str) -> ShardKind {
        self.by_name
            .get(name)
            .copied()
            .unwrap_or(ShardKind::Replicated)
    }

    /// The split of the parameter `id`.
    pub fn by_id(&self, id: ParamId) -> ShardKind {
        self.by_id
            .get(&id)
            .copied()
            .unwrap_or(ShardKind::Replicated)
    }

    /// The ids of the parameters split across the TP group.
    pub fn sharded_ids(&self) -> HashSet<ParamId> {
        (self.by_id.iter())
            .filter(|(_, kind)| kind.is_sharded())
            .map(|(id, _)| *id)
            .collect()
    }
}

/// The first walk of [`ParamSplits::of`]: every declaration, by the path of its layer.
#[derive(Default)]
struct Declarations {
    path: Vec<String>,
    found: Vec<(Vec<String>, Declared)>,
}

impl<B: Backend> ModuleVisitor<B> for Declarations {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.push(name.to_string());
            return;
        }
        // The path ends in the declaration's own field; the layer is the rest.
        let layer = self.path[..self.path.len().saturating_sub(1)].to_vec();
        let params = serde_json::from_str(name).unwrap_or_default();
        self.found.push((layer, params));
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.pop();
        }
    }
}

/// The second walk of [`ParamSplits::of`]: every parameter with its declared split.
struct Params {
    declarations: Vec<(Vec<String>, Declared)>,
    path: Vec<String>,
    splits: ParamSplits,
}

impl Params {
    /// The split the innermost declaring layer gives the parameter at the current path.
    fn kind(&self) -> ShardKind {
        (self.declarations.iter())
            .filter(|(layer, _)| self.path.starts_with(layer) && self.path.len() > layer.len())
            .max_by_key(|(layer, _)| layer.len())
            .and_then(|(layer, params)| {
                let inside = self.path[layer.len()..].join(".");
                params.iter().find(|(p, _)| *p == inside).map(|(_, k)| *k)
            })
            .unwrap_or(ShardKind::Replicated)
    }
}

impl<B: Backend> ModuleVisitor<B> for Params {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        if container_type != SPLIT_CONTAINER {
            self.path.pop();
        }
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let kind = self.kind();
        let elements = param.val().shape().num_elements() as u64;
        if kind.is_sharded() {
            self.splits.split_elements += elements;
        } else {
            self.splits.replicated_elements += elements;
        }
        self.splits.by_name.insert(self.path.join("."), kind);
        self.splits.by_id.insert(param.id, kind);
    }
}

/// `[rows, cols]` of a shape seen as a matrix (a vector is one row).
fn as_matrix(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [n] => (1, *n),
        [first, rest @ ..] => (*first, rest.iter().product()),
    }
}

impl ShardKind {
    /// Whether every rank holds a different piece.
    pub fn is_sharded(&self) -> bool {
        *self != ShardKind::Replicated
    }

    /// The full (single-process) shape of a parameter whose shard on a group of `tp` ranks has
    /// shape `local`.
    pub fn full_shape(&self, local: &[usize], tp: usize) -> Vec<usize> {
        let mut full = local.to_vec();
        match (self, full.as_mut_slice()) {
            (ShardKind::Replicated, _) | (_, []) => {}
            (ShardKind::Columns { .. }, [.., last]) => *last *= tp,
            (ShardKind::Rows, [first, ..]) => *first *= tp,
            (ShardKind::VocabRows { vocab }, [first, ..]) => *first = *vocab,
        }
        full
    }

    /// The number of values of each rank's piece of a full tensor of shape `full_shape` split
    /// over `tp` ranks, or why that shape cannot be split this way (a zero segment count, a
    /// dimension that does not divide, a size that overflows). Checked arithmetic throughout:
    /// the shape may come from an untrusted file.
    pub fn piece_len(&self, full_shape: &[usize], tp: usize) -> Result<usize, String> {
        let total = full_shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("shape {full_shape:?} has more than {} values", usize::MAX))?;
        if tp == 0 {
            return Err("a tensor-parallel degree of 0".into());
        }
        let (rows, cols) = as_matrix(full_shape);
        match *self {
            ShardKind::Replicated => Ok(total),
            ShardKind::Columns { segments } => {
                let parts = segments
                    .checked_mul(tp)
                    .filter(|&p| p > 0)
                    .ok_or_else(|| format!("{segments} column segments over tp = {tp}"))?;
                if !cols.is_multiple_of(parts) {
                    return Err(format!(
                        "last dimension {cols} is not divisible by {segments} segments x tp = {tp}"
                    ));
                }
                Ok(rows * (cols / tp))
            }
            ShardKind::Rows => match full_shape.first() {
                Some(&first) if first.is_multiple_of(tp) => Ok(total / tp),
                Some(&first) => Err(format!(
                    "first dimension {first} is not divisible by tp = {tp}"
                )),
                None => Err("a row split of a scalar".into()),
            },
            ShardKind::VocabRows { vocab } => {
                if full_shape.len() < 2 || full_shape[0] != vocab {
                    return Err(format!(
                        "a table of {vocab} vocabulary rows in a tensor of shape {full_shape:?}"
                    ));
                }
                vocab
                    .div_ceil(tp)
                    .checked_mul(cols)
                    .ok_or_else(|| format!("shape {full_shape:?} over tp = {tp} overflows"))
            }
        }
    }

    /// This rank's piece (row-major) of the full tensor `full` of shape `full_shape`.
    pub fn cut(&self, full: &[f32], full_shape: &[usize], shard: Shard) -> Vec<f32> {
        let (rows, cols) = as_matrix(full_shape);
        match *self {
            ShardKind::Replicated => full.to_vec(),
            ShardKind::Columns { segments } => shard.columns(full, rows, cols, segments),
            ShardKind::Rows => shard.rows(full, rows, cols),
            ShardKind::VocabRows { .. } => {
                let padded = padded_vocab(rows, shard.size);
                let mut table = full.to_vec();
                table.resize(padded * cols, 0.0);
                shard.rows(&table, padded, cols)
            }
        }
    }

    /// Puts the full tensor of shape `full_shape` back together from the pieces of every rank
    /// of a group (`pieces[r]` from rank `r`); the inverse of [`ShardKind::cut`].
    pub fn merge(&self, pieces: &[Vec<f32>], full_shape: &[usize]) -> Vec<f32> {
        let tp = pieces.len();
        let (rows, cols) = as_matrix(full_shape);
        match *self {
            ShardKind::Replicated => pieces.first().cloned().unwrap_or_default(),
            ShardKind::Columns { segments } => {
                let part = cols / segments / tp;
                let local_cols = cols / tp;
                let mut full = Vec::with_capacity(rows * cols);
                for row in 0..rows {
                    for s in 0..segments {
                        for piece in pieces {
                            let start = row * local_cols + s * part;
                            full.extend_from_slice(&piece[start..start + part]);
                        }
                    }
                }
                full
            }
            ShardKind::Rows => pieces.concat(),
            ShardKind::VocabRows { .. } => {
                let mut full = pieces.concat();
                full.truncate(rows * cols);
                full
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut_all(kind: ShardKind, full: &[f32], shape: &[usize], tp: usize) -> Vec<Vec<f32>> {
        (0..tp)
            .map(|rank| kind.cut(full, shape, Shard { rank, size: tp }))
            .collect()
    }

    #[test]
    fn merge_inverts_cut_for_every_kind_and_degree() {
        let kinds = [
            (ShardKind::Replicated, vec![4, 6]),
            (ShardKind::Columns { segments: 3 }, vec![2, 12]),
            (ShardKind::Columns { segments: 3 }, vec![12]),
            (ShardKind::Columns { segments: 1 }, vec![3, 8]),
            (ShardKind::Rows, vec![8, 3]),
            (ShardKind::VocabRows { vocab: 7 }, vec![7, 2]),
        ];
        for (kind, shape) in kinds {
            let n: usize = shape.iter().product();
            let full: Vec<f32> = (0..n).map(|i| i as f32).collect();
            for tp in [1, 2, 4] {
                let pieces = cut_all(kind, &full, &shape, tp);
                let local: Vec<usize> = match kind {
                    ShardKind::VocabRows { .. } => {
                        vec![padded_vocab(shape[0], tp) / tp, shape[1]]
                    }
                    _ => {
                        let mut l = shape.clone();
                        match kind {
                            ShardKind::Columns { .. } => *l.last_mut().unwrap() /= tp,
                            ShardKind::Rows => l[0] /= tp,
                            _ => {}
                        }
                        l
                    }
                };
                assert_eq!(
                    pieces[0].len(),
                    local.iter().product::<usize>(),
                    "{kind:?} tp={tp}"
                );
                assert_eq!(kind.full_shape(&local, tp), shape, "{kind:?} tp={tp}");
                assert_eq!(kind.merge(&pieces, &shape), full, "{kind:?} tp={tp}");
            }
        }
    }

    #[test]
    fn qkv_columns_keep_each_rank_on_its_own_heads() {
        // [1, 6] = q0 q1 | k0 k1 | v0 v1; rank 1 of 2 holds q1 k1 v1.
        let full = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let kind = ShardKind::Columns { segments: 3 };
        assert_eq!(
            kind.cut(&full, &[1, 6], Shard { rank: 1, size: 2 }),
            vec![1.0, 11.0, 21.0]
        );
    }

    #[derive(Module, Debug)]
    struct Layer<B: Backend> {
        inner: burn::nn::Linear<B>,
        // After the parameters it declares: the order of the fields does not matter.
        split: Split<B>,
    }

    #[derive(Module, Debug)]
    struct Model<B: Backend> {
        layers: Vec<Layer<B>>,
        norm: burn::nn::Linear<B>,
        split: Split<B>,
    }

    #[test]
    fn each_parameter_takes_the_declaration_of_its_innermost_layer() {
        use crate::backend::Cpu;
        let device = Default::default();
        let linear = || burn::nn::LinearConfig::new(2, 4).init::<Cpu>(&device);
        let group = Group::local();
        let cols = ShardKind::Columns { segments: 1 };
        let model = Model {
            layers: vec![
                Layer {
                    inner: linear(),
                    split: Split::new(group, [("inner.weight", cols), ("inner.bias", cols)]),
                },
                Layer {
                    inner: linear(),
                    split: Split::none(),
                },
            ],
            norm: linear(),
            // The outer declaration covers `norm` only: the layers declare their own.
            split: Split::new(group, [("norm.weight", ShardKind::Rows)]),
        };
        let splits = ParamSplits::of(&model.clone());
        assert_eq!(splits.by_name("layers.0.inner.weight"), cols);
        assert_eq!(splits.by_name("layers.0.inner.bias"), cols);
        assert_eq!(
            splits.by_name("layers.1.inner.weight"),
            ShardKind::Replicated
        );
        assert_eq!(splits.by_name("norm.weight"), ShardKind::Rows);
        assert_eq!(splits.by_name("norm.bias"), ShardKind::Replicated);
        assert_eq!(splits.by_id(model.layers[0].inner.weight.id), cols);
        assert_eq!(splits.sharded_ids().len(), 3);
        assert_eq!(splits.elements(), (8 + 4 + 8, 4 + 8 + 4));
        assert_eq!(splits.split_layers(), (1, 1));
        // A second model in the same process carries its own declarations.
        let other = Model {
            layers: vec![],
            norm: linear(),
            split: Split::none(),
        };
        assert!(ParamSplits::of(&other).sharded_ids().is_empty());
    }
}
