//! The data set a config names (`[data]`), opened with the library's readers.

pub use merak_burn::data::Dataset as Source;
use merak_burn::data::{SyntheticData, TokenData};

use crate::config::Config;

/// Opens the data set of `cfg` and checks it against the model (and a validation pass against
/// its validation windows, `data.val_batches`) before training.
pub fn open(cfg: &Config) -> anyhow::Result<Source> {
    let g = &cfg.model.gpt;
    match cfg.data.kind.as_str() {
        "tokens" => {
            let data = TokenData::open(
                std::path::Path::new(&cfg.data.path),
                g.seq_len,
                g.vocab_size,
                cfg.train.seed,
            )?;
            cfg.validate_val_windows(data.val_samples())?;
            Ok(Source::Tokens(Box::new(data)))
        }
        _ => Ok(Source::Synthetic(SyntheticData::new(
            cfg.train.seed,
            g.vocab_size,
        ))),
    }
}
