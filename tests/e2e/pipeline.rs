//! The judge, hint and teacher stages end to end (embedded bus, real lake, real model): every row of the
//! docs/method.md §5 table is built on purpose with a scripted judge/hint endpoint (real HTTP), and the
//! `samples` counts per pipeline are checked with SQL. A replay into a fresh lake reuses every cached vote
//! and reproduces the samples exactly.
use crate::common;

use std::path::Path;

use axum::routing::post;
use axum::{Json, Router};
use nextstate::lake::Lake;
use nextstate::schema::{Interaction, Message, Sample, TurnType};

/// A turn whose response carries a case marker the scripted judge reads, followed by a user reply.
fn session(case: &str, idx: i32) -> Vec<Interaction> {
    let sid = format!("case-{case}");
    let q = Message::text("user", format!("What is {idx} plus {idx}?"));
    let a = Message::text("assistant", format!("It is {}. [{case}]", idx * 2));
    let reply = Message::text("user", "ok, next one please.");
    let req0 = serde_json::to_string(&vec![q.clone()]).unwrap();
    let req1 = serde_json::to_string(&vec![q, a.clone(), reply, Message::text("user", "")]).unwrap();
    let mk = |turn: i32, req: String, resp: String, done: bool, tt: TurnType| Interaction {
        turn_type: tt,
        session_done: done,
        policy_version: Some(0),
        finish_reason: Some("stop".into()),
        source_format: "test".into(),
        source_line: Some(idx as i64),
        ingest_time: 1_764_000_000_000,
        ..Interaction::new(&sid, turn, &req, &resp, 1_764_000_000_000 + idx as i64 * 1000)
    };
    // turn 0: the main turn; turn 1: a closing side turn whose request carries the user's reply.
    let mut req1_msgs: Vec<Message> = serde_json::from_str(&req1).unwrap();
    req1_msgs.pop();
    let req1 = serde_json::to_string(&req1_msgs).unwrap();
    vec![mk(0, req0, a.content, false, TurnType::Main), mk(1, req1, "bye".into(), true, TurnType::Side)]
}

/// The four interactions of cases A–D ([`session`] 1 to 4), as every test writes them to its lake.
fn all_cases() -> Vec<Interaction> {
    ["A", "B", "C", "D"].iter().enumerate().flat_map(|(i, c)| session(c, i as i32 + 1)).collect()
}

/// The case marker (`[A]`…`[D]`, else `?`) found in a judge request.
fn case_of(req: &serde_json::Value) -> &'static str {
    let text = req.to_string();
    ["[A]", "[B]", "[C]", "[D]"].iter().find(|m| text.contains(*m)).copied().unwrap_or("?")
}

/// An OpenAI chat-completions response whose one choice says `content`.
fn reply(content: String) -> Json<serde_json::Value> {
    Json(serde_json::json!({"id": "x", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}))
}

/// Serves `app` on a free loopback port until the test ends; returns its `http://` base URL.
async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

/// The scripted judge: the case letter decides the vote. A = score 1, B = 0, C = −1, D = 0 (judge);
/// A and B get a hint, C and D do not (hint judge).
async fn scripted(kind: &'static str, Json(req): Json<serde_json::Value>) -> Json<serde_json::Value> {
    let content = match (kind, case_of(&req)) {
        ("judge", "[A]") => "The user moved on. \\boxed{1}".to_string(),
        ("judge", "[C]") => "The user corrected it. \\boxed{-1}".to_string(),
        ("judge", _) => "Ambiguous. \\boxed{0}".to_string(),
        ("hint", "[A]") | ("hint", "[B]") => "\\boxed{1} [HINT_START]State the sum as a single number.[HINT_END]".to_string(),
        _ => "\\boxed{-1}".to_string(),
    };
    reply(content)
}

async fn start_scripted() -> String {
    serve(Router::new().route("/judge/v1/chat/completions", post(|b| scripted("judge", b))).route("/hint/v1/chat/completions", post(|b| scripted("hint", b)))).await
}

