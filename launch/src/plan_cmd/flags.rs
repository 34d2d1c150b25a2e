//! The flags of `merak plan` that narrow the search, checked against the model, the devices and
//! the hardware before it: a value the search could never use is refused, naming its flag and
//! the numbers (one rule for every such flag: a flag given explicitly must be able to apply).

use anyhow::{Result, bail};
use merak_burn::pipeline::ScheduleKind;
use merak_burn::planner::{HardwareSpec, TransformerShape};

/// What the flags are checked against.
pub(super) struct Job<'a> {
    /// The model's shape (`--model`, with `--seq`).
    pub shape: &'a TransformerShape,
    /// The hardware (`--hardware`).
    pub hw: &'a HardwareSpec,
    /// `--gpus`.
    pub gpus: usize,
    /// `--model` as given.
    pub model: &'a str,
    /// `--hardware` as given.
    pub hardware: &'a str,
    /// Whether `--seq` gave the sequence length.
    pub seq_flag: bool,
}

impl Job<'_> {
    /// The pipeline units (layers + embedding + head).
    fn units(&self) -> usize {
        self.shape.layers.saturating_add(2)
    }

    /// The sequence length and where it comes from, for messages.
    fn seq_text(&self) -> String {
        if self.seq_flag {
            format!("--seq {}", self.shape.seq)
        } else {
            format!(
                "the sequence length {} of --model {:?}",
                self.shape.seq, self.model
            )
        }
    }

    /// Why no tensor-parallel degree above 1 fits, or `None` when one does (a divisor of both
    /// `--gpus` and the heads, within a node).
    fn no_tensor_parallelism(&self) -> Option<String> {
        let common = gcd(self.gpus, self.shape.heads);
        let per_node = self.hw.devices_per_node;
        match smallest_factor(common) {
            Some(tp) if tp <= per_node => None,
            Some(tp) => Some(format!(
                "the smallest degree dividing --gpus {} and the model's {} heads is {tp}, more \
                 than the {per_node} devices per node of --hardware {}",
                self.gpus, self.shape.heads, self.hardware
            )),
            None => Some(format!(
                "--gpus {} and the {} heads of --model {:?} have no common divisor above 1",
                self.gpus, self.shape.heads, self.model
            )),
        }
    }

    /// Whether a pipeline of `pp >= 2` ranks with `v` stages each fits: `pp` dividing `--gpus`
    /// and `pp x v` at most the units.
    fn has_pipeline(&self, v: usize) -> bool {
        (2..=self.units() / v).any(|pp| self.gpus.is_multiple_of(pp))
    }
}

/// The greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The smallest divisor of `n` above 1 (`None` for 0 and 1), in `O(√n)` steps.
fn smallest_factor(n: usize) -> Option<usize> {
    if n < 2 {
        return None;
    }
    let mut d = 2usize;
    while d.checked_mul(d).is_some_and(|square| square <= n) {
        if n.is_multiple_of(d) {
            return Some(d);
        }
        d += 1;
    }
    Some(n)
}

/// `--cp`: each degree at least 1, dividing `--gpus`, with `2 cp` dividing the sequence.
pub(super) fn check_context_parallel(degrees: &[usize], job: &Job<'_>) -> Result<()> {
    each_degree(degrees, "--cp", "no context parallelism", |cp| {
        if !job.gpus.is_multiple_of(cp) {
            bail!(
                "--cp {cp} does not divide --gpus {} (dp x cp x tp x pp = the devices)",
                job.gpus
            );
        }
        let chunks = cp.saturating_mul(2);
        if !job.shape.seq.is_multiple_of(chunks) {
            bail!(
                "--cp {cp}: 2 x cp = {chunks} does not divide {} (each rank of the ring holds \
                 two zigzag chunks of a sequence)",
                job.seq_text()
            );
        }
        Ok(())
    })
}

/// Refuses a degree of 0 for `flag` (`one` says what 1 means), and checks every degree above 1
/// with `check`; 1 (the axis unused) always passes.
fn each_degree(
    degrees: &[usize],
    flag: &str,
    one: &str,
    mut check: impl FnMut(usize) -> Result<()>,
) -> Result<()> {
    for &degree in degrees {
        if degree == 0 {
            bail!("{flag}: degrees must be at least 1 (1: {one})");
        }
        if degree > 1 {
            check(degree)?;
        }
    }
    Ok(())
}

