//! The hardware a plan runs on: devices, memory, compute and links, as the cost model reads them.
//!
//! A [`HardwareSpec`] is read from a TOML file (every key below, `name` optional) or taken from
//! a preset: `a100-80g`, `h100-80g`, `h200-141g`, `local-cpu`.
//!
//! A spec is mostly the hardware: peak rates, memory, bandwidths, latencies. A few keys say what
//! an implementation achieves on it (`achievable_fraction`, `flash_attention`,
//! `max_tp_overlap`, `tp_overlap_slowdown`, `runtime`, `gradient_copy_stall_s`): on the GPU
//! presets they describe the published runs the presets are fitted to (Megatron-LM and
//! Megatron-Core), on `local-cpu` and a probed spec merak's own CPU kernels.
//! [`Kernels`](super::kernels::Kernels) replaces them with another implementation's, such as
//! merak's CUDA kernels as last measured (`merak-cuda`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Why a hardware spec cannot be loaded.
#[derive(Debug, Error)]
pub enum HardwareError {
    /// Neither a preset nor a readable file.
    #[error("unknown hardware `{name}`: not a preset ({known}) and not a readable file: {source}")]
    Unknown {
        /// The name or path given.
        name: String,
        /// The presets.
        known: String,
        /// The file error.
        source: std::io::Error,
    },
    /// The TOML does not describe a spec (the message names the key).
    #[error("hardware spec: {0}")]
    Toml(#[from] toml::de::Error),
    /// Writing the spec failed.
    #[error("writing the hardware spec {}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A value out of range.
    #[error("hardware spec key `{key}` = {value} must be {expected}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        expected: &'static str,
    },
}

/// Devices, memory, compute and links of a cluster. Bandwidths are bytes/s per device and
/// direction; latencies seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSpec {
    /// A name for reports.
    #[serde(default)]
    pub name: String,
    /// Devices (GPUs) per node.
    pub devices_per_node: usize,
    /// Nodes.
    pub nodes: usize,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Peak FP32 FLOP/s per device.
    pub peak_flops_fp32: f64,
    /// Peak FP16/BF16 (dense tensor-core) FLOP/s per device.
    pub peak_flops_fp16: f64,
    /// The fraction of peak that the layers' matrix products achieve (0.70 on the GPU presets,
    /// fitted to Megatron-LM's 2021 A100 rows). Their memory-bound operations run at
    /// [`memory_bandwidth`](Self::memory_bandwidth) instead, so a layer's share of peak grows
    /// with its size.
    pub achievable_fraction: f64,
    /// Sustained device memory bandwidth, bytes/s (what a streaming kernel reaches, about 80%
    /// of the data sheet's on GPUs): the optimizer step and the layers' memory-bound
    /// operations are bound by it.
    pub memory_bandwidth: f64,
    /// Bandwidth between two devices of one node, bytes/s per direction.
    pub intra_node_bandwidth: f64,
    /// Latency of one intra-node message, seconds.
    pub intra_node_latency: f64,
    /// Inter-node bandwidth available to one device, bytes/s per direction.
    pub inter_node_bandwidth: f64,
    /// Latency of one inter-node message, seconds.
    pub inter_node_latency: f64,
    /// Compute units (CPU cores) that the ranks of a node share; 0 (the default): every
    /// device computes on its own, as GPUs do. `merak probe` sets the machine's cores.
    #[serde(default)]
    pub compute_units_per_node: usize,
    /// With shared compute units: the time a rank takes for its work while the other ranks of
    /// its node wait in MPI, as a fraction of its time when all of them work (`units / ranks`
    /// if waiting ranks gave their cores away entirely, 1 if they kept spinning on them).
    /// 0 (the default): `units / ranks`. `merak probe` measures it.
    #[serde(default)]
    pub alone_time_fraction: f64,
    /// The largest sub-pipelining degree of tensor parallelism (`Layout::tp_overlap`) the
    /// search may choose: 4 on the GPU presets, 1 (the default) where the runtime cannot overlap
    /// tensor-parallel all-reduces with computation (merak train's CPU ranks on MPI).
    #[serde(default = "super::one")]
    pub max_tp_overlap: usize,
    /// The extra time that overlapped tensor-parallel communication costs the computation it
    /// runs beside (shared SMs and memory bandwidth), as a fraction of the overlapped time;
    /// 0 (the default) on hardware without overlap.
    #[serde(default)]
    pub tp_overlap_slowdown: f64,
    /// Whether the attention core runs as one fused kernel (flash attention: the scores never
    /// reach device memory, so their memory-bound work costs nothing, and the backward pass
    /// keeps no probabilities). False (the default): the unfused softmax of Megatron-LM's 2021
    /// runs (the `a100-80g` preset, fitted to them); true on `h100-80g`, as Megatron-Core and
    /// torchtitan run today, and on `local-cpu` (merak's blockwise CPU kernel).
    #[serde(default)]
    pub flash_attention: bool,
    /// Bandwidth between a device and its host's memory, bytes/s per direction (the copies of
    /// host gradient buffers); 0 (the default): the device is the host (CPU ranks), and the
    /// copies run at [`memory_bandwidth`](Self::memory_bandwidth).
    #[serde(default)]
    pub host_bandwidth: f64,
    /// Whose runtime synchronises the data-parallel gradients ([`Runtime`]); `merak-mpi`
    /// (the default) for a spec file, `published` on the GPU presets.
    #[serde(default)]
    pub runtime: Runtime,
    /// Seconds the runtime's device waits per gradient tensor copied into host buffers (the
    /// host synchronises with the device for each copy, so the device's queue of launched
    /// work runs dry); 0 (the default) on CPU ranks, whose copies are plain memory copies.
    #[serde(default)]
    pub gradient_copy_stall_s: f64,
}

