//! Trainer configuration: a pipeline's `[trainer]` table (defaults from the reference scripts,
//! docs/method.md §6). Unknown keys are an error.

use serde::{Deserialize, Serialize};

use super::loss::{LossConfig, OpdLoss};
use super::tenants::TenantSettings;
use crate::method::Method;
use crate::schema::content_hash;
use crate::{config_err, Result};

/// What happens to a sample produced by a policy version older than `max_staleness` versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Staleness {
    /// The sample is dropped (counted with reason `stale`).
    #[default]
    Drop,
    /// The sample is kept with weight `staleness_decay^(age − max_staleness)` in the aggregation.
    Weight,
}

/// Whether each sample's advantage keeps the sign its signal gave it (`trainer.advantage_sign`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdvantageSign {
    /// The method's advantage as docs/method.md §6 defines it.
    #[default]
    Signal,
    /// A control arm: every token advantage `A_t` of a sample is multiplied by one sign s ∈ {−1, +1}
    /// drawn from (`trainer.seed`, sample id) ([`TrainerConfig::advantage_sign_of`]). The samples, their
    /// order and the advantages' magnitudes stay; only the direction the next state gave is lost, so
    /// the arm shows what training does without the signal. The top-K distillation term has no
    /// advantage and is not affected.
    Random,
}

impl AdvantageSign {
    /// Lower-case name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            AdvantageSign::Signal => "signal",
            AdvantageSign::Random => "random",
        }
    }

    fn is_signal(&self) -> bool {
        *self == AdvantageSign::Signal
    }
}

/// Which weights give the teacher log-probs the trainer uses (`trainer.teacher`, docs/method.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TeacherSource {
    /// The samples' own `teacher_logprobs`, from the teacher stage (by default the policy's initial
    /// weights, as in the reference).
    #[default]
    Samples,
    /// The current policy: before each micro-batch's loss, the trainer scores each hinted sample's
    /// response under its teacher prompt (`samples.teacher_prompt_token_ids`) with the weights being
    /// trained, without gradient, and uses those log-probs as `teacher` (the PPO teacher term only;
    /// the top-K and overlap terms keep the teacher stage's lists, so they are refused with it).
    Current,
}

impl TeacherSource {
    /// Lower-case name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            TeacherSource::Samples => "samples",
            TeacherSource::Current => "current",
        }
    }

    fn is_samples(&self) -> bool {
        *self == TeacherSource::Samples
    }
}

/// Which hint candidate's teacher a position learns from (`trainer.overlap.selection`, docs/method.md §3b).
/// With S_t the student's top-K ids at position t and P_{t,k} candidate k's, the overlap is
/// `O[k,t] = |S_t ∩ P_{t,k}|`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateSelection {
    /// Candidate 0, the shortest hint.
    Shortest,
    /// Per position, `k*(t) = argmax_k O[k,t]` (ties: the lower k).
    TokenOptimal,
    /// Per sample, one `k* = argmax_k Σ_t O[k,t]` over its trained positions (ties: the lower k); the
    /// reference's default.
    #[default]
    SequenceOptimal,
}

impl CandidateSelection {
    /// Name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateSelection::Shortest => "shortest",
            CandidateSelection::TokenOptimal => "token_optimal",
            CandidateSelection::SequenceOptimal => "sequence_optimal",
        }
    }
}

/// Over which ids of a position the overlap term runs (`trainer.overlap.subset`, docs/method.md §3b).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapSubset {
    /// The student's top-K ids S_t (the reference's default).
    #[default]
    Student,
    /// The chosen candidate teacher's top-K ids P_{t,k*}.
    Teacher,
    /// Their intersection `S_t ∩ P_{t,k*}` (empty positions contribute 0).
    Overlap,
}

impl OverlapSubset {
    /// Name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            OverlapSubset::Student => "student",
            OverlapSubset::Teacher => "teacher",
            OverlapSubset::Overlap => "overlap",
        }
    }
}

