//! The judge, hint and teacher stages end to end (embedded bus, real lake, real model): every row of the
//! METHOD.md §5 table is built on purpose with a scripted judge/hint endpoint (real HTTP), and the
//! `samples` counts per pipeline are checked with SQL. A replay into a fresh lake reuses every cached vote
//! and reproduces the samples exactly.
mod common;

use std::path::{Path, PathBuf};

use axum::routing::post;
use axum::{Json, Router};
use nextstate::lake::Lake;
use nextstate::schema::{Interaction, Message, Sample, TurnType};

fn model_dir() -> Option<PathBuf> {
    let d = common::root().join("models/smollm2-135m-instruct");
    d.join("model.safetensors").exists().then_some(d)
}

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

/// The scripted judge: the case letter decides the vote. A = score 1, B = 0, C = −1, D = 0 (judge);
/// A and B get a hint, C and D do not (hint judge).
async fn scripted(kind: &'static str, Json(req): Json<serde_json::Value>) -> Json<serde_json::Value> {
    let text = req.to_string();
    let case = ["[A]", "[B]", "[C]", "[D]"].iter().find(|m| text.contains(*m)).copied().unwrap_or("?");
    let content = match (kind, case) {
        ("judge", "[A]") => "The user moved on. \\boxed{1}".to_string(),
        ("judge", "[C]") => "The user corrected it. \\boxed{-1}".to_string(),
        ("judge", _) => "Ambiguous. \\boxed{0}".to_string(),
        ("hint", "[A]") | ("hint", "[B]") => "\\boxed{1} [HINT_START]State the sum as a single number.[HINT_END]".to_string(),
        _ => "\\boxed{-1}".to_string(),
    };
    Json(serde_json::json!({"id": "x", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}))
}

async fn start_scripted() -> String {
    let app = Router::new()
        .route("/judge/v1/chat/completions", post(|b| scripted("judge", b)))
        .route("/hint/v1/chat/completions", post(|b| scripted("hint", b)));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
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

async fn counts(lake: &Lake, pipeline: &str) -> Vec<(String, i64)> {
    let q = format!("SELECT sample_type, count(*) AS n FROM samples WHERE pipeline = '{pipeline}' GROUP BY sample_type ORDER BY sample_type");
    let out = nextstate::sql::render(&nextstate::sql::query(lake, &q).await.unwrap(), nextstate::sql::OutputFormat::Csv).unwrap();
    out.lines()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_sample_table_and_a_replay_from_the_vote_cache() {
    let Some(model) = model_dir() else {
        eprintln!("SKIPPED: models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return;
    };
    let url = start_scripted().await;
    let dir = tempfile::tempdir().unwrap();
    let lake_dir = dir.path().join("lake");
    let lake = Lake::open(&lake_dir).unwrap();
    let rows: Vec<Interaction> = ["A", "B", "C", "D"].iter().enumerate().flat_map(|(i, c)| session(c, i as i32 + 1)).collect();
    lake.write_rows(&rows, "test", 1).unwrap();

    // The same interactions through the three methods (three pipelines over one lake).
    for (name, method) in [("t-combined", "combined"), ("t-binary", "binary"), ("t-opd", "opd")] {
        let report = run(&pipeline(name, method, &lake_dir, &url, &model)).await;
        assert!(report.stages.contains_key("teacher"), "{name}: {report:?}");
    }
    // METHOD.md §5: combined — A hint+score: both; B hint, score 0: hint-only; C no hint, score −1:
    // score-only; D nothing: none.
    assert_eq!(
        counts(&lake, "t-combined").await,
        vec![("combined-both".into(), 1), ("combined-hint-only".into(), 1), ("combined-score-only".into(), 1)]
    );
    // binary — A (+1) and C (−1); B and D score 0: none.
    assert_eq!(counts(&lake, "t-binary").await, vec![("binary".into(), 2)]);
    // opd — the two accepted hints.
    assert_eq!(counts(&lake, "t-opd").await, vec![("opd".into(), 2)]);
    let rewards = nextstate::sql::render(
        &nextstate::sql::query(&lake, "SELECT sample_type, reward, teacher_logprobs IS NULL AS no_teacher FROM samples WHERE pipeline = 't-combined' ORDER BY sample_type")
            .await
            .unwrap(),
        nextstate::sql::OutputFormat::Csv,
    )
    .unwrap();
    assert_eq!(rewards, "sample_type,reward,no_teacher\ncombined-both,1.0,false\ncombined-hint-only,0.0,false\ncombined-score-only,-1.0,false\n");
    // score-only: teacher log-probs are the rollout log-probs (the teacher term is 0)
    let combined = sorted_samples(&lake, "t-combined");
    let so = combined.iter().find(|s| s.sample_type == nextstate::schema::SampleType::CombinedScoreOnly).unwrap();
    assert_eq!(so.teacher_logprobs.as_ref(), Some(&so.rollout_logprobs));
    assert!(combined.iter().all(|s| s.rollout_logprobs_recomputed), "the rows had no log-probs: recomputed by scoring");
    // Lineage: every sample of every pipeline names the `interactions` record its turn was read from,
    // the same position as its signal's (t-combined's chain ran straight from the topic; t-binary's and
    // t-opd's judge and hint inputs were re-published from the lake, carrying the signal's position).
    let lineage = nextstate::sql::render(
        &nextstate::sql::query(
            &lake,
            "SELECT s.pipeline, count(*) AS n, count(s.source_offset) AS with_offset,              sum(CASE WHEN s.source_topic = g.source_topic AND s.source_partition = g.source_partition AND s.source_offset = g.source_offset THEN 1 ELSE 0 END) AS same_as_signal              FROM samples s JOIN signals g ON s.interaction_id = g.interaction_id GROUP BY s.pipeline ORDER BY s.pipeline",
        )
        .await
        .unwrap(),
        nextstate::sql::OutputFormat::Csv,
    )
    .unwrap();
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
    let cache_src = lake_dir.join("_state/vote_cache");
    let cache_dst = lake2.state_dir("vote_cache").unwrap();
    for f in std::fs::read_dir(&cache_src).unwrap().flatten() {
        std::fs::copy(f.path(), cache_dst.join(f.file_name())).unwrap();
    }
    let report = run(&pipeline("t-combined", "combined", &lake2_dir, "http://127.0.0.1:9", &model)).await;
    let judge = &report.stages["judge"];
    assert_eq!(judge.get("votes"), 12);
    assert_eq!(judge.get("votes_cached"), 12, "every judge vote from the cache (the endpoint is unreachable): {judge:?}");
    assert_eq!(report.stages["hint"].get("votes_cached"), 8);
    assert_eq!(sorted_samples(&lake2, "t-combined"), combined, "bit-identical samples (but processing time)");
}
