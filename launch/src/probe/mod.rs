//! `merak probe` (a hardware spec of this machine) and `merak profile` (measured layer times
//! of a model: the calibration the cost model uses). Both run under `mpirun` with the ranks a
//! training job would use, and every rank works at once, so the numbers include the sharing of
//! cores (or of a device) between ranks.

mod fit;
mod profile;
mod units;

use anyhow::{Result, bail};
use merak_burn::backend::CpuAutodiff;
use merak_burn::comm::{Communicator, MpiCommunicator};
use std::path::PathBuf;

use merak_burn::probe::OverlapSample;
pub use merak_burn::probe::measure;
use merak_burn::probe::measure_with_overlap;
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
             device all-gather error {}, host all-reduce error {}, grouped all-to-all-v error {}, \
             inputs unchanged: {}",
            check.ranks,
            check.elements,
            check.all_reduce_error,
            check.all_gather_error,
            check.host_all_reduce_error,
            check.all_to_all_v_error,
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

/// Prints what the overlap measurement saw.
fn print_overlap(samples: Option<&[OverlapSample]>) {
    for s in samples.unwrap_or_default() {
        println!(
            "tp overlap k={}: product {:.3} ms, + all-reduce serial {:.3} ms, sub-pipelined {:.3} ms \
             (one chunk's all-reduce alone {:.3} ms): {:.0}% of the communication hidden, slowdown {:.2}",
            s.k,
            s.compute_s * 1e3,
            s.serial_s * 1e3,
            s.overlapped_s * 1e3,
            s.chunk_allreduce_s * 1e3,
            100.0 * s.hidden_fraction(),
            s.slowdown
        );
    }
}
