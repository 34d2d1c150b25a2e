//! Parameters and optimizer state by name: out of a model and its optimizers, and back in.
//!
//! A parameter's name is its path in the module tree (`blocks.0.attn.qkv.linear.weight`),
//! which does not depend on the layout. Burn keys optimizer state by [`ParamId`], which is
//! random per run, so the state is carried by name too. Every optimizer's state of a
//! parameter is stored in the same three places ([`Moments`]: a step count and two tensors of
//! the parameter's shape; see [`StateSlots`]): the AdamW moments, or the other optimizers'
//! tensors in the same places, so that one format cuts and merges all of them across layouts.

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::record::AdaptorRecord;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use super::CheckpointError;
use super::{Slots, StateSlots};
use crate::comm::host::tensor_to_vec;
use crate::kernels::FusedOps;
use crate::tensor_parallel::{ParamSplits, ShardKind};

/// Burn's record of the state of the optimizer `O` of every parameter it has stepped.
pub type OptimizerRecords<O, B> = hashbrown::HashMap<ParamId, AdaptorRecord<O, B>>;

/// Optimizer state (AdamW moments, or another optimizer's state in their places) by
/// parameter name.
pub type NamedMoments = Vec<(String, Moments)>;

/// One parameter of this rank, as stored.
#[derive(Clone, Debug)]
pub struct LocalParam {
    /// Path in the module tree.
    pub name: String,
    /// The parameter's id in this run.
    pub id: ParamId,
    /// This rank's shape.
    pub shape: Vec<usize>,
    /// How the model's layers declare it split across the TP group.
    pub split: ShardKind,
    /// This rank's values, row-major.
    pub values: Vec<f32>,
}

/// One parameter of a model without its values: what a checkpoint or pretrained weights are
/// cut for.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamShape {
    /// Path in the module tree.
    pub name: String,
    /// The parameter's id in this run.
    pub id: ParamId,
    /// This rank's shape.
    pub shape: Vec<usize>,
    /// How the model's layers declare it split across the TP group.
    pub split: ShardKind,
}

/// The optimizer state of one parameter: AdamW's (and Adam's) step count and moments, or
/// another optimizer's state in the same places ([`StateSlots`]; the manifest's `extra`
/// names the optimizer and what each place holds).
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    /// Steps the optimizer has taken on it (0 for optimizers that do not count them).
    pub time: usize,
    /// First moment (or the optimizer's first state tensor), row-major.
    pub m1: Vec<f32>,
    /// Second moment (or the optimizer's second state tensor; zeros where it keeps one),
    /// row-major.
    pub m2: Vec<f32>,
}

#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn name(&self) -> String {
        self.0.join(".")
    }
}

/// A visitor of a module's float parameters by their names (`blocks.0.attn.qkv.weight`).
trait NamedVisitor<B: Backend> {
    /// Visits the parameter called `name`.
    fn visit_named<const D: usize>(&mut self, name: String, param: &Param<Tensor<B, D>>);
}

/// Runs a [`NamedVisitor`] over a module, keeping track of the parameters' names.
struct Named<V> {
    path: Path,
    inner: V,
}

impl<V> Named<V> {
    /// `inner`, to be visited with names ([`visit_with_names`]).
    fn new(inner: V) -> Self {
        Self {
            path: Path::default(),
            inner,
        }
    }
}

impl<B: Backend, V: NamedVisitor<B>> ModuleVisitor<B> for Named<V> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.inner.visit_named(self.path.name(), param);
    }
}

/// `visitor` after visiting every float parameter of `module` with its name.
fn visit_with_names<B: Backend, M: Module<B>, V: NamedVisitor<B>>(module: &M, visitor: V) -> V {
    let mut named = Named::new(visitor);
    module.visit(&mut named);
    named.inner
}

struct Collect<'a, B: AutodiffBackend, O: StateSlots<B::InnerBackend>>
where
    B::InnerBackend: FusedOps,
{
    records: &'a OptimizerRecords<O, B>,
    optim: &'a O,
    moments: Vec<(String, Moments)>,
    error: Option<CheckpointError>,
}

impl<B: AutodiffBackend, O: StateSlots<B::InnerBackend>> Collect<'_, B, O>
where
    B::InnerBackend: FusedOps,
{
    fn read<const D: usize>(&mut self, t: Tensor<B::InnerBackend, D>) -> Vec<f32> {
        read_or_note(t, &mut self.error)
    }

    fn finish(self) -> Result<NamedMoments, CheckpointError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.moments),
        }
    }
}

