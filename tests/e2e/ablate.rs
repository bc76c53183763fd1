//! `nextstate replay` and `nextstate ablate`: lineage and cache reuse of a replay (a fake OpenAI-compatible
//! judge counts the calls), and the tiny ablation run twice — once as two invocations (a partial run of
//! two arms, then the rest: resume), once in another folder for two of its arms — giving identical
//! numbers, with arms that differ exactly where `ablations/tiny.toml` says.

use crate::common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use nextstate::ablate::config::{config_diff, AblationConfig, EvalVersions};
use nextstate::ablate::replay::{replay, run_stages, ReplayOptions, ReplayTarget};
use nextstate::ablate::hints::HintTextRow;
use nextstate::ablate::mass::MassRow;
use nextstate::ablate::results::*;
use nextstate::config::PipelineConfig;
use nextstate::lake::Lake;
use nextstate::runtime::Stop;
use nextstate::schema::{Interaction, Judgment, Message};

fn model_dir() -> Option<PathBuf> {
    let candidates = [std::env::var("NEXTSTATE_TEST_MODEL").ok().map(PathBuf::from), Some(common::root().join("models/smollm2-135m-instruct"))];
    let found = candidates.into_iter().flatten().find(|p| p.join("config.json").is_file());
    if found.is_none() {
        common::missing("models/smollm2-135m-instruct not found (run scripts/setup.sh, or set NEXTSTATE_TEST_MODEL)");
    }
    found
}

// ---------------------------------------------------------------- replay (no model needed)

fn turn(session: &str, turn: i32, reply: &str) -> Interaction {
    let request = vec![Message::text("user", format!("question {session} {turn}"))];
    let request_messages = serde_json::to_string(&request).unwrap();
    let response = format!("answer {session} {turn}");
    Interaction {
        session_done: turn == 1,
        policy_version: Some(0),
        finish_reason: Some("stop".into()),
        next_state: Some(serde_json::to_string(&[Message::text("user", reply)]).unwrap()),
        source_format: "test".into(),
        ingest_time: 1_767_225_600_000,
        ..Interaction::new(session, turn, &request_messages, &response, 1_767_225_600_000 + i64::from(turn) * 1000 + if session == "s1" { 0 } else { 100 })
    }
}

