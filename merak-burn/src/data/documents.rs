//! Document masks for packed token windows (`data.document_mask`): a window of the data set
//! holds the end of one document, whole documents and the start of another, separated by the
//! end-of-text token. With a document mask each token attends only to the tokens of its own
//! document, and its position restarts at 0 where a document starts, as if the documents were
//! trained one by one (Megatron's `reset_attention_mask` and `reset_position_ids`).
//!
//! The end-of-text token belongs to the document it ends (it still predicts the next
//! document's first token, as without a mask); the token after it starts a new document at
//! position 0. [`DocumentMasked`] adds both fields to every sample of a token source:
//! [`POSITIONS`] and [`SEGMENTS`] (the document's index within its window).

use crate::batch::{POSITIONS, SEGMENTS, Samples};
use crate::train::{BatchSource, SourceError, TokenSource, Windows};

/// Each token's position within its document and its document's index within its window, for
/// `inputs` cut into windows of `seq` tokens (row after row), documents ending at `eot`.
pub fn document_fields(inputs: &[i64], seq: usize, eot: i64) -> (Vec<i64>, Vec<i64>) {
    let mut positions = Vec::with_capacity(inputs.len());
    let mut segments = Vec::with_capacity(inputs.len());
    for window in inputs.chunks(seq.max(1)) {
        let (mut position, mut segment) = (0i64, 0i64);
        for &token in window {
            positions.push(position);
            segments.push(segment);
            if token == eot {
                (position, segment) = (0, segment + 1);
            } else {
                position += 1;
            }
        }
    }
    (positions, segments)
}

/// A token source whose samples carry [`POSITIONS`] and [`SEGMENTS`] besides the tokens and
/// targets, from the end-of-text token `eot` (see the module docs).
pub struct DocumentMasked<S> {
    /// The windows.
    pub source: S,
    /// The end-of-text token id.
    pub eot: i64,
}

impl<S: TokenSource> DocumentMasked<S> {
    /// `windows` (`count` sequences) as samples with their document fields.
    fn samples(&self, windows: Windows, count: usize) -> Result<Samples, SourceError> {
        let seq = windows.inputs.len() / count.max(1);
        let (positions, segments) = document_fields(&windows.inputs, seq, self.eot);
        Ok(windows
            .into_samples(count)?
            .with_int(POSITIONS, &[seq], positions)?
            .with_int(SEGMENTS, &[seq], segments)?)
    }
}

impl<S: TokenSource> BatchSource for DocumentMasked<S> {
    fn train_samples(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Samples, SourceError> {
        let windows = self.source.train_windows(step, first, count)?;
        self.samples(windows, count)
    }

    fn val_samples(&self, first: usize, count: usize) -> Result<Samples, SourceError> {
        let windows = self.source.val_windows(first, count)?;
        self.samples(windows, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_after_each_end_of_text_and_segments_count_documents() {
        // Two windows of 6 tokens, end-of-text 9.
        let inputs = [5, 6, 9, 7, 9, 9, 1, 2, 3, 9, 4, 5];
        let (positions, segments) = document_fields(&inputs, 6, 9);
        assert_eq!(positions, [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]);
        assert_eq!(segments, [0, 0, 0, 1, 1, 2, 0, 0, 0, 0, 1, 1]);
    }

    #[test]
    fn samples_carry_the_document_fields_next_to_tokens_and_targets() {
        struct Two;
        impl TokenSource for Two {
            fn train_windows(&self, _: usize, _: usize, _: usize) -> Result<Windows, SourceError> {
                Ok(Windows {
                    inputs: vec![1, 0, 2, 3, 0, 0],
                    targets: vec![0, 2, 3, 0, 0, 4],
                })
            }
            fn val_windows(&self, _: usize, _: usize) -> Result<Windows, SourceError> {
                self.train_windows(0, 0, 2)
            }
        }
        let masked = DocumentMasked {
            source: Two,
            eot: 0,
        };
        let s = masked.train_samples(0, 0, 2).unwrap();
        assert_eq!(s.ints(POSITIONS).unwrap(), [0, 1, 0, 0, 1, 0]);
        assert_eq!(s.ints(SEGMENTS).unwrap(), [0, 0, 1, 0, 0, 1]);
        assert_eq!(s.ints(crate::batch::TOKENS).unwrap(), [1, 0, 2, 3, 0, 0]);
        assert_eq!(s.loss_terms, 6);
    }
}
