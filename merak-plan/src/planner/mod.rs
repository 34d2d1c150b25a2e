//! The planner: pure computation, no MPI and no tensors, so a laptop can plan a thousand-GPU
//! cluster.
//!
//! - [`model`]: the model proxy, one [`UnitProfile`] per pipeline unit ([`LayerCosts`] lets a
//!   user's own model describe itself).
//! - [`measured`]: a proxy for a user's own model from its units timed on the real backend
//!   ([`MeasuredModel`]).
//! - [`hardware`]: the [`HardwareSpec`] (presets and TOML).
//! - [`kernels`]: whose kernels a prediction is for ([`Kernels`]: the spec's own efficiency,
//!   or merak's CUDA kernels as last measured).
//! - [`calibration`]: measured layer times from `merak profile` ([`Calibration`]).
//! - [`memory`](mod@memory): the one accounting of a rank's model states under every ZeRO
//!   stage and parallel group ([`model_states`]), shared by the cost model, the admission
//!   check and `memory.json`.
//! - [`cost`]: the [`CostModel`]: predicted step time and memory of a [`Layout`], the pipeline
//!   bubble taken from a simulation of the actual schedule.
//! - [`search`](mod@search): the fastest plan, runner-ups and the Pareto set of (step time,
//!   memory) under a memory budget.
//! - [`stage_dp`]: stage boundaries and per-stage recomputation under a memory budget, an
//!   exact dynamic program over the units ([`StageDp`]).
//! - [`layout_check`]: the checks of a layout given from outside the search (a plan file,
//!   `merak simulate --layout`), each naming its field ([`LayoutFieldError`]).
//! - [`plan_file`]: a saved plan with the job it was made for ([`PlanFile`]).
//! - [`reference`](mod@reference): published Megatron-LM throughput (Narayanan et al., SC'21)
//!   that the cost model reproduces.
//!
//! ```
//! use merak_plan::planner::{HardwareSpec, ModelProxy, SearchOptions, search};
//!
//! let model = ModelProxy::parse("gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200")?;
//! let hardware = HardwareSpec::load("a100-80g")?.with_devices(32);
//! let result = search(&model, &hardware, &SearchOptions::new(32, 512))?;
//! assert!(result.best.prediction.max_memory_bytes() <= hardware.memory_bytes);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod calibration;
pub mod cost;
pub mod hardware;
mod json_path;
pub mod kernels;
pub mod layout_check;
pub mod measured;
pub mod memory;
pub mod model;
pub mod plan_file;
pub mod reference;
pub mod search;
pub mod stage_dp;

pub use calibration::{CALIBRATION_FORMAT, Calibration, CalibrationError, UnitKind, UnitTiming};
pub use cost::{
    CostError, CostModel, Estimate, FRAMEWORK_BYTES, Layout, MuonTerms, OptimizerCost, Prediction,
};
pub use hardware::{HARDWARE_PRESETS, HardwareError, HardwareSpec, Runtime};
pub use kernels::{KERNEL_PRESETS, Kernels, UnknownKernels};
pub use layout_check::{FieldNames, LayoutFieldError};
pub use measured::{MeasuredError, MeasuredModel, MeasuredUnit, with_fixed_costs};
pub use memory::{
    GATHERED_AHEAD, ModelStates, StateFormat, StateSharding, gathered_bytes, model_states,
};
pub use model::{
    EXPERT_IMBALANCE, EXPERT_IMBALANCE_PCT, EXPERT_LOAD_BOUND, LayerCosts, ModelKind, ModelProxy,
    ModelSpecError, MoeShape, PRESETS, RankSplit, RecomputeMode, TransformerShape, UnitProfile,
};
pub use plan_file::{MAX_PLAN_UNITS, PLAN_FORMAT, PlanFile, PlanFileError};
pub use reference::{MEGATRON_MOE, MEGATRON_SC21, PublishedMoeRow, PublishedRow};
pub use search::{
    MAX_SEARCH_LAYOUTS, MAX_SEARCH_UNITS, MAX_SEARCH_WORK, Plan, SearchError, SearchOptions,
    SearchProgress, SearchResult, layout_limit, layout_work, search, search_calibrated,
    search_with_progress,
};
pub use stage_dp::{Skeleton, StageDp, StageDpError, StagePlan};

/// The serde default of the planner's switches that are on unless said
/// (`reshard_after_forward`).
pub(crate) fn yes() -> bool {
    true
}

/// The serde default of the planner's degrees that mean "off" at 1 (`tp_overlap`,
/// `max_tp_overlap`).
pub(crate) fn one() -> usize {
    1
}

/// Reads a layout's ZeRO stage: a number, or the `true`/`false` of `zero1` in plan files of
/// earlier versions (stage 1 or 0). A value that is neither, or a number beyond a `u8`, is
/// refused here; stages 4 to 255 by [`Layout::check_fields`], which names the field.
pub(crate) fn zero_stage<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u8, D::Error> {
    /// Reads the stage where it stands (an error there names the field's place in the file).
    struct Stage;
    impl serde::de::Visitor<'_> for Stage {
        type Value = u8;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a ZeRO stage (0, 1, 2 or 3)")
        }
        fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<u8, E> {
            Ok(u8::from(on))
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<u8, E> {
            u8::try_from(n)
                .map_err(|_| E::custom(format!("{n} is not a supported ZeRO stage (0, 1, 2 or 3)")))
        }
    }
    d.deserialize_any(Stage)
}

/// Writes `bytes` to `path` atomically: into `path.partial`, then renamed over `path`, so a
/// reader never sees half a file (plan and calibration files).
pub(crate) fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        // Leave nothing behind; the rename's error is the one to report.
        let _ = std::fs::remove_file(&tmp);
    })
}
