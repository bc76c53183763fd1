//! The voting machinery shared by the PRM judge ([`super::Judge`]) and the hint judge
//! (`crate::hint::Hinter`): the [`RetryPolicy`] of one call (per-attempt timeout, retries with
//! exponential backoff via `backon`), the [`Voter`] that asks a backend for m votes under a shared
//! semaphore and a vote cache, and [`VotingStage`], the configured stage (config, prompt template,
//! voter) both judges are instances of.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tokio::sync::Semaphore;

use super::backend::{build_backend, BackendKind, CallError, Sampling, VoteBackend, VoteRequest};
use super::cache::VoteCache;
use super::prompt::{ChatMessage, PromptTemplate};
use super::turn::TurnContext;
use crate::schema::content_hash;
use crate::{config_err, Result};

/// Requests the start-up probe ([`VotingStage::probe`], the remote teacher's) makes before it calls an
/// endpoint wrong: a wrong endpoint fails every time, a flaky one does not.
pub const PROBE_TRIES: u32 = 3;

/// Longest single backoff between retries, whatever `backoff_base_ms` and the retry number.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The fields the `[judge]` and `[hint]` tables share, borrowed from either (see
/// [`super::JudgeConfig`] for their meaning and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VotingFields<'a> {
    /// The table's name (`judge`, `hint`), for error messages.
    pub table: &'static str,
    /// `rules`, `openai` or `sglang`.
    pub backend: BackendKind,
    /// Endpoint base URL (network backends).
    pub url: Option<&'a str>,
    /// Model id (network backends).
    pub model: Option<&'a str>,
    /// Name of the environment variable holding the API key.
    pub api_key_env: Option<&'a str>,
    /// Votes per turn, m.
    pub m: u32,
    /// Sampling temperature of each vote.
    pub temperature: f32,
    /// Maximum tokens per vote.
    pub max_tokens: u32,
    /// Limit on one request, seconds.
    pub timeout_s: f64,
    /// Votes in flight at once across all turns.
    pub concurrency: usize,
    /// Retries of a vote after a retryable failure.
    pub retries: u32,
    /// Backoff base, milliseconds.
    pub backoff_base_ms: u64,
    /// Limit on each prompt field, characters (0 = no limit).
    pub max_field_chars: usize,
}

impl VotingFields<'_> {
    /// Checks ranges: m in 1..=64, temperature finite and >= 0, max_tokens >= 1, timeout_s in
    /// (0, 86400], concurrency >= 1.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the table, the field and its value.
    pub fn validate(&self) -> Result<()> {
        let (table, m, temperature, timeout_s) = (self.table, self.m, self.temperature, self.timeout_s);
        if !(1..=64).contains(&m) {
            return Err(config_err!("[{table}] m = {m}: votes per turn must be 1..=64"));
        }
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(config_err!("[{table}] temperature = {temperature}: must be finite and >= 0"));
        }
        if self.max_tokens == 0 {
            return Err(config_err!("[{table}] max_tokens = 0: must be >= 1"));
        }
        if !timeout_s.is_finite() || timeout_s <= 0.0 || timeout_s > 86_400.0 {
            return Err(config_err!("[{table}] timeout_s = {timeout_s}: must be in (0, 86400] seconds"));
        }
        if self.concurrency == 0 {
            return Err(config_err!("[{table}] concurrency = 0: must be >= 1"));
        }
        Ok(())
    }

    /// Sampling parameters of the votes.
    pub fn sampling(&self) -> Sampling {
        Sampling { temperature: self.temperature, max_tokens: self.max_tokens }
    }

    /// Retry policy of the votes (backoff capped at [`BACKOFF_MAX`]).
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            retries: self.retries,
            backoff_base: Duration::from_millis(self.backoff_base_ms),
            backoff_max: BACKOFF_MAX,
            timeout: Duration::from_secs_f64(self.timeout_s),
        }
    }
}