fn pipeline(name: &str, method: &str, lake: &Path, url: &str, model: &Path) -> nextstate::config::PipelineConfig {
    let toml = format!(
        r#"name = "{name}"
method = "{method}"
lake = "{}"
[judge]
backend = "openai"
url = "{url}/judge"
model = "scripted"
m = 3
[hint]
backend = "openai"
url = "{url}/hint"
model = "scripted"
m = 2
[policy]
model = "{}"
threads = 1
"#,
        lake.display(),
        model.display()
    );
    let cfg: nextstate::config::PipelineConfig = toml::from_str(&toml).unwrap();
    cfg.validate().unwrap();
    cfg
}

async fn run(cfg: &nextstate::config::PipelineConfig) -> nextstate::stages::run::RunReport {
    let opts = nextstate::stages::run::RunOptions {
        only: Some(["signals", "judge", "hint", "teacher", "sinks"].iter().map(|s| s.to_string()).collect()),
        until_idle: true,
        ..Default::default()
    };
    nextstate::stages::run::run_pipeline(cfg, &opts, nextstate::runtime::Stop::default()).await.unwrap()
}

/// The result of SQL query `q` over `lake`, as CSV with a header line.
async fn csv(lake: &Lake, q: &str) -> String {
    nextstate::sql::render(&nextstate::sql::query(lake, q).await.unwrap(), nextstate::sql::OutputFormat::Csv).unwrap()
}

async fn counts(lake: &Lake, pipeline: &str) -> Vec<(String, i64)> {
    let q = format!("SELECT sample_type, count(*) AS n FROM samples WHERE pipeline = '{pipeline}' GROUP BY sample_type ORDER BY sample_type");
    csv(lake, &q)
        .await
        .lines()
        .skip(1)
        .map(|l| {
            let (a, b) = l.split_once(',').unwrap();
            (a.to_string(), b.parse().unwrap())
        })
        .collect()
}

fn sorted_samples(lake: &Lake, pipeline: &str) -> Vec<Sample> {
    let mut v: Vec<Sample> = lake.read_table::<Sample>().unwrap().into_iter().filter(|s| s.pipeline == pipeline).collect();
    for s in v.iter_mut() {
        s.processed_time = 0; // wall clock; everything else must be identical
    }
    v.sort_by(|a, b| a.sample_id.cmp(&b.sample_id));
    v
}

/// A fault found by the ablation: an OPD pipeline alone on a fresh lake got its signals live from the
/// signals stage (the signal is the record, not in its carry) and dead-lettered every one as
/// `missing_context`, so it built no hint. Stages signals and hint only (no model needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opd_pipeline_alone_on_a_fresh_lake_hints_from_the_live_signals() {
    let url = start_scripted().await;
    let dir = tempfile::tempdir().unwrap();
    let lake_dir = dir.path().join("lake");
    let lake = Lake::open(&lake_dir).unwrap();
    let rows = all_cases();
    lake.write_rows(&rows, "test", 1).unwrap();
    let cfg = pipeline("t-opd-alone", "opd", &lake_dir, &url, Path::new("models/none"));
    let opts =
        nextstate::stages::run::RunOptions { only: Some(["signals", "hint", "sinks"].iter().map(|s| s.to_string()).collect()), until_idle: true, ..Default::default() };
    let report = nextstate::stages::run::run_pipeline(&cfg, &opts, nextstate::runtime::Stop::default()).await.unwrap();
    let hint = &report.stages["hint"].outcomes;
    assert_eq!((hint.get("hint: accepted"), hint.get("hint: none"), hint.get("dead_letter: missing_context")), (Some(&2), Some(&2), None), "{hint:?}");
}

/// What the tests with the real model start from: the model, the scripted judge/hint endpoint, and a
/// fresh lake (in `dir`) holding `rows` as its `interactions`.
struct Setup {
    model: std::path::PathBuf,
    url: String,
    dir: tempfile::TempDir,
    lake_dir: std::path::PathBuf,
    lake: Lake,
}

