//! Ingest adapters: real agent logs → [`Interaction`] rows (one per assistant turn) or
//! [`DeadLetter`]s (one per record that cannot be used, with a reason). docs/method.md §1.
//!
//! One file per log format; all share [`normalize`] (message normalisation), [`canonical`] (content
//! keys) and [`sessions`] (session inference for logs without session ids). Every adapter is pure
//! apart from reading its input file: it hands each item to a callback and never panics on input.
//!
//! Memory: JSONL formats (`openclaw`, `openai-chat`, `agentbench`) are read line by line (a line may
//! be at most [`IngestOptions::max_line_bytes`]); JSON arrays (`tau-bench`, `openhands`) element by
//! element. Single-document formats (`swe-agent`, `mini-swe-agent`, `toolbench`) are read whole, up to
//! [`IngestOptions::max_document_bytes`] (default 512 MiB); a larger document is dead-lettered. A
//! trajectory's turns are emitted once the whole session is known (the last turn's next state and
//! `session_done` need it), so memory per session is about the size of that session.

pub mod canonical;
mod detect;
pub mod normalize;
pub mod sessions;
mod stream;

mod agentbench;
pub(crate) mod anthropic_messages;
mod anthropic_managed_agents;
mod claude_code;
mod codex;
pub(crate) mod items;
mod langsmith;
mod mini_swe_agent;
mod messages;
mod copilot_cli;
mod gemini_cli;
mod qwen_code;
mod cline;
mod kimi_cli;
mod aider;
mod goose;
mod opencode;
mod oasst;
mod openai_chat;
pub(crate) mod openai_responses;
mod openclaw;
mod openclaw_session;
mod openhands;
mod openhands_v1;
mod otel;
mod sink;
mod swe_agent;
mod tau_bench;
mod toolbench;
mod trajectory;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use detect::{detect, detect_bytes, Detection, DEFAULT_HEAD_BYTES, DETECT_RECORDS};
pub use stream::UTF8_BOM;
pub use stream::Compression;
pub(crate) use sink::{jsonl_objects, read_lines, read_object_lines, Record, Sink, Turn};

use crate::schema::{DeadLetter, Interaction, TurnType};
use crate::{Error, Result};

