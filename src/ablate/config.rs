//! Ablation files (`ablations/<name>.toml`): the data, the shared settings, the arms (and sweeps that
//! expand into arms) and the evaluation. Every arm's pipeline configuration is *resolved* from layers:
//!
//! 1. the base pipeline (`base_pipeline`, a `pipelines/*.toml` file; else `name`/`method` only),
//! 2. the `[pipeline]` table (any pipeline keys, shared by every arm),
//! 3. the `[shared]` settings (initial weights, seed, batch size, learning rate, LoRA),
//! 4. the arm's own `method` and `set` (dotted pipeline keys → values),
//! 5. with `[shared] seeds = [s1, s2, …]` (more than one), each arm becomes one *replicate* per seed,
//!    named `<arm>.seed=<s>`, whose configuration differs from its siblings' in `trainer.seed` only (the
//!    LoRA initialisation and the random-sign control's signs). Replicates share the data pipeline's
//!    configuration, but not its data: replicate `s` trains on its own interaction stream
//!    ([`super::run::Replicates`]: with `[data.collect]` its own collected sessions; always its
//!    sessions in an order shuffled by `s`), while every arm of one replicate trains on the same
//!    interactions in the same order.
//!
//! The resolved configurations are compared key by key ([`config_diff`]) so the report and the tests can
//! show that two arms differ exactly where the file says.
//!
//! Paths of the ablation file (`base_pipeline`, `[shared] model`, `[student] gsm8k`, `[data] lake`,
//! judge-agreement logs, path keys of `[pipeline]` and `set`) are relative to the working directory;
//! those inside the base pipeline file are relative to that file's folder, as when `--pipeline` loads
//! it ([`crate::config::resolve_file_paths`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::baselines::Baseline;
use crate::demo::EvalSplit;
use crate::config::PipelineConfig;
use crate::method::Method;
use crate::schema::content_hash;
use crate::{config_err, Error, Result};

/// An ablation file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AblationConfig {
    /// Ablation name (run id of the evaluation rows, report title).
    pub name: String,
    /// One paragraph for the report.
    #[serde(default)]
    pub description: String,
    /// Base pipeline file; default: built-in defaults.
    #[serde(default)]
    pub base_pipeline: Option<PathBuf>,
    /// Pipeline keys shared by every arm, merged over the base pipeline (any `pipelines/*.toml` key).
    #[serde(default)]
    pub pipeline: toml::Table,
    /// Settings every arm shares.
    #[serde(default)]
    pub shared: SharedSettings,
    /// The simulated student (the `demo`'s environment): data collection and the personalization score.
    #[serde(default)]
    pub student: StudentSettings,
    /// Which interactions every arm replays.
    #[serde(default)]
    pub data: DataSettings,
    /// Evaluation.
    #[serde(default)]
    pub eval: EvalSettings,
    /// The online protocol (the paper's): present = `nextstate ablate` runs every arm as the demo's live
    /// loop ([`super::online`]) instead of replaying `[data]`.
    #[serde(default)]
    pub online: Option<OnlineSettings>,
    /// The arms.
    pub arms: Vec<ArmSpec>,
    /// Sweeps: each value of `key` becomes one more arm derived from `arm`.
    #[serde(default)]
    pub sweeps: Vec<SweepSpec>,
}

/// `[shared]`: what every arm shares (written into every arm's resolved pipeline configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SharedSettings {
    /// Initial weights of every arm (`policy.model`); None = the pipeline's.
    pub model: Option<PathBuf>,
    /// Trainer seed (`trainer.seed`; also seeds the LoRA initialisation) (42).
    pub seed: u64,
    /// Replicate seeds: with two or more, every arm runs once per seed (module docs, layer 5) — each
    /// replicate with its own data (with `[data.collect]`), sample order and LoRA initialisation — and
    /// the report gives each arm's mean and 95 % interval over them; empty (the default) = `[seed]`.
    pub seeds: Vec<u64>,
    /// Samples per optimizer step (`trainer.batch_size`) (8).
    pub batch_size: usize,
    /// At most this many optimizer steps per arm (each arm trains on the first `steps × batch_size`
    /// of its ordered samples) (4).
    pub steps: usize,
    /// AdamW learning rate (`trainer.lr`); None = the pipeline's.
    pub lr: Option<f64>,
    /// LoRA adapters (`trainer.lora.enabled`); None = the pipeline's.
    pub lora: Option<bool>,
    /// Write a checkpoint every this many steps (`trainer.checkpoint_every`) (1): each is evaluated.
    pub checkpoint_every: u64,
    /// libtorch threads for every model computation (`policy.threads`; 0 = libtorch's default).
    pub threads: usize,
}

impl SharedSettings {
    /// The replicate seeds: `seeds`, or `[seed]` when it is empty.
    pub fn replicate_seeds(&self) -> Vec<u64> {
        if self.seeds.is_empty() {
            vec![self.seed]
        } else {
            self.seeds.clone()
        }
    }
}

impl Default for SharedSettings {
    fn default() -> Self {
        SharedSettings { model: None, seed: 42, seeds: vec![], batch_size: 8, steps: 4, lr: None, lora: None, checkpoint_every: 1, threads: 0 }
    }
}

/// `[student]`: the simulated student of `src/demo/` (its preferences, its GSM8K problems).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StudentSettings {
    /// GSM8K problems file.
    pub gsm8k: PathBuf,
    /// Seed of the problem split and the student's phrasing (7).
    pub seed: u64,
    /// The student's word limit (80).
    pub max_words: usize,
    /// The student also requires the right answer (false: SmolLM2-135M almost never has it).
    pub require_correct: bool,
    /// Most agent turns per homework session (3).
    pub max_turns: u32,
}

impl Default for StudentSettings {
    fn default() -> Self {
        StudentSettings { gsm8k: PathBuf::from("data/gsm8k_test.json"), seed: 7, max_words: 80, require_correct: false, max_turns: 3 }
    }
}

impl StudentSettings {
    /// The student's preferences.
    pub fn preferences(&self) -> crate::demo::Preferences {
        crate::demo::Preferences { max_words: self.max_words, correct_answer: self.require_correct, ..Default::default() }
    }
}

