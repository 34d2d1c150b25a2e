//! The digits as the trainer's samples, the same for every layout: training images in an
//! order shuffled per epoch and shifted by a pixel at random, both keyed by the global sample
//! index; held-out images as they are, in order.

use merak_burn::data::splitmix64;
use merak_burn::prelude::*;

use crate::config::{IMAGE, MAX_PIXEL, POSITIONS};
use crate::data::{Digits, PIXELS};

/// The field of the images, float `[8, 8]` per sample, pixels scaled to `[0, 1]`.
pub const IMAGE_FIELD: &str = "image";
/// The field of the labels, int `[]` per sample.
pub const LABEL_FIELD: &str = "label";
/// The side input every block reads, float `[17]` per sample: 1 for a position attention may
/// look at, 0 for a patch dropped by the augmentation (the class token is always kept).
pub const KEEP_FIELD: &str = "keep";

/// A training patch is dropped with probability `1 / PATCH_DROP` (held-out images keep all).
const PATCH_DROP: u64 = 10;

/// Salts that keep the shuffle's and the augmentation's random streams apart.
const SHUFFLE: u64 = 0x5348_5546_464c_4521;
const SHIFT: u64 = 0x5348_4946_5421_2121;
const DROP: u64 = 0x4452_4f50_2121_2121;

/// The digits addressed by global sample index ([`BatchSource`]).
///
/// Training sample `g = step * global_batch + i` is image `perm_e[g % n]` of the training
/// images, `e = g / n` its epoch and `perm_e` a permutation keyed by the seed and `e`; with
/// augmentation on, half the samples are shifted by one of the 8 offsets of -1, 0 or 1 pixel
/// in x and in y (zero fill), whether and which drawn from a generator keyed by the seed, the
/// step and `g` only (shifting every image slows learning: the held-out images are centred).
/// The augmentation also drops each patch of a training sample with probability 1/10 from the
/// attention of every block (the side input [`KEEP_FIELD`]), drawn from a generator keyed the
/// same way. Held-out sample `j` is held-out image `j % held_out()` (reads past the end wrap
/// around), unaugmented, every patch kept.
#[derive(Clone, Debug)]
pub struct DigitsSource {
    digits: Digits,
    train: Vec<usize>,
    held: Vec<usize>,
    global_batch: usize,
    seed: u64,
    augment: bool,
}

/// One image's pixels scaled to `[0, 1]`, its label and the positions attention keeps
/// ([`KEEP_FIELD`]).
pub type LabelledImage = ([f32; PIXELS], i64, [f32; POSITIONS]);

impl DigitsSource {
    /// The digits split as [`Digits::split`] says, batched and seeded as `settings` say, with
    /// augmentation on.
    pub fn new(digits: Digits, settings: &TrainSettings) -> Self {
        let (train, held) = digits.split();
        Self {
            digits,
            train,
            held,
            global_batch: settings.global_batch,
            seed: settings.seed,
            augment: true,
        }
    }

    /// This source with augmentation on or off.
    #[must_use]
    pub fn with_augmentation(mut self, augment: bool) -> Self {
        self.augment = augment;
        self
    }

    /// Held-out images.
    pub fn held_out(&self) -> usize {
        self.held.len()
    }

    /// Training images.
    pub fn training(&self) -> usize {
        self.train.len()
    }

    /// Global batches of `global_batch` samples that cover every held-out image once (the
    /// last may wrap around to the first images).
    pub fn eval_batches(&self, global_batch: usize) -> usize {
        self.held.len().div_ceil(global_batch.max(1))
    }

    /// The labels of held-out samples `first..first + count`.
    pub fn held_out_labels(&self, first: usize, count: usize) -> Vec<u8> {
        (first..first + count)
            .map(|j| self.digits.label(self.held[j % self.held.len()]))
            .collect()
    }

