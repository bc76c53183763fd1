//! The SQL surface over a fixture lake: every query in `tests/sql/*.slt` with its expected output
//! run by the `sqllogictest` crate, as DataFusion tests its own SQL.
mod common;

use arrow::util::display::array_value_to_string;
use nextstate::lake::Lake;
use sqllogictest::{DBOutput, DefaultColumnType};

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

/// The lake as a sqllogictest database: each query runs through [`nextstate::sql::query`], the path
/// `nextstate sql` takes, and its values are printed as Arrow's display prints them (NULL for a null).
struct LakeDb(Lake);

#[async_trait::async_trait]
impl sqllogictest::AsyncDB for LakeDb {
    type Error = nextstate::Error;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, nextstate::Error> {
        let batches = nextstate::sql::query(&self.0, sql).await?;
        let Some(first) = batches.first() else { return Ok(DBOutput::Rows { types: vec![], rows: vec![] }) };
        let types = first
            .schema()
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                t if t.is_integer() => DefaultColumnType::Integer,
                t if t.is_floating() => DefaultColumnType::FloatingPoint,
                _ => DefaultColumnType::Text,
            })
            .collect();
        let mut rows = vec![];
        for b in &batches {
            for r in 0..b.num_rows() {
                let row = b.columns().iter().map(|c| if c.is_null(r) { Ok("NULL".to_string()) } else { array_value_to_string(c, r) }).collect::<Result<Vec<_>, _>>()?;
                rows.push(row);
            }
        }
        Ok(DBOutput::Rows { types, rows })
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "nextstate"
    }

    async fn sleep(dur: std::time::Duration) {
        tokio::time::sleep(dur).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slt_files_over_the_fixture_lake() {
    let dir = tempfile::tempdir().unwrap();
    let lake = fixture_lake(dir.path()).await;
    let mut runner = sqllogictest::Runner::new(|| {
        let lake = lake.clone();
        async move { Ok::<_, nextstate::Error>(LakeDb(lake)) }
    });
    // the column types in each `query` line must match what the lake returns
    runner.with_column_validator(sqllogictest::strict_column_validator);
    let mut n = 0;
    for f in std::fs::read_dir(common::root().join("tests/sql")).unwrap().flatten() {
        runner.run_file_async(f.path()).await.unwrap_or_else(|e| panic!("{}: {}", f.path().display(), e.display(false)));
        n += 1;
    }
    assert!(n >= 1, "ran {n} .slt files");
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
