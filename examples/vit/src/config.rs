//! The shape of the vision transformer: its sizes, and the image and patch sizes it reads.

use thiserror::Error;

/// Pixels per side of an image.
pub const IMAGE: usize = 8;
/// Pixels per side of a patch.
pub const PATCH: usize = 2;
/// Patches per side of an image.
pub const GRID: usize = IMAGE / PATCH;
/// Patches per image.
pub const PATCHES: usize = GRID * GRID;
/// Positions between the units: the class token, then the patches.
pub const POSITIONS: usize = PATCHES + 1;
/// The largest pixel value of the digits (pixels are scaled by it to `[0, 1]`).
pub const MAX_PIXEL: u8 = 16;
/// The mean of the training images' pixels scaled to `[0, 1]` (the first unit standardizes
/// its input with it and [`PIXEL_STD`]).
pub const PIXEL_MEAN: f64 = 0.3055;
/// The standard deviation of the training images' pixels scaled to `[0, 1]`.
pub const PIXEL_STD: f64 = 0.3762;
/// Digit classes.
pub const CLASSES: usize = 10;

/// The shape of a small pre-LayerNorm vision transformer over [`IMAGE`] x [`IMAGE`] images cut
/// into [`PATCH`] x [`PATCH`] patches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VitConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the hidden states.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of the MLP.
    pub mlp: usize,
    /// Output classes.
    pub classes: usize,
}

/// A [`VitConfig`] that describes no model, or a tensor-parallel degree it cannot be split
/// over.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("ViT config: {0}")]
pub struct InvalidConfig(pub String);

impl Default for VitConfig {
    /// 4 blocks, hidden 32, 4 heads, MLP 128, 10 classes (about 52,000 parameters).
    fn default() -> Self {
        Self::new(4, 32, 4)
    }
}

impl VitConfig {
    /// `layers` blocks of width `hidden` with `heads` heads, an MLP 4 times as wide, and
    /// [`CLASSES`] classes.
    pub fn new(layers: usize, hidden: usize, heads: usize) -> Self {
        Self {
            layers,
            hidden,
            heads,
            mlp: 4 * hidden,
            classes: CLASSES,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Checks that every size is positive and `heads` divides `hidden`.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        for (name, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("mlp", self.mlp),
            ("classes", self.classes),
        ] {
            if v == 0 {
                return Err(InvalidConfig(format!("{name} = 0")));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(InvalidConfig(format!(
                "hidden = {} is not a multiple of heads = {}",
                self.hidden, self.heads
            )));
        }
        Ok(())
    }

    /// Checks that tensor parallelism over `tp` ranks gives each rank whole heads and an
    /// equal share of the MLP.
    pub fn check_tp(&self, tp: usize) -> Result<(), InvalidConfig> {
        if tp == 0 || !self.heads.is_multiple_of(tp) || !self.mlp.is_multiple_of(tp) {
            return Err(InvalidConfig(format!(
                "tp = {tp} must divide the {} attention heads and the MLP width {}",
                self.heads, self.mlp
            )));
        }
        Ok(())
    }

    /// The sizes as JSON, for checkpoint manifests.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": "vit",
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "mlp": self.mlp,
            "classes": self.classes,
            "image": IMAGE,
            "patch": PATCH,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        assert!(VitConfig::default().validate().is_ok());
        assert_eq!(POSITIONS, 17);
        let odd = VitConfig::new(2, 30, 4);
        assert!(odd.validate().is_err());
        assert!(VitConfig::default().check_tp(2).is_ok());
        let err = VitConfig::default()
            .check_tp(3)
            .expect_err("3 does not divide 4 heads");
        assert!(err.to_string().contains("tp = 3"), "{err}");
    }
}
