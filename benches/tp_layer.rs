//! `bench-tp-layer`: forward + backward time of one GPT transformer layer
//! ([`merak_gpt::Block`]: LayerNorm, causal self-attention, LayerNorm, MLP with `4 * hidden`
//! features) on the CPU backend `Autodiff<Flex>`, split over a tensor-parallel group
//! of all ranks versus built whole on every rank.
//!
//! Both layers are cut from the same full-size weights (drawn with `InitRng`) and get the same
//! input `[batch, seq, hidden]` (replicated, with `require_grad`, as a layer inside a model).
//! One step is `block.forward(x).sum().backward()`. Trials of the serial layer (group
//! `Group::local()`, no communication) and of the tensor-parallel layer (the world
//! communicator registered as a `Group`, tp = number of ranks) alternate in the same run, and
//! the medians over trials are reported, with the median of the paired tp/serial time ratios.
//! A trial's time is the slowest rank's. With 2 ranks on 2 cores the serial layer of one rank
//! runs beside the serial layer of the other, so each gets one core in both cases.
//!
//! The tensor-parallel group's communicator is wrapped to time its collective calls: that time
//! (mean over ranks) includes waiting for the other rank, but not the tensor/host copies around
//! each call.
//!
//! Run, from the workspace root:
//!
//! ```text
//! cargo build --release -p merak-benches
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
//!     mpirun -np 2 --oversubscribe --bind-to none target/release/bench-tp-layer
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

use anyhow::{Result, bail};
use burn::tensor::{ElementConversion, Tensor, TensorData, backend::AutodiffBackend};
use clap::Parser;
use merak_burn::backend::{Cpu, CpuAutodiff, CpuDevice};
use merak_burn::comm::{
    CommError, Communicator, Group, MpiCommunicator, MpiWorld, Pending, ReduceOp,
};
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, InitRng, LayerNorm, MlpWeights, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout,
};
use merak_gpt::Block;

type B = CpuAutodiff;

/// Command-line options.
#[derive(Parser, Debug)]
#[command(about = "Forward+backward time of one GPT layer: tensor-parallel vs serial")]
struct Args {
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Timed trials of each variant; medians are reported.
    #[arg(long, default_value_t = 11)]
    trials: usize,
    /// Forward+backward steps per trial.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed steps of each variant before the trials.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Seed of the weights and the input.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

/// A communicator that forwards to MPI and adds up the time spent in its calls.
struct TimedComm {
    inner: MpiCommunicator,
    secs: Cell<f64>,
    calls: Cell<u64>,
    values: Cell<u64>,
}

impl TimedComm {
    fn new(inner: MpiCommunicator) -> Self {
        Self {
            inner,
            secs: Cell::new(0.0),
            calls: Cell::new(0),
            values: Cell::new(0),
        }
    }

    fn timed<T>(&self, values: usize, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.secs.set(self.secs.get() + t.elapsed().as_secs_f64());
        self.calls.set(self.calls.get() + 1);
        self.values.set(self.values.get() + values as u64);
        out
    }

    /// Returns (seconds, calls, values) since the last reset, and resets.
    fn take(&self) -> (f64, u64, u64) {
        (self.secs.take(), self.calls.take(), self.values.take())
    }
}

impl Communicator for TimedComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.timed(buf.len(), || self.inner.all_reduce(buf, op))
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.timed(recv.len(), || self.inner.all_gather(send, recv))
    }
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.timed(send.len(), || self.inner.reduce_scatter(send, recv, op))
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.timed(buf.len(), || self.inner.broadcast(buf, root))
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.timed(buf.len() / 4, || self.inner.broadcast_bytes(buf, root))
    }
    fn send(&self, buf: &[f32], dest: usize, tag: u16) -> Result<(), CommError> {
        self.timed(buf.len(), || self.inner.send(buf, dest, tag))
    }
    fn recv(&self, buf: &mut [f32], src: usize, tag: u16) -> Result<(), CommError> {
        self.timed(buf.len(), || self.inner.recv(buf, src, tag))
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.timed(0, || self.inner.barrier())
    }
    fn all_reduce_start(&self, buf: Vec<f32>, op: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        let n = buf.len();
        self.timed(n, || self.inner.all_reduce_start(buf, op))
    }
}

/// Builds the layer for `group` from the full-size weights, as `merak_gpt::Gpt::new` does
/// (default LayerNorm, no dropout).
fn build_block(
    args: &Args,
    attn: &AttentionWeights,
    mlp: &MlpWeights,
    group: Group,
    device: &CpuDevice,
) -> Result<Block<B>> {
    let h = args.hidden;
    Ok(Block {
        ln_1: LayerNorm::new(h, 1e-5, device),
        attn: ParallelSelfAttention::from_full(
            attn,
            h,
            args.heads,
            AttentionMask::Causal,
            group,
            device,
        )?,
        ln_2: LayerNorm::new(h, 1e-5, device),
        mlp: ParallelMlp::from_full(mlp, h, 4 * h, group, device)?,
        dropout: ReplicatedDropout::new(0.0, args.seed),
    })
}

/// One training step of the layer: forward, scalar loss, backward.
fn step(block: &Block<B>, x: &Tensor<B, 3>) -> (Tensor<B, 3>, <B as AutodiffBackend>::Gradients) {
    let y = block.forward(x.clone());
    let grads = y.clone().sum().backward();
    (y, grads)
}

