//! Samples of any shape: a micro-batch is a set of named fields (float or integer tensors of
//! any rank, several of them: images, token ids, labels, masks, position ids), read by global
//! sample index so that every layout sees the same samples, and handed to **every** unit of
//! the model (the first unit reads its inputs, the last its targets, every block its side
//! inputs such as an attention mask). Each pipeline rank reads the fields of its micro-batches
//! itself, so side inputs cost no pipeline message.
//!
//! A token language model's samples are the fields [`TOKENS`] and [`TARGETS`]
//! ([`Windows::into_samples`](crate::train::Windows::into_samples)).

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Shape, Tensor, TensorData};

/// The field of a token model's input ids, `[seq]` per sample.
pub const TOKENS: &str = "tokens";
/// The field of a token model's target ids, `[seq]` per sample (negative: not counted).
pub const TARGETS: &str = "targets";
/// The field of each token's position (within its document under a document mask), `[seq]`
/// per sample ([`DocumentMasked`](crate::data::DocumentMasked)).
pub const POSITIONS: &str = "positions";
/// The field of each token's document index within its sequence, `[seq]` per sample: a token
/// attends only to tokens of the same document ([`DocumentMasked`](crate::data::DocumentMasked)).
pub const SEGMENTS: &str = "segments";

/// The values of one field, sample after sample.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// Floating-point values (images, features, regression targets, float masks).
    Float(Vec<f32>),
    /// Integer values (token ids, class labels, position or segment ids).
    Int(Vec<i64>),
}

