//! The measurement of sub-pipelined tensor parallelism on this machine: how much
//! of a tensor-parallel all-reduce the runtime's chunked products hide, and what the overlap
//! costs them ([`HardwareSpec::tp_overlap_slowdown`](crate::planner::HardwareSpec)).
//!
//! Every rank runs the row-parallel product of the runtime
//! ([`crate::tensor_parallel::overlap::row_forward`]) on a `[512, 256] x [256, 256]`
//! product summed over all ranks: with one chunk (product, then all-reduce), with `k` chunks
//! (chunk `i`'s all-reduce in flight while chunk `i + 1` multiplies), and, apart, the product
//! alone and the all-reduce of one chunk alone. The cost model exposes, per block,
//! `a + (k - 1) (max(0, a - c) + s min(a, c))` for an all-reduce of `a` seconds per chunk
//! and `c` seconds of compute per chunk; solving the measured exposed time for `s` gives the
//! slowdown, clamped to [0, 1] (1: the overlap costs as much as it could hide).

use std::rc::Rc;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::agree::{from_rank0, median};
use crate::backend::Cpu;
use crate::comm::{CommError, Communicator, Group, MpiCommunicator, ReduceOp};
use crate::tensor_parallel::overlap::row_forward;

type Result<T> = std::result::Result<T, CommError>;

/// Rows (tokens) and features of the timed product.
const ROWS: usize = 512;
const FEATURES: usize = 256;
/// Operations per timed sample.
const REPEATS: usize = 8;
/// The overlap degrees measured.
pub const DEGREES: [usize; 2] = [2, 4];

/// What the probe saw at one overlap degree.
#[derive(Clone, Copy, Debug)]
pub struct OverlapSample {
    /// Token chunks.
    pub k: usize,
    /// Seconds of the product and all-reduce, serial (one chunk).
    pub serial_s: f64,
    /// Seconds of the same, sub-pipelined over `k` chunks.
    pub overlapped_s: f64,
    /// Seconds of the product alone.
    pub compute_s: f64,
    /// Seconds of the all-reduce of one chunk alone.
    pub chunk_allreduce_s: f64,
    /// The slowdown `s` solved from the cost model's formula, in [0, 1].
    pub slowdown: f64,
}

impl OverlapSample {
    /// The share of the serial all-reduce time the overlap saved (negative: it cost time).
    pub fn hidden_fraction(&self) -> f64 {
        let comm = self.serial_s - self.compute_s;
        if comm <= 0.0 {
            return 0.0;
        }
        (self.serial_s - self.overlapped_s) / comm
    }
}

/// Measures every degree of [`DEGREES`] over `world` (every rank returns the same samples,
/// rank 0's medians); `None` for a single rank, where there is no tensor parallelism.
pub fn measure(world: Option<&MpiCommunicator>, reps: usize) -> Result<Option<Vec<OverlapSample>>> {
    let Some(w) = world.filter(|w| w.size() > 1) else {
        return Ok(None);
    };
    let group = Group::register(Rc::new(w.duplicate()));
    let local = Group::local();
    let device = Default::default();
    let x = Tensor::<Cpu, 2>::random([ROWS, FEATURES], Distribution::Default, &device);
    let wt = Tensor::<Cpu, 2>::random([FEATURES, FEATURES], Distribution::Default, &device);
    let product = |k: usize, g: Group| -> Result<()> {
        let (x, wt) = (
            x.clone().into_primitive().tensor(),
            wt.clone().into_primitive().tensor(),
        );
        let y = row_forward::<Cpu>(x, wt, k, g);
        std::hint::black_box(
            Tensor::<Cpu, 2>::from_primitive(TensorPrimitive::Float(y)).into_data(),
        );
        Ok(())
    };
    // Each sample repeats the operation: one product takes about a millisecond here.
    let timed = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        let mut times = Vec::new();
        for i in 0..2 * reps + 1 {
            w.barrier()?;
            let t = Instant::now();
            for _ in 0..REPEATS {
                f()?;
            }
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() / REPEATS as f64);
            }
        }
        Ok(median(times))
    };
    let compute_s = timed(&|| product(1, local))?;
    let serial_s = timed(&|| product(1, group))?;
    let mut samples = Vec::new();
    for k in DEGREES {
        let buf = std::cell::RefCell::new(vec![1.0f32; ROWS * FEATURES / k]);
        let chunk_allreduce_s = timed(&|| w.all_reduce(&mut buf.borrow_mut(), ReduceOp::Sum))?;
        let overlapped_s = timed(&|| product(k, group))?;
        let mut v = [serial_s, overlapped_s, compute_s, chunk_allreduce_s];
        from_rank0(world, &mut v)?;
        samples.push(sample(k, v));
    }
    Ok(Some(samples))
}

/// The sample of degree `k` from `[serial, overlapped, compute, chunk all-reduce]` seconds.
fn sample(k: usize, [serial_s, overlapped_s, compute_s, a]: [f64; 4]) -> OverlapSample {
    let c = compute_s / k as f64;
    let exposed = overlapped_s - compute_s;
    let extra = (k - 1) as f64;
    let contended = extra * a.min(c);
    let slowdown = if contended > 0.0 {
        ((exposed - a - extra * (a - c).max(0.0)) / contended).clamp(0.0, 1.0)
    } else {
        0.0
    };
    OverlapSample {
        k,
        serial_s,
        overlapped_s,
        compute_s,
        chunk_allreduce_s: a,
        slowdown,
    }
}

/// The slowdown the spec records: the mean over the degrees measured.
pub fn slowdown(samples: &[OverlapSample]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.iter().map(|s| s.slowdown).sum::<f64>() / samples.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowdown_solves_the_cost_models_formula() {
        // k = 2, compute 4 ms (2 per chunk), all-reduce 1 ms per chunk, slowdown 0.5:
        // exposed = 1 + 1 * (0 + 0.5 * 1) = 1.5 ms.
        let s = sample(2, [6e-3, 5.5e-3, 4e-3, 1e-3]);
        assert!((s.slowdown - 0.5).abs() < 1e-9, "{s:?}");
        // Serial exposes 2 ms of communication; the overlap saved 0.5 ms of it.
        assert!((s.hidden_fraction() - 0.25).abs() < 1e-9);
        // An overlap slower than the serial product is clamped at 1.
        assert_eq!(sample(2, [6e-3, 9e-3, 4e-3, 1e-3]).slowdown, 1.0);
        // One that hides everything but the last chunk costs nothing.
        assert_eq!(sample(4, [6e-3, 4.5e-3, 4e-3, 0.5e-3]).slowdown, 0.0);
    }
}