impl<B: AutodiffBackend, O: StateSlots<B::InnerBackend>> NamedVisitor<B> for Collect<'_, B, O>
where
    B::InnerBackend: FusedOps,
{
    fn visit_named<const D: usize>(&mut self, name: String, param: &Param<Tensor<B, D>>) {
        let Some(record) = self.records.get(&param.id) else {
            return;
        };
        let device = param.val().inner().device();
        let state = record.clone().into_state::<D>();
        let slots = match self.optim.slots_of_state(state, &device) {
            Ok(Some(slots)) => slots,
            Ok(None) => return,
            Err(reason) => {
                self.error
                    .get_or_insert(CheckpointError::Mismatch { name, reason });
                return;
            }
        };
        let m1 = self.read(slots.m1);
        let m2 = match slots.m2 {
            Some(m2) => self.read(m2),
            None => vec![0.0; m1.len()],
        };
        self.moments.push((
            name,
            Moments {
                time: slots.time,
                m1,
                m2,
            },
        ));
    }
}

/// `t`'s values, or none with the error noted in `error` (the first one is kept).
fn read_or_note<B: Backend, const D: usize>(
    t: Tensor<B, D>,
    error: &mut Option<CheckpointError>,
) -> Vec<f32> {
    tensor_to_vec(t).unwrap_or_else(|e| {
        error.get_or_insert(e.into());
        Vec::new()
    })
}

/// Every parameter of a module with its name, shape and values.
struct CollectParams {
    params: Vec<LocalParam>,
    error: Option<CheckpointError>,
}

impl<B: AutodiffBackend> NamedVisitor<B> for CollectParams {
    fn visit_named<const D: usize>(&mut self, name: String, param: &Param<Tensor<B, D>>) {
        let value = param.val().inner();
        let shape = value.dims().to_vec();
        let values = read_or_note(value, &mut self.error);
        self.params.push(LocalParam {
            name,
            id: param.id,
            shape,
            split: ShardKind::Replicated,
            values,
        });
    }
}

/// This rank's parameters, in visit order, with their names.
pub fn local_params<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> Result<Vec<LocalParam>, CheckpointError> {
    let c = CollectParams {
        params: Vec::new(),
        error: None,
    };
    let c = visit_with_names(model, c);
    if let Some(e) = c.error {
        return Err(e);
    }
    let mut params = c.params;
    let splits = ParamSplits::of(model);
    for p in &mut params {
        p.split = splits.by_id(p.id);
    }
    Ok(params)
}

/// The values of the parameters of `model` (any backend) whose names `keep` selects.
struct Selected<'a> {
    keep: &'a dyn Fn(&str) -> bool,
    values: HashMap<String, Vec<f32>>,
    error: Option<CheckpointError>,
}

impl<B: Backend> NamedVisitor<B> for Selected<'_> {
    fn visit_named<const D: usize>(&mut self, name: String, param: &Param<Tensor<B, D>>) {
        if (self.keep)(&name) {
            let values = read_or_note(param.val(), &mut self.error);
            self.values.insert(name, values);
        }
    }
}

/// The values of the parameters of `model` (any backend) whose names `keep` selects, by name.
pub fn selected_params<B: Backend, M: Module<B>>(
    model: &M,
    keep: &dyn Fn(&str) -> bool,
) -> Result<HashMap<String, Vec<f32>>, CheckpointError> {
    let s = Selected {
        keep,
        values: HashMap::new(),
        error: None,
    };
    let s = visit_with_names(model, s);
    match s.error {
        Some(e) => Err(e),
        None => Ok(s.values),
    }
}

/// The state of the optimizer `optim` held in `records`, by parameter name, in the places of
/// the AdamW moments ([`StateSlots`]).
pub fn optimizer_moments<B: AutodiffBackend, M: AutodiffModule<B>, O: StateSlots<B::InnerBackend>>(
    model: &M,
    records: &OptimizerRecords<O, B>,
    optim: &O,
) -> Result<NamedMoments, CheckpointError>
where
    B::InnerBackend: FusedOps,
{
    let c = Collect::<B, O> {
        records,
        optim,
        moments: Vec::new(),
        error: None,
    };
    visit_with_names(model, c).finish()
}

