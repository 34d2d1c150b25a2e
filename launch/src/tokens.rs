//! `merak prepare-data`: tokenizes text into the data sets `merak_burn::data` reads.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use merak_burn::data::io;
pub use merak_burn::data::{DataError, GPT2_EOT, GPT2_VOCAB, Meta};

/// Writes `bytes` to `path` atomically: a temporary file in the same folder, synced, renamed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

fn tokens_to_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|&t| (t as u16).to_le_bytes())
        .collect()
}

/// Tokenizes `inputs` with the GPT-2 BPE (offline: the ranks ship inside `tiktoken-rs`) and
/// writes a data set to `output`. Returns its metadata.
pub fn prepare(
    inputs: &[PathBuf],
    output: &Path,
    tokenizer: &str,
    val_fraction: f64,
) -> Result<Meta, DataError> {
    if tokenizer != "gpt2" {
        return Err(DataError::Tokenizer(tokenizer.to_string()));
    }
    if !(val_fraction > 0.0 && val_fraction <= 0.5) {
        return Err(DataError::ValFraction(val_fraction));
    }
    let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::TokenizerLoad {
        name: tokenizer.into(),
        msg: e.to_string(),
    })?;
    let mut all: Vec<u32> = Vec::new();
    for path in inputs {
        let text = std::fs::read_to_string(path).map_err(io(path))?;
        let tokens = bpe.encode_ordinary(&text);
        if tokens.is_empty() {
            return Err(DataError::EmptyInput(path.display().to_string()));
        }
        all.extend_from_slice(&tokens);
        all.push(GPT2_EOT);
    }
    let n_val = ((all.len() as f64 * val_fraction).round() as usize).max(1);
    let split = all.len() - n_val;
    std::fs::create_dir_all(output).map_err(io(output))?;
    write_atomic(&output.join("train.bin"), &tokens_to_bytes(&all[..split]))?;
    write_atomic(&output.join("val.bin"), &tokens_to_bytes(&all[split..]))?;
    let meta = Meta {
        tokenizer: tokenizer.into(),
        vocab_size: GPT2_VOCAB,
        eot: GPT2_EOT,
        dtype: "u16".into(),
        train_tokens: split as u64,
        val_tokens: n_val as u64,
        val_fraction,
        sources: inputs.iter().map(|p| p.display().to_string()).collect(),
    };
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| DataError::Meta {
        path: output.join("meta.json").display().to_string(),
        msg: e.to_string(),
    })?;
    write_atomic(&output.join("meta.json"), &json)?;
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use merak_burn::data::TokenData;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("merak-tokens-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn prepare_then_read_round_trips_through_the_tokenizer() {
        let d = tmp("rt");
        let text = "It was the best of times, it was the worst of times. ".repeat(40);
        std::fs::write(d.join("a.txt"), &text).unwrap();
        let meta = prepare(&[d.join("a.txt")], &d.join("ds"), "gpt2", 0.1).unwrap();
        assert_eq!(meta.vocab_size, 50257);
        let data = TokenData::open(&d.join("ds"), 8, 50257, 1).unwrap();
        assert_eq!(
            data.train.token_count() + data.val.token_count(),
            meta.train_tokens + meta.val_tokens
        );
        let all: Vec<u32> = data
            .train
            .read(0, data.train.token_count() as usize)
            .into_iter()
            .chain(data.val.read(0, data.val.token_count() as usize))
            .map(|t| t as u32)
            .collect();
        assert_eq!(*all.last().unwrap(), GPT2_EOT);
        let bpe = tiktoken_rs::r50k_base().unwrap();
        assert_eq!(bpe.decode(&all[..all.len() - 1]).unwrap(), text);
        // Batches: targets are inputs shifted by one (that an epoch visits each window once is
        // checked in merak_burn::data).
        let (x, y) = data.train_batch(0, 2);
        assert_eq!(x[1..8], y[..7]);
    }

    #[test]
    fn bad_data_sets_are_named() {
        let d = tmp("bad");
        let e = TokenData::open(&d, 8, 50257, 1).err().unwrap().to_string();
        assert!(e.contains("meta.json") && e.contains("prepare-data"), "{e}");
        std::fs::write(d.join("a.txt"), "word ".repeat(200)).unwrap();
        prepare(&[d.join("a.txt")], &d, "gpt2", 0.1).unwrap();
        let e = TokenData::open(&d, 8, 512, 1).err().unwrap().to_string();
        assert!(
            e.contains("model.vocab_size is 512") && e.contains("50257"),
            "{e}"
        );
        let e = TokenData::open(&d, 4096, 50257, 1)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("too few"), "{e}");
        // Truncate the training file.
        let bytes = std::fs::read(d.join("train.bin")).unwrap();
        std::fs::write(d.join("train.bin"), &bytes[..bytes.len() - 2]).unwrap();
        let e = TokenData::open(&d, 8, 50257, 1).err().unwrap().to_string();
        assert!(e.contains("train.bin") && e.contains("truncated"), "{e}");
        std::fs::write(d.join("empty.txt"), "").unwrap();
        let e = prepare(&[d.join("empty.txt")], &d.join("x"), "gpt2", 0.1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
        let e = prepare(&[d.join("missing.txt")], &d.join("x"), "gpt2", 0.1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.txt"), "{e}");
    }
}