/// A pipeline table that configures a [`VotingStage`] (`[judge]`, `[hint]`).
pub trait VotingConfig: fmt::Debug + Send + Sync {
    /// The stage's prompt template.
    const TEMPLATE: PromptTemplate;
    /// The shared fields.
    fn voting(&self) -> VotingFields<'_>;
    /// The rule-based baseline answering when `backend = "rules"`.
    fn rules_backend(&self) -> Arc<dyn VoteBackend>;
    /// What the stage's [`VotingStage::config_fingerprint`] adds after the shared part (each item as
    /// `;key=value`); empty by default.
    fn fingerprint_extra(&self) -> String {
        String::new()
    }
}

/// Retry and timeout policy of one vote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (so at most `retries + 1` attempts).
    pub retries: u32,
    /// Backoff before retry k (0-based) = `backoff_base · 2^k`, capped at `backoff_max`.
    pub backoff_base: Duration,
    /// Cap on one backoff.
    pub backoff_max: Duration,
    /// Limit on one attempt (enforced around the backend call, whatever the backend does).
    pub timeout: Duration,
}

impl RetryPolicy {
    /// The sleeps before retries `0..retries`: sleep k = `min(backoff_base · 2^k, backoff_max)`, no
    /// jitter (backon's exponential backoff; its f32 arithmetic is exact to well under 1 µs).
    pub fn backoff_schedule(&self) -> ExponentialBuilder {
        ExponentialBuilder::new()
            .with_min_delay(self.backoff_base.min(self.backoff_max))
            .with_max_delay(self.backoff_max)
            .with_factor(2.0)
            .with_max_times(self.retries as usize)
    }

    /// Runs `call` (one invocation = one attempt) until it succeeds, fails with an error that is not
    /// [`CallError::retryable`], or `retries` retries are spent; each attempt holds a permit of
    /// `semaphore` (bounding calls in flight) and is cut at `timeout` ([`CallError::Timeout`]), and
    /// retry k is preceded by sleep k of [`RetryPolicy::backoff_schedule`]. The judge's [`Voter`] and
    /// the remote teacher (`crate::teacher::remote`) share this loop. Returns the last outcome and what
    /// the attempts were, for the caller's counters.
    pub async fn run<T, F, Fut>(&self, semaphore: &Semaphore, call: F) -> (std::result::Result<T, CallError>, AttemptCounts)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = std::result::Result<T, CallError>>,
    {
        let (attempts, timeouts) = (AtomicU32::new(0), AtomicU32::new(0));
        let (call, attempts_ref, timeouts_ref) = (&call, &attempts, &timeouts);
        let attempt = || async move {
            attempts_ref.fetch_add(1, Ordering::Relaxed);
            // The semaphore is never closed; if it were, run unbounded rather than fail the call.
            let _permit = semaphore.acquire().await.ok();
            let outcome = tokio::time::timeout(self.timeout, call()).await.unwrap_or(Err(CallError::Timeout(self.timeout.as_secs_f64())));
            if matches!(outcome, Err(CallError::Timeout(_))) {
                timeouts_ref.fetch_add(1, Ordering::Relaxed);
            }
            outcome
        };
        let outcome = attempt.retry(self.backoff_schedule()).when(CallError::retryable).await;
        (outcome, AttemptCounts { attempts: attempts.into_inner(), timeouts: timeouts.into_inner() })
    }
}

/// What one [`RetryPolicy::run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttemptCounts {
    /// Calls made: the first attempt and every retry (so retries = `attempts − 1`).
    pub attempts: u32,
    /// Attempts cut by the per-attempt timeout.
    pub timeouts: u32,
}

/// Counters of a [`Voter`] since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VoterStats {
    /// Backend calls made (attempts, including retries).
    pub requests: u64,
    /// Retries made (attempts after a retryable failure).
    pub retries: u64,
    /// Attempts that timed out.
    pub timeouts: u64,
    /// Votes that failed after all attempts (invalid votes from request failures).
    pub failed_votes: u64,
    /// Votes served from the cache.
    pub cache_hits: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    timeouts: AtomicU64,
    failed_votes: AtomicU64,
    cache_hits: AtomicU64,
}

