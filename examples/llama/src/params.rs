//! The decoder's parameters at full size by merak name, in and out (pretrained weights,
//! checkpoints, exports).

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use merak_burn::tensor_parallel::SPLIT_CONTAINER;
use thiserror::Error;

pub use merak_burn::session::FullParams;

use crate::{InvalidConfig, Llama, LlamaConfig};

impl<B: Backend> Llama<B> {
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

    /// This model with its parameters replaced by `params` (full size, by merak name): every
    /// parameter must be there with its shape, and nothing else.
    pub fn load_full_params(self, params: &FullParams) -> Result<Self, ParamsError> {
        let mut load = Load {
            path: Vec::new(),
            params,
            seen: HashSet::new(),
            error: None,
        };
        let model = self.map(&mut load);
        if let Some(e) = load.error {
            return Err(e);
        }
        let mut extra: Vec<&String> = (params.keys())
            .filter(|k| !load.seen.contains(*k))
            .collect();
        extra.sort();
        match extra.first() {
            Some(name) => Err(ParamsError::Unexpected {
                name: (*name).clone(),
            }),
            None => Ok(model),
        }
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
}

/// The merak name of the parameter at module path `path` of a [`Llama`] (its blocks are the
/// pipeline's `layers`).
fn merak_name(path: &[String]) -> String {
    match path.split_first() {
        Some((first, rest)) if first == "blocks" => std::iter::once("layers")
            .chain(rest.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("."),
        _ => path.join("."),
    }
}

/// The mapper behind [`Llama::load_full_params`].
struct Load<'a> {
    path: Vec<String>,
    params: &'a FullParams,
    seen: HashSet<String>,
    error: Option<ParamsError>,
}

impl<B: Backend> ModuleMapper<B> for Load<'_> {
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

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        let name = merak_name(&self.path);
        let Some((shape, values)) = self.params.get(&name) else {
            self.error = Some(ParamsError::Missing { name });
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims().to_vec();
        if *shape != dims || values.len() != dims.iter().product::<usize>() {
            self.error = Some(ParamsError::Shape {
                name,
                given: shape.clone(),
                values: values.len(),
                model: dims,
            });
            return Param::from_mapped_value(id, tensor, mapper);
        }
        self.seen.insert(name);
        let mut fresh = Tensor::<B, D>::from_data(
            TensorData::new(values.clone(), tensor.shape()),
            &tensor.device(),
        );
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
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
        self.params.insert(merak_name(&self.path), (shape, values));
    }
}
