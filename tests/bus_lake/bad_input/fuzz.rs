//! Cheap, bounded fuzzing that runs in the normal `cargo test` (the long runs are the cargo-fuzz
//! targets in `fuzz/`, `scripts/fuzz.sh`): arbitrary bytes, JSON-ish text, corrupted good records
//! and good records with arbitrary JSON values in their fields, through every ingest adapter
//! (`read_file`), format detection (`detect_bytes`) and the judge-output parser (`parse_vote`).
//! Asserts no panic, malformed content is never an error, every JSONL line of `openai-chat` and
//! `openclaw` becomes exactly one interaction or one dead letter, and stored token data is valid.
//! Per run: 96 cases per property; 4,120 adapter runs in all (768 arbitrary byte strings, 768
//! JSON-ish texts, 864 corrupted files, 96 records with an arbitrary field, 1,536 arbitrary
//! documents, 88 edge inputs) and 96 judge answers, in a few seconds.

use nextstate::ingest::{detect_bytes, read_file, Format, IngestItem, IngestOptions};
use nextstate::judge::{last_boxed_digit, parse_vote};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

/// Runs `bytes` through the adapter of `format`; returns (interactions, dead letters).
fn through(format: Format, bytes: &[u8]) -> Result<(u64, u64), TestCaseError> {
    let _ = detect_bytes(bytes);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("input");
    std::fs::write(&path, bytes).unwrap();
    let (mut rows, mut dead, mut bad) = (0u64, 0u64, None);
    let summary = read_file(&path, format, &IngestOptions::new(1_772_400_000_000), &mut |_| {}, &mut |item| {
        match item {
            IngestItem::Interaction(r) => {
                rows += 1;
                let lp_ok = r.rollout_logprobs.as_ref().is_none_or(|lp| lp.iter().all(|x| x.is_finite()) && r.response_token_ids.as_ref().is_none_or(|ids| ids.len() == lp.len()));
                let ids_ok = r.response_token_ids.iter().chain(&r.prompt_token_ids).flatten().all(|&t| t >= 0);
                if !(lp_ok && ids_ok) {
                    bad = Some(format!("invalid token data stored: ids {:?} log-probs {:?}", r.response_token_ids, r.rollout_logprobs));
                }
            }
            IngestItem::DeadLetter(d) => {
                dead += 1;
                if d.reason_code.is_empty() || d.reason.len() < 10 {
                    bad = Some(format!("unclear dead letter {:?}: {:?}", d.reason_code, d.reason));
                }
            }
        }
        Ok(())
    })
    .map_err(|e| TestCaseError::fail(format!("{format}: malformed content became an error: {e}")))?;
    if let Some(b) = bad {
        return Err(TestCaseError::fail(format!("{format}: {b}")));
    }
    prop_assert_eq!((summary.interactions, summary.dead_letters), (rows, dead), "{}: summary counts", format);
    if matches!(format, Format::OpenAiChat | Format::OpenClaw) {
        prop_assert_eq!(rows + dead, summary.records, "{}: every line becomes one interaction or one dead letter", format);
    }
    Ok((rows, dead))
}

fn all_formats(bytes: &[u8]) -> Result<(), TestCaseError> {
    for f in Format::ALL {
        through(f, bytes)?;
    }
    Ok(())
}

/// Any JSON value, up to depth 4.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| json!(i)),
        any::<f64>().prop_filter("finite", |x| x.is_finite()).prop_map(|x| json!(x)),
        "[a-z\\\\<>{}\"' ]{0,12}".prop_map(Value::String),
        prop_oneof![Just("user"), Just("assistant"), Just("system"), Just("tool"), Just("function"), Just("developer"), Just("wizard")].prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(prop_oneof![Just("role".to_string()), Just("content".to_string()), Just("tool_calls".to_string()), "[a-z_]{1,8}"], inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn good_chat(user: &str) -> Value {
    json!({"headers": {"x-session-id": "s"},
        "request": {"model": "m", "messages": [{"role": "user", "content": user}]},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
            "token_ids": [1, 2], "logprobs": {"content": [{"token": "o", "logprob": -0.5}, {"token": "k", "logprob": -0.25}]}}]}})
}

fn good_openclaw(turn: i64) -> Value {
    json!({"session_id": "oc", "turn": turn, "messages": [{"role": "user", "content": "q"}], "response_text": "a",
        "response_token_ids": [3, 4], "rollout_logprobs": [-0.5, -0.25]})
}

/// JSON pointers of good records' fields that arbitrary values are put into.
const CHAT_FIELDS: [&str; 9] = [
    "/request/messages",
    "/request/messages/0",
    "/request/messages/0/content",
    "/request/messages/0/role",
    "/response",
    "/response/choices/0/message",
    "/response/choices/0/token_ids",
    "/response/choices/0/logprobs/content",
    "/headers",
];
const OPENCLAW_FIELDS: [&str; 6] = ["/turn", "/messages", "/messages/0", "/response_text", "/response_token_ids", "/rollout_logprobs"];