/// Settings of the multi-candidate overlap term (`[trainer.overlap]`, used when `opd_loss = overlap`;
/// docs/method.md §3b).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlapSettings {
    /// Candidate selection (`sequence_optimal`).
    pub selection: CandidateSelection,
    /// The ids of each position's term (`student`).
    pub subset: OverlapSubset,
    /// Bound c on each id's `teacher − old` (1.0, the reference launcher's value; its loss file's
    /// default is 2.0).
    pub clip: f64,
}

impl Default for OverlapSettings {
    fn default() -> Self {
        OverlapSettings { selection: CandidateSelection::SequenceOptimal, subset: OverlapSubset::Student, clip: 1.0 }
    }
}

impl OverlapSettings {
    fn is_default(&self) -> bool {
        *self == OverlapSettings::default()
    }
}

/// The trainer's quarantine rules (`[trainer.quarantine]`), on by default: a sample a rule catches is
/// never trained; it is dropped with its reason (`near_empty_response`, `truncated`, `logprob_gap`),
/// counted in `trainer_skipped_samples_total{reason}` and dead-lettered by the train stage, like every
/// other [`DropReason`](super::DropReason). Samples older than the staleness bound are the fourth rule,
/// [`TrainerConfig::max_staleness`] (reason `stale`).
///
/// Why: users of the reference saw one-character replies and replies cut at the token cap enter
/// training, then the gradient norm rise from 3–8 to 2,243 and the rollout-vs-trainer log-prob gap from
/// 0.02 to 233.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuarantineSettings {
    /// A response with fewer trained tokens (loss mask 1) than this is `near_empty_response` (2: a
    /// reply of one token). 0 turns the rule off; an empty response is always dropped (`empty_response`).
    pub min_response_tokens: usize,
    /// A response the log marks as cut at the token cap ([`Sample::truncated`](crate::schema::Sample::truncated),
    /// from the turn's `finish_reason = length`) is `truncated` (true).
    pub truncated: bool,
    /// A sample whose mean |rollout − current policy| log-prob over its trained tokens is above this
    /// bound (nats per token, 2.0) is `logprob_gap`: its rollout log-probs were not made by these weights
    /// (another model or tokenizer, a broken server). The step is then retried without it, so the
    /// weights never move on it. `inf` turns the rule off. The gap is measured in the step's own
    /// forward pass, so a step without such a sample costs nothing more.
    pub max_logprob_gap: f64,
}

impl Default for QuarantineSettings {
    fn default() -> Self {
        QuarantineSettings { min_response_tokens: 2, truncated: true, max_logprob_gap: 2.0 }
    }
}

impl QuarantineSettings {
    /// Every rule off: no minimum length, truncated responses trained, no log-prob gap bound (the
    /// trainer before the quarantine existed).
    pub fn off() -> QuarantineSettings {
        QuarantineSettings { min_response_tokens: 0, truncated: false, max_logprob_gap: f64::INFINITY }
    }

    fn is_default(&self) -> bool {
        *self == QuarantineSettings::default()
    }
}

/// No spike alarm until this many earlier steps are in the window ([`AlarmSettings::window`] must be
/// at least this).
pub const ALARM_MIN_HISTORY: usize = 4;

/// Spike alarms (`[trainer.alarms]`): after each step the gradient norm (before clipping) and the
/// step's mean |rollout − current| log-prob gap are compared with the median of the previous `window`
/// steps; a value above `factor × max(median, floor)` raises an alarm: a warning log line and
/// `trainer_alarms_total{kind}` (`grad_norm`, `logprob_gap`). The floors (gradient norm 0.1, gap 0.01
/// nats) keep a run whose first steps have a near-zero gap (the weights that sampled) from alarming
/// on noise. Alarms report; they change nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlarmSettings {
    /// Steps in the running median (32, at least 4); no alarm before 4 steps are in it.
    pub window: usize,
    /// A value this many times the running median is a spike (10).
    pub factor: f64,
}

impl Default for AlarmSettings {
    fn default() -> Self {
        AlarmSettings { window: 32, factor: 10.0 }
    }
}

impl AlarmSettings {
    fn is_default(&self) -> bool {
        *self == AlarmSettings::default()
    }
}

