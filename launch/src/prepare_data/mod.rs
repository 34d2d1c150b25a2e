//! `merak prepare-data`: tokenizes text into the data sets `merak_burn::data` reads.
//!
//! The inputs are streamed, so a FIFO works (`--input <(zcat corpus.gz)`) and memory does not
//! grow with the corpus. A reader thread reads each input in chunks. The text is cut only
//! where GPT-2's pre-tokenizer cannot merge across the cut ([`safe_cut`]), tokenized and
//! written to a temporary file as it comes; the validation tail is copied out of that file at
//! the end. Memory is bounded by the chunk size and the longest stretch of text with no place
//! to cut ([`MAX_UNCUT_BYTES`]).
//!
//! Nothing that the command did not create is removed or overwritten. `--output` is checked
//! before any work: a file, or a folder that already holds a data set, is refused. Temporary
//! files have random hidden names (`.merak-prepare-*.tmp`), are removed on failure, and become
//! `train.bin`, `val.bin` and `meta.json` by renames that never replace an existing file.

mod error;
mod output;
mod split;
mod stream;
#[cfg(test)]
mod tests;

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use indicatif::ProgressBar;
pub use merak_burn::data::{DataError, GPT2_EOT, GPT2_VOCAB, Meta};
use tiktoken_rs::CoreBPE;

pub use error::PrepareError;
use error::signal_name;
use output::{Undo, check_inputs, check_output, create_output, publish, split_tail, temp_file};
use stream::{Sink, check_stop, progress_bar, tokenize_input};

/// The most text held while no place to cut it has been found (a run of letters, of
/// punctuation or of whitespace this long is not text).
pub const MAX_UNCUT_BYTES: usize = 4 << 20;
/// The longest run of whitespace characters tokenized: GPT-2's pre-tokenizer (`fancy-regex`,
/// a backtracking stack of 10^6 entries) fails on runs of about a million, and tiktoken-rs
/// panics then.
pub const MAX_WHITESPACE_RUN: usize = 1 << 18;

/// Bytes read from an input at once.
const CHUNK_BYTES: usize = 1 << 20;

/// `merak prepare-data`'s arguments.
#[derive(clap::Args, Debug)]
pub struct PrepareArgs {
    /// UTF-8 text files (or FIFOs, e.g. `<(zcat corpus.gz)`); each becomes one document,
    /// separated by the end-of-text token.
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// Output folder (train.bin, val.bin, meta.json): a new folder, or one without a data set.
    #[arg(long)]
    pub output: PathBuf,
    /// Tokenizer: gpt2 (GPT-2's BPE, bundled; no download).
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: String,
    /// Fraction of the tokens held out for validation (the end of the text).
    #[arg(long, default_value_t = 0.05)]
    pub val_fraction: f64,
}

/// `merak prepare-data`: writes the data set, showing progress on a terminal and stopping
/// cleanly on SIGINT or SIGTERM. Exit status 0, 2 for bad input, 128 + the signal's number when
/// stopped.
pub fn run(a: &PrepareArgs) -> ExitCode {
    let stop = Arc::new(AtomicUsize::new(0));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let value = usize::try_from(signal).unwrap_or(usize::MAX);
        if let Err(e) = signal_hook::flag::register_usize(signal, Arc::clone(&stop), value) {
            eprintln!("error: cannot handle {}: {e}", signal_name(value));
            return ExitCode::from(2);
        }
    }
    let job = Job {
        inputs: &a.input,
        output: &a.output,
        tokenizer: &a.tokenizer,
        val_fraction: a.val_fraction,
        progress: true,
    };
    match job.run(&stop) {
        Ok(m) => {
            println!(
                "wrote {}: {} training and {} validation tokens ({} tokenizer, vocabulary {})",
                a.output.display(),
                m.train_tokens,
                m.val_tokens,
                m.tokenizer,
                m.vocab_size
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_status())
        }
    }
}

/// Tokenizes `inputs` with the GPT-2 BPE (offline: the ranks ship inside `tiktoken-rs`) and
/// writes a data set to `output`, without progress bar or signal handling. Returns its
/// metadata. (The tests' shorthand for a [`Job`].)
#[cfg(test)]
pub fn prepare(
    inputs: &[PathBuf],
    output: &Path,
    tokenizer: &str,
    val_fraction: f64,
) -> Result<Meta, PrepareError> {
    let job = Job {
        inputs,
        output,
        tokenizer,
        val_fraction,
        progress: false,
    };
    job.run(&AtomicUsize::new(0))
}

/// One run of `prepare-data`.
pub struct Job<'a> {
    /// The text files, one document each.
    pub inputs: &'a [PathBuf],
    /// The data set's folder.
    pub output: &'a Path,
    /// The tokenizer's name.
    pub tokenizer: &'a str,
    /// Fraction of the tokens held out.
    pub val_fraction: f64,
    /// Whether to show a progress bar (on stderr, when it is a terminal).
    pub progress: bool,
}

impl Job<'_> {
    /// Checks the settings, the output and the inputs, then writes the data set; stops with
    /// [`PrepareError::Interrupted`] when `stop` holds a signal's number. On failure, what it
    /// made (temporary files, the output folder if it made it) is removed.
    pub fn run(&self, stop: &AtomicUsize) -> Result<Meta, PrepareError> {
        if self.tokenizer != "gpt2" {
            return Err(DataError::Tokenizer(self.tokenizer.to_string()).into());
        }
        if !(self.val_fraction > 0.0 && self.val_fraction <= 0.5) {
            return Err(DataError::ValFraction(self.val_fraction).into());
        }
        check_output(self.output)?;
        let total = check_inputs(self.inputs)?;
        let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::TokenizerLoad {
            name: self.tokenizer.into(),
            msg: e.to_string(),
        })?;
        let made = Undo {
            paths: create_output(self.output)?,
            folders: true,
        };
        let bar = match self.progress {
            true => progress_bar(total),
            false => ProgressBar::hidden(),
        };
        let result = self.write(&bpe, stop, &bar);
        bar.finish_and_clear();
        if result.is_ok() {
            made.keep();
        }
        result
    }

    /// Tokenizes every input into a temporary file, splits off the validation tail and
    /// publishes the data set.
    fn write(
        &self,
        bpe: &CoreBPE,
        stop: &AtomicUsize,
        bar: &ProgressBar,
    ) -> Result<Meta, PrepareError> {
        let mut all = temp_file(self.output)?;
        let mut sink = Sink {
            out: BufWriter::new(all.as_file()),
            path: all.path(),
            count: 0,
        };
        for path in self.inputs {
            let before = sink.count;
            tokenize_input(path, bpe, &mut sink, stop, bar)?;
            if sink.count == before {
                return Err(DataError::EmptyInput(path.display().to_string()).into());
            }
            sink.push(&[GPT2_EOT])?;
        }
        let n = sink.finish()?;
        let n_val = ((n as f64 * self.val_fraction).round() as u64).max(1);
        let split = n.saturating_sub(n_val);
        let val = split_tail(&mut all, split, self.output, stop)?;
        let meta = Meta {
            tokenizer: self.tokenizer.into(),
            vocab_size: GPT2_VOCAB,
            eot: GPT2_EOT,
            dtype: "u16".into(),
            train_tokens: split,
            val_tokens: n_val,
            val_fraction: self.val_fraction,
            sources: self
                .inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
        };
        check_stop(stop)?;
        publish(self.output, all, val, &meta)?;
        Ok(meta)
    }
}