/// [`Setup`] for `rows`; `None` (reported as missing) without the model.
async fn setup(rows: &[Interaction]) -> Option<Setup> {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return None;
    };
    let url = start_scripted().await;
    let dir = tempfile::tempdir().unwrap();
    let lake_dir = dir.path().join("lake");
    let lake = Lake::open(&lake_dir).unwrap();
    lake.write_rows(rows, "test", 1).unwrap();
    Some(Setup { model, url, dir, lake_dir, lake })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_sample_table_and_a_replay_from_the_vote_cache() {
    let rows = all_cases();
    let Some(Setup { model, url, dir, lake_dir, lake }) = setup(&rows).await else { return };

    // The same interactions through the three methods (three pipelines over one lake).
    for (name, method) in [("t-combined", "combined"), ("t-binary", "binary"), ("t-opd", "opd")] {
        let report = run(&pipeline(name, method, &lake_dir, &url, &model)).await;
        assert!(report.stages.contains_key("teacher"), "{name}: {report:?}");
    }
    // docs/method.md §5: combined — A hint+score: both; B hint, score 0: hint-only; C no hint, score −1:
    // score-only; D nothing: none.
    assert_eq!(counts(&lake, "t-combined").await, vec![("combined-both".into(), 1), ("combined-hint-only".into(), 1), ("combined-score-only".into(), 1)]);
    // binary — A (+1) and C (−1); B and D score 0: none.
    assert_eq!(counts(&lake, "t-binary").await, vec![("binary".into(), 2)]);
    // opd — the two accepted hints.
    assert_eq!(counts(&lake, "t-opd").await, vec![("opd".into(), 2)]);
    let rewards = csv(&lake, "SELECT sample_type, reward, teacher_logprobs IS NULL AS no_teacher FROM samples WHERE pipeline = 't-combined' ORDER BY sample_type").await;
    assert_eq!(rewards, "sample_type,reward,no_teacher\ncombined-both,1.0,false\ncombined-hint-only,0.0,false\ncombined-score-only,-1.0,false\n");
    // score-only: teacher log-probs are the rollout log-probs (the teacher term is 0)
    let combined = sorted_samples(&lake, "t-combined");
    let so = combined.iter().find(|s| s.sample_type == nextstate::schema::SampleType::CombinedScoreOnly).unwrap();
    assert_eq!(so.teacher_logprobs.as_ref(), Some(&so.rollout_logprobs));
    assert!(combined.iter().all(|s| s.rollout_logprobs_recomputed), "the rows had no log-probs: recomputed by scoring");
    // Lineage: every sample of every pipeline names the `interactions` record its turn was read from,
    // the same position as its signal's (t-combined's chain ran straight from the topic; t-binary's and
    // t-opd's judge and hint inputs were re-published from the lake, carrying the signal's position).
    let lineage = csv(
        &lake,
        "SELECT s.pipeline, count(*) AS n, count(s.source_offset) AS with_offset,              sum(CASE WHEN s.source_topic = g.source_topic AND s.source_partition = g.source_partition AND s.source_offset = g.source_offset THEN 1 ELSE 0 END) AS same_as_signal              FROM samples s JOIN signals g ON s.interaction_id = g.interaction_id GROUP BY s.pipeline ORDER BY s.pipeline",
    )
    .await;
    assert_eq!(lineage, "pipeline,n,with_offset,same_as_signal\nt-binary,2,2,2\nt-combined,3,3,3\nt-opd,2,2,2\n");
    assert_eq!(
        nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM signals WHERE source_topic = 'interactions' AND source_offset IS NOT NULL").await.unwrap(),
        nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM signals").await.unwrap(),
        "every signal names its interactions record"
    );
    // judgments store every vote and the tie/valid counts
    let j = nextstate::sql::scalar_i64(&lake, "SELECT sum(valid_votes) FROM judgments WHERE pipeline = 't-combined'").await.unwrap();
    assert_eq!(j, 12, "4 turns × m=3 valid votes");

    // Replay: the same interactions in a fresh lake with the vote cache copied: every vote is a cache hit
    // and the samples are identical.
    let lake2_dir = dir.path().join("lake2");
    let lake2 = Lake::open(&lake2_dir).unwrap();
    lake2.write_rows(&rows, "test", 1).unwrap();
    copy_dir(&lake_dir.join("_state/vote_cache"), &lake2.state_dir("vote_cache").unwrap());
    let report = run(&pipeline("t-combined", "combined", &lake2_dir, "http://127.0.0.1:9", &model)).await;
    let judge = &report.stages["judge"];
    assert_eq!(judge.get("votes"), 12);
    assert_eq!(judge.get("votes_cached"), 12, "every judge vote from the cache (the endpoint is unreachable): {judge:?}");
    assert_eq!(report.stages["hint"].get("votes_cached"), 8);
    assert_same_samples(&sorted_samples(&lake2, "t-combined"), &combined);
}

