//! The whole run: steps, validation, metrics, progress and checkpoints.

use std::time::Instant;

use crate::comm::watchdog::blocked_time;
use crate::kernels::FusedOps;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::attempts;
use crate::train::goodput::Goodput;
use crate::train::injected;
use crate::train::progress::Progress;
use crate::train::report::{report_memory, write_trace};
use crate::train::stragglers::{Stragglers, gather_hosts};
use crate::train::{
    BatchSource, MetricsWriter, RunOutput, StepMetrics, StepOutcome, TrainError, Trainer, process,
};

/// What a finished run reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Steps of the run (the last step's number).
    pub steps: usize,
    /// Loss of the last step that was not skipped.
    pub final_loss: f64,
    /// Mean tokens per second over the steps this run did.
    pub mean_tokens_per_s: f64,
    /// Wall time in seconds.
    pub wall_s: f64,
    /// Steps skipped for a non-finite loss.
    pub skipped: usize,
    /// Whether the run stopped early on a [`StopRequest`](crate::train::StopRequest) (after
    /// step `steps`, checkpointed when the run has a checkpoint policy).
    pub stopped: bool,
    /// On rank 0: what the run's wall time went to over all its attempts (`attempts.jsonl`).
    pub goodput: Option<Goodput>,
}

/// What [`Trainer::fit`] watches besides the steps.
struct RunWatch {
    /// Failures injected for tests ([`injected`]).
    faults: Vec<injected::Injected>,
    /// Rank 0's straggler detector.
    stragglers: Stragglers,
    /// Checkpoint saves so far.
    saves: usize,
    /// Seconds the training thread spent in them.
    save_s: f64,
}

impl RunWatch {
    /// Runs `save` (which says whether it started or wrote a save), counting its time as the
    /// saves' whatever it did (completing an asynchronous save in flight is a save's time too).
    fn timed_save(
        &mut self,
        save: impl FnOnce() -> Result<bool, TrainError>,
    ) -> Result<bool, TrainError> {
        let t = Instant::now();
        let saved = save()?;
        self.saves += usize::from(saved);
        self.save_s += t.elapsed().as_secs_f64();
        Ok(saved)
    }
}

