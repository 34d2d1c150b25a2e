//! End-to-end tests of the mixture of experts (`[model.moe]`) and expert parallelism
//! (`parallel.ep`) under real `mpirun`: the dropless MoE GPT (shared expert, Switch and z
//! auxiliary losses, dropout) at ep 2 and 4, ep with more data parallelism, with tensor and
//! sequence parallelism, with pipeline parallelism (1F1B, and DualPipeV, whose pairs compute weight gradients
//! while their exchanges wait) and with context parallelism, and the
//! capacity-factor mode, each train the same model as one process, at a fixed micro-batch and
//! at the default one (a rank's whole share, which changes with the layout: the experts are
//! balanced per sequence); balancing per micro-batch is kept as an option. Every case first
//! checks that the routing decisions are those of one process (each step's per-expert token
//! counts equal, with a margin between every token's k-th and k+1-th router score), then the
//! losses and parameters at the usual tolerance. Muon steps every expert as one process does.
//! A checkpoint saved at ep = 4 resumes at ep = 1; bad settings fail before training.

mod common;
use common::*;
use merak_tests::{Run, run_with_deadline};

/// The tiny GPT with 4 experts (top-2, width 32), one shared expert, both auxiliary losses
/// and dropout.
const MOE: [&str; 14] = [
    "--set",
    "model.moe.experts=4",
    "--set",
    "model.moe.top_k=2",
    "--set",
    "model.moe.expert_hidden=32",
    "--set",
    "model.moe.shared_experts=1",
    "--set",
    "model.moe.z_loss=0.001",
    "--set",
    "model.dropout=0.1",
    "--set",
    "train.seed=7",
];

/// The smallest gap between a token's k-th and k+1-th router score that the runs must keep:
/// far above the 1e-6 differences of the reduction order, so that no layout can route a
/// token otherwise.
const MARGIN: f64 = 1e-5;

/// Asserts that `got` routed every step's tokens to the experts as `want` did.
fn assert_same_routing(name: &str, got: &std::path::Path, want: &std::path::Path) {
    let (g, w) = (read_metrics(got), read_metrics(want));
    assert_eq!(g.len(), w.len(), "{name}: steps");
    for (a, b) in g.iter().zip(&w) {
        let margin = b["router_margin"].as_f64().expect("router_margin logged");
        assert!(
            margin > MARGIN,
            "{name}: the seed leaves a margin of {margin} only"
        );
        assert_eq!(
            a["expert_tokens"], b["expert_tokens"],
            "{name}: routing at {}",
            a["step"]
        );
        assert_eq!(
            a["dropped_tokens"], b["dropped_tokens"],
            "{name}: drops at {}",
            a["step"]
        );
        let (x, y) = (a["aux_loss"].as_f64(), b["aux_loss"].as_f64());
        let (x, y) = (x.expect("aux_loss logged"), y.expect("aux_loss logged"));
        assert!(((x - y) / y).abs() <= 1e-5, "{name}: aux loss {x} vs {y}");
    }
}

/// Trains `extra` on `np` ranks into `name` and compares it with `single`: routing, losses,
/// parameters. Returns the run's folder.
fn assert_moe_equals(
    single: &std::path::Path,
    np: usize,
    name: &str,
    extra: &[&str],
) -> std::path::PathBuf {
    assert_moe_run_equals(run_pp, single, np, name, &[&MOE[..], extra].concat())
}

/// Trains `args` with `run` on `np` ranks into `name` and compares it with `single`: routing,
/// losses, parameters. Returns the run's folder.
fn assert_moe_run_equals(
    run: fn(usize, &std::path::Path, &[&str]) -> Run,
    single: &std::path::Path,
    np: usize,
    name: &str,
    args: &[&str],
) -> std::path::PathBuf {
    let out = out_dir(name);
    run(np, &out, args).assert_success();
    assert_same_routing(name, &out, single);
    assert_same_losses(name, &out, single);
    assert_same_params(name, &out, single);
    out
}

/// `merak train` (tiny GPT, synthetic data, 8 sequences a step) on `np` ranks with
/// `train.micro_batch` at its default: each rank's whole share (8 sequences on one process, 4
/// at dp 2, 1 under a pipeline), so a micro-batch differs from layout to layout.
fn run_default(np: usize, out: &std::path::Path, extra: &[&str]) -> Run {
    let mut cmd = merak(np);
    train_args(&mut cmd, out, extra);
    run_with_deadline(cmd, std::time::Duration::from_secs(300))
}

