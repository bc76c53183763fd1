//! The evaluative signal: a PRM judge votes m times on each main turn with a next state, and the
//! majority of the votes is the turn's score (METHOD.md §2).
//!
//! The pure parts — the prompt ([`JUDGE_TEMPLATE`]), the vote parser ([`parse_vote`]) and the majority
//! ([`majority_vote`]) — are separate from the backends ([`VoteBackend`]: [`OpenAiBackend`],
//! [`SglangBackend`], the rule-based baseline [`RulesJudge`]) and from the [`Voter`] that runs votes
//! concurrently with timeouts, retries and the [`VoteCache`]. [`judge_turn`] puts them together and
//! builds the `judgments` row.

mod backend;
mod cache;
mod parse;
mod prompt;
mod rules;
mod turn;

pub use backend::{
    build_backend, ApiKey, AttemptCounts, BackendKind, CallError, OpenAiBackend, PromptRenderer, RawVote, RetryPolicy, Sampling,
    SglangBackend, VoteBackend, VoteRequest, Voter, VoterStats,
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
#[cfg(test)]
pub(crate) use turn::tests::{mini_swe_agent_messages, turn as turn_for_tests};

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::schema::{content_hash, now_ms, Judgment, Table, Vote};
use crate::{config_err, Result};

/// Longest single backoff between retries, whatever `backoff_base_ms` and the retry number.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

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
    /// Votes per turn, m (default 3, the reference's binary-RL setting; METHOD.md §6). 1..=64.
    pub m: u32,
    /// Sampling temperature of each vote (default 0.6, METHOD.md §2).
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

/// Checks the fields shared by the `[judge]` and `[hint]` tables.
pub(crate) fn validate_voting(table: &str, m: u32, temperature: f32, max_tokens: u32, timeout_s: f64, concurrency: usize) -> Result<()> {
    if !(1..=64).contains(&m) {
        return Err(config_err!("[{table}] m = {m}: votes per turn must be 1..=64"));
    }
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(config_err!("[{table}] temperature = {temperature}: must be finite and >= 0"));
    }
    if max_tokens == 0 {
        return Err(config_err!("[{table}] max_tokens = 0: must be >= 1"));
    }
    if !timeout_s.is_finite() || timeout_s <= 0.0 || timeout_s > 86_400.0 {
        return Err(config_err!("[{table}] timeout_s = {timeout_s}: must be in (0, 86400] seconds"));
    }
    if concurrency == 0 {
        return Err(config_err!("[{table}] concurrency = 0: must be >= 1"));
    }
    Ok(())
}

impl JudgeConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the field and its value.
    pub fn validate(&self) -> Result<()> {
        validate_voting("judge", self.m, self.temperature, self.max_tokens, self.timeout_s, self.concurrency)
    }

    /// Sampling parameters of the votes.
    pub fn sampling(&self) -> Sampling {
        Sampling { temperature: self.temperature, max_tokens: self.max_tokens }
    }

    /// Retry policy of the votes.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            retries: self.retries,
            backoff_base: Duration::from_millis(self.backoff_base_ms),
            backoff_max: BACKOFF_MAX,
            timeout: Duration::from_secs_f64(self.timeout_s),
        }
    }
}

/// A configured PRM judge: config, template and [`Voter`]. Share it (`Arc`) between concurrent
/// [`judge_turn`] calls so the concurrency limit and the cache are shared.
#[derive(Debug)]
pub struct Judge {
    cfg: JudgeConfig,
    template: PromptTemplate,
    voter: Voter,
}

impl Judge {
    /// A judge with the backend named by `cfg`, a fresh cache and its own semaphore.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for an invalid config (see [`JudgeConfig::validate`], [`build_backend`]).
    pub fn new(cfg: JudgeConfig) -> Result<Judge> {
        cfg.validate()?;
        let backend = build_backend(
            cfg.backend,
            cfg.url.as_deref(),
            cfg.model.as_deref(),
            cfg.api_key_env.as_deref(),
            cfg.timeout_s,
            Arc::new(RulesJudge),
        )?;
        let sem = Arc::new(Semaphore::new(cfg.concurrency));
        Judge::with_parts(cfg, backend, Arc::new(VoteCache::new()), sem)
    }

    /// A judge over a given backend, cache and semaphore (to share them, or to plug in a backend
    /// such as the model runtime's).
    ///
    /// # Errors
    /// [`crate::Error::Config`] for an invalid config.
    pub fn with_parts(cfg: JudgeConfig, backend: Arc<dyn VoteBackend>, cache: Arc<VoteCache>, semaphore: Arc<Semaphore>) -> Result<Judge> {
        cfg.validate()?;
        let voter = Voter::new(backend, semaphore, cache, cfg.retry_policy(), cfg.sampling());
        Ok(Judge { cfg, template: JUDGE_TEMPLATE, voter })
    }

    /// The configuration.
    pub fn config(&self) -> &JudgeConfig {
        &self.cfg
    }
    /// The prompt template.
    pub fn template(&self) -> &PromptTemplate {
        &self.template
    }
    /// The voter (backend, cache, counters).
    pub fn voter(&self) -> &Voter {
        &self.voter
    }
    /// The vote cache.
    pub fn cache(&self) -> &Arc<VoteCache> {
        self.voter.cache()
    }
    /// Counters since creation.
    pub fn stats(&self) -> VoterStats {
        self.voter.stats()
    }

    /// Fingerprint of everything that decides the votes: backend, model, template hash, sampling, m,
    /// field limit.
    pub fn config_fingerprint(&self) -> String {
        format!(
            "backend={};model={};template={};{};m={};max_field_chars={}",
            self.voter.backend().kind().as_str(),
            self.voter.backend().model(),
            self.template.hash(),
            self.cfg.sampling().canonical(),
            self.cfg.m,
            self.cfg.max_field_chars
        )
    }

    /// `judgment_id` of a turn in `pipeline`: hash of the pipeline name, the interaction id and
    /// [`Judge::config_fingerprint`] (two pipelines judging the same turn keep one row each).
    pub fn judgment_id(&self, pipeline: &str, interaction_id: &str) -> String {
        content_hash(&[pipeline.as_bytes(), interaction_id.as_bytes(), self.config_fingerprint().as_bytes()])
    }
}

/// Judges one turn: m votes (concurrent, bounded by the judge's shared semaphore; cached votes are
/// reused), each parsed with [`parse_vote`], aggregated with [`majority_vote`] into a `judgments` row.
/// Never fails: a failed request or an unparsable answer is an invalid vote with its error. Call it
/// for main turns that have a next state; a turn without one gets whatever the backend says (the rule
/// baseline says 0).
pub async fn judge_turn(judge: &Judge, pipeline: &str, turn: &TurnContext) -> Judgment {
    let cfg = &judge.cfg;
    let template_hash = judge.template.hash();
    let raw_votes = match judge.template.render(turn, cfg.max_field_chars) {
        Ok(messages) => judge.voter.vote_all(&messages, turn, &template_hash, cfg.m).await,
        Err(e) => (0..cfg.m)
            .map(|index| RawVote { index, raw: String::new(), error: Some(e.to_string()), cached: false, attempts: 0 })
            .collect(),
    };
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
        turn_index: turn.turn_index,
        policy_version: turn.policy_version,
        votes,
        m: cfg.m as i32,
        valid_votes: maj.valid,
        tie: maj.tie,
        score: maj.score,
        judge_backend: judge.voter.backend().kind().as_str().to_string(),
        judge_model: judge.voter.backend().model().to_string(),
        template_id: judge.template.id.to_string(),
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
