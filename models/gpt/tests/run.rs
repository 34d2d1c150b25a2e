//! A GPT trains through `merak_burn::run`, the front door a model of your own takes: with the
//! plan given it builds and trains the model a trainer built by hand trains (the same losses,
//! bit for bit), and the planner's choice (`PlanChoice::Auto`) plans it from its shape.

use merak_burn::backend::CpuAutodiff;
use merak_burn::data::{CausalWindows, Dataset, SyntheticData};
use merak_burn::entry::{AutoPlan, PlanChoice, RunError, RunOptions};
use merak_burn::grid::ProcessGrid;
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::train::{RunOutput, TrainSettings, Trainer};
use merak_gpt::{Gpt, GptConfig};

type B = CpuAutodiff;

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        layers: 2,
        heads: 2,
        hidden: 16,
        seq_len: 8,
        dropout: 0.1,
        ..GptConfig::preset("tiny").expect("a preset")
    }
}

fn settings(cfg: &GptConfig) -> TrainSettings {
    TrainSettings::default()
        .with_steps(3)
        .with_global_batch(4)
        .with_seq_len(cfg.seq_len)
}

/// The losses rank 0 wrote to `out/metrics.jsonl`.
fn losses(out: &std::path::Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["loss"].as_f64())
        .collect()
}

#[test]
fn a_gpt_trains_through_run_as_a_trainer_built_by_hand_trains_it() -> Result<(), RunError> {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let cfg = config();
    let settings = settings(&cfg);
    // The synthetic sequences of `merak train`'s default data.
    let dataset = Dataset::Synthetic(SyntheticData::new(7, cfg.vocab_size));
    let data = CausalWindows {
        data: &dataset,
        global_batch: settings.global_batch,
        seq: cfg.seq_len,
    };
    let plan = ParallelPlan {
        micro_batch: 2,
        ..ParallelPlan::default()
    };
    let out = dir.path().join("run");
    let options = RunOptions::default().with_out(&out);
    let given = PlanChoice::Given(plan.clone());
    let report = merak_burn::run::<B, _>(&cfg, &given, &data, &settings, &options)?;
    let through_run = losses(&out);
    assert_eq!(through_run.len(), 3);
    assert_eq!(report.summary.steps, 3);

    // By hand: the whole model, its pipeline from the shape, the trainer.
    let device = Default::default();
    let grid = ProcessGrid::single();
    let model = Gpt::<B>::new(&cfg, settings.seed, grid.tp, &device)?;
    let pipeline = plan.pipeline(&cfg.shape(), settings.global_batch)?;
    let mut trainer = Trainer::new(
        &grid,
        &plan,
        pipeline,
        settings.clone(),
        model,
        device,
        false,
    )?;
    let mut by_hand = Vec::new();
    let output = RunOutput {
        dir: dir.path().join("by-hand"),
        progress: false,
        ..Default::default()
    };
    trainer.fit(&data, &output, &mut |m| by_hand.push(m.loss))?;
    assert_eq!(
        through_run, by_hand,
        "run trains the model the trainer trains"
    );

    // The planner's choice for one process, from the GPT's shape.
    let out = dir.path().join("auto");
    let options = RunOptions::default().with_out(&out);
    let auto = PlanChoice::Auto(AutoPlan::default());
    let report = merak_burn::run::<B, _>(&cfg, &auto, &data, &settings, &options)?;
    assert_eq!(report.plan.layout().world_size(), 1);
    let planned = losses(&out);
    assert_eq!(planned.len(), 3);
    for (a, b) in planned.iter().zip(&by_hand) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "{planned:?} vs {by_hand:?}"
        );
    }
    Ok(())
}