/// A vote's raw answer before parsing.
#[derive(Debug, Clone, PartialEq)]
pub struct RawVote {
    /// 0-based vote index.
    pub index: u32,
    /// The judge's raw text (empty when the request failed).
    pub raw: String,
    /// Why the request failed (after all attempts), if it did.
    pub error: Option<String>,
    /// Served from the cache.
    pub cached: bool,
    /// Backend calls made for this vote (0 when cached).
    pub attempts: u32,
}

/// Asks a backend for votes: each vote checks the cache, then calls the backend under a semaphore
/// permit shared by every turn (at most `concurrency` calls in flight), with a per-attempt timeout and
/// retries with exponential backoff on retryable failures. A failed vote is returned with an error,
/// never raised.
pub struct Voter {
    backend: Arc<dyn VoteBackend>,
    semaphore: Arc<Semaphore>,
    cache: Arc<VoteCache>,
    policy: RetryPolicy,
    sampling: Sampling,
    counters: Counters,
}

impl fmt::Debug for Voter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Voter")
            .field("backend", &self.backend.kind())
            .field("model", &self.backend.model())
            .field("policy", &self.policy)
            .field("sampling", &self.sampling)
            .finish()
    }
}

impl Voter {
    /// A voter over `backend`; `semaphore` bounds backend calls in flight (share one `Arc` across
    /// stages that hit the same endpoint), `cache` may be shared too.
    pub fn new(backend: Arc<dyn VoteBackend>, semaphore: Arc<Semaphore>, cache: Arc<VoteCache>, policy: RetryPolicy, sampling: Sampling) -> Voter {
        Voter { backend, semaphore, cache, policy, sampling, counters: Counters::default() }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn VoteBackend> {
        &self.backend
    }
    /// The vote cache.
    pub fn cache(&self) -> &Arc<VoteCache> {
        &self.cache
    }
    /// Sampling parameters.
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }
    /// The retry policy.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// Counters since creation.
    pub fn stats(&self) -> VoterStats {
        let c = &self.counters;
        VoterStats {
            requests: c.requests.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            failed_votes: c.failed_votes.load(Ordering::Relaxed),
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
        }
    }

    /// Votes `0..m` for one turn, concurrently (each bounded by the shared semaphore), in index order.
    pub async fn vote_all(&self, messages: &[ChatMessage], turn: &TurnContext, template_hash: &str, m: u32) -> Vec<RawVote> {
        let turn_hash = turn.content_hash();
        let futs = (0..m).map(|i| self.vote_one(messages, turn, &turn_hash, template_hash, i));
        futures::future::join_all(futs).await
    }

    async fn vote_one(&self, messages: &[ChatMessage], turn: &TurnContext, turn_hash: &str, template_hash: &str, index: u32) -> RawVote {
        let cacheable = self.backend.cacheable();
        let key = VoteCache::key(
            turn_hash,
            template_hash,
            self.backend.kind().as_str(),
            self.backend.model(),
            &self.sampling.canonical(),
            index,
        );
        if cacheable {
            if let Some(raw) = self.cache.get(&key) {
                self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                return RawVote { index, raw, error: None, cached: true, attempts: 0 };
            }
        }
        let req = VoteRequest { messages, turn, index, sampling: self.sampling };
        let (outcome, counts) = self.policy.run(&self.semaphore, || self.backend.complete(req)).await;
        let attempts = counts.attempts;
        self.counters.requests.fetch_add(u64::from(attempts), Ordering::Relaxed);
        self.counters.retries.fetch_add(u64::from(attempts.saturating_sub(1)), Ordering::Relaxed);
        self.counters.timeouts.fetch_add(u64::from(counts.timeouts), Ordering::Relaxed);
        match outcome {
            Ok(raw) => {
                if cacheable {
                    self.cache.insert(&key, &raw);
                }
                RawVote { index, raw, error: None, cached: false, attempts }
            }
            Err(err) => {
                self.counters.failed_votes.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(backend = self.backend.kind().as_str(), vote = index, attempts, "judge vote failed: {err}");
                RawVote { index, raw: String::new(), error: Some(format!("request failed after {attempts} attempt(s): {err}")), cached: false, attempts }
            }
        }
    }
}


