//! Reading an input in chunks on a thread of its own (a FIFO may block), tokenizing it as it
//! comes, with progress and the stop flag looked at meanwhile.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use merak_burn::data::{DataError, io};
use tiktoken_rs::CoreBPE;

use super::split::Splitter;
use super::{CHUNK_BYTES, PrepareError};

/// How often a blocked read (a FIFO) looks at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// A progress bar on stderr (drawn only on a terminal): bytes read out of `total`, when known.
pub(super) fn progress_bar(total: Option<u64>) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
    let template = match total {
        Some(_) => "{spinner} {bytes}/{total_bytes} read, {msg} ({bytes_per_sec}, {eta} left)",
        None => "{spinner} {bytes} read, {msg} ({bytes_per_sec})",
    };
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("0 tokens");
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// An error if a signal has been received.
pub(super) fn check_stop(stop: &AtomicUsize) -> Result<(), PrepareError> {
    match stop.load(Ordering::SeqCst) {
        0 => Ok(()),
        signal => Err(PrepareError::Interrupted { signal }),
    }
}

/// Token ids written to a file as little-endian `u16`.
pub(super) struct Sink<'a> {
    pub(super) out: BufWriter<&'a File>,
    pub(super) path: &'a Path,
    pub(super) count: u64,
}

impl Sink<'_> {
    /// Appends `tokens`.
    pub(super) fn push(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        // GPT-2's ids are below 50,257, so they fit u16.
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| (t as u16).to_le_bytes())
            .collect();
        self.out.write_all(&bytes).map_err(io(self.path))?;
        self.count += tokens.len() as u64;
        Ok(())
    }

    /// Flushes the file; the number of tokens written.
    pub(super) fn finish(mut self) -> Result<u64, DataError> {
        self.out.flush().map_err(io(self.path))?;
        Ok(self.count)
    }
}

/// Streams the input `path` through the tokenizer into `sink`.
pub(super) fn tokenize_input(
    path: &Path,
    bpe: &CoreBPE,
    sink: &mut Sink<'_>,
    stop: &AtomicUsize,
    bar: &ProgressBar,
) -> Result<(), PrepareError> {
    let chunks = spawn_reader(path.to_path_buf());
    let mut text = Splitter::default();
    while let Some(chunk) = next_chunk(&chunks, path, stop)? {
        bar.inc(chunk.len() as u64);
        text.push(&chunk);
        if let Some(ready) = text.take_ready(path)? {
            sink.push(&bpe.encode_ordinary(&ready))?;
            bar.set_message(format!("{} tokens", sink.count));
        }
    }
    sink.push(&bpe.encode_ordinary(&text.finish(path)?))?;
    Ok(())
}

/// The next chunk from the reader, `None` at the end; waits while the reader blocks (a FIFO),
/// looking at `stop` meanwhile.
pub(super) fn next_chunk(
    chunks: &Receiver<std::io::Result<Vec<u8>>>,
    path: &Path,
    stop: &AtomicUsize,
) -> Result<Option<Vec<u8>>, PrepareError> {
    loop {
        check_stop(stop)?;
        match chunks.recv_timeout(POLL) {
            Ok(Ok(chunk)) if chunk.is_empty() => return Ok(None),
            Ok(Ok(chunk)) => return Ok(Some(chunk)),
            Ok(Err(e)) => return Err(io(path)(e).into()),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                let e = std::io::Error::other("the reading thread ended");
                return Err(io(path)(e).into());
            }
        }
    }
}

/// A thread that opens `path` and sends its content in chunks of at most [`CHUNK_BYTES`], then
/// an empty chunk at the end (or the error). It ends when the receiver is dropped; one blocked
/// on a FIFO ends with the process.
pub(super) fn spawn_reader(path: PathBuf) -> Receiver<std::io::Result<Vec<u8>>> {
    let (tx, rx) = sync_channel(2);
    std::thread::spawn(move || {
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        loop {
            let mut buf = vec![0u8; CHUNK_BYTES];
            match file.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send(Ok(buf)).is_err() || n == 0 {
                        return;
                    }
                }
            }
        }
    });
    rx
}
