//! The bounds of every real-valued key of a config, checked in one loop: the library's
//! settings' ([`GptConfig::REAL_KEYS`], [`MoeConfig::REAL_KEYS`], the trainer's
//! [`TRAIN_REAL_KEYS`] and [`OPTIMIZER_REAL_KEYS`]) and `merak train`'s own ([`REAL_KEYS`]).
//! The reasons for each bound are in the key's doc comment (the configuration reference).

use merak_burn::bounds::{Bounds, RealKey, shown};
use merak_burn::moe::MoeConfig;
use merak_burn::train::{OPTIMIZER_REAL_KEYS, TRAIN_REAL_KEYS};
use merak_gpt::GptConfig;

use super::{Config, ConfigError, MAX_COMM_TIMEOUT_S, bad};

/// The real-valued keys only `merak train` reads, by their dotted keys, with their bounds.
pub const REAL_KEYS: [RealKey<Config>; 5] = [
    RealKey {
        key: "train.sample_temperature",
        get: |c| Some(c.train.sample_temperature),
        bounds: Bounds::closed(0.0, 10.0),
    },
    RealKey {
        key: "train.comm_timeout_s",
        get: |c| Some(c.train.comm_timeout_s),
        bounds: Bounds::closed(0.0, MAX_COMM_TIMEOUT_S),
    },
    RealKey {
        key: "train.straggler_fraction",
        get: |c| Some(c.train.straggler_fraction),
        bounds: Bounds::above(0.0, 1000.0),
    },
    RealKey {
        key: "parallel.bucket_mb",
        get: |c| Some(c.parallel.bucket_mb),
        bounds: Bounds::above(0.0, 4096.0),
    },
    RealKey {
        key: "parallel.memory_budget_mb",
        get: |c| Some(c.parallel.memory_budget_mb),
        bounds: Bounds::closed(0.0, 1048576.0),
    },
];

/// `(prefix + key, value, bounds)` of each of `keys` in `settings`.
fn keyed<T>(prefix: &str, keys: &[RealKey<T>], settings: &T) -> Vec<(String, Option<f64>, Bounds)> {
    (keys.iter())
        .map(|k| (format!("{prefix}{}", k.key), (k.get)(settings), k.bounds))
        .collect()
}

impl Config {
    /// Every real-valued key of this config: its dotted key, its value (`None`: unset) and
    /// its bounds.
    pub fn real_keys(&self) -> Vec<(String, Option<f64>, Bounds)> {
        let mut all = keyed("model.", &GptConfig::REAL_KEYS, &self.model.gpt);
        if let Some(moe) = &self.model.gpt.moe {
            all.extend(keyed("model.moe.", &MoeConfig::REAL_KEYS, moe));
        }
        all.extend(keyed("train.", &TRAIN_REAL_KEYS, &self.train_settings()));
        all.extend(keyed("optimizer.", &OPTIMIZER_REAL_KEYS, &self.optimizer));
        all.extend(keyed("", &REAL_KEYS, self));
        all
    }

    /// Every real-valued key within its bounds; the error names the key, its value and the
    /// bounds.
    pub(super) fn validate_bounds(&self) -> Result<(), ConfigError> {
        for (key, value, bounds) in self.real_keys() {
            if let Some(v) = value.filter(|v| !bounds.contains(*v)) {
                return bad(&key, format!("{} must be in {bounds}", shown(v)));
            }
        }
        Ok(())
    }
}