impl Values {
    /// How many values there are.
    pub fn len(&self) -> usize {
        match self {
            Values::Float(v) => v.len(),
            Values::Int(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `"float"` or `"int"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Values::Float(_) => "float",
            Values::Int(_) => "int",
        }
    }
}

/// One named field of every sample: its shape per sample and its values, sample after sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    /// The shape of one sample's value (`[]` for a scalar such as a class label).
    pub shape: Vec<usize>,
    /// The values of all samples, row-major.
    pub values: Values,
}

/// A field that does not hold what a [`Samples`] or a [`Batch`] needs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// The field's values do not fill `count` samples of its shape.
    #[error("field `{field}`: {values} values, but {count} samples of shape {shape:?} need {want}")]
    Length {
        /// The field.
        field: String,
        /// Values given.
        values: usize,
        /// Samples.
        count: usize,
        /// Shape per sample.
        shape: Vec<usize>,
        /// Values needed.
        want: usize,
    },
    /// A unit asked for a field the samples do not have.
    #[error("no field `{field}` in the samples (they have: {have})")]
    Missing {
        /// The field asked for.
        field: String,
        /// The fields there are, comma-separated.
        have: String,
    },
    /// A unit asked for a field as another kind or rank than it has.
    #[error("field `{field}` is {kind} of shape {shape:?} per sample, asked for as {asked}")]
    Kind {
        /// The field.
        field: String,
        /// Its kind (`float` or `int`).
        kind: &'static str,
        /// Its shape per sample.
        shape: Vec<usize>,
        /// What was asked for (for example `int tensor of rank 2`).
        asked: String,
    },
    /// Two parts of one batch do not have the same fields, kinds and shapes.
    #[error("samples {first} on have {got}, but the samples before them have {want}")]
    Layout {
        /// The first sample of the part that differs.
        first: usize,
        /// Its fields.
        got: String,
        /// The fields of the samples before it.
        want: String,
    },
}

/// `count` samples as named fields, and how many loss terms they hold: the count by which
/// the last unit's summed loss is divided (targets that count for a token model, samples for
/// a classifier, masked positions for a masked language model). The trainer divides each
/// micro-batch's loss sum by the global batch's loss terms, so every layout computes the mean
/// one process computes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples {
    /// How many samples.
    pub count: usize,
    /// The fields by name.
    pub fields: BTreeMap<String, Field>,
    /// The loss terms these samples hold.
    pub loss_terms: usize,
}

impl Samples {
    /// `count` samples without fields, holding `count` loss terms (one per sample; change it
    /// with [`with_loss_terms`](Self::with_loss_terms)).
    pub fn new(count: usize) -> Self {
        Self {
            count,
            fields: BTreeMap::new(),
            loss_terms: count,
        }
    }

    /// Adds the integer field `name`, `shape` per sample. Fails when `values` do not fill the
    /// samples.
    pub fn with_int(
        self,
        name: &str,
        shape: &[usize],
        values: Vec<i64>,
    ) -> Result<Self, BatchError> {
        self.with_field(name, shape, Values::Int(values))
    }

    /// Adds the float field `name`, `shape` per sample. Fails when `values` do not fill the
    /// samples.
    pub fn with_float(
        self,
        name: &str,
        shape: &[usize],
        values: Vec<f32>,
    ) -> Result<Self, BatchError> {
        self.with_field(name, shape, Values::Float(values))
    }

    /// Sets the number of loss terms.
    pub fn with_loss_terms(mut self, terms: usize) -> Self {
        self.loss_terms = terms;
        self
    }

    fn with_field(
        mut self,
        name: &str,
        shape: &[usize],
        values: Values,
    ) -> Result<Self, BatchError> {
        let want = self.count * shape.iter().product::<usize>();
        if values.len() != want {
            return Err(BatchError::Length {
                field: name.into(),
                values: values.len(),
                count: self.count,
                shape: shape.to_vec(),
                want,
            });
        }
        let field = Field {
            shape: shape.to_vec(),
            values,
        };
        self.fields.insert(name.into(), field);
        Ok(self)
    }

    /// Checks that every field fills the samples (for samples built field by field).
    pub fn check(&self) -> Result<(), BatchError> {
        for (name, f) in &self.fields {
            let want = self.count * f.shape.iter().product::<usize>();
            if f.values.len() != want {
                return Err(BatchError::Length {
                    field: name.clone(),
                    values: f.values.len(),
                    count: self.count,
                    shape: f.shape.clone(),
                    want,
                });
            }
        }
        Ok(())
    }

    /// The fields, kinds and shapes, as one line (`images: float [8, 8]; labels: int []`).
    pub fn layout(&self) -> String {
        let fields: Vec<String> = (self.fields.iter())
            .map(|(n, f)| format!("{n}: {} {:?}", f.values.kind(), f.shape))
            .collect();
        match fields.is_empty() {
            true => "no fields".into(),
            false => fields.join("; "),
        }
    }

    /// Fails, naming both, when `other` (samples from `first` on) has other fields, kinds or
    /// shapes than these: every micro-batch of a run must look alike.
    pub fn check_same_layout(&self, other: &Samples, first: usize) -> Result<(), BatchError> {
        let alike = |(a, f): (&String, &Field), (b, g): (&String, &Field)| {
            a == b && f.shape == g.shape && f.values.kind() == g.values.kind()
        };
        let same = self.fields.len() == other.fields.len()
            && self
                .fields
                .iter()
                .zip(&other.fields)
                .all(|(x, y)| alike(x, y));
        match same {
            true => Ok(()),
            false => Err(BatchError::Layout {
                first,
                got: other.layout(),
                want: self.layout(),
            }),
        }
    }

    fn field(&self, name: &str) -> Result<&Field, BatchError> {
        self.fields.get(name).ok_or_else(|| BatchError::Missing {
            field: name.into(),
            have: self.fields.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// The integer values of `name` (for counting or checking targets).
    pub fn ints(&self, name: &str) -> Result<&[i64], BatchError> {
        let f = self.field(name)?;
        match &f.values {
            Values::Int(v) => Ok(v),
            Values::Float(_) => Err(kind_error(name, f, "int values".into())),
        }
    }
}

fn kind_error(name: &str, f: &Field, asked: String) -> BatchError {
    BatchError::Kind {
        field: name.into(),
        kind: f.values.kind(),
        shape: f.shape.clone(),
        asked,
    }
}

/// Where a forward pass stands in training, which keys its dropout masks: the step, the global
/// index of the micro-batch's first sample, and whether dropout is on even without autodiff.
/// The masks depend neither on the layout (dp, micro-batching) nor on history: a resumed run
/// and a recomputed forward pass draw the same ones
/// ([`ReplicatedDropout`](crate::tensor_parallel::ReplicatedDropout)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropoutPosition {
    /// The 0-based training step.
    pub step: u64,
    /// The global index of the micro-batch's first sample in the step.
    pub first_sample: u64,
    /// Dropout on also on a backend without autodiff: a forward pass run without its graph
    /// and recomputed with it later must drop the same elements both times. Off by default
    /// (then dropout is on exactly when the backend records gradients).
    pub forced: bool,
}

/// A micro-batch's [`Samples`] as tensors on a device, each made when a unit asks for it:
/// `[batch, ..shape]` for a field of `shape` per sample, and the pass's [`DropoutPosition`].
#[derive(Clone, Debug)]
pub struct Batch<'a, B: Backend> {
    samples: &'a Samples,
    device: B::Device,
    dropout: DropoutPosition,
    tied_table: Option<Tensor<B, 2>>,
}

impl<'a, B: Backend> Batch<'a, B> {
    /// The fields of `samples` on `device`.
    pub fn new(samples: &'a Samples, device: &B::Device) -> Self {
        Self {
            samples,
            device: device.clone(),
            dropout: DropoutPosition::default(),
            tied_table: None,
        }
    }

    /// The same batch handing the last unit the first unit's token `table` (a tied head's:
    /// [`tied_table`](Self::tied_table)).
    pub fn with_tied_table(mut self, table: Option<Tensor<B, 2>>) -> Self {
        self.tied_table = table;
        self
    }

    /// The first unit's token table (`[vocab, hidden]`,
    /// [`EmbedUnit::table`](crate::parallelize::EmbedUnit::table)) for a head tied to it
    /// ([`UnitModel::tie_embeddings`](crate::entry::UnitModel::tie_embeddings)): in the last
    /// unit, on its rank (the embedding's table or the copy the last pipeline stage keeps).
    /// `None` for an untied head and in the other units.
    pub fn tied_table(&self) -> Option<Tensor<B, 2>> {
        self.tied_table.clone()
    }

    /// The batch of a training pass at `position` (the executor's; without it, step 0 and
    /// sample 0).
    pub fn at(mut self, position: DropoutPosition) -> Self {
        self.dropout = position;
        self
    }

    /// Where the pass stands, for the dropout layers of the units.
    pub fn dropout(&self) -> &DropoutPosition {
        &self.dropout
    }

    /// Samples in the micro-batch.
    pub fn size(&self) -> usize {
        self.samples.count
    }

    /// The samples themselves.
    pub fn samples(&self) -> &'a Samples {
        self.samples
    }

    /// The loss terms of the micro-batch ([`Samples::loss_terms`]).
    pub fn loss_terms(&self) -> usize {
        self.samples.loss_terms
    }

    /// The device the tensors are made on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Whether the samples have the field `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.fields.contains_key(name)
    }

    /// The integer field `name` as `[batch, ..shape]` (`D` is one more than the rank of the
    /// field's shape per sample), or an error naming the field and what it is.
    pub fn try_int<const D: usize>(&self, name: &str) -> Result<Tensor<B, D, Int>, BatchError> {
        let f = self.samples.field(name)?;
        match &f.values {
            Values::Int(v) if f.shape.len() + 1 == D => Ok(Tensor::from_data(
                TensorData::new(v.clone(), self.shape(f)),
                &self.device,
            )),
            _ => Err(kind_error(name, f, format!("int tensor of rank {D}"))),
        }
    }

    /// The float field `name` as `[batch, ..shape]` (`D` is one more than the rank of the
    /// field's shape per sample), or an error naming the field and what it is.
    pub fn try_float<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, BatchError> {
        let f = self.samples.field(name)?;
        match &f.values {
            Values::Float(v) if f.shape.len() + 1 == D => Ok(Tensor::from_data(
                TensorData::new(v.clone(), self.shape(f)),
                &self.device,
            )),
            _ => Err(kind_error(name, f, format!("float tensor of rank {D}"))),
        }
    }

    /// [`try_int`](Self::try_int) for a unit's forward pass. [`merak_burn::run`](crate::run)
    /// runs every unit once on a sample micro-batch before training and turns a panic there
    /// into an error naming the unit, so a missing or mistyped field is reported before
    /// anything trains.
    ///
    /// # Panics
    /// When the field is missing or of another kind or rank (the message names it).
    pub fn int<const D: usize>(&self, name: &str) -> Tensor<B, D, Int> {
        self.try_int(name).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`try_float`](Self::try_float) for a unit's forward pass (see [`int`](Self::int)).
    ///
    /// # Panics
    /// When the field is missing or of another kind or rank (the message names it).
    pub fn float<const D: usize>(&self, name: &str) -> Tensor<B, D> {
        self.try_float(name).unwrap_or_else(|e| panic!("{e}"))
    }

    fn shape(&self, f: &Field) -> Shape {
        let mut dims = vec![self.samples.count];
        dims.extend(&f.shape);
        Shape::from(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    #[test]
    fn fields_become_tensors_of_their_shape_and_bad_ones_are_named() {
        let s = Samples::new(2)
            .with_float("image", &[2, 3], (0..12).map(|v| v as f32).collect())
            .and_then(|s| s.with_int("label", &[], vec![4, 7]))
            .map(|s| s.with_loss_terms(2))
            .expect("fields fill the samples");
        let device = Default::default();
        let b = Batch::<Cpu>::new(&s, &device);
        assert_eq!(b.float::<3>("image").dims(), [2, 2, 3]);
        let labels: Vec<i64> = b
            .int::<1>("label")
            .into_data()
            .convert::<i64>()
            .to_vec()
            .expect("ints");
        assert_eq!(labels, vec![4, 7]);
        assert!(matches!(
            b.try_int::<2>("image"),
            Err(BatchError::Kind { .. })
        ));
        assert!(matches!(
            b.try_float::<2>("image"),
            Err(BatchError::Kind { .. })
        ));
        let missing = b.try_float::<2>("mask").expect_err("no mask");
        assert!(missing.to_string().contains("image, label"), "{missing}");
        let short = Samples::new(3).with_int("label", &[], vec![1, 2]);
        assert!(matches!(short, Err(BatchError::Length { want: 3, .. })));
        let other = Samples::new(2)
            .with_int("label", &[1], vec![1, 2])
            .expect("fills");
        let err = s.check_same_layout(&other, 4).expect_err("other layout");
        assert!(err.to_string().contains("samples 4 on"), "{err}");
        assert_eq!(s.layout(), "image: float [2, 3]; label: int []");
    }
}