/// Whose runtime synchronises the data-parallel gradients, which decides what the cost model
/// makes of `parallel.gradient_buffers`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// The published implementations the GPU presets are fitted to (Megatron-LM's and
    /// Megatron-Core's): gradients bucketed on the device, their all-reduce overlapped with
    /// the backward pass; `gradient_buffers` does not apply.
    Published,
    /// merak's reducer with ranks on MPI: host buffers (the default beyond one rank) overlap
    /// the all-reduce with the backward pass and pay the copies; device buffers all-reduce
    /// after the backward pass.
    #[default]
    MerakMpi,
    /// merak's reducer with ranks on NCCL: as `merak-mpi`, and device buffers are the default
    /// without ZeRO.
    MerakNccl,
}

impl Runtime {
    /// Whether the ranks' collectives run over NCCL (what `gradient_buffers = "auto"` reads).
    pub fn nccl(self) -> bool {
        matches!(self, Self::MerakNccl | Self::Published)
    }
}

/// The preset names.
pub const HARDWARE_PRESETS: [&str; 4] = ["a100-80g", "h100-80g", "h200-141g", "local-cpu"];

impl HardwareSpec {
    /// A preset: `a100-80g` (8 A100-80GB per node, NVLink about 300 GB/s per direction,
    /// 8 x 200 Gb/s InfiniBand per node, 312 TFLOP/s fp16), `h100-80g` (989 TFLOP/s dense fp16,
    /// NVLink 450 GB/s, 8 x 400 Gb/s InfiniBand), `h200-141g` (the H100's compute and links with
    /// 141 GB at 4.8 TB/s) or `local-cpu` (1 node of 2 small devices).
    /// `nodes` is 1; set it (or use [`with_devices`](Self::with_devices)) for a cluster.
    pub fn preset(name: &str) -> Option<Self> {
        let spec = match name {
            "a100-80g" => HardwareSpec {
                name: name.to_string(),
                devices_per_node: 8,
                nodes: 1,
                memory_bytes: 80_000_000_000,
                peak_flops_fp32: 19.5e12,
                peak_flops_fp16: 312e12,
                achievable_fraction: 0.70,
                memory_bandwidth: 1.6e12,
                intra_node_bandwidth: 300e9,
                intra_node_latency: 5e-6,
                inter_node_bandwidth: 25e9,
                inter_node_latency: 1e-5,
                compute_units_per_node: 0,
                alone_time_fraction: 0.0,
                max_tp_overlap: 4,
                tp_overlap_slowdown: 0.15,
                flash_attention: false,
                // PCIe 4.0 x16.
                host_bandwidth: 25e9,
                runtime: Runtime::Published,
                gradient_copy_stall_s: 0.0,
            },
            "h100-80g" => HardwareSpec {
                name: name.to_string(),
                devices_per_node: 8,
                nodes: 1,
                memory_bytes: 80_000_000_000,
                peak_flops_fp32: 67e12,
                peak_flops_fp16: 989e12,
                achievable_fraction: 0.70,
                memory_bandwidth: 2.7e12,
                intra_node_bandwidth: 450e9,
                intra_node_latency: 4e-6,
                inter_node_bandwidth: 50e9,
                inter_node_latency: 8e-6,
                compute_units_per_node: 0,
                alone_time_fraction: 0.0,
                max_tp_overlap: 4,
                tp_overlap_slowdown: 0.15,
                flash_attention: true,
                // PCIe 5.0 x16.
                host_bandwidth: 50e9,
                runtime: Runtime::Published,
                gradient_copy_stall_s: 0.0,
            },
            "h200-141g" => Self::h200(),
            "local-cpu" => HardwareSpec {
                name: name.to_string(),
                devices_per_node: 2,
                nodes: 1,
                memory_bytes: 8_000_000_000,
                peak_flops_fp32: 50e9,
                peak_flops_fp16: 50e9,
                achievable_fraction: 0.5,
                memory_bandwidth: 10e9,
                intra_node_bandwidth: 5e9,
                intra_node_latency: 2e-6,
                inter_node_bandwidth: 1e9,
                inter_node_latency: 5e-5,
                compute_units_per_node: 0,
                alone_time_fraction: 0.0,
                max_tp_overlap: 1,
                tp_overlap_slowdown: 0.0,
                // merak's CPU attention is blockwise.
                flash_attention: true,
                host_bandwidth: 0.0,
                runtime: Runtime::MerakMpi,
                gradient_copy_stall_s: 0.0,
            },
            _ => return None,
        };
        Some(spec)
    }

