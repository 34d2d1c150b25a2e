//! BERT (masked language model) built from merak-burn tensor-parallel layers.
//!
//! The encoder follows the original BERT: token and learned position embeddings, an embedding
//! LayerNorm, post-LayerNorm encoder blocks with bidirectional self-attention and a GELU MLP of
//! width 4h, and the masked-language-model head (dense h → h, GELU, LayerNorm) whose output
//! projection is tied to the (vocabulary-parallel) token embedding. A model built with tp = N
//! holds exactly the shards of the model built with tp = 1 from the same seed.
//!
//! Differences from Google's BERT, all deliberate:
//!
//! - **Tokenizer.** Text is tokenized offline with the GPT-2 byte-level BPE (50,257 ids), and
//!   the `[MASK]` token is one extra id appended after the BPE vocabulary, so a real-text
//!   model has `vocab_size = 50_258` and `mask_token_id = 50_257`. There are no `[CLS]`,
//!   `[SEP]` or `[PAD]` tokens: training sequences are full-length windows of the token stream.
//! - **Single segment.** There are no token-type (segment) embeddings and no next-sentence
//!   prediction: pre-training is masked language modelling only (as in RoBERTa).
//! - **No output bias.** The tied vocabulary-parallel head has no bias, so the MLM decoder is
//!   `logits = LN(gelu(dense(h))) · Eᵀ` without BERT's per-token output bias.
//! - **No attention-probability dropout.** Dropout applies to the summed embeddings and to
//!   both residual branches of every block; the attention layers have none of their own.
//!
//! Hugging Face `BertForMaskedLM` weights go in and out: [`hf`] maps the parameters (and says
//! what is done with the token type table and the output bias merak's BERT lacks),
//! [`hf_import`] reads and checks a safetensors file.
//!
//! Masking is deterministic ([`mask_tokens`]): every rank and every parallel layout masks a
//! batch the same way, so the loss of a tp = N / dp = M run matches the single-process run.

mod config;
pub mod hf;
pub mod hf_import;
mod mask;
mod model;
mod run;

pub use config::{BertConfig, BertConfigError};
pub use mask::{IGNORE_TARGET, MASK_PROB, RANDOM_TOKEN_PROB, REPLACE_WITH_MASK_PROB, mask_tokens};
pub use model::{Bert, EncoderLayer, MlmHead};
