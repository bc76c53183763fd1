//! The directive signal: a hint judge votes m times on whether a turn's next state reveals hindsight
//! that would have improved the response and, if so, writes a short hint; one hint is chosen and the
//! teacher context is the turn's request with that hint appended to the last user message
//! (docs/method.md §3).
//!
//! Same shape as [`crate::judge`]: the pure parts ([`HINT_TEMPLATE`], [`parse_hint_vote`],
//! [`select_hint`], [`teacher_messages`]), the backends (the judge's network backends or the rule
//! baseline [`RulesHint`]), the [`Hinter`] (a [`VotingStage`], as the judge) and [`hint_turn`], which
//! builds the `hints` row.

mod rules;
mod select;

pub use rules::{error_line, first_sentences, instruction_from, RuleHintStyle, RulesHint, MAX_RULE_HINT_CHARS, RULES_HINT_MODEL};
pub use select::{candidate_hints, last_hint_block, parse_hint_vote, select_hint, ParsedHint, Selection, Strategy};

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::judge::{
    voting_fields, BackendKind, PromptTemplate, RetryPolicy, Sampling, TurnContext, VoteBackend, VotingConfig, VotingFields,
    VotingStage,
};
use crate::schema::{now_ms, HintCandidate, HintRecord, Message, Table};
use crate::Result;

/// What is appended to the last user message of the teacher context, before the hint
/// (docs/method.md §3; the exact string).
pub const HINT_SEPARATOR: &str = "\n\n[user's hint / instruction]\n";

/// The `[hint]` table of a pipeline: the judge's fields plus the selection. Every field has a
/// default; unknown fields are an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HintConfig {
    /// `rules` (default: the embedded rule-based baseline, no LLM), `openai` or `sglang`.
    pub backend: BackendKind,
    /// Endpoint base URL for `openai` / `sglang`; required for them.
    pub url: Option<String>,
    /// Hint-judge model id; required for `openai` / `sglang`. Ignored by `rules` (`hint-rules-v1`).
    pub model: Option<String>,
    /// Name of the environment variable holding the endpoint's API key; never printed.
    pub api_key_env: Option<String>,
    /// Hint votes per turn, m (default 3, the reference OPD default). 1..=64.
    pub m: u32,
    /// Sampling temperature (default 0.6).
    pub temperature: f32,
    /// Maximum tokens per vote (default 4096).
    pub max_tokens: u32,
    /// Limit on one request, seconds (default 120).
    pub timeout_s: f64,
    /// Votes in flight at once across all turns (default 16).
    pub concurrency: usize,
    /// Retries after a transport error, timeout, 5xx, 408 or 429 (default 3).
    pub retries: u32,
    /// Backoff before retry k = `backoff_base_ms · 2^k` ms, at most 30 s (default 500).
    pub backoff_base_ms: u64,
    /// Each prompt field is cut to this many characters, keeping head and tail (default 8000; 0 = no
    /// limit).
    pub max_field_chars: usize,
    /// Selection strategy: `longest` (default), `shortest` or `majority-gated`.
    pub strategy: Strategy,
    /// A hint must be longer than this many characters to be accepted (default 10, as the reference).
    pub min_hint_chars: usize,
    /// What the rule backend writes for a user's correction: `instruction` (default: an imperative
    /// rewritten from it, as the hint contract asks) or `verbatim` (the user's own sentences). Only
    /// `backend = "rules"` reads it ([`RuleHintStyle`]).
    pub rules_style: RuleHintStyle,
}

impl Default for HintConfig {
    fn default() -> Self {
        HintConfig {
            backend: BackendKind::Rules,
            url: None,
            model: None,
            api_key_env: None,
            m: 3,
            temperature: 0.6,
            max_tokens: 4096,
            timeout_s: 120.0,
            concurrency: 16,
            retries: 3,
            backoff_base_ms: 500,
            max_field_chars: 8000,
            strategy: Strategy::Longest,
            min_hint_chars: 10,
            rules_style: RuleHintStyle::Instruction,
        }
    }
}

impl HintConfig {
    /// Checks ranges ([`VotingFields::validate`]).
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the field and its value.
    pub fn validate(&self) -> Result<()> {
        self.voting().validate()
    }
    /// Sampling parameters of the votes.
    pub fn sampling(&self) -> Sampling {
        self.voting().sampling()
    }
    /// Retry policy of the votes.
    pub fn retry_policy(&self) -> RetryPolicy {
        self.voting().retry_policy()
    }
}

impl VotingConfig for HintConfig {
    const TEMPLATE: PromptTemplate = HINT_TEMPLATE;
    fn voting(&self) -> VotingFields<'_> {
        voting_fields!(self, "hint")
    }
    fn rules_backend(&self) -> Arc<dyn VoteBackend> {
        Arc::new(RulesHint { style: self.rules_style })
    }
    /// `;strategy=…;min_hint_chars=…` (the selection decides the hint too), and `;rules_style=…` with
    /// the rule backend (its hint text depends on it).
    fn fingerprint_extra(&self) -> String {
        let style = if self.backend == BackendKind::Rules { format!(";rules_style={}", self.rules_style.as_str()) } else { String::new() };
        format!(";strategy={};min_hint_chars={}{style}", self.strategy.as_str(), self.min_hint_chars)
    }
}

