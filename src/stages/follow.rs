//! `nextstate ingest --follow PATH...`: tail live agent session files (Claude Code, OpenClaw, Codex
//! sessions, proxy logs, ...) and emit each new turn once, across restarts.
//!
//! Every `poll` the paths are walked again ([`ingest::inputs`]: new files are picked up). A file
//! that grew is read again with its adapter (session adapters need the whole session for each turn's
//! context); JSONL formats are read up to the end of the last complete line, so a line being written
//! is never read half (single-document formats — OTel and LangSmith exports, the benchmark
//! trajectories — are read whole: they are written once, not appended to). An OpenHands V1 events
//! folder grows by files: it is read again when its number of event files changes. Only turns not
//! emitted before are produced:
//! - per (file, session) a watermark holds the next turn index to emit; turns below it are skipped;
//! - a session's **last** turn is held back until the file has not changed for `settle` (its response
//!   may still be streaming in, split over lines); the earlier ones are complete because a later turn
//!   follows them;
//! - dead letters are emitted once (by reason, session and line: a re-read builds them again with a
//!   new ingest time).
//!
//! A file that cannot be read this time (removed or rotated between the walk and the read, a
//! compressed file still being written) is named on stderr and tried again on the next poll.
//!
//! Known limits: a turn is identified by its index in its session, so a conversation that switches
//! branch (OpenClaw `/tree`) or a response whose last fragment arrives after `settle` (a Claude Code
//! tool call that streams longer) keeps the version emitted first; a truncated file is read again
//! from the start with fresh watermarks.
//!
//! **Positions** (per file: format, bytes read, watermarks, dead-letter ids) are saved atomically
//! after each poll's records are flushed to the bus, in `<lake>/_follow/<name>.json` by default. With
//! a real Kafka cluster a flushed record is durable, so the saved positions are the truth. With the
//! embedded bus a record is durable only once the in-process sink has written it to the lake, so on
//! start the watermarks are rebuilt from the lake's `interactions` and `dead_letters` of each file
//! (positions only tell which files are unchanged): a kill -9 re-emits what the lake lacks and skips
//! what it has, and the sink's key check drops any repeat. Compressed files are read once (they are
//! not appended to).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::source::{send_owned, settle, source_of, IngestReport};
use crate::bus::Bus;
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::ingest::{self, Compression, Format, IngestItem, IngestOptions, DEFAULT_HEAD_BYTES};
use crate::lake::Lake;
use crate::runtime::{Stop, TaskCtl};
use crate::schema::{Lineage, TurnType};

/// Options of `nextstate ingest --follow`.
#[derive(Debug, Clone)]
pub struct FollowArgs {
    /// Files and directories to follow.
    pub paths: Vec<PathBuf>,
    /// Format, or None for auto-detection per file.
    pub format: Option<Format>,
    /// Turn type of turns the log does not mark.
    pub default_turn_type: TurnType,
    /// Time between two looks at the files.
    pub poll: Duration,
    /// A session's last turn is emitted once its file has not changed for this long.
    pub settle: Duration,
    /// Stop once every file has been unchanged this long and everything is emitted (`None`: follow
    /// until stopped).
    pub exit_when_idle: Option<Duration>,
    /// The positions file (default `<lake>/_follow/positions.json`).
    pub state: Option<PathBuf>,
    /// Also run the lake sinks of `interactions` and `dead_letters` in this process.
    pub sink: bool,
    /// The tenant of every row (`--tenant`); `None`: `default`. Checked by [`follow`]
    /// ([`crate::schema::validate_tenant`]).
    pub tenant: Option<String>,
}

/// What is known of one followed file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct FileState {
    /// The format read (decided on first sight), by name.
    format: Option<String>,
    /// Bytes read (the end of the last complete line read).
    read_to: u64,
    /// File length at the last look.
    len: u64,
    /// When the length last changed (ms since the epoch).
    changed_ms: i64,
    /// Every turn up to the end of `read_to` is emitted, the last ones included.
    settled: bool,
    /// Next turn index to emit, by session.
    emitted: BTreeMap<String, i32>,
    /// Dead letters emitted, by [`dead_key`].
    dead: BTreeSet<String>,
}

