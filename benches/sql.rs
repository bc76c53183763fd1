//! SQL over a large lake: our DataFusion session (`sql::query`, as `nextstate sql` runs it) on three
//! queries, and the lake's size on disk against the same rows as JSON Lines. The peer is
//! `benches/peer_sql.py` (DuckDB over the same Parquet files).
//!
//! The lake (`turns=N`, default 1,000,000) is made from the tau-bench fixture's 2,454 real turns,
//! replicated with fresh ids (`<id>~r<k>`: a distinct turn of a distinct session, same content), and
//! written through the lake writer (`Lake::write_rows`, one file per table per copy):
//! - `interactions`: N rows;
//! - `judgments`: the rule-based judge's judgment of each fixture turn (`judge_turn`), replicated;
//! - `samples`: the binary method's sample of each scored turn (`samples::assemble`), with prompt and
//!   response token ids from the policy's tokenizer and chat template (`teacher::tokens::turn_tokens`)
//!   and rollout log-probs of −1.0 (no model forward pass: only the table's shape matters here); without
//!   the model directory the samples table is left out and the join is skipped.
//!
//! The lake is kept in `lake=DIR` (default `$CARGO_TARGET_TMPDIR/bench-lake-<N>`) and reused when
//! complete. Each query runs `repeats=3` times on a fresh session (file listing and Parquet metadata
//! included, as for a `nextstate sql` call); the best and median wall times are reported.
//!
//! `queries=count,join_samples_judgments` runs some of the queries (default: all); `layout=NAME` labels
//! the results (`scripts/bench.sh` runs the lake as written and a copy after `nextstate compact`). DataFusion's settings
//! can be varied through its `DATAFUSION_*` environment variables (see `sql::session`).
//!
//! Run: `cargo bench --bench sql -- turns=1000000`. Prints `BENCH {json}` lines.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use serde_json::json;

use nextstate::method::Method;
use nextstate::judge::{judge_turn, Judge, JudgeConfig, TurnContext};
use nextstate::lake::Lake;
use nextstate::model::{LanguageModel, LoadOptions};
use nextstate::samples::{assemble, SampleConfig, SampleOutcome};
use nextstate::schema::{Interaction, Judgment, Sample};
use nextstate::teacher::tokens::turn_tokens;

use common::{arg, dir_bytes, emit, fixture_rows, replica, signals_of};

/// The queries, by name (the peer runs the same text).
pub const QUERIES: &[(&str, &str)] = &[
    ("count", "SELECT count(*) AS turns FROM interactions"),
    ("group_by_session", "SELECT count(*) AS sessions, max(turns) AS max_turns, min(turns) AS min_turns FROM (SELECT session_id, count(*) AS turns FROM interactions GROUP BY session_id) t"),
    ("join_samples_judgments", "SELECT j.score, count(*) AS samples, sum(s.reward) AS reward FROM samples s JOIN judgments j ON s.judgment_id = j.judgment_id GROUP BY j.score ORDER BY j.score"),
];

fn model_dir() -> Option<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct");
    d.join("config.json").is_file().then_some(d)
}

struct Generated {
    secs: f64,
    jsonl: HashMap<&'static str, u64>,
    rows: HashMap<&'static str, u64>,
}

