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
use std::sync::{Arc, Mutex};

use super::CheckpointError;

/// The environment variable that names the point to abort at.
pub const ABORT_AT: &str = "MERAK_ABORT_AT";

/// Every point, in the order a save and its pruning reach them.
pub const POINTS: [&str; 9] = [
    // The partial folder exists, nothing written in it.
    "save:begun",
    // A rank's shard file is written and synced, its entry (size and hash) and parameter list
    // are not (on the writer thread when the save is asynchronous: training goes on).
    "save:writing",
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

/// An armed point and how many more times it is reached before it fails; shared by the
/// thread that armed it and the writer threads it starts ([`armed`], [`carry`]).
type Armed = Arc<Mutex<(String, usize)>>;

thread_local! {
    static INJECTED: RefCell<Option<Armed>> = const { RefCell::new(None) };
}

static HITS: AtomicUsize = AtomicUsize::new(0);

/// Makes the calling thread's next saves fail with [`CheckpointError::Injected`] at the
/// `nth` (1-based) time they reach `point` (one of [`POINTS`]); `None` disarms.
pub fn inject_error(point: Option<(&str, usize)>) {
    let armed = point.map(|(p, n)| Arc::new(Mutex::new((p.to_string(), n))));
    INJECTED.with(|i| *i.borrow_mut() = armed);
}

/// The point the calling thread armed, to [`carry`] into a thread it starts (an asynchronous
/// save's writer), so that a test's injected failure is reached there too; the count is
/// shared.
pub(crate) fn armed() -> Option<Armed> {
    INJECTED.with(|i| i.borrow().clone())
}

/// Arms in the calling thread what another thread had [`armed`].
pub(crate) fn carry(armed: Option<Armed>) {
    INJECTED.with(|i| *i.borrow_mut() = armed);
}

/// Reached `point`: aborts or fails if a test armed it.
pub(crate) fn reached(point: &'static str) -> Result<(), CheckpointError> {
    debug_assert!(POINTS.contains(&point), "{point} is not listed in POINTS");
    let injected = INJECTED.with(|i| {
        let armed = i.borrow();
        let Some(armed) = armed.as_ref() else {
            return false;
        };
        let mut armed = armed.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *armed {
            (p, n) if p == point && *n > 0 => {
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
