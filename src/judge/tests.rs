//! Tests of the judge stage with scripted in-process backends (the HTTP backends are tested against a
//! local server in `tests/model_train/judge_backends.rs`).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::Semaphore;

use super::turn::tests::{mini_swe_agent_messages, turn};
use super::*;
use crate::schema::{Message, NextStateKind};

/// Answers vote i with `script[i]` (the last entry for larger i); counts calls per index.
pub(crate) struct Scripted {
    pub script: Vec<std::result::Result<String, CallError>>,
    pub calls: Mutex<Vec<u32>>,
}

impl Scripted {
    pub(crate) fn new(script: Vec<std::result::Result<String, CallError>>) -> Arc<Scripted> {
        Arc::new(Scripted { script, calls: Mutex::new(vec![0; 64]) })
    }
    pub(crate) fn calls(&self, i: usize) -> u32 {
        self.calls.lock().unwrap()[i]
    }
    pub(crate) fn total(&self) -> u32 {
        self.calls.lock().unwrap().iter().sum()
    }
}

impl VoteBackend for Scripted {
    fn kind(&self) -> BackendKind {
        BackendKind::Openai
    }
    fn model(&self) -> &str {
        "scripted"
    }
    fn complete<'a>(&'a self, req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>> {
        let i = req.index as usize;
        self.calls.lock().unwrap()[i] += 1;
        let r = self.script[i.min(self.script.len() - 1)].clone();
        Box::pin(async move { r })
    }
}

fn judge_with(backend: Arc<dyn VoteBackend>, cfg: JudgeConfig) -> Judge {
    let sem = Arc::new(Semaphore::new(cfg.concurrency));
    Judge::with_parts(cfg, backend, Arc::new(VoteCache::new()), sem).unwrap()
}

fn sample_turn() -> TurnContext {
    turn(vec![Message::text("user", "rename the file to notes.md")], "Done: renamed.", NextStateKind::User, "thanks, that works")
}

fn ok(s: &str) -> std::result::Result<String, CallError> {
    Ok(s.to_string())
}

