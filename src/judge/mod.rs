//! The evaluative signal: a PRM judge votes m times on each main turn with a next state, and the
//! majority of the votes is the turn's score (docs/method.md §2).
//!
//! The pure parts — the prompt ([`JUDGE_TEMPLATE`]), the vote parser ([`parse_vote`]) and the majority
//! ([`majority_vote`]) — are separate from the backends ([`VoteBackend`]: [`OpenAiBackend`],
//! [`SglangBackend`], the rule-based baseline [`RulesJudge`]) and from the [`Voter`] that runs votes
//! concurrently with timeouts, retries and the [`VoteCache`]. A [`Judge`] is a [`VotingStage`] (shared
//! with the hint judge); [`judge_turn`] puts the parts together and builds the `judgments` row.

mod backend;
mod cache;
mod parse;
mod prompt;
pub(crate) use prompt::turn_sections;
mod rules;
mod turn;
mod voter;

pub use backend::{
    build_backend, ApiKey, BackendKind, CallError, OpenAiBackend, PromptRenderer, Sampling, SglangBackend, VoteBackend,
    VoteRequest,
};
/// The HTTP call helpers the remote teacher shares with the judge backends.
pub(crate) use backend::{endpoint_url, post_json};
pub use cache::{CacheEntry, VoteCache};
pub use parse::{last_boxed_digit, majority_vote, parse_vote, Majority};
pub use prompt::{
    describe_kind, render_message, render_next_state, render_request, render_response, render_role_tagged,
    truncate_middle, ChatMessage, PromptTemplate, JUDGE_TEMPLATE,
};
pub use rules::{RulesJudge, REPHRASE_JACCARD, RULES_JUDGE_MODEL};
pub use turn::TurnContext;
pub use voter::{
    AttemptCounts, RawVote, RetryPolicy, Voter, VoterStats, VotingConfig, VotingFields, VotingStage, BACKOFF_MAX, PROBE_TRIES,
};
#[cfg(test)]
pub(crate) use turn::tests::{mini_swe_agent_messages, turn as turn_for_tests};

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::schema::{now_ms, Judgment, Table, Vote};
use crate::Result;

/// The `[judge]` table of a pipeline. Every field has a default; unknown fields are an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JudgeConfig {
    /// `rules` (default: the embedded rule-based baseline, no LLM), `openai` or `sglang`.
    pub backend: BackendKind,
    /// Endpoint base URL for `openai` / `sglang` (e.g. `http://127.0.0.1:30000`); required for them.
    pub url: Option<String>,
    /// Judge model id; required for `openai` / `sglang` (sent to OpenAI-compatible servers, and part
    /// of every cache key). Ignored by `rules`, which records `rules-v1`.
    pub model: Option<String>,
    /// Name of the environment variable holding the endpoint's API key (sent as a bearer token); the
    /// key itself is never stored in config or printed. Default: none.
    pub api_key_env: Option<String>,
    /// Votes per turn, m (default 3, the reference's binary-RL setting; docs/method.md §6). 1..=64.
    pub m: u32,
    /// Sampling temperature of each vote (default 0.6, docs/method.md §2).
    pub temperature: f32,
    /// Maximum tokens per vote (default 4096).
    pub max_tokens: u32,
    /// Limit on one request, seconds (default 120).
    pub timeout_s: f64,
    /// Votes in flight at once across all turns (default 16).
    pub concurrency: usize,
    /// Retries of a vote after a transport error, timeout, 5xx, 408 or 429 (default 3).
    pub retries: u32,
    /// Backoff before retry k = `backoff_base_ms · 2^k` milliseconds, at most 30 s (default 500).
    pub backoff_base_ms: u64,
    /// Each prompt field (request, response, next state) is cut to this many characters, keeping its
    /// head and tail (default 8000; 0 = no limit).
    pub max_field_chars: usize,
}

impl Default for JudgeConfig {
    fn default() -> Self {
        JudgeConfig {
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
        }
    }
}