/// A supported log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Format {
    /// OpenClaw-RL record JSONL (`session_id, turn, timestamp, messages, prompt_text, response_text,
    /// tool_calls, next_state`).
    OpenClaw,
    /// JSONL of `{request, response}` OpenAI chat-completions logs (optional `headers`).
    OpenAiChat,
    /// tau-bench `historical_trajectories`: a JSON array of `{task_id, trial, reward, info, traj}`.
    TauBench,
    /// SWE-agent `.traj`: `{environment, trajectory[], history[], info}`.
    SweAgent,
    /// mini-swe-agent trajectory: `{info, messages[], trajectory_format}`.
    MiniSweAgent,
    /// OpenHands event stream: a JSON array of action/observation events.
    OpenHands,
    /// ToolBench answer file (`answer_generation.train_messages`, old `function_call` format).
    ToolBench,
    /// AgentBench run output JSONL (`{index, error, info, output: {history}, time}`).
    AgentBench,
    /// OpenClaw agent-runtime session transcript JSONL (pi session format v1–v3: header line,
    /// `parentId` tree of `message`/`compaction`/... entries).
    OpenClawSession,
    /// Claude Code session JSONL (`user`/`assistant`/`system`/... lines; responses split over lines
    /// sharing `message.id`; subagent files).
    ClaudeCode,
    /// OpenAI Codex CLI rollout JSONL (`{timestamp, type, payload}`: `session_meta`,
    /// `response_item`, `event_msg`, `turn_context`, `compacted`).
    Codex,
    /// JSONL of `{request, response}` OpenAI Responses API logs (input items, `previous_response_id`).
    OpenAiResponses,
    /// JSONL of `{request, response}` Anthropic Messages API logs (`system`, content blocks).
    AnthropicMessages,
    /// OpenHands V1 (software-agent-sdk) event JSONL (`kind`: `ActionEvent`, `ObservationEvent`, ...).
    OpenHandsV1,
    /// LangSmith runs: `{post, patch}` create/update payloads, a JSON array or JSONL of runs.
    LangSmith,
    /// OpenTelemetry GenAI spans: OTLP/JSON exports or SDK span dumps.
    Otel,
    /// Open Assistant conversation trees (oasst1/oasst2 `trees.jsonl` or `messages.jsonl`).
    Oasst,
    /// The generic fallback: one bare JSON array of chat messages (OpenAI or Anthropic shape).
    Messages,
    /// GitHub Copilot CLI session events (`session-state/<id>/events.jsonl`).
    CopilotCli,
    /// Gemini CLI chat recordings (`~/.gemini/tmp/<project hash>/chats/session-*.jsonl`, or the legacy
    /// `session-*.json` document).
    GeminiCli,
    /// Qwen Code chat recordings (`~/.qwen/projects/<project>/chats/<sessionId>.jsonl`: `uuid`/`parentUuid`
    /// records with Gemini `Content` messages).
    QwenCode,
    /// Cline / Roo Code task histories (`tasks/<task id>/api_conversation_history.json`: Anthropic
    /// messages with XML or native tool calls, or Roo Code's `{version: 2, messages}`).
    Cline,
    /// Kimi CLI context files (`~/.kimi/sessions/<work dir hash>/<session id>/context.jsonl`: one
    /// kosong message a line, plus `_system_prompt`/`_checkpoint`/`_usage` records).
    KimiCli,
    /// Aider logs: the markdown chat transcript `.aider.chat.history.md` (one session per launch) or
    /// the `--llm-history-file` log (`TO LLM` / `LLM RESPONSE` blocks).
    Aider,
    /// Goose session files (`~/.local/share/goose/sessions/<session id>.jsonl`: a metadata line, then
    /// one message a line with `text`/`toolRequest`/`toolResponse` content).
    Goose,
    /// OpenCode session storage (`storage/message/<session id>/<message id>.json` with the parts in
    /// `storage/part/<message id>/`): a folder per session.
    OpenCode,
    /// Anthropic Managed Agents session event logs (`client.beta.sessions.events.*`: one event, or a
    /// `[method, payload]` pair, a line; `user.*`/`agent.*`/`session.*`/`span.*` events).
    AnthropicManagedAgents,
}

impl Format {
    /// Every format, in documentation order.
    pub const ALL: [Format; 27] = [
        Format::OpenClaw,
        Format::OpenAiChat,
        Format::TauBench,
        Format::SweAgent,
        Format::MiniSweAgent,
        Format::OpenHands,
        Format::ToolBench,
        Format::AgentBench,
        Format::OpenClawSession,
        Format::ClaudeCode,
        Format::Codex,
        Format::OpenAiResponses,
        Format::AnthropicMessages,
        Format::OpenHandsV1,
        Format::LangSmith,
        Format::Otel,
        Format::Oasst,
        Format::Messages,
        Format::CopilotCli,
        Format::GeminiCli,
        Format::QwenCode,
        Format::Cline,
        Format::KimiCli,
        Format::Aider,
        Format::Goose,
        Format::OpenCode,
        Format::AnthropicManagedAgents,
    ];

