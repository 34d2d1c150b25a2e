//! Saving and pruning killed at every crash point ([`fault::POINTS`]): what is left on disk
//! always opens as a complete checkpoint (or, when the very first save dies before its
//! rename, as a clean "no checkpoint yet"), and the next save repairs the rest. Pruning never
//! touches another lineage's checkpoints.

use std::path::{Path, PathBuf};

use burn::module::ParamId;

use super::fault::{self, inject_error};
use super::root::list;
use super::*;
use crate::grid::ProcessGrid;
use crate::tensor_parallel::ShardKind;

/// A rank state whose one parameter holds `[step, step + 0.5]`, so a loaded checkpoint tells
/// which save it came from.
fn state_of(step: usize) -> RankState {
    let v = step as f32;
    RankState {
        params: vec![LocalParam {
            name: "w".into(),
            id: ParamId::new(),
            shape: vec![2],
            split: ShardKind::Replicated,
            values: vec![v, v + 0.5],
        }],
        moments: vec![(
            "w".into(),
            Moments {
                time: step,
                m1: vec![v; 2],
                m2: vec![v; 2],
            },
        )],
        pieces: Vec::new(),
    }
}

fn save_step(
    root: &Path,
    run: &RunId,
    step: usize,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    save(
        root,
        run,
        step,
        keep,
        &state_of(step),
        serde_json::Value::Null,
        &ProcessGrid::single(),
    )
}

/// Like [`save_step`], asynchronously: started (the writer thread writes while the test's
/// thread goes on), then completed.
fn save_step_async(
    root: &Path,
    run: &RunId,
    step: usize,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let grid = ProcessGrid::single();
    let pending = start(
        root,
        run,
        step,
        keep,
        state_of(step),
        serde_json::Value::Null,
        &grid,
    )?;
    assert_eq!(pending.step(), step);
    Ok(pending.finish(&grid)?.dir)
}

/// The step of the checkpoint `root` opens, checked against its values.
fn loaded_step(root: &Path) -> usize {
    let c = Checkpoint::open(root).expect("a complete checkpoint opens");
    let full = c.read_full().expect("and reads");
    let step = c.manifest.step;
    assert_eq!(full.params["w"], vec![step as f32, step as f32 + 0.5]);
    assert_eq!(full.moments["w"].time, step);
    step
}

/// A save: on the calling thread, or asynchronously.
type Saver = fn(&Path, &RunId, usize, usize) -> Result<PathBuf, CheckpointError>;

/// Saves steps 1 and 2, then step 3 killed at `point` (each with `saver`): returns the root.
fn killed_third_save(point: &'static str, keep: usize, saver: Saver) -> (tempfile::TempDir, RunId) {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let run = RunId::new();
    saver(&root, &run, 1, keep).expect("step 1");
    saver(&root, &run, 2, keep).expect("step 2");
    inject_error(Some((point, 1)));
    let e = saver(&root, &run, 3, keep).expect_err("killed");
    inject_error(None);
    assert!(
        matches!(e, CheckpointError::Injected { point: p } if p == point),
        "{e}"
    );
    (dir, run)
}

#[test]
fn a_save_killed_anywhere_leaves_a_checkpoint_that_opens_and_the_next_save_repairs() {
    killed_anywhere(save_step);
}

/// With the writer thread in flight (the crash at `save:writing` is reached on it, carried
/// from the test's thread), what is left is the same as a synchronous save's.
#[test]
fn an_asynchronous_save_killed_anywhere_leaves_what_a_synchronous_one_does() {
    killed_anywhere(save_step_async);
}

/// Every crash point of a third save with `saver`: the second or third checkpoint opens, and
/// the next save repairs the rest.
fn killed_anywhere(saver: Saver) {
    for point in fault::POINTS {
        if matches!(point, "save:pointed" | "save:replaced") {
            continue; // only reached when a same-step folder is replaced (below)
        }
        let (dir, run) = killed_third_save(point, 1, saver);
        let root = dir.path().join("checkpoints");
        let after_rename = matches!(point, "save:renamed" | "save:latest" | "prune:removing");
        assert_eq!(
            loaded_step(&root),
            if after_rename { 3 } else { 2 },
            "{point}"
        );
        let listing = list(&root).expect("listed");
        assert!(listing.unreadable.is_empty(), "{point}: {listing:?}");
        saver(&root, &run, 4, 1).expect("the next save");
        assert_eq!(loaded_step(&root), 4, "{point}");
        let listing = list(&root).expect("listed");
        assert_eq!(listing.checkpoints.len(), 1, "{point}: {listing:?}");
        assert!(listing.unfinished.is_empty(), "{point}: {listing:?}");
    }
}

#[test]
fn the_first_save_killed_before_its_rename_leaves_no_checkpoint_yet() {
    let points = ["save:begun", "save:writing", "save:shards", "save:manifest"];
    let savers = [save_step as Saver, save_step_async];
    for (point, saver) in points.into_iter().flat_map(|p| savers.map(|s| (p, s))) {
        let dir = tempfile::tempdir().expect("temp folder");
        let root = dir.path().join("checkpoints");
        inject_error(Some((point, 1)));
        assert!(saver(&root, &RunId::new(), 1, 3).is_err(), "{point}");
        inject_error(None);
        let e = Checkpoint::open(&root).expect_err("nothing to open");
        assert!(
            matches!(e, CheckpointError::NoCheckpoint { .. })
                && e.to_string().contains("no checkpoint yet"),
            "{point}: {e}"
        );
    }
}

