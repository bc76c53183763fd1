//! The SQL surface over a fixture lake: every query in `tests/offline/sql/*.slt` with its expected output
//! run by the `sqllogictest` crate, as DataFusion tests its own SQL.
use crate::common;

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
    let args = nextstate::stages::source::IngestArgs { files, format: None, default_turn_type: nextstate::schema::TurnType::Main, sink: true, progress: false, tenant: None };
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
    for f in std::fs::read_dir(common::root().join("tests/offline/sql")).unwrap().flatten() {
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

/// `train_steps` files written before schema version 2 (without the reward, learning-rate, length,
/// tokens/s, staleness and advantage-sign columns) and before version 3 (without the advantage's reward
/// and teacher parts) still read, through the lake and through SQL: the newer columns are null.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_steps_files_of_schema_version_1_read_with_null_new_columns() {
    use nextstate::schema::{field_refs, Table, TrainStep};
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let row = TrainStep {
        schema_version: 1,
        loss: 0.5,
        pg_loss: 0.5,
        entropy: 1.0,
        rollout_logprob_abs_diff: 0.01,
        grad_norm: 1.0,
        samples: 2,
        tokens: 8,
        seconds: 0.5,
        created_time: 1_700_000_000_000,
        ..TrainStep::new("r", 1, "binary")
    };
    // Rewrites the row's file with the first `columns` columns of `row` (an older schema version's),
    // leaving out `tenant`, which came later (issue 41) though it sits beside `run_id`.
    let rewrite = |row: &TrainStep, path: &std::path::Path, columns: usize, last: &str| {
        let batch = serde_arrow::to_record_batch(&field_refs::<TrainStep>(), &vec![row.clone()]).unwrap();
        let keep: Vec<usize> = batch.schema().fields().iter().enumerate().filter(|(_, f)| f.name() != "tenant").map(|(i, _)| i).take(columns).collect();
        let old = batch.project(&keep).unwrap();
        assert_eq!(old.schema().field(columns - 1).name(), last);
        let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path).unwrap(), old.schema(), None).unwrap();
        w.write(&old).unwrap();
        w.close().unwrap();
    };
    // Write it as the lake would, then rewrite the file with the 20 columns of schema version 1.
    let path = lake.write_rows(&[row.clone()], "w", 1).unwrap().remove(0);
    rewrite(&row, &path, 20, "created_time");
    assert_eq!(lake.read_table::<TrainStep>().unwrap(), vec![row.clone()]);
    let out = nextstate::sql::query(&lake, &format!("SELECT step, reward_mean IS NULL AS r, staleness_max IS NULL AS s, advantage_sign_by_type IS NULL AS a FROM {}", TrainStep::NAME)).await.unwrap();
    let text = nextstate::sql::render(&out, nextstate::sql::OutputFormat::Csv).unwrap();
    assert!(text.contains("1,true,true,true"), "{text}");

    // A version-2 file (31 columns, with the figures but without the advantage's parts).
    let v2 = TrainStep { schema_version: 2, reward_mean: Some(0.25), positive_advantage_fraction: Some(0.5), ..row };
    rewrite(&v2, &path, 31, "advantage_sign_by_type");
    assert_eq!(lake.read_table::<TrainStep>().unwrap(), vec![v2]);
    let out = nextstate::sql::query(&lake, &format!("SELECT reward_mean, advantage_reward_abs_mean IS NULL AS r, teacher_term_negative_fraction IS NULL AS t FROM {}", TrainStep::NAME)).await.unwrap();
    let text = nextstate::sql::render(&out, nextstate::sql::OutputFormat::Csv).unwrap();
    assert!(text.contains("0.25,true,true"), "{text}");
}

