//! Reading refuses what no run writes, naming it: keys of a manifest merak does not write,
//! shard tensors and metadata the manifest does not describe, optimizer state no run reaches,
//! and parameters that only the checkpoint or only the model has.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::ParamId;

use super::state::ParamShape;
use super::*;
use crate::grid::ProcessGrid;
use crate::tensor_parallel::{Shard, ShardKind};

/// Saves, into `dir`, the checkpoint of step `step` of parameters `w` [2, 3] and `v` [4]
/// with `moments` of `w`, written by the optimizer `optimizer` (`extra.optimizer`).
fn saved(dir: &Path, step: usize, moments: Moments, optimizer: serde_json::Value) -> PathBuf {
    let param = |name: &str, shape: Vec<usize>| LocalParam {
        name: name.into(),
        id: ParamId::new(),
        values: vec![0.5; shape.iter().product()],
        shape,
        split: ShardKind::Replicated,
    };
    let state = RankState {
        params: vec![param("w", vec![2, 3]), param("v", vec![4])],
        moments: vec![("w".into(), moments)],
        pieces: Vec::new(),
    };
    let extra = serde_json::json!({ "config": "x", "optimizer": optimizer });
    save(
        dir,
        &RunId::new(),
        step,
        1,
        &state,
        extra,
        &ProcessGrid::single(),
    )
    .expect("saved")
}

/// Adam's state of `w` after `time` steps: both moments `m`.
fn adam(time: usize, m: f32) -> Moments {
    Moments {
        time,
        m1: vec![m; 6],
        m2: vec![m; 6],
    }
}

fn adamw() -> serde_json::Value {
    serde_json::json!({"kind": "adamw", "state": ["first moment", "second moment"]})
}

/// What reading the checkpoint in `step` gives, as an error message.
fn read_error(step: &Path) -> String {
    Checkpoint::open(step)
        .and_then(|c| c.read_full())
        .expect_err("refused")
        .to_string()
}

/// Rewrites the only shard of the checkpoint `step` with `edit` and updates the manifest's
/// size and checksum of it (a shard altered on purpose).
fn rewrite_shard(
    step: &Path,
    edit: impl FnOnce(&mut Vec<NamedTensor>, &mut HashMap<String, String>),
) {
    let c = Checkpoint::open(step).expect("opens");
    let path = step.join(&c.manifest.files[0].file);
    let (mut tensors, mut meta) =
        shard_file::decode(&std::fs::read(&path).unwrap(), &path).unwrap();
    edit(&mut tensors, &mut meta);
    let bytes = shard_file::encode(&tensors, meta).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join(MANIFEST)).unwrap()).unwrap();
    m["files"][0]["bytes"] = bytes.len().into();
    m["files"][0]["sha256"] = sha256_hex(&bytes).into();
    std::fs::write(step.join(MANIFEST), m.to_string()).unwrap();
}

/// Sets the manifest of `step` at the JSON pointer `at` to `value`.
fn edit_manifest(step: &Path, at: &str, value: serde_json::Value) {
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join(MANIFEST)).unwrap()).unwrap();
    let (parent, key) = at.rsplit_once('/').unwrap();
    let object = m
        .pointer_mut(parent)
        .and_then(|p| p.as_object_mut())
        .unwrap();
    match value.is_null() {
        true => object.remove(key),
        false => object.insert(key.into(), value),
    };
    std::fs::write(step.join(MANIFEST), m.to_string()).unwrap();
}