/// Our hint-judge prompt (docs/method.md §3): exactly one `\boxed{1}` or `\boxed{-1}`; with 1, a 1–3
/// sentence hint between `[HINT_START]` and `[HINT_END]`.
pub const HINT_TEMPLATE: PromptTemplate = PromptTemplate {
    id: "nextstate-hint-v1",
    system: "You look back at a single step taken by an AI assistant, knowing what happened right \
after it. Your job is to find hindsight: something the next message or tool output reveals that the \
assistant could have used to take a better step in the first place, such as a correction, a preference \
or requirement the user states, a missing fact, or an error the step could have avoided.",
    user: concat!(
        crate::judge::turn_sections!(),
        "Does what came back reveal something that, known in advance, would have let the assistant take a \
better step?
- If yes, write \\boxed{1}, then a hint of one to three sentences between [HINT_START] and [HINT_END]. \
Address the hint to the assistant as a concrete instruction it could follow before taking the step \
(for example: \"The user wants the dates in ISO format; convert them before replying.\"). Do not \
mention that it comes from hindsight or from a later message.
- If no, write \\boxed{-1} and no hint.
Write exactly one \\boxed{} value."
    ),
};

/// The teacher context (docs/method.md §3): a copy of the turn's request messages with
/// [`HINT_SEPARATOR`] + the trimmed hint appended to the **last user message**; with no user message,
/// to the last message; with no messages, a new user message. When the target message's text is empty
/// the separator's leading blank line is left out (as the reference does by trimming). The other
/// messages, and the target's own text, are unchanged byte for byte.
pub fn teacher_messages(request: &[Message], hint: &str) -> Vec<Message> {
    let hint = hint.trim();
    let mut out = request.to_vec();
    let target = out.iter().rposition(|m| m.role == "user").or_else(|| out.len().checked_sub(1));
    match target {
        Some(i) => {
            let content = &mut out[i].content;
            if content.trim().is_empty() {
                *content = format!("{}{hint}", HINT_SEPARATOR.trim_start_matches('\n'));
            } else {
                content.push_str(HINT_SEPARATOR);
                content.push_str(hint);
            }
        }
        None => out.push(Message::text("user", format!("{}{hint}", HINT_SEPARATOR.trim_start_matches('\n')))),
    }
    out
}

/// A configured hint judge: config, [`HINT_TEMPLATE`] and voter (see [`VotingStage`] for `new`,
/// `with_parts` and the accessors; its [`VotingStage::config_fingerprint`] adds the strategy and the
/// length threshold). Share it (`Arc`) between concurrent [`hint_turn`] calls.
pub type Hinter = VotingStage<HintConfig>;

impl Hinter {
    /// `hint_id` of a turn in `pipeline`: hash of the pipeline name, the interaction id and
    /// [`VotingStage::config_fingerprint`] ([`VotingStage::row_id`]).
    pub fn hint_id(&self, pipeline: &str, interaction_id: &str) -> String {
        self.row_id(pipeline, interaction_id)
    }
}

/// Extracts the hint of one turn: m votes (concurrent, bounded, cached), each parsed with
/// [`parse_hint_vote`], a hint chosen with [`select_hint`], and the teacher context built with
/// [`teacher_messages`] when one is chosen. `teacher_prompt_text` is left null: rendering with the
/// policy's chat template belongs to the model runtime. Never fails: failed requests are invalid
/// votes with their error.
pub async fn hint_turn(hinter: &Hinter, pipeline: &str, turn: &TurnContext) -> HintRecord {
    let cfg = hinter.config();
    let (template_hash, raw_votes) = hinter.raw_votes(turn).await;
    let candidates: Vec<HintCandidate> = raw_votes
        .into_iter()
        .map(|rv| match rv.error {
            Some(e) => HintCandidate { index: rv.index as i32, raw: rv.raw, score: None, hint: None, error: Some(e), cached: rv.cached },
            None => {
                let p = parse_hint_vote(&rv.raw);
                HintCandidate { index: rv.index as i32, raw: rv.raw, score: p.score, hint: p.hint, error: p.error, cached: rv.cached }
            }
        })
        .collect();
    let sel = select_hint(cfg.strategy, &candidates, cfg.min_hint_chars);
    // Serialising our own message type cannot fail (string keys only).
    let teacher = sel
        .chosen_hint
        .as_deref()
        .and_then(|h| serde_json::to_string(&teacher_messages(&turn.request, h)).ok());
    let cache_hits = candidates.iter().filter(|c| c.cached).count() as i32;
    HintRecord {
        schema_version: HintRecord::SCHEMA_VERSION,
        hint_id: hinter.hint_id(pipeline, &turn.interaction_id),
        pipeline: pipeline.to_string(),
        interaction_id: turn.interaction_id.clone(),
        session_id: turn.session_id.clone(),
        tenant: turn.tenant.clone(),
        turn_index: turn.turn_index,
        candidates,
        strategy: cfg.strategy.as_str().to_string(),
        chosen_hint: sel.chosen_hint,
        chosen_index: sel.chosen_index,
        reason: sel.reason,
        hint_backend: hinter.voter().backend().kind().as_str().to_string(),
        hint_model: hinter.voter().backend().model().to_string(),
        template_id: hinter.template().id.to_string(),
        template_hash,
        teacher_messages: teacher,
        teacher_prompt_text: None,
        cache_hits,
        event_time: turn.event_time,
        processed_time: now_ms(),
    }
}

#[cfg(test)]
mod tests;
