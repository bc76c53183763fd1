//! AgentBench run outputs (`outputs/<run>/<agent>/<task>/{runs,error}.jsonl`): one JSON object per
//! line, `{index, error, info, output: {index, status, result, history}, time: {timestamp, str}}`,
//! where `history` is `[{role: "user" | "agent", content}]` (`agent` → `assistant`).
//!
//! Failed runs have `history: null` (the `error.jsonl` files): each such line is one dead letter with
//! reason code `null_history`, naming the run's `error` and `info`. Session id =
//! `agentbench:<file stem>:<index>`; the event time is `time.timestamp` (ms); a run whose
//! `output.status` is not `running` is complete.

use std::path::Path;

use serde_json::{Map, Value};

use super::normalize::{json_type, map_role, normalize_with_role, NormError};
use super::sink::Sink;
use super::timestamp::parse_timestamp;
use super::trajectory::{emit, MessageMeta, Trajectory};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    super::sink::read_object_lines(path, sink, progress, &mut |sink, n, text, obj| record(sink, n, text, &obj))
}

fn record(sink: &mut Sink<'_>, n: i64, text: &[u8], obj: &Map<String, Value>) -> Result<()> {
    let index = match obj.get("index") {
        Some(Value::Number(x)) => x.to_string(),
        Some(Value::String(s)) => s.clone(),
        _ => format!("line{n}"),
    };
    let session_id = format!("agentbench:{}:{index}", sink.stem);
    let output = obj.get("output").and_then(Value::as_object);
    let history = match output.and_then(|o| o.get("history")) {
        Some(Value::Array(h)) => h,
        Some(Value::Null) | None => {
            let err = obj.get("error").and_then(Value::as_str).unwrap_or("none");
            let info = obj.get("info").and_then(Value::as_str).unwrap_or("");
            return sink.dead_in_session(
                Some(n),
                &session_id,
                "null_history",
                format!("AgentBench run {index} has no history (error {err}, info {info:?}): nothing to ingest"),
                text,
            );
        }
        Some(h) => return sink.dead_in_session(Some(n), &session_id, "wrong_type", format!("output.history is a JSON {}", json_type(h)), text),
    };
    let status = output.and_then(|o| o.get("status")).and_then(Value::as_str).unwrap_or("");
    let mut t = Trajectory { complete: !status.is_empty() && status != "running", ..Trajectory::default() };
    let ts = obj.get("time").and_then(|t| t.get("timestamp")).and_then(parse_timestamp);
    for (i, m) in history.iter().enumerate() {
        let res = match m.as_object() {
            None => Err(NormError::NotAnObject(json_type(m))),
            Some(o) => match o.get("role").and_then(Value::as_str) {
                Some("agent") => normalize_with_role(o, "assistant", Some("agent role mapped to assistant".into())),
                Some(r) => map_role(r).and_then(|(role, note)| normalize_with_role(o, role, note)),
                None => Err(NormError::MissingRole),
            },
        };
        match res {
            Ok(nm) => t.push(nm, MessageMeta { event_time: ts, ..MessageMeta::default() }),
            Err(e) => return sink.dead_in_session(Some(n), &session_id, e.code(), format!("history[{i}]: {e}"), text),
        }
    }
    if t.turns() == 0 {
        return sink.dead_in_session(Some(n), &session_id, "no_assistant_turn", "history has no agent message", text);
    }
    emit(sink, &session_id, &t, Some(n))?;
    Ok(())
}
