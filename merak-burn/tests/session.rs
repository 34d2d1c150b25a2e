//! The one-call API (`merak_burn::entry`): every rank builds its units with the weights one
//! process gets; `merak_burn::run` refuses a model whose units do not fit together before
//! anything trains or is written, naming the unit and the shapes, trains one that fits, and
//! hands the parameter groups of its options to the optimizer. Burn's random generator is
//! global to the process, so the checks run one after the other in a single test of their own
//! binary (a test drawing weights on another thread would change the draws).

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use merak_burn::backend::{CpuAutodiff, CpuAutodiff as Cpu, CpuDevice};
use merak_burn::batch::{Batch, BatchError, Samples, TARGETS, TOKENS};
use merak_burn::checkpoint::state;
use merak_burn::entry::{
    ModelDims, PlanChoice, RunError, RunOptions, UnitModel, build_units, unit_seed,
};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::parallelize::{EmbedUnit, HeadUnit, LayerUnit, Linear, LossSum, TpPlan, TpStyle};
use merak_burn::pipeline::PipelineModel;
use merak_burn::tensor_parallel::ParallelBackend;
use merak_burn::train::{BatchSource, SourceError, TokenSource, TrainSettings, Windows};

#[derive(Module, Debug)]
struct Tokens<B: Backend> {
    table: Embedding<B>,
}

#[derive(Module, Debug)]
struct Block<B: Backend> {
    proj: Linear<B>,
    /// Whether the block scales its output by the side input `scale`.
    #[module(skip)]
    scaled: bool,
    /// Whether the block, as a head, returns its loss's mean as one term.
    #[module(skip)]
    mean_loss: bool,
}

impl<B: Backend> EmbedUnit<B> for Tokens<B> {
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        self.table.forward(batch.int(TOKENS))
    }
    fn table(&self) -> Option<(&Param<Tensor<B, 2>>, &'static str)> {
        Some((&self.table.weight, "table.weight"))
    }
}

impl<B: ParallelBackend> LayerUnit<B> for Block<B> {
    fn forward(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let y = self.proj.forward(x);
        match self.scaled {
            true => y * batch.float::<2>("scale").unsqueeze_dim(2),
            false => y,
        }
    }
}

impl<B: ParallelBackend> HeadUnit<B> for Block<B> {
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let (sum, terms) = (
            self.proj.forward(x).powi_scalar(2).sum(),
            batch.loss_terms(),
        );
        match self.mean_loss {
            // A head that takes its mean for a sum of one term.
            true => LossSum::new(sum / terms as f32, 1),
            false => LossSum::new(sum, terms),
        }
    }
}

/// The test model's head declaring three metric names for its two (default) sums.
#[derive(Module, Debug)]
struct Misnamed<B: Backend> {
    head: Block<B>,
}

impl<B: ParallelBackend> HeadUnit<B> for Misnamed<B> {
    const METRICS: &'static [&'static str] = &["loss", "loss_terms", "accuracy"];
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        self.head.loss(x, batch)
    }
}

/// The test model's head logging its loss's mean as a part (`LOSS_PARTS`), adding it `parts`
/// times.
#[derive(Module, Debug)]
struct Parted<B: Backend> {
    head: Block<B>,
    #[module(skip)]
    parts: usize,
}

impl<B: ParallelBackend> HeadUnit<B> for Parted<B> {
    const LOSS_PARTS: &'static [&'static str] = &["mean"];
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let loss = self.head.loss(x, batch);
        let mean = loss.clone().into_sum() / loss.terms() as f32;
        (0..self.parts).fold(loss, |l, _| l.with_part_mean(mean.clone()))
    }
}

/// The test model's head reading the field `ahead` (the targets one position on, `-1` at
/// each sequence's end) that it adds to the whole samples (`prepare_samples`), and logging the
/// share of its positions that have one (3 of 4: 0.75) as the part `ahead`.
#[derive(Module, Debug)]
struct Ahead<B: Backend> {
    head: Block<B>,
}

