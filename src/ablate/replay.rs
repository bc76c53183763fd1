//! `nextstate replay`: re-publish historical rows selected with SQL — into the pipeline's topics (a real
//! cluster), or into a fresh lake where the pipeline's stages run on them — preserving lineage to the
//! original rows.
//!
//! - **Rows keep their ids.** An interaction gets one more `notes` entry, `replay-of <interaction_id> from
//!   <lake>`; every replay into a lake also writes `_state/replay/manifest.json` (source lake, query,
//!   table, the replayed keys).
//! - **Caches.** Into a lake, the source lake's vote cache (`_state/vote_cache/`, judge and hint votes) is
//!   copied, and its teacher rows are copied into `_state/teacher_cache/` (see
//!   [`crate::stages::teacher::TeacherCache`]): the stages then reuse every vote and every teacher
//!   log-prob whose key matches, so a replay pays model time only for what changed. The stage counts
//!   `votes_cached` and `teacher_cache_hit` say how much was reused.
//! - **Carry.** Stages after the first need upstream context (a judgment needs its interaction and
//!   signal). Rows published to a topic carry it, looked up in the source lake by interaction id.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::bus::{Bus, BusProducer, Carry};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::runtime::Stop;
use crate::schema::{HintRecord, Interaction, Judgment, Sample, Signal, Table, TeacherLogprobs};
use crate::stages::run::{start_pipeline, RunOptions, RunReport, Stage};
use crate::stages::teacher::TEACHER_CACHE_DIR;
use crate::{config_err, input_err};

/// The tables `replay` re-publishes.
pub const REPLAY_TABLES: &[&str] = &["interactions", "signals", "judgments", "hints", "teacher_logprobs", "samples"];

/// Where replayed rows go.
#[derive(Debug, Clone)]
pub enum ReplayTarget {
    /// The topic of the rows' table on `pipeline`'s bus (`topic_prefix` namespaces it). Needs a real
    /// cluster: the embedded one would vanish with this process.
    Bus {
        /// Bus settings (and the pipeline whose stages consume the topic).
        pipeline: PipelineConfig,
    },
    /// A fresh lake, then the pipeline's stages on it until idle.
    Lake {
        /// The new lake folder (must hold no table yet).
        dir: PathBuf,
        /// The pipeline whose stages run (its `lake` is replaced by `dir`).
        pipeline: PipelineConfig,
        /// Stages to run (`signals`, `judge`, `hint`, `teacher`); None: the method's chain when the
        /// rows are interactions, no stage otherwise.
        stages: Option<Vec<String>>,
    },
}

/// What to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Lake the query reads.
    pub source_lake: PathBuf,
    /// Query returning full rows of `table`.
    pub sql: String,
    /// One of [`REPLAY_TABLES`] (the `--to-topic`).
    pub table: String,
    /// Where the rows go.
    pub target: ReplayTarget,
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayReport {
    /// Table of the rows.
    pub table: String,
    /// Rows the query returned.
    pub rows: u64,
    /// Rows published to the bus.
    pub published: u64,
    /// Rows written to the new lake.
    pub written: u64,
    /// Vote-cache files copied.
    pub vote_cache_files: u64,
    /// Teacher rows copied into the new lake's teacher cache.
    pub teacher_cache_rows: u64,
    /// The stages' report (lake target).
    pub run: Option<RunReport>,
}

impl ReplayReport {
    /// Judge and hint votes reused from the cache (sum of the stages' `votes_cached`).
    pub fn votes_cached(&self) -> u64 {
        self.run.as_ref().map_or(0, |r| r.stages.values().map(|c| c.get("votes_cached")).sum())
    }
    /// Teacher rows reused from the cache.
    pub fn teacher_cache_hits(&self) -> u64 {
        self.run.as_ref().map_or(0, |r| r.stages.values().map(|c| c.get("teacher_cache_hit")).sum())
    }
}

/// The rows of table `T` a query returns.
///
/// # Errors
/// [`Error::Sql`] for a bad query; [`Error::InvalidInput`] when the columns are not full `T` rows.
pub async fn select_rows<T: Table>(lake: &Lake, sql: &str) -> Result<Vec<T>> {
    let mut out = vec![];
    for b in crate::sql::query(lake, sql).await? {
        let rows: Vec<T> = serde_arrow::from_record_batch(&b)
            .map_err(|e| input_err!("the query must return full {} rows (SELECT * FROM {} ...): {e}", T::NAME, T::NAME))?;
        out.extend(rows);
    }
    Ok(out)
}

/// The lineage note added to a replayed interaction.
pub fn replay_note(interaction_id: &str, source_lake: &Path) -> String {
    format!("replay-of {interaction_id} from {}", source_lake.display())
}

