//! Learning-rate schedule: linear warm-up, then cosine decay to a floor.

/// Linear warm-up over `warmup` steps to `peak`, then cosine decay to `min` at `total`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The peak learning rate.
    pub peak: f64,
    /// The final learning rate.
    pub min: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Total steps.
    pub total: usize,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if self.warmup > 0 && step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup.min(step)) as f64 / span).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        let s = LrSchedule {
            peak: 1.0,
            min: 0.1,
            warmup: 4,
            total: 104,
        };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert!((s.at(4) - 1.0).abs() < 1e-12);
        assert!((s.at(54) - 0.55).abs() < 1e-12);
        assert!((s.at(104) - 0.1).abs() < 1e-12);
        assert!((s.at(500) - 0.1).abs() < 1e-12);
    }
}