impl<B: ParallelBackend> HeadUnit<B> for Ahead<B> {
    const LOSS_PARTS: &'static [&'static str] = &["ahead"];
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let loss = self.head.loss(x, batch);
        let ahead = batch.int::<2>("ahead").greater_equal_elem(0).float().sum();
        let share = ahead / loss.terms() as f32;
        loss.with_part_mean(share)
    }
    fn prepare_samples(&self, samples: Samples) -> Result<Samples, BatchError> {
        let targets = samples.ints(TARGETS)?.to_vec();
        let seq = targets.len() / samples.count.max(1);
        let ahead: Vec<i64> = (0..targets.len())
            .map(|i| match (i + 1) % seq {
                0 => -1,
                _ => targets[i + 1],
            })
            .collect();
        samples.with_int("ahead", &[seq], ahead)
    }
}

/// A [`Model`] with another head, `$head` built from the model's head block by `$wrap`.
macro_rules! with_head {
    ($doc:literal, $name:ident, $head:ident, $wrap:expr) => {
        #[doc = $doc]
        struct $name(Model, usize);

        impl<B: ParallelBackend> UnitModel<B> for $name {
            type Embed = Tokens<B>;
            type Layer = Block<B>;
            type Head = $head<B>;
            fn dims(&self) -> ModelDims {
                UnitModel::<B>::dims(&self.0)
            }
            fn embed(&self, device: &B::Device) -> Tokens<B> {
                self.0.embed(device)
            }
            fn layer(&self, index: usize, device: &B::Device) -> Block<B> {
                self.0.layer(index, device)
            }
            fn head(&self, device: &B::Device) -> $head<B> {
                $wrap(self.0.head(device), self.1)
            }
            fn tp_plan(&self) -> TpPlan {
                UnitModel::<B>::tp_plan(&self.0)
            }
        }
    };
}

with_head!(
    "[`Model`] with the [`Misnamed`] head.",
    MisnamedModel,
    Misnamed,
    |head, _| Misnamed { head }
);
with_head!(
    "[`Model`] with the [`Ahead`] head.",
    AheadModel,
    Ahead,
    |head, _| Ahead { head }
);
with_head!(
    "[`Model`] with the [`Parted`] head adding its part `.1` times.",
    PartedModel,
    Parted,
    |head, parts| Parted { head, parts }
);

/// A model of width 4 whose block returns `block_out` features and whose token table is
/// `table_width` wide.
#[derive(Clone)]
struct Model {
    block_out: usize,
    table_width: usize,
    tied: bool,
    /// Whether the blocks read the side input `scale`.
    scaled: bool,
    /// Whether the head returns the mean of its loss as one term.
    mean_loss: bool,
}

impl<B: ParallelBackend> UnitModel<B> for Model {
    type Embed = Tokens<B>;
    type Layer = Block<B>;
    type Head = Block<B>;
    fn dims(&self) -> ModelDims {
        // Blocks without attention.
        ModelDims::new(2, 4).with_outputs(8)
    }
    fn embed(&self, device: &B::Device) -> Tokens<B> {
        Tokens {
            table: EmbeddingConfig::new(8, self.table_width).init(device),
        }
    }
    fn layer(&self, _index: usize, device: &B::Device) -> Block<B> {
        Block {
            proj: LinearConfig::new(4, self.block_out).init(device).into(),
            scaled: self.scaled,
            mean_loss: false,
        }
    }
    fn head(&self, device: &B::Device) -> Block<B> {
        Block {
            proj: LinearConfig::new(4, 4).init(device).into(),
            scaled: false,
            mean_loss: self.mean_loss,
        }
    }
    fn tp_plan(&self) -> TpPlan {
        TpPlan::new([("proj", TpStyle::Column)])
    }
    fn tie_embeddings(&self) -> bool {
        self.tied
    }
}

