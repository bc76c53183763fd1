//! Kafka → Parquet sink, exactly-once by construction.
//!
//! - Rows are buffered per partition and written as one file per (partition, contiguous offset range,
//!   date), named by that range ([`kafka_stem`]); a file is complete once renamed into place.
//! - A file is written on a blocking thread while the sink goes on reading (at most
//!   [`MAX_WRITES_IN_FLIGHT`] files at a time, finished in the order they were started); its offsets are
//!   committed to Kafka only after the file is durable. The committed offset is advisory:
//!   on start and after every rebalance the sink re-reads the lake's own record of the last durable
//!   offset per partition ([`Lake::next_offsets`]) and skips anything below it, so a crash between the
//!   rename and the commit re-reads a range but never writes it twice.
//! - Rows whose primary key the sink has seen recently are skipped and counted (`duplicate_keys`): an
//!   upstream stage that re-emits after its own crash (at-least-once) still leaves each key once. The
//!   keys held are bounded by a window of offsets per partition (`[sink] dedupe_window`, see
//!   [`super::dedupe`]), not by the size of the table.
//! - With `--until-idle`, once the upstream is done and the input looks drained
//!   ([`InputLoop::drained`]: the high watermarks of the last fetch responses are read), every buffer
//!   is written at once, so the idle wait overlaps the last writes instead of preceding them; its polls
//!   then end when the idle wait does, and poll every [`crate::runtime::PENDING_POLL`] while its writes
//!   are still in flight ([`TaskCtl::poll_wait`]), so it exits soon after both, not up to a 200 ms poll
//!   later.
//! - Records that are not valid envelopes of the table's row type go to the dead-letter table with the
//!   reason, and their offsets still advance (an empty file can mark a range holding only such records).
//!
//! Residual risk (documented): a sink process that lost its partitions but has not noticed yet (a
//! "zombie") can write a range the new owner also writes; Kafka transactions would fence it, the mock
//! cluster and noida-db do not need it for the single-writer deployments we run.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::dedupe::RecentKeys;
use super::{date_of, kafka_stem, Lake};
use crate::bus::{Bus, BusProducer};
use crate::error::{Error, Result};
use crate::runtime::{InMsg, InputLoop, TaskCtl};
use crate::schema::{DeadLetter, Lineage, Table};

/// Sink settings (`[sink]` of a pipeline file).
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SinkConfig {
    /// Roll a file when its buffered payload reaches this many bytes.
    pub roll_bytes: usize,
    /// The most payload bytes the sink buffers across all its partitions (default 64 MiB): past it the
    /// largest partition's buffer is written early, so a sink's memory does not grow with the number of
    /// partitions it owns (at most this plus the [`MAX_WRITES_IN_FLIGHT`] files being written).
    pub buffer_bytes: usize,
    /// Roll a file when its oldest buffered row is this old, in ms.
    pub roll_ms: u64,
    /// Consumer group prefix; the group is `<topic prefix><group prefix>.<table>`.
    pub group_prefix: String,
    /// Max records per poll.
    pub batch: usize,
    /// How many records back, per partition, a row's key is checked against (default 50,000): the
    /// sink holds the keys of the newest `dedupe_window` records of each partition it owns (and of the
    /// newest `dedupe_window` rows the table got another way), about 100 bytes each. An upstream
    /// stage re-emits at most what it produced since its last commit, far fewer; a duplicate arriving
    /// more than this many records after its first copy is not caught (see [`super::dedupe`]).
    pub dedupe_window: u64,
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig { roll_bytes: 64 << 20, buffer_bytes: 64 << 20, roll_ms: 5000, group_prefix: "nextstate-lake".into(), batch: 2000, dedupe_window: 50_000 }
    }
}

/// What a sink did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SinkStats {
    /// Rows written to the table.
    pub rows_written: u64,
    /// Files written.
    pub files: u64,
    /// Records skipped because their offset was already durable in the lake.
    pub already_in_lake: u64,
    /// Rows skipped because their key was already in the table (within `dedupe_window`) or buffered.
    pub duplicate_keys: u64,
    /// Records sent to the dead-letter table.
    pub dead_letters: u64,
    /// Buffered records released because their partition was revoked (the new owner re-reads them).
    pub released_on_rebalance: u64,
}

