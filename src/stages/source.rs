//! `nextstate ingest` wiring: reads agent logs with the [`crate::ingest`] adapters (a blocking reader
//! thread, streaming) and produces each interaction to the `interactions` topic and each rejected record
//! to `dead_letters`, with a bounded window of in-flight sends. Unless told otherwise, the lake sinks of
//! those two tables run in the same process until everything produced is durable.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::mpsc;

use crate::bus::{Bus, TOO_LARGE, TOO_LARGE_PAYLOAD_BYTES};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::ingest::{self, Format, IngestItem, IngestOptions, DEFAULT_HEAD_BYTES};
use crate::lake::sink::{SinkStats, SinkTasks};
use crate::lake::Lake;
use crate::runtime::{Stop, TaskCtl};
use crate::schema::{Lineage, TurnType};

/// Options of `nextstate ingest`.
#[derive(Debug, Clone)]
pub struct IngestArgs {
    /// Files and directories to read (directories walked recursively: [`ingest::inputs`]).
    pub files: Vec<PathBuf>,
    /// Format, or None for auto-detection per file.
    pub format: Option<Format>,
    /// Turn type of turns the log does not mark.
    pub default_turn_type: TurnType,
    /// Also run the lake sinks of `interactions` and `dead_letters` until the records are durable.
    pub sink: bool,
    /// Show a progress bar.
    pub progress: bool,
    /// The tenant of every row (`--tenant`); `None`: `default`. Checked by [`ingest`]
    /// ([`crate::schema::validate_tenant`]).
    pub tenant: Option<String>,
}

/// What an ingest did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestReport {
    /// Per file read: its path, the format used and whether it was auto-detected.
    pub files: Vec<(String, String, bool)>,
    /// Input paths not read, by reason code ([`ingest::UNDETECTED_FORMAT`], [`ingest::FILE_NOT_FOUND`],
    /// [`ingest::UNREADABLE_FILE`], [`ingest::NOT_A_REGULAR_FILE`]). Each is also one dead letter of
    /// that code naming the file; a file whose read fails part-way counts here (as `unreadable_file`),
    /// not in `files`, and keeps the records read before the failure.
    pub files_skipped: BTreeMap<String, u64>,
    /// Interactions produced.
    pub interactions: u64,
    /// Dead letters produced, by reason code.
    pub dead_letters: BTreeMap<String, u64>,
    /// Sink statistics per table (when the sinks ran in-process).
    pub sinks: BTreeMap<String, SinkStats>,
    /// A stop request (Ctrl-C / SIGTERM) ended the ingest before every input was read: the file being
    /// read (the last of `files`) was read in part, the inputs after it not at all. What was produced
    /// is flushed to the bus; on the embedded bus, records the in-process sinks had not yet written
    /// when they stopped are dropped (ingest again: rows already in the lake are not written twice).
    pub stopped: bool,
}

impl IngestReport {
    /// The one-line summary of `nextstate ingest`: input files read and skipped (with the reasons
    /// counted), interactions, dead letters by reason, and whether a stop request cut it short.
    pub fn line(&self) -> String {
        let counted = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                String::new()
            } else {
                format!(" ({})", m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "))
            }
        };
        let skipped: u64 = self.files_skipped.values().sum();
        let dead: u64 = self.dead_letters.values().sum();
        format!(
            "ingest: files={} read={} skipped={}{} interactions={} dead_letters={}{}{}",
            self.files.len() as u64 + skipped,
            self.files.len(),
            skipped,
            counted(&self.files_skipped),
            self.interactions,
            dead,
            counted(&self.dead_letters),
            if self.stopped { " stopped=signal (the last file read in part, the inputs after it not at all)" } else { "" }
        )
    }

    /// Counts a dead letter of `code` that stands for a whole input not read.
    fn skip(&mut self, code: &str) {
        *self.files_skipped.entry(code.to_string()).or_default() += 1;
        *self.dead_letters.entry(code.to_string()).or_default() += 1;
    }
}

enum Item {
    Record(IngestItem),
    Bytes(u64),
}