/// A configured voting stage: config, prompt template and [`Voter`]. The PRM judge
/// ([`super::Judge`] = `VotingStage<JudgeConfig>`) and the hint judge (`crate::hint::Hinter` =
/// `VotingStage<HintConfig>`) are its instances. Share it (`Arc`) between concurrent turns so the
/// concurrency limit and the cache are shared.
#[derive(Debug)]
pub struct VotingStage<C> {
    cfg: C,
    template: PromptTemplate,
    voter: Voter,
}

impl<C: VotingConfig> VotingStage<C> {
    /// A stage with the backend named by `cfg` (its rule baseline for `rules`), a fresh cache and
    /// its own semaphore.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for an invalid config (see [`VotingFields::validate`],
    /// [`build_backend`]); [`crate::Error::Http`] when the HTTP client cannot be built.
    pub fn new(cfg: C) -> Result<VotingStage<C>> {
        let v = cfg.voting();
        v.validate()?;
        let backend = build_backend(v.backend, v.url, v.model, v.api_key_env, v.timeout_s, cfg.rules_backend())?;
        let sem = Arc::new(Semaphore::new(v.concurrency));
        VotingStage::with_parts(cfg, backend, Arc::new(VoteCache::new()), sem)
    }

    /// A stage over a given backend, cache and semaphore (to share them, or to plug in a backend
    /// such as the model runtime's).
    ///
    /// # Errors
    /// [`crate::Error::Config`] for an invalid config.
    pub fn with_parts(cfg: C, backend: Arc<dyn VoteBackend>, cache: Arc<VoteCache>, semaphore: Arc<Semaphore>) -> Result<VotingStage<C>> {
        let v = cfg.voting();
        v.validate()?;
        let voter = Voter::new(backend, semaphore, cache, v.retry_policy(), v.sampling());
        Ok(VotingStage { cfg, template: C::TEMPLATE, voter })
    }

