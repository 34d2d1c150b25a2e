//! One parameter's optimizer state as checkpoints store it: a step count and two tensors of the
//! parameter's shape, and the trait an optimizer implements to be stored that way (the
//! trainer's optimizers implement it in `train::optim`).

use burn::optim::SimpleOptimizer;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// One parameter's optimizer state in the checkpoint's two places.
pub struct Slots<B: Backend, const D: usize> {
    /// Steps the optimizer has taken on the parameter, where it counts them (AdamW, Adam,
    /// AdaGrad); 0 for the others.
    pub time: usize,
    /// The first tensor.
    pub m1: Tensor<B, D>,
    /// The second tensor; `None` (stored as zeros) where the optimizer keeps only one.
    pub m2: Option<Tensor<B, D>>,
}

/// An element-wise optimizer whose per-parameter state fits [`Slots`].
pub trait StateSlots<B: Backend>: SimpleOptimizer<B> {
    /// The slots of `state` (a parameter on `device`); `None` when the state holds no tensor.
    fn slots_of_state<const D: usize>(
        &self,
        state: Self::State<D>,
        device: &B::Device,
    ) -> Result<Option<Slots<B, D>>, String>;

    /// The state stored as `slots`.
    fn state_from_slots<const D: usize>(&self, slots: Slots<B, D>) -> Self::State<D>;
}
