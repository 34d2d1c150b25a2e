//! `bench-allreduce`: bandwidth of the MPI all-reduce behind merak-burn's `MpiCommunicator`.
//!
//! For every message size from 4 B to 64 MiB (a factor of 4 apart) it times
//!
//! - the blocking path, `Communicator::all_reduce(&mut [f32], ReduceOp::Sum)`, and
//! - the non-blocking path, `Communicator::all_reduce_start` followed by `Pending::test()`
//!   polling until it reports completion and `Pending::wait()`,
//!
//! on `f32` buffers. The number of operations per trial is calibrated (the same on every rank)
//! so that one trial lasts about `--trial-secs` (0.2 s); both paths run in alternating trials
//! and the medians over `--trials` (5) trials are reported. A trial's time is the slowest rank's.
//!
//! Rank 0 prints the time per operation, the algorithm bandwidth `algbw = bytes / time` and the
//! bus bandwidth `busbw = algbw * 2 (n - 1) / n` (the nccl-tests convention, `n` ranks), in
//! GB/s (1e9 bytes per second), then the non-blocking/blocking time ratio per size, and the
//! peak bus bandwidth.
//!
//! Run, from the workspace root:
//!
//! ```text
//! cargo build --release -p merak-benches
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
//!     mpirun -np 2 --oversubscribe --bind-to none target/release/bench-allreduce
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::time::Instant;

use anyhow::{Result, bail, ensure};
use clap::Parser;
use merak_burn::comm::{Communicator, MpiCommunicator, MpiWorld, ReduceOp};

/// Command-line options.
#[derive(Parser, Debug)]
#[command(about = "Blocking and non-blocking MPI all-reduce bandwidth through MpiCommunicator")]
struct Args {
    /// Smallest message, in bytes (a multiple of 4).
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    /// Largest message, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: usize,
    /// Factor between consecutive message sizes.
    #[arg(long, default_value_t = 4)]
    step: usize,
    /// Timed trials per size and path; the median is reported.
    #[arg(long, default_value_t = 5)]
    trials: usize,
    /// Target duration of one trial, in seconds.
    #[arg(long, default_value_t = 0.2)]
    trial_secs: f64,
}

/// The largest value of `v` over all ranks (identical on every rank afterwards).
fn max_over_ranks(comm: &MpiCommunicator, v: f64) -> Result<f64> {
    let mut b = [v as f32];
    comm.all_reduce(&mut b, ReduceOp::Max)?;
    Ok(f64::from(b[0]))
}

/// Seconds for `iters` blocking all-reduces of `buf` (slowest rank).
fn time_blocking(comm: &MpiCommunicator, buf: &mut [f32], iters: usize) -> Result<f64> {
    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce(buf, ReduceOp::Sum)?;
    }
    max_over_ranks(comm, t.elapsed().as_secs_f64())
}

/// Seconds for `iters` non-blocking all-reduces (start, poll `test()` until done, `wait()`),
/// the buffer handed back, and the mean number of `test()` calls per operation.
fn time_nonblocking(
    comm: &MpiCommunicator,
    mut buf: Vec<f32>,
    iters: usize,
) -> Result<(f64, Vec<f32>, f64)> {
    comm.barrier()?;
    let mut polls = 0u64;
    let t = Instant::now();
    for _ in 0..iters {
        let mut pending = comm.all_reduce_start(buf, ReduceOp::Sum)?;
        loop {
            polls += 1;
            if pending.test()? {
                break;
            }
            std::hint::spin_loop();
        }
        buf = pending.wait()?;
    }
    let secs = max_over_ranks(comm, t.elapsed().as_secs_f64())?;
    Ok((secs, buf, polls as f64 / iters as f64))
}

/// Operations per trial so that a trial lasts about `target` seconds. Doubles a probe count
/// until the probe takes 50 ms, then probes that count twice more and uses the median (so that
/// one descheduled probe on a busy machine does not shrink the count); every decision uses the
/// all-reduced time, so all ranks agree. Doubles as the warm-up of the blocking path.
fn calibrate(comm: &MpiCommunicator, buf: &mut [f32], target: f64) -> Result<usize> {
    let mut iters = 1usize;
    loop {
        let t = time_blocking(comm, buf, iters)?;
        if t >= 0.05 || iters >= 1 << 20 {
            let mut probes = vec![t, time_blocking(comm, buf, iters)?];
            probes.push(time_blocking(comm, buf, iters)?);
            let per_op = (median(&mut probes) / iters as f64).max(1e-9);
            return Ok(((target / per_op).ceil() as usize).clamp(1, 1 << 22));
        }
        iters *= 2;
    }
}

/// Checks both paths once: every rank contributes `rank + 1`.
fn check_result(comm: &MpiCommunicator, count: usize) -> Result<()> {
    let n = comm.size() as f32;
    let expected = n * (n + 1.0) / 2.0;
    let mut buf = vec![comm.rank() as f32 + 1.0; count];
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    ensure!(
        buf.iter().all(|&x| x == expected),
        "blocking all-reduce of {count} values gave a wrong sum"
    );
    let pending = comm.all_reduce_start(vec![comm.rank() as f32 + 1.0; count], ReduceOp::Sum)?;
    let buf = pending.wait()?;
    ensure!(
        buf.len() == count && buf.iter().all(|&x| x == expected),
        "non-blocking all-reduce of {count} values gave a wrong sum"
    );
    Ok(())
}

