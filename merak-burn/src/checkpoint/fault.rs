//! Deterministic crash points in saving and pruning, for tests of crash consistency.
//!
//! Each step of [`save`](super::save) that changes the disk is preceded or followed by a named
//! point. With `MERAK_ABORT_AT=<point>` (or `<point>@<n>`: the `n`-th time the point is
//! reached in this process, 1-based) the process aborts there (SIGABRT, no cleanup, as a
//! `kill -9` or a power cut would leave it), so an end-to-end test can check that the next
//! run resumes from what is on disk. In-process tests arm a point for the calling thread with
//! [`inject_error`] instead: the save then returns [`CheckpointError::Injected`] at that point,
//! leaving the disk as the crash would.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::CheckpointError;

/// The environment variable that names the point to abort at.
pub const ABORT_AT: &str = "MERAK_ABORT_AT";

/// Every point, in the order a save and its pruning reach them.
pub const POINTS: [&str; 8] = [
    // The partial folder exists, nothing written in it.
    "save:begun",
    // Every shard is written and synced, the manifest is not.
    "save:shards",
    // The manifest is written and synced, the folder is still the hidden partial one.
    "save:manifest",
    // Replacing a same-step folder: `latest` names the complete partial folder.
    "save:pointed",
    // Replacing a same-step folder: the old folder is gone, the new one not yet renamed.
    "save:replaced",
    // The folder is renamed into place, `latest` still names the previous checkpoint.
    "save:renamed",
    // `latest` names the new checkpoint; nothing pruned yet.
    "save:latest",
    // An old checkpoint was moved aside for removal and is partly removed.
    "prune:removing",
];

thread_local! {
    static INJECTED: RefCell<Option<(String, usize)>> = const { RefCell::new(None) };
}

static HITS: AtomicUsize = AtomicUsize::new(0);

/// Makes the calling thread's next saves fail with [`CheckpointError::Injected`] at the
/// `nth` (1-based) time they reach `point` (one of [`POINTS`]); `None` disarms.
pub fn inject_error(point: Option<(&str, usize)>) {
    INJECTED.with(|i| *i.borrow_mut() = point.map(|(p, n)| (p.to_string(), n)));
}

/// Reached `point`: aborts or fails if a test armed it.
pub(crate) fn reached(point: &'static str) -> Result<(), CheckpointError> {
    debug_assert!(POINTS.contains(&point), "{point} is not listed in POINTS");
    let injected = INJECTED.with(|i| {
        let mut armed = i.borrow_mut();
        match armed.as_mut() {
            Some((p, n)) if p == point => {
                *n -= 1;
                *n == 0
            }
            _ => false,
        }
    });
    if injected {
        return Err(CheckpointError::Injected { point });
    }
    if let Ok(spec) = std::env::var(ABORT_AT) {
        let (name, nth) = match spec.split_once('@') {
            Some((name, n)) => (name.to_string(), n.parse().unwrap_or(1)),
            None => (spec, 1),
        };
        if name == point && HITS.fetch_add(1, Ordering::SeqCst) + 1 == nth {
            eprintln!("merak: {ABORT_AT}={point}@{nth}: aborting here (a test's crash point)");
            std::process::abort();
        }
    }
    Ok(())
}
