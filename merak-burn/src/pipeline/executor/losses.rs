//! A step's losses, left on the device until the step's one read.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::precision::to_f32;

/// The losses of one step's forward passes that produced one, in the order they ran (those
/// that ran ahead during the previous call first), left on the device so that the trainer
/// reads them with the gradient norm's sums in one read ([`crate::host_read::together`]). Each
/// is a micro-batch's loss followed by its logged parts, with the factor it is weighted by once
/// read.
#[derive(Clone, Debug)]
pub struct StepLosses<C: Backend> {
    terms: Vec<(Tensor<C, 1>, f64)>,
}

impl<C: Backend> Default for StepLosses<C> {
    fn default() -> Self {
        Self { terms: Vec::new() }
    }
}

impl<C: Backend> StepLosses<C> {
    /// Adds a micro-batch's loss (followed by its logged parts), weighted by `factor` once read.
    pub(super) fn push(&mut self, value: Tensor<C, 1>, factor: f64) {
        self.terms.push((value, factor));
    }

    /// All the values, concatenated in `f32` in the order they ran; `None` when no forward pass
    /// of this rank produced a loss (no last stage here).
    pub fn values(&self) -> Option<Tensor<C, 1>> {
        let values: Vec<Tensor<C, 1>> = (self.terms.iter())
            .map(|(value, _)| to_f32(value.clone()))
            .collect();
        (!values.is_empty()).then(|| Tensor::cat(values, 0))
    }

    /// The weighted loss and its logged parts from `read`, the host values of
    /// [`values`](Self::values): each value times its factor, added in `f64` in the order the
    /// forward passes ran (0 and no parts without a loss).
    pub fn settle(&self, read: &[f32]) -> (f64, Vec<f64>) {
        let mut sums: Vec<f64> = Vec::new();
        let mut rest = read;
        for (value, factor) in &self.terms {
            let (these, tail) = rest.split_at(value.dims()[0].min(rest.len()));
            rest = tail;
            if sums.len() < these.len() {
                sums.resize(these.len(), 0.0);
            }
            for (sum, v) in sums.iter_mut().zip(these) {
                *sum += f64::from(*v) * factor;
            }
        }
        let loss = sums.first().copied().unwrap_or(0.0);
        (loss, sums.get(1..).unwrap_or_default().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    #[test]
    fn settles_each_term_times_its_factor_in_order() {
        let device = Default::default();
        let mut losses = StepLosses::<Cpu>::default();
        assert!(losses.values().is_none());
        assert_eq!(losses.settle(&[]), (0.0, vec![]));
        losses.push(Tensor::from_floats([2.0, 1.0], &device), 0.5);
        losses.push(Tensor::from_floats([4.0, 3.0], &device), 0.25);
        let read = crate::host_read::floats(losses.values().unwrap()).unwrap();
        assert_eq!(read, vec![2.0, 1.0, 4.0, 3.0]);
        assert_eq!(losses.settle(&read), (2.0, vec![1.25]));
    }
}
