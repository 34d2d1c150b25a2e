//! Rank 0's view of a run: a progress bar with loss, tokens/s and ETA on a terminal, one log
//! line per step otherwise (logs, CI).

use indicatif::{ProgressBar, ProgressStyle};

use crate::train::StepMetrics;

/// A progress bar on a terminal, log lines elsewhere, nothing on other ranks.
pub(crate) struct Progress {
    /// The bar, on rank 0 when stderr is a terminal.
    bar: Option<ProgressBar>,
    /// Whether this rank reports at all.
    shown: bool,
}

impl Progress {
    /// Progress of a run from step `start` to `steps`; silent when `shown` is false.
    pub(crate) fn new(shown: bool, start: usize, steps: usize) -> Self {
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = (shown && terminal).then(|| {
            let bar = ProgressBar::new(steps as u64);
            bar.set_position(start as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} step {pos}/{len} | {msg} | {elapsed_precise} ETA {eta_precise}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        Self { bar, shown }
    }

    /// Reports step `m`; `total_time` is the time of the run's steps so far.
    pub(crate) fn step(&self, m: &StepMetrics, steps: usize, total_time: f64, tokens: usize) {
        if !self.shown {
            return;
        }
        let line = format!(
            "step {}/{steps} loss {:.5}{} lr {:.2e} grad_norm {:.4} tokens/s {:.0} step {:.3}s",
            m.step,
            m.loss,
            m.val_loss
                .map(|v| format!(" val_loss {v:.5}"))
                .unwrap_or_default(),
            m.lr,
            m.grad_norm,
            m.tokens_per_s,
            m.step_time_s
        );
        match &self.bar {
            // On a terminal: a live bar, and a log line when validation ran.
            Some(bar) => {
                let mean = (tokens * m.step) as f64 / total_time.max(1e-9);
                bar.set_message(format!("loss {:.4} | {:.0} tokens/s", m.loss, mean));
                bar.inc(1);
                if m.val_loss.is_some() {
                    bar.suspend(|| tracing::info!("{line}"));
                }
            }
            None => tracing::info!("{line}"),
        }
    }

    /// Logs `line` without tearing the bar.
    pub(crate) fn log(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| tracing::info!("{line}")),
            None => tracing::info!("{line}"),
        }
    }

    /// Removes the bar.
    pub(crate) fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