/// Token `i % 8` everywhere.
struct Data;

impl TokenSource for Data {
    fn train_windows(&self, _: usize, first: usize, count: usize) -> Result<Windows, SourceError> {
        let ids: Vec<i64> = (0..count * 4).map(|i| ((first + i) % 8) as i64).collect();
        Ok(Windows {
            inputs: ids.clone(),
            targets: ids,
        })
    }
    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        self.train_windows(0, first, count)
    }
}

fn run(model: &Model, out: &std::path::Path, plan: ParallelPlan) -> Result<(), RunError> {
    run_with(model, RunOptions::default().with_out(out), plan)
}

fn settings() -> TrainSettings {
    TrainSettings::default()
        .with_steps(2)
        .with_global_batch(2)
        .with_seq_len(4)
}

fn run_with(model: &Model, options: RunOptions, plan: ParallelPlan) -> Result<(), RunError> {
    let settings = settings();
    let plan = PlanChoice::Given(ParallelPlan {
        micro_batch: 1,
        ..plan
    });
    merak_burn::run::<CpuAutodiff, _>(model, &plan, &Data, &settings, &options).map(|_| ())
}

/// [`run`] under `plan` as given (its micro-batch included).
fn run_plan<M>(model: &M, out: &std::path::Path, plan: ParallelPlan) -> Result<(), RunError>
where
    M: UnitModel<CpuAutodiff>,
    merak_burn::entry::UnitsOf<CpuAutodiff, M>: merak_burn::pipeline::TrainModel<CpuAutodiff>,
{
    let options = RunOptions::default().with_out(out);
    let plan = PlanChoice::Given(plan);
    merak_burn::run::<CpuAutodiff, _>(model, &plan, &Data, &settings(), &options).map(|_| ())
}

#[test]
fn units_that_do_not_fit_together_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let out = dir.path().join("run");
    let cases = [
        (
            Model {
                block_out: 3,
                table_width: 4,
                tied: false,
                scaled: false,
                mean_loss: false,
            },
            "block 0 returns [1, 4, 3]",
        ),
        (
            Model {
                block_out: 4,
                table_width: 5,
                tied: false,
                scaled: false,
                mean_loss: false,
            },
            "the first unit returns [1, 4, 5]",
        ),
    ];
    for (model, says) in cases {
        let err = run(&model, &out, ParallelPlan::default()).expect_err("refused");
        let text = err.to_string();
        assert!(matches!(err, RunError::UnitShape { .. }), "{text}");
        assert!(text.contains(says) && text.contains("[1, 4, 4]"), "{text}");
        assert!(!out.exists(), "{} was made", out.display());
    }
    // A micro-batch that does not split the batch: refused before a sample is run.
    let odd = ParallelPlan {
        micro_batch: 0,
        ..ParallelPlan::default()
    };
    let err = run_plan(&fits(false), &out, odd).expect_err("refused");
    assert!(err.to_string().contains("micro_batch = 0"), "{err}");
    // More ranks than this one process: refused, naming the command.
    let fits = Model {
        block_out: 4,
        table_width: 4,
        tied: true,
        scaled: false,
        mean_loss: false,
    };
    let two = ParallelPlan {
        dp: 2,
        ..ParallelPlan::default()
    };
    let err = run(&fits, &out, two).expect_err("refused");
    assert!(err.to_string().contains("mpirun -np 2"), "{err}");
    assert!(!out.exists());
    // Blocks asking for a side input the data does not have: refused naming the field.
    let scaled = Model {
        scaled: true,
        mean_loss: false,
        ..self::fits(false)
    };
    let err = run(&scaled, &out, ParallelPlan::default()).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, RunError::UnitPanic { .. }), "{text}");
    assert!(
        text.contains("block 0") && text.contains("no field `scale`"),
        "{text}"
    );
    assert!(!out.exists());
    // A head that takes a mean for a sum: refused, naming both counts.
    let mean = Model {
        mean_loss: true,
        ..self::fits(false)
    };
    let err = run(&mean, &out, ParallelPlan::default()).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, RunError::LossTerms { .. }), "{text}");
    assert!(
        text.contains("counts 1 loss terms") && text.contains("has 4"),
        "{text}"
    );
    assert!(!out.exists());
    // A head naming three metrics for two sums: refused, naming both counts.
    let misnamed = MisnamedModel(fits.clone(), 0);
    let err = run_plan(&misnamed, &out, ParallelPlan::default()).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, RunError::MetricNames { .. }), "{text}");
    assert!(
        text.contains("metrics are 2 sums, but HeadUnit::METRICS names [\"loss\", \"loss_terms\", \"accuracy\"]"),
        "{text}"
    );
    assert!(!out.exists());
    // A head adding two logged parts for the one it names: refused, naming both.
    let parted = PartedModel(fits.clone(), 2);
    let err = run_plan(&parted, &out, ParallelPlan::default()).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, RunError::LossParts { .. }), "{text}");
    assert!(
        text.contains("adds 2 logged parts, but HeadUnit::LOSS_PARTS names [\"mean\"]"),
        "{text}"
    );
    assert!(!out.exists());
    a_heads_loss_parts_are_logged(dir.path());
    a_head_prepares_its_fields_from_whole_samples(dir.path());
    side_inputs_reach_every_block(dir.path());
    // The same model, fitting, trains and checkpoints.
    run(&fits, &out, ParallelPlan::default()).expect("trains");
    assert!(out.join("metrics.jsonl").exists() && out.join("checkpoints/latest").exists());
    param_groups_of_the_options_reach_the_optimizer(dir.path());
    a_head_without_metrics_reports_its_held_out_loss(dir.path());
    a_rank_that_builds_some_units_gets_the_weights_one_process_gets();
    a_tied_head_alone_on_its_rank_holds_a_copy_of_the_first_units_table();
    a_user_model_is_profiled_unit_by_unit();
}

