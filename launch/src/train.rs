//! `merak train` on the library's trainer: the config mapped onto [`TrainSettings`], the data
//! set seen through the model's objective (causal or masked), checkpoints to resume.

use std::path::Path;

use anyhow::Result;
use merak_bert::{BertConfig, mask_tokens};
use merak_burn::checkpoint::{Checkpoint, FullState};
use merak_burn::data::{CausalWindows, DocumentMasked};
use merak_burn::entry::{InitWeights, PlanChoice, RunModel, RunOn, RunOptions, Trained, run_on};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::TrainBackend;
pub use merak_burn::train::Summary;
use merak_burn::train::{BatchSource, ExistingRun, RunFile, SourceError, TokenSource, Windows};

use crate::config::Config;
use crate::data::Source;

/// What the model learns from a window of tokens.
pub enum Objective {
    /// Next-token prediction (GPT).
    Causal,
    /// Masked-token prediction (BERT): 15% of the positions, masked 80/10/10 from the seed.
    Masked(BertConfig),
}

impl Objective {
    /// Turns causal windows of `seq` tokens into the model's inputs and targets; `stream(i)`
    /// names the random stream of window `i` (global, so every layout agrees).
    fn apply(
        &self,
        w: Windows,
        seq: usize,
        seed: u64,
        stream: impl Fn(usize) -> String,
    ) -> Windows {
        match self {
            Objective::Causal => w,
            Objective::Masked(cfg) => {
                let mut out = Windows::default();
                for (i, window) in w.inputs.chunks(seq).enumerate() {
                    let (a, b) = mask_tokens(window, seq, cfg, seed, &stream(i));
                    out.inputs.extend(a);
                    out.targets.extend(b);
                }
                out
            }
        }
    }
}

/// A checkpoint to continue from, read and verified before training starts.
pub struct Resume {
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its tensors at full size.
    pub state: FullState,
}

/// Where checkpoints of this run go.
pub fn checkpoint_root(cfg: &Config, out: &Path) -> std::path::PathBuf {
    if cfg.checkpoint.dir.is_empty() {
        out.join("checkpoints")
    } else {
        std::path::PathBuf::from(&cfg.checkpoint.dir)
    }
}

/// How a run is set up besides its config.
pub struct RunSpec<'a> {
    /// The output folder.
    pub out: &'a Path,
    /// The parallel plan of the config.
    pub parallel: &'a ParallelPlan,
    /// Write a Chrome trace of every rank's actions here.
    pub trace: Option<&'a Path>,
    /// What to do with folders that hold another run (`--replace`, `--branch`).
    pub existing: ExistingRun,
    /// Pretrained weights to start from (`--init-from`).
    pub init: Option<InitWeights>,
    /// Stop after the current step on SIGTERM, SIGINT or SIGUSR1 and checkpoint.
    pub signals: bool,
}

/// The config file `merak train` writes into its output folder.
pub const CONFIG_FILE: &str = "config.toml";
/// The charts `merak train` may draw into its output folder at the end (loss, throughput,
/// memory per rank, pipeline timeline: [`crate::plot`]).
pub const CHARTS: [&str; 5] = crate::plot::FILES;

/// The names of `merak train`'s own files in its output folder (besides the trainer's): its
/// config and every chart it may draw.
pub fn own_file_names() -> Vec<String> {
    std::iter::once(CONFIG_FILE)
        .chain(CHARTS)
        .map(str::to_string)
        .collect()
}

/// The library's run options of `cfg` as `spec` says: its checkpoint policy (the config in
/// every manifest), trace, folder policy, `merak train`'s own files (the config and the
/// charts), the pretrained weights, the signal handlers and the watchdog.
fn run_options(cfg: &Config, spec: RunSpec<'_>) -> Result<RunOptions> {
    let c = &cfg.checkpoint;
    let config = toml::to_string(cfg)?;
    Ok(RunOptions {
        out: Some(spec.out.to_path_buf()),
        checkpoint_dir: Some(checkpoint_root(cfg, spec.out)),
        checkpoint_every: c.every,
        checkpoint_at_end: c.at_end,
        keep_checkpoints: c.keep,
        checkpoint_async: c.asynchronous,
        manifest_extra: serde_json::json!({ "config": config }),
        trace: spec.trace.map(Path::to_path_buf),
        existing: spec.existing,
        init: spec.init,
        signals: spec.signals,
        comm_timeout_s: cfg.train.comm_timeout_s,
        files: std::iter::once(RunFile {
            name: CONFIG_FILE.into(),
            contents: Some(config.into_bytes()),
        })
        .chain(CHARTS.map(|name| RunFile {
            name: name.into(),
            contents: None,
        }))
        .collect(),
        stragglers: merak_burn::train::StragglerRule {
            fraction: cfg.train.straggler_fraction,
            steps: cfg.train.straggler_steps,
        },
        ..RunOptions::default()
    })
}

/// The config's data set seen through the model's objective.
pub struct ObjectiveData<'a> {
    /// The data set's causal windows.
    pub windows: CausalWindows<'a>,
    /// What the model learns from them.
    pub objective: &'a Objective,
    /// Seed of the masking streams.
    pub seed: u64,
}

impl TokenSource for ObjectiveData<'_> {
    fn train_windows(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError> {
        let w = self.windows.train_windows(step, first, count)?;
        let stream = |i| format!("mlm/{step}/{}", first + i);
        Ok(self.objective.apply(w, self.windows.seq, self.seed, stream))
    }

    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        let w = self.windows.val_windows(first, count)?;
        let stream = |i| format!("mlm-val/{}", first + i);
        Ok(self.objective.apply(w, self.windows.seq, self.seed, stream))
    }
}

