//! A saved plan (`merak plan --output plan.json`): the plan with the model, device count and
//! global batch it was made for, so that `merak train --plan plan.json` and
//! `merak simulate --plan plan.json` can check that it fits the job before using it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::cost::{CostError, CostModel};
use super::hardware::HardwareSpec;
use super::model::{ModelProxy, TransformerShape};
use super::search::Plan;

/// The format tag written into every plan file.
pub const PLAN_FORMAT: &str = "merak-plan/1";

/// A plan file that cannot be read or does not fit the job. Every message names the file and
/// the numbers.
#[derive(Debug, Error)]
pub enum PlanFileError {
    /// The file could not be read or written.
    #[error("plan file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not a plan file (bad JSON, missing fields, a partition with holes, ...).
    #[error("plan file {path} is not a valid plan: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Another format version.
    #[error("plan file {path} has format {found:?}; this merak reads {PLAN_FORMAT:?}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The format it states.
        found: String,
    },
    /// The plan was made for something else than the job.
    #[error("plan file {path} was made for {field} = {planned}, but the job has {job}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        field: &'static str,
        /// The plan's value.
        planned: String,
        /// The job's value.
        job: String,
    },
    /// The layout is inconsistent with its own model (stages, units, recomputation list).
    #[error("plan file {path}: {source}")]
    Layout {
        /// The file.
        path: PathBuf,
        /// The cost model's complaint.
        source: CostError,
    },
}

/// A plan with what it was made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// [`PLAN_FORMAT`].
    pub format: String,
    /// The model's shape.
    pub model: TransformerShape,
    /// The hardware the prediction is for (a preset name or the spec's name).
    pub hardware: String,
    /// Devices (`dp * cp * tp * pp`).
    pub gpus: usize,
    /// Sequences per step.
    pub global_batch: usize,
    /// The plan: layout, recomputation policy and prediction.
    pub plan: Plan,
}

impl PlanFile {
    /// Wraps `plan` of `model` for `gpus` devices and `global_batch` sequences.
    pub fn new(model: TransformerShape, hardware: &str, gpus: usize, plan: Plan) -> Self {
        PlanFile {
            format: PLAN_FORMAT.to_string(),
            model,
            hardware: hardware.to_string(),
            gpus,
            global_batch: plan.layout.global_batch(),
            plan,
        }
    }

    /// Writes the plan as pretty JSON, atomically (a temporary file renamed into place).
    ///
    /// # Errors
    ///
    /// [`PlanFileError::Io`].
    pub fn write(&self, path: &Path) -> Result<(), PlanFileError> {
        let text = serde_json::to_vec_pretty(self).map_err(|e| PlanFileError::Parse {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        super::write_atomically(path, &text).map_err(|source| PlanFileError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Reads and checks a plan file: the format, and that the layout is consistent with its
    /// own model (degrees, partition over `layers + 2` units, one recomputation mode per
    /// stage, devices and global batch).
    ///
    /// # Errors
    ///
    /// Any [`PlanFileError`].
    pub fn read(path: &Path) -> Result<Self, PlanFileError> {
        let text = std::fs::read(path).map_err(|source| PlanFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let file: PlanFile = serde_json::from_slice(&text).map_err(|e| PlanFileError::Parse {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        if file.format != PLAN_FORMAT {
            return Err(PlanFileError::Format {
                path: path.to_path_buf(),
                found: file.format,
            });
        }
        file.model.validate().map_err(|e| PlanFileError::Parse {
            path: path.to_path_buf(),
            msg: format!("model: {e}"),
        })?;
        let layout = &file.plan.layout;
        file.mismatch(path, "dp * cp * tp * pp", layout.gpus(), file.gpus)?;
        file.mismatch(
            path,
            "dp * micro_batch * micro_batches",
            layout.global_batch(),
            file.global_batch,
        )?;
        // The cost model's own checks: partition over the model's units, recomputation list.
        let model = ModelProxy::from_shape(file.model);
        let hardware = HardwareSpec::preset("local-cpu")
            .unwrap_or_else(|| unreachable!("the local-cpu preset exists"));
        CostModel::new(&model, &hardware)
            .estimate(layout)
            .map_err(|source| PlanFileError::Layout {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(file)
    }

    fn mismatch<T: PartialEq + ToString>(
        &self,
        path: &Path,
        field: &'static str,
        planned: T,
        job: T,
    ) -> Result<(), PlanFileError> {
        if planned == job {
            return Ok(());
        }
        Err(PlanFileError::Mismatch {
            path: path.to_path_buf(),
            field,
            planned: planned.to_string(),
            job: job.to_string(),
        })
    }

    /// Checks that the plan was made for this job: the model's shape, the devices it is launched
    /// on and the global batch.
    ///
    /// # Errors
    ///
    /// [`PlanFileError::Mismatch`] naming the first difference.
    pub fn check_job(
        &self,
        path: &Path,
        model: &TransformerShape,
        gpus: usize,
        global_batch: usize,
    ) -> Result<(), PlanFileError> {
        self.mismatch(path, "model", self.model.to_string(), model.to_string())?;
        self.mismatch(path, "devices", self.gpus, gpus)?;
        self.mismatch(path, "global batch", self.global_batch, global_batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{SearchOptions, search};

    fn plan_file() -> PlanFile {
        let shape: TransformerShape = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=1024"
            .parse()
            .unwrap();
        let model = ModelProxy::from_shape(shape);
        let hw = HardwareSpec::preset("local-cpu").unwrap().with_devices(4);
        let result = search(&model, &hw, &SearchOptions::new(4, 16)).unwrap();
        PlanFile::new(shape, "local-cpu", 4, result.best)
    }

    #[test]
    fn round_trip_and_job_checks() {
        let dir = std::env::temp_dir().join(format!("merak-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("plan.json");
        let file = plan_file();
        file.write(&path).unwrap();
        let back = PlanFile::read(&path).unwrap();
        assert_eq!(back, file);
        back.check_job(&path, &file.model, 4, 16).unwrap();
        let err = back.check_job(&path, &file.model, 8, 16).unwrap_err();
        assert!(err.to_string().contains("devices = 4"), "{err}");
        let mut other = file.model;
        other.layers = 6;
        let err = back.check_job(&path, &other, 4, 16).unwrap_err();
        assert!(err.to_string().contains("layers=4"), "{err}");

        // A layout whose degrees disagree with its device count is refused on reading.
        let mut bad = file.clone();
        bad.gpus = 8;
        bad.write(&path).unwrap();
        let err = PlanFile::read(&path).unwrap_err().to_string();
        assert!(err.contains("dp * cp * tp * pp = 4"), "{err}");
        // So is one whose recomputation list does not cover its stages.
        let mut bad = file.clone();
        bad.plan.layout.recompute.push(bad.plan.layout.recompute[0]);
        bad.write(&path).unwrap();
        assert!(matches!(
            PlanFile::read(&path),
            Err(PlanFileError::Layout { .. })
        ));
        std::fs::write(&path, b"{\"format\": 1}").unwrap();
        assert!(matches!(
            PlanFile::read(&path),
            Err(PlanFileError::Parse { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
