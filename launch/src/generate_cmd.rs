//! `merak generate`: text from a GPT checkpoint of any layout, in one process on the CPU.

use std::path::PathBuf;

use anyhow::{Result, bail};
use merak_burn::checkpoint::{Checkpoint, write_file_atomically};
use merak_burn::grid::ProcessGrid;

use crate::export::{gpt_of, ids_tensor, load_gpt, logits_json, not_a_folder};
use crate::generate::{self, Sampling};
use crate::prepare_data::GPT2_VOCAB;

/// Arguments of `merak generate`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint: a `step-*` folder, or a checkpoint folder whose `latest` names one.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The prompt, tokenized with GPT-2's BPE.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<i64>>,
    /// Tokens to generate, at most the model's context (`model.seq_len`); default 50, or the
    /// context if it is shorter.
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// 0: greedy; otherwise sample among the top-k at this temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Candidates for sampling.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the prompt and generated ids, comma-separated, on the last line.
    #[arg(long)]
    pub print_ids: bool,
    /// Also write the logits of every prompt position as JSON (`{"ids", "shape", "logits"}`),
    /// to compare with another implementation.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

/// Continues a prompt with a checkpoint and prints the result.
pub fn generate(args: &GenerateArgs) -> Result<()> {
    if let Some(path) = &args.logits_out {
        not_a_folder(path, "--logits-out")?;
    }
    let ck = Checkpoint::open(&args.checkpoint)?;
    let cfg = gpt_of(&ck)?;
    let g = &cfg.model.gpt;
    let bpe = tiktoken_rs::r50k_base()?;
    let prompt: Vec<i64> = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => bpe
            .encode_ordinary(text)
            .into_iter()
            .map(i64::from)
            .collect(),
        (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let new_tokens = check_sampling(args, g.seq_len)?;
    if let Some(&bad) = prompt
        .iter()
        .find(|&&t| t < 0 || t as usize >= g.vocab_size)
    {
        bail!(
            "prompt token {bad} is outside this model's vocabulary (0..{}){}",
            g.vocab_size,
            if args.prompt.is_some() {
                "; the model was not trained on GPT-2 tokens, give --prompt-ids"
            } else {
                ""
            }
        );
    }
    let model = load_gpt(&ck, g, cfg.train.seed)?;
    let grid = ProcessGrid::single();
    if let Some(path) = &args.logits_out {
        let ids = &prompt[..prompt.len().min(g.seq_len)];
        let json = logits_json(model.logits(ids_tensor(ids)), ids, g.vocab_size)?;
        // Made only now that the checkpoint is loaded: a refused command leaves no folder.
        crate::output_file(path, "--logits-out")?;
        write_file_atomically(path, &json)?;
    }
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let device = Default::default();
    // GPT-2 text is printed as it comes: the prompt, then each token.
    let mut text = (g.vocab_size == GPT2_VOCAB).then(|| TextStream::new(&bpe));
    if let Some(t) = &mut text {
        t.push(&prompt)?;
    }
    let ids = generate::generate(
        &model,
        &prompt,
        new_tokens,
        g.seq_len,
        g.vocab_size,
        &sampling,
        grid.tp,
        &device,
        &mut |id| match &mut text {
            Some(t) => t.push(&[id]),
            None => Ok(()),
        },
    )?;
    if let Some(t) = text {
        t.finish()?;
    }
    if args.print_ids || g.vocab_size != GPT2_VOCAB {
        let text: Vec<String> = ids.iter().map(i64::to_string).collect();
        println!("{}", text.join(","));
    }
    Ok(())
}

/// Checks the sampling options (at most the model's context of new tokens, a finite
/// temperature of at least 0, at least one candidate token) and returns the tokens to make.
fn check_sampling(args: &GenerateArgs, seq_len: usize) -> Result<usize> {
    let new_tokens = args.max_new_tokens.unwrap_or(50.min(seq_len));
    if new_tokens > seq_len {
        bail!(
            "--max-new-tokens {new_tokens} is more than the model's context of {seq_len} tokens \
             (model.seq_len); give at most {seq_len}"
        );
    }
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature {}: must be a finite number >= 0 (0: greedy)",
            args.temperature
        );
    }
    if args.top_k == 0 {
        bail!("--top-k 0: sampling needs at least 1 candidate token");
    }
    Ok(new_tokens)
}

/// GPT-2 tokens decoded and printed as they come; bytes that do not form a whole UTF-8
/// character yet wait for the next token.
struct TextStream<'a> {
    bpe: &'a tiktoken_rs::CoreBPE,
    pending: Vec<u8>,
}

impl<'a> TextStream<'a> {
    fn new(bpe: &'a tiktoken_rs::CoreBPE) -> Self {
        Self {
            bpe,
            pending: Vec::new(),
        }
    }

    /// Decodes `ids` and prints the whole characters so far.
    fn push(&mut self, ids: &[i64]) -> Result<()> {
        use std::io::Write;
        let tokens: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        self.pending.extend(self.bpe.decode_bytes(&tokens)?);
        let whole = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let mut out = std::io::stdout().lock();
        out.write_all(&self.pending[..whole])?;
        out.flush()?;
        self.pending.drain(..whole);
        Ok(())
    }

    /// Prints what is left (invalid bytes replaced) and ends the line.
    fn finish(self) -> Result<()> {
        println!("{}", String::from_utf8_lossy(&self.pending));
        Ok(())
    }
}
