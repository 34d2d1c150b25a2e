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
    /// The logged parts' sums, without a graph.
    parts: Vec<Tensor<B, 1>>,
}

impl<B: Backend> LossSum<B> {
    /// `sum`, the sum of `terms` loss terms.
    pub fn new(sum: Tensor<B, 1>, terms: usize) -> Self {
        Self {
            sum,
            terms,
            parts: Vec::new(),
        }
    }

    /// `mean`, the mean of `terms` loss terms, as their sum.
    pub fn from_mean(mean: Tensor<B, 1>, terms: usize) -> Self {
        Self {
            sum: mean * terms as f32,
            terms,
            parts: Vec::new(),
        }
    }

    /// With one more logged part of the loss: `mean` (`[1]`), a mean over the micro-batch
    /// (for example an auxiliary loss that the loss adds), which a training step logs beside
    /// the loss under the next name of
    /// [`HeadUnit::LOSS_PARTS`](super::HeadUnit::LOSS_PARTS), averaged over the micro-batches
    /// as the loss is. It is logged only: the gradient comes from the loss alone.
    pub fn with_part_mean(mut self, mean: Tensor<B, 1>) -> Self {
        self.parts.push(mean.detach() * self.terms as f32);
        self
    }

    /// The number of logged parts ([`with_part_mean`](Self::with_part_mean)).
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// The sum followed by the logged parts' sums, `[1 + parts]`: what the pipeline's last
    /// unit returns ([`StageOutput::Loss`](crate::pipeline::StageOutput::Loss)).
    pub fn into_sum_and_parts(self) -> Tensor<B, 1> {
        match self.parts.is_empty() {
            true => self.sum,
            false => Tensor::cat(std::iter::once(self.sum).chain(self.parts).collect(), 0),
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
