//! Measured layer times (`merak profile`): the cost model uses them instead of FLOPs over a
//! rate when they describe the model being planned.
//!
//! A calibration holds, per unit kind (embedding, transformer layer, head), tensor-parallel
//! degree and micro-batch size, the measured forward and backward seconds of one unit on the
//! real backend, taken while every rank of the launch ran the same work at once (so sharing of
//! cores or of a device is in the numbers, and so is the tensor-parallel communication inside
//! the unit). Other micro-batch sizes are interpolated by a least-squares line in the
//! micro-batch size (a fixed cost per call plus a cost per sequence).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::model::TransformerShape;

/// The format tag of calibration files.
pub const CALIBRATION_FORMAT: &str = "merak-calibration/1";

/// The kind of a pipeline unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    /// Unit 0: token (and position) embedding.
    Embedding,
    /// A transformer layer.
    Layer,
    /// The last unit: final norm, output layer and loss.
    Head,
}

impl UnitKind {
    /// The kind of unit `unit` of a model with `units` units.
    pub fn of(unit: usize, units: usize) -> Self {
        if unit == 0 {
            UnitKind::Embedding
        } else if unit + 1 == units {
            UnitKind::Head
        } else {
            UnitKind::Layer
        }
    }
}

/// One measurement: a unit kind at a tensor-parallel degree and micro-batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitTiming {
    /// Which unit.
    pub unit: UnitKind,
    /// Tensor-parallel degree it ran at.
    pub tp: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Median seconds of one forward pass.
    pub forward_s: f64,
    /// Median seconds of one backward pass.
    pub backward_s: f64,
    /// The tensor-parallel overlap degree it ran with (`parallel.tp_overlap`; 1: none).
    #[serde(default = "one")]
    pub tp_overlap: usize,
}

/// The overlap degree of timings written before overlap was measured.
fn one() -> usize {
    1
}

/// A calibration file that cannot be used.
#[derive(Debug, Error)]
pub enum CalibrationError {
    /// The file could not be read or written.
    #[error("calibration file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not a calibration file.
    #[error("calibration file {path} is not valid: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Measured for another model.
    #[error("calibration file {path} was measured for {measured}, not for {model}")]
    OtherModel {
        /// The file.
        path: PathBuf,
        /// The calibration's model.
        measured: String,
        /// The model being planned.
        model: String,
    },
}

/// Measured unit times and per-step costs of one model on one machine and launch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// [`CALIBRATION_FORMAT`].
    pub format: String,
    /// The model that was timed.
    pub model: TransformerShape,
    /// The backend, e.g. `ndarray-f32`.
    pub backend: String,
    /// Ranks that ran at once while timing.
    pub ranks: usize,
    /// Bytes per element of gradients and activations (4 for fp32).
    pub element_bytes: f64,
    /// Seconds of the optimizer step per parameter held by the rank.
    pub optimizer_s_per_param: f64,
    /// Seconds per micro-batch and per parameter held spent outside the units' arithmetic
    /// (fresh parameter leaves and gradient hooks for every pass, gradient accumulation).
    pub micro_batch_s_per_param: f64,
    /// Seconds per step spent outside the micro-batches and the optimizer (gradient norm,
    /// clipping, metrics).
    pub step_overhead_s: f64,
    /// ZeRO-1 with data parallelism over all `ranks`: seconds per parameter held of sending
    /// the updated shards to every rank.
    pub zero1_s_per_param: f64,
    /// The time a rank needs for the model's forward and backward pass while half the ranks
    /// wait in MPI, as a fraction of its time when all work (1: ranks do not share compute;
    /// 0: not measured). Overrides `HardwareSpec::alone_time_fraction`.
    #[serde(default)]
    pub alone_time_fraction: f64,
    /// The measurements.
    pub timings: Vec<UnitTiming>,
}

