//! The batching inference worker: one thread that owns the models ([`Policies`]: the shared policy and
//! the resident tenant adapters), drains queued jobs into batched generation ([`run_batch`]) or
//! scoring-then-generation ([`run_completions`]) calls, one call per policy (a batch never mixes
//! adapters), and swaps in reloaded weights and installs tenant adapters between batches. A chat batch
//! is continuous ([`crate::model::Decoder`]): requests of its policy that arrive while it decodes join
//! it at the next token boundary, and each leaves it (its response sent) at the step it finishes.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::adapters::Policies;
use super::messages::{CompletionJob, CompletionOut, Job, JobEvent, PromptInput, TokenOut, WorkerMsg};
use super::shared::{Shared, TimeClock};
use crate::model::generate::check_request;
use crate::model::{GenerationRequest, LanguageModel};
use crate::{Error, Result};

/// Renders and validates one job; `Err` is (HTTP status, message) for that job alone.
fn prepare(lm: &LanguageModel, job: &Job) -> std::result::Result<GenerationRequest, (StatusCode, String)> {
    let chat = lm.chat_template().ok_or((StatusCode::BAD_REQUEST, format!("model {} has no chat template", lm.dir().display())))?;
    let text = chat.render(&job.messages, job.tools.as_ref(), true, job.template_kwargs.as_ref()).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let prompt_ids = lm.encode(&text).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let mut params = job.params.clone();
    let mut stops = lm.eos_token_ids().to_vec();
    stops.extend(job.extra_stop_ids.iter().copied());
    params.stop_token_ids = Some(stops);
    let req = GenerationRequest { prompt_ids, params };
    check_request(&lm.transformer().config, &req).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    if let Some(&bad) = job.extra_stop_ids.iter().find(|&&t| t as usize >= lm.transformer().config.vocab_size) {
        return Err((StatusCode::BAD_REQUEST, format!("stop token id {bad} outside the vocabulary")));
    }
    Ok(req)
}

