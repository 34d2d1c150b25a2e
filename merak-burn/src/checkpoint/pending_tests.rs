//! Asynchronous saves over two ranks run as threads: a failing writer fails every rank
//! together, and a writer's panic is an error, not a hang.

use std::rc::Rc;
use std::sync::{Arc, Barrier, Mutex};

use burn::module::ParamId;

use super::*;
use crate::comm::{CommError, Communicator, Group, Pending};
use crate::grid::Layout;
use crate::tensor_parallel::ShardKind;

/// One rank of a world of threads that can all-reduce (maximum) and wait at a barrier.
struct Threads {
    rank: usize,
    size: usize,
    barrier: Arc<Barrier>,
    slots: Arc<Mutex<Vec<Vec<f32>>>>,
}

impl Communicator for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn kind(&self) -> &'static str {
        "threads"
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        assert_eq!(op, ReduceOp::Max, "a save agrees by maxima");
        self.slots.lock().expect("slots")[self.rank] = buf.to_vec();
        self.barrier.wait();
        for (i, v) in buf.iter_mut().enumerate() {
            let all = self.slots.lock().expect("slots");
            *v = all.iter().map(|s| s[i]).fold(f32::MIN, f32::max);
        }
        self.barrier.wait();
        Ok(())
    }
    fn all_gather(&self, _: &[f32], _: &mut [f32]) -> Result<(), CommError> {
        unreachable!("a save does not all-gather")
    }
    fn reduce_scatter(&self, _: &[f32], _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        unreachable!("a save does not reduce-scatter")
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<(), CommError> {
        unreachable!("a save does not broadcast")
    }
    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<(), CommError> {
        unreachable!("a save does not broadcast")
    }
    fn send(&self, _: &[f32], _: usize, _: u16) -> Result<(), CommError> {
        unreachable!("a save does not send")
    }
    fn recv(&self, _: &mut [f32], _: usize, _: u16) -> Result<(), CommError> {
        unreachable!("a save does not receive")
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier.wait();
        Ok(())
    }
    fn all_reduce_start(&self, _: Vec<f32>, _: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        unreachable!("a save does not all-reduce in the background")
    }
}

/// Rank `rank` of 2 tensor-parallel ranks whose world is `comm`.
fn grid_of(rank: usize, comm: Threads) -> ProcessGrid {
    let mut grid = ProcessGrid::single();
    grid.world = Group::register(Rc::new(comm));
    grid.rank = rank;
    grid.coords.tp = rank;
    grid.layout = Layout {
        tp: 2,
        ..Layout::SINGLE
    };
    grid
}

/// A rank's state: one replicated parameter.
fn state() -> RankState {
    RankState {
        params: vec![super::super::LocalParam {
            name: "w".into(),
            id: ParamId::new(),
            shape: vec![2],
            split: ShardKind::Replicated,
            values: vec![1.0, 2.0],
        }],
        moments: Vec::new(),
        pieces: Vec::new(),
    }
}

/// Both ranks save asynchronously into `root`, rank 1 with `point` armed on its thread; each
/// rank's result. A rank left waiting for the other fails the test after 30 s.
fn two_ranks_save(root: &Path, point: Option<&'static str>) -> Vec<Result<Saved, String>> {
    let barrier = Arc::new(Barrier::new(2));
    let slots = Arc::new(Mutex::new(vec![vec![]; 2]));
    let run = RunId::new();
    let (done, results) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let comm = Threads {
            rank,
            size: 2,
            barrier: barrier.clone(),
            slots: slots.clone(),
        };
        let (root, run, done) = (root.to_path_buf(), run.clone(), done.clone());
        std::thread::spawn(move || {
            let grid = grid_of(rank, comm);
            if rank == 1 {
                fault::inject_error(point.map(|p| (p, 1)));
            }
            let pending = start(&root, &run, 1, 0, state(), serde_json::Value::Null, &grid);
            let saved = (pending.and_then(|p| p.finish(&grid))).map_err(|e| e.to_string());
            let _ = done.send((rank, saved));
        });
    }
    let mut all = vec![Err("no result".to_string()), Err("no result".to_string())];
    for _ in 0..2 {
        let wait = std::time::Duration::from_secs(30);
        let (rank, saved) = results.recv_timeout(wait).expect("a rank left waiting");
        all[rank] = saved;
    }
    all
}

#[test]
fn a_writer_that_fails_on_one_rank_fails_every_rank_together() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let saved = two_ranks_save(&root, None);
    assert!(saved.iter().all(|s| s.is_ok()), "{saved:?}");
    assert!(root.join("step-00000001/manifest.json").is_file());

    let failed = two_ranks_save(&root, Some("save:writing"));
    let rank0 = failed[0].as_ref().expect_err("rank 0 fails too");
    assert!(
        rank0.contains("rank 1 failed to write its files") && rank0.contains(".step-00000001"),
        "{rank0}"
    );
    let rank1 = failed[1].as_ref().expect_err("rank 1's own error");
    assert!(
        rank1.contains("injected failure at save:writing"),
        "{rank1}"
    );
    // Rank 0 removed the partial folder; the first save is still there.
    assert!(!root.join(".step-00000001.partial").exists());
    assert!(root.join("step-00000001/manifest.json").is_file());
}

#[test]
fn a_writer_thread_that_panics_is_an_error() {
    let dir = tempfile::tempdir().expect("temp folder");
    let root = dir.path().join("checkpoints");
    let grid = ProcessGrid::single();
    let target = SaveTarget::new(&root, &RunId::new(), 1, 0, serde_json::Value::Null, &grid);
    begin(&target, &grid).expect("partial folder");
    let writer = Writer::Running(std::thread::spawn(|| panic!("disk on fire")));
    let e = (PendingSave { target, writer }).finish(&grid);
    let e = e.expect_err("a panic is an error").to_string();
    assert!(e.contains("writer thread panicked: disk on fire"), "{e}");
    assert!(!root.join(".step-00000001.partial").exists());
}
