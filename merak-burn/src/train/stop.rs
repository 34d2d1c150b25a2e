//! Stopping a run early on request (a scheduler's preemption signal): every rank finishes the
//! step it is in, the ranks agree on the step to stop after, a checkpoint is written and
//! [`Trainer::fit`](crate::train::Trainer::fit) returns with [`Summary::stopped`](crate::train::Summary::stopped) set.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A flag a signal handler (or any thread) sets to ask the run to stop after the current step.
#[derive(Clone, Debug, Default)]
pub struct StopRequest(Arc<AtomicBool>);

impl StopRequest {
    /// A request not yet made.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was asked for on this rank.
    pub fn is_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// The flag itself, for a signal handler to set (`signal_hook::flag::register`).
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// SIGTERM, SIGINT and SIGUSR1 ask the run to stop after the current step (every rank agrees
/// on the step, then checkpoints): `stop` is requested. A second signal ends the process at
/// once with status 130. Installing handlers is the program's choice: `merak train` does,
/// [`merak_burn::run`](crate::run) does when [`RunOptions::signals`](crate::entry::RunOptions)
/// asks.
pub fn stop_on_signals(stop: &StopRequest) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    for signal in [SIGTERM, SIGINT, SIGUSR1] {
        // Registered first, so it sees the flag as the earlier signal left it.
        signal_hook::flag::register_conditional_shutdown(signal, 130, stop.flag())?;
        signal_hook::flag::register(signal, stop.flag())?;
    }
    Ok(())
}
