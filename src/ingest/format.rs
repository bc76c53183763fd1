//! [`Format`]: the log formats `nextstate ingest` reads, by their command-line names.

use serde::Serialize;

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
