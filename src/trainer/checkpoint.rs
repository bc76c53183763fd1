//! Checkpoints: `checkpoints/<run>/<version>/` folders with the weights, the optimizer state and a
//! `manifest.json` (version, parent, step, method, config hash, metrics, lineage).
//!
//! Layout of one checkpoint (version N, written by [`CheckpointWriter::write`]):
//!
//! ```text
//! checkpoints/<run>/N/
//!   full weights:  model.safetensors + config.json (+ tokenizer files): a complete HF model folder
//!   LoRA:          adapter_model.safetensors + adapter_config.json: a PEFT adapter folder (keys
//!                  base_model.model.<module>.lora_A.weight [r, in] / .lora_B.weight [out, r], the
//!                  trained dtype; `model::peft`), which vLLM/SGLang (`lora_path` = this folder) and
//!                  `peft.PeftModel.from_pretrained` load as is
//!   optimizer/optimizer.safetensors   AdamW moments exp_avg/<name>, exp_avg_sq/<name>, and f32
//!                           master weights master/<name> of bf16/f16 tensors (`optim` module docs,
//!                           "Precision"). In a subfolder because serving engines load every
//!                           `*.safetensors` at the top of the folder they are given (SGLang's LoRA and
//!                           disk loaders, vLLM's disk loader): the optimizer's names would be read as
//!                           weights. Checkpoints written before keep `optimizer.safetensors` at the top;
//!                           resume reads the path the manifest names (`optimizer.file`).
//!   manifest.json           written last; `weight_files` lists the files the policy wrote
//! ```
//!
//! (These are the files of the model runtime's policy; a policy using the default
//! `Policy::save_weights` writes `model.safetensors` or `adapter.safetensors` under its variable names.)
//! LoRA checkpoints written before the PEFT layout hold `adapter.safetensors` with bare module names
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`); resume, `serve --model <ckpt> --base`, reloads
//! and evaluation still read them (`model::peft::read_adapter_weights`).
//!
//! Atomicity: everything is written into `checkpoints/<run>/.tmp-N-<uuid>/`, each file fsynced, then the
//! folder is renamed to `N` and the run folder fsynced. A folder named by a number with a readable
//! manifest of that version is complete; temporary folders and anything else are ignored by
//! [`scan`] and [`latest_complete`].
//!
//! On object storage (a lake at `s3://bucket/prefix`, [`CheckpointWriter::with_lake`]): once a checkpoint
//! is complete locally, each of its files is uploaded to
//! `<prefix>/_checkpoints/<run>/<version>/<file>` (one conditional PUT per file, a file above
//! [`crate::lake::remote::SINGLE_PUT_BYTES`] in parts), `manifest.json` last, so a manifest in the bucket
//! marks a complete checkpoint there too ([`upload`]). (`_checkpoints`, not `checkpoints`: that folder is
//! the lake's `checkpoints` table.) A trainer resuming on a machine whose run folder lacks the newest
//! checkpoint downloads it ([`fetch_latest`]: into a temporary folder renamed into place, as a local
//! write), together with the manifests of the older versions, kept in `<run>/.lineage/<version>.json` for
//! their lineage (exactly-once needs the whole [`ancestry`]; their weights are not downloaded).
//!
//! Exactly-once into the trainer: every sample the trainer consumed (trained or dropped) between a
//! checkpoint's parent and the checkpoint is in its manifest's lineage, so after a restart from the
//! newest complete checkpoint [`consumed_sample_ids`] over its [`ancestry`] is the set to skip; samples
//! consumed after that checkpoint are trained again, since their updates were lost with the process.

use std::collections::HashSet;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::loss::LossMetrics;
use crate::lake::remote::Remote;
use crate::lake::Lake;
use crate::schema::{Checkpoint, Table};
use crate::{Error, Result};

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The optimizer state's path inside a checkpoint folder (a subfolder: see the module docs).
pub const OPTIMIZER_FILE: &str = "optimizer/optimizer.safetensors";
/// Version of the manifest format.
pub const MANIFEST_FORMAT: u32 = 1;
/// The folder below a lake's prefix on object storage that holds `<run>/<version>/` checkpoints.
pub const REMOTE_FOLDER: &str = "_checkpoints";
/// The folder in a run folder holding manifests of checkpoints whose files are only on object storage
/// (`<version>.json`), downloaded for their lineage.
pub const LINEAGE_FOLDER: &str = ".lineage";

