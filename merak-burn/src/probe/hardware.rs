//! The measurements of this machine (`merak probe`): matrix-product rate with every rank at
//! once, memory bandwidth, MPI latency and bandwidth.

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};

use super::ProbeError;
use super::agree::{barrier, from_rank0, mean_over_ranks, median, total_memory_bytes};
use super::overlap::OverlapSample;
use crate::backend::Cpu;
use crate::comm::{Communicator, MpiCommunicator};
use crate::planner::{HardwareSpec, Runtime};

type Result<T> = std::result::Result<T, ProbeError>;

/// Measures this machine: the backend's matrix-product rate per rank with every rank
/// multiplying at once, memory bandwidth, and the MPI latency and bandwidth between rank 0 and
/// rank 1. One node of `ranks` devices sharing the machine's cores, each with its share of the
/// main memory. Every rank returns the same spec.
pub fn measure(world: Option<&MpiCommunicator>, reps: usize) -> Result<HardwareSpec> {
    Ok(measure_with_overlap(world, reps)?.0)
}

/// [`measure`], with what the measurement of sub-pipelined tensor parallelism saw (`None` for
/// a single rank).
pub fn measure_with_overlap(
    world: Option<&MpiCommunicator>,
    reps: usize,
) -> Result<(HardwareSpec, Option<Vec<OverlapSample>>)> {
    let reps = reps.max(1);
    let ranks = world.map_or(1, |w| w.size());
    // Matrix products of the size of a small model's layers.
    let products = Products::new(256);
    let mut rates = [
        product_rate(world, &products, reps)?,
        copy_rate(world, reps)?,
    ];
    mean_over_ranks(world, &mut rates)?;
    let alone = alone_product_fraction(world, &products, reps, rates[0])?;
    let link = link_speed(world, reps)?;
    let overlap = super::overlap::measure(world, reps)?;
    let total = total_memory_bytes();
    let spec = HardwareSpec {
        name: format!("probed: {ranks} ranks of this machine"),
        devices_per_node: ranks,
        nodes: 1,
        memory_bytes: total / ranks as u64,
        peak_flops_fp32: rates[0],
        peak_flops_fp16: rates[0],
        achievable_fraction: 1.0,
        memory_bandwidth: rates[1],
        intra_node_bandwidth: link[1],
        intra_node_latency: link[0],
        inter_node_bandwidth: link[1],
        inter_node_latency: link[0],
        compute_units_per_node: std::thread::available_parallelism().map_or(1, |n| n.get()),
        alone_time_fraction: alone,
        // Measured where there is tensor parallelism (more than one rank).
        max_tp_overlap: overlap.as_ref().map_or(1, |_| 4),
        tp_overlap_slowdown: overlap.as_deref().map_or(0.0, super::overlap::slowdown),
        // merak's CPU attention is blockwise: no scores in memory, no probabilities kept.
        flash_attention: true,
        // The ranks are the host: host buffers are copies within memory.
        host_bandwidth: 0.0,
        runtime: Runtime::MerakMpi,
        gradient_copy_stall_s: 0.0,
    };
    spec.validate()?;
    Ok((spec, overlap))
}

/// Two random `n` x `n` matrices whose products measure the backend's matrix-product rate.
pub(super) struct Products {
    n: usize,
    a: Tensor<Cpu, 2>,
    b: Tensor<Cpu, 2>,
}

impl Products {
    /// Random `n` x `n` matrices on the default CPU device.
    fn new(n: usize) -> Self {
        let device = Default::default();
        let a = Tensor::<Cpu, 2>::random([n, n], Distribution::Default, &device);
        let b = Tensor::<Cpu, 2>::random([n, n], Distribution::Default, &device);
        Self { n, a, b }
    }

    /// Computes the product 32 times, fetching each result.
    fn run(&self) {
        for _ in 0..32 {
            let c = self.a.clone().matmul(self.b.clone());
            std::hint::black_box(c.into_data());
        }
    }

    /// The rate in FLOP/s of one `run` that took `secs` seconds.
    fn rate(&self, secs: f64) -> f64 {
        32.0 * 2.0 * (self.n * self.n * self.n) as f64 / secs
    }
}