/// A fake OpenAI-compatible judge: every vote is `\boxed{1}`; counts calls.
async fn fake_judge() -> (String, Arc<AtomicU32>) {
    use axum::routing::post;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                axum::Json(serde_json::json!({
                    "id": "x", "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "It worked. \\boxed{1}"}, "finish_reason": "stop"}]
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), calls)
}

fn pipeline(name: &str, lake: &Path, url: &str) -> PipelineConfig {
    let text =
        format!("name = \"{name}\"\nmethod = \"binary\"\nlake = \"{}\"\n[judge]\nbackend = \"openai\"\nurl = \"{url}\"\nmodel = \"fake-judge\"\nm = 2\n", lake.display());
    let cfg: PipelineConfig = toml::from_str(&text).unwrap();
    cfg.validate().unwrap();
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_lineage_and_reuses_cached_votes() {
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("src"), dir.path().join("replayed"));
    let rows = vec![turn("s1", 0, "hmm, that's wrong, try again"), turn("s1", 1, "thanks!"), turn("s2", 0, "thanks, perfect"), turn("s2", 1, "great, thanks")];
    Lake::open(&src).unwrap().write_rows(&rows, "test", 1).unwrap();
    let (url, calls) = fake_judge().await;

    // The original run: the judge stage's start-up probe, then 4 turns × m = 2 votes, all from the
    // endpoint.
    let r = run_stages(&pipeline("orig", &src, &url), &["signals".into(), "judge".into()], Stop::default()).await.unwrap();
    assert_eq!(r.stages["judge"].get("votes"), 8);
    assert_eq!(r.stages["judge"].get("votes_cached"), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 1 + 8);

    // Replay session s1 into a fresh lake and judge it again: every vote comes from the copied cache.
    let opts = ReplayOptions {
        source_lake: src.clone(),
        sql: "SELECT * FROM interactions WHERE session_id = 's1'".into(),
        table: "interactions".into(),
        target: ReplayTarget::Lake { dir: out.clone(), pipeline: pipeline("replay", &src, &url), stages: Some(vec!["signals".into(), "judge".into()]) },
    };
    let rep = replay(&opts, Stop::default()).await.unwrap();
    assert_eq!((rep.rows, rep.written, rep.published), (2, 2, 0));
    assert!(rep.vote_cache_files >= 1);
    assert_eq!(rep.votes_cached(), 4);
    assert_eq!(calls.load(Ordering::SeqCst), 1 + 8 + 1, "no vote was asked again (only the replay's judge stage probed)");
    let lake = Lake::open(&out).unwrap();
    let mut got = lake.read_table::<Interaction>().unwrap();
    got.sort_by_key(|i| i.turn_index);
    assert_eq!(got.iter().map(|i| i.interaction_id.clone()).collect::<Vec<_>>(), vec![rows[0].interaction_id.clone(), rows[1].interaction_id.clone()]);
    for (g, o) in got.iter().zip(&rows) {
        assert_eq!(g.notes, vec![format!("replay-of {} from {}", o.interaction_id, src.display())]);
        assert_eq!(g.request_messages, o.request_messages);
    }
    let judgments = lake.read_table::<Judgment>().unwrap();
    assert_eq!(judgments.len(), 2);
    assert!(judgments.iter().all(|j| j.pipeline == "replay" && j.cache_hits == 2 && j.score == 1));
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("_state/replay/manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["rows"], 2);
    assert_eq!(manifest["table"], "interactions");

    // Not a fresh lake any more.
    let e = replay(&opts, Stop::default()).await.unwrap_err().to_string();
    assert!(e.contains("not a fresh lake"), "{e}");
    // A topic target needs a real cluster.
    let bus = ReplayOptions { target: ReplayTarget::Bus { pipeline: pipeline("x", &src, &url) }, ..opts.clone() };
    let e = replay(&bus, Stop::default()).await.unwrap_err().to_string();
    assert!(e.contains("needs a real cluster"), "{e}");
    // Other tables replay as they are (ids kept, no stage by default).
    let j = ReplayOptions {
        sql: "SELECT * FROM judgments WHERE pipeline = 'orig'".into(),
        table: "judgments".into(),
        target: ReplayTarget::Lake { dir: dir.path().join("j"), pipeline: pipeline("j", &src, &url), stages: None },
        ..opts.clone()
    };
    let rj = replay(&j, Stop::default()).await.unwrap();
    assert_eq!((rj.rows, rj.written), (4, 4));
    assert!(rj.run.is_none());
    let copied = Lake::open(dir.path().join("j")).unwrap().read_table::<Judgment>().unwrap();
    let orig = Lake::open(&src).unwrap().read_table::<Judgment>().unwrap();
    let ids = |v: &[Judgment]| {
        let mut x: Vec<String> = v.iter().map(|j| j.judgment_id.clone()).collect();
        x.sort();
        x
    };
    assert_eq!(ids(&copied), ids(&orig));
    let bad = ReplayOptions { table: "checkpoints".into(), ..j };
    assert!(replay(&bad, Stop::default()).await.unwrap_err().to_string().contains("cannot replay table"));
}

// ---------------------------------------------------------------- the tiny ablation (needs the model)

/// `ablations/tiny.toml` with absolute paths (the test binary's working directory may differ).
fn tiny_config(dir: &Path, model: &Path) -> PathBuf {
    ablation_file(dir, model, "tiny.toml")
}

/// `ablations/<file>` with absolute paths, written to `dir/<file>`.
fn ablation_file(dir: &Path, model: &Path, file: &str) -> PathBuf {
    let root = common::root();
    let mut text = std::fs::read_to_string(root.join("ablations").join(file)).unwrap();
    text = text.replace("model = \"models/smollm2-135m-instruct\"", &format!("model = \"{}\"", model.display()));
    text = text.replace("base_pipeline = \"pipelines/demo.toml\"", &format!("base_pipeline = \"{}\"", root.join("pipelines/demo.toml").display()));
    text = text.replace("[student]\n", &format!("[student]\ngsm8k = \"{}\"\n", root.join("data/gsm8k_test.json").display()));
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap();
    path
}

fn ablate(config: &Path, out: &Path, arms: Option<&str>) {
    let mut args = vec!["ablate", "--config", config.to_str().unwrap(), "--out", out.to_str().unwrap()];
    if let Some(a) = arms {
        args.extend(["--arms", a]);
    }
    let (ok, stdout, stderr) = common::run_bin(&args);
    assert!(ok, "nextstate ablate failed:\n{stdout}\n{stderr}");
}

/// The rows of `table` that `keep` selects are identical in both results folders.
fn same_rows<T: serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(a: &Path, b: &Path, table: &str, keep: impl Fn(&T) -> bool) {
    let rows = |d: &Path| read_table::<T>(d, table).unwrap().into_iter().filter(|r| keep(r)).collect::<Vec<_>>();
    assert_eq!(rows(a), rows(b), "results table {table} differs between the two runs");
}

#[test]
fn tiny_ablation_is_deterministic_resumable_and_arms_differ_only_where_configured() {
    let Some(model) = model_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), &model);
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));

    // Run 1 as two invocations: two arms, then the rest (resume: finished work is not redone). Run 2 in
    // another folder, a separate process, one arm only: the same numbers (determinism).
    ablate(&config, &one, Some("binary,opd"));
    let marker = one.join("work/arms/binary/train.json");
    let before = std::fs::metadata(&marker).unwrap().modified().unwrap();
    let partial = read_table::<ArmRow>(&one.join("results"), "arms").unwrap();
    assert_eq!(partial.iter().map(|a| a.arm.as_str()).collect::<Vec<_>>(), vec!["binary", "opd"]);
    // An evaluation written before the token mass existed (its marker without `mass` and `mass_sets`)
    // gets the same rows on resume, without the rest of it being redone.
    let version_of = |p: &Path| -> i64 { p.file_stem().unwrap().to_str().unwrap().trim_start_matches('v').parse().unwrap() };
    let last_eval = std::fs::read_dir(one.join("work/arms/opd/eval")).unwrap().map(|e| e.unwrap().path()).max_by_key(|p| version_of(p)).unwrap();
    assert!(version_of(&last_eval) > 0);
    let mut saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&last_eval).unwrap()).unwrap();
    let mass_before = saved["eval"]["mass"].take();
    assert!(mass_before.as_array().is_some_and(|m| !m.is_empty()), "{}: no mass rows", last_eval.display());
    let sets_before = saved["eval"]["mass_sets"].take();
    assert_eq!(sets_before, serde_json::json!(["heldout", "trained", "teacher-top1", "teacher-topk-other", "teacher-answers"]), "{}", last_eval.display());
    saved["eval"].as_object_mut().unwrap().remove("mass");
    saved["eval"].as_object_mut().unwrap().remove("mass_sets");
    std::fs::write(&last_eval, serde_json::to_string(&saved).unwrap()).unwrap();
    ablate(&config, &one, None);
    assert_eq!(std::fs::metadata(&marker).unwrap().modified().unwrap(), before, "finished work is not redone");
    let refilled: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&last_eval).unwrap()).unwrap();
    assert_eq!(refilled["eval"]["mass"], mass_before, "token mass refilled on resume");
    assert_eq!(refilled["eval"]["mass_sets"], sets_before);
    assert_eq!(refilled["eval"]["responses"], saved["eval"]["responses"], "the rest of the evaluation kept");
    let both = ["control"];
    let jsonl = dir.path().join("two-steps.jsonl");
    let (ok, stdout, stderr) = common::run_bin(&["ablate", "--config", config.to_str().unwrap(), "--out", two.to_str().unwrap(), "--arms", "control", "--metrics-jsonl", jsonl.to_str().unwrap()]);
    assert!(ok, "nextstate ablate failed:\n{stdout}\n{stderr}");

    // Identical numbers (every table but the wall times) for the arms both runs trained.
    let (r1, r2) = (one.join("results"), two.join("results"));
    let mine = |arm: &str| both.contains(&arm);
    same_rows::<ArmRow>(&r1, &r2, "arms", |r| mine(&r.arm));
    same_rows::<CheckpointRow>(&r1, &r2, "checkpoint_metrics", |r| mine(&r.arm));
    same_rows::<PreferenceRow>(&r1, &r2, "preference_rates", |r| mine(&r.arm));
    same_rows::<HeldoutRow>(&r1, &r2, "heldout_losses", |r| mine(&r.arm));
    same_rows::<GapRow>(&r1, &r2, "teacher_gaps", |r| mine(&r.arm));
    same_rows::<MassRow>(&r1, &r2, "token_mass", |r| mine(&r.arm));
    same_rows::<StepRow>(&r1, &r2, "steps", |r| mine(&r.arm));
    // --metrics-jsonl: one line per training step of the arm, with its arm and seed, as the steps table.
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&jsonl).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<(i64, f64)> = read_table::<StepRow>(&r2, "steps").unwrap().into_iter().filter(|r| r.arm == "control").map(|r| (r.step, r.loss)).collect();
    assert_eq!(lines.iter().map(|l| (l["step"].as_i64().unwrap(), l["loss"].as_f64().unwrap())).collect::<Vec<_>>(), steps);
    assert!(lines.iter().all(|l| l["arm"] == "control" && l["seed"] == 42 && l["learning_rate"] == 1e-3), "{lines:?}");
    same_rows::<AdvantageRow>(&r1, &r2, "advantages", |r| mine(&r.arm));
    same_rows::<ResponseRow>(&r1, &r2, "responses", |r| mine(&r.arm));
    // Run 2 built only the data pipelines its arm needs: control's (combined's) and the first hinted one
    // (opd's: the held-out gap set); their stage counts are run 1's.
    let built2: BTreeSet<String> = read_table::<StageCountRow>(&r2, "stage_counts").unwrap().into_iter().map(|r| r.data_pipeline).collect();
    let arms2 = read_table::<ArmRow>(&r2, "arms").unwrap();
    assert_eq!(arms2.len(), 1);
    let pipeline_of = |arms: &[ArmRow], name: &str| arms.iter().find(|a| a.arm == name).map(|a| a.data_pipeline.clone()).unwrap();
    let all1 = read_table::<ArmRow>(&r1, "arms").unwrap();
    assert_eq!(built2, BTreeSet::from([pipeline_of(&arms2, "control"), pipeline_of(&all1, "opd")]));
    // The lake's signals are shared by its data pipelines: whichever ran first paired them (binary's in
    // run 1, opd's in run 2), so the signals stage is compared as a total.
    same_rows::<StageCountRow>(&r1, &r2, "stage_counts", |r| built2.contains(&r.data_pipeline) && r.stage != "signals");
    let signals = |d: &Path| -> i64 { read_table::<StageCountRow>(d, "stage_counts").unwrap().iter().filter(|r| r.stage == "signals" && r.outcome == "interactions").map(|r| r.count).sum() };
    assert_eq!((signals(&r1), signals(&r2)), (9, 9));
    // The accepted hint texts of the data pipelines both runs built are the same (the `arms` column
    // names only each run's own arms), and each source's shares add up to 1.
    let hint_texts = |d: &Path| -> Vec<(String, i64, String, i64, i64)> {
        let mut v: Vec<_> = read_table::<HintTextRow>(d, "hint_texts").unwrap().into_iter().filter(|r| built2.contains(&r.source)).map(|r| (r.source, r.rank, r.hint, r.count, r.words)).collect();
        v.sort();
        v
    };
    let h1 = hint_texts(&r1);
    assert!(h1.iter().any(|r| r.0 == pipeline_of(&all1, "opd")), "no accepted hint text for opd's pipeline: {h1:?}");
    assert_eq!(h1, hint_texts(&r2));
    let all_hints = read_table::<HintTextRow>(&r1, "hint_texts").unwrap();
    for src in all_hints.iter().map(|r| r.source.as_str()).collect::<BTreeSet<_>>() {
        let total: f64 = all_hints.iter().filter(|r| r.source == src).map(|r| r.share).sum();
        assert!((total - 1.0).abs() < 1e-9, "{src}: shares add up to {total}");
    }
    let ck = read_table::<CheckpointRow>(&r1, "checkpoint_metrics").unwrap();
    assert!(ck.iter().all(|c| c.score.is_finite() && c.heldout_loss.is_some_and(f64::is_finite)), "{ck:?}");
    // Token mass: every evaluated version of an arm scores the same tokens (v0's held-out answers: one
    // count per group at every version; the arm's trained tokens, each with its starting advantage sign),
    // and the trained set counts exactly the arm's trained tokens.
    let mass = read_table::<MassRow>(&r1, "token_mass").unwrap();
    let adv1 = read_table::<AdvantageRow>(&r1, "advantages").unwrap();
    let groups = |arm: &str, v: i64| -> Vec<(String, String, String, String, String, i64)> {
        mass.iter().filter(|r| r.arm == arm && r.version == v && !r.set.starts_with("by-teacher")).map(|r| (r.set.clone(), r.class.clone(), r.band.clone(), r.sign.clone(), r.teacher_sign.clone(), r.tokens)).collect()
    };
    // (the `by-teacher-*` sets are the teacher's own log-probs, at v0 only)
    let sum = |arm: &str, v: i64| -> f64 { mass.iter().filter(|r| r.arm == arm && r.version == v && !r.set.starts_with("by-teacher")).map(|r| r.logprob_sum).sum() };
    let signs = |arm: &str, f: fn(&MassRow) -> &str| -> BTreeSet<String> { mass.iter().filter(|r| r.arm == arm && r.set == "trained").map(|r| f(r).to_string()).collect() };
    for c in ck.iter().filter(|c| c.version > 0) {
        assert_eq!(groups(&c.arm, c.version), groups(&c.arm, 0), "{} v{}: other tokens than v0's", c.arm, c.version);
        assert_ne!(sum(&c.arm, c.version), sum(&c.arm, 0), "{} v{}: training moved no log-prob", c.arm, c.version);
    }
    for a in ck.iter().map(|c| c.arm.as_str()).collect::<BTreeSet<_>>() {
        let of = |set: &str| mass.iter().filter(|r| r.arm == a && r.version == 0 && r.set == set).collect::<Vec<_>>();
        assert!(!of("heldout").is_empty() && of("heldout").iter().all(|r| r.sign.is_empty() && r.teacher_sign.is_empty() && r.logprob_sum.is_finite() && r.logprob_sum <= 0.0), "{a}");
        let trained: i64 = of("trained").iter().map(|r| r.tokens).sum();
        assert!(trained > 0, "{a}: no trained tokens");
        assert_eq!(trained, adv1.iter().filter(|x| x.arm == a).map(|x| x.tokens).sum::<i64>(), "{a}: trained tokens");
    }
    // By hand from the methods: top-K OPD carries the teacher outside the advantage (every token 0) but
    // has the teacher's direction; binary has no teacher log-probs; the random-sign control pushes both
    // ways; OPD's advantage at the start is teacher − rollout, so its two signs agree.
    assert_eq!(signs("opd-topk", |r| &r.sign), BTreeSet::from(["0".to_string()]));
    assert!(signs("opd-topk", |r| &r.teacher_sign).contains("-"));
    assert_eq!(signs("binary", |r| &r.teacher_sign), BTreeSet::from([String::new()]));
    assert!(signs("control", |r| &r.sign).is_superset(&BTreeSet::from(["+".to_string(), "-".to_string()])));
    assert!(mass.iter().filter(|r| r.arm == "opd" && r.set == "trained").all(|r| r.sign == r.teacher_sign), "opd: advantage sign = teacher direction");
    // The teacher's own choices at the trained positions: scored at every version for the arms trained
    // on teacher log-probs (the same positions at each), by the teacher itself at v0 only; its top token
    // is at least as likely to it as the sampled one at every position, so in every group; a log of a
    // probability mass is at most 0.
    for a in ["opd", "opd-topk"] {
        let n = |set: &str, v: i64| -> i64 { mass.iter().filter(|r| r.arm == a && r.version == v && r.set == set).map(|r| r.tokens).sum() };
        let (all, trained) = (n("by-teacher-sampled", 0), n("trained", 0));
        assert!(all > 0 && all <= trained && all == n("by-teacher-top1", 0) && all == n("teacher-topk-other", 0), "{a}: {all} teacher positions, {trained} trained");
        assert!(n("teacher-top1", 0) > 0 && n("teacher-top1", 0) < all, "{a}: the teacher's top token differs from the sampled one at some positions, not all");
        for c in ck.iter().filter(|c| c.arm == a && c.version > 0) {
            assert_eq!((n("teacher-top1", c.version), n("teacher-topk-other", c.version), n("by-teacher-sampled", c.version)), (n("teacher-top1", 0), all, 0), "{a} v{}", c.version);
        }
        let by = |set: &str| -> BTreeMap<(String, String, String, String), (i64, f64)> {
            mass.iter().filter(|r| r.arm == a && r.set == set).map(|r| ((r.class.clone(), r.band.clone(), r.sign.clone(), r.teacher_sign.clone()), (r.tokens, r.logprob_sum))).collect()
        };
        let (sampled, top1) = (by("by-teacher-sampled"), by("by-teacher-top1"));
        let band_sum = |m: &BTreeMap<(String, String, String, String), (i64, f64)>, band: &str| -> f64 { m.iter().filter(|(k, _)| k.1 == band).map(|(_, v)| v.1).sum() };
        for band in ["first", "middle", "last"] {
            assert!(band_sum(&top1, band) >= band_sum(&sampled, band) - 1e-3, "{a} {band}: the teacher's top token below the sampled one");
        }
        assert!(mass.iter().filter(|r| r.arm == a && r.set == "teacher-topk-other").all(|r| r.logprob_sum.is_finite() && r.logprob_sum <= 0.0), "{a}");
    }
    // The instruction-hint teacher's greedy answers to the hinted held-out problems: scored by every
    // version of an arm trained on a teacher (the same tokens at each), and by the teacher itself at v0
    // (its own answers, and v0's answers to the same problems).
    for a in ["opd", "opd-topk"] {
        let n = |set: &str, v: i64| -> i64 { mass.iter().filter(|r| r.arm == a && r.version == v && r.set == set).map(|r| r.tokens).sum() };
        let answers = n("teacher-answers", 0);
        assert!(answers > 0 && n("by-teacher-answers", 0) == answers && n("by-teacher-v0-answers", 0) > 0, "{a}: {answers} teacher-answer tokens");
        for c in ck.iter().filter(|c| c.arm == a && c.version > 0) {
            assert_eq!((n("teacher-answers", c.version), n("by-teacher-answers", c.version)), (answers, 0), "{a} v{}", c.version);
        }
    }
    assert!(!mass.iter().any(|r| r.arm == "binary" && r.set != "heldout" && r.set != "trained"), "binary: no teacher");
    // The sets every arm shares are scored once at v0 and copied: the same rows in every arm.
    let shared = |arm: &str, sets: &[&str]| -> Vec<(String, String, String, i64, f64)> {
        mass.iter().filter(|r| r.arm == arm && r.version == 0 && sets.contains(&r.set.as_str())).map(|r| (r.set.clone(), r.class.clone(), r.band.clone(), r.tokens, r.logprob_sum)).collect()
    };
    for a in ck.iter().map(|c| c.arm.as_str()).collect::<BTreeSet<_>>() {
        assert_eq!(shared(a, &["heldout"]), shared("binary", &["heldout"]), "{a}: v0's held-out rows");
    }
    let teacher_sets = ["teacher-answers", "by-teacher-answers", "by-teacher-v0-answers"];
    assert_eq!(shared("opd-topk", &teacher_sets), shared("opd", &teacher_sets));
    // ... and copied, not scored again: in a copy of run 1, a changed row of the base evaluation's
    // `v0_mass` shows up in an arm's v0 evaluation made after it (the copy's only v0 evaluation redone).
    let three = dir.path().join("three");
    assert!(std::process::Command::new("cp").args(["-r", one.to_str().unwrap(), three.to_str().unwrap()]).status().unwrap().success());
    let base_path = three.join("work/state/base-eval.json");
    let mut base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&base_path).unwrap()).unwrap();
    let rows = base["v0_mass"].as_array_mut().unwrap();
    let k = rows.iter().position(|r| r["set"] == "teacher-answers").unwrap();
    let tampered = rows[k]["logprob_sum"].as_f64().unwrap() - 1.0;
    rows[k]["logprob_sum"] = serde_json::json!(tampered);
    let (class, band) = (rows[k]["class"].clone(), rows[k]["band"].clone());
    std::fs::write(&base_path, serde_json::to_string(&base).unwrap()).unwrap();
    let v0_path = three.join("work/arms/opd-topk/eval/v0.json");
    let before: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&v0_path).unwrap()).unwrap();
    std::fs::remove_file(&v0_path).unwrap();
    ablate(&config, &three, Some("opd-topk"));
    let after: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&v0_path).unwrap()).unwrap();
    let copied = after["eval"]["mass"].as_array().unwrap().iter().find(|r| r["set"] == "teacher-answers" && r["class"] == class && r["band"] == band).unwrap().clone();
    assert_eq!(copied["logprob_sum"].as_f64(), Some(tampered), "v0's teacher-answer row copied from the base evaluation");
    assert_eq!(copied["arm"], "opd-topk");
    assert_eq!(after["eval"]["mass_sets"], before["eval"]["mass_sets"]);
    let other_rows = |v: &serde_json::Value| -> Vec<serde_json::Value> { v["eval"]["mass"].as_array().unwrap().iter().filter(|r| r["set"] != "teacher-answers").cloned().collect() };
    assert_eq!(other_rows(&after), other_rows(&before), "every other v0 row as before");
    let report1 = std::fs::read_to_string(one.join("report.md")).unwrap();
    assert!(report1.contains("## Where the probability mass moved") && report1.contains("On the teacher's own choices"));

    // The arms differ exactly where the file says.
    let cfg = AblationConfig::load(&config).unwrap();
    let resolved = cfg.resolve(&one.join("work/lake")).unwrap();
    let by: HashMap<&str, _> = resolved.iter().map(|a| (a.name.as_str(), a)).collect();
    let diff = |a: &str, b: &str| config_diff(&by[a].pipeline, &by[b].pipeline);
    assert_eq!(diff("binary", "opd"), vec!["method"]);
    assert_eq!(diff("binary", "combined"), vec!["method"]);
    assert_eq!(diff("opd", "opd-topk"), vec!["teacher.top_k", "trainer.opd_loss"]);
    assert_eq!(diff("combined", "control"), vec!["trainer.advantage_sign"]);
    let arms = read_table::<ArmRow>(&r1, "arms").unwrap();
    assert_eq!(arms.len(), 6);
    assert!(arms.iter().all(|a| a.group == a.arm), "one seed: every arm is its own group");
    let row: HashMap<&str, &ArmRow> = arms.iter().map(|a| (a.arm.as_str(), a)).collect();
    for a in &arms {
        assert_eq!((a.seed, a.batch_size, a.lr, a.lora), (42, 2, 1e-3, true), "{}", a.arm);
        assert_eq!(a.initial_weights, model.display().to_string());
        assert_eq!(a.config_hash, by[a.arm.as_str()].config_hash);
        assert!(!a.sample_ids.is_empty() && a.sample_ids.len() <= 4, "{}: {} samples", a.arm, a.sample_ids.len());
    }
    // A trainer-only difference (the random-sign control) trains on the very same samples, in the same
    // order, with the same advantage magnitudes and each sample's own fixed sign.
    assert_eq!(row["combined"].data_pipeline, row["control"].data_pipeline);
    assert_eq!(row["combined"].sample_ids, row["control"].sample_ids);
    assert_ne!(row["combined"].config_hash, row["control"].config_hash);
    let adv = read_table::<AdvantageRow>(&r1, "advantages").unwrap();
    let of = |arm: &str| adv.iter().filter(|r| r.arm == arm).map(|r| (r.sample_id.clone(), r.advantage)).collect::<Vec<_>>();
    let control_cfg = &by["control"].pipeline.trainer;
    let flipped: Vec<(String, f64)> = of("combined")
        .into_iter()
        .map(|(id, a)| {
            let s = f64::from(control_cfg.advantage_sign_of(&id));
            (id, s * a)
        })
        .collect();
    assert_eq!(of("control"), flipped);
    assert!(!flipped.is_empty());
    assert_ne!(row["opd"].data_pipeline, row["opd-topk"].data_pipeline);
    assert_eq!(row["opd"].interaction_ids, row["opd-topk"].interaction_ids, "same hints, same turns");
    assert!(row["binary"].sample_types.iter().all(|t| t == "binary"));
    assert!(row["opd"].sample_types.iter().all(|t| t == "opd"));
    // Context distillation: one binary sample with reward +1 per hinted turn of opd's pipeline (the
    // same hint), the teacher's own answer after the original prompt.
    assert!(!row["cd"].sample_ids.is_empty() && row["cd"].sample_types.iter().all(|t| t == "binary"), "{:?}", row["cd"]);
    let lake_samples = Lake::open(one.join("work/lake")).unwrap().read_table::<nextstate::schema::Sample>().unwrap();
    let of_pipeline = |p: &str| lake_samples.iter().filter(|s| s.pipeline == p).collect::<Vec<_>>();
    let (cd, opd) = (of_pipeline(&row["cd"].data_pipeline), of_pipeline(&row["opd"].data_pipeline));
    assert!(!cd.is_empty() && cd.len() <= opd.len());
    let mut differs = 0;
    for c in &cd {
        let o = opd.iter().find(|o| o.interaction_id == c.interaction_id).expect("a cd sample comes from a hinted opd sample");
        assert_eq!((c.reward, &c.prompt_token_ids, &c.hint_id, c.teacher_logprobs.is_none()), (1.0, &o.prompt_token_ids, &o.hint_id, true));
        assert_eq!((c.response_token_ids.len(), c.rollout_logprobs.len(), c.loss_mask.len()), (c.response_token_ids.len(), c.response_token_ids.len(), c.response_token_ids.len()));
        differs += usize::from(c.response_token_ids != o.response_token_ids);
    }
    assert!(differs > 0, "the teacher's answers are not the student's");
    // Every arm's samples follow the one interaction order (event time), none from the held-out session.
    let lake = Lake::open(one.join("work/lake")).unwrap();
    let mut inter = lake.read_table::<Interaction>().unwrap();
    inter.sort_by(|a, b| (a.event_time, &a.session_id, a.turn_index).cmp(&(b.event_time, &b.session_id, b.turn_index)));
    let mut first: BTreeMap<&str, i64> = BTreeMap::new();
    for i in &inter {
        let e = first.entry(i.session_id.as_str()).or_insert(i.event_time);
        *e = (*e).min(i.event_time);
    }
    let last_session = first.iter().max_by_key(|(s, t)| (**t, s.to_string())).map(|(s, _)| s.to_string()).unwrap();
    let held: Vec<&str> = inter.iter().filter(|i| i.session_id == last_session).map(|i| i.interaction_id.as_str()).collect();
    let pos: HashMap<&str, usize> = inter.iter().enumerate().map(|(k, i)| (i.interaction_id.as_str(), k)).collect();
    for a in &arms {
        let p: Vec<usize> = a.interaction_ids.iter().map(|i| pos[i.as_str()]).collect();
        assert!(p.windows(2).all(|w| w[0] <= w[1]), "{} trains out of order: {p:?}", a.arm);
        assert!(a.interaction_ids.iter().all(|i| !held.contains(&i.as_str())), "{} trains on a held-out session", a.arm);
        // The checkpoints' lineage is that order.
        let run = one.join("work/arms").join(&a.arm).join("checkpoints").join(&a.arm);
        let trained: Vec<String> = nextstate::trainer::scan(&run).unwrap().complete.into_iter().flat_map(|(_, m)| m.lineage).map(|l| l.sample_id).collect();
        assert_eq!(trained, a.sample_ids, "{}", a.arm);
    }
    // v0 and the last version of every arm were evaluated (`[eval] versions = "last"`); v0 is shared.
    let v0: Vec<f64> = ck.iter().filter(|c| c.version == 0).map(|c| c.score).collect();
    assert_eq!(v0.len(), 6);
    assert!(v0.windows(2).all(|w| w[0] == w[1]));
    let mut versions: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for c in &ck {
        versions.entry(c.arm.as_str()).or_default().push(c.version);
    }
    for (arm, v) in versions {
        assert_eq!(v, EvalVersions::Last.select(&(0..=row[arm].steps).collect::<Vec<_>>()), "{arm}");
    }
    // The second hinted data pipeline took its teacher rows from the cache (same hints as opd's).
    let counts = read_table::<StageCountRow>(&r1, "stage_counts").unwrap();
    let hits: i64 = counts.iter().filter(|c| c.data_pipeline == row["combined"].data_pipeline && c.outcome == "teacher_cache_hit").map(|c| c.count).sum();
    assert!(hits > 0, "{counts:?}");
    // The report and plots.
    let md = std::fs::read_to_string(one.join("report.md")).unwrap();
    for a in &arms {
        assert!(md.contains(&format!("### {}", a.arm)), "report lacks arm {}", a.arm);
    }
    assert!(md.contains("## Arms over seeds") && md.contains("The paper's ordering: "), "{md}");
    // The hint-conditioned teacher opens the report: v0 and one row per hint strategy, each of the 2
    // problems hinted by the oracle.
    let teacher = md.find("## The teacher, the bound").expect("teacher section");
    assert!(teacher < md.find("## Setup").unwrap(), "the teacher section comes first");
    for row in ["| v0 (no hint) | – |", "| teacher, verbatim hints |", "| teacher, instruction hints |", "| teacher, oracle hints | 2 of 2 |"] {
        assert!(md.contains(row), "{row} missing:\n{md}");
    }
    assert!(md.contains("| A | B | seeds | problems | A − B | 95 % CI | p | Holm p | only A / only B met all |"), "{md}");
    assert!(md.contains("## Hint texts") && md.contains("| source | rank | count | share | words | hint |"), "{md}");
    // The baselines without training: `prompted` always, compared with every arm group.
    assert!(md.contains("### Against the baselines without training") && md.contains("- `prompted`: personalization score"), "{md}");
    let vb = read_table::<nextstate::ablate::compare::PairRow>(&r1, "arm_vs_baselines").unwrap();
    assert_eq!(vb.iter().filter(|p| p.b == "prompted").count(), 6, "{vb:?}");
    let groups = read_table::<nextstate::ablate::compare::GroupRow>(&r1, "arm_summary").unwrap();
    assert_eq!(groups.iter().map(|g| g.group.as_str()).collect::<Vec<_>>(), vec!["binary", "opd", "combined", "opd-topk", "control", "cd"]);
    for g in &groups {
        assert_eq!((g.seeds.clone(), g.low, g.responses), (vec![42], None, 2), "{g:?}");
        assert_eq!(g.mean, ck.iter().filter(|c| c.arm == g.group).max_by_key(|c| c.version).unwrap().score);
    }
    let pairs = read_table::<nextstate::ablate::compare::PairRow>(&r1, "arm_comparisons").unwrap();
    assert_eq!(pairs.len(), 15, "every pair of the 6 arms");
    assert!(pairs.iter().all(|p| p.problems == 2 && (0.0..=1.0).contains(&p.p_value)));
    for f in ["score_vs_interactions.png", "score_by_arm.png", "train_loss.png", "advantages_binary.png"] {
        assert!(one.join(f).is_file(), "{f} missing");
    }
    assert_eq!(std::fs::read_to_string(one.join(".gitignore")).unwrap().lines().last(), Some("work/"));
}