/// Issue 41: the tenant of each interaction reaches every row built from it (signals, judgments, hints,
/// teacher log-probs, samples), and an interaction whose tenant is not a valid id is a dead letter of
/// the signals stage (`invalid_tenant`), counted, while the other tenants' turns go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rows_tenant_reaches_every_table_and_an_invalid_tenant_is_a_dead_letter() {
    // A and B are alice's sessions, C and D bob's, E's tenant id has a space.
    let tenant_of = |sid: &str| match sid {
        "case-A" | "case-B" => "alice",
        "case-C" | "case-D" => "bob",
        _ => "not valid",
    };
    let rows: Vec<Interaction> = all_cases()
        .into_iter()
        .chain(session("E", 5))
        .map(|r| Interaction { tenant: Some(tenant_of(&r.session_id).to_string()), ..r })
        .collect();
    let Some(Setup { model, url, dir: _dir, lake_dir, lake }) = setup(&rows).await else { return };
    let report = run(&pipeline("t-tenants", "combined", &lake_dir, &url, &model)).await;
    assert_eq!(report.stages["signals"].get("dead_letter: invalid_tenant"), 2, "E's main and side turn: {:?}", report.stages["signals"]);
    for table in ["signals", "judgments", "hints", "teacher_logprobs", "samples"] {
        let got = csv(&lake, &format!("SELECT tenant, count(*) AS n FROM {table} GROUP BY tenant ORDER BY tenant")).await;
        let want = match table {
            // combined: A both, B hint-only, C score-only; D none. Hints: A and B accepted.
            "samples" => "tenant,n\nalice,2\nbob,1\n",
            "teacher_logprobs" => "tenant,n\nalice,2\n",
            _ => "tenant,n\nalice,2\nbob,2\n",
        };
        assert_eq!(got, want, "{table}");
    }
    // Each sample's tenant is its interaction's.
    let mismatched = "SELECT count(*) FROM samples s JOIN interactions i ON s.interaction_id = i.interaction_id WHERE s.tenant <> i.tenant";
    assert_eq!(nextstate::sql::scalar_i64(&lake, mismatched).await.unwrap(), 0);
    let dead = csv(&lake, "SELECT stage, reason_code, session_id, count(*) AS n FROM dead_letters GROUP BY stage, reason_code, session_id").await;
    assert_eq!(dead, "stage,reason_code,session_id,n\nsignals,invalid_tenant,case-E,2\n");
    let reason = csv(&lake, "SELECT reason FROM dead_letters WHERE session_id = 'case-E' AND reason LIKE '%byte 3%' LIMIT 1").await;
    assert!(reason.contains("tenant id \"\"not valid\"\" has the character ' ' at byte 3"), "{reason}");
}

/// A replay gives the same samples: every field equal but the log-probs, which agree to 1e-4 per token.
/// Log-probs are not bit-identical across runs: the teacher stage scores whatever records have arrived
/// together as one padded batch, and a batch's shape changes the float summation order (the same
/// tolerance as `tests/model_train/model.rs`'s batch-vs-single check). A fault found in CI: the exact comparison
/// failed once when the two runs batched the three turns differently.
fn assert_same_samples(got: &[Sample], want: &[Sample]) {
    /// Every log-prob of a sample, in one order (rollout, teacher, top-K, each candidate's two arrays).
    fn floats(s: &Sample) -> Vec<f32> {
        let mut v = s.rollout_logprobs.clone();
        v.extend(s.teacher_logprobs.iter().flatten());
        v.extend(s.topk_logprobs.iter().flatten().flatten());
        for c in s.candidates.iter().flatten() {
            v.extend(c.topk_logprobs.iter().flatten().chain(c.logprobs_at_student_topk.iter().flatten()));
        }
        v
    }
    /// The sample with its log-probs emptied (their shapes are checked by `floats`' lengths and the ids).
    fn strip(s: &Sample) -> Sample {
        let mut s = s.clone();
        s.rollout_logprobs.clear();
        s.teacher_logprobs = s.teacher_logprobs.map(|_| vec![]);
        s.topk_logprobs = s.topk_logprobs.map(|_| vec![]);
        for c in s.candidates.iter_mut().flatten() {
            c.topk_logprobs.clear();
            c.logprobs_at_student_topk.clear();
        }
        s
    }
    assert_eq!(got.len(), want.len(), "sample count");
    for (g, w) in got.iter().zip(want) {
        let (a, b) = (floats(g), floats(w));
        assert_eq!(a.len(), b.len(), "{}: number of log-probs", w.sample_id);
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "{}: log-probs differ by {d}", w.sample_id);
        assert_eq!(strip(g), strip(w), "the same sample but its log-probs (and processing time)");
    }
}

