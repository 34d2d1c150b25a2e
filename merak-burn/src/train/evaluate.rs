//! Evaluation and prediction under any layout: held-out samples through the pipeline without
//! gradients, the head's metric sums or per-sample outputs gathered on every rank.

use crate::comm::{Group, ReduceOp};
use crate::pipeline::{EvalValues, Evaluate, MicroBatch, PipelineError, PipelineModel};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::read_samples;
use crate::train::{BatchSource, TrainError, Trainer};

/// The head's outputs for held-out samples, one row per sample in sample order.
#[derive(Clone, Debug, PartialEq)]
pub struct Predictions {
    /// Samples (rows).
    pub rows: usize,
    /// Values per sample.
    pub width: usize,
    /// `rows * width` values, row-major.
    pub values: Vec<f32>,
}

impl Predictions {
    /// The outputs of sample `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.width..(i + 1) * self.width]
    }

    /// The index of the largest output of each sample (a classifier's predicted class).
    pub fn argmax(&self) -> Vec<usize> {
        (0..self.rows)
            .map(|i| {
                let row = self.row(i);
                (0..row.len())
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .unwrap_or(0)
            })
            .collect()
    }
}

/// One micro-batch's values from [`Executor::forward_eval`](crate::pipeline::Executor), `mb`
/// being its first sample (counted from the pass's first).
type Values = EvalValues;

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// The sums of the head's metrics ([`HeadUnit::metrics`](crate::parallelize::HeadUnit::metrics))
    /// over `batches` global batches of held-out samples, the same on every rank and for every
    /// layout (each data-parallel rank evaluates its share through the pipeline).
    pub fn evaluate(&self, data: &dyn BatchSource, batches: usize) -> Result<Vec<f64>, TrainError> {
        let values = self.eval_pass(data, batches, Evaluate::Metrics)?;
        let width = self.agreed_width(&values)?;
        let mut sums = vec![0.0f32; width];
        for v in &values {
            (sums.iter_mut().zip(&v.values)).for_each(|(s, x)| *s += x);
        }
        self.sum_over_stages_and_replicas(&mut sums)?;
        Ok(sums.into_iter().map(f64::from).collect())
    }

    /// The head's outputs ([`HeadUnit::predict`](crate::parallelize::HeadUnit::predict)) for
    /// the first `batches` global batches of held-out samples, one row per sample in sample
    /// order, on every rank.
    pub fn predict(
        &self,
        data: &dyn BatchSource,
        batches: usize,
    ) -> Result<Predictions, TrainError> {
        let values = self.eval_pass(data, batches, Evaluate::Predictions)?;
        let width = self.agreed_width(&values)?;
        let rows = batches * self.settings.global_batch;
        let mut all = vec![0.0f32; rows * width];
        // Under context parallelism every rank of a cp group predicts its samples alike (from
        // the whole sequences): the first one's count.
        let values = if self.grid.cp.rank() == 0 {
            &values[..]
        } else {
            &[]
        };
        for v in values {
            let (first, n) = (v.mb, v.shape[0]);
            all[first * width..(first + n) * width].copy_from_slice(&v.values);
        }
        self.sum_over_stages_and_replicas(&mut all)?;
        Ok(Predictions {
            rows,
            width,
            values: all,
        })
    }

    /// This rank's micro-batches of `batches` held-out global batches through the pipeline,
    /// the head returning `what`: the values of the micro-batches whose last stage is here.
    fn eval_pass(
        &self,
        data: &dyn BatchSource,
        batches: usize,
        what: Evaluate,
    ) -> Result<Vec<Values>, TrainError> {
        let (model, shape) = self.held_out_model()?;
        let mut out = Vec::new();
        for b in 0..batches {
            let micro = self.val_micro_batches(data, b)?;
            let values = self.executor.forward_eval(
                &model,
                self.sync.shards(),
                &micro,
                shape,
                &self.device,
                what,
            )?;
            out.extend(values.into_iter().map(|v| EvalValues {
                mb: micro[v.mb].first_sample,
                ..v
            }));
        }
        Ok(out)
    }

    /// The model without gradients (under ZeRO-3 with empty parameters, run with the shards)
    /// and the shape of the messages between stages, for a pass over held-out samples (in the
    /// run's precision); refused while the forwards of a next step are in flight (2BW's
    /// overlap).
    pub(crate) fn held_out_model(&self) -> Result<(M::InnerModule, [usize; 3]), TrainError> {
        crate::precision::set_precision(self.settings.precision);
        if let Some(step) = self.versions.ran_ahead.step() {
            let rank = self.grid.coords.pp;
            return Err(PipelineError::AheadInFlight {
                rank,
                step: step + 1,
            }
            .into());
        }
        // Under ZeRO-3 its parameters are empty: each unit is gathered when it runs.
        let model = self.model.valid();
        let shape = [
            self.parallel.micro_batch,
            self.settings.seq_len / model.sequence_parts(),
            model.hidden_size(),
        ];
        Ok((model, shape))
    }

    /// This data-parallel rank's micro-batches of held-out global batch `b`.
    pub(crate) fn val_micro_batches(
        &self,
        data: &dyn BatchSource,
        b: usize,
    ) -> Result<Vec<MicroBatch>, TrainError> {
        let global = self.settings.global_batch;
        let local = self.parallel.local_batch(global);
        let micro = self.parallel.micro_batch;
        (0..local / micro)
            .map(|m| {
                let first = b * global + self.grid.data_rank().0 * local + m * micro;
                let samples = read_samples(micro, self.done, || data.val_samples(first, micro))?;
                let samples = self.context_share(samples, self.done)?;
                Ok(MicroBatch {
                    samples,
                    weight: 1.0,
                    first_sample: first,
                })
            })
            .collect()
    }

    /// The width of the values, which only the last stage's ranks know, on every rank.
    fn agreed_width(&self, values: &[Values]) -> Result<usize, TrainError> {
        let mut width = [values.iter().map(|v| v.shape[1]).max().unwrap_or(0) as f32];
        self.grid
            .world
            .comm()?
            .all_reduce(&mut width, ReduceOp::Max)?;
        Ok(width[0] as usize)
    }

    /// Sums `values` over the pipeline stages (only the last one has them) and the
    /// data-parallel replicas (each has its samples'); tensor-parallel ranks hold copies.
    fn sum_over_stages_and_replicas(&self, values: &mut [f32]) -> Result<(), TrainError> {
        for group in [self.grid.pp, self.grid.dp] {
            sum_if(group, values)?;
        }
        Ok(())
    }
}

/// Sums `values` over `group` when it has more than one rank.
fn sum_if(group: Group, values: &mut [f32]) -> Result<(), TrainError> {
    if group.size() > 1 {
        group.comm()?.all_reduce(values, ReduceOp::Sum)?;
    }
    Ok(())
}