    /// The name used on the command line and in `interactions.source_format`.
    pub fn name(self) -> &'static str {
        match self {
            Format::OpenClaw => "openclaw",
            Format::OpenAiChat => "openai-chat",
            Format::TauBench => "tau-bench",
            Format::SweAgent => "swe-agent",
            Format::MiniSweAgent => "mini-swe-agent",
            Format::OpenHands => "openhands",
            Format::ToolBench => "toolbench",
            Format::AgentBench => "agentbench",
            Format::OpenClawSession => "openclaw-session",
            Format::ClaudeCode => "claude-code",
            Format::Codex => "codex",
            Format::OpenAiResponses => "openai-responses",
            Format::AnthropicMessages => "anthropic-messages",
            Format::OpenHandsV1 => "openhands-v1",
            Format::LangSmith => "langsmith",
            Format::Otel => "otel",
            Format::Oasst => "oasst",
            Format::Messages => "messages",
            Format::CopilotCli => "copilot-cli",
            Format::GeminiCli => "gemini-cli",
            Format::QwenCode => "qwen-code",
            Format::Cline => "cline",
            Format::KimiCli => "kimi-cli",
            Format::Aider => "aider",
            Format::Goose => "goose",
            Format::OpenCode => "opencode",
            Format::AnthropicManagedAgents => "anthropic-managed-agents",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Format {
    type Err = Error;
    /// Parses a format name ([`Format::name`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the accepted values.
    fn from_str(s: &str) -> Result<Format> {
        Format::ALL
            .iter()
            .copied()
            .find(|f| f.name() == s.trim())
            .ok_or_else(|| crate::config_err!("unknown log format {s:?}; expected auto or one of {}", Format::ALL.map(Format::name).join(", ")))
    }
}

/// `--format`: a fixed format or `auto` (detect by structure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatChoice {
    /// Detect with [`detect`].
    Auto,
    /// This format.
    Fixed(Format),
}

impl std::str::FromStr for FormatChoice {
    type Err = Error;
    /// `auto` or a format name.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown name.
    fn from_str(s: &str) -> Result<FormatChoice> {
        if s.trim() == "auto" {
            Ok(FormatChoice::Auto)
        } else {
            Ok(FormatChoice::Fixed(s.parse()?))
        }
    }
}

/// One adapter output.
#[derive(Debug, Clone, PartialEq)]
pub enum IngestItem {
    /// An assistant turn.
    Interaction(Box<Interaction>),
    /// A record that could not be used (stage `ingest`).
    DeadLetter(Box<DeadLetter>),
}

/// Options shared by all adapters.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Turn type of a turn the log does not mark (used by `openai-chat`; docs/method.md §1 says this is
    /// configurable, the reference defaults to side). Other formats log only the agent's own turns,
    /// which are `main`.
    pub default_turn_type: TurnType,
    /// Ingest time (ms since the Unix epoch): `ingest_time` of every row, and `event_time` when the
    /// log has no timestamp.
    pub ingest_time_ms: i64,
    /// Longest JSONL line accepted, in bytes (default 256 MiB); longer lines are dead-lettered.
    pub max_line_bytes: usize,
    /// Largest single-document file (`.traj`, mini-swe-agent, ToolBench) read whole, in bytes
    /// (default 512 MiB); larger ones are dead-lettered.
    pub max_document_bytes: u64,
    /// Capacity of the session inferrer (`openai-chat` rows without a session id); see
    /// [`sessions::SessionInferrer`].
    pub session_cache: usize,
    /// Read at most this many bytes of a JSONL file (`ingest --follow`: up to the end of its last
    /// complete line, so a line being written is not read half); `None` reads everything.
    pub read_limit: Option<u64>,
    /// Raised to stop reading (Ctrl-C / SIGTERM): readers check it before each record (JSONL line,
    /// array element) and before handing on each item, and then return [`Error::Cancelled`]. A single
    /// record being parsed (one line or one whole document) is finished first. `None`: never stopped.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The tenant of every row (`ingest --tenant`); `None`: [`crate::schema::DEFAULT_TENANT`]. Checked
    /// by the caller ([`crate::schema::validate_tenant`]).
    pub tenant: Option<String>,
}

impl IngestOptions {
    /// Defaults with the given ingest time: unmarked turns are `main`, rows of the `default` tenant.
    pub fn new(ingest_time_ms: i64) -> IngestOptions {
        IngestOptions {
            default_turn_type: TurnType::Main,
            ingest_time_ms,
            max_line_bytes: 256 << 20,
            max_document_bytes: 512 << 20,
            session_cache: sessions::DEFAULT_CAPACITY,
            read_limit: None,
            stop: None,
            tenant: None,
        }
    }