#[test]
fn keys_merak_does_not_write_are_named_and_older_manifests_still_open() {
    let dir = tempfile::tempdir().unwrap();
    // Manifests of earlier versions: no lineage, no cp, no optimizer.
    let older = saved(&dir.path().join("older"), 2, adam(2, 0.5), adamw());
    edit_manifest(&older, "/run", serde_json::Value::Null);
    edit_manifest(&older, "/layout/cp", serde_json::Value::Null);
    edit_manifest(&older, "/extra/optimizer", serde_json::Value::Null);
    Checkpoint::open(&older)
        .and_then(|c| c.read_full())
        .expect("an older manifest reads");
    let step = saved(&dir.path().join("new"), 2, adam(2, 0.5), adamw());
    for (at, key) in [
        ("/bogus", "`bogus`"),
        ("/layout/ep", "`layout.ep`"),
        ("/params/1/dtype", "`params[1].dtype`"),
        ("/params/0/shard/segments", "`params[0].shard.segments`"),
        ("/files/0/pp", "`files[0].pp`"),
        ("/extra/optimizer/lr", "`extra.optimizer.lr`"),
    ] {
        let edited = dir.path().join("edited");
        let _ = std::fs::remove_dir_all(&edited);
        std::fs::create_dir_all(&edited).unwrap();
        for f in std::fs::read_dir(&step).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), edited.join(f.file_name())).unwrap();
        }
        edit_manifest(&edited, at, serde_json::json!(2));
        let e = Checkpoint::open(&edited).expect_err(at).to_string();
        assert!(e.contains(key) && e.contains("manifest.json"), "{at}: {e}");
    }
}