#[test]
fn replacing_a_same_step_folder_never_leaves_latest_without_a_checkpoint() {
    let points = ["save:pointed", "save:replaced", "save:renamed"];
    let savers = [save_step as Saver, save_step_async];
    for (point, saver) in points.into_iter().flat_map(|p| savers.map(|s| (p, s))) {
        let dir = tempfile::tempdir().expect("temp folder");
        let root = dir.path().join("checkpoints");
        let run = RunId::new();
        save_step(&root, &run, 3, 0).expect("step 3");
        inject_error(Some((point, 1)));
        assert!(saver(&root, &run, 3, 0).is_err(), "{point}");
        inject_error(None);
        assert_eq!(loaded_step(&root), 3, "{point}");
        // While the old folder goes, `latest` alone names a complete checkpoint too (after
        // the rename it names the vanished partial folder until it is switched, and opening
        // the root finds the renamed one by its step).
        let listing = list(&root).expect("listed");
        if point != "save:renamed" {
            assert!(listing.latest_dir(&root).is_some(), "{point}: {listing:?}");
        }
        save_step(&root, &run, 4, 1).expect("the next save");
        assert_eq!(loaded_step(&root), 4);
        let listing = list(&root).expect("listed");
        assert!(listing.unfinished.is_empty(), "{point}: {listing:?}");
    }
}

#[test]
fn pruning_keeps_other_lineages_the_newest_and_the_one_latest_names() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let (ours, theirs) = (RunId::new(), RunId::new());
    save_step(&root, &theirs, 1, 1).expect("another run's step 1");
    save_step(&root, &theirs, 7, 1).expect("another run's step 7");
    for step in [2, 3, 4] {
        save_step(&root, &ours, step, 2).expect("ours");
    }
    let listing = list(&root).expect("listed");
    let steps: Vec<(usize, bool)> = (listing.checkpoints.iter())
        .map(|c| (c.step, c.run.as_ref() == Some(&ours)))
        .collect();
    // Theirs: only their own pruning removed their step 1; ours keeps 3 and 4.
    assert_eq!(steps, vec![(3, true), (4, true), (7, false)]);
    // An older save of ours than theirs is still the newest written: it is kept.
    save_step(&root, &ours, 5, 1).expect("ours");
    let kept: Vec<usize> = list(&root)
        .expect("listed")
        .checkpoints
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(kept, vec![5, 7]);
}

#[test]
fn hostile_manifests_are_refused_before_anything_is_allocated() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let step = save_step(&root, &RunId::new(), 1, 1).expect("saved");
    let path = step.join(MANIFEST);
    let good = std::fs::read_to_string(&path).expect("manifest");
    let refused = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut m: serde_json::Value = serde_json::from_str(&good).expect("json");
        edit(&mut m);
        std::fs::write(&path, m.to_string()).expect("written");
        let e = Checkpoint::open(&step).and_then(|c| c.read_full().map(|_| ()));
        let e = e.expect_err(says).to_string();
        assert!(
            e.contains(says) && e.contains("manifest.json"),
            "{says}: {e}"
        );
    };
    refused(
        &|m| m["layout"]["tp"] = 1usize.wrapping_shl(62).into(),
        "layout tp",
    );
    refused(&|m| m["layout"]["dp"] = 0.into(), "layout dp = 0");
    refused(
        &|m| m["params"][0]["shard"] = serde_json::json!({"kind": "columns", "segments": 0}),
        "segments",
    );
    refused(
        &|m| m["params"][0]["shape"] = serde_json::json!([1usize << 40, 1usize << 40]),
        "parameter w",
    );
    refused(&|m| m["step"] = (MAX_STEP + 1).into(), "step");
    refused(&|m| m["files"][0]["tp"] = 3.into(), "tp rank 3");
    refused(&|m| m["run"] = "../../etc".into(), "run id");
    std::fs::write(&path, &good).expect("restored");
    assert_eq!(loaded_step(&root), 1);
}

#[test]
fn non_finite_values_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let mut state = state_of(1);
    state.params[0].values[1] = f32::NAN;
    save(
        &root,
        &RunId::new(),
        1,
        1,
        &state,
        serde_json::Value::Null,
        &ProcessGrid::single(),
    )
    .expect("saved");
    let e = Checkpoint::open(&root)
        .expect("opens")
        .read_full()
        .expect_err("NaN")
        .to_string();
    assert!(
        e.contains("param/w") && e.contains("NaN") && e.contains("index 1"),
        "{e}"
    );
}

#[test]
fn a_fifo_in_place_of_a_manifest_or_latest_is_refused_without_blocking() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let step = save_step(&root, &RunId::new(), 1, 1).expect("saved");
    let fifo = |path: &Path| {
        std::fs::remove_file(path).expect("removed");
        let made = std::process::Command::new("mkfifo").arg(path).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
    };
    fifo(&root.join(LATEST));
    let e = Checkpoint::open(&root).expect_err("refused").to_string();
    assert!(
        e.contains("latest") && e.contains("not a regular file"),
        "{e}"
    );
    fifo(&step.join(MANIFEST));
    let e = Checkpoint::open(&step).expect_err("refused").to_string();
    assert!(
        e.contains("manifest.json") && e.contains("not a regular file"),
        "{e}"
    );
}
