//! `--format auto`: choose the format by the structure of the file's first bytes.
//!
//! The head (default 1 MiB) is parsed with serde_json as far as it goes; a probe records the key
//! paths it meets (to depth 3; of arrays only the first element), e.g. `[].traj`, `history`,
//! `info.exit_status`, `output.history`. A head cut mid-document is fine: the keys seen before the
//! cut are kept. JSONL files are recognised by their first record; when the head's first value matches
//! no rule (stray bytes before the first record, a corrupt first line), the next lines that start a JSON
//! object or array are tried in turn, at most [`DETECT_RECORDS`] of them, and the first that matches
//! decides (the readers dead-letter the bad lines and read the rest). A leading UTF-8 byte-order mark is
//! skipped. Rules, first match wins:
//!
//! | structure | format |
//! |---|---|
//! | array whose first element has `traj` and `task_id` or `reward` | tau-bench |
//! | array whose first element has `source` and `action` or `observation` | openhands |
//! | object with `trajectory` (steps with `action`/`observation`) or `history` + `info` | swe-agent |
//! | object with `trajectory_format`, or `messages` + `info`, or starting with `info.exit_status` | mini-swe-agent |
//! | object with `answer_generation`, or a search `tree` with `win`/`compare_candidates` | toolbench |
//! | object with `request` and `response` | openai-chat |
//! | object with `session_id` and `turn` and `messages`/`response_text`/`prompt_text` | openclaw |
//! | object with `output` and `index`/`error` | agentbench |
//! | array whose first element has `role` and `content` or `tool_calls` | messages (the generic fallback) |
//!
//! Checked before those (the formats of 2026; `type` is the first record's `type` value):
//!
//! | structure | format |
//! |---|---|
//! | object with `resourceSpans`, or `spans` of span objects (`context`/`traceId` + `attributes`); array of such spans | otel |
//! | object with `post`/`patch` run lists, or a run (`run_type` + `trace_id`/`dotted_order`); array of runs | langsmith |
//! | array whose first element has `role` and `ts` (ms); object `{version, messages}` of such messages | cline |
//! | first record `[method, payload]` with a Managed Agents event payload (or `{data/events: [...]}`), or an event `{id, type: user.*/agent.*/session.*/span.*, processed_at}` without `data` | anthropic-managed-agents |
//! | first record `{role: "_system_prompt" / "_checkpoint" / "_usage"}` | kimi-cli |
//! | object `{id, sessionID, role, time: {created}}` (an OpenCode message file; a `message/<session id>` folder is OpenCode too) | opencode |
//! | first record `{working_dir, description, message_count}` without `role` (session metadata), or `{role, created, content}` with typed parts and no `timestamp` | goose |
//! | records `{timestamp, type, payload}`, or a first line `{id, timestamp, instructions}` without `type` | codex |
//! | records `{type, data, id, timestamp, parentId}` with `type` `session.*`/`user.*`/`assistant.*`/`system.*`/`tool.*` | copilot-cli |
//! | first record `{sessionId, projectHash}` (a chat recording's header, or the legacy document with `messages`) | gemini-cli |
//! | records with `message_tree_id` and `prompt`/`message_id` | oasst |
//! | records with `kind`, `source`, `id`, `timestamp` | openhands-v1 |
//! | first record `type: "session"` with `cwd`, or entries with `parentId` and `message.role` | openclaw-session |
//! | records with `sessionId` and `uuid`, and a Gemini `message.parts`, a `systemPayload` or `type: "tool_result"` | qwen-code |
//! | records with `sessionId` and `uuid`/`parentUuid`, or `type` `file-history-snapshot`/`summary` + `leafUuid`/`queue-operation` | claude-code |
//! | `request` + `response` with `request.input` or `response.output` | openai-responses |
//! | `request` + `response` with `response.content` + `response.stop_reason` or `request.system`/`max_tokens` without `response.choices` | anthropic-messages |
//!
//! Text formats, checked first on the first non-blank line:
//!
//! | first line | format |
//! |---|---|
//! | `# aider chat started at …` (chat transcript), `TO LLM <time>` / `LLM RESPONSE <time>` (LLM history) | aider |

