//! The optimizer state of one parameter as checkpoints store it: a step count and two tensors
//! of the parameter's shape (`m1`, `m2`; the AdamW moments, and the same two places for the
//! other optimizers), so that every optimizer's state is cut and merged across layouts and
//! ZeRO pieces by the one checkpoint format.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumState;
use burn::optim::{
    AdaGrad, AdaGradState, Adam, AdamState, AdamWState, AdaptiveMomentumState, CenteredState,
    LearningRate, LrDecayState, MuonState, RmsProp, RmsPropMomentumState, RmsPropState, Sgd,
    SgdState, SimpleOptimizer, SquareAvgState,
};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Record, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::checkpoint::{Slots, StateSlots};
use crate::kernels::FusedOps;
use crate::train::FusedAdamW;

/// Copies `record` into another record type with the same field names (through Burn's named
/// MessagePack recorder): how the state fields Burn keeps private are read (only when a
/// checkpoint is written).
fn mirror<B: Backend, R: Record<B>, T: Record<B>>(
    record: R,
    device: &B::Device,
) -> Result<T, String> {
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = Recorder::<B>::record(&recorder, record, ()).map_err(|e| e.to_string())?;
    Recorder::<B>::load(&recorder, bytes, device).map_err(|e| e.to_string())
}

/// The fields of Burn's `MomentumState` (SGD's velocity).
#[derive(Record)]
struct MomentumMirror<B: Backend, const D: usize> {
    velocity: Tensor<B, D>,
}

/// The fields of Burn's `LrDecayState` (AdaGrad's sum of squared gradients).
#[derive(Record)]
struct LrDecayMirror<B: Backend, const D: usize> {
    time: usize,
    sum: Tensor<B, D>,
}

/// The fields of Burn's `AdaGradState`.
#[derive(Record)]
struct AdaGradMirror<B: Backend, const D: usize> {
    lr_decay: LrDecayMirror<B, D>,
}

/// The fields of Burn's `RmsPropMomentumState`.
#[derive(Record)]
struct RmsPropMomentumMirror<B: Backend, const D: usize> {
    buf: Tensor<B, D>,
}

/// Adam's and AdamW's two moments as slots.
fn moment_slots<B: Backend, const D: usize>(m: AdaptiveMomentumState<B, D>) -> Slots<B, D> {
    Slots {
        time: m.time,
        m1: m.moment_1,
        m2: Some(m.moment_2),
    }
}

/// Slots as Adam's and AdamW's two moments (a missing second moment is zero).
fn moments_of<B: Backend, const D: usize>(s: Slots<B, D>) -> AdaptiveMomentumState<B, D> {
    let m2 = s.m2.unwrap_or_else(|| s.m1.zeros_like());
    AdaptiveMomentumState::new(s.time, s.m1, m2)
}

impl<B: FusedOps> StateSlots<B> for FusedAdamW {
    fn slots_of_state<const D: usize>(
        &self,
        state: AdamWState<B, D>,
        _device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        Ok(Some(moment_slots(state.momentum)))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> AdamWState<B, D> {
        AdamWState::new(moments_of(s))
    }
}

impl<B: Backend> StateSlots<B> for Adam {
    fn slots_of_state<const D: usize>(
        &self,
        state: AdamState<B, D>,
        _device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        Ok(Some(moment_slots(state.momentum)))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> AdamState<B, D> {
        AdamState::new(moments_of(s))
    }
}

impl<B: Backend> StateSlots<B> for Sgd<B> {
    fn slots_of_state<const D: usize>(
        &self,
        state: SgdState<B, D>,
        device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        let Some(momentum) = state.momentum else {
            return Ok(None);
        };
        let m: MomentumMirror<B, D> = mirror(momentum, device)?;
        Ok(Some(Slots {
            time: 0,
            m1: m.velocity,
            m2: None,
        }))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> SgdState<B, D> {
        SgdState::new(Some(MomentumState::new(s.m1)))
    }
}

impl<B: Backend> StateSlots<B> for super::MuonStep<B> {
    fn slots_of_state<const D: usize>(
        &self,
        state: MuonState<B, D>,
        device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        let m: MomentumMirror<B, D> = mirror(state.momentum, device)?;
        Ok(Some(Slots {
            time: 0,
            m1: m.velocity,
            m2: None,
        }))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> MuonState<B, D> {
        MuonState::new(MomentumState::new(s.m1))
    }
}

impl<B: Backend> StateSlots<B> for AdaGrad {
    fn slots_of_state<const D: usize>(
        &self,
        state: AdaGradState<B, D>,
        device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        let m: AdaGradMirror<B, D> = mirror(state, device)?;
        Ok(Some(Slots {
            time: m.lr_decay.time,
            m1: m.lr_decay.sum,
            m2: None,
        }))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> AdaGradState<B, D> {
        AdaGradState::new(LrDecayState::new(s.time, s.m1))
    }
}

/// Burn's [`RmsProp`] with what its state holds (which Burn keeps private): the
/// squared-gradient average always, and either the momentum buffer (momentum > 0) or the
/// gradient average (centered), never both (checkpoints hold two tensors per parameter).
#[derive(Clone)]
pub struct RmsPropStep {
    /// Burn's optimizer, which does the step.
    pub inner: RmsProp,
    /// Whether it keeps a momentum buffer.
    pub momentum: bool,
    /// Whether it keeps a gradient average.
    pub centered: bool,
}

impl RmsPropStep {
    /// Burn's optimizer for a module `M` on the autodiff backend `B`.
    pub fn init<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>(
        self,
    ) -> OptimizerAdaptor<Self, M, B> {
        OptimizerAdaptor::from(self)
    }
}

impl<B: Backend> SimpleOptimizer<B> for RmsPropStep {
    type State<const D: usize> = RmsPropState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        self.inner.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        <RmsProp as SimpleOptimizer<B>>::to_device(state, device)
    }
}

impl<B: Backend> StateSlots<B> for RmsPropStep {
    fn slots_of_state<const D: usize>(
        &self,
        state: RmsPropState<B, D>,
        device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String> {
        let m1 = state.square_avg.square_avg;
        let m2 = match (state.momentum, state.centered.grad_avg) {
            (Some(buf), _) => {
                let m: RmsPropMomentumMirror<B, D> = mirror(buf, device)?;
                Some(m.buf)
            }
            (None, grad_avg) => grad_avg,
        };
        Ok(Some(Slots { time: 0, m1, m2 }))
    }

    fn state_from_slots<const D: usize>(&self, s: Slots<B, D>) -> RmsPropState<B, D> {
        let square_avg = s.m1;
        let m2 = s.m2.unwrap_or_else(|| square_avg.zeros_like());
        // `avg` is recomputed from the averages at every step; it is kept only within one.
        let (grad_avg, momentum) = match (self.momentum, self.centered) {
            (true, _) => (None, Some(RmsPropMomentumState::new(m2))),
            (false, true) => (Some(m2), None),
            (false, false) => (None, None),
        };
        let avg = square_avg.clone();
        RmsPropState::new(
            SquareAvgState::new(square_avg),
            CenteredState::new(grad_avg, avg),
            momentum,
        )
    }
}