/// Fails `jobs` with the error of the model call `what` (400 for invalid input, else 500).
fn fail_jobs(jobs: impl IntoIterator<Item = Job>, e: &Error, what: &str, shared: &Shared) {
    let status = if matches!(e, Error::InvalidInput(_)) { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
    fail_chat(jobs, status, &format!("{what}: {e}"), shared);
}

/// Sends each finished sequence's `Done` to its job (removed from `running`, keyed as the decoder's
/// requests) and counts it completed.
fn send_done(done: Vec<(usize, crate::model::Generation)>, running: &mut std::collections::HashMap<usize, Job>, shared: &Shared) {
    for (key, g) in done {
        if let Some(job) = running.remove(&key) {
            shared.completed.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(JobEvent::Done(g));
        }
    }
}

/// A panic of a model call as an error (the worker thread survives it).
fn caught<T>(r: std::thread::Result<Result<T>>) -> Result<T> {
    r.unwrap_or_else(|_| Err(Error::Internal("internal error during generation".into())))
}

/// Runs chat jobs of one policy (`adapter`'s, or the shared one) in one continuous batch: each job
/// streams its own events, finishes (its `Done` sent) at the step its sequence ends, and `more(room)`
/// is asked after every step for up to `room` further jobs of this policy to join (continuous
/// batching; `max_batch` rows at most). Returns when no sequence is left running.
fn run_batch(lm: &LanguageModel, version: i64, adapter: Option<&str>, jobs: Vec<Job>, shared: &Shared, more: &mut dyn FnMut(usize) -> Vec<Job>) {
    let max_batch = shared.opts.max_batch.max(1);
    let tok = lm.tokenizer();
    let mut decoder = lm.decoder();
    // Running jobs by key (the decoder's request key).
    let mut running: std::collections::HashMap<usize, Job> = std::collections::HashMap::new();
    let mut next_key = 0usize;
    let mut admit = |jobs: Vec<Job>, decoder: &mut crate::model::Decoder<'_>, running: &mut std::collections::HashMap<usize, Job>| {
        let mut keyed = Vec::with_capacity(jobs.len());
        for job in jobs {
            match prepare(lm, &job) {
                Ok(req) => {
                    let _ = job.events.send(JobEvent::Started { version, adapter: adapter.map(str::to_string), prompt_ids: req.prompt_ids.clone() });
                    keyed.push((next_key, req));
                    running.insert(next_key, job);
                    next_key += 1;
                }
                Err((status, message)) => {
                    shared.failed.fetch_add(1, Ordering::Relaxed);
                    let _ = job.events.send(JobEvent::Failed { status, message });
                }
            }
        }
        if keyed.is_empty() {
            return;
        }
        match caught(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decoder.admit(&keyed)))) {
            Ok(done) => send_done(done, running, shared),
            Err(e) => {
                // The batch is unchanged by a failed admission: only these jobs fail.
                tracing::error!("prefill failed for {} requests: {e}", keyed.len());
                fail_jobs(keyed.iter().filter_map(|(k, _)| running.remove(k)), &e, "generation failed", shared);
            }
        }
    };
    // The worker's chat time is counted as it is spent (a continuous batch can last minutes).
    let mut mark = std::time::Instant::now();
    admit(jobs, &mut decoder, &mut running);
    while !decoder.is_empty() {
        TimeClock::add_since(&shared.clock.chat_us, mark);
        mark = std::time::Instant::now();
        let stepped = caught(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            decoder.step(&mut |ev| {
                let Some(job) = running.get(&ev.request) else { return false };
                let top = ev.top_logprobs.iter().map(|&(id, lp)| (id, tok.token_bytes(id), lp)).collect();
                let out = TokenOut { id: ev.token_id, logprob: ev.logprob, bytes: tok.token_bytes(ev.token_id), top, text: ev.text_delta.to_string() };
                // A closed channel means the client went away: cancel this sequence.
                job.events.send(JobEvent::Token(out)).is_ok()
            })
        })));
        match stepped {
            Ok(done) => send_done(done, &mut running, shared),
            Err(e) => {
                tracing::error!("generation failed for a batch of {} requests: {e}", running.len());
                fail_jobs(running.drain().map(|(_, j)| j), &e, "generation failed", shared);
                TimeClock::add_since(&shared.clock.chat_us, mark);
                return;
            }
        }
        let room = max_batch.saturating_sub(decoder.len());
        if room > 0 && !decoder.is_empty() {
            let joining = more(room);
            if !joining.is_empty() {
                admit(joining, &mut decoder, &mut running);
            }
        }
    }
    TimeClock::add_since(&shared.clock.chat_us, mark);
}

/// The chat jobs that may join a running batch of `adapter`'s policy, at most `room`: the jobs of that
/// policy at the front of `pending` (after moving everything received into it), oldest first. Once any
/// other message waits — a shared-policy swap anywhere in the queue, or another kind of message or
/// another policy's job at its front — `closed` is set and nothing joins any more: the batch drains
/// and the worker turns to that message, so a steady stream of requests cannot hold back a swap,
/// an install, a completion request or another tenant.
fn joining_jobs(adapter: &Option<String>, room: usize, rx: &std::sync::mpsc::Receiver<WorkerMsg>, pending: &mut VecDeque<WorkerMsg>, closed: &mut bool) -> Vec<Job> {
    if *closed {
        return vec![];
    }
    while let Ok(m) = rx.try_recv() {
        pending.push_back(m);
    }
    if pending.iter().any(|m| matches!(m, WorkerMsg::Swap { .. } | WorkerMsg::Shutdown)) {
        *closed = true;
        return vec![];
    }
    let mut out = vec![];
    while out.len() < room {
        match pending.front() {
            Some(WorkerMsg::Job(j)) if j.adapter == *adapter => {
                if let Some(WorkerMsg::Job(j)) = pending.pop_front() {
                    out.push(*j);
                }
            }
            Some(_) => {
                *closed = true;
                break;
            }
            None => break,
        }
    }
    out
}

