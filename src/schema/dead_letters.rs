//! `dead_letters`: every input that could not be processed, with the reason (nothing is dropped silently).

use arrow::datatypes::Field;
use serde::{Deserialize, Serialize};

use super::clock::now_ms;
use super::fields::{schema_version_field, ts, utf8};
use super::hash::content_hash;
use super::lineage::{lineage_fields, Lineage};
use super::table::Table;

/// A record that could not be processed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Schema version.
    pub schema_version: i32,
    /// Key: for a keyed input (`input_key` set), hash of stage, reason code and input key, so the same
    /// record rejected again for the same reason — another copy of it after an upstream stage re-sent
    /// it (at-least-once) — is the same row; otherwise hash of stage, source position, reason code and
    /// payload.
    pub dead_letter_id: String,
    /// Stage that rejected the record (`ingest`, `signals`, `judge`, `proxy`, `sink`, ...).
    pub stage: String,
    /// Short machine-readable reason code (`malformed_json`, `null_history`, `non_finite_logprob`, ...).
    pub reason_code: String,
    /// Human-readable reason.
    pub reason: String,
    /// The raw payload (lossy UTF-8; truncated to 1 MiB with a note).
    pub payload: String,
    /// Session id when known (Kafka key), else empty.
    pub session_id: String,
    /// Tenant of the refused record, when it could be read (null otherwise).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Key of the input record (e.g. its interaction id) when known; lets a stage count it as handled.
    pub input_key: Option<String>,
    /// Kafka topic of the rejected record.
    pub source_topic: Option<String>,
    /// Kafka partition.
    pub source_partition: Option<i32>,
    /// Kafka offset.
    pub source_offset: Option<i64>,
    /// Input file.
    pub source_file: Option<String>,
    /// 1-based line or record index.
    pub source_line: Option<i64>,
    /// When rejected (ms). Also the event time.
    pub created_time: i64,
}

/// Payloads larger than this are truncated in the dead-letter row (the reason says so).
pub const MAX_DEAD_LETTER_PAYLOAD: usize = 1 << 20;

impl DeadLetter {
    /// A dead letter for `payload` rejected by `stage`; the id hashes stage, position and payload, so the
    /// same rejection written twice is one row.
    pub fn new(stage: &str, reason_code: &str, reason: impl Into<String>, payload: &[u8], lineage: Lineage) -> DeadLetter {
        let mut reason = reason.into();
        let mut text = String::from_utf8_lossy(payload).into_owned();
        if text.len() > MAX_DEAD_LETTER_PAYLOAD {
            let mut cut = MAX_DEAD_LETTER_PAYLOAD;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            reason.push_str(&format!(" (payload of {} bytes truncated to {cut})", payload.len()));
        }
        let pos = format!(
            "{:?}/{:?}/{:?}/{:?}/{:?}",
            lineage.source_topic, lineage.source_partition, lineage.source_offset, lineage.source_file, lineage.source_line
        );
        DeadLetter {
            schema_version: Self::SCHEMA_VERSION,
            dead_letter_id: content_hash(&[stage.as_bytes(), pos.as_bytes(), reason_code.as_bytes(), payload]),
            stage: stage.to_string(),
            reason_code: reason_code.to_string(),
            reason,
            payload: text,
            session_id: String::new(),
            tenant: None,
            input_key: None,
            source_topic: lineage.source_topic,
            source_partition: lineage.source_partition,
            source_offset: lineage.source_offset,
            source_file: lineage.source_file,
            source_line: lineage.source_line,
            created_time: now_ms(),
        }
    }
    /// Sets the session id and input key; with an input key the id becomes the hash of stage, reason
    /// code and input key (see [`DeadLetter::dead_letter_id`]).
    pub fn with_keys(mut self, session_id: &str, input_key: Option<&str>) -> DeadLetter {
        self.session_id = session_id.to_string();
        if let Some(k) = input_key {
            self.dead_letter_id = content_hash(&[b"input", self.stage.as_bytes(), self.reason_code.as_bytes(), k.as_bytes()]);
        }
        self.input_key = input_key.map(str::to_string);
        self
    }
    /// Sets the tenant of the refused record (when it could be read).
    pub fn with_tenant(mut self, tenant: Option<&str>) -> DeadLetter {
        self.tenant = tenant.map(str::to_string);
        self
    }
}

impl Table for DeadLetter {
    const NAME: &'static str = "dead_letters";
    const SCHEMA_VERSION: i32 = 1;
    const KEY: &'static str = "dead_letter_id";
    const DOC: &'static str = "Every record a stage could not process: the stage, a reason code and a \
        readable reason, the raw payload and where it came from. Nothing is dropped silently.";
    fn fields() -> Vec<Field> {
        let mut f = vec![
            schema_version_field(),
            utf8("dead_letter_id", false, "Hash of stage, reason code and input key when the input is keyed (one row per rejected record, whatever copy of it was read); else of stage, source position, reason code and payload."),
            utf8("stage", false, "Stage that rejected the record."),
            utf8("reason_code", false, "Machine-readable reason code."),
            utf8("reason", false, "Human-readable reason."),
            utf8("payload", false, "Raw payload (lossy UTF-8, truncated to 1 MiB)."),
            utf8("session_id", false, "Session id when known."),
            utf8("tenant", true, "Tenant of the refused record, when it could be read (null otherwise)."),
            utf8("input_key", true, "Key of the input record when known."),
        ];
        f.extend(lineage_fields());
        f.push(ts("created_time", false, "When rejected (UTC)."));
        f
    }
    table_accessors!(dead_letter_id, session_id, created_time);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(offset: i64) -> Lineage {
        Lineage { source_topic: Some("judgments".into()), source_partition: Some(0), source_offset: Some(offset), ..Default::default() }
    }

    #[test]
    fn a_keyed_input_rejected_again_is_the_same_dead_letter() {
        // The judge re-sent a judgment after a crash (a second copy at another offset, with a newer
        // processing time in the payload): the teacher rejects the same turn for the same reason.
        let a = DeadLetter::new("teacher", "too_long", "900 tokens", b"{\"t\":1}", at(3)).with_keys("s", Some("i1"));
        let b = DeadLetter::new("teacher", "too_long", "900 tokens", b"{\"t\":2}", at(9)).with_keys("s", Some("i1"));
        assert_eq!(a.dead_letter_id, b.dead_letter_id);
        assert_eq!(a.dead_letter_id, content_hash(&[b"input", b"teacher", b"too_long", b"i1"]));
        // Another reason, stage or turn is another dead letter.
        let c = DeadLetter::new("teacher", "tokenization", "x", b"{}", at(3)).with_keys("s", Some("i1"));
        let d = DeadLetter::new("judge", "too_long", "x", b"{}", at(3)).with_keys("s", Some("i1"));
        let e = DeadLetter::new("teacher", "too_long", "x", b"{}", at(3)).with_keys("s", Some("i2"));
        for x in [&c, &d, &e] {
            assert_ne!(x.dead_letter_id, a.dead_letter_id);
        }
        // Unkeyed records (a malformed payload) keep the position-and-payload identity.
        let f = DeadLetter::new("sink", "malformed_record", "x", b"{", at(3)).with_keys("s", None);
        let g = DeadLetter::new("sink", "malformed_record", "x", b"{", at(4)).with_keys("s", None);
        assert_ne!(f.dead_letter_id, g.dead_letter_id);
    }
}
