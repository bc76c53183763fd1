//! The remote teacher: the teacher's log-probs of the student's response tokens from an inference
//! server that holds the teacher model (`[teacher] backend = "sglang" | "vllm"`), instead of in-process.
//!
//! The alignment contract is the local teacher's (docs/method.md §4): the request is the teacher prompt ids
//! (rendered and tokenised locally, with the policy's template and tokenizer) followed by the student's
//! response ids, scored in one prefill; the answer is read back so that `logprobs[i]` scores
//! `response[i]` given the teacher prompt and `response[..i]`, and every value is checked against the
//! token id the server says it scored.
//!
//! - **SGLang** (`POST {url}/generate`, native API): `{"input_ids", "sampling_params": {"max_new_tokens":
//!   0, "temperature": 0}, "return_logprob": true, "logprob_start_len": P − 1, "top_logprobs_num": K}`.
//!   SGLang's `meta_info.input_token_logprobs` holds one `[logprob, token_id, text]` per input position
//!   from `logprob_start_len` on, entry j scoring `input_ids[logprob_start_len + j]` given the ids before
//!   it, and its entry 0 is always `null` (SGLang pads the first entry and drops the sampling position's
//!   value; `scheduler_output_processor_mixin.py`, "Always pad the first one with None"). Starting at
//!   P − 1 therefore gives T + 1 entries: a `null`, then the T response tokens.
//!   `meta_info.input_top_logprobs` has the same layout with a list of K `[logprob, token_id, text]`
//!   per position.
//! - **vLLM** (`POST {url}/v1/completions`, OpenAI-compatible with vLLM's `prompt_logprobs` extension):
//!   `{"model", "prompt": [ids], "max_tokens": 1, "temperature": 0, "prompt_logprobs": K}` (vLLM
//!   refuses `max_tokens` = 0; the one generated token is ignored). `choices[0].prompt_logprobs` has one
//!   element per prompt position: `null` for position 0, then a map `{"<token id>": {"logprob", "rank",
//!   "decoded_token"}}` holding the actual token and the K most likely ones (K or K + 1 entries). vLLM
//!   writes a log-prob of −∞ as −9999.0 (`clamp_prompt_logprobs`), which is read back as non-finite.
//!
//! A remote teacher cannot score the student's top-K ids (multi-candidate hints, `candidates` > 1):
//! neither API returns log-probs at given ids for prompt positions, so config validation refuses that
//! combination.
//!
//! Calls run concurrently (at most `teacher.batch` in flight), each with the judge's retry policy
//! ([`RetryPolicy::run`]: timeouts, retries with exponential backoff on transport errors, 5xx, 408 and
//! 429). What a failure means is in [`RemoteFailure`].

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::{TeacherBackend, TeacherConfig};
use crate::error::{Error, Result};
use crate::judge::{endpoint_url, post_json, ApiKey, CallError, RetryPolicy, BACKOFF_MAX};
use crate::model::ScoredResponse;

/// vLLM's wire value for a log-prob of −∞ in prompt log-probs (`clamp_prompt_logprobs`).
pub const VLLM_NEG_INF: f64 = -9999.0;

/// Why one remote scoring request gave no teacher log-probs.
#[derive(Debug)]
pub enum RemoteFailure {
    /// The server is not usable for any turn: transport errors, timeouts, 5xx, 408 or 429 after every
    /// retry, a TLS failure, or 401 / 403 / 404 (wrong key or URL). The stage stops with this error
    /// (its input is not committed, so the turns are read again after a restart) rather than
    /// dead-lettering every turn while the teacher is down.
    Unavailable(Error),
    /// This turn's request or answer is at fault: another 4xx (e.g. a prompt longer than the
    /// server's context), or an answer that does not follow the API (see [`parse_sglang`],
    /// [`parse_vllm`]). The turn is dead-lettered with `code` as the reason.
    Turn {
        /// Dead-letter reason: `teacher_rejected`, `teacher_bad_response`, `logprob_length_mismatch`
        /// or `non_finite_logprob`.
        code: &'static str,
        /// What went wrong, for the dead letter's message.
        error: Error,
    },
}