/// One consumed sample and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineageEntry {
    /// Sample id.
    pub sample_id: String,
    /// The turn.
    pub interaction_id: String,
    /// Kafka topic of the interaction row.
    pub source_topic: Option<String>,
    /// Kafka partition of the interaction row.
    pub source_partition: Option<i32>,
    /// Kafka offset of the interaction row.
    pub source_offset: Option<i64>,
    /// Policy version that produced the response.
    pub policy_version: Option<i64>,
    /// Where the trainer read the sample: `samples` topic (null when read with SQL from the lake).
    #[serde(default)]
    pub sample_topic: Option<String>,
    /// Partition of the `samples` topic.
    #[serde(default)]
    pub sample_partition: Option<i32>,
    /// Offset in the `samples` topic.
    #[serde(default)]
    pub sample_offset: Option<i64>,
    /// Optimizer step that consumed it.
    pub step: i64,
    /// False when the sample was dropped (see `drop_reason`).
    pub trained: bool,
    /// Why it was dropped (`DropReason::as_str`).
    pub drop_reason: Option<String>,
}

/// Metrics of one optimizer step, as kept in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step number (1-based).
    pub step: i64,
    /// Loss metrics.
    pub metrics: LossMetrics,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean |rollout − current| log-prob over trained tokens (nats).
    pub rollout_logprob_abs_diff: f64,
    /// Samples dropped from the step's input.
    pub dropped: i64,
    /// Wall time (seconds).
    pub seconds: f64,
    /// The step's advantages split into their reward and teacher parts (None in manifests written
    /// before it existed).
    #[serde(default)]
    pub advantage_parts: Option<super::advantage_parts::AdvantageParts>,
}

/// Optimizer state recorded in the manifest (the moments are in [`OPTIMIZER_FILE`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerRecord {
    /// `adamw`.
    pub kind: String,
    /// Steps taken (Adam's t, for bias correction).
    pub step: i64,
    /// Learning rate.
    pub lr: f64,
    /// (β1, β2).
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// File holding the moments, relative to the checkpoint folder.
    pub file: String,
}

/// `manifest.json` of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// Training run id (the run folder's name).
    pub run_id: String,
    /// Tenant whose adapter this is (per-tenant training: the folder `<run>/<tenant>/<version>`); absent
    /// for the policy shared by all tenants (and in every manifest written before tenants existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Policy version of these weights (1, 2, ...; 0 is the initial weights and has no checkpoint).
    pub version: i64,
    /// Version trained from.
    pub parent_version: i64,
    /// Optimizer steps taken in total.
    pub step: i64,
    /// Method (`binary`, `opd`, `combined`).
    pub method: String,
    /// `TrainerConfig::hash`.
    pub config_hash: String,
    /// `full` (all trainable weights) or `lora` (adapter tensors only).
    pub weights_format: String,
    /// Weight files written by the policy, relative to the folder.
    pub weight_files: Vec<String>,
    /// Optimizer state.
    pub optimizer: OptimizerRecord,
    /// Per-step metrics since the parent.
    pub metrics: Vec<StepRecord>,
    /// Samples consumed since the parent.
    pub lineage: Vec<LineageEntry>,
    /// When written (ms since the Unix epoch).
    pub created_time: i64,
}

