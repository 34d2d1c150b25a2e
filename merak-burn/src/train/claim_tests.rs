//! A run never writes over, prunes or removes what another run wrote; a resumed run never
//! silently forks its own history.

use std::path::{Path, PathBuf};

use burn::module::ParamId;

use super::claim::*;
use crate::checkpoint::{self, Checkpoint, LocalParam, RankState, RunId};
use crate::grid::ProcessGrid;
use crate::tensor_parallel::ShardKind;

/// A checkpoint of `run` after `step` steps in `root`.
fn checkpoint_of(root: &Path, run: &RunId, step: usize) -> PathBuf {
    let state = RankState {
        params: vec![LocalParam {
            name: "w".into(),
            id: ParamId::new(),
            shape: vec![1],
            split: ShardKind::Replicated,
            values: vec![step as f32],
        }],
        moments: Vec::new(),
        pieces: Vec::new(),
    };
    let grid = ProcessGrid::single();
    checkpoint::save(root, run, step, 0, &state, serde_json::Value::Null, &grid).expect("saved")
}

/// A finished run in `out`: run.json, metrics, a config and checkpoints at `steps`.
fn finished_run(out: &Path, steps: &[usize]) -> RunId {
    let folders = RunFolders {
        out,
        checkpoints: Some(&out.join("checkpoints")),
        own_files: &["config.toml".to_string()],
    };
    let c = claim(folders, None, ExistingRun::Refuse).expect("a fresh folder");
    c.apply().expect("claimed");
    std::fs::write(out.join("metrics.jsonl"), "{\"step\":1}\n").expect("metrics");
    std::fs::write(out.join("config.toml"), "x = 1\n").expect("config");
    for &s in steps {
        checkpoint_of(&out.join("checkpoints"), &c.run, s);
    }
    c.run
}

fn folders<'a>(out: &'a Path, root: &'a Path, own: &'a [String]) -> RunFolders<'a> {
    RunFolders {
        out,
        checkpoints: Some(root),
        own_files: own,
    }
}

fn origin(dir: &Path) -> Origin {
    Origin::of(&Checkpoint::open(dir).expect("opens"))
}

#[test]
fn a_fresh_run_refuses_a_folder_holding_another_run_and_changes_nothing() {
    let tmp = tempfile::tempdir().expect("temp folder");
    let out = tmp.path().join("a");
    let theirs = finished_run(&out, &[2, 4]);
    let root = out.join("checkpoints");
    let own = ["config.toml".to_string()];
    let e = claim(folders(&out, &root, &own), None, ExistingRun::Refuse)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains(theirs.as_str()) && e.contains("--resume") && e.contains("--replace"),
        "{e}"
    );
    // Only metrics and no run record (an earlier merak): refused too.
    let legacy = tmp.path().join("legacy");
    std::fs::create_dir_all(&legacy).expect("made");
    std::fs::write(legacy.join("metrics.jsonl"), "").expect("metrics");
    let e = claim(
        folders(&legacy, &legacy.join("checkpoints"), &own),
        None,
        ExistingRun::Refuse,
    )
    .expect_err("refused")
    .to_string();
    assert!(e.contains("no run.json"), "{e}");
    // A checkpoint folder shared with another run is refused even when --out is new.
    let new = tmp.path().join("new");
    let e = claim(folders(&new, &root, &own), None, ExistingRun::Refuse).expect_err("refused");
    assert!(matches!(e, ClaimError::OtherRun { .. }), "{e}");
    // Nothing changed.
    assert_eq!(
        checkpoint::root::list(&root)
            .expect("listed")
            .checkpoints
            .len(),
        2
    );
    assert!(out.join("metrics.jsonl").exists() && !new.exists());
    // A folder with only the user's own files is fine, and they are left alone.
    let mine = tmp.path().join("mine");
    std::fs::create_dir_all(&mine).expect("made");
    std::fs::write(mine.join("notes.txt"), "keep").expect("notes");
    let c = claim(
        folders(&mine, &mine.join("checkpoints"), &own),
        None,
        ExistingRun::Refuse,
    )
    .expect("claimable");
    assert!(!c.changes_files());
    c.apply().expect("applied");
    assert_eq!(
        std::fs::read_to_string(mine.join("notes.txt")).expect("kept"),
        "keep"
    );
}

