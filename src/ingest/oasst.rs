//! Open Assistant conversation trees (OpenAssistant/oasst1, oasst2): `--format oasst`.
//!
//! Two layouts of the released data (the dataset cards and `oasst-data` exporter, read, not
//! copied):
//! - trees (`*.trees.jsonl`): one tree per line, `{message_tree_id, tree_state, prompt}` where each
//!   message is `{message_id, parent_id, text, role, created_date, deleted, review_result, replies[]}`;
//! - messages (`*.messages.jsonl`): one message per line with `message_tree_id` and `parent_id`;
//!   the trees are rebuilt from the parents (the whole file is held in memory).
//!
//! Each tree is one session (`oasst:<message_tree_id>`). `role` `prompter` → user, `assistant` →
//! assistant. Every assistant message is a turn: its request is the path from the root to its
//! parent, its next state the human replies to it — several replies are alternative continuations
//! (pairing takes the earliest and counts the rest). Turns are numbered in depth-first order (replies
//! by `rank`, then time). Deleted messages and everything under them are left out and counted.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::sink::{Sink, Turn};
use super::timestamp::parse_timestamp;
use crate::schema::Message;
use crate::Result;

/// Deepest reply chain read (a deeper one is cut there, with a dead letter): the walk recurses.
const MAX_DEPTH: usize = 2000;

pub(crate) fn read(path: &Path, sink: &mut Sink<'_>, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let records = super::sink::jsonl_objects(path, sink, progress)?;
    let mut flat: Vec<super::sink::Record> = vec![];
    for (n, r) in records {
        match r.get("prompt") {
            Some(Value::Object(root)) => {
                let tree = r.get("message_tree_id").and_then(Value::as_str).or_else(|| root.get("message_id").and_then(Value::as_str)).unwrap_or("").to_string();
                tree_session(sink, n, &tree, root)?;
            }
            _ if r.contains_key("message_id") => flat.push((n, r)),
            _ => sink.dead(Some(n), "wrong_type", format!("line {n}: neither a tree (`prompt`) nor a message (`message_id`)"), serde_json::to_string(&r)?.as_bytes())?,
        }
    }
    if flat.is_empty() {
        return Ok(());
    }
    // Messages layout: rebuild each tree from the parents.
    let mut by_tree: HashMap<String, Vec<super::sink::Record>> = HashMap::new();
    let mut order: Vec<String> = vec![];
    for (n, m) in flat {
        let tree = m.get("message_tree_id").and_then(Value::as_str).unwrap_or("").to_string();
        if !by_tree.contains_key(&tree) {
            order.push(tree.clone());
        }
        by_tree.entry(tree).or_default().push((n, m));
    }
    for tree in order {
        let msgs = by_tree.remove(&tree).unwrap_or_default();
        let mut children: HashMap<String, Vec<usize>> = HashMap::new();
        let mut roots = vec![];
        for (i, (_, m)) in msgs.iter().enumerate() {
            match m.get("parent_id").and_then(Value::as_str) {
                Some(p) => children.entry(p.to_string()).or_default().push(i),
                None => roots.push(i),
            }
        }
        // Nest the replies as the trees layout does, then read it the same way. A message seen again
        // (a repeated id, a parent loop) is not nested twice; nesting stops at MAX_DEPTH.
        fn nest(
            i: usize,
            msgs: &[super::sink::Record],
            children: &HashMap<String, Vec<usize>>,
            seen: &mut std::collections::HashSet<usize>,
            depth: usize,
        ) -> Map<String, Value> {
            let mut m = msgs[i].1.clone();
            let id = m.get("message_id").and_then(Value::as_str).unwrap_or("").to_string();
            let mut replies: Vec<Value> = vec![];
            if depth < MAX_DEPTH {
                for &j in children.get(&id).map(Vec::as_slice).unwrap_or(&[]) {
                    if seen.insert(j) {
                        replies.push(Value::Object(nest(j, msgs, children, seen, depth + 1)));
                    }
                }
            }
            m.insert("replies".into(), Value::Array(replies));
            m
        }
        let reachable = roots.len();
        for r in roots {
            let mut seen = std::collections::HashSet::from([r]);
            let root = nest(r, &msgs, &children, &mut seen, 0);
            tree_session(sink, msgs[r].0, &tree, &root)?;
        }
        if reachable == 0 {
            sink.dead_in_session(msgs.first().map(|m| m.0), &format!("oasst:{tree}"), "no_root_message", format!("tree {tree}: no message without a parent"), b"")?;
        }
    }
    Ok(())
}

