//! The `nextstate` command line.
use anyhow::Result;
use clap::{Parser, Subcommand};

/// nextstate: turn agents' next states into training signal and train the policy online.
#[derive(Parser)]
#[command(name = "nextstate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the Arrow schema of every table (JSON).
    Schema,
    /// Import, run and inspect models (GGUF import, generation).
    Model(nextstate::model::cli::ModelArgs),
    /// Run the policy server (OpenAI-compatible chat completions with weight hot-swap).
    Serve(nextstate::serve::ServeArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Schema => {
            let all: Vec<_> = nextstate::schema::all_schemas().iter().map(|(_, s)| nextstate::schema::schema_json(s)).collect();
            println!("{}", serde_json::to_string_pretty(&all)?);
        }
        Command::Model(args) => args.run()?,
        Command::Serve(args) => args.run()?,
    }
    Ok(())
}