    /// `Err(`[`Error::Cancelled`]`)` once [`IngestOptions::stop`] is raised.
    ///
    /// # Errors
    /// [`Error::Cancelled`] when a stop was requested.
    pub fn check_stop(&self) -> Result<()> {
        match &self.stop {
            Some(s) if s.load(std::sync::atomic::Ordering::Relaxed) => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }
}

/// What reading one file did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileSummary {
    /// The format read.
    pub format: Format,
    /// How the format was chosen (`--format auto`), if it was detected.
    pub detection: Option<String>,
    /// Bytes read.
    pub bytes: u64,
    /// Records read: lines (JSONL), array elements, or 1 for a single document.
    pub records: u64,
    /// Distinct sessions among the interactions (the ids are kept while the file is read).
    pub sessions: u64,
    /// Interactions emitted.
    pub interactions: u64,
    /// Dead letters emitted.
    pub dead_letters: u64,
    /// Dead letters by reason code.
    pub dead_letters_by_reason: BTreeMap<String, u64>,
    /// Named counts of what the adapter noticed or skipped without it being an error (blank lines,
    /// null observations, environment events, `state` as string/object, ...).
    pub counters: BTreeMap<String, u64>,
}

impl FileSummary {
    /// One-line summary with units.
    pub fn line(&self) -> String {
        format!(
            "{}: {} records, {} bytes → {} interactions in {} sessions, {} dead letters",
            self.format, self.records, self.bytes, self.interactions, self.sessions, self.dead_letters
        )
    }
}

/// Reads `path` in `format`, handing every interaction and dead letter to `out` in file order
/// (trajectory formats: a session's turns in turn order, once the session is read). `progress` is
/// called with the number of bytes read so far after each record.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or read; any error returned by `out`. Malformed
/// content is never an error: it becomes dead letters.
pub fn read_file(path: &Path, format: Format, opts: &IngestOptions, progress: &mut dyn FnMut(u64), out: &mut dyn FnMut(IngestItem) -> Result<()>) -> Result<FileSummary> {
    let mut sink = Sink::new(format, path, opts, out);
    match format {
        Format::OpenClaw => openclaw::read(path, &mut sink, progress)?,
        Format::OpenAiChat => openai_chat::read(path, &mut sink, progress)?,
        Format::TauBench => tau_bench::read(path, &mut sink, progress)?,
        Format::SweAgent => swe_agent::read(path, &mut sink, progress)?,
        Format::MiniSweAgent => mini_swe_agent::read(path, &mut sink, progress)?,
        Format::OpenHands => openhands::read(path, &mut sink, progress)?,
        Format::ToolBench => toolbench::read(path, &mut sink, progress)?,
        Format::AgentBench => agentbench::read(path, &mut sink, progress)?,
        Format::OpenClawSession => openclaw_session::read(path, &mut sink, progress)?,
        Format::ClaudeCode => claude_code::read(path, &mut sink, progress)?,
        Format::Codex => codex::read(path, &mut sink, progress)?,
        Format::OpenAiResponses => openai_responses::read(path, &mut sink, progress)?,
        Format::AnthropicMessages => anthropic_messages::read(path, &mut sink, progress)?,
        Format::OpenHandsV1 => openhands_v1::read(path, &mut sink, progress)?,
        Format::LangSmith => langsmith::read(path, &mut sink, progress)?,
        Format::Otel => otel::read(path, &mut sink, progress)?,
        Format::Oasst => oasst::read(path, &mut sink, progress)?,
        Format::Messages => messages::read(path, &mut sink, progress)?,
        Format::CopilotCli => copilot_cli::read(path, &mut sink, progress)?,
        Format::GeminiCli => gemini_cli::read(path, &mut sink, progress)?,
        Format::QwenCode => qwen_code::read(path, &mut sink, progress)?,
        Format::Cline => cline::read(path, &mut sink, progress)?,
        Format::KimiCli => kimi_cli::read(path, &mut sink, progress)?,
        Format::Aider => aider::read(path, &mut sink, progress)?,
        Format::Goose => goose::read(path, &mut sink, progress)?,
        Format::OpenCode => opencode::read(path, &mut sink, progress)?,
        Format::AnthropicManagedAgents => anthropic_managed_agents::read(path, &mut sink, progress)?,
    }
    Ok(sink.finish())
}