/// A head logging its loss's mean as the part `mean`: each step's metrics record it under
/// `loss_parts`, equal to the loss.
fn a_heads_loss_parts_are_logged(dir: &std::path::Path) {
    let out = dir.join("parted");
    run_plan(&PartedModel(fits(false), 1), &out, ParallelPlan::default()).expect("trains");
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    let records: Vec<serde_json::Value> = (text.lines())
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    assert_eq!(records.len(), 2);
    for r in &records {
        let (loss, part) = (r["loss"].as_f64(), r["loss_parts"]["mean"].as_f64());
        let (loss, part) = (loss.expect("a loss"), part.expect("the part"));
        assert!((part - loss).abs() <= 1e-6 * loss.abs(), "{r}");
    }
}

/// A head's own fields (`HeadUnit::prepare_samples`) reach it, in the sample check before
/// training and in every step: the part it computes from them is logged at its value.
fn a_head_prepares_its_fields_from_whole_samples(dir: &std::path::Path) {
    let out = dir.join("ahead");
    run_plan(&AheadModel(fits(false), 0), &out, ParallelPlan::default()).expect("trains");
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    for line in text.lines() {
        let r: serde_json::Value = serde_json::from_str(line).expect("JSON");
        assert_eq!(r["loss_parts"]["ahead"].as_f64(), Some(0.75), "{r}");
    }
}

/// The model of width 4 whose units fit, tied or not.
fn fits(tied: bool) -> Model {
    Model {
        block_out: 4,
        table_width: 4,
        tied,
        scaled: false,
        mean_loss: false,
    }
}

