//! The model, a small pre-LayerNorm vision transformer: nothing in it knows about parallelism
//! but the type of the linear layers tensor parallelism splits.

use burn::module::{Initializer, Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig, LinearConfig};
use burn::tensor::activation::{gelu, log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use merak_burn::prelude::*;

use crate::config::{GRID, IMAGE, PATCH, PATCHES, PIXEL_MEAN, PIXEL_STD, POSITIONS, VitConfig};
use crate::source::{IMAGE_FIELD, KEEP_FIELD, LABEL_FIELD};

/// How far below the others a dropped position's attention score is put.
const DROPPED_SCORE: f64 = 1e4;

/// The standard deviation of the initial position embeddings: comparable to the patch
/// projection's outputs, so that the blocks tell the patches apart from the first step (at
/// ViT's usual 0.02 the loss stays near its initial value for 50 to 100 steps here).
pub const POS_STD: f64 = 0.5;

/// The first unit: images to the class token and one token per patch, with learned position
/// embeddings.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    /// A [`PATCH`] x [`PATCH`] patch's pixels to the hidden width.
    pub patch: burn::nn::Linear<B>,
    /// The class token, `[hidden]`.
    pub cls: Param<Tensor<B, 1>>,
    /// The position embeddings, `[positions, hidden]` (the class token's first).
    pub pos: Param<Tensor<B, 2>>,
}

/// Multi-head self-attention over the positions a sample keeps ([`KEEP_FIELD`]).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection.
    pub wq: Linear<B>,
    /// Key projection, without bias: a key bias adds the same score to every key a query
    /// sees, which the softmax ignores (its gradient is zero up to rounding, which Adam would
    /// amplify into steps).
    pub wk: Linear<B>,
    /// Value projection.
    pub wv: Linear<B>,
    /// Output projection.
    pub wo: Linear<B>,
    /// Width of one head.
    #[module(skip)]
    head_dim: usize,
    /// Heads of the whole model.
    #[module(skip)]
    heads: usize,
}

/// The MLP: `fc2(gelu(fc1 x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Expansion.
    pub fc1: Linear<B>,
    /// Projection back to the hidden width.
    pub fc2: Linear<B>,
}

/// A pre-LayerNorm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub attn_norm: LayerNorm<B>,
    /// Attention.
    pub attn: Attention<B>,
    /// Norm before the MLP.
    pub mlp_norm: LayerNorm<B>,
    /// MLP.
    pub mlp: Mlp<B>,
}

/// The last unit: the class token's final norm, its class scores and the loss.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    /// The final norm.
    pub norm: LayerNorm<B>,
    /// The class token's state to class scores.
    pub classifier: burn::nn::Linear<B>,
}

/// A linear layer that tensor parallelism may split, `[i, o]`, with or without bias.
fn linear<B: Backend>(i: usize, o: usize, bias: bool, device: &B::Device) -> Linear<B> {
    Linear::from(LinearConfig::new(i, o).with_bias(bias).init(device))
}

/// Panics with the problem of an invalid `c`.
fn check(c: &VitConfig) {
    if let Err(e) = c.validate() {
        panic!("{e}");
    }
}

impl<B: Backend> Embed<B> {
    /// The patch projection (Burn's initializer), the class token (normal, standard deviation
    /// 0.02) and the position embeddings (normal, standard deviation [`POS_STD`]) of a model of
    /// shape `c`.
    pub fn new(c: &VitConfig, device: &B::Device) -> Self {
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Self {
            patch: LinearConfig::new(PATCH * PATCH, c.hidden).init(device),
            cls: normal.init([c.hidden], device),
            pos: Initializer::Normal {
                mean: 0.0,
                std: POS_STD,
            }
            .init([POSITIONS, c.hidden], device),
        }
    }