/// `jobs` grouped by the adapter that serves them (`adapter_of`), groups in the order of their first
/// job, jobs in their order.
fn by_adapter<T>(jobs: Vec<T>, adapter_of: impl Fn(&T) -> Option<String>) -> Vec<(Option<String>, Vec<T>)> {
    let mut groups: Vec<(Option<String>, Vec<T>)> = Vec::new();
    for job in jobs {
        let key = adapter_of(&job);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(job),
            None => groups.push((key, vec![job])),
        }
    }
    groups
}

/// Fails every job of a group whose policy could not be loaded.
fn fail_chat(jobs: impl IntoIterator<Item = Job>, status: StatusCode, message: &str, shared: &Shared) {
    for job in jobs {
        shared.failed.fetch_add(1, Ordering::Relaxed);
        let _ = job.events.send(JobEvent::Failed { status, message: message.to_string() });
    }
}

/// The worker thread's loop: serves `policies` until a shutdown message or until every sender is
/// gone; a swap message replaces the shared weights and an install message a tenant's adapter, between
/// batches. (An idle worker's freed activation blocks are unmapped by the caching CPU allocator's own
/// idle thread: [`crate::model::cpu_allocator::trim_when_idle`].)
pub(super) fn worker_loop(mut policies: Policies, rx: std::sync::mpsc::Receiver<WorkerMsg>, shared: Arc<Shared>) {
    let max_batch = shared.opts.max_batch.max(1);
    let mut pending: VecDeque<WorkerMsg> = VecDeque::new();
    loop {
        // Everything received so far joins the queue, so a shared-policy swap waiting behind queued jobs
        // is seen and goes first.
        while let Ok(m) = rx.try_recv() {
            pending.push_back(m);
        }
        let msg = match next_message(&mut pending, |m| matches!(m, WorkerMsg::Swap { .. })) {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => return,
            },
        };
        match msg {
            WorkerMsg::Shutdown => return,
            WorkerMsg::Swap { model, version: v, ack } => {
                let old = policies.swap_shared(model, v);
                shared.version.store(v, Ordering::SeqCst);
                crate::metrics::get().server_policy_version.set(v);
                tracing::info!("policy weights swapped: version {old} -> {v}");
                let _ = ack.send(old);
            }
            WorkerMsg::Install { tenant, path, model, version, ack } => {
                let _ = ack.send(policies.install(&tenant, path, model, version, &shared));
            }
            WorkerMsg::Job(job) => {
                let batch = take_batch(*job, &rx, &shared, max_batch, &mut pending, |m| match m {
                    WorkerMsg::Job(j) => Ok(*j),
                    other => Err(other),
                });
                let groups = by_adapter(batch, |j| j.adapter.clone());
                let n_groups = groups.len();
                for (g, (adapter, jobs)) in groups.into_iter().enumerate() {
                    // Only the last group's batch takes new jobs while it decodes (continuous batching),
                    // so the groups after it never wait behind a stream of new requests.
                    let mut closed = !shared.opts.continuous_batching || g + 1 < n_groups;
                    let mut more = |room: usize| joining_jobs(&adapter, room, &rx, &mut pending, &mut closed);
                    // Chat time: resolving the policy (an on-demand adapter load) here, decoding in run_batch.
                    let t0 = std::time::Instant::now();
                    let resolved = policies.resolve(adapter.as_deref(), &shared);
                    TimeClock::add_since(&shared.clock.chat_us, t0);
                    match resolved {
                        Ok((lm, version)) => run_batch(lm, version, adapter.as_deref(), jobs, &shared, &mut more),
                        Err((status, message)) => fail_chat(jobs, status, &message, &shared),
                    }
                }
            }
            WorkerMsg::Complete(job) => {
                let batch = take_batch(*job, &rx, &shared, max_batch, &mut pending, |m| match m {
                    WorkerMsg::Complete(j) => Ok(*j),
                    other => Err(other),
                });
                let t0 = std::time::Instant::now();
                for (adapter, jobs) in by_adapter(batch, |j| j.adapter.clone()) {
                    match policies.resolve(adapter.as_deref(), &shared) {
                        Ok((lm, version)) => run_completions(lm, version, adapter.as_deref(), jobs, &shared),
                        Err((status, message)) => {
                            for job in jobs {
                                shared.failed.fetch_add(1, Ordering::Relaxed);
                                let _ = job.reply.send(Err((status, message.clone())));
                            }
                        }
                    }
                }
                TimeClock::add_since(&shared.clock.completions_us, t0);
            }
        }
    }
}

