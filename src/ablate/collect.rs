//! Data for the student ablation: the simulated student of [`crate::demo`] does homework with the
//! **frozen initial policy**, generated directly with the model runtime (no server, no proxy), so the
//! collected interactions are the same bit for bit on every run with the same seeds and settings.
//!
//! Sessions run in fixed groups of `batch`, turn by turn: each turn generates one response per open
//! session of the group in one batch (the per-request seed is a hash of the seed, the problem and the
//! turn), the student replies ([`crate::demo::Student::reply_at`]), and the reply is recorded as the
//! turn's `next_state` (the signal stage takes a logged next state as is, docs/method.md §1). Event times are
//! synthetic — a fixed epoch plus one second per interaction in generation order — so ordering by event
//! time is the generation order, on every run.

use serde::{Deserialize, Serialize};

use super::config::CollectSettings;
use crate::demo::{Problem, Student};
use crate::error::Result;
use crate::model::{GenerationRequest, LanguageModel, LogprobMode, SamplingParams};
use crate::schema::{content_hash, Interaction, Message, Table, TurnType};

/// Event time of the first collected interaction: 2026-01-01T00:00:00Z, ms.
pub const EPOCH_MS: i64 = 1_767_225_600_000;

/// `source_format` of collected rows.
pub const SOURCE_FORMAT: &str = "ablation-student";

/// What a collection produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CollectReport {
    /// Sessions run.
    pub sessions: u64,
    /// Agent turns (interactions).
    pub interactions: u64,
    /// Turns whose response met every preference (the student said thanks).
    pub satisfied: u64,
    /// Response tokens generated.
    pub tokens: u64,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl std::ops::AddAssign<&CollectReport> for CollectReport {
    /// Sums every count and the seconds (several collections as one).
    fn add_assign(&mut self, o: &CollectReport) {
        self.sessions += o.sessions;
        self.interactions += o.interactions;
        self.satisfied += o.satisfied;
        self.tokens += o.tokens;
        self.seconds += o.seconds;
    }
}

/// The sampling seed of one turn: the first 16 hex digits of sha256(seed, problem id, turn).
pub fn turn_seed(seed: u64, problem_id: usize, turn: u32) -> u64 {
    let h = content_hash(&[&seed.to_le_bytes(), &(problem_id as u64).to_le_bytes(), &turn.to_le_bytes()]);
    u64::from_str_radix(&h[..16], 16).unwrap_or(seed)
}

/// One collection of an ablation: its problems in session order, the seed of its sampling and of its
/// student's wording, and where its rows go.
#[derive(Debug, Clone)]
pub struct CollectPlan {
    /// Problems, one session each, in order (the first `sessions` are used).
    pub problems: Vec<Problem>,
    /// Sampling seed ([`turn_seed`]) and the student's seed.
    pub seed: u64,
    /// Session-id prefix and first event time.
    pub target: CollectTarget,
}

/// A replicate's collection seed: the first 16 hex digits of sha256(student seed, replicate seed).
pub fn replicate_seed(student_seed: u64, replicate: u64) -> u64 {
    let h = content_hash(&[b"replicate", &student_seed.to_le_bytes(), &replicate.to_le_bytes()]);
    u64::from_str_radix(&h[..16], 16).unwrap_or(replicate)
}

/// The collections of an ablation with `seeds` replicates on the training problems `train`.
///
/// One seed: one collection of the first `sessions` problems with the student's seed (the data of a
/// single run). Several: one per replicate `s`, each of `sessions` sessions — `sessions − heldout`
/// training problems drawn from `train[heldout..]` in an order shuffled by [`replicate_seed`], then the
/// `heldout` problems `train[..heldout]`, the same in every replicate and last (so they are its
/// held-out sessions) — sampled and worded with that seed, session ids prefixed `r<s>-`
/// ([`super::plan::replicate_prefix`]), event times from [`EPOCH_MS`] + k × 10⁹ ms for the k-th
/// replicate (so the replicates' streams never interleave).
pub fn collect_plans(train: &[Problem], sessions: usize, heldout: usize, student_seed: u64, seeds: &[u64]) -> Vec<CollectPlan> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    if seeds.len() <= 1 {
        return vec![CollectPlan { problems: train.to_vec(), seed: student_seed, target: CollectTarget::default() }];
    }
    let held = heldout.min(train.len());
    let (reserved, pool) = train.split_at(held);
    seeds
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            let seed = replicate_seed(student_seed, s);
            let mut drawn = pool.to_vec();
            drawn.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
            drawn.truncate(sessions.saturating_sub(held));
            drawn.extend_from_slice(reserved);
            let target = CollectTarget { session_prefix: super::plan::replicate_prefix(s), epoch_ms: EPOCH_MS + k as i64 * 1_000_000_000 };
            CollectPlan { problems: drawn, seed, target }
        })
        .collect()
}