/// A rule freezing the blocks (learning-rate scale 0) leaves them as built while the rest
/// moves.
fn param_groups_of_the_options_reach_the_optimizer(dir: &std::path::Path) {
    use merak_burn::checkpoint::Checkpoint;
    use merak_burn::train::ParamGroup;

    let model = Model {
        block_out: 4,
        table_width: 4,
        tied: false,
        scaled: false,
        mean_loss: false,
    };
    let out = dir.join("frozen");
    let options = RunOptions::default()
        .with_out(&out)
        .with_param_groups(|p| ParamGroup {
            lr_scale: if p.name.starts_with("layers.") {
                0.0
            } else {
                1.0
            },
            ..p.default
        });
    run_with(&model, options, ParallelPlan::default()).expect("trains");
    let trained = (Checkpoint::open(&out.join("checkpoints")))
        .and_then(|c| c.read_full())
        .expect("a checkpoint");
    let device = Default::default();
    let built = build_units::<CpuAutodiff, _>(&model, settings().seed, &device, |_| true);
    let built = state::local_params(&built.expect("built")).expect("readable");
    for p in built {
        let after = &trained.params[&p.name];
        let frozen = p.name.starts_with("layers.");
        assert_eq!(after == &p.values, frozen, "{}: frozen {frozen}", p.name);
    }
}

/// A head with neither metrics nor predictions (the test model's): its held-out loss is
/// reported as `[summed loss, loss terms]`, and predictions asked of it are refused before the
/// first step (they used to be refused only after the last one).
fn a_head_without_metrics_reports_its_held_out_loss(dir: &std::path::Path) {
    let plan = PlanChoice::Given(ParallelPlan {
        micro_batch: 1,
        ..ParallelPlan::default()
    });
    let out = dir.join("held-out");
    let mut options = RunOptions::default().with_out(&out);
    options.eval_batches = 2;
    let report =
        merak_burn::run::<CpuAutodiff, _>(&fits(false), &plan, &Data, &settings(), &options)
            .expect("trains and evaluates");
    let metrics = report.metrics.expect("evaluated");
    // 2 global batches of 2 windows of 4 tokens: 16 loss terms.
    let names: Vec<&str> = metrics.iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["loss", "loss_terms"], "{metrics:?}");
    assert_eq!(metrics.sum("loss_terms"), Some(16.0), "{metrics:?}");
    let loss = metrics.sum("loss").expect("a loss");
    assert!(loss.is_finite() && loss > 0.0, "{metrics:?}");
    let out = dir.join("no-predictions");
    let mut options = RunOptions::default().with_out(&out);
    options.predict_batches = 1;
    let err = merak_burn::run::<CpuAutodiff, _>(&fits(false), &plan, &Data, &settings(), &options)
        .expect_err("a head that predicts nothing");
    assert!(err.to_string().contains("HeadUnit::predict"), "{err}");
    assert!(!out.exists(), "refused after training: {}", out.display());
}

/// The parameters of `model` by checkpoint name.
fn params<M: burn::module::AutodiffModule<Cpu>>(
    model: &M,
) -> std::collections::HashMap<String, Vec<f32>> {
    (state::local_params(model).expect("readable").into_iter())
        .map(|p| (p.name, p.values))
        .collect()
}

fn a_rank_that_builds_some_units_gets_the_weights_one_process_gets() {
    let device = CpuDevice::default();
    let all = params(&build_units(&fits(false), 7, &device, |_| true).expect("built"));
    assert_eq!(all.len(), 1 + 2 * 2 + 2, "{:?}", all.keys());
    // A middle rank holding block 1 (unit 2), another holding the head (unit 3).
    for held in [vec![2], vec![3], vec![0, 1]] {
        let part = build_units(&fits(false), 7, &device, |u| held.contains(&u));
        let part = params(&part.expect("built"));
        assert!(!part.is_empty());
        for (name, values) in &part {
            assert_eq!(
                Some(values),
                all.get(name),
                "{name} on a rank holding {held:?}"
            );
        }
        assert!(part.len() < all.len());
    }
    // Another seed, other weights; another unit, another seed.
    let other = params(&build_units(&fits(false), 8, &device, |_| true).expect("built"));
    assert_ne!(
        other.get("layers.0.proj.linear.weight"),
        all.get("layers.0.proj.linear.weight")
    );
    assert_ne!(
        all.get("layers.0.proj.linear.weight"),
        all.get("layers.1.proj.linear.weight")
    );
    assert_ne!(unit_seed(7, 1), unit_seed(7, 2));
}