    /// Images `[batch, 8, 8]` (pixels in `[0, 1]`) to `[batch, 17, hidden]`: the pixels
    /// standardized ([`PIXEL_MEAN`], [`PIXEL_STD`]; the digits' pixels are small and mostly
    /// zero, which leaves the image a weak signal next to the position embeddings and slows
    /// the start of training), cut into patches and projected, after the class token.
    pub fn forward(&self, images: Tensor<B, 3>) -> Tensor<B, 3> {
        let b = images.dims()[0];
        let patches = ((images - PIXEL_MEAN) / PIXEL_STD)
            .reshape([b, GRID, PATCH, GRID, PATCH])
            .swap_dims(2, 3)
            .reshape([b, PATCHES, PATCH * PATCH]);
        let x = self.patch.forward(patches);
        let hidden = x.dims()[2];
        let cls = self.cls.val().reshape([1, 1, hidden]).repeat_dim(0, b);
        Tensor::cat(vec![cls, x], 1) + self.pos.val().unsqueeze::<3>()
    }
}

impl<B: Backend> Block<B> {
    /// A block of shape `c`.
    ///
    /// # Panics
    ///
    /// If `c` is not valid ([`VitConfig::validate`]).
    pub fn new(c: &VitConfig, device: &B::Device) -> Self {
        check(c);
        let h = c.hidden;
        Self {
            attn_norm: LayerNormConfig::new(h).init(device),
            attn: Attention {
                wq: linear(h, h, true, device),
                wk: linear(h, h, false, device),
                wv: linear(h, h, true, device),
                wo: linear(h, h, true, device),
                head_dim: c.head_dim(),
                heads: c.heads,
            },
            mlp_norm: LayerNormConfig::new(h).init(device),
            mlp: Mlp {
                fc1: linear(h, c.mlp, true, device),
                fc2: linear(c.mlp, h, true, device),
            },
        }
    }
}

impl<B: Backend> Head<B> {
    /// The final norm and the classifier of a model of shape `c`.
    pub fn new(c: &VitConfig, device: &B::Device) -> Self {
        Self {
            norm: LayerNormConfig::new(c.hidden).init(device),
            classifier: LinearConfig::new(c.hidden, c.classes).init(device),
        }
    }

    /// Hidden states `[batch, positions, hidden]` to the class scores `[batch, classes]` of
    /// the class token (position 0).
    pub fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 2> {
        let [b, _, hidden] = x.dims();
        let cls = x.slice([0..b, 0..1]).reshape([b, hidden]);
        self.classifier.forward(self.norm.forward(cls))
    }

    /// The summed cross-entropy of `logits` (`[batch, classes]`) against `labels`, `[1]`.
    fn loss_sum(logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let b = labels.dims()[0];
        log_softmax(logits, 1)
            .gather(1, labels.reshape([b, 1]))
            .sum()
            .neg()
    }
}

impl<B: ParallelBackend> Attention<B> {
    /// `[batch, positions, hidden]` to `[batch, positions, hidden]`, attending only to the
    /// positions `keep` (`[batch, positions]`, 1 or 0) keeps. The number of heads comes from
    /// the width of the query projection, so a tensor-parallel rank runs its share.
    fn forward(&self, x: Tensor<B, 3>, keep: Tensor<B, 2>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let d = self.head_dim;
        let split = |t: Tensor<B, 3>| {
            let width = t.dims()[2];
            assert!(
                width >= d && width.is_multiple_of(d),
                "{width} features per rank are not whole heads of {d}: tensor parallelism must \
                 divide the {} attention heads",
                self.heads
            );
            t.reshape([b, s, width / d, d]).swap_dims(1, 2)
        };
        let q = split(self.wq.forward(x.clone()));
        let k = split(self.wk.forward(x.clone()));
        let v = split(self.wv.forward(x));
        let local = q.dims()[1];
        // A dropped key's score is pushed far below the others (its softmax weight is 0).
        let dropped = (keep - 1.0).reshape([b, 1, 1, s]) * DROPPED_SCORE;
        let scores = q.matmul(k.swap_dims(2, 3)) / (d as f64).sqrt() + dropped;
        let ctx = softmax(scores, 3).matmul(v).swap_dims(1, 2);
        self.wo.forward(ctx.reshape([b, s, local * d]))
    }
}