/// This rank's median matrix-product rate (FLOP/s) over `reps` repetitions after a warm-up,
/// with all ranks aligned and multiplying at once.
pub(super) fn product_rate(
    world: Option<&MpiCommunicator>,
    products: &Products,
    reps: usize,
) -> Result<f64> {
    let mut gemm = Vec::new();
    for i in 0..reps + 1 {
        barrier(world)?;
        let t = Instant::now();
        products.run();
        if i > 0 {
            gemm.push(products.rate(t.elapsed().as_secs_f64()));
        }
    }
    Ok(median(gemm))
}

/// This rank's median memory bandwidth (bytes/s) over `reps` copies of 64 MiB (a copy reads
/// and writes it), with all ranks aligned and copying at once.
pub(super) fn copy_rate(world: Option<&MpiCommunicator>, reps: usize) -> Result<f64> {
    let src = vec![1.0f32; 16 << 20];
    let mut copy = Vec::new();
    for _ in 0..reps {
        barrier(world)?;
        let t = Instant::now();
        let dst = src.clone();
        std::hint::black_box(&dst);
        copy.push(2.0 * (src.len() * 4) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median(copy))
}

/// The same products on the even ranks only, while the odd ranks wait in a receive (as a
/// pipeline rank waits in its bubble): rank 0's time then as a fraction of the all-busy time
/// (from `busy_rate`), clamped to [0, 1]; 1 for a single rank. Every rank gets the same value.
pub(super) fn alone_product_fraction(
    world: Option<&MpiCommunicator>,
    products: &Products,
    reps: usize,
    busy_rate: f64,
) -> Result<f64> {
    let Some(w) = world.filter(|w| w.size() > 1) else {
        return Ok(1.0);
    };
    let (rank, ranks) = (w.rank(), w.size());
    let mut times = Vec::new();
    for i in 0..reps + 1 {
        w.barrier()?;
        let t = Instant::now();
        if rank % 2 == 0 {
            products.run();
            if rank + 1 < ranks {
                w.send(&[0.0], rank + 1, 9)?;
            }
        } else {
            w.recv(&mut [0.0], rank - 1, 9)?;
        }
        if i > 0 && rank % 2 == 0 {
            times.push(products.rate(t.elapsed().as_secs_f64()));
        }
    }
    let mut rate = [if rank % 2 == 0 { median(times) } else { 0.0 }];
    from_rank0(world, &mut rate)?;
    Ok((busy_rate / rate[0]).clamp(0.0, 1.0))
}

/// The median time of half a round trip of `len` floats between ranks 0 and 1 (the other
/// ranks only align), over `reps * 10` round trips after a warm-up.
pub(super) fn pingpong(w: &MpiCommunicator, len: usize, reps: usize) -> Result<f64> {
    let rank = w.rank();
    let mut buf = vec![0.0f32; len];
    let mut times = Vec::new();
    for i in 0..reps * 10 + 1 {
        w.barrier()?;
        let t = Instant::now();
        if rank == 0 {
            w.send(&buf, 1, 7)?;
            w.recv(&mut buf, 1, 7)?;
        } else if rank == 1 {
            w.recv(&mut buf, 0, 7)?;
            w.send(&buf, 0, 7)?;
        }
        if i > 0 {
            times.push(t.elapsed().as_secs_f64() / 2.0);
        }
    }
    Ok(median(times))
}

/// Rank 0's MPI latency (s) and bandwidth (bytes/s) to rank 1 from ping-pongs of 1 and 2^20
/// floats, on every rank; 2 us and 5 GB/s for a single rank.
pub(super) fn link_speed(world: Option<&MpiCommunicator>, reps: usize) -> Result<[f64; 2]> {
    let mut link = [2e-6, 5e9];
    if let Some(w) = world.filter(|w| w.size() > 1) {
        let latency = pingpong(w, 1, reps)?;
        let big = 1 << 20;
        let big_time = pingpong(w, big, reps)?;
        link = [latency, (big * 4) as f64 / (big_time - latency).max(1e-9)];
        from_rank0(world, &mut link)?;
    }
    Ok(link)
}
