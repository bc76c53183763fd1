//! Pipeline configuration: `pipelines/<name>.toml`.
//!
//! Layers, later ones win: built-in defaults → the pipeline file → environment variables naming any
//! key of a table, `NEXTSTATE_<TABLE>__<KEY>[__<KEY>…]` (e.g. `NEXTSTATE_TRAINER__LR=1e-4`,
//! `NEXTSTATE_TRAINER__LORA__RANK=16`; [`ENV_PREFIX`], layered with figment) → the command-line flags
//! and their own variables (`--brokers` / `NEXTSTATE_BROKERS`, `--lake` / `NEXTSTATE_LAKE`, ...; see
//! each command). Every table is `deny_unknown_fields`, so a typo, in the file or in a variable, is an
//! error naming the key.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::bus::BusConfig;
use crate::error::{Error, Result};
use crate::lake::sink::SinkConfig;
use crate::method::Method;
use crate::serve::ServeConfig;
use crate::teacher::TeacherConfig;

/// The policy model and where it runs (`[policy]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Model directory (HF-style: config.json, *.safetensors, tokenizer.json, tokenizer_config.json).
    pub model: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `f32`, `f16` or `bf16`. With `f16`/`bf16` the trainer's AdamW keeps f32 master weights and f32
    /// moments (`trainer::optim` module docs, "Precision").
    pub dtype: String,
    /// libtorch intra-op threads (0 = libtorch's default).
    pub threads: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig { model: PathBuf::from("models/smollm2-135m-instruct"), device: "cpu".into(), dtype: "f32".into(), threads: 0 }
    }
}

/// The capture proxy run by `nextstate run` (`[proxy]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address to listen on.
    pub host: String,
    /// Port (0 = any free port).
    pub port: u16,
    /// Turn type of requests that do not say (docs/method.md §1: the reference's `side` trains nothing).
    pub default_turn_type: String,
    /// Spool folder for events while Kafka is unavailable.
    pub spool_dir: PathBuf,
    /// Spool bound, bytes.
    pub spool_max_bytes: u64,
    /// Environment variable holding the bearer key clients must send (none: open).
    pub api_key_env: Option<String>,
    /// Require that key on `/health` too (default false: `/health` stays open, for load balancers).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub health_requires_key: bool,
    /// Listen on https with this certificate chain and key (`[proxy.tls] cert_file`, `key_file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::net::ServerTls>,
    /// Seconds a client may take to send a request's headers; also the longest a connection may stay
    /// silent or idle; the connection is then closed (default 10).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout_s: Option<u64>,
    /// Seconds a client may take to send a request's body after its headers; then 408 and the
    /// connection is closed (default 30).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_timeout_s: Option<u64>,
    /// Most connections open at once; further ones wait in the listen backlog until one closes
    /// (default 512).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Headers naming a request's tenant, first present wins (case-insensitive; default
    /// `["X-Agent-Id", "X-User-Id"]`). A request naming none belongs to the `default` tenant; an
    /// invalid id is refused with 400 `invalid_tenant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_headers: Option<Vec<String>>,
    /// Whether a turn's non-default tenant goes upstream as the `X-Agent-Id` header (default true: a
    /// `nextstate serve` upstream then answers with the tenant's adapter). Set false when the upstream
    /// is a third-party API that should not see your tenant ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_tenant: Option<bool>,
}

impl ProxyConfig {
    /// The listener limits of `header_timeout_s`, `body_timeout_s` and `max_connections`.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero value.
    pub fn limits(&self) -> Result<crate::net::ListenLimits> {
        crate::net::ListenLimits::from_settings("proxy", self.header_timeout_s, self.body_timeout_s, self.max_connections)
    }

    /// `tenant_headers` as lower-case header names, or the default list when unset.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty list or a name that is not a valid HTTP header name.
    pub fn tenant_header_names(&self) -> Result<Vec<String>> {
        crate::serve::proxy::request::tenant_header_names(self.tenant_headers.as_deref()).map_err(|e| crate::config_err!("proxy.tenant_headers: {e}"))
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            host: "127.0.0.1".into(),
            port: 30000,
            default_turn_type: "main".into(),
            spool_dir: PathBuf::from(".cache/proxy-spool"),
            spool_max_bytes: 256 << 20,
            api_key_env: None,
            health_requires_key: false,
            tls: None,
            header_timeout_s: None,
            body_timeout_s: None,
            max_connections: None,
            tenant_headers: None,
            forward_tenant: None,
        }
    }
}

