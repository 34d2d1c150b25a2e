//! The ranges of real-valued settings: each settings type lists its real-valued keys with
//! their bounds ([`RealKey`]), so that one loop checks them ([`out_of_bounds`]) and a
//! configuration loader can check every key of a config the same way, naming the key, the
//! value and the range.

use std::fmt;

/// The values a real-valued setting may take: the finite numbers of an interval, each end
/// closed or open; an infinite end is no bound on that side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// The lower end.
    pub low: f64,
    /// Whether `low` itself is excluded.
    pub low_open: bool,
    /// The upper end (`f64::INFINITY`: none).
    pub high: f64,
    /// Whether `high` itself is excluded.
    pub high_open: bool,
}

impl Bounds {
    /// `[low, high]`.
    pub const fn closed(low: f64, high: f64) -> Self {
        Self {
            low,
            low_open: false,
            high,
            high_open: false,
        }
    }

    /// `(low, high]`.
    pub const fn above(low: f64, high: f64) -> Self {
        Self {
            low_open: true,
            ..Self::closed(low, high)
        }
    }

    /// `[low, high)`.
    pub const fn below(low: f64, high: f64) -> Self {
        Self {
            high_open: true,
            ..Self::closed(low, high)
        }
    }

    /// Whether `x` is a finite number within the bounds.
    pub fn contains(&self, x: f64) -> bool {
        let low = if self.low_open {
            x > self.low
        } else {
            x >= self.low
        };
        let high = if self.high_open {
            x < self.high
        } else {
            x <= self.high
        };
        x.is_finite() && low && high
    }
}

/// `x` as messages write it: plainly (`0.5`, `31536000`), in scientific notation when very
/// large or small (`1e30`, `1e-30`), `inf` when infinite.
pub fn shown(x: f64) -> String {
    match x {
        x if x.is_infinite() => format!("{}inf", if x < 0.0 { "-" } else { "" }),
        x if x != 0.0 && !(1e-4..1e15).contains(&x.abs()) => format!("{x:e}"),
        x => x.to_string(),
    }
}

impl fmt::Display for Bounds {
    /// Interval notation: `[0, 1)`, `(0, 10]`, `(0, inf)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let end = shown;
        write!(
            f,
            "{}{}, {}{}",
            if self.low_open { '(' } else { '[' },
            end(self.low),
            end(self.high),
            if self.high_open || self.high == f64::INFINITY {
                ')'
            } else {
                ']'
            }
        )
    }
}

/// A real-valued key of settings `T`: its name (a field of `T`), how to read it (`None`: unset)
/// and its bounds. The reasons for the bounds are in the field's doc comment.
pub struct RealKey<T> {
    /// The field's name.
    pub key: &'static str,
    /// Its value in a `T` (`None` when unset).
    pub get: fn(&T) -> Option<f64>,
    /// The values it may take.
    pub bounds: Bounds,
}

/// A real-valued setting outside its bounds.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{key} = {value} must be in {bounds}")]
pub struct OutOfBounds {
    /// The key, as the settings name it.
    pub key: String,
    /// Its value, as [`shown`] writes it.
    pub value: String,
    /// The values it may take.
    pub bounds: Bounds,
}

/// The first key of `keys` whose value in `settings` is outside its bounds, its name prefixed
/// by `prefix` (`"model.moe."`).
pub fn out_of_bounds<T>(settings: &T, keys: &[RealKey<T>], prefix: &str) -> Option<OutOfBounds> {
    keys.iter().find_map(|k| {
        let value = (k.get)(settings)?;
        (!k.bounds.contains(value)).then(|| OutOfBounds {
            key: format!("{prefix}{}", k.key),
            value: shown(value),
            bounds: k.bounds,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_include_their_closed_ends_and_refuse_non_finite_values() {
        let unit = Bounds::below(0.0, 1.0);
        assert!(unit.contains(0.0) && unit.contains(0.5) && !unit.contains(1.0));
        assert!(!unit.contains(f64::NAN) && !unit.contains(-0.1));
        let rate = Bounds::above(0.0, 10.0);
        assert!(!rate.contains(0.0) && rate.contains(10.0) && !rate.contains(1e30));
        let open = Bounds::above(0.0, f64::INFINITY);
        assert!(open.contains(1e300) && !open.contains(f64::INFINITY));
        assert_eq!(
            (unit.to_string(), rate.to_string(), open.to_string()),
            ("[0, 1)".into(), "(0, 10]".into(), "(0, inf)".into())
        );
        assert_eq!(Bounds::closed(0.0, 1048576.0).to_string(), "[0, 1048576]");
        assert_eq!(Bounds::closed(1e-30, 1e300).to_string(), "[1e-30, 1e300]");
    }
}