#[test]
fn replacing_removes_only_what_the_other_run_wrote_and_says_so() {
    let tmp = tempfile::tempdir().expect("temp folder");
    let out = tmp.path().join("a");
    let theirs = finished_run(&out, &[2, 4]);
    std::fs::write(out.join("notes.txt"), "keep").expect("notes");
    std::fs::write(out.join("checkpoints/README"), "keep").expect("readme");
    let root = out.join("checkpoints");
    let own = ["config.toml".to_string()];
    let c = claim(folders(&out, &root, &own), None, ExistingRun::Replace).expect("replaceable");
    assert_ne!(c.run, theirs);
    let said = c.apply().expect("applied").join("\n");
    for gone in [
        "step-00000002",
        "step-00000004",
        "latest",
        "metrics.jsonl",
        "config.toml",
    ] {
        assert!(said.contains(gone), "{gone} in {said}");
    }
    assert!(out.join("notes.txt").exists() && root.join("README").exists());
    assert!(checkpoint::root::list(&root).expect("listed").is_empty());
    let record = std::fs::read_to_string(out.join(RUN_FILE)).expect("run.json");
    assert!(record.contains(c.run.as_str()), "{record}");
}

#[test]
fn resuming_continues_the_lineage_and_refuses_to_fork_it_silently() {
    let tmp = tempfile::tempdir().expect("temp folder");
    let out = tmp.path().join("a");
    let run = finished_run(&out, &[50, 100]);
    let root = out.join("checkpoints");
    let own = ["config.toml".to_string()];
    // From the newest: the same lineage, nothing to change.
    let newest = origin(&root.join("step-00000100"));
    let c = claim(
        folders(&out, &root, &own),
        Some(&newest),
        ExistingRun::Refuse,
    )
    .expect("ours");
    assert_eq!(c.run, run);
    assert!(!c.changes_files());
    // From an older one: refused, naming the later steps.
    let older = origin(&root.join("step-00000050"));
    let e = claim(
        folders(&out, &root, &own),
        Some(&older),
        ExistingRun::Refuse,
    )
    .expect_err("refused")
    .to_string();
    assert!(e.contains("steps 100") && e.contains("--branch"), "{e}");
    // Branching moves step 100 aside (nothing is deleted) and points latest at step 50.
    let c = claim(
        folders(&out, &root, &own),
        Some(&older),
        ExistingRun::Branch,
    )
    .expect("branch");
    let said = c.apply().expect("applied").join("\n");
    assert!(said.contains("branch-1"), "{said}");
    let listing = checkpoint::root::list(&root).expect("listed");
    assert_eq!(
        listing
            .checkpoints
            .iter()
            .map(|c| c.step)
            .collect::<Vec<_>>(),
        vec![50]
    );
    assert_eq!(listing.latest.as_deref(), Some("step-00000050"));
    let branch = Checkpoint::open(&root.join("branch-1")).expect("the branch resumes");
    assert_eq!(branch.manifest.step, 100);
    assert!(root.join("branch-1/metrics.jsonl").exists());
    // Another lineage's checkpoint cannot be resumed into this folder.
    let other = tmp.path().join("b");
    finished_run(&other, &[3]);
    let foreign = origin(&other.join("checkpoints/step-00000003"));
    let e = claim(
        folders(&out, &root, &own),
        Some(&foreign),
        ExistingRun::Refuse,
    )
    .expect_err("refused");
    assert!(matches!(e, ClaimError::OtherRun { .. }), "{e}");
    // But into a new folder it continues its own lineage.
    let fresh = tmp.path().join("c");
    let c = claim(
        folders(&fresh, &fresh.join("checkpoints"), &own),
        Some(&foreign),
        ExistingRun::Refuse,
    )
    .expect("a new folder");
    assert_eq!(Some(c.run), foreign.run);
}

#[test]
fn a_folder_that_looks_like_a_checkpoint_without_a_manifest_is_never_touched() {
    let tmp = tempfile::tempdir().expect("temp folder");
    let out = tmp.path().join("a");
    let root = out.join("checkpoints");
    std::fs::create_dir_all(root.join("step-00000007")).expect("made");
    let own: [String; 0] = [];
    for existing in [ExistingRun::Refuse, ExistingRun::Replace] {
        let e = claim(folders(&out, &root, &own), None, existing).expect_err("refused");
        assert!(matches!(e, ClaimError::Unreadable(_)), "{e}");
    }
    assert!(root.join("step-00000007").is_dir());
    let e = claim(folders(&out, &root, &own), None, ExistingRun::Branch).expect_err("refused");
    assert!(matches!(e, ClaimError::BranchWithoutResume), "{e}");
}
