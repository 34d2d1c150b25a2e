//! Learning-rate schedules: a linear warm-up, then one of several shapes
//! ([`LrScheduleKind`]): cosine decay to a floor (the default), constant, linear decay, or
//! warm-up-stable-decay (WSD).

use serde::{Deserialize, Serialize};

/// Linear warm-up over `warmup` steps to `peak`, then cosine decay to `min` at `total`
/// ([`at`](Self::at)), or another shape ([`shaped_at`](Self::shaped_at)).
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

/// The shape of the learning rate after the linear warm-up (`warmup_steps` steps up to `lr`).
/// The decaying shapes reach `min_lr` at step `steps` (0-based: just after the last step), as
/// the cosine schedule always has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    /// Cosine decay from `lr` to `min_lr` over the steps after the warm-up.
    #[default]
    Cosine,
    /// `lr` after the warm-up (`min_lr` is not used).
    Constant,
    /// Linear decay from `lr` to `min_lr` over the steps after the warm-up.
    Linear,
    /// Warm-up-stable-decay: `lr` until `decay_steps` steps before the end
    /// ([`OptimizerSettings::decay_steps`](crate::train::OptimizerSettings::decay_steps)),
    /// then linear decay to `min_lr`.
    Wsd,
}

impl LrScheduleKind {
    /// The name used in settings and configs.
    pub fn name(self) -> &'static str {
        match self {
            LrScheduleKind::Cosine => "cosine",
            LrScheduleKind::Constant => "constant",
            LrScheduleKind::Linear => "linear",
            LrScheduleKind::Wsd => "wsd",
        }
    }
}

impl std::fmt::Display for LrScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based): warm-up, then cosine decay.
    pub fn at(&self, step: usize) -> f64 {
        if let Some(lr) = self.warming_up(step) {
            return lr;
        }
        let t = self.progress(step, self.warmup);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }

    /// The learning rate of step `step` (0-based) with the shape `kind` after the warm-up;
    /// `decay_steps` is the length of WSD's final decay.
    pub fn shaped_at(&self, kind: LrScheduleKind, decay_steps: usize, step: usize) -> f64 {
        if let Some(lr) = self.warming_up(step) {
            return lr;
        }
        match kind {
            LrScheduleKind::Cosine => self.at(step),
            LrScheduleKind::Constant => self.peak,
            LrScheduleKind::Linear => {
                let t = self.progress(step, self.warmup);
                self.peak + (self.min - self.peak) * t
            }
            LrScheduleKind::Wsd => {
                let start = self.total.saturating_sub(decay_steps).max(self.warmup);
                if step < start {
                    return self.peak;
                }
                let t = self.progress(step, start);
                self.peak + (self.min - self.peak) * t
            }
        }
    }

    /// The warm-up's learning rate, while it lasts.
    fn warming_up(&self, step: usize) -> Option<f64> {
        (self.warmup > 0 && step < self.warmup)
            .then(|| self.peak * (step + 1) as f64 / self.warmup as f64)
    }

    /// How far step `step` is from `start` (0) to `total` (1), clamped.
    fn progress(&self, step: usize, start: usize) -> f64 {
        let span = self.total.saturating_sub(start).max(1) as f64;
        ((step - start.min(step)) as f64 / span).min(1.0)
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
        for step in [0, 3, 4, 30, 54, 104, 500] {
            assert_eq!(s.shaped_at(LrScheduleKind::Cosine, 0, step), s.at(step));
        }
    }

    #[test]
    fn constant_linear_and_wsd_follow_their_shapes() {
        let s = LrSchedule {
            peak: 1.0,
            min: 0.2,
            warmup: 2,
            total: 12,
        };
        let lr = |kind, decay, step| s.shaped_at(kind, decay, step);
        for kind in [
            LrScheduleKind::Constant,
            LrScheduleKind::Linear,
            LrScheduleKind::Wsd,
        ] {
            assert_eq!(lr(kind, 4, 0), 0.5, "{kind}: warm-up");
            assert_eq!(lr(kind, 4, 1), 1.0, "{kind}: warm-up");
        }
        for step in 2..20 {
            assert_eq!(lr(LrScheduleKind::Constant, 0, step), 1.0);
        }
        // Linear: from 1 after the warm-up to 0.2 at step 12, 0.08 per step.
        assert!((lr(LrScheduleKind::Linear, 0, 2) - 1.0).abs() < 1e-12);
        assert!((lr(LrScheduleKind::Linear, 0, 7) - 0.6).abs() < 1e-12);
        assert!((lr(LrScheduleKind::Linear, 0, 12) - 0.2).abs() < 1e-12);
        assert!((lr(LrScheduleKind::Linear, 0, 40) - 0.2).abs() < 1e-12);
        // WSD with 4 decay steps: stable through step 8, then 0.8, 0.6, 0.4 at steps 9 to 11
        // (the last step of a 12-step run) and the floor from step 12 on.
        for step in 2..9 {
            assert_eq!(lr(LrScheduleKind::Wsd, 4, step), 1.0, "step {step}");
        }
        for (step, want) in [(9, 0.8), (10, 0.6), (11, 0.4), (12, 0.2), (15, 0.2)] {
            let got = lr(LrScheduleKind::Wsd, 4, step);
            assert!((got - want).abs() < 1e-12, "step {step}: {got}");
        }
    }
}
