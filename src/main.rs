//! The `nextstate` command line.
use std::path::PathBuf;

use std::io::{IsTerminal, Write};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use nextstate::config::PipelineConfig;
use nextstate::lake::Lake;
use nextstate::runtime::Stop;
use nextstate::sql::OutputFormat;

/// nextstate: turn agents' next states into training signal and train the policy online.
#[derive(Parser)]
#[command(name = "nextstate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Writes `text` to stdout; a closed stdout (`nextstate sql ... | head`) ends the process quietly with
/// exit code 0, as a command-line tool in a pipe does, instead of a panic.
fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("Error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

/// `print!` through [`emit`].
macro_rules! out {
    ($($arg:tt)*) => { emit(&format!($($arg)*)) };
}

/// `println!` through [`emit`].
macro_rules! outln {
    () => { emit("\n") };
    ($($arg:tt)*) => { emit(&(format!($($arg)*) + "\n")) };
}

/// Where the data lives (shared by the commands that touch the bus or the lake).
#[derive(Args, Clone, Debug, Default)]
struct DataArgs {
    /// Kafka bootstrap servers (HOST:PORT,...). Without it: an embedded in-process mock cluster.
    #[arg(long, env = "NEXTSTATE_BROKERS")]
    brokers: Option<String>,
    /// Lake folder (default: the pipeline's, else ./lake).
    #[arg(long, env = "NEXTSTATE_LAKE")]
    lake: Option<PathBuf>,
    /// Prefix of every topic name.
    #[arg(long, env = "NEXTSTATE_TOPIC_PREFIX")]
    topic_prefix: Option<String>,
    /// Static consumer-group membership: a stable name of this process, unique among those sharing
    /// its groups; a restarted process then takes over its partitions at once ([bus] group_instance_id).
    #[arg(long, env = "NEXTSTATE_GROUP_INSTANCE_ID")]
    group_instance_id: Option<String>,
    /// A librdkafka setting for the cluster at --brokers, `KEY=VALUE` (repeatable), e.g.
    /// `security.protocol=SASL_SSL`; added to the pipeline's [bus.properties].
    #[arg(long = "kafka-property", value_parser = nextstate::net::parse_key_value)]
    kafka_properties: Vec<(String, String)>,
    /// A librdkafka setting read from an environment variable, `KEY=VARIABLE` (repeatable), e.g.
    /// `sasl.password=KAFKA_PASSWORD`; added to the pipeline's [bus.secret_env].
    #[arg(long = "kafka-secret-env", value_parser = nextstate::net::parse_key_value)]
    kafka_secret_env: Vec<(String, String)>,
    /// Extra CA certificates (PEM) trusted by every HTTP client (judge, hint, teacher, reloads),
    /// besides the platform's roots and SSL_CERT_FILE ([tls] ca_file); a server's own certificate
    /// listed there (self-signed included) is pinned.
    #[arg(long, env = "NEXTSTATE_CA_FILE")]
    ca_file: Option<PathBuf>,
}

impl DataArgs {
    fn apply(&self, cfg: &mut PipelineConfig) {
        if let Some(b) = &self.brokers {
            cfg.bus.brokers = Some(b.clone());
        }
        if let Some(l) = &self.lake {
            cfg.lake = l.clone();
        }
        if let Some(p) = &self.topic_prefix {
            cfg.bus.topic_prefix = p.clone();
        }
        if let Some(g) = &self.group_instance_id {
            cfg.bus.group_instance_id = Some(g.clone());
        }
        cfg.bus.properties.extend(self.kafka_properties.iter().cloned());
        cfg.bus.secret_env.extend(self.kafka_secret_env.iter().cloned());
        if let Some(c) = &self.ca_file {
            cfg.tls.ca_file = Some(c.clone());
        }
    }
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
    Schema {
        /// Write one file per table into this folder instead of printing.
        #[arg(long)]
        write: Option<PathBuf>,
    },
    /// Run a SQL query over every table of the lake (DataFusion).
    Sql {
        /// Lake folder or object-storage URL (default: the pipeline's lake, else ./lake). It must exist.
        #[arg(long, env = "NEXTSTATE_LAKE")]
        lake: Option<PathBuf>,
        /// Pipeline file whose lake to query (when --lake is not given).
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Output format: table, csv (nested values as JSON text) or json (JSON Lines; NaN and
        /// infinities as the strings "NaN", "Infinity", "-Infinity").
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        format: OutputFormat,
        /// The query, e.g. "SELECT kind, count(*) FROM signals GROUP BY kind", or `-` to read it from
        /// standard input. Queries only: COPY, INSERT, CREATE, DROP and SET are refused.
        query: String,
    },
    /// Merge each table's small files into large ones (safe beside running sinks and readers).
    Compact {
        /// Lake folder.
        #[arg(long, env = "NEXTSTATE_LAKE", default_value = "lake")]
        lake: PathBuf,
        /// Only this table (default: every table of the lake).
        #[arg(long)]
        table: Option<String>,
        /// Merge adjacent small files until a merged file holds about this many MiB.
        #[arg(long, default_value_t = 128)]
        target_mb: u64,
        /// Delete the merged-away files only once the merged file is this many seconds old (readers
        /// that listed them before may still be reading them).
        #[arg(long, default_value_t = 600)]
        retain_secs: u64,
    },
    /// Export SQL-selected samples as Parquet for another trainer: slime, verl, trl (kto/sft/gkd) or hf.
    Export {
        /// Lake folder.
        #[arg(long, env = "NEXTSTATE_LAKE", default_value = "lake")]
        lake: PathBuf,
        /// The rows, e.g. "SELECT * FROM samples WHERE pipeline = 'combined'" (`hf`: any query).
        #[arg(long)]
        sql: String,
        /// Layout to write.
        #[arg(long = "to", value_enum)]
        to: nextstate::export::ExportFormat,
        /// Output folder (created; files of the same names are replaced).
        #[arg(long)]
        out: PathBuf,
        /// Fail when the query selects no rows (default: write empty files).
        #[arg(long)]
        require_rows: bool,
    },
    /// Ingest agent logs into `interactions` (and `dead_letters`) through the bus and the lake.
    Ingest {
        /// Log format: auto (detected per file), openclaw, openai-chat, tau-bench, swe-agent,
        /// mini-swe-agent, openhands, toolbench, agentbench, openclaw-session, claude-code, codex,
        /// openai-responses, anthropic-messages, openhands-v1, langsmith, otel, oasst.
        #[arg(long, default_value = "auto")]
        format: String,
        /// Turn type of turns the log does not mark (main = trainable).
        #[arg(long, default_value = "main")]
        default_turn_type: String,
        /// Tenant (agent or user of a fleet) of every turn read: 1-64 characters from
        /// [A-Za-z0-9_.-], beginning with a letter or digit. Default: `default`.
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
    },
    /// Train the policy on samples from the `samples` topic (default) or a SQL query over the lake.
    Train {
        /// Pipeline file (method, [trainer], [policy]).
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Read samples with this query instead of the topic, e.g.
        /// "SELECT * FROM samples WHERE pipeline = 'combined' ORDER BY event_time".
        #[arg(long, conflicts_with = "from_topic")]
        sql: Option<String>,
        /// Read samples from the `samples` topic (the default).
        #[arg(long)]
        from_topic: bool,
        /// Continue from the newest complete checkpoint of the run.
        #[arg(long)]
        resume: bool,
        /// Run id (checkpoint folder name; default: the pipeline name).
        #[arg(long)]
        run_id: Option<String>,
        /// Checkpoints folder.
        #[arg(long, default_value = "checkpoints")]
        checkpoints: PathBuf,
        /// Stop after this many optimizer steps.
        #[arg(long)]
        max_steps: Option<i64>,
        /// Exit once the topic is drained (topic source).
        #[arg(long)]
        until_idle: bool,
        #[command(flatten)]
        metrics: MetricsArgs,
        /// Append one JSON object per optimizer step (the `train_steps` row) to FILE, flushed per line
        /// (`tail -f FILE` follows the run).
        #[arg(long, value_name = "FILE")]
        metrics_jsonl: Option<PathBuf>,
        #[command(flatten)]
        data: DataArgs,
    },
    /// Compute per-sample advantages and every loss component for selected samples under the current
    /// weights, without updating them ("is it learning, and from what?").
    Loss {
        /// Pipeline file ([trainer], [policy]).
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Query returning full samples rows.
        #[arg(long)]
        sql: String,
        /// Method whose advantage to use (default: the pipeline's).
        #[arg(long, value_enum)]
        method: Option<nextstate::method::Method>,
        /// Weights to evaluate: a checkpoint folder (default: the pipeline's policy model).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        data: DataArgs,
    },
    /// The main job: a simulated student uses the agent for homework while the whole pipeline judges,
    /// extracts hints, trains and hot-swaps the served policy; prints the personalization score before
    /// and after, and writes a report.
    Demo {
        /// Pipeline file (default: pipelines/demo.toml when present, else built-in defaults).
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Output folder (lake, checkpoints, report.md, personalization.png); its lake and checkpoints
        /// are replaced.
        #[arg(long, default_value = "demo-out")]
        out: PathBuf,
        /// GSM8K problems.
        #[arg(long, default_value = "data/gsm8k_test.json")]
        gsm8k: PathBuf,
        /// Student turns answered by the agent before the students stop.
        #[arg(long, default_value_t = 88)]
        interactions: usize,
        /// The students keep working past --interactions until this many policy versions answered them
        /// (2: at least one trained checkpoint reached live traffic); 1 stops at --interactions.
        #[arg(long, default_value_t = 2)]
        min_versions_served: usize,
        /// Hard limit on student turns (default: 3 × --interactions).
        #[arg(long)]
        max_interactions: Option<usize>,
        /// Students working at once.
        #[arg(long, default_value_t = 8)]
        students: usize,
        /// Most agent turns per homework session (1: every trained prompt is a first request, like the
        /// held-out evaluation's; the student's reply is the next state).
        #[arg(long, default_value_t = 1)]
        max_turns: u32,
        /// Held-out problems the personalization score is measured on.
        #[arg(long, default_value_t = 48)]
        eval_problems: usize,
        /// Response length limit, tokens.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature of the students' sessions (evaluation is greedy).
        #[arg(long, default_value_t = 0.6)]
        temperature: f32,
        /// Seed.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// The student's word limit.
        #[arg(long, default_value_t = 80)]
        max_words: usize,
        /// The student also requires the right answer (SmolLM2-135M almost never has it).
        #[arg(long)]
        require_correct: bool,
        #[command(flatten)]
        data: DataArgs,
    },
    /// PRM accuracy against the truth: judge the simulated student's turns of demo lakes with each
    /// judge (`rules`, or a TOML file with a [judge] table, e.g. an LLM behind an OpenAI-compatible
    /// endpoint) and compare the votes with the student's own checker; writes report.md, results.json
    /// and every judgment
    PrmEval {
        /// Demo lake to read turns from (repeat for more; `nextstate demo` or an online ablation arm).
        #[arg(long, required = true)]
        lake: Vec<PathBuf>,
        /// A judge: `rules` or a TOML file with a [judge] table (repeat; each judges the same turns).
        #[arg(long)]
        judge: Vec<String>,
        /// A hint extractor: `rules` or a TOML file with a [hint] table (repeat; each reads the same turns).
        #[arg(long)]
        hint: Vec<String>,
        /// Most turns.
        #[arg(long, default_value_t = 120)]
        limit: usize,
        /// GSM8K file the demo's problems came from (default: the shipped data/gsm8k_test.json).
        #[arg(long)]
        gsm8k: Option<PathBuf>,
        /// The student's word limit (as the demo's --max-words).
        #[arg(long, default_value_t = 80)]
        max_words: usize,
        /// The student also requires the right answer (as the demo's --require-correct).
        #[arg(long)]
        require_correct: bool,
        /// Output folder.
        #[arg(long, default_value = "prm-eval")]
        out: PathBuf,
    },
    /// Re-publish rows selected with SQL (interactions, signals, judgments, hints, teacher_logprobs or
    /// samples), keeping their ids and a lineage note: to the pipeline's topics on a real cluster, or into
    /// a fresh lake where the pipeline's stages run on them (votes and teacher log-probs come from the
    /// source lake's caches where the key matches).
    Replay {
        /// Query over the source lake (--lake) returning full rows, e.g.
        /// "SELECT * FROM interactions WHERE session_id LIKE 'student-%'".
        #[arg(long)]
        sql: String,
        /// Table of the rows, and the topic they are published to.
        #[arg(long, default_value = "interactions")]
        to_topic: String,
        /// Pipeline file (bus settings; the stages run with --lake-out). Default: built-in.
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Write the rows into this fresh lake and run the pipeline's stages there until idle.
        #[arg(long)]
        lake_out: Option<PathBuf>,
        /// With --lake-out: the stages to run (default: the method's chain for interactions, none for
        /// other tables).
        #[arg(long, value_delimiter = ',')]
        only: Option<Vec<String>>,
        #[command(flatten)]
        data: DataArgs,
    },
    /// Compare methods offline on the same data: binary, OPD, combined, top-K OPD and sweeps, every arm
    /// from the same weights, samples, order and seeds; writes report.md, plots and Parquet results.
    Ablate {
        /// Ablation file (ablations/<name>.toml).
        #[arg(long)]
        config: PathBuf,
        /// Output folder (default: ablation-out/<name>); re-running resumes it.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only these arms in this process (run others in parallel processes with the same --out); an
        /// arm's name selects all its replicate seeds.
        #[arg(long, value_delimiter = ',')]
        arms: Option<Vec<String>>,
        /// Append one JSON object per optimizer step of every arm trained here (the `train_steps` row
        /// plus `arm`, `group` and `seed`) to FILE, flushed per line.
        #[arg(long, value_name = "FILE")]
        metrics_jsonl: Option<PathBuf>,
    },
    /// Run the pipeline's stages and lake sinks (all, or --only a subset).
    Run {
        /// Pipeline file (pipelines/*.toml). Default: the built-in combined pipeline.
        #[arg(long)]
        pipeline: Option<PathBuf>,
        /// Comma-separated subset of: serve, proxy, signals, judge, hint, teacher, train, sinks, reload
        /// (the reload follower: loads each checkpoint of the `checkpoints` topic into the servers of
        /// `[serve] reload_urls` / `url`). Default: all but reload; with --until-idle, all but serve,
        /// proxy (unbounded inputs) and reload.
        #[arg(long, value_delimiter = ',')]
        only: Option<Vec<String>>,
        /// Exit once every input is processed (batch use and tests).
        #[arg(long)]
        until_idle: bool,
        /// Checkpoints folder of the trainer.
        #[arg(long, default_value = "checkpoints")]
        checkpoints: PathBuf,
        /// Trainer run id (default: the pipeline name).
        #[arg(long)]
        run_id: Option<String>,
        /// Resume the trainer from its newest checkpoint (and serve that checkpoint).
        #[arg(long)]
        resume: bool,
        #[command(flatten)]
        metrics: MetricsArgs,
        #[command(flatten)]
        data: DataArgs,
    },
}

/// `--metrics-addr`, on the long-running commands without a listener of their own.
#[derive(Args, Clone, Debug, Default)]
struct MetricsArgs {
    /// Serve this process's Prometheus metrics at http://HOST:PORT/metrics (docs/metrics.md).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<String>,
}

impl MetricsArgs {
    /// Starts the `--metrics-addr` endpoint when one is given (until `stop`).
    async fn serve(&self, stop: &Stop) -> Result<()> {
        if let Some(a) = &self.metrics_addr {
            nextstate::stages::metrics_http::serve_metrics(a, stop.clone()).await.context("--metrics-addr")?;
        }
        Ok(())
    }
}

fn load_pipeline(path: &Option<PathBuf>, data: &DataArgs) -> Result<PipelineConfig> {
    let mut cfg = match path {
        Some(p) => PipelineConfig::load(p)?,
        None => PipelineConfig::embedded_default(),
    };
    data.apply(&mut cfg);
    cfg.validate()?;
    cfg.tls.apply()?;
    Ok(cfg)
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

/// `e`'s message and causes joined by ": " (as anyhow's `{:#}`), leaving out a cause whose text the
/// message before it already contains: thiserror's `#[error("sql: {0}")]` wrappers print their source in
/// their own text, and DataFusion nests one error in another with the same text, so `{:#}` would print a
/// schema error's list of valid fields four times.
fn user_message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if previous.is_empty() || !previous.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        previous = text;
    }
    out
}

fn run() -> Result<()> {
    // Freed libtorch buffers go back to the OS (bounded resident set); a user's own glibc setting wins.
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        nextstate::model::return_freed_memory();
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,rdkafka=warn".into()))
        .with_writer(std::io::stderr)
        // colour codes only for a person at a terminal, never in a log file or a pipe (and never with NO_COLOR)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()))
        .init();
    let cli = Cli::parse();
    // These manage their own runtime and threads.
    let cli = match cli.command {
        Command::Model(args) => return Ok(args.run()?),
        Command::Serve(args) => return Ok(args.run()?),
        Command::Proxy(args) => return Ok(args.run()?),
        other => Cli { command: other },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match cli.command {
            Command::Model(_) | Command::Serve(_) | Command::Proxy(_) => unreachable!("handled above"),
            Command::Schema { write } => {
                for (name, s) in nextstate::schema::all_schemas() {
                    let json = serde_json::to_string_pretty(&nextstate::schema::schema_json(&s))?;
                    match &write {
                        Some(dir) => {
                            std::fs::create_dir_all(dir)?;
                            std::fs::write(dir.join(format!("{name}.json")), json + "\n")?;
                        }
                        None => outln!("{json}"),
                    }
                }
            }
            Command::PrmEval { lake, judge, hint, limit, gsm8k, max_words, require_correct, out } => {
                let judges = judge.iter().map(|j| nextstate::demo::prm_eval::JudgeSpec::parse(j)).collect::<nextstate::Result<Vec<_>>>()?;
                let hints = hint.iter().map(|h| nextstate::demo::prm_eval::HintSpec::parse(h)).collect::<nextstate::Result<Vec<_>>>()?;
                let opts = nextstate::demo::prm_eval::PrmEvalOptions {
                    lakes: lake,
                    judges,
                    hints,
                    limit,
                    gsm8k: gsm8k.unwrap_or_else(nextstate::demo::default_gsm8k_path),
                    preferences: nextstate::demo::Preferences { max_words, correct_answer: require_correct, ..Default::default() },
                    out: out.clone(),
                    command: std::env::args().collect::<Vec<_>>().join(" "),
                };
                let r = nextstate::demo::prm_eval::prm_eval_command(&opts).await?;
                for f in &r.judges {
                    outln!(
                        "prm-eval {}: turns={} usable={:.3} agreement={:.3} [{:.3}-{:.3}] ties={:.3} minus_precision={:.3} minus_recall={:.3} s_per_vote={:.2}",
                        f.name, f.turns, f.usable.estimate, f.agreement.estimate, f.agreement.low, f.agreement.high, f.ties.estimate, f.minus_precision.estimate, f.minus_recall.estimate, f.seconds_per_vote
                    );
                }
                for f in &r.hints {
                    outln!(
                        "prm-eval hint {}: usable={:.3} chosen_when_due={:.3} chosen_when_not_due={:.3} distinct_candidates={:.2} words={:.1} s_per_vote={:.2}",
                        f.name, f.usable.estimate, f.accepted_when_due.estimate, f.accepted_when_not_due.estimate, f.distinct_candidates_mean, f.hint_words_mean, f.seconds_per_vote
                    );
                }
                outln!("report: {}", out.join("report.md").display());
            }
            Command::Sql { lake, pipeline, format, query } => {
                let lake = match (lake, &pipeline) {
                    (Some(l), _) => l,
                    (None, Some(p)) => PipelineConfig::load(p)?.lake,
                    (None, None) => PathBuf::from("lake"),
                };
                let lake = Lake::open_existing(&lake)?;
                let query = if query == "-" {
                    std::io::read_to_string(std::io::stdin()).context("reading the query from standard input")?
                } else {
                    query
                };
                for (path, why) in nextstate::sql::stray_files(&lake)? {
                    eprintln!("note: {}: {}", path.display(), why.explain());
                }
                let batches = nextstate::sql::query(&lake, &query).await?;
                out!("{}", nextstate::sql::render(&batches, format)?);
                if format == OutputFormat::Table {
                    outln!();
                }
            }
            Command::Compact { lake, table, target_mb, retain_secs } => {
                let lake = Lake::open_existing(&lake)?;
                let mut tables = nextstate::schema::all_schemas();
                if let Some(t) = &table {
                    tables.retain(|(name, _)| name == t);
                    anyhow::ensure!(
                        !tables.is_empty(),
                        "--table {t}: not a lake table (tables: {})",
                        nextstate::schema::all_schemas().iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                    );
                }
                let opts = nextstate::lake::compact::CompactOptions { target_bytes: target_mb << 20, retain: std::time::Duration::from_secs(retain_secs) };
                for (t, s) in nextstate::lake::compact::compact(&lake, &tables, &opts)? {
                    outln!(
                        "compact {t}: files {} -> {} ({} merged into {}, {} rows), MB {:.1} -> {:.1}, covered files deleted={} kept={} (retain {retain_secs} s)",
                        s.files_before,
                        s.files_after,
                        s.files_merged,
                        s.merged,
                        s.rows_merged,
                        s.bytes_before as f64 / 1e6,
                        s.bytes_after as f64 / 1e6,
                        s.covered_deleted,
                        s.covered_kept
                    );
                }
            }
            Command::Export { lake, sql, to, out, require_rows } => {
                let opts = nextstate::export::ExportOptions { require_rows };
                let r = nextstate::export::export(&Lake::open_existing(&lake)?, &sql, to, &out, &opts).await?;
                outln!("export {}: selected={}", to.as_str(), r.selected);
                for f in &r.files {
                    outln!("export {}: {}", to.as_str(), f.summary());
                }
            }
            Command::Ingest { format, default_turn_type, tenant, no_sink, pipeline, data, files, follow, poll_ms, settle_ms, exit_when_idle_ms, positions, metrics } => {
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
            }
            Command::Train { pipeline, sql, from_topic: _, resume, run_id, checkpoints, max_steps, until_idle, data, metrics, metrics_jsonl } => {
                let cfg = load_pipeline(&pipeline, &data)?;
                let stop = Stop::default();
                stop.on_signals();
                metrics.serve(&stop).await?;
                let source = match sql {
                    Some(q) => nextstate::stages::train::TrainSource::Sql(q),
                    None => nextstate::stages::train::TrainSource::Topic,
                };
                let opts = nextstate::stages::train::TrainOptions { source, resume, run_id, checkpoints_dir: checkpoints, max_steps, metrics_jsonl, metrics_jsonl_extra: vec![] };
                let r = nextstate::stages::train::train_command(&cfg, &opts, until_idle, stop).await.context("training failed")?;
                outln!(
                    "train: steps={} samples_trained={} skipped_already_trained={} skipped_duplicates={} skipped_other_pipeline={} dropped={:?} skipped_steps={} skipped_samples={:?} resumed_from={:?} last_loss={:?}",
                    r.steps, r.samples_trained, r.skipped_already_trained, r.skipped_duplicates, r.skipped_other_pipeline, r.dropped, r.skipped_steps, r.skipped_samples, r.resumed_from, r.last_loss
                );
                for (v, p) in &r.checkpoints {
                    outln!("checkpoint v{v}: {p}");
                }
            }
            Command::Loss { pipeline, sql, method, checkpoint, json, data } => {
                let mut cfg = load_pipeline(&pipeline, &data)?;
                if let Some(m) = method {
                    cfg.method = m;
                }
                let lake = Lake::open(&cfg.lake)?;
                let samples = nextstate::stages::train::query_samples(&lake, &sql).await?;
                let report = nextstate::stages::train::loss_command(&cfg, checkpoint.as_deref(), &samples)?;
                if json {
                    outln!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    out!("{}", nextstate::stages::train::render_loss_report(&report));
                }
            }
            Command::Demo { pipeline, out, gsm8k, interactions, min_versions_served, max_interactions, students, max_turns, eval_problems, max_tokens, temperature, seed, max_words, require_correct, data } => {
                let pipeline = pipeline.or_else(|| Some(PathBuf::from("pipelines/demo.toml")).filter(|p| p.exists()));
                let cfg = load_pipeline(&pipeline, &data)?;
                let prefs = nextstate::demo::Preferences { max_words, correct_answer: require_correct, ..Default::default() };
                let opts = nextstate::demo::run::DemoOptions {
                    pipeline: cfg,
                    out: out.clone(),
                    gsm8k,
                    interactions,
                    min_versions_served,
                    max_interactions: max_interactions.unwrap_or(interactions.saturating_mul(3)),
                    students,
                    max_turns,
                    eval_problems,
                    max_tokens,
                    temperature,
                    seed,
                    split_seed: None,
                    preferences: prefs,
                    eval_last_only: false,
                    context: nextstate::demo::run::AgentContext::None,
                    train: true,
                };
                let stop = Stop::default();
                stop.on_signals();
                let s = nextstate::demo::run::run_demo(opts, stop).await.context("demo failed")?;
                outln!("\nnextstate demo — {} interactions in {} sessions, {:.0} s, {} failed requests", s.interactions, s.sessions, s.seconds, s.failed_requests);
                outln!("personalization score (held-out problems, all preferences met):");
                for e in &s.evaluations {
                    outln!("  version {:>2} after {:>3} interactions: {:.3}   (accuracy {:.3})", e.version, e.interactions, e.score.fraction_all_satisfied, e.score.accuracy);
                }
                outln!("before {:.3} → after {:.3}", s.before.fraction_all_satisfied, s.after.fraction_all_satisfied);
                outln!("result: {}", s.result_line);
                let q: Vec<String> = s.sessions_summary.first_answer_rate_by_quarter.iter().map(|q| format!("{q:.2}")).collect();
                outln!("sessions: {}; first answers meeting every preference, per quarter: {}", s.sessions_summary.until_stable_text(), q.join(" → "));
                for (n, c) in &s.run.stages {
                    outln!("stage {n}: {}", c.line());
                }
                if let Some(t) = &s.run.train {
                    outln!("train: steps={} samples_trained={} checkpoints={} reloads by the server={:?}", t.steps, t.samples_trained, t.checkpoints.len(), s.run.reloads);
                }
                outln!("report: {}", s.report.display());
            }
            Command::Replay { sql, to_topic, pipeline, lake_out, only, data } => {
                let cfg = load_pipeline(&pipeline, &data)?;
                let stop = Stop::default();
                stop.on_signals();
                let target = match lake_out {
                    Some(dir) => nextstate::ablate::ReplayTarget::Lake { dir, pipeline: cfg.clone(), stages: only },
                    None => nextstate::ablate::ReplayTarget::Bus { pipeline: cfg.clone() },
                };
                let opts = nextstate::ablate::ReplayOptions { source_lake: cfg.lake.clone(), sql, table: to_topic, target };
                let r = nextstate::ablate::replay(&opts, stop).await.context("replay failed")?;
                outln!(
                    "replay: table={} rows={} published={} written={} vote_cache_files={} teacher_cache_rows={} votes_cached={} teacher_cache_hits={}",
                    r.table, r.rows, r.published, r.written, r.vote_cache_files, r.teacher_cache_rows, r.votes_cached(), r.teacher_cache_hits()
                );
                if let Some(run) = &r.run {
                    for (n, c) in &run.stages {
                        outln!("stage {n}: {}", c.line());
                    }
                }
            }
            Command::Ablate { config, out, arms, metrics_jsonl } => {
                let config = nextstate::ablate::AblationConfig::load(&config)?;
                let out = out.unwrap_or_else(|| PathBuf::from("ablation-out").join(&config.name));
                let stop = Stop::default();
                stop.on_signals();
                let opts = nextstate::ablate::AblateOptions { config, out, arms, metrics_jsonl };
                let s = nextstate::ablate::run_ablation(&opts, stop).await.context("ablation failed")?;
                outln!("\nnextstate ablate — {:.0} s; personalization score per version (interactions trained on):", s.seconds);
                for arm in &s.reported {
                    let line: Vec<String> = s.checkpoints.iter().filter(|c| &c.arm == arm).map(|c| format!("v{}@{}: {:.3}", c.version, c.interactions_seen, c.score)).collect();
                    outln!("  {arm:<24} {}", line.join("  "));
                }
                if !s.missing.is_empty() {
                    outln!("not finished: {}", s.missing.join(", "));
                }
                outln!("final score per arm (mean over seeds, 95% CI):");
                for g in &s.groups {
                    let ci = g.low.zip(g.high).map(|(l, h)| format!("[{l:.3}-{h:.3}]")).unwrap_or_else(|| "(one seed)".into());
                    let v0 = s.versus_v0.iter().find(|p| p.a == g.group).map(|p| format!("; vs v0 {:+.3}, p = {}", p.mean_diff, nextstate::stats::p_text(p.p_value))).unwrap_or_default();
                    outln!("  {:<24} {:.3} {ci} over {} seed(s){v0}", g.group, g.mean, g.seeds.len());
                }
                if let Some(o) = &s.ordering {
                    outln!("{}", o.replace("**", ""));
                }
                outln!("report: {}\nresults: {}", s.report.display(), s.results.display());
            }
            Command::Run { pipeline, only, until_idle, checkpoints, run_id, resume, data, metrics } => {
                let cfg = load_pipeline(&pipeline, &data)?;
                let stop = Stop::default();
                stop.on_signals();
                metrics.serve(&stop).await?;
                let only = only.or_else(|| {
                    until_idle.then(|| ["signals", "judge", "hint", "teacher", "train", "sinks"].iter().map(|s| s.to_string()).collect())
                });
                let opts = nextstate::stages::run::RunOptions { only, until_idle, checkpoints_dir: Some(checkpoints), run_id, resume };
                let report = nextstate::stages::run::run_pipeline(&cfg, &opts, stop).await.context("pipeline run failed")?;
                for (n, c) in &report.republished {
                    eprintln!("republished from lake for {n}: {c}");
                }
                if report.sinks_added {
                    eprintln!("note: the lake sinks ran too: without --brokers the topics live only in this process, so every row produced reaches the lake through them");
                }
                for (n, c) in &report.stages {
                    outln!("stage {n}: {}", c.line());
                }
                for (t, s) in &report.sinks {
                    outln!("sink {t}: {}", s.line());
                }
                if let Some(t) = &report.train {
                    outln!(
                        "train: steps={} samples_trained={} checkpoints={:?} dropped={:?} skipped_steps={} skipped_samples={:?}",
                        t.steps,
                        t.samples_trained,
                        t.checkpoints.iter().map(|c| c.0).collect::<Vec<_>>(),
                        t.dropped,
                        t.skipped_steps,
                        t.skipped_samples
                    );
                }
                if let Some(p) = &report.proxy {
                    outln!("proxy: {p:?}");
                }
            }
        }
        Ok(())
    })
}
