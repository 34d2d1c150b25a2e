//! `llama-export`: writes a `llama-train` checkpoint (of any layout) as a Hugging Face
//! `LlamaForCausalLM` (or `MixtralForCausalLM`) folder (`config.json` and safetensors), which
//! transformers loads.

use std::path::PathBuf;

use clap::Parser;

/// Export a llama-train checkpoint as a Hugging Face LlamaForCausalLM (or MixtralForCausalLM).
#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint: a `step-*` folder or a run's `checkpoints/` folder (its newest).
    checkpoint: PathBuf,
    /// The folder to write `config.json` and the weights into.
    out: PathBuf,
    /// Split the weights into files of at most this many MiB, with an index.
    #[arg(long)]
    shard_mib: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let shard = args.shard_mib.map(|m| m.saturating_mul(1 << 20));
    let files = merak_example_llama::export_checkpoint(&args.checkpoint, &args.out, shard)?;
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(())
}