/// Human-readable message size.
fn fmt_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// One message size's results.
struct Row {
    bytes: usize,
    iters: usize,
    blocking: f64,
    nonblocking: f64,
    ratio: f64,
    polls: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.min_bytes < 4 || args.min_bytes % 4 != 0 || args.max_bytes < args.min_bytes {
        bail!("--min-bytes must be a positive multiple of 4 and at most --max-bytes");
    }
    if args.step < 2 || args.trials == 0 || args.trial_secs <= 0.0 {
        bail!("--step must be at least 2, --trials and --trial-secs positive");
    }
    let mpi = MpiWorld::init()?;
    let comm = mpi.world();
    let (rank, n) = (comm.rank(), comm.size());
    let bus_factor = 2.0 * (n as f64 - 1.0) / n as f64;
    if rank == 0 {
        println!(
            "# all-reduce (sum, f32) through MpiCommunicator: {n} ranks, {} trials of ~{} s per \
             size and path, medians; times of the slowest rank",
            args.trials, args.trial_secs
        );
        if n < 2 {
            println!("# warning: one rank, nothing is communicated (run under mpirun -np 2)");
        }
    }

    let mut rows = Vec::new();
    let mut bytes = args.min_bytes;
    while bytes <= args.max_bytes {
        let count = bytes / 4;
        check_result(&comm, count)?;
        // Zeros stay zeros under summation: no overflow to infinity over many operations.
        let mut buf = vec![0.0f32; count];
        let iters = calibrate(&comm, &mut buf, args.trial_secs)?;
        // Warm the non-blocking path up too.
        let (_, mut nb_buf, _) = time_nonblocking(&comm, vec![0.0f32; count], iters.min(16))?;

        let (mut blk, mut nb, mut ratio, mut polls) = (vec![], vec![], vec![], vec![]);
        for trial in 0..args.trials {
            // Alternate which path goes first, so that slow drifts of the machine hit both.
            let (b, (t_nb, back, p)) = if trial % 2 == 0 {
                let b = time_blocking(&comm, &mut buf, iters)?;
                (b, time_nonblocking(&comm, nb_buf, iters)?)
            } else {
                let r = time_nonblocking(&comm, nb_buf, iters)?;
                (time_blocking(&comm, &mut buf, iters)?, r)
            };
            nb_buf = back;
            blk.push(b / iters as f64);
            nb.push(t_nb / iters as f64);
            ratio.push(t_nb / b);
            polls.push(p);
        }
        rows.push(Row {
            bytes,
            iters,
            blocking: median(&mut blk),
            nonblocking: median(&mut nb),
            ratio: median(&mut ratio),
            polls: median(&mut polls),
        });
        match bytes.checked_mul(args.step) {
            Some(b) => bytes = b,
            None => break,
        }
    }

    if rank == 0 {
        println!();
        println!(
            "{:>10} {:>9} {:>10} {:>9} {:>12} {:>12} {:>12}",
            "size", "bytes", "elements", "iters", "time (us)", "algbw GB/s", "busbw GB/s"
        );
        for r in &rows {
            let algbw = r.bytes as f64 / r.blocking / 1e9;
            println!(
                "{:>10} {:>9} {:>10} {:>9} {:>12.2} {:>12.3} {:>12.3}",
                fmt_bytes(r.bytes),
                r.bytes,
                r.bytes / 4,
                r.iters,
                r.blocking * 1e6,
                algbw,
                algbw * bus_factor
            );
        }
        println!();
        println!("# non-blocking path: all_reduce_start + test() polling + wait(), vs blocking");
        println!(
            "{:>10} {:>14} {:>14} {:>12} {:>12}",
            "size", "blocking (us)", "nonblock (us)", "nb/blk", "tests/op"
        );
        for r in &rows {
            println!(
                "{:>10} {:>14.2} {:>14.2} {:>12.3} {:>12.1}",
                fmt_bytes(r.bytes),
                r.blocking * 1e6,
                r.nonblocking * 1e6,
                r.ratio,
                r.polls
            );
        }
        println!("# nb/blk: median over trials of the paired time ratio");
        if let Some(peak) = rows
            .iter()
            .max_by(|a, b| (a.bytes as f64 / a.blocking).total_cmp(&(b.bytes as f64 / b.blocking)))
        {
            let algbw = peak.bytes as f64 / peak.blocking / 1e9;
            println!();
            println!(
                "peak bus bandwidth: {:.3} GB/s (algbw {:.3} GB/s) at {} ({} ranks, blocking \
                 all-reduce)",
                algbw * bus_factor,
                algbw,
                fmt_bytes(peak.bytes),
                n
            );
        }
    }
    Ok(())
}