/// `--ep`: each degree at least 1; above 1 only for a mixture of experts, dividing its
/// experts and `--gpus`.
pub(super) fn check_expert_parallel(degrees: &[usize], job: &Job<'_>) -> Result<()> {
    each_degree(degrees, "--ep", "no expert parallelism", |ep| {
        let Some(moe) = &job.shape.moe else {
            bail!(
                "--ep {ep}: --model {:?} is dense (no model.moe): an expert-parallel degree \
                 needs a mixture of experts",
                job.model
            );
        };
        if !moe.experts.is_multiple_of(ep) {
            bail!(
                "--ep {ep} does not divide the {} experts (model.moe.experts) of --model {:?}",
                moe.experts,
                job.model
            );
        }
        if !job.gpus.is_multiple_of(ep) {
            bail!(
                "--ep {ep} does not divide --gpus {} (an expert-parallel group is made of \
                 data-parallel ranks, dp x cp dividing the devices)",
                job.gpus
            );
        }
        Ok(())
    })
}

/// `--tp-overlap`: each degree at least 1; above 1 within the hardware's `max_tp_overlap`
/// and only where tensor parallelism fits.
pub(super) fn check_overlaps(degrees: &[usize], job: &Job<'_>) -> Result<()> {
    each_degree(degrees, "--tp-overlap", "no overlap", |k| {
        let max = job.hw.max_tp_overlap;
        if k > max {
            bail!(
                "--tp-overlap {k}: above the {max} chunks of --hardware {} (its max_tp_overlap)",
                job.hardware
            );
        }
        if let Some(why) = job.no_tensor_parallelism() {
            bail!(
                "--tp-overlap {k}: sub-pipelining splits tensor parallelism's all-reduces, and \
                 no tp > 1 fits: {why}"
            );
        }
        Ok(())
    })
}

/// `--sequence-parallel on` or `both`: only where tensor parallelism fits.
pub(super) fn check_sequence_parallel(mode: SequenceParallel, job: &Job<'_>) -> Result<()> {
    if mode == SequenceParallel::Off {
        return Ok(());
    }
    if let Some(why) = job.no_tensor_parallelism() {
        bail!(
            "--sequence-parallel {}: sequence parallelism needs tp > 1, and no tp > 1 fits: {why}",
            mode.name()
        );
    }
    Ok(())
}

/// `--schedules`: each needs a pipeline (`pp >= 2` dividing `--gpus`), with room for two
/// stages per rank for the interleaved and ZB-V schedules.
pub(super) fn check_schedules(schedules: &[ScheduleKind], job: &Job<'_>) -> Result<()> {
    for &kind in schedules {
        let v = if kind.uses_virtual_stages() { 2 } else { 1 };
        if job.has_pipeline(v) {
            continue;
        }
        let units = job.units();
        if v == 1 {
            bail!(
                "--schedules {kind}: a pipeline schedule needs pp > 1, and --gpus {} has no \
                 divisor from 2 to the model's {units} units (layers + embedding + head)",
                job.gpus
            );
        }
        bail!(
            "--schedules {kind} runs at least 2 stages per pipeline rank, and --gpus {} has no \
             divisor pp from 2 to {} (2 pp at most the model's {units} units)",
            job.gpus,
            units / 2
        );
    }
    Ok(())
}

/// What `merak plan --sequence-parallel` searches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum SequenceParallel {
    // Plain comments: doc comments would become clap's per-value help, which switches the
    // whole `--help` to its long layout.
    // With sequence parallelism wherever tp > 1 divides a rank's tokens.
    On,
    // With and without it.
    Both,
    // Without it.
    Off,
}

impl SequenceParallel {
    /// The flag's value naming this mode.
    pub(super) fn name(self) -> &'static str {
        match self {
            SequenceParallel::On => "on",
            SequenceParallel::Both => "both",
            SequenceParallel::Off => "off",
        }
    }

    /// The settings the search tries.
    pub(super) fn settings(self) -> Vec<bool> {
        match self {
            SequenceParallel::On => vec![true],
            SequenceParallel::Both => vec![false, true],
            SequenceParallel::Off => vec![false],
        }
    }
}
