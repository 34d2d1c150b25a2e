//! The stop signals `merak train --np`'s launcher passes on to mpirun: the first as SIGUSR1
//! (the ranks checkpoint and stop after their step), a second one, or ranks still running a
//! grace period after the first, as SIGTERM (stop at once).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

/// The launcher's stop signals, registered (before mpirun starts, so that none is missed).
pub struct Forwarder {
    signals: Signals,
}

/// What was passed on, read once mpirun has ended.
pub struct Forwarded {
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    /// Signals received.
    count: AtomicUsize,
    /// Whether the grace period ran out and mpirun was stopped at once.
    escalated: AtomicBool,
    /// Whether mpirun has ended (nothing is sent after).
    ended: AtomicBool,
}

impl Forwarder {
    /// Registers SIGTERM, SIGINT and SIGUSR1.
    pub fn register() -> std::io::Result<Self> {
        Ok(Self {
            signals: Signals::new([SIGTERM, SIGINT, SIGUSR1])?,
        })
    }

    /// Passes the signals on to mpirun (process `pid`) on a thread of their own: the first
    /// as SIGUSR1, later ones as SIGTERM; and SIGTERM when mpirun still runs `grace` after
    /// the first.
    pub fn forward(mut self, pid: u32, grace: Duration) -> Forwarded {
        let state = Arc::new(State::default());
        let seen = state.clone();
        std::thread::spawn(move || {
            for signal in self.signals.forever() {
                let n = seen.count.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 {
                    eprintln!(
                        "merak: signal {signal}: checkpointing and stopping after the current \
                         step (signal {SIGUSR1} to mpirun)"
                    );
                    send(&seen, pid, SIGUSR1);
                    escalate_after(seen.clone(), pid, grace);
                } else {
                    eprintln!(
                        "merak: signal {signal}: stopping at once (signal {SIGTERM} to mpirun)"
                    );
                    send(&seen, pid, SIGTERM);
                }
            }
        });
        Forwarded { state }
    }
}

impl Forwarded {
    /// Records that mpirun has ended; returns whether the job was stopped at once (a second
    /// signal, or the grace period ran out).
    pub fn aborted(&self) -> bool {
        self.state.ended.store(true, Ordering::SeqCst);
        self.state.count.load(Ordering::SeqCst) > 1 || self.state.escalated.load(Ordering::SeqCst)
    }
}

/// After `grace`, stops mpirun at once if it still runs.
fn escalate_after(state: Arc<State>, pid: u32, grace: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(grace);
        if state.ended.load(Ordering::SeqCst) {
            return;
        }
        state.escalated.store(true, Ordering::SeqCst);
        eprintln!(
            "merak: the ranks did not stop within {:.0} s of the stop signal \
             (train.comm_timeout_s): stopping them at once (signal {SIGTERM} to mpirun)",
            grace.as_secs_f64()
        );
        send(&state, pid, SIGTERM);
    });
}

/// `signal` to mpirun, unless it has ended.
fn send(state: &State, pid: u32, signal: i32) {
    if state.ended.load(Ordering::SeqCst) {
        return;
    }
    // SAFETY: kill(2) on the pid of our own child. The main thread sets `ended` right after
    // reaping it, so the pid is not reused before, but for that instant.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}