/// A client for a remote teacher (module docs). Cheap to share behind an `Arc`.
pub struct RemoteTeacher {
    client: reqwest::Client,
    backend: TeacherBackend,
    url: String,
    model: String,
    key: Option<ApiKey>,
    top_k: usize,
    policy: RetryPolicy,
    semaphore: Arc<Semaphore>,
}

impl std::fmt::Debug for RemoteTeacher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTeacher").field("backend", &self.backend).field("url", &self.url).field("model", &self.model).field("key", &self.key).finish()
    }
}

impl RemoteTeacher {
    /// A client for the remote backend of `cfg` (`url`, `model`, `api_key_env`, `timeout_s`, `retries`,
    /// `backoff_base_ms`, `top_k`; `batch` calls in flight). The URL may be the server's base or the
    /// full endpoint path (`/generate`, `/v1/completions`).
    ///
    /// # Errors
    /// [`Error::Config`] for the local backend, a missing `url` / `model`, or an unset `api_key_env`
    /// variable; [`Error::Config`] / [`Error::Http`] when the HTTP client cannot be built.
    pub fn new(cfg: &TeacherConfig) -> Result<RemoteTeacher> {
        let path = match cfg.backend {
            TeacherBackend::Local => return Err(Error::Config("teacher.backend = \"local\" has no remote client".into())),
            TeacherBackend::Sglang => "/generate",
            TeacherBackend::Vllm => "/v1/completions",
        };
        let url = cfg.url.as_deref().filter(|u| !u.trim().is_empty()).ok_or_else(|| Error::Config(format!("teacher.backend = \"{}\" needs teacher.url", cfg.backend.as_str())))?;
        let model = cfg.remote_model().ok_or_else(|| Error::Config(format!("teacher.backend = \"{}\" needs teacher.model (the served model id)", cfg.backend.as_str())))?;
        let timeout = Duration::from_secs_f64(cfg.timeout_s);
        Ok(RemoteTeacher {
            client: crate::net::http_client(Some(timeout))?,
            backend: cfg.backend,
            url: endpoint_url(url, path),
            model,
            key: cfg.api_key_env.as_deref().map(ApiKey::from_env).transpose()?,
            top_k: cfg.top_k,
            policy: RetryPolicy { retries: cfg.retries, backoff_base: Duration::from_millis(cfg.backoff_base_ms), backoff_max: BACKOFF_MAX, timeout },
            semaphore: Arc::new(Semaphore::new(cfg.batch.max(1))),
        })
    }

    /// The full endpoint URL requests go to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The served model id (recorded as `teacher_model`).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The request body scoring `response` after `prompt` (module docs for each API).
    pub fn request_body(&self, prompt: &[u32], response: &[u32]) -> Value {
        let ids: Vec<u32> = prompt.iter().chain(response).copied().collect();
        match self.backend {
            TeacherBackend::Vllm => json!({
                "model": self.model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": self.top_k,
            }),
            _ => {
                let mut body = json!({
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": true,
                    "logprob_start_len": prompt.len().saturating_sub(1),
                    "return_text_in_logprobs": false,
                });
                if self.top_k > 0 {
                    body["top_logprobs_num"] = json!(self.top_k);
                }
                body
            }
        }
    }

