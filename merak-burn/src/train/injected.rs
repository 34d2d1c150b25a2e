//! Failures injected on purpose, to test what a run does when a rank dies, stalls or lags:
//! `MERAK_INJECT` holds a comma-separated list of
//!
//! - `kill@R:S`: world rank `R` kills itself with SIGKILL (as `kill -9` would) when step `S`
//!   (1-based) begins;
//! - `stall@R:S`: rank `R` stops at step `S` and sleeps for an hour (the others block in their
//!   next collective until the watchdog ends the job);
//! - `delay@R:MS`: rank `R` sleeps `MS` milliseconds at the start of every step (a straggler).
//!
//! `kill` and `stall` fire only in an attempt that started from step 0, so a restart from a
//! checkpoint runs on; with `:always` after them (`kill@1:7:always`) they fire in every
//! attempt that reaches the step. Unset, a run checks one empty list per step.

use std::time::Duration;

use crate::train::InvalidSetting;

/// The environment variable that lists the failures to inject.
pub const INJECT: &str = "MERAK_INJECT";

/// What to do to a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill,
    Stall,
    Delay,
}

/// One injected failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injected {
    fault: Fault,
    /// The world rank it hits.
    rank: usize,
    /// The step (kill, stall) or the milliseconds (delay).
    value: u64,
    /// Whether it fires in attempts that started from a checkpoint too.
    always: bool,
}

/// The failures `MERAK_INJECT` lists (none when it is unset); a malformed entry is refused
/// naming the variable and the entry.
pub fn from_env() -> Result<Vec<Injected>, InvalidSetting> {
    match std::env::var(INJECT) {
        Ok(text) => parse(&text),
        Err(_) => Ok(Vec::new()),
    }
}

/// Parses a `MERAK_INJECT` list.
fn parse(text: &str) -> Result<Vec<Injected>, InvalidSetting> {
    let bad = |entry: &str| InvalidSetting {
        key: INJECT.into(),
        value: entry.into(),
        reason: "expected kill@RANK:STEP, stall@RANK:STEP or delay@RANK:MILLISECONDS (kill and \
                 stall optionally followed by :always), comma-separated"
            .into(),
    };
    let mut all = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (what, rest) = entry.split_once('@').ok_or_else(|| bad(entry))?;
        let fault = match what {
            "kill" => Fault::Kill,
            "stall" => Fault::Stall,
            "delay" => Fault::Delay,
            _ => return Err(bad(entry)),
        };
        let parts: Vec<&str> = rest.split(':').collect();
        let always = match parts.get(2) {
            None => false,
            Some(&"always") if fault != Fault::Delay => true,
            Some(_) => return Err(bad(entry)),
        };
        let (Some(rank), Some(value), true) = (
            parts.first().and_then(|r| r.parse().ok()),
            parts.get(1).and_then(|v| v.parse().ok()),
            parts.len() <= 3,
        ) else {
            return Err(bad(entry));
        };
        all.push(Injected {
            fault,
            rank,
            value,
            always,
        });
    }
    Ok(all)
}

/// Applies `faults` to world rank `rank` at the start of step `step` (1-based) of an attempt
/// that started after step `from_step`.
pub fn before_step(faults: &[Injected], rank: usize, step: usize, from_step: usize) {
    for f in faults.iter().filter(|f| f.rank == rank) {
        let due = f.value == step as u64 && (f.always || from_step == 0);
        match f.fault {
            Fault::Delay => std::thread::sleep(Duration::from_millis(f.value)),
            Fault::Kill if due => {
                tracing::warn!("{INJECT}: rank {rank} kills itself (SIGKILL) at step {step}");
                // SAFETY: kill(2) of this process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            Fault::Stall if due => {
                tracing::warn!("{INJECT}: rank {rank} stalls at step {step}");
                std::thread::sleep(Duration::from_secs(3600));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_parses_and_bad_entries_are_named() {
        let all = parse("kill@1:7, delay@0:20,stall@2:3:always").expect("a list");
        assert_eq!(all.len(), 3);
        assert_eq!(
            all[0],
            Injected {
                fault: Fault::Kill,
                rank: 1,
                value: 7,
                always: false
            }
        );
        assert!(all[2].always);
        assert!(parse("").expect("empty").is_empty());
        for bad in [
            "kill@1",
            "boom@1:2",
            "kill@x:2",
            "delay@1:5:always",
            "kill@1:2:3:4",
            "kill1:2",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(INJECT) && e.contains(bad), "{bad}: {e}");
        }
    }
}
