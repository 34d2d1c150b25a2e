//! Measured times as the probes use them: their median, and rank 0's values on every rank.

use anyhow::Result;
use merak_burn::comm::{Communicator, MpiCommunicator};

/// The median of `v` (the upper one of an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rank 0's values on every rank.
pub(crate) fn from_rank0(world: Option<&MpiCommunicator>, values: &mut [f64]) -> Result<()> {
    let Some(w) = world else { return Ok(()) };
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    w.broadcast(&mut buf, 0)?;
    for (v, b) in values.iter_mut().zip(buf) {
        *v = b as f64;
    }
    Ok(())
}
