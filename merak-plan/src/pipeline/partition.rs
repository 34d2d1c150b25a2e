//! Cutting a model's units into contiguous pipeline stages.
//!
//! A GPT or BERT model with `L` transformer layers has `L + 2` *units*: unit 0 is the embedding,
//! units `1..=L` are the transformer blocks and unit `L + 1` is the head (final norm, tied output
//! layer and loss). A [`Partition`] gives every unit to exactly one stage; the stages are
//! contiguous, non-empty and in order. A `Partition` can only be made by [`balanced_partition`]
//! (the split with the smallest bottleneck for given per-unit costs) or [`explicit_partition`]
//! (the user's `parallel.stage_layers`: units per stage). Both check their input, so a partition
//! that drops or repeats a unit cannot exist.
//!
//! # Arithmetic
//!
//! Stage costs are differences of prefix sums, `P[end] - P[start]` with
//! `P[i] = costs[0] + .. + costs[i - 1]` added left to right in `f64`. Because rounding is
//! monotone, this cost never decreases when a stage grows at either end, which is what makes the
//! search below exact: [`balanced_partition`] finds the smallest bottleneck that this arithmetic
//! can express, and [`Partition::stage_costs`] uses the same arithmetic, so the largest of its
//! values equals that optimum bit for bit.

use std::fmt;
use std::ops::Range;

use thiserror::Error;

/// An input that cannot be cut into pipeline stages. Every message names the numbers involved.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum PartitionError {
    /// A pipeline of zero stages.
    #[error("a pipeline needs at least 1 stage, got 0 stages")]
    ZeroStages,
    /// More stages than units: some stage would be empty.
    #[error(
        "cannot cut {units} units into {stages} non-empty pipeline stages \
         (at most {units} stages; use fewer stages or a deeper model)"
    )]
    MoreStagesThanUnits {
        /// The requested number of stages.
        stages: usize,
        /// The number of units to distribute.
        units: usize,
    },
    /// An explicit stage size of zero.
    #[error("stage {stage} has 0 units: every pipeline stage needs at least 1 unit")]
    EmptyStage {
        /// The (0-based) stage with no units.
        stage: usize,
    },
    /// Explicit stage sizes that do not add up to the number of units.
    #[error("stage sizes {sizes:?} sum to {sum} units, but the model has {units} units")]
    SizesDoNotSum {
        /// The requested units per stage.
        sizes: Vec<usize>,
        /// Their sum (saturating at `usize::MAX`).
        sum: usize,
        /// The number of units of the model.
        units: usize,
    },
    /// A stage (read from a file) that does not start where the previous one ends.
    #[error(
        "stage {stage} starts at unit {start}, but the stage before it ends at unit {expected}"
    )]
    NotContiguous {
        /// The (0-based) stage.
        stage: usize,
        /// Its first unit.
        start: usize,
        /// Where the previous stage ended (0 for the first stage).
        expected: usize,
    },
    /// A unit cost that is negative, infinite or NaN.
    #[error("unit {unit} has cost {cost}: unit costs must be finite and non-negative")]
    BadCost {
        /// The (0-based) unit.
        unit: usize,
        /// Its cost.
        cost: f64,
    },
    /// Finite costs whose running sum exceeds `f64::MAX`.
    #[error(
        "the unit costs sum past f64::MAX at unit {unit} (sum of units 0..={unit}): \
         scale the costs down"
    )]
    CostOverflow {
        /// The first unit at which the running sum becomes infinite.
        unit: usize,
    },
}

/// Model units cut into contiguous, non-empty, ordered pipeline stages that cover every unit
/// exactly once. Made only by [`balanced_partition`] and [`explicit_partition`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RawPartition")]
pub struct Partition {
    /// `ranges[s]` is the half-open unit range of stage `s`; `ranges[0].start == 0`,
    /// `ranges[s].end == ranges[s + 1].start`, the last end is the number of units and no range
    /// is empty.
    ranges: Vec<Range<usize>>,
}

/// A partition as read from JSON, before it is checked.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPartition {
    ranges: Vec<Range<usize>>,
}

impl TryFrom<RawPartition> for Partition {
    type Error = PartitionError;

