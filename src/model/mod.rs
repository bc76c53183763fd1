//! The model runtime: GGUF import, a decoder-only transformer in tch (Llama, Qwen2, Qwen3), the
//! tokenizer and chat template, batched generation with a KV cache, and scoring of responses.

pub mod gguf;
pub mod import;
pub mod cli;

use crate::{Error, Result};

/// Sets libtorch's intra-op thread count (`--threads` / `NEXTSTATE_THREADS`).
///
/// # Errors
/// [`Error::Config`] when `n` is not positive.
pub fn set_threads(n: i32) -> Result<()> {
    if n <= 0 {
        return Err(Error::Config(format!("threads must be positive, got {n}")));
    }
    tch::set_num_threads(n);
    Ok(())
}