/// At the default micro-batch (a rank's whole share, which changes with dp and pp) the
/// experts, balanced per sequence by default, route, lose and step as one process under every
/// kind of layout: plain data parallelism, ep 2 and 4, ep with tensor and sequence
/// parallelism, with a pipeline, with context parallelism, under ZeRO-1, 2 and 3 and hybrid
/// sharding; and under a capacity factor they drop the same tokens. (Balanced per micro-batch,
/// the auxiliary loss of `--dp 2` differed from one process's at step 1.)
#[test]
fn experts_at_the_default_micro_batch_equal_one_process() {
    let single = out_dir("moe-default-single");
    run_default(0, &single, &MOE).assert_success();
    let sp = ["--tp", "2", "--set", "parallel.sequence_parallel=true"];
    let zero = |z: &'static str| ["--set", z];
    let cases: [(usize, &str, Vec<&str>); 11] = [
        (2, "moe-default-dp2", vec!["--dp", "2"]),
        (2, "moe-default-ep2", vec!["--dp", "2", "--ep", "2"]),
        (4, "moe-default-ep4", vec!["--dp", "4", "--ep", "4"]),
        (
            4,
            "moe-default-ep2-tp2-sp",
            [&["--dp", "2", "--ep", "2"][..], &sp].concat(),
        ),
        (
            4,
            "moe-default-ep2-pp2",
            vec!["--dp", "2", "--ep", "2", "--pp", "2"],
        ),
        (2, "moe-default-pp2", vec!["--pp", "2"]),
        (2, "moe-default-ep2-cp2", vec!["--cp", "2", "--ep", "2"]),
        (
            2,
            "moe-default-ep2-zero1",
            [&["--dp", "2", "--ep", "2"][..], &zero("parallel.zero=1")].concat(),
        ),
        (
            4,
            "moe-default-ep2-dp4-zero2",
            [&["--dp", "4", "--ep", "2"][..], &zero("parallel.zero=2")].concat(),
        ),
        (
            2,
            "moe-default-ep2-zero3",
            [&["--dp", "2", "--ep", "2"][..], &zero("parallel.zero=3")].concat(),
        ),
        (
            4,
            "moe-default-ep2-dp4-hybrid-zero3",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=3"),
                &["--set", "parallel.shard=2"],
            ]
            .concat(),
        ),
    ];
    for (np, name, extra) in cases {
        assert_moe_run_equals(run_default, &single, np, name, &[&MOE[..], &extra].concat());
    }
    // DualPipeV's pairs, with the all-to-alls inside both passes (4 micro-batches a rank):
    // a pair's forward computes the weight gradients of the W after it while its exchanges
    // wait, in the trace as a W span inside the forward.
    let name = "moe-default-ep2-pp2-dualpipev";
    let trace = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(name)
        .join("trace.json");
    let dual = [
        &["--dp", "2", "--ep", "2", "--pp", "2"][..],
        &["--set", "parallel.schedule=dualpipev"],
        &["--trace", trace.to_str().unwrap_or_default()],
    ]
    .concat();
    assert_moe_run_equals(run_default, &single, 4, name, &[&MOE[..], &dual].concat());
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&trace).expect("trace written")).expect("json");
    let fills = (json["traceEvents"].as_array().expect("traceEvents").iter())
        .filter(|e| {
            e["cat"] == "weight"
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("'s exchanges"))
        })
        .count();
    assert!(
        fills > 0,
        "no weight gradients computed during a pair's exchanges"
    );
    // Seed 15 keeps a router margin (2.2e-5) under this routing (seed 12 leaves 1.6e-6).
    let capacity = [
        &MOE[..],
        &[
            "--set",
            "model.moe.capacity_factor=1.0",
            "--set",
            "train.seed=15",
        ],
    ]
    .concat();
    let single = out_dir("moe-default-capacity-single");
    run_default(0, &single, &capacity).assert_success();
    let dropped = read_metrics(&single)[0]["dropped_tokens"].as_u64();
    assert!(
        dropped.is_some_and(|d| d > 0),
        "nothing dropped: {dropped:?}"
    );
    for (np, name, extra) in [
        (
            2,
            "moe-default-capacity-ep2",
            vec!["--dp", "2", "--ep", "2"],
        ),
        (
            4,
            "moe-default-capacity-ep2-tp2",
            [&["--dp", "2", "--ep", "2"][..], &sp].concat(),
        ),
    ] {
        assert_moe_run_equals(
            run_default,
            &single,
            np,
            name,
            &[&capacity[..], &extra].concat(),
        );
    }
}

