//! [`TrainOptions`]: the options of `nextstate train`, and where it reads samples ([`TrainSource`]).

use std::path::PathBuf;

/// Where the trainer reads samples.
#[derive(Debug, Clone)]
pub enum TrainSource {
    /// The `samples` topic, as a consumer group (online).
    Topic,
    /// A SQL query over the lake returning full `samples` rows (offline replay), e.g.
    /// `SELECT * FROM samples WHERE pipeline = 'combined' ORDER BY event_time`.
    Sql(String),
}

/// Options of `nextstate train`.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Sample source.
    pub source: TrainSource,
    /// Continue from the newest complete checkpoint of the run.
    pub resume: bool,
    /// Run id (checkpoint folder name); default: the pipeline name.
    pub run_id: Option<String>,
    /// Folder holding `<run id>/<version>/` checkpoints.
    pub checkpoints_dir: PathBuf,
    /// Stop after this many optimizer steps.
    pub max_steps: Option<i64>,
    /// `--metrics-jsonl FILE`: append one JSON object per optimizer step (the `train_steps` row, plus
    /// `metrics_jsonl_extra`), flushed per line.
    pub metrics_jsonl: Option<PathBuf>,
    /// Keys added to each JSON line (`ablate`: `arm`, `group` and `seed`).
    pub metrics_jsonl_extra: Vec<(String, serde_json::Value)>,
}
