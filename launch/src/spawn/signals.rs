//! The stop signals `merak train --np`'s launcher passes on to mpirun: the first as SIGUSR1
//! (the ranks checkpoint and stop after their step), a second one, or ranks still running a
//! grace period after the first, as SIGTERM (stop at once).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

/// The launcher's stop signals, registered (before mpirun starts, so that none is missed) and
/// passed on by a thread of their own to the mpirun of the current start of the ranks.
pub struct Forwarder {
    state: Arc<State>,
}

/// What was passed on to one mpirun, read once it has ended.
pub struct Forwarded {
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    /// Signals received (over every start of the ranks).
    count: AtomicUsize,
    /// Whether the grace period ran out and mpirun was stopped at once.
    escalated: AtomicBool,
    /// Whether the current mpirun has ended (nothing is sent after).
    ended: AtomicBool,
    /// The current mpirun's process id (0: none).
    pid: AtomicU32,
    /// How long the ranks may take to stop after the first signal.
    grace: Mutex<Duration>,
}

impl Forwarder {
    /// Registers SIGTERM, SIGINT and SIGUSR1 and starts passing them on: the first as SIGUSR1,
    /// later ones as SIGTERM; and SIGTERM when mpirun still runs its grace period after the
    /// first.
    pub fn register() -> std::io::Result<Self> {
        let mut signals = Signals::new([SIGTERM, SIGINT, SIGUSR1])?;
        let state = Arc::new(State {
            ended: AtomicBool::new(true),
            ..State::default()
        });
        let seen = state.clone();
        std::thread::spawn(move || {
            for signal in signals.forever() {
                pass_on(&seen, signal);
            }
        });
        Ok(Self { state })
    }

    /// Passes the signals on to mpirun (process `pid`) until it has ended, with `grace` for
    /// the ranks to stop after the first.
    pub fn forward(&self, pid: u32, grace: Duration) -> Forwarded {
        if let Ok(mut g) = self.state.grace.lock() {
            *g = grace;
        }
        self.state.pid.store(pid, Ordering::SeqCst);
        self.state.ended.store(false, Ordering::SeqCst);
        // A signal that came before this mpirun started still stops it.
        if self.state.count.load(Ordering::SeqCst) > 0 {
            send(&self.state, pid, SIGUSR1);
        }
        Forwarded {
            state: self.state.clone(),
        }
    }
}

/// The launcher got `signal`: the first to the current mpirun as SIGUSR1 (with the escalation
/// after the grace period), later ones as SIGTERM.
fn pass_on(state: &Arc<State>, signal: i32) {
    let n = state.count.fetch_add(1, Ordering::SeqCst) + 1;
    let pid = state.pid.load(Ordering::SeqCst);
    if n == 1 {
        eprintln!(
            "merak: signal {signal}: checkpointing and stopping after the current step (signal \
             {SIGUSR1} to mpirun)"
        );
        send(state, pid, SIGUSR1);
        let grace = state.grace.lock().map_or(Duration::ZERO, |g| *g);
        escalate_after(state.clone(), pid, grace);
    } else {
        eprintln!("merak: signal {signal}: stopping at once (signal {SIGTERM} to mpirun)");
        send(state, pid, SIGTERM);
    }
}

impl Forwarded {
    /// Whether a stop signal has reached the launcher (and was passed on).
    pub fn signalled(&self) -> bool {
        self.state.count.load(Ordering::SeqCst) > 0
    }

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
    if state.ended.load(Ordering::SeqCst) || pid == 0 {
        return;
    }
    // SAFETY: kill(2) on the pid of our own child. The main thread sets `ended` right after
    // reaping it, so the pid is not reused before, but for that instant.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}