/// `model.moe.balance = "micro-batch"` keeps the balancing per micro-batch: with the
/// micro-batch fixed (2 sequences) ep 2 equals one process, and it differs from the default
/// balancing per sequence, which micro-batches of one sequence reproduce. Left to follow the layout (`train.micro_batch = 0`), rank 0 warns
/// once, naming both keys, and the run trains.
#[test]
fn balancing_per_micro_batch_is_kept_as_an_option() {
    let per_micro = [&MOE[..], &["--set", "model.moe.balance=\"micro-batch\""]].concat();
    let single = out_dir("moe-per-micro-single");
    run_pp(0, &single, &per_micro).assert_success();
    let ep2 = [&per_micro[..], &["--dp", "2", "--ep", "2"]].concat();
    assert_moe_run_equals(run_pp, &single, 2, "moe-per-micro-ep2", &ep2);
    let per_sequence = out_dir("moe-per-sequence-single");
    run_pp(0, &per_sequence, &MOE).assert_success();
    let (a, b) = (read_metrics(&single), read_metrics(&per_sequence));
    assert_ne!(
        a[0]["aux_loss"], b[0]["aux_loss"],
        "the balancing groups differ"
    );
    // Micro-batches of one sequence each are the sequences' groups.
    let one = [&per_micro[..], &["--set", "train.micro_batch=1"]].concat();
    assert_moe_run_equals(run_pp, &per_sequence, 0, "moe-per-micro-of-1", &one);
    let out = out_dir("moe-per-micro-default");
    let run = run_default(2, &out, &[&per_micro[..], &["--dp", "2"]].concat());
    run.assert_success();
    let warned = "model.moe.balance = \"micro-batch\" computes the experts' balancing losses";
    assert_eq!(run.stderr.matches(warned).count(), 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("set train.micro_batch"),
        "{}",
        run.stderr
    );
}

/// Expert parallelism with a shared expert, both auxiliary losses and dropout: every layout
/// routes, loses and steps as one process. The shared expert runs while the tokens travel
/// (`model.moe.shared_overlap`, on by default; under ep2 x tp2 its sequence-parallel
/// collectives run beside the exchange in flight) and, in one case, before them.
#[test]
fn expert_parallel_moe_gpt_equals_one_process() {
    let single = out_dir("moe-single");
    run_pp(0, &single, &MOE).assert_success();
    let m = read_metrics(&single);
    assert!(
        m[0]["aux_loss"].as_f64().is_some_and(|a| a > 0.0),
        "{}",
        m[0]
    );
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let cases: [(usize, &str, Vec<&str>); 8] = [
        (2, "moe-ep2", vec!["--dp", "2", "--ep", "2"]),
        (
            2,
            "moe-ep2-shared-first",
            vec![
                "--dp",
                "2",
                "--ep",
                "2",
                "--set",
                "model.moe.shared_overlap=false",
            ],
        ),
        (4, "moe-ep4", vec!["--dp", "4", "--ep", "4"]),
        (4, "moe-ep2-dp4", vec!["--dp", "4", "--ep", "2"]),
        // Gradients left as the backend's tensors: the expert buckets summed over their group
        // after the backward pass, an expert without tokens here getting zeros.
        (
            4,
            "moe-ep2-dp4-device-grads",
            vec![
                "--dp",
                "4",
                "--ep",
                "2",
                "--set",
                "parallel.gradient_buffers=device",
            ],
        ),
        (
            4,
            "moe-ep2-tp2-sp",
            [&["--dp", "2", "--ep", "2", "--tp", "2"][..], &sp].concat(),
        ),
        (
            4,
            "moe-ep2-pp2",
            vec!["--dp", "2", "--ep", "2", "--pp", "2"],
        ),
        (2, "moe-ep2-cp2", vec!["--cp", "2", "--ep", "2"]),
    ];
    for (np, name, extra) in cases {
        assert_moe_equals(&single, np, name, &extra);
    }
}

/// Muon (`optimizer.kind = "muon"`) steps every expert's matrices (and the router's) as one
/// process does: each rank holds its experts whole under expert parallelism, the tensor
/// parallel ranks' split matrices are gathered, and under ZeRO-1, 2, 3 and hybrid sharding
/// each matrix's pieces are joined at its owner.
#[test]
fn muon_with_experts_equals_one_process() {
    // Seed 18 keeps a router margin under Muon (3.8e-5; seed 7 leaves 7e-7 at step 3).
    let muon = ["--set", "optimizer.kind=muon", "--set", "train.seed=18"];
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let layouts = [
        (2, "moe-muon-ep2", vec!["--dp", "2", "--ep", "2"]),
        (
            4,
            "moe-muon-ep2-tp2-sp",
            [&["--dp", "2", "--ep", "2", "--tp", "2"][..], &sp].concat(),
        ),
        // Under ZeRO the experts' pieces go to owners among the ranks holding the same
        // experts, the dense matrices' among the shard group.
        (
            4,
            "moe-muon-ep2-dp4-zero3",
            vec!["--dp", "4", "--ep", "2", "--set", "parallel.zero=3"],
        ),
        (
            4,
            "moe-muon-ep2-dp4-hybrid-zero2",
            vec![
                "--dp",
                "4",
                "--ep",
                "2",
                "--set",
                "parallel.zero=2",
                "--set",
                "parallel.shard=2",
            ],
        ),
        (
            4,
            "moe-muon-ep2-tp2-sp-zero1",
            [
                &["--dp", "2", "--ep", "2", "--tp", "2"][..],
                &sp,
                &["--set", "parallel.zero=1"],
            ]
            .concat(),
        ),
    ];
    assert_layouts_equal("moe-muon-single", &muon, &layouts);
}

