use super::simulate::*;
use super::*;
use merak_burn::data_parallel::ReduceScatter;

fn gpt2() -> ModelProxy {
    ModelProxy::parse("gpt2").expect("preset")
}

fn refused(text: &str) -> String {
    parse_layout(text, &gpt2(), 8, 8)
        .expect_err(text)
        .to_string()
}

#[test]
fn a_layout_key_given_twice_is_refused_naming_it() {
    let e = refused("dp=2,dp=4,tp=2");
    assert!(
        e.contains("`dp` is given twice") && e.contains("dp=4"),
        "{e}"
    );
    let e = refused("dp=8,schedule=gpipe,schedule=1f1b");
    assert!(e.contains("`schedule` is given twice"), "{e}");
}

#[test]
fn every_layout_value_is_range_checked() {
    for (text, part) in [
        (
            "dp=8,zero=5",
            "zero=5 is not a supported ZeRO stage (0 to 3)",
        ),
        ("dp=8,mbs=0", "mbs=0 must be at least 1"),
        ("dp=0", "dp=0 must be at least 1"),
        ("dp=8,v=0", "v=0 must be at least 1"),
        ("dp=4,tp=2,overlap=0", "overlap=0 must be at least 1"),
        ("dp=1,tp=8", "tp=8 does not divide the model's 12 heads"),
        ("dp=1,pp=8,v=2", "more than the model's 14 units"),
        (
            "dp=2,tp=2,pp=2,v=9223372036854775807",
            "more than the model's 14 units",
        ),
        ("dp=4611686018427387904,tp=4", "more than 2^64"),
        (
            "dp=8,mbs=2305843009213693952",
            "dp * mbs = 8 x 2305843009213693952 overflows",
        ),
        (
            "dp=4,tp=2,overlap=3",
            "overlap = 3: does not divide the 1024 tokens",
        ),
        ("dp=8,schedule=fast", "--layout: schedule=fast"),
        ("dp=8,speed=1", "unknown key `speed`"),
        ("dp=8,zero=2,shard=3", "shard = 3: must divide dp = 8"),
        (
            "dp=8,shard=4",
            "shard = 4: hybrid sharding needs zero = 1, 2 or 3 (it is 0)",
        ),
        ("dp=8,shard=0", "shard=0 must be at least 1"),
        (
            "dp=8,zero=1,reduce_scatter=micro-batch",
            "reduce_scatter = micro-batch: needs zero = 2 or 3 (it is 1)",
        ),
        (
            "dp=8,zero=2,reduce_scatter=often",
            "reduce_scatter=often (step or micro-batch)",
        ),
    ] {
        let e = refused(text);
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
    let l = parse_layout("dp=4,tp=2,zero=1,overlap=2", &gpt2(), 8, 8).expect("valid");
    assert!(l.zero == 1 && l.tp_overlap == 2 && l.micro_batches == 2);
    let l = parse_layout(
        "dp=8,mbs=1,zero=2,reduce_scatter=micro-batch,shard=4",
        &gpt2(),
        8,
        8,
    )
    .expect("valid");
    assert!(l.shard_degree() == 4 && l.reduce_scatter == ReduceScatter::MicroBatch);
    assert_eq!(l.zero_label(), "zero=2 reduce_scatter=micro-batch shard=4");
}

#[test]
fn a_layout_with_context_and_sequence_parallelism() {
    let long =
        ModelProxy::parse("gpt:layers=4,hidden=256,heads=8,seq=4096,vocab=1000").expect("a shape");
    let l = parse_layout("dp=2,tp=2,cp=2,sp=on,mbs=2,overlap=4", &long, 8, 8).expect("valid");
    assert_eq!((l.cp, l.sequence_parallel, l.gpus()), (2, true, 8));
    assert_eq!(l.sequence_label(), "cp=2 sp");
    for (text, part) in [
        ("dp=2,cp=3", "dp * cp * tp * pp = 6 devices"),
        ("dp=1,cp=8,sp=on", "sp = on: needs tp > 1 (it is 1)"),
        ("dp=4,tp=2,sp=yes", "sp=yes (on or off)"),
        ("dp=4,cp=0", "cp=0 must be at least 1"),
    ] {
        let e = parse_layout(text, &long, 8, 8).expect_err(text).to_string();
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
    // 2 x cp must divide the sequence; the overlap degree the positions a TP rank holds.
    let odd =
        ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=40,vocab=100").expect("a shape");
    let e = parse_layout("dp=1,cp=8", &odd, 8, 8)
        .expect_err("2 x 8 does not divide 40")
        .to_string();
    assert!(
        e.contains("cp = 8: 2 x cp = 16 does not divide the model's sequence length 40"),
        "{e}"
    );
    let e = parse_layout("dp=2,tp=4,sp=on,overlap=3", &odd, 8, 8)
        .expect_err("10 / 3")
        .to_string();
    assert!(e.contains("the 10 tokens"), "{e}");
}

#[test]
fn a_layout_with_expert_parallelism() {
    let moe = ModelProxy::parse("moe-tiny").expect("a preset");
    let l = parse_layout("dp=4,tp=2,sp=on,ep=4", &moe, 8, 8).expect("valid");
    assert_eq!((l.ep, l.expert_replicas()), (4, 1));
    assert_eq!(l.sequence_label(), "sp ep=4");
    // Each copy of hybrid sharding holds every expert, its experts' states cut within it.
    let l = parse_layout("dp=8,ep=2,zero=1,shard=4", &moe, 8, 8).expect("valid");
    assert_eq!(l.state_sharding().expert_shard, 2);
    for (text, part) in [
        ("dp=8,ep=3", "ep = 3: does not divide the model's 4 experts"),
        (
            "dp=2,pp=4,ep=4",
            "ep = 4: does not divide dp x cp = 2 x 1 = 2",
        ),
        (
            "dp=4,tp=2,ep=2",
            "sp = off: a mixture of experts at tp = 2 needs sequence parallelism",
        ),
        ("dp=8,ep=0", "ep=0 must be at least 1"),
        (
            "dp=8,ep=4,zero=1,shard=2",
            "shard = 2: hybrid sharding needs ep = 4 to divide it",
        ),
    ] {
        let e = parse_layout(text, &moe, 8, 8).expect_err(text).to_string();
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
    let e = refused("dp=8,ep=2");
    assert!(e.contains("ep = 2: needs a mixture of experts"), "{e}");
}

/// Issue 50: `--layout` is checked by the same rules as a plan file's layout: the virtual
/// stages the schedule runs, ZeRO-3's recomputation and schedules, sub-pipelining only with
/// tensor parallelism.
#[test]
fn a_layout_is_checked_as_a_plan_file_is() {
    for (text, part) in [
        (
            "dp=4,pp=2,v=2",
            "v = 2: 2 stages per rank need schedule = \"interleaved\", \"zb-v\" or \"dualpipev\" (it is \"1f1b\")",
        ),
        (
            "dp=4,pp=2,schedule=zb-v",
            "v = 1: schedule = \"zb-v\" runs 2 stages per rank",
        ),
        (
            "dp=4,pp=2,v=2,mbs=2,schedule=interleaved",
            "m (--global-batch / (dp x mbs)) = 1: schedule = \"interleaved\" needs a multiple of \
             pp = 2",
        ),
        (
            "dp=8,overlap=2",
            "overlap = 2: splits the tensor-parallel blocks' all-reduces; it needs tp > 1",
        ),
        (
            "dp=8,zero=3",
            "recompute = [\"none\"]: zero = 3 recomputes every unit",
        ),
        (
            "dp=8,zero=3,recompute=full,schedule=zb-h1",
            "schedule = zb-h1: zero = 3 runs a unit's whole backward pass",
        ),
    ] {
        let e = refused(text);
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
    parse_layout("dp=2,pp=4,v=2,schedule=interleaved", &gpt2(), 8, 8).expect("valid");
    parse_layout("dp=8,zero=3,recompute=full", &gpt2(), 8, 8).expect("valid");
}

/// ZeRO-3 reduce-scatters every micro-batch unless told, and `reshard=off` keeps the gathered
/// parameters through the step: nothing recomputed, ZB schedules allowed, one all-gather of
/// everything a step, and the whole parameters held; without ZeRO-3 it is refused.
#[test]
fn zero_3_layouts_reshard_or_keep_the_gathered_parameters() {
    let model = gpt2();
    let l = parse_layout("dp=8,zero=3,recompute=full", &model, 8, 16).expect("valid");
    assert_eq!(l.reduce_scatter, ReduceScatter::MicroBatch);
    assert!(l.reshard_after_forward);
    let once = parse_layout(
        "dp=8,zero=3,recompute=full,reduce_scatter=step",
        &model,
        8,
        16,
    )
    .expect("valid");
    assert_eq!(once.reduce_scatter, ReduceScatter::Step);
    let two = parse_layout("dp=8,zero=2", &model, 8, 16).expect("valid");
    assert_eq!(two.reduce_scatter, ReduceScatter::Step);
    let kept = parse_layout("dp=8,zero=3,reshard=off", &model, 8, 16).expect("valid");
    assert!(!kept.reshard_after_forward);
    parse_layout("dp=4,pp=2,zero=3,reshard=off,schedule=zb-h1", &model, 8, 16).expect("valid");
    let hw = HardwareSpec::preset("a100-80g")
        .expect("preset")
        .with_devices(8);
    let cm = merak_burn::planner::CostModel::new(&model, &hw);
    let (a, b) = (
        cm.predict(&l).expect("costed"),
        cm.predict(&kept).expect("costed"),
    );
    assert!(b.step_time_s < a.step_time_s, "{b:?} vs {a:?}");
    // Kept gathered: every 16-bit parameter of the rank beside the framework's bytes (the
    // layout without recomputation keeps no recomputation workspace).
    let params: f64 = model.units.iter().map(|u| u.params_per_rank(1)).sum();
    let gathered = b.breakdown["workspace_bytes"] - merak_burn::planner::FRAMEWORK_BYTES;
    assert!(
        (gathered - 2.0 * params).abs() < 1.0,
        "{gathered} vs {params}"
    );
    for (text, part) in [
        (
            "dp=8,zero=2,reshard=off",
            "reshard = off: only zero = 3 shards the parameters",
        ),
        ("dp=8,zero=3,reshard=no", "reshard=no (on or off)"),
    ] {
        let e = parse_layout(text, &model, 8, 16)
            .expect_err(text)
            .to_string();
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
}

mod flags {
    use super::super::flags::*;
    use merak_burn::pipeline::ScheduleKind;
    use merak_burn::planner::{HardwareSpec, TransformerShape};

    /// The error of `check` on `model` (a preset or shape) with `seq` from `--seq` when given,
    /// on `gpus` devices of the a100-80g preset.
    fn refused(
        model: &str,
        seq: Option<usize>,
        gpus: usize,
        check: impl FnOnce(&Job<'_>) -> anyhow::Result<()>,
    ) -> String {
        let mut shape: TransformerShape = model.parse().expect("a model");
        shape.seq = seq.unwrap_or(shape.seq);
        let hw = HardwareSpec::preset("a100-80g").expect("a preset");
        let job = Job {
            shape: &shape,
            hw: &hw,
            gpus,
            model,
            hardware: "a100-80g",
            seq_flag: seq.is_some(),
        };
        check(&job).expect_err("refused").to_string()
    }

    fn ok(model: &str, gpus: usize, check: impl FnOnce(&Job<'_>) -> anyhow::Result<()>) {
        let shape: TransformerShape = model.parse().expect("a model");
        let hw = HardwareSpec::preset("a100-80g").expect("a preset");
        let job = Job {
            shape: &shape,
            hw: &hw,
            gpus,
            model,
            hardware: "a100-80g",
            seq_flag: false,
        };
        check(&job).expect("accepted");
    }

    /// Issue 50: `merak plan --ep` on a dense model was ignored, and `--ep 3` failed without
    /// naming `--ep`.
    #[test]
    fn ep_is_refused_where_it_cannot_apply_naming_it() {
        for (model, gpus, ep, want) in [
            (
                "gpt2",
                4,
                2,
                "--ep 2: --model \"gpt2\" is dense (no model.moe): an expert-parallel degree needs \
                 a mixture of experts",
            ),
            (
                "moe-tiny",
                4,
                3,
                "--ep 3 does not divide the 4 experts (model.moe.experts) of --model \"moe-tiny\"",
            ),
            ("moe-tiny", 2, 4, "--ep 4 does not divide --gpus 2"),
            ("moe-tiny", 4, 0, "--ep: degrees must be at least 1"),
        ] {
            let e = refused(model, None, gpus, |job| {
                check_expert_parallel(&[1, ep], job)
            });
            assert!(e.contains(want), "{model} --ep {ep}: {e}");
        }
        ok("gpt2", 4, |job| check_expert_parallel(&[1], job));
        ok("moe-tiny", 4, |job| check_expert_parallel(&[1, 2, 4], job));
    }

    /// Issue 50: `merak plan --cp 3` failed without naming `--cp`.
    #[test]
    fn cp_is_refused_where_it_cannot_apply_naming_it() {
        let e = refused("gpt2", None, 4, |job| check_context_parallel(&[3], job));
        assert!(e.contains("--cp 3 does not divide --gpus 4"), "{e}");
        let e = refused("gpt2", None, 4, |job| {
            check_context_parallel(&[usize::MAX], job)
        });
        assert!(
            e.contains(&format!("--cp {} does not divide", usize::MAX)),
            "{e}"
        );
        let e = refused("gpt2", Some(1000), 8, |job| {
            check_context_parallel(&[1, 8], job)
        });
        assert!(
            e.contains("--cp 8: 2 x cp = 16 does not divide --seq 1000"),
            "{e}"
        );
        let e = refused(
            "gpt:layers=2,hidden=64,heads=4,seq=40,vocab=100",
            None,
            8,
            |job| check_context_parallel(&[8], job),
        );
        assert!(e.contains("the sequence length 40 of --model"), "{e}");
        let e = refused("gpt2", None, 4, |job| check_context_parallel(&[0], job));
        assert!(e.contains("--cp: degrees must be at least 1"), "{e}");
        ok("gpt2", 8, |job| check_context_parallel(&[1, 2, 8], job));
    }

    /// Issue 50: flags that only mean something with tensor or pipeline parallelism are refused
    /// where neither fits, naming the flag and the numbers.
    #[test]
    fn overlap_schedules_and_sequence_parallelism_need_somewhere_to_apply() {
        let e = refused("gpt2", None, 1, |job| check_overlaps(&[1, 2], job));
        assert!(
            e.contains(
                "--tp-overlap 2: sub-pipelining splits tensor parallelism's all-reduces, \
                        and no tp > 1 fits: --gpus 1 and the 12 heads"
            ),
            "{e}"
        );
        let e = refused("gpt2", None, 8, |job| check_overlaps(&[64], job));
        assert!(
            e.contains("--tp-overlap 64: above the 4 chunks of --hardware a100-80g"),
            "{e}"
        );
        // 11 heads on 11 devices: tp = 11 is more than a node of the preset holds.
        let e = refused(
            "gpt:layers=2,hidden=88,heads=11,seq=64,vocab=100",
            None,
            11,
            |job| check_overlaps(&[2], job),
        );
        assert!(
            e.contains(
                "the smallest degree dividing --gpus 11 and the model's 11 heads is 11, \
                        more than the 8 devices per node of --hardware a100-80g"
            ),
            "{e}"
        );
        // gpt2-xl's 25 heads share no divisor above 1 with 7 devices.
        let e = refused("gpt2-xl", None, 7, |job| {
            check_sequence_parallel(SequenceParallel::Both, job)
        });
        assert!(
            e.contains("--sequence-parallel both: sequence parallelism needs tp > 1"),
            "{e}"
        );
        ok("gpt2-xl", 7, |job| {
            check_sequence_parallel(SequenceParallel::Off, job)
        });
        let e = refused("gpt2", None, 1, |job| {
            check_schedules(&[ScheduleKind::OneFOneB], job)
        });
        assert!(
            e.contains("--schedules 1f1b: a pipeline schedule needs pp > 1, and --gpus 1"),
            "{e}"
        );
        let e = refused("tiny", None, 3, |job| {
            check_schedules(&[ScheduleKind::GPipe, ScheduleKind::ZbV], job)
        });
        assert!(
            e.contains("--schedules zb-v runs at least 2 stages per pipeline rank, and --gpus 3"),
            "{e}"
        );
        ok("gpt2", 8, |job| check_schedules(&ScheduleKind::ALL, job));
        ok("gpt2", 8, |job| check_overlaps(&[1, 2, 4], job));
    }
}