impl SinkStats {
    /// One line for a person: what was written, what went to the dead-letter table, and what was not
    /// written again because the lake already holds it (normal whenever rows are read again — a restart,
    /// a rebalance, the embedded bus re-published from the lake — not a fault), then any buffered
    /// records released on a rebalance. E.g. `rows_written=10 files=1 dead_letters=0 already_written=4
    /// (by offset 0, by key 4: each row is written once)`.
    pub fn line(&self) -> String {
        let mut s = format!("rows_written={} files={} dead_letters={}", self.rows_written, self.files, self.dead_letters);
        let again = self.already_in_lake + self.duplicate_keys;
        if again > 0 {
            s.push_str(&format!(
                " already_written={again} (by offset {}, by key {}: rows read again are written once; not a fault)",
                self.already_in_lake, self.duplicate_keys
            ));
        }
        if self.released_on_rebalance > 0 {
            s.push_str(&format!(" released_on_rebalance={} (the partition's new owner writes them)", self.released_on_rebalance));
        }
        s
    }
}

#[derive(Deserialize)]
struct RowOnly<T> {
    row: T,
}

struct Buffer<T> {
    rows: Vec<T>,
    first: i64,
    last: i64,
    /// UTC day (days since the epoch) of the buffered rows' event times: one file holds one date.
    day: Option<i64>,
    bytes: usize,
    since: Instant,
}

/// How many files a sink writes at once on blocking threads while it goes on reading (the machines we
/// run on have 2 cores: the consumer loop and one or two writers); a further file waits for the oldest.
pub const MAX_WRITES_IN_FLIGHT: usize = 2;

/// A file being written on a blocking thread.
struct Write {
    partition: i32,
    /// The offset after the file's range (what is committed once the file is durable).
    next: i64,
    rows: u64,
    /// The file's path, or `None` when no file was needed (an empty range on the embedded cluster).
    task: tokio::task::JoinHandle<Result<Option<super::Written>>>,
}

/// The sink's writes in flight, finished in start order so that a partition's commits stay in order.
#[derive(Default)]
struct Writes {
    queue: VecDeque<Write>,
}

impl Writes {
    /// Waits for the oldest write, then records it: stats, the lake's next offset, the Kafka commit.
    async fn finish_one(&mut self, input: &InputLoop, table: &str, stats: &mut SinkStats, lake_next: &mut HashMap<i32, i64>) -> Result<bool> {
        let Some(w) = self.queue.pop_front() else { return Ok(false) };
        let written = w.task.await.map_err(|e| Error::Internal(format!("sink file writer task failed: {e}")))??;
        if let Some(file) = written {
            stats.files += 1;
            crate::metrics::sink_file(table, w.rows, file.bytes);
        }
        stats.rows_written += w.rows;
        lake_next.insert(w.partition, w.next);
        // The file is durable; only now tell Kafka. A failed commit is harmless (the lake has the truth).
        if let Err(e) = input.commit(&HashMap::from([(w.partition, w.next)])) {
            tracing::warn!(partition = w.partition, error = %e, "offset commit failed after a durable write; the lake offsets still protect against duplicates");
        }
        Ok(true)
    }

    /// Waits for every write in flight (before the sink re-reads the lake's offsets, and at the end).
    async fn finish_all(&mut self, input: &InputLoop, table: &str, stats: &mut SinkStats, lake_next: &mut HashMap<i32, i64>) -> Result<()> {
        while self.finish_one(input, table, stats, lake_next).await? {}
        Ok(())
    }

    /// Records the writes that are done, without waiting for the others.
    async fn finish_done(&mut self, input: &InputLoop, table: &str, stats: &mut SinkStats, lake_next: &mut HashMap<i32, i64>) -> Result<()> {
        while self.queue.front().is_some_and(|w| w.task.is_finished()) {
            self.finish_one(input, table, stats, lake_next).await?;
        }
        Ok(())
    }
}

/// The consumer group of the lake sink of `table`.
pub fn sink_group(bus: &Bus, cfg: &SinkConfig, table: &str) -> String {
    bus.group(&format!("{}.{}", cfg.group_prefix, table))
}

