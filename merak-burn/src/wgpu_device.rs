//! The `wgpu` device (Vulkan, Metal or DX12): which adapter a run trains on, and the start-up
//! self-test.
//!
//! CubeCL compiles its kernels when they are first used, so a driver that cannot compile or
//! run one would otherwise fail in the middle of the first step, after the data and the model
//! are loaded, with a panic deep inside wgpu. [`choose_adapter`] refuses a machine without an
//! adapter, naming what to install, and [`self_test`] runs the operations of a training step
//! on tiny shapes and compares them with the CPU backend, before training
//! ([`crate::self_test`], shared with CUDA).
//! The software driver (Mesa's llvmpipe) is a CPU adapter: it runs every kernel correctly and
//! slowly, and [`Adapter::is_cpu`] lets the caller warn about it.

use thiserror::Error;

use crate::backend::{Wgpu, WgpuDevice};
pub use crate::self_test::{SELF_TEST_TOLERANCE, SelfTest};

/// What kind of adapter a wgpu device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    /// A discrete GPU.
    Discrete,
    /// A GPU integrated with the CPU.
    Integrated,
    /// A virtual GPU (a virtual machine's).
    Virtual,
    /// A software driver running on the CPU (Mesa's llvmpipe, SwiftShader).
    Cpu,
    /// An adapter wgpu cannot classify.
    Other,
}

/// The adapter a run trains on.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// The adapter's name, as its driver reports it.
    pub name: String,
    /// Its kind.
    pub kind: AdapterKind,
    /// The graphics API (Vulkan, Metal, DX12).
    pub backend: String,
    /// The driver and its version.
    pub driver: String,
    /// The device to give Burn: this adapter.
    pub device: WgpuDevice,
}

impl Adapter {
    /// Whether the adapter is a software driver on the CPU: correct, and far slower than the
    /// CPU backend.
    pub fn is_cpu(&self) -> bool {
        self.kind == AdapterKind::Cpu
    }
}

impl std::fmt::Display for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({:?}, {}, driver {})",
            self.name, self.kind, self.backend, self.driver
        )
    }
}

/// A failure of the wgpu device before training.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum WgpuError {
    /// No adapter at all.
    #[error(
        "train.device = \"wgpu\": no GPU adapter was found (Vulkan, Metal or DX12). Install your \
         GPU's Vulkan driver, or Mesa's software driver to test on the CPU (Debian/Ubuntu: \
         apt-get install mesa-vulkan-drivers libvulkan1), or train with train.device = \"cpu\""
    )]
    NoAdapter,
    /// An operation of the self-test failed to compile or run, or gave wrong values.
    #[error("train.device = \"wgpu\": the self-test of {check} failed on {adapter}: {reason}")]
    SelfTest {
        /// The adapter.
        adapter: String,
        /// The operation.
        check: String,
        /// What went wrong.
        reason: String,
    },
}

/// The adapter to train on, among those of the graphics API CubeCL uses here (Vulkan on Linux
/// and Windows, Metal on macOS): the first discrete GPU, else the first integrated one, else
/// the first virtual one, else a software driver on the CPU.
pub fn choose_adapter() -> Result<Adapter, WgpuError> {
    use burn_wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
    let instance = wgpu::Instance::default();
    let api = wgpu::Backends::from(AutoGraphicsApi::backend());
    let adapters = burn_cubecl::cubecl::future::block_on(instance.enumerate_adapters(api));
    let infos: Vec<wgpu::AdapterInfo> = adapters.iter().map(|a| a.get_info()).collect();
    let preference = [
        (wgpu::DeviceType::DiscreteGpu, AdapterKind::Discrete),
        (wgpu::DeviceType::IntegratedGpu, AdapterKind::Integrated),
        (wgpu::DeviceType::VirtualGpu, AdapterKind::Virtual),
        (wgpu::DeviceType::Cpu, AdapterKind::Cpu),
    ];
    for (ty, kind) in preference {
        if let Some(info) = infos.iter().find(|i| i.device_type == ty) {
            return Ok(adapter(info, kind, device_of(kind)));
        }
    }
    // Only unclassified adapters: cubecl picks among them by its default preference.
    (infos.first())
        .map(|info| adapter(info, AdapterKind::Other, WgpuDevice::DefaultDevice))
        .ok_or(WgpuError::NoAdapter)
}

fn adapter(info: &wgpu::AdapterInfo, kind: AdapterKind, device: WgpuDevice) -> Adapter {
    Adapter {
        name: info.name.clone(),
        kind,
        backend: format!("{:?}", info.backend),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        device,
    }
}

/// The first adapter of `kind` (cubecl numbers the adapters of each kind from 0).
fn device_of(kind: AdapterKind) -> WgpuDevice {
    match kind {
        AdapterKind::Discrete => WgpuDevice::DiscreteGpu(0),
        AdapterKind::Integrated => WgpuDevice::IntegratedGpu(0),
        AdapterKind::Virtual => WgpuDevice::VirtualGpu(0),
        AdapterKind::Cpu => WgpuDevice::Cpu,
        AdapterKind::Other => WgpuDevice::DefaultDevice,
    }
}

/// Runs [`crate::self_test::self_test`] on `adapter`: every operation of a training step against
/// the CPU backend, before training.
pub fn self_test(adapter: &Adapter) -> Result<SelfTest, WgpuError> {
    crate::self_test::self_test::<Wgpu>(&adapter.device, SELF_TEST_TOLERANCE).map_err(|f| {
        WgpuError::SelfTest {
            adapter: adapter.to_string(),
            check: f.check,
            reason: f.reason,
        }
    })
}
