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
        ("dp=4,tp=2,overlap=3", "overlap=3 does not divide"),
        ("dp=8,schedule=fast", "--layout: schedule=fast"),
        ("dp=8,speed=1", "unknown key `speed`"),
        ("dp=8,zero=2,shard=3", "shard=3 must divide dp=8"),
        (
            "dp=8,shard=4",
            "shard=4 (hybrid sharding) needs zero=1, 2 or 3",
        ),
        ("dp=8,shard=0", "shard=0 must be at least 1"),
        (
            "dp=8,zero=1,reduce_scatter=micro-batch",
            "reduce_scatter=micro-batch needs zero=2 or zero=3",
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
        ("dp=1,cp=8,sp=on", "sp=on needs tp > 1"),
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
        e.contains("cp=8: 2 x cp must divide the sequence length 40"),
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
    for (text, part) in [
        (
            "dp=8,ep=3",
            "ep=3 must divide the model's 4 experts and dp x cp = 8",
        ),
        (
            "dp=2,pp=4,ep=4",
            "ep=4 must divide the model's 4 experts and dp x cp = 2",
        ),
        (
            "dp=4,tp=2,ep=2",
            "tp=2 with a mixture of experts needs sp=on",
        ),
        ("dp=8,ep=0", "ep=0 must be at least 1"),
    ] {
        let e = parse_layout(text, &moe, 8, 8).expect_err(text).to_string();
        assert!(e.contains(part), "{text}: {part:?} not in {e}");
    }
    let e = refused("dp=8,ep=2");
    assert!(e.contains("ep=2 needs a mixture of experts"), "{e}");
}
