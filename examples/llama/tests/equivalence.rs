//! The Llama example under dp=2, tp=2, pp=2 and dp x tp x pp = 2 x 2 x 2 equals one process:
//! the same losses at every step and the same final parameters (relative error <= 1e-5).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use merak_burn::checkpoint::FullState;
use merak_tests::{assert_same_training, run_training, run_with_deadline};

const BIN: &str = env!("CARGO_BIN_EXE_llama-train");
const TOL: f64 = 1e-5;

/// What a run reports: its losses, final parameters at full size, and its held-out
/// evaluation (loss, accuracy, next tokens predicted).
type Trained = (Vec<f64>, FullState, Held);

/// The held-out loss, the accuracy and the predicted next tokens, as `llama-train` prints them.
#[derive(Debug, PartialEq)]
struct Held {
    loss: f64,
    accuracy: String,
    next: String,
}

impl Held {
    fn parse(stdout: &str) -> Held {
        let line = (stdout.lines())
            .find_map(|l| l.strip_prefix("llama: held-out loss "))
            .unwrap_or_else(|| panic!("no held-out line:\n{stdout}"));
        let (loss, rest) = line.split_once(" accuracy ").expect("an accuracy");
        let (accuracy, next) = rest.split_once(", next tokens ").expect("next tokens");
        Held {
            loss: loss.parse().expect("a loss"),
            accuracy: accuracy.into(),
            next: next.into(),
        }
    }
}

/// Runs `llama-train` on `np` ranks (alone for 1) with `args`; returns its losses, final
/// parameters at full size and held-out evaluation.
fn train(np: usize, name: &str, args: &[&str]) -> Trained {
    let (losses, state, stdout) = train_printing(np, name, args);
    (losses, state, Held::parse(&stdout))
}

