//! The model runtime: GGUF import, a decoder-only transformer in tch (Llama, Qwen2, Qwen3) with
//! optional LoRA, the tokenizer and chat template, batched generation with a KV cache, and scoring
//! of responses (one alignment convention shared by the teacher stage and the trainer).
//!
//! ```no_run
//! use nextstate::model::{LanguageModel, LoadOptions, SamplingParams};
//! use nextstate::schema::Message;
//! # fn main() -> nextstate::Result<()> {
//! let lm = LanguageModel::load("models/smollm2-135m-instruct".as_ref(), &LoadOptions::default())?;
//! let prompt = lm.chat_prompt_ids(&[Message::text("user", "What is the capital of Germany?")], None, true)?;
//! let out = lm.generate(&[prompt.clone()], &SamplingParams::greedy(32))?;
//! // Re-scoring the sampled tokens gives the same log-probs (greedy: plain log-softmax).
//! let scored = lm.score(&[(prompt, out[0].token_ids.clone())], 0)?;
//! assert_eq!(scored[0].logprobs.len(), out[0].token_ids.len());
//! # Ok(()) }
//! ```

pub mod cli;
pub mod config;
pub mod cpu_allocator;
pub mod generate;
pub mod gguf;
pub mod import;
pub mod lm;
pub mod peft;
pub mod score;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, ModelConfig};
pub use generate::{Decoder, FinishReason, Generation, GenerationRequest, LogprobMode, SamplingParams, TokenEvent};
pub use lm::LanguageModel;
pub use peft::{LoraConfig, LoraTarget};
pub use score::{PackedBatch, ResponseLogits, ScoredResponse};
pub use tokenizer::{ChatTemplate, TextTokenizer};
pub use transformer::{AttnMask, KvCache, LoadOptions, Trainable, Transformer};

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

/// Allocations of at least this many bytes are served by `mmap` ([`return_freed_memory`]): 64 KiB.
pub const MMAP_THRESHOLD_BYTES: i32 = 64 * 1024;

/// Makes glibc's allocator give large freed blocks back to the OS at once: every allocation of at least
/// [`MMAP_THRESHOLD_BYTES`] is served by `mmap` and unmapped when freed (`mallopt(M_MMAP_THRESHOLD)`,
/// which also turns off glibc's growing threshold; `MALLOC_MMAP_THRESHOLD_` in the environment does the
/// same). libtorch's CPU tensors come from `malloc`; under glibc's default dynamic threshold (up to
/// 32 MiB) freed activation and logit buffers stay in the heap, so a training process's resident set
/// grows to the sum of the peaks of differently sized buffers. Measured on the 8 × 2,000-token LoRA
/// step of `benches/train.rs`: see docs/trainer-memory.md (memory against step time). Returns whether the setting was accepted (always
/// false off glibc Linux, where it does nothing).
pub fn return_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; M_MMAP_THRESHOLD with a value below the
        // 32 MiB maximum is documented as valid at any time.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