impl Calibration {
    /// Forward and backward seconds of a `kind` unit at tensor-parallel degree `tp` with
    /// micro-batch `micro_batch`: the least-squares line through the measurements of that kind
    /// and degree (proportional when there is one), never below zero. `None` when that
    /// degree was not measured.
    pub fn unit_time(&self, kind: UnitKind, tp: usize, micro_batch: usize) -> Option<(f64, f64)> {
        self.unit_time_overlapped(kind, tp, 1, micro_batch)
    }

    /// Like [`Calibration::unit_time`], for the unit run with the tensor-parallel overlap degree
    /// `overlap`: its own measurements where the profile took them, otherwise those without
    /// overlap (an embedding or a head has no overlapped products; a calibration written
    /// before overlap was measured has none).
    pub fn unit_time_overlapped(
        &self,
        kind: UnitKind,
        tp: usize,
        overlap: usize,
        micro_batch: usize,
    ) -> Option<(f64, f64)> {
        let at = |k: usize| -> Vec<&UnitTiming> {
            (self.timings.iter())
                .filter(|t| t.unit == kind && t.tp == tp && t.tp_overlap == k)
                .collect()
        };
        let mut points = at(overlap);
        if points.is_empty() && overlap != 1 {
            points = at(1);
        }
        if points.is_empty() {
            return None;
        }
        let b = micro_batch as f64;
        let fit = |value: &dyn Fn(&UnitTiming) -> f64| -> f64 {
            if let Some(exact) = points.iter().find(|t| t.micro_batch == micro_batch) {
                return value(exact);
            }
            let n = points.len() as f64;
            let mx = points.iter().map(|t| t.micro_batch as f64).sum::<f64>() / n;
            let my = points.iter().map(|t| value(t)).sum::<f64>() / n;
            let sxx: f64 = points
                .iter()
                .map(|t| (t.micro_batch as f64 - mx).powi(2))
                .sum();
            if sxx == 0.0 {
                return my * b / mx;
            }
            let sxy: f64 = points
                .iter()
                .map(|t| (t.micro_batch as f64 - mx) * (value(t) - my))
                .sum();
            let slope = sxy / sxx;
            (my + slope * (b - mx)).max(0.0)
        };
        Some((fit(&|t| t.forward_s), fit(&|t| t.backward_s)))
    }

