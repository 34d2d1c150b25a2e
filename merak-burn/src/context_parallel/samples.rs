//! A context-parallel rank's share of a micro-batch's samples.

use crate::batch::{Field, POSITIONS, Samples, TARGETS, Values};

use super::ZigZag;

/// The samples cannot be cut into context-parallel shares.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The zigzag cut failed (a field's length).
    #[error(transparent)]
    ZigZag(#[from] super::ZigZagError),
    /// The samples have no targets to count the rank's loss terms by.
    #[error(
        "context parallelism needs the `{TARGETS}` field to count each rank's loss terms; the \
         samples have: {0}"
    )]
    NoTargets(String),
}

/// This rank's share of every sequence of `samples` (sequences of `zigzag.seq()` tokens): each
/// field whose per-sample shape starts with the sequence length keeps the positions of the
/// zigzag shard (other fields stay whole); [`POSITIONS`] is added with each token's place in
/// its whole sequence when the samples do not carry positions already (under a document mask
/// they do, and are cut like the other fields); the loss terms are this rank's counted
/// (non-negative) targets, so that the terms of the cp ranks add up to the sequences'.
pub fn shard_samples(samples: Samples, zigzag: &ZigZag) -> Result<Samples, ShardError> {
    let seq = zigzag.seq();
    let mut out = Samples {
        count: samples.count,
        fields: Default::default(),
        loss_terms: 0,
    };
    for (name, field) in samples.fields {
        let field = match field.shape.first() {
            Some(&n) if n == seq => shard_field(field, zigzag)?,
            _ => field,
        };
        out.fields.insert(name, field);
    }
    if !out.fields.contains_key(POSITIONS) {
        let held: Vec<i64> = zigzag.positions().into_iter().map(|p| p as i64).collect();
        let field = Field {
            shape: vec![held.len()],
            values: Values::Int(held.repeat(out.count)),
        };
        out.fields.insert(POSITIONS.into(), field);
    }
    let targets = out
        .ints(TARGETS)
        .map_err(|_| ShardError::NoTargets(out.layout()))?;
    out.loss_terms = targets.iter().filter(|&&t| t >= 0).count();
    Ok(out)
}

/// `field` (`[seq, ...]` per sample) cut to the zigzag shard's positions.
fn shard_field(field: Field, zigzag: &ZigZag) -> Result<Field, ShardError> {
    let width = field.shape[1..].iter().product::<usize>();
    let values = match field.values {
        Values::Int(v) => Values::Int(zigzag.shard(&v, width)?),
        Values::Float(v) => Values::Float(zigzag.shard(&v, width)?),
    };
    let mut shape = field.shape;
    shape[0] = zigzag.local_len();
    Ok(Field { shape, values })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two samples of 8 tokens at cp = 2: rank 1 holds chunks 1 and 2 (positions 2, 3, 4, 5)
    /// of every field of the sequence's length, gets those positions, and counts its own
    /// targets; a per-sample label stays whole.
    #[test]
    fn a_rank_keeps_its_zigzag_positions_of_every_sequence_field() {
        let tokens: Vec<i64> = (0..16).collect();
        let targets: Vec<i64> = (0..16).map(|t| if t % 3 == 0 { -1 } else { t }).collect();
        let samples = Samples::new(2)
            .with_int(crate::batch::TOKENS, &[8], tokens)
            .and_then(|s| s.with_int(TARGETS, &[8], targets))
            .and_then(|s| s.with_int("label", &[], vec![7, 9]))
            .expect("fields fill the samples");
        let zigzag = ZigZag::new(8, 2, 1).expect("2 x 2 divides 8");
        let shard = shard_samples(samples, &zigzag).expect("a shard");
        assert_eq!(
            shard.ints(crate::batch::TOKENS).unwrap(),
            [2, 3, 4, 5, 10, 11, 12, 13]
        );
        assert_eq!(shard.ints(POSITIONS).unwrap(), [2, 3, 4, 5, 2, 3, 4, 5]);
        assert_eq!(shard.ints("label").unwrap(), [7, 9]);
        // Targets 3 and 12 are not counted.
        assert_eq!(shard.loss_terms, 6);
        let no_targets = Samples::new(1).with_int("x", &[8], vec![0; 8]).unwrap();
        let e = shard_samples(no_targets, &zigzag).unwrap_err();
        assert!(e.to_string().contains("`targets`"), "{e}");
    }
}
