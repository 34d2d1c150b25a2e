//! The whole run: steps, validation, metrics, progress and checkpoints.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use crate::pipeline::PipelineModel;
use crate::tensor_parallel::ParallelBackend;
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
}

impl<B, M> Trainer<'_, B, M>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
    M::InnerModule: PipelineModel<B::InnerBackend>,
{
    /// Runs the remaining steps on `data`. Rank 0 writes `metrics.jsonl` (appending after a
    /// resumed checkpoint's step) and shows progress; `on_step` sees every step's metrics on
    /// every rank; checkpoints follow `out.checkpoints`. At the end rank 0 writes
    /// `memory.json`, and the trace when `out.trace` asks for one.
    pub fn fit(
        &mut self,
        data: &dyn BatchSource,
        out: &RunOutput,
        on_step: &mut dyn FnMut(&StepMetrics),
    ) -> Result<Summary, TrainError> {
        let t0 = Instant::now();
        let (start, steps) = (self.done, self.settings.steps);
        let metrics_path = out.dir.join("metrics.jsonl");
        let mut metrics = self.metrics_writer(&metrics_path, start)?;
        let progress = Progress::new(self.grid.rank == 0 && out.progress, start, steps);
        let (mut final_loss, mut skipped, mut total_time) = (f64::NAN, 0, 0.0);
        while self.done < steps {
            let ts = Instant::now();
            let faults = process::minor_faults();
            let outcome = self.step(data)?;
            if let Some(grad_norm) = outcome.grad_norm {
                let val_loss = (self.settings.validates_after(outcome.step))
                    .then(|| self.validation_loss(data))
                    .transpose()?;
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
            self.save_if_due(out, &progress)?;
        }
        progress.finish();
        report_memory(
            self.grid,
            self.executor.plan(),
            self.max_in_flight,
            &out.dir,
        )?;
        if let Some(path) = &out.trace {
            write_trace(path, self.executor.take_trace(), self.grid)?;
        }
        Ok(Summary {
            steps,
            final_loss,
            mean_tokens_per_s: (self.settings.tokens_per_step() * (steps - start)) as f64
                / f64::max(total_time, 1e-9),
            wall_s: t0.elapsed().as_secs_f64(),
            skipped,
        })
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
        }
    }

    /// Saves a checkpoint when `out.checkpoints` asks for one after the steps done.
    fn save_if_due(&self, out: &RunOutput, progress: &Progress) -> Result<(), TrainError> {
        let Some(policy) = out.checkpoints.as_ref() else {
            return Ok(());
        };
        if !policy.due(self.done, self.settings.steps) {
            return Ok(());
        }
        let t = Instant::now();
        let dir = self.save_checkpoint(policy)?;
        if self.grid.rank == 0 {
            let secs = t.elapsed().as_secs_f64();
            progress.log(&format!("checkpoint: {} ({secs:.2}s)", dir.display()));
        }
        Ok(())
    }
}
