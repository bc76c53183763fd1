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
    let first = lake.write_file::<DeadLetter>("1970-01-01", &stem, &refs).unwrap();
    assert_eq!(first.bytes, std::fs::metadata(&first.path).unwrap().len());
    // the same range again (a restarted sink) is a no-op that writes 0 bytes
    let again = lake.write_file::<DeadLetter>("1970-01-01", &stem, &refs[..1]).unwrap();
    assert_eq!((again.path, again.bytes), (first.path, 0));
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

/// Two interleaved sessions of 30 turns whose request history grows by two ~1 kB messages a turn
/// (pseudo-random letters, so ZSTD cannot shrink a message by itself much): the file holds each
/// session's rows together in turn order, `request_messages` has no dictionary, and its compressed
/// bytes stay within 1.3× of the session's unique messages compressed once with the same codec (the
/// floor of a message-once layout). Before the history layout (1 MiB pages, dictionary, rows in offset
/// order) this column took 1.77× that floor.
#[test]
fn long_sessions_are_grouped_and_their_history_costs_about_its_new_content() {
    use crate::schema::Interaction;
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut text = |n: usize| -> String {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (b'a' + (seed % 26) as u8) as char
            })
            .collect()
    };
    let turns = 30;
    let mut unique = String::new();
    let mut rows = vec![];
    let mut history: HashMap<&str, Vec<serde_json::Value>> = HashMap::new();
    for t in 0..turns {
        for s in ["b", "a"] {
            let h = history.entry(s).or_default();
            for role in ["user", "assistant"] {
                let m = serde_json::json!({"role": role, "content": text(1000)});
                unique.push_str(&m.to_string());
                h.push(m);
            }
            rows.push(Interaction::new(s, t, &serde_json::Value::Array(h.clone()).to_string(), "ok", 1_700_000_000_000));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path()).unwrap();
    let refs: Vec<&Interaction> = rows.iter().collect();
    let path = lake.write_file::<Interaction>("2023-11-14", &kafka_stem("c", "interactions", 0, 0, 59), &refs).unwrap().path;
    let back: Vec<(String, i32)> = read_file::<Interaction>(&path).unwrap().into_iter().map(|r| (r.session_id, r.turn_index)).collect();
    let expected: Vec<(String, i32)> = ["a", "b"].iter().flat_map(|s| (0..turns).map(move |t| (s.to_string(), t))).collect();
    assert_eq!(back, expected);
    let reader = SerializedFileReader::new(File::open(&path).unwrap()).unwrap();
    let rg = reader.metadata().row_group(0);
    let col = rg.columns().iter().find(|c| c.column_path().string() == "request_messages").unwrap();
    assert!(col.encodings().all(|e| !matches!(e, parquet::basic::Encoding::RLE_DICTIONARY | parquet::basic::Encoding::PLAIN_DICTIONARY)), "{:?}", col.encodings().collect::<Vec<_>>());
    let floor = zstd::bulk::compress(unique.as_bytes(), 3).unwrap().len() as f64;
    let ratio = col.compressed_size() as f64 / floor;
    eprintln!("request_messages {} bytes compressed, unique messages {} bytes ZSTD: {ratio:.2}x", col.compressed_size(), floor);
    assert!(ratio <= 1.3, "request_messages {} bytes against a floor of {floor} bytes ({ratio:.2}x)", col.compressed_size());
}
