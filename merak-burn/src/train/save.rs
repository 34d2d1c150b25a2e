//! Saving a trainer's state as a sharded checkpoint, on the training thread or (with
//! [`CheckpointPolicy::asynchronous`]) on a writer thread while training goes on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::checkpoint::{self, PendingSave, RankState, RunId};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::progress::Progress;
use crate::train::trainer::AsyncSave;
use crate::train::{CheckpointPolicy, TrainError, Trainer};

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// Writes a checkpoint of the steps done so far under `policy.dir` (every rank of the grid
    /// must call it), keeping the newest `policy.keep`; returns its folder. The manifest holds
    /// `policy.extra`, the data position, the seed, and the optimizer with what its state
    /// holds (`optimizer`: a checkpoint resumes only into the same optimizer). Always on the
    /// calling thread, whatever `policy.asynchronous` says.
    pub fn save_checkpoint(&self, policy: &CheckpointPolicy) -> Result<PathBuf, TrainError> {
        let (state, extra, run) = self.checkpoint_contents(policy)?;
        let (step, keep) = (self.done, policy.keep);
        Ok(checkpoint::save(
            &policy.dir,
            &run,
            step,
            keep,
            &state,
            extra,
            self.grid,
        )?)
    }

    /// Starts an asynchronous save of the steps done so far, like
    /// [`save_checkpoint`](Self::save_checkpoint) but returning once this rank's state is
    /// copied to host memory and a writer thread writes it; every rank of the grid must call
    /// it, and later [`PendingSave::finish`] at the same point.
    pub fn start_checkpoint(&self, policy: &CheckpointPolicy) -> Result<PendingSave, TrainError> {
        let (state, extra, run) = self.checkpoint_contents(policy)?;
        let (step, keep) = (self.done, policy.keep);
        Ok(checkpoint::start(
            &policy.dir,
            &run,
            step,
            keep,
            state,
            extra,
            self.grid,
        )?)
    }

    /// What this rank saves (its host copy), the manifest's extra state and the lineage.
    fn checkpoint_contents(
        &self,
        policy: &CheckpointPolicy,
    ) -> Result<(RankState, serde_json::Value, RunId), TrainError> {
        let step = self.done;
        // What this rank writes: without ZeRO the first data-parallel copy's whole state,
        // under ZeRO every rank of the first copy its chunks.
        let mut rank_state = (self.sync).rank_state(&self.model, &self.optim)?;
        // A tied copy is stored once, under its original's name.
        let copies: Vec<String> = (self.model.tied_names().into_iter())
            .map(|(c, _)| c)
            .collect();
        (rank_state.moments).retain(|(name, _)| !copies.contains(name));
        rank_state.pieces.retain(|s| !copies.contains(&s.name));
        rank_state.params.retain(|p| !copies.contains(&p.name));
        let mut extra = serde_json::json!({
            "data": {
                "samples_consumed": step.saturating_mul(self.settings.global_batch),
                "order": "windows shuffled per epoch by train.seed; step s reads global batch s",
            },
            "rng": {
                "seed": self.settings.seed,
                "note": "dropout and masking streams are keyed by (seed, step, sample): the step is the whole RNG state",
            },
        });
        if let (Some(all), serde_json::Value::Object(user)) =
            (extra.as_object_mut(), policy.extra.clone())
        {
            all.extend(user);
        }
        if let Some(all) = extra.as_object_mut() {
            all.insert("optimizer".into(), self.settings.optimizer.manifest_entry());
        }
        // Outside `fit` (which claims the folders first) the lineage is the resumed one, or new.
        let run = self.lineage.written().unwrap_or_default();
        Ok((rank_state, extra, run))
    }

    /// `fit`'s save after the steps done: on this thread, or (asynchronously) started once the
    /// previous one is complete. Rank 0 logs what it cost the step.
    pub(crate) fn checkpoint_now(
        &mut self,
        policy: &CheckpointPolicy,
        progress: &Progress,
    ) -> Result<(), TrainError> {
        if !policy.asynchronous {
            let t = Instant::now();
            let dir = self.save_checkpoint(policy)?;
            self.log_save(progress, &dir, t.elapsed(), None);
            return Ok(());
        }
        self.complete_save(progress)?;
        let t = Instant::now();
        let pending = self.start_checkpoint(policy)?;
        let stall = t.elapsed();
        self.saving = Some(AsyncSave { pending, stall });
        Ok(())
    }

    /// After a step while an asynchronous save is in flight: every rank tells whether its
    /// writer is done (one small all-reduce), and when all are, the save is completed here,
    /// without waiting for any writer. Every rank must call it after the same steps.
    pub(crate) fn complete_save_if_written(
        &mut self,
        progress: &Progress,
    ) -> Result<(), TrainError> {
        let Some(flight) = self.saving.as_mut() else {
            return Ok(());
        };
        let t = Instant::now();
        let written = flight.pending.written_everywhere(self.grid);
        flight.stall += t.elapsed();
        if written? {
            self.complete_save(progress)?;
        }
        Ok(())
    }

    /// Completes the asynchronous save in flight, if any, waiting for the writers: before the
    /// next save, on a stop, and at the end of the run. Every rank must call it together.
    pub(crate) fn complete_save(&mut self, progress: &Progress) -> Result<(), TrainError> {
        let Some(AsyncSave { pending, stall }) = self.saving.take() else {
            return Ok(());
        };
        let t = Instant::now();
        let saved = pending.finish(self.grid)?;
        let stall = stall + t.elapsed();
        self.log_save(progress, &saved.dir, stall, Some(saved.write_time));
        Ok(())
    }

    /// Rank 0's line about a save: the time the training thread spent on it (`stall`), and
    /// the writer thread's write time when it was asynchronous.
    fn log_save(
        &self,
        progress: &Progress,
        dir: &Path,
        stall: Duration,
        written: Option<Duration>,
    ) {
        if self.grid.rank != 0 {
            return;
        }
        let stall = stall.as_secs_f64();
        let how = match written {
            Some(w) => format!("written in {:.2} s on the writer thread", w.as_secs_f64()),
            None => "written on the training thread".into(),
        };
        progress.log(&format!(
            "checkpoint: {} (stall {stall:.2} s, {how})",
            dir.display()
        ));
    }
}
