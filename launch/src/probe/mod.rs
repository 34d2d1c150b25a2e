//! `merak probe` (a hardware spec of this machine) and `merak profile` (measured layer times
//! of a model: the calibration the cost model uses). Both run under `mpirun` with the ranks a
//! training job would use, and every rank works at once, so the numbers include the sharing of
//! cores (or of a device) between ranks.

mod fit;
mod hardware;
mod overlap;
mod profile;
mod units;

use anyhow::{Result, bail};
use merak_burn::backend::CpuAutodiff;
use merak_burn::comm::{Communicator, MpiCommunicator, ReduceOp};
use std::path::PathBuf;

pub use hardware::measure;
use hardware::{measure_with_overlap, print_overlap};
use overlap::OverlapSample;
pub use profile::profile;

type B = CpuAutodiff;

/// Arguments of `merak probe`.
#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// Write the hardware spec (TOML) here.
    #[arg(long, default_value = "hardware.toml")]
    pub out: PathBuf,
    /// Timed repetitions of each measurement (the median is kept).
    #[arg(long, default_value_t = 7)]
    pub reps: usize,
    /// Instead of measuring, check NCCL on each rank's GPU: device all-reduce (f32, bf16) and
    /// all-gather of Burn tensors and a host all-reduce against exact values (a CUDA build,
    /// under `mpirun`, one rank per GPU; one rank checks how tensors are lent to NCCL).
    #[arg(long)]
    pub nccl: bool,
}

/// Arguments of `merak profile`.
#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// TOML config of the model (the built-in default without it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override config keys, e.g. --set model.layers=4 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Micro-batch sizes to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub micro_batches: Vec<usize>,
    /// Tensor-parallel degrees to time (default: every degree that divides the ranks and the
    /// heads).
    #[arg(long, value_delimiter = ',')]
    pub tp: Vec<usize>,
    /// Tensor-parallel overlap degrees (`parallel.tp_overlap`) at which to time the layer too,
    /// at every degree tp > 1 and every micro-batch whose tokens they divide (1: none).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub tp_overlap: Vec<usize>,
    /// Timed repetitions of each measurement (the fastest is kept).
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    /// Steps of each of the two short training runs that measure the framework's own costs
    /// per micro-batch and per step.
    #[arg(long, default_value_t = 16)]
    pub train_steps: usize,
    /// Write the calibration (JSON) here.
    #[arg(long, default_value = "calibration.json")]
    pub out: PathBuf,
}

/// The fastest of `v`: other work on a shared machine only ever adds time, so the fastest
/// repetition is the best estimate of the work itself (the benchmarks count a layout's fastest
/// round the same way).
pub(super) fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// The mean of `values` over all ranks (every rank gets the same numbers).
pub(super) fn mean_over_ranks(world: Option<&MpiCommunicator>, values: &mut [f64]) -> Result<()> {
    let Some(w) = world else { return Ok(()) };
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    w.all_reduce(&mut buf, ReduceOp::Sum)?;
    for (v, b) in values.iter_mut().zip(buf) {
        *v = b as f64 / w.size() as f64;
    }
    Ok(())
}

/// Aligns all ranks (nothing without MPI).
pub(super) fn barrier(world: Option<&MpiCommunicator>) -> Result<()> {
    if let Some(w) = world {
        w.barrier()?;
    }
    Ok(())
}

/// The machine's main memory in bytes (`MemTotal` of /proc/meminfo; 8 GiB when unknown).
pub(super) fn total_memory_bytes() -> u64 {
    merak_burn::admission::meminfo_bytes("MemTotal").unwrap_or(8 << 30)
}

/// `merak probe`: writes the measured spec (rank 0).
pub fn probe(args: &ProbeArgs, world: Option<&MpiCommunicator>) -> Result<()> {
    if args.nccl {
        return nccl_check(world);
    }
    if args.reps == 0 {
        bail!("--reps 0: at least 1 repetition is needed");
    }
    if world.is_none_or(|w| w.rank() == 0) {
        crate::output_file(&args.out, "--out")?;
    }
    let (spec, overlap) = measure_with_overlap(world, args.reps)?;
    if world.is_none_or(|w| w.rank() == 0) {
        print_overlap(overlap.as_deref());
        spec.write(&args.out)?;
        println!(
            "{}: {:.2} GFLOP/s per rank (f32 matrix products, all ranks at once; {:.2} of that time when half the ranks wait), memory {:.1} GB/s, MPI latency {:.1} us, bandwidth {:.2} GB/s",
            args.out.display(),
            spec.peak_flops_fp32 / 1e9,
            spec.alone_time_fraction,
            spec.memory_bandwidth / 1e9,
            spec.intra_node_latency * 1e6,
            spec.intra_node_bandwidth / 1e9
        );
    }
    Ok(())
}

/// `merak probe --nccl`: [`merak_burn::comm::nccl_device::self_check`] on this rank's GPU;
/// rank 0 prints the result, and a wrong value is an error.
#[cfg(feature = "cuda")]
pub(super) fn nccl_check(world: Option<&MpiCommunicator>) -> Result<()> {
    let Some(world) = world else {
        bail!("merak probe --nccl runs under mpirun (mpirun -np 1 works: one GPU)");
    };
    let local = merak_burn::device::LocalRank::from_env()?;
    let devices = merak_burn::comm::nccl::cuda_device_count()?;
    let choice = merak_burn::device::choose_device(local, devices, None, false)?;
    let check = merak_burn::comm::nccl_device::self_check(world, choice.ordinal)?;
    if world.rank() == 0 {
        println!(
            "NCCL over {} ranks, {} elements: device all-reduce error {} (f32 and bf16), \
             device all-gather error {}, host all-reduce error {}, inputs unchanged: {}",
            check.ranks,
            check.elements,
            check.all_reduce_error,
            check.all_gather_error,
            check.host_all_reduce_error,
            check.inputs_unchanged
        );
    }
    if !check.passed() {
        bail!(
            "the NCCL self-check found wrong values on rank {}",
            world.rank()
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub(super) fn nccl_check(_world: Option<&MpiCommunicator>) -> Result<()> {
    bail!("merak probe --nccl needs a build with CUDA (cargo build --release --features cuda)")
}
