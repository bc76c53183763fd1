//! The `nextstate model …` subcommands (argument types live here so `main.rs` stays a dispatcher).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::import::{import_gguf, ImportDtype};
use super::{GenerationRequest, LanguageModel, LoadOptions, SamplingParams};
use crate::schema::Message;
use crate::Result;

/// `nextstate model`: import and run models.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: ModelCommand,
    /// libtorch intra-op threads (default: libtorch's own choice).
    #[arg(long, global = true, env = "NEXTSTATE_THREADS")]
    pub threads: Option<i32>,
}

/// The model subcommands.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Convert a GGUF file (llama / qwen2 / qwen3, byte-level BPE) into an HF-style directory.
    Import {
        /// The GGUF file.
        #[arg(long)]
        gguf: PathBuf,
        /// Output directory (must not exist or be empty).
        #[arg(long)]
        out: PathBuf,
        /// Element type of model.safetensors: f32 (exact dequantised values) or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Generate a continuation of a prompt (greedy by default) and print it.
    Generate {
        /// Model directory (HF layout: config.json, *.safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// The prompt: plain text, or the user message with --chat.
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// Maximum new tokens.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Nucleus mass (1 = off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Random seed for sampling.
        #[arg(long)]
        seed: Option<u64>,
        /// Device: cpu, cuda, cuda:N or auto.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Weight dtype: f32, f16, bf16 or auto (f32 on CPU, bf16 on CUDA).
        #[arg(long, default_value = "auto")]
        dtype: String,
    },
}

impl ModelArgs {
    /// Runs the subcommand.
    ///
    /// # Errors
    /// Whatever the subcommand returns ([`crate::Error`]).
    pub fn run(self) -> Result<()> {
        if let Some(n) = self.threads {
            super::set_threads(n)?;
        }
        match self.command {
            ModelCommand::Import { gguf, out, dtype } => {
                let dtype = ImportDtype::parse(&dtype)?;
                let bar = indicatif::ProgressBar::new(0);
                bar.set_style(
                    indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} tensors")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                bar.set_message("importing");
                let t0 = std::time::Instant::now();
                let s = import_gguf(&gguf, &out, dtype, &mut |done, total| {
                    bar.set_length(total as u64);
                    bar.set_position(done as u64);
                })?;
                bar.finish_and_clear();
                tracing::info!(
                    "imported {} ({}) into {}: {} tensors, {:.1} M parameters, vocab {} tokens, {} merges, tied embeddings {}, {:.1} s",
                    gguf.display(),
                    s.architecture,
                    s.out_dir.display(),
                    s.tensors,
                    s.parameters as f64 / 1e6,
                    s.vocab_size,
                    s.merges,
                    s.tied_embeddings,
                    t0.elapsed().as_secs_f64()
                );
            }
            ModelCommand::Generate { model, prompt, chat, max_tokens, temperature, top_p, seed, device, dtype } => {
                let device = LoadOptions::parse_device(&device)?;
                let opts = LoadOptions { device, dtype: LoadOptions::parse_dtype(&dtype, device)?, ..Default::default() };
                let t0 = std::time::Instant::now();
                let lm = LanguageModel::load(&model, &opts)?;
                let load_s = t0.elapsed().as_secs_f64();
                let ids = if chat { lm.chat_prompt_ids(&[Message::text("user", prompt)], None, true)? } else { lm.encode(&prompt)? };
                let params = SamplingParams { temperature, top_p, max_new_tokens: max_tokens, seed, ..Default::default() };
                let req = GenerationRequest { prompt_ids: ids.clone(), params };
                let t1 = std::time::Instant::now();
                let mut out = std::io::stdout();
                let g = lm.generate_stream(&[req], &mut |ev| {
                    use std::io::Write;
                    let _ = write!(out, "{}", ev.text_delta);
                    let _ = out.flush();
                    true
                })?;
                println!();
                let gen_s = t1.elapsed().as_secs_f64();
                let n = g.first().map(|g| g.token_ids.len()).unwrap_or(0);
                tracing::info!(
                    "{} prompt tokens, {n} generated tokens in {gen_s:.2} s ({:.1} tokens/s), finish {}, load {load_s:.1} s, {:?}",
                    ids.len(),
                    n as f64 / gen_s.max(1e-9),
                    g.first().map(|g| g.finish_reason.as_str()).unwrap_or("-"),
                    device
                );
            }
        }
        Ok(())
    }
}
