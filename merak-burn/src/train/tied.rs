//! The two copies of a tied embedding across the pipeline take the same step.

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use crate::grid::ProcessGrid;
use crate::train::TrainError;

/// Tag of the tied-embedding gradient exchange (after every pipeline message of the step).
const TIED_TAG: u16 = 32_767;

/// Sums the gradients of the two copies of a tied embedding (`tied`: this rank's copy, see
/// [`PipelineModel::tied_embedding`](crate::pipeline::PipelineModel::tied_embedding)) across
/// the first and the last pipeline rank, so that both copies take the same step.
pub fn sum_tied_grads<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    grid: &ProcessGrid,
    tied: Option<ParamId>,
    device: &B::Device,
) -> Result<(), TrainError> {
    let (Some(id), true) = (tied, grid.layout.pp > 1) else {
        return Ok(());
    };
    let g = grads
        .remove::<B::InnerBackend, 2>(id)
        .ok_or(TrainError::TiedGradient)?;
    let shape = g.dims();
    let mut sum = crate::host_read::floats(g).map_err(|_| TrainError::TiedGradient)?;
    sum_tied_chunk(&mut sum, grid)?;
    grads.register(
        id,
        Tensor::<B::InnerBackend, 2>::from_data(TensorData::new(sum, shape), device),
    );
    Ok(())
}

/// Sums `values` with the same values on the partner stage (the first and the last pipeline
/// rank), in place: the whole tied gradient ([`sum_tied_grads`]), or under ZeRO-2 this rank's
/// chunk of the tied copy's own bucket (both stages cut it alike). Nothing happens without a
/// pipeline.
pub fn sum_tied_chunk(values: &mut [f32], grid: &ProcessGrid) -> Result<(), TrainError> {
    if grid.layout.pp <= 1 {
        return Ok(());
    }
    let p = grid.layout.pp;
    let partner = if grid.coords.pp == 0 { p - 1 } else { 0 };
    let comm = grid.pp.comm()?;
    let sending = comm.send_start(values.to_vec(), partner, TIED_TAG)?;
    let mut other = vec![0.0f32; values.len()];
    comm.recv(&mut other, partner, TIED_TAG)?;
    sending.wait()?;
    // a + b == b + a: both ranks get the same bits.
    values.iter_mut().zip(&other).for_each(|(a, b)| *a += b);
    Ok(())
}
