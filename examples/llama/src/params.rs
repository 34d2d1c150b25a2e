//! The decoder's parameters at full size by merak name, in and out (pretrained weights,
//! checkpoints, exports).

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use merak_burn::checkpoint::state;
use merak_burn::tensor_parallel::{ParallelBackend, SPLIT_CONTAINER};
use thiserror::Error;

pub use merak_burn::entry::FullParams;

use crate::{InvalidConfig, Llama, LlamaConfig};

impl<B: ParallelBackend> Llama<B> {
    /// A decoder of shape `c` holding `params` (full size, by merak name, e.g. from
    /// [`read_hf_llama`](crate::read_hf_llama) or a checkpoint).
    pub fn from_full_params(
        c: &LlamaConfig,
        params: &FullParams,
        device: &B::Device,
    ) -> Result<Self, ParamsError> {
        c.validate().map_err(ParamsError::Config)?;
        Self::new(c, device).load_full_params(params)
    }
}

impl<B: Backend> Llama<B> {
    /// This model with its parameters replaced by `params` (full size, by merak name): every
    /// parameter must be there with its shape, and nothing else.
    pub fn load_full_params(self, params: &FullParams) -> Result<Self, ParamsError> {
        let shapes = state::param_shapes(&self);
        let mut values = HashMap::with_capacity(shapes.len());
        for p in &shapes {
            let name = merak_name(&p.name);
            let Some((given, v)) = params.get(&name) else {
                return Err(ParamsError::Missing { name });
            };
            if *given != p.shape || v.len() != p.shape.iter().product::<usize>() {
                return Err(ParamsError::Shape {
                    name,
                    given: given.clone(),
                    values: v.len(),
                    model: p.shape.clone(),
                });
            }
            values.insert(p.name.clone(), v.clone());
        }
        let known: HashSet<String> = shapes.iter().map(|p| merak_name(&p.name)).collect();
        if let Some(name) = params.keys().filter(|k| !known.contains(*k)).min() {
            return Err(ParamsError::Unexpected { name: name.clone() });
        }
        state::assign_params(self, values).map_err(|e| ParamsError::Assign(e.to_string()))
    }

    /// Every parameter at full size by merak name (of an unsplit model).
    pub fn full_params(&self) -> FullParams {
        let mut collect = Collect {
            path: Vec::new(),
            params: FullParams::new(),
        };
        self.visit(&mut collect);
        collect.params
    }
}

/// A parameter set that does not fit the model.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ParamsError {
    /// The model's config is not valid.
    #[error(transparent)]
    Config(InvalidConfig),
    /// A parameter of the model has no values.
    #[error("parameter {name} is missing")]
    Missing {
        /// Its merak name.
        name: String,
    },
    /// Values for a parameter the model does not have.
    #[error("parameter {name} is not a parameter of the model")]
    Unexpected {
        /// Its name.
        name: String,
    },
    /// Values of another shape than the model's parameter.
    #[error("parameter {name} has shape {given:?} ({values} values), the model's is {model:?}")]
    Shape {
        /// Its merak name.
        name: String,
        /// The shape given.
        given: Vec<usize>,
        /// The number of values given.
        values: usize,
        /// The model's shape.
        model: Vec<usize>,
    },
    /// The checked values could not be assigned (a parameter the model names twice).
    #[error("{0}")]
    Assign(String),
}

/// The merak name of the parameter at module path `path` (`blocks.3.attn.wq.linear.weight`) of
/// a [`Llama`]: its blocks are the pipeline's `layers`.
fn merak_name(path: &str) -> String {
    match path.strip_prefix("blocks.") {
        Some(rest) => format!("layers.{rest}"),
        None => path.to_string(),
    }
}

/// The visitor behind [`Llama::full_params`].
struct Collect {
    path: Vec<String>,
    params: FullParams,
}

impl<B: Backend> ModuleVisitor<B> for Collect {
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
        let t = param.val();
        let shape = t.dims().to_vec();
        let values = t
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default();
        self.params
            .insert(merak_name(&self.path.join(".")), (shape, values));
    }
}
