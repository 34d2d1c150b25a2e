//! Zero-bubble pipelines under real `mpirun`: ZB-H1 and ZB-V with the split backward (B, then
//! the weight gradients in W) train the same model as one process under pp = 2 and 4, with
//! recomputation, in 3D (dp x tp x pp) with dropout and ZeRO-1, and for BERT (whose tied
//! decoder keeps its gradient in B; under ZB-V and DualPipeV its two ends share rank 0); and
//! ZB-H1 at pp = 2 equals 1F1B bit for bit.

use std::path::Path;

use merak_burn::checkpoint::Checkpoint;

mod common;
use common::*;

const ZB: [&str; 2] = ["--set", "parallel.schedule=zb-h1"];
const ZB_V: [&str; 2] = ["--set", "parallel.schedule=zb-v"];

#[test]
fn zb_h1_equals_one_process_and_1f1b_bit_for_bit() {
    let single = out_dir("zb-single");
    run_pp(0, &single, &[]).assert_success();
    let one_f_one_b = out_dir("zb-pp2-1f1b");
    run_pp(2, &one_f_one_b, &["--pp", "2"]).assert_success();
    let cases: Vec<(usize, &str, Vec<&str>)> = vec![
        (2, "zb-pp2", vec!["--pp", "2"]),
        // 8 micro-batches of one sequence: rank r postpones r W passes.
        (
            4,
            "zb-pp4-m8",
            vec!["--pp", "4", "--set", "train.micro_batch=1"],
        ),
        (
            2,
            "zb-pp2-full",
            vec!["--pp", "2", "--set", "parallel.recompute=full"],
        ),
        (
            4,
            "zb-pp2-tp2-selective",
            vec![
                "--pp",
                "2",
                "--tp",
                "2",
                "--set",
                "parallel.recompute=selective",
            ],
        ),
    ];
    for (np, name, layout) in cases {
        let out = out_dir(name);
        run_pp(np, &out, &[&layout[..], &ZB].concat()).assert_success();
        assert_same_losses(name, &out, &single);
        assert_same_params(name, &out, &single);
    }
    // B then W accumulates every gradient in the order of the unsplit backward.
    let zb = Path::new(env!("CARGO_TARGET_TMPDIR")).join("zb-pp2");
    assert_eq!(
        series(&read_metrics(&zb), "loss"),
        series(&read_metrics(&one_f_one_b), "loss")
    );
    let params = |dir: &Path| {
        Checkpoint::open(&dir.join("checkpoints"))
            .unwrap()
            .read_full()
            .unwrap()
            .params
    };
    assert!(params(&zb) == params(&one_f_one_b), "zb-h1 and 1f1b differ");
}

#[test]
fn zb_v_equals_one_process() {
    // Two stages per rank: 4 units make 4 stages at pp = 2; 8 units (6 layers) at pp = 4.
    let single = out_dir("zbv-single");
    run_pp(0, &single, &[]).assert_success();
    let six = ["--set", "model.layers=6"];
    let single6 = out_dir("zbv-single-6");
    run_pp(0, &single6, &six).assert_success();
    let cases: Vec<(usize, &str, Vec<&str>, &Path)> = vec![
        (
            2,
            "zbv-pp2",
            vec!["--pp", "2", "--set", "train.micro_batch=1"],
            &single,
        ),
        (
            2,
            "zbv-pp2-full",
            vec!["--pp", "2", "--set", "parallel.recompute=full"],
            &single,
        ),
        (
            4,
            "zbv-pp4",
            vec![
                "--pp",
                "4",
                "--set",
                "train.micro_batch=1",
                "--set",
                "model.layers=6",
            ],
            &single6,
        ),
    ];
    for (np, name, layout, want) in cases {
        let out = out_dir(name);
        run_pp(np, &out, &[&layout[..], &ZB_V].concat()).assert_success();
        assert_same_losses(name, &out, want);
        assert_same_params(name, &out, want);
    }
}

#[test]
fn zero_bubble_schedules_in_3d_with_dropout_and_zero1_equal_one_process() {
    let drop = ["--set", "model.dropout=0.1", "--set", "parallel.zero=1"];
    let single = out_dir("zb-3d-single");
    run_pp(0, &single, &drop).assert_success();
    let out = out_dir("zb-dp2-tp2-pp2");
    let layout = ["--dp", "2", "--tp", "2", "--pp", "2"];
    run_pp(8, &out, &[&layout[..], &drop, &ZB].concat()).assert_success();
    assert_same_losses("zb-h1 dp2 x tp2 x pp2", &out, &single);
    assert_same_params("zb-h1 dp2 x tp2 x pp2", &out, &single);
    let out = out_dir("zbv-dp2-tp2-pp2");
    run_pp(8, &out, &[&layout[..], &drop, &ZB_V].concat()).assert_success();
    assert_same_losses("zb-v dp2 x tp2 x pp2", &out, &single);
    assert_same_params("zb-v dp2 x tp2 x pp2", &out, &single);
}

#[test]
fn bert_under_zero_bubble_schedules_equals_one_process() {
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bert-tiny.toml");
    let run = |np: usize, name: &str, extra: &[&str]| {
        let micro = ["--set", "train.micro_batch=2"];
        train_dir_with(&bert, np, name, &[&micro[..], extra].concat())
    };
    let single = run(0, "bert-zb-single", &[]);
    let out = run(2, "bert-zb-pp2", &[&["--pp", "2"][..], &ZB].concat());
    assert_same_losses("bert zb-h1 pp2", &out, &single);
    assert_same_params("bert zb-h1 pp2", &out, &single);
    let out = run(2, "bert-zbv-pp2", &[&["--pp", "2"][..], &ZB_V].concat());
    assert_same_losses("bert zb-v pp2", &out, &single);
    assert_same_params("bert zb-v pp2", &out, &single);
    // DualPipeV: 4 micro-batches of 2, pairs in the steady state, the tied decoder's two ends
    // on rank 0.
    let dual = ["--pp", "2", "--set", "parallel.schedule=dualpipev"];
    let out = run(2, "bert-dualpipev-pp2", &dual);
    assert_same_losses("bert dualpipev pp2", &out, &single);
    assert_same_params("bert dualpipev pp2", &out, &single);
}