/// A pipeline file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Pipeline name (stored with every judgment, hint and sample it produces).
    pub name: String,
    /// Training method.
    pub method: Method,
    /// Lake folder.
    #[serde(default = "default_lake")]
    pub lake: PathBuf,
    /// Kafka settings.
    #[serde(default)]
    pub bus: BusConfig,
    /// TLS trust of every HTTP client the pipeline makes (judge, hint, teacher, proxy upstream,
    /// reloads): `[tls] ca_file` adds a private CA to the platform's roots and pins a server certificate
    /// listed in it (see [`crate::net`]).
    #[serde(default, skip_serializing_if = "crate::net::TlsConfig::is_empty")]
    pub tls: crate::net::TlsConfig,
    /// Lake sink settings.
    #[serde(default)]
    pub sink: SinkConfig,
    /// Policy model.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Signal extraction.
    #[serde(default)]
    pub signals: crate::signals::SignalConfig,
    /// PRM judge (docs/method.md §2).
    #[serde(default)]
    pub judge: crate::judge::JudgeConfig,
    /// Hint extraction (docs/method.md §3).
    #[serde(default)]
    pub hint: crate::hint::HintConfig,
    /// Teacher log-probs (docs/method.md §4).
    #[serde(default)]
    pub teacher: TeacherConfig,
    /// Sample assembly (docs/method.md §5).
    #[serde(default)]
    pub samples: crate::samples::SampleConfig,
    /// Policy server.
    #[serde(default)]
    pub serve: ServeConfig,
    /// Capture proxy.
    #[serde(default)]
    pub proxy: ProxyConfig,
    /// Trainer (docs/method.md §6).
    #[serde(default)]
    pub trainer: crate::trainer::TrainerConfig,
    /// Max records a stage handles per batch.
    #[serde(default = "default_stage_batch")]
    pub stage_batch: usize,
}

/// The built-in pipeline file.
const EMBEDDED: &str = "name = \"combined\"\nmethod = \"combined\"\n";

/// Prefix of the environment variables that override pipeline keys: `NEXTSTATE_`, then the key path
/// with its parts joined by `__` (at least one `__`, so top-level names such as `NEXTSTATE_LAKE` stay
/// the flags' own variables). Names are case-insensitive; values are read as TOML-like values
/// (`1.0e-4`: a float needs its decimal point, `1e-4` is text; `true`, `[1, 2]`, text).
pub const ENV_PREFIX: &str = "NEXTSTATE_";

/// The `NEXTSTATE_<TABLE>__<KEY>` variables of this process, as figment's environment provider.
fn env_overrides() -> figment::providers::Env {
    // Say which keys the environment set: a variable left over from another shell changes a run silently otherwise.
    for (name, _) in std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v))) {
        if let Some(key) = name.strip_prefix(ENV_PREFIX).filter(|k| k.contains("__")) {
            tracing::info!(variable = %name, key = %key.to_ascii_lowercase().replace("__", "."), "pipeline key set by the environment");
        }
    }
    env_overrides_with(ENV_PREFIX)
}

fn env_overrides_with(prefix: &str) -> figment::providers::Env {
    figment::providers::Env::prefixed(prefix).filter(|k| k.as_str().contains("__")).split("__")
}

/// `table` (a pipeline file, already parsed, `origin` naming it in errors) with `env` layered on top,
/// as a [`PipelineConfig`].
///
/// # Errors
/// [`Error::Config`] with figment's message (key, expected type, and which layer gave the value).
fn layered(table: toml::Table, origin: &str, env: figment::providers::Env) -> Result<PipelineConfig> {
    use figment::providers::Serialized;
    figment::Figment::from(Serialized::defaults(table))
        .merge(env)
        .extract()
        .map_err(|e| Error::Config(format!("{origin}: {}", e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))))
}

fn default_stage_batch() -> usize {
    64
}

fn default_lake() -> PathBuf {
    PathBuf::from("lake")
}

