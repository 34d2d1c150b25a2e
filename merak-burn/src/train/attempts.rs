//! A run's attempts: every start of its ranks on the run's output folder, how each ended, and
//! what the run's wall time was spent on (goodput).
//!
//! Rank 0 appends one JSON line to `attempts.jsonl` when an attempt starts and one when it
//! ends (finished, or stopped on a signal after its checkpoint). An attempt whose ranks died
//! writes no end: the next start of the run (or `merak train --np`'s launcher, which knows the
//! failed rank and its signal) records the failure, with the step it failed in (one after the
//! last step in `metrics.jsonl`) and the steps lost (those after the checkpoint resumed). The
//! same record decides whether a failed run is restarted ([`restart_verdict`]) and how much of
//! its wall time trained ([`Goodput`](super::Goodput)).

use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The file in a run's output folder that records its attempts.
pub const ATTEMPTS_FILE: &str = "attempts.jsonl";

/// One line of `attempts.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum AttemptEvent {
    /// An attempt started.
    Started {
        /// 1-based number of the attempt in the run.
        attempt: usize,
        /// When (seconds since the Unix epoch).
        at_s: f64,
        /// The step it starts after (the resumed checkpoint's; 0 for a fresh run).
        from_step: usize,
        /// Its ranks.
        ranks: usize,
    },
    /// An attempt ended by itself: the run finished, or stopped on a signal after a checkpoint.
    Ended {
        /// The attempt.
        attempt: usize,
        /// When.
        at_s: f64,
        /// Steps done at the end.
        steps: usize,
        /// Whether it stopped on a signal (else it finished).
        stopped: bool,
        /// Seconds the training thread spent in checkpoint saves.
        save_s: f64,
        /// Saves written.
        saves: usize,
    },
    /// An attempt whose ranks died (or were ended by the watchdog) before it ended.
    Failed {
        /// The attempt.
        attempt: usize,
        /// When it was last seen alive (its last step's record), else when it started.
        at_s: f64,
        /// The step it failed in (1-based).
        step: usize,
        /// Steps it had done after the checkpoint the run continues from.
        lost_steps: usize,
        /// What ended it, where known (rank, host, signal or exit status).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cause: Option<String>,
    },
}

/// An attempt as the record tells it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attempt {
    /// 1-based number.
    pub number: usize,
    /// When it started.
    pub started_s: f64,
    /// The step it started after.
    pub from_step: usize,
    /// How it ended: `None` while nothing says (running, or died unrecorded).
    pub end: Option<AttemptEnd>,
}

/// How an attempt ended.
#[derive(Clone, Debug, PartialEq)]
pub enum AttemptEnd {
    /// Finished or stopped on a signal.
    Ended {
        /// When.
        at_s: f64,
        /// Whether it stopped on a signal.
        stopped: bool,
        /// Seconds in checkpoint saves.
        save_s: f64,
        /// Saves written.
        saves: usize,
    },
    /// Its ranks died.
    Failed {
        /// When it was last seen.
        at_s: f64,
        /// The step it failed in.
        step: usize,
        /// Steps lost.
        lost_steps: usize,
        /// What ended it, where known.
        cause: Option<String>,
    },
}

/// A run's attempts, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attempts(pub Vec<Attempt>);

/// Seconds since the Unix epoch now.
pub fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Attempts {
    /// The record of the run in `out` (empty when it has none); lines that do not parse are
    /// skipped (a line cut by a crash).
    pub fn read(out: &Path) -> std::io::Result<Self> {
        let text = match std::fs::read_to_string(out.join(ATTEMPTS_FILE)) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(e),
        };
        let mut all: Vec<Attempt> = Vec::new();
        for event in text.lines().filter_map(|l| serde_json::from_str(l).ok()) {
            match event {
                AttemptEvent::Started {
                    attempt,
                    at_s,
                    from_step,
                    ..
                } => all.push(Attempt {
                    number: attempt,
                    started_s: at_s,
                    from_step,
                    end: None,
                }),
                AttemptEvent::Ended {
                    attempt,
                    at_s,
                    stopped,
                    save_s,
                    saves,
                    ..
                } => set_end(&mut all, attempt, || AttemptEnd::Ended {
                    at_s,
                    stopped,
                    save_s,
                    saves,
                }),
                AttemptEvent::Failed {
                    attempt,
                    at_s,
                    step,
                    lost_steps,
                    cause,
                } => set_end(&mut all, attempt, || AttemptEnd::Failed {
                    at_s,
                    step,
                    lost_steps,
                    cause,
                }),
            }
        }
        Ok(Self(all))
    }

    /// The last attempt when nothing says how it ended: it died (or still runs).
    pub fn unfinished(&self) -> Option<&Attempt> {
        self.0.last().filter(|a| a.end.is_none())
    }

    /// The failures since the run last ended by itself, oldest first: (step, cause).
    pub fn recent_failures(&self) -> Vec<(usize, Option<&str>)> {
        let mut failures = Vec::new();
        for a in &self.0 {
            match &a.end {
                Some(AttemptEnd::Failed { step, cause, .. }) => {
                    failures.push((*step, cause.as_deref()))
                }
                Some(AttemptEnd::Ended { .. }) => failures.clear(),
                None => {}
            }
        }
        failures
    }
}