/// The positions file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Positions {
    files: BTreeMap<String, FileState>,
}

/// The number of event files of an OpenHands V1 events folder.
fn event_count(dir: &Path) -> Result<u64> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io("read", dir, e))?;
    Ok(rd.filter_map(|e| e.ok()).filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("event-") && n.ends_with(".json"))).count() as u64)
}

/// The end of the last complete line of `path` (of length `len`): bytes up to and including its last
/// `\n`, 0 when it has none.
fn complete_prefix(path: &Path, len: u64) -> Result<u64> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut end = len;
    let mut buf = vec![0u8; 1 << 16];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let n = (end - start) as usize;
        f.seek(SeekFrom::Start(start)).map_err(|e| Error::io("seek", path, e))?;
        f.read_exact(&mut buf[..n]).map_err(|e| Error::io("read", path, e))?;
        if let Some(p) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + p as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// What identifies a dead letter across re-reads of a file (its id hashes the payload, which holds
/// the ingest time).
fn key_of(code: &str, session: &str, line: Option<i64>) -> String {
    format!("{code}\u{1f}{session}\u{1f}{}", line.map(|l| l.to_string()).unwrap_or_default())
}

fn dead_key(d: &crate::schema::DeadLetter) -> String {
    key_of(&d.reason_code, &d.session_id, d.source_line)
}

/// Query results as JSON objects, one per row.
fn json_rows(batches: &[arrow::record_batch::RecordBatch]) -> Result<Vec<serde_json::Value>> {
    let text = crate::sql::render(batches, crate::sql::OutputFormat::Json)?;
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).map_err(Error::from)).collect()
}

/// Watermarks of every file in the lake: (file → session → next turn index), (file → dead-letter ids).
async fn from_lake(lake: &Lake) -> Result<(HashMap<String, BTreeMap<String, i32>>, HashMap<String, BTreeSet<String>>)> {
    let mut turns: HashMap<String, BTreeMap<String, i32>> = HashMap::new();
    let mut dead: HashMap<String, BTreeSet<String>> = HashMap::new();
    let q = "SELECT source_file, session_id, max(turn_index) + 1 AS next FROM interactions WHERE source_file IS NOT NULL GROUP BY source_file, session_id";
    if let Ok(batches) = crate::sql::query(lake, q).await {
        for row in json_rows(&batches)? {
            if let (Some(f), Some(s), Some(n)) = (row["source_file"].as_str(), row["session_id"].as_str(), row["next"].as_i64()) {
                turns.entry(f.to_string()).or_default().insert(s.to_string(), n as i32);
            }
        }
    }
    let q = "SELECT source_file, reason_code, session_id, source_line FROM dead_letters WHERE stage = 'ingest' AND source_file IS NOT NULL";
    if let Ok(batches) = crate::sql::query(lake, q).await {
        for row in json_rows(&batches)? {
            if let (Some(f), Some(code)) = (row["source_file"].as_str(), row["reason_code"].as_str()) {
                let key = key_of(code, row["session_id"].as_str().unwrap_or(""), row["source_line"].as_i64());
                dead.entry(f.to_string()).or_default().insert(key);
            }
        }
    }
    Ok((turns, dead))
}