    /// Scores one (teacher prompt, response) pair, with retries.
    ///
    /// # Errors
    /// [`RemoteFailure`]: `Unavailable` when the server cannot be used, `Turn` when this turn's request
    /// or answer is at fault.
    pub async fn score_one(&self, prompt: &[u32], response: &[u32]) -> std::result::Result<ScoredResponse, RemoteFailure> {
        if prompt.is_empty() {
            return Err(RemoteFailure::Turn { code: "teacher_rejected", error: Error::InvalidInput("empty teacher prompt".into()) });
        }
        let body = self.request_body(prompt, response);
        let (outcome, counts) = self.policy.run(&self.semaphore, || post_json(&self.client, &self.url, self.key.as_ref(), &body, self.policy.timeout.as_secs_f64())).await;
        let answer = match outcome {
            Ok(v) => v,
            Err(e) => {
                let attempts = counts.attempts;
                let turn_fault = match &e {
                    CallError::Status { status, .. } => !matches!(*status, 401 | 403 | 404) && !e.retryable(),
                    CallError::BadResponse(_) => true,
                    _ => false,
                };
                let error = Error::Http(crate::net::redact_url(&format!("remote teacher {} ({}) after {attempts} attempt(s): {e}", self.url, self.backend.as_str())));
                return Err(if turn_fault {
                    let code = if matches!(e, CallError::BadResponse(_)) { "teacher_bad_response" } else { "teacher_rejected" };
                    RemoteFailure::Turn { code, error }
                } else if let CallError::Timeout(s) = e {
                    RemoteFailure::Unavailable(Error::Timeout(s))
                } else {
                    RemoteFailure::Unavailable(error)
                });
            }
        };
        self.parse(&answer, prompt.len(), response).map_err(|error| {
            let code = match &error {
                Error::NonFinite { .. } => "non_finite_logprob",
                Error::LogprobLenMismatch { .. } => "logprob_length_mismatch",
                _ => "teacher_bad_response",
            };
            RemoteFailure::Turn { code, error }
        })
    }

    /// The start-up probe: scores (up to [`crate::judge::PROBE_TRIES`] times while the failure is this
    /// request's own) a fixed two-token prompt (`prompt` = one token, `response` = one token,
    /// from the policy's tokenizer) before the stage reads any input. A systematically wrong endpoint
    /// stops the stage with an error naming the setting: a 404 or an answer that is not the backend's
    /// API (`[teacher] backend`, `url`: a vLLM answer without `prompt_logprobs`, an SGLang answer
    /// without `meta_info`), a 401/403 (`api_key_env`), a 400 about log-probs (`[teacher] top_k` above
    /// the server's `--max-logprobs`), another rejection (`model`). A server that does not answer yet
    /// is only logged (the stage itself stops on the first unavailable turn, as before).
    ///
    /// # Errors
    /// [`Error::Config`] naming the settings to check.
    pub async fn probe(&self, prompt: &[u32], response: &[u32]) -> Result<()> {
        let b = self.backend.as_str();
        let url = crate::net::redact_url(&self.url);
        let body = self.request_body(prompt, response);
        // As the judge's probe: only PROBE_TRIES failures in a row that a retry would not change (a
        // rejection, an answer not in the API) call the endpoint wrong; the classification is on the
        // call's own error, never on the text of an answer.
        let mut last: Option<(String, String)> = None;
        for _ in 0..crate::judge::PROBE_TRIES {
            let (outcome, _) = self.policy.run(&self.semaphore, || post_json(&self.client, &self.url, self.key.as_ref(), &body, self.policy.timeout.as_secs_f64())).await;
            let answer = match outcome {
                Ok(a) => a,
                Err(e) if e.retryable() => {
                    tracing::warn!(backend = b, url = %url, error = %e, "teacher start-up probe: the server does not answer yet; the stage starts anyway");
                    return Ok(());
                }
                Err(e) => {
                    let advice = match &e {
                        CallError::Status { status: 401 | 403, .. } => "the server refused the key: check [teacher] api_key_env".to_string(),
                        CallError::Status { status: 404, .. } => format!(
                            "nothing answers at that path: check [teacher] url (the server's base URL) and [teacher] backend = \"{b}\" (vllm posts to /v1/completions, sglang to /generate)"
                        ),
                        CallError::Status { body, .. } if body.to_lowercase().contains("logprob") => {
                            format!("the server refused the log-probs asked for: [teacher] top_k = {} must be at most the server's --max-logprobs (vLLM), or 0", self.top_k)
                        }
                        CallError::Status { .. } => format!("the server rejected the request: check [teacher] model = \"{}\" (the served model's name)", self.model),
                        CallError::Tls(_) => "check [teacher] url's scheme and the pipeline's [tls] ca_file".to_string(),
                        // Transport errors and timeouts are retryable, handled above.
                        CallError::BadResponse(_) | CallError::Transport(_) | CallError::Timeout(_) => {
                            format!("the answer is not JSON: check [teacher] backend = \"{b}\" against the server")
                        }
                    };
                    last = Some((e.to_string(), advice));
                    continue;
                }
            };
            match self.parse(&answer, prompt.len(), response) {
                Ok(_) => {
                    tracing::info!(backend = b, url = %url, "teacher start-up probe answered");
                    return Ok(());
                }
                Err(e) => {
                    let advice = format!(
                        "the answer is not what [teacher] backend = \"{b}\" returns (vllm: choices[0].prompt_logprobs, sglang: meta_info.input_token_logprobs): check the backend against the server, and that it returns prompt log-probs"
                    );
                    last = Some((e.to_string(), advice));
                }
            }
        }
        let Some((error, advice)) = last else { return Ok(()) };
        Err(Error::Config(format!("[teacher] start-up probe: the {b} server {url} (model \"{}\") failed to score a two-token prompt: {error}. {advice}", self.model)))
    }