impl Manifest {
    /// Reads `dir/manifest.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when unreadable, [`Error::Json`] when malformed.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let text = fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
        Ok(serde_json::from_str(&text)?)
    }

    /// `<run id>` (shared policy) or `<run id>/<tenant>` (a tenant's adapter): the prefix of checkpoint
    /// and step ids and the checkpoints' folder below the checkpoints directory.
    pub fn key(&self) -> String {
        run_key(&self.run_id, self.tenant.as_deref())
    }

    /// The `checkpoints` table row for this manifest, stored at `path`: metrics and lineage as JSON text.
    ///
    /// # Errors
    /// [`Error::Json`] if serialisation fails (not expected).
    pub fn to_row(&self, path: &Path) -> Result<Checkpoint> {
        Ok(Checkpoint {
            schema_version: Checkpoint::SCHEMA_VERSION,
            checkpoint_id: format!("{}/{}", self.key(), self.version),
            run_id: self.run_id.clone(),
            tenant: self.tenant.clone(),
            version: self.version,
            parent_version: self.parent_version,
            step: self.step,
            method: self.method.clone(),
            config_hash: self.config_hash.clone(),
            path: path.display().to_string(),
            weights_format: self.weights_format.clone(),
            samples: self.lineage.iter().filter(|l| l.trained).count() as i64,
            metrics: serde_json::to_string(&self.metrics)?,
            lineage: serde_json::to_string(&self.lineage)?,
            created_time: self.created_time,
        })
    }
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| Error::io("fsync folder", dir, e))
}

fn fsync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))? {
        let path = entry.map_err(|e| Error::io("list", dir, e))?.path();
        if path.is_dir() {
            fsync_tree(&path)?;
        } else {
            File::open(&path).and_then(|f| f.sync_all()).map_err(|e| Error::io("fsync", &path, e))?;
        }
    }
    fsync_dir(dir)
}

/// `<run id>` or `<run id>/<tenant>`: where a run's (or a tenant's) checkpoints live below the
/// checkpoints directory and on object storage, and the prefix of their ids.
pub fn run_key(run_id: &str, tenant: Option<&str>) -> String {
    match tenant {
        Some(t) => format!("{run_id}/{t}"),
        None => run_id.to_string(),
    }
}

/// Writes the checkpoints of one run into `<checkpoints dir>/<run id>/` (a tenant's adapter, per-tenant
/// training: `<checkpoints dir>/<run id>/<tenant>/`) (and, with a lake on object
/// storage, tells the trainer where to upload them: [`CheckpointWriter::remote`]).
#[derive(Debug, Clone)]
pub struct CheckpointWriter {
    run_dir: PathBuf,
    run_id: String,
    tenant: Option<String>,
    lake: Option<Lake>,
}

impl CheckpointWriter {
    /// A writer for run `run_id` under `checkpoints_dir` (created on the first write).
    pub fn new(checkpoints_dir: &Path, run_id: &str) -> CheckpointWriter {
        CheckpointWriter { run_dir: checkpoints_dir.join(run_id), run_id: run_id.to_string(), tenant: None, lake: None }
    }

    /// A writer for tenant `tenant`'s adapter in run `run_id`: `<checkpoints_dir>/<run_id>/<tenant>/`
    /// (per-tenant training). `tenant` must be a valid tenant id ([`crate::schema::validate_tenant`]),
    /// which is a safe folder name.
    pub fn for_tenant(checkpoints_dir: &Path, run_id: &str, tenant: &str) -> CheckpointWriter {
        CheckpointWriter { run_dir: checkpoints_dir.join(run_id).join(tenant), run_id: run_id.to_string(), tenant: Some(tenant.to_string()), lake: None }
    }

    /// The tenant whose adapter this writer writes (None: the shared policy).
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// [`run_key`]: `<run id>` or `<run id>/<tenant>`, the prefix of checkpoint and step ids and the
    /// folder on object storage.
    pub fn key(&self) -> String {
        run_key(&self.run_id, self.tenant.as_deref())
    }

    /// This writer, with the run's checkpoints mirrored to `lake` when it is on object storage (see the
    /// module documentation); a local lake changes nothing.
    pub fn with_lake(mut self, lake: &Lake) -> CheckpointWriter {
        self.lake = lake.remote().is_some().then(|| lake.clone());
        self
    }

    /// The object store the run's checkpoints are mirrored to, if any.
    pub fn remote(&self) -> Option<&Remote> {
        self.lake.as_ref().and_then(Lake::remote)
    }

