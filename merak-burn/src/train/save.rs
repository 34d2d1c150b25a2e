//! Saving a trainer's state as a sharded checkpoint.

use std::path::PathBuf;

use crate::checkpoint;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::{CheckpointPolicy, TrainError, Trainer};

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// Writes a checkpoint of the steps done so far under `policy.dir` (every rank of the grid
    /// must call it), keeping the newest `policy.keep`; returns its folder. The manifest holds
    /// `policy.extra`, the data position, the seed, and the optimizer with what its state
    /// holds (`optimizer`: a checkpoint resumes only into the same optimizer).
    pub fn save_checkpoint(&self, policy: &CheckpointPolicy) -> Result<PathBuf, TrainError> {
        let step = self.done;
        let grid = self.grid;
        // What this rank writes: without ZeRO the first data-parallel copy's whole state,
        // under ZeRO every rank of the first copy its chunks.
        let mut rank_state =
            (self.sync).rank_state(&self.model, &self.optim, &self.norm.experts)?;
        // A tied copy is stored once, under its original's name.
        let copies: Vec<String> = self
            .model
            .tied_names()
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        rank_state
            .moments
            .retain(|(name, _)| !copies.contains(name));
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
        Ok(checkpoint::save(
            &policy.dir,
            &run,
            step,
            policy.keep,
            &rank_state,
            extra,
            grid,
        )?)
    }
}