/// [`read_file`] with `--format auto` support: detects the format first (reading
/// [`DEFAULT_HEAD_BYTES`]) and records the choice and its reason in [`FileSummary::detection`].
///
/// # Errors
/// As [`read_file`]; [`Error::InvalidInput`] when `auto` cannot recognise the file.
pub fn read_path(
    path: &Path,
    choice: FormatChoice,
    opts: &IngestOptions,
    progress: &mut dyn FnMut(u64),
    out: &mut dyn FnMut(IngestItem) -> Result<()>,
) -> Result<FileSummary> {
    match choice {
        FormatChoice::Fixed(f) => read_file(path, f, opts, progress, out),
        FormatChoice::Auto => {
            let d = detect(path, DEFAULT_HEAD_BYTES)?;
            tracing::info!(file = %path.display(), format = %d.format, reason = %d.reason, "detected log format");
            let mut s = read_file(path, d.format, opts, progress, out)?;
            s.detection = Some(d.to_string());
            Ok(s)
        }
    }
}

/// File names `nextstate ingest DIR` reads when it walks a directory: logs (`.json`, `.jsonl`,
/// `.ndjson`, `.traj`, and Aider's `.aider.chat.history.md` / `.aider.llm.history`), compressed or not
/// (`.gz`, `.zst`).
pub fn is_log_file_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    let n = n.strip_suffix(".gz").or_else(|| n.strip_suffix(".zst")).unwrap_or(&n);
    [".json", ".jsonl", ".ndjson", ".traj", ".aider.chat.history.md", ".aider.llm.history"].iter().any(|e| n.ends_with(e))
}

/// The index of an OpenHands V1 persisted event file name, `event-<index, 5+ digits>-<event id>.json`.
pub(crate) fn event_file_index(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("event-")?.strip_suffix(".json")?;
    let (idx, id) = rest.split_once('-')?;
    (idx.len() >= 5 && !id.is_empty() && idx.bytes().all(|b| b.is_ascii_digit())).then(|| idx.parse().ok()).flatten()
}

/// Whether `dir` is an OpenHands V1 events folder (it holds `event-NNNNN-<id>.json` files): one
/// conversation, read as a whole by `--format openhands-v1`.
pub fn is_event_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()).any(|e| event_file_index(&e.file_name().to_string_lossy()).is_some())).unwrap_or(false)
}

/// Reason code of an input file whose format `--format auto` cannot recognise.
pub const UNDETECTED_FORMAT: &str = "undetected_format";
/// Reason code of an input path that does not exist (never did, or vanished before it was read).
pub const FILE_NOT_FOUND: &str = "file_not_found";
/// Reason code of an input file that cannot be opened or read (permissions, an I/O error, corrupt
/// compressed data). Records read before a read error are kept.
pub const UNREADABLE_FILE: &str = "unreadable_file";
/// Reason code of an input path that is neither a regular file nor a directory (FIFO, socket, device):
/// refused from its metadata without opening it, since opening a FIFO blocks until a writer comes.
pub const NOT_A_REGULAR_FILE: &str = "not_a_regular_file";

/// One input of `nextstate ingest`, as [`inputs`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A file (or an OpenHands V1 events folder) to read.
    Read {
        /// The path.
        path: PathBuf,
        /// Found by walking a directory (rather than named on the command line).
        walked: bool,
    },
    /// A path that is not read at all (each becomes one dead letter of stage `ingest` with this code).
    Skip {
        /// The path.
        path: PathBuf,
        /// [`FILE_NOT_FOUND`], [`UNREADABLE_FILE`] or [`NOT_A_REGULAR_FILE`].
        code: &'static str,
        /// What is wrong, for the dead letter and the console.
        reason: String,
    },
}

