//! The `nextstate model …` subcommands (argument types live here so `main.rs` stays a dispatcher).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::import::{import_gguf, ImportDtype};
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
        }
        Ok(())
    }
}
