//! Token data sets on disk, read memory-mapped: a folder with `train.bin` and `val.bin` (token
//! ids as little-endian `u16`) and `meta.json` (tokenizer, vocabulary size, token counts,
//! sources). Documents are separated by the tokenizer's end-of-text token; the validation split
//! is the last `val_fraction` of the tokens. (`merak prepare-data` writes them.)

use std::fs::File;
use std::io::Read;
use std::path::Path;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::DataError;
use crate::rng::InitRng;

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

/// The largest `meta.json` read: far more than any data set's (its `sources` list is the only
/// part that grows).
const MAX_META_BYTES: u64 = 64 << 20;

/// The error of an I/O failure on `path`.
pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What a file type that is not a regular file is, in words.
fn kind_of(t: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_char_device() {
            return "a character device";
        }
    }
    if t.is_dir() { "a folder" } else { "not a file" }
}

/// The metadata of `path`, following links, if it is a regular file: what is not (a FIFO, a
/// device, a folder) is refused before anything opens it, so a FIFO cannot block the reader.
fn regular_file(path: &Path) -> Result<std::fs::Metadata, DataError> {
    let m = std::fs::metadata(path).map_err(io(path))?;
    if m.is_file() {
        Ok(m)
    } else {
        Err(DataError::NotAFile {
            path: path.display().to_string(),
            what: kind_of(m.file_type()),
        })
    }
}

/// Opens the regular file `path` for reading and checks that what was opened is still a
/// regular file of `len` bytes (it could have been replaced since [`regular_file`]).
fn open_regular(path: &Path, len: u64) -> Result<File, DataError> {
    let f = File::open(path).map_err(io(path))?;
    let m = f.metadata().map_err(io(path))?;
    if !m.is_file() || m.len() != len {
        return Err(DataError::Io {
            path: path.display().to_string(),
            source: std::io::Error::other("the file changed while it was opened"),
        });
    }
    Ok(f)
}

impl Meta {
    /// Reads `meta.json` at `path`: a regular file of at most 64 MiB, valid JSON, and values
    /// that a data set can have (see [`Meta::check`]).
    pub fn read(path: &Path) -> Result<Self, DataError> {
        let bad = |msg: String| DataError::Meta {
            path: path.display().to_string(),
            msg,
        };
        // A missing meta.json says how to make one.
        let len = match regular_file(path) {
            Err(DataError::Io { source, .. }) => return Err(bad(source.to_string())),
            m => m?.len(),
        };
        if len > MAX_META_BYTES {
            return Err(bad(format!(
                "{len} bytes, more than the {MAX_META_BYTES} a meta.json may have"
            )));
        }
        let mut text = String::new();
        open_regular(path, len)?
            .take(MAX_META_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| bad(e.to_string()))?;
        let meta: Meta = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        meta.check(path)?;
        Ok(meta)
    }

    /// Checks the values that do not depend on the token files (`path` names `meta.json` in
    /// errors): `dtype` is "u16", the vocabulary fits `u16` ids, `eot` is in it and
    /// `val_fraction` is a fraction.
    pub fn check(&self, path: &Path) -> Result<(), DataError> {
        let bad = |key, value: String, why: String| {
            Err(DataError::MetaValue {
                path: path.display().to_string(),
                key,
                value,
                why,
            })
        };
        if self.dtype != "u16" {
            let why = "merak reads token files of \"u16\" only".to_string();
            return bad("dtype", format!("{:?}", self.dtype), why);
        }
        if !(1..=U16_IDS).contains(&self.vocab_size) {
            let why = format!("token ids are u16, so a vocabulary has 1 to {U16_IDS} ids");
            return bad("vocab_size", self.vocab_size.to_string(), why);
        }
        if usize::try_from(self.eot).map_or(true, |eot| eot >= self.vocab_size) {
            let why = format!(
                "the end-of-text id must be below vocab_size = {}",
                self.vocab_size
            );
            return bad("eot", self.eot.to_string(), why);
        }
        if !(self.val_fraction > 0.0 && self.val_fraction < 1.0) {
            let why = "the held-out fraction must be between 0 and 1".to_string();
            return bad("val_fraction", self.val_fraction.to_string(), why);
        }
        Ok(())
    }
}

/// Token ids a `u16` token file can hold.
const U16_IDS: usize = 1 << 16;

/// One split of a data set, memory-mapped.
pub struct TokenFile {
    map: Mmap,
    tokens: u64,
}

impl TokenFile {
    /// Maps `path`, which must be a regular file (or a link to one) of `expected` 2-byte
    /// tokens: its size is checked before it is opened.
    fn open(path: &Path, expected: u64) -> Result<Self, DataError> {
        let len = regular_file(path)?.len();
        if expected.checked_mul(2) != Some(len) {
            return Err(DataError::Size {
                path: path.display().to_string(),
                expected,
                got: len / 2,
                bytes: len,
            });
        }
        let f = open_regular(path, len)?;
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

    /// Checks that every id of the file (`path`, for errors) is below `model_vocab` (the data
    /// claims a vocabulary of `data_vocab`) and that it holds at least `need` tokens.
    fn check(
        &self,
        path: &Path,
        model_vocab: usize,
        data_vocab: usize,
        need: u64,
    ) -> Result<(), DataError> {
        if let Some((offset, id)) = self.first_id_at_or_above(model_vocab) {
            return Err(DataError::TokenId {
                path: path.display().to_string(),
                offset,
                id,
                model_vocab,
                data_vocab,
            });
        }
        if self.tokens < need {
            return Err(DataError::TooSmall {
                path: path.display().to_string(),
                tokens: self.tokens,
                need,
            });
        }
        Ok(())
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
        if seq_len == 0 {
            return Err(DataError::ZeroSeqLen);
        }
        let meta = Meta::read(&dir.join("meta.json"))?;
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
        let need = (seq_len as u64).saturating_add(1);
        for (name, f) in [("train.bin", &train), ("val.bin", &val)] {
            f.check(&dir.join(name), model_vocab, meta.vocab_size, need)?;
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

    /// `dir`'s meta.json with `edit` applied.
    fn edit_meta(dir: &Path, edit: impl FnOnce(&mut Meta)) {
        let path = dir.join("meta.json");
        let mut meta: Meta = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut meta);
        std::fs::write(&path, serde_json::to_vec(&meta).unwrap()).unwrap();
    }

    /// The error of opening `dir` (a model of 512 ids, sequences of 8), within 20 s: a FIFO
    /// opened for reading would block forever.
    fn refusal(dir: &Path) -> String {
        let dir = dir.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(
                TokenData::open(&dir, 8, 512, 1)
                    .err()
                    .map(|e| e.to_string()),
            );
        });
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("answered at once, not blocked");
        e.expect("refused")
    }

