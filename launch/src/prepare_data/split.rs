//! Where a text may be cut without changing GPT-2's tokens, and the text of one input held
//! until such a place is read.

use std::path::Path;

use super::{MAX_UNCUT_BYTES, MAX_WHITESPACE_RUN, PrepareError};

/// Whether cutting a text between the characters `a` and `b` leaves GPT-2's tokens unchanged:
/// the tokens of the two parts, put together, are those of the whole.
///
/// GPT-2's tokenizer (r50k) splits text into pieces with the regex
/// `'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s` and
/// encodes each piece alone. The regex has no look-behind, so text after a cut is split as in
/// the whole text when the cut falls between two pieces of the whole. Text before the cut is
/// split as in the whole when no piece before it looked past the cut. Both hold when `a` is not
/// whitespace and
///
/// - `b` is whitespace: the piece holding `a` (a contraction, or a run of letters, digits or
///   other characters) ends at `b`. Every whitespace run before the cut ends before `a`, so
///   neither `(?!\S)` nor `$` sees the cut;
/// - or one of `a`, `b` is an ASCII digit and the other no digit (`\p{N}`) nor whitespace:
///   runs of digits end there, and a run of letters or of other characters ends at a digit.
///   Contractions are an apostrophe and letters only.
///
/// A cut between other neighbours can change the tokens: `"a  b"` is `"a"`, `" "`, `" b"`, but
/// cut after the two spaces, `"a  "` ends in the piece `"  "` (`\s++$`); `"'s"` cut after the
/// apostrophe loses the contraction. (`char::is_whitespace` and `char::is_numeric` are the
/// regex's `\s` and `\p{N}`; ASCII digits keep the second rule exact across Unicode versions.)
pub fn safe_cut(a: char, b: char) -> bool {
    if a.is_whitespace() {
        return false;
    }
    b.is_whitespace()
        || (a.is_ascii_digit() && !b.is_numeric())
        || (b.is_ascii_digit() && !a.is_numeric())
}

/// The last place in `text` at or after byte `from` (a character boundary) where it can be cut
/// ([`safe_cut`]), if any.
pub(super) fn last_cut(text: &str, from: usize) -> Option<usize> {
    let mut after: Option<(usize, char)> = None;
    for (i, a) in text.char_indices().rev() {
        if let Some((p, b)) = after {
            if safe_cut(a, b) {
                return Some(p);
            }
            if p <= from {
                return None;
            }
        }
        after = Some((i, a));
    }
    None
}

/// Refuses `text` (at `offset` in the input `path`) if it holds a run of more than
/// [`MAX_WHITESPACE_RUN`] whitespace characters. (A cut never falls inside or right after
/// whitespace, so every run lies whole in one text given to the tokenizer.)
pub(super) fn check_whitespace_runs(
    text: &str,
    offset: u64,
    path: &Path,
) -> Result<(), PrepareError> {
    let (mut run, mut start) = (0, 0);
    for (i, c) in text.char_indices() {
        if !c.is_whitespace() {
            run = 0;
            continue;
        }
        if run == 0 {
            start = i;
        }
        run += 1;
        if run > MAX_WHITESPACE_RUN {
            return Err(PrepareError::LongWhitespace {
                path: path.display().to_string(),
                offset: offset + start as u64,
            });
        }
    }
    Ok(())
}

/// Text read from one input and not tokenized yet.
#[derive(Default)]
pub(super) struct Splitter {
    /// The bytes.
    pub(super) pending: Vec<u8>,
    /// How many of them are checked UTF-8 with no place to cut.
    pub(super) checked: usize,
    /// The input's offset of `pending[0]`.
    pub(super) offset: u64,
}

impl Splitter {
    /// Appends bytes read.
    pub(super) fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// Takes out the text up to the last place where it can be cut, if there is one.
    pub(super) fn take_ready(&mut self, path: &Path) -> Result<Option<String>, PrepareError> {
        let valid = self.valid_len(path, false)?;
        let text = self.text(valid, path)?;
        match last_cut(text, self.checked) {
            Some(p) => {
                let ready = text[..p].to_owned();
                check_whitespace_runs(&ready, self.offset, path)?;
                self.pending.drain(..p);
                self.offset += p as u64;
                self.checked = valid - p;
                Ok(Some(ready))
            }
            None if self.pending.len() > MAX_UNCUT_BYTES => Err(PrepareError::NoCut {
                path: path.display().to_string(),
                offset: self.offset,
                bytes: self.pending.len(),
            }),
            None => {
                self.checked = valid;
                Ok(None)
            }
        }
    }

    /// The rest of the text, at the end of the input.
    pub(super) fn finish(mut self, path: &Path) -> Result<String, PrepareError> {
        let valid = self.valid_len(path, true)?;
        self.pending.truncate(valid);
        let text = String::from_utf8(self.pending).map_err(|e| PrepareError::NotUtf8 {
            path: path.display().to_string(),
            offset: self.offset + e.utf8_error().valid_up_to() as u64,
        })?;
        check_whitespace_runs(&text, self.offset, path)?;
        Ok(text)
    }

    /// The first `valid` pending bytes as text.
    fn text(&self, valid: usize, path: &Path) -> Result<&str, PrepareError> {
        std::str::from_utf8(&self.pending[..valid]).map_err(|e| PrepareError::NotUtf8 {
            path: path.display().to_string(),
            offset: self.offset + e.valid_up_to() as u64,
        })
    }

    /// How many pending bytes are whole UTF-8 characters (a character cut by the end of a
    /// chunk waits for the next, unless `at_end`); an invalid byte is an error.
    fn valid_len(&self, path: &Path, at_end: bool) -> Result<usize, PrepareError> {
        match std::str::from_utf8(&self.pending[self.checked..]) {
            Ok(_) => Ok(self.pending.len()),
            Err(e) if e.error_len().is_none() && !at_end => Ok(self.checked + e.valid_up_to()),
            Err(e) => Err(PrepareError::NotUtf8 {
                path: path.display().to_string(),
                offset: self.offset + (self.checked + e.valid_up_to()) as u64,
            }),
        }
    }
}
