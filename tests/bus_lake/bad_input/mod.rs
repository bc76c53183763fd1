//! The bad-input suite: a corpus of malformed and hostile inputs (truncated JSON, wrong types, huge
//! messages, deep nesting, invalid UTF-8, NaN/Infinity log-probs, mismatched token/log-prob lengths,
//! unknown roles, duplicate turns) through `nextstate ingest` and the capture proxy. Every bad record
//! gives a dead letter with a reason (ingest) or a 4xx (proxy); no panic, no hang, and the good records
//! around it come through.

use crate::common;

mod corpus;
mod files;
mod fuzz;
mod proxy;

use std::collections::BTreeMap;
use std::time::Duration;

use nextstate::bus::flow::EMBEDDED_MAX_RECORD_BYTES;
use nextstate::bus::Envelope;
use nextstate::ingest::{read_file, Format, IngestItem, IngestOptions};
use nextstate::lake::Lake;
use nextstate::schema::{DeadLetter, Interaction};

/// What the adapters made of one file: interactions, dead letters (code, reason).
fn adapters(path: &std::path::Path, format: Format) -> (Vec<Interaction>, Vec<(String, String)>) {
    let (mut rows, mut dead) = (vec![], vec![]);
    read_file(path, format, &IngestOptions::new(1_772_400_000_000), &mut |_| {}, &mut |item| {
        match item {
            IngestItem::Interaction(i) => rows.push(*i),
            IngestItem::DeadLetter(d) => dead.push((d.reason_code, d.reason)),
        }
        Ok(())
    })
    .expect("malformed content is never an error");
    (rows, dead)
}