impl<B: ParallelBackend> EmbedUnit<B> for Embed<B> {
    /// The field [`IMAGE_FIELD`], `[batch, 8, 8]`, to `[batch, 17, hidden]`.
    fn embed(&self, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let images = batch.float::<3>(IMAGE_FIELD);
        let [_, h, w] = images.dims();
        assert!(
            h == IMAGE && w == IMAGE,
            "images of {h}x{w} pixels, the model reads {IMAGE}x{IMAGE}"
        );
        self.forward(images)
    }
}

impl<B: ParallelBackend> LayerUnit<B> for Block<B> {
    /// The block, reading the side input [`KEEP_FIELD`] (which positions attention sees).
    fn forward(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Tensor<B, 3> {
        let keep = batch.float::<2>(KEEP_FIELD);
        let x = x.clone() + self.attn.forward(self.attn_norm.forward(x), keep);
        let h = self.mlp_norm.forward(x.clone());
        x + self.mlp.fc2.forward(gelu(self.mlp.fc1.forward(h)))
    }
}

impl<B: ParallelBackend> HeadUnit<B> for Head<B> {
    /// The summed cross-entropy of the micro-batch against [`LABEL_FIELD`].
    fn loss(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> LossSum<B> {
        let labels = batch.int::<1>(LABEL_FIELD);
        let images = labels.dims()[0];
        LossSum::new(Self::loss_sum(self.logits(x), labels), images)
    }

    const METRICS: &'static [&'static str] = &["loss", "correct", "images"];