    /// The configuration.
    pub fn config(&self) -> &C {
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

    /// Fingerprint of everything that decides the stage's output: backend, model, template hash,
    /// sampling, m, field limit, then [`VotingConfig::fingerprint_extra`] (the hint judge's strategy
    /// and length threshold).
    pub fn config_fingerprint(&self) -> String {
        let v = self.cfg.voting();
        format!(
            "backend={};model={};template={};{};m={};max_field_chars={}{}",
            self.voter.backend().kind().as_str(),
            self.voter.backend().model(),
            self.template.hash(),
            v.sampling().canonical(),
            v.m,
            v.max_field_chars,
            self.cfg.fingerprint_extra()
        )
    }

    /// Row id of a turn in `pipeline` (`judgment_id`, `hint_id`): hash of the pipeline name, the
    /// interaction id and [`VotingStage::config_fingerprint`] (two pipelines voting on the same turn
    /// keep one row each).
    pub fn row_id(&self, pipeline: &str, interaction_id: &str) -> String {
        content_hash(&[pipeline.as_bytes(), interaction_id.as_bytes(), self.config_fingerprint().as_bytes()])
    }

    /// The start-up probe (a network backend only; `rules` needs none): a vote request on a fixed
    /// two-message turn, with the stage's retries and timeout, before the stage reads any input (up to
    /// [`PROBE_TRIES`] while the answers fail for a reason a retry would not change). An endpoint that
    /// is systematically wrong — 401/403 (key), 404 (URL, path or backend kind), another
    /// 4xx (model, parameters), a 2xx answer that is not the backend's API, or a TLS refusal — stops the
    /// stage with an error naming the settings to check, instead of making every turn an invalid vote.
    /// A server that does not answer yet (transport errors, timeouts, 5xx after every retry) is only
    /// logged: it may come up, and each vote retries on its own. What the model answers is not checked
    /// (an unparsable vote is counted as usual).
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming `[table] url`, `backend`, `model` or `api_key_env`.
    pub async fn probe(&self) -> Result<()> {
        let v = self.cfg.voting();
        if v.backend == BackendKind::Rules {
            return Ok(());
        }
        let turn = TurnContext::probe();
        let messages = self.template.render(&turn, v.max_field_chars)?;
        // The configured sampling: a reasoning judge cut at a few tokens would answer no content.
        let req = VoteRequest { messages: &messages, turn: &turn, index: 0, sampling: v.sampling() };
        // A wrong endpoint fails the same way every time; a flaky one (a gateway's error page now and
        // then) does not: the stage stops only when PROBE_TRIES requests in a row fail for a reason
        // that retrying would not change.
        let mut last = None;
        for _ in 0..PROBE_TRIES {
            let (outcome, _) = self.voter.policy.run(&self.voter.semaphore, || self.voter.backend.complete(req)).await;
            match outcome {
                Ok(_) => {
                    tracing::info!(table = v.table, backend = v.backend.as_str(), url = v.url.unwrap_or(""), "start-up probe answered");
                    return Ok(());
                }
                Err(e) if e.retryable() => {
                    last = Some(e);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some(err) = last else { return Ok(()) };
        let (t, url, model) = (v.table, crate::net::redact_url(v.url.unwrap_or("")), v.model.unwrap_or(""));
        let advice = match &err {
            CallError::Status { status: 401 | 403, .. } => format!("the server refused the key: check [{t}] api_key_env (the variable holding the key{})", v.api_key_env.map(|k| format!(", now {k}")).unwrap_or_default()),
            CallError::Status { status: 404, .. } => format!(
                "nothing answers at that path: check [{t}] url (the server's base URL, without /v1/...) and [{t}] backend = \"{}\" (openai posts to /v1/chat/completions, sglang to /generate)",
                v.backend.as_str()
            ),
            CallError::Status { status, .. } if !err.retryable() => format!("the server rejected the request ({status}): check [{t}] model = \"{model}\" (the served model's name) and [{t}] max_tokens / temperature"),
            CallError::BadResponse(_) => format!("the answer is not the {} API: check [{t}] backend (openai or sglang) against the server", v.backend.as_str()),
            CallError::Tls(_) => format!("check [{t}] url's scheme and the pipeline's [tls] ca_file"),
            _ => {
                tracing::warn!(table = t, url = %url, error = %err, "start-up probe: the endpoint does not answer yet; the stage starts anyway and every vote retries");
                return Ok(());
            }
        };
        Err(config_err!("[{t}] start-up probe: the {} endpoint {url} (model \"{model}\") failed one request: {err}. {advice}", v.backend.as_str()))
    }

    /// The m raw votes on one turn (concurrent, bounded by the shared semaphore, cached votes
    /// reused), in index order, with the template hash they were asked under. Never fails: when the
    /// template does not render, every vote is an invalid vote carrying that error.
    pub async fn raw_votes(&self, turn: &TurnContext) -> (String, Vec<RawVote>) {
        let v = self.cfg.voting();
        let template_hash = self.template.hash();
        let votes = match self.template.render(turn, v.max_field_chars) {
            Ok(messages) => self.voter.vote_all(&messages, turn, &template_hash, v.m).await,
            Err(e) => (0..v.m)
                .map(|index| RawVote { index, raw: String::new(), error: Some(e.to_string()), cached: false, attempts: 0 })
                .collect(),
        };
        (template_hash, votes)
    }
}

#[cfg(test)]
mod tests {
    use backon::BackoffBuilder;

    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let p = RetryPolicy {
            retries: 5,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_millis(500),
            timeout: Duration::from_secs(1),
        };
        let ms: Vec<u128> = p.backoff_schedule().build().map(|d| d.as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 500, 500]);
        let long = RetryPolicy { retries: 200, ..p };
        assert_eq!(long.backoff_schedule().build().last(), Some(Duration::from_millis(500)));
        let base_over_cap = RetryPolicy { backoff_base: Duration::from_secs(60), ..p };
        assert_eq!(base_over_cap.backoff_schedule().build().next(), Some(Duration::from_millis(500)));
    }
}