    /// Image `i` of the file shifted by `(dx, dy)` pixels, scaled, and its label.
    fn image(&self, i: usize, (dx, dy): (isize, isize)) -> LabelledImage {
        let src = self.digits.image(i);
        let mut out = [0.0f32; PIXELS];
        for (r, row) in out.chunks_exact_mut(IMAGE).enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                let (sr, sc) = (r as isize - dy, c as isize - dx);
                if (0..IMAGE as isize).contains(&sr) && (0..IMAGE as isize).contains(&sc) {
                    let p = src[sr as usize * IMAGE + sc as usize];
                    *v = f32::from(p) / f32::from(MAX_PIXEL);
                }
            }
        }
        (out, i64::from(self.digits.label(i)), [1.0; POSITIONS])
    }

    /// The training images in epoch `epoch`'s order (a Fisher-Yates shuffle keyed by the seed
    /// and the epoch).
    fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut order = self.train.clone();
        let mut state = splitmix64(self.seed ^ SHUFFLE) ^ splitmix64(epoch);
        for k in (1..order.len()).rev() {
            state = splitmix64(state);
            order.swap(k, (state % (k as u64 + 1)) as usize);
        }
        order
    }

    /// The shift of training sample `g` of step `step`: none for half the samples, one of
    /// the 8 shifts by -1, 0 or 1 pixel in x and in y for the others.
    fn shift(&self, step: usize, g: usize) -> (isize, isize) {
        if !self.augment {
            return (0, 0);
        }
        let h = splitmix64(splitmix64(splitmix64(self.seed ^ SHIFT) ^ step as u64) ^ g as u64);
        if h >> 63 == 0 {
            return (0, 0);
        }
        let k = (h % 8) as isize;
        let k = k + isize::from(k >= 4);
        (k % 3 - 1, k / 3 - 1)
    }

    /// The positions attention keeps for training sample `g` of step `step`: the class token
    /// always, each patch unless the augmentation drops it.
    fn kept(&self, step: usize, g: usize) -> [f32; POSITIONS] {
        let mut keep = [1.0; POSITIONS];
        if !self.augment {
            return keep;
        }
        let mut h = splitmix64(splitmix64(splitmix64(self.seed ^ DROP) ^ step as u64) ^ g as u64);
        for k in keep.iter_mut().skip(1) {
            h = splitmix64(h);
            if h.is_multiple_of(PATCH_DROP) {
                *k = 0.0;
            }
        }
        keep
    }

    /// Training samples `first..first + count` of step `step`, as images and labels.
    pub fn train_images(&self, step: usize, first: usize, count: usize) -> Vec<LabelledImage> {
        let n = self.train.len();
        let mut epoch = None;
        let mut order = Vec::new();
        (first..first + count)
            .map(|i| {
                let g = step * self.global_batch + i;
                let e = (g / n) as u64;
                if epoch != Some(e) {
                    (epoch, order) = (Some(e), self.permutation(e));
                }
                let (image, label, _) = self.image(order[g % n], self.shift(step, g));
                (image, label, self.kept(step, g))
            })
            .collect()
    }

    /// Held-out samples `first..first + count`, as images and labels.
    pub fn held_out_images(&self, first: usize, count: usize) -> Vec<LabelledImage> {
        (first..first + count)
            .map(|j| self.image(self.held[j % self.held.len()], (0, 0)))
            .collect()
    }
}

/// The fields [`IMAGE_FIELD`], [`LABEL_FIELD`] and [`KEEP_FIELD`] of `images`, one loss term
/// per image.
pub fn samples(images: Vec<LabelledImage>) -> Result<Samples, SourceError> {
    let count = images.len();
    let (mut pixels, mut labels) = (
        Vec::with_capacity(count * PIXELS),
        Vec::with_capacity(count),
    );
    let mut keep = Vec::with_capacity(count * POSITIONS);
    for (image, label, kept) in images {
        pixels.extend_from_slice(&image);
        labels.push(label);
        keep.extend_from_slice(&kept);
    }
    Ok(Samples::new(count)
        .with_float(IMAGE_FIELD, &[IMAGE, IMAGE], pixels)?
        .with_int(LABEL_FIELD, &[], labels)?
        .with_float(KEEP_FIELD, &[POSITIONS], keep)?)
}

