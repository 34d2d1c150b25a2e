//! A head's loss as the sum of its terms together with their count ([`LossSum`]), so that a
//! mean cannot pass for a sum unnoticed.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// The sum of a micro-batch's loss terms (`[1]`) and how many terms it adds up: what
/// [`HeadUnit::loss`](super::HeadUnit::loss) returns.
///
/// The trainer divides the sums of every micro-batch and rank by the global batch's terms, so
/// every layout computes the mean one process computes. A head that returned a mean (Burn's
/// `CrossEntropyLoss` does) would scale its gradients by one over the terms; here it says so
/// with [`from_mean`](Self::from_mean), and [`merak_burn::run`](crate::run) checks on a sample
/// micro-batch, before training, that the head counts the terms the batch has
/// ([`Batch::loss_terms`](crate::batch::Batch::loss_terms)).
///
/// ```
/// use burn::tensor::Tensor;
/// use merak_burn::backend::Cpu;
/// use merak_burn::parallelize::LossSum;
///
/// let device = Default::default();
/// let mean = Tensor::<Cpu, 1>::from_floats([0.5], &device);
/// let loss = LossSum::from_mean(mean, 8);
/// assert_eq!(loss.terms(), 8);
/// assert_eq!(loss.into_sum().into_scalar(), 4.0);
/// ```
#[derive(Clone, Debug)]
pub struct LossSum<B: Backend> {
    sum: Tensor<B, 1>,
    terms: usize,
}

impl<B: Backend> LossSum<B> {
    /// `sum`, the sum of `terms` loss terms.
    pub fn new(sum: Tensor<B, 1>, terms: usize) -> Self {
        Self { sum, terms }
    }

    /// `mean`, the mean of `terms` loss terms, as their sum.
    pub fn from_mean(mean: Tensor<B, 1>, terms: usize) -> Self {
        Self {
            sum: mean * terms as f32,
            terms,
        }
    }

    /// The number of loss terms summed.
    pub fn terms(&self) -> usize {
        self.terms
    }

    /// The sum, `[1]`.
    pub fn into_sum(self) -> Tensor<B, 1> {
        self.sum
    }
}