/// Replicates that replicate (issue 37): `ablations/tiny.toml` with two seeds and two arms. Each
/// replicate collects its own sessions (ids `r<seed>-…`; the same held-out problem, last), trains its
/// sessions in an order shuffled by its seed, and both arms of a replicate train on that replicate's
/// interactions in that order; the replicates' first steps differ (with the data shared and only LoRA A
/// seeded, step-1 losses were identical across seeds); the gap set holds both replicates' held-out
/// samples.
#[test]
fn tiny_replicates_differ_in_data_order_and_initialisation() {
    let Some(model) = model_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config(dir.path(), &model);
    let text = std::fs::read_to_string(&config).unwrap().replace("seed = 42\n", "seed = 42\nseeds = [1, 2]\n");
    std::fs::write(&config, text).unwrap();
    let out = dir.path().join("out");
    ablate(&config, &out, Some("binary,combined"));
    let r = out.join("results");
    let arms: HashMap<String, ArmRow> = read_table::<ArmRow>(&r, "arms").unwrap().into_iter().map(|a| (a.arm.clone(), a)).collect();
    assert_eq!(arms.keys().cloned().collect::<BTreeSet<_>>(), BTreeSet::from(["binary.seed=1", "binary.seed=2", "combined.seed=1", "combined.seed=2"].map(String::from)));
    let lake = Lake::open(out.join("work/lake")).unwrap();
    let inter = lake.read_table::<Interaction>().unwrap();
    let session: HashMap<&str, &str> = inter.iter().map(|i| (i.interaction_id.as_str(), i.session_id.as_str())).collect();
    // Own data: 6 sessions per replicate, the held-out problem the same in both.
    for seed in [1, 2] {
        let prefix = format!("r{seed}-");
        let mine: BTreeSet<&str> = inter.iter().filter(|i| i.session_id.starts_with(&prefix)).map(|i| i.session_id.as_str()).collect();
        assert_eq!(mine.len(), 6, "{mine:?}");
    }
    assert_eq!(inter.iter().filter(|i| !i.session_id.starts_with("r1-") && !i.session_id.starts_with("r2-")).count(), 0);
    let problem = |s: &str| s.rsplit('-').next().unwrap().to_string();
    let held = |seed: u64| {
        let mut first: BTreeMap<&str, i64> = BTreeMap::new();
        for i in inter.iter().filter(|i| i.session_id.starts_with(&format!("r{seed}-"))) {
            let e = first.entry(i.session_id.as_str()).or_insert(i.event_time);
            *e = (*e).min(i.event_time);
        }
        first.into_iter().max_by_key(|(s, t)| (*t, s.to_string())).unwrap().0.to_string()
    };
    assert_eq!(problem(&held(1)), problem(&held(2)), "the same held-out problem");
    let training_problems = |seed: u64| -> BTreeSet<String> {
        inter.iter().filter(|i| i.session_id.starts_with(&format!("r{seed}-")) && i.session_id != held(seed)).map(|i| problem(&i.session_id)).collect()
    };
    assert_ne!(training_problems(1), training_problems(2), "each replicate draws its own training problems");
    for (name, a) in &arms {
        let seed = a.seed as u64;
        assert!(a.interaction_ids.iter().all(|i| session[i.as_str()].starts_with(&format!("r{seed}-")) && session[i.as_str()] != held(seed)), "{name} trains on its replicate's training sessions only");
    }
    // Both arms of a replicate follow one order: binary's turns (score ±1 only) are a subsequence of
    // combined's (every judged or hinted turn), and the order is not the logged one.
    for seed in [1, 2] {
        let (b, c) = (&arms[&format!("binary.seed={seed}")], &arms[&format!("combined.seed={seed}")]);
        let pos: HashMap<&str, usize> = c.interaction_ids.iter().enumerate().map(|(k, i)| (i.as_str(), k)).collect();
        let p: Vec<usize> = b.interaction_ids.iter().filter_map(|i| pos.get(i.as_str()).copied()).collect();
        assert_eq!(p.len(), b.interaction_ids.len(), "seed {seed}: every turn binary trains on, combined trains on too");
        assert!(p.windows(2).all(|w| w[0] <= w[1]), "seed {seed}: binary's order is combined's: {p:?}");
        // The replicate's stream: its training turns in its seeded session order (not the logged one);
        // combined trains on its first samples in that order.
        let streams = nextstate::ablate::run::Replicates::new(&inter, 1, &[1, 2], true);
        let order = &streams.of(seed).order;
        let time: HashMap<&str, i64> = inter.iter().map(|i| (i.interaction_id.as_str(), i.event_time)).collect();
        let times: Vec<i64> = order.iter().map(|i| time[i.as_str()]).collect();
        assert!(times.windows(2).any(|w| w[0] > w[1]), "seed {seed}: the order is the seed's, not the logged one: {times:?}");
        let at: HashMap<&str, usize> = order.iter().enumerate().map(|(k, i)| (i.as_str(), k)).collect();
        let q: Vec<usize> = c.interaction_ids.iter().map(|i| at[i.as_str()]).collect();
        assert!(q.windows(2).all(|w| w[0] <= w[1]), "seed {seed}: combined trains in its replicate's order: {q:?}");
    }
    // The first optimizer step differs between the replicates (other samples, other LoRA A).
    let steps = read_table::<StepRow>(&r, "steps").unwrap();
    let first = |arm: &str| steps.iter().find(|s| s.arm == arm && s.step == 1).map(|s| s.loss).unwrap();
    assert_ne!(first("combined.seed=1"), first("combined.seed=2"));
    // The gap set: the hinted held-out samples of both replicates, the same set for every arm.
    let gaps = read_table::<GapRow>(&r, "teacher_gaps").unwrap();
    let sample_session: HashMap<String, String> = lake.read_table::<nextstate::schema::Sample>().unwrap().into_iter().map(|s| (s.sample_id, s.session_id)).collect();
    let gap_sessions: BTreeSet<&String> = gaps.iter().map(|g| &sample_session[&g.sample_id]).collect();
    assert!(gap_sessions.iter().all(|s| **s == held(1) || **s == held(2)), "{gap_sessions:?}");
    // exactly the held-out samples with an accepted hint of both replicates (combined's hints are the
    // gap source opd's: the same hint stage)
    let want: BTreeSet<String> = lake
        .read_table::<nextstate::schema::Sample>()
        .unwrap()
        .into_iter()
        .filter(|s| s.pipeline == arms["combined.seed=1"].data_pipeline && s.sample_type.has_hint() && s.teacher_logprobs.is_some() && (s.session_id == held(1) || s.session_id == held(2)))
        .map(|s| s.sample_id)
        .collect();
    for arm in arms.keys() {
        let versions: BTreeSet<i64> = gaps.iter().filter(|g| &g.arm == arm).map(|g| g.version).collect();
        for v in versions {
            let got: BTreeSet<String> = gaps.iter().filter(|g| &g.arm == arm && g.version == v).map(|g| g.sample_id.clone()).collect();
            assert_eq!(got, want, "{arm} v{v}");
        }
    }
    assert!(gaps.is_empty() == want.is_empty(), "gap rows exist when the held-out sessions have hinted samples");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("its own collected sessions") && md.contains("- **Split** (replicate 1: ") && md.contains("- **Split** (replicate 2: "), "{md}");
}