#[tokio::test]
async fn judgment_row_from_three_votes() {
    let b = Scripted::new(vec![ok("good. \\boxed{1}"), ok("\\boxed{-1} hmm, no: \\boxed{1}"), ok("\\boxed{-1}")]);
    let judge = judge_with(b.clone(), JudgeConfig::default());
    let t = sample_turn();
    let j = judge_turn(&judge, "demo", &t).await;
    assert_eq!(j.votes.iter().map(|v| v.value).collect::<Vec<_>>(), [Some(1), Some(1), Some(-1)]);
    assert_eq!((j.score, j.valid_votes, j.tie, j.m), (1, 3, false, 3));
    assert_eq!(j.votes[1].raw, "\\boxed{-1} hmm, no: \\boxed{1}");
    assert_eq!(j.votes.iter().map(|v| v.index).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(j.judgment_id, judge.judgment_id("demo", "i1"));
    assert_eq!(j.pipeline, "demo");
    assert_eq!((j.interaction_id.as_str(), j.session_id.as_str(), j.turn_index), ("i1", "s1", 0));
    assert_eq!(j.policy_version, Some(3));
    assert_eq!((j.judge_backend.as_str(), j.judge_model.as_str()), ("openai", "scripted"));
    assert_eq!(j.template_id, "nextstate-prm-v1");
    assert_eq!(j.template_hash, JUDGE_TEMPLATE.hash());
    assert_eq!((j.temperature, j.max_tokens, j.cache_hits), (0.6, 4096, 0));
    assert_eq!(j.event_time, 1_700_000_000_000);
    assert!(j.processed_time >= j.event_time);
    assert_eq!(b.total(), 3);
}

#[tokio::test]
async fn invalid_votes_carry_errors_and_tie_is_flagged() {
    let b = Scripted::new(vec![
        ok("\\boxed{1}"),
        Err(CallError::BadResponse("no \"text\" field".into())),
        ok("I think it is fine"),
        ok("\\boxed{-1}"),
    ]);
    let cfg = JudgeConfig { m: 4, ..JudgeConfig::default() };
    let j = judge_turn(&judge_with(b, cfg), "p", &sample_turn()).await;
    assert_eq!(j.votes.iter().map(|v| v.value).collect::<Vec<_>>(), [Some(1), None, None, Some(-1)]);
    assert_eq!(
        j.votes[1].error.as_deref(),
        Some("request failed after 1 attempt(s): unreadable response: no \"text\" field")
    );
    assert_eq!(j.votes[1].raw, "");
    assert_eq!(j.votes[2].error.as_deref(), Some("no \\boxed{d} with a single signed digit in the judge's answer"));
    assert_eq!(j.votes[2].raw, "I think it is fine");
    assert_eq!((j.score, j.valid_votes, j.tie), (0, 2, true));
}

#[tokio::test]
async fn no_valid_votes_is_zero_without_tie() {
    let b = Scripted::new(vec![ok("\\boxed{5}")]);
    let j = judge_turn(&judge_with(b, JudgeConfig::default()), "p", &sample_turn()).await;
    assert_eq!((j.score, j.valid_votes, j.tie), (0, 0, false));
    assert!(j.votes.iter().all(|v| v.error.as_deref() == Some("last \\boxed{} holds 5, not one of 1, 0, -1")));
}

#[tokio::test]
async fn rerun_is_served_from_cache_and_identical() {
    let b = Scripted::new(vec![ok("\\boxed{1}"), Err(CallError::Status { status: 400, body: "bad".into() }), ok("\\boxed{0}")]);
    let judge = judge_with(b.clone(), JudgeConfig::default());
    let t = sample_turn();
    let first = judge_turn(&judge, "p", &t).await;
    assert_eq!(b.total(), 3);
    assert_eq!(judge.cache().len(), 2); // the failed vote is not cached
    let second = judge_turn(&judge, "p", &t).await;
    // Votes 0 and 2 come from the cache; the failed vote 1 is asked again.
    assert_eq!((b.calls(0), b.calls(1), b.calls(2)), (1, 2, 1));
    assert_eq!(second.cache_hits, 2);
    assert_eq!(second.votes.iter().map(|v| v.cached).collect::<Vec<_>>(), [true, false, true]);
    assert_eq!(second.judgment_id, first.judgment_id);
    for (a, b) in first.votes.iter().zip(&second.votes) {
        assert_eq!((&a.raw, a.value, &a.error), (&b.raw, b.value, &b.error));
    }
    assert_eq!((judge.cache().hits(), judge.cache().misses()), (2, 4));
    assert_eq!(judge.stats().cache_hits, 2);

    // Another turn content, or another temperature, misses the cache.
    let mut t2 = t.clone();
    t2.next_state_text = "no, rename it to todo.md".into();
    let third = judge_turn(&judge, "p", &t2).await;
    assert_eq!(third.cache_hits, 0);
    let hot = judge_with(b.clone(), JudgeConfig { temperature: 1.0, ..JudgeConfig::default() });
    hot.cache().load(judge.cache().entries_since(0).0);
    assert_eq!(judge_turn(&hot, "p", &t).await.cache_hits, 0);
    // A new process that loads the persisted entries is served from them.
    let fresh = judge_with(b, JudgeConfig::default());
    fresh.cache().load(judge.cache().entries_since(0).0);
    assert_eq!(judge_turn(&fresh, "p", &t).await.cache_hits, 2);
}

#[tokio::test]
async fn default_config_is_the_rule_baseline() {
    let judge = Judge::new(JudgeConfig::default()).unwrap();
    let mut t = sample_turn();
    t.thanks_cue = true;
    let j = judge_turn(&judge, "p", &t).await;
    assert_eq!((j.judge_backend.as_str(), j.judge_model.as_str()), ("rules", "rules-v1"));
    assert_eq!((j.score, j.valid_votes, j.tie), (1, 3, false));
    assert!(j.votes.iter().all(|v| v.raw.contains("Rule `thanks_cue` fired") && !v.cached));
    assert!(judge.cache().is_empty(), "rule answers are not cached");
}

#[test]
fn config_table_parses_with_defaults_and_rejects_unknown_fields() {
    let cfg: JudgeConfig = toml::from_str("backend = \"openai\"\nurl = \"http://127.0.0.1:8000\"\nmodel = \"qwen\"\nm = 5\n").unwrap();
    assert_eq!(cfg.backend, BackendKind::Openai);
    assert_eq!(cfg.m, 5);
    assert_eq!(cfg.temperature, 0.6);
    assert_eq!(cfg.max_tokens, 4096);
    let e = toml::from_str::<JudgeConfig>("modle = \"x\"").unwrap_err();
    assert!(e.to_string().contains("unknown field `modle`"), "{e}");
    assert!(toml::from_str::<JudgeConfig>("backend = \"vllm\"").is_err());

    let e = Judge::new(JudgeConfig { backend: BackendKind::Openai, ..JudgeConfig::default() }).unwrap_err();
    assert_eq!(e.to_string(), "config: backend openai needs `url`");
    let e = Judge::new(JudgeConfig { backend: BackendKind::Sglang, url: Some("http://x".into()), ..JudgeConfig::default() }).unwrap_err();
    assert_eq!(e.to_string(), "config: backend sglang needs `model`");
    let e = Judge::new(JudgeConfig { m: 0, ..JudgeConfig::default() }).unwrap_err();
    assert_eq!(e.to_string(), "config: [judge] m = 0: votes per turn must be 1..=64");
    let e = Judge::new(JudgeConfig { timeout_s: f64::NAN, ..JudgeConfig::default() }).unwrap_err();
    assert!(e.to_string().contains("timeout_s = NaN"), "{e}");
}

#[test]
fn judgment_id_depends_on_config() {
    let a = Judge::new(JudgeConfig::default()).unwrap();
    let b = Judge::new(JudgeConfig { m: 5, ..JudgeConfig::default() }).unwrap();
    assert_eq!(a.judgment_id("p", "x"), Judge::new(JudgeConfig::default()).unwrap().judgment_id("p", "x"));
    assert_ne!(a.judgment_id("p", "x"), b.judgment_id("p", "x"));
    assert_ne!(a.judgment_id("p", "x"), a.judgment_id("p", "y"));
}

/// Sleeps, tracking how many calls are in flight at once.
struct Slow {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    calls: AtomicU32,
    fail_first: u32,
    status: u16,
}

impl VoteBackend for Slow {
    fn kind(&self) -> BackendKind {
        BackendKind::Sglang
    }
    fn model(&self) -> &str {
        "slow"
    }
    fn complete<'a>(&'a self, _req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>> {
        Box::pin(async move {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            if n < self.fail_first {
                Err(CallError::Status { status: self.status, body: "overloaded".into() })
            } else {
                Ok("\\boxed{1}".to_string())
            }
        })
    }
}

fn slow(fail_first: u32, status: u16) -> Arc<Slow> {
    Arc::new(Slow {
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
        calls: AtomicU32::new(0),
        fail_first,
        status,
    })
}

#[tokio::test]
async fn concurrency_is_bounded_across_turns() {
    let b = slow(0, 500);
    let judge = judge_with(b.clone(), JudgeConfig { concurrency: 2, m: 3, ..JudgeConfig::default() });
    let mut t2 = sample_turn();
    t2.next_state_text = "other".into();
    let t1 = sample_turn();
    let (j1, j2) = tokio::join!(judge_turn(&judge, "p", &t1), judge_turn(&judge, "p", &t2));
    assert_eq!((j1.score, j2.score), (1, 1));
    assert_eq!(b.calls.load(Ordering::SeqCst), 6);
    assert_eq!(b.max_in_flight.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn retries_with_backoff_then_succeeds() {
    let b = slow(2, 503);
    let cfg = JudgeConfig { m: 1, retries: 3, backoff_base_ms: 30, ..JudgeConfig::default() };
    let judge = judge_with(b.clone(), cfg);
    let start = Instant::now();
    let j = judge_turn(&judge, "p", &sample_turn()).await;
    let elapsed = start.elapsed();
    assert_eq!(j.votes[0].value, Some(1));
    assert_eq!(b.calls.load(Ordering::SeqCst), 3);
    let s = judge.stats();
    assert_eq!((s.requests, s.retries, s.failed_votes), (3, 2, 0));
    // Three 20 ms calls plus backoffs of 30 ms and 60 ms.
    assert!(elapsed >= Duration::from_millis(150), "{elapsed:?}");
}

#[tokio::test]
async fn gives_up_after_retries_and_not_on_4xx() {
    let b = slow(100, 500);
    let judge = judge_with(b.clone(), JudgeConfig { m: 1, retries: 2, backoff_base_ms: 1, ..JudgeConfig::default() });
    let j = judge_turn(&judge, "p", &sample_turn()).await;
    assert_eq!(j.votes[0].value, None);
    assert_eq!(j.votes[0].error.as_deref(), Some("request failed after 3 attempt(s): HTTP status 500: overloaded"));
    assert_eq!(b.calls.load(Ordering::SeqCst), 3);
    assert_eq!(judge.stats().failed_votes, 1);

    let b = slow(100, 401);
    let judge = judge_with(b.clone(), JudgeConfig { m: 1, retries: 2, backoff_base_ms: 1, ..JudgeConfig::default() });
    let j = judge_turn(&judge, "p", &sample_turn()).await;
    assert_eq!(j.votes[0].error.as_deref(), Some("request failed after 1 attempt(s): HTTP status 401: overloaded"));
    assert_eq!(b.calls.load(Ordering::SeqCst), 1);
}

/// Never answers.
struct Hang;
impl VoteBackend for Hang {
    fn kind(&self) -> BackendKind {
        BackendKind::Openai
    }
    fn model(&self) -> &str {
        "hang"
    }
    fn complete<'a>(&'a self, _req: VoteRequest<'a>) -> BoxFuture<'a, std::result::Result<String, CallError>> {
        Box::pin(futures::future::pending())
    }
}

#[tokio::test]
async fn a_hanging_backend_times_out_into_invalid_votes() {
    let cfg = JudgeConfig { m: 2, timeout_s: 0.1, retries: 1, backoff_base_ms: 10, ..JudgeConfig::default() };
    let judge = judge_with(Arc::new(Hang), cfg);
    let start = Instant::now();
    let j = judge_turn(&judge, "p", &sample_turn()).await;
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
    assert_eq!((j.score, j.valid_votes), (0, 0));
    assert_eq!(j.votes[0].error.as_deref(), Some("request failed after 2 attempt(s): timeout after 0.1 s"));
    let s = judge.stats();
    assert_eq!((s.requests, s.timeouts, s.retries, s.failed_votes), (4, 4, 2, 2));
}

/// The mini-swe-agent log (real claude-sonnet-4 run): shell output comes back as role `user` inside
/// `<returncode>` tags. The exit code is read here the way the signal stage would, then the rule
/// judge decides.
#[tokio::test]
async fn rule_judge_on_a_real_mini_swe_agent_log() {
    let msgs = mini_swe_agent_messages();
    let code_re = regex::Regex::new(r"<returncode>(-?\d+)</returncode>").unwrap();
    let judge = Judge::new(JudgeConfig { m: 1, ..JudgeConfig::default() }).unwrap();
    let mut scores = vec![];
    for (i, m) in msgs.iter().enumerate() {
        if m.role != "assistant" || i + 1 >= msgs.len() {
            continue;
        }
        let next = &msgs[i + 1];
        let mut t = turn(msgs[..i].to_vec(), &m.content, NextStateKind::Environment, &next.content);
        t.exit_code = code_re.captures(&next.content).and_then(|c| c[1].parse().ok());
        scores.push(judge_turn(&judge, "p", &t).await.score);
    }
    // Turn 0 (`cat` of a missing path) and turn 7 (running the script: a traceback) exit 1; the
    // others exit 0, except the last, whose next state is the final diff with no exit code.
    assert_eq!(scores, [-1, 1, 1, 1, 1, 1, 1, -1, 1, 0]);
}