/// The next message to handle from `queue`: the first `urgent` one (a shared-policy swap), else the
/// oldest. A swap thus takes effect at the next batch boundary, ahead of jobs still waiting (which then
/// run on the new weights and report its version), instead of after every job received before it; the
/// batch being decoded finishes on the weights it started with. Messages of one kind keep their order.
/// A tenant adapter's install keeps its place: ahead of other tenants' queued jobs it could evict their
/// adapters, which the worker would then load again itself.
fn next_message<T>(queue: &mut VecDeque<T>, urgent: impl Fn(&T) -> bool) -> Option<T> {
    match queue.iter().position(urgent) {
        Some(i) => queue.remove(i),
        None => queue.pop_front(),
    }
}

/// Moves the messages of the batch's kind (`same` returns them, and gives any other back) from the front
/// of `pending` into `batch`, oldest first, until `batch` holds `max_batch`. True when the batch is
/// complete: full, or another kind of message is at the front of `pending` (left there); false when
/// `pending` ran empty.
fn take_queued<M, T>(batch: &mut Vec<T>, pending: &mut VecDeque<M>, max_batch: usize, same: impl Fn(M) -> std::result::Result<T, M>) -> bool {
    while batch.len() < max_batch {
        let Some(m) = pending.pop_front() else { return false };
        match same(m) {
            Ok(j) => batch.push(j),
            Err(other) => {
                pending.push_front(other);
                return true;
            }
        }
    }
    true
}

/// `first` and the messages of its kind (`same` returns them, and gives any other back) already waiting
/// in `pending` (oldest first), then, once none wait, those arriving within the batching window; at
/// most `max_batch`. Another kind of message ends the batch and waits in `pending`, so order is kept
/// and a batch never crosses a swap.
fn take_batch<T>(
    first: T,
    rx: &std::sync::mpsc::Receiver<WorkerMsg>,
    shared: &Shared,
    max_batch: usize,
    pending: &mut VecDeque<WorkerMsg>,
    same: impl Fn(WorkerMsg) -> std::result::Result<T, WorkerMsg>,
) -> Vec<T> {
    let mut batch = vec![first];
    if take_queued(&mut batch, pending, max_batch, &same) {
        return batch;
    }
    let deadline = std::time::Instant::now() + shared.opts.batch_window;
    while batch.len() < max_batch {
        let wait = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(wait) {
            Ok(m) => match same(m) {
                Ok(j) => batch.push(j),
                Err(other) => {
                    pending.push_back(other);
                    break;
                }
            },
            Err(_) => break,
        }
    }
    batch
}