/// Every way a query could write or reach outside the lake is refused before it runs, through the path
/// every SQL entry point takes ([`nextstate::sql::query`], [`nextstate::sql::read_only_frame`]): no
/// file appears, the lake's files are unchanged, and the error names what was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_queries_run_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let lake = fixture_lake(&dir.path().join("lake")).await;
    let files_before = lake.files("interactions").unwrap().len() + lake.files("dead_letters").unwrap().len();
    let copied = dir.path().join("copied.csv");
    let copy = format!("COPY (SELECT interaction_id FROM interactions) TO '{}'", copied.display());
    let refused = [
        (copy.clone(), "COPY"),
        (format!("EXPLAIN ANALYZE {copy}"), "COPY"),
        ("INSERT INTO dead_letters SELECT * FROM dead_letters LIMIT 1".to_string(), "Insert"),
        ("CREATE EXTERNAL TABLE pw (line VARCHAR) STORED AS CSV LOCATION '/etc/passwd'".to_string(), "CreateExternalTable"),
        ("CREATE TABLE t AS SELECT 1".to_string(), "CreateMemoryTable"),
        ("CREATE VIEW v AS SELECT 1".to_string(), "CreateView"),
        ("DROP TABLE interactions".to_string(), "DropTable"),
        ("SET datafusion.execution.batch_size = 1".to_string(), "SetVariable"),
    ];
    for (q, what) in &refused {
        let e = nextstate::sql::query(&lake, q).await.expect_err(q);
        assert!(matches!(e, nextstate::Error::InvalidInput(_)), "{q}: {e:?}");
        assert_eq!(e.domain(), nextstate::error::Domain::User, "{q}");
        let text = e.to_string();
        assert!(text.contains("only read-only queries") && text.contains(what), "{q}: {text}");
    }
    assert!(!copied.exists(), "COPY wrote {}", copied.display());
    let files_after = lake.files("interactions").unwrap().len() + lake.files("dead_letters").unwrap().len();
    assert_eq!(files_after, files_before, "a refused statement changed the lake");
    // the table is still the lake's, and queries (with subqueries, CTEs, EXPLAIN, SHOW) still run
    let n = nextstate::sql::scalar_i64(&lake, "WITH t AS (SELECT * FROM interactions) SELECT count(*) FROM t WHERE interaction_id IN (SELECT interaction_id FROM interactions)").await.unwrap();
    assert!(n > 0);
    nextstate::sql::query(&lake, "EXPLAIN SELECT count(*) FROM interactions").await.unwrap();
    nextstate::sql::query(&lake, "SHOW TABLES").await.unwrap();
    // the other entry points: train/loss/ablate read samples through query_samples; export plans its own
    let e = nextstate::stages::train::query_samples(&lake, &copy).await.unwrap_err();
    assert!(matches!(e, nextstate::Error::InvalidInput(_)), "{e:?}");
    let out = dir.path().join("export");
    let e = nextstate::export::export(&lake, &copy, nextstate::export::ExportFormat::Hf, &out, &Default::default()).await.unwrap_err();
    assert!(matches!(e, nextstate::Error::InvalidInput(_)), "{e:?}");
    assert!(!copied.exists() && !out.exists(), "export ran the COPY or wrote its folder");
}

/// The three output formats on the results a user meets: a nested column in CSV is its JSON text, a
/// result without rows still prints its columns, and JSON keeps NaN and the infinities apart from null.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_formats_write_nested_values_empty_results_and_non_finite_floats() {
    use nextstate::sql::{render, OutputFormat};
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let q = "SELECT 1 AS n, [1, 2] AS xs, named_struct('a', 'x', 'b', 2.5) AS s, CAST(NULL AS INT[]) AS none";
    let b = nextstate::sql::query(&lake, q).await.unwrap();
    assert_eq!(render(&b, OutputFormat::Csv).unwrap(), "n,xs,s,none\n1,\"[1,2]\",\"{\"\"a\"\":\"\"x\"\",\"\"b\"\":2.5}\",\n");
    let empty = nextstate::sql::query(&lake, "SELECT interaction_id, session_id FROM interactions").await.unwrap();
    assert_eq!(render(&empty, OutputFormat::Csv).unwrap(), "interaction_id,session_id\n");
    let table = render(&empty, OutputFormat::Table).unwrap();
    assert!(table.contains("| interaction_id | session_id |") && table.ends_with("\n0 rows"), "{table}");
    assert_eq!(render(&empty, OutputFormat::Json).unwrap(), "");
    let q = "SELECT * FROM (VALUES (1, CAST('NaN' AS DOUBLE)), (2, CAST('inf' AS DOUBLE)), (3, CAST('-inf' AS DOUBLE)), (4, 0.25), (5, NULL)) AS t(i, x)";
    let b = nextstate::sql::query(&lake, &format!("SELECT i, x, CAST(x AS REAL) AS x32, [x] AS xs FROM ({q}) ORDER BY i")).await.unwrap();
    assert_eq!(
        render(&b, OutputFormat::Json).unwrap(),
        concat!(
            "{\"i\":1,\"x\":\"NaN\",\"x32\":\"NaN\",\"xs\":[\"NaN\"]}\n",
            "{\"i\":2,\"x\":\"Infinity\",\"x32\":\"Infinity\",\"xs\":[\"Infinity\"]}\n",
            "{\"i\":3,\"x\":\"-Infinity\",\"x32\":\"-Infinity\",\"xs\":[\"-Infinity\"]}\n",
            "{\"i\":4,\"x\":0.25,\"x32\":0.25,\"xs\":[0.25]}\n",
            "{\"i\":5,\"xs\":[null]}\n",
        )
    );
}
