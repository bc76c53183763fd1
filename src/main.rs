//! The `nextstate` command line: the parser and a dispatch to each command's `run` (`src/cli/`).
mod cli;

use std::io::IsTerminal;

use anyhow::Result;
use clap::{Parser, Subcommand};

use cli::common::user_message;

/// nextstate: turn agents' next states into training signal and train the policy online.
#[derive(Parser)]
#[command(name = "nextstate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Import, run and inspect models (GGUF import, generation).
    Model(nextstate::model::cli::ModelArgs),
    /// Run the policy server (OpenAI-compatible chat completions with weight hot-swap).
    Serve(nextstate::serve::ServeArgs),
    /// Run the capture proxy: OpenAI-compatible, in front of any policy server; emits interactions.
    Proxy(nextstate::serve::proxy::ProxyArgs),
    /// Print the Arrow schema of every table as JSON, or write them to schemas/<table>.json.
    Schema(cli::schema::SchemaArgs),
    /// Run a SQL query over every table of the lake (DataFusion).
    Sql(cli::sql::SqlArgs),
    /// Merge each table's small files into large ones (safe beside running sinks and readers).
    Compact(cli::compact::CompactArgs),
    /// Export SQL-selected samples as Parquet for another trainer: slime, verl, trl (kto/sft/gkd) or hf.
    Export(cli::export::ExportArgs),
    /// Ingest agent logs into `interactions` (and `dead_letters`) through the bus and the lake.
    Ingest(cli::ingest::IngestArgs),
    /// Train the policy on samples from the `samples` topic (default) or a SQL query over the lake.
    Train(cli::train::TrainArgs),
    /// Compute per-sample advantages and every loss component for selected samples under the current
    /// weights, without updating them ("is it learning, and from what?").
    Loss(cli::loss::LossArgs),
    /// The main job: a simulated student uses the agent for homework while the whole pipeline judges,
    /// extracts hints, trains and hot-swaps the served policy; prints the personalization score before
    /// and after, and writes a report.
    Demo(cli::demo::DemoArgs),
    /// PRM accuracy against the truth: judge the simulated student's turns of demo lakes with each
    /// judge (`rules`, or a TOML file with a [judge] table, e.g. an LLM behind an OpenAI-compatible
    /// endpoint) and compare the votes with the student's own checker; writes report.md, results.json
    /// and every judgment
    PrmEval(cli::prm_eval::PrmEvalArgs),
    /// Re-publish rows selected with SQL (interactions, signals, judgments, hints, teacher_logprobs or
    /// samples), keeping their ids and a lineage note: to the pipeline's topics on a real cluster, or into
    /// a fresh lake where the pipeline's stages run on them (votes and teacher log-probs come from the
    /// source lake's caches where the key matches).
    Replay(cli::replay::ReplayArgs),
    /// Compare methods offline on the same data: binary, OPD, combined, top-K OPD and sweeps, every arm
    /// from the same weights, samples, order and seeds; writes report.md, plots and Parquet results.
    Ablate(cli::ablate::AblateArgs),
    /// Run the pipeline's stages and lake sinks (all, or --only a subset).
    Run(cli::run::RunArgs),
}

/// Runs the command; an error prints its message and causes once each ([`user_message`]: an OS error
/// inside an I/O error is not repeated); a user error (bad flag value, config, input:
/// [`nextstate::error::Domain::User`]) never with a backtrace, whatever `RUST_BACKTRACE` says, any other
/// with the backtrace when one was captured. Exit code 1 on error.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let user = e.chain().find_map(|c| c.downcast_ref::<nextstate::Error>()).is_some_and(|ne| ne.domain() == nextstate::error::Domain::User);
            eprintln!("Error: {}", user_message(&e));
            // Not the user's: the backtrace too, when RUST_BACKTRACE captured one.
            if !user && e.backtrace().status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("\nStack backtrace:\n{}", e.backtrace());
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    // Freed libtorch buffers go back to the OS (bounded resident set); a user's own glibc setting wins.
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        nextstate::model::return_freed_memory();
    }
    // libtorch's large CPU buffers come from a cache of huge-page blocks (reused, not faulted in again).
    if let Some(cfg) = nextstate::model::cpu_allocator::config_from_env()? {
        nextstate::model::cpu_allocator::install(cfg)?;
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,rdkafka=warn".into()))
        .with_writer(std::io::stderr)
        // colour codes only for a person at a terminal, never in a log file or a pipe (and never with NO_COLOR)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()))
        .init();
    // These manage their own runtime and threads.
    let command = match Cli::parse().command {
        Command::Model(args) => return Ok(args.run()?),
        Command::Serve(args) => return Ok(args.run()?),
        Command::Proxy(args) => return Ok(args.run()?),
        other => other,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match command {
            Command::Model(_) | Command::Serve(_) | Command::Proxy(_) => unreachable!("handled above"),
            Command::Schema(args) => cli::schema::run(args),
            Command::Sql(args) => cli::sql::run(args).await,
            Command::Compact(args) => cli::compact::run(args),
            Command::Export(args) => cli::export::run(args).await,
            Command::Ingest(args) => cli::ingest::run(args).await,
            Command::Train(args) => cli::train::run(args).await,
            Command::Loss(args) => cli::loss::run(args).await,
            Command::Demo(args) => cli::demo::run(args).await,
            Command::PrmEval(args) => cli::prm_eval::run(args).await,
            Command::Replay(args) => cli::replay::run(args).await,
            Command::Ablate(args) => cli::ablate::run(args).await,
            Command::Run(args) => cli::run::run(args).await,
        }
    })
}
