use super::idle::IDLE;
use super::load::*;
use super::*;
use toml::Value;

use std::path::Path;

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

#[test]
fn overrides_apply_and_unknown_keys_are_named() {
    let c = load(
        None,
        &sets(&["train.steps=5", "parallel.tp=2", "data.kind=synthetic"]),
    )
    .unwrap();
    assert_eq!(c.train.steps, 5);
    assert_eq!(c.parallel.tp, 2);
    let e = load(None, &sets(&["train.stepz=5"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.stepz") && e.contains("steps"), "{e}");
    let e = load(None, &sets(&["train.steps=many"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.steps"), "{e}");
    let e = load(None, &sets(&["data.kind=books"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.kind"), "{e}");
    let e = load(None, &sets(&["train.steps"])).unwrap_err().to_string();
    assert!(e.contains("key=value"), "{e}");
}

#[test]
fn cuda_devices_are_a_number_or_a_list() {
    use merak_burn::device::DeviceRequest;
    let c = load(None, &sets(&["train.device=cuda", "train.cuda_device=1"])).unwrap();
    assert_eq!(c.train.cuda_device, Some(DeviceRequest::Same(1)));
    let c = load(
        None,
        &sets(&["train.device=cuda", "train.cuda_device=[1, 0]"]),
    )
    .unwrap();
    assert_eq!(
        c.train.cuda_device,
        Some(DeviceRequest::PerLocalRank(vec![1, 0]))
    );
    assert_eq!(load(None, &[]).unwrap().train.cuda_device, None);
    // Idle on another device (warned, config/idle.rs).
    load(None, &sets(&["train.cuda_device=1"])).unwrap();
    let e = load(None, &sets(&["train.device=cuda", "train.cuda_device=-1"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.cuda_device"), "{e}");
}

#[test]
fn comm_is_auto_nccl_or_mpi_and_nccl_only_on_cuda() {
    use merak_burn::comm::TransportRequest;
    assert_eq!(load(None, &[]).unwrap().train.comm, TransportRequest::Auto);
    let c = load(None, &sets(&["train.comm=\"mpi\""])).unwrap();
    assert_eq!(c.train.comm, TransportRequest::Mpi);
    let c = load(None, &sets(&["train.device=cuda", "train.comm=nccl"])).unwrap();
    assert_eq!(c.train.comm, TransportRequest::Nccl);
    let e = load(None, &sets(&["train.comm=nccl"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.comm") && e.contains("cpu"), "{e}");
    let e = load(None, &sets(&["train.comm=gloo"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.comm") && e.contains("gloo"), "{e}");
}

#[test]
fn presets_fill_the_shape_and_keys_override_them() {
    let c = load(None, &sets(&["model.preset=gpt2", "model.layers=2"])).unwrap();
    assert_eq!(c.model.gpt.hidden, 768);
    assert_eq!(c.model.gpt.layers, 2);
    let e = load(None, &sets(&["model.preset=gpt5"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.preset") && e.contains("gpt2-xl"), "{e}");
}

/// Every leaf key of the built-in default, as (section, key, value).
fn leaves() -> Vec<(String, String, Value)> {
    let Value::Table(root) = default_value() else {
        panic!("the default is a table");
    };
    let mut out = Vec::new();
    for (section, table) in root {
        let Value::Table(table) = table else {
            panic!("{section} is a section");
        };
        for (key, value) in table {
            out.push((section.clone(), key, value));
        }
    }
    out
}

#[test]
fn a_value_used_as_a_table_is_an_unknown_key_in_every_section_by_file_and_set() {
    let e = load(None, &sets(&["model.kind.x=1"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`model.kind.x`") && e.contains("not a table"),
        "{e}"
    );
    let e = load(None, &sets(&["model.kind={x=1}"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`model.kind.x`"), "{e}");
    let leaves = leaves();
    assert!(leaves.len() > 40, "{}", leaves.len());
    for (section, key, _) in &leaves {
        let dotted = format!("{section}.{key}.x");
        let e = load(None, &[format!("{dotted}=1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("`{dotted}`")), "{e}");
        let file = format!("[{section}.{key}]\nx = 1\n");
        let e = load_text(Some((&file, "f.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("`{dotted}`")), "{e}");
        // A section given a value is named too.
        let e = load(None, &[format!("{section}=3")])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("`{section}`")), "{e}");
        let e = load_text(Some((&format!("{section} = 3"), "f.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("`{section}`")), "{e}");
    }
}

#[test]
fn every_non_finite_float_is_refused_naming_its_key_by_file_and_set() {
    let e = load(None, &sets(&["train.min_lr=nan"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`train.min_lr`") && e.contains("finite"), "{e}");
    let floats: Vec<_> = leaves()
        .into_iter()
        .filter(|(_, _, v)| matches!(v, Value::Float(_)))
        .collect();
    assert!(floats.len() >= 14, "{}", floats.len());
    for (section, key, _) in floats {
        let dotted = format!("{section}.{key}");
        for bad in ["nan", "inf", "-inf", "+nan", "1e309", "-1e309"] {
            let e = load(None, &[format!("{dotted}={bad}")])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{dotted}`")), "{bad}: {e}");
            let file = format!("[{section}]\n{key} = {bad}\n");
            let e = load_text(Some((&file, "f.toml")), &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{dotted}`")), "{bad}: {e}");
        }
    }
    // Inside an array the element is named.
    let e = check_finite(&parse_literal("[1.0, nan]"), "a.b")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`a.b[1]`"), "{e}");
}

#[test]
fn a_key_twice_in_a_file_is_refused_and_the_later_set_wins() {
    for text in [
        "[train]\nsteps = 1\nsteps = 2\n",
        "[train]\nsteps = 1\n[train]\nlr = 0.1\n",
        "model = { layers = 1, layers = 2 }\n",
    ] {
        let e = load_text(Some((text, "twice.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("twice.toml") && e.contains("duplicate"),
            "{text}: {e}"
        );
    }
    let c = load(None, &sets(&["train.steps=1", "train.steps=7"])).unwrap();
    assert_eq!(c.train.steps, 7);
}

#[test]
fn comm_timeout_is_bounded_by_a_year() {
    let c = load(None, &sets(&["train.comm_timeout_s=31536000"])).unwrap();
    assert_eq!(c.train.comm_timeout_s, MAX_COMM_TIMEOUT_S);
    for big in ["1e300", "31536001"] {
        let e = load(None, &[format!("train.comm_timeout_s={big}")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`train.comm_timeout_s`") && e.contains("31536000"),
            "{e}"
        );
    }
}

#[test]
fn a_validation_pass_is_bounded_by_the_data() {
    let huge = ["data.val_every=1", "data.val_batches=1000000000"];
    let e = load(None, &sets(&huge)).unwrap_err().to_string();
    for part in ["`data.val_batches`", "8000000000 sequences", "(65536)"] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    // Unused without validation.
    load(None, &sets(&["data.val_batches=1000000000"])).unwrap();
    let e = load(
        None,
        &sets(&["data.val_every=1", "data.val_batches=9223372036854775807"]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("more than 2^64"), "{e}");
    // Tokens: as many windows as a pass reads, not one more.
    let c = load(None, &sets(&["data.val_every=1", "data.val_batches=2"])).unwrap();
    c.validate_val_windows(16).unwrap();
    let e = c.validate_val_windows(15).unwrap_err().to_string();
    assert!(e.contains("16 sequences") && e.contains("(15)"), "{e}");
}

#[test]
fn zero_stages_prefetch_reduce_scatter_and_hybrid_sharding_are_checked_and_named() {
    let refused = |keys: &[&str]| load(None, &sets(keys)).unwrap_err().to_string();
    let e = refused(&["parallel.zero=4"]);
    assert!(
        e.contains("parallel.zero") && e.contains("0, 1, 2 or 3"),
        "{e}"
    );
    let e = refused(&["parallel.zero=3", "parallel.prefetch=9"]);
    assert!(
        e.contains("parallel.prefetch") && e.contains("at most 8"),
        "{e}"
    );
    let e = refused(&["parallel.dp=4", "parallel.zero=3", "parallel.shard=3"]);
    assert!(e.contains("parallel.shard") && e.contains("divide"), "{e}");
    let e = refused(&["parallel.zero=2", "parallel.reduce_scatter=always"]);
    assert!(
        e.contains("reduce_scatter") && e.contains("micro-batch"),
        "{e}"
    );
    for ok in [
        &[
            "parallel.dp=2",
            "parallel.zero=2",
            "parallel.reduce_scatter=micro-batch",
        ][..],
        &["parallel.dp=4", "parallel.zero=2", "parallel.shard=2"],
        &["parallel.dp=4", "parallel.zero=1", "parallel.shard=2"],
        &["parallel.dp=4", "parallel.zero=3", "parallel.shard=1"],
        &["parallel.dp=4", "parallel.zero=0", "parallel.shard=4"],
        // Idle at these stages: accepted (warned, config/idle.rs).
        &["parallel.dp=4", "parallel.zero=0", "parallel.shard=3"],
        &["parallel.zero=1", "parallel.reduce_scatter=micro-batch"],
        &["parallel.zero=2", "parallel.reshard_after_forward=false"],
    ] {
        load(None, &sets(ok)).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
}

#[test]
fn products_of_degrees_that_overflow_are_refused() {
    let e = load(
        None,
        &sets(&[
            "train.global_batch=4611686018427387904",
            "parallel.dp=4611686018427387904",
            "parallel.tp=4",
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`parallel.dp`") && e.contains("overflows"),
        "{e}"
    );
    let e = load(
        None,
        &sets(&[
            "parallel.pp=4",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=9223372036854775807",
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`parallel.virtual_stages`"), "{e}");
}

#[test]
fn optimizer_keys_are_checked_and_named() {
    use merak_burn::train::{LrScheduleKind, OptimizerKind};
    let c = load(None, &[]).unwrap();
    assert_eq!(c.optimizer, merak_burn::train::OptimizerSettings::default());
    let c = load(
        None,
        &sets(&[
            "optimizer.kind=sgd",
            "optimizer.momentum=0.9",
            "optimizer.nesterov=true",
            "optimizer.schedule=wsd",
            "optimizer.decay_steps=20",
        ]),
    )
    .unwrap();
    assert_eq!(c.optimizer.kind, OptimizerKind::Sgd);
    assert_eq!(c.optimizer.schedule, LrScheduleKind::Wsd);
    let s = c.train_settings();
    assert_eq!((s.optimizer.momentum, s.optimizer.decay_steps), (0.9, 20));
    for (set, key, part) in [
        (vec!["optimizer.kind=lion"], "`optimizer.kind`", "lion"),
        (
            vec!["optimizer.kind=muon", "optimizer.muon_scale=\"spectral\""],
            "optimizer.muon_scale",
            "spectral",
        ),
        (
            vec!["optimizer.schedule=step"],
            "`optimizer.schedule`",
            "step",
        ),
        (
            vec!["optimizer.kind=sgd", "optimizer.momentum=1.5"],
            "`optimizer.momentum`",
            "1.5 must be in [0, 1)",
        ),
        (
            vec!["optimizer.momentum=0.9"],
            "`optimizer.momentum`",
            "does not use it",
        ),
        (
            vec!["optimizer.kind=sgd", "optimizer.nesterov=true"],
            "`optimizer.nesterov`",
            "momentum > 0",
        ),
        (
            vec!["optimizer.schedule=wsd"],
            "`optimizer.decay_steps`",
            "at least 1",
        ),
        (
            vec!["optimizer.schedule=linear", "train.warmup_steps=300"],
            "`train.warmup_steps`",
            "longer than the run",
        ),
        (
            vec!["optimizer.kind=rmsprop", "optimizer.alpha=-0.5"],
            "`optimizer.alpha`",
            "-0.5",
        ),
    ] {
        let e = load(None, &sets(&set)).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(part), "{set:?}: {e}");
    }
    let file = "[optimizer]\nkind = \"adagrad\"\nlr_decay = 0.01\n";
    let c = load_text(Some((file, "f.toml")), &[]).unwrap();
    assert_eq!(c.optimizer.kind, OptimizerKind::AdaGrad);
}

#[test]
fn the_shipped_config_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt-tiny.toml");
    let c = load(Some(&path), &[]).unwrap();
    assert_eq!(c.model.gpt.heads, 4);
}

#[test]
fn a_document_mask_is_refused_for_bert_naming_the_key_and_the_kind() {
    load(None, &sets(&["data.document_mask=true"])).unwrap();
    let e = load(None, &sets(&["model.kind=bert", "data.document_mask=true"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`data.document_mask`") && e.contains("\"bert\""),
        "{e}"
    );
}

#[test]
fn a_moe_table_set_in_part_names_the_missing_key() {
    let e = load(None, &sets(&["model.moe.experts=4", "model.moe.top_k=2"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.moe.expert_hidden") && e.contains("no default"),
        "{e}"
    );
    let e = load(
        None,
        &sets(&["model.moe.experts=4", "model.moe.expert_hidden=8"]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("model.moe.top_k"), "{e}");
    assert!(
        load(
            None,
            &sets(&[
                "model.moe.experts=4",
                "model.moe.top_k=2",
                "model.moe.expert_hidden=8"
            ])
        )
        .is_ok()
    );
}

/// Every key of `known_keys` (the optional and `[model.moe]` ones too) with a value of another
/// type: the key `--set` or a file gives it, and the value.
fn wrong_types() -> Vec<(String, String)> {
    let mut keys = Vec::new();
    let mut stack = vec![(String::new(), known_keys())];
    while let Some((path, v)) = stack.pop() {
        match v {
            Value::Table(t) => stack.extend(t.into_iter().map(|(k, v)| (join_key(&path, &k), v))),
            Value::String(_) => keys.push((path, "true".to_string())),
            _ => keys.push((path, "\"x\"".to_string())),
        }
    }
    keys
}

#[test]
fn a_wrong_type_names_the_whole_key_and_the_type_expected_by_set_and_in_a_file() {
    for (set, want) in [
        (
            "model.hidden=\"x\"",
            "`model.hidden`: invalid type: string \"x\", expected usize",
        ),
        (
            "model.moe.top_k=true",
            "`model.moe.top_k`: invalid type: boolean `true`, expected usize",
        ),
        (
            "model.moe.score=3",
            "`model.moe.score`: invalid type: integer `3`, expected `softmax` or `sigmoid`",
        ),
        (
            "parallel.schedule=3",
            "`parallel.schedule`: invalid type: integer `3`, expected one of `gpipe`",
        ),
        (
            "parallel.stage_recompute=[1]",
            "`parallel.stage_recompute`: invalid entry in array `[1]`, expected one of `none`",
        ),
        (
            "train.precision=[1]",
            "`train.precision`: invalid type: array `[1]`, expected `fp32` or `bf16`",
        ),
        (
            "train.cuda_device=\"x\"",
            "`train.cuda_device`: invalid type: string \"x\", expected a device number or a list",
        ),
    ] {
        let e = load(None, &sets(&["model.preset=moe-tiny", set]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{set}: {e}");
    }
    let keys = wrong_types();
    assert!(keys.len() > 60, "{}", keys.len());
    for (key, bad) in keys {
        let e = load(
            None,
            &["model.preset=moe-tiny".to_string(), format!("{key}={bad}")],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("config key `{key}`: ")) && e.contains("expected"),
            "{key}: {e}"
        );
        let preset = match key.as_str() {
            "model.preset" => "",
            _ => "model.preset = \"moe-tiny\"\n",
        };
        let file = format!("{preset}{key} = {bad}\n");
        let e = load_text(Some((&file, "f.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("config file f.toml: config key `{key}`: "))
                && e.contains("expected"),
            "{key}: {e}"
        );
    }
}

#[test]
fn settings_that_select_nothing_are_refused_naming_the_keys() {
    let moe = ["model.preset=moe-tiny", "model.layers=2"];
    let refused = |extra: &[&str]| {
        let mut s = sets(&moe);
        s.extend(sets(extra));
        load(None, &s).unwrap_err().to_string()
    };
    let e = refused(&["model.moe.every=3"]);
    assert!(
        e.contains("`model.moe.every`")
            && e.contains("model.moe.every = 3 is more than model.layers = 2"),
        "{e}"
    );
    // The experts are 4, top-2: a factor of 2 already holds every token.
    let e = refused(&["model.moe.capacity_factor=2.5"]);
    assert!(
        e.contains("`model.moe.capacity_factor`")
            && e.contains("2.5 is more than model.moe.experts / model.moe.top_k = 4 / 2"),
        "{e}"
    );
    let e = load(
        None,
        &sets(&[
            "train.steps=5",
            "checkpoint.every=6",
            "checkpoint.at_end=false",
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`checkpoint.every`") && e.contains("6 is more than train.steps = 5"),
        "{e}"
    );
    for ok in [&["model.moe.every=2"][..], &["model.moe.capacity_factor=2"]] {
        let mut s = sets(&moe);
        s.extend(sets(ok));
        load(None, &s).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
    for ok in [
        &["train.steps=5", "checkpoint.every=6"][..],
        &[
            "train.steps=5",
            "checkpoint.every=5",
            "checkpoint.at_end=false",
        ],
        &[
            "train.steps=5",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
        ],
    ] {
        load(None, &sets(ok)).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
}

/// A config with every real-valued key set: a mixture of experts with a capacity factor.
fn every_real_key() -> Config {
    load(
        None,
        &sets(&["model.preset=moe-tiny", "model.moe.capacity_factor=1"]),
    )
    .unwrap()
}

#[test]
fn every_real_valued_key_has_bounds_and_its_doc_states_them() {
    let cfg = every_real_key();
    let real = cfg.real_keys();
    let mut floats = Vec::new();
    let mut stack = vec![(String::new(), known_keys())];
    while let Some((path, v)) = stack.pop() {
        match v {
            Value::Table(t) => stack.extend(t.into_iter().map(|(k, v)| (join_key(&path, &k), v))),
            Value::Float(_) => floats.push(path),
            _ => {}
        }
    }
    assert!(floats.len() >= 20, "{floats:?}");
    for key in &floats {
        assert!(
            real.iter().any(|(k, v, _)| k == key && v.is_some()),
            "{key} is real-valued but has no bounds (Config::real_keys)"
        );
    }
    // The configuration reference (generated from the keys' doc comments) states each range.
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference/config.md"),
    )
    .unwrap();
    for (key, _, bounds) in &real {
        let row = (page.lines())
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("{key}: no row in the configuration reference"));
        assert!(
            row.contains(&bounds.to_string()),
            "{key}: its doc comment does not state {bounds}: {row}"
        );
    }
}

#[test]
fn an_absurd_real_value_is_refused_naming_the_key_the_value_and_the_range() {
    let e = load(
        None,
        &sets(&["model.preset=moe-tiny", "model.moe.aux_loss=1e30"]),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(e, "config key `model.moe.aux_loss`: 1e30 must be in [0, 1]");
    for (key, _, bounds) in every_real_key().real_keys() {
        let mut outside = Vec::new();
        if bounds.high.is_finite() {
            outside.push(bounds.high * 2.0 + 1.0);
        }
        outside.push(match (bounds.low_open, bounds.low) {
            (true, low) => low,
            (false, 0.0) => -1.0,
            (false, low) => low / 10.0,
        });
        for v in outside {
            let shown = shown(v);
            let set = [
                "model.preset=moe-tiny".to_string(),
                "model.moe.capacity_factor=1".to_string(),
                format!("{key}={v:e}"),
            ];
            let e = load(None, &set).unwrap_err().to_string();
            let want = format!("config key `{key}`: {shown} must be in {bounds}");
            assert_eq!(e, want, "{key} = {v}");
            let mut file = format!("{key} = {v:e}\n");
            if key != "model.moe.capacity_factor" {
                file.push_str("model.moe.capacity_factor = 1.0\n");
            }
            let e = match load_text(Some((&file, "f.toml")), &set[..1]) {
                Ok(_) => panic!("{key} = {v:e} in a file is accepted"),
                Err(e) => e.to_string(),
            };
            assert_eq!(e, format!("config file f.toml: {want}"), "{key} = {v}");
        }
    }
}

#[test]
fn settings_idle_in_the_layout_are_listed_with_the_reason_and_only_there() {
    const MOE: &str = "model.preset=moe-tiny";
    const EP2: [&str; 2] = ["parallel.dp=2", "parallel.ep=2"];
    // (key, settings where a value other than its default is idle, settings where it acts)
    let cases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (
            "parallel.prefetch",
            vec!["parallel.prefetch=2"],
            vec!["parallel.zero=3"],
        ),
        (
            "parallel.reshard_after_forward",
            vec!["parallel.reshard_after_forward=false", "parallel.zero=2"],
            vec!["parallel.zero=3"],
        ),
        (
            "parallel.reduce_scatter",
            vec!["parallel.reduce_scatter=micro-batch", "parallel.zero=1"],
            vec!["parallel.zero=2"],
        ),
        (
            "parallel.shard",
            vec!["parallel.dp=4", "parallel.shard=2"],
            vec!["parallel.zero=1"],
        ),
        (
            "parallel.gradient_buffers",
            vec!["parallel.gradient_buffers=device", "parallel.zero=1"],
            vec!["parallel.zero=0"],
        ),
        (
            "parallel.cp_attention",
            vec!["parallel.cp_attention=all-to-all"],
            vec!["parallel.cp=2"],
        ),
        (
            "parallel.sequence_parallel",
            vec!["parallel.sequence_parallel=true"],
            vec!["parallel.tp=2"],
        ),
        (
            "parallel.tp_overlap",
            vec!["parallel.tp_overlap=2"],
            vec!["parallel.tp=2"],
        ),
        (
            "parallel.virtual_stages",
            vec!["parallel.virtual_stages=2", "parallel.pp=2"],
            vec!["parallel.schedule=interleaved"],
        ),
        (
            "parallel.stage_layers",
            vec!["parallel.stage_layers=[2, 2]"],
            vec!["parallel.pp=2"],
        ),
        (
            "parallel.memory_budget_mb",
            vec!["parallel.memory_budget_mb=100"],
            vec!["parallel.recompute=stage-aware"],
        ),
        (
            "parallel.recompute",
            vec![
                "parallel.recompute=full",
                "parallel.stage_recompute=[\"none\"]",
            ],
            vec!["parallel.stage_recompute=[]"],
        ),
        (
            "model.moe.max_load",
            vec![MOE, "model.moe.max_load=8"],
            EP2.to_vec(),
        ),
        (
            "model.moe.shared_overlap",
            vec![
                MOE,
                "model.moe.shared_overlap=false",
                "model.moe.shared_experts=1",
            ],
            EP2.to_vec(),
        ),
        (
            "model.mask_token_id",
            vec!["model.mask_token_id=5"],
            vec!["model.kind=bert"],
        ),
        ("train.comm", vec!["train.comm=mpi"], vec!["parallel.dp=2"]),
        (
            "train.comm_timeout_s",
            vec!["train.comm_timeout_s=5"],
            vec!["parallel.dp=2"],
        ),
        (
            "train.cuda_device",
            vec!["train.cuda_device=1"],
            vec!["train.device=cuda"],
        ),
        (
            "train.sample_temperature",
            vec!["train.sample_temperature=0.5"],
            vec!["train.sample_tokens=4"],
        ),
        (
            "train.sample_tokens",
            vec!["train.sample_tokens=4", "parallel.pp=2"],
            vec!["parallel.pp=1"],
        ),
        (
            "train.min_lr",
            vec!["train.min_lr=0", "optimizer.schedule=constant"],
            vec!["optimizer.schedule=linear"],
        ),
        (
            "data.val_batches",
            vec!["data.val_batches=3"],
            vec!["data.val_every=5"],
        ),
        (
            "data.path",
            vec!["data.path=somewhere"],
            vec!["data.kind=tokens"],
        ),
    ];
    let mut keys: Vec<&str> = cases.iter().map(|c| c.0).collect();
    keys.sort_unstable();
    let mut table: Vec<&str> = IDLE.iter().map(|i| i.key).collect();
    table.sort_unstable();
    assert_eq!(keys, table, "a case for every key of IDLE");
    let idle = |s: &[&str]| {
        load(None, &sets(s))
            .unwrap_or_else(|e| panic!("{s:?}: {e}"))
            .idle_settings()
    };
    assert_eq!(idle(&[]), vec![], "the defaults");
    assert_eq!(idle(&[MOE]), vec![], "the defaults of [model.moe]");
    for (key, idle_here, acting) in cases {
        let listed = idle(&idle_here);
        let found: Vec<_> = listed.iter().filter(|s| s.key == key).collect();
        assert_eq!(found.len(), 1, "{key} under {idle_here:?}: {listed:?}");
        let line = found[0].to_string();
        assert!(
            line.starts_with(&format!("{key} = "))
                && line.contains("has no effect in this layout ("),
            "{line}"
        );
        let both = [idle_here.clone(), acting.clone()].concat();
        let listed = idle(&both);
        assert!(
            listed.iter().all(|s| s.key != key),
            "{key} under {both:?}: {listed:?}"
        );
    }
}

/// A mixture of experts balances per sequence unless `model.moe.balance` names the
/// micro-batch; balanced per micro-batch with a micro-batch that follows the layout, it is
/// warned about; a value neither names is refused naming the file, the key and both values.
#[test]
fn the_experts_balance_per_sequence_unless_told_and_a_bad_balance_is_refused() {
    use merak_burn::moe::Balance;
    let tiny = load(None, &sets(&["model.preset=moe-tiny"])).unwrap();
    let moe = tiny.model.gpt.moe.as_ref().expect("experts");
    assert_eq!(moe.balance, Balance::Sequence);
    assert_eq!(tiny.layout_dependent_balance(true), None);
    let per_micro = ["model.preset=moe-tiny", "model.moe.balance=\"micro-batch\""];
    let c = load(None, &sets(&per_micro)).unwrap();
    assert_eq!(
        c.model.gpt.moe.as_ref().map(|m| m.balance),
        Some(Balance::MicroBatch)
    );
    let w = c.layout_dependent_balance(true).expect("a warning");
    assert!(
        w.contains("model.moe.balance = \"micro-batch\"")
            && w.contains("train.micro_batch = 8 here")
            && w.contains("parallel.dp"),
        "{w}"
    );
    assert_eq!(c.layout_dependent_balance(false), None);
    let file = "model.preset = \"moe-tiny\"\n[model.moe]\nbalance = \"batch\"\n";
    let e = load_text(Some((file, "f.toml")), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("config file f.toml: config key `model.moe.balance`: ")
            && e.contains("unknown variant `batch`, expected `sequence` or `micro-batch`"),
        "{e}"
    );
}
