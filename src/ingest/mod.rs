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
//!
//! [`Interaction`]: crate::schema::Interaction
//! [`DeadLetter`]: crate::schema::DeadLetter

pub mod canonical;
mod detect;
mod format;
pub mod normalize;
mod options;
mod output;
pub mod sessions;
mod stream;
mod timestamp;

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

use std::path::{Path, PathBuf};

pub use detect::{detect, detect_bytes, Detection, DEFAULT_HEAD_BYTES, DETECT_RECORDS};
pub use format::Format;
pub use openhands_v1::is_event_dir;
pub use options::IngestOptions;
pub use output::{FileSummary, IngestItem};
pub use stream::UTF8_BOM;
pub use stream::Compression;
pub use timestamp::parse_timestamp;
use sink::Sink;

use crate::{Error, Result};

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