/// A fault found running the student ablation: SIGTERM during the collection phase did nothing until
/// all collections had finished (minutes). The collection checks the stop flag before each turn's
/// generation and gives nothing back when stopped; a requested stop ends it before any generation.
#[test]
fn a_collection_stops_when_asked_and_returns_nothing() {
    let Some(model) = model_dir() else { return };
    use nextstate::ablate::collect::{collect, CollectTarget};
    use nextstate::ablate::config::CollectSettings;
    let lm = nextstate::model::LanguageModel::load(&model, &nextstate::model::LoadOptions::default()).unwrap();
    let problems = nextstate::demo::load_gsm8k(&common::root().join("data/gsm8k_test.json")).unwrap();
    let student = nextstate::demo::Student::new(7, nextstate::demo::Preferences::default(), 1).unwrap();
    let cfg = CollectSettings { sessions: 2, batch: 2, max_tokens: 8, temperature: 0.6 };
    let stop = Stop::default();
    stop.request();
    let e = collect(&lm, &problems[..2], &student, &cfg, 7, &CollectTarget::default(), &stop).unwrap_err();
    assert!(matches!(e, nextstate::Error::Cancelled), "{e:?}");
    // Not stopped: the two sessions are collected.
    let (rows, report) = collect(&lm, &problems[..2], &student, &cfg, 7, &CollectTarget::default(), &Stop::default()).unwrap();
    assert_eq!((rows.len(), report.sessions), (2, 2));
}