    /// `[summed loss, correct predictions, images]` of the micro-batch.
    fn metrics(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Option<Tensor<B, 1>> {
        let logits = self.logits(x);
        let labels = batch.int::<1>(LABEL_FIELD);
        let b = labels.dims()[0];
        let loss = Self::loss_sum(logits.clone(), labels.clone());
        let hits = logits.argmax(1).equal(labels.reshape([b, 1])).int().sum();
        let count = Tensor::<B, 1>::from_floats([b as f32], &loss.device());
        Some(Tensor::cat(vec![loss, hits.float(), count], 0))
    }

    /// The class scores, `[batch, classes]`.
    fn predict(&self, x: Tensor<B, 3>, _: &Batch<'_, B>) -> Option<Tensor<B, 2>> {
        Some(self.logits(x))
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::loss::CrossEntropyLossConfig;
    use merak_burn::backend::Cpu;
    use merak_burn::batch::Samples;

    use super::*;

    #[test]
    fn the_units_fit_together_and_the_loss_is_a_sum() {
        let device = Default::default();
        let c = VitConfig::new(1, 16, 4);
        let pixels = (0..3 * 64).map(|v| (v % 17) as f32 / 16.0).collect();
        let samples = Samples::new(3)
            .with_float(IMAGE_FIELD, &[IMAGE, IMAGE], pixels)
            .and_then(|s| s.with_int(LABEL_FIELD, &[], vec![1, 7, 3]))
            .and_then(|s| s.with_float(KEEP_FIELD, &[POSITIONS], vec![1.0; 3 * POSITIONS]))
            .expect("fields fill the samples");
        let batch = Batch::<Cpu>::new(&samples, &device);
        let x = Embed::<Cpu>::new(&c, &device).embed(&batch);
        assert_eq!(x.dims(), [3, POSITIONS, 16]);
        let x = LayerUnit::forward(&Block::<Cpu>::new(&c, &device), x, &batch);
        assert_eq!(x.dims(), [3, POSITIONS, 16]);
        let head = Head::<Cpu>::new(&c, &device);
        let scalar = |t: Tensor<Cpu, 1>| t.into_data().to_vec::<f32>().expect("floats")[0];
        let loss = head.loss(x.clone(), &batch);
        assert_eq!(loss.terms(), 3);
        let sum = scalar(loss.into_sum());
        let mean = scalar(
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(head.logits(x.clone()), batch.int::<1>(LABEL_FIELD)),
        );
        assert!(
            (sum - 3.0 * mean).abs() <= 1e-5 * sum.abs(),
            "{sum} vs 3 x {mean}"
        );
        let m: Vec<f32> = (head.metrics(x.clone(), &batch))
            .expect("metrics")
            .into_data()
            .to_vec()
            .expect("floats");
        assert_eq!(m.len(), 3);
        assert!((m[0] - sum).abs() <= 1e-5 * sum.abs());
        assert!(m[1] <= 3.0 && m[2] == 3.0, "{m:?}");
        let p = head.predict(x, &batch).expect("scores");
        assert_eq!(p.dims(), [3, 10]);
    }

    #[test]
    fn a_dropped_patch_is_not_seen_by_the_class_token() {
        let device = Default::default();
        let c = VitConfig::new(2, 16, 4);
        let (embed, block, head) = (
            Embed::<Cpu>::new(&c, &device),
            Block::<Cpu>::new(&c, &device),
            Head::<Cpu>::new(&c, &device),
        );
        let logits = |pixels: Vec<f32>, keep: Vec<f32>| -> Vec<f32> {
            let samples = Samples::new(1)
                .with_float(IMAGE_FIELD, &[IMAGE, IMAGE], pixels)
                .and_then(|s| s.with_float(KEEP_FIELD, &[POSITIONS], keep))
                .expect("fields fill the samples");
            let batch = Batch::<Cpu>::new(&samples, &device);
            let x = LayerUnit::forward(&block, embed.embed(&batch), &batch);
            let x = LayerUnit::forward(&block, x, &batch);
            head.logits(x).into_data().to_vec().expect("floats")
        };
        let image: Vec<f32> = (0..64).map(|v| (v % 5) as f32 / 4.0).collect();
        // Patch 0 (position 1) holds pixels (0, 0), (0, 1), (1, 0), (1, 1).
        let mut other = image.clone();
        for p in [0, 1, 8, 9] {
            other[p] = 1.0 - other[p];
        }
        let mut keep = vec![1.0; POSITIONS];
        assert_ne!(
            logits(image.clone(), keep.clone()),
            logits(other.clone(), keep.clone())
        );
        keep[1] = 0.0;
        assert_eq!(logits(image, keep.clone()), logits(other, keep));
    }

    #[test]
    fn patches_are_2x2_blocks_row_by_row() {
        let device = Default::default();
        let c = VitConfig::new(1, 4, 1);
        let mut embed = Embed::<Cpu>::new(&c, &device);
        // The patch projection copies the patch; no class token or position embeddings.
        let eye: Tensor<Cpu, 2> = Tensor::eye(4, &device);
        embed.patch.weight = Param::from_tensor(eye);
        embed.patch.bias = None;
        embed.cls = Param::from_tensor(Tensor::zeros([4], &device));
        embed.pos = Param::from_tensor(Tensor::zeros([POSITIONS, 4], &device));
        let image: Tensor<Cpu, 3> = Tensor::<Cpu, 1, Int>::arange(0..64, &device)
            .float()
            .reshape([1, 8, 8]);
        let x: Vec<f32> = embed.forward(image).into_data().to_vec().expect("floats");
        let x: Vec<f32> = (x.iter())
            .map(|v| (f64::from(*v) * PIXEL_STD + PIXEL_MEAN).round() as f32)
            .collect();
        // Patch 1 (row 0, column 1) holds pixels (0, 2), (0, 3), (1, 2), (1, 3).
        assert_eq!(&x[8..12], &[2.0, 3.0, 10.0, 11.0]);
        // Patch 4 (row 1, column 0) holds pixels (2, 0), (2, 1), (3, 0), (3, 1).
        assert_eq!(&x[20..24], &[16.0, 17.0, 24.0, 25.0]);
    }
}
