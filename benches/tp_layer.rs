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
use merak_burn::batch::DropoutPosition;
use merak_burn::comm::{
    CommError, Communicator, Group, MpiCommunicator, MpiWorld, Pending, ProgressThreadComm,
    ReduceOp,
};
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, InitRng, LayerNorm, MlpWeights, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout, TpOverlap,
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
    /// Overlap degrees (`parallel.tp_overlap`) of the tensor-parallel layer to time; 1 is the
    /// layer without sub-pipelining.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    overlap: Vec<usize>,
    /// Also time every overlap degree above 1 with the all-reduces progressed by a
    /// communication thread (`ProgressThreadComm`, MPI initialised with
    /// `MPI_THREAD_MULTIPLE`) instead of `test()` between chunk products.
    #[arg(long)]
    thread_progress: bool,
}

/// A communicator that forwards to MPI and adds up the time spent in its calls.
struct TimedComm {
    inner: Box<dyn Communicator>,
    secs: Rc<Cell<f64>>,
    calls: Cell<u64>,
    values: Cell<u64>,
}

impl TimedComm {
    fn new(inner: Box<dyn Communicator>) -> Self {
        Self {
            inner,
            secs: Rc::new(Cell::new(0.0)),
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
        let inner = self.timed(n, || self.inner.all_reduce_start(buf, op))?;
        Ok(Box::new(TimedPending {
            inner,
            secs: self.secs.clone(),
        }))
    }
}

/// An all-reduce in flight whose `test` and `wait` calls count as communication time.
struct TimedPending {
    inner: Box<dyn Pending>,
    secs: Rc<Cell<f64>>,
}

impl Pending for TimedPending {
    fn test(&mut self) -> Result<bool, CommError> {
        let t = Instant::now();
        let done = self.inner.test();
        self.secs.set(self.secs.get() + t.elapsed().as_secs_f64());
        done
    }
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CommError> {
        let this = *self;
        let secs = this.secs.clone();
        let t = Instant::now();
        let out = this.inner.wait();
        secs.set(secs.get() + t.elapsed().as_secs_f64());
        out
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
        mlp: Some(ParallelMlp::from_full(mlp, h, 4 * h, group, device)?),
        moe: None,
        dropout: ReplicatedDropout::new(0.0, args.seed),
    })
}

