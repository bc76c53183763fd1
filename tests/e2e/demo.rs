//! A short `nextstate demo` (few turns, tiny settings) against the real broker: every stage produces rows,
//! checkpoints are published and loaded by the server while the students are being served, and no request
//! fails during the reloads.
use crate::common;

use nextstate::config::PipelineConfig;
use nextstate::lake::Lake;

/// The test model, or `None` (reported as missing).
fn model() -> Option<std::path::PathBuf> {
    let model = common::root().join("models/smollm2-135m-instruct");
    if !model.join("model.safetensors").exists() {
        common::missing("models/smollm2-135m-instruct missing (run scripts/setup.sh)");
        return None;
    }
    let _ = nextstate::model::set_threads(1);
    Some(model)
}

/// A tiny demo under `dir`: `pipelines/demo.toml` on the real broker (fresh topics, 2 partitions), batches
/// of 2, one libtorch thread; 8 student turns by 2 students, 2 held-out problems, answers of 24 tokens.
fn tiny_demo(model: &std::path::Path, dir: &std::path::Path) -> nextstate::demo::run::DemoOptions {
    let mut cfg = PipelineConfig::load(&common::root().join("pipelines/demo.toml")).unwrap();
    cfg.bus.brokers = Some(common::brokers());
    cfg.bus.topic_prefix = common::prefix();
    cfg.bus.partitions = 2;
    cfg.bus.max_poll_interval_ms = 10_000;
    cfg.policy.model = model.to_path_buf();
    cfg.policy.threads = 1;
    cfg.proxy.spool_dir = dir.join("spool");
    cfg.trainer.batch_size = 2;
    cfg.sink.roll_ms = 500;
    nextstate::demo::run::DemoOptions {
        pipeline: cfg,
        out: dir.join("out"),
        gsm8k: common::root().join("data/gsm8k_test.json"),
        interactions: 8,
        min_versions_served: 1,
        max_interactions: 8,
        students: 2,
        max_turns: 1,
        eval_problems: 2,
        eval_split: nextstate::demo::EvalSplit::Test,
        max_tokens: 24,
        temperature: 0.6,
        seed: 11,
        split_seed: None,
        preferences: nextstate::demo::Preferences { correct_answer: false, ..Default::default() },
        eval_last_only: false,
        context: nextstate::demo::run::AgentContext::None,
        train: true,
        fleet: vec![],
        v0_kept: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_demo_against_the_real_broker() {
    let Some(model) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let opts = nextstate::demo::run::DemoOptions {
        // the first checkpoint must reach the students (CI once answered all 8 before it loaded)
        min_versions_served: 2,
        max_interactions: 40,
        max_turns: 2,
        ..tiny_demo(&model, dir.path())
    };
    let s = nextstate::demo::run::run_demo(opts, nextstate::runtime::Stop::default()).await.unwrap();
    eprintln!("versions seen by the students: {:?}; reloads: {:?}; evaluations: {:?}", s.versions_seen, s.run.reloads, s.evaluations.iter().map(|e| e.version).collect::<Vec<_>>());
    assert_eq!(s.failed_requests, 0, "no request failed, reloads included");
    assert!(s.interactions >= 8);
    assert!(!s.run.reloads.is_empty(), "the server loaded at least one checkpoint");
    assert!(s.versions_seen.len() >= 2, "the weights changed while the students were being served: {:?}", s.versions_seen);
    assert!(s.evaluations.iter().any(|e| e.version >= 1), "a trained version was evaluated");
    // v0 first, then at most the first, middle and last loaded versions, in order; each with its mean
    // word count and its drift from v0 (0 for v0 itself).
    let versions: Vec<i64> = s.evaluations.iter().map(|e| e.version).collect();
    assert!(versions[0] == 0 && versions.len() <= 4 && versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    assert_eq!(s.evaluations[0].drift_nats_per_token, Some(0.0));
    assert!(s.evaluations.iter().all(|e| e.mean_words.is_some_and(|w| w > 0.0) && e.drift_nats_per_token.is_some_and(f64::is_finite)), "{:?}", s.evaluations);
    let lake = Lake::open(dir.path().join("out/lake")).unwrap();
    for table in ["interactions", "signals", "judgments", "hints", "samples", "train_steps", "checkpoints", "eval_scores"] {
        let n = nextstate::sql::scalar_i64(&lake, &format!("SELECT count(*) FROM {table}")).await.unwrap();
        assert!(n > 0, "{table} is empty");
    }
    assert!(s.report.exists());
    // Every evaluation records its per-problem outcomes, so the first and last are compared pairwise.
    assert!(s.evaluations.iter().all(|e| e.satisfied.len() == 2), "{:?}", s.evaluations);
    assert!(s.result_line.contains("on 2 held-out problems; exact McNemar: "), "{}", s.result_line);
    let md = std::fs::read_to_string(&s.report).unwrap();
    assert!(md.contains("Paired test on the same 2 problems (exact McNemar"), "{md}");
    assert!(md.contains("## What the trainer was given"), "{md}");
    // Every session is recorded once, numbered in the order it ended, with the version of its first
    // answer; the report states the online metric.
    assert_eq!(s.sessions_log.len() as u64, s.sessions, "{:?}", s.sessions_log);
    let mut ended: Vec<usize> = s.sessions_log.iter().map(|o| o.ended).collect();
    ended.sort_unstable();
    assert_eq!(ended, (1..=s.sessions_log.len()).collect::<Vec<_>>());
    assert!(s.sessions_log.iter().all(|o| o.first_version >= 0 && (1..=2).contains(&o.turns) && (!o.first_answer_satisfied || o.turns == 1)), "{:?}", s.sessions_log);
    assert_eq!(s.sessions_summary.sessions, s.sessions_log.len());
    assert!(md.contains("## The student's sessions") && md.contains("consecutive sessions"), "{md}");
    assert!(md.contains("## Where the advantage came from, per step") && md.contains("| step | samples | mean r | reward part | teacher part | teacher share |"), "{md}");
}

/// `demo --tenants 2` in miniature on the real broker (issue 41; mechanics, not learning): both modes run,
/// every turn carries its student's tenant, the per-tenant run trains one adapter per tenant, each
/// checkpoint's lineage holds only its own tenant's samples, and the report scores each tenant's three
/// policies with its own checker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenant_demo_trains_and_scores_each_tenant() {
    let Some(model) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let opts = nextstate::demo::run::DemoOptions {
        preferences: nextstate::demo::Preferences::default(),
        eval_last_only: true,
        fleet: nextstate::demo::fleet::two_tenants(80, false),
        ..tiny_demo(&model, dir.path())
    };
    let s = nextstate::demo::fleet::run_fleet_demo(opts, nextstate::runtime::Stop::default()).await.unwrap();
    assert_eq!(s.runs.iter().map(|r| (r.mode.as_str(), r.failed_requests)).collect::<Vec<_>>(), vec![("shared", 0), ("per_tenant", 0)]);
    let per_tenant = Lake::open(dir.path().join("out/per_tenant/lake")).unwrap();
    let turns = nextstate::sql::query(&per_tenant, "SELECT tenant, count(*) AS n FROM interactions WHERE turn_type = 'main' GROUP BY tenant ORDER BY tenant").await.unwrap();
    let turns = nextstate::sql::render(&turns, nextstate::sql::OutputFormat::Csv).unwrap();
    assert!(turns.starts_with("tenant,n\nalice,") && turns.contains("\nbob,"), "every turn is alice's or bob's: {turns}");
    let samples: Vec<nextstate::schema::Sample> = per_tenant.read_table().unwrap();
    for t in ["alice", "bob"] {
        let run_dir = dir.path().join("out/per_tenant/checkpoints/demo").join(t);
        let scan = nextstate::trainer::scan(&run_dir).unwrap();
        assert!(!scan.complete.is_empty(), "{t} has an adapter");
        for (_, m) in &scan.complete {
            assert_eq!(m.tenant.as_deref(), Some(t));
            for l in &m.lineage {
                let s = samples.iter().find(|s| s.sample_id == l.sample_id).unwrap();
                assert_eq!(s.tenant.as_deref(), Some(t), "{t}'s adapter trained only {t}'s samples");
            }
        }
    }
    assert!(nextstate::trainer::latest_complete(&dir.path().join("out/per_tenant/checkpoints/demo")).unwrap().is_none(), "no shared checkpoint in the per-tenant run");
    assert!(nextstate::trainer::latest_complete(&dir.path().join("out/shared/checkpoints/demo")).unwrap().is_some(), "the shared run trained the shared policy");
    assert_eq!(s.tenants.iter().map(|t| (t.tenant.as_str(), t.policies.iter().map(|p| p.policy.as_str()).collect::<Vec<_>>())).collect::<Vec<_>>(), vec![("alice", vec!["v0", "shared", "per_tenant"]), ("bob", vec!["v0", "shared", "per_tenant"])]);
    assert!(s.tenants.iter().all(|t| t.policies.iter().all(|p| p.satisfied.len() == 2)));
    assert_eq!(s.comparisons.len(), 6);
    let md = std::fs::read_to_string(&s.report).unwrap();
    assert!(md.contains("| alice | ") && md.contains("| bob | ") && md.contains("labeled_steps"), "{md}");
}

/// The online ablation generates v0's held-out answers once and keeps them for every replicate: the kept
/// answers are exactly the generated ones, a kept file is read back instead of generating, and a
/// changed key (the answer length) or an unreadable file generates again and rewrites the file.
#[test]
fn kept_v0_answers_are_the_generated_ones_and_a_changed_key_generates_again() {
    use nextstate::demo::heldout::{greedy_generations, greedy_generations_kept, load_policy};
    let Some(model) = model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = PipelineConfig::load(&common::root().join("pipelines/demo.toml")).unwrap();
    cfg.policy.model = model;
    let problems = nextstate::demo::load_gsm8k(&common::root().join("data/gsm8k_test.json")).unwrap();
    let problems = &problems[..3];
    let student = nextstate::demo::Student::new(5, nextstate::demo::Preferences::default(), 1).unwrap();
    let lm = load_policy(&cfg, None).unwrap();
    let kept = dir.path().join("online/v0-answers.json");

    let fresh = greedy_generations(&lm, problems, &student, 12, 2).unwrap();
    assert_eq!(greedy_generations_kept(&cfg, &lm, problems, &student, 12, 2, &kept).unwrap(), fresh);
    assert!(kept.is_file());

    // A second call reads the file: an answer edited in it comes back as edited.
    let mut file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&kept).unwrap()).unwrap();
    file["answers"][0]["text"] = "kept, not generated".into();
    std::fs::write(&kept, file.to_string()).unwrap();
    let again = greedy_generations_kept(&cfg, &lm, problems, &student, 12, 2, &kept).unwrap();
    assert_eq!(again[0].text, "kept, not generated");
    assert_eq!(again[1..], fresh[1..]);

    // Another answer length is another key: generated again, and the file now holds the new answers.
    let shorter = greedy_generations_kept(&cfg, &lm, problems, &student, 6, 2, &kept).unwrap();
    assert_eq!(shorter, greedy_generations(&lm, problems, &student, 6, 2).unwrap());
    assert!(shorter.iter().all(|a| a.response_ids.len() <= 6));
    let file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&kept).unwrap()).unwrap();
    assert_eq!(file["answers"][0]["text"], shorter[0].text.as_str());

    // Another student phrases other prompts: another key too.
    let other = nextstate::demo::Student::new(6, nextstate::demo::Preferences::default(), 1).unwrap();
    let theirs = greedy_generations_kept(&cfg, &lm, problems, &other, 6, 2, &kept).unwrap();
    assert_ne!(theirs.iter().map(|a| &a.prompt_ids).collect::<Vec<_>>(), shorter.iter().map(|a| &a.prompt_ids).collect::<Vec<_>>());
    assert_eq!(theirs, greedy_generations(&lm, problems, &other, 6, 2).unwrap());

    // An unreadable file is never trusted: generated again, and rewritten.
    std::fs::write(&kept, "not json").unwrap();
    assert_eq!(greedy_generations_kept(&cfg, &lm, problems, &other, 6, 2, &kept).unwrap(), theirs);
    assert!(std::fs::read_to_string(&kept).unwrap().starts_with('{'));
}