/// The reason code of an I/O error on an input path: [`FILE_NOT_FOUND`] or [`UNREADABLE_FILE`].
pub fn io_skip_reason(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::NotFound {
        FILE_NOT_FOUND
    } else {
        UNREADABLE_FILE
    }
}

/// What kind of non-regular file `t` is, in words ("FIFO", "socket", ...).
fn special_kind(t: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    let _ = t;
    "not a regular file"
}

/// The inputs to ingest for `paths`, never failing on one bad path: a regular file as given; a
/// directory walked recursively (entries in name order, hidden entries skipped), keeping the files
/// [`is_log_file_name`] accepts, and an OpenHands V1 events folder ([`is_event_dir`]) as one input.
/// A path that does not exist or cannot be read, and one that is neither a regular file nor a
/// directory (FIFO, socket, device: decided from its metadata, never opened), is an
/// [`Input::Skip`] with its reason; so is a directory entry the walk cannot read. Symbolic links
/// named on the command line are followed; inside a walked directory they are not.
pub fn inputs(paths: &[PathBuf]) -> Vec<Input> {
    let mut out = vec![];
    for p in paths {
        let meta = match std::fs::metadata(p) {
            Ok(m) => m,
            Err(e) => {
                out.push(Input::Skip { path: p.clone(), code: io_skip_reason(&e), reason: format!("{}: {e}", p.display()) });
                continue;
            }
        };
        if meta.is_file() {
            out.push(Input::Read { path: p.clone(), walked: false });
            continue;
        }
        if !meta.is_dir() {
            let reason = format!("{}: {}, not a regular file: refused without opening it", p.display(), special_kind(meta.file_type()));
            out.push(Input::Skip { path: p.clone(), code: NOT_A_REGULAR_FILE, reason });
            continue;
        }
        // Hidden entries are skipped, except Aider's logs (`.aider.chat.history.md` in each repository).
        let shown = |n: &str| !n.starts_with('.') || (n.starts_with(".aider") && is_log_file_name(n));
        let mut walk = walkdir::WalkDir::new(p).sort_by_file_name().into_iter().filter_entry(move |e| e.depth() == 0 || shown(&e.file_name().to_string_lossy()));
        while let Some(e) = walk.next() {
            let e = match e {
                Ok(e) => e,
                Err(e) => {
                    let path = e.path().map(Path::to_path_buf).unwrap_or_else(|| p.clone());
                    let io = e.into_io_error().unwrap_or_else(|| std::io::Error::other("directory loop"));
                    out.push(Input::Skip { code: io_skip_reason(&io), reason: format!("{}: {io}", path.display()), path });
                    continue;
                }
            };
            if e.file_type().is_dir() && (is_event_dir(e.path()) || opencode::is_message_dir(e.path())) {
                out.push(Input::Read { path: e.into_path(), walked: true });
                walk.skip_current_dir();
            } else if let Some(sessions) = e.file_type().is_dir().then(|| opencode::storage_sessions(e.path())).flatten() {
                // An OpenCode storage folder: its sessions, and none of its other files.
                out.extend(sessions.into_iter().map(|path| Input::Read { path, walked: true }));
                walk.skip_current_dir();
            } else if e.file_type().is_file() && is_log_file_name(&e.file_name().to_string_lossy()) {
                out.push(Input::Read { path: e.into_path(), walked: true });
            }
        }
    }
    out
}

/// [`inputs`] for callers that want every path good: the inputs to read, or the first path that
/// [`inputs`] skips. The flag is true for inputs found by walking.
///
/// # Errors
/// [`Error::InvalidInput`] naming the first path [`inputs`] skips and why.
pub fn expand_paths(paths: &[PathBuf]) -> Result<Vec<(PathBuf, bool)>> {
    inputs(paths)
        .into_iter()
        .map(|i| match i {
            Input::Read { path, walked } => Ok((path, walked)),
            Input::Skip { reason, .. } => Err(Error::InvalidInput(reason)),
        })
        .collect()
}

