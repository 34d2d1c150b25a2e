//! Token data sets on disk: `merak prepare-data` writes them, training reads them memory-mapped.
//!
//! A data set is a folder with `train.bin` and `val.bin` (token ids as little-endian `u16`)
//! and `meta.json` (tokenizer, vocabulary size, token counts, sources). Documents are
//! separated by the tokenizer's end-of-text token. The validation split is the last
//! `val_fraction` of the tokens.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use merak_burn::tensor_parallel::InitRng;

/// The GPT-2 BPE vocabulary size (r50k_base), end-of-text included.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>` id.
pub const GPT2_EOT: u32 = 50256;

/// A data set error; each names the file or the numbers.
#[derive(Debug, Error)]
pub enum DataError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An input text has no tokens.
    #[error("{0}: the input is empty (no text to tokenize)")]
    EmptyInput(String),
    /// An unknown tokenizer name.
    #[error("unknown tokenizer {0:?} (known: gpt2)")]
    Tokenizer(String),
    /// The tokenizer could not be loaded.
    #[error("loading the {name} tokenizer failed: {msg}")]
    TokenizerLoad {
        /// The tokenizer.
        name: String,
        /// What failed.
        msg: String,
    },
    /// A bad split fraction.
    #[error("--val-fraction {0} must be in (0, 0.5]")]
    ValFraction(f64),
    /// `meta.json` is missing or unreadable.
    #[error("{path}: not a merak data set ({msg}); create one with `merak prepare-data`")]
    Meta {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// A token file does not hold what `meta.json` says.
    #[error("{path}: holds {got} tokens but meta.json says {expected} (truncated or altered?)")]
    Size {
        /// The file.
        path: String,
        /// Tokens from meta.json.
        expected: u64,
        /// Tokens found.
        got: u64,
    },
    /// The data's vocabulary does not fit the model.
    #[error(
        "data.path {path}: tokenized with {tokenizer} (vocabulary {data_vocab}) but model.vocab_size is {model_vocab}; \
         use a model with model.vocab_size >= {data_vocab}"
    )]
    Vocab {
        /// The data folder.
        path: String,
        /// The tokenizer.
        tokenizer: String,
        /// The data's vocabulary size.
        data_vocab: usize,
        /// The model's vocabulary size.
        model_vocab: usize,
    },
    /// Too few tokens for one sequence.
    #[error("{path}: {tokens} tokens are too few for one sequence of {need} (model.seq_len + 1)")]
    TooSmall {
        /// The file.
        path: String,
        /// Tokens in the split.
        tokens: u64,
        /// Tokens one sample needs.
        need: u64,
    },
}

/// `meta.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Tokenizer name ("gpt2").
    pub tokenizer: String,
    /// Vocabulary size of the tokenizer.
    pub vocab_size: usize,
    /// End-of-text id separating documents.
    pub eot: u32,
    /// Element type of the token files ("u16").
    pub dtype: String,
    /// Tokens in `train.bin`.
    pub train_tokens: u64,
    /// Tokens in `val.bin`.
    pub val_tokens: u64,
    /// Fraction of tokens held out for validation.
    pub val_fraction: f64,
    /// The input files.
    pub sources: Vec<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

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

/// One split of a data set, memory-mapped.
pub struct TokenFile {
    map: Mmap,
    tokens: u64,
}

impl TokenFile {
    fn open(path: &Path, expected: u64) -> Result<Self, DataError> {
        let f = File::open(path).map_err(io(path))?;
        let len = f.metadata().map_err(io(path))?.len();
        if len != expected * 2 {
            return Err(DataError::Size {
                path: path.display().to_string(),
                expected,
                got: len / 2,
            });
        }
        // SAFETY: the file is opened read-only and not modified while training reads it
        // (merak writes data sets atomically, to new files).
        let map = unsafe { Mmap::map(&f) }.map_err(io(path))?;
        Ok(Self {
            map,
            tokens: expected,
        })
    }

    /// Number of tokens.
    pub fn token_count(&self) -> u64 {
        self.tokens
    }

    /// Tokens `start..start + n` as `i64` ids.
    pub fn read(&self, start: u64, n: usize) -> Vec<i64> {
        let b = &self.map[(start * 2) as usize..(start as usize + n) * 2];
        b.chunks_exact(2)
            .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    }
}