#[test]
fn adapters_turn_every_bad_record_into_a_dead_letter_and_keep_the_good_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut report = vec![];
    let mut failures = vec![];
    for c in corpus::cases() {
        let path = dir.path().join(format!("{}.{}", c.name, c.ext));
        std::fs::write(&path, &c.bytes).unwrap();
        let (rows, dead) = adapters(&path, c.format.parse().unwrap());
        let mut codes: Vec<&str> = dead.iter().map(|d| d.0.as_str()).collect();
        codes.sort();
        for (code, reason) in &dead {
            assert!(!code.is_empty() && reason.len() >= 10, "{}: unclear dead letter {code:?}: {reason:?}", c.name);
        }
        report.push(format!("{:<40} {:>3} interactions  dead: {:?}", c.name, rows.len(), dead));
        if rows.len() != c.interactions || codes != c.dead {
            failures.push(format!("{}: got {} interactions and {codes:?}, want {} and {:?}", c.name, rows.len(), c.interactions, c.dead));
        }
        if let Some(note) = c.note {
            let kept: Vec<&Interaction> = rows.iter().filter(|r| r.notes.iter().any(|n| n.contains(note))).collect();
            if kept.len() != 1 {
                failures.push(format!("{}: want one row noting {note:?}, notes are {:?}", c.name, rows.iter().map(|r| &r.notes).collect::<Vec<_>>()));
            } else if kept[0].rollout_logprobs.is_some() {
                failures.push(format!("{}: the bad log-probs were kept", c.name));
            }
        }
        for r in &rows {
            if let Some(lp) = &r.rollout_logprobs {
                assert!(lp.iter().all(|x| x.is_finite()), "{}: non-finite log-prob stored", c.name);
                assert_eq!(Some(lp.len()), r.response_token_ids.as_ref().map(Vec::len), "{}: log-probs and token ids differ in length", c.name);
            }
            assert!(r.response_token_ids.iter().chain(&r.prompt_token_ids).flatten().all(|&t| t >= 0), "{}: negative token id stored", c.name);
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The whole corpus through the `nextstate ingest` binary on the embedded bus with its lake sinks:
/// exits cleanly within the limit, and the lake holds exactly what the adapters give (interactions and
/// dead letters with their reasons), except that an interaction whose bus record is over the embedded
/// bus's 2 MiB limit is a `record_too_large` dead letter instead.
#[test]
fn ingest_command_survives_the_corpus_and_loses_nothing() {
    let dir = tempfile::Builder::new().disable_cleanup(std::env::var("KEEP").is_ok()).tempdir().unwrap();
    eprintln!("DIR {}", dir.path().display());
    let lake = dir.path().join("lake");
    let mut want_rows: BTreeMap<String, usize> = BTreeMap::new();
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut want_dead: BTreeMap<String, usize> = BTreeMap::new();
    let mut files = vec![];
    for c in corpus::cases() {
        let path = dir.path().join(format!("{}.{}", c.name, c.ext));
        std::fs::write(&path, &c.bytes).unwrap();
        // One command per format (the `--format` flag applies to every file of a command).
        files.push((c.format, path));
    }
    let mut tried = 0;
    for format in ["openai-chat", "openclaw", "swe-agent", "mini-swe-agent", "openhands", "tau-bench", "toolbench", "agentbench"] {
        let these: Vec<&std::path::PathBuf> = files.iter().filter(|(f, _)| *f == format).map(|(_, p)| p).collect();
        for p in &these {
            let (rows, dead) = adapters(p, format.parse().unwrap());
            for r in rows {
                // The embedded bus refuses records over its limit: those become dead letters.
                let bytes = serde_json::to_vec(&Envelope { row: &r, carry: None }).unwrap().len() as u64;
                if bytes > EMBEDDED_MAX_RECORD_BYTES {
                    *want_dead.entry("record_too_large".into()).or_default() += 1;
                    continue;
                }
                names.insert(r.interaction_id.clone(), format!("{} turn {} ({} bytes of request)", r.session_id, r.turn_index, r.request_messages.len()));
                *want_rows.entry(r.interaction_id).or_default() += 1;
            }
            for d in dead {
                *want_dead.entry(d.0).or_default() += 1;
            }
        }
        let mut args = common::args(&["ingest", "--format", format, "--lake", &lake.display().to_string()]);
        args.extend(these.iter().map(|p| p.display().to_string()));
        let log = dir.path().join(format!("ingest-{format}.log"));
        let mut p = common::Proc::spawn("ingest", &args, &log);
        let status = p.wait_for(Duration::from_secs(120));
        assert!(status.is_some_and(|s| s.success()), "ingest --format {format} did not exit cleanly within 120 s: {status:?}\n{}", p.log_tail(40));
        tried += these.len();
    }
    let lake = Lake::open(&lake).unwrap();
    let rows: Vec<Interaction> = lake.read_table().unwrap();
    let mut got_rows: BTreeMap<String, usize> = BTreeMap::new();
    for r in rows {
        *got_rows.entry(r.interaction_id).or_default() += 1;
    }
    let missing: Vec<&String> = want_rows.keys().filter(|k| !got_rows.contains_key(*k)).map(|k| &names[k]).collect();
    let extra: Vec<&String> = got_rows.keys().filter(|k| !want_rows.contains_key(*k)).collect();
    let twice: Vec<&String> = got_rows.iter().filter(|(_, n)| **n > 1).map(|(k, _)| k).collect();
    assert!(missing.is_empty() && extra.is_empty() && twice.is_empty(), "interactions in the lake: missing {missing:?}, unexpected {extra:?}, more than once {twice:?}");
    let dead: Vec<DeadLetter> = lake.read_table().unwrap();
    let mut got_dead: BTreeMap<String, usize> = BTreeMap::new();
    for d in &dead {
        assert_eq!(d.stage, "ingest");
        *got_dead.entry(d.reason_code.clone()).or_default() += 1;
    }
    assert_eq!(got_dead, want_dead, "dead letters in the lake");
    eprintln!("ingest: {tried} corpus files, {} interactions and {} dead letters in the lake", got_rows.len(), dead.len());
}
