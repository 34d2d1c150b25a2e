//! The pipeline plan of a training config: stages, schedule and recomputation per stage.

use anyhow::{Result, bail};
use merak_burn::pipeline::{
    PipelinePlan, Recompute, ScheduleKind, activation_bytes_per_layer, balanced_partition,
    build_schedule, explicit_partition, kept_bytes_per_layer, stage_aware_recompute,
    unit_costs_gpt, validate,
};

use crate::config::Config;

/// Micro-batches per step on one DP rank.
pub fn micro_batches(cfg: &Config) -> usize {
    cfg.train.global_batch / cfg.parallel.dp.max(1) / cfg.micro_batch().max(1)
}

/// Builds and validates the pipeline plan of `cfg` (also for pp = 1, where it is one stage
/// running its micro-batches one after the other). Every error names the config key.
///
/// Recomputation comes from `parallel.stage_recompute` when it is set (a full stage recomputes
/// all its units; a selective one is handled by the rank's backend, see
/// [`selective_on_rank`]), otherwise from the `parallel.recompute` policy.
pub fn build_plan(cfg: &Config) -> Result<PipelinePlan> {
    let g = &cfg.model.gpt;
    let p = &cfg.parallel;
    let units = g.layers + 2;
    let stages = p.pp * p.virtual_stages;
    let kind: ScheduleKind = p
        .schedule
        .parse()
        .map_err(|e| anyhow::anyhow!("parallel.schedule: {e}"))?;
    let recompute: Recompute = p
        .recompute
        .parse()
        .map_err(|e| anyhow::anyhow!("parallel.recompute: {e}"))?;
    let partition = if p.stage_layers.is_empty() {
        let costs = unit_costs_gpt(g.layers, g.hidden, g.seq_len, g.vocab_size);
        balanced_partition(&costs, stages).map_err(|e| {
            anyhow::anyhow!(
                "parallel.pp = {} x parallel.virtual_stages = {}: {e}",
                p.pp,
                p.virtual_stages
            )
        })?
    } else {
        if p.stage_layers.len() != stages {
            bail!(
                "parallel.stage_layers has {} entries for {stages} stages (pp = {} x virtual_stages = {})",
                p.stage_layers.len(),
                p.pp,
                p.virtual_stages
            );
        }
        explicit_partition(&p.stage_layers, units).map_err(|e| {
            anyhow::anyhow!(
                "parallel.stage_layers = {:?} (units: embedding + {} layers + head = {units}): {e}",
                p.stage_layers,
                g.layers
            )
        })?
    };
    let m = micro_batches(cfg);
    // Interleaving with one stage per rank is plain 1F1B (a model with few layers may not have
    // units for more stages per rank).
    let kind = if kind == ScheduleKind::Interleaved && p.virtual_stages == 1 {
        ScheduleKind::OneFOneB
    } else {
        kind
    };
    let per_stage = &p.stage_recompute;
    let recompute_flags = if per_stage.is_empty() {
        match recompute {
            Recompute::Full | Recompute::StageAware => vec![true; stages],
            Recompute::None | Recompute::Selective => vec![false; stages],
        }
    } else {
        if per_stage.len() != stages {
            bail!(
                "parallel.stage_recompute has {} entries for {stages} stages",
                per_stage.len()
            );
        }
        per_stage.iter().map(|m| m == "full").collect()
    };
    let mut schedule = build_schedule(kind, p.pp, m, p.virtual_stages, &recompute_flags)
        .map_err(|e| anyhow::anyhow!("parallel.schedule = {:?}: {e}", p.schedule))?;
    let sizes = partition.sizes();
    let recompute_units = match recompute {
        _ if !per_stage.is_empty() => sizes
            .iter()
            .zip(&recompute_flags)
            .map(|(&size, &full)| if full { size } else { 0 })
            .collect(),
        Recompute::None | Recompute::Selective => vec![0; stages],
        Recompute::Full => sizes.clone(),
        Recompute::StageAware => {
            let in_flight: Vec<usize> = (0..stages).map(|s| schedule.max_in_flight(s)).collect();
            let micro = cfg.micro_batch();
            let act = activation_bytes_per_layer(g.seq_len, micro, g.hidden, g.heads, p.tp, 4.0);
            let kept = kept_bytes_per_layer(g.seq_len, micro, g.hidden, 4.0);
            let budget = if p.memory_budget_mb > 0.0 {
                p.memory_budget_mb * (1u64 << 20) as f64
            } else {
                let last = stages - 1;
                in_flight[last] as f64 * sizes[last] as f64 * act
            };
            stage_aware_recompute(&in_flight, &sizes, act, kept, budget)
        }
    };
    // Only stages that recompute something get the shifted-critical-path Recompute actions.
    if recompute == Recompute::StageAware && per_stage.is_empty() {
        let flags: Vec<bool> = recompute_units.iter().map(|&k| k > 0).collect();
        schedule = build_schedule(kind, p.pp, m, p.virtual_stages, &flags)
            .map_err(|e| anyhow::anyhow!("parallel.schedule = {:?}: {e}", p.schedule))?;
    }
    validate(&schedule).map_err(|e| anyhow::anyhow!("the {kind} schedule is invalid: {e}"))?;
    Ok(PipelinePlan {
        schedule,
        partition,
        recompute_units,
    })
}

/// Whether pipeline rank `pp_rank` runs with selective recomputation (Burn's balanced
/// checkpointing): the `parallel.recompute` policy says so, or one of its stages in
/// `parallel.stage_recompute` does.
pub fn selective_on_rank(cfg: &Config, pp_rank: usize) -> bool {
    let p = &cfg.parallel;
    if p.stage_recompute.is_empty() {
        return p.recompute == "selective";
    }
    p.stage_recompute
        .iter()
        .enumerate()
        .any(|(stage, mode)| stage % p.pp.max(1) == pp_rank && mode == "selective")
}