/// Multi-token prediction (`model.mtp_depth`) in a mixture of experts: the depths' dense
/// blocks after the MoE blocks, under expert parallelism and with tensor and sequence
/// parallelism beside it, as one process.
#[test]
fn mtp_with_experts_equals_one_process() {
    // Seed 4 keeps every router margin above 1e-5 here (seeds 1, 2, 3, 5, 7, 11, 18 do not).
    let mtp = ["--set", "model.mtp_depth=2", "--set", "train.seed=4"];
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let layouts = [
        (2, "moe-mtp-ep2", vec!["--dp", "2", "--ep", "2"]),
        (
            4,
            "moe-mtp-ep2-tp2-sp",
            [&["--dp", "2", "--ep", "2", "--tp", "2"][..], &sp].concat(),
        ),
    ];
    assert_layouts_equal("moe-mtp-single", &mtp, &layouts);
}

/// Trains the mixture of experts with `settings` in one process (into `single`), then under
/// each of `layouts` (`(ranks, folder, flags)`), and compares each with it: routing, losses,
/// parameters.
fn assert_layouts_equal(single: &str, settings: &[&str], layouts: &[(usize, &str, Vec<&str>)]) {
    let single = out_dir(single);
    run_pp(0, &single, &[&MOE[..], settings].concat()).assert_success();
    for (np, name, extra) in layouts {
        assert_moe_equals(&single, *np, name, &[&extra[..], settings].concat());
    }
}

/// MoE layers in every stage of every schedule that trains as one process: the auxiliary
/// losses enter the backward pass where their layer's stage runs it (a 4-layer model, each of
/// the 2 pipeline ranks holding two stages under the interleaved and ZB-V schedules).
#[test]
fn moe_layers_train_in_every_pipeline_schedule() {
    // Seed 18 keeps a router margin in this shape (4.2e-5; seed 12 leaves 6.7e-6).
    let shape = [
        "--set",
        "model.layers=4",
        "--set",
        "model.seq_len=16",
        "--set",
        "train.seed=18",
    ];
    let single = out_dir("moe-pp-single");
    run_pp(0, &single, &[&MOE[..], &shape].concat()).assert_success();
    for schedule in ["zb-h1", "interleaved", "zb-v", "gpipe"] {
        let set = format!("parallel.schedule={schedule}");
        let mut extra = vec!["--dp", "2", "--ep", "2", "--pp", "2", "--set", &set];
        if schedule == "interleaved" {
            extra.extend(["--set", "parallel.virtual_stages=2"]);
        }
        let name = format!("moe-ep2-pp2-{schedule}");
        assert_moe_equals(&single, 4, &name, &[&shape[..], &extra].concat());
    }
}

/// Under a capacity factor of 1 some assignments are dropped, the same ones (by global token
/// index) under expert, tensor and sequence parallelism as in one process.
#[test]
fn capacity_drops_the_same_tokens_as_one_process() {
    // Seed 15 keeps a margin under this routing (2.2e-5; seed 12 leaves 1.6e-6 at some step).
    let capacity = [
        &MOE[..],
        &[
            "--set",
            "model.moe.capacity_factor=1.0",
            "--set",
            "train.seed=15",
        ],
    ]
    .concat();
    let single = out_dir("moe-capacity-single");
    run_pp(0, &single, &capacity).assert_success();
    let dropped = read_metrics(&single)[0]["dropped_tokens"].as_u64();
    assert!(
        dropped.is_some_and(|d| d > 0),
        "nothing dropped: {dropped:?}"
    );
    let sp = ["--set", "parallel.sequence_parallel=true", "--tp", "2"];
    let cases: [(usize, &str, Vec<&str>); 2] = [
        (2, "moe-capacity-ep2", vec!["--dp", "2", "--ep", "2"]),
        (
            4,
            "moe-capacity-ep2-tp2",
            [&["--dp", "2", "--ep", "2"][..], &sp].concat(),
        ),
    ];
    for (np, name, extra) in cases {
        let extra = [&capacity[MOE.len()..], &extra[..]].concat();
        assert_moe_equals(&single, np, name, &extra);
    }
}

