//! The data set a config names (`[data]`), opened with the library's readers.

pub use merak_burn::data::Dataset as Source;
use merak_burn::data::{DataError, SyntheticData, TokenData};

use crate::config::Config;

/// Opens the data set of `cfg` and checks it against the model before training.
pub fn open(cfg: &Config) -> Result<Source, DataError> {
    let g = &cfg.model.gpt;
    match cfg.data.kind.as_str() {
        "tokens" => Ok(Source::Tokens(Box::new(TokenData::open(
            std::path::Path::new(&cfg.data.path),
            g.seq_len,
            g.vocab_size,
            cfg.train.seed,
        )?))),
        _ => Ok(Source::Synthetic(SyntheticData::new(
            cfg.train.seed,
            g.vocab_size,
        ))),
    }
}
