//! Token data sets on disk, read memory-mapped: a folder with `train.bin` and `val.bin` (token
//! ids as little-endian `u16`) and `meta.json` (tokenizer, vocabulary size, token counts,
//! sources). Documents are separated by the tokenizer's end-of-text token; the validation split
//! is the last `val_fraction` of the tokens. (`merak prepare-data` writes them.)

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::DataError;
use crate::tensor_parallel::InitRng;

/// The GPT-2 BPE vocabulary size (r50k_base), end-of-text included.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>` id.
pub const GPT2_EOT: u32 = 50256;

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

/// The error of an I/O failure on `path`.
pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
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

    /// The position and value of the first token id that is not below `vocab`, if any (one
    /// pass over the file).
    pub fn first_id_at_or_above(&self, vocab: usize) -> Option<(u64, usize)> {
        (self.map.chunks_exact(2))
            .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])))
            .enumerate()
            .find(|&(_, id)| id >= vocab)
            .map(|(i, id)| (i as u64, id))
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
            if let Some((offset, id)) = f.first_id_at_or_above(model_vocab) {
                return Err(DataError::TokenId {
                    path: dir.join(name).display().to_string(),
                    offset,
                    id,
                    model_vocab,
                    data_vocab: meta.vocab_size,
                });
            }
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
    pub(crate) fn train_start(&self, c: u64) -> u64 {
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

    /// A data set of `n` training tokens `0, 1, 2, ...` and 20 validation tokens.
    fn counting(n: u64, name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("merak-data-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        let bytes = |k: u64| -> Vec<u8> { (0..k).flat_map(|t| (t as u16).to_le_bytes()).collect() };
        std::fs::write(d.join("train.bin"), bytes(n)).expect("train.bin");
        std::fs::write(d.join("val.bin"), bytes(20)).expect("val.bin");
        let meta = Meta {
            tokenizer: "gpt2".into(),
            vocab_size: 512,
            eot: 0,
            dtype: "u16".into(),
            train_tokens: n,
            val_tokens: 20,
            val_fraction: 0.1,
            sources: Vec::new(),
        };
        std::fs::write(
            d.join("meta.json"),
            serde_json::to_vec(&meta).expect("json"),
        )
        .expect("meta");
        d
    }

    #[test]
    fn an_epoch_visits_every_window_once_in_a_seeded_order() {
        let d = counting(81, "epoch");
        let data = TokenData::open(&d, 8, 512, 1).expect("a valid data set");
        let n = data.samples_per_epoch();
        assert_eq!(n, 10);
        let mut starts: Vec<u64> = (0..n).map(|c| data.train_start(c)).collect();
        let order = starts.clone();
        starts.sort();
        assert_eq!(starts, (0..n).map(|i| i * 8).collect::<Vec<_>>());
        assert_ne!(order, starts, "shuffled");
        let (x, y) = data.train_batch(0, 2);
        assert_eq!(x[1..8], y[..7]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn ids_outside_the_models_vocabulary_are_refused_naming_file_and_offset() {
        // Training tokens 0..100, but meta.json claims a vocabulary of 64: ids 64 and up do
        // not fit a model of 64.
        let d = counting(100, "ids");
        let meta_path = d.join("meta.json");
        let mut meta: Meta = serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
        meta.vocab_size = 64;
        std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
        let e = TokenData::open(&d, 8, 64, 1)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("train.bin") && e.contains("token 64 has id 64") && e.contains("= 64"),
            "{e}"
        );
        assert!(TokenData::open(&d, 8, 100, 1).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }
}