fn generate(dir: &std::path::Path, turns: usize, rows: &[Interaction]) -> Generated {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let t = Instant::now();
    // Judgments of the fixture's turns (rule-based judge).
    let signals: HashMap<String, nextstate::schema::Signal> = signals_of(rows).into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
    let judge = Judge::new(JudgeConfig::default()).expect("judge");
    let judgments: Vec<Option<Judgment>> = rows
        .iter()
        .map(|i| {
            let s = signals.get(&i.interaction_id)?;
            let turn = TurnContext::from_rows(i, s).ok()?;
            Some(rt.block_on(judge_turn(&judge, "bench", &turn)))
        })
        .collect();
    // Binary samples of the scored turns.
    let lm = model_dir().map(|d| LanguageModel::load(&d, &LoadOptions::default()).expect("load model"));
    let cfg = SampleConfig::default();
    let samples: Vec<Option<Sample>> = rows
        .iter()
        .zip(&judgments)
        .map(|(i, j)| {
            let (lm, j) = (lm.as_ref()?, j.as_ref()?);
            if !matches!(j.score, 1 | -1) {
                return None;
            }
            let (p, r) = turn_tokens(lm, i).ok()?;
            let p: Vec<i32> = p.iter().map(|&x| x as i32).collect();
            let r: Vec<i32> = r.iter().map(|&x| x as i32).collect();
            match assemble(Method::Binary, &cfg, i, Some(j), None, None, &p, &r, &vec![-1.0f32; r.len()], "bench") {
                Ok(SampleOutcome::Sample(s)) => Some(s),
                _ => None,
            }
        })
        .collect();
    eprintln!(
        "fixture: {} turns, {} judgments, {} samples (prepared in {:.1} s)",
        rows.len(),
        judgments.iter().flatten().count(),
        samples.iter().flatten().count(),
        t.elapsed().as_secs_f64()
    );
    let lake = Lake::open(dir).expect("lake");
    let mut jsonl: HashMap<&'static str, u64> = HashMap::new();
    let mut counts: HashMap<&'static str, u64> = HashMap::new();
    let copies = turns.div_ceil(rows.len());
    let mut left = turns;
    // JSONL sizes: a copy's rows differ from copy 0's only by the id suffix `~r<k>` (ASCII, no
    // escaping), so each row's JSON length is its copy-0 length plus (digits(k) - 1) per suffixed id.
    // Checked against a real serialisation of copy 1 below.
    let jlen = |v: &dyn erased::Json| v.json_len();
    let mut base: Option<(Vec<u64>, Vec<u64>, Vec<u64>)> = None;
    for k in 0..copies {
        let take = left.min(rows.len());
        left -= take;
        let (is, js, ss) = copy(k, &rows[..take], &judgments[..take], &samples[..take]);
        let extra = k.to_string().len() as u64 - 1;
        if base.is_none() {
            base = Some((is.iter().map(|r| jlen(r)).collect(), js.iter().map(|r| jlen(r)).collect(), ss.iter().map(|r| jlen(r)).collect()));
        }
        let (bi, bj, bs) = base.as_ref().expect("base sizes");
        let sample_ids = |s: &Sample| 3 + s.judgment_id.is_some() as u64;
        let size_i: u64 = bi[..is.len()].iter().sum::<u64>() + is.len() as u64 * 2 * extra;
        let size_j: u64 = bj[..js.len()].iter().sum::<u64>() + js.len() as u64 * 3 * extra;
        let size_s: u64 = bs[..ss.len()].iter().sum::<u64>() + ss.iter().map(|s| sample_ids(s) * extra).sum::<u64>();
        if k == 1 {
            let real = |v: &[&dyn erased::Json]| v.iter().map(|r| r.json_len()).sum::<u64>();
            assert_eq!(size_i, real(&is.iter().map(|r| r as &dyn erased::Json).collect::<Vec<_>>()), "JSONL size formula (interactions)");
            assert_eq!(size_j, real(&js.iter().map(|r| r as &dyn erased::Json).collect::<Vec<_>>()), "JSONL size formula (judgments)");
            assert_eq!(size_s, real(&ss.iter().map(|r| r as &dyn erased::Json).collect::<Vec<_>>()), "JSONL size formula (samples)");
        }
        *jsonl.entry("interactions").or_default() += size_i;
        *jsonl.entry("judgments").or_default() += size_j;
        *jsonl.entry("samples").or_default() += size_s;
        *counts.entry("interactions").or_default() += is.len() as u64;
        *counts.entry("judgments").or_default() += js.len() as u64;
        *counts.entry("samples").or_default() += ss.len() as u64;
        lake.write_rows(&is, "gen", k as u64).expect("write interactions");
        lake.write_rows(&js, "gen", k as u64).expect("write judgments");
        lake.write_rows(&ss, "gen", k as u64).expect("write samples");
        if k % 50 == 0 {
            eprintln!("copy {k}/{copies} written ({:.0} s)", t.elapsed().as_secs_f64());
        }
    }
    Generated { secs: t.elapsed().as_secs_f64(), jsonl, rows: counts }
}

/// Copy `k` of the fixture's rows (ids suffixed `~r<k>`): interactions, judgments, samples.
fn copy(k: usize, rows: &[Interaction], judgments: &[Option<Judgment>], samples: &[Option<Sample>]) -> (Vec<Interaction>, Vec<Judgment>, Vec<Sample>) {
    let suffix = |id: &str| format!("{id}~r{k}");
    let is: Vec<Interaction> = rows.iter().map(|r| replica(r, k)).collect();
    let js: Vec<Judgment> = judgments
        .iter()
        .flatten()
        .map(|j| {
            let mut j = j.clone();
            j.judgment_id = suffix(&j.judgment_id);
            j.interaction_id = suffix(&j.interaction_id);
            j.session_id = suffix(&j.session_id);
            j
        })
        .collect();
    let ss: Vec<Sample> = samples
        .iter()
        .flatten()
        .map(|s| {
            let mut s = s.clone();
            s.sample_id = suffix(&s.sample_id);
            s.interaction_id = suffix(&s.interaction_id);
            s.session_id = suffix(&s.session_id);
            s.judgment_id = s.judgment_id.as_deref().map(suffix);
            s
        })
        .collect();
    (is, js, ss)
}

