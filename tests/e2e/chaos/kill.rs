//! SIGKILL of every long-running process at random points, over many rounds.

use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::{base_args, check, common, create_topics, data, pipeline_roles, serial, setting};

const PIPELINE: &str = "chaos";

fn pipeline_toml(model: &std::path::Path) -> String {
    format!(
        r#"name = "{PIPELINE}"
method = "binary"
stage_batch = 8
[bus]
partitions = 2
max_poll_interval_ms = 60000
[sink]
roll_ms = 300
batch = 200
[judge]
backend = "rules"
m = 1
[teacher]
# the real agent logs' long prompts are dead-lettered (too_long) before any model work
max_tokens = 384
batch = 4
[trainer]
batch_size = 4
checkpoint_every = 1
[trainer.lora]
enabled = true
rank = 4
alpha = 8.0
[policy]
model = "{}"
"#,
        model.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_process_killed_at_random_points_keeps_each_record_exactly_once() {
    let _serial = serial();
    let Some(model) = common::test_model_or_missing() else {
        return;
    };
    let rounds: usize = setting("NEXTSTATE_CHAOS_ROUNDS", 12);
    let sessions: usize = setting("NEXTSTATE_CHAOS_SESSIONS", 12);
    let seed: u64 = setting("NEXTSTATE_CHAOS_SEED", rand::random::<u64>() % 100_000);
    eprintln!("[chaos] seed {seed} (NEXTSTATE_CHAOS_SEED), {rounds} rounds, {sessions} synthetic sessions");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t0 = Instant::now();

    let brokers = common::brokers();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let (lake, ckpt) = (dir.path().join("lake"), dir.path().join("checkpoints"));
    let pipeline = dir.path().join("chaos.toml");
    std::fs::write(&pipeline, pipeline_toml(&model)).unwrap();
    let files = data::write_inputs(dir.path(), sessions, true);
    let expected = data::expected(&files);
    create_topics(&brokers, &prefix, 2).await;

    let base = base_args(&pipeline, &brokers, &prefix, &lake);
    let mut sup = pipeline_roles(dir.path(), &base, &files, &["signals", "judge", "teacher", "sinks"]);
    let mut train = common::args(&["train", "--resume", "--group-instance-id", "train", "--checkpoints", &ckpt.display().to_string()]);
    train.extend(base.iter().cloned());
    sup.add("train", train, false);
    let names: Vec<&'static str> = sup.roles.iter().map(|r| r.name).collect();
    for n in &names {
        sup.start(n);
    }

    // Rounds: each cycle of six kills every role once, in a random order, after a random delay. Killing
    // `ingest` after it completed starts it again (an at-least-once source re-sending everything) and
    // kills it mid-way.
    let mut order = names.clone();
    for round in 0..rounds {
        if round % order.len() == 0 {
            order.shuffle(&mut rng);
        }
        let victim = order[round % order.len()];
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1_000..4_000))).await;
        sup.reap();
        if victim == "ingest" && sup.roles[0].proc.is_none() {
            sup.start("ingest");
            tokio::time::sleep(Duration::from_millis(rng.gen_range(100..1_500))).await;
        }
        let hit = sup.kill(victim);
        eprintln!("[chaos] round {round}: SIGKILL {victim}{} at {:.1} s", if hit { "" } else { " (had already exited)" }, t0.elapsed().as_secs_f64());
        if victim != "ingest" || sup.roles[0].completed == 0 {
            sup.start(victim);
        }
    }
    // Let the last restarts make progress, then kill everything once more and drain in chain order.
    tokio::time::sleep(Duration::from_millis(rng.gen_range(1_000..3_000))).await;
    sup.kill_all();
    eprintln!("[chaos] chaos phase over at {:.1} s: {}", t0.elapsed().as_secs_f64(), sup.summary());
    if sup.roles[0].completed == 0 {
        sup.run_until_idle("ingest", Duration::from_secs(120));
    }
    for n in ["signals", "judge", "teacher", "train", "sinks"] {
        sup.run_until_idle(n, Duration::from_secs(420));
    }

    let c = check::check(&lake, PIPELINE, &expected, true, Some(&ckpt));
    let kills = sup.kills();
    assert!(kills as usize >= rounds.min(names.len()), "too few kills hit a running process: {}", sup.summary());
    eprintln!(
        "[chaos] PASS in {:.0} s: {rounds} rounds, {kills} SIGKILLs ({}); {} records checked ({:?}), {} samples in the lineage of {} checkpoints",
        t0.elapsed().as_secs_f64(),
        sup.summary(),
        c.total(),
        c.rows,
        c.lineage,
        c.checkpoints
    );
}

