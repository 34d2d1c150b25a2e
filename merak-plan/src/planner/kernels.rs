//! Whose kernels a prediction is for: a [`HardwareSpec`]'s own efficiency (`spec`, the
//! default), or merak's CUDA kernels as last measured (`merak-cuda`).
//!
//! The GPU presets' efficiency keys (`achievable_fraction`, `flash_attention`,
//! `max_tp_overlap`, `tp_overlap_slowdown`, `runtime`) describe the published runs they are
//! fitted to, so the published rows keep predicting Megatron's implementation. What merak's own
//! kernels achieve on the same GPU is a separate set of values, fitted to the recorded GPU runs
//! of `benches/gpu` and applied on top of any GPU spec by [`Kernels::apply`]:
//!
//! ```
//! use merak_plan::planner::{HardwareSpec, Kernels};
//!
//! let h200 = HardwareSpec::preset("h200-141g").unwrap();
//! let ours = Kernels::preset("merak-cuda").unwrap().apply(&h200);
//! assert!(ours.achievable_flops() < h200.achievable_flops() / 4.0);
//! assert_eq!(ours.peak_flops_fp16, h200.peak_flops_fp16);
//! ```

use serde::{Deserialize, Serialize};

use super::hardware::{HardwareSpec, Runtime};

/// The kernel presets' names.
pub const KERNEL_PRESETS: [&str; 2] = ["spec", "merak-cuda"];

/// What an implementation's kernels achieve on a device, as fractions of the hardware's rates;
/// `None` keeps the spec's value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernels {
    /// The preset's name.
    pub name: String,
    /// The share of the peak 16-bit rate the matrix products reach
    /// ([`HardwareSpec::achievable_fraction`]).
    pub achievable_fraction: Option<f64>,
    /// The share of the spec's sustained memory bandwidth the memory-bound kernels reach.
    pub memory_fraction: f64,
    /// Whether the attention core is one fused kernel.
    pub flash_attention: Option<bool>,
    /// The largest tensor-parallel sub-pipelining degree the runtime runs (1: none).
    pub max_tp_overlap: Option<usize>,
    /// Whose runtime synchronises the gradients.
    pub runtime: Option<Runtime>,
    /// Seconds the device waits per gradient tensor copied into host buffers.
    pub gradient_copy_stall_s: Option<f64>,
}

impl Kernels {
    /// A preset:
    /// - `spec`: the hardware spec as it is (the GPU presets: the published implementation;
    ///   `local-cpu` and probed specs: merak on the CPU).
    /// - `merak-cuda`: merak's CUDA kernels (bf16, the default build: CubeCL's matrix products
    ///   without autotuning, the composed attention, device gradient buffers, NCCL), fitted to
    ///   the H200 run of 2026-11-28 (`docs/src/benchmarks/gpu.md`): GPT-2 small's matrix
    ///   products took 325.6 ms of a 512 ms step (about 4.4% of the peak rate), the rest of the
    ///   step is memory-bound work at about a quarter of the sustained bandwidth (fitted to
    ///   GPT-2 small and medium together), and host gradient buffers cost 271 ms a step
    ///   (1.55 ms for each of the 12 gradients the cost model counts per unit).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "spec" => Some(Kernels {
                name: name.into(),
                achievable_fraction: None,
                memory_fraction: 1.0,
                flash_attention: None,
                max_tp_overlap: None,
                runtime: None,
                gradient_copy_stall_s: None,
            }),
            "merak-cuda" => Some(Kernels {
                name: name.into(),
                achievable_fraction: Some(MERAK_CUDA_MATMUL_FRACTION),
                memory_fraction: MERAK_CUDA_MEMORY_FRACTION,
                flash_attention: Some(false),
                max_tp_overlap: Some(1),
                runtime: Some(Runtime::MerakNccl),
                gradient_copy_stall_s: Some(MERAK_CUDA_COPY_STALL_S),
            }),
            _ => None,
        }
    }

    /// The preset `name`, or an error listing the presets.
    pub fn load(name: &str) -> Result<Self, UnknownKernels> {
        Self::preset(name).ok_or_else(|| UnknownKernels(name.to_string()))
    }

    /// `hardware` with these kernels' efficiency in place of its own (its peak rates, memory
    /// and links unchanged; the name gains `+` and the preset's name).
    pub fn apply(&self, hardware: &HardwareSpec) -> HardwareSpec {
        let mut hw = hardware.clone();
        if self.name == "spec" {
            return hw;
        }
        hw.name = format!("{}+{}", hardware.name, self.name);
        if let Some(f) = self.achievable_fraction {
            hw.achievable_fraction = f;
        }
        hw.memory_bandwidth *= self.memory_fraction;
        if let Some(f) = self.flash_attention {
            hw.flash_attention = f;
        }
        if let Some(k) = self.max_tp_overlap {
            hw.max_tp_overlap = k;
            if k == 1 {
                hw.tp_overlap_slowdown = 0.0;
            }
        }
        if let Some(r) = self.runtime {
            hw.runtime = r;
        }
        if let Some(s) = self.gradient_copy_stall_s {
            hw.gradient_copy_stall_s = s;
        }
        hw
    }
}

/// The share of the peak 16-bit rate merak's CUDA matrix products reached (H200, 2026-11-28).
pub const MERAK_CUDA_MATMUL_FRACTION: f64 = 0.044;

/// The share of the sustained memory bandwidth merak's memory-bound CUDA kernels reached.
pub const MERAK_CUDA_MEMORY_FRACTION: f64 = 0.25;

/// Seconds merak's CUDA device waited per gradient copied into host buffers.
pub const MERAK_CUDA_COPY_STALL_S: f64 = 1.55e-3;

/// A kernel preset that does not exist.
#[derive(Debug, thiserror::Error)]
#[error("unknown kernels `{0}`: the presets are {presets}", presets = KERNEL_PRESETS.join(", "))]
pub struct UnknownKernels(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_changes_nothing_and_merak_cuda_changes_only_efficiency() {
        let h200 = HardwareSpec::preset("h200-141g").unwrap();
        assert_eq!(Kernels::load("spec").unwrap().apply(&h200), h200);
        let ours = Kernels::load("merak-cuda").unwrap().apply(&h200);
        assert_eq!(ours.name, "h200-141g+merak-cuda");
        assert_eq!(ours.achievable_fraction, MERAK_CUDA_MATMUL_FRACTION);
        assert_eq!(
            ours.memory_bandwidth,
            h200.memory_bandwidth * MERAK_CUDA_MEMORY_FRACTION
        );
        assert!(!ours.flash_attention);
        assert_eq!((ours.max_tp_overlap, ours.tp_overlap_slowdown), (1, 0.0));
        assert_eq!(ours.runtime, Runtime::MerakNccl);
        let same = |a: &HardwareSpec| {
            (
                a.peak_flops_fp16,
                a.memory_bytes,
                a.intra_node_bandwidth,
                a.inter_node_bandwidth,
            )
        };
        assert_eq!(same(&ours), same(&h200));
        ours.validate().unwrap();
        let e = Kernels::load("cublas").unwrap_err().to_string();
        assert!(e.contains("cublas") && e.contains("merak-cuda"), "{e}");
    }
}
