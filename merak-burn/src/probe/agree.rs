//! Measured times as the probes use them: the fastest or the median of repetitions, their
//! mean over ranks, and rank 0's values on every rank.

use crate::comm::{CommError, Communicator, ReduceOp};

type Result<T> = std::result::Result<T, CommError>;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rank 0's values on every rank.
pub fn from_rank0<C: Communicator + ?Sized>(world: Option<&C>, values: &mut [f64]) -> Result<()> {
    let Some(w) = world else { return Ok(()) };
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    w.broadcast(&mut buf, 0)?;
    for (v, b) in values.iter_mut().zip(buf) {
        *v = b as f64;
    }
    Ok(())
}

/// The fastest of `v`: other work on a shared machine only ever adds time, so the fastest
/// repetition is the best estimate of the work itself (the benchmarks count a layout's fastest
/// round the same way).
pub fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// The mean of `values` over all ranks (every rank gets the same numbers; summed as `f32`).
pub fn mean_over_ranks<C: Communicator + ?Sized>(
    world: Option<&C>,
    values: &mut [f64],
) -> Result<()> {
    let Some(w) = world else { return Ok(()) };
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    w.all_reduce(&mut buf, ReduceOp::Sum)?;
    for (v, b) in values.iter_mut().zip(buf) {
        *v = b as f64 / w.size() as f64;
    }
    Ok(())
}

/// Aligns all ranks (nothing without MPI).
pub fn barrier<C: Communicator + ?Sized>(world: Option<&C>) -> Result<()> {
    if let Some(w) = world {
        w.barrier()?;
    }
    Ok(())
}

/// The machine's main memory in bytes (`MemTotal` of /proc/meminfo; 8 GiB when unknown).
pub fn total_memory_bytes() -> u64 {
    crate::admission::meminfo_bytes("MemTotal").unwrap_or(8 << 30)
}