use std::io::Read;
use std::path::Path;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::format::Format;
use crate::{Error, Result};

/// Bytes read by [`super::read_path`] for detection.
pub const DEFAULT_HEAD_BYTES: usize = 1 << 20;

/// Lines that start a JSON value tried after the first value when it matches no rule (module docs).
pub const DETECT_RECORDS: usize = 16;

/// The detected format and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    /// The format chosen.
    pub format: Format,
    /// The structure that decided it, e.g. `array of objects with keys traj, task_id`.
    pub reason: String,
}

impl std::fmt::Display for Detection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.format, self.reason)
    }
}

const MAX_DEPTH: usize = 3;
const MAX_PATHS: usize = 4096;

struct Probe<'a> {
    paths: &'a mut Vec<String>,
    prefix: String,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let paths = self.paths;
        while let Some(key) = map.next_key::<String>()? {
            let path = format!("{}{key}", self.prefix);
            if paths.len() < MAX_PATHS {
                paths.push(path.clone());
            }
            if self.depth + 1 < MAX_DEPTH {
                map.next_value_seed(Probe { paths: &mut *paths, prefix: format!("{path}."), depth: self.depth + 1 })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let paths = self.paths;
        let prefix = format!("{}[].", self.prefix.trim_end_matches('.'));
        if self.depth < MAX_DEPTH && seq.next_element_seed(Probe { paths: &mut *paths, prefix, depth: self.depth + 1 })?.is_none() {
            return Ok(());
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> std::result::Result<(), E> {
        Ok(())
    }
}

/// The key paths of the first JSON value in `head` (see the module doc), and whether it is an array.
pub(crate) fn probe(head: &[u8]) -> (bool, Vec<String>) {
    let first = head.iter().find(|b| !b.is_ascii_whitespace()).copied();
    let mut paths = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(head);
    // A cut head ends in an EOF error: the paths recorded up to the cut are what we want.
    let _ = Probe { paths: &mut paths, prefix: String::new(), depth: 0 }.deserialize(&mut de);
    (first == Some(b'['), paths)
}

/// Chooses a format from the structure of the first `head_bytes` bytes of `path`.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::InvalidInput`] naming the keys seen when no
/// rule matches (or the file does not start with JSON).
pub fn detect(path: &Path, head_bytes: usize) -> Result<Detection> {
    if path.is_dir() {
        if super::openhands_v1::is_event_dir(path) {
            return Ok(Detection { format: Format::OpenHandsV1, reason: "folder of OpenHands event-NNNNN-<id>.json files".into() });
        }
        if super::opencode::is_message_dir(path) {
            return Ok(Detection { format: Format::OpenCode, reason: "OpenCode message/<session id> folder (parts in ../../part)".into() });
        }
        return Err(Error::InvalidInput(format!("{}: a directory that is not an OpenHands events folder or an OpenCode message/<session id> folder; pass files, or let `ingest` walk it", path.display())));
    }
    let f = super::stream::open(path)?;
    let mut head = Vec::with_capacity(head_bytes.min(1 << 24));
    f.take(head_bytes as u64).read_to_end(&mut head).map_err(|e| Error::io("read", path, e))?;
    detect_bytes(&head).map_err(|e| match e {
        Error::InvalidInput(m) => Error::InvalidInput(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// [`detect`] on bytes already read: the rules on the first JSON value, else on each of the next
/// [`DETECT_RECORDS`] lines that start one (module docs).
///
/// # Errors
/// [`Error::InvalidInput`] when no rule matches (the error of the first value, with how many later
/// lines were tried).
pub fn detect_bytes(head: &[u8]) -> Result<Detection> {
    let head = head.strip_prefix(super::stream::UTF8_BOM).unwrap_or(head);
    if let Some(d) = detect_text(head) {
        return Ok(d);
    }
    let first = detect_value(head);
    let Err(Error::InvalidInput(m)) = first else { return first };
    let mut tried = 0;
    let mut start = 0;
    for (i, line) in head.split_inclusive(|b| *b == b'\n').enumerate() {
        let at = start;
        start += line.len();
        if i == 0 || tried == DETECT_RECORDS {
            continue;
        }
        if !matches!(line.trim_ascii_start().first(), Some(b'{' | b'[')) {
            continue;
        }
        tried += 1;
        if let Ok(d) = detect_value(&head[at..]) {
            return Ok(Detection { format: d.format, reason: format!("{}, from line {} (the lines before it are not records of a known format)", d.reason, i + 1) });
        }
    }
    Err(Error::InvalidInput(if tried > 0 { format!("{m} (also tried the next {tried} lines that start a JSON value)") } else { m }))
}

/// The text formats (module docs): the first non-blank line of `head`.
fn detect_text(head: &[u8]) -> Option<Detection> {
    let line = head.split(|b| *b == b'\n').map(<[u8]>::trim_ascii).find(|l| !l.is_empty())?;
    let line = std::str::from_utf8(line).ok()?;
    if line.starts_with(super::aider::LAUNCH_HEADER.trim_end()) {
        return Some(Detection { format: Format::Aider, reason: "Aider chat transcript ('# aider chat started at')".into() });
    }
    super::aider::llm_header(line).map(|_| Detection { format: Format::Aider, reason: "Aider LLM history ('TO LLM <time>' / 'LLM RESPONSE <time>')".into() })
}

/// The rules on the first JSON value of `head`.
fn detect_value(head: &[u8]) -> Result<Detection> {
    let (is_array, paths) = probe(head);
    let has = |p: &str| paths.iter().any(|x| x == p);
    let found = |f: Format, why: String| Ok(Detection { format: f, reason: why });
    // The first record's `type` and `role` (JSONL: the first line), when it fits in the head.
    let first: Option<serde_json::Value> = serde_json::Deserializer::from_slice(head).into_iter::<serde_json::Value>().next().and_then(|v| v.ok());
    let first_str = |k: &str| first.as_ref().and_then(|v| v.get(k)).and_then(serde_json::Value::as_str);
    let ty = first_str("type");
    if let Some(why) = first.as_ref().and_then(super::anthropic_managed_agents::detect_record) {
        return found(Format::AnthropicManagedAgents, why.into());
    }
    if is_array {
        if (has("[].context") || has("[].traceId")) && has("[].attributes") {
            return found(Format::Otel, "array of spans with keys context/traceId, attributes".into());
        }
        if has("[].run_type") && (has("[].trace_id") || has("[].dotted_order")) {
            return found(Format::LangSmith, "array of runs with keys run_type, trace_id/dotted_order".into());
        }
        if has("[].role") && has("[].ts") {
            return found(Format::Cline, "array of messages with keys role, ts (Cline / Roo Code api_conversation_history)".into());
        }
    } else {
        if has("resourceSpans") {
            return found(Format::Otel, "OTLP/JSON export (resourceSpans)".into());
        }
        if has("spans") && (has("spans[].context") || has("spans[].traceId")) {
            return found(Format::Otel, "object with spans (context/traceId, attributes)".into());
        }
        if (has("post") || has("patch")) && (has("post[].run_type") || has("post[].dotted_order") || has("patch[].dotted_order") || has("patch[].trace_id")) {
            return found(Format::LangSmith, "LangSmith run payloads (post/patch)".into());
        }
        if has("run_type") && (has("trace_id") || has("dotted_order")) {
            return found(Format::LangSmith, "runs with keys run_type, trace_id/dotted_order".into());
        }
        if first_str("role").is_some_and(|r| matches!(r, "_system_prompt" | "_checkpoint" | "_usage")) {
            return found(Format::KimiCli, "Kimi CLI context records (role _system_prompt/_checkpoint/_usage)".into());
        }
        if has("sessionID") && has("role") && has("time.created") && has("id") {
            return found(Format::OpenCode, "OpenCode message (id, sessionID, role, time.created)".into());
        }
        if has("message_count") && has("description") && !has("role") {
            return found(Format::Goose, "Goose session metadata (message_count, description)".into());
        }
        if has("role") && has("created") && has("content[].type") && !has("timestamp") {
            return found(Format::Goose, "Goose messages (role, created, typed content parts)".into());
        }
        if has("version") && has("messages[].role") && !has("info") && !has("trajectory_format") {
            return found(Format::Cline, "object {version, messages} (Roo Code api_conversation_history v2)".into());
        }
        if has("type") && has("payload") && has("timestamp") {
            return found(Format::Codex, "records with keys timestamp, type, payload".into());
        }
        if has("id") && has("instructions") && has("timestamp") && !has("type") && !has("request") {
            return found(Format::Codex, "first record {id, timestamp, instructions} (older Codex rollout)".into());
        }
        if has("type") && has("data") && has("id") && has("timestamp") && has("parentId") && ty.is_some_and(|t| t.starts_with("session.") || t.starts_with("user.") || t.starts_with("assistant.") || t.starts_with("system.") || t.starts_with("tool.")) {
            return found(Format::CopilotCli, "events {type, data, id, timestamp, parentId} with Copilot CLI event types".into());
        }
        if has("sessionId") && has("projectHash") && !has("uuid") && !has("parentUuid") {
            return found(Format::GeminiCli, "Gemini CLI chat recording (sessionId, projectHash)".into());
        }
        if has("message_tree_id") && (has("prompt") || has("message_id")) {
            return found(Format::Oasst, "Open Assistant trees/messages (message_tree_id)".into());
        }
        if has("kind") && has("source") && has("id") && has("timestamp") {
            return found(Format::OpenHandsV1, "events with keys kind, source, id, timestamp".into());
        }
        if (ty == Some("session") && has("cwd")) || (has("parentId") && has("message.role")) {
            return found(Format::OpenClawSession, "session header (type session, cwd) / entries with parentId, message.role".into());
        }
        if has("sessionId") && has("uuid") && (has("message.parts") || has("systemPayload") || ty == Some("tool_result")) {
            return found(Format::QwenCode, "Qwen Code chat records (sessionId, uuid, message.parts / systemPayload)".into());
        }
        if (has("sessionId") && (has("uuid") || has("parentUuid")))
            || ty == Some("file-history-snapshot")
            || ty == Some("queue-operation")
            || (ty == Some("summary") && has("leafUuid"))
        {
            return found(Format::ClaudeCode, "Claude Code lines (sessionId + uuid/parentUuid, or file-history-snapshot/summary)".into());
        }
        if has("request") && has("response") {
            if has("request.input") || has("response.output") {
                return found(Format::OpenAiResponses, "records with keys request.input/response.output".into());
            }
            if !has("response.choices")
                && ((has("response.content") && has("response.stop_reason")) || has("request.system") || has("request.max_tokens") && has("response.content"))
            {
                return found(Format::AnthropicMessages, "records with keys response.content + stop_reason / request.system".into());
            }
        }
    }
    if is_array {
        if has("[].traj") && (has("[].task_id") || has("[].reward")) {
            return found(Format::TauBench, "array of objects with keys traj, task_id/reward".into());
        }
        if has("[].source") && (has("[].action") || has("[].observation")) {
            return found(Format::OpenHands, "array of events with keys source, action/observation".into());
        }
        if has("[].role") && (has("[].content") || has("[].tool_calls")) {
            return found(Format::Messages, "array of chat messages with keys role, content/tool_calls".into());
        }
    } else {
        if has("trajectory[].action") || has("trajectory[].observation") || (has("history") && has("info") && !has("messages")) {
            return found(Format::SweAgent, "object with trajectory steps (action/observation) or history + info".into());
        }
        if has("trajectory_format") || (has("messages") && has("info")) {
            return found(Format::MiniSweAgent, "object with messages + info / trajectory_format".into());
        }
        if paths.first().map(String::as_str) == Some("info") && has("info.exit_status") && !has("history") {
            // mini-swe-agent writes `info` (exit status, submission) first; a long submission can fill the head.
            return found(Format::MiniSweAgent, "object starting with info.exit_status".into());
        }
        if has("answer_generation") || (has("tree") && (has("compare_candidates") || has("tree.tree") || has("win"))) {
            return found(Format::ToolBench, "object with answer_generation / a search tree (tree + win / compare_candidates)".into());
        }
        if has("request") && has("response") {
            return found(Format::OpenAiChat, "records with keys request, response".into());
        }
        if has("session_id") && has("turn") && (has("messages") || has("response_text") || has("prompt_text")) {
            return found(Format::OpenClaw, "records with keys session_id, turn, messages/response_text".into());
        }
        if has("output") && (has("index") || has("error")) {
            return found(Format::AgentBench, "records with keys index/error, output".into());
        }
    }
    let mut shown: Vec<&str> = paths.iter().filter(|p| !p.contains('.') || p.starts_with("[].") && p.matches('.').count() == 1).map(String::as_str).take(20).collect();
    shown.dedup();
    Err(Error::InvalidInput(format!(
        "cannot detect the log format ({}; keys seen: {}); pass --format",
        if is_array { "a JSON array" } else { "a JSON object or JSONL" },
        if shown.is_empty() { "none".to_string() } else { shown.join(", ") }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_records_paths_of_a_cut_head() {
        let (arr, p) = probe(br#"[{"task_id": 0, "reward": 1.0, "info": {"task": {"x": 1}}, "traj": [{"role": "system", "content": "long"#);
        assert!(arr);
        assert_eq!(p, vec!["[].task_id", "[].reward", "[].info", "[].info.task", "[].traj", "[].traj[].role", "[].traj[].content"]);
    }

    #[test]
    fn each_structure_is_recognised() {
        let cases: Vec<(&[u8], Format)> = vec![
            (br#"[{"task_id": 3, "traj": []}]"#, Format::TauBench),
            (br#"[{"id": 0, "source": "user", "action": "message"}]"#, Format::OpenHands),
            (br#"{"environment": "swe_main", "trajectory": [{"action": "ls", "observation": "#, Format::SweAgent),
            (br#"{"info": {"exit_status": "Submitted"}, "messages": [{"role": "system"}]}"#, Format::MiniSweAgent),
            (b"{\r\n  \"win\": true,\r\n  \"tree\": {},\r\n  \"compare_candidates\": []", Format::ToolBench),
            (b"{\"request\": {\"messages\": []}, \"response\": {}}\n{\"request\":", Format::OpenAiChat),
            (b"{\"session_id\": \"s\", \"turn\": 1, \"messages\": []}\n", Format::OpenClaw),
            (b"{\"index\": 53, \"error\": \"AGENT_FAILED\", \"output\": {\"history\": null}}\n", Format::AgentBench),
        ];
        for (bytes, want) in cases {
            let d = detect_bytes(bytes).unwrap_or_else(|e| panic!("{want}: {e}"));
            assert_eq!(d.format, want, "{}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn unknown_structure_names_the_keys() {
        let e = detect_bytes(br#"{"foo": 1, "bar": {"baz": 2}}"#).unwrap_err().to_string();
        assert!(e.contains("keys seen: foo, bar"), "{e}");
        assert!(detect_bytes(b"not json").is_err());
    }
}