/// Follows `args.paths` until stopped (or idle, with `exit_when_idle`), producing new turns to the bus.
///
/// # Errors
/// [`Error::Io`] for unreadable paths or positions, Kafka and lake errors, [`Error::Config`] for an
/// invalid `args.tenant`. Malformed records become
/// dead letters; a file whose format cannot be detected is skipped and named on stderr until it can.
pub async fn follow(cfg: &PipelineConfig, args: &FollowArgs, stop: Stop) -> Result<IngestReport> {
    if let Some(t) = &args.tenant {
        crate::schema::validate_tenant(t).map_err(|e| crate::config_err!("--tenant: {e}"))?;
    }
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&["interactions", "dead_letters"]).await?;
    let producer = bus.producer()?;
    let source = TaskCtl::new("ingest-follow", true, stop.clone());
    let sinks = super::source::start_sinks(cfg, &bus, &lake, &producer, &source, &stop, args.sink);
    let state_path = args.state.clone().unwrap_or_else(|| cfg.lake.join("_follow").join("positions.json"));
    let mut pos: Positions = match std::fs::read(&state_path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| Error::InvalidInput(format!("{}: not a positions file: {e}", state_path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Positions::default(),
        Err(e) => return Err(Error::io("read", &state_path, e)),
    };
    // Embedded bus: the lake is the durable record of what was emitted (for files in the positions
    // and files first seen now alike).
    let (lake_turns, lake_dead) = if cfg.bus.brokers.is_none() { from_lake(&lake).await? } else { Default::default() };
    if cfg.bus.brokers.is_none() {
        for (f, st) in pos.files.iter_mut() {
            st.emitted = lake_turns.get(f).cloned().unwrap_or_default();
            st.dead = lake_dead.get(f).cloned().unwrap_or_default();
            st.settled = false;
        }
    }
    let mut report = IngestReport::default();
    let result = async {
        let mut undetected: BTreeSet<String> = BTreeSet::new();
        loop {
            let now = crate::schema::now_ms();
            let mut all_idle = true;
            let mut inputs = vec![];
            for i in ingest::inputs(&args.paths) {
                match i {
                    ingest::Input::Read { path, .. } => inputs.push(path),
                    // Missing, unreadable or not a regular file (never opened): looked at again next poll.
                    ingest::Input::Skip { path, code, reason } => {
                        if undetected.insert(path.display().to_string()) {
                            eprintln!("{reason} ({code}; trying again)");
                        }
                    }
                }
            }
            for file in inputs {
                let key = file.display().to_string();
                let is_dir = file.is_dir();
                // A folder of event files grows by files: its length is their number.
                let len = match if is_dir { event_count(&file) } else { std::fs::metadata(&file).map(|m| m.len()).map_err(|e| Error::io("stat", &file, e)) } {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!("{}: {e} (trying again)", file.display());
                        continue;
                    }
                };
                let st = pos.files.entry(key.clone()).or_insert_with(|| FileState {
                    changed_ms: now,
                    emitted: lake_turns.get(&key).cloned().unwrap_or_default(),
                    dead: lake_dead.get(&key).cloned().unwrap_or_default(),
                    ..FileState::default()
                });
                if len != st.len {
                    if len < st.read_to {
                        // Truncated or replaced: read it again from the start.
                        *st = FileState { format: st.format.take(), ..FileState::default() };
                    }
                    st.len = len;
                    st.changed_ms = now;
                    st.settled = false;
                }
                let idle = now - st.changed_ms >= args.settle.as_millis() as i64;
                all_idle &= idle && args.exit_when_idle.is_none_or(|w| now - st.changed_ms >= w.as_millis() as i64);
                let compressed = Compression::of(&file) != Compression::None;
                let whole = compressed || is_dir;
                let limit = if whole {
                    len
                } else {
                    match complete_prefix(&file, len) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("{}: {e} (trying again)", file.display());
                            continue;
                        }
                    }
                };
                if limit == st.read_to && (st.settled || !idle) {
                    all_idle &= st.settled;
                    continue;
                }
                if compressed && st.settled {
                    continue;
                }
                if limit == 0 {
                    continue;
                }
                let known = st.format.as_deref().and_then(|f| f.parse::<Format>().ok());
                let format = match known.or(args.format) {
                    Some(f) => f,
                    None => match ingest::detect(&file, DEFAULT_HEAD_BYTES.min(limit.max(1) as usize)) {
                        Ok(d) => {
                            eprintln!("{}: {d}", file.display());
                            d.format
                        }
                        Err(Error::InvalidInput(why)) => {
                            if undetected.insert(key.clone()) {
                                eprintln!("{}: not followed (yet): {why}", file.display());
                            }
                            continue;
                        }
                        // Gone or unreadable since it was listed: looked at again next poll.
                        Err(e @ Error::Io { .. }) => {
                            eprintln!("{}: {e} (trying again)", file.display());
                            continue;
                        }
                        Err(e) => return Err(e),
                    },
                };
                st.format = Some(format.name().to_string());
                let mut opts = IngestOptions::new(now);
                opts.default_turn_type = args.default_turn_type;
                opts.tenant = args.tenant.clone();
                opts.read_limit = (!whole).then_some(limit);
                let path = file.clone();
                let read = tokio::task::spawn_blocking(move || {
                    let mut items: Vec<IngestItem> = vec![];
                    ingest::read_file(&path, format, &opts, &mut |_| {}, &mut |item| {
                        items.push(item);
                        Ok(())
                    })?;
                    Ok::<_, Error>(items)
                })
                .await
                .map_err(|e| Error::Internal(format!("reader thread: {e}")))?;
                let items = match read {
                    Ok(items) => items,
                    Err(e @ Error::Io { .. }) => {
                        eprintln!("{}: {e} (trying again)", file.display());
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let (new, sent) = select(items, st, idle);
                for item in new {
                    match item {
                        IngestItem::Interaction(i) => {
                            report.interactions += 1;
                            settle(send_owned(&producer, i.as_ref(), source_of(&i))?.await?, &mut report);
                        }
                        IngestItem::DeadLetter(d) => {
                            *report.dead_letters.entry(d.reason_code.clone()).or_default() += 1;
                            settle(send_owned(&producer, d.as_ref(), Lineage::default())?.await?, &mut report);
                        }
                    }
                }
                if sent > 0 {
                    eprintln!("{}: {sent} new records ({} bytes read)", file.display(), limit);
                }
                st.read_to = limit;
                st.settled = idle;
                all_idle &= idle;
                if !report.files.iter().any(|(f, _, _)| f == &key) {
                    report.files.push((key.clone(), format.name().to_string(), args.format.is_none()));
                }
            }
            producer.flush()?;
            let bytes = serde_json::to_vec_pretty(&pos)?;
            if let Some(dir) = state_path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
            }
            crate::lake::write_atomic(&state_path, &bytes)?;
            if args.exit_when_idle.is_some() && all_idle {
                return Ok(());
            }
            let mut s = stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(args.poll) => {}
                _ = s.wait() => return Ok(()),
            }
        }
    }
    .await;
    super::source::finish_sinks(source, &stop, sinks, result.is_err(), &mut report).await?;
    result?;
    Ok(report)
}

