//! Ending a job that cannot go on: one-line reports on stderr that ranks sharing the
//! launcher's output do not interleave, `MPI_Abort`, and failures raised where no `Result`
//! can carry them ([`fail`]: inside a forward pass), which end the job as failures (exit
//! status 1), not as panics.

use std::any::Any;
use std::sync::{Mutex, Once};
use std::thread::ThreadId;

/// Writes `line` to stderr as one line in one write, so that the lines of ranks sharing the
/// launcher's stderr do not interleave (a message's newlines become `; `).
pub fn report_line(line: &str) {
    use std::io::Write;
    let mut one = line.trim_end().replace('\n', "; ");
    one.push('\n');
    let _ = std::io::stderr().lock().write_all(one.as_bytes());
}

/// Calls `MPI_Abort` on the world communicator.
pub(crate) fn abort_world(code: i32) -> ! {
    // SAFETY: MPI is initialised (an `MpiWorld` exists) and MPI_Abort does not return.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code)
}

/// A failure of this rank during training that code without a `Result` (a forward pass)
/// raises with [`fail`]: a panic carrying this payload. Under MPI the panic hook reports it as
/// `merak: rank R failed: <message>` and ends the job with exit status 1 (a panic's is 101);
/// in one process [`catch_failure`] turns it into an error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RankFailure(pub String);

/// Stops this rank with the failure `message` (see [`RankFailure`]).
pub fn fail(message: impl std::fmt::Display) -> ! {
    std::panic::panic_any(RankFailure(message.to_string()))
}

/// The failure a panic's `payload` carries, if it is one.
pub fn failure_of(payload: &(dyn Any + Send)) -> Option<&RankFailure> {
    payload.downcast_ref::<RankFailure>()
}

/// The threads inside [`catch_failure`]: a failure raised there is reported by its caller.
static CATCHING: Mutex<Vec<ThreadId>> = Mutex::new(Vec::new());

/// Whether the current thread is inside [`catch_failure`].
fn catching() -> bool {
    let me = std::thread::current().id();
    CATCHING.lock().is_ok_and(|t| t.contains(&me))
}

/// Installs, once, a panic hook that stays silent for a [`RankFailure`] raised inside
/// [`catch_failure`] outside MPI (its caller reports it); every other panic goes to the hook
/// that was installed before (under MPI: the one that reports the rank and aborts the job).
fn quiet_failures() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let under_mpi = mpi::environment::is_initialized();
            if failure_of(info.payload()).is_some() && catching() && !under_mpi {
                return;
            }
            before(info);
        }));
    });
}

/// Runs `f`, and returns the [`RankFailure`] it raised on this thread as `Err` instead of
/// unwinding (in one process: no panic message; under MPI the hook has already ended the job
/// as a failure). Other panics unwind on.
pub fn catch_failure<T>(f: impl FnOnce() -> T) -> Result<T, RankFailure> {
    quiet_failures();
    let me = std::thread::current().id();
    if let Ok(mut t) = CATCHING.lock() {
        t.push(me);
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    if let Ok(mut t) = CATCHING.lock()
        && let Some(at) = t.iter().position(|&id| id == me)
    {
        t.swap_remove(at);
    }
    match result {
        Ok(v) => Ok(v),
        Err(payload) => match payload.downcast::<RankFailure>() {
            Ok(failure) => Err(*failure),
            Err(other) => std::panic::resume_unwind(other),
        },
    }
}