/// Seconds per step of `iters` steps (slowest rank). `control` is used only outside the timed
/// region, for the barrier and the reduction of the time.
fn trial(
    control: &MpiCommunicator,
    block: &Block<B>,
    x: &Tensor<B, 3>,
    iters: usize,
) -> Result<f64> {
    control.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        drop(step(block, x));
    }
    let mut secs = [(t.elapsed().as_secs_f64() / iters as f64) as f32];
    control.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok(f64::from(secs[0]))
}

fn max_abs_diff(a: Tensor<Cpu, 3>, b: Tensor<Cpu, 3>) -> f32 {
    (a - b).abs().max().into_scalar().elem::<f32>()
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.trials == 0 || args.iters == 0 {
        bail!("--trials and --iters must be positive");
    }
    let mpi = MpiWorld::init()?;
    let control = mpi.world();
    let (rank, n) = (control.rank(), control.size());
    let timed = Rc::new(TimedComm::new(mpi.world()));
    let tp_group = Group::register(timed.clone());
    let local_group = Group::local();
    let device = CpuDevice::default();

    // Full-size weights as GPT-2 initializes a 1-layer model, except for nonzero biases so that
    // the check below covers them (identical on every rank).
    let (h, rng) = (args.hidden, InitRng::new(args.seed));
    let (std, proj_std) = (0.02f32, 0.02f32 / 2f32.sqrt());
    let attn = AttentionWeights {
        qkv_weight: rng.normal("attn.c_attn.weight", h * 3 * h, std),
        qkv_bias: rng.normal("attn.c_attn.bias", 3 * h, std),
        proj_weight: rng.normal("attn.c_proj.weight", h * h, proj_std),
        proj_bias: rng.normal("attn.c_proj.bias", h, std),
    };
    let mlp = MlpWeights {
        fc_weight: rng.normal("mlp.c_fc.weight", h * 4 * h, std),
        fc_bias: rng.normal("mlp.c_fc.bias", 4 * h, std),
        proj_weight: rng.normal("mlp.c_proj.weight", 4 * h * h, proj_std),
        proj_bias: rng.normal("mlp.c_proj.bias", h, std),
    };
    let serial = build_block(&args, &attn, &mlp, local_group, &device)?;
    let parallel = build_block(&args, &attn, &mlp, tp_group, &device)?;
    let shape = [args.batch, args.seq, h];
    let x = Tensor::<B, 3>::from_data(
        TensorData::new(rng.normal("input", shape.iter().product(), 1.0), shape),
        &device,
    )
    .require_grad();

    // The two layers compute the same function: compare outputs and input gradients.
    let (ys, gs) = step(&serial, &x);
    let (yp, gp) = step(&parallel, &x);
    let grad = |g| x.grad(g).expect("the input requires a gradient");
    let out_diff = max_abs_diff(ys.inner(), yp.inner());
    let grad_diff = max_abs_diff(grad(&gs), grad(&gp));
    let comm_per_step = timed.take();

    for _ in 0..args.warmup {
        drop(step(&serial, &x));
        drop(step(&parallel, &x));
    }
    timed.take();

    let (mut ser, mut par, mut ratio, mut comm) = (vec![], vec![], vec![], vec![]);
    for t in 0..args.trials {
        // Alternate which variant goes first, so that slow drifts of the machine hit both.
        let (s, p) = if t % 2 == 0 {
            let s = trial(&control, &serial, &x, args.iters)?;
            (s, trial(&control, &parallel, &x, args.iters)?)
        } else {
            let p = trial(&control, &parallel, &x, args.iters)?;
            (trial(&control, &serial, &x, args.iters)?, p)
        };
        let mut c = [(timed.take().0 / args.iters as f64) as f32];
        control.all_reduce(&mut c, ReduceOp::Mean)?;
        ser.push(s);
        par.push(p);
        ratio.push(p / s);
        comm.push(f64::from(c[0]));
    }

    if rank == 0 {
        let (s, p, r, c) = (
            median(&mut ser),
            median(&mut par),
            median(&mut ratio),
            median(&mut comm),
        );
        println!(
            "# one GPT layer fwd+bwd on Autodiff<Flex>: hidden {h}, heads {}, seq {}, \
             batch {}, mlp {}; {} trials x {} steps, medians, slowest rank",
            args.heads,
            args.seq,
            args.batch,
            4 * h,
            args.trials,
            args.iters
        );
        println!(
            "# check: max |y_tp - y_serial| = {out_diff:.2e}, max |dx_tp - dx_serial| = \
             {grad_diff:.2e}"
        );
        println!(
            "# tp={n} communication per step: {} calls, {} values ({:.0} KiB)",
            comm_per_step.1,
            comm_per_step.2,
            comm_per_step.2 as f64 * 4.0 / 1024.0
        );
        println!();
        println!("{:<34} {:>10}", "variant", "ms/step");
        println!("{:<34} {:>10.3}", "serial (tp=1, Group::local)", s * 1e3);
        println!("{:<34} {:>10.3}", format!("tp={n} (world group)"), p * 1e3);
        println!(
            "{:<34} {:>10.3}",
            "  of which in communicator calls",
            c * 1e3
        );
        println!();
        println!(
            "ratio tp{n}/serial: {r:.3} (median of paired trials; ratio of medians {:.3}); \
             ideal {:.3}",
            p / s,
            1.0 / n as f64
        );
        println!(
            "communication share of the tp={n} step: {:.1}% (mean over ranks, includes waiting \
             for the peer)",
            100.0 * c / p
        );
    }
    Ok(())
}