    /// Reads an answer with the backend's parser ([`parse_vllm`] or [`parse_sglang`]).
    fn parse(&self, answer: &Value, prompt_len: usize, response: &[u32]) -> Result<ScoredResponse> {
        match self.backend {
            TeacherBackend::Vllm => parse_vllm(answer, prompt_len, response, self.top_k),
            _ => parse_sglang(answer, response, self.top_k),
        }
    }

    /// Scores every item concurrently (at most `teacher.batch` requests in flight); results in input order.
    pub async fn score_all(&self, items: &[(Vec<u32>, Vec<u32>)]) -> Vec<std::result::Result<ScoredResponse, RemoteFailure>> {
        futures::future::join_all(items.iter().map(|(p, r)| self.score_one(p, r))).await
    }
}

fn bad(msg: String) -> Error {
    Error::InvalidInput(format!("remote teacher answer: {msg}"))
}

/// A log-prob read from an answer: a JSON number that is finite (and not vLLM's −∞ sentinel).
///
/// # Errors
/// [`Error::NonFinite`] at response position `t` for a non-number, `null`, or the −∞ sentinel.
fn finite_logprob(v: Option<&Value>, what: &'static str, t: usize) -> Result<f32> {
    match v.and_then(Value::as_f64) {
        Some(x) if x.is_finite() && x != VLLM_NEG_INF && x <= 1e-3 => Ok(x as f32),
        Some(x) if x > 1e-3 && x.is_finite() => Err(bad(format!("{what} {x} at response position {t} is a positive log-prob"))),
        _ => Err(Error::NonFinite { what, position: t }),
    }
}

fn token_id(v: Option<&Value>, t: usize) -> Result<u32> {
    v.and_then(Value::as_u64).and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad(format!("no token id at response position {t}")))
}

/// Sorts top-K pairs by log-prob, most likely first (stable: ties keep the server's order), as the local
/// scorer returns them.
fn sort_topk(pairs: &mut [(u32, f32)]) {
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
}

/// Top-K ids `[T][K]` and log-probs `[T][K]`, as [`ScoredResponse`] holds them.
type TopK = (Option<Vec<Vec<u32>>>, Option<Vec<Vec<f32>>>);

fn split_topk(rows: Vec<Vec<(u32, f32)>>) -> TopK {
    let ids = rows.iter().map(|r| r.iter().map(|p| p.0).collect()).collect();
    let lps = rows.iter().map(|r| r.iter().map(|p| p.1).collect()).collect();
    (Some(ids), Some(lps))
}

