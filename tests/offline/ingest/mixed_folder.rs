//! `nextstate ingest DIR` over one folder holding a file of every format in the fixture folders
//! (tests/fixtures/agent-logs and agent-logs-2026): each file is detected as its own format, as when it
//! is ingested alone, and lands in the lake with the same interactions (issue 40). The expected format
//! and count of each file come from the library (`detect`, then `read_path` of the file alone), so a
//! fixture added with a new adapter is covered without editing this test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::common::INGEST_MS;
use nextstate::ingest::{detect, is_log_file_name, read_path, FormatChoice, IngestOptions, DEFAULT_HEAD_BYTES};

/// Distinct formats among the fixture files when this test was written (8 in agent-logs, 14 in
/// agent-logs-2026): fewer seen means a file is no longer detected as its own format.
const FORMATS_AT_LEAST: usize = 22;

/// The log files of the fixture folders (what `ingest DIR` would read there), sorted.
fn fixture_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut out = vec![];
    for folder in ["agent-logs", "agent-logs-2026"] {
        for e in std::fs::read_dir(root.join(folder)).unwrap().flatten() {
            let p = e.path();
            if p.is_file() && is_log_file_name(&e.file_name().to_string_lossy()) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_folder_mixing_every_fixture_format_detects_each_file_as_when_it_is_ingested_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mixed = dir.path().join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    // Each file alone: its detected format and interaction count (files that detect as nothing are
    // dead letters in both runs and not counted here).
    let mut want: BTreeMap<String, (String, u64)> = BTreeMap::new();
    for src in fixture_files() {
        let name = src.file_name().unwrap().to_string_lossy().into_owned();
        let copy = mixed.join(&name);
        assert!(!copy.exists(), "two fixture files are named {name}");
        std::fs::copy(&src, &copy).unwrap();
        let Ok(d) = detect(&copy, DEFAULT_HEAD_BYTES) else { continue };
        let alone = read_path(&copy, FormatChoice::Auto, &IngestOptions::new(INGEST_MS), &mut |_| {}, &mut |_| Ok(())).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(alone.format, d.format, "{name}");
        want.insert(copy.display().to_string(), (d.format.name().to_string(), alone.interactions));
    }
    let formats: BTreeSet<&str> = want.values().map(|(f, _)| f.as_str()).collect();
    assert!(formats.len() >= FORMATS_AT_LEAST, "only {} formats among the fixtures: {formats:?}", formats.len());

    let lake = dir.path().join("lake");
    let (ok, out, err) = super::test_env::run_bin(&["ingest", "--lake", lake.to_str().unwrap(), mixed.to_str().unwrap()]);
    assert!(ok, "ingest failed: {err}");

    // The command's own per-file lines: the format it chose, and the interactions it read.
    for (file, (format, n)) in &want {
        assert!(err.contains(&format!("{file}: format {format} (auto-detected)")), "{file} not read as {format}:\n{err}");
        let summary = err.lines().find(|l| l.starts_with(&format!("{file}: {format}: "))).unwrap_or_else(|| panic!("no summary line of {file}:\n{err}"));
        assert!(summary.contains(&format!("→ {n} interactions in ")), "{n} interactions expected: {summary}");
    }
    let total: u64 = want.values().map(|(_, n)| n).sum();
    assert!(out.contains(&format!("interactions={total} ")), "{out}");

    // The lake: per file, its format and its rows, as when the file was ingested alone.
    let (ok, csv, err) = super::test_env::run_bin(&[
        "sql",
        "--format",
        "csv",
        "--lake",
        lake.to_str().unwrap(),
        "SELECT source_file, source_format, count(*) AS n FROM interactions GROUP BY source_file, source_format ORDER BY source_file, source_format",
    ]);
    assert!(ok, "sql failed: {err}");
    let got: BTreeMap<String, (String, u64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let mut f = l.rsplitn(3, ',');
            let (n, format, file) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            let file = file.trim_matches('"').to_string();
            assert!(!file.is_empty());
            (file, (format.to_string(), n.parse().unwrap()))
        })
        .collect();
    let want_rows: BTreeMap<String, (String, u64)> = want.iter().filter(|(_, (_, n))| *n > 0).map(|(k, v)| (k.clone(), v.clone())).collect();
    assert_eq!(got, want_rows, "per file (format, rows) in the lake vs each file alone");
    let seen: BTreeSet<&str> = got.values().map(|(f, _)| f.as_str()).collect();
    let with_rows: BTreeSet<&str> = want_rows.values().map(|(f, _)| f.as_str()).collect();
    assert_eq!(seen, with_rows);
}
