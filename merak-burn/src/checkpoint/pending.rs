//! Asynchronous saves: the training thread makes the partial folder with the others (a
//! collective), hands this rank's host copy of its state to a writer thread, and goes on
//! training; later it completes the save ([`PendingSave::finish`]): it joins the writer, every
//! rank learns whether all wrote their files, and rank 0 seals, renames, switches `latest` and
//! prunes exactly as [`save`](super::save) does. The writer thread only writes files: no MPI
//! call (MPI is initialised single-threaded, and communicators belong to the training
//! thread) and no Burn call.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::write::{Place, SaveTarget, begin, complete, write_rank_files};
use super::{CheckpointError, RankState, RunId, fault};
use crate::comm::ReduceOp;
use crate::grid::ProcessGrid;

/// What the writer thread returns: how long writing took, or why it failed.
type Written = Result<Duration, CheckpointError>;

/// A save whose files this rank's writer thread is writing; every rank of the grid holds one
/// for the same step and completes it at the same point ([`finish`](Self::finish)).
pub struct PendingSave {
    target: SaveTarget,
    writer: Writer,
}

/// The writer thread, or what it would have returned when it could not be started.
enum Writer {
    Running(JoinHandle<Written>),
    Done(Written),
}

/// A completed save.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// The checkpoint's folder.
    pub dir: PathBuf,
    /// How long this rank's files took to write.
    pub write_time: Duration,
}

/// Starts an asynchronous save of `state` (this rank's host copy, owned by the writer from
/// now on) after `step` steps of `run` under `root`: collectively makes the partial folder,
/// then writes this rank's files on a writer thread and returns. Every rank of the grid must
/// call it, and later [`PendingSave::finish`] (or poll [`PendingSave::written_everywhere`]
/// first). A test's armed crash point ([`fault::inject_error`]) is carried into the writer.
pub fn start(
    root: &Path,
    run: &RunId,
    step: usize,
    keep: usize,
    state: RankState,
    extra: serde_json::Value,
    grid: &ProcessGrid,
) -> Result<PendingSave, CheckpointError> {
    let target = SaveTarget::new(root, run, step, keep, extra, grid);
    begin(&target, grid)?;
    let (tmp_dir, place, armed) = (target.tmp_dir.clone(), Place::of(grid), fault::armed());
    let spawned = std::thread::Builder::new()
        .name("checkpoint-writer".into())
        .spawn(move || {
            fault::carry(armed);
            let t = Instant::now();
            write_rank_files(&tmp_dir, &state, place).map(|()| t.elapsed())
        });
    // A thread that cannot start is this rank's write error, agreed on at completion like any.
    let writer = match spawned {
        Ok(handle) => Writer::Running(handle),
        Err(e) => Writer::Done(Err(CheckpointError::io(&target.tmp_dir)(e))),
    };
    Ok(PendingSave { target, writer })
}

impl PendingSave {
    /// The step of the checkpoint being written.
    pub fn step(&self) -> usize {
        self.target.step
    }

    /// The folder the checkpoint will have.
    pub fn dir(&self) -> &Path {
        &self.target.final_dir
    }

    /// Whether this rank's writer is done (without waiting; no collective).
    pub fn written_here(&self) -> bool {
        match &self.writer {
            Writer::Running(handle) => handle.is_finished(),
            Writer::Done(_) => true,
        }
    }

    /// Whether every rank's writer is done: one all-reduce of a flag over the world, which
    /// every rank must call at the same point. When it says yes, [`finish`](Self::finish)
    /// completes the save without waiting for a writer.
    pub fn written_everywhere(&self, grid: &ProcessGrid) -> Result<bool, CheckpointError> {
        let mut busy = [if self.written_here() { 0.0f32 } else { 1.0 }];
        grid.world.comm()?.all_reduce(&mut busy, ReduceOp::Max)?;
        Ok(busy[0] == 0.0)
    }

    /// Completes the save (every rank of the grid together): waits for this rank's writer,
    /// agrees with the others on whether every rank wrote its files (a rank that failed
    /// returns its own error, the others [`CheckpointError::OtherRank`]), and rank 0 seals the
    /// checkpoint, renames it into place, switches `latest` and prunes. A panic of the writer
    /// is this rank's error ([`CheckpointError::WriterPanicked`]).
    pub fn finish(self, grid: &ProcessGrid) -> Result<Saved, CheckpointError> {
        let written = match self.writer {
            Writer::Done(written) => written,
            Writer::Running(handle) => handle.join().unwrap_or_else(|payload| {
                Err(CheckpointError::WriterPanicked {
                    dir: self.target.tmp_dir.clone(),
                    message: panic_message(payload.as_ref()),
                })
            }),
        };
        let write_time = *written.as_ref().unwrap_or(&Duration::ZERO);
        let dir = complete(&self.target, written.map(|_| ()), grid)?;
        Ok(Saved { dir, write_time })
    }
}

/// The text of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

#[cfg(test)]
#[path = "pending_tests.rs"]
mod tests;