mod erased {
    /// A row's length as one JSON Lines line (JSON + newline).
    pub trait Json {
        fn json_len(&self) -> u64;
    }
    impl<T: serde::Serialize> Json for T {
        fn json_len(&self) -> u64 {
            serde_json::to_vec(self).map(|b| b.len() as u64 + 1).unwrap_or(0)
        }
    }
}

fn main() {
    let Some(rows) = fixture_rows() else {
        eprintln!("SKIPPED: tau-bench fixture not found");
        return;
    };
    let turns: usize = arg("turns", "1000000").parse().expect("turns=N");
    let repeats: usize = arg("repeats", "3").parse().expect("repeats=N");
    let only = arg("queries", "");
    let layout = arg("layout", "as written");
    let dir = PathBuf::from(arg("lake", &format!("{}/bench-lake-{turns}", env!("CARGO_TARGET_TMPDIR"))));
    let marker = dir.join("_complete.json");
    let meta: serde_json::Value = match std::fs::read(&marker).ok().and_then(|b| serde_json::from_slice(&b).ok()) {
        Some(m) => m,
        None => {
            let _ = std::fs::remove_dir_all(&dir);
            let g = generate(&dir, turns, &rows);
            let m = json!({"generate_secs": g.secs, "jsonl_bytes": g.jsonl, "rows": g.rows});
            std::fs::write(&marker, serde_json::to_vec(&m).expect("json")).expect("write marker");
            m
        }
    };
    let mut sizes = serde_json::Map::new();
    for table in ["interactions", "judgments", "samples"] {
        sizes.insert(table.into(), json!({
            "rows": meta["rows"][table],
            "parquet_bytes": dir_bytes(&dir.join(table)),
            "jsonl_bytes": meta["jsonl_bytes"][table],
        }));
    }
    let files: serde_json::Map<String, serde_json::Value> = ["interactions", "judgments", "samples"]
        .iter()
        .map(|t| (t.to_string(), json!(Lake::open(&dir).and_then(|l| l.files(t)).map(|f| f.len()).unwrap_or(0))))
        .collect();
    let o = nextstate::sql::session_options().expect("DATAFUSION_* settings");
    let settings = json!({"target_partitions": o.execution.target_partitions, "collect_statistics": o.execution.collect_statistics,
        "metadata_size_hint": o.execution.parquet.metadata_size_hint});
    emit(json!({"bench": "sql", "case": "lake", "layout": layout, "lake": dir.display().to_string(), "turns": turns, "generate_secs": meta["generate_secs"],
        "tables": sizes, "files": files, "settings": settings}));

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let lake = Lake::open(&dir).expect("lake");
    let has_samples = meta["rows"]["samples"].as_u64().unwrap_or(0) > 0;
    for (name, q) in QUERIES {
        if name.starts_with("join") && !has_samples {
            emit(json!({"bench": "sql", "case": name, "engine": "datafusion", "skipped": "no samples table (model directory missing)"}));
            continue;
        }
        if !only.is_empty() && !only.split(',').any(|o| o == *name) {
            continue;
        }
        let (mut times, mut session_times) = (vec![], vec![]);
        let mut result = String::new();
        for _ in 0..repeats {
            let t = Instant::now();
            // As `sql::query`, with the session's set-up (table registration) timed apart.
            let batches = rt.block_on(async {
                let ctx = nextstate::sql::session(&lake).await.expect("session");
                session_times.push(t.elapsed().as_secs_f64());
                ctx.sql(q).await.expect("plan").collect().await.expect("query")
            });
            times.push(t.elapsed().as_secs_f64());
            result = nextstate::sql::render(&batches, nextstate::sql::OutputFormat::Json).expect("render");
        }
        times.sort_by(f64::total_cmp);
        session_times.sort_by(f64::total_cmp);
        emit(json!({"bench": "sql", "case": name, "engine": "datafusion", "layout": layout, "query": q, "best_s": times[0],
            "median_s": times[times.len() / 2], "session_median_s": session_times[session_times.len() / 2], "repeats": repeats, "result": result.trim()}));
    }
}