/// A checkpoint written at ep = 4 (each rank writing its experts) resumes on one process,
/// which continues as the uninterrupted one-process run does.
#[test]
fn a_checkpoint_saved_at_ep_4_resumes_at_ep_1() {
    let stateful = [
        &MOE[..],
        &["--set", "train.steps=6", "--set", "checkpoint.every=3"],
    ]
    .concat();
    let whole = out_dir("moe-resume-whole");
    run_pp(0, &whole, &stateful).assert_success();
    let saved = out_dir("moe-resume-ep4");
    let ep4 = [&stateful[..], &["--dp", "4", "--ep", "4"]].concat();
    run_pp(4, &saved, &ep4).assert_success();
    let step3 = saved.join("checkpoints/step-00000003");
    let resumed = read_metrics(&resumed(0, &step3, "moe-resume-ep1", &[]));
    let want = read_metrics(&whole);
    assert_eq!(resumed.len(), 3, "steps 4 to 6");
    let keys = (&["loss", "grad_norm"][..], &["expert_tokens"][..]);
    assert_continues(&resumed, &want, 3, keys);
}

/// Auxiliary-loss-free balancing (DeepSeek's selection biases, moved after every step by the
/// whole grid's loads) trains as one process at ep = 2, with and without ZeRO-1, and the
/// biases travel in checkpoints:
/// the ep = 2 run's step-3 checkpoint resumed on one process routes and trains as the
/// uninterrupted one-process run.
#[test]
fn balancing_biases_equal_one_process_and_resume() {
    let biased = [
        "--set",
        "model.moe.bias_update_rate=0.001",
        "--set",
        "checkpoint.every=3",
    ];
    let single = out_dir("moe-bias-single");
    run_pp(0, &single, &[&MOE[..], &biased].concat()).assert_success();
    let ep2 = [&biased[..], &["--dp", "2", "--ep", "2"]].concat();
    let saved = assert_moe_equals(&single, 2, "moe-bias-ep2", &ep2);
    // ZeRO's slices step the parameters that get gradients; the biases get none, so the
    // balancing moves them as without ZeRO.
    let zero1 = [&ep2[..], &["--set", "parallel.zero=1"]].concat();
    assert_moe_equals(&single, 2, "moe-bias-ep2-zero1", &zero1);
    let step3 = saved.join("checkpoints/step-00000003");
    let resumed = read_metrics(&resumed(0, &step3, "moe-bias-resumed", &[]));
    let want = read_metrics(&single);
    assert_continues(&resumed, &want, 3, (&["loss"], &["expert_tokens"]));
}

/// Under bf16 mixed precision the router still runs in f32 and the exchanged rows keep their
/// bf16 type: ep = 2 gives bf16 one process's losses within 1e-3, the bound the other bf16
/// layouts are held to (measured: 2.5e-5; bf16 rounding of the layouts may move a token to
/// another expert, so the routing is not compared exactly).
#[test]
fn bf16_expert_parallelism_follows_bf16_on_one_process() {
    let bf16 = [&MOE[..], &["--set", "train.precision=bf16"]].concat();
    let single = out_dir("moe-bf16-single");
    run_pp(0, &single, &bf16).assert_success();
    let out = out_dir("moe-bf16-ep2");
    run_pp(2, &out, &[&bf16[..], &["--dp", "2", "--ep", "2"]].concat()).assert_success();
    let (a, b) = (read_metrics(&out), read_metrics(&single));
    for (x, y) in series(&a, "loss").iter().zip(series(&b, "loss")) {
        assert!(((x - y) / y).abs() < 1e-3, "bf16 ep 2: loss {x} vs {y}");
    }
}

/// A rank that receives no token for a layer still takes part in both exchanges, forward and
/// backward: strong balancing biases (rate 1) leave experts without any token after the first
/// steps (top-1 of 4 experts at ep = 4, one expert per rank), and the run still equals one
/// process.
#[test]
fn a_rank_without_tokens_still_exchanges() {
    let starved = [
        "--set",
        "model.moe.experts=4",
        "--set",
        "model.moe.top_k=1",
        "--set",
        "model.moe.expert_hidden=32",
        "--set",
        "model.moe.bias_update_rate=1.0",
    ];
    let single = out_dir("moe-starved-single");
    run_pp(0, &single, &starved).assert_success();
    let empty = read_metrics(&single).iter().any(|m| {
        (m["expert_tokens"].as_array().into_iter().flatten()).any(|l| {
            l.as_array()
                .is_some_and(|l| l.contains(&serde_json::json!(0)))
        })
    });
    assert!(empty, "no expert went without tokens");
    let out = out_dir("moe-starved-ep4");
    run_pp(
        4,
        &out,
        &[&starved[..], &["--dp", "4", "--ep", "4"]].concat(),
    )
    .assert_success();
    assert_same_losses("moe-starved-ep4", &out, &single);
    assert_same_params("moe-starved-ep4", &out, &single);
}

