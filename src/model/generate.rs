//! Batched sampling with a KV cache.
//!
//! Prompts are left-padded into one batch; each sequence has its own [`SamplingParams`] and random
//! generator, so concurrent server requests can share a batch. Finished sequences are dropped from the
//! batch (their cache rows removed) as soon as they finish.
//!
//! **Log-prob convention** (what [`Generation::logprobs`] holds for each sampled token):
//! - greedy (`temperature == 0`): the plain log-softmax of the model's logits, `log softmax(z)[y]`,
//!   i.e. exactly what [`super::score`] returns for the same tokens;
//! - sampling (`temperature > 0`), [`LogprobMode::Sampling`] (default): the log-probability under the
//!   distribution actually sampled from: `log softmax(z / T)` restricted to the top-k / top-p set and
//!   renormalised over it, `log p_T(y) − log Σ_{j ∈ kept} p_T(j)`;
//! - sampling with [`LogprobMode::Raw`]: the untempered, untruncated `log softmax(z)[y]` (what a
//!   trainer recomputes, so PPO ratios start at 1).
//!
//! Top-p keeps the smallest prefix of tokens sorted by probability whose mass reaches `top_p`
//! (a token is kept when the mass before it is below `top_p`; the most likely token is always kept).

use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

use super::tokenizer::TextTokenizer;
use super::transformer::{AttnMask, KvCache, Transformer};
use crate::{Error, Result};

/// Positions added to the KV cache at a time during generation (see [`set_kv_cache_step`]).
static CACHE_STEP: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(256);

/// Sets how many positions the generation KV cache grows by at a time (default 256). Only memory
/// use and allocation count depend on it, never the results.
pub fn set_kv_cache_step(positions: usize) {
    CACHE_STEP.store(positions.max(1) as i64, std::sync::atomic::Ordering::Relaxed);
}

/// Which distribution [`Generation::logprobs`] refers to for sampled (temperature > 0) tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogprobMode {
    /// The tempered, truncated, renormalised distribution actually sampled from.
    #[default]
    Sampling,
    /// The model's plain log-softmax (temperature 1, no truncation).
    Raw,
}