    /// The `h200-141g` preset: the H100's compute and links with 141 GB at 4.8 TB/s.
    fn h200() -> Self {
        let h100 = Self::preset("h100-80g").unwrap_or_else(|| unreachable!("a preset"));
        HardwareSpec {
            name: "h200-141g".into(),
            memory_bytes: 141_000_000_000,
            // 80% of the data sheet's 4.8 TB/s, as on the other presets.
            memory_bandwidth: 3.84e12,
            ..h100
        }
    }

    /// The same spec with `devices` devices in all (whole nodes, rounding up).
    pub fn with_devices(mut self, devices: usize) -> Self {
        let per = self.devices_per_node.max(1);
        self.nodes = devices.div_ceil(per).max(1);
        self
    }

    /// Total devices.
    pub fn devices(&self) -> usize {
        self.devices_per_node * self.nodes
    }

    /// Parses and checks a TOML spec.
    pub fn from_toml(text: &str) -> Result<Self, HardwareError> {
        let spec: HardwareSpec = toml::from_str(text)?;
        spec.validate()?;
        Ok(spec)
    }

    /// Writes the spec as TOML to `path` atomically (a reader never sees half a file).
    pub fn write(&self, path: &Path) -> Result<(), HardwareError> {
        let io = |source| HardwareError::Io {
            path: path.to_path_buf(),
            source,
        };
        let text = toml::to_string(self).map_err(|e| io(std::io::Error::other(e)))?;
        super::write_atomically(path, text.as_bytes()).map_err(io)
    }

    /// A preset name, or else the path of a TOML file.
    pub fn load(name_or_path: &str) -> Result<Self, HardwareError> {
        if let Some(spec) = HardwareSpec::preset(name_or_path) {
            return Ok(spec);
        }
        let text = std::fs::read_to_string(Path::new(name_or_path)).map_err(|source| {
            HardwareError::Unknown {
                name: name_or_path.to_string(),
                known: HARDWARE_PRESETS.join(", "),
                source,
            }
        })?;
        HardwareSpec::from_toml(&text)
    }

