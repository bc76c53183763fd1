//! Pipeline configuration: `pipelines/<name>.toml`.
//!
//! Layers (Arroyo's pattern): built-in defaults → the pipeline file → environment variables
//! (`NEXTSTATE_BROKERS`, `NEXTSTATE_LAKE`, ...; see the flags of each command) → command-line flags.
//! Every table is `deny_unknown_fields`, so a typo is an error naming the key.

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
    /// Turn type of requests that do not say (METHOD.md §1: the reference's `side` trains nothing).
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
}

impl ProxyConfig {
    /// The listener limits of `header_timeout_s`, `body_timeout_s` and `max_connections`.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero value.
    pub fn limits(&self) -> Result<crate::net::ListenLimits> {
        crate::net::ListenLimits::from_settings("proxy", self.header_timeout_s, self.body_timeout_s, self.max_connections)
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
    /// PRM judge (METHOD.md §2).
    #[serde(default)]
    pub judge: crate::judge::JudgeConfig,
    /// Hint extraction (METHOD.md §3).
    #[serde(default)]
    pub hint: crate::hint::HintConfig,
    /// Teacher log-probs (METHOD.md §4).
    #[serde(default)]
    pub teacher: TeacherConfig,
    /// Sample assembly (METHOD.md §5).
    #[serde(default)]
    pub samples: crate::samples::SampleConfig,
    /// Policy server.
    #[serde(default)]
    pub serve: ServeConfig,
    /// Capture proxy.
    #[serde(default)]
    pub proxy: ProxyConfig,
    /// Trainer (METHOD.md §6).
    #[serde(default)]
    pub trainer: crate::trainer::TrainerConfig,
    /// Max records a stage handles per batch.
    #[serde(default = "default_stage_batch")]
    pub stage_batch: usize,
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
    pub fn load(path: &Path) -> Result<PipelineConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read pipeline", path, e))?;
        let cfg: PipelineConfig = toml::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The built-in default pipeline (combined method, embedded everything).
    pub fn embedded_default() -> PipelineConfig {
        toml::from_str("name = \"combined\"\nmethod = \"combined\"\n").expect("built-in pipeline parses")
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
                "teacher.temperature = {} and trainer.temperature = {} differ: the OPD term teacher − student must compare log-probs of one distribution family (METHOD.md §6); set both to the rollout temperature",
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

#[cfg(test)]
mod tests {
    use super::PipelineConfig;

    fn parse(extra: &str) -> PipelineConfig {
        toml::from_str(&format!("name = \"t\"\nmethod = \"combined\"\n{extra}")).unwrap()
    }

    /// The OPD term compares the teacher's and the student's log-probs: both must be scored at one
    /// temperature (METHOD.md §6), and only the local teacher scores at another than 1.
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
