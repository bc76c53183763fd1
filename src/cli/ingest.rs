//! `nextstate ingest`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use nextstate::runtime::Stop;

use super::common::{DataArgs, MetricsArgs, load_pipeline, outln};

/// `nextstate ingest`'s arguments.
#[derive(Args)]
pub struct IngestArgs {
    /// Log format: auto (detected per file), openclaw, openai-chat, tau-bench, swe-agent,
    /// mini-swe-agent, openhands, toolbench, agentbench, openclaw-session, claude-code, codex,
    /// openai-responses, anthropic-messages, openhands-v1, langsmith, otel, oasst.
    #[arg(long, default_value = "auto")]
    format: String,
    /// Turn type of turns the log does not mark (main = trainable).
    #[arg(long, default_value = "main")]
    default_turn_type: String,
    /// Tenant (agent or user of a fleet) of every turn read: 1-64 characters from
    /// [A-Za-z0-9_.@-], beginning with a letter or digit. Default: the tenant the log names
    /// (OpenAI `user` / `safety_identifier`, Anthropic `metadata.user_id`), else `default`.
    #[arg(long)]
    tenant: Option<String>,
    /// Only produce to Kafka; do not run the lake sinks in this process.
    #[arg(long)]
    no_sink: bool,
    /// Pipeline file (for bus, lake and sink settings). Default: built-in.
    #[arg(long)]
    pipeline: Option<PathBuf>,
    #[command(flatten)]
    data: DataArgs,
    /// Log files and directories (walked recursively; `.gz` and `.zst` files are decompressed).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Follow the files as agents append to them: emit each new turn once, keep read positions
    /// across restarts (`<lake>/_follow/positions.json`), pick up new files; until Ctrl-C.
    #[arg(long)]
    follow: bool,
    /// `--follow`: milliseconds between two looks at the files.
    #[arg(long, default_value_t = 1000)]
    poll_ms: u64,
    /// `--follow`: a session's last turn is emitted once its file is unchanged this long (ms).
    #[arg(long, default_value_t = 10_000)]
    settle_ms: u64,
    /// `--follow`: exit once every file is unchanged this long (ms) and everything is emitted.
    #[arg(long)]
    exit_when_idle_ms: Option<u64>,
    /// `--follow`: the positions file (default `<lake>/_follow/positions.json`).
    #[arg(long)]
    positions: Option<PathBuf>,
    #[command(flatten)]
    metrics: MetricsArgs,
}

pub async fn run(args: IngestArgs) -> Result<()> {
    let IngestArgs { format, default_turn_type, tenant, no_sink, pipeline, data, files, follow, poll_ms, settle_ms, exit_when_idle_ms, positions, metrics } = args;
    let cfg = load_pipeline(&pipeline, &data)?;
    let choice: nextstate::ingest::FormatChoice = format.parse()?;
    let format = match choice {
        nextstate::ingest::FormatChoice::Auto => None,
        nextstate::ingest::FormatChoice::Fixed(f) => Some(f),
    };
    let default_turn_type = nextstate::schema::TurnType::parse(&default_turn_type)
        .with_context(|| format!("--default-turn-type must be main or side, got {default_turn_type}"))?;
    let stop = Stop::default();
    stop.on_signals_second_exits();
    metrics.serve(&stop).await?;
    let r = if follow {
        let args = nextstate::stages::follow::FollowArgs {
            paths: files,
            format,
            default_turn_type,
            poll: std::time::Duration::from_millis(poll_ms),
            settle: std::time::Duration::from_millis(settle_ms),
            exit_when_idle: exit_when_idle_ms.map(std::time::Duration::from_millis),
            state: positions,
            sink: !no_sink,
            tenant,
        };
        nextstate::stages::follow::follow(&cfg, &args, stop).await.context("ingest --follow failed")?
    } else {
        let args = nextstate::stages::source::IngestArgs { files, format, default_turn_type, sink: !no_sink, progress: true, tenant };
        nextstate::stages::source::ingest(&cfg, &args, stop).await.context("ingest failed")?
    };
    outln!("{}", r.line());
    for (t, s) in &r.sinks {
        outln!("sink {t}: {}", s.line());
    }
    if r.stopped {
        // Not an error with a backtrace: the user asked for it; the status says it is partial.
        eprintln!("ingest: stopped by a signal before every input was read (what was read is kept; run it again for the rest)");
        std::process::exit(1);
    }
    Ok(())
}
