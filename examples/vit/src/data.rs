//! The 8x8 handwritten digits: the committed binary file, validated as untrusted input, and its
//! fixed split into training and held-out images.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::config::{CLASSES, IMAGE, MAX_PIXEL};

/// Pixels per image.
pub const PIXELS: usize = IMAGE * IMAGE;
/// Bytes per record: the pixels row by row, then the label.
pub const RECORD: usize = PIXELS + 1;
/// Every this many images, one is held out (images 0, 6, 12, ...).
pub const HOLD_OUT_EVERY: usize = 6;

/// A digits file that cannot be read or does not hold what [`Digits`] needs.
#[derive(Debug, Error)]
pub enum DigitsError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a whole number of records.
    #[error(
        "{}: {len} bytes is not a whole number of {RECORD}-byte records (64 pixels and a label)",
        path.display()
    )]
    Length {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The file holds too few images to split into training and held-out images.
    #[error(
        "{}: {images} images; at least {HOLD_OUT_EVERY} are needed for a training and a \
         held-out image",
        path.display()
    )]
    TooFew {
        /// The file.
        path: PathBuf,
        /// Its images.
        images: usize,
    },
    /// A record's label is not a digit.
    #[error("{}: record {record}: label {label} (must be below {CLASSES})", path.display())]
    Label {
        /// The file.
        path: PathBuf,
        /// The record (0-based).
        record: usize,
        /// Its label.
        label: u8,
    },
    /// A record's pixel is out of range.
    #[error(
        "{}: record {record}: pixel {pixel} is {value} (must be at most {MAX_PIXEL})",
        path.display()
    )]
    Pixel {
        /// The file.
        path: PathBuf,
        /// The record (0-based).
        record: usize,
        /// The pixel (0-based, row by row).
        pixel: usize,
        /// Its value.
        value: u8,
    },
}

/// The digits file committed with the example, `examples/vit/data/digits.bin`.
pub fn default_digits_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.bin")
}

/// Labelled 8x8 images of digits, pixels 0..=16, labels 0..=9.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digits {
    /// The records, [`RECORD`] bytes each, all valid.
    records: Vec<u8>,
}

impl Digits {
    /// Reads and validates the digits file at `path`.
    pub fn read(path: &Path) -> Result<Self, DigitsError> {
        let bytes = std::fs::read(path).map_err(|source| DigitsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(bytes, path)
    }

    /// Validates `bytes`, read from `path` (named in errors): whole records, at least
    /// [`HOLD_OUT_EVERY`] of them, labels below 10 and pixels at most 16.
    pub fn parse(bytes: Vec<u8>, path: &Path) -> Result<Self, DigitsError> {
        let path = || path.to_path_buf();
        if !bytes.len().is_multiple_of(RECORD) {
            let len = bytes.len();
            return Err(DigitsError::Length { path: path(), len });
        }
        let images = bytes.len() / RECORD;
        if images < HOLD_OUT_EVERY {
            return Err(DigitsError::TooFew {
                path: path(),
                images,
            });
        }
        for (record, r) in bytes.chunks_exact(RECORD).enumerate() {
            if let Some((pixel, &value)) = r[..PIXELS]
                .iter()
                .enumerate()
                .find(|(_, v)| **v > MAX_PIXEL)
            {
                return Err(DigitsError::Pixel {
                    path: path(),
                    record,
                    pixel,
                    value,
                });
            }
            let label = r[PIXELS];
            if usize::from(label) >= CLASSES {
                return Err(DigitsError::Label {
                    path: path(),
                    record,
                    label,
                });
            }
        }
        Ok(Self { records: bytes })
    }

    /// Images in the file.
    pub fn len(&self) -> usize {
        self.records.len() / RECORD
    }

    /// Whether there are none (never, once validated).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The [`PIXELS`] pixels of image `i`, row by row, each 0..=16.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`len`](Self::len).
    pub fn image(&self, i: usize) -> &[u8] {
        &self.records[i * RECORD..i * RECORD + PIXELS]
    }

    /// The label of image `i`, 0..=9.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`len`](Self::len).
    pub fn label(&self, i: usize) -> u8 {
        self.records[i * RECORD + PIXELS]
    }

    /// The fixed split: the indices of the training images and of the held-out images (every
    /// [`HOLD_OUT_EVERY`]th image, from the first).
    pub fn split(&self) -> (Vec<usize>, Vec<usize>) {
        (0..self.len()).partition(|i| !i.is_multiple_of(HOLD_OUT_EVERY))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_file_is_valid_and_split() {
        let digits = Digits::read(&default_digits_path()).expect("the committed digits");
        assert_eq!(digits.len(), 1797);
        let (train, held) = digits.split();
        assert_eq!((train.len(), held.len()), (1497, 300));
        assert_eq!(&held[..3], &[0, 6, 12]);
        // scikit-learn's first image is a zero, its second a one.
        assert_eq!((digits.label(0), digits.label(1)), (0, 1));
    }

    #[test]
    fn a_bad_record_is_named() {
        let path = Path::new("bad.bin");
        let mut bytes = vec![0u8; RECORD * 8];
        bytes[RECORD * 3 + 5] = 17;
        let err = Digits::parse(bytes.clone(), path).expect_err("pixel 17");
        assert!(matches!(
            err,
            DigitsError::Pixel {
                record: 3,
                pixel: 5,
                value: 17,
                ..
            }
        ));
        assert!(err.to_string().starts_with("bad.bin: record 3"), "{err}");
        bytes[RECORD * 3 + 5] = 0;
        bytes[RECORD * 7 + PIXELS] = 10;
        let err = Digits::parse(bytes.clone(), path).expect_err("label 10");
        assert!(matches!(
            err,
            DigitsError::Label {
                record: 7,
                label: 10,
                ..
            }
        ));
        bytes.pop();
        let err = Digits::parse(bytes, path).expect_err("a short record");
        assert!(matches!(err, DigitsError::Length { .. }), "{err}");
        let err = Digits::read(Path::new("/nonexistent/digits.bin")).expect_err("no file");
        assert!(err.to_string().contains("/nonexistent/digits.bin"), "{err}");
    }
}
