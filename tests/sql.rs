//! The SQL surface over a fixture lake: every query in `tests/sql/*.slt` with its expected output
//! (DataFusion's sqllogictest habit, in a small format of our own: `query`, SQL, `----`, CSV rows).
mod common;

use nextstate::lake::Lake;

/// Builds the fixture lake: the real fixture logs ingested and paired on the embedded bus.
async fn fixture_lake(dir: &std::path::Path) -> Lake {
    let fx = common::root().join("tests/fixtures/agent-logs");
    let files: Vec<std::path::PathBuf> = ["agentbench__medagentbench-std__gemini-2.0__error.jsonl", "mini-swe-agent__claude-sonnet-4__test_output.json", "openhands__basic.json", "openhands__basic_interactions.json", "swe-agent__gpt4__pydicom__pydicom-1458.traj", "toolbench__G1_10_ChatGPT_DFS_woFilter_w2.json"]
        .iter()
        .map(|f| fx.join(f))
        .collect();
    let mut cfg = nextstate::config::PipelineConfig::embedded_default();
    cfg.lake = dir.to_path_buf();
    let args = nextstate::stages::source::IngestArgs { files, format: None, default_turn_type: nextstate::schema::TurnType::Main, sink: true, progress: false };
    nextstate::stages::source::ingest(&cfg, &args, nextstate::runtime::Stop::default()).await.unwrap();
    let opts = nextstate::stages::run::RunOptions { only: Some(vec!["signals".into(), "sinks".into()]), until_idle: true, ..Default::default() };
    nextstate::stages::run::run_pipeline(&cfg, &opts, nextstate::runtime::Stop::default()).await.unwrap();
    Lake::open(dir).unwrap()
}

fn parse(text: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let mut lines = text.lines().peekable();
    while let Some(l) = lines.next() {
        if l.trim() != "query" {
            continue;
        }
        let mut q = String::new();
        for l in lines.by_ref() {
            if l.trim() == "----" {
                break;
            }
            q.push_str(l);
            q.push('\n');
        }
        let mut expected = String::new();
        while let Some(l) = lines.peek() {
            if l.trim().is_empty() {
                break;
            }
            expected.push_str(lines.next().unwrap());
            expected.push('\n');
        }
        out.push((q, expected));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slt_files_over_the_fixture_lake() {
    let dir = tempfile::tempdir().unwrap();
    let lake = fixture_lake(dir.path()).await;
    let mut n = 0;
    for f in std::fs::read_dir(common::root().join("tests/sql")).unwrap().flatten() {
        let text = std::fs::read_to_string(f.path()).unwrap();
        for (q, expected) in parse(&text) {
            let batches = nextstate::sql::query(&lake, &q).await.unwrap_or_else(|e| panic!("{}: {q}: {e}", f.path().display()));
            let got = nextstate::sql::render(&batches, nextstate::sql::OutputFormat::Csv).unwrap();
            assert_eq!(got, expected, "{}: {q}", f.path().display());
            n += 1;
        }
    }
    assert!(n >= 6, "ran {n} queries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_table_or_column() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let e = nextstate::sql::query(&lake, "SELECT * FROM no_such_table").await.unwrap_err().to_string();
    assert!(e.contains("no_such_table"), "{e}");
    let e = nextstate::sql::query(&lake, "SELECT no_such_column FROM interactions").await.unwrap_err().to_string();
    assert!(e.contains("no_such_column"), "{e}");
    // an empty lake still has every table, with its schema
    assert_eq!(nextstate::sql::scalar_i64(&lake, "SELECT count(*) FROM samples").await.unwrap(), 0);
}