    /// `<checkpoints dir>/<run id>` (`<checkpoints dir>/<run id>/<tenant>` for a tenant).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Writes checkpoint `manifest.version`: `write_files` fills the temporary folder (weights and
    /// optimizer state) and returns the weight files' names, which are stored in the manifest; then the
    /// manifest is written, everything fsynced, and the folder renamed to `<version>`. Returns the final
    /// folder. On failure the temporary folder is removed (or left to be ignored).
    ///
    /// # Errors
    /// [`Error::Config`] when version `N` already exists (checkpoints are never overwritten);
    /// [`Error::Io`] on a file-system failure; whatever `write_files` returns.
    pub fn write(&self, manifest: &mut Manifest, write_files: impl FnOnce(&Path) -> Result<Vec<String>>) -> Result<PathBuf> {
        let final_dir = self.run_dir.join(manifest.version.to_string());
        if final_dir.exists() {
            return Err(crate::config_err!("checkpoint {} already exists; refusing to overwrite it", final_dir.display()));
        }
        fs::create_dir_all(&self.run_dir).map_err(|e| Error::io("create folder", &self.run_dir, e))?;
        let tmp = self.run_dir.join(format!(".tmp-{}-{}", manifest.version, uuid::Uuid::new_v4().simple()));
        fs::create_dir(&tmp).map_err(|e| Error::io("create folder", &tmp, e))?;
        let result = (|| {
            manifest.weight_files = write_files(&tmp)?;
            let json = serde_json::to_vec_pretty(&*manifest)?;
            let mpath = tmp.join(MANIFEST_FILE);
            fs::write(&mpath, json).map_err(|e| Error::io("write", &mpath, e))?;
            fsync_tree(&tmp)?;
            fs::rename(&tmp, &final_dir).map_err(|e| Error::io("rename", &final_dir, e))?;
            fsync_dir(&self.run_dir)
        })();
        if let Err(e) = result {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Ok(final_dir)
    }
}

/// What [`scan`] found in a run folder.
#[derive(Debug, Default)]
pub struct CheckpointScan {
    /// Complete checkpoints `(folder, manifest)`, ascending by version.
    pub complete: Vec<(PathBuf, Manifest)>,
    /// Folders that are not complete checkpoints, with the reason (temporary folders, unreadable or
    /// mismatched manifests).
    pub ignored: Vec<(PathBuf, String)>,
    /// Manifests of checkpoints that are complete only on object storage ([`LINEAGE_FOLDER`]), ascending
    /// by version: for their lineage ([`ancestry`]), not loadable.
    pub lineage_only: Vec<Manifest>,
}

impl CheckpointScan {
    /// Every manifest known for the run: the complete checkpoints' and the lineage-only ones (a version
    /// in both counts once, complete), ascending by version.
    pub fn manifests(&self) -> Vec<Manifest> {
        let mut out: Vec<Manifest> = self.complete.iter().map(|(_, m)| m.clone()).collect();
        out.extend(self.lineage_only.iter().filter(|l| !self.complete.iter().any(|(_, m)| m.version == l.version)).cloned());
        out.sort_by_key(|m| m.version);
        out
    }
}

/// Lists the checkpoints of a run folder (`checkpoints/<run>`); a missing folder has none.
///
/// # Errors
/// [`Error::Io`] when the folder exists but cannot be listed.
pub fn scan(run_dir: &Path) -> Result<CheckpointScan> {
    let mut out = CheckpointScan::default();
    let entries = match fs::read_dir(run_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io("list", run_dir, e)),
    };
    for entry in entries {
        let path = entry.map_err(|e| Error::io("list", run_dir, e))?.path();
        if !path.is_dir() {
            continue;
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name == LINEAGE_FOLDER {
            out.lineage_only = read_lineage_folder(&path)?;
            continue;
        }
        let Ok(version) = name.parse::<i64>() else {
            out.ignored.push((path, "not a version folder (temporary or foreign)".into()));
            continue;
        };
        match Manifest::read(&path) {
            Ok(m) if m.version == version => out.complete.push((path, m)),
            Ok(m) => out.ignored.push((path, format!("manifest says version {}, folder {version}", m.version))),
            Err(e) => out.ignored.push((path, format!("no readable manifest: {e}"))),
        }
    }
    out.complete.sort_by_key(|(_, m)| m.version);
    Ok(out)
}

/// The manifests in a run folder's [`LINEAGE_FOLDER`] (`<version>.json`), ascending by version;
/// unreadable ones are skipped with a warning.
///
/// # Errors
/// [`Error::Io`] when the folder cannot be listed.
fn read_lineage_folder(dir: &Path) -> Result<Vec<Manifest>> {
    let mut out = vec![];
    for entry in fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))? {
        let path = entry.map_err(|e| Error::io("list", dir, e))?.path();
        let Some(version) = path.file_stem().and_then(|n| n.to_str()).and_then(|n| n.parse::<i64>().ok()) else { continue };
        let read = fs::read(&path).map_err(|e| Error::io("read", &path, e)).and_then(|b| Ok(serde_json::from_slice::<Manifest>(&b)?));
        match read {
            Ok(m) if m.version == version => out.push(m),
            Ok(m) => tracing::warn!(path = %path.display(), version = m.version, "lineage manifest of another version; ignored"),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable lineage manifest; ignored"),
        }
    }
    out.sort_by_key(|m| m.version);
    Ok(out)
}

