//! Goodput: the share of a run's wall time that trained the model it ends with.

use std::path::Path;

use super::attempts::{AttemptEnd, Attempts};

/// What a run's wall time went to, over all its attempts (`attempts.jsonl`) up to now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Goodput {
    /// The run's wall time: every attempt from its start to its end (a failed one to when it
    /// was last seen), and the time from each failure to the next attempt's start (restarting
    /// is the failure's cost); not the time between a stop on a signal and the next start.
    pub wall_s: f64,
    /// The step time of the steps the model keeps (`metrics.jsonl`'s, validation passes
    /// included): steps lost to a failure are not in it.
    pub trained_s: f64,
    /// Attempts.
    pub attempts: usize,
    /// Attempts that failed (each followed by a restart, or the run's end).
    pub failures: usize,
    /// Steps done and lost to failures (done after the checkpoint the run continued from).
    pub lost_steps: usize,
    /// Checkpoint saves of the attempts that ended by themselves.
    pub saves: usize,
    /// Seconds the training thread spent in those saves.
    pub save_s: f64,
}

impl Goodput {
    /// The goodput of the run in `out` at `now_s` (seconds since the Unix epoch), from its
    /// attempts and its `metrics.jsonl`; `None` without a record of attempts.
    pub fn of(out: &Path, now_s: f64) -> Option<Self> {
        let attempts = Attempts::read(out).ok()?;
        attempts.0.first()?;
        let mut g = Goodput {
            attempts: attempts.0.len(),
            trained_s: kept_step_time(out),
            ..Self::default()
        };
        for (i, a) in attempts.0.iter().enumerate() {
            let next_start = attempts.0.get(i + 1).map(|n| n.started_s);
            match &a.end {
                Some(AttemptEnd::Ended {
                    at_s,
                    saves,
                    save_s,
                    ..
                }) => {
                    g.wall_s += at_s - a.started_s;
                    g.saves += saves;
                    g.save_s += save_s;
                }
                Some(AttemptEnd::Failed { lost_steps, .. }) => {
                    g.failures += 1;
                    g.lost_steps += lost_steps;
                    g.wall_s += next_start.unwrap_or(now_s) - a.started_s;
                }
                None if next_start.is_none() => g.wall_s += now_s - a.started_s,
                None => {}
            }
        }
        g.wall_s = g.wall_s.max(0.0);
        Some(g)
    }

    /// Trained time over wall time, in [0, 1].
    pub fn fraction(&self) -> f64 {
        if self.wall_s <= 0.0 {
            return 0.0;
        }
        (self.trained_s / self.wall_s).clamp(0.0, 1.0)
    }
}

impl std::fmt::Display for Goodput {
    /// `goodput 83.1%: 41.2 s of 49.6 s trained; 2 attempts, 1 failure (27 steps lost), 10
    /// saves (0.42 s)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "goodput {:.1}%: {:.1} s of {:.1} s trained; {} attempt{}, {} failure{} ({} steps \
             lost), {} saves ({:.2} s)",
            100.0 * self.fraction(),
            self.trained_s,
            self.wall_s,
            self.attempts,
            plural(self.attempts),
            self.failures,
            plural(self.failures),
            self.lost_steps,
            self.saves,
            self.save_s
        )
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The summed `step_time_s` of the run's `metrics.jsonl` (0 without one).
fn kept_step_time(out: &Path) -> f64 {
    let Ok(text) = std::fs::read_to_string(out.join("metrics.jsonl")) else {
        return 0.0;
    };
    (text.lines())
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("step_time_s").and_then(serde_json::Value::as_f64))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::attempts::{AttemptEvent, append, restart_verdict};
    use super::*;

    fn started(attempt: usize, at_s: f64, from_step: usize) -> AttemptEvent {
        AttemptEvent::Started {
            attempt,
            at_s,
            from_step,
            ranks: 2,
        }
    }

    /// Two attempts, the first failed: the wall time runs to the restart, the lost steps
    /// and saves add up, and the trained time is the kept steps'.
    #[test]
    fn a_failed_attempt_counts_to_the_restart_and_loses_its_steps() {
        let dir = tempfile::tempdir().expect("scratch");
        let out = dir.path();
        let failed = AttemptEvent::Failed {
            attempt: 1,
            at_s: 108.0,
            step: 8,
            lost_steps: 1,
            cause: Some("rank 1 (host h) ended by signal 9".into()),
        };
        let ended = AttemptEvent::Ended {
            attempt: 2,
            at_s: 130.0,
            steps: 10,
            stopped: false,
            save_s: 0.5,
            saves: 2,
        };
        for e in [started(1, 100.0, 0), failed, started(2, 110.0, 6), ended] {
            append(out, &e).expect("append");
        }
        let steps: String = (1..=10)
            .map(|s| format!("{{\"step\":{s},\"step_time_s\":1.5}}\n"))
            .collect();
        std::fs::write(out.join("metrics.jsonl"), steps).expect("metrics");
        let g = Goodput::of(out, 200.0).expect("a record");
        assert_eq!(g.wall_s, 30.0);
        assert_eq!(g.trained_s, 15.0);
        assert_eq!((g.attempts, g.failures, g.lost_steps), (2, 1, 1));
        assert_eq!((g.saves, g.save_s), (2, 0.5));
        assert!((g.fraction() - 0.5).abs() < 1e-12);
        assert!(g.to_string().starts_with("goodput 50.0%"), "{g}");
        let attempts = Attempts::read(out).expect("read");
        assert!(attempts.recent_failures().is_empty(), "the run ended since");
    }

    /// An unfinished attempt is recorded as failed in the step after its last logged one;
    /// a second failure in the same step is not restarted, nor more than the allowed count.
    #[test]
    fn failures_are_recorded_and_judged() {
        let dir = tempfile::tempdir().expect("scratch");
        let out = dir.path();
        append(out, &started(1, 100.0, 0)).expect("append");
        std::fs::write(out.join("metrics.jsonl"), "{\"step\":6}\n{\"step\":7}\n").unwrap();
        let e = super::super::attempts::record_failure(out, 5, None).expect("record");
        assert!(
            matches!(
                e,
                Some(AttemptEvent::Failed {
                    step: 8,
                    lost_steps: 2,
                    ..
                })
            ),
            "{e:?}"
        );
        let again = super::super::attempts::record_failure(out, 5, None).expect("record");
        assert_eq!(again, None, "recorded once");
        let failures = Attempts::read(out).expect("read").recent_failures().len();
        assert_eq!(failures, 1);
        assert!(restart_verdict(&[(8, None)], 1).is_ok());
        assert!(restart_verdict(&[(8, None)], 0).is_err());
        let same = restart_verdict(&[(8, None), (8, Some("rank 1"))], 5).unwrap_err();
        assert!(
            same.to_string().contains("twice in a row in step 8"),
            "{same}"
        );
        assert!(restart_verdict(&[(8, None), (9, None)], 2).is_ok());
        assert!(restart_verdict(&[(7, None), (8, None), (9, None)], 2).is_err());
    }
}