/// Reads an SGLang `/generate` answer to [`RemoteTeacher::request_body`] (`logprob_start_len` = P − 1)
/// into the teacher's scores of `response` (T tokens): `meta_info.input_token_logprobs` must have T + 1
/// entries, entry i + 1 = `[logprob, response[i], _]`; with `top_k` > 0, `meta_info.input_top_logprobs`
/// entry i + 1 holds K `[logprob, id, _]` (returned most likely first). An answer that is a JSON array
/// (SGLang's batch form) is read as its first element.
///
/// # Errors
/// [`Error::LogprobLenMismatch`] for another number of entries; [`Error::NonFinite`] for a missing or
/// non-finite log-prob; [`Error::InvalidInput`] for a missing field, an entry scoring another token id
/// than the response's, or a top-K row of another width than K.
pub fn parse_sglang(answer: &Value, response: &[u32], top_k: usize) -> Result<ScoredResponse> {
    let answer = match answer {
        Value::Array(a) => a.first().ok_or_else(|| bad("empty array".into()))?,
        other => other,
    };
    let meta = answer.get("meta_info").ok_or_else(|| bad("no meta_info".into()))?;
    let entries = meta.get("input_token_logprobs").and_then(Value::as_array).ok_or_else(|| bad("no meta_info.input_token_logprobs list".into()))?;
    let t_len = response.len();
    if entries.len() != t_len + 1 {
        return Err(Error::LogprobLenMismatch { expected: t_len + 1, got: entries.len() });
    }
    let mut logprobs = Vec::with_capacity(t_len);
    for (t, (entry, &want)) in entries[1..].iter().zip(response).enumerate() {
        let e = entry.as_array().ok_or_else(|| bad(format!("input_token_logprobs entry {} is not a [logprob, token_id, text] list", t + 1)))?;
        let id = token_id(e.get(1), t)?;
        if id != want {
            return Err(bad(format!("input_token_logprobs scores token {id} at response position {t}, the response has {want} (misaligned)")));
        }
        logprobs.push(finite_logprob(e.first(), "teacher log-prob", t)?);
    }
    let (topk_ids, topk_logprobs) = if top_k > 0 {
        let rows = meta.get("input_top_logprobs").and_then(Value::as_array).ok_or_else(|| bad("no meta_info.input_top_logprobs list (top_logprobs_num > 0)".into()))?;
        if rows.len() != t_len + 1 {
            return Err(Error::LogprobLenMismatch { expected: t_len + 1, got: rows.len() });
        }
        let mut out = Vec::with_capacity(t_len);
        for (t, row) in rows[1..].iter().enumerate() {
            let row = row.as_array().ok_or_else(|| bad(format!("input_top_logprobs entry {} is not a list", t + 1)))?;
            if row.len() != top_k {
                return Err(bad(format!("{} top log-probs at response position {t}, asked for {top_k}", row.len())));
            }
            let mut pairs = Vec::with_capacity(top_k);
            for e in row {
                let e = e.as_array().ok_or_else(|| bad(format!("a top log-prob at response position {t} is not a [logprob, token_id, text] list")))?;
                pairs.push((token_id(e.get(1), t)?, finite_logprob(e.first(), "teacher top-K log-prob", t)?));
            }
            sort_topk(&mut pairs);
            out.push(pairs);
        }
        split_topk(out)
    } else {
        (None, None)
    };
    Ok(ScoredResponse { logprobs, topk_ids, topk_logprobs, at_logprobs: None, ranks: None })
}