    #[test]
    fn token_counts_beyond_the_files_are_refused_without_overflow() {
        let d = counting(100, "counts");
        // 2^63 tokens are 2^64 bytes: `expected * 2` wrapped to 0 and matched an empty file.
        std::fs::write(d.join("val.bin"), b"").unwrap();
        edit_meta(&d, |m| m.val_tokens = 1 << 63);
        let e = refusal(&d);
        assert!(
            e.contains("val.bin")
                && e.contains("holds 0 bytes")
                && e.contains("9223372036854775808"),
            "{e}"
        );
        for huge in [u64::MAX, u64::MAX / 2 + 1, u64::MAX / 2] {
            let d = counting(100, "counts");
            edit_meta(&d, |m| m.train_tokens = huge);
            let e = refusal(&d);
            assert!(
                e.contains("train.bin") && e.contains("200 bytes") && e.contains(&huge.to_string()),
                "{e}"
            );
        }
        // A count one off, and an odd size.
        let d = counting(100, "counts");
        edit_meta(&d, |m| m.train_tokens = 99);
        let e = refusal(&d);
        assert!(
            e.contains("train.bin") && e.contains("200 bytes") && e.contains("says 99"),
            "{e}"
        );
        edit_meta(&d, |m| m.train_tokens = 100);
        std::fs::write(d.join("train.bin"), [0u8; 201]).unwrap();
        let e = refusal(&d);
        assert!(e.contains("201 bytes (100 tokens"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn absurd_meta_values_are_named() {
        type Edit = fn(&mut Meta);
        let cases: [(&str, Edit); 7] = [
            ("`dtype` is \"u32\"", |m| m.dtype = "u32".into()),
            ("`vocab_size` is 0", |m| m.vocab_size = 0),
            ("`vocab_size` is 65537", |m| m.vocab_size = 65537),
            ("`vocab_size` is 18446744073709551615", |m| {
                m.vocab_size = usize::MAX
            }),
            ("`eot` is 512", |m| m.eot = 512),
            ("`eot` is 4294967295", |m| m.eot = u32::MAX),
            ("`val_fraction` is 2", |m| m.val_fraction = 2.0),
        ];
        for (want, edit) in cases {
            let d = counting(100, "absurd");
            edit_meta(&d, edit);
            let e = refusal(&d);
            assert!(e.contains("meta.json") && e.contains(want), "{want}: {e}");
        }
        let d = counting(100, "absurd");
        let e = TokenData::open(&d, 0, 512, 1)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("seq_len is 0"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn token_files_that_are_not_regular_files_are_refused_before_opening() {
        let fifo = |path: &Path| {
            let ok = std::process::Command::new("mkfifo")
                .arg(path)
                .status()
                .unwrap();
            assert!(ok.success(), "mkfifo");
        };
        let d = counting(100, "special");
        std::fs::remove_file(d.join("train.bin")).unwrap();
        fifo(&d.join("train.bin"));
        let e = refusal(&d);
        assert!(e.contains("train.bin") && e.contains("FIFO"), "{e}");
        // A link to a FIFO, to a device and to a folder; meta.json as a FIFO.
        let d = counting(100, "special");
        let target = d.join("pipe");
        fifo(&target);
        std::fs::remove_file(d.join("val.bin")).unwrap();
        std::os::unix::fs::symlink(&target, d.join("val.bin")).unwrap();
        let e = refusal(&d);
        assert!(e.contains("val.bin") && e.contains("FIFO"), "{e}");
        std::fs::remove_file(d.join("val.bin")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("val.bin")).unwrap();
        let e = refusal(&d);
        assert!(
            e.contains("val.bin") && e.contains("character device"),
            "{e}"
        );
        std::fs::remove_file(d.join("val.bin")).unwrap();
        std::fs::create_dir(d.join("val.bin")).unwrap();
        let e = refusal(&d);
        assert!(e.contains("val.bin") && e.contains("a folder"), "{e}");
        std::fs::remove_file(d.join("meta.json")).unwrap();
        fifo(&d.join("meta.json"));
        let e = refusal(&d);
        assert!(e.contains("meta.json") && e.contains("FIFO"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn token_files_may_be_links_to_files() {
        let d = counting(100, "links");
        let cache = counting(100, "links-cache");
        for name in ["train.bin", "val.bin"] {
            std::fs::remove_file(d.join(name)).unwrap();
            std::os::unix::fs::symlink(cache.join(name), d.join(name)).unwrap();
        }
        let data = TokenData::open(&d, 8, 512, 1).expect("links to files are read");
        assert_eq!(data.train.read(5, 2), [5, 6]);
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&cache);
    }
}