/// ZeRO at ep = 1 keeps the experts with the dense parameters, sliced over the data-parallel
/// ranks; with 16 experts (top-1) over a rank's 64 tokens a step, some expert gets tokens on
/// some ranks only, and the rank owning its slice must step it as one process does. Under
/// ZeRO-2 and 3 reducing every micro-batch, an expert bucket is reduce-scattered once a step
/// on every rank, whichever micro-batches gave it gradients.
#[test]
fn zero_at_ep_1_steps_experts_that_other_ranks_saw() {
    let sparse = [
        "--set",
        "model.moe.experts=16",
        "--set",
        "model.moe.top_k=1",
        "--set",
        "model.moe.expert_hidden=16",
        // Two micro-batches a step on each of 4 ranks.
        "--set",
        "train.micro_batch=1",
    ];
    let single = out_dir("moe-sparse-single");
    run_pp(0, &single, &sparse).assert_success();
    let each = ["--set", "parallel.reduce_scatter=\"micro-batch\""];
    for (zero, each) in [
        (1, None),
        (2, None),
        (2, Some(each)),
        (3, None),
        (3, Some(each)),
    ] {
        let suffix = if each.is_some() { "-each" } else { "" };
        let name = format!("moe-sparse-dp4-zero{zero}{suffix}");
        let set = format!("parallel.zero={zero}");
        let each = each.as_ref().map_or(&[][..], |e| &e[..]);
        let out = out_dir(&name);
        run_pp(
            4,
            &out,
            &[&sparse[..], &["--dp", "4", "--set", &set], each].concat(),
        )
        .assert_success();
        assert_same_losses(&name, &out, &single);
        assert_same_params(&name, &out, &single);
    }
}