impl Attempt {
    /// The last step this attempt logged in `out`'s `metrics.jsonl` and when; the step it
    /// started after, and its start, when it logged none.
    fn last_seen(&self, out: &Path) -> (usize, f64) {
        last_logged_step(out)
            .filter(|(s, _)| *s >= self.from_step)
            .unwrap_or((self.from_step, self.started_s))
    }
}

/// Sets the end of attempt `number` (the last with that number) unless it has one.
fn set_end(all: &mut [Attempt], number: usize, end: impl FnOnce() -> AttemptEnd) {
    if let Some(a) = all.iter_mut().rev().find(|a| a.number == number)
        && a.end.is_none()
    {
        a.end = Some(end());
    }
}

/// Appends `event` to the record of the run in `out`, synced.
pub fn append(out: &Path, event: &AttemptEvent) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(event).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join(ATTEMPTS_FILE))?;
    file.write_all(&line)?;
    file.sync_data()
}

/// The last step in the run's `metrics.jsonl` and when it was written (the file's time), if
/// it has one.
pub fn last_logged_step(out: &Path) -> Option<(usize, f64)> {
    let path = out.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).ok()?;
    let step = (text.lines().rev())
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("step").and_then(serde_json::Value::as_u64))?;
    let at = (std::fs::metadata(&path).and_then(|m| m.modified()).ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or_else(now_s, |d| d.as_secs_f64());
    Some((step as usize, at))
}

/// Records the failure of the run's unfinished attempt, if it has one: the step it failed in
/// (one after its last logged step), the steps lost when the run continues after
/// `resume_step`, and `cause` where known. Returns the event written.
pub fn record_failure(
    out: &Path,
    resume_step: usize,
    cause: Option<String>,
) -> std::io::Result<Option<AttemptEvent>> {
    let attempts = Attempts::read(out)?;
    let Some(last) = attempts.unfinished() else {
        return Ok(None);
    };
    let (logged, at_s) = last.last_seen(out);
    let event = AttemptEvent::Failed {
        attempt: last.number,
        at_s,
        step: logged + 1,
        lost_steps: logged.saturating_sub(resume_step),
        cause,
    };
    append(out, &event)?;
    Ok(Some(event))
}

/// Whether a start of the run in `out` under `--max-restarts max` (`resuming` a checkpoint or
/// not) may go on, from what its record says: a first start may; a start after a failure must
/// resume, and [`restart_verdict`] must allow it (the failure of an attempt that ended
/// unrecorded counts, in the step after its last logged one). Only reads.
pub fn may_restart(out: &Path, max: usize, resuming: bool) -> Result<(), NotRestarted> {
    let attempts = Attempts::read(out).unwrap_or_default();
    let mut failures = attempts.recent_failures();
    if let Some(last) = attempts.unfinished() {
        failures.push((last.last_seen(out).0 + 1, None));
    }
    if failures.is_empty() {
        return Ok(());
    }
    if !resuming {
        return Err(NotRestarted::NoCheckpoint {
            out: out.to_path_buf(),
        });
    }
    restart_verdict(&failures, max)
}

/// Why a failed run is not started again.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum NotRestarted {
    /// The same step failed twice in a row: most likely the run itself (its data, a
    /// non-finite value, memory), which a restart repeats.
    #[error(
        "not restarted: the run failed twice in a row in step {step} (last: {cause}); a restart \
         would most likely fail there again: find the cause, then continue with --resume"
    )]
    SameStep {
        /// The step.
        step: usize,
        /// The last failure's cause, as known.
        cause: String,
    },
    /// The restarts allowed are used up.
    #[error(
        "not restarted: the run failed {failures} times since it last ended by itself, more than \
         --max-restarts {max} allows; continue with --resume when the cause is fixed"
    )]
    TooMany {
        /// Failures in a row.
        failures: usize,
        /// `--max-restarts`.
        max: usize,
    },
    /// The run failed before its first checkpoint: there is nothing to continue from.
    #[error(
        "not restarted: the run in {out} failed before its first checkpoint, so there is nothing \
         to continue from; start it again with --replace (or choose checkpoint.every so that a \
         checkpoint comes before a failure costs much)"
    )]
    NoCheckpoint {
        /// The run's output folder.
        out: std::path::PathBuf,
    },
}

/// Whether the run whose failures since it last ended by itself are `failures` (oldest
/// first: step and cause) may be restarted once more under `--max-restarts max`: not after
/// more than `max` failures, nor after two failures in a row in the same step.
pub fn restart_verdict(failures: &[(usize, Option<&str>)], max: usize) -> Result<(), NotRestarted> {
    if let [.., (a, _), (b, cause)] = failures
        && a == b
    {
        return Err(NotRestarted::SameStep {
            step: *b,
            cause: cause
                .unwrap_or("the ranks ended without a cause on record")
                .to_string(),
        });
    }
    if failures.len() > max {
        return Err(NotRestarted::TooMany {
            failures: failures.len(),
            max,
        });
    }
    Ok(())
}