    /// Checks every value: counts and memory positive, rates positive and finite, latencies,
    /// `host_bandwidth` and `gradient_copy_stall_s` non-negative, the fraction in `(0, 1]`,
    /// `max_tp_overlap` at least 1 and `tp_overlap_slowdown` in `[0, 1]`.
    pub fn validate(&self) -> Result<(), HardwareError> {
        let positive: [(&'static str, f64); 9] = [
            ("devices_per_node", self.devices_per_node as f64),
            ("nodes", self.nodes as f64),
            ("memory_bytes", self.memory_bytes as f64),
            ("peak_flops_fp32", self.peak_flops_fp32),
            ("peak_flops_fp16", self.peak_flops_fp16),
            ("memory_bandwidth", self.memory_bandwidth),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
            ("achievable_fraction", self.achievable_fraction),
        ];
        for (key, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return Err(HardwareError::Invalid {
                    key,
                    value,
                    expected: "positive and finite",
                });
            }
        }
        if self.achievable_fraction > 1.0 {
            return Err(HardwareError::Invalid {
                key: "achievable_fraction",
                value: self.achievable_fraction,
                expected: "at most 1",
            });
        }
        for (key, value) in [
            ("intra_node_latency", self.intra_node_latency),
            ("inter_node_latency", self.inter_node_latency),
            ("host_bandwidth", self.host_bandwidth),
            ("gradient_copy_stall_s", self.gradient_copy_stall_s),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(HardwareError::Invalid {
                    key,
                    value,
                    expected: "non-negative and finite",
                });
            }
        }
        if self.max_tp_overlap == 0 {
            return Err(HardwareError::Invalid {
                key: "max_tp_overlap",
                value: 0.0,
                expected: "at least 1 (1: no overlap)",
            });
        }
        if !(0.0..=1.0).contains(&self.tp_overlap_slowdown) {
            return Err(HardwareError::Invalid {
                key: "tp_overlap_slowdown",
                value: self.tp_overlap_slowdown,
                expected: "between 0 and 1",
            });
        }
        Ok(())
    }

    /// Achievable 16-bit FLOP/s of one device: peak times the achievable fraction.
    pub fn achievable_flops(&self) -> f64 {
        self.peak_flops_fp16 * self.achievable_fraction
    }

    /// Bytes/s of a copy between a device and its host's memory ([`host_bandwidth`](Self::host_bandwidth),
    /// or the memory's bandwidth where the device is the host).
    pub fn host_copy_bandwidth(&self) -> f64 {
        if self.host_bandwidth > 0.0 {
            self.host_bandwidth
        } else {
            self.memory_bandwidth
        }
    }

    /// Bandwidth and latency of a group of devices whose ranks span `span` consecutive ranks:
    /// intra-node when the span fits in a node, inter-node otherwise.
    pub fn link(&self, span: usize) -> (f64, f64) {
        if span <= self.devices_per_node {
            (self.intra_node_bandwidth, self.intra_node_latency)
        } else {
            (self.inter_node_bandwidth, self.inter_node_latency)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_spec_loads_back_and_a_folder_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!("merak-hw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = HardwareSpec::preset("h100-80g").unwrap();
        let path = dir.join("hw.toml");
        spec.write(&path).unwrap();
        let back = HardwareSpec::load(&path.display().to_string()).unwrap();
        assert_eq!(back, spec);
        let e = spec.write(&dir).unwrap_err().to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
        assert!(!dir.with_extension("partial").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn presets_are_valid_and_round_trip_through_toml() {
        for name in HARDWARE_PRESETS {
            let spec = HardwareSpec::load(name).unwrap();
            spec.validate().unwrap();
            let text = toml::to_string(&spec).unwrap();
            assert_eq!(HardwareSpec::from_toml(&text).unwrap(), spec);
        }
        assert_eq!(
            HardwareSpec::preset("a100-80g")
                .unwrap()
                .with_devices(64)
                .devices(),
            64
        );
    }

    #[test]
    fn errors_name_the_key() {
        let spec = HardwareSpec::preset("a100-80g").unwrap();
        let text = toml::to_string(&spec).unwrap();
        let missing: String = text
            .lines()
            .filter(|l| !l.starts_with("nodes"))
            .collect::<Vec<_>>()
            .join("\n");
        let err = HardwareSpec::from_toml(&missing).unwrap_err().to_string();
        assert!(err.contains("nodes"), "{err}");
        let bad = text.replace("achievable_fraction = 0.7", "achievable_fraction = 1.5");
        let err = HardwareSpec::from_toml(&bad).unwrap_err().to_string();
        assert!(err.contains("achievable_fraction"), "{err}");
        for (key, bad) in [("max_tp_overlap", "0"), ("tp_overlap_slowdown", "2.0")] {
            let line = text
                .lines()
                .find(|l| l.starts_with(key))
                .expect("the preset writes the key");
            let err = HardwareSpec::from_toml(&text.replace(line, &format!("{key} = {bad}")))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
        }
        // Specs written before the overlap keys existed still load, without overlap.
        let old: String = text
            .lines()
            .filter(|l| !l.starts_with("max_tp_overlap") && !l.starts_with("tp_overlap_slowdown"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(HardwareSpec::from_toml(&old).unwrap().max_tp_overlap, 1);
        let extra = format!("{text}\nwarp_speed = 3\n");
        let err = HardwareSpec::from_toml(&extra).unwrap_err().to_string();
        assert!(err.contains("warp_speed"), "{err}");
        let err = HardwareSpec::load("tpu-v9").unwrap_err().to_string();
        assert!(err.contains("a100-80g"), "{err}");
    }
}
