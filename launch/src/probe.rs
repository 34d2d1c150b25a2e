//! `merak probe` (a hardware spec of this machine) and `merak profile` (measured layer times
//! of a model: the calibration the cost model uses). Both run under `mpirun` with the ranks a
//! training job would use, and every rank works at once, so the numbers include the sharing of
//! cores (or of a device) between ranks.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Distribution, Tensor};
use merak_burn::backend::{Cpu, CpuAutodiff};
use merak_burn::batch::{Batch, Samples};
use merak_burn::comm::{Communicator, MpiCommunicator, ReduceOp};
use merak_burn::grid::{Layout, ProcessGrid};
use merak_burn::pipeline::{PipelineModel, StageInput, StageOutput};
use merak_burn::planner::{CALIBRATION_FORMAT, Calibration, HardwareSpec, UnitKind, UnitTiming};
use merak_burn::tensor_parallel::TpOverlap;
use merak_burn::train::Windows;

use crate::config;
use crate::measured::{from_rank0, median};
use crate::probe_overlap::{self, OverlapSample};

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
fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// The mean of `values` over all ranks (every rank gets the same numbers).
fn mean_over_ranks(world: Option<&MpiCommunicator>, values: &mut [f64]) -> Result<()> {
    let Some(w) = world else { return Ok(()) };
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    w.all_reduce(&mut buf, ReduceOp::Sum)?;
    for (v, b) in values.iter_mut().zip(buf) {
        *v = b as f64 / w.size() as f64;
    }
    Ok(())
}

/// Aligns all ranks (nothing without MPI).
fn barrier(world: Option<&MpiCommunicator>) -> Result<()> {
    if let Some(w) = world {
        w.barrier()?;
    }
    Ok(())
}

/// Measures this machine: the backend's matrix-product rate per rank with every rank
/// multiplying at once, memory bandwidth, and the MPI latency and bandwidth between rank 0 and
/// rank 1. One node of `ranks` devices sharing the machine's cores, each with its share of the
/// main memory. Every rank returns the same spec.
pub fn measure(world: Option<&MpiCommunicator>, reps: usize) -> Result<HardwareSpec> {
    Ok(measure_with_overlap(world, reps)?.0)
}

/// [`measure`], with what the measurement of sub-pipelined tensor parallelism saw (`None` for
/// a single rank).
fn measure_with_overlap(
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
    let overlap = probe_overlap::measure(world, reps)?;
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
        tp_overlap_slowdown: overlap.as_deref().map_or(0.0, probe_overlap::slowdown),
        // Burn's attention on the CPU backend is not fused.
        flash_attention: false,
    };
    spec.validate()?;
    Ok((spec, overlap))
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