/// Distinct hints per vote for the multi-candidate test: the k-th vote on a case gets variant k
/// (cases A and B; B's first and third variants are the same text, so it has two candidates).
fn hint_variant(case: &str, k: usize) -> Option<&'static str> {
    const A: [&str; 3] = ["State the sum as a single number.", "Answer with digits only and no words at all.", "Give just the number."];
    const B: [&str; 3] = ["Give just the number.", "Reply with the sum and nothing else.", "Give just the number."];
    match case {
        "[A]" => Some(A[k % 3]),
        "[B]" => Some(B[k % 3]),
        _ => None,
    }
}

async fn scripted_multi(Json(req): Json<serde_json::Value>) -> Json<serde_json::Value> {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let case = case_of(&req);
    let k = {
        let mut seen = SEEN.lock().unwrap();
        seen.push(case.to_string());
        seen.iter().filter(|c| *c == case).count() - 1
    };
    let content = match hint_variant(case, k) {
        Some(h) => format!("\\boxed{{1}} [HINT_START]{h}[HINT_END]"),
        None => "\\boxed{-1}".to_string(),
    };
    reply(content)
}

/// Multi-candidate hints (docs/method.md §3b) through the real teacher stage: every accepted, distinct hint
/// vote gets its own teacher row, shortest first; the student's top-K ids are the policy's own on the
/// original prompt; each candidate's log-probs at them agree with its own top-K lists and with its
/// log-prob of the sampled token wherever the ids coincide; the trainer's overlap packing takes the
/// samples; a rerun is served from the teacher cache with identical samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_candidate_hints_score_every_candidate_at_the_students_top_k() {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let url = start_scripted().await;
    let hint_url = serve(Router::new().route("/v1/chat/completions", post(scripted_multi))).await;

    let dir = tempfile::tempdir().unwrap();
    let lake_dir = dir.path().join("lake");
    let lake = Lake::open(&lake_dir).unwrap();
    let rows = all_cases();
    lake.write_rows(&rows, "test", 1).unwrap();
    let mut cfg = pipeline("t-multi", "combined", &lake_dir, &url, &model);
    cfg.hint.url = Some(hint_url);
    cfg.hint.m = 3;
    cfg.teacher.candidates = 3;
    cfg.teacher.top_k = 4;
    // One turn per forward pass: the numbers do not depend on which turns share a padded batch, so
    // the replay below, which scores other subsets together, reproduces them bit for bit.
    cfg.teacher.batch = 1;
    cfg.validate().unwrap();
    let report = run(&cfg).await;
    let teacher = &report.stages["teacher"];
    assert_eq!(teacher.get("teacher_logprobs"), 5, "A: 3 distinct hints, B: 2: {teacher:?}");
    assert_eq!((teacher.get("hint_candidates: 3"), teacher.get("hint_candidates: 2")), (1, 1), "{teacher:?}");
    assert_eq!(counts(&lake, "t-multi").await, vec![("combined-both".into(), 1), ("combined-hint-only".into(), 1), ("combined-score-only".into(), 1)]);

    let lm = nextstate::model::LanguageModel::load(&model, &Default::default()).unwrap();
    let trows: std::collections::HashMap<String, nextstate::schema::TeacherLogprobs> =
        lake.read_table::<nextstate::schema::TeacherLogprobs>().unwrap().into_iter().map(|r| (r.teacher_id.clone(), r)).collect();
    let samples = sorted_samples(&lake, "t-multi");
    let u32s = |v: &[i32]| v.iter().map(|&x| x as u32).collect::<Vec<u32>>();
    let (mut same_token, mut same_id) = (0, 0);
    for s in &samples {
        let Some(cands) = &s.candidates else {
            assert_eq!(s.sample_type, nextstate::schema::SampleType::CombinedScoreOnly, "only the turn without a hint has no candidates");
            assert!(s.student_topk_ids.is_none());
            continue;
        };
        let case = if s.sample_type == nextstate::schema::SampleType::CombinedBoth { "[A]" } else { "[B]" };
        // Shortest first, deduplicated: each candidate's teacher prompt ends its last user message with its hint.
        let mut want: Vec<&str> = (0..3).filter_map(|k| hint_variant(case, k)).collect();
        want.sort_by_key(|h| h.len());
        want.dedup();
        assert_eq!(cands.len(), want.len());
        for (c, hint) in cands.iter().zip(&want) {
            let text = lm.decode(&u32s(&trows[&c.teacher_id].teacher_prompt_token_ids), false).unwrap();
            assert!(text.contains(&format!("[user's hint / instruction]\n{hint}")), "candidate {} is not {hint:?}: {text}", c.teacher_id);
        }
        // Candidate 0 is the sample's teacher.
        assert_eq!(s.teacher_id.as_deref(), Some(cands[0].teacher_id.as_str()));
        assert_eq!(s.teacher_logprobs.as_ref(), Some(&trows[&cands[0].teacher_id].teacher_logprobs));
        // The student's top-4 ids are the policy's own on the original prompt.
        let own = lm.score(&[(u32s(&s.prompt_token_ids), u32s(&s.response_token_ids))], 4).unwrap().remove(0);
        let own_ids: Vec<Vec<i32>> = own.topk_ids.unwrap().iter().map(|r| r.iter().map(|&x| x as i32).collect()).collect();
        assert_eq!(s.student_topk_ids.as_ref(), Some(&own_ids));
        for c in cands {
            let row = &trows[&c.teacher_id];
            assert_eq!(row.student_topk_ids.as_ref(), Some(&own_ids));
            for (t, ids) in own_ids.iter().enumerate() {
                for (j, id) in ids.iter().enumerate() {
                    let at = c.logprobs_at_student_topk[t][j];
                    if *id == s.response_token_ids[t] {
                        assert!((at - row.teacher_logprobs[t]).abs() < 1e-5, "t {t}: {at} vs {}", row.teacher_logprobs[t]);
                        same_token += 1;
                    }
                    if let Some(jj) = c.topk_ids[t].iter().position(|x| x == id) {
                        assert!((at - c.topk_logprobs[t][jj]).abs() < 1e-5, "t {t} id {id}: {at} vs {}", c.topk_logprobs[t][jj]);
                        same_id += 1;
                    }
                }
            }
        }
    }
    assert!(same_token > 0 && same_id > 0, "the checks compared something: {same_token} sampled tokens, {same_id} shared ids");

    // The trainer's overlap packing takes every sample.
    let tcfg = nextstate::trainer::TrainerConfig { opd_loss: nextstate::trainer::OpdLoss::Overlap, recompute_old_logprobs: true, ..Default::default() };
    let opts = nextstate::trainer::PackOptions {
        method: nextstate::method::Method::Combined,
        vocab_size: lm.transformer().config.vocab_size,
        pad_id: 0,
        current_version: 0,
        device: tch::Device::Cpu,
        config: tcfg,
    };
    let packed = nextstate::trainer::pack_samples(&samples, &opts).unwrap();
    assert!(packed.dropped.is_empty(), "{:?}", packed.dropped);
    let b = packed.batch.unwrap();
    assert_eq!(b.topk_subset.as_ref().unwrap().size()[2], 4);
    assert_eq!(b.overlap_fraction.iter().filter(|o| o.is_some()).count(), 2, "the two hinted rows");

    // A replay into a fresh lake with the vote cache and, as its teacher cache (what `nextstate replay`
    // copies), the rows of every candidate but the shortest: those three are served from the cache, the
    // shortest ones are scored again at the cached rows' student ids, and the samples are the same.
    let lake2_dir = dir.path().join("lake2");
    let lake2 = Lake::open(&lake2_dir).unwrap();
    lake2.write_rows(&rows, "test", 1).unwrap();
    copy_dir(&lake_dir.join("_state/vote_cache"), &lake2.state_dir("vote_cache").unwrap());
    let later: std::collections::HashSet<&str> =
        samples.iter().filter_map(|s| s.candidates.as_ref()).flat_map(|c| c[1..].iter().map(|c| c.teacher_id.as_str())).collect();
    let cached: Vec<nextstate::schema::TeacherLogprobs> = trows.values().filter(|r| later.contains(r.teacher_id.as_str())).cloned().collect();
    assert_eq!(cached.len(), 3);
    Lake::open(lake2_dir.join("_state/teacher_cache")).unwrap().write_rows(&cached, "test", 1).unwrap();
    let cfg2 = nextstate::config::PipelineConfig { lake: lake2_dir.clone(), ..cfg };
    let report = run(&cfg2).await;
    assert_eq!(report.stages["teacher"].get("teacher_cache_hit"), 3, "{:?}", report.stages["teacher"]);
    assert_eq!(report.stages["teacher"].get("teacher_logprobs"), 5, "{:?}", report.stages["teacher"]);
    assert_same_samples(&sorted_samples(&lake2, "t-multi"), &samples);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dst = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// Each stage run alone (`--only <stage>`, sinks not named) on the embedded bus writes every row it