impl PipelineConfig {
    /// Reads and validates a pipeline file.
    ///
    /// # Errors
    /// [`Error::Io`] when unreadable, [`Error::Config`] naming the bad key or value.
    ///
    /// Relative paths in the file resolve against the file's folder ([`resolve_file_paths`]), so the
    /// file works from any working directory.
    pub fn load(path: &Path) -> Result<PipelineConfig> {
        let cwd = std::env::current_dir().map_err(|e| Error::io("read the working directory", Path::new("."), e))?;
        Self::load_from(path, &cwd)
    }

    /// [`PipelineConfig::load`] with the working directory given (the fallback of relative paths).
    ///
    /// # Errors
    /// As [`PipelineConfig::load`], and [`Error::Config`] naming a path key whose path is not found.
    pub fn load_from(path: &Path, cwd: &Path) -> Result<PipelineConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read pipeline", path, e))?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        for warning in resolve_file_paths(&mut table, path, cwd)? {
            tracing::warn!("{warning}");
        }
        let cfg = layered(table, &path.display().to_string(), env_overrides())?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The built-in default pipeline ([`PipelineConfig::embedded_default`]) with the environment's
    /// `NEXTSTATE_<TABLE>__<KEY>` variables layered on top (what a command without `--pipeline` runs).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable's key when a variable names an unknown key or holds a
    /// value of the wrong type, or when the result fails [`PipelineConfig::validate`].
    pub fn embedded_layered() -> Result<PipelineConfig> {
        let table: toml::Table = toml::from_str(EMBEDDED).expect("built-in pipeline parses");
        let cfg = layered(table, "built-in pipeline", env_overrides())?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The built-in default pipeline (combined method, embedded everything).
    pub fn embedded_default() -> PipelineConfig {
        toml::from_str(EMBEDDED).expect("built-in pipeline parses")
    }

    /// Checks cross-field constraints.
    ///
    /// # Errors
    /// [`Error::Config`] describing the violation.
    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(Error::Config("pipeline name must not be empty".into()));
        }
        if self.bus.session_timeout_ms < 6000 {
            return Err(Error::Config(format!("bus.session_timeout_ms = {} is below Kafka's minimum of 6000", self.bus.session_timeout_ms)));
        }
        self.judge.validate()?;
        self.hint.validate()?;
        self.trainer.validate()?;
        self.teacher.validate()?;
        if self.method.uses_hints() && self.teacher.temperature != self.trainer.temperature {
            return Err(Error::Config(format!(
                "teacher.temperature = {} and trainer.temperature = {} differ: the OPD term teacher − student must compare log-probs of one distribution family (docs/method.md §6); set both to the rollout temperature",
                self.teacher.temperature, self.trainer.temperature
            )));
        }
        crate::serve::reload::validate(&self.serve)?;
        // A LoRA reload needs adapter checkpoints, a disk reload full weights: the other way round every
        // reload would fail at run time.
        let kind = crate::serve::reload::ReloadKind::parse(&self.serve.reload)?;
        let disk = matches!(kind, crate::serve::reload::ReloadKind::VllmDisk | crate::serve::reload::ReloadKind::SglangDisk);
        if kind.is_lora() && !self.trainer.lora.enabled {
            return Err(Error::Config(format!(
                "serve.reload = {:?} loads LoRA adapters, but the trainer writes full weights (set [trainer.lora] enabled = true, or a disk reload kind)",
                self.serve.reload
            )));
        }
        if disk && self.trainer.lora.enabled {
            return Err(Error::Config(format!(
                "serve.reload = {:?} loads full weights, but the trainer writes LoRA adapters (use vllm-lora / sglang-lora, or train full weights)",
                self.serve.reload
            )));
        }
        if self.bus.partitions < 1 {
            return Err(Error::Config("bus.partitions must be at least 1".into()));
        }
        self.proxy.limits()?;
        self.serve.limits()?;
        Ok(())
    }

    /// A stable hash of the whole configuration (for checkpoint manifests and sample ids).
    pub fn hash(&self) -> String {
        let json = serde_json::to_string(self).unwrap_or_default();
        crate::schema::content_hash(&[json.as_bytes()])
    }
}

/// How a path key of a pipeline file is used: read at start (it must exist) or written (created).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathUse {
    /// Read: a model folder, a certificate. Not found anywhere = a configuration error.
    Input,
    /// Written: created when missing (the lake, the proxy's spool).
    Output,
}