/// Two random `n` x `n` matrices whose products measure the backend's matrix-product rate.
struct Products {
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
fn product_rate(world: Option<&MpiCommunicator>, products: &Products, reps: usize) -> Result<f64> {
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
fn copy_rate(world: Option<&MpiCommunicator>, reps: usize) -> Result<f64> {
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
fn alone_product_fraction(
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
fn pingpong(w: &MpiCommunicator, len: usize, reps: usize) -> Result<f64> {
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
fn link_speed(world: Option<&MpiCommunicator>, reps: usize) -> Result<[f64; 2]> {
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

/// The machine's main memory in bytes (`MemTotal` of /proc/meminfo; 8 GiB when unknown).
fn total_memory_bytes() -> u64 {
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
fn nccl_check(world: Option<&MpiCommunicator>) -> Result<()> {
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
fn nccl_check(_world: Option<&MpiCommunicator>) -> Result<()> {
    bail!("merak probe --nccl needs a build with CUDA (cargo build --release --features cuda)")
}

/// `b` sequences of deterministic token ids for the profiled model, inputs and targets.
fn token_batch(cfg: &merak_gpt::GptConfig, b: usize) -> Samples {
    let s = cfg.seq_len;
    let ids: Vec<i64> = (0..b * s)
        .map(|i| (i * 7919 % cfg.vocab_size) as i64)
        .collect();
    let windows = Windows {
        inputs: ids.clone(),
        targets: ids,
    };
    windows
        .into_samples(b)
        .expect("b windows of seq_len tokens")
}

/// One forward and backward pass of the whole model on `b` sequences.
fn whole_pass(model: &merak_gpt::Gpt<B>, cfg: &merak_gpt::GptConfig, b: usize) -> Result<()> {
    let units = 0..cfg.layers + 2;
    let samples = token_batch(cfg, b);
    let batch = Batch::new(&samples, &Default::default());
    let StageOutput::Loss(loss) = model.run_units(units, StageInput::Data, &batch) else {
        bail!("the model returned hidden states");
    };
    std::hint::black_box(loss.backward());
    Ok(())
}

/// Times the forward and backward passes of the embedding, the first layer and the head at
/// micro-batch `b`, back to back as in a training step (ranks align once per repetition), and
/// the whole model's forward and backward pass; `reps` times after a warm-up. The fastest unit
/// times (averaged over ranks) are scaled so that embedding + `L` layers + head add up to the
/// fastest whole pass.
fn time_units(
    model: &merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    b: usize,
    reps: usize,
) -> Result<[(f64, f64); 3]> {
    let device = Default::default();
    let (s, h, l) = (cfg.seq_len, cfg.hidden, cfg.layers);
    let samples = token_batch(cfg, b);
    let batch = Batch::new(&samples, &device);
    let grad = Tensor::<B, 3>::random([b, s, h], Distribution::Default, &device);
    let mut samples = vec![Vec::new(); 7];
    for rep in 0..reps + 1 {
        let mut t = [0.0; 6];
        barrier(world)?;
        let start = Instant::now();
        let StageOutput::Hidden(h0) = model.run_units(0..1, StageInput::Data, &batch) else {
            bail!("the embedding returned a loss");
        };
        let h0c = h0.clone().into_data();
        t[0] = start.elapsed().as_secs_f64();
        let x = Tensor::<B, 3>::from_data(h0c, &device).require_grad();
        let start = Instant::now();
        let StageOutput::Hidden(h1) = model.run_units(1..2, StageInput::Hidden(x), &batch) else {
            bail!("a layer returned a loss");
        };
        let h1c = h1.clone().into_data();
        t[1] = start.elapsed().as_secs_f64();
        let y = Tensor::<B, 3>::from_data(h1c, &device).require_grad();
        let start = Instant::now();
        let StageOutput::Loss(loss) = model.run_units(l + 1..l + 2, StageInput::Hidden(y), &batch)
        else {
            bail!("the head returned hidden states");
        };
        let _ = loss.clone().into_data();
        t[2] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box(loss.backward());
        t[5] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box((h1 * grad.clone()).sum().backward());
        t[4] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box((h0 * grad.clone()).sum().backward());
        t[3] = start.elapsed().as_secs_f64();
        barrier(world)?;
        let start = Instant::now();
        whole_pass(model, cfg, b)?;
        let whole = start.elapsed().as_secs_f64();
        if rep > 0 {
            for (v, x) in samples.iter_mut().zip(t) {
                v.push(x);
            }
            samples[6].push(whole);
        }
    }
    let mut m: Vec<f64> = samples.into_iter().map(fastest).collect();
    mean_over_ranks(world, &mut m)?;
    // The isolated passes give the split between units; the level comes from the whole
    // model's forward and backward pass, as a training step runs it.
    let sum = m[0] + m[3] + l as f64 * (m[1] + m[4]) + m[2] + m[5];
    let scale = if sum > 0.0 { m[6] / sum } else { 1.0 };
    let m: Vec<f64> = m.iter().map(|x| x * scale).collect();
    Ok([(m[0], m[3]), (m[1], m[4]), (m[2], m[5])])
}

/// The whole model's forward and backward pass (micro-batch `b`) on the even ranks while the
/// odd ranks wait in a receive, as pipeline ranks wait in their bubbles, against all ranks
/// working: the time fraction a rank needs when its peers wait (1 for one rank). Run with
/// tp = 1 (a waiting rank would stall a tensor-parallel group).
fn alone_fraction(
    model: &merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    b: usize,
    reps: usize,
) -> Result<f64> {
    let Some(w) = world.filter(|w| w.size() > 1) else {
        return Ok(1.0);
    };
    let (rank, ranks) = (w.rank(), w.size());
    let pass = || whole_pass(model, cfg, b);
    let (mut all, mut half) = (Vec::new(), Vec::new());
    for rep in 0..reps + 1 {
        w.barrier()?;
        let start = Instant::now();
        pass()?;
        let together = start.elapsed().as_secs_f64();
        w.barrier()?;
        let start = Instant::now();
        if rank % 2 == 0 {
            pass()?;
            half.push(start.elapsed().as_secs_f64());
            if rank + 1 < ranks {
                w.send(&[0.0], rank + 1, 11)?;
            }
        } else {
            w.recv(&mut [0.0], rank - 1, 11)?;
        }
        if rep > 0 {
            all.push(together);
        }
    }
    let mut times = [
        fastest(all),
        if half.len() > 1 {
            fastest(half[1..].to_vec())
        } else {
            0.0
        },
    ];
    from_rank0(world, &mut times)?;
    Ok((times[1] / times[0]).clamp(0.0, 1.0))
}

/// Seconds of one AdamW step per parameter of `model` (fastest of `reps`).
fn time_optimizer(
    model: merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    reps: usize,
) -> Result<f64> {
    let samples = token_batch(cfg, 1);
    let batch = Batch::new(&samples, &Default::default());
    let params = model.num_params() as f64;
    let mut optim = AdamWConfig::new().init();
    let mut model = model;
    let mut times = Vec::new();
    for rep in 0..reps + 1 {
        let StageOutput::Loss(loss) = model.run_units(0..cfg.layers + 2, StageInput::Data, &batch)
        else {
            bail!("the model returned hidden states");
        };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        barrier(world)?;
        let start = Instant::now();
        model = optim.step(1e-4, model, grads);
        let _ = model.valid();
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let mut m = [fastest(times) / params];
    mean_over_ranks(world, &mut m)?;
    Ok(m[0])
}

/// Micro-batches per step of the longer of the two training runs that give the framework's
/// cost per micro-batch.
const SLOPE_MICRO_BATCHES: usize = 8;

/// The median step time (after the first two steps) of a short `merak train` run of the
/// profiled model with the data-parallel layout over every rank, micro-batches of one sequence
/// and `m` of them per step: the framework's own costs (parameter hooks, gradient
/// accumulation, all-reduces, gradient norm, metrics) are in it.
fn train_step_time(
    args: &ProfileArgs,
    mpi: Option<&merak_burn::comm::MpiWorld>,
    m: usize,
    zero: u8,
    out: &std::path::Path,
) -> Result<f64> {
    let ranks = mpi.map_or(1, |w| w.world().size());
    let rank = mpi.map_or(0, |w| w.world().rank());
    let sets = train_run_sets(args, ranks, m, zero);
    let cfg = config::load(args.config.as_deref(), &sets)?;
    let plan = cfg.pipeline_plan()?;
    let grid = match mpi {
        Some(w) => ProcessGrid::from_mpi(
            w.world(),
            Layout {
                dp: ranks,
                tp: 1,
                pp: 1,
            },
        )?,
        None => ProcessGrid::single(),
    };
    let data = crate::data::open(&cfg)?;
    let device = Default::default();
    let model =
        merak_gpt::Gpt::<B>::new_units(&cfg.model.gpt, cfg.train.seed, grid.tp, &device, &|_| {
            true
        })?;
    let parallel = cfg.parallel_plan();
    let never = merak_burn::train::StopRequest::new();
    let spec = crate::train::RunSpec {
        parallel: &parallel,
        plan: &plan,
        resume: None,
        trace: None,
        stop: &never,
        existing: merak_burn::train::ExistingRun::Refuse,
    };
    crate::train::train(
        &cfg,
        &data,
        &grid,
        out,
        &device,
        model,
        &crate::train::Objective::Causal,
        spec,
    )?;
    let mut t = [0.0];
    if rank == 0 {
        t[0] = median_step_time(out)?;
    }
    from_rank0(mpi.map(|w| w.world()).as_ref(), &mut t)?;
    Ok(t[0])
}

/// The `--set` overrides of a `train_step_time` run: `args.sets` followed by the
/// data-parallel layout over `ranks` with ZeRO stage `zero`, `m` micro-batches of one
/// sequence per step, `--train-steps` steps (at least 3) on synthetic data, and no
/// validation, checkpoints or samples.
fn train_run_sets(args: &ProfileArgs, ranks: usize, m: usize, zero: u8) -> Vec<String> {
    let mut sets = args.sets.clone();
    for set in [
        format!("parallel.dp={ranks}"),
        format!("parallel.zero={zero}"),
        "parallel.tp=1".into(),
        "parallel.pp=1".into(),
        "train.micro_batch=1".into(),
        format!("train.global_batch={}", ranks * m),
        format!("train.steps={}", args.train_steps.max(3)),
        "data.kind=\"synthetic\"".into(),
        "data.val_every=0".into(),
        "checkpoint.every=0".into(),
        "checkpoint.at_end=false".into(),
        "train.sample_tokens=0".into(),
    ] {
        sets.push(set);
    }
    sets
}

/// The median `step_time_s` of the records of `out/metrics.jsonl` after the first two. Fails
/// when a record lacks the field or there is none.
fn median_step_time(out: &std::path::Path) -> Result<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut times = Vec::new();
    for line in text.lines().skip(2) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        times.push(
            v["step_time_s"]
                .as_f64()
                .context("step_time_s in metrics")?,
        );
    }
    if times.is_empty() {
        bail!("no step times in {}", out.display());
    }
    Ok(median(times))
}

/// `merak profile`: times the embedding, one layer and the head of the configured GPT at each
/// tensor-parallel degree and micro-batch size, with every rank working at once, plus the
/// optimizer step; rank 0 writes the calibration.
pub fn profile(args: &ProfileArgs, mpi: Option<&merak_burn::comm::MpiWorld>) -> Result<()> {
    let cfg = config::load(args.config.as_deref(), &args.sets)?;
    if mpi.is_none_or(|w| w.world().rank() == 0) {
        crate::output_file(&args.out, "--out")?;
    }
    if cfg.model.kind != "gpt" {
        bail!(
            "model.kind = {:?}: merak profile times GPT models",
            cfg.model.kind
        );
    }
    let g = &cfg.model.gpt;
    let world = mpi.map(|m| m.world());
    let ranks = world.as_ref().map_or(1, |w| w.size());
    let rank = world.as_ref().map_or(0, |w| w.rank());
    if args.micro_batches.is_empty() || args.micro_batches.contains(&0) {
        bail!(
            "--micro-batches {:?}: sizes must be at least 1",
            args.micro_batches
        );
    }
    if args.tp_overlap.contains(&0) {
        bail!(
            "--tp-overlap {:?}: degrees must be at least 1 (1: no overlap)",
            args.tp_overlap
        );
    }
    if args.reps == 0 || args.train_steps == 0 {
        bail!(
            "--reps {} --train-steps {}: both must be at least 1",
            args.reps,
            args.train_steps
        );
    }
    let tps = tp_degrees(args, ranks, g.heads)?;
    let profiling = Profiling {
        args,
        mpi,
        world,
        ranks,
        rank,
        gpt: g,
        seed: cfg.train.seed,
    };
    let units = time_all_degrees(&profiling, &tps)?;
    let runs = time_training_runs(args, mpi, ranks)?;
    let mut calibration = Calibration {
        format: CALIBRATION_FORMAT.to_string(),
        model: cfg.shape()?,
        backend: "flex-f32".to_string(),
        ranks,
        element_bytes: 4.0,
        optimizer_s_per_param: units.optimizer_s_per_param,
        micro_batch_s_per_param: 0.0,
        step_overhead_s: 0.0,
        zero1_s_per_param: 0.0,
        alone_time_fraction: units.alone_time_fraction,
        timings: units.timings,
    };
    let fit = fit_framework_costs(&mut calibration, &runs, tps[0], g.layers);
    if rank == 0 {
        print_framework_costs(&calibration, &runs, &fit);
    }
    if rank == 0 {
        calibration.write(&args.out)?;
        println!(
            "optimizer: {:.2} ns per parameter; a rank whose peers wait needs {:.2} of its time; calibration written to {}",
            units.optimizer_s_per_param * 1e9,
            units.alone_time_fraction,
            args.out.display()
        );
    }
    Ok(())
}

/// The tensor-parallel degrees to profile: `--tp`, or by default every degree that divides
/// both the `ranks` and the model's `heads`. Fails when a given degree divides either not.
fn tp_degrees(args: &ProfileArgs, ranks: usize, heads: usize) -> Result<Vec<usize>> {
    let tps: Vec<usize> = if args.tp.is_empty() {
        (1..=ranks)
            .filter(|t| ranks.is_multiple_of(*t) && heads.is_multiple_of(*t))
            .collect()
    } else {
        args.tp.clone()
    };
    for &tp in &tps {
        if tp == 0 || !ranks.is_multiple_of(tp) || !heads.is_multiple_of(tp) {
            bail!("--tp {tp} must divide the {ranks} ranks and model.heads = {heads}");
        }
    }
    Ok(tps)
}

/// One `merak profile` run: its arguments, the profiled model and this rank's MPI world.
struct Profiling<'a> {
    args: &'a ProfileArgs,
    mpi: Option<&'a merak_burn::comm::MpiWorld>,
    /// The world communicator that the timings align on and average over.
    world: Option<MpiCommunicator>,
    ranks: usize,
    rank: usize,
    gpt: &'a merak_gpt::GptConfig,
    /// The seed of the profiled model's parameters.
    seed: u64,
}

/// The measured costs of the model's units and of its optimizer step.
struct UnitCosts {
    /// Forward and backward times of each unit kind per tp degree and micro-batch size.
    timings: Vec<UnitTiming>,
    /// Seconds of one AdamW step per parameter (at the first tp degree).
    optimizer_s_per_param: f64,
    /// A rank's time fraction when its peers wait (measured at tp = 1; 0 without it).
    alone_time_fraction: f64,
}

/// Builds the model at each of the tp degrees `tps` and times its units at every micro-batch
/// size, its alone fraction at tp = 1 (largest micro-batch) and its optimizer step at the
/// first degree.
fn time_all_degrees(p: &Profiling, tps: &[usize]) -> Result<UnitCosts> {
    let reps = p.args.reps.max(1);
    let mut costs = UnitCosts {
        timings: Vec::new(),
        optimizer_s_per_param: 0.0,
        alone_time_fraction: 0.0,
    };
    for &tp in tps {
        let grid = profiling_grid(p, tp)?;
        let device = Default::default();
        let model = merak_gpt::Gpt::<B>::new_units(p.gpt, p.seed, grid.tp, &device, &|_| true)?;
        for &b in &p.args.micro_batches {
            time_micro_batch(p, &model, (tp, 1), b, &mut costs.timings)?;
        }
        time_overlapped(p, &grid, &mut costs.timings)?;
        if tp == 1 {
            let b = p.args.micro_batches.iter().copied().max().unwrap_or(1);
            costs.alone_time_fraction = alone_fraction(&model, p.world.as_ref(), p.gpt, b, reps)?;
        }
        if tp == tps[0] {
            costs.optimizer_s_per_param = time_optimizer(model, p.world.as_ref(), p.gpt, reps)?;
        }
    }
    Ok(costs)
}

/// Times the units of the model sub-pipelined at every overlap degree above 1 of the profile
/// (tensor-parallel degrees above 1 only, and micro-batches whose tokens the degree divides).
fn time_overlapped(p: &Profiling, grid: &ProcessGrid, timings: &mut Vec<UnitTiming>) -> Result<()> {
    let tp = grid.tp.size();
    if tp == 1 {
        return Ok(());
    }
    for &k in p.args.tp_overlap.iter().filter(|&&k| k > 1) {
        let overlap = TpOverlap::new(k)?;
        let device = Default::default();
        let model = merak_gpt::Gpt::<B>::new_units(p.gpt, p.seed, grid.tp, &device, &|_| true)?
            .with_tp_overlap(overlap);
        for &b in &p.args.micro_batches {
            if overlap.check_tokens(b * p.gpt.seq_len).is_ok() {
                time_micro_batch(p, &model, (tp, k), b, timings)?;
            }
        }
    }
    Ok(())
}

/// The process grid with `tp`-way tensor and `ranks / tp`-way data parallelism over the MPI
/// world (a single process without MPI).
fn profiling_grid(p: &Profiling, tp: usize) -> Result<ProcessGrid> {
    Ok(match &p.world {
        Some(_) => {
            let w = p.mpi.map(|m| m.world()).context("MPI world")?;
            ProcessGrid::from_mpi(
                w,
                Layout {
                    dp: p.ranks / tp,
                    tp,
                    pp: 1,
                },
            )?
        }
        None => ProcessGrid::single(),
    })
}

/// Times the embedding, a layer and the head of `model` (tensor-parallel and overlap degrees
/// `(tp, k)`) at micro-batch `b`, appends their timings to `timings` and prints them in
/// milliseconds (rank 0).
fn time_micro_batch(
    p: &Profiling,
    model: &merak_gpt::Gpt<B>,
    (tp, k): (usize, usize),
    b: usize,
    timings: &mut Vec<UnitTiming>,
) -> Result<()> {
    let kinds = [UnitKind::Embedding, UnitKind::Layer, UnitKind::Head];
    let measured = time_units(model, p.world.as_ref(), p.gpt, b, p.args.reps.max(1))?;
    for (unit, (forward_s, backward_s)) in kinds.into_iter().zip(measured) {
        timings.push(UnitTiming {
            unit,
            tp,
            micro_batch: b,
            forward_s,
            backward_s,
            tp_overlap: k,
        });
    }
    if p.rank == 0 {
        let overlap = if k > 1 {
            format!(" tp_overlap={k}")
        } else {
            String::new()
        };
        println!(
            "tp={tp}{overlap} micro_batch={b}: forward/backward ms: embedding {:.3}/{:.3}, layer {:.3}/{:.3}, head {:.3}/{:.3}",
            measured[0].0 * 1e3,
            measured[0].1 * 1e3,
            measured[1].0 * 1e3,
            measured[1].1 * 1e3,
            measured[2].0 * 1e3,
            measured[2].1 * 1e3
        );
    }
    Ok(())
}

/// Step times (seconds) of the short training runs that give the framework's own costs.
struct TrainRuns {
    /// With 1 micro-batch per step.
    one: f64,
    /// With `SLOPE_MICRO_BATCHES` micro-batches per step.
    many: f64,
    /// With 1 micro-batch per step and ZeRO-1 (`one` for a single rank).
    zero1: f64,
}

/// Times the training runs of `TrainRuns`, each three times with the fastest counting (as for
/// the units: other work on a shared machine only ever adds time).
fn time_training_runs(
    args: &ProfileArgs,
    mpi: Option<&merak_burn::comm::MpiWorld>,
    ranks: usize,
) -> Result<TrainRuns> {
    // The framework's own costs, from two short training runs with 1 and 8 micro-batches of
    // one sequence: step(m) = m * (units + per micro-batch) + optimizer + per step. The wide
    // spread keeps the per-micro-batch slope from amplifying the noise of the two times.
    // A fresh folder of this process's own, removed when dropped: nothing the user named is
    // ever written into or removed.
    let scratch = tempfile::Builder::new()
        .prefix("merak-profile-run-")
        .tempdir()
        .context("making a scratch folder for the profile's training runs")?;
    let fastest_run = |m: usize, zero: u8| -> Result<f64> {
        let mut best = f64::INFINITY;
        for i in 0..3 {
            // Each run in a folder of its own: a run never writes into another run's folder.
            let out = scratch.path().join(format!("m{m}-zero{zero}-{i}"));
            best = best.min(train_step_time(args, mpi, m, zero, &out)?);
        }
        Ok(best)
    };
    let one = fastest_run(1, 0)?;
    let many = fastest_run(SLOPE_MICRO_BATCHES, 0)?;
    // ZeRO-1 (with more than one rank): the optimizer works on 1/ranks of the parameters,
    // then the owners send the new values to everyone.
    let zero1 = if ranks > 1 { fastest_run(1, 1)? } else { one };
    Ok(TrainRuns { one, many, zero1 })
}

/// The framework's cost per micro-batch fitted from the training runs, and the parameters
/// per rank it was fitted for.
struct FrameworkFit {
    /// Seconds per micro-batch beyond the units' own forward and backward passes.
    per_micro_batch: f64,
    /// Parameters of the model per rank at the first tp degree.
    params: f64,
}

/// Sets the calibration's per-micro-batch, per-step and ZeRO-1 costs from the training runs,
/// given its unit timings at tp degree `tp0` and micro-batch 1, its optimizer cost and the
/// model's `layers`.
fn fit_framework_costs(
    calibration: &mut Calibration,
    runs: &TrainRuns,
    tp0: usize,
    layers: usize,
) -> FrameworkFit {
    let TrainRuns { one, many, zero1 } = *runs;
    let (ranks, optimizer_s_per_param) = (calibration.ranks, calibration.optimizer_s_per_param);
    let unit = |kind| {
        calibration
            .unit_time(kind, tp0, 1)
            .map_or(0.0, |(f, b)| f + b)
    };
    let units_b1 =
        unit(UnitKind::Embedding) + layers as f64 * unit(UnitKind::Layer) + unit(UnitKind::Head);
    let params =
        merak_burn::planner::ModelProxy::from_shape(calibration.model).params() as f64 / tp0 as f64;
    let per_micro_batch = ((many - one) / (SLOPE_MICRO_BATCHES - 1) as f64 - units_b1).max(0.0);
    calibration.micro_batch_s_per_param = per_micro_batch / params;
    calibration.step_overhead_s =
        (one - units_b1 - per_micro_batch - optimizer_s_per_param * params).max(0.0);
    if ranks > 1 {
        let saved = optimizer_s_per_param * params * (1.0 - 1.0 / ranks as f64);
        calibration.zero1_s_per_param = ((zero1 - one + saved) / params).max(0.0);
    }
    FrameworkFit {
        per_micro_batch,
        params,
    }
}

/// Prints the training runs' step times and the framework costs fitted from them, in
/// milliseconds.
fn print_framework_costs(calibration: &Calibration, runs: &TrainRuns, fit: &FrameworkFit) {
    println!(
        "training runs (dp={}, micro-batch 1): {:.1} ms with 1 micro-batch, {:.1} ms with {SLOPE_MICRO_BATCHES}, {:.1} ms with ZeRO-1; framework costs {:.2} ms per micro-batch, {:.2} ms per step, ZeRO-1 exchange {:.2} ms",
        calibration.ranks,
        runs.one * 1e3,
        runs.many * 1e3,
        runs.zero1 * 1e3,
        fit.per_micro_batch * 1e3,
        calibration.step_overhead_s * 1e3,
        calibration.zero1_s_per_param * fit.params * 1e3
    );
}
