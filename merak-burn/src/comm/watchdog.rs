//! A watchdog for stuck collectives: a rank blocked in one MPI call longer than its limit says
//! which operation, over which group and which peers it waits for, and aborts the job, instead
//! of the whole job hanging until a scheduler kills it.
//!
//! [`arm`] starts it (`merak train` arms it with `train.comm_timeout_s`); until then a watched
//! call costs one atomic load. The limit of a call is the armed base plus the time of its
//! message at 100 MB/s, so large transfers on a slow link are not mistaken for a hang.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Bytes per second a watched call is granted on top of the base limit.
const GRANTED_RATE: f64 = 1e8;

/// The call in progress on this process.
struct Watch {
    op: &'static str,
    values: usize,
    group: Arc<str>,
    members: Arc<[usize]>,
    since: Instant,
    limit: Duration,
}

struct State {
    base: Duration,
    rank: usize,
    current: Option<Watch>,
}

static ARMED: AtomicBool = AtomicBool::new(false);
static STATE: OnceLock<Mutex<State>> = OnceLock::new();

/// `secs` seconds as a [`Duration`], saturating instead of panicking like
/// [`Duration::from_secs_f64`]: NaN and negative values are zero, values beyond
/// [`Duration::MAX`] (infinity included) are [`Duration::MAX`]. Use it for every limit read
/// from a user's number (`train.comm_timeout_s`).
pub fn saturating_duration(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(if secs > 0.0 {
        Duration::MAX
    } else {
        Duration::ZERO
    })
}

/// The limit of a call of `values` floats: `base` plus their time at [`GRANTED_RATE`],
/// saturating at [`Duration::MAX`].
fn call_limit(base: Duration, values: usize) -> Duration {
    base.saturating_add(saturating_duration(values as f64 * 4.0 / GRANTED_RATE))
}

/// Arms the watchdog of this process (world rank `rank`): from now on a watched call blocked
/// longer than `base` (plus its message's time) aborts the job. A zero `base` disarms it.
pub fn arm(base: Duration, rank: usize) {
    let state = STATE.get_or_init(|| {
        std::thread::spawn(watch_loop);
        Mutex::new(State {
            base,
            rank,
            current: None,
        })
    });
    if let Ok(mut s) = state.lock() {
        s.base = base;
        s.rank = rank;
    }
    ARMED.store(!base.is_zero(), Ordering::Release);
}

/// Marks a blocking call until it is dropped (whether it is watched, and when it began).
pub(crate) struct Guard(bool, Instant);

impl Drop for Guard {
    fn drop(&mut self) {
        let nanos = u64::try_from(self.1.elapsed().as_nanos()).unwrap_or(u64::MAX);
        BLOCKED_NS.fetch_add(nanos, Ordering::Relaxed);
        if self.0
            && let Some(Ok(mut s)) = STATE.get().map(Mutex::lock)
        {
            s.current = None;
        }
    }
}

/// Nanoseconds this process has spent blocked in communication calls (every call the
/// watchdog watches, armed or not).
static BLOCKED_NS: AtomicU64 = AtomicU64::new(0);

/// The time this process has spent blocked in communication calls so far: every blocking MPI
/// call and every wait for a non-blocking one (an NCCL call blocks only while it is queued).
/// A process-wide counter, like the kernel's fault counters: the difference over a step is
/// that step's time waiting for the other ranks and the network.
pub fn blocked_time() -> Duration {
    Duration::from_nanos(BLOCKED_NS.load(Ordering::Relaxed))
}

/// Watches the call `op` of `values` floats over `group` (its world ranks `members`).
pub(crate) fn watch(
    op: &'static str,
    values: usize,
    group: &Arc<str>,
    members: &Arc<[usize]>,
) -> Guard {
    let since = Instant::now();
    if !ARMED.load(Ordering::Acquire) {
        return Guard(false, since);
    }
    let Some(Ok(mut s)) = STATE.get().map(Mutex::lock) else {
        return Guard(false, since);
    };
    let limit = call_limit(s.base, values);
    s.current = Some(Watch {
        op,
        values,
        group: group.clone(),
        members: members.clone(),
        since,
        limit,
    });
    Guard(true, since)
}

/// The watchdog thread: checks the call in progress a few times per limit.
fn watch_loop() {
    loop {
        let tick = STATE
            .get()
            .and_then(|s| s.lock().ok().map(|s| s.base / 10))
            .unwrap_or(Duration::from_secs(1))
            .clamp(Duration::from_millis(50), Duration::from_secs(5));
        std::thread::sleep(tick);
        if !ARMED.load(Ordering::Acquire) {
            continue;
        }
        let Some(Ok(s)) = STATE.get().map(Mutex::lock) else {
            continue;
        };
        if let Some(w) = &s.current
            && w.since.elapsed() > w.limit
        {
            let line = format!(
                "merak: rank {} stuck for {:.1} s (limit {:.1} s, train.comm_timeout_s) in {} of \
                 {} values over the {} group of world ranks {:?}: one of them is stalled or \
                 dead; aborting the job",
                s.rank,
                w.since.elapsed().as_secs_f64(),
                w.limit.as_secs_f64(),
                w.op,
                w.values,
                w.group,
                w.members
            );
            super::abort::report_line(&line);
            super::abort::abort_world(124);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_saturate_instead_of_panicking() {
        assert_eq!(saturating_duration(1.5), Duration::from_millis(1500));
        assert_eq!(saturating_duration(0.0), Duration::ZERO);
        for big in [1e300, f64::INFINITY, 1.9e19] {
            assert_eq!(saturating_duration(big), Duration::MAX, "{big}");
        }
        for small in [-1.0, f64::NEG_INFINITY, f64::NAN] {
            assert_eq!(saturating_duration(small), Duration::ZERO, "{small}");
        }
    }

    #[test]
    fn a_call_limit_adds_the_message_time_and_saturates() {
        assert_eq!(
            call_limit(Duration::from_secs(2), 25_000_000),
            Duration::from_secs(3)
        );
        assert_eq!(call_limit(Duration::MAX, usize::MAX), Duration::MAX);
        assert_eq!(call_limit(saturating_duration(1e300), 1000), Duration::MAX);
    }
}