/// Adds the [`replay_note`] to each interaction (once: a row already noted for this lake is left as is).
pub fn mark_replayed(rows: &mut [Interaction], source_lake: &Path) {
    for r in rows {
        let note = replay_note(&r.interaction_id, source_lake);
        if !r.notes.contains(&note) {
            r.notes.push(note);
        }
    }
}

/// Copies the source lake's vote cache files into `dest`'s, and its teacher rows (its table and its own
/// teacher cache) into `dest`'s `_state/teacher_cache/`. Returns (files copied, teacher rows copied).
///
/// # Errors
/// Lake read/write errors.
pub fn copy_caches(source: &Lake, dest: &Lake) -> Result<(u64, u64)> {
    let mut files = 0;
    let src_votes = source.root().join("_state").join("vote_cache");
    if src_votes.is_dir() {
        let dst = dest.state_dir("vote_cache")?;
        for e in std::fs::read_dir(&src_votes).map_err(|e| Error::io("list", &src_votes, e))?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "jsonl") {
                if let Some(name) = p.file_name() {
                    let to = dst.join(name);
                    if !to.exists() {
                        std::fs::copy(&p, &to).map_err(|e| Error::io("copy", &p, e))?;
                        files += 1;
                    }
                }
            }
        }
    }
    // File by file (one cache file per source file and date), so only one file's rows are held; the
    // first row of a teacher_id wins: the lake's, then its own cache's.
    let mut sources = vec![source.clone()];
    let old_cache = source.root().join("_state").join(TEACHER_CACHE_DIR);
    if old_cache.is_dir() {
        sources.push(Lake::open(&old_cache)?);
    }
    let mut seen = std::collections::HashSet::new();
    let (mut n, mut seq, mut dst) = (0, 0, None);
    for lake in &sources {
        for f in lake.files(TeacherLogprobs::NAME)? {
            let mut rows: Vec<TeacherLogprobs> = lake.read_rows(&f.path)?;
            rows.retain(|r| seen.insert(r.teacher_id.clone()));
            if rows.is_empty() {
                continue;
            }
            let dst = match &mut dst {
                Some(d) => d,
                None => dst.insert(Lake::open(dest.state_dir(TEACHER_CACHE_DIR)?)?),
            };
            seq += 1;
            dst.write_rows(&rows, "replay-cache", seq)?;
            n += rows.len() as u64;
        }
    }
    Ok((files, n))
}

/// Upstream context of rows of `table`, from the source lake (see module docs).
struct CarrySource {
    interactions: HashMap<String, Interaction>,
    signals: HashMap<String, Signal>,
    judgments: HashMap<(String, String), Judgment>,
}

impl CarrySource {
    fn load(lake: &Lake, table: &str) -> Result<CarrySource> {
        let mut c = CarrySource { interactions: HashMap::new(), signals: HashMap::new(), judgments: HashMap::new() };
        if matches!(table, "signals" | "judgments" | "hints") {
            c.interactions = lake.read_table::<Interaction>()?.into_iter().map(|i| (i.interaction_id.clone(), i)).collect();
            c.signals = lake.read_table::<Signal>()?.into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
        }
        if table == "hints" {
            c.judgments = lake.read_table::<Judgment>()?.into_iter().map(|j| ((j.pipeline.clone(), j.interaction_id.clone()), j)).collect();
        }
        Ok(c)
    }
    fn base(&self, interaction_id: &str) -> Carry {
        let signal = self.signals.get(interaction_id);
        Carry {
            interaction: self.interactions.get(interaction_id).map(|i| crate::stages::pending::carried(i, signal)),
            signal: signal.cloned(),
            ..Default::default()
        }
    }
}

/// A row of a replayable table and the carry its consuming stage needs (the pending-input rules of
/// [`crate::stages::pending`]).
trait Replayable: Table {
    fn carry(&self, _src: &CarrySource) -> Option<Carry> {
        None
    }
}
impl Replayable for Interaction {}
impl Replayable for TeacherLogprobs {}
impl Replayable for Sample {}
impl Replayable for Signal {
    fn carry(&self, src: &CarrySource) -> Option<Carry> {
        Some(src.base(&self.interaction_id))
    }
}
impl Replayable for Judgment {
    fn carry(&self, src: &CarrySource) -> Option<Carry> {
        Some(Carry { judgment: Some(self.clone()), ..src.base(&self.interaction_id) })
    }
}
impl Replayable for HintRecord {
    fn carry(&self, src: &CarrySource) -> Option<Carry> {
        let judgment = src.judgments.get(&(self.pipeline.clone(), self.interaction_id.clone())).cloned();
        Some(Carry { judgment, hint: Some(self.clone()), ..src.base(&self.interaction_id) })
    }
}

async fn publish_rows<T: Replayable>(rows: &[T], producer: &BusProducer, carry: &CarrySource) -> Result<u64> {
    for r in rows {
        producer.send(r, r.carry(carry).as_ref()).await?;
    }
    Ok(rows.len() as u64)
}