// ---------------------------------------------------------------- the tiny online ablation (needs the model)

#[test]
fn tiny_online_ablation_runs_each_replicate_live_and_resumes_without_redoing_one() {
    let Some(model) = model_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = ablation_file(dir.path(), &model, "tiny-online.toml");
    let out = dir.path().join("out");

    // One arm's replicates first, then the rest: the finished ones are not run again.
    ablate(&config, &out, Some("binary"));
    let marker = out.join("work/online/binary.seed=1/run.json");
    let before = std::fs::read_to_string(&marker).unwrap();
    let modified = std::fs::metadata(&marker).unwrap().modified().unwrap();
    ablate(&config, &out, None);
    assert_eq!(std::fs::metadata(&marker).unwrap().modified().unwrap(), modified, "a finished replicate is not run again");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), before);

    let results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("results/online.json")).unwrap()).unwrap();
    let runs = results["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["binary.seed=1", "binary.seed=2", "combined.seed=1", "combined.seed=2", "prompted.seed=1", "prompted.seed=2", "memory.seed=1", "memory.seed=2"]);
    let mut v0 = vec![];
    let (trained, baselines) = runs.split_at(4);
    for r in baselines {
        // A baseline never trains, serves every session with v0 and runs `max_interactions` turns.
        assert_eq!(r["train_steps"], 0, "{r}");
        assert_eq!(r["versions_seen"], serde_json::json!([0]), "{r}");
        assert!(r["interactions"].as_u64().unwrap() >= 24, "{r}");
        let lake = nextstate::lake::Lake::open(out.join("work/online").join(r["arm"].as_str().unwrap()).join("demo/lake")).unwrap();
        let mut turns: Vec<nextstate::schema::Interaction> = lake.read_table().unwrap();
        turns.sort_by_key(|t| t.event_time);
        let systems: Vec<Option<String>> = turns
            .iter()
            .filter(|t| t.turn_type == nextstate::schema::TurnType::Main)
            .map(|t| {
                let m: Vec<serde_json::Value> = serde_json::from_str(&t.request_messages).unwrap();
                (m[0]["role"] == "system").then(|| m[0]["content"].as_str().unwrap().to_string())
            })
            .collect();
        assert!(!systems.is_empty());
        let versions: Vec<i64> = r["checkpoints"].as_array().unwrap().iter().map(|c| c["version"].as_i64().unwrap()).collect();
        if r["baseline"] == "prompted" {
            // Every session starts with the preferences; the end evaluation uses them too.
            let prompt = "The user has these preferences for every answer: ";
            assert!(systems.iter().all(|s| s.as_deref().is_some_and(|s| s.starts_with(prompt))), "{systems:?}");
            assert!(r["system_prompt"].as_str().unwrap().starts_with(prompt), "{r}");
            assert_eq!(versions, [0, 1], "v0, then v0 with the system prompt at the end of the run");
        } else {
            assert_eq!(r["baseline"], "memory");
            // The memory starts empty: the first sessions have no system prompt, and any they have is a
            // list of accepted hints.
            assert_eq!(systems[0], None, "{systems:?}");
            assert!(systems.iter().flatten().all(|s| s.starts_with("Notes from earlier conversations with this user:\n- ")), "{systems:?}");
            if r["accepted_hints"].as_u64().unwrap() > 0 {
                assert!(r["system_prompt"].as_str().unwrap().starts_with("Notes from earlier conversations with this user:\n- "), "{r}");
                assert_eq!(versions, [0, 1]);
            } else {
                assert_eq!(versions, [0]);
            }
        }
        assert_eq!(r["responses"].as_array().unwrap().len(), 2 * versions.len());
        v0.push(r["responses"].as_array().unwrap().iter().filter(|x| x["version"] == 0).map(|x| (x["problem_id"].as_i64().unwrap(), x["response_text"].as_str().unwrap().to_string())).collect());
    }
    for r in trained {
        let sessions = r["sessions"].as_array().unwrap();
        assert!(!sessions.is_empty(), "{r}");
        assert_eq!(r["summary"]["sessions"].as_u64().unwrap() as usize, sessions.len());
        assert_eq!(r["failed_requests"], 0, "{r}");
        assert!(r["interactions"].as_u64().unwrap() >= 4);
        // `[eval] versions = "last"`: v0, then the last checkpoint the server loaded; two answers each.
        let versions: Vec<i64> = r["checkpoints"].as_array().unwrap().iter().map(|c| c["version"].as_i64().unwrap()).collect();
        assert!(versions.len() == 2 && versions[0] == 0 && versions[1] >= 1, "{versions:?}");
        assert_eq!(r["responses"].as_array().unwrap().len(), 2 * versions.len());
        let v0_answers: Vec<(i64, String)> = r["responses"].as_array().unwrap().iter().filter(|x| x["version"] == 0).map(|x| (x["problem_id"].as_i64().unwrap(), x["response_text"].as_str().unwrap().to_string())).collect();
        v0.push(v0_answers);
    }
    // Every replicate is evaluated on the same held-out problems, and v0 answers them the same way: the
    // first replicate's answers, kept for the others.
    assert!(v0.windows(2).all(|w| w[0] == w[1]), "{v0:?}");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("work/online/v0-answers.json")).unwrap()).unwrap();
    let mut kept: Vec<(i64, String)> = kept["answers"].as_array().unwrap().iter().map(|a| (a["problem"]["id"].as_i64().unwrap(), a["text"].as_str().unwrap().to_string())).collect();
    kept.sort();
    assert_eq!(kept, v0[0]);
    // Replicates differ in their student seed: their first sessions are on different problems.
    let problems = |i: usize| runs[i]["sessions"].as_array().unwrap().iter().map(|s| s["problem_id"].as_u64().unwrap()).collect::<std::collections::BTreeSet<_>>();
    assert_ne!(problems(0), problems(1), "the two replicates' training problems come in different orders");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("# Online ablation `tiny-online`"), "{md}");
    assert!(md.contains("| binary | binary | 2 |") && md.contains("| combined | combined | 2 |"), "{md}");
    assert!(md.contains("**Sessions until stable**") && md.contains("## Between arms") && md.contains("| binary | combined | 2 |"), "{md}");
    assert!(md.contains("peak RSS ") && !md.contains("peak RSS not measured"), "{md}");
    assert!(md.contains("Sessions until stable without any learning"), "{md}");
    assert!(md.contains("| prompted | prompted | 2 |") && md.contains("## Does training beat the baselines without training?") && md.contains("| end: v0 with its system prompt |"), "{md}");
    // The teacher's own score per hint strategy opens the report; each preference's rate per arm follows.
    assert!(md.contains("## Hint texts"), "{md}");
    assert!(md.contains("## The teacher, the bound") && md.contains("| teacher, oracle hints | 2 of 2 |") && md.contains("## Which preferences moved"), "{md}");
    assert!(out.join("work/online/teacher.json").is_file());
}