/// [`train`], also returning what it printed.
fn train_printing(np: usize, name: &str, args: &[&str]) -> (Vec<f64>, FullState, String) {
    let out = std::env::temp_dir().join(format!("merak-llama-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let trained = train_into(np, &out, args);
    let _ = std::fs::remove_dir_all(&out);
    trained
}

/// Runs `llama-train` on `np` ranks writing to `out`; its losses, final parameters and output.
fn train_into(np: usize, out: &Path, args: &[&str]) -> (Vec<f64>, FullState, String) {
    let run = run_training(BIN, np, out, args, Duration::from_secs(240));
    (run.losses, run.state, run.stdout)
}

/// Asserts that `got` (losses, parameters, held-out loss) equals the one-process run `want`
/// within [`TOL`], and that it predicts the same next tokens with the same accuracy.
fn assert_equal(name: &str, got: &Trained, want: &Trained) {
    let ((losses, state, held), (single, reference, held_single)) = (got, want);
    let err = (held.loss - held_single.loss).abs() / held_single.loss.abs();
    assert!(err <= TOL, "{name}: held-out {held:?} vs {held_single:?}");
    assert_eq!(
        (&held.accuracy, &held.next),
        (&held_single.accuracy, &held_single.next),
        "{name}"
    );
    assert_same_training(name, (losses, state), (single, reference), TOL);
}

/// With the output projection tied to the token embedding, the pipeline's last stage keeps a
/// copy of the table whose gradient the trainer sums with the embedding's: pp=2 and 2x2x2
/// (also under sequence parallelism) equal one process, and the checkpoint stores the table
/// once.
#[test]
fn a_tied_embedding_across_the_pipeline_equals_one_process() {
    let tie = ["--tie-embeddings"];
    let single = train(1, "tied-single", &tie);
    assert!(!single.1.params.contains_key("tied_table"));
    assert!(!single.1.params.keys().any(|k| k.starts_with("head.output")));
    for (np, name, args) in [
        (2, "tied-pp2", vec!["--pp", "2"]),
        (8, "tied-3d", vec!["--dp", "2", "--tp", "2", "--pp", "2"]),
        (
            8,
            "tied-3d-sp",
            vec!["--dp", "2", "--tp", "2", "--pp", "2", "--sequence-parallel"],
        ),
    ] {
        let args: Vec<&str> = tie.iter().copied().chain(args).collect();
        assert_equal(name, &train(np, name, &args), &single);
    }
}

/// A mixture of 16 experts (top-2) in every block, declared to the trainer
/// (`UnitModel::experts`), without expert parallelism: dp=4, tp=2 (experts whole on every TP
/// rank) and pp=2 equal one process. (Here every expert gets tokens on every rank in every
/// step; the case of an expert chosen on some ranks only is tested on the GPT, through the
/// same trainer.)
#[test]
fn a_mixture_of_experts_equals_one_process() {
    // Seed 10 keeps every token's second router score 1.9e-5 above its third: no tie that
    // rounding could flip.
    let moe = ["--experts", "16", "--top-k", "2", "--seed", "10"];
    let single = train(1, "moe-single", &moe);
    for (np, name, args) in [
        (4, "moe-dp4", vec!["--dp", "4"]),
        (2, "moe-tp2", vec!["--tp", "2"]),
        (2, "moe-pp2", vec!["--pp", "2"]),
    ] {
        let args: Vec<&str> = moe.iter().copied().chain(args).collect();
        assert_equal(name, &train(np, name, &args), &single);
    }
}

/// With the load-balancing loss on (computed per sequence) and each rank's micro-batch its
/// whole share (8 sequences on one process, 4 at dp 2, 1 under a pipeline: what `merak train`
/// does by default), dp=2 ep=2, tp=2 and pp=2 equal one process.
#[test]
fn a_balanced_mixture_at_whole_share_micro_batches_equals_one_process() {
    let moe = [
        "--experts",
        "16",
        "--top-k",
        "2",
        "--seed",
        "10",
        "--aux-loss",
        "0.02",
    ];
    let single = train(
        1,
        "aux-single",
        &[&moe[..], &["--micro-batch", "8"]].concat(),
    );
    for (np, name, args) in [
        (
            2,
            "aux-ep2",
            vec!["--dp", "2", "--ep", "2", "--micro-batch", "4"],
        ),
        (2, "aux-tp2", vec!["--tp", "2", "--micro-batch", "8"]),
        (2, "aux-pp2", vec!["--pp", "2", "--micro-batch", "1"]),
    ] {
        let args: Vec<&str> = moe.iter().copied().chain(args).collect();
        assert_equal(name, &train(np, name, &args), &single);
    }
}

/// dp=2, tp=2, pp=2, dp x tp x pp = 2 x 2 x 2, tp=2 and tp=2 x pp=2 under sequence
/// parallelism (the hidden states between the units split along the sequence, the norms'
/// gradients summed over the TP ranks), and cp=2, cp=2 x pp=2 and cp=2 x tp=2 with sequence
/// parallelism (each rank holding its zigzag share of every sequence, the attention a ring)
/// equal one process.
#[test]
fn every_layout_equals_one_process() {
    let want = train(1, "single", &[]);
    let single = &want.0;
    assert_eq!(single.len(), 6);
    assert!(single[5] < single[0] - 0.3, "the loss falls: {single:?}");
    assert!(want.2.loss < single[0], "held out: {:?}", want.2);
    let sp: &[&str] = &["--tp", "2", "--pp", "2", "--sequence-parallel"];
    let cp_sp: &[&str] = &["--cp", "2", "--tp", "2", "--sequence-parallel"];
    let layouts: [(usize, &str, &[&str]); 9] = [
        (2, "dp2", &["--dp", "2"]),
        (2, "tp2", &["--tp", "2"]),
        (2, "tp2-sp", &["--tp", "2", "--sequence-parallel"]),
        (2, "pp2", &["--pp", "2"]),
        (2, "cp2", &["--cp", "2"]),
        (4, "cp2pp2", &["--cp", "2", "--pp", "2"]),
        (4, "tp2pp2-sp", sp),
        (4, "cp2tp2-sp", cp_sp),
        (8, "dp2tp2pp2", &["--dp", "2", "--tp", "2", "--pp", "2"]),
    ];
    for (np, name, args) in layouts {
        assert_equal(name, &train(np, name, args), &want);
    }
}

/// With `--plan-auto` the planner picks the layout for 4 ranks from the units timed on this
/// backend (a proxy of the user's model, not GPT formulas), and the run still equals one
/// process.
#[test]
fn the_planned_layout_of_a_timed_model_equals_one_process() {
    let want = train(1, "auto-single", &[]);
    let (losses, state, stdout) = train_printing(4, "auto", &["--plan-auto"]);
    let planned = (stdout.lines())
        .find(|l| l.starts_with("llama: planned dp="))
        .unwrap_or_else(|| panic!("no plan printed:\n{stdout}"));
    let degree = |key: &str| -> usize {
        let field = (planned.split_whitespace())
            .find_map(|f| f.strip_prefix(key))
            .unwrap_or_else(|| panic!("{key} in {planned}"));
        field
            .parse()
            .unwrap_or_else(|_| panic!("{key} in {planned}"))
    };
    assert_eq!(
        degree("dp=") * degree("tp=") * degree("pp="),
        4,
        "{planned}"
    );
    assert_equal("auto", &(losses, state, Held::parse(&stdout)), &want);
}

/// The checkpoint holds every parameter of the model at full size (the embedding, every
/// block's projections, norms and the head), whatever the layout cut.
#[test]
fn the_checkpoint_of_a_3d_run_has_every_parameter_at_full_size() {
    let (_, state, _) = train(
        8,
        "names",
        &["--dp", "2", "--tp", "2", "--pp", "2", "--steps", "1"],
    );
    let cfg = merak_example_llama::LlamaConfig::tiny();
    let size = |n: &str| state.params.get(n).map(Vec::len);
    assert_eq!(size("embed.tokens.weight"), Some(cfg.vocab * cfg.hidden));
    for l in 0..cfg.layers {
        let p = |s: &str| format!("layers.{l}.{s}");
        assert_eq!(
            size(&p("attn.wq.linear.weight")),
            Some(cfg.hidden * cfg.hidden)
        );
        assert_eq!(size(&p("mlp.w2.linear.weight")), Some(cfg.ffn * cfg.hidden));
        assert_eq!(size(&p("attn_norm.gamma")), Some(cfg.hidden));
    }
    assert_eq!(
        size("head.output.linear.weight"),
        Some(cfg.hidden * cfg.vocab)
    );
}

/// Expert parallelism for a model trained through `merak_burn::run`: its blocks are built
/// with the rank's expert-parallel group (`UnitModel::layer_on`), each holding its share of
/// the 16 experts. dp=2 ep=2, dp=4 ep=4, dp=4 ep=2 and dp=2 ep=2 pp=2 equal one process, each
/// timing its token exchanges (`moe_exchange_s`, written only under ep > 1), and the ep=4
/// run's step-3 checkpoint resumes on one process where the uninterrupted run goes on.
#[test]
fn expert_parallelism_equals_one_process_and_resumes_on_one() {
    let moe = ["--experts", "16", "--top-k", "2", "--seed", "10"];
    let single = train(1, "ep-single", &moe);
    let dir = std::env::temp_dir().join(format!("merak-llama-ep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (np, name, args) in [
        (2, "ep2", vec!["--dp", "2", "--ep", "2"]),
        (
            4,
            "ep4",
            vec!["--dp", "4", "--ep", "4", "--checkpoint-every", "3"],
        ),
        (4, "dp4-ep2", vec!["--dp", "4", "--ep", "2"]),
        (4, "ep2-pp2", vec!["--dp", "2", "--ep", "2", "--pp", "2"]),
    ] {
        let args: Vec<&str> = moe.iter().copied().chain(args).collect();
        let out = dir.join(name);
        let (losses, state, stdout) = train_into(np, &out, &args);
        assert_equal(name, &(losses, state, Held::parse(&stdout)), &single);
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
        let exchanged = metrics
            .lines()
            .filter(|l| l.contains("\"moe_exchange_s\":"))
            .count();
        assert_eq!(
            exchanged, 6,
            "{name}: every step times its exchanges:\n{metrics}"
        );
    }
    let step3 = dir.join("ep4/checkpoints/step-00000003");
    let step3 = step3.to_str().expect("a UTF-8 path");
    let resume: Vec<&str> = moe.iter().copied().chain(["--resume", step3]).collect();
    let (losses, state, stdout) = train_into(1, &dir.join("resumed"), &resume);
    let want = (single.0[3..].to_vec(), single.1.clone(), single.2);
    assert_equal("resumed", &(losses, state, Held::parse(&stdout)), &want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek's auxiliary-loss-free balancing in a model trained through `merak_burn::run`
/// (`LayerUnit::balance_experts` moves each block's selection biases after a step by the whole
/// grid's loads): dp=2 ep=2, pp=2 (whose units are timed first, a pass whose routing is not
/// the first step's) and dp=4 route every step's tokens as one process does and train alike,
/// and the biases, parameters of the checkpoint, have moved.
#[test]
fn balancing_biases_of_a_unit_model_equal_one_process() {
    let biased = ["--experts", "16", "--top-k", "2", "--seed", "10"];
    let biased: Vec<&str> = biased
        .into_iter()
        .chain(["--bias-update-rate", "0.01"])
        .collect();
    let dir = std::env::temp_dir().join(format!("merak-llama-bias-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let routing = |name: &str| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join(name).join("metrics.jsonl")).expect("metrics");
        (text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()))
        .filter_map(|m| m.get("expert_tokens").cloned())
        .collect()
    };
    let (losses, state, stdout) = train_into(1, &dir.join("single"), &biased);
    let single = (losses, state, Held::parse(&stdout));
    let bias = &single.1.params["layers.0.moe.bias"];
    assert!(bias.iter().any(|&b| b != 0.0), "the biases moved: {bias:?}");
    assert_eq!(routing("single").len(), 6, "every step logs its routing");
    for (np, name, args) in [
        (2, "ep2", vec!["--dp", "2", "--ep", "2"]),
        (2, "pp2", vec!["--pp", "2"]),
        (4, "dp4", vec!["--dp", "4"]),
    ] {
        let args: Vec<&str> = biased.iter().copied().chain(args).collect();
        let (losses, state, stdout) = train_into(np, &dir.join(name), &args);
        assert_eq!(routing(name), routing("single"), "{name}: routing");
        assert_equal(name, &(losses, state, Held::parse(&stdout)), &single);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-process run checkpointed at step 3 and resumed under tp=2 x pp=2 ends where the
/// uninterrupted run ends: the same losses of steps 4 to 6, parameters and held-out results.
#[test]
fn a_run_resumed_under_another_layout_equals_the_uninterrupted_run() {
    let dir = std::env::temp_dir().join(format!("merak-llama-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (first, second) = (dir.join("first"), dir.join("second"));
    let (losses, state, stdout) = train_into(1, &first, &["--checkpoint-every", "3"]);
    let want = (losses[3..].to_vec(), state, Held::parse(&stdout));
    let step3 = first.join("checkpoints/step-00000003");
    let step3 = step3.to_str().expect("a UTF-8 path");
    let (losses, state, stdout) =
        train_into(4, &second, &["--tp", "2", "--pp", "2", "--resume", step3]);
    assert_equal("resumed", &(losses, state, Held::parse(&stdout)), &want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A layout of more ranks than were launched is refused before anything is built or written,
/// naming the ranks and the command, with exit status 2 (bad input, as `merak train`).
#[test]
fn a_layout_without_its_ranks_is_refused_before_anything_is_written() {
    let out = std::env::temp_dir().join(format!("merak-llama-refused-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = Command::new(BIN);
    cmd.args(["--dp", "2", "--tp", "2", "--out"]).arg(&out);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("mpirun -np 4"), "{}", run.stderr);
    assert!(!out.exists(), "{} was made", out.display());
}

/// Context and sequence parallelism that the sequences cannot take are refused on every rank
/// before anything is written, naming the key and the numbers: 30
/// tokens are not 2 cp = 4 zigzag chunks, and 33 are not a multiple of tp = 2 (exit status
/// 2, passed to `MPI_Abort`).
#[test]
fn uneven_context_and_sequence_splits_are_refused_before_anything_is_written() {
    let cases: [(&[&str], &str); 2] = [
        (&["--cp", "2", "--seq", "30"], "parallel.cp = 2"),
        (
            &["--tp", "2", "--sequence-parallel", "--seq", "33"],
            "parallel.sequence_parallel at parallel.tp = 2",
        ),
    ];
    for (args, key) in cases {
        let dir = merak_tests::fresh_folder("llama-uneven");
        let out = dir.join("run");
        let mut cmd = merak_tests::mpirun(2);
        cmd.arg(BIN).args(args).arg("--out").arg(&out);
        let run = run_with_deadline(cmd, Duration::from_secs(120));
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(key), "{args:?}: {}", run.stderr);
        assert!(!out.exists(), "{} was made", out.display());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A checkpoint whose experts moved selection biases (`--bias-update-rate`) is not exported as
/// a MixtralForCausalLM, which has no place for them: a non-zero exit naming the biases,
/// and nothing written.
#[test]
fn a_checkpoint_with_selection_biases_is_not_exported() {
    let dir = std::env::temp_dir().join(format!("merak-llama-bias-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let args = [
        "--experts",
        "4",
        "--bias-update-rate",
        "0.01",
        "--steps",
        "5",
    ];
    train_into(1, &dir.join("run"), &args);
    let hf = dir.join("hf");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_llama-export"));
    cmd.arg(dir.join("run/checkpoints")).arg(&hf);
    let run = run_with_deadline(cmd, Duration::from_secs(60));
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(run.stderr.contains("selection biases"), "{}", run.stderr);
    assert!(!hf.exists(), "{} was made", hf.display());
    let _ = std::fs::remove_dir_all(&dir);
}