/// Reads a vLLM `/v1/completions` answer to [`RemoteTeacher::request_body`] (prompt = P teacher
/// prompt ids ++ `response`) into the teacher's scores of `response`: `choices[0].prompt_logprobs` must
/// have P + T elements; element P + i must hold `response[i]` (its log-prob is the score) and, with
/// `top_k` > 0, at least K entries, of which the K most likely (by log-prob) are the top-K. When the
/// answer carries `prompt_token_ids` (on the choice or the body), they must be the ids sent.
///
/// # Errors
/// [`Error::LogprobLenMismatch`] for another number of elements; [`Error::NonFinite`] for a missing,
/// non-finite or −9999.0 log-prob of a response token or a top-K entry; [`Error::InvalidInput`] for a
/// missing field, a position without the response token, an unparsable token id key, fewer than K
/// entries, or other prompt ids.
pub fn parse_vllm(answer: &Value, prompt_len: usize, response: &[u32], top_k: usize) -> Result<ScoredResponse> {
    let choice = answer.pointer("/choices/0").ok_or_else(|| bad("no choices[0]".into()))?;
    let positions = choice.get("prompt_logprobs").and_then(Value::as_array).ok_or_else(|| bad("no choices[0].prompt_logprobs list".into()))?;
    let t_len = response.len();
    if positions.len() != prompt_len + t_len {
        return Err(Error::LogprobLenMismatch { expected: prompt_len + t_len, got: positions.len() });
    }
    if let Some(ids) = choice.get("prompt_token_ids").or_else(|| answer.get("prompt_token_ids")).and_then(Value::as_array) {
        let ok = ids.len() == prompt_len + t_len && ids[prompt_len..].iter().zip(response).all(|(v, &r)| v.as_u64() == Some(u64::from(r)));
        if !ok {
            return Err(bad("prompt_token_ids are not the ids sent".into()));
        }
    }
    let mut logprobs = Vec::with_capacity(t_len);
    let mut topk = Vec::with_capacity(if top_k > 0 { t_len } else { 0 });
    for (t, (pos, &want)) in positions[prompt_len..].iter().zip(response).enumerate() {
        let map = pos.as_object().ok_or_else(|| bad(format!("prompt_logprobs element {} (response position {t}) is not a map", prompt_len + t)))?;
        let own = map.get(&want.to_string()).ok_or_else(|| bad(format!("prompt_logprobs at response position {t} has no entry for the response token {want}")))?;
        logprobs.push(finite_logprob(own.get("logprob"), "teacher log-prob", t)?);
        if top_k > 0 {
            if map.len() < top_k {
                return Err(bad(format!("{} prompt log-probs at response position {t}, asked for the top {top_k}", map.len())));
            }
            let mut pairs = Vec::with_capacity(map.len());
            for (key, e) in map {
                let id: u32 = key.parse().map_err(|_| bad(format!("prompt_logprobs key {key:?} at response position {t} is not a token id")))?;
                pairs.push((id, finite_logprob(e.get("logprob"), "teacher top-K log-prob", t)?));
            }
            sort_topk(&mut pairs);
            pairs.truncate(top_k);
            topk.push(pairs);
        }
    }
    let (topk_ids, topk_logprobs) = if top_k > 0 { split_topk(topk) } else { (None, None) };
    Ok(ScoredResponse { logprobs, topk_ids, topk_logprobs, at_logprobs: None, ranks: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u32, lp: f64) -> Value {
        let mut m = serde_json::Map::new();
        m.insert(id.to_string(), json!({"logprob": lp, "rank": 1, "decoded_token": "x"}));
        Value::Object(m)
    }

    /// Prompt [1, 2] + response [7, 8], K = 2: position 2 scores 7 (top: 7, 9), position 3 scores 8,
    /// which is outside the top 2 (top: 5, 6), so its map has K + 1 entries.
    fn vllm_answer() -> Value {
        json!({"choices": [{"index": 0, "text": "", "prompt_token_ids": [1, 2, 7, 8], "prompt_logprobs": [
            null,
            entry(2, -3.0),
            {"7": {"logprob": -0.25, "rank": 1, "decoded_token": "a"}, "9": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}},
            {"8": {"logprob": -4.0, "rank": 7, "decoded_token": "c"}, "5": {"logprob": -0.5, "rank": 1, "decoded_token": "d"},
             "6": {"logprob": -1.0, "rank": 2, "decoded_token": "e"}},
        ]}]})
    }

    #[test]
    fn vllm_prompt_logprobs_are_aligned_on_the_response_tokens() {
        let s = parse_vllm(&vllm_answer(), 2, &[7, 8], 2).unwrap();
        assert_eq!(s.logprobs, vec![-0.25, -4.0]);
        assert_eq!(s.topk_ids, Some(vec![vec![7, 9], vec![5, 6]]));
        assert_eq!(s.topk_logprobs, Some(vec![vec![-0.25, -1.5], vec![-0.5, -1.0]]));
        // K = 0: only the response token's own entry is read.
        let s = parse_vllm(&vllm_answer(), 2, &[7, 8], 0).unwrap();
        assert_eq!((s.logprobs, s.topk_ids), (vec![-0.25, -4.0], None));
        // A one-token response whose first token differs from the prompt's last: position 3 only.
        let s = parse_vllm(&vllm_answer(), 3, &[8], 0).unwrap();
        assert_eq!(s.logprobs, vec![-4.0]);
    }

    #[test]
    fn vllm_answers_that_break_the_contract_are_errors() {
        // Wrong length (the prompt is longer than what was scored).
        assert!(matches!(parse_vllm(&vllm_answer(), 3, &[7, 8], 0), Err(Error::LogprobLenMismatch { expected: 5, got: 4 })));
        // The response token is missing at its position (an answer without the echoed ids).
        let mut a = vllm_answer();
        a["choices"][0].as_object_mut().map(|c| c.remove("prompt_token_ids"));
        let e = parse_vllm(&a, 2, &[7, 9], 0).unwrap_err().to_string();
        assert!(e.contains("no entry for the response token 9"), "{e}");
        // Non-finite: vLLM's -inf sentinel, a null and a string.
        for lp in [json!(-9999.0), Value::Null, json!("nan")] {
            let mut a = vllm_answer();
            a["choices"][0]["prompt_logprobs"][2]["7"]["logprob"] = lp;
            assert!(matches!(parse_vllm(&a, 2, &[7, 8], 0), Err(Error::NonFinite { position: 0, .. })));
        }
        // A null where a response position should be, and no prompt_logprobs at all.
        let mut a = vllm_answer();
        a["choices"][0]["prompt_logprobs"][3] = Value::Null;
        assert!(parse_vllm(&a, 2, &[7, 8], 0).unwrap_err().to_string().contains("not a map"));
        assert!(parse_vllm(&json!({"choices": [{"text": ""}]}), 2, &[7, 8], 0).is_err());
        assert!(parse_vllm(&json!({"error": {"message": "x"}}), 2, &[7, 8], 0).is_err());
        // Fewer entries than K.
        assert!(parse_vllm(&vllm_answer(), 2, &[7, 8], 3).unwrap_err().to_string().contains("asked for the top 3"));
        // Echoed prompt ids that are not the ids sent.
        let mut a = vllm_answer();
        a["choices"][0]["prompt_token_ids"] = json!([1, 2, 7, 9]);
        assert!(parse_vllm(&a, 2, &[7, 8], 0).unwrap_err().to_string().contains("not the ids sent"));
        // A key that is not a token id.
        let mut a = vllm_answer();
        a["choices"][0]["prompt_logprobs"][2]["x"] = json!({"logprob": -2.0, "rank": 3});
        assert!(parse_vllm(&a, 2, &[7, 8], 2).unwrap_err().to_string().contains("not a token id"));
    }

    #[test]
    fn sglang_input_logprobs_skip_the_null_first_entry() {
        let a = json!({"text": "", "meta_info": {
            "input_token_logprobs": [[null, 2, null], [-0.25, 7, null], [-4.0, 8, null]],
            "input_top_logprobs": [null, [[-0.25, 7, null], [-1.5, 9, null]], [[-1.0, 6, null], [-0.5, 5, null]]],
        }});
        let s = parse_sglang(&a, &[7, 8], 2).unwrap();
        assert_eq!(s.logprobs, vec![-0.25, -4.0]);
        assert_eq!(s.topk_ids, Some(vec![vec![7, 9], vec![5, 6]]), "sorted most likely first");
        // The batch form (an array of answers) and a misaligned entry.
        assert_eq!(parse_sglang(&json!([a.clone()]), &[7, 8], 0).unwrap().logprobs, vec![-0.25, -4.0]);
        assert!(parse_sglang(&a, &[8, 8], 0).unwrap_err().to_string().contains("misaligned"));
        assert!(matches!(parse_sglang(&a, &[7], 0), Err(Error::LogprobLenMismatch { expected: 2, got: 3 })));
        let mut b = a.clone();
        b["meta_info"]["input_token_logprobs"][2][0] = Value::Null;
        assert!(matches!(parse_sglang(&b, &[7, 8], 0), Err(Error::NonFinite { position: 1, .. })));
        assert!(parse_sglang(&a, &[7, 8], 3).unwrap_err().to_string().contains("asked for 3"));
    }
}
