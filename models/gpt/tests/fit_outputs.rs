//! `Trainer::fit` checks every path it will write before its first step: a checkpoint folder
//! that is a file fails at once, named, with no step run and no metrics written.

use merak_burn::backend::{CpuAutodiff, CpuDevice};
use merak_burn::data::{CausalWindows, Dataset, SyntheticData};
use merak_burn::grid::ProcessGrid;
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::train::{
    CheckpointPolicy, OutputError, RunOutput, TrainError, TrainSettings, Trainer,
};
use merak_gpt::{Gpt, GptConfig};

#[test]
fn a_checkpoint_folder_that_is_a_file_fails_before_the_first_step() {
    let root = std::env::temp_dir().join(format!("merak-fit-outputs-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let file = root.join("not-a-folder");
    std::fs::write(&file, b"x").unwrap();

    let cfg = GptConfig::preset("tiny").unwrap();
    let grid = ProcessGrid::single();
    let device = CpuDevice::default();
    let model = Gpt::<CpuAutodiff>::new(&cfg, 7, grid.tp, &device).unwrap();
    let parallel = ParallelPlan::default();
    let pipeline = parallel.pipeline(&cfg.shape(), 2).unwrap();
    let settings = TrainSettings {
        steps: 2,
        global_batch: 2,
        seq_len: cfg.seq_len,
        lr: 1e-3,
        min_lr: 1e-3,
        warmup_steps: 0,
        weight_decay: 0.0,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        grad_clip: 1.0,
        skip_nonfinite: false,
        seed: 7,
        val_every: 0,
        val_batches: 0,
        precision: Default::default(),
        optimizer: Default::default(),
    };
    let mut trainer =
        Trainer::new(&grid, &parallel, pipeline, settings, model, device, false).unwrap();
    let data = Dataset::Synthetic(SyntheticData::new(7, cfg.vocab_size));
    let windows = CausalWindows {
        data: &data,
        global_batch: 2,
        seq: cfg.seq_len,
    };
    let out = RunOutput {
        dir: root.join("run"),
        checkpoints: Some(CheckpointPolicy {
            dir: file.clone(),
            every: 1,
            at_end: true,
            keep: 0,
            extra: serde_json::Value::Null,
            asynchronous: false,
        }),
        trace: None,
        progress: false,
        stop: None,
        ..Default::default()
    };
    let err = trainer.fit(&windows, &out, &mut |_| {}).unwrap_err();
    assert!(
        matches!(&err, TrainError::Output(OutputError::IsAFile { path, .. }) if *path == file),
        "{err}"
    );
    assert!(err.to_string().contains("checkpoint folder"), "{err}");
    assert!(!root.join("run/metrics.jsonl").exists());
    std::fs::remove_dir_all(&root).unwrap();
}