fn replace(mut v: Value, pointer: &str, with: Value) -> Value {
    if let Some(slot) = v.pointer_mut(pointer) {
        *slot = with;
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    /// Arbitrary bytes through every adapter.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        all_formats(&bytes)?;
    }

    /// JSON-ish text (JSON punctuation, keywords, numbers and newlines) through every adapter.
    #[test]
    fn json_ish_text_never_panics(text in "([\\[\\]{}\",:\\n ]|-?[0-9]{1,3}(\\.[0-9]+)?(e[+-]?[0-9]{1,3})?|NaN|-?Infinity|null|true|\"(role|content|messages|request|response|choices|history|traj|turn|session_id)\"){0,60}") {
        all_formats(text.as_bytes())?;
    }

    /// A good JSONL file with one line cut short or one byte changed: the other lines come through.
    #[test]
    fn corrupted_lines_are_dead_letters_and_the_rest_survive(cut in 0usize..400, at in 0usize..400, byte in any::<u8>(), flip in any::<bool>()) {
        let lines: Vec<String> = (0..3).map(|i| good_chat(&format!("question {i}")).to_string()).collect();
        let mut middle = lines[1].clone().into_bytes();
        if flip {
            let i = at % middle.len();
            middle[i] = byte;
        } else {
            middle.truncate(cut % middle.len());
        }
        let mut file = format!("{}\n", lines[0]).into_bytes();
        file.extend_from_slice(&middle);
        file.extend_from_slice(format!("\n{}\n", lines[2]).as_bytes());
        let (rows, dead) = through(Format::OpenAiChat, &file)?;
        prop_assert!(rows >= 2, "the good lines around the corrupted one: {} interactions, {} dead letters", rows, dead);
        all_formats(&file)?;
    }

    /// Good records with an arbitrary JSON value in one field.
    #[test]
    fn arbitrary_values_in_record_fields(which in 0usize..CHAT_FIELDS.len() + OPENCLAW_FIELDS.len(), value in any_json()) {
        if which < CHAT_FIELDS.len() {
            let bad = replace(good_chat("x"), CHAT_FIELDS[which], value);
            let file = format!("{}\n{bad}\n", good_chat("first"));
            let (rows, _) = through(Format::OpenAiChat, file.as_bytes())?;
            prop_assert!(rows >= 1, "the good line before it");
        } else {
            let bad = replace(good_openclaw(2), OPENCLAW_FIELDS[which - CHAT_FIELDS.len()], value);
            let file = format!("{}\n{bad}\n", good_openclaw(1));
            let (rows, _) = through(Format::OpenClaw, file.as_bytes())?;
            prop_assert!(rows >= 1, "the good line before it");
        }
    }

    /// Whole documents of the document formats with arbitrary JSON values.
    #[test]
    fn arbitrary_documents(value in any_json(), key in prop_oneof![Just("history"), Just("trajectory"), Just("messages"), Just("traj"), Just("answer_generation"), Just("output")]) {
        let doc = json!({key: value.clone(), "info": {}});
        all_formats(doc.to_string().as_bytes())?;
        all_formats(json!([{"task_id": 1, "traj": value.clone()}, {"source": "agent", "action": value}]).to_string().as_bytes())?;
    }

    /// The judge-output parser on arbitrary text and on text built from box fragments: a vote is
    /// always 1, 0 or −1 and is the last boxed digit (or, with no box, the whole answer's bare grade);
    /// it is refused only when that digit is missing or out of range. A fault found in a local run:
    /// the bare-grade reading (prm-eval, issue 39) was not in this property, and `0` failed it.
    #[test]
    fn judge_votes_are_always_in_range(parts in proptest::collection::vec(prop_oneof![
        Just("\\boxed{".to_string()), Just("}".to_string()), Just("-".to_string()), Just("+".to_string()),
        "[0-9]".prop_map(String::from), Just(" ".to_string()), Just("\n".to_string()), Just("\u{2212}".to_string()),
        "\\PC{0,8}".prop_map(String::from)], 0..24)) {
        let text = parts.concat();
        // Without a box, an answer that is only a grade (`1`, ` -1.`) counts (a small judge's form).
        let bare = regex::Regex::new(r"^\s*([+-]?[0-9])\s*[.,!]?\s*$").unwrap();
        let digit = last_boxed_digit(&text).or_else(|| bare.captures(&text).map(|c| c[1].parse::<i32>().unwrap()));
        match parse_vote(&text) {
            Ok(v) => {
                prop_assert!((-1..=1).contains(&v));
                prop_assert_eq!(digit, Some(v));
            }
            Err(e) => {
                prop_assert!(e.len() >= 10);
                prop_assert!(!matches!(digit, Some(-1..=1)), "valid digit {:?} refused: {}", digit, e);
            }
        }
    }
}

/// Hand-picked inputs that earlier versions mishandled or that sit on limits, through every adapter.
#[test]
fn edge_inputs_through_every_adapter() {
    let cases: Vec<Vec<u8>> = vec![
        vec![],
        b"\n\n\n".to_vec(),
        b"\xef\xbb\xbf{}".to_vec(),
        b"{\"request\": {\"messages\": []}, \"response\": {\"choices\": []}}\n".to_vec(),
        format!("{}\n", "[".repeat(200_000)).into_bytes(),
        good_chat("\u{0}").to_string().into_bytes(),
        replace(good_chat("x"), "/response/choices/0/logprobs/content/0/logprob", json!(-1e300)).to_string().into_bytes(),
        replace(good_chat("x"), "/response/choices/0/token_ids", json!([2147483648u64, -1])).to_string().into_bytes(),
        replace(good_openclaw(1), "/turn", json!(-7)).to_string().into_bytes(),
        replace(good_openclaw(1), "/turn", json!(i64::MAX)).to_string().into_bytes(),
        replace(good_openclaw(1), "/rollout_logprobs", json!([1e39, -0.5])).to_string().into_bytes(),
    ];
    for c in &cases {
        all_formats(c).unwrap_or_else(|e| panic!("{:?}: {e}", String::from_utf8_lossy(&c[..c.len().min(80)])));
    }
}