    /// Accepts only contiguous, non-empty, ordered ranges starting at unit 0.
    fn try_from(raw: RawPartition) -> Result<Self, Self::Error> {
        let mut next = 0;
        for (stage, range) in raw.ranges.iter().enumerate() {
            if range.start != next {
                return Err(PartitionError::NotContiguous {
                    stage,
                    start: range.start,
                    expected: next,
                });
            }
            if range.end <= range.start {
                return Err(PartitionError::EmptyStage { stage });
            }
            next = range.end;
        }
        let sizes: Vec<usize> = raw.ranges.iter().map(|r| r.len()).collect();
        explicit_partition(&sizes, next)
    }
}

impl Partition {
    /// Builds the partition from stage sizes that the caller has checked (all non-zero).
    fn from_sizes(sizes: &[usize]) -> Self {
        let mut start = 0;
        let ranges = sizes
            .iter()
            .map(|&size| {
                let range = start..start + size;
                start += size;
                range
            })
            .collect();
        Self { ranges }
    }

    /// The number of stages (at least 1).
    pub fn stages(&self) -> usize {
        self.ranges.len()
    }

    /// The number of units (at least the number of stages).
    pub fn units(&self) -> usize {
        self.ranges.last().map_or(0, |range| range.end)
    }

    /// The half-open range of units of `stage`.
    ///
    /// # Panics
    ///
    /// If `stage >= self.stages()`.
    pub fn range(&self, stage: usize) -> Range<usize> {
        self.ranges[stage].clone()
    }

    /// All stage ranges, in stage order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// The stage that holds `unit`.
    ///
    /// # Panics
    ///
    /// If `unit >= self.units()`.
    pub fn stage_of(&self, unit: usize) -> usize {
        assert!(
            unit < self.units(),
            "unit {unit} is out of range: the partition has {} units",
            self.units()
        );
        self.ranges.partition_point(|range| range.end <= unit)
    }

    /// The number of units of each stage.
    pub fn sizes(&self) -> Vec<usize> {
        self.ranges.iter().map(|range| range.len()).collect()
    }

    /// The cost of each stage: the sum of its units' costs, computed as a difference of prefix
    /// sums exactly as [`balanced_partition`] does (see the module documentation), so for the
    /// partition `balanced_partition(costs, k)` the largest value is the optimal bottleneck.
    ///
    /// # Panics
    ///
    /// If `costs.len() != self.units()`.
    pub fn stage_costs(&self, costs: &[f64]) -> Vec<f64> {
        assert_eq!(
            costs.len(),
            self.units(),
            "got {} unit costs for a partition of {} units",
            costs.len(),
            self.units()
        );
        let prefix = prefix_sums(costs);
        self.ranges
            .iter()
            .map(|range| prefix[range.end] - prefix[range.start])
            .collect()
    }
}

impl fmt::Display for Partition {
    /// Writes the stages as unit ranges, e.g. `[0..5, 5..9, 9..14]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (stage, range) in self.ranges.iter().enumerate() {
            if stage > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}..{}", range.start, range.end)?;
        }
        f.write_str("]")
    }
}

/// `P[0] = 0`, `P[i + 1] = P[i] + costs[i]`, added left to right.
fn prefix_sums(costs: &[f64]) -> Vec<f64> {
    let mut prefix = Vec::with_capacity(costs.len() + 1);
    let mut sum = 0.0;
    prefix.push(sum);
    for &cost in costs {
        sum += cost;
        prefix.push(sum);
    }
    prefix
}

/// [`prefix_sums`] of costs checked to be finite and non-negative, with a finite total.
fn checked_prefix_sums(costs: &[f64]) -> Result<Vec<f64>, PartitionError> {
    if let Some((unit, &cost)) = costs
        .iter()
        .enumerate()
        .find(|&(_, &cost)| !(cost.is_finite() && cost >= 0.0))
    {
        return Err(PartitionError::BadCost { unit, cost });
    }
    let prefix = prefix_sums(costs);
    if let Some(unit) = prefix.iter().skip(1).position(|sum| !sum.is_finite()) {
        return Err(PartitionError::CostOverflow { unit });
    }
    Ok(prefix)
}