/// Runs the lake sink of `table` (by name).
///
/// # Errors
/// [`Error::Config`] for an unknown table; sink errors.
pub async fn spawn_sink(table: &str, bus: &Bus, lake: &Lake, cfg: &SinkConfig, ctl: &TaskCtl, dl: Option<&BusProducer>) -> Result<SinkStats> {
    use crate::schema::*;
    match table {
        t if t == Interaction::NAME => run_sink::<Interaction>(bus, lake, cfg, ctl, dl).await,
        t if t == Signal::NAME => run_sink::<Signal>(bus, lake, cfg, ctl, dl).await,
        t if t == Judgment::NAME => run_sink::<Judgment>(bus, lake, cfg, ctl, dl).await,
        t if t == HintRecord::NAME => run_sink::<HintRecord>(bus, lake, cfg, ctl, dl).await,
        t if t == TeacherLogprobs::NAME => run_sink::<TeacherLogprobs>(bus, lake, cfg, ctl, dl).await,
        t if t == Sample::NAME => run_sink::<Sample>(bus, lake, cfg, ctl, dl).await,
        t if t == Checkpoint::NAME => run_sink::<Checkpoint>(bus, lake, cfg, ctl, dl).await,
        t if t == TrainStep::NAME => run_sink::<TrainStep>(bus, lake, cfg, ctl, dl).await,
        t if t == DeadLetter::NAME => run_sink::<DeadLetter>(bus, lake, cfg, ctl, dl).await,
        t => Err(Error::Config(format!("no sink for table '{t}'"))),
    }
}