/// The newest complete checkpoint of a run folder (for `--resume`), or `None`.
///
/// # Errors
/// As [`scan`].
pub fn latest_complete(run_dir: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    Ok(scan(run_dir)?.complete.pop())
}

/// `_checkpoints/<run>/<version>/<rel>` below the lake's prefix.
fn remote_rel(run_id: &str, version: i64, rel: &str) -> String {
    format!("{REMOTE_FOLDER}/{run_id}/{version}/{rel}")
}

/// The files below `dir` (recursive), as `/`-separated paths relative to it, sorted.
fn files_below(dir: &Path) -> Result<Vec<String>> {
    let mut out = vec![];
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let d = dir.join(&rel);
        for entry in fs::read_dir(&d).map_err(|e| Error::io("list", &d, e))? {
            let entry = entry.map_err(|e| Error::io("list", &d, e))?;
            let r = rel.join(entry.file_name());
            if entry.path().is_dir() {
                todo.push(r);
            } else {
                out.push(r.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect::<Vec<_>>().join("/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Uploads the complete checkpoint folder `dir` (of run `run_id`, version `version`) to
/// `_checkpoints/<run>/<version>/` below the lake's prefix: every file, each with
/// [`Remote::upload_file`] (an object already there is left as is), then `manifest.json` with one
/// conditional PUT. Returns whether this call wrote the manifest (false: the store already had this
/// version, e.g. uploaded before a crash, or written by another trainer of the same run).
///
/// # Errors
/// [`Error::Io`] when a file cannot be read; [`Error::Unreachable`] when an upload fails (the version
/// then has no manifest in the store, so it is not complete there; [`upload_missing`] retries).
pub fn upload(remote: &Remote, run_id: &str, version: i64, dir: &Path) -> Result<bool> {
    for rel in files_below(dir)?.iter().filter(|r| r.as_str() != MANIFEST_FILE) {
        remote.upload_file(&dir.join(rel), &remote.path(&remote_rel(run_id, version, rel)))?;
    }
    let mpath = dir.join(MANIFEST_FILE);
    let manifest = fs::read(&mpath).map_err(|e| Error::io("read", &mpath, e))?;
    remote.put_new(&remote.path(&remote_rel(run_id, version, MANIFEST_FILE)), manifest)
}

/// The manifests of run `run_id`'s complete checkpoints on object storage (a `manifest.json` of its
/// version), ascending by version. `run_id` is a [`run_key`]: `run` or `run/tenant` (a tenant's
/// adapter); a shared run's listing never includes its tenants' checkpoints (one level deeper).
///
/// # Errors
/// [`Error::Unreachable`] when listing or reading fails; [`Error::Json`] for a malformed manifest.
pub fn remote_manifests(remote: &Remote, run_id: &str) -> Result<Vec<Manifest>> {
    let mut out = vec![];
    for meta in remote.list(&format!("{REMOTE_FOLDER}/{run_id}"))? {
        let rel = remote.rel(meta.location.as_ref());
        // `<folder>/<run>[/<tenant>]/<version>/<file>`: what follows the key (`run_id` may be `run/tenant`)
        let Some(tail) = rel.strip_prefix(&format!("{REMOTE_FOLDER}/{run_id}/")) else { continue };
        let parts: Vec<&str> = tail.split('/').collect();
        let [v, name] = parts.as_slice() else { continue };
        let Ok(version) = v.parse::<i64>() else { continue };
        if *name != MANIFEST_FILE {
            continue;
        }
        let m: Manifest = serde_json::from_slice(&remote.get(&meta.location)?)?;
        if m.version == version {
            out.push(m);
        } else {
            tracing::warn!(object = %meta.location, version = m.version, "checkpoint manifest of another version on object storage; ignored");
        }
    }
    out.sort_by_key(|m| m.version);
    Ok(out)
}

/// Downloads version `version` of run `run_id` from object storage into `run_dir/<version>/`: every
/// object of it into a temporary folder (`manifest.json` last), fsynced, renamed into place. Returns
/// the folder.
///
/// # Errors
/// [`Error::Config`] when the folder already exists locally or the store has no manifest for the
/// version; [`Error::Unreachable`]/[`Error::Io`] on a failed transfer (the temporary folder is removed).
pub fn download(remote: &Remote, run_id: &str, version: i64, run_dir: &Path) -> Result<PathBuf> {
    let final_dir = run_dir.join(version.to_string());
    if final_dir.exists() {
        return Err(crate::config_err!("checkpoint {} already exists locally; not downloading over it", final_dir.display()));
    }
    let prefix = remote_rel(run_id, version, "");
    let mut files: Vec<(String, datafusion::object_store::path::Path)> = remote
        .list(prefix.trim_end_matches('/'))?
        .into_iter()
        .filter_map(|m| {
            let rel = remote.rel(m.location.as_ref()).strip_prefix(&prefix)?.to_string();
            Some((rel, m.location))
        })
        .collect();
    if !files.iter().any(|(rel, _)| rel == MANIFEST_FILE) {
        return Err(crate::config_err!("checkpoint {version} of run {run_id} has no {MANIFEST_FILE} on object storage (incomplete there)"));
    }
    // the manifest last, as on upload
    files.sort_by_key(|(rel, _)| (rel == MANIFEST_FILE, rel.clone()));
    fs::create_dir_all(run_dir).map_err(|e| Error::io("create folder", run_dir, e))?;
    let tmp = run_dir.join(format!(".tmp-{version}-{}", uuid::Uuid::new_v4().simple()));
    let result = (|| {
        for (rel, object) in &files {
            let local = tmp.join(rel);
            if let Some(parent) = local.parent() {
                fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
            }
            remote.download_file(object, &local)?;
        }
        fsync_tree(&tmp)?;
        fs::rename(&tmp, &final_dir).map_err(|e| Error::io("rename", &final_dir, e))?;
        fsync_dir(run_dir)
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(final_dir)
}

/// Brings run `run_id`'s folder `run_dir` up to date with object storage before a resume: when the
/// store holds a newer complete checkpoint than the folder, downloads it ([`download`]), and writes the
/// manifest of every other version the folder lacks into [`LINEAGE_FOLDER`] (their lineage). Returns
/// the version downloaded, if any.
///
/// # Errors
/// As [`remote_manifests`], [`scan`] and [`download`]; [`Error::Io`] when a lineage manifest cannot be
/// written.
pub fn fetch_latest(remote: &Remote, run_id: &str, run_dir: &Path) -> Result<Option<i64>> {
    let stored = remote_manifests(remote, run_id)?;
    let local = scan(run_dir)?;
    let local_latest = local.complete.last().map(|(_, m)| m.version);
    let newest = stored.last().map(|m| m.version).filter(|&v| local_latest.is_none_or(|l| v > l));
    if let Some(v) = newest {
        let dir = download(remote, run_id, v, run_dir)?;
        tracing::info!(run = run_id, version = v, path = %dir.display(), "checkpoint downloaded from object storage");
    }
    let have = |v: i64| Some(v) == newest || local.complete.iter().any(|(_, m)| m.version == v) || local.lineage_only.iter().any(|m| m.version == v);
    for m in stored.iter().filter(|m| !have(m.version)) {
        let path = run_dir.join(LINEAGE_FOLDER).join(format!("{}.json", m.version));
        crate::lake::write_atomic(&path, &serde_json::to_vec_pretty(m)?)?;
    }
    Ok(newest)
}

/// Uploads every complete checkpoint of `run_dir` that object storage lacks (a manifest not there:
/// e.g. an upload cut short by a crash). Returns the versions uploaded.
///
/// # Errors
/// As [`remote_manifests`], [`scan`] and [`upload`].
pub fn upload_missing(remote: &Remote, run_id: &str, run_dir: &Path) -> Result<Vec<i64>> {
    let stored: HashSet<i64> = remote_manifests(remote, run_id)?.into_iter().map(|m| m.version).collect();
    let mut out = vec![];
    for (dir, m) in scan(run_dir)?.complete.into_iter().filter(|(_, m)| !stored.contains(&m.version)) {
        if upload(remote, run_id, m.version, &dir)? {
            out.push(m.version);
        }
    }
    Ok(out)
}

/// The manifests on the path from `version` back to the initial weights (following `parent_version`),
/// newest first. Stops at the first missing parent.
pub fn ancestry(manifests: &[Manifest], version: i64) -> Vec<&Manifest> {
    let mut chain = Vec::new();
    let mut seen = HashSet::new();
    let mut v = version;
    while let Some(m) = manifests.iter().find(|m| m.version == v) {
        if !seen.insert(v) {
            break;
        }
        chain.push(m);
        v = m.parent_version;
    }
    chain
}

/// Every sample id in the lineage of the given manifests (trained or dropped): the samples to skip
/// after resuming (pass the [`ancestry`] of the checkpoint resumed from).
pub fn consumed_sample_ids<'a>(manifests: impl IntoIterator<Item = &'a Manifest>) -> HashSet<String> {
    manifests.into_iter().flat_map(|m| m.lineage.iter().map(|l| l.sample_id.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(version: i64, parent: i64, ids: &[&str]) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            run_id: "run".into(),
            tenant: None,
            version,
            parent_version: parent,
            step: version,
            method: "binary".into(),
            config_hash: "h".into(),
            weights_format: "full".into(),
            weight_files: vec![],
            optimizer: OptimizerRecord { kind: "adamw".into(), step: version, lr: 1e-5, betas: (0.9, 0.98), eps: 1e-8, weight_decay: 0.1, file: OPTIMIZER_FILE.into() },
            metrics: vec![],
            lineage: ids
                .iter()
                .map(|id| LineageEntry {
                    sample_id: id.to_string(),
                    interaction_id: format!("i-{id}"),
                    source_topic: Some("interactions".into()),
                    source_partition: Some(1),
                    source_offset: Some(7),
                    policy_version: Some(parent),
                    sample_topic: Some("samples".into()),
                    sample_partition: Some(0),
                    sample_offset: Some(version),
                    step: version,
                    trained: true,
                    drop_reason: None,
                })
                .collect(),
            created_time: 0,
        }
    }

    #[test]
    fn writes_atomically_and_finds_the_newest_complete() {
        let dir = tempfile::tempdir().unwrap();
        let w = CheckpointWriter::new(dir.path(), "run");
        let mut m1 = manifest(1, 0, &["a", "b"]);
        let p1 = w
            .write(&mut m1, |tmp| {
                fs::write(tmp.join("model.safetensors"), b"w1").unwrap();
                Ok(vec!["model.safetensors".into()])
            })
            .unwrap();
        assert_eq!(p1, dir.path().join("run").join("1"));
        assert_eq!(Manifest::read(&p1).unwrap().weight_files, vec!["model.safetensors".to_string()]);
        let mut m2 = manifest(2, 1, &["c"]);
        w.write(&mut m2, |_| Ok(vec![])).unwrap();
        // A crashed write: a temporary folder with files but no rename; a numbered folder without manifest.
        fs::create_dir_all(dir.path().join("run/.tmp-3-abc")).unwrap();
        fs::write(dir.path().join("run/.tmp-3-abc/manifest.json"), serde_json::to_vec(&manifest(3, 2, &["d"])).unwrap()).unwrap();
        fs::create_dir_all(dir.path().join("run/4")).unwrap();
        let s = scan(w.run_dir()).unwrap();
        assert_eq!(s.complete.iter().map(|(_, m)| m.version).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(s.ignored.len(), 2);
        let (path, latest) = latest_complete(w.run_dir()).unwrap().unwrap();
        assert_eq!((latest.version, path), (2, dir.path().join("run/2")));
        // Never overwritten.
        assert!(w.write(&mut manifest(2, 1, &[]), |_| Ok(vec![])).unwrap_err().to_string().contains("already exists"));
        // A failing writer leaves no folder behind.
        assert!(w.write(&mut manifest(5, 2, &[]), |_| Err(Error::Internal("disk full".into()))).is_err());
        assert!(!dir.path().join("run/5").exists());
        assert_eq!(fs::read_dir(w.run_dir()).unwrap().count(), 4);
        // Missing run folder: nothing.
        assert!(latest_complete(&dir.path().join("nope")).unwrap().is_none());
    }

    #[test]
    fn lineage_only_manifests_join_the_ancestry_but_not_the_complete_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let w = CheckpointWriter::new(dir.path(), "run");
        w.write(&mut manifest(2, 1, &["c"]), |_| Ok(vec![])).unwrap();
        // version 1 only on object storage: its manifest kept for the lineage (and a stale copy of 2)
        let lineage = w.run_dir().join(LINEAGE_FOLDER);
        fs::create_dir_all(&lineage).unwrap();
        fs::write(lineage.join("1.json"), serde_json::to_vec(&manifest(1, 0, &["a", "b"])).unwrap()).unwrap();
        fs::write(lineage.join("2.json"), serde_json::to_vec(&manifest(2, 1, &["stale"])).unwrap()).unwrap();
        fs::write(lineage.join("7.json"), b"not json").unwrap();
        let s = scan(w.run_dir()).unwrap();
        assert_eq!(s.complete.iter().map(|(_, m)| m.version).collect::<Vec<_>>(), vec![2]);
        assert!(s.ignored.is_empty(), "{:?}", s.ignored);
        assert_eq!(s.lineage_only.iter().map(|m| m.version).collect::<Vec<_>>(), vec![1, 2]);
        let all = s.manifests();
        assert_eq!(all.iter().map(|m| m.version).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(consumed_sample_ids(ancestry(&all, 2)), ["a", "b", "c"].iter().map(|s| s.to_string()).collect());
        assert_eq!(latest_complete(w.run_dir()).unwrap().unwrap().1.version, 2);
    }

    #[test]
    fn consumed_ids_follow_the_ancestry() {
        // 1 ← 2 ← 3, and a sibling 4 whose parent is 2 (e.g. written by another run after a resume).
        let ms = vec![manifest(1, 0, &["a", "b"]), manifest(2, 1, &["c"]), manifest(3, 2, &["d"]), manifest(4, 2, &["x"])];
        let chain: Vec<i64> = ancestry(&ms, 3).iter().map(|m| m.version).collect();
        assert_eq!(chain, vec![3, 2, 1]);
        let ids = consumed_sample_ids(ancestry(&ms, 3));
        assert_eq!(ids, ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect());
        assert_eq!(consumed_sample_ids(&ms).len(), 5);
    }

    #[test]
    fn manifest_becomes_a_checkpoints_row() {
        let mut m = manifest(2, 1, &["a", "b"]);
        m.lineage[1].trained = false;
        m.lineage[1].drop_reason = Some("stale".into());
        let row = m.to_row(Path::new("/c/run/2")).unwrap();
        assert_eq!((row.checkpoint_id.as_str(), row.version, row.parent_version, row.samples), ("run/2", 2, 1, 1));
        let lineage: Vec<LineageEntry> = serde_json::from_str(&row.lineage).unwrap();
        assert_eq!(lineage, m.lineage);
        assert_eq!(row.path, "/c/run/2");
    }
}