/// LoRA settings (`[trainer.lora]`). The model runtime attaches the adapters; the trainer then trains
/// and checkpoints only the adapter tensors (docs/method.md §6: rank 16, alpha 32 on q,k,v,o,gate,up,down).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSettings {
    /// Train LoRA adapters instead of all weights (default false).
    pub enabled: bool,
    /// Adapter rank r (16).
    pub rank: usize,
    /// Scaling alpha; the adapter output is multiplied by alpha / r (32).
    pub alpha: f64,
    /// Projections that get adapters: any of `q`, `k`, `v`, `o`, `gate`, `up`, `down` (all seven).
    pub targets: Vec<String>,
}

/// The LoRA target names [`LoraSettings::targets`] accepts.
pub const LORA_TARGETS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

impl Default for LoraSettings {
    fn default() -> Self {
        LoraSettings { enabled: false, rank: 16, alpha: 32.0, targets: LORA_TARGETS.iter().map(|s| s.to_string()).collect() }
    }
}

/// The `[trainer]` table. Every field has a default; see each field for its unit and source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// Samples per optimizer step (16). The wiring collects this many samples, then calls
    /// `Trainer::train_step` once.
    pub batch_size: usize,
    /// AdamW learning rate, constant (1e-5).
    pub lr: f64,
    /// AdamW decoupled weight decay (0.1), applied to every trainable tensor.
    pub weight_decay: f64,
    /// AdamW (β1, β2) = (0.9, 0.98); TOML `betas = [0.9, 0.98]`.
    pub betas: (f64, f64),
    /// AdamW ε in the denominator (1e-8, PyTorch's default).
    pub adam_eps: f64,
    /// Maximum global L2 norm of the gradient (1.0); 0 disables clipping.
    pub grad_clip: f64,
    /// PPO lower clip ε (0.2): the ratio is clipped below at 1 − ε.
    pub eps_clip: f64,
    /// PPO upper clip ε_high (0.28): the ratio is clipped above at 1 + ε_high.
    pub eps_clip_high: f64,
    /// Weight of the reward in the combined advantage (1).
    pub w_rl: f64,
    /// Weight of the teacher term in the combined advantage (1).
    pub w_opd: f64,
    /// Weight of the k3 KL to a reference policy (0; > 0 needs a reference policy).
    pub kl_coef: f64,
    /// Weight of the entropy bonus (0; the entropy is reported either way).
    pub entropy_coef: f64,
    /// Weight of the top-K reverse-KL term when `opd_loss` is `topk` or `both` (1).
    pub topk_coef: f64,
    /// Use only the first `topk_k` of the teacher's top-K columns (0 = all the samples carry).
    pub topk_k: usize,
    /// How the teacher signal enters the loss: `ppo` (advantage `teacher − student`, student = the
    /// current policy), `topk` (top-K reverse KL only) or `both`.
    pub opd_loss: OpdLoss,
    /// LoRA settings.
    pub lora: LoraSettings,
    /// Write a checkpoint every this many optimizer steps (1).
    pub checkpoint_every: u64,
    /// Also write one after a step when this many seconds have passed since the last checkpoint (or
    /// the trainer's start); none = steps only. A slow run then always leaves a resumable checkpoint.
    /// It (and `checkpoint_every_samples`) matters when `checkpoint_every` is above 1: at 1, every step
    /// already writes one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_secs: Option<f64>,
    /// Also write one after a step when at least this many samples were trained since the last
    /// checkpoint; none = steps only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_samples: Option<u64>,
    /// Use the current policy's log-probs (computed in the same forward pass, without gradient) as
    /// `old` instead of the rollout log-probs (false). The mean |rollout − current| is reported either way.
    pub recompute_old_logprobs: bool,
    /// Samples whose policy version is more than this many versions behind the trainer's are dropped or
    /// down-weighted (see `staleness`); none = no limit.
    pub max_staleness: Option<u64>,
    /// `drop` or `weight` for samples beyond `max_staleness`.
    pub staleness: Staleness,
    /// Weight mode: a sample `a` versions old (a > max_staleness) gets weight
    /// `staleness_decay^(a − max_staleness)` (0.5).
    pub staleness_decay: f64,
    /// Seed for libtorch's generator (42).
    pub seed: u64,
    /// Token budget of one forward/backward pass (4096): a step's samples, taken shortest first, are
    /// split into micro-batches of at most this many padded tokens (samples × longest prompt +
    /// response), and gradients are accumulated over them. The loss is a mean over the step's samples
    /// of sample means, so the step equals one pass over the whole batch, with activation memory
    /// bounded by the budget.
    pub micro_batch_tokens: usize,
    /// Rows (samples × response positions) of one output-head chunk (256): the output head, the
    /// log-softmax and every per-token loss term run on at most this many positions at a time, so
    /// the largest vocabulary-sized tensor is `[256, V]` (48 MiB f32 for V = 49,152) instead of
    /// `[B, T, V]`. Changes speed and memory only, not the result.
    pub logits_chunk_tokens: usize,
    /// Per-layer activation recomputation (gradient checkpointing, true): the forward pass keeps only
    /// each decoder layer's input and the backward pass reruns one layer at a time, so activation
    /// memory is one layer's instead of all layers'. About one more forward pass of time; the same
    /// gradients.
    pub recompute_layers: bool,
    /// Samples with more prompt + response tokens are dropped (`too_long`) (4096).
    pub max_sequence_tokens: usize,
    /// `signal` (default) or `random`: the control arm's per-sample random sign on the advantage
    /// ([`AdvantageSign`]). Left out of the serialised form when `signal`, so configurations (and the
    /// hashes in checkpoint manifests) that predate it are unchanged.
    #[serde(skip_serializing_if = "AdvantageSign::is_signal")]
    pub advantage_sign: AdvantageSign,
    /// The overlap term's settings (`opd_loss = overlap`). Left out of the serialised form when all
    /// default, as `advantage_sign`.
    #[serde(skip_serializing_if = "OverlapSettings::is_default")]
    pub overlap: OverlapSettings,
    /// Teacher log-probs from the samples (`samples`, default) or from the current policy (`current`,
    /// [`TeacherSource`]). Left out of the serialised form when `samples`.
    #[serde(skip_serializing_if = "TeacherSource::is_samples")]
    pub teacher: TeacherSource,
    /// Temperature of the distribution trained and scored (1): the trainer's log-probs, the teacher
    /// stage's local scoring and the ablation's held-out gap are the log-softmax of `logits / temperature`.
    /// Set it to the temperature the rollouts are sampled at (the reference trains at its rollout
    /// temperature, 0.6): then the trained distribution is the one that sampled, the policy-gradient
    /// estimate is on-policy, and a constant offset in the advantage (the OPD term's mean is
    /// −KL(student‖teacher) ≤ 0) cancels in expectation instead of pushing the sampled (most likely)
    /// tokens down. Values other than 1 need `recompute_old_logprobs = true` (rollout log-probs are
    /// recorded at temperature 1). Left out of the serialised form when 1.
    #[serde(skip_serializing_if = "is_one")]
    pub temperature: f64,
    /// Quarantine rules ([`QuarantineSettings`]). Left out of the serialised form when default.
    #[serde(skip_serializing_if = "QuarantineSettings::is_default")]
    pub quarantine: QuarantineSettings,
    /// Spike alarms ([`AlarmSettings`]). Left out of the serialised form when default.
    #[serde(skip_serializing_if = "AlarmSettings::is_default")]
    pub alarms: AlarmSettings,
    /// Shared policy or one adapter per tenant ([`TenantSettings`], `[trainer.tenants]`). Left out of the
    /// serialised form when default.
    #[serde(skip_serializing_if = "TenantSettings::is_default")]
    pub tenants: TenantSettings,
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            batch_size: 16,
            lr: 1e-5,
            weight_decay: 0.1,
            betas: (0.9, 0.98),
            adam_eps: 1e-8,
            grad_clip: 1.0,
            eps_clip: 0.2,
            eps_clip_high: 0.28,
            w_rl: 1.0,
            w_opd: 1.0,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            topk_coef: 1.0,
            topk_k: 0,
            opd_loss: OpdLoss::Ppo,
            lora: LoraSettings::default(),
            checkpoint_every: 1,
            checkpoint_every_secs: None,
            checkpoint_every_samples: None,
            recompute_old_logprobs: false,
            max_staleness: None,
            staleness: Staleness::Drop,
            staleness_decay: 0.5,
            seed: 42,
            micro_batch_tokens: 4096,
            logits_chunk_tokens: crate::model::score::LOGIT_CHUNK_TOKENS,
            recompute_layers: true,
            max_sequence_tokens: 4096,
            advantage_sign: AdvantageSign::Signal,
            overlap: OverlapSettings::default(),
            teacher: TeacherSource::Samples,
            temperature: 1.0,
            quarantine: QuarantineSettings::default(),
            alarms: AlarmSettings::default(),
            tenants: TenantSettings::default(),
        }
    }
}