/// The path keys of a pipeline file (dotted), every `PathBuf` of [`PipelineConfig`] and its tables.
/// `teacher.model` is a path for the local backend only (a remote backend's is a served model id).
pub const PATH_KEYS: &[(&str, PathUse)] = &[
    ("lake", PathUse::Output),
    ("policy.model", PathUse::Input),
    ("teacher.model", PathUse::Input),
    ("tls.ca_file", PathUse::Input),
    ("proxy.spool_dir", PathUse::Output),
    ("proxy.tls.cert_file", PathUse::Input),
    ("proxy.tls.key_file", PathUse::Input),
    ("serve.tls.cert_file", PathUse::Input),
    ("serve.tls.key_file", PathUse::Input),
];

/// A resolved path and, when it was found only against the working directory, the warning to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedPath {
    /// The path to use (relative paths stay relative to the process's working directory).
    pub path: PathBuf,
    /// Set when the path resolved against `cwd`, not the file's folder (the older form).
    pub warning: Option<String>,
}

/// Resolves the value of path key `key` written in a configuration file in folder `file_dir`, the
/// working directory being `cwd`. An absolute path is kept. A relative one is taken against
/// `file_dir` when that exists; else against `cwd` when that exists (the older form, with a warning
/// that the file-relative form is preferred); else, for an [`PathUse::Output`], against `file_dir`
/// (created later), and for an [`PathUse::Input`] it is an error naming the key, the path and both
/// places tried. Pure but for the existence checks: the process's working directory is not read.
///
/// # Errors
/// [`Error::Config`] for an input path that does not exist.
pub fn resolve_path(key: &str, value: &Path, file_dir: &Path, cwd: &Path, usage: PathUse) -> Result<ResolvedPath> {
    if value.is_absolute() {
        if usage == PathUse::Input && !value.exists() {
            return Err(Error::Config(format!("{key} = {:?}: no such file or folder", value.display().to_string())));
        }
        return Ok(ResolvedPath { path: value.to_path_buf(), warning: None });
    }
    let by_file = lexical_join(file_dir, value);
    if by_file.exists() {
        return Ok(ResolvedPath { path: by_file, warning: None });
    }
    let by_cwd = lexical_join(cwd, value);
    if by_cwd.exists() {
        let warning = format!(
            "{key} = {:?} is found relative to the working directory ({}), not to the pipeline file's folder ({}): write it relative to the file's folder (or absolute) so the file works from any directory",
            value.display().to_string(),
            by_cwd.display(),
            file_dir.display()
        );
        return Ok(ResolvedPath { path: by_cwd, warning: Some(warning) });
    }
    match usage {
        PathUse::Output => Ok(ResolvedPath { path: by_file, warning: None }),
        PathUse::Input => Err(Error::Config(format!(
            "{key} = {:?}: not found relative to the pipeline file's folder ({}) nor to the working directory ({})",
            value.display().to_string(),
            by_file.display(),
            by_cwd.display()
        ))),
    }
}

/// The value at dotted `key` of `t`, if every table on the way is there.
fn dotted_mut<'a>(t: &'a mut toml::Table, key: &str) -> Option<&'a mut toml::Value> {
    match key.split_once('.') {
        None => t.get_mut(key),
        Some((head, rest)) => match t.get_mut(head)? {
            toml::Value::Table(inner) => dotted_mut(inner, rest),
            _ => None,
        },
    }
}

/// `base` joined with `rel`, `.` dropped and `dir/..` collapsed when `dir` is not a symbolic link (so
/// `pipelines/../models/m` reads `models/m`, as before files said `../models/m`).
fn lexical_join(base: &Path, rel: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                let collapsible = matches!(out.components().next_back(), Some(Component::Normal(_)))
                    && !std::fs::symlink_metadata(&out).is_ok_and(|m| m.file_type().is_symlink());
                let at_root = matches!(out.components().next_back(), Some(Component::RootDir | Component::Prefix(_)));
                if collapsible {
                    out.pop();
                } else if !at_root {
                    out.push("..");
                }
            }
            other => out.push(other.as_os_str()),
        }
    }
    if out.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        out
    }
}

