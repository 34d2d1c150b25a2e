//! Naming a rank that is slower than the others: each step, every rank's time computing (its
//! step time less its time blocked in communication, [`blocked_time`]) is compared with the
//! median of the other ranks'; a rank above it by more than a set fraction for several steps
//! in a row is named in the log with its host. In a synchronous step every rank's wall time is
//! the same (the fast ones wait for the slow one), so the time computing is what tells them
//! apart. A rank must also be slower by at least [`NOISE_S`]: on a busy machine a step of a
//! few milliseconds varies by a scheduler's time slice.
//!
//! [`blocked_time`]: crate::comm::watchdog::blocked_time

use crate::comm::{CommError, Communicator};

/// The least excess over the others' median that counts as slow (10 ms: a few of a busy
/// machine's scheduler time slices).
pub const NOISE_S: f64 = 0.01;

/// When a rank counts as a straggler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StragglerRule {
    /// A rank computing more than `1 + fraction` times the median of the others' time is slow.
    pub fraction: f64,
    /// Steps in a row a rank must be slow to be named (0: never named).
    pub steps: usize,
}

impl Default for StragglerRule {
    /// Half as slow again as the others, for 5 steps in a row.
    fn default() -> Self {
        Self {
            fraction: 0.5,
            steps: 5,
        }
    }
}

/// The straggler detector of a run (rank 0's).
#[derive(Clone, Debug)]
pub struct Stragglers {
    rule: StragglerRule,
    hosts: Vec<String>,
    /// Steps in a row each rank has been slow.
    streak: Vec<usize>,
}

impl Stragglers {
    /// A detector for the ranks on `hosts` (one entry per world rank).
    pub fn new(rule: StragglerRule, hosts: Vec<String>) -> Self {
        let streak = vec![0; hosts.len()];
        Self {
            rule,
            hosts,
            streak,
        }
    }

    /// Takes one step's time computing of every rank (seconds, by world rank); returns a line
    /// for each rank slow for exactly `rule.steps` steps in a row now (named once a streak).
    pub fn observe(&mut self, computing: &[f64]) -> Vec<String> {
        let mut lines = Vec::new();
        if self.rule.steps == 0 || computing.len() < 2 || computing.len() != self.streak.len() {
            return lines;
        }
        for (rank, &mine) in computing.iter().enumerate() {
            let others: Vec<f64> = (computing.iter().enumerate())
                .filter(|&(r, _)| r != rank)
                .map(|(_, &t)| t)
                .collect();
            let median = median(others);
            let slow = median > 0.0
                && mine > (1.0 + self.rule.fraction) * median
                && mine - median >= NOISE_S;
            self.streak[rank] = if slow { self.streak[rank] + 1 } else { 0 };
            if self.streak[rank] == self.rule.steps {
                lines.push(format!(
                    "straggler: rank {rank} (host {}) computed {:.2}x as long as the median of \
                     the other ranks for {} steps in a row ({:.4} s against {:.4} s in the last \
                     step; train.straggler_fraction = {})",
                    self.hosts.get(rank).map_or("?", String::as_str),
                    mine / median,
                    self.rule.steps,
                    mine,
                    median,
                    self.rule.fraction
                ));
            }
        }
        lines
    }
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Every rank's host name, by world rank (each sends at most 64 bytes of it).
pub fn gather_hosts(world: &dyn Communicator) -> Result<Vec<String>, CommError> {
    const BYTES: usize = 64;
    let mine = crate::train::run_lock::host_name();
    let mut send = vec![0.0f32; BYTES];
    for (slot, b) in send.iter_mut().zip(mine.bytes()) {
        *slot = f32::from(b);
    }
    let mut all = vec![0.0f32; BYTES * world.size()];
    world.all_gather(&send, &mut all)?;
    Ok(all
        .chunks(BYTES)
        .map(|c| {
            let bytes: Vec<u8> = c.iter().map(|&v| v as u8).take_while(|&b| b != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector(fraction: f64, steps: usize, ranks: usize) -> Stragglers {
        let hosts = (0..ranks).map(|r| format!("node{r}")).collect();
        Stragglers::new(StragglerRule { fraction, steps }, hosts)
    }

    /// A rank slower than the others' median by more than the fraction is named after the
    /// set number of steps in a row, once per streak; noise below the fraction is not.
    #[test]
    fn a_rank_slow_for_several_steps_is_named_once() {
        let mut d = detector(0.5, 3, 4);
        let step = [0.010, 0.011, 0.025, 0.012];
        // 25 ms against 11 ms: 2.27x, 14 ms more.
        assert!(d.observe(&step).is_empty());
        assert!(d.observe(&step).is_empty());
        let named = d.observe(&step);
        assert_eq!(named.len(), 1, "{named:?}");
        assert!(
            named[0].contains("rank 2 (host node2)") && named[0].contains("2.27x"),
            "{named:?}"
        );
        assert!(d.observe(&step).is_empty(), "named once a streak");
        // Recovered, then slow again: named again after a new streak.
        assert!(d.observe(&[0.01; 4]).is_empty());
        for _ in 0..2 {
            assert!(d.observe(&step).is_empty());
        }
        assert_eq!(d.observe(&step).len(), 1);
        // Within the fraction: never named.
        let mut d = detector(0.5, 2, 2);
        for _ in 0..10 {
            assert!(d.observe(&[0.100, 0.140]).is_empty());
        }
        // Beyond the fraction but within the noise of a busy machine: not named either.
        for _ in 0..10 {
            assert!(d.observe(&[0.004, 0.009]).is_empty());
        }
    }

    /// A streak broken by one fast step starts again; 0 steps never names.
    #[test]
    fn a_broken_streak_starts_again_and_zero_steps_is_off() {
        let mut d = detector(0.2, 2, 2);
        assert!(d.observe(&[0.01, 0.03]).is_empty());
        assert!(d.observe(&[0.01, 0.01]).is_empty());
        assert!(d.observe(&[0.01, 0.03]).is_empty());
        assert_eq!(d.observe(&[0.01, 0.03]).len(), 1);
        let mut off = detector(0.2, 0, 2);
        for _ in 0..5 {
            assert!(off.observe(&[0.01, 1.0]).is_empty());
        }
    }

    #[test]
    fn the_median_of_an_even_count_is_the_middle_mean() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