/// The items of one read not emitted before (see the module doc), in file order, and their count;
/// updates the file's watermarks.
fn select(items: Vec<IngestItem>, st: &mut FileState, idle: bool) -> (Vec<IngestItem>, usize) {
    let mut last: HashMap<String, i32> = HashMap::new();
    for it in &items {
        if let IngestItem::Interaction(i) = it {
            let e = last.entry(i.session_id.clone()).or_insert(i.turn_index);
            *e = (*e).max(i.turn_index);
        }
    }
    let mut out = vec![];
    let mut next: BTreeMap<String, i32> = BTreeMap::new();
    for it in items {
        match it {
            IngestItem::Interaction(i) => {
                let mark = st.emitted.get(&i.session_id).copied().unwrap_or(0);
                let is_last = last.get(&i.session_id) == Some(&i.turn_index);
                if i.turn_index < mark || (is_last && !idle) {
                    continue;
                }
                let n = next.entry(i.session_id.clone()).or_insert(mark);
                *n = (*n).max(i.turn_index + 1);
                out.push(IngestItem::Interaction(i));
            }
            IngestItem::DeadLetter(d) => {
                // A dead letter about a whole session (no line) may change as the file grows.
                let key = dead_key(&d);
                if (d.source_line.is_none() && !idle) || st.dead.contains(&key) {
                    continue;
                }
                st.dead.insert(key);
                out.push(IngestItem::DeadLetter(d));
            }
        }
    }
    for (s, n) in next {
        st.emitted.insert(s, n);
    }
    let n = out.len();
    (out, n)
}
