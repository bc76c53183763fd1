//! Fuzzes every ingest adapter (`nextstate::ingest::read_file`) and format detection
//! (`detect_bytes`). The first byte picks the format (`Format::ALL[b % 8]`); the rest is the file.
//! Asserts: no panic, malformed content is never an error, every JSONL line of `openai-chat` and
//! `openclaw` becomes exactly one interaction or dead letter, and every stored row has valid token
//! data (non-negative ids, finite log-probs, one per response token).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nextstate::ingest::{detect_bytes, read_file, Format, IngestItem, IngestOptions};

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let format = Format::ALL[which as usize % Format::ALL.len()];
    let _ = detect_bytes(body);
    let path = std::env::temp_dir().join(format!("nextstate-fuzz-{}.in", std::process::id()));
    std::fs::write(&path, body).expect("temp file");
    let (mut rows, mut dead) = (0u64, 0u64);
    let summary = read_file(&path, format, &IngestOptions::new(1_772_400_000_000), &mut |_| {}, &mut |item| {
        match item {
            IngestItem::Interaction(r) => {
                rows += 1;
                if let Some(lp) = &r.rollout_logprobs {
                    assert!(lp.iter().all(|x| x.is_finite()), "non-finite log-prob stored");
                    if let Some(ids) = &r.response_token_ids {
                        assert_eq!(lp.len(), ids.len(), "log-probs and token ids differ in length");
                    }
                }
                assert!(r.response_token_ids.iter().chain(&r.prompt_token_ids).flatten().all(|&t| t >= 0), "negative token id stored");
            }
            IngestItem::DeadLetter(d) => {
                dead += 1;
                assert!(!d.reason_code.is_empty() && !d.reason.is_empty(), "dead letter without a reason");
            }
        }
        Ok(())
    })
    .expect("malformed content is never an error");
    assert_eq!((summary.interactions, summary.dead_letters), (rows, dead), "summary counts what was handed out");
    if matches!(format, Format::OpenAiChat | Format::OpenClaw) {
        assert_eq!(rows + dead, summary.records, "every line becomes one interaction or one dead letter");
    }
});