#[test]
fn extra_keys_are_the_trainer_s_and_the_caller_s_only() {
    let dir = tempfile::tempdir().unwrap();
    let step = saved(dir.path(), 2, adam(2, 0.5), adamw());
    let path = step.join(MANIFEST);
    let m = Checkpoint::open(&step).unwrap().manifest;
    m.check_extra(&path, &["config"])
        .expect("merak train's keys");
    let e = m.check_extra(&path, &[]).unwrap_err().to_string();
    assert!(
        e.contains("`extra.config`") && e.contains("manifest.json"),
        "{e}"
    );
    let mut data = m.clone();
    data.extra["data"] = serde_json::json!({"samples_consumed": 16, "shuffle": true});
    let e = data
        .check_extra(&path, &["config"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`extra.data.shuffle`"), "{e}");
    // A caller that writes its own `data` owns its keys.
    data.check_extra(&path, &["config", "data"])
        .expect("the caller's");
}

#[test]
fn optimizer_state_no_run_reaches_is_named_with_its_index_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let mut negative = adam(2, 0.5);
    negative.m2[4] = -0.25;
    let sgd = serde_json::json!({"kind": "sgd", "state": ["momentum buffer", "-"]});
    let adagrad =
        serde_json::json!({"kind": "adagrad", "state": ["sum of squared gradients", "-"]});
    let centered = serde_json::json!({
        "kind": "rmsprop", "state": ["squared-gradient average", "gradient average"]
    });
    let mut rms = adam(0, 0.25);
    rms.m2[1] = 0.75; // 0.75² > 0.25
    let mut infinite = adam(2, 0.5);
    infinite.m2[2] = f32::INFINITY;
    for (name, step, moments, optimizer, want) in [
        (
            "negative second moment",
            2,
            negative,
            adamw(),
            "m2/w holds -0.25 at index 4",
        ),
        (
            "negative sum",
            2,
            adam(2, -0.5),
            adagrad,
            "m1/w holds -0.5 at index 0",
        ),
        (
            "infinite second moment",
            2,
            infinite,
            adamw(),
            "m2/w holds inf at index 2",
        ),
        (
            "no step",
            2,
            adam(0, 0.5),
            adamw(),
            "adamw_time of w is 0: adamw writes a count only once",
        ),
        (
            "steps beyond",
            2,
            adam(3, 0.5),
            adamw(),
            "adamw_time of w is 3: beyond the checkpoint's step 2",
        ),
        ("centered", 2, rms, centered, "m1/w holds 0.25 at index 1"),
    ] {
        let step = saved(&dir.path().join(name), step, moments, optimizer);
        let e = read_error(&step);
        // The file: the shard, or the checkpoint's folder for a tensor of several shards.
        let file = step.file_name().unwrap().to_string_lossy().into_owned();
        assert!(e.contains(want) && e.contains(&file), "{name}: {e}");
    }
    // A momentum buffer has either sign, and SGD counts no steps.
    let step = saved(&dir.path().join("sgd"), 2, adam(0, -0.5), sgd);
    Checkpoint::open(&step)
        .and_then(|c| c.read_full())
        .expect("sgd reads");
}

/// An alteration of a shard's tensors and metadata.
type ShardEdit = Box<dyn Fn(&mut Vec<NamedTensor>, &mut HashMap<String, String>)>;

#[test]
fn shard_tensors_and_metadata_the_manifest_does_not_describe_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let named = |t: &NamedTensor| t.name.clone();
    let cases: [(&str, ShardEdit, &str); 5] = [
        (
            "unknown parameter",
            Box::new(move |t, _| {
                t.push(NamedTensor {
                    name: "param/u".into(),
                    ..t[0].clone()
                })
            }),
            "tensor param/u: the manifest lists no parameter u",
        ),
        (
            "unknown kind",
            Box::new(|t, _| {
                t.push(NamedTensor {
                    name: "m3/w".into(),
                    ..t[0].clone()
                })
            }),
            "tensor m3/w: not a tensor merak writes",
        ),
        (
            "unknown metadata",
            Box::new(|_, m| {
                m.insert("lr".into(), "1".into());
            }),
            "unknown metadata key \"lr\"",
        ),
        (
            "negative step count",
            Box::new(|_, m| {
                m.insert("adamw_time".into(), r#"{"w": -1}"#.into());
            }),
            "adamw_time of w is -1",
        ),
        (
            "transposed",
            Box::new(move |t, _| {
                let w = t.iter_mut().find(|t| named(t) == "param/w").unwrap();
                w.shape = vec![3, 2];
            }),
            "tensor param/w: shape [3, 2]",
        ),
    ];
    for (name, edit, want) in cases {
        let step = saved(&dir.path().join(name), 2, adam(2, 0.5), adamw());
        rewrite_shard(&step, edit);
        let e = read_error(&step);
        assert!(
            e.contains(want) && e.contains(".safetensors"),
            "{name}: {e}"
        );
    }
}

#[test]
fn parameters_on_one_side_only_are_listed_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let step = saved(dir.path(), 2, adam(2, 0.5), adamw());
    let c = Checkpoint::open(&step).unwrap();
    let shape = |name: &str, shape: Vec<usize>| ParamShape {
        name: name.into(),
        id: ParamId::new(),
        shape,
        split: ShardKind::Replicated,
    };
    // A rank holding only `w` of a model that is only `w`: `v` would be dropped.
    let only_w = [shape("w", vec![2, 3])];
    let world = crate::comm::LocalCommunicator;
    let e = c.check_held(&only_w, &[], &world).unwrap_err().to_string();
    assert!(
        e.contains("holds 1 parameter(s) the model lacks (v)"),
        "{e}"
    );
    let e = c.manifest.check_model(&only_w).unwrap_err().to_string();
    assert!(e.contains("the model lacks (v)"), "{e}");
    // A model with more parameters than the checkpoint: all are counted, a few named.
    let mut more: Vec<ParamShape> = vec![shape("w", vec![2, 3]), shape("v", vec![4])];
    more.extend((0..6).map(|i| shape(&format!("x{i}"), vec![1])));
    let full = c.read_full().unwrap();
    let e = (full.cut_for(&c.manifest, &more, Shard::FULL, &[]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("has 6 parameter(s) the checkpoint lacks (x0, x1, x2, x3 and 2 more)"),
        "{e}"
    );
    // The same names with another shape: the parameter and both shapes.
    let other = [shape("w", vec![3, 2]), shape("v", vec![4])];
    let e = c.manifest.check_model(&other).unwrap_err().to_string();
    assert!(
        e.contains("parameter w: shape [2, 3] in the checkpoint, [3, 2] in the model"),
        "{e}"
    );
    c.check_held(&more, &[], &world).expect("all held");
}