fn finite_in(name: &str, x: f64, lo: f64, hi: f64) -> Result<()> {
    if !x.is_finite() || x < lo || x > hi {
        return Err(config_err!("trainer.{name} = {x} must be in [{lo}, {hi}]"));
    }
    Ok(())
}

impl TrainerConfig {
    /// Checks every value's range.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the key and the value.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(config_err!("trainer.batch_size must be at least 1"));
        }
        self.tenants.validate(self.batch_size, self.lora.enabled)?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(config_err!("trainer.lr = {} must be a positive number", self.lr));
        }
        finite_in("weight_decay", self.weight_decay, 0.0, f64::MAX)?;
        finite_in("betas[0]", self.betas.0, 0.0, 0.999_999)?;
        finite_in("betas[1]", self.betas.1, 0.0, 0.999_999)?;
        if !(self.adam_eps.is_finite() && self.adam_eps > 0.0) {
            return Err(config_err!("trainer.adam_eps = {} must be a positive number", self.adam_eps));
        }
        finite_in("grad_clip", self.grad_clip, 0.0, f64::MAX)?;
        finite_in("eps_clip", self.eps_clip, 0.0, 0.999_999)?;
        finite_in("eps_clip_high", self.eps_clip_high, 0.0, f64::MAX)?;
        for (name, x) in [("w_rl", self.w_rl), ("w_opd", self.w_opd), ("kl_coef", self.kl_coef), ("entropy_coef", self.entropy_coef), ("topk_coef", self.topk_coef)] {
            finite_in(name, x, f64::MIN, f64::MAX)?;
        }
        if self.micro_batch_tokens == 0 || self.logits_chunk_tokens == 0 {
            return Err(config_err!("trainer.micro_batch_tokens and trainer.logits_chunk_tokens must be at least 1"));
        }
        if self.checkpoint_every == 0 {
            return Err(config_err!("trainer.checkpoint_every must be at least 1"));
        }
        if let Some(s) = self.checkpoint_every_secs {
            if !(s.is_finite() && s > 0.0) {
                return Err(config_err!("trainer.checkpoint_every_secs = {s} must be a positive number of seconds"));
            }
        }
        if self.checkpoint_every_samples == Some(0) {
            return Err(config_err!("trainer.checkpoint_every_samples must be at least 1"));
        }
        let gap = self.quarantine.max_logprob_gap;
        if gap.is_nan() || gap <= 0.0 {
            return Err(config_err!("trainer.quarantine.max_logprob_gap = {gap} must be a positive number of nats (inf turns the rule off)"));
        }
        if self.alarms.window < ALARM_MIN_HISTORY {
            return Err(config_err!("trainer.alarms.window = {} must be at least {ALARM_MIN_HISTORY} (no alarm is raised before that many steps are in it)", self.alarms.window));
        }
        if !(self.alarms.factor.is_finite() && self.alarms.factor > 1.0) {
            return Err(config_err!("trainer.alarms.factor = {} must be a number above 1", self.alarms.factor));
        }
        if !(self.staleness_decay > 0.0 && self.staleness_decay <= 1.0) {
            return Err(config_err!("trainer.staleness_decay = {} must be in (0, 1]", self.staleness_decay));
        }
        if self.lora.enabled {
            if self.lora.rank == 0 {
                return Err(config_err!("trainer.lora.rank must be at least 1"));
            }
            finite_in("lora.alpha", self.lora.alpha, f64::MIN_POSITIVE, f64::MAX)?;
            if self.lora.targets.is_empty() {
                return Err(config_err!("trainer.lora.targets must name at least one projection"));
            }
        }
        if !(self.overlap.clip.is_finite() && self.overlap.clip > 0.0) {
            return Err(config_err!("trainer.overlap.clip = {} must be a positive number", self.overlap.clip));
        }
        if self.opd_loss == OpdLoss::Overlap && self.topk_k > 0 {
            return Err(config_err!("trainer.topk_k = {} applies to the top-K loss; the overlap loss uses every column the teacher stage kept (set teacher.top_k instead)", self.topk_k));
        }
        if self.opd_loss == OpdLoss::Overlap && !self.recompute_old_logprobs {
            return Err(config_err!(
                "trainer.opd_loss = \"overlap\" needs trainer.recompute_old_logprobs = true: the overlap term's old log-probs at the student's top-K ids are the current policy's (as in the reference); rollout log-probs exist only for the sampled token"
            ));
        }
        if self.teacher == TeacherSource::Current && self.opd_loss != OpdLoss::Ppo {
            return Err(config_err!(
                "trainer.teacher = \"current\" works with trainer.opd_loss = \"ppo\" only (got \"{}\"): the current policy is scored at the sampled tokens, the top-K and overlap terms need the teacher stage's lists",
                self.opd_loss.as_str()
            ));
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(config_err!("trainer.temperature = {} must be a positive number", self.temperature));
        }
        if self.temperature != 1.0 && !self.recompute_old_logprobs {
            return Err(config_err!(
                "trainer.temperature = {} needs trainer.recompute_old_logprobs = true: the rollout log-probs are recorded at temperature 1, so the PPO ratio would compare two distributions",
                self.temperature
            ));
        }
        if let Some(bad) = self.lora.targets.iter().find(|t| !LORA_TARGETS.contains(&t.as_str())) {
            return Err(config_err!("trainer.lora.targets: unknown projection {bad:?} (expected one of {LORA_TARGETS:?})"));
        }
        Ok(())
    }

    /// The loss coefficients for `method` (docs/method.md §6).
    pub fn loss_config(&self, method: Method) -> LossConfig {
        LossConfig {
            method,
            eps_clip: self.eps_clip,
            eps_clip_high: self.eps_clip_high,
            w_rl: self.w_rl,
            w_opd: self.w_opd,
            kl_coef: self.kl_coef,
            entropy_coef: self.entropy_coef,
            topk_coef: self.topk_coef,
            opd_loss: self.opd_loss,
            overlap_clip: self.overlap.clip,
        }
    }

    /// Stable hash of this configuration and the method (32 hex characters), stored in every
    /// checkpoint manifest.
    ///
    /// # Errors
    /// [`crate::Error::Json`] if the configuration cannot be serialised (not expected).
    pub fn hash(&self, method: Method) -> Result<String> {
        let json = serde_json::to_string(self)?;
        Ok(content_hash(&[method.as_str().as_bytes(), json.as_bytes()]))
    }

    /// The factor on every token advantage of sample `sample_id`: 1 with `advantage_sign = signal`;
    /// with `random`, −1 or +1 from the first byte of `content_hash(seed, sample_id)` (even: +1), the
    /// same on every run, step and machine, and different between seeds.
    pub fn advantage_sign_of(&self, sample_id: &str) -> f32 {
        match self.advantage_sign {
            AdvantageSign::Signal => 1.0,
            AdvantageSign::Random => {
                let h = content_hash(&[b"advantage_sign", &self.seed.to_le_bytes(), sample_id.as_bytes()]);
                let first = u8::from_str_radix(&h[..2], 16).unwrap_or(0);
                if first.is_multiple_of(2) {
                    1.0
                } else {
                    -1.0
                }
            }
        }
    }

    /// The aggregation weight of a sample produced by `sample_version` when the trainer is at
    /// `current_version`: `Some(1.0)` when fresh enough (or its version is unknown), `None` to drop it,
    /// or `Some(staleness_decay^(age − max_staleness))` in weight mode.
    pub fn staleness_weight(&self, current_version: i64, sample_version: Option<i64>) -> Option<f64> {
        let (Some(max), Some(v)) = (self.max_staleness, sample_version) else {
            return Some(1.0);
        };
        let age = current_version.saturating_sub(v).max(0) as u64;
        if age <= max {
            return Some(1.0);
        }
        match self.staleness {
            Staleness::Drop => None,
            Staleness::Weight => Some(self.staleness_decay.powf((age - max) as f64)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_reference_scripts() {
        let c = TrainerConfig::default();
        assert_eq!((c.batch_size, c.lr, c.weight_decay, c.betas, c.grad_clip), (16, 1e-5, 0.1, (0.9, 0.98), 1.0));
        assert_eq!((c.eps_clip, c.eps_clip_high, c.w_rl, c.w_opd, c.kl_coef, c.entropy_coef), (0.2, 0.28, 1.0, 1.0, 0.0, 0.0));
        assert_eq!((c.lora.enabled, c.lora.rank, c.lora.alpha, c.lora.targets.len()), (false, 16, 32.0, 7));
        assert_eq!((c.checkpoint_every, c.recompute_old_logprobs, c.opd_loss), (1, false, OpdLoss::Ppo));
        c.validate().unwrap();
    }

    #[test]
    fn overlap_settings_parse_validate_and_leave_old_hashes_alone() {
        let d = TrainerConfig::default();
        assert!(!serde_json::to_string(&d).unwrap().contains("overlap"), "defaults are not serialised");
        let c: TrainerConfig = toml::from_str("opd_loss = \"overlap\"\nrecompute_old_logprobs = true\n[overlap]\nselection = \"token_optimal\"\nsubset = \"overlap\"\nclip = 2.0\n").unwrap();
        c.validate().unwrap();
        assert_eq!((c.opd_loss, c.overlap.selection, c.overlap.subset, c.overlap.clip), (OpdLoss::Overlap, CandidateSelection::TokenOptimal, OverlapSubset::Overlap, 2.0));
        assert_eq!(c.loss_config(Method::Combined).overlap_clip, 2.0);
        assert_ne!(c.hash(Method::Combined).unwrap(), TrainerConfig { opd_loss: OpdLoss::Overlap, recompute_old_logprobs: true, ..d.clone() }.hash(Method::Combined).unwrap());
        let e = TrainerConfig { opd_loss: OpdLoss::Overlap, ..d.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("needs trainer.recompute_old_logprobs = true"), "{e}");
        let e = TrainerConfig { overlap: OverlapSettings { clip: 0.0, ..Default::default() }, ..d }.validate().unwrap_err().to_string();
        assert!(e.contains("trainer.overlap.clip = 0"), "{e}");
        assert!(toml::from_str::<TrainerConfig>("[overlap]\nselection = \"best\"\n").is_err());
    }

    #[test]
    fn random_advantage_signs_are_fixed_per_seed_and_sample_and_leave_old_hashes_alone() {
        let signal = TrainerConfig::default();
        assert_eq!(signal.advantage_sign_of("s1"), 1.0);
        assert!(!serde_json::to_string(&signal).unwrap().contains("advantage_sign"), "the default is not serialised");
        let random: TrainerConfig = toml::from_str("advantage_sign = \"random\"\n").unwrap();
        assert_eq!(random.advantage_sign, AdvantageSign::Random);
        assert_ne!(random.hash(Method::Combined).unwrap(), signal.hash(Method::Combined).unwrap());
        let ids: Vec<String> = (0..200).map(|k| format!("sample-{k}")).collect();
        let signs: Vec<f32> = ids.iter().map(|i| random.advantage_sign_of(i)).collect();
        assert!(signs.iter().all(|s| *s == 1.0 || *s == -1.0));
        assert_eq!(signs, ids.iter().map(|i| random.advantage_sign_of(i)).collect::<Vec<_>>(), "deterministic");
        let plus = signs.iter().filter(|s| **s > 0.0).count();
        assert!((70..=130).contains(&plus), "{plus} of 200 positive");
        // by hand: the first byte of content_hash(["advantage_sign", 42u64 LE, "sample-0"])
        let h = content_hash(&[b"advantage_sign", &42u64.to_le_bytes(), b"sample-0"]);
        let want = if u8::from_str_radix(&h[..2], 16).unwrap().is_multiple_of(2) { 1.0 } else { -1.0 };
        assert_eq!(signs[0], want);
        let other = TrainerConfig { seed: 43, ..random.clone() };
        assert_ne!(signs, ids.iter().map(|i| other.advantage_sign_of(i)).collect::<Vec<_>>(), "another seed, other signs");
    }

    #[test]
    fn parses_a_trainer_table_and_rejects_unknown_keys() {
        let c: TrainerConfig = toml::from_str(
            "batch_size = 4\nbetas = [0.8, 0.9]\nopd_loss = \"both\"\nmax_staleness = 2\nstaleness = \"weight\"\n[lora]\nenabled = true\ntargets = [\"q\", \"v\"]\n",
        )
        .unwrap();
        assert_eq!((c.batch_size, c.betas, c.opd_loss, c.max_staleness, c.staleness), (4, (0.8, 0.9), OpdLoss::Both, Some(2), Staleness::Weight));
        assert_eq!((c.lora.enabled, c.lora.rank, c.lora.targets.clone()), (true, 16, vec!["q".to_string(), "v".to_string()]));
        let e = toml::from_str::<TrainerConfig>("learning_rate = 1.0\n").unwrap_err().to_string();
        assert!(e.contains("learning_rate"), "{e}");
        let bad = TrainerConfig { lora: LoraSettings { targets: vec!["qkv".into()], ..Default::default() }, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("qkv"));
        let bad = TrainerConfig { eps_clip: 1.5, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("eps_clip = 1.5"));
    }

    #[test]
    fn staleness_drop_and_weight() {
        let dropping = TrainerConfig { max_staleness: Some(2), ..Default::default() };
        // Trainer at version 5: versions 3..=5 are within 2; version 2 is 3 old → dropped.
        assert_eq!(dropping.staleness_weight(5, Some(3)), Some(1.0));
        assert_eq!(dropping.staleness_weight(5, Some(2)), None);
        assert_eq!(dropping.staleness_weight(5, None), Some(1.0));
        let weight = TrainerConfig { staleness: Staleness::Weight, staleness_decay: 0.5, ..dropping };
        // 3 old: 0.5^1; 5 old: 0.5^3 = 0.125.
        assert_eq!(weight.staleness_weight(5, Some(2)), Some(0.5));
        assert_eq!(weight.staleness_weight(5, Some(0)), Some(0.125));
        // No limit: always 1.
        assert_eq!(TrainerConfig::default().staleness_weight(100, Some(0)), Some(1.0));
    }

    #[test]
    fn hash_changes_with_config_and_method() {
        let c = TrainerConfig::default();
        let h = c.hash(Method::Combined).unwrap();
        assert_eq!(h.len(), 32);
        assert_eq!(h, c.hash(Method::Combined).unwrap());
        assert_ne!(h, c.hash(Method::Binary).unwrap());
        assert_ne!(h, TrainerConfig { lr: 2e-5, ..c.clone() }.hash(Method::Combined).unwrap());
        // The default temperature is left out of the serialised form (hashes of older configurations
        // stay), another one changes the hash.
        assert!(!serde_json::to_string(&c).unwrap().contains("temperature"));
        assert_ne!(h, TrainerConfig { temperature: 0.6, recompute_old_logprobs: true, ..c }.hash(Method::Combined).unwrap());
    }

    #[test]
    fn a_temperature_needs_recomputed_old_logprobs() {
        let e = TrainerConfig { temperature: 0.6, ..TrainerConfig::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("trainer.temperature = 0.6 needs trainer.recompute_old_logprobs = true"), "{e}");
        assert!(TrainerConfig { temperature: 0.6, recompute_old_logprobs: true, ..TrainerConfig::default() }.validate().is_ok());
        assert!(TrainerConfig { temperature: 0.0, recompute_old_logprobs: true, ..TrainerConfig::default() }.validate().is_err());
    }
}
