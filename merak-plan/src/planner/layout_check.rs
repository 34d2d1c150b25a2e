//! The range and consistency checks of a planned [`Layout`] that comes from outside the search
//! (a plan file, `merak simulate --layout`): every field checked as `merak train` checks the
//! `parallel.*` key it sets, each error naming the field as the caller names it.

use thiserror::Error;

use super::cost::Layout;
use super::model::{ModelProxy, RecomputeMode};
use crate::data_parallel::{HybridSharding, ReduceScatter};
use crate::pipeline::ScheduleKind;

/// A layout field out of range, or inconsistent with another field or with the model. `key`
/// is the field as the caller names it (`plan.layout.zero` in a plan file, `zero` in
/// `merak simulate --layout`); the reason names the other fields the same way.
#[derive(Clone, Debug, Error, PartialEq)]
#[error("{key} = {value}: {reason}")]
pub struct LayoutFieldError {
    /// The field, as the caller names it.
    pub key: String,
    /// Its value.
    pub value: String,
    /// What is wrong, with the numbers.
    pub reason: String,
}

/// Names a [`Layout`] field (its serde name, e.g. `virtual_stages`) for messages.
pub type FieldNames<'a> = &'a dyn Fn(&'static str) -> String;

/// The checks of one layout against its model, with the caller's field names.
struct Check<'a> {
    layout: &'a Layout,
    model: &'a ModelProxy,
    name: FieldNames<'a>,
}