impl BatchSource for DigitsSource {
    fn train_samples(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Samples, SourceError> {
        samples(self.train_images(step, first, count))
    }

    fn val_samples(&self, first: usize, count: usize) -> Result<Samples, SourceError> {
        samples(self.held_out_images(first, count))
    }
}

#[cfg(test)]
mod tests {
    use merak_burn::batch::Values;

    use super::*;
    use crate::data::default_digits_path;

    fn source() -> DigitsSource {
        let digits = Digits::read(&default_digits_path()).expect("the committed digits");
        let settings = TrainSettings::default().with_global_batch(8).with_seed(3);
        DigitsSource::new(digits, &settings)
    }

    #[test]
    fn augmentation_is_keyed_by_the_sample_index() {
        let s = source();
        let all = s.train_samples(5, 0, 8).expect("samples 0..8");
        let part = s.train_samples(5, 4, 4).expect("samples 4..8");
        assert_eq!(all.count, 8);
        for (name, whole) in &all.fields {
            let per = whole.shape.iter().product::<usize>();
            let got = &part.fields[name];
            match (&whole.values, &got.values) {
                (Values::Float(a), Values::Float(b)) => assert_eq!(&a[4 * per..], &b[..]),
                (Values::Int(a), Values::Int(b)) => assert_eq!(&a[4 * per..], &b[..]),
                _ => panic!("{name}: kinds differ"),
            }
        }
        assert_eq!(s.train_images(5, 6, 1), s.train_images(5, 6, 1));
        // The same image shifted differently on another step, and some sample shifted at all.
        let shifted = (0..64).any(|i| s.shift(0, i) != (0, 0));
        assert!(shifted);
        let plain = s.clone().with_augmentation(false);
        let (a, b) = (s.train_images(0, 0, 64), plain.train_images(0, 0, 64));
        assert!(a.iter().zip(&b).any(|(x, y)| x != y));
        assert!(a.iter().zip(&b).all(|(x, y)| x.1 == y.1), "the labels stay");
        // Some patches dropped, never the class token; none without augmentation.
        assert!(a.iter().any(|x| x.2.contains(&0.0)) && a.iter().all(|x| x.2[0] == 1.0));
        assert!(b.iter().all(|x| x.2.iter().all(|k| *k == 1.0)));
    }

    #[test]
    fn an_epoch_visits_every_training_image_once() {
        let s = source();
        let order = s.permutation(0);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, s.train);
        assert_ne!(order, s.permutation(1));
        assert_ne!(order, s.train);
    }

    #[test]
    fn held_out_samples_are_unaugmented_and_wrap_around() {
        let s = source();
        let n = s.held_out();
        assert_eq!(s.held_out_images(n, 2), s.held_out_images(0, 2));
        let (pixels, label, keep) = &s.held_out_images(0, 1)[0];
        assert!(
            keep.iter().all(|k| *k == 1.0),
            "held-out images keep every patch"
        );
        let raw = s.digits.image(0);
        assert!(
            pixels
                .iter()
                .zip(raw)
                .all(|(p, r)| *p == f32::from(*r) / 16.0)
        );
        assert_eq!(*label, i64::from(s.digits.label(0)));
        assert_eq!(s.held_out_labels(0, 1), vec![s.digits.label(0)]);
        assert_eq!(s.eval_batches(60), 5);
        assert_eq!(s.eval_batches(64), 5);
    }

    #[test]
    fn a_shift_moves_the_pixels_and_fills_with_zeros() {
        let s = source();
        let (base, _, _) = s.image(0, (0, 0));
        let (moved, _, _) = s.image(0, (1, -1));
        for r in 0..IMAGE {
            for c in 0..IMAGE {
                let want = match (r + 1 < IMAGE, c >= 1) {
                    (true, true) => base[(r + 1) * IMAGE + c - 1],
                    _ => 0.0,
                };
                assert_eq!(moved[r * IMAGE + c], want, "({r}, {c})");
            }
        }
    }
}
