//! The commands as a user runs them, through the real broker: `ingest` of every real log, `run --only
//! signals,sinks --until-idle`, and `sql`; counts checked by hand against the raw files (tau-bench:
//! 2,454 assistant turns, 1,164 followed by tool results and 1,290 by the customer; mini-swe-agent: 10
//! turns answered by the shell, as role `user`); AgentBench's null histories become dead letters with a
//! reason and exit status 0. Lineage: every signal names the `interactions` record it was read from.
use crate::common;

use std::path::PathBuf;

fn logs() -> Vec<PathBuf> {
    let dir = common::data("agent-logs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).filter(|p| !p.ends_with("README.md")).collect();
    v.sort();
    v
}

fn sql(lake: &std::path::Path, q: &str) -> String {
    let (ok, out, err) = common::run_bin(&["sql", "--format", "csv", "--lake", lake.to_str().unwrap(), q]);
    assert!(ok, "sql failed: {err}");
    out
}

/// Runs `nextstate <cmd…> --brokers <test broker> --topic-prefix <prefix> --lake <lake> <tail…>` and
/// checks it succeeded; returns (stdout, stderr).
fn on_broker(cmd: &[&str], prefix: &str, lake: &std::path::Path, tail: &[&str]) -> (String, String) {
    let brokers = common::brokers();
    let mut args = cmd.to_vec();
    args.extend(["--brokers", brokers.as_str(), "--topic-prefix", prefix, "--lake", lake.to_str().unwrap()]);
    args.extend(tail);
    let (ok, out, err) = common::run_bin(&args);
    assert!(ok, "{} failed: {err}", cmd[0]);
    (out, err)
}

/// `run --pipeline pipelines/combined.toml --only signals,sinks --until-idle` with static membership
/// `member`: pairs every ingested turn and lands the signals.
fn pair(member: &str, prefix: &str, lake: &std::path::Path) {
    on_broker(&["run", "--pipeline", "pipelines/combined.toml", "--only", "signals,sinks", "--until-idle", "--group-instance-id", member], prefix, lake, &[]);
}

#[test]
fn ingest_pair_and_query_the_real_logs_through_the_broker() {
    let shared = common::root().join("../shared/data/agent-logs");
    if !shared.exists() {
        common::missing("../shared/data/agent-logs not present");
        return;
    }
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let files: Vec<String> = logs().iter().map(|p| p.display().to_string()).collect();
    let (out, err) = on_broker(&["ingest"], &prefix, &lake, &files.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.contains("interactions=2484 dead_letters=22 (null_history=22)"), "{out}");
    assert!(err.contains("format tau-bench (auto-detected)"), "says which format it chose: {err}");

    // Produced through the broker, landed by the sinks: the lake holds exactly what was produced.
    assert_eq!(sql(&lake, "SELECT count(*) AS n FROM interactions"), "n\n2484\n");
    assert_eq!(
        sql(&lake, "SELECT reason_code, count(*) AS n FROM dead_letters GROUP BY reason_code"),
        "reason_code,n\nnull_history,22\n"
    );

    pair("cli-1", &prefix, &lake);
    assert_eq!(sql(&lake, "SELECT count(*) AS n FROM signals"), "n\n2484\n", "one signal per main turn");
    let by_format = sql(
        &lake,
        "SELECT i.source_format, s.kind, count(*) AS n FROM signals s JOIN interactions i ON s.interaction_id = i.interaction_id \
         GROUP BY i.source_format, s.kind ORDER BY i.source_format, s.kind",
    );
    assert!(by_format.contains("tau-bench,tool,1164\n"), "{by_format}");
    assert!(by_format.contains("tau-bench,user,1290\n"), "{by_format}");
    assert!(by_format.contains("mini-swe-agent,environment,10\n"), "{by_format}");
    assert!(by_format.contains("swe-agent,environment,12\n"), "{by_format}");
    // no signal pairs a response with a message written before it: every next state came later
    assert_eq!(
        sql(&lake, "SELECT count(*) AS n FROM signals s JOIN interactions i ON s.next_interaction_id = i.interaction_id JOIN interactions t ON s.interaction_id = t.interaction_id WHERE i.turn_index <= t.turn_index"),
        "n\n0\n"
    );
}

/// Lineage through the broker: `ingest` of the tau-bench log produces its 2,454 assistant turns as the
/// first 2,454 records of a fresh `interactions` topic; the signals stage reads them back and every
/// signal names its own record: all 2,454 (partition, offset) positions, each once, in turn order
/// within a session (a session's records are produced in turn order to one partition), and the
/// interactions keep the file position they were ingested from.
#[test]
fn signals_name_the_interactions_record_they_were_read_from() {
    let tau = common::root().join("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json");
    if !tau.exists() {
        common::missing("../shared/data/agent-logs/tau-bench__gpt-4o-airline.json not present");
        return;
    }
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let tau = tau.display().to_string();
    let (out, _err) = on_broker(&["ingest"], &prefix, &lake, &[&tau]);
    assert!(out.contains("interactions=2454 dead_letters=0"), "{out}");
    pair("cli-lineage", &prefix, &lake);

    let topic = format!("{prefix}interactions");
    assert_eq!(
        sql(&lake, &format!("SELECT count(*) AS n FROM signals WHERE source_topic = '{topic}' AND source_partition IS NOT NULL AND source_offset IS NOT NULL")),
        "n\n2454\n",
        "every signal names a record of the topic"
    );
    assert_eq!(
        sql(&lake, "SELECT count(*) AS positions FROM (SELECT DISTINCT source_partition, source_offset FROM signals)"),
        "positions\n2454\n",
        "each a different one"
    );
    // The positions are exactly the topic's records: per partition, offsets 0..n-1.
    assert_eq!(
        sql(&lake, "SELECT sum(hi + 1 - n) AS gaps, sum(lo) AS first FROM (SELECT source_partition, min(source_offset) AS lo, max(source_offset) AS hi, count(*) AS n FROM signals GROUP BY source_partition)"),
        "gaps,first\n0,0\n"
    );
    assert_eq!(
        sql(&lake, "SELECT count(*) AS n FROM signals a JOIN signals b ON a.session_id = b.session_id AND a.turn_index < b.turn_index WHERE a.source_partition <> b.source_partition OR a.source_offset >= b.source_offset"),
        "n\n0\n",
        "a session's records: one partition, in turn order"
    );
    assert_eq!(
        sql(&lake, &format!("SELECT count(*) AS n FROM interactions WHERE source_file = '{tau}' AND source_line IS NOT NULL AND source_topic IS NULL")),
        "n\n2454\n",
        "the interactions table keeps the file position (its rows are written before they have a Kafka position)"
    );
}

/// `ingest --follow`: an agent appends to its session file while the follower runs; the follower is
/// killed (-9) and restarted; every turn reaches the lake exactly once (counted by key).
#[test]
fn follow_emits_each_appended_turn_once_across_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let sessions = dir.path().join("sessions");
    std::fs::create_dir_all(&sessions).unwrap();
    let lake = dir.path().join("lake");
    let file = sessions.join("S.jsonl");
    let turn = |k: usize| {
        format!(
            concat!(
                r#"{{"type":"user","uuid":"u{k}","parentUuid":null,"sessionId":"S","timestamp":"2026-01-01T00:00:{k:02}Z","message":{{"role":"user","content":"question {k}"}}}}"#,
                "\n",
                r#"{{"type":"assistant","uuid":"a{k}","parentUuid":"u{k}","sessionId":"S","timestamp":"2026-01-01T00:00:{k:02}Z","message":{{"id":"m{k}","role":"assistant","model":"c","content":[{{"type":"text","text":"answer {k}"}}],"stop_reason":"end_turn"}}}}"#,
                "\n"
            ),
            k = k
        )
    };
    let append = |s: &str| {
        use std::io::Write;
        std::fs::OpenOptions::new().create(true).append(true).open(&file).unwrap().write_all(s.as_bytes()).unwrap();
    };
    let pipeline = dir.path().join("p.toml");
    std::fs::write(&pipeline, format!("name = \"follow\"\nmethod = \"binary\"\nlake = \"{}\"\n[sink]\nroll_ms = 200\n", lake.display())).unwrap();
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["ingest", "--follow", "--pipeline", pipeline.to_str().unwrap(), "--poll-ms", "100", "--settle-ms", "400"].iter().map(|s| s.to_string()).collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a.push(sessions.display().to_string());
        a
    };
    let count = || -> Vec<(i32, String)> {
        let (ok, out, _) = common::run_bin(&["sql", "--lake", lake.to_str().unwrap(), "--format", "csv", "SELECT turn_index, response_text FROM interactions ORDER BY turn_index"]);
        if !ok {
            return vec![];
        }
        out.lines().skip(1).filter_map(|l| l.split_once(',').map(|(t, r)| (t.parse().unwrap(), r.to_string()))).collect()
    };
    let wait_for = |n: usize| {
        let t = std::time::Instant::now();
        while count().len() < n {
            assert!(t.elapsed().as_secs() < 60, "lake has {:?}, waited for {n} rows", count());
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    // Turn 0 and half of turn 1 (the assistant line still being written).
    append(&turn(0));
    let t1 = turn(1);
    let (user1, rest1) = t1.split_at(t1.find('\n').unwrap() + 1);
    append(user1);
    append(&rest1[..20]);
    let log = dir.path().join("follow.log");
    let mut p = common::Proc::spawn("follow", &args(&[]), &log);
    wait_for(1);
    append(&rest1[20..]);
    append(&turn(2));
    wait_for(3);
    p.kill();
    // More turns while it is down; the restart picks them up, and nothing is emitted twice.
    append(&turn(3));
    let mut p = common::Proc::spawn("follow-2", &args(&["--exit-when-idle-ms", "1500"]), &log);
    let t = std::time::Instant::now();
    while p.exited().is_none() {
        assert!(t.elapsed().as_secs() < 90, "the follower did not exit when idle:\n{}", std::fs::read_to_string(&log).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(count(), (0..4).map(|k| (k, format!("answer {k}"))).collect::<Vec<_>>(), "{}", std::fs::read_to_string(&log).unwrap());
    assert!(lake.join("_follow/positions.json").is_file());
}

/// `--pipeline <absolute path>` from another working directory: the file's relative paths (`lake`,
/// `[policy] model`) are taken against the file's folder; a model found nowhere is a one-line error
/// naming `policy.model` and both places tried, without a backtrace (issue 40).
#[test]
fn pipeline_paths_are_relative_to_the_pipeline_file_not_the_working_directory() {
    let root = tempfile::tempdir().unwrap();
    let (a, elsewhere) = (root.path().join("a"), root.path().join("elsewhere"));
    std::fs::create_dir_all(a.join("models/m")).unwrap();
    std::fs::create_dir_all(a.join("lake")).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    let run_in = |cwd: &std::path::Path, args: &[&str]| {
        let out = std::process::Command::new(common::bin()).args(args).current_dir(cwd).env("RUST_BACKTRACE", "1").output().expect("run nextstate");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let good = a.join("p.toml");
    std::fs::write(&good, "name = \"paths\"\nmethod = \"binary\"\nlake = \"lake\"\n[policy]\nmodel = \"models/m\"\n").unwrap();
    // `sql --pipeline` loads the pipeline and opens its lake, which must exist: only a/lake does.
    let (ok, out, err) = run_in(&elsewhere, &["sql", "--format", "csv", "--pipeline", good.to_str().unwrap(), "SELECT 1 AS one"]);
    assert!(ok, "{err}");
    assert_eq!(out, "one\n1\n");
    assert!(!err.contains("relative to the working directory"), "no fallback warning: {err}");
    assert!(!elsewhere.join("lake").exists());

    let bad = a.join("bad.toml");
    std::fs::write(&bad, "name = \"paths\"\nmethod = \"binary\"\nlake = \"lake\"\n[policy]\nmodel = \"models/absent\"\n").unwrap();
    let (ok, _, err) = run_in(&elsewhere, &["sql", "--pipeline", bad.to_str().unwrap(), "SELECT 1"]);
    assert!(!ok);
    let line = err.lines().find(|l| l.starts_with("Error:")).unwrap_or_else(|| panic!("no error line: {err}"));
    assert!(line.contains("policy.model = \"models/absent\""), "{err}");
    assert!(line.contains(&a.join("models/absent").display().to_string()) && line.contains(&elsewhere.join("models/absent").display().to_string()), "both places tried: {err}");
    assert!(!err.to_lowercase().contains("stack backtrace"), "{err}");
}

/// `ingest --tenant`: every turn of the file is the tenant's (issue 41); an invalid tenant id is a
/// one-line error before anything is read, and without the flag the turns are the `default` tenant's.
#[test]
fn ingest_tenant_marks_every_turn_and_an_invalid_one_is_refused() {
    let log = common::root().join("tests/fixtures/agent-logs/mini-swe-agent__claude-sonnet-4__test_output.json");
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let (out, _) = on_broker(&["ingest", "--tenant", "team-a"], &prefix, &lake, &[log.to_str().unwrap()]);
    assert!(out.contains("interactions=10 "), "{out}");
    assert_eq!(sql(&lake, "SELECT tenant, count(*) AS n FROM interactions GROUP BY tenant"), "tenant,n\nteam-a,10\n");
    let (ok, _, err) = common::run_bin(&["ingest", "--tenant", "team a", "--lake", lake.to_str().unwrap(), log.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("--tenant: tenant id \"team a\" has the character ' ' at byte 4"), "{err}");
    assert!(!err.to_lowercase().contains("stack backtrace"), "{err}");
    let lake2 = dir.path().join("lake2");
    on_broker(&["ingest"], &format!("{prefix}-2"), &lake2, &[log.to_str().unwrap()]);
    assert_eq!(sql(&lake2, "SELECT tenant, count(*) AS n FROM interactions GROUP BY tenant"), "tenant,n\ndefault,10\n");
}

/// `NEXTSTATE_<TABLE>__<KEY>` variables reach the pipeline a command loads, with `--pipeline` and
/// without (the built-in one): a key the variable names is parsed and checked like one in the file
/// (issue 42; the override itself is checked with hand values in `config::tests`).
#[test]
fn environment_variables_override_pipeline_keys_of_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let (lake, empty) = (dir.path().join("lake"), dir.path().join("empty"));
    std::fs::create_dir_all(&empty).unwrap();
    let pipeline = common::root().join("pipelines/combined.toml");
    // `ingest` of an empty folder on the embedded bus: it loads the pipeline and reads nothing.
    let run = |vars: &[(&str, &str)], with_pipeline: bool| {
        let mut args = vec!["ingest", "--lake", lake.to_str().unwrap()];
        if with_pipeline {
            args.extend(["--pipeline", pipeline.to_str().unwrap()]);
        }
        args.push(empty.to_str().unwrap());
        let out = std::process::Command::new(common::bin()).args(&args).envs(vars.iter().copied()).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for with_pipeline in [false, true] {
        let (ok, out, err) = run(&[("NEXTSTATE_TRAINER__LR", "0.0005"), ("NEXTSTATE_JUDGE__M", "5")], with_pipeline);
        assert!(ok, "{err}");
        assert!(out.starts_with("ingest: files=0 read=0"), "{out}");
        let (ok, _, err) = run(&[("NEXTSTATE_JUDGE__M", "many")], with_pipeline);
        assert!(!ok);
        assert!(err.contains("invalid type: found string \"many\", expected u32 for key \"JUDGE.M\""), "{err}");
        let (ok, _, err) = run(&[("NEXTSTATE_TRAINER__LRR", "1")], with_pipeline);
        assert!(!ok);
        assert!(err.contains("unknown field: found `lrr`"), "{err}");
        assert!(!err.to_lowercase().contains("stack backtrace"), "{err}");
    }
}

/// `replay --sql` sets the tenant with a SQL expression (issue 41): the replayed rows and the signals
/// built from them in the fresh lake carry the query's `tenant` (embedded bus, no broker needed).
#[test]
fn replay_sets_the_tenant_with_a_sql_expression() {
    let log = common::root().join("tests/fixtures/agent-logs/mini-swe-agent__claude-sonnet-4__test_output.json");
    let dir = tempfile::tempdir().unwrap();
    let (lake, out) = (dir.path().join("lake"), dir.path().join("replayed"));
    let (ok, _, err) = common::run_bin(&["ingest", "--lake", lake.to_str().unwrap(), log.to_str().unwrap()]);
    assert!(ok, "{err}");
    let query = "SELECT * EXCLUDE (tenant), 'alice' AS tenant FROM interactions";
    let (ok, stdout, err) = common::run_bin(&["replay", "--sql", query, "--lake", lake.to_str().unwrap(), "--lake-out", out.to_str().unwrap(), "--only", "signals"]);
    assert!(ok, "{err}");
    assert!(stdout.contains("rows=10 "), "{stdout}");
    let q = "SELECT 'interactions' AS t, tenant, count(*) AS n FROM interactions GROUP BY tenant UNION ALL SELECT 'signals', tenant, count(*) FROM signals GROUP BY tenant ORDER BY t";
    assert_eq!(sql(&out, q), "t,tenant,n\ninteractions,alice,10\nsignals,alice,10\n");
    assert_eq!(sql(&lake, "SELECT tenant, count(*) AS n FROM interactions GROUP BY tenant"), "tenant,n\ndefault,10\n", "the source lake is unchanged");
}