/// ZeRO-1, 2 and 3 (reducing once a step, or every micro-batch; over the whole data-parallel
/// group, or hybrid: shard groups of 2 of the 4 ranks) with expert or tensor parallelism: the
/// experts' buckets are cut over the ranks holding the same experts (dp × cp / ep and their TP
/// peers, across shard groups, with no all-reduce over the copies), the dense ones over the
/// data-parallel or shard group; ZeRO-3 gathers each over its own group. With
/// sparse routing (8 experts, top-1: as few as 7 of a step's 256 tokens for one expert) some
/// expert gets tokens on some ranks of its group only. Every layout equals one process, and
/// checkpoints written under ZeRO-2 and 3 at ep = 2, ZeRO-1 at ep2 × tp2 and hybrid ZeRO-1, 2
/// and 3 (each rank its slices of the dense parameters' and of its experts' moments; at tp 2
/// an expert's slices come from both TP ranks, under hybrid sharding from both shard groups)
/// resume on one process as the uninterrupted run goes on.
#[test]
fn zero_with_expert_parallelism_equals_one_process() {
    let sparse = [
        "--set",
        "model.moe.experts=8",
        "--set",
        "model.moe.top_k=1",
        "--set",
        "model.moe.expert_hidden=16",
        // Seed 16 keeps a router margin (2.6e-5; seed 12 leaves 1.4e-6).
        "--set",
        "train.seed=16",
        "--set",
        "train.steps=5",
        "--set",
        "checkpoint.every=3",
    ];
    let sparse = [&MOE[..], &sparse].concat();
    let single = out_dir("moe-zero-ep-single");
    run_pp(0, &single, &sparse).assert_success();
    let zero = |z: &'static str| ["--set", z];
    let each = ["--set", "parallel.reduce_scatter=\"micro-batch\""];
    let tp2 = ["--tp", "2", "--set", "parallel.sequence_parallel=true"];
    let hybrid = ["--set", "parallel.shard=2"];
    let cases: [(usize, &str, Vec<&str>); 15] = [
        (
            2,
            "moe-ep2-zero1",
            [&["--dp", "2", "--ep", "2"][..], &zero("parallel.zero=1")].concat(),
        ),
        (
            4,
            "moe-ep2-dp4-zero1",
            [&["--dp", "4", "--ep", "2"][..], &zero("parallel.zero=1")].concat(),
        ),
        (
            4,
            "moe-ep2-dp4-zero2",
            [&["--dp", "4", "--ep", "2"][..], &zero("parallel.zero=2")].concat(),
        ),
        (
            4,
            "moe-ep2-dp4-zero2-each",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=2"),
                &each,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-cp2-dp2-zero2",
            [
                &["--dp", "2", "--cp", "2", "--ep", "2"][..],
                &zero("parallel.zero=2"),
            ]
            .concat(),
        ),
        (
            2,
            "moe-ep2-zero3",
            [&["--dp", "2", "--ep", "2"][..], &zero("parallel.zero=3")].concat(),
        ),
        (
            4,
            "moe-ep2-dp4-zero3-each",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=3"),
                &each,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-tp2-zero3",
            [
                &["--dp", "2", "--ep", "2"][..],
                &tp2,
                &zero("parallel.zero=3"),
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-tp2-zero1",
            [
                &["--dp", "2", "--ep", "2"][..],
                &tp2,
                &zero("parallel.zero=1"),
            ]
            .concat(),
        ),
        (
            4,
            "moe-tp2-dp2-zero2-each",
            [&["--dp", "2"][..], &tp2, &zero("parallel.zero=2"), &each].concat(),
        ),
        (
            4,
            "moe-ep2-dp4-hybrid-zero1",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=1"),
                &hybrid,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-dp4-hybrid-zero2",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=2"),
                &hybrid,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-dp4-hybrid-zero2-each",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=2"),
                &hybrid,
                &each,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-dp4-hybrid-zero3",
            [
                &["--dp", "4", "--ep", "2"][..],
                &zero("parallel.zero=3"),
                &hybrid,
            ]
            .concat(),
        ),
        (
            4,
            "moe-ep2-pp2-zero1",
            [
                &["--dp", "2", "--ep", "2", "--pp", "2"][..],
                &zero("parallel.zero=1"),
            ]
            .concat(),
        ),
    ];
    let mut saved = Vec::new();
    for (np, name, extra) in cases {
        let out = out_dir(name);
        run_pp(np, &out, &[&sparse[..], &extra].concat()).assert_success();
        assert_same_routing(name, &out, &single);
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
        let resumes = ["moe-ep2-dp4-zero2", "moe-ep2-zero3", "moe-ep2-tp2-zero1"];
        if resumes.contains(&name) || name.contains("hybrid-zero") && !name.ends_with("each") {
            saved.push(out);
        }
    }
    let want = read_metrics(&single);
    for (i, run) in saved.iter().enumerate() {
        let step3 = run.join("checkpoints/step-00000003");
        let name = format!("moe-zero-resumed-{i}");
        // Hybrid runs too: a shard group of 2, which does not divide one process's dp = 1,
        // becomes the whole group.
        let resumed = read_metrics(&resumed(0, &step3, &name, &[]));
        assert_continues(
            &resumed,
            &want,
            3,
            (&["loss", "grad_norm"], &["expert_tokens"]),
        );
    }
}

/// Dropless routing that sends a rank more rows than the stated bound ends the job as a failed
/// rank, not a panic: exit status 1, `merak: rank R failed:` with the layer and the counts. Its
/// advice, raising `model.moe.max_load`, is accepted by a resume (the bound is memory, not
/// part of the model): a run at the default bound checkpoints, its resume at
/// `max_load = 1` (a rank's exact mean share, which the untrained router exceeds) fails, and
/// its resume at 2 (the most two ranks can send one) continues.
#[test]
fn routing_past_the_stated_bound_fails_the_rank_and_a_resume_may_raise_it() {
    let ep2 = [&MOE[..], &["--dp", "2", "--ep", "2"]].concat();
    let base = out_dir("moe-bound");
    run_pp(2, &base, &[&ep2[..], &["--set", "train.steps=2"]].concat()).assert_success();
    let checkpoint = base.join("checkpoints");
    let resume = |name: &str, max_load: &str| {
        let out = out_dir(name);
        let mut cmd = resume_cmd(2, &checkpoint, &out);
        cmd.args(["--set", "train.steps=3", "--set", max_load]);
        let run = merak_tests::run_with_deadline(cmd, std::time::Duration::from_secs(300));
        (run, out)
    };
    let (run, _) = resume("moe-bound-1", "model.moe.max_load=1");
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    let line = (run.stderr.lines())
        .find(|l| {
            l.starts_with("merak: rank ") && l.contains(" failed: mixture of experts: layer ")
        })
        .unwrap_or_else(|| panic!("no failed rank in {}", run.stderr));
    for wants in [
        "this expert-parallel rank received",
        "more than the stated bound model.moe.max_load = 1 x the mean of",
        "raise it to ",
        "a resume may: --set model.moe.max_load=",
    ] {
        assert!(line.contains(wants), "{line}");
    }
    let (run, out) = resume("moe-bound-2", "model.moe.max_load=2");
    run.assert_success();
    let m = read_metrics(&out);
    assert_eq!(
        m.last().map(|r| r["step"].clone()),
        Some(serde_json::json!(3)),
        "{m:?}"
    );
}

