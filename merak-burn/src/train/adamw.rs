//! AdamW with each parameter's update fused into one pass ([`FusedOps::adamw_step`]).

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::kernels::{AdamWStep, FusedOps, lift, prim};

/// AdamW (decoupled weight decay, bias-corrected moments) as a Burn [`SimpleOptimizer`]: Burn's
/// `AdamW` formula and state record ([`AdamWState`]), with the update of a parameter and its
/// moments done in one pass over memory, in place where the buffers are not shared (Burn's
/// `AdamW` makes about ten tensors per parameter per step). On the CPU it equals Burn's
/// `AdamW` bit for bit (tested).
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAdamW {
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
}

impl FusedAdamW {
    /// AdamW with moment decays `beta1`, `beta2`, `eps` added to the root of the second
    /// moment, and decoupled weight decay `weight_decay`.
    pub fn new(beta1: f32, beta2: f32, eps: f32, weight_decay: f32) -> Self {
        Self {
            beta1,
            beta2,
            eps,
            weight_decay,
        }
    }

    /// Burn's optimizer for a module `M` on the autodiff backend `B`.
    pub fn init<B, M>(self) -> OptimizerAdaptor<Self, M, B>
    where
        B: AutodiffBackend,
        B::InnerBackend: FusedOps,
        M: AutodiffModule<B>,
    {
        OptimizerAdaptor::from(self)
    }
}

impl<B: FusedOps> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let (time, moments) = match state {
            Some(s) => (
                s.momentum.time + 1,
                Some((prim(s.momentum.moment_1), prim(s.momentum.moment_2))),
            ),
            None => (1, None),
        };
        let step = AdamWStep {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            time,
        };
        let (p, m, v) = B::adamw_step(prim(tensor), prim(grad), moments, step);
        let momentum = AdaptiveMomentumState::new(time, lift(m), lift(v));
        (lift(p), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum.moment_1 = state.momentum.moment_1.to_device(device);
        state.momentum.moment_2 = state.momentum.moment_2.to_device(device);
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuAutodiff;
    use burn::module::{Module, Param};
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use burn::tensor::TensorData;

    type AB = CpuAutodiff;

    #[derive(Module, Debug)]
    struct Net<B: burn::tensor::backend::Backend> {
        w: Param<Tensor<B, 2>>,
    }

    fn net() -> Net<AB> {
        let v: Vec<f32> = (0..60)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.05)
            .collect();
        Net {
            w: Param::from_tensor(Tensor::from_data(
                TensorData::new(v, [6, 10]),
                &Default::default(),
            )),
        }
    }

    fn grads(net: &Net<AB>, step: usize) -> GradientsParams {
        let x: Vec<f32> = (0..30)
            .map(|i| ((i * 7 + step * 13) % 17) as f32 * 0.1 - 0.8)
            .collect();
        let x = Tensor::<AB, 2>::from_data(TensorData::new(x, [3, 10]), &Default::default());
        let loss = x.matmul(net.w.val().transpose()).powi_scalar(2).sum();
        GradientsParams::from_grads(loss.backward(), net)
    }

    /// Ten steps of the fused AdamW and of Burn's give the same parameters bit for bit.
    #[test]
    fn equals_burns_adamw_bit_for_bit() {
        for wd in [0.0, 0.1] {
            let (mut a, mut b) = (net(), net());
            let mut fused = FusedAdamW::new(0.9, 0.95, 1e-8, wd).init::<AB, Net<AB>>();
            let mut burn = AdamWConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.95)
                .with_epsilon(1e-8)
                .with_weight_decay(wd)
                .init::<AB, Net<AB>>();
            for step in 0..10 {
                let lr = 1e-2 * (step + 1) as f64;
                let (ga, gb) = (grads(&a, step), grads(&b, step));
                a = fused.step(lr, a, ga);
                b = burn.step(lr, b, gb);
            }
            let va = a.w.val().into_data().into_vec::<f32>().unwrap();
            let vb = b.w.val().into_data().into_vec::<f32>().unwrap();
            assert_eq!(va, vb, "weight decay {wd}");
        }
    }
}
