//! What [`Trainer::fit`] does before its first step: the run's folders are locked
//! ([`run_lock`](mod@super::run_lock)), every path it will write is checked, the folders are
//! claimed for its lineage ([`claim`](mod@super::claim)), and the caller's files are written.

use crate::checkpoint::{RunId, plain_name, write_file_atomically};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::{RunLocks, RunOutput, TrainError, Trainer, attempts, claim};

/// The most bytes of a run id (ids are at most 64 characters).
const ID_BYTES: usize = 64;

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// Locks `out`'s folders (rank 0 holds the locks it returns, or joins those its process
    /// or launcher holds), checks its paths on every rank, claims its folders (every rank
    /// checks, rank 0 changes what the claim asks and writes the caller's files) and agrees
    /// on the lineage.
    pub(crate) fn start(&mut self, out: &RunOutput) -> Result<RunLocks, TrainError> {
        let rank = self.grid.rank;
        let world = self.grid.world.comm()?;
        // A file where a folder goes is named as such before a lock is made in it.
        super::not_a_file(&out.dir, "output folder")?;
        if let Some(c) = &out.checkpoints {
            super::not_a_file(&c.dir, "checkpoint folder")?;
        }
        let mut folders = vec![out.dir.as_path()];
        folders.extend(out.checkpoints.as_ref().map(|c| c.dir.as_path()));
        let locks = RunLocks::on_rank_zero(world.as_ref(), &folders)?;
        out.check(rank)?;
        if let Some(f) = out.files.iter().find(|f| !plain_name(&f.name)) {
            return Err(TrainError::BadRunFile(f.name.clone()));
        }
        let own = out.own_files();
        let claim = claim::claim(
            out.folders(&own),
            self.lineage.origin.as_ref(),
            out.existing,
        )?;
        // Every rank has checked before rank 0 changes anything.
        world.barrier()?;
        if rank == 0 {
            for line in claim.apply()? {
                tracing::warn!("{line}");
            }
            for f in &out.files {
                if let Some(bytes) = &f.contents {
                    write_file_atomically(&out.dir.join(&f.name), bytes)?;
                }
            }
            self.begin_attempt(&out.dir, world.size())?;
        }
        let text = world.broadcast_text(claim.run.as_str(), ID_BYTES, 0)?;
        self.lineage.run = Some(RunId::try_from(text).unwrap_or(claim.run));
        Ok(locks)
    }

    /// Rank 0 records in `out`'s `attempts.jsonl` the failure of the run's previous attempt
    /// when nothing says how it ended (its ranks died), then this attempt's start.
    fn begin_attempt(&self, out: &std::path::Path, ranks: usize) -> Result<(), TrainError> {
        let io = TrainError::io(out);
        if let Some(attempts::AttemptEvent::Failed {
            attempt,
            step,
            lost_steps,
            ..
        }) = attempts::record_failure(out, self.done, None).map_err(io)?
        {
            tracing::warn!(
                "the run's attempt {attempt} ended without finishing, in step {step}: \
                 recorded as failed ({lost_steps} steps lost)"
            );
        }
        let io = TrainError::io(out);
        let number = attempts::Attempts::read(out).map_err(io)?.0.len() + 1;
        let started = attempts::AttemptEvent::Started {
            attempt: number,
            at_s: attempts::now_s(),
            from_step: self.done,
            ranks,
        };
        attempts::append(out, &started).map_err(TrainError::io(out))
    }
}
