//! Greedy generation from a (tensor-parallel) GPT, for the sample printed after training.

use anyhow::Result;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::comm::{Group, TensorComm};
use merak_burn::tensor_parallel::ParallelBackend;
use merak_gpt::Gpt;

/// Continues `prompt` by `new_tokens` greedy steps. Every rank of the TP group must call it:
/// each computes its slice of the logits and the slices are gathered for the arg-max (the
/// vocabulary padding is never chosen).
pub fn greedy<B: ParallelBackend>(
    model: &Gpt<B>,
    prompt: &[i64],
    new_tokens: usize,
    seq_len: usize,
    vocab: usize,
    tp: Group,
    device: &B::Device,
) -> Result<Vec<i64>> {
    let comm = tp.comm()?;
    let mut ids = prompt.to_vec();
    for _ in 0..new_tokens {
        let context = &ids[ids.len().saturating_sub(seq_len)..];
        let n = context.len();
        let x = Tensor::<B, 2, Int>::from_data(TensorData::new(context.to_vec(), [1, n]), device);
        let logits = model.logits(x);
        let [_, _, local] = logits.dims();
        let last = logits.slice([0..1, n - 1..n, 0..local]).reshape([local]);
        let full = comm.all_gather_tensor(last, 0)?.narrow(0, 0, vocab);
        let next = full.argmax(0).into_scalar();
        ids.push(burn::tensor::ElementConversion::elem::<i64>(next));
    }
    Ok(ids)
}