fn sample(id: &str, reward: f32) -> nextstate::schema::Sample {
    use nextstate::schema::{Sample, SampleType};
    Sample {
        sample_id: id.to_string(),
        pipeline: "dup".into(),
        interaction_id: format!("i-{id}"),
        session_id: format!("s-{id}"),
        event_time: 1_772_400_000_000,
        processed_time: 1_772_400_000_000,
        ..Sample::new(SampleType::Binary, vec![1, 4093, 198, 30, 2], vec![504, 30, 2], vec![-1.5, -0.75, -0.25], reward)
    }
}

/// The regression test of the fault the kill test found: an upstream stage killed after sending a
/// sample but before committing its input sends that sample again, and the trainer trained both
/// copies (the second in the same run, since only the checkpoints' lineage was checked, at start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trainer_trains_a_resent_sample_once() {
    use nextstate::bus::{Bus, BusConfig};
    use nextstate::stages::train::{run_train, TrainOptions, TrainSource};
    let _serial = serial();
    let Some(model) = common::test_model() else {
        common::missing("model directory not found");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // The samples' rollout log-probs are made up (not the model's), so the log-prob gap quarantine
    // is off: this test is about resent samples.
    let toml = format!(
        "name = \"dup\"\nmethod = \"binary\"\n[trainer]\nbatch_size = 2\n[trainer.lora]\nenabled = true\nrank = 2\nalpha = 4.0\n[trainer.quarantine]\nmax_logprob_gap = inf\n[policy]\nmodel = \"{}\"\n",
        model.display()
    );
    let cfg: nextstate::config::PipelineConfig = toml::from_str(&toml).unwrap();
    let bus = Bus::connect(BusConfig::default()).await.unwrap();
    bus.ensure_topics(&["samples", "train_steps", "checkpoints", "dead_letters"]).await.unwrap();
    bus.expect_consumer(&bus.group("nextstate.dup.trainer"), "samples");
    let producer = bus.producer().unwrap();
    for (id, r) in [("a", 1.0), ("b", -1.0), ("a", 1.0), ("c", 1.0), ("d", -1.0)] {
        producer.send(&sample(id, r), None).await.unwrap();
    }
    let ctl = nextstate::runtime::TaskCtl::new("train", true, nextstate::runtime::Stop::default());
    let opts = TrainOptions { source: TrainSource::Topic, resume: false, run_id: Some("dup".into()), checkpoints_dir: dir.path().to_path_buf(), max_steps: None, metrics_jsonl: None, metrics_jsonl_extra: vec![] };
    let report = tokio::time::timeout(Duration::from_secs(420), run_train(&cfg, &opts, &bus, &ctl, None)).await.expect("trainer finished").unwrap();
    assert_eq!((report.steps, report.samples_trained, report.skipped_duplicates), (2, 4, 1), "{report:?}");
    let scan = nextstate::trainer::scan(&dir.path().join("dup")).unwrap();
    let mut ids: Vec<String> = scan.complete.iter().flat_map(|(_, m)| m.lineage.iter().map(|l| l.sample_id.clone())).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "c", "d"], "each sample once in the checkpoints' lineage");
}