impl Check<'_> {
    /// The error of `field` (holding `value`) for `reason`.
    fn bad(&self, field: &'static str, value: impl ToString, reason: String) -> LayoutFieldError {
        LayoutFieldError {
            key: (self.name)(field),
            value: value.to_string(),
            reason,
        }
    }

    /// Every degree and count at least 1; the products of the degrees fit a `usize`; tensor
    /// parallelism divides the heads; at most as many stages as units.
    fn degrees(&self) -> Result<(), LayoutFieldError> {
        let l = self.layout;
        for (field, v) in [
            ("dp", l.dp),
            ("tp", l.tp),
            ("cp", l.cp),
            ("ep", l.ep),
            ("pp", l.pp),
            ("virtual_stages", l.virtual_stages),
            ("micro_batch", l.micro_batch),
            ("micro_batches", l.micro_batches),
            ("tp_overlap", l.tp_overlap),
        ] {
            if v == 0 {
                return Err(self.bad(field, 0, "must be at least 1".into()));
            }
        }
        let n = self.name;
        let product =
            |factors: &[usize]| (factors.iter()).try_fold(1usize, |a, &f| a.checked_mul(f));
        if product(&[l.dp, l.cp, l.tp, l.pp]).is_none() {
            let what = format!("{} x {} x {} x {}", n("dp"), n("cp"), n("tp"), n("pp"));
            return Err(self.bad("dp", l.dp, format!("{what} overflows")));
        }
        if product(&[l.dp, l.micro_batch, l.micro_batches]).is_none() {
            let what = format!(
                "{} x {} x {}",
                n("dp"),
                n("micro_batch"),
                n("micro_batches")
            );
            return Err(self.bad(
                "micro_batches",
                l.micro_batches,
                format!("{what} overflows"),
            ));
        }
        let seq = self.model.seq().unwrap_or(1);
        if product(&[l.micro_batch, seq]).is_none() {
            let what = format!("{} x the sequence length {seq}", n("micro_batch"));
            return Err(self.bad("micro_batch", l.micro_batch, format!("{what} overflows")));
        }
        if !self.model.heads.is_multiple_of(l.tp) {
            let heads = self.model.heads;
            return Err(self.bad(
                "tp",
                l.tp,
                format!("does not divide the model's {heads} heads"),
            ));
        }
        let units = self.model.num_units();
        if product(&[l.pp, l.virtual_stages]).is_none_or(|stages| stages > units) {
            return Err(self.bad(
                "virtual_stages",
                l.virtual_stages,
                format!(
                    "{} = {} x {} stages are more than the model's {units} units (layers + \
                     embedding + head)",
                    n("pp"),
                    l.pp,
                    l.virtual_stages
                ),
            ));
        }
        Ok(())
    }

    /// The ZeRO stage, its hybrid shard group and when it reduce-scatters.
    fn zero(&self) -> Result<(), LayoutFieldError> {
        let (l, n) = (self.layout, self.name);
        if l.zero > 3 {
            let reason = "not a supported ZeRO stage (0, 1, 2 or 3)".into();
            return Err(self.bad("zero", l.zero, reason));
        }
        let hybrid = HybridSharding {
            dp: l.dp,
            cp: l.cp,
            ep: l.ep,
            zero: l.zero,
            shard: l.shard,
        };
        if let Some(reason) = hybrid.problem(n) {
            return Err(self.bad("shard", l.shard, reason));
        }
        if l.reduce_scatter == ReduceScatter::MicroBatch && l.zero < 2 {
            let reason = format!(
                "needs {} = 2 or 3 (it is {}): stages 0 and 1 reduce whole gradients",
                n("zero"),
                l.zero
            );
            return Err(self.bad("reduce_scatter", l.reduce_scatter, reason));
        }
        if !l.reshard_after_forward && l.zero != 3 {
            let reason = format!("only {} = 3 shards the parameters", n("zero"));
            return Err(self.bad("reshard_after_forward", "false", reason));
        }
        if l.zero == 3 {
            let recomputes = l.reshard_after_forward;
            let partial = l.recompute.iter().find(|&&m| m != RecomputeMode::Full);
            if let Some(mode) = partial.filter(|_| recomputes) {
                let reason = format!(
                    "{} = 3 recomputes every unit: every stage must be \"full\" (one is \"{}\")",
                    n("zero"),
                    mode.as_str()
                );
                return Err(self.bad("recompute", recompute_list(&l.recompute), reason));
            }
            let splits = l.schedule.splits_backward() && recomputes;
            if l.schedule == ScheduleKind::TwoBw || splits {
                let reason = format!(
                    "{} = 3 runs a unit's whole backward pass on its gathered parameters \
                     (unless {} is off) and keeps one weight version: use gpipe, 1f1b, \
                     interleaved or shifted-critical-path",
                    n("zero"),
                    n("reshard_after_forward")
                );
                return Err(self.bad("schedule", l.schedule, reason));
            }
        }
        Ok(())
    }

    /// The virtual stages the schedule runs, and the recomputation list and partition
    /// covering the stages.
    fn pipeline(&self) -> Result<(), LayoutFieldError> {
        let (l, n) = (self.layout, self.name);
        let (v, schedule) = (l.virtual_stages, l.schedule);
        let reason = if schedule.v_shaped() && v != 2 {
            Some(format!(
                "{} = \"{schedule}\" runs 2 stages per rank",
                n("schedule")
            ))
        } else if schedule == ScheduleKind::Interleaved && v < 2 {
            Some(format!(
                "{} = \"{schedule}\" needs at least 2",
                n("schedule")
            ))
        } else if !schedule.uses_virtual_stages() && v != 1 {
            Some(format!(
                "{v} stages per rank need {} = \"interleaved\", \"zb-v\" or \"dualpipev\" (it is \"{schedule}\")",
                n("schedule")
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(self.bad("virtual_stages", v, reason));
        }
        if schedule == ScheduleKind::Interleaved && !l.micro_batches.is_multiple_of(l.pp) {
            let reason = format!(
                "{} = \"interleaved\" needs a multiple of {} = {}",
                n("schedule"),
                n("pp"),
                l.pp
            );
            return Err(self.bad("micro_batches", l.micro_batches, reason));
        }
        let needed = schedule.min_micro_batches(l.pp);
        if l.micro_batches < needed {
            let reason = format!(
                "{} = \"{schedule}\" needs at least 2 per pipeline rank: {needed} for {} = {}",
                n("schedule"),
                n("pp"),
                l.pp
            );
            return Err(self.bad("micro_batches", l.micro_batches, reason));
        }
        let stages = l.pp * v;
        let what = format!("{} x {} = {stages} stages", n("pp"), n("virtual_stages"));
        if l.recompute.len() != stages {
            let reason = format!("{} entries for {what}", l.recompute.len());
            return Err(self.bad("recompute", recompute_list(&l.recompute), reason));
        }
        let units = self.model.num_units();
        if l.partition.stages() != stages || l.partition.units() != units {
            let reason = format!(
                "{} stages over {} units, for {what} over the model's {units} units",
                l.partition.stages(),
                l.partition.units()
            );
            return Err(self.bad("partition", format!("{:?}", l.partition.sizes()), reason));
        }
        Ok(())
    }

    /// Context parallelism's zigzag and sequence parallelism cut the model's sequence.
    fn sequence(&self) -> Result<(), LayoutFieldError> {
        let (l, n) = (self.layout, self.name);
        let seq = self.model.seq();
        if l.cp > 1 {
            let Some(seq) = seq else {
                let reason = "needs the model's sequence length; this model has no transformer \
                              shape"
                    .into();
                return Err(self.bad("cp", l.cp, reason));
            };
            let chunks = l.cp.saturating_mul(2);
            if !seq.is_multiple_of(chunks) {
                let reason = format!(
                    "2 x {} = {chunks} does not divide the model's sequence length {seq} (each \
                     rank of the ring holds two zigzag chunks)",
                    n("cp"),
                );
                return Err(self.bad("cp", l.cp, reason));
            }
        }
        if l.sequence_parallel {
            if l.tp < 2 {
                let reason = format!("needs {} > 1 (it is {})", n("tp"), l.tp);
                return Err(self.bad("sequence_parallel", true, reason));
            }
            let Some(seq) = seq else {
                let reason = "needs the model's sequence length; this model has no \
                              transformer shape"
                    .into();
                return Err(self.bad("sequence_parallel", true, reason));
            };
            if !(seq / l.cp).is_multiple_of(l.tp) {
                let reason = format!(
                    "{} = {} does not divide the {} tokens of a sequence a rank holds (sequence \
                     length {seq} / {} = {})",
                    n("tp"),
                    l.tp,
                    seq / l.cp,
                    n("cp"),
                    l.cp
                );
                return Err(self.bad("sequence_parallel", true, reason));
            }
        }
        Ok(())
    }

    /// Sub-pipelined tensor parallelism: only with tensor parallelism, dividing the tokens of
    /// a micro-batch on a rank.
    fn overlap(&self) -> Result<(), LayoutFieldError> {
        let (l, n) = (self.layout, self.name);
        let k = l.tp_overlap;
        if k > 1 && l.tp == 1 {
            let reason = format!(
                "splits the tensor-parallel blocks' all-reduces; it needs {} > 1 (it is 1)",
                n("tp")
            );
            return Err(self.bad("tp_overlap", k, reason));
        }
        if let Err(tokens) = self.model.splits_tokens_on(l.micro_batch, k, l.split()) {
            let reason = format!("does not divide the {tokens} tokens of a micro-batch on a rank");
            return Err(self.bad("tp_overlap", k, reason));
        }
        Ok(())
    }

    /// Expert parallelism: only for a mixture of experts, dividing its experts and the ranks
    /// holding the same parameters; a mixture of experts under tensor parallelism only with
    /// sequence parallelism.
    fn experts(&self) -> Result<(), LayoutFieldError> {
        let (l, n) = (self.layout, self.name);
        let Some(experts) = self.model.experts() else {
            if l.ep > 1 {
                let reason = "needs a mixture of experts; this model is dense".into();
                return Err(self.bad("ep", l.ep, reason));
            }
            return Ok(());
        };
        if !experts.is_multiple_of(l.ep) {
            let reason = format!("does not divide the model's {experts} experts");
            return Err(self.bad("ep", l.ep, reason));
        }
        if !l.replicas().is_multiple_of(l.ep) {
            let reason = format!(
                "does not divide {} x {} = {} x {} = {} (the expert-parallel groups are made of \
                 data-parallel ranks)",
                n("dp"),
                n("cp"),
                l.dp,
                l.cp,
                l.replicas()
            );
            return Err(self.bad("ep", l.ep, reason));
        }
        if l.tp > 1 && !l.sequence_parallel {
            let reason = format!(
                "a mixture of experts at {} = {} needs sequence parallelism (each tensor-parallel \
                 rank routes its own positions)",
                n("tp"),
                l.tp
            );
            return Err(self.bad("sequence_parallel", false, reason));
        }
        Ok(())
    }
}

/// `["full", "none"]`: a recomputation list as a plan file writes it.
fn recompute_list(modes: &[RecomputeMode]) -> String {
    let names: Vec<String> = modes.iter().map(|m| format!("{:?}", m.as_str())).collect();
    format!("[{}]", names.join(", "))
}

impl Layout {
    /// Checks every field of this layout against the others and against `model`, as
    /// `merak train` checks the `parallel.*` key each sets: the degrees and counts at least 1
    /// (their products within range, tp dividing the heads, at most one stage per unit), the
    /// ZeRO stage 0 to 3 (a hybrid shard group dividing dp under a ZeRO stage, reduce-scattering
    /// every micro-batch only under stages 2 and 3, stage 3 with full recomputation and a
    /// schedule it runs), the virtual stages the schedule runs, one recomputation mode and one
    /// partition range per stage, context and sequence parallelism cutting the sequence,
    /// sub-pipelining only with tensor parallelism and dividing a rank's tokens, and expert
    /// parallelism only for a mixture of experts, dividing its experts and dp x cp. `name`
    /// names a field (its serde name) in messages.
    ///
    /// # Errors
    ///
    /// [`LayoutFieldError`] naming the first field at fault, its value and the numbers.
    pub fn check_fields(
        &self,
        model: &ModelProxy,
        name: FieldNames<'_>,
    ) -> Result<(), LayoutFieldError> {
        let check = Check {
            layout: self,
            model,
            name,
        };
        check.degrees()?;
        check.zero()?;
        check.pipeline()?;
        check.sequence()?;
        check.overlap()?;
        check.experts()
    }
}