/// The log-prob as vLLM writes it: −∞ (and NaN) as −9999.0 (`clamp_prompt_logprobs`).
fn wire_logprob(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// vLLM's `prompt_logprobs` for `ids` from their scores (`scored` scores `ids[1..]` after `ids[..1]`):
/// `null` for position 0, then per position a map from token id (as a string) to `{logprob, rank,
/// decoded_token}` holding the prompt token (rank: 1-based, in the whole vocabulary) and the `k` most
/// likely tokens (ranks 1..=k; a prompt token among them carries its top-K rank, as in vLLM).
fn prompt_logprobs_json(lm: &LanguageModel, ids: &[u32], scored: Option<&crate::model::ScoredResponse>, k: usize) -> Vec<Value> {
    let decoded = |id: u32| lm.decode(&[id], false).unwrap_or_default();
    let mut out = vec![Value::Null];
    let Some(s) = scored else { return out };
    for (t, &id) in ids.iter().skip(1).enumerate() {
        let mut m = serde_json::Map::new();
        let rank = s.ranks.as_ref().and_then(|r| r.get(t)).copied().unwrap_or(1);
        m.insert(id.to_string(), json!({"logprob": wire_logprob(s.logprobs[t]), "rank": rank, "decoded_token": decoded(id)}));
        if let (Some(top_ids), Some(top_lps)) = (&s.topk_ids, &s.topk_logprobs) {
            for (j, (&tid, &lp)) in top_ids[t].iter().zip(&top_lps[t]).take(k).enumerate() {
                m.insert(tid.to_string(), json!({"logprob": wire_logprob(lp), "rank": j + 1, "decoded_token": decoded(tid)}));
            }
        }
        out.push(Value::Object(m));
    }
    out
}

/// The prompt ids of a completion job: the ids given (checked against the vocabulary), or the text
/// tokenised without special tokens.
fn completion_prompt(lm: &LanguageModel, job: &CompletionJob) -> std::result::Result<Vec<u32>, (StatusCode, String)> {
    let ids = match &job.prompt {
        PromptInput::Ids(ids) => ids.clone(),
        PromptInput::Text(text) => lm.encode(text).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    };
    let config = &lm.transformer().config;
    if ids.is_empty() {
        return Err((StatusCode::BAD_REQUEST, "empty prompt".into()));
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
        return Err((StatusCode::BAD_REQUEST, format!("token id {bad} outside the vocabulary of {}", config.vocab_size)));
    }
    if ids.len() > config.max_position_embeddings {
        return Err((StatusCode::BAD_REQUEST, format!("prompt of {} tokens exceeds the context of {}", ids.len(), config.max_position_embeddings)));
    }
    Ok(ids)
}

/// The value of a batched model call (`what`) over the jobs `jobs`, or `None` after recording its error
/// (400 for invalid input, else 500) or panic (500) in `failed` for each of them.
fn batch_outcome<T>(outcome: std::thread::Result<Result<T>>, what: &str, jobs: &[usize], failed: &mut [Option<(StatusCode, String)>]) -> Option<T> {
    let (status, message) = match outcome {
        Ok(Ok(v)) => return Some(v),
        Ok(Err(e)) => {
            tracing::error!("{what} failed for a batch of {} completion requests: {e}", jobs.len());
            let status = if matches!(e, Error::InvalidInput(_)) { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
            (status, e.to_string())
        }
        Err(_) => {
            tracing::error!("{what} panicked for a batch of {} completion requests", jobs.len());
            (StatusCode::INTERNAL_SERVER_ERROR, format!("internal error during {what}"))
        }
    };
    for &i in jobs {
        failed[i] = Some((status, message.clone()));
    }
    None
}

/// Runs a batch of completion jobs of one policy (`adapter`'s, or the shared one): one scoring call ([`LanguageModel::score_ranked`], the code the
/// local teacher scores with) for the prompts that ask for log-probs, then one generation call for
/// those with tokens to generate. A job that fails alone gets its own error; a failed call fails the
/// jobs in it.
fn run_completions(lm: &LanguageModel, version: i64, adapter: Option<&str>, jobs: Vec<CompletionJob>, shared: &Shared) {
    let fail = |job: CompletionJob, status: StatusCode, message: String| {
        shared.failed.fetch_add(1, Ordering::Relaxed);
        let _ = job.reply.send(Err((status, message)));
    };
    let mut ready: Vec<(CompletionJob, CompletionOut)> = Vec::with_capacity(jobs.len());
    for job in jobs {
        match completion_prompt(lm, &job) {
            Ok(prompt_ids) => ready.push((job, CompletionOut { version, adapter: adapter.map(str::to_string), prompt_ids, prompt_logprobs: None, generation: None })),
            Err((status, message)) => fail(job, status, message),
        }
    }
    // Prompt log-probs: position t + 1 scored after ids[..t + 1], as a response after a one-token prompt.
    let scoring: Vec<usize> = (0..ready.len()).filter(|&i| ready[i].0.prompt_logprobs.is_some() && ready[i].1.prompt_ids.len() > 1).collect();
    let k_max = scoring.iter().filter_map(|&i| ready[i].0.prompt_logprobs).max().unwrap_or(0);
    let items: Vec<(Vec<u32>, Vec<u32>)> = scoring.iter().map(|&i| (ready[i].1.prompt_ids[..1].to_vec(), ready[i].1.prompt_ids[1..].to_vec())).collect();
    let scored = if items.is_empty() {
        Ok(Ok(vec![]))
    } else {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lm.score_ranked(&items, k_max)))
    };
    let mut failed: Vec<Option<(StatusCode, String)>> = vec![None; ready.len()];
    if let Some(scores) = batch_outcome(scored, "prompt scoring", &scoring, &mut failed) {
        let mut by_job: Vec<Option<crate::model::ScoredResponse>> = vec![None; ready.len()];
        for (&i, sc) in scoring.iter().zip(scores) {
            by_job[i] = Some(sc);
        }
        for ((job, out), sc) in ready.iter_mut().zip(by_job) {
            if let Some(k) = job.prompt_logprobs {
                out.prompt_logprobs = Some(prompt_logprobs_json(lm, &out.prompt_ids, sc.as_ref(), k));
            }
        }
    }
    // Generation for the jobs with tokens to generate.
    let mut generating = vec![];
    let mut reqs = vec![];
    for (i, (job, out)) in ready.iter().enumerate() {
        if failed[i].is_some() || job.params.max_new_tokens == 0 {
            continue;
        }
        let mut params = job.params.clone();
        params.stop_token_ids = Some(lm.eos_token_ids().to_vec());
        let req = GenerationRequest { prompt_ids: out.prompt_ids.clone(), params };
        match check_request(&lm.transformer().config, &req) {
            Ok(()) => {
                generating.push(i);
                reqs.push(req);
            }
            Err(e) => failed[i] = Some((StatusCode::BAD_REQUEST, e.to_string())),
        }
    }
    if !reqs.is_empty() {
        let generated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lm.generate_stream(&reqs, &mut |_| true)));
        if let Some(gens) = batch_outcome(generated, "generation", &generating, &mut failed) {
            for (&i, g) in generating.iter().zip(gens) {
                ready[i].1.generation = Some(g);
            }
        }
    }
    for ((job, out), f) in ready.into_iter().zip(failed) {
        match f {
            Some((status, message)) => fail(job, status, message),
            None => {
                shared.completed.fetch_add(1, Ordering::Relaxed);
                let _ = job.reply.send(Ok(out));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_changes_go_ahead_of_waiting_jobs_in_their_own_order() {
        // Even numbers are weight changes, odd ones jobs.
        let mut q: VecDeque<u32> = [1, 3, 2, 5, 4, 7].into_iter().collect();
        let order: Vec<u32> = std::iter::from_fn(|| next_message(&mut q, |m| m % 2 == 0)).collect();
        assert_eq!(order, vec![2, 4, 1, 3, 5, 7]);
        assert_eq!(next_message(&mut VecDeque::<u32>::new(), |_| true), None);
    }

    #[test]
    fn a_batch_takes_the_waiting_jobs_of_its_kind_oldest_first_and_stops_at_another_kind() {
        // Odd numbers are jobs of the batch's kind.
        let same = |m: u32| if m % 2 == 1 { Ok(m) } else { Err(m) };
        let (mut batch, mut pending) = (vec![9], [1, 3, 5, 2, 7].into_iter().collect::<VecDeque<u32>>());
        assert!(take_queued(&mut batch, &mut pending, 8, same), "another kind ends the batch");
        assert_eq!((batch, pending.into_iter().collect::<Vec<_>>()), (vec![9, 1, 3, 5], vec![2, 7]));
        let (mut batch, mut pending) = (vec![9], [1, 3, 5].into_iter().collect::<VecDeque<u32>>());
        assert!(take_queued(&mut batch, &mut pending, 2, same), "full");
        assert_eq!((batch, pending.into_iter().collect::<Vec<_>>()), (vec![9, 1], vec![3, 5]));
        let (mut batch, mut pending) = (vec![9], [1].into_iter().collect::<VecDeque<u32>>());
        assert!(!take_queued(&mut batch, &mut pending, 8, same), "nothing more waits: the window decides");
        assert_eq!(batch, vec![9, 1]);
    }

    fn job(adapter: Option<&str>, tag: &str) -> WorkerMsg {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        WorkerMsg::Job(Box::new(Job {
            adapter: adapter.map(str::to_string),
            messages: vec![crate::schema::Message::text("user", tag)],
            tools: None,
            template_kwargs: None,
            params: Default::default(),
            extra_stop_ids: vec![],
            events,
        }))
    }

    fn tags(jobs: &[Job]) -> Vec<String> {
        jobs.iter().map(|j| j.messages[0].content.clone()).collect()
    }

    #[test]
    fn jobs_join_a_running_batch_until_anything_else_waits() {
        let a = Some("a".to_string());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut pending = VecDeque::new();
        let mut closed = false;
        // Same-policy jobs join, oldest first, at most `room`; the rest wait.
        for t in ["1", "2", "3"] {
            tx.send(job(Some("a"), t)).unwrap();
        }
        assert_eq!(tags(&joining_jobs(&a, 2, &rx, &mut pending, &mut closed)), ["1", "2"]);
        assert!(!closed);
        // Another policy's job at the front closes the batch; the job behind it waits too.
        tx.send(job(None, "4")).unwrap();
        tx.send(job(Some("a"), "5")).unwrap();
        assert_eq!(tags(&joining_jobs(&a, 8, &rx, &mut pending, &mut closed)), ["3"]);
        assert!(closed);
        assert!(joining_jobs(&a, 8, &rx, &mut pending, &mut closed).is_empty(), "closed stays closed");
        assert_eq!(pending.len(), 2);
        // A shutdown (as a swap) anywhere in the queue closes the batch before any job joins.
        let (tx, rx) = std::sync::mpsc::channel();
        let (mut pending, mut closed) = (VecDeque::new(), false);
        tx.send(job(Some("a"), "6")).unwrap();
        tx.send(WorkerMsg::Shutdown).unwrap();
        assert!(joining_jobs(&a, 8, &rx, &mut pending, &mut closed).is_empty());
        assert!(closed);
        assert_eq!(pending.len(), 2, "nothing is lost");
    }

    #[test]
    fn jobs_are_grouped_by_adapter_in_order_of_first_appearance() {
        let jobs = vec![(1, None), (2, Some("a")), (3, None), (4, Some("b")), (5, Some("a"))];
        let groups = by_adapter(jobs, |j| j.1.map(str::to_string));
        let got: Vec<(Option<String>, Vec<i32>)> = groups.into_iter().map(|(k, g)| (k, g.into_iter().map(|j| j.0).collect())).collect();
        assert_eq!(got, vec![(None, vec![1, 3]), (Some("a".into()), vec![2, 5]), (Some("b".into()), vec![4])]);
    }
}
