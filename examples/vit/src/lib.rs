//! A small vision transformer (2x2 patches, a class token, learned position embeddings,
//! pre-LayerNorm blocks of multi-head self-attention and a GELU MLP) trained on the 8x8
//! handwritten digits, written with Burn's own modules, and the three descriptions that make
//! it dp x tp x pp parallel with merak-burn: which linear layers tensor parallelism splits
//! ([`tp_plan`]), which sub-modules are the pipeline units (the `impl`s of `EmbedUnit`,
//! `LayerUnit` and `HeadUnit`), and where the samples come from ([`DigitsSource`], a
//! `BatchSource` of named fields: the images and their labels).
//!
//! The digits are the UCI "Optical Recognition of Handwritten Digits" data set (E. Alpaydin and
//! C. Kaynak, CC BY 4.0) as scikit-learn distributes it, committed as `data/digits.bin`.

#![warn(missing_docs)]

mod config;
mod data;
mod model;
mod recipe;
mod source;
mod tp;
mod units;

pub use config::{
    CLASSES, GRID, IMAGE, InvalidConfig, MAX_PIXEL, PATCH, PATCHES, PIXEL_MEAN, PIXEL_STD,
    POSITIONS, VitConfig,
};
pub use data::{Digits, DigitsError, HOLD_OUT_EVERY, PIXELS, RECORD, default_digits_path};
pub use model::{Attention, Block, Embed, Head, Mlp, POS_STD};
pub use recipe::{report, settings};
pub use source::{DigitsSource, IMAGE_FIELD, KEEP_FIELD, LABEL_FIELD, LabelledImage, samples};
pub use tp::tp_plan;
