//! `nextstate export`: a lake with hand-made samples of every type (binary, opd, combined-*; token ids,
//! teacher log-probs and top-K) and their turns and hints, exported in each format through the library
//! and the binary, then loaded with Hugging Face `datasets` (tests/python/export_check.py) the way a
//! trainer would: columns, feature types, row counts and the first record field by field.
use crate::common;

use std::path::{Path, PathBuf};

use nextstate::export::{export, ExportFormat, ExportOptions};
use nextstate::lake::Lake;
use nextstate::schema::{HintRecord, Interaction, Sample, SampleType, Table};
use serde_json::{json, Value};

/// 2026-01-01T00:00:00Z, ms.
const T0: i64 = 1_767_225_600_000;

fn request(session: &str) -> String {
    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": format!("Question of {session}")}]).to_string()
}

fn turn(session: &str) -> Interaction {
    Interaction {
        prompt_token_ids: Some(vec![1, 2, 3]),
        response_token_ids: Some(vec![10, 11, 12]),
        rollout_logprobs: Some(vec![-0.5, -0.25, -1.0]),
        policy_version: Some(3),
        ..Interaction::new(session, 0, &request(session), &format!("Answer of {session}"), T0)
    }
}

fn hint(n: usize, it: &Interaction) -> HintRecord {
    let ctx = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": format!("Question of {}\n\n[user's hint] Use fewer words.", it.session_id)}]);
    HintRecord {
        schema_version: HintRecord::SCHEMA_VERSION,
        hint_id: format!("h{n}"),
        pipeline: "combined".into(),
        interaction_id: it.interaction_id.clone(),
        session_id: it.session_id.clone(),
        tenant: None,
        turn_index: 0,
        candidates: vec![],
        strategy: "longest".into(),
        chosen_hint: Some("Use fewer words.".into()),
        chosen_index: Some(0),
        reason: "longest accepted".into(),
        hint_backend: "rules".into(),
        hint_model: "rules-v1".into(),
        template_id: "t".into(),
        template_hash: "h".into(),
        teacher_messages: Some(ctx.to_string()),
        teacher_prompt_text: None,
        cache_hits: 0,
        event_time: T0,
        processed_time: T0,
    }
}

/// Sample `s<n>` of `ty` over `it` (prompt [1, 2, 3], response [10, 11, 12], rollout [-0.5, -0.25, -1]);
/// with `hinted` the teacher log-probs [-0.25, -0.125, -0.5], top-2 and the hint `h<n>`.
fn sample(n: usize, ty: SampleType, reward: f32, interaction_id: &str, session: &str, hinted: bool) -> Sample {
    let base = Sample {
        sample_id: format!("s{n}"),
        pipeline: "combined".into(),
        interaction_id: interaction_id.into(),
        session_id: session.into(),
        policy_version: Some(3),
        judgment_id: (ty != SampleType::Opd && ty != SampleType::CombinedHintOnly).then(|| format!("j{n}")),
        event_time: T0,
        processed_time: T0,
        ..Sample::new(ty, vec![1, 2, 3], vec![10, 11, 12], vec![-0.5, -0.25, -1.0], reward)
    };
    if !hinted {
        return base;
    }
    Sample {
        teacher_logprobs: Some(vec![-0.25, -0.125, -0.5]),
        topk_ids: Some(vec![vec![10, 7], vec![11, 8], vec![12, 9]]),
        topk_logprobs: Some(vec![vec![-0.25, -2.0], vec![-0.125, -3.0], vec![-0.5, -1.5]]),
        teacher_prompt_token_ids: Some(vec![1, 2, 3, 4, 5]),
        hint_id: Some(format!("h{n}")),
        teacher_id: Some(format!("t{n}")),
        ..base
    }
}

/// The lake: sessions sess1..sess6 with one turn each and samples s1..s7:
/// s1 binary +1, s2 binary −1, s3 opd (hint), s4 combined-both +1 (hint), s5 combined-hint-only
/// (hint), s6 combined-score-only −1 (teacher := rollout), s7 combined-score-only +1 whose turn is not
/// in the lake and whose loss mask has 2 values for 3 tokens.
fn make_lake(dir: &Path) -> (Lake, Vec<Interaction>) {
    let lake = Lake::open(dir).unwrap();
    let turns: Vec<Interaction> = (1..=6).map(|i| turn(&format!("sess{i}"))).collect();
    let t = |i: usize| (turns[i - 1].interaction_id.clone(), turns[i - 1].session_id.clone());
    let samples = vec![
        sample(1, SampleType::Binary, 1.0, &t(1).0, &t(1).1, false),
        sample(2, SampleType::Binary, -1.0, &t(2).0, &t(2).1, false),
        sample(3, SampleType::Opd, 0.0, &t(3).0, &t(3).1, true),
        sample(4, SampleType::CombinedBoth, 1.0, &t(4).0, &t(4).1, true),
        sample(5, SampleType::CombinedHintOnly, 0.0, &t(5).0, &t(5).1, true),
        Sample { teacher_logprobs: Some(vec![-0.5, -0.25, -1.0]), ..sample(6, SampleType::CombinedScoreOnly, -1.0, &t(6).0, &t(6).1, false) },
        Sample { loss_mask: vec![1, 1], ..sample(7, SampleType::CombinedScoreOnly, 1.0, "missing-turn", "sess7", false) },
    ];
    let hints: Vec<HintRecord> = [3, 4, 5].iter().map(|&n| hint(n, &turns[n - 1])).collect();
    lake.write_rows(&turns, "test", 1).unwrap();
    lake.write_rows(&hints, "test", 1).unwrap();
    lake.write_rows(&samples, "test", 1).unwrap();
    (lake, turns)
}

const ALL: &str = "SELECT * FROM samples ORDER BY sample_id";

/// A python that imports `datasets`: `NEXTSTATE_TEST_PYTHON`, the set-up's venv, else `python3`.
fn python_with_datasets() -> Option<PathBuf> {
    let candidates = [
        std::env::var("NEXTSTATE_TEST_PYTHON").ok().map(PathBuf::from),
        Some(common::root().join(".cache/venv-openai/bin/python")),
        Some(PathBuf::from("python3")),
    ];
    candidates.into_iter().flatten().find(|py| std::process::Command::new(py).args(["-c", "import datasets"]).output().map(|o| o.status.success()).unwrap_or(false))
}

/// Runs tests/python/export_check.py over `NAME=PATH` pairs; its JSON.
fn load_with_datasets(py: &Path, outputs: &[(&str, PathBuf)]) -> Value {
    let args: Vec<String> = outputs.iter().map(|(n, p)| format!("{n}={}", p.display())).collect();
    let out = std::process::Command::new(py)
        .arg(common::root().join("tests/python/export_check.py"))
        .args(&args)
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", std::env::temp_dir().join("nextstate-export-test-hf"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "export_check.py failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn skipped(pairs: &[(&str, usize)]) -> std::collections::BTreeMap<String, usize> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn columns(v: &Value) -> Vec<String> {
    v["columns"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_is_read_by_datasets() {
    let Some(py) = python_with_datasets() else {
        common::missing("no python with the datasets package (scripts/setup.sh installs it into .cache/venv-openai)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (lake, turns) = make_lake(&dir.path().join("lake"));
    let out = |f: &str| dir.path().join(format!("out-{f}"));
    let opts = ExportOptions::default();

    let slime = export(&lake, ALL, ExportFormat::Slime, &out("slime"), &opts).await.unwrap();
    assert_eq!(slime.selected, 7);
    assert_eq!((slime.files[0].rows, &slime.files[0].skipped), (6, &skipped(&[("length_mismatch", 1)])));
    let verl = export(&lake, ALL, ExportFormat::Verl, &out("verl"), &opts).await.unwrap();
    assert_eq!((verl.files[0].rows, &verl.files[0].skipped), (6, &skipped(&[("no_interaction_row", 1)])));
    let trl = export(&lake, ALL, ExportFormat::Trl, &out("trl"), &opts).await.unwrap();
    let got: Vec<(String, usize, _)> = trl.files.iter().map(|f| (f.path.file_name().unwrap().to_string_lossy().into_owned(), f.rows, f.skipped.clone())).collect();
    assert_eq!(
        got,
        vec![
            ("kto.parquet".to_string(), 4, skipped(&[("no_binary_score", 2), ("no_interaction_row", 1)])),
            ("sft.parquet".to_string(), 3, skipped(&[("no_hint", 4)])),
            ("gkd.parquet".to_string(), 3, skipped(&[("no_teacher_topk", 4)])),
        ]
    );
    let hf = export(&lake, ALL, ExportFormat::Hf, &out("hf"), &opts).await.unwrap();
    assert_eq!((hf.files[0].rows, hf.files[0].skipped.len()), (7, 0));
    assert!(out("hf").join("data/train-00000-of-00001.parquet").is_file());

    let v = load_with_datasets(
        &py,
        &[
            ("slime", out("slime").join("slime.parquet")),
            ("verl", out("verl").join("train.parquet")),
            ("kto", out("trl").join("kto.parquet")),
            ("sft", out("trl").join("sft.parquet")),
            ("gkd", out("trl").join("gkd.parquet")),
            ("hf", out("hf")),
        ],
    );
    eprintln!("{}", serde_json::to_string_pretty(&v).unwrap());
    let id = |i: usize| Value::from(turns[i - 1].interaction_id.clone());

    // slime: slime's Sample fields, s1 (binary +1)
    let s = &v["slime"];
    assert_eq!(s["num_rows"], 6);
    assert_eq!(
        columns(s),
        ["index", "tokens", "response_length", "loss_mask", "rollout_log_probs", "reward", "teacher_log_probs", "weight_versions", "session_id", "prompt_length", "sample_id", "interaction_id", "turn_index", "pipeline", "method", "sample_type", "policy_version", "judgment_id", "hint_id", "teacher_id", "event_time"]
    );
    for (c, t) in [("tokens", "list<int32>"), ("response_length", "int64"), ("loss_mask", "list<int32>"), ("rollout_log_probs", "list<float32>"), ("reward", "float32"), ("teacher_log_probs", "list<float32>"), ("weight_versions", "list<string>"), ("session_id", "string")] {
        assert_eq!(s["features"][c], t, "slime {c}");
    }
    let r = &s["first"];
    assert_eq!(r["index"], 0);
    assert_eq!(r["tokens"], json!([1, 2, 3, 10, 11, 12]));
    assert_eq!(r["response_length"], 3);
    assert_eq!(r["prompt_length"], 3);
    assert_eq!(r["loss_mask"], json!([1, 1, 1]));
    assert_eq!(r["rollout_log_probs"], json!([-0.5, -0.25, -1.0]));
    assert_eq!(r["reward"], json!(1.0));
    assert_eq!(r["teacher_log_probs"], Value::Null);
    assert_eq!(r["weight_versions"], json!(["3"]));
    assert_eq!((&r["sample_id"], &r["interaction_id"], &r["session_id"]), (&json!("s1"), &id(1), &json!("sess1")));
    assert_eq!((&r["sample_type"], &r["method"], &r["judgment_id"]), (&json!("binary"), &json!("binary"), &json!("j1")));

    // verl: the RL layout, s1
    let s = &v["verl"];
    assert_eq!(s["num_rows"], 6);
    assert_eq!(columns(s), ["data_source", "prompt", "ability", "reward_model", "extra_info"]);
    assert_eq!(s["features"]["prompt"], "list<struct<role:string,content:string>>");
    assert_eq!(s["features"]["reward_model"], "struct<style:string,ground_truth:string>");
    let r = &s["first"];
    assert_eq!(r["data_source"], "nextstate/combined");
    assert_eq!(r["prompt"], json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question of sess1"}]));
    assert_eq!(r["ability"], "agent");
    assert_eq!(r["reward_model"], json!({"style": "model", "ground_truth": ""}));
    let e = &r["extra_info"];
    assert_eq!((&e["sample_id"], &e["interaction_id"], &e["session_id"]), (&json!("s1"), &id(1), &json!("sess1")));
    assert_eq!((&e["reward"], &e["sample_type"], &e["response"], &e["split"]), (&json!(1.0), &json!("binary"), &json!("Answer of sess1"), &json!("train")));

    // trl kto: s1, s2, s4, s6 (binary-scored), labels from the sign
    let s = &v["kto"];
    assert_eq!(s["num_rows"], 4);
    assert_eq!(s["features"]["label"], "bool");
    assert_eq!(s["features"]["completion"], "list<struct<role:string,content:string>>");
    let r = &s["first"];
    assert_eq!(r["prompt"], json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question of sess1"}]));
    assert_eq!(r["completion"], json!([{"role": "assistant", "content": "Answer of sess1"}]));
    assert_eq!((&r["label"], &r["sample_id"]), (&json!(true), &json!("s1")));

    // trl sft: s3, s4, s5 (hinted): the teacher context, then the logged response
    let s = &v["sft"];
    assert_eq!(s["num_rows"], 3);
    assert_eq!(s["features"]["messages"], "list<struct<role:string,content:string>>");
    let r = &s["first"];
    assert_eq!(
        r["messages"],
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Question of sess3\n\n[user's hint] Use fewer words."},
            {"role": "assistant", "content": "Answer of sess3"}
        ])
    );
    assert_eq!((&r["hint"], &r["sample_id"], &r["sample_type"]), (&json!("Use fewer words."), &json!("s3"), &json!("opd")));

    // trl gkd: s3, s4, s5 (top-K)
    let s = &v["gkd"];
    assert_eq!(s["num_rows"], 3);
    assert_eq!(s["features"]["teacher_topk_ids"], "list<list<int32>>");
    assert_eq!(s["features"]["teacher_topk_logprobs"], "list<list<float32>>");
    let r = &s["first"];
    assert_eq!((&r["prompt_token_ids"], &r["response_token_ids"], &r["loss_mask"]), (&json!([1, 2, 3]), &json!([10, 11, 12]), &json!([1, 1, 1])));
    assert_eq!(r["teacher_logprobs"], json!([-0.25, -0.125, -0.5]));
    assert_eq!(r["teacher_topk_ids"], json!([[10, 7], [11, 8], [12, 9]]));
    assert_eq!(r["teacher_topk_logprobs"], json!([[-0.25, -2.0], [-0.125, -3.0], [-0.5, -1.5]]));
    assert_eq!((&r["teacher_prompt_token_ids"], &r["sample_id"], &r["interaction_id"]), (&json!([1, 2, 3, 4, 5]), &json!("s3"), &id(3)));

    // hf: the samples columns as they are, read through the card
    let s = &v["hf"];
    assert_eq!(s["num_rows"], 7);
    for c in ["sample_id", "sample_type", "prompt_token_ids", "response_token_ids", "loss_mask", "rollout_logprobs", "reward", "teacher_logprobs", "topk_ids", "event_time"] {
        assert!(columns(s).iter().any(|x| x == c), "hf has no column {c}: {s}");
    }
    assert_eq!(s["features"]["topk_ids"], "list<list<int32>>");
    assert_eq!(s["features"]["reward"], "float32");
    let r = &s["first"];
    assert_eq!((&r["sample_id"], &r["interaction_id"], &r["sample_type"], &r["reward"]), (&json!("s1"), &id(1), &json!("binary"), &json!(1.0)));
    assert_eq!((&r["prompt_token_ids"], &r["rollout_logprobs"]), (&json!([1, 2, 3]), &json!([-0.5, -0.25, -1.0])));
    let card = std::fs::read_to_string(out("hf").join("README.md")).unwrap();
    for want in ["configs:", "path: data/train-*", ALL, "`combined` (7)", "rows: 7", env!("CARGO_PKG_VERSION"), "`binary` (2)"] {
        assert!(card.contains(want), "card lacks {want:?}:\n{card}");
    }
    // the lake by its name: the card leaves the machine, its folders do not
    assert!(card.contains("- lake: `lake`\n"), "{card}");
    assert!(!card.contains(&*dir.path().to_string_lossy()), "the card names a local path:\n{card}");
}

#[test]
fn the_binary_exports_and_require_rows_refuses_an_empty_selection() {
    let dir = tempfile::tempdir().unwrap();
    let lake_dir = dir.path().join("lake");
    make_lake(&lake_dir);
    let lake = lake_dir.to_string_lossy().into_owned();
    let out = dir.path().join("trl").to_string_lossy().into_owned();
    let (ok, stdout, stderr) = common::run_bin(&["export", "--lake", &lake, "--sql", ALL, "--to", "trl", "--out", &out]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("export trl: selected=7"), "{stdout}");
    assert!(stdout.contains("kto.parquet: rows=4 skipped=3 (no_binary_score=2 no_interaction_row=1)"), "{stdout}");
    assert!(stdout.contains("sft.parquet: rows=3 skipped=4 (no_hint=4)"), "{stdout}");
    assert!(stdout.contains("gkd.parquet: rows=3 skipped=4 (no_teacher_topk=4)"), "{stdout}");

    let none = "SELECT * FROM samples WHERE sample_id = 'nothing'";
    let empty = dir.path().join("empty").to_string_lossy().into_owned();
    let (ok, stdout, stderr) = common::run_bin(&["export", "--lake", &lake, "--sql", none, "--to", "slime", "--out", &empty]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("slime.parquet: rows=0 skipped=0"), "{stdout}");
    let refused = dir.path().join("refused");
    let (ok, stdout, stderr) = common::run_bin(&["export", "--lake", &lake, "--sql", none, "--to", "slime", "--out", &refused.to_string_lossy(), "--require-rows"]);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("selected no rows"), "{stderr}");
    assert!(!refused.exists(), "nothing is written");

    // a format that needs samples rows says so
    let (ok, _, stderr) = common::run_bin(&["export", "--lake", &lake, "--sql", "SELECT sample_id FROM samples", "--to", "slime", "--out", &empty]);
    assert!(!ok);
    assert!(stderr.contains("full samples rows"), "{stderr}");
}
