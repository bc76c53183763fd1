//! The commands as a user runs them, through the real broker: `ingest` of every real log, `run --only
//! signals,sinks --until-idle`, and `sql`; counts checked by hand against the raw files (tau-bench:
//! 2,454 assistant turns, 1,164 followed by tool results and 1,290 by the customer; mini-swe-agent: 10
//! turns answered by the shell, as role `user`); AgentBench's null histories become dead letters with a
//! reason and exit status 0. Lineage: every signal names the `interactions` record it was read from.
mod common;

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

#[test]
fn ingest_pair_and_query_the_real_logs_through_the_broker() {
    let shared = common::root().join("../shared/data/agent-logs");
    if !shared.exists() {
        common::missing("../shared/data/agent-logs not present");
        return;
    }
    let brokers = common::brokers();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let data = ["--brokers", brokers.as_str(), "--topic-prefix", prefix.as_str(), "--lake", lake.to_str().unwrap()];
    let files: Vec<String> = logs().iter().map(|p| p.display().to_string()).collect();
    let mut args = vec!["ingest"];
    args.extend(data);
    args.extend(files.iter().map(String::as_str));
    let (ok, out, err) = common::run_bin(&args);
    assert!(ok, "ingest failed: {err}");
    assert!(out.contains("interactions=2484 dead_letters=22 (null_history=22)"), "{out}");
    assert!(err.contains("format tau-bench (auto-detected)"), "says which format it chose: {err}");

    // Produced through the broker, landed by the sinks: the lake holds exactly what was produced.
    assert_eq!(sql(&lake, "SELECT count(*) AS n FROM interactions"), "n\n2484\n");
    assert_eq!(
        sql(&lake, "SELECT reason_code, count(*) AS n FROM dead_letters GROUP BY reason_code"),
        "reason_code,n\nnull_history,22\n"
    );

    let mut args = vec!["run", "--pipeline", "pipelines/combined.toml", "--only", "signals,sinks", "--until-idle", "--group-instance-id", "cli-1"];
    args.extend(data);
    let (ok, _out, err) = common::run_bin(&args);
    assert!(ok, "run failed: {err}");
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
    let brokers = common::brokers();
    let prefix = common::prefix();
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("lake");
    let data = ["--brokers", brokers.as_str(), "--topic-prefix", prefix.as_str(), "--lake", lake.to_str().unwrap()];
    let tau = tau.display().to_string();
    let mut args = vec!["ingest"];
    args.extend(data);
    args.push(&tau);
    let (ok, out, err) = common::run_bin(&args);
    assert!(ok, "ingest failed: {err}");
    assert!(out.contains("interactions=2454 dead_letters=0"), "{out}");
    let mut args = vec!["run", "--pipeline", "pipelines/combined.toml", "--only", "signals,sinks", "--until-idle", "--group-instance-id", "cli-lineage"];
    args.extend(data);
    let (ok, _out, err) = common::run_bin(&args);
    assert!(ok, "run failed: {err}");

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