/// Resolves, in place, every path key ([`PATH_KEYS`]) set in the table of the configuration file
/// `file` ([`resolve_path`] against the file's folder, then `cwd`); keys the file does not set keep
/// their defaults (relative to the working directory, as before). A lake URL is left alone. Returns the
/// warnings to log.
///
/// # Errors
/// [`Error::Config`] naming the key (and the file) of an input path that is not found, or of a path
/// key that is not a string.
pub fn resolve_file_paths(table: &mut toml::Table, file: &Path, cwd: &Path) -> Result<Vec<String>> {
    let file_dir = file.parent().unwrap_or(Path::new(""));
    let local_teacher = match table.get("teacher").and_then(|t| t.get("backend")) {
        None => true,
        Some(b) => b.as_str() == Some("local"),
    };
    let mut warnings = vec![];
    for &(key, usage) in PATH_KEYS {
        if key == "teacher.model" && !local_teacher {
            continue;
        }
        let Some(v) = dotted_mut(table, key) else { continue };
        let Some(s) = v.as_str() else {
            return Err(Error::Config(format!("{}: {key} must be a path (a string), got {v}", file.display())));
        };
        if key == "lake" && crate::lake::remote::is_url(s) {
            continue;
        }
        let r = resolve_path(key, Path::new(s), file_dir, cwd, usage).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", file.display())),
            other => other,
        })?;
        warnings.extend(r.warning.map(|w| format!("{}: {w}", file.display())));
        *v = toml::Value::String(r.path.display().to_string());
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::PipelineConfig;

    /// `NEXTSTATE_<TABLE>__<KEY>` variables override nested keys of the file; names without `__` are
    /// not keys (they are the flags' own variables); a typo or a wrong type is an error naming the key.
    /// A prefix of its own per case keeps other tests' pipelines free of these variables.
    #[test]
    fn environment_variables_override_pipeline_keys() {
        let file = || -> toml::Table { toml::from_str("name = \"t\"\nmethod = \"combined\"\n[trainer]\nlr = 0.001\n").unwrap() };
        for (k, v) in [("NS41A_TRAINER__LR", "1.0e-4"), ("NS41A_trainer__lora__rank", "4"), ("NS41A_JUDGE__M", "5"), ("NS41A_LAKE", "elsewhere"), ("NS41A_PROXY__TENANT_HEADERS", "[\"X-Team\"]")] {
            std::env::set_var(k, v);
        }
        let cfg = super::layered(file(), "p.toml", super::env_overrides_with("NS41A_")).unwrap();
        assert_eq!(cfg.trainer.lr, 1e-4, "the variable wins over the file's 0.001");
        assert_eq!(cfg.trainer.lora.rank, 4, "nested, case-insensitive");
        assert_eq!(cfg.judge.m, 5);
        assert_eq!(cfg.lake, std::path::PathBuf::from("lake"), "no __: not a key");
        assert_eq!(cfg.proxy.tenant_headers, Some(vec!["X-Team".to_string()]));
        assert_eq!(super::layered(file(), "p.toml", super::env_overrides_with("NS41-NONE_")).unwrap().trainer.lr, 0.001);

        std::env::set_var("NS41B_TRAINER__LRR", "1");
        let e = super::layered(file(), "p.toml", super::env_overrides_with("NS41B_")).unwrap_err().to_string();
        assert!(e.starts_with("config: p.toml: unknown field: found `lrr`"), "{e}");
        std::env::set_var("NS41C_JUDGE__M", "many");
        let e = super::layered(file(), "p.toml", super::env_overrides_with("NS41C_")).unwrap_err().to_string();
        assert_eq!(e, "config: p.toml: invalid type: found string \"many\", expected u32 for key \"JUDGE.M\" in `NS41C_` environment variable(s)");
    }

    fn parse(extra: &str) -> PipelineConfig {
        toml::from_str(&format!("name = \"t\"\nmethod = \"combined\"\n{extra}")).unwrap()
    }

    /// The OPD term compares the teacher's and the student's log-probs: both must be scored at one
    /// temperature (docs/method.md §6), and only the local teacher scores at another than 1.
    #[test]
    fn teacher_and_trainer_temperatures_must_agree() {
        let e = parse("[trainer]\ntemperature = 0.6\nrecompute_old_logprobs = true\n").validate().unwrap_err().to_string();
        assert!(e.contains("teacher.temperature = 1 and trainer.temperature = 0.6 differ"), "{e}");
        parse("[trainer]\ntemperature = 0.6\nrecompute_old_logprobs = true\n[teacher]\ntemperature = 0.6\n").validate().unwrap();
        // Binary has no teacher term: the teacher stage's temperature does not matter.
        let mut b = parse("[trainer]\ntemperature = 0.6\nrecompute_old_logprobs = true\n");
        b.method = crate::method::Method::Binary;
        b.validate().unwrap();
        let e = parse("[teacher]\ntemperature = 0.6\nbackend = \"vllm\"\nurl = \"http://127.0.0.1:1\"\nmodel = \"m\"\n[trainer]\ntemperature = 0.6\nrecompute_old_logprobs = true\n")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs teacher.backend = \"local\""), "{e}");
        // At temperature 1 neither key appears in the serialised form (hashes of older pipelines hold).
        let d = parse("");
        assert!(!serde_json::to_string(&d.teacher).unwrap().contains("temperature") && !serde_json::to_string(&d.trainer).unwrap().contains("temperature"));
    }

    /// `[proxy]` and `[serve]` listener limits and `health_requires_key`: parsed, a zero refused, and
    /// left out of the serialised form when unset (hashes of older pipelines hold).
    #[test]
    fn listener_limits_and_health_key() {
        let c = parse("[proxy]\nheader_timeout_s = 3\nmax_connections = 7\nhealth_requires_key = true\n[serve]\nbody_timeout_s = 5\n");
        c.validate().unwrap();
        let p = c.proxy.limits().unwrap();
        assert_eq!((p.header_read_timeout.as_secs(), p.body_read_timeout.as_secs(), p.max_connections, c.proxy.health_requires_key), (3, 30, 7, true));
        assert_eq!(c.serve.limits().unwrap().body_read_timeout.as_secs(), 5);
        let e = parse("[serve]\nmax_connections = 0\n").validate().unwrap_err().to_string();
        assert!(e.contains("serve.max_connections must be at least 1"), "{e}");
        let d = serde_json::to_string(&parse("")).unwrap();
        for key in ["header_timeout_s", "body_timeout_s", "max_connections", "health_requires_key"] {
            assert!(!d.contains(key), "{key} serialised by default");
        }
    }
}