/// Trains `model` (a GPT or a BERT config) on the config's data seen through `objective`,
/// on `launch`'s ranks, through the library's front door,
/// [`run_on`](merak_burn::entry::run_on), under the config's plan; rank 0 writes
/// `out/metrics.jsonl`; checkpoints follow `[checkpoint]`. Returns the trained part and the
/// grid it trained on.
pub fn train<B, K, M>(
    launch: RunOn<'_, B>,
    cfg: &Config,
    data: &Source,
    model: &M,
    objective: &Objective,
    spec: RunSpec<'_>,
) -> Result<Trained<M::Part>>
where
    B: TrainBackend,
    M: RunModel<B, K>,
{
    let windows = CausalWindows {
        data,
        global_batch: cfg.train.global_batch,
        seq: cfg.model.gpt.seq_len,
    };
    let source = DocumentMasked {
        source: ObjectiveData {
            windows,
            objective,
            seed: cfg.train.seed,
        },
        eot: data.eot(),
    };
    // With data.document_mask the samples carry each token's document and position in it.
    let source: &dyn BatchSource = match cfg.data.document_mask {
        true => &source,
        false => &source.source,
    };
    let plan = PlanChoice::Given(spec.parallel.clone());
    let options = run_options(cfg, spec)?;
    let settings = cfg.train_settings();
    Ok(run_on(launch, model, &plan, source, &settings, &options)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use burn::tensor::{Tensor, TensorData};
    use merak_burn::checkpoint::state::local_params;
    use merak_burn::grid::ProcessGrid;
    use merak_gpt::Gpt;

    type B = merak_burn::backend::CpuAutodiff;

    /// Runs `merak train`'s loop in this process (one rank) and returns its losses and model.
    fn run_loop(sets: &[&str], name: &str) -> (Vec<f64>, Gpt<B>, Config) {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = crate::config::load(None, &sets).unwrap();
        let data = crate::data::open(&cfg).unwrap();
        let out = std::env::temp_dir().join(format!("merak-unit-{name}-{}", std::process::id()));
        let parallel = cfg.parallel_plan();
        let spec = RunSpec {
            out: &out,
            parallel: &parallel,
            trace: None,
            existing: ExistingRun::Refuse,
            init: None,
            signals: false,
        };
        let launch = RunOn::<B>::new(None);
        let model = cfg.model.gpt.clone();
        let trained = train(launch, &cfg, &data, &model, &Objective::Causal, spec)
            .unwrap()
            .part;
        let losses = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        let _ = std::fs::remove_dir_all(&out);
        (losses, trained, cfg)
    }

    const SETS: [&str; 7] = [
        "train.steps=4",
        "train.weight_decay=0",
        "train.grad_clip=0",
        "train.min_lr=3e-3",
        "train.warmup_steps=0",
        "checkpoint.at_end=false",
        "parallel.schedule=2bw",
    ];

    #[test]
    fn two_bw_follows_the_delayed_weight_rule() {
        let (losses, trained, cfg) = run_loop(&SETS, "2bw");
        // The reference: a plain Burn loop applying V_t = V_{t-1} - AdamW(grad(V_{t-2})).
        let device = Default::default();
        let grid = ProcessGrid::single();
        let data = crate::data::open(&cfg).unwrap();
        let (gb, seq) = (cfg.train.global_batch, cfg.model.gpt.seq_len);
        let mut current = Gpt::<B>::new(&cfg.model.gpt, cfg.train.seed, grid.tp, &device).unwrap();
        let mut stale = current.clone();
        let mut optim = AdamWConfig::new()
            .with_beta_1(cfg.train.beta1 as f32)
            .with_beta_2(cfg.train.beta2 as f32)
            .with_epsilon(cfg.train.eps as f32)
            .with_weight_decay(0.0)
            .init::<B, Gpt<B>>();
        let mut reference = Vec::new();
        for step in 0..cfg.train.steps {
            let (x, y) = data.train_batch(step, gb, 0, gb, seq);
            let x = Tensor::<B, 2, burn::tensor::Int>::from_data(
                TensorData::new(x, [gb, seq]),
                &device,
            );
            let y = Tensor::<B, 2, burn::tensor::Int>::from_data(
                TensorData::new(y, [gb, seq]),
                &device,
            );
            let loss = stale.loss(x, y);
            reference.push(f64::from(loss.clone().into_scalar()));
            let grads = GradientsParams::from_grads(loss.backward(), &stale);
            let next_stale = current.clone();
            current = optim.step(cfg.train.lr, current, grads);
            stale = next_stale;
        }
        for (i, (a, b)) in losses.iter().zip(&reference).enumerate() {
            assert!(
                ((a - b) / b).abs() <= 1e-6,
                "step {}: merak {a}, reference {b}",
                i + 1
            );
        }
        let (ours, theirs) = (
            local_params(&trained).unwrap(),
            local_params(&current).unwrap(),
        );
        for (p, q) in ours.iter().zip(&theirs) {
            assert_eq!(p.name, q.name);
            let num: f64 = p
                .values
                .iter()
                .zip(&q.values)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = q.values.iter().map(|b| f64::from(*b).powi(2)).sum();
            assert!(num.sqrt() <= 1e-5 * den.sqrt().max(1e-12), "{}", p.name);
        }
        // The delay is real: plain 1F1B takes other steps.
        let mut plain = SETS;
        plain[6] = "parallel.schedule=1f1b";
        let (plain_losses, _, _) = run_loop(&plain, "1f1b");
        assert_eq!(plain_losses[0], losses[0], "the first step uses V0 in both");
        assert!(
            plain_losses[1..]
                .iter()
                .zip(&losses[1..])
                .all(|(a, b)| a != b),
            "{plain_losses:?} vs {losses:?}"
        );
    }
}