/// `[data]`: the interactions every arm replays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSettings {
    /// Lake the query reads. None: `<out>/work/source`, filled by `[data.collect]`.
    pub lake: Option<PathBuf>,
    /// Query over that lake returning full `interactions` rows.
    pub sql: String,
    /// The last this many sessions (by first event time, then id) are held out of training; their
    /// samples measure the held-out loss and the teacher/student gap (4).
    pub heldout_sessions: usize,
    /// Collect the interactions first with the simulated student against the frozen initial policy.
    pub collect: Option<CollectSettings>,
}

impl Default for DataSettings {
    fn default() -> Self {
        DataSettings { lake: None, sql: "SELECT * FROM interactions".into(), heldout_sessions: 4, collect: None }
    }
}

/// `[data.collect]`: the student works through training problems with the frozen initial policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CollectSettings {
    /// Homework sessions (one GSM8K training problem each) (16).
    pub sessions: usize,
    /// Sessions generated together (one batch, turn by turn) (8).
    pub batch: usize,
    /// Response length limit, tokens (128).
    pub max_tokens: usize,
    /// Sampling temperature (0.6, docs/method.md §6 rollout temperature).
    pub temperature: f32,
}

impl Default for CollectSettings {
    fn default() -> Self {
        CollectSettings { sessions: 16, batch: 8, max_tokens: 128, temperature: 0.6 }
    }
}

/// `[online]`: every arm replicate runs the demo's loop (`nextstate demo`, [`crate::demo::run`]): the
/// policy serves the simulated student while the pipeline judges, hints, trains and the server loads
/// each checkpoint, from the same initial weights and the same student seeds for every arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineSettings {
    /// Student turns answered per arm replicate before the students stop (48).
    pub interactions: usize,
    /// The students keep working past `interactions` until this many policy versions answered them (2:
    /// at least one checkpoint reached them).
    pub min_versions_served: usize,
    /// Hard limit on student turns per arm replicate (96).
    pub max_interactions: usize,
    /// Students working at once (2).
    pub students: usize,
    /// Response length limit of the students' sessions, tokens (128).
    pub max_tokens: usize,
    /// Sampling temperature of the students' sessions (0.6).
    pub temperature: f32,
}

impl Default for OnlineSettings {
    fn default() -> Self {
        OnlineSettings { interactions: 48, min_versions_served: 2, max_interactions: 96, students: 2, max_tokens: 128, temperature: 0.6 }
    }
}

/// `[eval]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSettings {
    /// Held-out GSM8K problems of the personalization score (12).
    pub problems: usize,
    /// Response length limit of the greedy evaluation answers, tokens (128).
    pub max_tokens: usize,
    /// Problems generated together (12).
    pub batch: usize,
    /// Which checkpoints are evaluated: `all` (default; a score-vs-interactions curve per arm) or
    /// `last` (v0 and the last checkpoint only: a multi-seed run's budget).
    pub versions: EvalVersions,
    /// Which problems the score is measured on: `test` (default; the held-out problems, the reported
    /// result) or `validation` (as many training problems set aside, for choosing a recipe: the test
    /// problems are then neither trained on nor evaluated; [`crate::demo::Split::evaluated_on`]). Left out
    /// of the configuration hashes when `test`, so earlier runs keep their keys.
    #[serde(skip_serializing_if = "EvalSplit::is_test")]
    pub split: EvalSplit,
    /// Judge-vs-outcome agreement on ingested logs with outcome labels.
    pub judge_agreement: Option<AgreementSettings>,
}

impl Default for EvalSettings {
    fn default() -> Self {
        EvalSettings { problems: 12, max_tokens: 128, batch: 12, versions: EvalVersions::All, split: EvalSplit::Test, judge_agreement: None }
    }
}

/// `[eval] versions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalVersions {
    /// Every checkpoint.
    #[default]
    All,
    /// The initial weights (v0) and the last checkpoint.
    Last,
}

impl EvalVersions {
    /// Keeps the versions to evaluate of `all` (v0 first, then the checkpoints in order).
    pub fn select<T: Clone>(self, all: &[T]) -> Vec<T> {
        match self {
            EvalVersions::All => all.to_vec(),
            EvalVersions::Last if all.len() > 2 => vec![all[0].clone(), all[all.len() - 1].clone()],
            EvalVersions::Last => all.to_vec(),
        }
    }
}

/// `[eval.judge_agreement]`: logs whose sessions carry an outcome label (`outcome_reward`, e.g.
/// tau-bench rewards).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgreementSettings {
    /// Log files to ingest.
    pub files: Vec<PathBuf>,
    /// Log format (`auto` or an ingest format name).
    #[serde(default = "default_auto")]
    pub format: String,
    /// A session counts as a success when its outcome reward is at least this (0.5).
    #[serde(default = "default_threshold")]
    pub success_threshold: f64,
}

fn default_auto() -> String {
    "auto".into()
}

fn default_threshold() -> f64 {
    0.5
}

/// One arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmSpec {
    /// Arm name (folder name and legend; letters, digits, `-`, `_`, `.`, `=`).
    pub name: String,
    /// The method (shorthand for `set = { method = ... }`).
    #[serde(default)]
    pub method: Option<Method>,
    /// Pipeline keys this arm changes, dotted (`"trainer.w_opd" = 0.5`, `"hint.strategy" = "shortest"`).
    #[serde(default)]
    pub set: toml::Table,
    /// What the arm trains on: its data pipeline's samples (`pipeline`, the default), or the
    /// hint-conditioned teacher's own generations (`teacher-generations`: context distillation,
    /// [`ArmSamples`]).
    #[serde(default)]
    pub samples: ArmSamples,
    /// A baseline without training instead of a trained arm (online mode only; [`Baseline`]): the
    /// initial weights serve with the baseline's system prompt and nothing trains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
}

