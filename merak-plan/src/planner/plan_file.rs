//! A saved plan (`merak plan --output plan.json`): the plan with the model, device count and
//! global batch it was made for, so that `merak train --plan plan.json` and
//! `merak simulate --plan plan.json` can check that it fits the job before using it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::cost::{CostError, CostModel};
use super::hardware::HardwareSpec;
use super::layout_check::LayoutFieldError;
use super::model::{ModelProxy, TransformerShape};
use super::search::Plan;

/// The format tag written into every plan file.
pub const PLAN_FORMAT: &str = "merak-plan/1";

/// The most units (layers + embedding + head) of a plan file's model: its model proxy, built
/// to check the layout, takes about 140 bytes per unit (`merak plan` writes plans of at most
/// [`MAX_SEARCH_UNITS`](super::MAX_SEARCH_UNITS) units; a plan written by hand may cover more).
pub const MAX_PLAN_UNITS: usize = 1 << 20;

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
    /// A field of the layout out of range, or inconsistent with another or with the plan's
    /// model (named `plan.layout.<field>`).
    #[error("plan file {path}: {source}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field and why.
        source: LayoutFieldError,
    },
    /// The stored prediction's step time or throughput is negative (named
    /// `plan.prediction.<field>`).
    #[error("plan file {path}: plan.prediction.{field} = {value}: must be a finite number >= 0")]
    Prediction {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
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

/// A plan with what it was made for. Every field is read (an unknown one is refused).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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

    /// Reads and checks a plan file: every field known (an unknown one is refused), the
    /// format, every field of the layout as `merak train` checks the `parallel.*` key it sets
    /// ([`Layout::check_fields`](super::Layout::check_fields), against the plan's own model),
    /// the prediction's step time and throughput not negative, and the devices and global
    /// batch the layout gives those stated.
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
            msg: super::json_path::describe(&text, &e),
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
        let units = file.model.layers.saturating_add(2);
        if units > MAX_PLAN_UNITS {
            return Err(PlanFileError::Parse {
                path: path.to_path_buf(),
                msg: format!(
                    "model.layers = {}: {units} units (layers + embedding + head), more than \
                     the {MAX_PLAN_UNITS} a plan file may cover",
                    file.model.layers
                ),
            });
        }
        let layout = &file.plan.layout;
        let model = ModelProxy::from_shape(file.model);
        layout
            .check_fields(&model, &|field| format!("plan.layout.{field}"))
            .map_err(|source| PlanFileError::Field {
                path: path.to_path_buf(),
                source,
            })?;
        file.check_prediction(path)?;
        file.mismatch(path, "dp * cp * tp * pp", layout.gpus(), file.gpus)?;
        file.mismatch(
            path,
            "dp * micro_batch * micro_batches",
            layout.global_batch(),
            file.global_batch,
        )?;
        // The cost model's own checks (a backstop: the fields were checked above).
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

    /// The stored prediction's step time and throughput (what `merak train --plan` reports):
    /// not negative (JSON holds no infinity or NaN).
    fn check_prediction(&self, path: &Path) -> Result<(), PlanFileError> {
        let p = &self.plan.prediction;
        for (field, value) in [
            ("step_time_s", p.step_time_s),
            ("tflops_per_gpu", p.tflops_per_gpu),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PlanFileError::Prediction {
                    path: path.to_path_buf(),
                    field,
                    value,
                });
            }
        }
        Ok(())
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
            Err(PlanFileError::Field { .. })
        ));
        std::fs::write(&path, b"{\"format\": 1}").unwrap();
        assert!(matches!(
            PlanFile::read(&path),
            Err(PlanFileError::Parse { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An edit of a plan file's JSON.
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

    /// A plan file of the tiny shape on 4 devices (dp 2 x tp 2, one stage, ZeRO-1), edited by
    /// `edit` and read back: the error's text.
    fn refused(edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut plan = serde_json::to_value(plan_file()).unwrap();
        plan["plan"]["layout"] = serde_json::json!({
            "dp": 2, "tp": 2, "pp": 1, "virtual_stages": 1, "micro_batch": 2,
            "micro_batches": 4, "schedule": "1f1b", "recompute": ["full"], "zero": 1,
            "reduce_scatter": "step", "shard": 0,
            "partition": {"ranges": [{"start": 0, "end": 6}]},
            "tp_overlap": 1, "cp": 1, "sequence_parallel": true, "ep": 1
        });
        let dir = std::env::temp_dir().join(format!(
            "merak-plan-fields-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("plan.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&plan).unwrap()).unwrap();
        PlanFile::read(&path).expect("the base plan is valid");
        edit(&mut plan);
        std::fs::write(&path, serde_json::to_vec_pretty(&plan).unwrap()).unwrap();
        let e = PlanFile::read(&path).expect_err("refused").to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.starts_with("plan file "), "{e}");
        e
    }

    /// Issue 50: every field of a plan file's layout is range-checked as `merak train` checks
    /// the `parallel.*` key it sets, naming the field (a ZeRO stage 7 and a shard group that
    /// divides nothing were taken and dropped).
    #[test]
    fn every_layout_field_is_checked_naming_it() {
        let cases: Vec<(&str, Edit)> = vec![
            (
                "plan.layout.zero = 7: not a supported ZeRO stage (0, 1, 2 or 3)",
                Box::new(|l| l["zero"] = 7.into()),
            ),
            (
                "plan.layout.zero: 300 is not a supported ZeRO stage",
                Box::new(|l| l["zero"] = 300.into()),
            ),
            (
                "plan.layout.shard = 3: must divide plan.layout.dp = 2",
                Box::new(|l| l["shard"] = 3.into()),
            ),
            (
                "plan.layout.shard = 1: hybrid sharding needs plan.layout.zero = 1, 2 or 3",
                Box::new(|l| {
                    l["shard"] = 1.into();
                    l["zero"] = 0.into();
                }),
            ),
            (
                "plan.layout.reduce_scatter = micro-batch: needs plan.layout.zero = 2 or 3 (it is 1)",
                Box::new(|l| l["reduce_scatter"] = "micro-batch".into()),
            ),
            (
                "plan.layout.micro_batch = 0: must be at least 1",
                Box::new(|l| l["micro_batch"] = 0.into()),
            ),
            (
                "plan.layout.micro_batch = 576460752303423488: plan.layout.micro_batch x the \
                 sequence length 64 overflows",
                Box::new(|l| l["micro_batch"] = (1u64 << 59).into()),
            ),
            (
                "plan.layout.tp = 3: does not divide the model's 4 heads",
                Box::new(|l| l["tp"] = 3.into()),
            ),
            (
                "plan.layout.dp x plan.layout.cp x plan.layout.tp x plan.layout.pp overflows",
                Box::new(|l| l["dp"] = (1u64 << 63).into()),
            ),
            (
                "plan.layout.virtual_stages = 2: 2 stages per rank need plan.layout.schedule = \
                 \"interleaved\", \"zb-v\" or \"dualpipev\" (it is \"1f1b\")",
                Box::new(|l| l["virtual_stages"] = 2.into()),
            ),
            (
                "plan.layout.virtual_stages = 1: plan.layout.schedule = \"zb-v\" runs 2 stages",
                Box::new(|l| l["schedule"] = "zb-v".into()),
            ),
            (
                "plan.layout.recompute = [\"none\"]: plan.layout.zero = 3 recomputes every unit",
                Box::new(|l| {
                    l["zero"] = 3.into();
                    l["recompute"] = serde_json::json!(["none"]);
                }),
            ),
            (
                "plan.layout.schedule = zb-h1: plan.layout.zero = 3 runs a unit's whole backward",
                Box::new(|l| {
                    l["zero"] = 3.into();
                    l["schedule"] = "zb-h1".into();
                }),
            ),
            (
                "plan.layout.recompute = [\"full\", \"full\"]: 2 entries for plan.layout.pp x \
                 plan.layout.virtual_stages = 1 stages",
                Box::new(|l| l["recompute"] = serde_json::json!(["full", "full"])),
            ),
            (
                "plan.layout.partition = [1, 5]: 2 stages over 6 units",
                Box::new(|l| {
                    l["partition"] = serde_json::json!({"ranges": [
                        {"start": 0, "end": 1}, {"start": 1, "end": 6}]});
                }),
            ),
            (
                "plan.layout.cp = 3: 2 x plan.layout.cp = 6 does not divide the model's sequence \
                 length 64",
                Box::new(|l| l["cp"] = 3.into()),
            ),
            (
                "plan.layout.sequence_parallel = true: needs plan.layout.tp > 1 (it is 1)",
                Box::new(|l| l["tp"] = 1.into()),
            ),
            (
                "plan.layout.tp_overlap = 2: splits the tensor-parallel blocks' all-reduces; it \
                 needs plan.layout.tp > 1 (it is 1)",
                Box::new(|l| {
                    l["tp"] = 1.into();
                    l["sequence_parallel"] = false.into();
                    l["tp_overlap"] = 2.into();
                }),
            ),
            (
                "plan.layout.tp_overlap = 3: does not divide the 32 tokens",
                Box::new(|l| l["tp_overlap"] = 3.into()),
            ),
            (
                "plan.layout.ep = 2: needs a mixture of experts; this model is dense",
                Box::new(|l| l["ep"] = 2.into()),
            ),
            (
                "plan.layout.micro_batches = 1: plan.layout.schedule = \"dualpipev\" needs at \
                 least 2 per pipeline rank: 2 for plan.layout.pp = 1",
                Box::new(|l| {
                    l["schedule"] = "dualpipev".into();
                    l["virtual_stages"] = 2.into();
                    l["micro_batches"] = 1.into();
                }),
            ),
        ];
        for (want, edit) in cases {
            let e = refused(|plan| edit(&mut plan["plan"]["layout"]));
            assert!(e.contains(want), "wanted `{want}` in: {e}");
        }
    }

    /// Issue 50: nothing in a plan file is dropped silently (an unknown field anywhere is
    /// refused), a value of the wrong type names its field, and the stored prediction is not
    /// negative.
    #[test]
    fn unknown_fields_and_wrong_types_are_refused_naming_them() {
        for (want, edit) in [
            (
                "plan.layout: unknown field `speed`",
                Box::new(|p: &mut serde_json::Value| p["plan"]["layout"]["speed"] = 1.into())
                    as Edit,
            ),
            (
                ": unknown field `comment`",
                Box::new(|p| p["comment"] = "x".into()),
            ),
            (
                "model: unknown field `depth`",
                Box::new(|p| p["model"]["depth"] = 3.into()),
            ),
            (
                "plan.prediction: unknown field `cost`",
                Box::new(|p| p["plan"]["prediction"]["cost"] = 3.into()),
            ),
            (
                "plan.layout.partition.ranges[0]: unknown field `x`",
                Box::new(|p| p["plan"]["layout"]["partition"]["ranges"][0]["x"] = 3.into()),
            ),
            (
                "plan.layout.dp: invalid type: string \"two\", expected usize",
                Box::new(|p| p["plan"]["layout"]["dp"] = "two".into()),
            ),
            (
                "model.layers = 1000000000: 1000000002 units (layers + embedding + head), more \
                 than the 1048576 a plan file may cover",
                Box::new(|p| p["model"]["layers"] = 1_000_000_000.into()),
            ),
            (
                "plan.prediction.step_time_s = -1: must be a finite number >= 0",
                Box::new(|p| p["plan"]["prediction"]["step_time_s"] = (-1.0).into()),
            ),
        ] {
            let e = refused(edit);
            assert!(e.contains(want), "wanted `{want}` in: {e}");
        }
    }
}