/// The names, shapes and splits of a model's parameters (any backend), in visit order.
pub fn param_shapes<B: Backend, M: Module<B>>(model: &M) -> Vec<ParamShape> {
    struct Shapes(Path, Vec<ParamShape>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.0.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.1.push(ParamShape {
                name: self.0.name(),
                id: param.id,
                shape: param.val().dims().to_vec(),
                split: ShardKind::Replicated,
            });
        }
    }
    let mut s = Shapes(Path::default(), Vec::new());
    model.visit(&mut s);
    let splits = ParamSplits::of(model);
    for p in &mut s.1 {
        p.split = splits.by_id(p.id);
    }
    s.1
}

struct Assign<'a> {
    path: Path,
    values: &'a mut HashMap<String, Vec<f32>>,
    error: Option<CheckpointError>,
}

impl<B: Backend> ModuleMapper<B> for Assign<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let name = self.path.name();
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.dims();
        let n: usize = shape.iter().product();
        let value = match self.values.remove(&name) {
            Some(v) if v.len() == n => v,
            Some(v) => {
                self.error.get_or_insert(CheckpointError::Mismatch {
                    name,
                    reason: format!("{} values for a shard of shape {shape:?}", v.len()),
                });
                return Param::from_mapped_value(id, tensor, mapper);
            }
            None => {
                self.error.get_or_insert(CheckpointError::Mismatch {
                    name,
                    reason: "not in the checkpoint".into(),
                });
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        let require_grad = tensor.is_require_grad();
        let mut fresh = Tensor::<B, D>::from_data(TensorData::new(value, shape), &tensor.device());
        if require_grad {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Replaces every parameter of `model` by the values of the same name in `values` (this rank's
/// shard, row-major). Every parameter must be there with the right number of values, and every
/// entry must be used.
pub fn assign_params<B: Backend, M: Module<B>>(
    model: M,
    mut values: HashMap<String, Vec<f32>>,
) -> Result<M, CheckpointError> {
    let mut a = Assign {
        path: Path::default(),
        values: &mut values,
        error: None,
    };
    let model = model.map(&mut a);
    if let Some(e) = a.error {
        return Err(e);
    }
    if let Some(name) = values.keys().min() {
        return Err(CheckpointError::Mismatch {
            name: name.clone(),
            reason: "in the checkpoint but not in the model".into(),
        });
    }
    Ok(model)
}

struct Build<'a, B: AutodiffBackend, O: StateSlots<B::InnerBackend>>
where
    B::InnerBackend: FusedOps,
{
    moments: &'a HashMap<String, Moments>,
    keep: &'a dyn Fn(ParamId, usize) -> bool,
    optim: &'a O,
    out: OptimizerRecords<O, B>,
}

impl<B: AutodiffBackend, O: StateSlots<B::InnerBackend>> NamedVisitor<B> for Build<'_, B, O>
where
    B::InnerBackend: FusedOps,
{
    fn visit_named<const D: usize>(&mut self, name: String, param: &Param<Tensor<B, D>>) {
        if !(self.keep)(param.id, D) {
            return;
        }
        let Some(m) = self.moments.get(&name) else {
            return;
        };
        let value = param.val();
        let (shape, device) = (value.dims(), value.device());
        let t = |v: &Vec<f32>| {
            Tensor::<B::InnerBackend, D>::from_data(TensorData::new(v.clone(), shape), &device)
        };
        let state = self.optim.state_from_slots(Slots {
            time: m.time,
            m1: t(&m.m1),
            m2: Some(t(&m.m2)),
        });
        self.out
            .insert(param.id, AdaptorRecord::from_state::<D>(state));
    }
}

/// Burn records of the optimizer `optim` for the parameters of `model` that `keep(id, rank)`
/// selects and that have state (this rank's shards, in the places of the AdamW moments) in
/// `moments`.
pub fn optimizer_records<B: AutodiffBackend, M: AutodiffModule<B>, O: StateSlots<B::InnerBackend>>(
    model: &M,
    moments: &HashMap<String, Moments>,
    keep: &dyn Fn(ParamId, usize) -> bool,
    optim: &O,
) -> OptimizerRecords<O, B>
where
    B::InnerBackend: FusedOps,
{
    let b = Build::<B, O> {
        moments,
        keep,
        optim,
        out: hashbrown::HashMap::new(),
    };
    visit_with_names(model, b).out
}
