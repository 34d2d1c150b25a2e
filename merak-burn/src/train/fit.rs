//! The whole run: steps, validation, metrics, progress and checkpoints.

use std::time::Instant;

use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::progress::Progress;
use crate::train::report::{report_memory, write_trace};
use crate::train::{
    BatchSource, MetricsWriter, RunOutput, StepMetrics, StepOutcome, TrainError, Trainer, process,
};

/// What a finished run reports.
#[derive(Clone, Copy, Debug, PartialEq)]
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
        let metrics_path = out.dir.join("metrics.jsonl");
        let mut metrics = self.metrics_writer(&metrics_path, start)?;
        let progress = Progress::new(self.grid.rank == 0 && out.progress, start, steps);
        let (mut final_loss, mut skipped, mut total_time) = (f64::NAN, 0, 0.0);
        let mut stopped = false;
        // Under 2BW a step may run the next one's first forwards: whether to stop is agreed
        // before such a step, so that none runs ahead of a stop.
        let overlapping = self.overlaps_steps();
        while self.done < steps {
            let ts = Instant::now();
            let faults = process::minor_faults();
            let stop_first = overlapping && self.stop_agreed(out)?;
            // No step runs ahead of a validation pass (after step `done + 1`, 1-based); the
            // trainer itself overlaps only where a step is left.
            let next_follows = !stop_first && !self.settings.validates_after(self.done + 1);
            let outcome = self.step_overlapping(data, next_follows)?;
            if let Some(grad_norm) = outcome.grad_norm {
                let val_loss = (self.settings.validates_after(outcome.step))
                    .then(|| self.validation_loss_unless_stopped(data, out.stop.as_ref()))
                    .transpose()?
                    .flatten();
                let dt = ts.elapsed().as_secs_f64();
                total_time += dt;
                final_loss = outcome.loss;
                let m = self.metrics(&outcome, grad_norm, dt, faults, val_loss);
                if let Some(w) = metrics.as_mut() {
                    w.write(&m).map_err(TrainError::io(&metrics_path))?;
                    progress.step(&m, steps, total_time, self.settings.tokens_per_step());
                }
                on_step(&m);
            } else {
                skipped += 1;
            }
            let saved = self.save_if_due(out, &progress)?;
            let stop = if overlapping {
                stop_first
            } else {
                self.done < steps && self.stop_agreed(out)?
            };
            if self.done < steps && stop {
                if !saved {
                    self.save_now(out, &progress)?;
                }
                stopped = true;
                break;
            }
        }
        // An asynchronous save still being written is completed before the run ends.
        self.complete_save(&progress)?;
        progress.finish();
        self.write_reports(out, startup_alloc)?;
        Ok(Summary {
            steps: self.done,
            final_loss,
            mean_tokens_per_s: (self.settings.tokens_per_step() * (self.done - start)) as f64
                / f64::max(total_time, 1e-9),
            wall_s: t0.elapsed().as_secs_f64(),
            skipped,
            stopped,
        })
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

    /// The metrics record of a step that took `dt` seconds.
    fn metrics(
        &self,
        o: &StepOutcome,
        grad_norm: f64,
        dt: f64,
        faults_before: u64,
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
            val_loss,
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