/// produces to the lake: the same rows, by key, as one run of the whole chain with its sinks, each key
/// once. (Before: `--only signals` counted its signals and the lake kept none of them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stage_alone_on_the_embedded_bus_writes_its_rows_to_the_lake() {
    let Some(model) = common::smollm2() else {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let url = start_scripted().await;
    let dir = tempfile::tempdir().unwrap();
    let rows = all_cases();
    let (alone_dir, chain_dir) = (dir.path().join("alone"), dir.path().join("chain"));
    for d in [&alone_dir, &chain_dir] {
        Lake::open(d).unwrap().write_rows(&rows, "test", 1).unwrap();
    }
    let alone = pipeline("t-alone", "combined", &alone_dir, &url, &model);
    for stage in ["signals", "judge", "hint", "teacher"] {
        let opts = nextstate::stages::run::RunOptions { only: Some(vec![stage.to_string()]), until_idle: true, ..Default::default() };
        let report = nextstate::stages::run::run_pipeline(&alone, &opts, nextstate::runtime::Stop::default()).await.unwrap();
        assert!(report.sinks_added && report.stages.contains_key(stage), "{stage}: {report:?}");
    }
    run(&pipeline("t-alone", "combined", &chain_dir, &url, &model)).await;
    let (a, c) = (Lake::open(&alone_dir).unwrap(), Lake::open(&chain_dir).unwrap());
    fn keys<T: nextstate::schema::Table>(l: &Lake) -> std::collections::BTreeSet<String> {
        l.keys::<T>().unwrap().into_iter().collect()
    }
    use nextstate::schema::{HintRecord, Judgment, Signal, TeacherLogprobs};
    let pairs = [
        ("signals", keys::<Signal>(&a), keys::<Signal>(&c)),
        ("judgments", keys::<Judgment>(&a), keys::<Judgment>(&c)),
        ("hints", keys::<HintRecord>(&a), keys::<HintRecord>(&c)),
        ("teacher_logprobs", keys::<TeacherLogprobs>(&a), keys::<TeacherLogprobs>(&c)),
        ("samples", keys::<Sample>(&a), keys::<Sample>(&c)),
    ];
    for (table, alone_keys, chain_keys) in pairs {
        assert!(!chain_keys.is_empty(), "{table}: the chain wrote rows");
        assert_eq!(alone_keys, chain_keys, "{table}: the stage run alone wrote the same rows");
        let n = nextstate::sql::scalar_i64(&a, &format!("SELECT count(*) FROM {table}")).await.unwrap();
        assert_eq!(n as usize, alone_keys.len(), "{table}: each key once");
    }
}