/// Whether the units can be cut into at most `stages` contiguous stages of cost `<= bound`.
///
/// Greedy from the front, each stage as long as the bound allows; exact because a stage's cost
/// never decreases as it grows at either end. `O(stages * log(units))`.
fn fits(prefix: &[f64], bound: f64, stages: usize) -> bool {
    let units = prefix.len() - 1;
    let mut start = 0;
    for _ in 0..stages {
        let base = prefix[start];
        // prefix[start] - base = 0 <= bound, so the count is at least 1.
        let end = start + prefix[start..].partition_point(|&sum| sum - base <= bound) - 1;
        if end == start {
            // A single unit exceeds the bound.
            return false;
        }
        if end == units {
            return true;
        }
        start = end;
    }
    false
}

/// The smallest bottleneck (largest stage cost) over all cuts of the units of `prefix` into
/// `stages` non-empty contiguous stages; `1 <= stages <= units`, finite non-negative prefix
/// sums. `lo` is at most the answer (e.g. the largest single unit cost) and `hi` at least it
/// (a bound known to fit).
///
/// Non-negative finite `f64`s are ordered like their bit patterns, so a binary search over the
/// bits finds the smallest bound that [`fits`] in at most 64 steps. That bound is attained: the
/// greedy cut under it has every stage cost `<= bound`, and its largest stage cost fits too, so
/// it cannot be smaller.
fn min_bottleneck(prefix: &[f64], stages: usize, lo: f64, hi: f64) -> f64 {
    let (mut lo, mut hi) = (lo.to_bits(), hi.to_bits());
    // Often the known bound is already the answer: one check instead of a search.
    if lo < hi && !fits(prefix, f64::from_bits(hi - 1), stages) {
        return f64::from_bits(hi);
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(prefix, f64::from_bits(mid), stages) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    f64::from_bits(lo)
}

/// Cuts units with the given per-unit costs into `stages` contiguous, non-empty stages so that
/// the largest stage cost (the pipeline's bottleneck) is as small as possible.
///
/// The optimum is exact (see the module documentation for the arithmetic): a binary search over
/// the bit patterns of the bound with a greedy feasibility check.
///
/// Tie-break, among the optimal cuts: the last stage is as large as the optimum allows, and the
/// stages before it are, recursively, the same kind of cut of the units that remain. So every
/// leading group of stages `0..=j` is itself an optimal cut of its units into `j + 1` stages
/// (the front of the pipeline is balanced within itself), and the slack that the optimum leaves
/// goes to the first stages. Under 1F1B the first stages hold the most micro-batches in flight
/// (`p - r` on rank `r`), so they are the ones that should get the least work and activation
/// memory. For example, 10 equal units on 4 stages give sizes `[2, 2, 3, 3]`.
///
/// Cost: `O(units)` for the prefix sums, then per stage one greedy check of
/// `O(stages * log(units))`, or a 64-step search of such checks when the bound of the remaining
/// units drops: thousands of units into hundreds of stages take milliseconds.
///
/// # Errors
///
/// [`PartitionError::ZeroStages`], [`PartitionError::MoreStagesThanUnits`] (including no units
/// at all), [`PartitionError::BadCost`] for a negative, infinite or NaN cost and
/// [`PartitionError::CostOverflow`] when the costs sum past `f64::MAX`.
pub fn balanced_partition(costs: &[f64], stages: usize) -> Result<Partition, PartitionError> {
    let units = costs.len();
    if stages == 0 {
        return Err(PartitionError::ZeroStages);
    }
    if stages > units {
        return Err(PartitionError::MoreStagesThanUnits { stages, units });
    }
    let prefix = checked_prefix_sums(costs)?;
    // largest_before[i]: the largest single unit cost among units 0..i, a lower bound on the
    // bottleneck of any cut of those units.
    let mut largest_before = Vec::with_capacity(units + 1);
    largest_before.push(0.0_f64);
    for pair in prefix.windows(2) {
        let largest = largest_before[largest_before.len() - 1];
        largest_before.push(largest.max(pair[1] - pair[0]));
    }

    // From the last stage back: stages 0..=stage share units 0..end. Take the optimal bound of
    // that cut; stage `stage` starts at the first unit that keeps its cost within the bound, but
    // no earlier than its index (the stages before it need a unit each). The units left in front
    // still fit that bound with one stage fewer (an optimal cut's last stage starts no earlier,
    // and its front part restricted to fewer units never costs more), so the bound never grows
    // and the previous one is a valid upper end for the next search.
    let mut ranges = vec![0..0; stages];
    let mut end = units;
    let mut bound = prefix[units];
    for stage in (1..stages).rev() {
        bound = min_bottleneck(&prefix[..=end], stage + 1, largest_before[end], bound);
        let top = prefix[end];
        let first_fit = prefix[..end].partition_point(|&sum| top - sum > bound);
        let start = first_fit.max(stage);
        ranges[stage] = start..end;
        end = start;
    }
    ranges[0] = 0..end;
    Ok(Partition { ranges })
}

/// Cuts `units` units into stages of the given sizes, in order: `sizes[s]` units for stage `s`
/// (the user's `parallel.stage_layers`).
///
/// # Errors
///
/// [`PartitionError::ZeroStages`] for no sizes, [`PartitionError::MoreStagesThanUnits`] for
/// more sizes than units, [`PartitionError::EmptyStage`] for a size of zero and
/// [`PartitionError::SizesDoNotSum`] when the sizes do not add up to `units`.
pub fn explicit_partition(sizes: &[usize], units: usize) -> Result<Partition, PartitionError> {
    let stages = sizes.len();
    if stages == 0 {
        return Err(PartitionError::ZeroStages);
    }
    if stages > units {
        return Err(PartitionError::MoreStagesThanUnits { stages, units });
    }
    if let Some(stage) = sizes.iter().position(|&size| size == 0) {
        return Err(PartitionError::EmptyStage { stage });
    }
    let sum = sizes
        .iter()
        .fold(0_usize, |sum, &size| sum.saturating_add(size));
    if sum != units {
        return Err(PartitionError::SizesDoNotSum {
            sizes: sizes.to_vec(),
            sum,
            units,
        });
    }
    Ok(Partition::from_sizes(sizes))
}

/// Per-unit training cost of a GPT model, in FLOPs per sequence for the forward and backward
/// pass, for the `layers + 2` units (embedding, `layers` blocks, head). With `s = seq`,
/// `h = hidden`, `V = vocab`:
///
/// - embedding (unit 0): `2 s h` — a table lookup plus the position embedding, next to nothing;
/// - transformer block (units `1..=layers`): `3 (24 s h^2 + 4 s^2 h)` — the forward pass is
///   `24 s h^2` for the QKV, attention-output and two MLP GEMMs (MLP width `4h`) plus `4 s^2 h`
///   for the attention scores and their product with V, counting a multiply-add as 2 FLOPs; the
///   backward pass costs twice the forward;
/// - head (unit `layers + 1`): `3 (2 s h V)` — the tied output projection to the vocabulary,
///   forward and backward (the final LayerNorm and the loss are negligible next to it).
///
/// Computed in `f64`, so large shapes do not overflow.
pub fn unit_costs_gpt(layers: usize, hidden: usize, seq: usize, vocab: usize) -> Vec<f64> {
    let (h, s, v) = (hidden as f64, seq as f64, vocab as f64);
    let embedding = 2.0 * s * h;
    let block = 3.0 * (24.0 * s * h * h + 4.0 * s * s * h);
    let head = 3.0 * (2.0 * s * h * v);
    let mut costs = Vec::with_capacity(layers + 2);
    costs.push(embedding);
    costs.extend(std::iter::repeat_n(block, layers));
    costs.push(head);
    costs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a tiny deterministic generator for the tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in `[0, 1)`.
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1_u64 << 53) as f64
        }
    }

    /// Every cut of `units` units into `stages` non-empty contiguous stages, as sizes.
    fn all_splits(units: usize, stages: usize) -> Vec<Vec<usize>> {
        if stages == 1 {
            return vec![vec![units]];
        }
        let mut splits = Vec::new();
        for first in 1..=units - (stages - 1) {
            for mut rest in all_splits(units - first, stages - 1) {
                rest.insert(0, first);
                splits.push(rest);
            }
        }
        splits
    }

    fn max_of(values: &[f64]) -> f64 {
        values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    }

    /// Checks the structural invariants of a partition of `units` units into `stages` stages.
    fn check_structure(partition: &Partition, units: usize, stages: usize) {
        assert_eq!(partition.stages(), stages);
        assert_eq!(partition.units(), units);
        let mut next = 0;
        for stage in 0..stages {
            let range = partition.range(stage);
            assert_eq!(range.start, next, "stage {stage} is not contiguous");
            assert!(!range.is_empty(), "stage {stage} is empty");
            for unit in range.clone() {
                assert_eq!(partition.stage_of(unit), stage);
            }
            next = range.end;
        }
        assert_eq!(next, units, "the stages do not cover every unit");
        assert_eq!(partition.sizes().iter().sum::<usize>(), units);
        assert_eq!(partition.ranges().len(), stages);
    }

    /// The brute-force optimal bottleneck of cutting units `0..units` (of `costs`) into `stages`.
    fn brute_optimum(costs: &[f64], units: usize, stages: usize) -> f64 {
        let costs = &costs[..units];
        all_splits(units, stages)
            .iter()
            .map(|sizes| max_of(&explicit_partition(sizes, units).unwrap().stage_costs(costs)))
            .fold(f64::INFINITY, f64::min)
    }

    /// The documented tie-break, by brute force: the last stage is the largest one that an
    /// optimal cut of units `0..units` can have, and the stages before it are the same kind of
    /// cut of the units in front of it.
    fn brute_sizes(costs: &[f64], units: usize, stages: usize) -> Vec<usize> {
        if stages == 1 {
            return vec![units];
        }
        let best = brute_optimum(costs, units, stages);
        let start = (stages - 1..units)
            .find(|&start| {
                let last = explicit_partition(&[start, units - start], units)
                    .unwrap()
                    .stage_costs(&costs[..units])[1];
                last <= best && brute_optimum(costs, start, stages - 1) <= best
            })
            .unwrap();
        let mut sizes = brute_sizes(costs, start, stages - 1);
        sizes.push(units - start);
        sizes
    }

    /// Checks `balanced_partition` against every possible cut: the bottleneck is the minimum,
    /// every leading group of stages is an optimal cut of its units, and the tie-break is the
    /// documented one.
    fn check_against_brute_force(costs: &[f64]) {
        let units = costs.len();
        for stages in 1..=units {
            let partition = balanced_partition(costs, stages).unwrap();
            check_structure(&partition, units, stages);
            let stage_costs = partition.stage_costs(costs);
            let got = max_of(&stage_costs);
            let best = brute_optimum(costs, units, stages);
            assert_eq!(
                got, best,
                "costs {costs:?}, {stages} stages: bottleneck {got} but brute force {best}"
            );
            for leading in 1..=stages {
                let end = partition.range(leading - 1).end;
                assert_eq!(
                    max_of(&stage_costs[..leading]),
                    brute_optimum(costs, end, leading),
                    "costs {costs:?}, {stages} stages: the first {leading} stages are not optimal"
                );
            }
            assert_eq!(
                partition.sizes(),
                brute_sizes(costs, units, stages),
                "costs {costs:?}, {stages} stages: tie-break"
            );
        }
    }

    #[test]
    fn optimal_against_brute_force_integer_costs() {
        let mut rng = Rng(0x5EED);
        for units in 1..=9 {
            for _ in 0..40 {
                // Small integers with many zeros and ties: exact sums, many equal optima.
                let costs: Vec<f64> = (0..units).map(|_| (rng.next() % 6) as f64).collect();
                check_against_brute_force(&costs);
            }
        }
    }

    #[test]
    fn optimal_against_brute_force_real_costs() {
        let mut rng = Rng(42);
        for units in 1..=9 {
            for _ in 0..40 {
                let costs: Vec<f64> = (0..units)
                    .map(|_| {
                        let x = rng.unit();
                        // Some zeros and a spread of magnitudes.
                        if x < 0.1 {
                            0.0
                        } else {
                            x * 10f64.powi((rng.next() % 7) as i32 - 3)
                        }
                    })
                    .collect();
                check_against_brute_force(&costs);
            }
        }
    }

    #[test]
    fn uniform_costs_split_evenly() {
        let partition = balanced_partition(&[1.0; 12], 4).unwrap();
        assert_eq!(partition.sizes(), vec![3, 3, 3, 3]);
        assert_eq!(partition.to_string(), "[0..3, 3..6, 6..9, 9..12]");
        // 10 units into 4 stages: bottleneck 3, the slack goes to the front, which is balanced
        // within itself.
        let partition = balanced_partition(&[1.0; 10], 4).unwrap();
        assert_eq!(partition.sizes(), vec![2, 2, 3, 3]);
        // All zero costs: the later stages take as many units as they can.
        let partition = balanced_partition(&[0.0; 7], 3).unwrap();
        assert_eq!(partition.sizes(), vec![1, 1, 5]);
        assert_eq!(partition.stage_costs(&[0.0; 7]), vec![0.0; 3]);
    }

    #[test]
    fn gpt_partition_isolates_heavy_head() {
        // GPT-2 small: the head costs about 4.5 blocks, so with 12 layers on 4 stages it gets a
        // stage of its own and the blocks split 4/4/4.
        let costs = unit_costs_gpt(12, 768, 1024, 50257);
        let partition = balanced_partition(&costs, 4).unwrap();
        assert_eq!(partition.sizes(), vec![5, 4, 4, 1]);
        assert_eq!(partition.stage_of(0), 0);
        assert_eq!(partition.stage_of(13), 3);
        let stage_costs = partition.stage_costs(&costs);
        assert_eq!(max_of(&stage_costs), costs[13]);

        // GPT-2 medium on 8 stages: the head (about 3.5 blocks) alone on the last stage, 4 blocks
        // on the stages before it, and 3 on the first ones.
        let costs = unit_costs_gpt(24, 1024, 1024, 50257);
        let partition = balanced_partition(&costs, 8).unwrap();
        assert_eq!(partition.sizes(), vec![4, 3, 3, 3, 4, 4, 4, 1]);
    }

    #[test]
    fn unit_costs_gpt_formulas() {
        // s = 4, h = 8, V = 16, two layers.
        let costs = unit_costs_gpt(2, 8, 4, 16);
        let block = 3.0 * (24.0 * 4.0 * 64.0 + 4.0 * 16.0 * 8.0);
        assert_eq!(block, 19_968.0);
        assert_eq!(costs, vec![64.0, 19_968.0, 19_968.0, 3072.0]);
        // No layers: embedding and head only.
        assert_eq!(unit_costs_gpt(0, 8, 4, 16).len(), 2);
    }

    #[test]
    fn more_stages_than_units_names_both_numbers() {
        let err = balanced_partition(&[1.0; 5], 7).unwrap_err();
        assert_eq!(
            err,
            PartitionError::MoreStagesThanUnits {
                stages: 7,
                units: 5
            }
        );
        let message = err.to_string();
        assert!(message.contains('5') && message.contains('7'), "{message}");
        assert_eq!(
            balanced_partition(&[], 1).unwrap_err(),
            PartitionError::MoreStagesThanUnits {
                stages: 1,
                units: 0
            }
        );
        assert_eq!(
            balanced_partition(&[1.0; 3], 0).unwrap_err(),
            PartitionError::ZeroStages
        );
    }

    #[test]
    fn bad_costs_are_rejected() {
        for (cost, unit) in [
            (-1.0, 2),
            (f64::NAN, 0),
            (f64::INFINITY, 3),
            (f64::NEG_INFINITY, 1),
        ] {
            let mut costs = vec![1.0; 4];
            costs[unit] = cost;
            match balanced_partition(&costs, 2).unwrap_err() {
                PartitionError::BadCost { unit: u, cost: c } => {
                    assert_eq!(u, unit);
                    assert!(c.to_bits() == cost.to_bits());
                }
                other => panic!("expected BadCost, got {other}"),
            }
        }
        let err = balanced_partition(&[f64::MAX, f64::MAX, 1.0], 2).unwrap_err();
        assert_eq!(err, PartitionError::CostOverflow { unit: 1 });
        // -0.0 is not negative.
        assert!(balanced_partition(&[-0.0, 1.0], 2).is_ok());
    }

    #[test]
    fn explicit_partitions_and_their_errors() {
        let partition = explicit_partition(&[2, 3, 1], 6).unwrap();
        check_structure(&partition, 6, 3);
        assert_eq!(partition.ranges(), &[0..2, 2..5, 5..6]);
        assert_eq!(
            partition.stage_costs(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            vec![3.0, 12.0, 6.0]
        );

        assert_eq!(
            explicit_partition(&[], 4).unwrap_err(),
            PartitionError::ZeroStages
        );
        let err = explicit_partition(&[2, 0, 2], 4).unwrap_err();
        assert_eq!(err, PartitionError::EmptyStage { stage: 1 });
        assert!(err.to_string().contains("stage 1"), "{err}");
        let err = explicit_partition(&[2, 3], 6).unwrap_err();
        assert_eq!(
            err,
            PartitionError::SizesDoNotSum {
                sizes: vec![2, 3],
                sum: 5,
                units: 6
            }
        );
        let message = err.to_string();
        assert!(message.contains("[2, 3]") && message.contains('5') && message.contains('6'));
        assert_eq!(
            explicit_partition(&[1, 1, 1], 2).unwrap_err(),
            PartitionError::MoreStagesThanUnits {
                stages: 3,
                units: 2
            }
        );
        let err = explicit_partition(&[usize::MAX, 2], 5).unwrap_err();
        assert!(matches!(
            err,
            PartitionError::SizesDoNotSum {
                sum: usize::MAX,
                ..
            }
        ));
    }

    #[test]
    fn large_partition_is_fast_and_optimal() {
        let mut rng = Rng(7);
        let costs: Vec<f64> = (0..2000).map(|_| 1.0 + 99.0 * rng.unit()).collect();
        let start = std::time::Instant::now();
        let partition = balanced_partition(&costs, 256).unwrap();
        let elapsed = start.elapsed();
        assert!(elapsed.as_secs_f64() < 1.0, "took {elapsed:?}");
        check_structure(&partition, 2000, 256);

        // Optimality: the bottleneck fits, and nothing one step below it does.
        let prefix = prefix_sums(&costs);
        let bottleneck = max_of(&partition.stage_costs(&costs));
        assert!(fits(&prefix, bottleneck, 256));
        assert!(!fits(
            &prefix,
            f64::from_bits(bottleneck.to_bits() - 1),
            256
        ));
        // At least the average stage cost and the largest unit.
        assert!(bottleneck >= prefix[2000] / 256.0 * (1.0 - 1e-12));
        assert!(bottleneck >= max_of(&costs));

        // Much larger inputs stay fast too.
        let costs: Vec<f64> = (0..20_000).map(|_| rng.unit()).collect();
        let start = std::time::Instant::now();
        let partition = balanced_partition(&costs, 1000).unwrap();
        assert!(
            start.elapsed().as_secs_f64() < 1.0,
            "took {:?}",
            start.elapsed()
        );
        check_structure(&partition, 20_000, 1000);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn stage_of_out_of_range_panics() {
        let partition = explicit_partition(&[1, 2], 3).unwrap();
        partition.stage_of(3);
    }

    #[test]
    fn json_round_trip_and_checked_reading() {
        let partition = explicit_partition(&[2, 3, 1], 6).unwrap();
        let text = serde_json::to_string(&partition).unwrap();
        let back: Partition = serde_json::from_str(&text).unwrap();
        assert_eq!(back, partition);
        let gap = r#"{"ranges":[{"start":0,"end":2},{"start":3,"end":6}]}"#;
        let err = serde_json::from_str::<Partition>(gap)
            .unwrap_err()
            .to_string();
        assert!(err.contains("stage 1 starts at unit 3"), "{err}");
        let empty = r#"{"ranges":[{"start":0,"end":2},{"start":2,"end":2}]}"#;
        let err = serde_json::from_str::<Partition>(empty)
            .unwrap_err()
            .to_string();
        assert!(err.contains("stage 1 has 0 units"), "{err}");
        assert!(serde_json::from_str::<Partition>(r#"{"ranges":[]}"#).is_err());
    }
}
