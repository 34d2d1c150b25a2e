//! Saving a trainer's state as a sharded checkpoint.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::checkpoint::{self, RankState, state};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::experts::experts_apart;
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
        // Without ZeRO every DP replica holds the same state: the first one writes it. Under
        // ZeRO every DP rank of the first copy writes its slices.
        let mut moments = Vec::new();
        let mut slices = Vec::new();
        if self.sliced.is_some() {
            // Under hybrid sharding the other copies hold the same dense slices, but the
            // slices of experts held apart are cut over every rank holding those experts.
            let first_copy = grid.coords.dp < self.shard.size();
            let apart = !self.experts.is_empty() && experts_apart(grid);
            if first_copy || apart {
                slices = self.slices_to_write()?;
            }
            if !first_copy {
                slices.retain(|s| crate::moe::is_expert_param(&s.name));
            }
        } else if grid.coords.dp < grid.ep.size() {
            // The first expert-parallel group's other ranks write their experts' state.
            moments = self.optim.moments(&self.model)?;
            if grid.coords.dp != 0 {
                moments.retain(|(name, _)| crate::moe::is_expert_param(name));
            }
        }
        // A tied copy is stored once, under its original's name.
        let copies: Vec<String> = self
            .model
            .tied_names()
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        moments.retain(|(name, _)| !copies.contains(name));
        slices.retain(|s| !copies.contains(&s.name));
        let mut params = state::local_params(&self.model)?;
        params.retain(|p| !copies.contains(&p.name));
        if let Some(s) = self.sliced.as_ref().filter(|_| self.shards.is_some()) {
            // ZeRO-3: the model's parameters are empty; their values travel as slices.
            let shapes: HashMap<&str, &[usize]> = (s.params.iter())
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            for p in &mut params {
                p.shape = shapes
                    .get(p.name.as_str())
                    .map(|s| s.to_vec())
                    .unwrap_or_default();
                p.values.clear();
            }
        }
        let rank_state = RankState {
            params,
            moments,
            slices,
        };
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
        let run = (self.run.clone())
            .or_else(|| self.origin.as_ref().and_then(|o| o.run.clone()))
            .unwrap_or_default();
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
