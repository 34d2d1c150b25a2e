//! Property tests of `merak`'s own parsers: a config file and `--set` overrides, and
//! `--layout` strings, give a value or an error for arbitrary input, never a panic.

use proptest::prelude::*;

use crate::config;
use crate::plan_cmd::parse_layout;

/// A TOML-ish line: a known or unknown key, `=`, a value of any type.
fn assignment() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "model.layers",
        "model.heads",
        "model.hidden",
        "model.seq_len",
        "model.vocab_size",
        "model.init_std",
        "model.dropout",
        "parallel.dp",
        "parallel.tp",
        "parallel.pp",
        "parallel.tp_overlap",
        "parallel.sequence_parallel",
        "parallel.schedule",
        "parallel.stage_layers",
        "parallel.virtual_stages",
        "train.global_batch",
        "train.micro_batch",
        "train.lr",
        "train.steps",
        "train.comm_timeout_s",
        "data.kind",
        "checkpoint.every",
        "nonsense.key",
    ]);
    let value = prop::sample::select(vec![
        "0",
        "1",
        "-1",
        "3",
        "1e309",
        "nan",
        "18446744073709551616",
        "\"gpipe\"",
        "\"interleaved\"",
        "[1, 2]",
        "[]",
        "true",
        "\"\"",
        "{}",
        "",
    ]);
    (key, value).prop_map(|(k, v)| format!("{k}={v}"))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn configs_and_overrides(
        text in "\\PC{0,120}",
        sets in prop::collection::vec(assignment(), 0..6),
        raw in prop::collection::vec("\\PC{0,30}", 0..3),
    ) {
        let _ = config::load_text(Some((&text, "prop.toml")), &[]);
        // A config that loads also resolves into a pipeline plan (or names what does not fit).
        if let Ok(cfg) = config::load_text(None, &sets)
            && let Ok(shape) = cfg.shape()
        {
            let _ = cfg.parallel_plan().pipeline(&shape, cfg.train.global_batch);
        }
        let _ = config::load_text(None, &raw);
        // A config of the same assignments as TOML lines (sections from the keys).
        let toml: String = sets
            .iter()
            .filter_map(|s| s.split_once('.'))
            .map(|(section, rest)| format!("[{section}]\n{rest}\n"))
            .collect();
        let _ = config::load_text(Some((&toml, "prop.toml")), &[]);
    }

    /// A value that is not a finite number, set on any known key (in a file or with `--set`,
    /// after other assignments), is refused naming that key.
    #[test]
    fn non_finite_values_are_refused_naming_the_key(
        before in prop::collection::vec(assignment(), 0..4),
        target in assignment(),
        bad in prop::sample::select(vec!["nan", "-nan", "inf", "-inf", "1e309", "-1e400"]),
    ) {
        let key = target.split_once('=').map_or("", |(k, _)| k).to_string();
        // An unknown key is refused as such (naming its unknown part).
        prop_assume!(key != "nonsense.key");
        let mut sets = before.clone();
        sets.retain(|s| !s.starts_with(&format!("{key}=")));
        sets.push(format!("{key}={bad}"));
        let e = config::load_text(None, &sets).expect_err("not finite").to_string();
        // An earlier bad assignment may be named first; this one must not pass.
        prop_assert!(e.contains('`'), "{}", e);
        let alone = config::load_text(None, &[format!("{key}={bad}")])
            .expect_err("not finite")
            .to_string();
        prop_assert!(alone.contains(&format!("`{key}`")), "{}", alone);
        let (section, rest) = key.split_once('.').unwrap_or(("", &key));
        let file = format!("[{section}]\n{rest} = {bad}\n");
        let e = config::load_text(Some((&file, "prop.toml")), &[])
            .expect_err("not finite")
            .to_string();
        prop_assert!(e.contains(&key), "{}", e);
    }

    #[test]
    fn layouts(text in "[a-z0-9=,.-]{0,60}", global_batch in 0usize..64) {
        let model = merak_burn::planner::ModelProxy::parse(
            "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512",
        )
        .expect("model");
        let _ = parse_layout(&text, &model, 4, global_batch);
        let _ = parse_layout(
            &format!("dp=1,tp=2,pp=2,mbs=1,{text}"),
            &model,
            4,
            global_batch,
        );
    }
}