/// One training step of the layer: forward, scalar loss, backward.
fn step(block: &Block<B>, x: &Tensor<B, 3>) -> (Tensor<B, 3>, <B as AutodiffBackend>::Gradients) {
    let y = block.forward(x.clone(), &DropoutPosition::default());
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

/// One layer under test: the serial layer (`overlap == 0`) or the tensor-parallel layer with an
/// overlap degree.
struct Variant {
    name: String,
    overlap: usize,
    block: Block<B>,
    /// The timed communicator of its group (none for the serial layer).
    comm: Option<Rc<TimedComm>>,
}

/// A tensor-parallel group and the timed communicator behind it.
type TimedGroup = (Group, Rc<TimedComm>);

/// The full-size weights of the layer, as GPT-2 initializes a 1-layer model, except for nonzero
/// biases so that the check covers them (identical on every rank).
fn weights(args: &Args) -> (AttentionWeights, MlpWeights) {
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
    (attn, mlp)
}

/// The serial layer and the tensor-parallel layer at every requested overlap degree (over
/// `tp_group`), and at every degree above 1 over `thread_group` (progressed by a thread) when
/// given.
fn variants(
    args: &Args,
    tp_group: &TimedGroup,
    thread_group: Option<&TimedGroup>,
    device: &CpuDevice,
) -> Result<Vec<Variant>> {
    let (attn, mlp) = weights(args);
    let tokens = args.batch * args.seq;
    let mut out = vec![Variant {
        name: "serial (tp=1, Group::local)".into(),
        overlap: 0,
        block: build_block(args, &attn, &mlp, Group::local(), device)?,
        comm: None,
    }];
    for &k in &args.overlap {
        let overlap = TpOverlap::new(k)?;
        overlap.check_tokens(tokens)?;
        let groups = [(tp_group, "")]
            .into_iter()
            .chain(thread_group.filter(|_| k > 1).map(|g| (g, ", thread")));
        for ((group, comm), how) in groups {
            let mut block = build_block(args, &attn, &mlp, *group, device)?;
            block.attn.set_overlap(overlap);
            if let Some(mlp) = &mut block.mlp {
                mlp.set_overlap(overlap);
            }
            out.push(Variant {
                name: format!("tp={} overlap k={k}{how}", group.size()),
                overlap: k,
                block,
                comm: Some(comm.clone()),
            });
        }
    }
    Ok(out)
}

/// Medians over the trials of one variant.
struct Timing {
    step: f64,
    comm: f64,
    /// Paired ratio to the serial layer.
    ratio: f64,
    /// Paired step-time saving against overlap 1 (`None` without overlap 1).
    saved: Option<f64>,
}

/// Runs the trials, alternating the variants' order, and returns each variant's medians.
fn measure(
    args: &Args,
    control: &MpiCommunicator,
    vs: &[Variant],
    x: &Tensor<B, 3>,
) -> Result<Vec<Timing>> {
    let n = vs.len();
    let (mut step_s, mut comm_s) = (vec![vec![]; n], vec![vec![]; n]);
    for t in 0..args.trials {
        // Rotate the order, so that slow drifts of the machine hit every variant.
        for j in 0..n {
            let i = (j + t) % n;
            let took = || vs[i].comm.as_ref().map_or(0.0, |c| c.take().0);
            took();
            step_s[i].push(trial(control, &vs[i].block, x, args.iters)?);
            let mut c = [(took() / args.iters as f64) as f32];
            control.all_reduce(&mut c, ReduceOp::Mean)?;
            comm_s[i].push(f64::from(c[0]));
        }
    }
    let k1 = vs.iter().position(|v| v.overlap == 1);
    let paired = |i: usize, f: &dyn Fn(f64, f64) -> f64, base: usize| {
        let mut v: Vec<f64> = (0..args.trials)
            .map(|t| f(step_s[i][t], step_s[base][t]))
            .collect();
        median(&mut v)
    };
    Ok((0..n)
        .map(|i| Timing {
            step: median(&mut step_s[i].clone()),
            comm: median(&mut comm_s[i].clone()),
            ratio: paired(i, &|a, b| a / b, 0),
            saved: k1.map(|b| paired(i, &|a, b| b - a, b)),
        })
        .collect())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.trials == 0 || args.iters == 0 {
        bail!("--trials and --iters must be positive");
    }
    let mpi = if args.thread_progress {
        MpiWorld::init_thread_multiple()?
    } else {
        MpiWorld::init()?
    };
    let control = mpi.world();
    let (rank, n) = (control.rank(), control.size());
    let timed_group = |inner: Box<dyn Communicator>| {
        let timed = Rc::new(TimedComm::new(inner));
        (Group::register(timed.clone()), timed)
    };
    let tp_group = timed_group(Box::new(mpi.world()));
    let thread_group = if args.thread_progress {
        Some(timed_group(Box::new(ProgressThreadComm::new(mpi.world())?)))
    } else {
        None
    };
    let device = CpuDevice::default();
    let vs = variants(&args, &tp_group, thread_group.as_ref(), &device)?;
    let shape = [args.batch, args.seq, args.hidden];
    let rng = InitRng::new(args.seed);
    let x = Tensor::<B, 3>::from_data(
        TensorData::new(rng.normal("input", shape.iter().product(), 1.0), shape),
        &device,
    )
    .require_grad();

    // Every variant computes the same function: compare outputs and input gradients.
    let grad =
        |g: &<B as AutodiffBackend>::Gradients| x.grad(g).expect("the input requires a gradient");
    let (ys, gs) = step(&vs[0].block, &x);
    let mut diffs = Vec::new();
    let mut comm_per_step = Vec::new();
    for v in &vs[1..] {
        let took = || v.comm.as_ref().map_or((0.0, 0, 0), |c| c.take());
        took();
        let (y, g) = step(&v.block, &x);
        comm_per_step.push(took());
        diffs.push((
            max_abs_diff(ys.clone().inner(), y.inner()),
            max_abs_diff(grad(&gs), grad(&g)),
        ));
    }
    for _ in 0..args.warmup {
        for v in &vs {
            drop(step(&v.block, &x));
        }
    }
    let timings = measure(&args, &control, &vs, &x)?;
    if rank == 0 {
        report(&args, n, &vs, &timings, &diffs, &comm_per_step);
    }
    Ok(())
}

/// Prints the table (rank 0).
fn report(
    args: &Args,
    n: usize,
    vs: &[Variant],
    ts: &[Timing],
    diffs: &[(f32, f32)],
    comm_per_step: &[(f64, u64, u64)],
) {
    println!(
        "# one GPT layer fwd+bwd on Autodiff<Flex>: hidden {}, heads {}, seq {}, batch {}, \
         mlp {}; {} trials x {} steps, medians, slowest rank",
        args.hidden,
        args.heads,
        args.seq,
        args.batch,
        4 * args.hidden,
        args.trials,
        args.iters
    );
    for ((v, (dy, dx)), c) in vs[1..].iter().zip(diffs).zip(comm_per_step) {
        println!(
            "# {}: max |y - y_serial| = {dy:.2e}, max |dx - dx_serial| = {dx:.2e}; \
             {} communicator calls per step, {:.0} KiB all-reduced",
            v.name,
            c.1,
            c.2 as f64 * 4.0 / 1024.0
        );
    }
    let comm1 = vs
        .iter()
        .zip(ts)
        .find(|(v, _)| v.overlap == 1)
        .map(|(_, t)| t.comm);
    println!();
    println!(
        "{:<30} {:>9} {:>9} {:>10} {:>12} {:>13}",
        "variant", "ms/step", "comm ms", "vs serial", "saved vs k=1", "hidden of k=1"
    );
    for (v, t) in vs.iter().zip(ts) {
        let (saved, hidden) = match (t.saved, comm1) {
            (Some(s), Some(c)) if v.overlap > 1 => (
                format!("{:.3} ms", s * 1e3),
                format!("{:.0}%", 100.0 * s / c.max(1e-12)),
            ),
            _ => ("-".into(), "-".into()),
        };
        let comm = if v.overlap == 0 {
            "-".into()
        } else {
            format!("{:.3}", t.comm * 1e3)
        };
        println!(
            "{:<30} {:>9.3} {:>9} {:>10.3} {:>12} {:>13}",
            v.name,
            t.step * 1e3,
            comm,
            t.ratio,
            saved,
            hidden
        );
    }
    println!();
    println!(
        "vs serial: median of paired trials (ideal {:.3}); comm ms: time inside communicator \
         calls (start, test, wait), mean over ranks, includes waiting for the peer; saved vs \
         k=1: paired median of step(k=1) - step(k); hidden of k=1: that saving over the k=1 \
         communication time",
        1.0 / n as f64
    );
}