/// Running lake sinks: each table's name and its task (see [`start_sinks`]).
pub type SinkTasks = Vec<(&'static str, tokio::task::JoinHandle<Result<SinkStats>>)>;

/// Starts one lake sink per table of `tables` on tokio tasks: first registers every sink's consumer
/// group (an embedded bus then keeps the tables' records for them), then spawns [`spawn_sink`] with the
/// controls `ctl(table)` gives. Malformed records go to `dead_letters` (except the dead-letter table's
/// own sink, which writes them into the lake itself).
///
/// Errors are those of each task: [`spawn_sink`]'s, returned when the task is awaited.
pub fn start_sinks(tables: &[&'static str], bus: &Bus, lake: &Lake, cfg: &SinkConfig, dead_letters: &BusProducer, ctl: impl Fn(&str) -> TaskCtl) -> SinkTasks {
    for table in tables {
        bus.expect_consumer(&sink_group(bus, cfg, table), table);
    }
    tables
        .iter()
        .map(|&table| {
            let ctl = ctl(table);
            let (bus, lake, cfg) = (bus.clone(), lake.clone(), cfg.clone());
            let dl = (table != DeadLetter::NAME).then(|| dead_letters.clone());
            (table, tokio::spawn(async move { spawn_sink(table, &bus, &lake, &cfg, &ctl, dl.as_ref()).await }))
        })
        .collect()
}

/// Consumes the topic of table `T` and writes it into `lake`, until stopped (or idle, per `ctl`).
///
/// `dead_letters`: producer for malformed records (`None` when this is the dead-letter table's own
/// sink: those are then written straight into the lake).
///
/// # Errors
/// [`crate::Error::Kafka`] on consumer failures, lake write errors.
pub async fn run_sink<T: Table>(bus: &Bus, lake: &Lake, cfg: &SinkConfig, ctl: &TaskCtl, dead_letters: Option<&BusProducer>) -> Result<SinkStats> {
    let topic = bus.topic(T::NAME);
    let group = sink_group(bus, cfg, T::NAME);
    let mut input = InputLoop::new(bus, &group, &topic)?.for_stage("sink");
    let mut stats = SinkStats::default();
    let mut lake_next = load_next(lake, bus, &topic, T::NAME)?;
    let mut keys = RecentKeys::load(lake, T::NAME, T::KEY, bus.source_id(), &topic, cfg.dedupe_window, None)?;
    let mut bufs: HashMap<i32, Buffer<T>> = HashMap::new();
    let mut dl_seq = 0u64;
    let writer_id = format!("sink-{}", uuid::Uuid::new_v4().simple());
    let mut writes = Writes::default();
    let mut generation = input.generation();
    loop {
        if ctl.stop.requested() {
            break;
        }
        let wait = input.poll_wait(ctl, Duration::from_millis(200), bufs.len() + writes.queue.len());
        let msgs = input.next_batch(cfg.batch, wait).await?;
        writes.finish_done(&input, T::NAME, &mut stats, &mut lake_next).await?;
        if input.rebalanced() {
            // The lake's offsets are the truth only once this process's own files are in it.
            writes.finish_all(&input, T::NAME, &mut stats, &mut lake_next).await?;
            lake_next = load_next(lake, bus, &topic, T::NAME)?;
            let owned: HashSet<i32> = input.assigned().into_iter().collect();
            // Another process may have written the partitions this one now owns: re-read their window.
            keys = RecentKeys::load(lake, T::NAME, T::KEY, bus.source_id(), &topic, cfg.dedupe_window, Some(&owned))?;
            // A replaced consumer reads every partition again from its committed offset: no buffer is
            // kept (its records arrive again).
            let replaced = input.generation() != generation;
            generation = input.generation();
            bufs.retain(|p, b| {
                let keep = !replaced && owned.contains(p);
                if !keep {
                    stats.released_on_rebalance += (b.last - b.first + 1) as u64;
                }
                keep
            });
            for (p, b) in &bufs {
                for r in &b.rows {
                    keys.insert(*p, r.key(), b.last);
                }
            }
        }
        let mut dead: Vec<DeadLetter> = vec![];
        for m in msgs {
            if m.offset < lake_next.get(&m.partition).copied().unwrap_or(0) {
                stats.already_in_lake += 1;
                continue;
            }
            let parsed = serde_json::from_slice::<RowOnly<T>>(&m.payload);
            let row = match parsed {
                Ok(r) => Some(r.row),
                Err(e) => {
                    dead.push(dead_letter_for(&m, &topic, T::NAME, &e.to_string()));
                    None
                }
            };
            if let Some(r) = &row {
                if let Some(b) = bufs.get(&m.partition) {
                    if b.day.is_some_and(|day| day != day_of(r.event_time_ms())) {
                        flush(lake, bus, &input, &mut bufs, m.partition, &mut writes, &mut stats, &mut lake_next).await?;
                    }
                }
            }
            let b = bufs.entry(m.partition).or_insert_with(|| Buffer {
                rows: vec![],
                first: m.offset,
                last: m.offset,
                day: None,
                bytes: 0,
                since: Instant::now(),
            });
            b.last = m.offset;
            b.bytes += m.payload.len();
            if let Some(r) = row {
                if keys.contains(m.partition, r.key()) {
                    stats.duplicate_keys += 1;
                } else {
                    keys.insert(m.partition, r.key(), m.offset);
                    b.day.get_or_insert_with(|| day_of(r.event_time_ms()));
                    b.rows.push(r);
                }
            }
        }
        if !dead.is_empty() {
            stats.dead_letters += dead.len() as u64;
            match dead_letters {
                Some(p) => {
                    for d in &dead {
                        p.send(d, None).await?;
                    }
                }
                None => {
                    dl_seq += 1;
                    lake.write_rows(&dead, &writer_id, dl_seq)?;
                }
            }
        }
        let finishing = ctl.until_idle && ctl.upstream_done() && input.quiet_ms() >= ctl.idle_ms;
        // Until idle, once the input looks drained the buffers are written at once, so the idle wait
        // overlaps the last writes (a record arriving later starts a new buffer).
        let drained = ctl.until_idle && ctl.upstream_done() && !bufs.is_empty() && input.drained();
        let due = due_partitions(&bufs, cfg, finishing || drained);
        for p in due {
            flush(lake, bus, &input, &mut bufs, p, &mut writes, &mut stats, &mut lake_next).await?;
        }
        if finishing {
            writes.finish_all(&input, T::NAME, &mut stats, &mut lake_next).await?;
        }
        if input.idle_finished(ctl, bufs.len() + writes.queue.len()).await? {
            break;
        }
    }
    let parts: Vec<i32> = bufs.keys().copied().collect();
    for p in parts {
        flush(lake, bus, &input, &mut bufs, p, &mut writes, &mut stats, &mut lake_next).await?;
    }
    writes.finish_all(&input, T::NAME, &mut stats, &mut lake_next).await?;
    tracing::info!(table = T::NAME, ?stats, "sink finished");
    ctl.done.set();
    Ok(stats)
}

/// The partitions whose buffers are written now: all when `finishing`; those past `roll_bytes` or
/// `roll_ms`; then, while the others together still hold more than `buffer_bytes`, the largest of them.
fn due_partitions<T>(bufs: &HashMap<i32, Buffer<T>>, cfg: &SinkConfig, finishing: bool) -> Vec<i32> {
    let rolled = |b: &Buffer<T>| finishing || b.bytes >= cfg.roll_bytes || b.since.elapsed().as_millis() as u64 >= cfg.roll_ms;
    let mut due: Vec<i32> = bufs.iter().filter(|(_, b)| rolled(b)).map(|(p, _)| *p).collect();
    let mut rest: Vec<(usize, i32)> = bufs.iter().filter(|(_, b)| !rolled(b)).map(|(p, b)| (b.bytes, *p)).collect();
    let mut held: usize = rest.iter().map(|(bytes, _)| bytes).sum();
    rest.sort_unstable();
    while held > cfg.buffer_bytes {
        let Some((bytes, p)) = rest.pop() else { break };
        held -= bytes;
        due.push(p);
    }
    due
}

const MS_PER_DAY: i64 = 86_400_000;

/// The UTC day of a time in ms since the epoch (the `date=` partition [`date_of`] names), compared per
/// row without formatting a date.
fn day_of(ms: i64) -> i64 {
    ms.div_euclid(MS_PER_DAY)
}

fn load_next(lake: &Lake, bus: &Bus, topic: &str, table: &str) -> Result<HashMap<i32, i64>> {
    Ok(lake
        .next_offsets(table)?
        .into_iter()
        .filter(|((s, t, _), _)| s == bus.source_id() && t == topic)
        .map(|((_, _, p), o)| (p, o))
        .collect())
}

/// Starts writing partition `partition`'s buffer as one file on a blocking thread (after the oldest
/// write in flight when [`MAX_WRITES_IN_FLIGHT`] are): the file is named by the buffer's offset range
/// and dated by its rows' day. Its offsets are committed when [`Writes`] finishes it.
#[allow(clippy::too_many_arguments)]
async fn flush<T: Table>(
    lake: &Lake,
    bus: &Bus,
    input: &InputLoop,
    bufs: &mut HashMap<i32, Buffer<T>>,
    partition: i32,
    writes: &mut Writes,
    stats: &mut SinkStats,
    lake_next: &mut HashMap<i32, i64>,
) -> Result<()> {
    let Some(b) = bufs.remove(&partition) else { return Ok(()) };
    while writes.queue.len() >= MAX_WRITES_IN_FLIGHT {
        writes.finish_one(input, T::NAME, stats, lake_next).await?;
    }
    let date = date_of(b.day.unwrap_or_else(|| day_of(crate::schema::now_ms())) * MS_PER_DAY);
    let stem = kafka_stem(bus.source_id(), &input.topic, partition, b.first, b.last);
    tracing::debug!(table = T::NAME, partition, first = b.first, last = b.last, rows = b.rows.len(), "flush");
    // An empty file marks a durable offset range (records that were all duplicates or dead letters).
    // The embedded cluster's offsets die with the process, so there it would only clutter the lake.
    let write_file = !(b.rows.is_empty() && bus.is_embedded());
    let rows = b.rows.len() as u64;
    let lake = lake.clone();
    let task = tokio::task::spawn_blocking(move || {
        if !write_file {
            return Ok(None);
        }
        let refs: Vec<&T> = b.rows.iter().collect();
        lake.write_file::<T>(&date, &stem, &refs).map(Some)
    });
    writes.queue.push_back(Write { partition, next: b.last + 1, rows, task });
    Ok(())
}

/// A dead letter for a record that is not a valid envelope of `table`'s rows.
pub fn dead_letter_for(m: &InMsg, topic: &str, table: &str, why: &str) -> DeadLetter {
    DeadLetter::new(
        "sink",
        "malformed_record",
        format!("record is not a valid {table} row: {why}"),
        &m.payload,
        Lineage {
            source_topic: Some(topic.to_string()),
            source_partition: Some(m.partition),
            source_offset: Some(m.offset),
            ..Default::default()
        },
    )
    .with_keys(&m.key, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_reads_rows_read_again_as_normal() {
        let clean = SinkStats { rows_written: 10, files: 1, ..Default::default() };
        assert_eq!(clean.line(), "rows_written=10 files=1 dead_letters=0");
        let again = SinkStats { already_in_lake: 3, duplicate_keys: 4, dead_letters: 1, released_on_rebalance: 2, ..Default::default() };
        assert_eq!(
            again.line(),
            "rows_written=0 files=0 dead_letters=1 already_written=7 (by offset 3, by key 4: rows read again are written once; not a fault) released_on_rebalance=2 (the partition's new owner writes them)"
        );
    }

    fn buffer(bytes: usize) -> Buffer<()> {
        Buffer { rows: vec![], first: 0, last: 0, day: None, bytes, since: Instant::now() }
    }

    #[test]
    fn the_largest_buffers_are_written_while_all_together_hold_more_than_buffer_bytes() {
        let cfg = SinkConfig { roll_bytes: 100, buffer_bytes: 100, ..Default::default() };
        let bufs: HashMap<i32, Buffer<()>> = [(0, buffer(30)), (1, buffer(50)), (2, buffer(40)), (3, buffer(10))].into_iter().collect();
        // 130 held: the largest (50) goes, leaving 80.
        assert_eq!(due_partitions(&bufs, &cfg, false), vec![1]);
        let cfg = SinkConfig { buffer_bytes: 45, ..cfg };
        // 130 → 80 → 40: p1 (50) then p2 (40) go.
        assert_eq!(due_partitions(&bufs, &cfg, false), vec![1, 2]);
        // A rolled buffer does not count towards the rest.
        let bufs: HashMap<i32, Buffer<()>> = [(0, buffer(100)), (1, buffer(60)), (2, buffer(30))].into_iter().collect();
        let cfg = SinkConfig { roll_bytes: 100, buffer_bytes: 100, ..Default::default() };
        assert_eq!(due_partitions(&bufs, &cfg, false), vec![0]);
        let mut all = due_partitions(&bufs, &cfg, true);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2], "finishing writes every buffer");
        let cfg = SinkConfig { roll_ms: 0, ..cfg };
        assert_eq!(due_partitions(&bufs, &cfg, false).len(), 3, "roll_ms reached");
    }

    /// Until idle, a drained input's buffers are written at once, before the idle wait (here 6 s, with
    /// rolls far off), not after it; the run still ends only after the wait, with every row once. (The
    /// embedded cluster's group join takes about 3 s, so the times are measured from the write.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn until_idle_writes_the_buffers_once_the_input_is_drained_not_after_the_idle_wait() {
        use crate::bus::BusConfig;
        use crate::runtime::Stop;
        use crate::schema::Interaction;
        let bus = Bus::connect(BusConfig { partitions: 2, ..Default::default() }).await.unwrap();
        bus.ensure_topics(&["interactions", "dead_letters"]).await.unwrap();
        let producer = bus.producer().unwrap();
        for i in 0..20 {
            producer.send(&crate::ablate::fixtures::interaction(&format!("s{}", i % 5), i), None).await.unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let mut ctl = TaskCtl::new("sink:interactions", true, Stop::default());
        ctl.idle_ms = 6000;
        let cfg = SinkConfig { roll_ms: 600_000, ..Default::default() };
        let started = Instant::now();
        let sink = {
            let (bus, lake) = (bus.clone(), lake.clone());
            tokio::spawn(async move { run_sink::<Interaction>(&bus, &lake, &cfg, &ctl, None).await })
        };
        let written = loop {
            if lake.keys::<Interaction>().unwrap().len() == 20 || sink.is_finished() {
                break started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(!sink.is_finished(), "the sink was still waiting for idle when its rows were written");
        let stats = sink.await.unwrap().unwrap();
        let done = started.elapsed();
        // Written at once: most of the 6 s wait comes after (without the early write: none of it).
        assert!(done >= written + Duration::from_millis(4000), "rows written after {written:?}, the run ended after {done:?}");
        assert_eq!((stats.rows_written, stats.duplicate_keys, stats.dead_letters), (20, 0, 0));
        assert_eq!(lake.keys::<Interaction>().unwrap().len(), 20);
    }

    #[test]
    fn day_of_names_the_same_date_as_date_of() {
        for ms in [0, 1, 86_399_999, 86_400_000, 1_764_000_000_000, 1_764_028_799_999, -1, -86_400_001, 4_102_444_800_000] {
            assert_eq!(date_of(day_of(ms) * MS_PER_DAY), date_of(ms), "{ms}");
        }
    }
}