/// Parses a log timestamp: epoch seconds or milliseconds (numbers above 1e11 are taken as ms),
/// RFC 3339, or a zone-less `YYYY-MM-DD[T ]HH:MM:SS[.f]` (read as UTC). Returns ms since the epoch.
pub fn parse_timestamp(v: &serde_json::Value) -> Option<i64> {
    match v {
        serde_json::Value::Number(n) => {
            let x = n.as_f64()?;
            if !x.is_finite() || x <= 0.0 {
                return None;
            }
            Some(if x > 1e11 { x as i64 } else { (x * 1000.0) as i64 })
        }
        serde_json::Value::String(s) => parse_time_str(s),
        _ => None,
    }
}

fn parse_time_str(s: &str) -> Option<i64> {
    let s = s.trim();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_millis());
    }
    for fmt in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, fmt) {
            return Some(t.and_utc().timestamp_millis());
        }
    }
    s.parse::<f64>().ok().and_then(|x| parse_timestamp(&serde_json::json!(x)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn timestamps() {
        assert_eq!(parse_timestamp(&json!(1_737_159_055_712i64)), Some(1_737_159_055_712));
        assert_eq!(parse_timestamp(&json!(1_738_046_713)), Some(1_738_046_713_000));
        assert_eq!(parse_timestamp(&json!("2025-01-27T22:44:56.900854")), Some(1_738_017_896_900));
        assert_eq!(parse_timestamp(&json!("2025-01-27 22:44:56")), Some(1_738_017_896_000));
        assert_eq!(parse_timestamp(&json!("2025-01-27T22:44:56Z")), Some(1_738_017_896_000));
        assert_eq!(parse_timestamp(&json!("2025-01-27T23:44:56+01:00")), Some(1_738_017_896_000));
        assert_eq!(parse_timestamp(&json!("yesterday")), None);
        assert_eq!(parse_timestamp(&json!(null)), None);
    }

    #[cfg(unix)]
    #[test]
    fn inputs_skip_missing_and_special_paths_without_opening_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let log = d.join("a.jsonl");
        std::fs::write(&log, b"{}\n").unwrap();
        let fifo = d.join("pipe.jsonl");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let walked = d.join("walked");
        std::fs::create_dir(&walked).unwrap();
        std::fs::write(walked.join("b.json"), b"[]").unwrap();
        std::fs::write(walked.join("notes.txt"), b"x").unwrap();
        let missing = d.join("gone.jsonl");
        let got = inputs(&[log.clone(), fifo.clone(), missing.clone(), walked.clone(), PathBuf::from("/dev/null")]);
        let codes: Vec<(PathBuf, &str)> = got
            .iter()
            .map(|i| match i {
                Input::Read { path, walked } => (path.clone(), if *walked { "walked" } else { "read" }),
                Input::Skip { path, code, .. } => (path.clone(), *code),
            })
            .collect();
        assert_eq!(
            codes,
            vec![
                (log.clone(), "read"),
                (fifo.clone(), NOT_A_REGULAR_FILE),
                (missing.clone(), FILE_NOT_FOUND),
                (walked.join("b.json"), "walked"),
                (PathBuf::from("/dev/null"), NOT_A_REGULAR_FILE),
            ]
        );
        let Input::Skip { reason, .. } = &got[1] else { unreachable!() };
        assert_eq!(reason, &format!("{}: a FIFO (named pipe), not a regular file: refused without opening it", fifo.display()));
        let Input::Skip { reason, .. } = &got[4] else { unreachable!() };
        assert!(reason.contains("a character device"), "{reason}");
        assert!(matches!(expand_paths(&[log.clone(), missing]), Err(Error::InvalidInput(m)) if m.contains("gone.jsonl")));
    }

    #[test]
    fn format_names_round_trip() {
        for f in Format::ALL {
            assert_eq!(f.name().parse::<Format>().unwrap(), f);
        }
        assert_eq!("auto".parse::<FormatChoice>().unwrap(), FormatChoice::Auto);
        assert!("csv".parse::<Format>().is_err());
    }
}
