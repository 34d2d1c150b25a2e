//! The held-out metrics of a run, by name.

/// The sums of the head's evaluation metrics over the held-out batches
/// ([`RunOptions::eval_batches`](super::RunOptions::eval_batches)), named as the head declares
/// them ([`HeadUnit::METRICS`](crate::parallelize::HeadUnit::METRICS)); the same on every rank
/// and every layout.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricSums {
    names: Vec<String>,
    sums: Vec<f64>,
}

impl MetricSums {
    /// The sums `sums`, named `names` in order; `None` unless there are as many of each.
    pub fn new(names: &[&str], sums: Vec<f64>) -> Option<Self> {
        (names.len() == sums.len()).then(|| Self {
            names: names.iter().map(|n| n.to_string()).collect(),
            sums,
        })
    }

    /// The sum of metric `name` (`None`: the head has no such metric).
    pub fn sum(&self, name: &str) -> Option<f64> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(self.sums[i])
    }

    /// The sum of `numerator` over the sum of `denominator` (for example the held-out loss,
    /// `ratio("loss", "loss_terms")`); `None` when either is missing or the denominator is 0.
    pub fn ratio(&self, numerator: &str, denominator: &str) -> Option<f64> {
        let den = self.sum(denominator).filter(|d| *d != 0.0)?;
        Some(self.sum(numerator)? / den)
    }

    /// Every metric's name and sum, in the head's order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.sums.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_read_by_name_and_counts_must_match() {
        let m = MetricSums::new(&["loss", "correct", "tokens"], vec![6.0, 2.0, 4.0]).expect("3");
        assert_eq!(m.sum("correct"), Some(2.0));
        assert_eq!(m.sum("accuracy"), None);
        assert_eq!(m.ratio("loss", "tokens"), Some(1.5));
        assert_eq!(m.ratio("loss", "accuracy"), None);
        let zero = MetricSums::new(&["loss", "tokens"], vec![1.0, 0.0]).expect("2");
        assert_eq!(zero.ratio("loss", "tokens"), None);
        let names: Vec<&str> = m.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["loss", "correct", "tokens"]);
        assert_eq!(MetricSums::new(&["loss"], vec![1.0, 2.0]), None);
    }
}