impl std::fmt::Display for Summary {
    /// `6 steps, final loss 5.22491, 12345 tokens/s, 0.2 s` (and `, stopped early`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} steps, final loss {:.5}, {:.0} tokens/s, {:.1} s",
            self.steps, self.final_loss, self.mean_tokens_per_s, self.wall_s
        )?;
        if self.stopped {
            write!(f, ", stopped early")?;
        }
        Ok(())
    }
}

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// Runs the remaining steps on `data`. Rank 0 writes `metrics.jsonl` (appending after a
    /// resumed checkpoint's step) and shows progress; `on_step` sees every step's metrics on
    /// every rank; checkpoints follow `out.checkpoints`. At the end rank 0 writes
    /// `memory.json`, and the trace when `out.trace` asks for one. Every path of `out` is
    /// checked for writing before the first step ([`RunOutput::check`]), and the folders are
    /// claimed for this run's lineage ([`claim`](mod@super::claim)): a folder that holds another
    /// run, or later checkpoints of the resumed one, is refused as `out.existing` says.
    pub fn fit(
        &mut self,
        data: &dyn BatchSource,
        out: &RunOutput,
        on_step: &mut dyn FnMut(&StepMetrics),
    ) -> Result<Summary, TrainError> {
        let t0 = Instant::now();
        // Held until the run returns.
        let _locks = self.start(out)?;
        // Building, sharding and resuming are done: their high-water mark.
        let startup_alloc = process::alloc_peak_bytes();
        let (start, steps) = (self.done, self.settings.steps);
        let mut watch = self.run_watch(out)?;
        let metrics_path = out.dir.join("metrics.jsonl");
        let mut metrics = self.metrics_writer(&metrics_path, start)?;
        let progress = Progress::new(self.grid.rank == 0 && out.progress, start, steps);
        let (mut final_loss, mut skipped, mut total_time) = (f64::NAN, 0, 0.0);
        let mut stopped = false;
        // Under 2BW a step may run the next one's first forwards: whether to stop is agreed
        // before such a step, so that none runs ahead of a stop.
        let overlapping = self.overlaps_steps();
        while self.done < steps {
            let (ts, blocked) = (Instant::now(), blocked_time());
            injected::before_step(&watch.faults, self.grid.rank, self.done + 1, start);
            let (faults, reads) = (process::minor_faults(), crate::host_read::count());
            let stop_first = overlapping && self.stop_agreed(out)?;
            // No step runs ahead of a validation pass (after step `done + 1`, 1-based); the
            // trainer itself overlaps only where a step is left.
            let next_follows = !stop_first && !self.settings.validates_after(self.done + 1);
            let outcome = self.step_overlapping(data, next_follows)?;
            let reads = crate::host_read::count().saturating_sub(reads);
            if let Some(grad_norm) = outcome.grad_norm {
                let val_loss = (self.settings.validates_after(outcome.step))
                    .then(|| self.validation_loss_unless_stopped(data, out.stop.as_ref()))
                    .transpose()?
                    .flatten();
                let dt = ts.elapsed().as_secs_f64();
                total_time += dt;
                final_loss = outcome.loss;
                let mut m = self.metrics(&outcome, grad_norm, dt, (faults, reads), val_loss);
                self.time_ranks(&mut m, (blocked_time() - blocked).as_secs_f64(), &mut watch)?;
                if let Some(w) = metrics.as_mut() {
                    w.write(&m).map_err(TrainError::io(&metrics_path))?;
                    progress.step(&m, steps, total_time, self.settings.tokens_per_step());
                }
                on_step(&m);
            } else {
                skipped += 1;
            }
            let saved = watch.timed_save(|| self.save_if_due(out, &progress))?;
            let stop = if overlapping {
                stop_first
            } else {
                self.done < steps && self.stop_agreed(out)?
            };
            if self.done < steps && stop {
                if !saved {
                    watch.timed_save(|| self.save_now(out, &progress).map(|()| true))?;
                }
                stopped = true;
                break;
            }
        }
        // An asynchronous save still being written is completed before the run ends (its
        // time is the save's).
        watch.timed_save(|| self.complete_save(&progress).map(|()| false))?;
        progress.finish();
        self.write_reports(out, startup_alloc)?;
        let goodput = self.end_attempt(out, stopped, &watch)?;
        Ok(Summary {
            steps: self.done,
            final_loss,
            mean_tokens_per_s: (self.settings.tokens_per_step() * (self.done - start)) as f64
                / f64::max(total_time, 1e-9),
            wall_s: t0.elapsed().as_secs_f64(),
            skipped,
            stopped,
            goodput,
        })
    }

    /// What the run watches besides its steps: the injected failures ([`injected`]), the
    /// stragglers (every rank's host, gathered once), the saves' time.
    fn run_watch(&self, out: &RunOutput) -> Result<RunWatch, TrainError> {
        let world = self.grid.world;
        let hosts = match world.size() > 1 {
            true => gather_hosts(world.comm()?.as_ref())?,
            false => Vec::new(),
        };
        Ok(RunWatch {
            faults: injected::from_env()?,
            stragglers: Stragglers::new(out.stragglers, hosts),
            saves: 0,
            save_s: 0.0,
        })
    }

    /// Puts every rank's step time and time blocked in communication (this rank's:
    /// `blocked_s`) into `m`, gathered over the world (rank 0 names stragglers from them).
    fn time_ranks(
        &self,
        m: &mut StepMetrics,
        blocked_s: f64,
        watch: &mut RunWatch,
    ) -> Result<(), TrainError> {
        let world = self.grid.world;
        if world.size() == 1 {
            m.rank_comm_wait_s = Some(vec![blocked_s]);
            m.rank_step_s = Some(vec![m.step_time_s]);
            return Ok(());
        }
        let mut all = vec![0.0f32; 2 * world.size()];
        let mine = [m.step_time_s as f32, blocked_s as f32];
        world.comm()?.all_gather(&mine, &mut all)?;
        let step: Vec<f64> = all.iter().step_by(2).map(|&v| f64::from(v)).collect();
        let wait: Vec<f64> = all
            .iter()
            .skip(1)
            .step_by(2)
            .map(|&v| f64::from(v))
            .collect();
        if self.grid.rank == 0 {
            let computing: Vec<f64> = step.iter().zip(&wait).map(|(s, w)| s - w).collect();
            for line in watch.stragglers.observe(&computing) {
                tracing::warn!("{line}");
            }
        }
        m.rank_step_s = Some(step);
        m.rank_comm_wait_s = Some(wait);
        Ok(())
    }

    /// Rank 0 records this attempt's end in `attempts.jsonl`; the run's goodput so far.
    fn end_attempt(
        &self,
        out: &RunOutput,
        stopped: bool,
        watch: &RunWatch,
    ) -> Result<Option<Goodput>, TrainError> {
        if self.grid.rank != 0 {
            return Ok(None);
        }
        let attempts = attempts::Attempts::read(&out.dir).map_err(TrainError::io(&out.dir))?;
        let attempt = attempts.0.last().map_or(1, |a| a.number);
        let now = attempts::now_s();
        let event = attempts::AttemptEvent::Ended {
            attempt,
            at_s: now,
            steps: self.done,
            stopped,
            save_s: watch.save_s,
            saves: watch.saves,
        };
        attempts::append(&out.dir, &event).map_err(TrainError::io(&out.dir))?;
        Ok(Goodput::of(&out.dir, now))
    }

    /// Writes `memory.json` (with `startup_alloc`, the allocation peak before the first step)
    /// and the trace when `out.trace` asks for one.
    fn write_reports(
        &mut self,
        out: &RunOutput,
        startup_alloc: Option<u64>,
    ) -> Result<(), TrainError> {
        report_memory(
            self.grid,
            self.executor.plan(),
            self.executor.max_in_flight(),
            self.state_bytes(),
            startup_alloc,
            &out.dir,
        )?;
        if let Some(path) = &out.trace {
            write_trace(path, self.executor.take_trace(), self.grid)?;
        }
        Ok(())
    }

    /// Rank 0's metrics file at `path`: a new one, or the old one cut after step `start` on
    /// resume.
    fn metrics_writer(
        &self,
        path: &std::path::Path,
        start: usize,
    ) -> Result<Option<MetricsWriter>, TrainError> {
        if self.grid.rank != 0 {
            return Ok(None);
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(TrainError::io(dir))?;
        }
        let w = if start > 0 {
            MetricsWriter::resume(path, start)
        } else {
            MetricsWriter::create(path)
        };
        w.map(Some).map_err(TrainError::io(path))
    }

    /// The step's logged loss parts by name; `None` for a model without them.
    fn loss_parts(&self, o: &StepOutcome) -> Option<std::collections::BTreeMap<String, f64>> {
        let names = self.model.loss_parts();
        (!names.is_empty()).then(|| names.into_iter().zip(o.loss_parts.clone()).collect())
    }

    /// The metrics record of a step that took `dt` seconds, from the minor faults before it
    /// and the host reads it made.
    fn metrics(
        &self,
        o: &StepOutcome,
        grad_norm: f64,
        dt: f64,
        (faults_before, host_reads): (u64, u64),
        val_loss: Option<f64>,
    ) -> StepMetrics {
        StepMetrics {
            step: o.step,
            loss: o.loss,
            lr: o.lr,
            grad_norm,
            tokens_per_s: self.settings.tokens_per_step() as f64 / dt,
            step_time_s: dt,
            dp_exposed_comm_s: o.dp.exposed_wait.as_secs_f64(),
            dp_overlapped_buckets: o.dp.overlapped_buckets,
            dp_buckets: o.dp.buckets,
            minor_faults: process::minor_faults().saturating_sub(faults_before),
            host_reads,
            device_reserved_bytes: <B::InnerBackend as FusedOps>::memory_reserved(&self.device),
            val_loss,
            loss_parts: self.loss_parts(o),
            aux_loss: o.aux_loss,
            expert_tokens: self.routing.as_ref().map(|r| r.expert_tokens.clone()),
            expert_max_load: self.routing.as_ref().map(|r| r.max_load()),
            router_margin: self.routing.as_ref().map(|r| r.router_margin),
            moe_exchange_s: (self.routing.as_ref())
                .filter(|_| self.grid.ep.size() > 1)
                .map(|r| r.exchange_s),
            dropped_tokens: (self.routing.as_ref())
                .filter(|_| self.model.experts().is_some())
                .map(|r| r.dropped)
                .filter(|&d| d > 0),
            rank_step_s: None,
            rank_comm_wait_s: None,
        }
    }

    /// Saves a checkpoint when `out.checkpoints` asks for one after the steps done; whether it
    /// did. First completes an asynchronous save whose writers are all done.
    fn save_if_due(&mut self, out: &RunOutput, progress: &Progress) -> Result<bool, TrainError> {
        self.complete_save_if_written(progress)?;
        match &out.checkpoints {
            Some(policy) if policy.due(self.done, self.settings.steps) => {
                self.save_now(out, progress)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Whether any rank was asked to stop (a collective over the world when `out.stop` is
    /// set, so that every rank stops after the same step).
    fn stop_agreed(&self, out: &RunOutput) -> Result<bool, TrainError> {
        match &out.stop {
            Some(stop) => self.stop_agreed_now(stop),
            None => Ok(false),
        }
    }

    /// Saves a checkpoint now (or starts an asynchronous one), when the run has a checkpoint
    /// policy.
    fn save_now(&mut self, out: &RunOutput, progress: &Progress) -> Result<(), TrainError> {
        match out.checkpoints.as_ref() {
            Some(policy) => self.checkpoint_now(policy, progress),
            None => Ok(()),
        }
    }
}
