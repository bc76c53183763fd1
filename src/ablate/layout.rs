//! The ablation's output folders ([`Layout`]) and its phase markers: the JSON files under `work/` that
//! say a phase finished (and with what), so a killed ablation resumes where it stopped (see
//! [`super::run`] for the phases).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::eval::VersionEval;
use super::results::{AgreementRow, GapRow, JudgeSessionRow, ResponseRow};
use crate::demo::Score;
use crate::error::{Error, Result};
use crate::input_err;

/// The folders of an ablation's output.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `<out>`.
    pub out: PathBuf,
    /// `<out>/work`.
    pub work: PathBuf,
}

impl Layout {
    /// The layout under `out`.
    pub fn new(out: &Path) -> Layout {
        Layout { out: out.to_path_buf(), work: out.join("work") }
    }
    /// Collected source lake.
    pub fn source(&self) -> PathBuf {
        self.work.join("source")
    }
    /// The ablation lake.
    pub fn lake(&self) -> PathBuf {
        self.work.join("lake")
    }
    /// The judge-agreement lake.
    pub fn agreement_lake(&self) -> PathBuf {
        self.work.join("agreement")
    }
    /// Phase markers.
    pub fn state(&self) -> PathBuf {
        self.work.join("state")
    }
    /// An arm's folder.
    pub fn arm(&self, arm: &str) -> PathBuf {
        self.work.join("arms").join(arm)
    }
    /// An arm's checkpoints folder (the run folder is `<this>/<arm>`).
    pub fn checkpoints(&self, arm: &str) -> PathBuf {
        self.arm(arm).join("checkpoints")
    }
    /// `<out>/results`.
    pub fn results(&self) -> PathBuf {
        self.out.join("results")
    }
}

/// Reads a phase marker (JSON); `None` when the phase has not finished.
pub(super) fn read_marker<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(serde_json::from_str(&s).map_err(|e| input_err!("{}: {e} (delete it to redo that phase)", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

/// Writes a phase marker atomically.
pub(super) fn write_marker<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    crate::lake::write_atomic(path, serde_json::to_string_pretty(value)?.as_bytes())
}

/// Removes `dir` and everything in it, if it exists.
pub(super) fn remove_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io("remove", dir, e))?;
    }
    Ok(())
}

/// `work/state/replay.json`: the replay into the ablation lake is done.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct ReplayMarker {
    pub(super) rows: u64,
    pub(super) vote_cache_files: u64,
    pub(super) teacher_cache_rows: u64,
    pub(super) seconds: f64,
}

/// `work/state/data-<pipeline>.json`: a data pipeline's stages ran; their outcome counts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StagesMarker {
    pub(super) pipeline: String,
    pub(super) counts: BTreeMap<String, BTreeMap<String, u64>>,
    pub(super) seconds: f64,
}

/// `work/state/agreement-<pipeline>.json`: a judge configuration's agreement with the outcomes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct AgreementMarker {
    pub(super) row: AgreementRow,
    pub(super) sessions: Vec<JudgeSessionRow>,
    pub(super) seconds: f64,
}

/// `work/state/base-eval.json`: the evaluation of the initial weights, shared by every arm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct BaseEval {
    pub(super) fingerprint: String,
    pub(super) score: Score,
    pub(super) responses: Vec<ResponseRow>,
    pub(super) gaps: Vec<GapRow>,
    pub(super) seconds: f64,
    /// The hint-conditioned teacher per hint strategy (empty in markers written before it existed:
    /// computed then).
    #[serde(default)]
    pub(super) teachers: Vec<super::teacher_eval::TeacherEval>,
    /// The baselines without training (empty in markers written before they existed: computed then).
    #[serde(default)]
    pub(super) baselines: Vec<BaselineEval>,
    /// v0's greedy answers as token ids, one per held-out problem in `responses` order: (problem id,
    /// prompt ids, response ids) ([`super::mass`]'s held-out set; empty in markers written before it
    /// existed: computed then).
    #[serde(default)]
    pub(super) answer_ids: Vec<(i64, Vec<u32>, Vec<u32>)>,
    /// v0's token mass rows of the sets every arm shares (arm `""`: v0's held-out answers, the teacher's
    /// answers and the teacher's own log-probs of them), scored once and copied into each arm's v0
    /// evaluation (empty in markers written before it existed: computed then).
    #[serde(default)]
    pub(super) v0_mass: Option<Vec<super::mass::MassRow>>,
}

/// A baseline without training on the held-out problems ([`super::baselines`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct BaselineEval {
    /// `prompted` or `memory`.
    pub(crate) name: String,
    /// The system prompt it answered with.
    pub(crate) system: String,
    /// Its score.
    pub(crate) score: Score,
    /// Its responses (arm = the name, version 0), for the paired tests.
    pub(crate) responses: Vec<ResponseRow>,
    /// Seconds the evaluation took.
    pub(crate) seconds: f64,
}

/// `work/arms/<arm>/train.json`: an arm is trained; what it trained on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TrainMarker {
    pub(super) config_hash: String,
    pub(super) train_sql: String,
    pub(super) sample_ids: Vec<String>,
    pub(super) interaction_ids: Vec<String>,
    pub(super) sample_types: Vec<String>,
    pub(super) steps: i64,
    pub(super) seconds: f64,
}

/// `work/arms/<arm>/eval/v<version>.json`: one evaluated version of an arm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct EvalMarker {
    pub(super) fingerprint: String,
    pub(super) eval: VersionEval,
    pub(super) seconds: f64,
}