struct Open {
    index: usize,
    problem: Problem,
    session_id: String,
    messages: Vec<Message>,
}

/// Where a collection's rows go: session ids start with `session_prefix` (`""`, or a replicate's
/// `r<seed>-`), and event times with `epoch_ms` (ms; [`EPOCH_MS`] for the first collection).
#[derive(Debug, Clone)]
pub struct CollectTarget {
    /// Prefix of every session id.
    pub session_prefix: String,
    /// Event time of the first interaction, ms since the Unix epoch.
    pub epoch_ms: i64,
}

impl Default for CollectTarget {
    fn default() -> Self {
        CollectTarget { session_prefix: String::new(), epoch_ms: EPOCH_MS }
    }
}

/// Runs `cfg.sessions` homework sessions on `problems` (in order; fewer when there are fewer problems)
/// and returns their interactions in generation order (see the module docs). `seed` seeds sampling;
/// `target` names the sessions and places the event times. `stop` is checked before each turn's
/// generation.
///
/// # Errors
/// Model errors (chat template, generation); [`crate::Error::Cancelled`] when `stop` was requested
/// (nothing is returned: a collection is kept whole or not at all).
pub fn collect(lm: &LanguageModel, problems: &[Problem], student: &Student, cfg: &CollectSettings, seed: u64, target: &CollectTarget, stop: &crate::runtime::Stop) -> Result<(Vec<Interaction>, CollectReport)> {
    let started = std::time::Instant::now();
    let model_name = lm.dir().file_name().map(|n| n.to_string_lossy().into_owned());
    let mut rows: Vec<Interaction> = vec![];
    let mut report = CollectReport::default();
    let chosen: Vec<Problem> = problems.iter().take(cfg.sessions).cloned().collect();
    for (gi, group) in chosen.chunks(cfg.batch.max(1)).enumerate() {
        let mut open: Vec<Open> = group
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let index = gi * cfg.batch.max(1) + i;
                Open { index, problem: p.clone(), session_id: format!("{}student-{index}-{}", target.session_prefix, p.id), messages: vec![Message::text("user", student.first_message(p))] }
            })
            .collect();
        report.sessions += open.len() as u64;
        for turn in 1..=student.max_turns() {
            if open.is_empty() {
                break;
            }
            if stop.requested() {
                return Err(crate::Error::Cancelled);
            }
            let mut requests = vec![];
            let mut prompts_text = vec![];
            for o in &open {
                let text = lm.render_chat(&o.messages, None, true)?;
                let ids = lm.encode(&text)?;
                prompts_text.push(text);
                let params = SamplingParams {
                    temperature: cfg.temperature,
                    max_new_tokens: cfg.max_tokens,
                    seed: Some(turn_seed(seed, o.problem.id, turn)),
                    logprob_mode: LogprobMode::Raw,
                    ..Default::default()
                };
                requests.push(GenerationRequest { prompt_ids: ids, params });
            }
            let gens = lm.generate_stream(&requests, &mut |_| true)?;
            let mut still = vec![];
            for ((mut o, g), (req, prompt_text)) in open.into_iter().zip(gens).zip(requests.into_iter().zip(prompts_text)) {
                let reply = student.reply_at(&g.text, &o.problem, turn);
                let done = reply.session_done || turn >= student.max_turns();
                let request_messages = serde_json::to_string(&o.messages)?;
                let turn_index = (turn - 1) as i32;
                let interaction_id = Interaction::compute_id(&o.session_id, turn_index, &request_messages, &g.text, None);
                let next_state = serde_json::to_string(&[Message::text("user", reply.text.clone())])?;
                report.interactions += 1;
                report.tokens += g.token_ids.len() as u64;
                report.satisfied += u64::from(reply.satisfied);
                rows.push(Interaction {
                    schema_version: Interaction::SCHEMA_VERSION,
                    interaction_id,
                    session_id: o.session_id.clone(),
                    tenant: Some(crate::schema::DEFAULT_TENANT.to_string()),
                    session_inferred: false,
                    turn_index,
                    turn_type: TurnType::Main,
                    session_done: done,
                    policy_version: Some(0),
                    model: model_name.clone(),
                    request_messages,
                    tools: None,
                    response_text: g.text.clone(),
                    reasoning_text: None,
                    tool_calls: None,
                    finish_reason: Some(g.finish_reason.as_str().to_string()),
                    truncated: g.finish_reason == crate::model::FinishReason::Length,
                    prompt_text: Some(prompt_text),
                    prompt_token_ids: Some(req.prompt_ids.iter().map(|&x| x as i32).collect()),
                    response_token_ids: Some(g.token_ids.iter().map(|&x| x as i32).collect()),
                    rollout_logprobs: Some(g.logprobs.clone()),
                    next_state: Some(next_state),
                    outcome_reward: None,
                    notes: vec![format!("simulated student (seed {}), session {}, problem {}, turn {turn}", seed, o.index, o.problem.id)],
                    source_format: SOURCE_FORMAT.into(),
                    source_topic: None,
                    source_partition: None,
                    source_offset: None,
                    source_file: None,
                    source_line: None,
                    event_time: target.epoch_ms + rows.len() as i64 * 1000,
                    ingest_time: crate::schema::now_ms(),
                });
                if !done {
                    o.messages.push(Message::text("assistant", g.text));
                    o.messages.push(Message::text("user", reply.text));
                    still.push(o);
                }
            }
            open = still;
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok((rows, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(n: usize) -> Vec<Problem> {
        (0..n).map(|id| Problem { id, question: format!("q{id}"), answer: id.to_string() }).collect()
    }

    #[test]
    fn replicates_collect_their_own_draws_with_the_same_heldout_problems_last() {
        let train = problems(20);
        let one = collect_plans(&train, 6, 2, 7, &[42]);
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].problems.len(), one[0].seed, one[0].target.session_prefix.as_str(), one[0].target.epoch_ms), (20, 7, "", EPOCH_MS));
        let plans = collect_plans(&train, 6, 2, 7, &[1, 2, 3]);
        let ids = |p: &CollectPlan| p.problems.iter().map(|p| p.id).collect::<Vec<_>>();
        for (k, p) in plans.iter().enumerate() {
            let v = ids(p);
            assert_eq!(v.len(), 6);
            assert_eq!(&v[4..], &[0, 1], "the held-out problems, last, in every replicate");
            assert!(v[..4].iter().all(|&i| i >= 2), "training problems from the pool only: {v:?}");
            assert_eq!(p.target.epoch_ms, EPOCH_MS + k as i64 * 1_000_000_000);
            assert_eq!(p.seed, replicate_seed(7, [1, 2, 3][k]));
        }
        assert_eq!(plans.iter().map(|p| p.target.session_prefix.as_str()).collect::<Vec<_>>(), vec!["r1-", "r2-", "r3-"]);
        assert!(ids(&plans[0])[..4] != ids(&plans[1])[..4] && ids(&plans[1])[..4] != ids(&plans[2])[..4], "different draws");
        assert_eq!(ids(&collect_plans(&train, 6, 2, 7, &[1, 2, 3])[1]), ids(&plans[1]), "deterministic");
        assert_ne!(replicate_seed(7, 1), replicate_seed(8, 1));
        // fewer problems than sessions: every pool problem once, then the held-out ones
        assert_eq!(ids(&collect_plans(&problems(4), 10, 1, 7, &[1, 2])[0]).len(), 4);
    }

    #[test]
    fn turn_seeds_are_stable_and_distinct() {
        assert_eq!(turn_seed(7, 12, 1), turn_seed(7, 12, 1));
        assert_ne!(turn_seed(7, 12, 1), turn_seed(7, 12, 2));
        assert_ne!(turn_seed(7, 12, 1), turn_seed(8, 12, 1));
        assert_ne!(turn_seed(7, 12, 1), turn_seed(7, 13, 1));
    }
}