fn write_manifest(dest: &Lake, opts: &ReplayOptions, keys: Vec<String>) -> Result<()> {
    let dir = dest.state_dir("replay")?;
    let m = serde_json::json!({
        "source_lake": opts.source_lake,
        "sql": opts.sql,
        "table": opts.table,
        "rows": keys.len(),
        "keys": keys,
        "replayed_at_ms": crate::schema::now_ms(),
    });
    crate::lake::write_atomic(&dir.join("manifest.json"), serde_json::to_string_pretty(&m)?.as_bytes())
}

async fn replay_table<T: Replayable>(opts: &ReplayOptions, stop: Stop, note: impl Fn(&mut Vec<T>)) -> Result<ReplayReport> {
    let source = Lake::open(&opts.source_lake)?;
    let mut rows: Vec<T> = select_rows(&source, &opts.sql).await?;
    note(&mut rows);
    let mut report = ReplayReport { table: T::NAME.into(), rows: rows.len() as u64, ..Default::default() };
    match &opts.target {
        ReplayTarget::Bus { pipeline } => {
            if pipeline.bus.brokers.is_none() {
                return Err(config_err!("replay to a topic needs a real cluster (--brokers): the embedded bus ends with this command; use --lake-out to run the stages here"));
            }
            let bus = Bus::connect(pipeline.bus.clone()).await?;
            bus.ensure_topics(&[T::NAME]).await?;
            let producer = bus.producer()?;
            let carry = CarrySource::load(&source, T::NAME)?;
            report.published = publish_rows(&rows, &producer, &carry).await?;
            producer.flush()?;
        }
        ReplayTarget::Lake { dir, pipeline, stages } => {
            let dest = Lake::open(dir)?;
            let existing: Vec<String> = dest.tables().into_iter().filter(|t| dest.files(t).map(|f| !f.is_empty()).unwrap_or(false)).collect();
            if !existing.is_empty() {
                return Err(config_err!("{} is not a fresh lake (it has tables {}); replay into a new folder", dir.display(), existing.join(", ")));
            }
            let (files, teacher_rows) = copy_caches(&source, &dest)?;
            report.vote_cache_files = files;
            report.teacher_cache_rows = teacher_rows;
            dest.write_rows(&rows, "replay", 1)?;
            report.written = rows.len() as u64;
            write_manifest(&dest, opts, rows.iter().map(|r| r.key().to_string()).collect())?;
            let stages: Vec<String> = match stages {
                Some(s) => s.clone(),
                None if T::NAME == Interaction::NAME => Stage::chain(pipeline.method).into_iter().map(|s| s.name().to_string()).collect(),
                None => vec![],
            };
            if !stages.is_empty() {
                let mut cfg = pipeline.clone();
                cfg.lake = dir.clone();
                report.run = Some(run_stages(&cfg, &stages, stop).await?);
            }
        }
    }
    Ok(report)
}

/// Runs `stages` (a subset of the method's chain) and the lake sinks on `cfg`'s lake until idle.
///
/// # Errors
/// [`Error::Config`] for a stage that is not in the method's chain; the pipeline's errors.
pub async fn run_stages(cfg: &PipelineConfig, stages: &[String], stop: Stop) -> Result<RunReport> {
    let allowed: Vec<&str> = Stage::chain(cfg.method).into_iter().map(Stage::name).collect();
    for s in stages {
        if !allowed.contains(&s.as_str()) {
            return Err(config_err!("stage {s:?} is not part of method {} (its stages: {})", cfg.method.as_str(), allowed.join(", ")));
        }
    }
    let mut only: Vec<String> = stages.to_vec();
    only.push("sinks".into());
    let opts = RunOptions { only: Some(only), until_idle: true, checkpoints_dir: None, run_id: None, resume: false };
    start_pipeline(cfg, &opts, stop).await?.finish().await
}

/// Replays rows (see the module docs).
///
/// # Errors
/// [`Error::Config`] for an unknown table or a bus target without brokers or a lake target that is not
/// fresh; query, lake, Kafka and stage errors.
pub async fn replay(opts: &ReplayOptions, stop: Stop) -> Result<ReplayReport> {
    let source = opts.source_lake.clone();
    match opts.table.as_str() {
        "interactions" => replay_table::<Interaction>(opts, stop, move |rows| mark_replayed(rows, &source)).await,
        "signals" => replay_table::<Signal>(opts, stop, |_| {}).await,
        "judgments" => replay_table::<Judgment>(opts, stop, |_| {}).await,
        "hints" => replay_table::<HintRecord>(opts, stop, |_| {}).await,
        "teacher_logprobs" => replay_table::<TeacherLogprobs>(opts, stop, |_| {}).await,
        "samples" => replay_table::<Sample>(opts, stop, |_| {}).await,
        other => Err(config_err!("cannot replay table {other:?} (one of {})", REPLAY_TABLES.join(", "))),
    }
}
