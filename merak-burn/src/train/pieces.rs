//! A rank's ZeRO state ([`Sliced`]): the pieces of the parameters it steps and their
//! optimizer state (the step itself is `train::sliced`).

use std::collections::HashMap;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::state::ParamShape;
use crate::checkpoint::{Moments, Slots};
use crate::data_parallel::slices::RankSlices;
use crate::train::TrainError;

/// A rank's ZeRO state: the pieces it holds and the optimizer state of each.
pub(crate) struct Sliced<B: Backend> {
    /// This rank's pieces of the flat gradients.
    pub slices: RankSlices,
    /// Each parameter's `(offset, len)` in the flat gradients, in visit order.
    pub ranges: Vec<(usize, usize)>,
    /// Each parameter's name, id and shape, in visit order.
    pub params: Vec<ParamShape>,
    /// The optimizer state of each piece (in `slices.pieces` order), once it has stepped.
    pub states: Vec<Option<Slots<B, 1>>>,
}

impl<B: Backend> Sliced<B> {
    /// The slices of a reducer that reduce-scatters (`slices`, `ranges`) over the parameters
    /// `params`, before any step.
    pub fn new(slices: RankSlices, ranges: Vec<(usize, usize)>, params: Vec<ParamShape>) -> Self {
        let states = (0..slices.pieces.len()).map(|_| None).collect();
        Self {
            slices,
            ranges,
            params,
            states,
        }
    }

    /// The pieces' state from whole-tensor `moments` (by name; a checkpoint's, cut for this
    /// rank's tensor-parallel shard).
    pub fn load(&mut self, moments: &HashMap<String, Moments>, device: &B::Device) {
        for (k, p) in self.slices.pieces.iter().enumerate() {
            let Some(m) = moments.get(&self.params[p.param].name) else {
                continue;
            };
            let range = p.param_start..p.param_start + p.len;
            let (Some(m1), Some(m2)) = (m.m1.get(range.clone()), m.m2.get(range)) else {
                continue;
            };
            self.states[k] = Some(Slots {
                time: m.time,
                m1: flat::<B>(m1, device),
                m2: Some(flat::<B>(m2, device)),
            });
        }
    }
}

/// A flat tensor of `values`.
pub(crate) fn flat<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// The values of a flat tensor.
pub(crate) fn values_of<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, TrainError> {
    (t.into_data().convert::<f32>().into_vec::<f32>())
        .map_err(|e| TrainError::Sliced(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    /// The claim the slicing rests on: every optimizer merak trains with updates each element
    /// from that element alone, so stepping pieces of a parameter (cut anywhere, each with its
    /// own state) equals stepping the whole tensor, step after step.
    #[test]
    fn every_optimizer_steps_pieces_as_it_steps_the_whole_tensor() {
        use crate::backend::{Cpu, CpuAutodiff};
        use crate::train::FusedAdamW;
        use burn::module::{Module, Param};
        use burn::optim::decay::WeightDecayConfig;
        use burn::optim::momentum::MomentumConfig;
        use burn::optim::{AdaGradConfig, AdamConfig, RmsPropConfig, SgdConfig, SimpleOptimizer};
        use burn::tensor::backend::Backend;
        use burn::tensor::{Tensor, TensorData};

        #[derive(Module, Debug)]
        struct Net<B: Backend> {
            w: Param<Tensor<B, 2>>,
        }
        type Ad = CpuAutodiff;

        fn compare<O: SimpleOptimizer<Cpu>>(name: &str, o: &O) {
            let device = Default::default();
            let values = |n: usize, k: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i * 37 + k * 11) % 23) as f32 * 0.05 - 0.55)
                    .collect()
            };
            let (rows, cols) = (6, 10);
            let tensor = |v: Vec<f32>| {
                Tensor::<Cpu, 2>::from_data(TensorData::new(v, [rows, cols]), &device)
            };
            let flat = |v: &[f32]| {
                Tensor::<Cpu, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
            };
            let cuts = [0, 7, 8, 33, 60];
            let (mut whole, mut state) = (tensor(values(60, 0)), None);
            let mut pieces: Vec<_> = (cuts.windows(2))
                .map(|c| (flat(&values(60, 0)[c[0]..c[1]]), None))
                .collect();
            for step in 1..=5 {
                let lr = 0.01 * step as f64;
                let grad = values(60, step);
                (whole, state) = o.step(lr, whole, tensor(grad.clone()), state);
                for ((piece, st), c) in pieces.iter_mut().zip(cuts.windows(2)) {
                    let (p, s) = o.step(lr, piece.clone(), flat(&grad[c[0]..c[1]]), st.take());
                    (*piece, *st) = (p, s);
                }
            }
            let whole = whole.into_data().into_vec::<f32>().expect("f32");
            let joined: Vec<f32> = (pieces.into_iter())
                .flat_map(|(p, _)| p.into_data().into_vec::<f32>().expect("f32"))
                .collect();
            assert_eq!(joined, whole, "{name}");
        }
        let l2 = Some(WeightDecayConfig::new(0.1));
        compare("AdamW", &FusedAdamW::new(0.9, 0.95, 1e-8, 0.1));
        let adam = AdamConfig::new()
            .with_weight_decay(l2.clone())
            .init::<Ad, Net<Ad>>();
        compare("Adam", adam.optim());
        let momentum = Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
        });
        let sgd = SgdConfig::new()
            .with_weight_decay(l2.clone())
            .with_momentum(momentum);
        compare("SGD", sgd.init::<Ad, Net<Ad>>().optim());
        let adagrad = AdaGradConfig::new()
            .with_lr_decay(0.01)
            .with_weight_decay(l2.clone());
        compare("AdaGrad", adagrad.init::<Ad, Net<Ad>>().optim());
        let rms = RmsPropConfig::new()
            .with_momentum(0.9)
            .with_centered(true)
            .with_weight_decay(l2);
        compare("RMSProp", &rms.build());
    }
}