/// Sends the dead letter of an input that is not read (reason `code`, lineage: the file) and counts it.
async fn skip_file(producer: &crate::bus::BusProducer, report: &mut IngestReport, file: &std::path::Path, code: &str, why: String) -> Result<()> {
    eprintln!("{}: skipped ({code}): {why}", file.display());
    let lineage = Lineage { source_file: Some(file.display().to_string()), ..Lineage::default() };
    let d = crate::schema::DeadLetter::new("ingest", code, why, b"", lineage);
    report.skip(code);
    settle(send_owned(producer, &d, Lineage::default())?.await?, report);
    Ok(())
}

/// Ingests `args.files` through the bus (and the lake, when `args.sink`).
///
/// Nothing valid is lost to one bad input: a path that does not exist or cannot be read, one that is
/// not a regular file or directory (FIFO, socket, device: refused from its metadata, never opened), a
/// file whose format `--format auto` cannot recognise, and a file whose read fails part-way are each
/// a dead letter with its reason (see [`IngestReport::files_skipped`]), and ingest goes on with the
/// next input. A stop request (Ctrl-C / SIGTERM on `stop`) is checked between records: the reader
/// stops, what was produced is flushed (and sunk), and the report says [`IngestReport::stopped`].
///
/// # Errors
/// Kafka and lake errors; [`crate::Error::Config`] for an invalid `args.tenant`. Malformed records
/// and bad input files are never errors: they become dead letters.
pub async fn ingest(cfg: &PipelineConfig, args: &IngestArgs, stop: Stop) -> Result<IngestReport> {
    if let Some(t) = &args.tenant {
        crate::schema::validate_tenant(t).map_err(|e| crate::config_err!("--tenant: {e}"))?;
    }
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&["interactions", "dead_letters"]).await?;
    let producer = bus.producer()?;
    let source = TaskCtl::new("ingest", true, stop.clone());
    let sinks = start_sinks(cfg, &bus, &lake, &producer, &source, &stop, args.sink);
    let mut report = IngestReport::default();
    let inputs = ingest::inputs(&args.files);
    // The readers run on blocking threads: they see the stop request through this flag.
    let stop_flag = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (flag, mut s) = (stop_flag.clone(), stop.clone());
        tokio::spawn(async move {
            s.wait().await;
            flag.store(true, Ordering::Relaxed);
        })
    };
    let total_bytes: u64 = inputs
        .iter()
        .filter_map(|i| match i {
            ingest::Input::Read { path, .. } => std::fs::metadata(path).ok(),
            ingest::Input::Skip { .. } => None,
        })
        .map(|m| m.len())
        .sum();
    let bar = if args.progress && total_bytes > (8 << 20) {
        let b = ProgressBar::new(total_bytes);
        b.set_style(ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}").unwrap_or_else(|_| ProgressStyle::default_bar()));
        b
    } else {
        ProgressBar::hidden()
    };
    let result = async {
        for input in &inputs {
            if stop.requested() {
                report.stopped = true;
                break;
            }
            let file = match input {
                ingest::Input::Skip { path, code, reason } => {
                    skip_file(&producer, &mut report, path, code, reason.clone()).await?;
                    continue;
                }
                ingest::Input::Read { path, .. } => path,
            };
            let (format, detected) = match args.format {
                Some(f) => (f, false),
                None => match ingest::detect(file, DEFAULT_HEAD_BYTES) {
                    Ok(d) => {
                        eprintln!("{}: {d}", file.display());
                        (d.format, true)
                    }
                    // No agent log we know, or gone or unreadable since it was listed: a dead letter.
                    Err(Error::InvalidInput(why)) => {
                        skip_file(&producer, &mut report, file, ingest::UNDETECTED_FORMAT, why).await?;
                        continue;
                    }
                    Err(Error::Io { source, .. }) => {
                        let code = ingest::io_skip_reason(&source);
                        skip_file(&producer, &mut report, file, code, format!("{}: {source}", file.display())).await?;
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            let how = if detected { "auto-detected" } else { "given" };
            eprintln!("{}: format {} ({how})", file.display(), format.name());
            let (tx, mut rx) = mpsc::channel::<Item>(1024);
            let path = file.clone();
            let mut opts = IngestOptions::new(crate::schema::now_ms());
            opts.default_turn_type = args.default_turn_type;
            opts.tenant = args.tenant.clone();
            opts.stop = Some(stop_flag.clone());
            let reader = tokio::task::spawn_blocking(move || {
                let tx2 = tx.clone();
                let mut last = 0u64;
                ingest::read_file(
                    &path,
                    format,
                    &opts,
                    &mut |read| {
                        if read >= last + (1 << 20) {
                            let _ = tx2.blocking_send(Item::Bytes(read - last));
                            last = read;
                        }
                    },
                    &mut |item| tx.blocking_send(Item::Record(item)).map_err(|_| Error::Cancelled),
                )
            });
            // Records of this file the bus refused for their size (dead-lettered instead), so the
            // file's own line agrees with the totals.
            let mut too_large = 0u64;
            let mut inflight = FuturesUnordered::new();
            while let Some(item) = rx.recv().await {
                match item {
                    Item::Bytes(n) => bar.inc(n),
                    Item::Record(IngestItem::Interaction(i)) => {
                        report.interactions += 1;
                        inflight.push(send_owned(&producer, i.as_ref(), source_of(&i))?);
                    }
                    Item::Record(IngestItem::DeadLetter(d)) => {
                        *report.dead_letters.entry(d.reason_code.clone()).or_default() += 1;
                        inflight.push(send_owned(&producer, d.as_ref(), Lineage::default())?);
                    }
                }
                while inflight.len() >= 1000 {
                    if let Some(r) = inflight.next().await {
                        too_large += settle(r?, &mut report);
                    }
                }
            }
            while let Some(r) = inflight.next().await {
                too_large += settle(r?, &mut report);
            }
            match reader.await.map_err(|e| Error::Internal(format!("reader thread: {e}")))? {
                Ok(mut summary) => {
                    summary.interactions -= too_large.min(summary.interactions);
                    summary.dead_letters += too_large;
                    if too_large > 0 {
                        *summary.dead_letters_by_reason.entry(TOO_LARGE.to_string()).or_default() += too_large;
                    }
                    eprintln!("{}: {}", file.display(), summary.line());
                    report.files.push((file.display().to_string(), format.name().to_string(), detected));
                }
                Err(Error::Cancelled) if stop.requested() => {
                    eprintln!("{}: stopped (stop requested) part-way through the file", file.display());
                    report.files.push((file.display().to_string(), format.name().to_string(), detected));
                    report.stopped = true;
                    break;
                }
                // Gone, unreadable or corrupt part-way: what was read is kept; the file is a dead letter.
                Err(Error::Io { op, source, .. }) => {
                    let code = ingest::io_skip_reason(&source);
                    skip_file(&producer, &mut report, file, code, format!("{op} {}: {source}", file.display())).await?;
                }
                Err(e) => return Err(e),
            }
        }
        producer.flush()?;
        Ok::<(), Error>(())
    }
    .await;
    watcher.abort();
    bar.finish_and_clear();
    finish_sinks(source, &stop, sinks, result.is_err(), &mut report).await?;
    result?;
    Ok(report)
}

/// The in-process lake sinks of `interactions` and `dead_letters`, each finishing once `source` is
/// done and everything it produced is durable.
pub(crate) type Sinks = SinkTasks;

/// Starts the sinks of `interactions` and `dead_letters` when `sink` (else none).
pub(crate) fn start_sinks(cfg: &PipelineConfig, bus: &Bus, lake: &Lake, producer: &crate::bus::BusProducer, source: &TaskCtl, stop: &Stop, sink: bool) -> Sinks {
    if !sink {
        return vec![];
    }
    crate::lake::sink::start_sinks(&["interactions", "dead_letters"], bus, lake, &cfg.sink, producer, |table| TaskCtl::new(&format!("sink:{table}"), true, stop.clone()).after(&source.done))
}

/// Marks `source` done (a stop is requested first when it `failed`) and waits for the sinks,
/// recording their statistics.
///
/// # Errors
/// A sink's error, or [`Error::Internal`] when its task panicked.
pub(crate) async fn finish_sinks(source: TaskCtl, stop: &Stop, sinks: Sinks, failed: bool, report: &mut IngestReport) -> Result<()> {
    source.done.set();
    if failed {
        stop.request();
    }
    for (table, h) in sinks {
        let s = h.await.map_err(|e| Error::Internal(format!("sink task: {e}")))??;
        report.sinks.insert(table.to_string(), s);
    }
    Ok(())
}

/// What became of one send.
pub(crate) enum Sent {
    /// Delivered as is.
    Delivered,
    /// Over the bus's record limit: a `record_too_large` dead letter was sent instead.
    TooLarge,
}

/// Counts a send that was turned into a dead letter: moves it from the interactions to the
/// `record_too_large` dead letters of `report`. Returns how many sends were (0 or 1), for the
/// caller's per-file counts.
pub(crate) fn settle(sent: Sent, report: &mut IngestReport) -> u64 {
    match sent {
        Sent::Delivered => 0,
        Sent::TooLarge => {
            report.interactions = report.interactions.saturating_sub(1);
            *report.dead_letters.entry(TOO_LARGE.to_string()).or_default() += 1;
            1
        }
    }
}

/// A send of `row` to its table's topic as an owned future (so sends of different tables can share one
/// window of in-flight futures). A row the bus refuses for its size becomes a dead letter instead
/// (stage `ingest`, reason `record_too_large`, the first [`TOO_LARGE_PAYLOAD_BYTES`] of the record or a
/// quarter of the limit if less, none if even that is refused; the row's session and key, and its
/// source file and line from `source`). The limit: 2 MiB on the embedded
/// bus ([`crate::bus::flow::EMBEDDED_MAX_RECORD_BYTES`], fixed); `[bus] max_message_bytes` (default
/// 64 MiB) and the broker's own limit on a real cluster.
pub(crate) fn send_owned<T: crate::schema::Table>(
    p: &crate::bus::BusProducer,
    row: &T,
    source: Lineage,
) -> Result<std::pin::Pin<Box<dyn std::future::Future<Output = Result<Sent>> + Send>>> {
    let payload = serde_json::to_vec(&crate::bus::Envelope { row, carry: None })?;
    let (p, topic, key) = (p.clone(), p.topic_of::<T>(), row.message_key().to_string());
    let is_dead_letter = T::NAME == <crate::schema::DeadLetter as crate::schema::Table>::NAME;
    let row_key = row.key().to_string();
    Ok(Box::pin(async move {
        match p.send_raw(&topic, &key, &payload).await {
            Ok(_) => Ok(Sent::Delivered),
            Err(e @ Error::RecordTooLarge { limit, .. }) if !is_dead_letter => {
                // A quarter of the limit leaves room for the dead letter's own fields and JSON escaping
                // when `[bus] max_message_bytes` is set low.
                let keep = TOO_LARGE_PAYLOAD_BYTES.min(usize::try_from(limit / 4).unwrap_or(usize::MAX));
                let head = &payload[..payload.len().min(keep)];
                let d = crate::schema::DeadLetter::new("ingest", TOO_LARGE, format!("{e} (payload: first {} bytes)", head.len()), head, source.clone()).with_keys(&key, Some(&row_key));
                match p.send(&d, None).await {
                    Err(Error::RecordTooLarge { .. }) => {
                        let d = crate::schema::DeadLetter::new("ingest", TOO_LARGE, format!("{e} (payload not kept)"), b"", source).with_keys(&key, Some(&row_key));
                        p.send(&d, None).await?;
                    }
                    r => {
                        r?;
                    }
                }
                Ok(Sent::TooLarge)
            }
            Err(e) => Err(e),
        }
    }))
}

/// The source file and line of an interaction read from a log, for [`send_owned`].
pub(crate) fn source_of(i: &crate::schema::Interaction) -> Lineage {
    Lineage { source_file: i.source_file.clone(), source_line: i.source_line, ..Lineage::default() }
}