/// Emits the turns of one tree.
fn tree_session(sink: &mut Sink<'_>, line: i64, tree: &str, root: &Map<String, Value>) -> Result<()> {
    let session = format!("oasst:{tree}");
    let mut turn = 0i32;
    let mut path: Vec<Message> = vec![];
    let mut deleted = 0u64;
    walk(sink, &session, line, root, &mut path, &mut turn, &mut deleted)?;
    sink.count("deleted messages left out (with their replies)", deleted);
    if turn == 0 {
        sink.dead_in_session(Some(line), &session, "no_assistant_turn", format!("tree {tree} has no assistant message"), b"")?;
    }
    Ok(())
}

fn role_of(m: &Map<String, Value>) -> Option<&'static str> {
    match m.get("role").and_then(Value::as_str)? {
        "prompter" | "user" => Some("user"),
        "assistant" => Some("assistant"),
        _ => None,
    }
}

fn walk(sink: &mut Sink<'_>, session: &str, line: i64, m: &Map<String, Value>, path: &mut Vec<Message>, turn: &mut i32, deleted: &mut u64) -> Result<()> {
    if path.len() >= MAX_DEPTH {
        return sink.dead_in_session(Some(line), session, "tree_too_deep", format!("reply chain deeper than {MAX_DEPTH} messages: cut there"), b"");
    }
    if m.get("deleted").and_then(Value::as_bool) == Some(true) {
        *deleted += 1;
        return Ok(());
    }
    let Some(role) = role_of(m) else {
        let r = m.get("role").map(Value::to_string).unwrap_or_default();
        return sink.dead_in_session(
            Some(line),
            session,
            "unknown_role",
            format!("message role {r} (expected prompter or assistant)"),
            serde_json::to_string(m)?.as_bytes(),
        );
    };
    let text = m.get("text").and_then(Value::as_str).unwrap_or("").to_string();
    let msg = Message::text(role, text);
    let mut replies: Vec<&Map<String, Value>> = m.get("replies").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_object).collect()).unwrap_or_default();
    replies.sort_by(|a, b| {
        let rank = |x: &Map<String, Value>| x.get("rank").and_then(Value::as_i64).unwrap_or(i64::MAX);
        let time = |x: &Map<String, Value>| x.get("created_date").and_then(parse_timestamp).unwrap_or(i64::MAX);
        (rank(a), time(a)).cmp(&(rank(b), time(b)))
    });
    if role == "assistant" {
        let answers: Vec<Message> = replies
            .iter()
            .filter(|r| role_of(r) == Some("user") && r.get("deleted").and_then(Value::as_bool) != Some(true))
            .map(|r| Message::text("user", r.get("text").and_then(Value::as_str).unwrap_or("")))
            .collect();
        let mut t = Turn::new(session.to_string(), *turn, path, &msg);
        *turn += 1;
        t.model = m.get("model_name").and_then(Value::as_str).map(str::to_string);
        t.event_time = m.get("created_date").and_then(parse_timestamp);
        t.source_line = Some(line);
        // The first reply (by rank) is the next state; the others continue the same turn.
        t.next_state = answers.into_iter().next().map(|a| vec![a]);
        if m.get("review_result").and_then(Value::as_bool) == Some(false) {
            t.notes.push("the message failed Open Assistant review".into());
        }
        sink.turn(t)?;
    }
    path.push(msg);
    for r in replies {
        walk(sink, session, line, r, path, turn, deleted)?;
    }
    path.pop();
    Ok(())
}