    /// Writes the calibration as pretty JSON, atomically.
    ///
    /// # Errors
    ///
    /// [`CalibrationError::Io`].
    pub fn write(&self, path: &Path) -> Result<(), CalibrationError> {
        let text = serde_json::to_vec_pretty(self).map_err(|e| CalibrationError::Parse {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        super::write_atomically(path, &text).map_err(|source| CalibrationError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Reads a calibration and checks that it was measured for `model`.
    ///
    /// # Errors
    ///
    /// Any [`CalibrationError`].
    pub fn read(path: &Path, model: &TransformerShape) -> Result<Self, CalibrationError> {
        let parse = |msg: String| CalibrationError::Parse {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read(path).map_err(|source| CalibrationError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let cal: Calibration = serde_json::from_slice(&text)
            .map_err(|e| parse(super::json_path::describe(&text, &e)))?;
        if cal.format != CALIBRATION_FORMAT {
            return Err(parse(format!(
                "format {:?}, expected {CALIBRATION_FORMAT:?}",
                cal.format
            )));
        }
        let finite = |x: f64| x.is_finite() && x >= 0.0;
        if let Some(t) = cal.timings.iter().find(|t| {
            !finite(t.forward_s) || !finite(t.backward_s) || t.tp == 0 || t.micro_batch == 0
        }) {
            return Err(parse(format!("bad measurement {t:?}")));
        }
        for (field, v) in [
            ("element_bytes", cal.element_bytes),
            ("optimizer_s_per_param", cal.optimizer_s_per_param),
            ("micro_batch_s_per_param", cal.micro_batch_s_per_param),
            ("step_overhead_s", cal.step_overhead_s),
            ("zero1_s_per_param", cal.zero1_s_per_param),
            ("alone_time_fraction", cal.alone_time_fraction),
        ] {
            if !finite(v) {
                return Err(parse(format!("{field} = {v} must be finite and >= 0")));
            }
        }
        if cal.model != *model {
            return Err(CalibrationError::OtherModel {
                path: path.to_path_buf(),
                measured: cal.model.to_string(),
                model: model.to_string(),
            });
        }
        Ok(cal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal() -> Calibration {
        let timing = |micro_batch, forward_s, backward_s| UnitTiming {
            unit: UnitKind::Layer,
            tp: 1,
            micro_batch,
            forward_s,
            backward_s,
            tp_overlap: 1,
        };
        Calibration {
            format: CALIBRATION_FORMAT.into(),
            model: "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512"
                .parse()
                .unwrap(),
            backend: "test".into(),
            ranks: 1,
            element_bytes: 4.0,
            optimizer_s_per_param: 1e-9,
            micro_batch_s_per_param: 0.0,
            step_overhead_s: 0.0,
            zero1_s_per_param: 0.0,
            alone_time_fraction: 0.0,
            timings: vec![
                timing(1, 3.0, 5.0),
                timing(2, 5.0, 9.0),
                timing(4, 9.0, 17.0),
            ],
        }
    }

    #[test]
    fn measured_sizes_exact_others_on_the_fitted_line() {
        let c = cal();
        assert_eq!(c.unit_time(UnitKind::Layer, 1, 2), Some((5.0, 9.0)));
        // The points lie on f = 1 + 2b, g = 1 + 4b.
        let (f, g) = c.unit_time(UnitKind::Layer, 1, 8).unwrap();
        assert!(
            (f - 17.0).abs() < 1e-12 && (g - 33.0).abs() < 1e-12,
            "{f} {g}"
        );
        assert_eq!(c.unit_time(UnitKind::Layer, 2, 1), None);
        assert_eq!(c.unit_time(UnitKind::Head, 1, 1), None);
    }

    #[test]
    fn overlapped_timings_are_used_at_their_degree_and_others_fall_back() {
        let mut c = cal();
        c.timings.push(UnitTiming {
            unit: UnitKind::Layer,
            tp: 1,
            micro_batch: 2,
            forward_s: 4.0,
            backward_s: 7.0,
            tp_overlap: 2,
        });
        assert_eq!(
            c.unit_time_overlapped(UnitKind::Layer, 1, 2, 2),
            Some((4.0, 7.0))
        );
        // Degree 2 has one point: other sizes are proportional to it.
        assert_eq!(
            c.unit_time_overlapped(UnitKind::Layer, 1, 2, 4),
            Some((8.0, 14.0))
        );
        // Degree 4 was not measured: the timings without overlap.
        assert_eq!(
            c.unit_time_overlapped(UnitKind::Layer, 1, 4, 2),
            Some((5.0, 9.0))
        );
        assert_eq!(c.unit_time(UnitKind::Layer, 1, 2), Some((5.0, 9.0)));
        assert_eq!(UnitKind::of(0, 4), UnitKind::Embedding);
        assert_eq!(UnitKind::of(2, 4), UnitKind::Layer);
        assert_eq!(UnitKind::of(3, 4), UnitKind::Head);
    }

    #[test]
    fn reading_checks_format_values_and_model() {
        let dir = std::env::temp_dir().join(format!("merak-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cal.json");
        let c = cal();
        c.write(&path).unwrap();
        assert_eq!(Calibration::read(&path, &c.model).unwrap(), c);
        let mut other = c.model;
        other.layers = 3;
        let err = Calibration::read(&path, &other).unwrap_err().to_string();
        assert!(
            err.contains("layers=2") && err.contains("layers=3"),
            "{err}"
        );
        let mut bad = c.clone();
        bad.timings[0].forward_s = f64::NAN;
        bad.write(&path).unwrap();
        assert!(matches!(
            Calibration::read(&path, &c.model),
            Err(CalibrationError::Parse { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