/// Settings that do nothing in the chosen layout are accepted, rank 0 warning once each with
/// the key, its value and why (config/idle.rs): at dp = 2, ep = 1 a bound on the rows an
/// expert-parallel rank receives, ZeRO-3's prefetch, ZeRO-2's reduce-scatter per micro-batch,
/// the Ulysses attention without context parallelism and sequence parallelism without tensor
/// parallelism (the last two were refused before) leave the run as it was.
#[test]
fn settings_idle_in_the_layout_train_with_one_warning_each() {
    let idle = [
        "--set",
        "model.moe.max_load=8",
        "--set",
        "parallel.prefetch=2",
        "--set",
        "parallel.reduce_scatter=micro-batch",
        "--set",
        "parallel.cp_attention=all-to-all",
        "--set",
        "parallel.sequence_parallel=true",
    ];
    let plain = out_dir("moe-idle-plain");
    run_pp(2, &plain, &[&MOE[..], &["--dp", "2"]].concat()).assert_success();
    let out = out_dir("moe-idle");
    let run = run_pp(2, &out, &[&MOE[..], &["--dp", "2"], &idle].concat());
    run.assert_success();
    for setting in [
        "model.moe.max_load = 8",
        "parallel.prefetch = 2",
        "parallel.reduce_scatter = \"micro-batch\"",
        "parallel.cp_attention = \"all-to-all\"",
        "parallel.sequence_parallel = true",
    ] {
        let warned = format!("{setting} has no effect in this layout");
        let n = run.stderr.matches(&warned).count();
        assert_eq!(n, 1, "{setting}: {}", run.stderr);
    }
    assert_same_losses("moe-idle", &out, &plain);
}

#[test]
fn bad_expert_settings_fail_before_training() {
    let moe = &MOE[..];
    for (np, name, extra, wants) in [
        (
            2,
            "moe-ep3",
            vec!["--dp", "2", "--ep", "3"],
            "`parallel.ep`: 3 does not divide parallel.dp x parallel.cp = 2 x 1 = 2",
        ),
        (
            4,
            "moe-ep4-of-2",
            vec!["--dp", "4", "--ep", "4", "--set", "model.moe.experts=2"],
            "parallel.ep = 4 does not divide model.moe.experts = 2",
        ),
        (
            4,
            "moe-ep4-shard2",
            vec![
                "--dp",
                "4",
                "--ep",
                "4",
                "--set",
                "parallel.zero=1",
                "--set",
                "parallel.shard=2",
            ],
            "`parallel.shard`: 2 (hybrid sharding needs parallel.ep = 4 to divide it times \
             parallel.cp = 1",
        ),
        (
            0,
            "moe-topk",
            vec!["--set", "model.moe.top_k=5"],
            "model.moe.top_k = 5 is more than model.moe.experts = 4",
        ),
        (
            0,
            "moe-capacity-0",
            vec!["--set", "model.moe.capacity_factor=0"],
            "`model.moe.capacity_factor`: 0 must be in (0, inf)",
        ),
        (
            2,
            "moe-tp2-no-sp",
            vec!["--tp", "2"],
            "`parallel.sequence_parallel`: false, but a mixture of experts at parallel.tp = 2",
        ),
    ] {
        let out = out_dir(name);
        let run = run_pp(np, &out, &[moe, &extra].concat());
        assert_ne!(run.code, Some(0), "{name}: {run:?}");
        assert!(run.stderr.contains(wants), "{name}: {}", run.stderr);
        assert!(!out.join("metrics.jsonl").exists(), "{name}: trained");
    }
    // A balance that names no routing group: exit status 2, the key and the values.
    let out = out_dir("moe-balance-batch");
    let run = run_pp(
        0,
        &out,
        &[moe, &["--set", "model.moe.balance=batch"]].concat(),
    );
    assert_refused(
        &run,
        "`model.moe.balance`: unknown variant `batch`, expected `sequence` or `micro-batch`",
    );
    assert!(!out.exists(), "a refused run made {}", out.display());
    // Expert parallelism needs experts.
    let out = out_dir("moe-dense-ep2");
    let run = run_pp(2, &out, &["--dp", "2", "--ep", "2"]);
    assert!(
        run.stderr.contains("needs a mixture of experts"),
        "{}",
        run.stderr
    );
}