/// [`VotingFields`] of a config struct that has all of them under the same names (`[judge]`,
/// `[hint]`); `$table` names the table in error messages.
macro_rules! voting_fields {
    ($cfg:expr, $table:literal) => {
        $crate::judge::VotingFields {
            table: $table,
            backend: $cfg.backend,
            url: $cfg.url.as_deref(),
            model: $cfg.model.as_deref(),
            api_key_env: $cfg.api_key_env.as_deref(),
            m: $cfg.m,
            temperature: $cfg.temperature,
            max_tokens: $cfg.max_tokens,
            timeout_s: $cfg.timeout_s,
            concurrency: $cfg.concurrency,
            retries: $cfg.retries,
            backoff_base_ms: $cfg.backoff_base_ms,
            max_field_chars: $cfg.max_field_chars,
        }
    };
}
pub(crate) use voting_fields;

impl JudgeConfig {
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

impl VotingConfig for JudgeConfig {
    const TEMPLATE: PromptTemplate = JUDGE_TEMPLATE;
    fn voting(&self) -> VotingFields<'_> {
        voting_fields!(self, "judge")
    }
    fn rules_backend(&self) -> Arc<dyn VoteBackend> {
        Arc::new(RulesJudge)
    }
}

/// A configured PRM judge: config, [`JUDGE_TEMPLATE`] and [`Voter`] (see [`VotingStage`] for
/// `new`, `with_parts` and the accessors). Share it (`Arc`) between concurrent [`judge_turn`] calls
/// so the concurrency limit and the cache are shared.
pub type Judge = VotingStage<JudgeConfig>;

impl Judge {
    /// `judgment_id` of a turn in `pipeline`: hash of the pipeline name, the interaction id and
    /// [`VotingStage::config_fingerprint`] (backend, model, template hash, sampling, m, field limit)
    /// ([`VotingStage::row_id`]).
    pub fn judgment_id(&self, pipeline: &str, interaction_id: &str) -> String {
        self.row_id(pipeline, interaction_id)
    }
}

/// Judges one turn: m votes (concurrent, bounded by the judge's shared semaphore; cached votes are
/// reused), each parsed with [`parse_vote`], aggregated with [`majority_vote`] into a `judgments` row.
/// Never fails: a failed request or an unparsable answer is an invalid vote with its error. Call it
/// for main turns that have a next state; a turn without one gets whatever the backend says (the rule
/// baseline says 0).
pub async fn judge_turn(judge: &Judge, pipeline: &str, turn: &TurnContext) -> Judgment {
    let cfg = judge.config();
    let (template_hash, raw_votes) = judge.raw_votes(turn).await;
    let votes: Vec<Vote> = raw_votes
        .into_iter()
        .map(|rv| {
            let (value, error) = match rv.error {
                Some(e) => (None, Some(e)),
                None => match parse_vote(&rv.raw) {
                    Ok(v) => (Some(v), None),
                    Err(e) => (None, Some(e)),
                },
            };
            Vote { index: rv.index as i32, raw: rv.raw, value, error, cached: rv.cached }
        })
        .collect();
    let maj = majority_vote(&votes.iter().map(|v| v.value).collect::<Vec<_>>());
    let cache_hits = votes.iter().filter(|v| v.cached).count() as i32;
    Judgment {
        schema_version: Judgment::SCHEMA_VERSION,
        judgment_id: judge.judgment_id(pipeline, &turn.interaction_id),
        pipeline: pipeline.to_string(),
        interaction_id: turn.interaction_id.clone(),
        session_id: turn.session_id.clone(),
        tenant: turn.tenant.clone(),
        turn_index: turn.turn_index,
        policy_version: turn.policy_version,
        votes,
        m: cfg.m as i32,
        valid_votes: maj.valid,
        tie: maj.tie,
        score: maj.score,
        judge_backend: judge.voter().backend().kind().as_str().to_string(),
        judge_model: judge.voter().backend().model().to_string(),
        template_id: judge.template().id.to_string(),
        template_hash,
        temperature: cfg.temperature,
        max_tokens: cfg.max_tokens as i32,
        cache_hits,
        event_time: turn.event_time,
        processed_time: now_ms(),
    }
}

#[cfg(test)]
pub(crate) mod tests;
