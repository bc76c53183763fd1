//! `nextstate ingest` wiring: reads agent logs with the [`crate::ingest`] adapters (a blocking reader
//! thread, streaming) and produces each interaction to the `interactions` topic and each rejected record
//! to `dead_letters`, with a bounded window of in-flight sends. Unless told otherwise, the lake sinks of
//! those two tables run in the same process until everything produced is durable.

use std::collections::BTreeMap;
use std::path::PathBuf;

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
use crate::schema::TurnType;

/// Options of `nextstate ingest`.
#[derive(Debug, Clone)]
pub struct IngestArgs {
    /// Files and directories to read (directories walked recursively: [`ingest::expand_paths`]).
    pub files: Vec<PathBuf>,
    /// Format, or None for auto-detection per file.
    pub format: Option<Format>,
    /// Turn type of turns the log does not mark.
    pub default_turn_type: TurnType,
    /// Also run the lake sinks of `interactions` and `dead_letters` until the records are durable.
    pub sink: bool,
    /// Show a progress bar.
    pub progress: bool,
}

/// What an ingest did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestReport {
    /// Per file: the format used and whether it was auto-detected.
    pub files: Vec<(String, String, bool)>,
    /// Interactions produced.
    pub interactions: u64,
    /// Dead letters produced, by reason code.
    pub dead_letters: BTreeMap<String, u64>,
    /// Sink statistics per table (when the sinks ran in-process).
    pub sinks: BTreeMap<String, SinkStats>,
}

enum Item {
    Record(IngestItem),
    Bytes(u64),
}

/// Ingests `args.files` through the bus (and the lake, when `args.sink`).
///
/// # Errors
/// [`Error::Io`] for unreadable files, [`Error::InvalidInput`] when a format cannot be detected, Kafka
/// and lake errors. Malformed records are never errors: they become dead letters.
pub async fn ingest(cfg: &PipelineConfig, args: &IngestArgs, stop: Stop) -> Result<IngestReport> {
    let lake = Lake::open(&cfg.lake)?;
    let bus = Bus::connect(cfg.bus.clone()).await?;
    bus.ensure_topics(&["interactions", "dead_letters"]).await?;
    let producer = bus.producer()?;
    let source = TaskCtl::new("ingest", true, stop.clone());
    let sinks = start_sinks(cfg, &bus, &lake, &producer, &source, &stop, args.sink);
    let mut report = IngestReport::default();
    let files = ingest::expand_paths(&args.files)?;
    let total_bytes: u64 = files.iter().filter_map(|(f, _)| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let bar = if args.progress && total_bytes > (8 << 20) {
        let b = ProgressBar::new(total_bytes);
        b.set_style(ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}").unwrap_or_else(|_| ProgressStyle::default_bar()));
        b
    } else {
        ProgressBar::hidden()
    };
    let result = async {
        for (file, walked) in &files {
            let (format, detected) = match args.format {
                Some(f) => (f, false),
                None => match ingest::detect(file, DEFAULT_HEAD_BYTES) {
                    Ok(d) => {
                        eprintln!("{}: {d}", file.display());
                        (d.format, true)
                    }
                    // A file found by walking a directory that is no agent log we know: a dead letter.
                    Err(Error::InvalidInput(why)) if *walked => {
                        eprintln!("{}: skipped: {why}", file.display());
                        let lineage = crate::schema::Lineage { source_file: Some(file.display().to_string()), ..crate::schema::Lineage::default() };
                        let d = crate::schema::DeadLetter::new("ingest", "undetected_format", why, b"", lineage);
                        *report.dead_letters.entry(d.reason_code.clone()).or_default() += 1;
                        settle(send_owned(&producer, &d)?.await?, &mut report);
                        report.files.push((file.display().to_string(), "undetected".to_string(), true));
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            let how = if detected { "auto-detected" } else { "given" };
            eprintln!("{}: format {} ({how})", file.display(), format.name());
            report.files.push((file.display().to_string(), format.name().to_string(), detected));
            let (tx, mut rx) = mpsc::channel::<Item>(1024);
            let path = file.clone();
            let mut opts = IngestOptions::new(crate::schema::now_ms());
            opts.default_turn_type = args.default_turn_type;
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
            let mut inflight = FuturesUnordered::new();
            while let Some(item) = rx.recv().await {
                match item {
                    Item::Bytes(n) => bar.inc(n),
                    Item::Record(IngestItem::Interaction(i)) => {
                        report.interactions += 1;
                        inflight.push(send_owned(&producer, i.as_ref())?);
                    }
                    Item::Record(IngestItem::DeadLetter(d)) => {
                        *report.dead_letters.entry(d.reason_code.clone()).or_default() += 1;
                        inflight.push(send_owned(&producer, d.as_ref())?);
                    }
                }
                while inflight.len() >= 1000 {
                    if let Some(r) = inflight.next().await {
                        settle(r?, &mut report);
                    }
                }
            }
            while let Some(r) = inflight.next().await {
                settle(r?, &mut report);
            }
            let summary = reader.await.map_err(|e| Error::Internal(format!("reader thread: {e}")))??;
            eprintln!("{}: {}", file.display(), summary.line());
        }
        producer.flush()?;
        Ok::<(), Error>(())
    }
    .await;
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

/// Counts a send that was turned into a dead letter.
pub(crate) fn settle(sent: Sent, report: &mut IngestReport) {
    if let Sent::TooLarge = sent {
        report.interactions = report.interactions.saturating_sub(1);
        *report.dead_letters.entry(TOO_LARGE.to_string()).or_default() += 1;
    }
}

/// A send of `row` to its table's topic as an owned future (so sends of different tables can share one
/// window of in-flight futures). A row the bus refuses for its size becomes a dead letter (stage
/// `ingest`, reason `record_too_large`, the first [`TOO_LARGE_PAYLOAD_BYTES`] of the record).
pub(crate) fn send_owned<T: crate::schema::Table>(p: &crate::bus::BusProducer, row: &T) -> Result<std::pin::Pin<Box<dyn std::future::Future<Output = Result<Sent>> + Send>>> {
    let payload = serde_json::to_vec(&crate::bus::Envelope { row, carry: None })?;
    let (p, topic, key) = (p.clone(), p.topic_of::<T>(), row.session_id().to_string());
    let is_dead_letter = T::NAME == <crate::schema::DeadLetter as crate::schema::Table>::NAME;
    let row_key = row.key().to_string();
    Ok(Box::pin(async move {
        match p.send_raw(&topic, &key, &payload).await {
            Ok(_) => Ok(Sent::Delivered),
            Err(e @ Error::RecordTooLarge { .. }) if !is_dead_letter => {
                let head = &payload[..payload.len().min(TOO_LARGE_PAYLOAD_BYTES)];
                let d =
                    crate::schema::DeadLetter::new("ingest", TOO_LARGE, format!("{e} (payload: first {} bytes)", head.len()), head, crate::schema::Lineage::default())
                        .with_keys(&key, Some(&row_key));
                p.send(&d, None).await?;
                Ok(Sent::TooLarge)
            }
            Err(e) => Err(e),
        }
    }))
}