/// Sampling parameters of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables top-p.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 disables top-k.
    pub top_k: usize,
    /// Maximum number of generated tokens (the stop token, when reached, counts).
    pub max_new_tokens: usize,
    /// Token ids that end the sequence (kept as its last token, not in the text); `None` uses the
    /// model's EOS ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Strings that end the sequence; the text is cut before the first occurrence (the ids keep the
    /// tokens sampled up to the one completing it).
    pub stop_strings: Vec<String>,
    /// Seed of this sequence's random generator (`None`: from entropy).
    pub seed: Option<u64>,
    /// Number of most likely alternatives to report per position (0 = none).
    pub top_logprobs: usize,
    /// Distribution of the reported log-probs of sampled tokens.
    pub logprob_mode: LogprobMode,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 256,
            stop_token_ids: None,
            stop_strings: vec![],
            seed: None,
            top_logprobs: 0,
            logprob_mode: LogprobMode::Sampling,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> SamplingParams {
        SamplingParams { max_new_tokens, ..Default::default() }
    }
    fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
    fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(crate::input_err!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(crate::input_err!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_logprobs > 20 {
            return Err(crate::input_err!("top_logprobs must be at most 20, got {}", self.top_logprobs));
        }
        Ok(())
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_new_tokens` (or the model's context) reached.
    Length,
    /// The caller's callback asked to stop (e.g. the client went away).
    Cancelled,
}

impl FinishReason {
    /// `stop`, `length` or `cancelled` (OpenAI's names for the first two).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// One sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty).
    pub prompt_ids: Vec<u32>,
    /// Its sampling parameters.
    pub params: SamplingParams,
}

/// Reported to the callback after every sampled token.
#[derive(Debug)]
pub struct TokenEvent<'a> {
    /// Index of the request in the batch given to [`generate`].
    pub request: usize,
    /// The sampled token.
    pub token_id: u32,
    /// Its log-prob (see the module docs for the convention), nats.
    pub logprob: f32,
    /// The most likely alternatives (id, log-prob), best first, same distribution as `logprob`.
    pub top_logprobs: &'a [(u32, f32)],
    /// Newly final text (may be empty while a multi-byte character or a possible stop string is
    /// pending; everything is flushed by the last event).
    pub text_delta: &'a str,
    /// Set on the sequence's last event.
    pub finish_reason: Option<FinishReason>,
}

/// The result of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Number of prompt tokens.
    pub prompt_len: usize,
    /// Sampled token ids, including a final stop token.
    pub token_ids: Vec<u32>,
    /// One log-prob per sampled token (nats), see the module docs.
    pub logprobs: Vec<f32>,
    /// Per sampled token, the requested number of alternatives (empty lists when none requested).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The stop string or the text of the stop token that ended it, if any.
    pub matched_stop: Option<String>,
    /// Decoded text without special tokens, cut before a stop string.
    pub text: String,
}

/// Incremental text bookkeeping of one sequence: stop strings and the part of the text that is final.
#[derive(Debug, Clone)]
pub(crate) struct TextTracker {
    stops: Vec<String>,
    emitted: usize,
}

impl TextTracker {
    pub(crate) fn new(stops: Vec<String>) -> TextTracker {
        TextTracker { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), emitted: 0 }
    }

    /// The byte offset and text of the earliest stop string in `text`.
    pub(crate) fn find_stop(&self, text: &str) -> Option<(usize, String)> {
        self.stops.iter().filter_map(|s| text.find(s.as_str()).map(|p| (p, s.clone()))).min_by_key(|(p, _)| *p)
    }

    /// The new final part of `text` (the current decoded text). When not `finished`, trailing
    /// replacement characters (an incomplete UTF-8 sequence) and a suffix that could begin a stop
    /// string are held back.
    pub(crate) fn delta(&mut self, text: &str, finished: bool) -> String {
        let mut end = text.len();
        if !finished {
            end = text.trim_end_matches('\u{FFFD}').len();
            let visible = &text[..end];
            let mut hold = 0;
            for s in &self.stops {
                for (k, _) in s.char_indices().skip(1) {
                    if visible.ends_with(&s[..k]) {
                        hold = hold.max(k);
                    }
                }
            }
            end -= hold;
        }
        if end <= self.emitted {
            return String::new();
        }
        match text.get(self.emitted..end) {
            Some(d) => {
                self.emitted = end;
                d.to_string()
            }
            None => String::new(),
        }
    }
}

struct Row {
    /// The caller's key of the request.
    request: usize,
    params: SamplingParams,
    prompt_len: usize,
    /// Cache column of the prompt's first token (columns before it are padding for this row).
    start_col: usize,
    max_new: usize,
    stop_ids: Vec<u32>,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    tops: Vec<Vec<(u32, f32)>>,
    rng: rand::rngs::StdRng,
    tracker: TextTracker,
    finished: Option<(FinishReason, Option<String>, String)>,
}

/// The tokens chosen for the current batch rows.
struct Choice {
    token: u32,
    logprob: f32,
    tops: Vec<(u32, f32)>,
}

fn to_vec_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(&t.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_reshape([-1])?)?)
}

fn to_vec_i64(t: &Tensor) -> Result<Vec<i64>> {
    Ok(Vec::<i64>::try_from(&t.f_to_kind(Kind::Int64)?.f_to_device(Device::Cpu)?.f_reshape([-1])?)?)
}

/// Chooses one token per row from `logits` `[B, V]` (f32), drawing each row's uniform variate from
/// its own generator. Sorting, truncation and the inverse-CDF draw run on the logits' device.
fn choose(logits: &Tensor, rows: &mut [Row]) -> Result<Vec<Choice>> {
    let b = rows.len() as i64;
    let device = logits.device();
    let v = logits.size()[1];
    let n_top = rows.iter().map(|r| r.params.top_logprobs).max().unwrap_or(0) as i64;
    let raw = logits.f_log_softmax(-1, Kind::Float)?;
    if rows.iter().all(|r| r.params.is_greedy()) {
        let (vals, idx) = raw.f_topk(n_top.max(1), -1, true, true)?;
        let (vals, idx) = (to_vec_f32(&vals)?, to_vec_i64(&idx)?);
        let k = n_top.max(1) as usize;
        return Ok(rows
            .iter()
            .enumerate()
            .map(|(i, r)| Choice {
                token: idx[i * k] as u32,
                logprob: vals[i * k],
                tops: (0..r.params.top_logprobs).map(|j| (idx[i * k + j] as u32, vals[i * k + j])).collect(),
            })
            .collect());
    }
    let temps: Vec<f32> = rows.iter().map(|r| if r.params.is_greedy() { 1.0 } else { r.params.temperature }).collect();
    let temps = Tensor::f_from_slice(&temps)?.f_to_device(device)?.f_unsqueeze(1)?;
    let logp = logits.f_div(&temps)?.f_log_softmax(-1, Kind::Float)?;
    let (sorted, idx) = logp.f_sort(-1, true)?;
    // Kept set per row: rank < top_k (when set) and mass before the token < top_p; rank 0 always.
    let top_p: Vec<f32> = rows.iter().map(|r| if r.params.is_greedy() { 0.0 } else { r.params.top_p }).collect();
    let top_k: Vec<i64> = rows.iter().map(|r| if r.params.is_greedy() { 1 } else if r.params.top_k == 0 { v } else { r.params.top_k as i64 }).collect();
    let probs = sorted.f_exp()?;
    let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
    let p_lim = Tensor::f_from_slice(&top_p)?.f_to_device(device)?.f_unsqueeze(1)?;
    let k_lim = Tensor::f_from_slice(&top_k)?.f_to_device(device)?.f_unsqueeze(1)?;
    let rank = Tensor::f_arange(v, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let no_p: Vec<bool> = rows.iter().map(|r| !r.params.is_greedy() && r.params.top_p >= 1.0).collect();
    let no_p = Tensor::f_from_slice(&no_p)?.f_to_device(device)?.f_unsqueeze(1)?;
    let keep = before.f_lt_tensor(&p_lim)?.f_logical_or(&no_p)?.f_logical_and(&rank.f_lt_tensor(&k_lim)?)?.f_logical_or(&rank.f_eq(0)?)?;
    let masked = sorted.f_masked_fill(&keep.f_logical_not()?, f64::NEG_INFINITY)?;
    let log_z = masked.f_logsumexp([-1], true)?; // [B, 1]
    let kept_probs = masked.f_sub(&log_z)?.f_exp()?;
    let cum = kept_probs.f_cumsum(-1, Kind::Float)?;
    let u: Vec<f32> = rows.iter_mut().map(|r| r.rng.gen::<f32>()).collect();
    let u = Tensor::f_from_slice(&u)?.f_to_device(device)?.f_unsqueeze(1)?;
    let n_kept = keep.f_sum_dim_intlist(-1i64, true, Kind::Int64)?;
    let j = cum.f_lt_tensor(&u)?.f_sum_dim_intlist(-1i64, true, Kind::Int64)?.f_minimum(&n_kept.f_sub_scalar(1)?)?; // [B, 1]
    let token = idx.f_gather(1, &j, false)?;
    let lp_sorted = sorted.f_gather(1, &j, false)?;
    // Sampling-mode values: renormalised over the kept set; greedy rows keep the plain log-softmax.
    let greedy: Vec<bool> = rows.iter().map(|r| r.params.is_greedy()).collect();
    let greedy_t = Tensor::f_from_slice(&greedy)?.f_to_device(device)?.f_unsqueeze(1)?;
    let lp_samp = lp_sorted.f_where_self(&greedy_t, &lp_sorted.f_sub(&log_z)?)?;
    let k = n_top.max(1);
    let top_ids = idx.f_narrow(1, 0, k)?;
    let top_samp = sorted.f_narrow(1, 0, k)?.f_where_self(&greedy_t, &masked.f_narrow(1, 0, k)?.f_sub(&log_z)?)?;
    // Raw-mode values for every row (cheap gathers; used where asked).
    let raw_tok = raw.f_gather(1, &token, false)?;
    let raw_top = raw.f_gather(1, &top_ids, false)?;
    let (token, lp_samp, raw_tok) = (to_vec_i64(&token)?, to_vec_f32(&lp_samp)?, to_vec_f32(&raw_tok)?);
    let (top_ids, top_samp, raw_top) = (to_vec_i64(&top_ids)?, to_vec_f32(&top_samp)?, to_vec_f32(&raw_top)?);
    let k = k as usize;
    let mut out = Vec::with_capacity(b as usize);
    for (i, r) in rows.iter().enumerate() {
        let raw_mode = r.params.logprob_mode == LogprobMode::Raw && !r.params.is_greedy();
        let logprob = if raw_mode { raw_tok[i] } else { lp_samp[i] };
        let tops = (0..r.params.top_logprobs)
            .map(|jj| (top_ids[i * k + jj] as u32, if raw_mode { raw_top[i * k + jj] } else { top_samp[i * k + jj] }))
            .filter(|(_, lp)| lp.is_finite())
            .collect();
        out.push(Choice { token: token[i] as u32, logprob, tops });
    }
    Ok(out)
}

/// Checks one request against the model: valid sampling parameters, a non-empty prompt of ids inside
/// the vocabulary that leaves room for at least one new token.
///
/// # Errors
/// [`Error::InvalidInput`] describing the first problem.
pub fn check_request(config: &super::config::ModelConfig, r: &GenerationRequest) -> Result<()> {
    r.params.validate()?;
    if r.prompt_ids.is_empty() {
        return Err(crate::input_err!("empty prompt"));
    }
    if let Some(&bad) = r.prompt_ids.iter().find(|&&t| t as usize >= config.vocab_size) {
        return Err(crate::input_err!("token id {bad} outside the vocabulary of {}", config.vocab_size));
    }
    if r.prompt_ids.len() >= config.max_position_embeddings {
        return Err(crate::input_err!("prompt of {} tokens fills the context of {}", r.prompt_ids.len(), config.max_position_embeddings));
    }
    Ok(())
}

/// Generates continuations for a batch of requests; `on_event` is called after every sampled token
/// of every sequence, and returning `false` cancels that sequence ([`FinishReason::Cancelled`]).
/// [`TokenEvent::request`] is the request's index in `requests`.
///
/// `default_stop_ids` are used for requests whose `stop_token_ids` is `None`. `max_new_tokens` is
/// lowered so no sequence exceeds the model's `max_position_embeddings`. A [`Decoder`] with every
/// request admitted at once.
///
/// # Errors
/// [`Error::InvalidInput`] for an empty prompt, a token id outside the vocabulary, a prompt that
/// fills the context, or invalid sampling parameters; [`Error::Torch`] on a tensor failure (e.g. out
/// of memory).
pub fn generate(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    default_stop_ids: &[u32],
    requests: &[GenerationRequest],
    on_event: &mut dyn FnMut(&TokenEvent<'_>) -> bool,
) -> Result<Vec<Generation>> {
    let mut decoder = Decoder::new(model, tokenizer, default_stop_ids);
    let keyed: Vec<(usize, GenerationRequest)> = requests.iter().cloned().enumerate().collect();
    let mut results: Vec<Option<Generation>> = vec![None; requests.len()];
    for (i, g) in decoder.admit(&keyed)? {
        results[i] = Some(g);
    }
    while !decoder.is_empty() {
        for (i, g) in decoder.step(on_event)? {
            results[i] = Some(g);
        }
    }
    results
        .into_iter()
        .enumerate()
        .map(|(i, g)| g.ok_or_else(|| Error::Internal(format!("request {i} produced no result"))))
        .collect()
}

/// The rows being decoded: their KV cache `[B, n_kv, capacity, d]` per layer, the key-valid mask
/// `[B, capacity]` (bool, false on left padding and unfilled columns) and each row's next-token logits
/// `[B, V]` (f32).
struct Running {
    cache: KvCache,
    valid: Tensor,
    logits: Tensor,
}

/// A decoding batch that requests join and leave at token boundaries (continuous batching): the
/// caller admits new requests between [`Decoder::step`] calls, and each finished sequence leaves the
/// batch (its cache rows dropped) at the step it finishes, so a short request never waits for a long
/// one and a free row is refilled without waiting for the batch to drain.
///
/// Each admitted group is prefilled on its own (left-padded to its longest prompt), then its cache is
/// concatenated with the running one, both right-aligned: the t-th generated token of every row
/// sits at the same cache column, so one decoding step serves all rows; positions (RoPE) are each
/// row's own, and the padding columns are masked. Cache columns no row attends to any more (the left
/// padding of a finished long prompt) are dropped when rows leave. Masked columns change no result
/// beyond floating-point summation order: greedy tokens equal decoding each request alone
/// (`tests/model_train/model.rs`). Each row keeps its own random generator, so a seeded request samples the same
/// tokens whatever it is batched with.
pub struct Decoder<'m> {
    model: &'m Transformer,
    tokenizer: &'m TextTokenizer,
    default_stop_ids: Vec<u32>,
    rows: Vec<Row>,
    running: Option<Running>,
}

impl<'m> Decoder<'m> {
    /// An empty batch decoding with `model`; `default_stop_ids` end requests whose `stop_token_ids`
    /// is `None`.
    pub fn new(model: &'m Transformer, tokenizer: &'m TextTokenizer, default_stop_ids: &[u32]) -> Decoder<'m> {
        Decoder { model, tokenizer, default_stop_ids: default_stop_ids.to_vec(), rows: vec![], running: None }
    }

    /// Sequences being decoded.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no sequence is being decoded.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Admits `requests` (each with the caller's key, reported as [`TokenEvent::request`] and with its
    /// result): one forward pass over their prompts, after which the next [`Decoder::step`] samples
    /// their first tokens with the rows already running. Requests asking for no tokens are returned at
    /// once, finished ([`FinishReason::Length`], no tokens). `max_new_tokens` is lowered so no sequence
    /// exceeds the model's `max_position_embeddings`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the first invalid request (see [`check_request`]); nothing is
    /// admitted then. [`Error::Torch`] on a tensor failure; the batch is left as it was.
    /// [`Error::Internal`] after a failed [`Decoder::step`] (the batch is lost; drop the decoder).
    pub fn admit(&mut self, requests: &[(usize, GenerationRequest)]) -> Result<Vec<(usize, Generation)>> {
        if self.running.is_none() && !self.rows.is_empty() {
            return Err(Error::Internal("decoder lost its batch in an earlier failed step".into()));
        }
        let _guard = tch::no_grad_guard();
        let model = self.model;
        let cfg = &model.config;
        let device = model.device();
        let max_pos = cfg.max_position_embeddings;
        let mut rows = Vec::with_capacity(requests.len());
        let mut done = vec![];
        for (key, r) in requests {
            check_request(cfg, r).map_err(|e| match e {
                Error::InvalidInput(m) => crate::input_err!("request {key}: {m}"),
                other => other,
            })?;
        }
        for (key, r) in requests {
            let max_new = r.params.max_new_tokens.min(max_pos - r.prompt_ids.len());
            if max_new == 0 {
                // Requests asking for no tokens finish at once.
                let g = Generation {
                    prompt_len: r.prompt_ids.len(),
                    token_ids: vec![],
                    logprobs: vec![],
                    top_logprobs: vec![],
                    finish_reason: FinishReason::Length,
                    matched_stop: None,
                    text: String::new(),
                };
                done.push((*key, g));
                continue;
            }
            let rng = match r.params.seed {
                Some(s) => rand::rngs::StdRng::seed_from_u64(s),
                None => rand::rngs::StdRng::from_entropy(),
            };
            rows.push((
                &r.prompt_ids,
                Row {
                    request: *key,
                    prompt_len: r.prompt_ids.len(),
                    start_col: 0,
                    max_new,
                    stop_ids: r.params.stop_token_ids.clone().unwrap_or_else(|| self.default_stop_ids.clone()),
                    ids: vec![],
                    logprobs: vec![],
                    tops: vec![],
                    rng,
                    tracker: TextTracker::new(r.params.stop_strings.clone()),
                    finished: None,
                    params: r.params.clone(),
                },
            ));
        }
        if rows.is_empty() {
            return Ok(done);
        }

        let b = rows.len() as i64;
        let p = rows.iter().map(|(_, r)| r.prompt_len).max().unwrap_or(1) as i64;
        // The cache starts with room for CACHE_STEP new tokens and grows by CACHE_STEP as needed, so a
        // large max_new_tokens does not allocate memory that short answers never use.
        let step = CACHE_STEP.load(std::sync::atomic::Ordering::Relaxed);
        let max_len = p + rows.iter().map(|(_, r)| r.max_new).max().unwrap_or(1) as i64;
        let cap = max_len.min(p + step);
        let mut ids = vec![0i64; (b * p) as usize];
        let mut valid = vec![false; (b * cap) as usize];
        let mut pos = vec![0i64; (b * p) as usize];
        for (i, (prompt, r)) in rows.iter_mut().enumerate() {
            let off = p as usize - r.prompt_len;
            r.start_col = off;
            for (j, &t) in prompt.iter().enumerate() {
                ids[i * p as usize + off + j] = t as i64;
                valid[i * cap as usize + off + j] = true;
                pos[i * p as usize + off + j] = j as i64;
            }
        }
        let ids = Tensor::f_from_slice(&ids)?.f_view([b, p])?.f_to_device(device)?;
        let pos = Tensor::f_from_slice(&pos)?.f_view([b, p])?.f_to_device(device)?;
        let valid = Tensor::f_from_slice(&valid)?.f_view([b, cap])?.f_to_device(device)?;
        let mut cache = KvCache::new(cfg, b as usize, cap as usize, model.dtype(), device)?;
        let same_len = rows.iter().all(|(_, r)| r.prompt_len as i64 == p);
        let hidden = if same_len {
            model.forward_hidden(&ids, &pos, AttnMask::Causal, Some(&mut cache))?
        } else {
            // Causal and key-valid; a padded query row may see itself so no row is fully masked.
            let causal = Tensor::f_ones([p, p], (Kind::Bool, device))?.f_tril(0)?;
            let eye = Tensor::f_eye(p, (Kind::Bool, device))?;
            let keys = valid.f_narrow(1, 0, p)?.f_view([b, 1, 1, p])?;
            let mask = causal.f_view([1, 1, p, p])?.f_logical_and(&keys)?.f_logical_or(&eye.f_view([1, 1, p, p])?)?;
            model.forward_hidden(&ids, &pos, AttnMask::Explicit(&mask), Some(&mut cache))?
        };
        let logits = model.logits(&hidden.f_narrow(1, p - 1, 1)?.f_squeeze_dim(1)?)?.f_to_kind(Kind::Float)?;
        let mut new_rows: Vec<Row> = rows.into_iter().map(|(_, r)| r).collect();
        let added = Running { cache, valid, logits };
        // Join the running batch (right-aligned); nothing of `self` changes until every tensor is built.
        let running = match &self.running {
            None => added,
            Some(old) => {
                let room = (old.cache.capacity() - old.cache.len()).max(added.cache.capacity() - added.cache.len()).max(1);
                let (cache, shift_old, shift_new) = old.cache.concat_right_aligned(&added.cache, room)?;
                let valid = Tensor::f_zeros([old.valid.size()[0] + b, cache.capacity() as i64], (Kind::Bool, device))?;
                let (n_old, len_old, len_new) = (old.valid.size()[0], old.cache.len() as i64, added.cache.len() as i64);
                valid.f_narrow(0, 0, n_old)?.f_narrow(1, shift_old as i64, len_old)?.f_copy_(&old.valid.f_narrow(1, 0, len_old)?)?;
                valid.f_narrow(0, n_old, b)?.f_narrow(1, shift_new as i64, len_new)?.f_copy_(&added.valid.f_narrow(1, 0, len_new)?)?;
                let logits = Tensor::f_cat(&[&old.logits, &added.logits], 0)?;
                for r in self.rows.iter_mut() {
                    r.start_col += shift_old;
                }
                for r in new_rows.iter_mut() {
                    r.start_col += shift_new;
                }
                Running { cache, valid, logits }
            }
        };
        self.running = Some(running);
        self.rows.append(&mut new_rows);
        Ok(done)
    }

    /// One decoding step: samples the next token of every running sequence, reports it to `on_event`
    /// (returning `false` cancels that sequence, [`FinishReason::Cancelled`]), removes the sequences
    /// that finished and returns them with their keys, and runs the forward pass of the sampled tokens
    /// of the others. A no-op on an empty batch.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure (e.g. out of memory); the running sequences are then lost
    /// (drop the decoder).
    pub fn step(&mut self, on_event: &mut dyn FnMut(&TokenEvent<'_>) -> bool) -> Result<Vec<(usize, Generation)>> {
        let _guard = tch::no_grad_guard();
        let Some(mut run) = self.running.take() else {
            if self.rows.is_empty() {
                return Ok(vec![]);
            }
            return Err(Error::Internal("decoder lost its batch in an earlier failed step".into()));
        };
        let (model, tokenizer) = (self.model, self.tokenizer);
        let device = model.device();
        let choices = choose(&run.logits, &mut self.rows)?;
        for (row, ch) in self.rows.iter_mut().zip(choices) {
            row.ids.push(ch.token);
            row.logprobs.push(ch.logprob);
            row.tops.push(ch.tops);
            let mut finish = None;
            let mut matched = None;
            let text_ids: &[u32] = if row.stop_ids.contains(&ch.token) {
                finish = Some(FinishReason::Stop);
                matched = Some(tokenizer.decode(&[ch.token], false).unwrap_or_default());
                &row.ids[..row.ids.len() - 1]
            } else {
                &row.ids
            };
            let mut text = tokenizer.decode(text_ids, true)?;
            if finish.is_none() {
                if let Some((at, s)) = row.tracker.find_stop(&text) {
                    text.truncate(at);
                    finish = Some(FinishReason::Stop);
                    matched = Some(s);
                } else if row.ids.len() >= row.max_new {
                    finish = Some(FinishReason::Length);
                }
            }
            let delta = row.tracker.delta(&text, finish.is_some());
            let ev = TokenEvent {
                request: row.request,
                token_id: ch.token,
                logprob: ch.logprob,
                top_logprobs: row.tops.last().map(|v| v.as_slice()).unwrap_or(&[]),
                text_delta: &delta,
                finish_reason: finish,
            };
            if !on_event(&ev) && finish.is_none() {
                finish = Some(FinishReason::Cancelled);
            }
            if let Some(f) = finish {
                row.finished = Some((f, matched, text));
            }
        }
        // Move finished rows out; shrink the batch and drop the cache columns no row attends to.
        let mut done = vec![];
        let keep: Vec<i64> = self.rows.iter().enumerate().filter(|(_, r)| r.finished.is_none()).map(|(i, _)| i as i64).collect();
        if keep.len() < self.rows.len() {
            let mut kept_rows = Vec::with_capacity(keep.len());
            for mut r in self.rows.drain(..) {
                match r.finished.take() {
                    Some((finish_reason, matched_stop, text)) => {
                        let g = Generation { prompt_len: r.prompt_len, token_ids: r.ids, logprobs: r.logprobs, top_logprobs: r.tops, finish_reason, matched_stop, text };
                        done.push((r.request, g));
                    }
                    None => kept_rows.push(r),
                }
            }
            self.rows = kept_rows;
            if self.rows.is_empty() {
                return Ok(done);
            }
            let front = self.rows.iter().map(|r| r.start_col).min().unwrap_or(0);
            let keep_t = Tensor::f_from_slice(&keep)?.f_to_device(device)?;
            let cap = run.cache.capacity() as i64;
            run.cache.select_rows_from(&keep_t, front)?;
            run.valid = run.valid.f_narrow(1, front as i64, cap - front as i64)?.f_index_select(0, &keep_t)?;
            for r in self.rows.iter_mut() {
                r.start_col -= front;
            }
        }
        // Feed the sampled tokens: each row's t-th generated token sits at the same cache column
        // (right-aligned rows) and at RoPE position prompt_len + t.
        let bb = self.rows.len() as i64;
        let col = run.cache.len() as i64;
        let toks: Vec<i64> = self.rows.iter().map(|r| r.ids.last().copied().unwrap_or(0) as i64).collect();
        let poss: Vec<i64> = self.rows.iter().map(|r| (r.prompt_len + r.ids.len() - 1) as i64).collect();
        let toks = Tensor::f_from_slice(&toks)?.f_view([bb, 1])?.f_to_device(device)?;
        let poss = Tensor::f_from_slice(&poss)?.f_view([bb, 1])?.f_to_device(device)?;
        if col + 1 > run.cache.capacity() as i64 {
            // Room for the tokens still to feed: a row with n of max_new tokens feeds max_new − n more.
            let needed = col + self.rows.iter().map(|r| (r.max_new - r.ids.len()) as i64).max().unwrap_or(1);
            let step = CACHE_STEP.load(std::sync::atomic::Ordering::Relaxed);
            let grown = (run.cache.capacity() as i64 + step).min(needed).max(col + 1);
            run.cache.reserve(grown as usize)?;
            let extra = Tensor::f_zeros([bb, grown - run.valid.size()[1]], (Kind::Bool, device))?;
            run.valid = Tensor::f_cat(&[&run.valid, &extra], 1)?;
        }
        let _ = run.valid.f_narrow(1, col, 1)?.f_fill_(1)?;
        let mask = run.valid.f_narrow(1, 0, col + 1)?.f_view([bb, 1, 1, col + 1])?;
        let hidden = model.forward_hidden(&toks, &poss, AttnMask::Explicit(&mask), Some(&mut run.cache))?;
        run.logits = model.logits(&hidden.f_squeeze_dim(1)?)?.f_to_kind(Kind::Float)?;
        self.running = Some(run);
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_holds_back_partial_stop_strings() {
        let mut t = TextTracker::new(vec!["</s>".into()]);
        assert_eq!(t.delta("Hello <", false), "Hello ");
        assert_eq!(t.delta("Hello </", false), "");
        assert_eq!(t.delta("Hello <b", false), "<b");
        assert_eq!(t.find_stop("Hello <b</s>x"), Some((8, "</s>".to_string())));
        assert_eq!(t.delta("Hello <b", true), "");
    }

    #[test]
    fn tracker_waits_for_complete_characters() {
        let mut t = TextTracker::new(vec![]);
        assert_eq!(t.delta("a\u{FFFD}", false), "a");
        assert_eq!(t.delta("aé", false), "é");
        assert_eq!(t.delta("aé!", true), "!");
    }

    #[test]
    fn validates_params() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: f32::NAN, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }

    fn row(params: SamplingParams) -> Row {
        Row {
            request: 0,
            prompt_len: 1,
            start_col: 0,
            max_new: 1,
            stop_ids: vec![],
            ids: vec![],
            logprobs: vec![],
            tops: vec![],
            rng: rand::rngs::StdRng::seed_from_u64(params.seed.unwrap_or(0)),
            tracker: TextTracker::new(vec![]),
            finished: None,
            params,
        }
    }

    #[test]
    fn choose_greedy_top_k_and_top_p() {
        // log-probs of 4 tokens: p = [0.5, 0.3, 0.15, 0.05].
        let p = [0.5f32, 0.3, 0.15, 0.05];
        let logits = Tensor::from_slice(&p.map(f32::ln)).view([1, 4]);
        // Greedy: token 0, plain log-softmax ln 0.5, top-2 alternatives.
        let mut rows = vec![row(SamplingParams { top_logprobs: 2, ..Default::default() })];
        let c = choose(&logits, &mut rows).unwrap();
        assert_eq!(c[0].token, 0);
        assert!((c[0].logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(c[0].tops.len(), 2);
        assert!((c[0].tops[1].1 - 0.3f32.ln()).abs() < 1e-6);
        // top_k = 1 at temperature 1: always token 0 with probability 1 → log-prob 0.
        let mut rows = vec![row(SamplingParams { temperature: 1.0, top_k: 1, seed: Some(3), ..Default::default() })];
        let c = choose(&logits, &mut rows).unwrap();
        assert_eq!((c[0].token, c[0].logprob), (0, 0.0));
        // top_p = 0.6 keeps {0, 1} (mass before token 1 is 0.5 < 0.6, before token 2 is 0.8):
        // renormalised p(0) = 0.5/0.8, p(1) = 0.3/0.8; Raw mode reports ln 0.5 / ln 0.3 instead.
        for seed in 0..20 {
            let mut rows = vec![
                row(SamplingParams { temperature: 1.0, top_p: 0.6, seed: Some(seed), ..Default::default() }),
                row(SamplingParams { temperature: 1.0, top_p: 0.6, seed: Some(seed), logprob_mode: LogprobMode::Raw, ..Default::default() }),
            ];
            let c = choose(&Tensor::cat(&[&logits, &logits], 0), &mut rows).unwrap();
            assert!(c[0].token <= 1 && c[0].token == c[1].token, "seed {seed}: {}", c[0].token);
            let (renorm, raw) = if c[0].token == 0 { (0.5f32 / 0.8, 0.5f32) } else { (0.3 / 0.8, 0.3) };
            assert!((c[0].logprob - renorm.ln()).abs() < 1e-5);
            assert!((c[1].logprob - raw.ln()).abs() < 1e-5);
        }
        // Temperature 2 with no truncation: p_T ∝ sqrt(p).
        let z: f32 = p.iter().map(|x| x.sqrt()).sum();
        let mut rows = vec![row(SamplingParams { temperature: 2.0, seed: Some(1), ..Default::default() })];
        let c = choose(&logits, &mut rows).unwrap();
        let want = (p[c[0].token as usize].sqrt() / z).ln();
        assert!((c[0].logprob - want).abs() < 1e-5);
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        // p = [0.7, 0.2, 0.1]; 2000 draws at temperature 1: counts near 1400/400/200.
        let logits = Tensor::from_slice(&[0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()]).view([1, 3]);
        let mut rows = vec![row(SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() })];
        let mut counts = [0usize; 3];
        for _ in 0..2000 {
            counts[choose(&logits, &mut rows).unwrap()[0].token as usize] += 1;
        }
        assert!((1320..1480).contains(&counts[0]), "{counts:?}");
        assert!((340..460).contains(&counts[1]), "{counts:?}");
    }
}