/// A prepared data set opened for training a model with `seq_len` and `vocab_size`.
pub struct TokenData {
    /// Metadata.
    pub meta: Meta,
    /// Training split.
    pub train: TokenFile,
    /// Validation split.
    pub val: TokenFile,
    seq: usize,
    rng: InitRng,
    samples: u64,
    /// The permutation of samples for the epoch `perm_epoch`.
    perm: std::cell::RefCell<(u64, Vec<u64>)>,
}

impl TokenData {
    /// Opens and checks a data set (meta, sizes, vocabulary, enough tokens) before training.
    pub fn open(
        dir: &Path,
        seq_len: usize,
        model_vocab: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        let meta_path = dir.join("meta.json");
        let text = std::fs::read_to_string(&meta_path).map_err(|e| DataError::Meta {
            path: meta_path.display().to_string(),
            msg: e.to_string(),
        })?;
        let meta: Meta = serde_json::from_str(&text).map_err(|e| DataError::Meta {
            path: meta_path.display().to_string(),
            msg: e.to_string(),
        })?;
        if meta.vocab_size > model_vocab {
            return Err(DataError::Vocab {
                path: dir.display().to_string(),
                tokenizer: meta.tokenizer.clone(),
                data_vocab: meta.vocab_size,
                model_vocab,
            });
        }
        let train = TokenFile::open(&dir.join("train.bin"), meta.train_tokens)?;
        let val = TokenFile::open(&dir.join("val.bin"), meta.val_tokens)?;
        let need = seq_len as u64 + 1;
        for (name, f) in [("train.bin", &train), ("val.bin", &val)] {
            if f.token_count() < need {
                return Err(DataError::TooSmall {
                    path: dir.join(name).display().to_string(),
                    tokens: f.token_count(),
                    need,
                });
            }
        }
        let samples = (train.token_count() - 1) / seq_len as u64;
        Ok(Self {
            meta,
            train,
            val,
            seq: seq_len,
            rng: InitRng::new(seed ^ 0x0DA7_A5E7),
            samples,
            perm: std::cell::RefCell::new((u64::MAX, Vec::new())),
        })
    }

    /// Training samples per epoch (non-overlapping windows of `seq_len + 1` tokens).
    pub fn samples_per_epoch(&self) -> u64 {
        self.samples
    }

    /// The start of global training sample `c` (the `c`-th sequence consumed since the start
    /// of training): epochs visit every window once, in an order shuffled from the seed.
    fn train_start(&self, c: u64) -> u64 {
        let epoch = c / self.samples;
        let mut perm = self.perm.borrow_mut();
        if perm.0 != epoch {
            let mut p: Vec<u64> = (0..self.samples).collect();
            let r = self
                .rng
                .integers(&format!("epoch/{epoch}"), p.len(), u64::MAX);
            for i in (1..p.len()).rev() {
                let j = (r[i] % (i as u64 + 1)) as usize;
                p.swap(i, j);
            }
            *perm = (epoch, p);
        }
        perm.1[(c % self.samples) as usize] * self.seq as u64
    }

    /// Inputs and targets of global training samples `first..first + count` (row-major).
    pub fn train_batch(&self, first: u64, count: usize) -> (Vec<i64>, Vec<i64>) {
        self.windows(
            &self.train,
            (first..first + count as u64).map(|c| self.train_start(c)),
        )
    }

    /// Inputs and targets (shifted by one token) of the windows of `seq_len + 1` tokens of
    /// `file` starting at `starts`, row-major.
    fn windows(&self, file: &TokenFile, starts: impl Iterator<Item = u64>) -> (Vec<i64>, Vec<i64>) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for start in starts {
            let w = file.read(start, self.seq + 1);
            x.extend_from_slice(&w[..self.seq]);
            y.extend_from_slice(&w[1..]);
        }
        (x, y)
    }

    /// Validation windows available.
    pub fn val_samples(&self) -> u64 {
        (self.val.token_count() - 1) / self.seq as u64
    }

    /// Inputs and targets of validation windows `first..first + count` (in order, wrapping).
    pub fn val_batch(&self, first: u64, count: usize) -> (Vec<i64>, Vec<i64>) {
        let n = self.val_samples();
        let seq = self.seq as u64;
        self.windows(
            &self.val,
            (first..first + count as u64).map(|c| (c % n) * seq),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Batches: targets are inputs shifted by one; an epoch visits each window once.
        let (x, y) = data.train_batch(0, 2);
        assert_eq!(x[1..8], y[..7]);
        let n = data.samples_per_epoch();
        let mut starts: Vec<u64> = (0..n).map(|c| data.train_start(c)).collect();
        starts.sort();
        assert_eq!(starts, (0..n).map(|i| i * 8).collect::<Vec<_>>());
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