/// What an arm trains on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArmSamples {
    /// The samples its data pipeline's stages build from the interactions.
    #[default]
    Pipeline,
    /// Context distillation, the reference point beside sampled-token OPD (issue 37): for every turn
    /// with an accepted hint, the initial weights answer greedily in the teacher context (the turn's
    /// request with the hint, as the teacher stage builds it), and the arm trains on that answer after
    /// the **original** prompt with reward +1 — `method = "binary"` is required, so `A_t = +1` and the
    /// PPO step raises the log-prob of every token of the teacher's own answer (supervised fine-tuning
    /// on the teacher's outputs, what `export --to trl` would give an SFT trainer if the lake held them).
    /// The hints come from the arm's configuration with `method = "opd"` (shared with an `opd` arm of the
    /// same stage settings).
    TeacherGenerations,
}

/// A sweep: one arm per value of `key`, each `arm` with `key = value`, named `<arm>.<last key part>=<value>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// The arm the sweep starts from.
    pub arm: String,
    /// Dotted pipeline key.
    pub key: String,
    /// Values.
    pub values: Vec<toml::Value>,
}

/// An arm with its resolved pipeline configuration.
#[derive(Debug, Clone)]
pub struct ResolvedArm {
    /// Arm name (`<group>.seed=<s>` for a replicate of a multi-seed run, else the group).
    pub name: String,
    /// The arm as the file names it (the `[[arms]]` or sweep name): replicates of one group differ
    /// only in `seed`.
    pub group: String,
    /// `trainer.seed` of this replicate.
    pub seed: u64,
    /// Every key the arm itself sets (dotted path → value as TOML text), including `method`.
    pub overrides: BTreeMap<String, String>,
    /// The arm's pipeline configuration (`name` = its data pipeline, `lake` = the ablation lake).
    pub pipeline: PipelineConfig,
    /// Hash of the configuration of the stages that build the arm's samples ([`data_key`]).
    pub data_hash: String,
    /// Name of the data pipeline (arms with the same `data_hash` share it and its samples).
    pub data_pipeline: String,
    /// Hash of the whole resolved configuration (trainer included) and the step count.
    pub config_hash: String,
    /// `trainer.hash(method)`: the hash stored in the arm's checkpoint manifests.
    pub trainer_hash: String,
    /// What the arm trains on ([`ArmSamples`]).
    pub samples: ArmSamples,
    /// `teacher-generations`: the hinting data pipeline (the arm's configuration with `method = "opd"`,
    /// named as an `opd` arm with the same stage settings would be) whose hinted samples give the
    /// teacher contexts; `None` otherwise.
    pub hints_from: Option<PipelineConfig>,
    /// The baseline the arm is, if it is one ([`ArmSpec::baseline`]).
    pub baseline: Option<Baseline>,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 80 && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '='))
}

/// Sets `path` (dotted) in `table` to `value`, creating intermediate tables.
///
/// # Errors
/// [`Error::Config`] when a path component is not a table.
pub fn set_dotted(table: &mut toml::Table, path: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = path.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(config_err!("bad key {path:?}: empty component"));
    }
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| config_err!("key {path:?}: {p:?} is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// Deep merge: tables merge key by key, anything else in `over` replaces.
pub fn merge(base: &mut toml::Table, over: &toml::Table) {
    for (k, v) in over {
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Flattens a (possibly nested) table of overrides into dotted keys.
fn flatten(prefix: &str, t: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (k, v) in t {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(inner) => flatten(&key, inner, out),
            other => {
                out.insert(key, other.clone());
            }
        }
    }
}

/// The part of a pipeline configuration that decides which samples its stages build: method, policy
/// model (tokens and teacher), signals, judge, hint, teacher and sample settings — not the trainer, and
/// not where things run (bus, lake, sink, server, proxy, name).
pub fn data_key(p: &PipelineConfig) -> serde_json::Value {
    serde_json::json!({
        "method": p.method,
        "policy_model": p.policy.model,
        "policy_dtype": p.policy.dtype,
        "signals": p.signals,
        "judge": p.judge,
        "hint": p.hint,
        "teacher": p.teacher,
        "samples": p.samples,
    })
}

/// The dotted keys (leaves of the JSON forms) at which two pipeline configurations differ, sorted;
/// `name` and `lake` are ignored (they differ by construction).
pub fn config_diff(a: &PipelineConfig, b: &PipelineConfig) -> Vec<String> {
    fn leaves(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    leaves(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, x, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.clone());
            }
        }
    }
    let (mut la, mut lb) = (BTreeMap::new(), BTreeMap::new());
    leaves("", &serde_json::to_value(a).unwrap_or_default(), &mut la);
    leaves("", &serde_json::to_value(b).unwrap_or_default(), &mut lb);
    let keys: BTreeSet<&String> = la.keys().chain(lb.keys()).collect();
    keys.into_iter().filter(|k| *k != "name" && *k != "lake" && la.get(*k) != lb.get(*k)).cloned().collect()
}

