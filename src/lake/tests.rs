use super::*;
use crate::schema::{DeadLetter, Lineage};

fn dl(i: i64, day_ms: i64) -> DeadLetter {
    let mut d = DeadLetter::new("test", "x", format!("reason {i}"), format!("payload {i}").as_bytes(), Lineage { source_line: Some(i), ..Default::default() });
    d.created_time = day_ms;
    d
}

#[test]
fn writes_one_file_per_date_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let day1 = 1_700_000_000_000; // 2023-11-14
    let day2 = day1 + 86_400_000;
    let rows = vec![dl(1, day1), dl(2, day2), dl(3, day1)];
    let paths = lake.write_rows(&rows, "w1", 1).unwrap();
    assert_eq!(paths.len(), 2);
    let files = lake.files("dead_letters").unwrap();
    let dates: Vec<&str> = files.iter().map(|f| f.date.as_str()).collect();
    assert_eq!(dates, vec!["2023-11-14", "2023-11-15"]);
    let mut back = lake.read_table::<DeadLetter>().unwrap();
    back.sort_by_key(|d| d.source_line);
    assert_eq!(back, vec![rows[0].clone(), rows[1].clone(), rows[2].clone()]);
    assert_eq!(lake.keys::<DeadLetter>().unwrap().len(), 3);
}

#[test]
fn kafka_file_names_record_offsets_and_rewrites_are_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let rows = [dl(1, 0), dl(2, 0)];
    let refs: Vec<&DeadLetter> = rows.iter().collect();
    let stem = kafka_stem("mock-1", "dead_letters", 3, 10, 11);
    lake.write_file::<DeadLetter>("1970-01-01", &stem, &refs).unwrap();
    // the same range again (a restarted sink) is a no-op
    lake.write_file::<DeadLetter>("1970-01-01", &stem, &refs[..1]).unwrap();
    assert_eq!(lake.read_table::<DeadLetter>().unwrap().len(), 2);
    let next = lake.next_offsets("dead_letters").unwrap();
    assert_eq!(next.get(&("mock-1".to_string(), "dead_letters".to_string(), 3)), Some(&12));
    match &lake.files("dead_letters").unwrap()[0].origin {
        FileOrigin::Kafka { partition, first, last, .. } => assert_eq!((*partition, *first, *last), (3, 10, 11)),
        o => panic!("unexpected origin {o:?}"),
    }
}

#[test]
fn temporary_files_are_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let p = lake.table_dir("dead_letters").join("date=2024-01-01");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join(".w~x~000001.parquet.tmp"), b"partial").unwrap();
    assert!(lake.files("dead_letters").unwrap().is_empty());
}

#[test]
fn empty_range_files_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    lake.write_file::<DeadLetter>("2024-01-01", &kafka_stem("c", "t", 0, 0, 4), &[]).unwrap();
    assert!(lake.read_table::<DeadLetter>().unwrap().is_empty());
    assert_eq!(lake.next_offsets("dead_letters").unwrap().values().copied().collect::<Vec<_>>(), vec![5]);
}

#[tokio::test]
async fn stray_parquet_files_are_named_with_what_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let paths = lake.write_rows(&[dl(1, 0), dl(2, 0)], "w1", 1).unwrap();
    assert!(lake.stray_files("dead_letters").unwrap().is_empty(), "the lake's own files are not stray");
    // A user drops copies of that file: one directly in the table folder, one under another name in the
    // date folder and a hidden one there (sql reads hidden .parquet files too); the lake's own temporary
    // files (.parquet.tmp) are not Parquet files to anyone.
    let table = lake.table_dir("dead_letters");
    std::fs::copy(&paths[0], table.join("mine.parquet")).unwrap();
    let date_dir = paths[0].parent().unwrap();
    std::fs::copy(&paths[0], date_dir.join("export.parquet")).unwrap();
    std::fs::copy(&paths[0], date_dir.join(".hidden.parquet")).unwrap();
    std::fs::copy(&paths[0], date_dir.join(".k~x.parquet.tmp")).unwrap();
    let stray = lake.stray_files("dead_letters").unwrap();
    assert_eq!(
        stray,
        vec![
            (date_dir.join(".hidden.parquet"), StrayReason::ForeignName),
            (date_dir.join("export.parquet"), StrayReason::ForeignName),
            (table.join("mine.parquet"), StrayReason::OutsideDateFolder)
        ]
    );
    // What each reason says is what happens: sql reads the two date-folder copies only, the lake neither.
    assert_eq!(crate::sql::scalar_i64(&lake, "SELECT count(*) FROM dead_letters").await.unwrap(), 6);
    assert_eq!(lake.read_table::<DeadLetter>().unwrap().len(), 2);
    assert_eq!(crate::sql::stray_files(&lake).unwrap(), stray);
}
