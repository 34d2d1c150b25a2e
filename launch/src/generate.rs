//! Generation from a (tensor-parallel) GPT, for the sample printed after training: greedy, or
//! sampled from the `top_k` most likely tokens at a temperature, deterministically from a seed.

use anyhow::Result;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::comm::{Group, TensorComm};
use merak_burn::tensor_parallel::{InitRng, ParallelBackend};
use merak_gpt::Gpt;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// 0: greedy (arg-max); otherwise the softmax temperature.
    pub temperature: f64,
    /// Sample among this many most likely tokens.
    pub top_k: usize,
    /// Seed of the draws (the same on every rank, so every rank picks the same token).
    pub seed: u64,
}

/// Chooses a token from full (unpadded) logits.
fn choose(logits: &[f32], s: &Sampling, step: usize) -> usize {
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0
    };
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(s.top_k.max(1));
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / s.temperature).exp())
        .collect();
    let u = f64::from(InitRng::new(s.seed).uniform(&format!("sample/{step}"), 1)[0]);
    let mut target = u * weights.iter().sum::<f64>();
    for (i, w) in order.iter().zip(&weights) {
        if target < *w {
            return *i;
        }
        target -= w;
    }
    order[order.len() - 1]
}

/// Continues `prompt` by `new_tokens` tokens, handing each to `on_token` as soon as it is
/// chosen. Every rank of the TP group must call it: each computes its slice of the logits and
/// the slices are gathered before the choice (the vocabulary padding is never chosen).
#[allow(clippy::too_many_arguments)]
pub fn generate<B: ParallelBackend>(
    model: &Gpt<B>,
    prompt: &[i64],
    new_tokens: usize,
    seq_len: usize,
    vocab: usize,
    sampling: &Sampling,
    tp: Group,
    device: &B::Device,
    on_token: &mut dyn FnMut(i64) -> Result<()>,
) -> Result<Vec<i64>> {
    let comm = tp.comm()?;
    let mut ids = prompt.to_vec();
    for step in 0..new_tokens {
        let context = &ids[ids.len().saturating_sub(seq_len)..];
        let n = context.len();
        let x = Tensor::<B, 2, Int>::from_data(TensorData::new(context.to_vec(), [1, n]), device);
        let logits = model.logits(x);
        let [_, _, local] = logits.dims();
        let last = logits.slice([0..1, n - 1..n, 0..local]).reshape([local]);
        let full = comm.all_gather_tensor(last, 0)?.narrow(0, 0, vocab);
        let values = full
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let id = choose(&values, sampling, step) as i64;
        ids.push(id);
        on_token(id)?;
    }
    Ok(ids)
}

/// Continues the first held-out sequence's first tokens with the trained GPT and
/// prints the text (for a prepared data set) and the ids on rank 0. Every rank takes part
/// (the logits are split over the TP group).
pub fn print_sample<B: merak_burn::tensor_parallel::ParallelBackend>(
    cfg: &crate::config::Config,
    data: &crate::data::Source,
    grid: &merak_burn::grid::ProcessGrid,
    model: &merak_gpt::Gpt<B>,
    device: &B::Device,
) -> Result<()> {
    let g = &cfg.model.gpt;
    let (prompt, _) = data.val_batch(0, 1, g.seq_len);
    let prompt = &prompt[..g.seq_len.min(8)];
    let new = cfg.train.sample_tokens;
    let sampling = Sampling {
        temperature: cfg.train.sample_temperature,
        top_k: 40,
        seed: cfg.train.seed,
    };
    let ids = generate(
        model,
        prompt,
        new,
        g.seq_len,
        g.vocab_size,
        &sampling,
        grid.tp,
        device,
        &mut |_| Ok(()),
    )?;
    if grid.rank == 0 {
        if let crate::data::Source::Tokens(_) = data {
            let bpe = tiktoken_rs::r50k_base()?;
            let tokens: Vec<u32> = ids
                .iter()
                .filter_map(|&t| {
                    u32::try_from(t)
                        .ok()
                        .filter(|&t| t < crate::prepare_data::GPT2_VOCAB as u32)
                })
                .collect();
            let text = String::from_utf8_lossy(&bpe.decode_bytes(&tokens)?).into_owned();
            let how = if sampling.temperature > 0.0 {
                format!("top-40 sampling at temperature {}", sampling.temperature)
            } else {
                "greedy".to_string()
            };
            println!(
                "sample ({how}, {new} tokens after a {}-token prompt):\n{text}",
                prompt.len()
            );
        }
        let ids_text = ids.iter().map(i64::to_string).collect::<Vec<_>>();
        println!("sample ids: {}", ids_text.join(","));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_arg_max_and_sampling_stays_in_the_top_k() {
        let logits = [0.1, 3.0, 2.9, -1.0, 0.0];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: 1,
            seed: 0,
        };
        assert_eq!(choose(&logits, &greedy, 0), 1);
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            seed: 7,
        };
        let picks: Vec<usize> = (0..200).map(|i| choose(&logits, &s, i)).collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 2));
        assert!(picks.contains(&1) && picks.contains(&2));
        assert_eq!(
            picks,
            (0..200).map(|i| choose(&logits, &s, i)).collect::<Vec<_>>()
        );
    }
}