/// Relative paths of a pipeline file resolve against its folder, then (older files) the working
/// directory; the working directory is passed in, never changed (tests run in parallel).
#[cfg(test)]
mod path_tests {
    use std::path::{Path, PathBuf};

    use super::{resolve_path, PathUse, PipelineConfig};

    /// `a/p.toml` naming `[policy] model = "models/m"`, with `a/models/m` present; `b` another folder.
    fn layout() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        std::fs::create_dir_all(a.join("models/m")).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        (root, a, b)
    }

    #[test]
    fn a_relative_model_is_found_from_the_pipeline_files_folder_whatever_the_working_directory() {
        let (_root, a, b) = layout();
        std::fs::write(a.join("p.toml"), "name = \"t\"\nmethod = \"combined\"\nlake = \"lake\"\n[policy]\nmodel = \"models/m\"\n[proxy]\nspool_dir = \"spool\"\n").unwrap();
        let cfg = PipelineConfig::load_from(&a.join("p.toml"), &b).unwrap();
        assert_eq!(cfg.policy.model, a.join("models/m"));
        // Outputs found nowhere are created beside the file, not in the working directory.
        assert_eq!(cfg.lake, a.join("lake"));
        assert_eq!(cfg.proxy.spool_dir, a.join("spool"));
        // Keys the file does not set keep their defaults.
        assert_eq!(cfg.teacher.model, None);
        // `..` climbs out of the file's folder (the shipped pipelines say `../models/...`).
        std::fs::create_dir_all(a.join("pipelines")).unwrap();
        std::fs::write(a.join("pipelines/p.toml"), "name = \"t\"\nmethod = \"combined\"\n[policy]\nmodel = \"../models/m\"\n").unwrap();
        assert_eq!(PipelineConfig::load_from(&a.join("pipelines/p.toml"), &b).unwrap().policy.model, a.join("models/m"));
    }

    #[test]
    fn a_path_found_only_in_the_working_directory_still_works_with_a_warning() {
        let (_root, a, b) = layout();
        std::fs::create_dir_all(b.join("models/only-here")).unwrap();
        let r = resolve_path("policy.model", Path::new("models/only-here"), &a, &b, PathUse::Input).unwrap();
        assert_eq!(r.path, b.join("models/only-here"));
        let w = r.warning.expect("a warning");
        assert!(w.contains("policy.model") && w.contains("relative to the file's folder"), "{w}");
        // Found beside the file: no warning, the file's copy wins.
        std::fs::create_dir_all(b.join("models/m")).unwrap();
        let r = resolve_path("policy.model", Path::new("models/m"), &a, &b, PathUse::Input).unwrap();
        assert_eq!((r.path, r.warning), (a.join("models/m"), None));
        // An existing output folder in the working directory (an older lake) is kept.
        std::fs::create_dir_all(b.join("lake")).unwrap();
        assert_eq!(resolve_path("lake", Path::new("lake"), &a, &b, PathUse::Output).unwrap().path, b.join("lake"));
    }

    #[test]
    fn an_input_path_found_nowhere_is_a_config_error_naming_the_key_and_both_places() {
        let (_root, a, b) = layout();
        let e = resolve_path("policy.model", Path::new("models/absent"), &a, &b, PathUse::Input).unwrap_err();
        assert!(matches!(e, crate::Error::Config(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("policy.model = \"models/absent\""), "{e}");
        assert!(e.contains(&a.join("models/absent").display().to_string()) && e.contains(&b.join("models/absent").display().to_string()), "{e}");
        let abs = a.join("nope.pem");
        let e = resolve_path("tls.ca_file", &abs, &a, &b, PathUse::Input).unwrap_err().to_string();
        assert!(e.contains("tls.ca_file") && e.contains(&abs.display().to_string()), "{e}");
        // Through a file: the file is named too, and every input key is checked.
        std::fs::write(a.join("p.toml"), "name = \"t\"\nmethod = \"combined\"\n[tls]\nca_file = \"ca.pem\"\n").unwrap();
        let e = PipelineConfig::load_from(&a.join("p.toml"), &b).unwrap_err().to_string();
        assert!(e.contains("p.toml") && e.contains("tls.ca_file = \"ca.pem\""), "{e}");
        std::fs::write(a.join("p.toml"), "name = \"t\"\nmethod = \"opd\"\n[teacher]\nmodel = \"teachers/t\"\n").unwrap();
        let e = PipelineConfig::load_from(&a.join("p.toml"), &b).unwrap_err().to_string();
        assert!(e.contains("teacher.model = \"teachers/t\""), "{e}");
    }

    #[test]
    fn remote_model_ids_and_lake_urls_are_not_paths() {
        let (_root, a, b) = layout();
        std::fs::write(
            a.join("p.toml"),
            "name = \"t\"\nmethod = \"opd\"\nlake = \"s3://bucket/lake\"\n[teacher]\nbackend = \"vllm\"\nurl = \"http://127.0.0.1:1\"\nmodel = \"Qwen/Qwen3-4B\"\n",
        )
        .unwrap();
        let cfg = PipelineConfig::load_from(&a.join("p.toml"), &b).unwrap();
        assert_eq!(cfg.teacher.model, Some(PathBuf::from("Qwen/Qwen3-4B")));
        assert_eq!(cfg.lake, PathBuf::from("s3://bucket/lake"));
    }

    /// The shipped pipelines load from any working directory, their paths landing in the repository.
    #[test]
    fn shipped_pipelines_name_their_paths_relative_to_their_folder() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let elsewhere = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(root.join("pipelines")).unwrap().flatten() {
            let mut t: toml::Table = toml::from_str(&std::fs::read_to_string(entry.path()).unwrap()).unwrap();
            if let Some(toml::Value::Table(policy)) = t.get_mut("policy") {
                // The model is fetched by scripts/setup.sh: check where it points, not that it is there.
                let model = policy.remove("model");
                assert_eq!(model.as_ref().and_then(|m| m.as_str()), Some("../models/smollm2-135m-instruct"), "{}", entry.path().display());
            }
            let warnings = super::resolve_file_paths(&mut t, &entry.path(), elsewhere.path()).unwrap();
            assert!(warnings.is_empty(), "{warnings:?}");
            for key in ["lake", "proxy.spool_dir"] {
                let (table, leaf) = key.split_once('.').map_or((None, key), |(a, b)| (Some(a), b));
                let v = match table {
                    Some(tb) => t.get(tb).and_then(|x| x.get(leaf)),
                    None => t.get(leaf),
                };
                if let Some(v) = v.and_then(|v| v.as_str()) {
                    assert!(Path::new(v).starts_with(root) && !Path::new(v).starts_with(root.join("pipelines")), "{key} = {v} ({})", entry.path().display());
                }
            }
        }
    }
}