fn a_tied_head_alone_on_its_rank_holds_a_copy_of_the_first_units_table() {
    let device = CpuDevice::default();
    let all = build_units(&fits(true), 3, &device, |_| true).expect("built");
    let table = params(&all)
        .remove("embed.table.weight")
        .expect("the table");
    let last = build_units(&fits(true), 3, &device, |u| u == 3).expect("built");
    assert!(last.embed.is_none() && last.head.is_some());
    assert_eq!(params(&last).get("tied_table"), Some(&table));
    assert!(last.tied_embedding().is_some());
    let middle = build_units::<Cpu, _>(&fits(true), 3, &device, |u| u == 2).expect("built");
    assert!(middle.embed.is_none() && middle.tied_table.is_none());
}

/// The library's profiler (`merak profile` uses it) times a Burn user's model too: each unit's
/// passes, the fraction of its time a lone rank needs (1 on one rank) and the optimizer step.
fn a_user_model_is_profiled_unit_by_unit() {
    use merak_burn::comm::Communicator;
    use merak_burn::probe;
    let device = CpuDevice::default();
    let model = build_units::<Cpu, _>(&fits(false), 7, &device, |_| true).expect("built");
    let samples = Data.train_samples(0, 0, 2).expect("two samples");
    let alone = None::<&dyn Communicator>;
    let passes = probe::time_units(&model, &samples, &device, alone, 2).expect("timed");
    for pass in [passes.embedding, passes.layer, passes.head] {
        for t in [pass.forward_s, pass.backward_s] {
            assert!(t > 0.0 && t.is_finite(), "{passes:?}");
        }
    }
    let fraction = probe::alone_fraction(&model, &samples, &device, alone, 1).expect("timed");
    assert_eq!(fraction, 1.0);
    let per_param = probe::time_optimizer(model, &samples, &device, alone, 1).expect("timed");
    assert!(per_param > 0.0 && per_param < 1e-3, "{per_param}");
}

/// [`Data`] with the side input `scale` (`[seq]` per sample): one where `halve` is false,
/// 0.5 otherwise.
struct Scaled {
    halve: bool,
}

impl BatchSource for Scaled {
    fn train_samples(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Samples, SourceError> {
        let scale = vec![if self.halve { 0.5 } else { 1.0 }; count * 4];
        Ok(Data
            .train_samples(step, first, count)?
            .with_float("scale", &[4], scale)?)
    }
    fn val_samples(&self, first: usize, count: usize) -> Result<Samples, SourceError> {
        self.train_samples(0, first, count)
    }
}

/// A side input reaches every block: blocks scaling by one train as blocks that ignore it,
/// blocks halving their output do not.
fn side_inputs_reach_every_block(dir: &std::path::Path) {
    let loss = |model: &Model, data: &dyn BatchSource, name: &str| {
        let plan = PlanChoice::Given(ParallelPlan::default());
        let options = RunOptions::default().with_out(dir.join(name));
        let report = merak_burn::run::<CpuAutodiff, _>(model, &plan, data, &settings(), &options);
        report.expect("trains").summary.final_loss
    };
    let scaled = Model {
        scaled: true,
        mean_loss: false,
        ..fits(false)
    };
    let plain = loss(&fits(false), &Data, "plain");
    assert_eq!(loss(&scaled, &Scaled { halve: false }, "ones"), plain);
    let halved = loss(&scaled, &Scaled { halve: true }, "halves");
    assert!(
        (halved - plain).abs() > 1e-3 * plain.abs(),
        "{halved} vs {plain}"
    );
}
