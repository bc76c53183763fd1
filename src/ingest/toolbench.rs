//! ToolBench answer files (`data_example/answer/G*_answer/*.json`): a depth-first tool search whose
//! final chain is `answer_generation.train_messages`, a list of conversations each one assistant
//! step longer than the previous (each ends with an assistant `function_call`).
//!
//! The longest conversation is the trajectory (the others must be its prefixes; a mismatch is
//! noted). Old OpenAI `function_call` format: `content: null` plus `function_call {name, arguments}`
//! with the arguments as a JSON string; results come back with role `function` (→ `tool`, joined to
//! calls by position: there are no ids). API results carry an `"error"` field that is often `""`.
//! The tool definitions (`answer_generation.function`) become `tools`. The file is stored with CRLF
//! line ends; JSON does not care. The last call is `Finish`, which has no result: the last turn has no
//! next state. `win` and `finish_type` are noted, not mapped to a reward (a found answer is not a
//! checked answer). Session id = `toolbench:<file stem>`.

use std::path::Path;

use serde_json::Value;

use super::canonical::message_key;
use super::normalize::{json_type, normalize_message};
use super::sink::Sink;
use super::trajectory::{emit, Trajectory};
use crate::Result;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let Some(doc) = sink.load_document(path, progress)? else {
        return Ok(());
    };
    let payload = || doc.to_string().into_bytes();
    let session_id = format!("toolbench:{}", sink.stem);
    let Some(ag) = doc.get("answer_generation").and_then(Value::as_object) else {
        return sink.dead(None, "missing_answer_generation", "no `answer_generation` object", &payload());
    };
    let convs: Vec<&Vec<Value>> = match ag.get("train_messages") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_array).collect(),
        _ => vec![],
    };
    let Some(longest) = convs.iter().max_by_key(|c| c.len()) else {
        return sink.dead(None, "no_train_messages", "`answer_generation.train_messages` is missing or empty", &payload());
    };
    let mut t = Trajectory { complete: true, ..Trajectory::default() };
    if let Err((i, e)) = t.push_all(longest) {
        return sink.dead_in_session(None, &session_id, e.code(), format!("train_messages message {i}: {e}"), &payload());
    }
    // The shorter conversations should be prefixes of the longest.
    let keys: Vec<_> = t.messages.iter().map(message_key).collect();
    let mut not_prefix = 0;
    for c in &convs {
        let ok = c.len() <= keys.len()
            && c.iter().zip(&keys).all(|(m, k)| normalize_message(m).map(|n| message_key(&n.message) == *k).unwrap_or(false));
        not_prefix += (!ok) as usize;
    }
    if not_prefix > 0 {
        t.notes.push(format!("{not_prefix} of {} train_messages conversations are not prefixes of the longest", convs.len()));
    }
    if let Some(w) = doc.get("win").and_then(Value::as_bool) {
        t.notes.push(format!("toolbench win: {w}"));
    }
    if let Some(ft) = ag.get("finish_type").and_then(Value::as_str) {
        t.notes.push(format!("toolbench finish_type: {ft}"));
    }
    t.tools = match ag.get("function") {
        Some(f @ Value::Array(_)) => Some(f.to_string()),
        Some(Value::Null) | None => None,
        Some(f) => {
            t.notes.push(format!("answer_generation.function is a JSON {}; not used as tools", json_type(f)));
            None
        }
    };
    if t.turns() == 0 {
        return sink.dead_in_session(None, &session_id, "no_assistant_turn", "train_messages have no assistant message", &payload());
    }
    sink.count("train_messages conversations", convs.len() as u64);
    emit(sink, &session_id, &t, Some(1))?;
    Ok(())
}
