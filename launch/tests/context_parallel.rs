//! End-to-end tests of context parallelism (`parallel.cp`, ring attention over a zigzag split)
//! under real `mpirun`: GPT at cp = 2 and 4, with tensor, sequence, pipeline and data
//! parallelism, ZeRO, document masks, and BERT, each train the same model as one process (with
//! dropout); a checkpoint saved at cp = 4 resumes at cp = 1; bad settings fail before training.

mod common;
use common::*;

/// Dropout on, so that the masks drawn on the zigzag shards are checked too.
const DROPOUT: [&str; 2] = ["--set", "model.dropout=0.1"];

/// Trains the tiny GPT on `np` ranks with `extra` (and dropout) into `name`, checks that it
/// ran context-parallel, and compares its losses and final parameters with `single`.
fn assert_gpt_equals(single: &std::path::Path, np: usize, name: &str, extra: &[&str]) {
    let out = out_dir(name);
    let run = run_pp(np, &out, &[&DROPOUT[..], extra].concat());
    run.assert_success();
    let log = format!("{}{}", run.stdout, run.stderr);
    assert!(
        !log.contains(" cp=1 "),
        "{name}: not context-parallel:\n{log}"
    );
    assert_same_losses(name, &out, single);
    assert_same_params(name, &out, single);
}

#[test]
fn context_parallel_gpt_equals_one_process() {
    let single = out_dir("cp-single");
    run_pp(0, &single, &DROPOUT).assert_success();
    let cases: [(usize, &str, Vec<&str>); 4] = [
        (2, "cp2", vec!["--cp", "2"]),
        (4, "cp4", vec!["--cp", "4"]),
        (
            4,
            "cp2-dp2-zero1",
            vec!["--cp", "2", "--dp", "2", "--set", "parallel.zero=1"],
        ),
        (
            4,
            "cp2-pp2",
            vec!["--cp", "2", "--pp", "2", "--set", "parallel.recompute=full"],
        ),
    ];
    for (np, name, extra) in cases {
        assert_gpt_equals(&single, np, name, &extra);
    }
}

#[test]
fn context_parallel_composes_with_tensor_sequence_and_pipeline_parallelism() {
    let single = out_dir("cp-3d-single");
    run_pp(0, &single, &DROPOUT).assert_success();
    let sp = ["--set", "parallel.sequence_parallel=true"];
    let cases: [(usize, &str, Vec<&str>); 3] = [
        (4, "cp2-tp2", vec!["--cp", "2", "--tp", "2"]),
        (
            8,
            "cp2-tp2-pp2-sp",
            [&["--cp", "2", "--tp", "2", "--pp", "2"][..], &sp].concat(),
        ),
        (
            8,
            "cp2-dp2-tp2-zero3",
            vec![
                "--cp",
                "2",
                "--dp",
                "2",
                "--tp",
                "2",
                "--set",
                "parallel.zero=3",
            ],
        ),
    ];
    for (np, name, extra) in cases {
        assert_gpt_equals(&single, np, name, &extra);
    }
}

/// The all-to-all (DeepSpeed-Ulysses) attention trains what the ring trains: cp 2 (2 of the 4
/// heads per rank) and cp 2 x tp 2 (1 of a TP rank's 2 heads), with a document mask too.
#[test]
fn all_to_all_context_parallelism_equals_one_process() {
    let single = out_dir("cp-a2a-single");
    run_pp(0, &single, &DROPOUT).assert_success();
    let a2a = ["--set", "parallel.cp_attention=all-to-all"];
    let cases: [(usize, &str, Vec<&str>); 2] = [
        (2, "cp2-a2a", [&["--cp", "2"][..], &a2a].concat()),
        (
            4,
            "cp2-tp2-a2a",
            [&["--cp", "2", "--tp", "2"][..], &a2a].concat(),
        ),
    ];
    for (np, name, extra) in cases {
        assert_gpt_equals(&single, np, name, &extra);
    }
    let masked = [
        "--set",
        "model.vocab_size=64",
        "--set",
        "data.document_mask=true",
    ];
    let single = out_dir("cp-a2a-docs-single");
    run_pp(0, &single, &[&DROPOUT[..], &masked].concat()).assert_success();
    let extra = [&masked[..], &a2a, &["--cp", "2"]].concat();
    assert_gpt_equals(&single, 2, "cp2-a2a-docs", &extra);
}

#[test]
fn context_parallel_keeps_documents_apart() {
    let masked = [
        "--set",
        "model.vocab_size=64",
        "--set",
        "data.document_mask=true",
    ];
    let single = out_dir("cp-docs-single");
    run_pp(0, &single, &[&DROPOUT[..], &masked].concat()).assert_success();
    assert_gpt_equals(
        &single,
        2,
        "cp2-docs",
        &[&masked[..], &["--cp", "2"]].concat(),
    );
}

#[test]
fn context_parallel_bert_equals_one_process() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml");
    let base = ["--set", "train.global_batch=8"];
    let single = train_dir_with(&config, 0, "cp-bert-single", &base);
    let got = train_dir_with(
        &config,
        2,
        "cp-bert-cp2",
        &[&base[..], &["--cp", "2"]].concat(),
    );
    assert_same_losses("cp-bert-cp2", &got, &single);
    assert_same_params("cp-bert-cp2", &got, &single);
}

/// A checkpoint written at cp = 4 (with ZeRO-1, so the optimizer state is sliced over the 4
/// ranks that hold the same parameters) resumes on one process, which continues as the
/// uninterrupted one-process run does.
#[test]
fn a_checkpoint_saved_at_cp_4_resumes_at_cp_1() {
    let stateful = [
        "--set",
        "train.steps=6",
        "--set",
        "checkpoint.every=3",
        "--set",
        "model.dropout=0.1",
    ];
    let whole = out_dir("cp-resume-whole");
    run_pp(0, &whole, &stateful).assert_success();
    let saved = out_dir("cp-resume-cp4");
    let cp4 = [&stateful[..], &["--cp", "4", "--set", "parallel.zero=1"]].concat();
    run_pp(4, &saved, &cp4).assert_success();
    let step3 = saved.join("checkpoints/step-00000003");
    let extra = ["--cp", "1", "--set", "parallel.zero=0"];
    let resumed = read_metrics(&resumed(0, &step3, "cp-resume-cp1", &extra));
    let want = read_metrics(&whole);
    assert_eq!(resumed.len(), 3, "steps 4 to 6");
    assert_continues(&resumed, &want, 3, (&["loss", "grad_norm"], &[]));
}

#[test]
fn a_context_parallel_degree_that_does_not_fit_fails_before_training() {
    for (np, name, extra, wants) in [
        (
            2,
            "cp-seq-30",
            vec!["--cp", "2", "--set", "model.seq_len=30"],
            "2 x parallel.cp = 4 does not divide model.seq_len = 30",
        ),
        // 4 heads over tp 2: 2 heads per TP rank, which cp 4 cannot share out.
        (
            8,
            "cp4-tp2-a2a",
            vec![
                "--cp",
                "4",
                "--tp",
                "2",
                "--set",
                "parallel.cp_attention=all-to-all",
            ],
            "`parallel.cp_attention`: \"all-to-all\": all-to-all (Ulysses) context parallelism",
        ),
    ] {
        let out = out_dir(name);
        let run = run_pp(np, &out, &extra);
        assert_ne!(run.code, Some(0), "{name}: {run:?}");
        assert!(run.stderr.contains(wants), "{name}: {}", run.stderr);
        assert!(!out.join("metrics.jsonl").exists(), "{name}: trained");
    }
}