impl AblationConfig {
    /// Reads and checks an ablation file.
    ///
    /// # Errors
    /// [`Error::Io`] when unreadable; [`Error::Config`] naming the bad key, a duplicate or invalid arm
    /// name, a sweep of an unknown arm, or an arm whose pipeline configuration is invalid.
    pub fn load(path: &Path) -> Result<AblationConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read ablation", path, e))?;
        Self::parse(&text).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses and checks ablation TOML (see [`AblationConfig::load`]).
    ///
    /// # Errors
    /// As [`AblationConfig::load`].
    pub fn parse(text: &str) -> Result<AblationConfig> {
        let cfg: AblationConfig = toml::from_str(text).map_err(|e| config_err!("{e}"))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<()> {
        if !valid_name(&self.name) {
            return Err(config_err!("ablation name {:?}: use letters, digits, '-', '_', '.'", self.name));
        }
        if self.arms.is_empty() {
            return Err(config_err!("no [[arms]]"));
        }
        if self.shared.batch_size == 0 || self.shared.steps == 0 || self.shared.checkpoint_every == 0 {
            return Err(config_err!("[shared] batch_size, steps and checkpoint_every must be at least 1"));
        }
        if self.eval.batch == 0 || self.eval.max_tokens == 0 {
            return Err(config_err!("[eval] batch and max_tokens must be at least 1"));
        }
        if let Some(c) = &self.data.collect {
            if c.sessions == 0 || c.batch == 0 || c.max_tokens == 0 {
                return Err(config_err!("[data.collect] sessions, batch and max_tokens must be at least 1"));
            }
        }
        match &self.online {
            Some(o) => {
                if o.interactions == 0 || o.students == 0 || o.max_tokens == 0 {
                    return Err(config_err!("[online] interactions, students and max_tokens must be at least 1"));
                }
                if self.data.lake.is_some() || self.data.collect.is_some() {
                    return Err(config_err!("[online] and [data] exclude each other: the online mode collects its interactions live"));
                }
                if o.max_interactions < o.interactions {
                    return Err(config_err!("[online] max_interactions ({}) is below interactions ({})", o.max_interactions, o.interactions));
                }
                if !(o.temperature.is_finite() && o.temperature >= 0.0) {
                    return Err(config_err!("[online] temperature must be a finite number ≥ 0, got {}", o.temperature));
                }
                if let Some(a) = self.arms.iter().find(|a| a.samples != ArmSamples::Pipeline) {
                    return Err(config_err!("arm {:?} trains on the teacher's generations, an offline arm: the online mode serves and trains each arm's own pipeline", a.name));
                }
            }
            None if self.arms.iter().any(|a| a.baseline.is_some()) => {
                let a = self.arms.iter().find(|a| a.baseline.is_some()).map(|a| a.name.clone()).unwrap_or_default();
                return Err(config_err!(
                    "arm {a:?} sets `baseline`, an arm of the online mode (an [online] section): offline, the `prompted` and `memory` baselines are evaluated beside every run without an arm"
                ));
            }
            None if self.data.lake.is_none() && self.data.collect.is_none() => {
                return Err(config_err!("[data] needs a lake to query or a [data.collect] section (or an [online] section)"));
            }
            None => {}
        }
        for s in &self.sweeps {
            if !self.arms.iter().any(|a| a.name == s.arm) {
                return Err(config_err!("sweep of unknown arm {:?}", s.arm));
            }
        }
        let names = self.arm_specs()?.into_iter().map(|a| a.name).collect::<Vec<_>>();
        let mut seen = BTreeSet::new();
        for n in &names {
            if !valid_name(n) {
                return Err(config_err!("arm name {n:?}: use letters, digits, '-', '_', '.', '='"));
            }
            if !seen.insert(n) {
                return Err(config_err!("two arms are named {n:?}"));
            }
        }
        let seeds = self.shared.replicate_seeds();
        if seeds.iter().collect::<BTreeSet<_>>().len() != seeds.len() {
            return Err(config_err!("[shared] seeds {seeds:?}: a seed is listed twice"));
        }
        if seeds.len() > 1 {
            if let Some(n) = names.iter().find(|n| n.contains(".seed=")) {
                return Err(config_err!("arm name {n:?}: '.seed=' names the replicates of a multi-seed run"));
            }
        }
        Ok(())
    }

    /// The arms with the sweeps expanded (sweep arms follow the declared arms, in file order).
    ///
    /// # Errors
    /// [`Error::Config`] for a sweep of an unknown arm or a bad key.
    pub fn arm_specs(&self) -> Result<Vec<ArmSpec>> {
        let mut out = self.arms.clone();
        for s in &self.sweeps {
            let base = self.arms.iter().find(|a| a.name == s.arm).ok_or_else(|| config_err!("sweep of unknown arm {:?}", s.arm))?;
            let last = s.key.rsplit('.').next().unwrap_or(&s.key);
            for v in &s.values {
                let shown = match v {
                    toml::Value::String(x) => x.clone(),
                    other => other.to_string(),
                };
                let mut arm = base.clone();
                arm.name = format!("{}.{last}={shown}", base.name);
                arm.set.insert(s.key.clone(), v.clone());
                out.push(arm);
            }
        }
        Ok(out)
    }

    /// The base pipeline table: the base file, `[pipeline]`, then `[shared]`.
    fn base_table(&self) -> Result<toml::Table> {
        let mut t: toml::Table = match &self.base_pipeline {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| Error::io("read base pipeline", p, e))?;
                let mut t: toml::Table = toml::from_str(&text).map_err(|e| config_err!("{}: {e}", p.display()))?;
                // Its paths are relative to its folder, as when `--pipeline` loads it.
                let cwd = std::env::current_dir().map_err(|e| Error::io("read the working directory", Path::new("."), e))?;
                for warning in crate::config::resolve_file_paths(&mut t, p, &cwd)? {
                    tracing::warn!("{warning}");
                }
                t
            }
            None => toml::from_str("name = \"ablation\"\nmethod = \"combined\"\n").map_err(|e| config_err!("{e}"))?,
        };
        merge(&mut t, &self.pipeline);
        let s = &self.shared;
        if let Some(m) = &s.model {
            set_dotted(&mut t, "policy.model", toml::Value::String(m.display().to_string()))?;
        }
        set_dotted(&mut t, "policy.threads", toml::Value::Integer(s.threads as i64))?;
        // One listed seed is the seed (with several, each replicate sets its own below).
        let seed = match s.seeds.as_slice() {
            [one] => *one,
            _ => s.seed,
        };
        set_dotted(&mut t, "trainer.seed", toml::Value::Integer(seed as i64))?;
        set_dotted(&mut t, "trainer.batch_size", toml::Value::Integer(s.batch_size as i64))?;
        set_dotted(&mut t, "trainer.checkpoint_every", toml::Value::Integer(s.checkpoint_every as i64))?;
        if let Some(lr) = s.lr {
            set_dotted(&mut t, "trainer.lr", toml::Value::Float(lr))?;
        }
        if let Some(l) = s.lora {
            set_dotted(&mut t, "trainer.lora.enabled", toml::Value::Boolean(l))?;
        }
        Ok(t)
    }

    /// Every arm's resolved configuration (see the module docs), with its lake set to `lake`.
    ///
    /// # Errors
    /// [`Error::Config`] when a layer does not parse or an arm's configuration is invalid (the arm is
    /// named).
    pub fn resolve(&self, lake: &Path) -> Result<Vec<ResolvedArm>> {
        let base = self.base_table()?;
        let mut arms = vec![];
        let mut data_names: BTreeMap<String, String> = BTreeMap::new();
        let seeds = self.shared.replicate_seeds();
        for (spec, seed) in self.arm_specs()?.into_iter().flat_map(|s| seeds.iter().map(move |seed| (s.clone(), *seed))) {
            let mut t = base.clone();
            let mut sets: BTreeMap<String, toml::Value> = BTreeMap::new();
            flatten("", &spec.set, &mut sets);
            if let Some(m) = spec.method {
                sets.insert("method".into(), toml::Value::String(m.as_str().into()));
            }
            let group = spec.name.clone();
            let name = if seeds.len() > 1 {
                sets.insert("trainer.seed".into(), toml::Value::Integer(seed as i64));
                format!("{}.seed={seed}", spec.name)
            } else {
                spec.name.clone()
            };
            for (k, v) in &sets {
                set_dotted(&mut t, k, v.clone()).map_err(|e| config_err!("arm {name}: {e}"))?;
            }
            t.insert("lake".into(), toml::Value::String(lake.display().to_string()));
            let mut p: PipelineConfig = toml::Value::Table(t).try_into().map_err(|e| config_err!("arm {name}: {e}"))?;
            p.validate().map_err(|e| config_err!("arm {name}: {e}"))?;
            let (data_hash, hints_from) = match spec.samples {
                ArmSamples::Pipeline => (content_hash(&[serde_json::to_string(&data_key(&p))?.as_bytes()]), None),
                ArmSamples::TeacherGenerations => {
                    if p.method != Method::Binary {
                        return Err(config_err!("arm {name}: samples = \"teacher-generations\" trains with method = \"binary\" (A = +1 on the teacher's answer), not {}", p.method.as_str()));
                    }
                    let mut h = p.clone();
                    h.method = Method::Opd;
                    h.validate().map_err(|e| config_err!("arm {name}: its hint pipeline: {e}"))?;
                    let hint_hash = content_hash(&[serde_json::to_string(&data_key(&h))?.as_bytes()]);
                    h.name = data_names.entry(hint_hash.clone()).or_insert_with(|| format!("{}-hints-{}", spec.name, &hint_hash[..8])).clone();
                    (content_hash(&[hint_hash.as_bytes(), b"teacher-generations"]), Some(h))
                }
            };
            let data_pipeline = data_names.entry(data_hash.clone()).or_insert_with(|| format!("{}-{}", spec.name, &data_hash[..8])).clone();
            p.name = data_pipeline.clone();
            let trainer_hash = p.trainer.hash(p.method)?;
            // The hash names what the arm computes, not where: the lake folder (under --out) is left out,
            // so the same ablation run into two folders has the same hashes.
            let mut hashed = p.clone();
            hashed.lake = Default::default();
            let mut config_hash = content_hash(&[serde_json::to_string(&hashed)?.as_bytes(), &(self.shared.steps as u64).to_le_bytes()]);
            if spec.samples != ArmSamples::Pipeline {
                // (kept out of the default's hash so existing arms keep theirs)
                config_hash = content_hash(&[config_hash.as_bytes(), serde_json::to_string(&spec.samples)?.as_bytes()]);
            }
            if let Some(b) = spec.baseline {
                if b == Baseline::Memory && !p.method.uses_hints() {
                    return Err(config_err!("arm {name}: the memory baseline remembers accepted hints: its method must extract them (opd or combined), not {}", p.method.as_str()));
                }
                if spec.samples != ArmSamples::Pipeline {
                    return Err(config_err!("arm {name}: a baseline does not train, so `samples` does not apply"));
                }
                config_hash = content_hash(&[config_hash.as_bytes(), b"baseline", b.as_str().as_bytes()]);
            }
            let overrides = sets.into_iter().map(|(k, v)| (k, v.to_string())).collect();
            arms.push(ResolvedArm { name, group, seed, overrides, pipeline: p, data_hash, data_pipeline, config_hash, trainer_hash, samples: spec.samples, hints_from, baseline: spec.baseline });
        }
        Ok(arms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
name = "t"
[shared]
seed = 3
batch_size = 2
steps = 2
lr = 0.001
lora = true
[data]
heldout_sessions = 1
[data.collect]
sessions = 2
[[arms]]
name = "binary"
method = "binary"
[[arms]]
name = "combined"
method = "combined"
[[arms]]
name = "opd-topk"
method = "opd"
set = { "teacher.top_k" = 4, "trainer.opd_loss" = "topk" }
[[sweeps]]
arm = "combined"
key = "trainer.w_opd"
values = [0.5, 2.0]
"#;

    #[test]
    fn arms_differ_exactly_where_configured() {
        let cfg = AblationConfig::parse(FILE).unwrap();
        let arms = cfg.resolve(Path::new("/tmp/lake")).unwrap();
        let names: Vec<&str> = arms.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, vec!["binary", "combined", "opd-topk", "combined.w_opd=0.5", "combined.w_opd=2.0"]);
        let by = |n: &str| arms.iter().find(|a| a.name == n).unwrap();
        assert_eq!(config_diff(&by("binary").pipeline, &by("combined").pipeline), vec!["method"]);
        assert_eq!(config_diff(&by("combined").pipeline, &by("combined.w_opd=0.5").pipeline), vec!["trainer.w_opd"]);
        assert_eq!(config_diff(&by("combined").pipeline, &by("opd-topk").pipeline), vec!["method", "teacher.top_k", "trainer.opd_loss"]);
        // shared settings reach every arm
        for a in &arms {
            assert_eq!((a.pipeline.trainer.seed, a.pipeline.trainer.batch_size, a.pipeline.trainer.lr), (3, 2, 0.001));
            assert!(a.pipeline.trainer.lora.enabled);
            assert_eq!(a.pipeline.lake, PathBuf::from("/tmp/lake"));
        }
        // a trainer-only difference shares the data pipeline; a teacher difference does not
        assert_eq!(by("combined").data_pipeline, by("combined.w_opd=0.5").data_pipeline);
        assert_ne!(by("combined").config_hash, by("combined.w_opd=0.5").config_hash);
        assert_ne!(by("combined").data_hash, by("opd-topk").data_hash);
        assert_eq!(by("combined").data_pipeline, format!("combined-{}", &by("combined").data_hash[..8]));
        assert_eq!(by("opd-topk").overrides.keys().collect::<Vec<_>>(), vec!["method", "teacher.top_k", "trainer.opd_loss"]);
        // the output folder is not part of any hash (found by the determinism test: two --out folders)
        let elsewhere = cfg.resolve(Path::new("/elsewhere/lake")).unwrap();
        for (a, b) in arms.iter().zip(&elsewhere) {
            assert_eq!((&a.config_hash, &a.data_hash, &a.trainer_hash), (&b.config_hash, &b.data_hash, &b.trainer_hash), "{}", a.name);
        }
    }

    #[test]
    fn the_eval_split_parses_and_its_default_stays_out_of_the_hashes() {
        let cfg = AblationConfig::parse(FILE).unwrap();
        assert_eq!(cfg.eval.split, EvalSplit::Test);
        // The eval settings are hashed as JSON (ablate::run): the default leaves the key out, so a run
        // made before the option existed keeps its markers.
        let json = serde_json::to_value(&cfg.eval).unwrap();
        assert!(json.get("split").is_none(), "{json}");
        let v = AblationConfig::parse(&format!("{FILE}\n[eval]\nsplit = \"validation\"\n")).unwrap();
        assert_eq!(v.eval.split, EvalSplit::Validation);
        assert_eq!(serde_json::to_value(&v.eval).unwrap()["split"], "validation");
        let e = AblationConfig::parse(&format!("{FILE}\n[eval]\nsplit = \"dev\"\n")).unwrap_err();
        assert!(e.to_string().contains("unknown variant `dev`"), "{e}");
    }

    #[test]
    fn a_context_distillation_arm_trains_binary_on_its_opd_pipelines_hints() {
        let file = format!("{FILE}\n[[arms]]\nname = \"opd\"\nmethod = \"opd\"\n[[arms]]\nname = \"cd\"\nmethod = \"binary\"\nsamples = \"teacher-generations\"\n");
        let arms = AblationConfig::parse(&file).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        let by = |n: &str| arms.iter().find(|a| a.name == n).unwrap();
        let (cd, opd, binary) = (by("cd"), by("opd"), by("binary"));
        assert_eq!((cd.samples, cd.pipeline.method), (ArmSamples::TeacherGenerations, Method::Binary));
        let h = cd.hints_from.as_ref().expect("a hint pipeline");
        // its hints are the opd arm's (same stage settings), its samples its own
        assert_eq!((h.method, h.name.as_str()), (Method::Opd, opd.data_pipeline.as_str()));
        assert!(cd.data_pipeline.starts_with("cd-") && cd.data_pipeline != opd.data_pipeline && cd.data_pipeline != binary.data_pipeline);
        // the trainer is binary's, the arm is not binary's
        assert_eq!(config_diff(&cd.pipeline, &binary.pipeline), Vec::<String>::new());
        assert_ne!(cd.config_hash, binary.config_hash);
        assert_eq!((binary.samples, binary.hints_from.is_none(), opd.hints_from.is_none()), (ArmSamples::Pipeline, true, true));
        // alone (no opd arm), the hint pipeline is named after the arm
        let alone = format!("{FILE}\n[[arms]]\nname = \"cd\"\nmethod = \"binary\"\nsamples = \"teacher-generations\"\n");
        let arms = AblationConfig::parse(&alone).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        assert!(arms.iter().find(|a| a.name == "cd").unwrap().hints_from.as_ref().unwrap().name.starts_with("cd-hints-"));
        // any other method is refused
        let bad = format!("{FILE}\n[[arms]]\nname = \"cd\"\nmethod = \"opd\"\nsamples = \"teacher-generations\"\n");
        let e = AblationConfig::parse(&bad).unwrap().resolve(Path::new("/tmp/lake")).unwrap_err().to_string();
        assert!(e.contains("arm cd: samples = \"teacher-generations\" trains with method = \"binary\""), "{e}");
    }

    #[test]
    fn seeds_make_replicates_that_differ_in_the_trainer_seed_only() {
        let multi = FILE.replace("seed = 3\n", "seed = 3\nseeds = [7, 8, 9]\n");
        let cfg = AblationConfig::parse(&multi).unwrap();
        let arms = cfg.resolve(Path::new("/tmp/lake")).unwrap();
        assert_eq!(arms.len(), 15);
        assert_eq!(arms.iter().take(4).map(|a| a.name.as_str()).collect::<Vec<_>>(), vec!["binary.seed=7", "binary.seed=8", "binary.seed=9", "combined.seed=7"]);
        let by = |n: &str| arms.iter().find(|a| a.name == n).unwrap();
        let (a, b) = (by("combined.w_opd=0.5.seed=7"), by("combined.w_opd=0.5.seed=9"));
        assert_eq!((a.group.as_str(), a.seed, b.seed), ("combined.w_opd=0.5", 7, 9));
        assert_eq!((a.pipeline.trainer.seed, b.pipeline.trainer.seed), (7, 9));
        assert_eq!(config_diff(&a.pipeline, &b.pipeline), vec!["trainer.seed"]);
        assert_eq!(a.data_pipeline, b.data_pipeline, "replicates share the data pipeline's configuration (each reads its own stream)");
        assert_eq!(a.data_pipeline, by("combined.seed=8").data_pipeline);
        assert_ne!(a.config_hash, b.config_hash);
        assert_eq!(a.overrides["trainer.seed"], "7");
        // across groups, the same seed: only the configured difference
        assert_eq!(config_diff(&by("binary.seed=8").pipeline, &by("combined.seed=8").pipeline), vec!["method"]);
        // one seed: names and hashes as without `seeds`
        let one = AblationConfig::parse(&FILE.replace("seed = 3\n", "seed = 3\nseeds = [3]\n")).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        let plain = AblationConfig::parse(FILE).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        assert_eq!(one.iter().map(|a| (&a.name, &a.config_hash)).collect::<Vec<_>>(), plain.iter().map(|a| (&a.name, &a.config_hash)).collect::<Vec<_>>());
        assert!(plain.iter().all(|a| a.group == a.name && a.seed == 3));
        // one seed that differs from `seed`: it is the trainer's seed, as the report says
        let five = AblationConfig::parse(&FILE.replace("seed = 3\n", "seed = 3\nseeds = [5]\n")).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        assert!(five.iter().all(|a| a.seed == 5 && a.pipeline.trainer.seed == 5), "{:?}", five.iter().map(|a| (a.seed, a.pipeline.trainer.seed)).collect::<Vec<_>>());
        assert!(AblationConfig::parse(&FILE.replace("seed = 3\n", "seed = 3\nseeds = [1, 1]\n")).unwrap_err().to_string().contains("listed twice"));
        let clash = format!("{multi}\n[[arms]]\nname = \"x.seed=7\"\nmethod = \"opd\"\n");
        assert!(AblationConfig::parse(&clash).unwrap_err().to_string().contains("names the replicates"));
    }

    #[test]
    fn eval_versions_last_keeps_v0_and_the_last() {
        assert_eq!(EvalVersions::Last.select(&[0, 1, 2, 3]), vec![0, 3]);
        assert_eq!(EvalVersions::Last.select(&[0, 1]), vec![0, 1]);
        assert_eq!(EvalVersions::Last.select(&[0]), vec![0]);
        assert_eq!(EvalVersions::All.select(&[0, 1, 2]), vec![0, 1, 2]);
        let e: EvalSettings = toml::from_str("versions = \"last\"\n").unwrap();
        assert_eq!(e.versions, EvalVersions::Last);
    }

    fn by_name<'a>(arms: &'a [ResolvedArm], n: &str) -> &'a ResolvedArm {
        arms.iter().find(|a| a.name == n).unwrap()
    }

    #[test]
    fn shipped_ablation_files_resolve() {
        let tiny = AblationConfig::load(Path::new("ablations/tiny.toml")).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        assert_eq!(tiny.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), vec!["binary", "opd", "combined", "opd-topk", "control", "cd"]);
        let cfg = AblationConfig::load(Path::new("ablations/student.toml")).unwrap();
        let arms = cfg.resolve(Path::new("/tmp/lake")).unwrap();
        assert_eq!(arms.len(), 21, "7 arms × 3 seeds");
        assert_eq!((by_name(&arms, "cd.seed=1").samples, by_name(&arms, "cd.seed=1").hints_from.as_ref().map(|h| h.name.clone())), (ArmSamples::TeacherGenerations, Some(by_name(&arms, "opd.seed=1").data_pipeline.clone())));
        let by = |n: &str| arms.iter().find(|a| a.name == n).unwrap();
        assert_eq!(config_diff(&by("combined.seed=2").pipeline, &by("control.seed=2").pipeline), vec!["trainer.advantage_sign"]);
        assert_eq!(by("control.seed=2").data_pipeline, by("combined.seed=1").data_pipeline);
        assert_eq!((by("opd.seed=3").pipeline.trainer.lr, by("opd.seed=3").pipeline.trainer.w_opd), (5e-4, 4.0));
        assert_eq!((cfg.eval.versions, cfg.shared.checkpoint_every, cfg.data.heldout_sessions), (EvalVersions::All, 2, 28), "every checkpoint, 84 held-out sessions");
        let multi = &by("multi.seed=1").pipeline;
        assert_eq!((multi.teacher.candidates, multi.teacher.top_k, multi.hint.m), (3, 4, 3));
        assert_eq!((multi.trainer.opd_loss, multi.trainer.recompute_old_logprobs), (crate::trainer::OpdLoss::Overlap, true));
        assert_ne!(by("multi.seed=1").data_pipeline, by("combined.seed=1").data_pipeline, "its own hints and teacher rows");
        for (file, n, split) in [("ablations/online.toml", 21, EvalSplit::Test), ("ablations/tiny-online.toml", 8, EvalSplit::Test), ("ablations/demo-validation.toml", 12, EvalSplit::Validation)] {
            let cfg = AblationConfig::load(Path::new(file)).unwrap();
            let on = cfg.online.clone().unwrap();
            assert!(on.interactions >= 4 && on.max_interactions >= on.interactions, "{file}");
            assert_eq!((cfg.resolve(Path::new("/tmp/lake")).unwrap().len(), cfg.eval.split), (n, split), "{file}");
        }
        let validation = AblationConfig::load(Path::new("ablations/demo-validation.toml")).unwrap().resolve(Path::new("/tmp/lake")).unwrap();
        let w_opd = |n: &str| by_name(&validation, n).pipeline.trainer.w_opd;
        assert_eq!((w_opd("combined.seed=1"), w_opd("combined.w_opd=1.0.seed=2"), w_opd("combined.w_opd=2.0.seed=3")), (4.0, 1.0, 2.0));
    }

    #[test]
    fn the_online_section_is_checked() {
        let online = FILE.replace("[data]\nheldout_sessions = 1\n[data.collect]\nsessions = 2\n", "[online]\ninteractions = 8\n");
        let cfg = AblationConfig::parse(&online).unwrap();
        assert_eq!(cfg.online, Some(OnlineSettings { interactions: 8, ..Default::default() }));
        let both = format!("{FILE}\n[online]\ninteractions = 8\n");
        assert!(AblationConfig::parse(&both).unwrap_err().to_string().contains("[online] and [data] exclude each other"));
        let below = online.replace("interactions = 8", "interactions = 8\nmax_interactions = 4");
        assert!(AblationConfig::parse(&below).unwrap_err().to_string().contains("max_interactions (4) is below interactions (8)"));
        let hot = online.replace("interactions = 8", "interactions = 8\ntemperature = -1.0");
        assert!(AblationConfig::parse(&hot).unwrap_err().to_string().contains("temperature must be a finite number"));
        let cd = format!("{online}\n[[arms]]\nname = \"cd\"\nmethod = \"binary\"\nsamples = \"teacher-generations\"\n");
        assert!(AblationConfig::parse(&cd).unwrap_err().to_string().contains("an offline arm"));
        let zero = online.replace("interactions = 8", "interactions = 0");
        assert!(AblationConfig::parse(&zero).unwrap_err().to_string().contains("[online] interactions, students and max_tokens must be at least 1"));
        let neither = FILE.replace("[data]\nheldout_sessions = 1\n[data.collect]\nsessions = 2\n", "");
        assert!(AblationConfig::parse(&neither).unwrap_err().to_string().contains("or an [online] section"));
        // Baselines: online arms only; memory needs a method that extracts hints; their own hash.
        let offline_baseline = format!("{FILE}\n[[arms]]\nname = \"prompted\"\nbaseline = \"prompted\"\n");
        assert!(AblationConfig::parse(&offline_baseline).unwrap_err().to_string().contains("an arm of the online mode"));
        let binary_memory = format!("{online}\n[[arms]]\nname = \"memory\"\nmethod = \"binary\"\nbaseline = \"memory\"\n");
        let e = AblationConfig::parse(&binary_memory).unwrap().resolve(Path::new("l")).unwrap_err().to_string();
        assert!(e.contains("arm memory: the memory baseline remembers accepted hints"), "{e}");
        let with = format!("{online}\n[[arms]]\nname = \"memory\"\nmethod = \"combined\"\nbaseline = \"memory\"\n");
        let arms = AblationConfig::parse(&with).unwrap().resolve(Path::new("l")).unwrap();
        let plain = AblationConfig::parse(&online).unwrap().resolve(Path::new("l")).unwrap();
        let (memory, combined) = (arms.iter().find(|a| a.name == "memory").unwrap(), arms.iter().find(|a| a.name == "combined").unwrap());
        assert_eq!(memory.baseline, Some(Baseline::Memory));
        assert_ne!(memory.config_hash, combined.config_hash, "same pipeline, but a baseline");
        assert_eq!(combined.config_hash, plain.iter().find(|a| a.name == "combined").unwrap().config_hash, "a trained arm keeps its hash");
    }

    #[test]
    fn bad_files_name_the_problem() {
        let dup = format!("{FILE}\n[[arms]]\nname = \"binary\"\nmethod = \"opd\"\n");
        assert!(AblationConfig::parse(&dup).unwrap_err().to_string().contains("two arms are named \"binary\""));
        let typo = FILE.replace("heldout_sessions", "heldout_session");
        assert!(AblationConfig::parse(&typo).unwrap_err().to_string().contains("heldout_session"));
        let sweep = FILE.replace("arm = \"combined\"", "arm = \"nope\"");
        assert!(AblationConfig::parse(&sweep).unwrap_err().to_string().contains("unknown arm \"nope\""));
        let badkey = FILE.replace("\"teacher.top_k\" = 4", "\"teacher.topk\" = 4");
        let cfg = AblationConfig::parse(&badkey).unwrap();
        let e = cfg.resolve(Path::new("l")).unwrap_err().to_string();
        assert!(e.contains("arm opd-topk") && e.contains("topk"), "{e}");
    }

    #[test]
    fn set_dotted_and_merge() {
        let mut t = toml::Table::new();
        set_dotted(&mut t, "a.b.c", toml::Value::Integer(1)).unwrap();
        let mut over = toml::Table::new();
        set_dotted(&mut over, "a.b.d", toml::Value::Integer(2)).unwrap();
        merge(&mut t, &over);
        assert_eq!(t["a"]["b"]["c"].as_integer(), Some(1));
        assert_eq!(t["a"]["b"]["d"].as_integer(), Some(2));
        assert!(set_dotted(&mut t, "a.b.c.x", toml::Value::Integer(3)).is_err());
        assert!(set_dotted(&mut t, "a..c", toml::Value::Integer(3)).is_err());
    }

    /// Every shipped ablation file loads and resolves (a file a user is told to run must); the files
    /// behind a shipped report keep the recipe they were run with when the demo's default moves on:
    /// `pipelines/demo.toml` now has w_opd = 1, their arms still w_opd = 4 unless an arm sets it.
    #[test]
    fn shipped_ablation_files_resolve_and_keep_their_recipe() {
        let lake = Path::new("unused-lake");
        let mut files: Vec<_> = std::fs::read_dir("ablations").unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect();
        files.sort();
        assert!(files.len() >= 8, "{files:?}");
        for f in &files {
            let arms = AblationConfig::load(f).and_then(|c| c.resolve(lake)).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            assert!(!arms.is_empty(), "{}", f.display());
        }
        let demo = crate::config::PipelineConfig::load(Path::new("pipelines/demo.toml")).unwrap();
        assert_eq!(demo.trainer.w_opd, 1.0);
        for name in ["student", "online", "online-w1", "opd-tokens", "student-collect-t0.6", "demo-validation"] {
            let arms = AblationConfig::load(&PathBuf::from(format!("ablations/{name}.toml"))).unwrap().resolve(lake).unwrap();
            // Every arm that does not set w_opd itself (all of them, not only those that use it: the
            // hash of an arm's resolved configuration, which a resume checks, includes it).
            let unset: Vec<_> = arms.iter().filter(|a| !a.overrides.iter().any(|(k, _)| k == "trainer.w_opd")).collect();
            assert!(!unset.is_empty(), "{name}");
            for a in unset {
                assert_eq!(a.pipeline.trainer.w_opd, 4.0, "{name}: {}", a.name);
            }
        }
        let validation = AblationConfig::load(Path::new("ablations/demo-validation.toml")).unwrap().resolve(lake).unwrap();
        let w_opd = |group: &str| validation.iter().filter(|a| a.group == group).map(|a| a.pipeline.trainer.w_opd).collect::<Vec<_>>();
        assert_eq!(w_opd("combined.w_opd=1.0"), vec![1.0; 3]);
        assert_eq!(w_opd("combined.w_opd=2.0"), vec![2.0; 3]);
    }
}
