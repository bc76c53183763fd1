//! Training per tenant (`[trainer.tenants]`): which adapter a sample trains, and the per-adapter
//! batches the trainer wiring (`stages::train`) steps on.
//!
//! Two modes ([`TrainingMode`]):
//! - `shared` (the default): one policy for every tenant; every sample trains it.
//! - `per_tenant`: one LoRA adapter per tenant on one frozen base (the base weights are shared by every
//!   adapter of the process, `model::weights::read_checkpoint_shared`). A sample trains the adapter of
//!   its `tenant` column (null: [`crate::schema::DEFAULT_TENANT`]); a batch never mixes tenants; each adapter has its
//!   own optimizer state, versions and checkpoints (`checkpoints/<run>/<tenant>/<version>`).
//!
//! [`Batcher`] is the pure part: it buffers samples per adapter in arrival order, hands out a batch
//! as soon as one adapter has `batch_size` samples (the adapter whose oldest waiting sample arrived
//! first goes first), and at the end of the input hands out what is left of every adapter with at
//! least `min_batch` samples. An adapter with fewer waits: its samples are not trained on their own
//! (one sample is a noisy step) and, read from Kafka, their offsets stay uncommitted, so the next run
//! reads them again. At most `max_tenants` adapters are admitted; a sample of one more tenant is
//! refused ([`OverCap`]) and the wiring dead-letters it (`tenant_cap`).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::config_err;
use crate::schema::tenant_or_default;
use crate::Result;

/// How samples map to trained weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainingMode {
    /// One policy trained on every tenant's samples (checkpoints `<run>/<version>`).
    #[default]
    Shared,
    /// One LoRA adapter per tenant (checkpoints `<run>/<tenant>/<version>`); needs `[trainer.lora]`.
    PerTenant,
}

impl TrainingMode {
    /// The configuration's name of the mode (`shared`, `per_tenant`).
    pub fn as_str(self) -> &'static str {
        match self {
            TrainingMode::Shared => "shared",
            TrainingMode::PerTenant => "per_tenant",
        }
    }
}

/// `[trainer.tenants]`: the training mode and its per-tenant limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantSettings {
    /// `shared` (default) or `per_tenant`.
    pub mode: TrainingMode,
    /// Fewest samples an adapter trains on when the input ends (a partial batch); an adapter with fewer
    /// waits for more. Default: 1 in `shared` mode (today's behaviour: the last partial batch trains),
    /// ⌈batch_size / 2⌉ in `per_tenant` mode. Must be in 1..=batch_size.
    pub min_batch: Option<usize>,
    /// Most tenants one trainer process trains (`per_tenant`; 64). Samples of a tenant beyond the cap are
    /// dead-lettered with reason `tenant_cap`; the admitted tenants keep training.
    pub max_tenants: usize,
    /// Seconds an adapter's oldest buffered sample may wait for a full batch while the input goes on
    /// (continuous training, not only at its end): past it, an adapter holding at least `min_batch`
    /// samples trains them as a partial batch, so a tenant with little traffic still learns (its
    /// partition's commit moves on at the tenant's next checkpoint). Fewer than `min_batch` keep waiting. Default: 600 in `per_tenant`
    /// mode, none in `shared` mode (its batches fill from every tenant); 0: no maximum. Must be ≥ 0.
    pub max_wait_s: Option<f64>,
}

impl Default for TenantSettings {
    fn default() -> Self {
        TenantSettings { mode: TrainingMode::Shared, min_batch: None, max_tenants: 64, max_wait_s: None }
    }
}

impl TenantSettings {
    /// Whether these are the defaults (left out of the serialised trainer configuration, so existing
    /// configuration hashes are unchanged).
    pub fn is_default(&self) -> bool {
        *self == TenantSettings::default()
    }

    /// Whether each tenant trains its own adapter.
    pub fn per_tenant(&self) -> bool {
        self.mode == TrainingMode::PerTenant
    }

    /// The effective `min_batch` for batches of `batch_size` (see [`TenantSettings::min_batch`]).
    pub fn min_batch_for(&self, batch_size: usize) -> usize {
        let batch_size = batch_size.max(1);
        match (self.min_batch, self.mode) {
            (Some(m), _) => m.clamp(1, batch_size),
            (None, TrainingMode::Shared) => 1,
            (None, TrainingMode::PerTenant) => batch_size.div_ceil(2),
        }
    }

    /// The effective `max_wait_s` (see [`TenantSettings::max_wait_s`]); None: no maximum.
    pub fn max_wait(&self) -> Option<std::time::Duration> {
        match (self.max_wait_s, self.mode) {
            (Some(s), _) if s > 0.0 => std::time::Duration::try_from_secs_f64(s).ok(),
            (Some(_), _) | (None, TrainingMode::Shared) => None,
            (None, TrainingMode::PerTenant) => Some(std::time::Duration::from_secs(600)),
        }
    }

    /// Checks the settings against `batch_size` and whether LoRA is on.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for `min_batch` outside 1..=batch_size, `max_tenants = 0`, a negative or
    /// not finite `max_wait_s`, or
    /// `per_tenant` without `[trainer.lora] enabled = true` (a full copy of the weights per tenant is
    /// not what this mode is for).
    pub fn validate(&self, batch_size: usize, lora: bool) -> Result<()> {
        if let Some(m) = self.min_batch {
            if m == 0 || m > batch_size {
                return Err(config_err!("trainer.tenants.min_batch = {m} must be in 1..={batch_size} (trainer.batch_size)"));
            }
        }
        if let Some(w) = self.max_wait_s.filter(|w| std::time::Duration::try_from_secs_f64(*w).is_err()) {
            return Err(config_err!("trainer.tenants.max_wait_s = {w} must be a number of seconds ≥ 0 (0: no maximum)"));
        }
        if self.max_tenants == 0 {
            return Err(config_err!("trainer.tenants.max_tenants must be at least 1"));
        }
        if self.per_tenant() && !lora {
            return Err(config_err!("trainer.tenants.mode = \"per_tenant\" trains one LoRA adapter per tenant: set [trainer.lora] enabled = true"));
        }
        Ok(())
    }

    /// The adapter a sample of tenant `tenant` trains: `None` (the shared policy) in `shared` mode,
    /// else the tenant (null → [`crate::schema::DEFAULT_TENANT`]).
    pub fn adapter_of(&self, tenant: Option<&str>) -> Option<String> {
        self.per_tenant().then(|| tenant_or_default(tenant).to_string())
    }
}

/// Which weights a batch trains: `None` = the shared policy, `Some(tenant)` = that tenant's adapter.
pub type AdapterKey = Option<String>;

/// The name of an adapter key in logs and reports (`shared` or the tenant).
pub fn adapter_name(key: &AdapterKey) -> &str {
    key.as_deref().unwrap_or("shared")
}

/// A sample refused because `max_tenants` adapters are already admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverCap {
    /// The refused tenant.
    pub tenant: String,
    /// The cap.
    pub max_tenants: usize,
}

impl std::fmt::Display for OverCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tenant {} is beyond trainer.tenants.max_tenants = {} tenants of this trainer", self.tenant, self.max_tenants)
    }
}

/// Per-adapter sample buffers (see the module docs). `T` is whatever the wiring keeps per sample (the
/// sample and its Kafka position).
#[derive(Debug)]
pub struct Batcher<T> {
    batch_size: usize,
    min_batch: usize,
    max_tenants: usize,
    max_wait: Option<std::time::Duration>,
    next_seq: u64,
    pending: BTreeMap<AdapterKey, VecDeque<(u64, std::time::Instant, T)>>,
}

impl<T> Batcher<T> {
    /// A batcher of `batch_size`-sample batches (≥ 1) under `settings`.
    pub fn new(settings: &TenantSettings, batch_size: usize) -> Batcher<T> {
        Batcher {
            batch_size: batch_size.max(1),
            min_batch: settings.min_batch_for(batch_size),
            max_tenants: settings.max_tenants.max(1),
            max_wait: settings.max_wait(),
            next_seq: 0,
            pending: BTreeMap::new(),
        }
    }

    /// Registers adapter `key` (already known keys and the shared key always pass).
    ///
    /// # Errors
    /// [`OverCap`] when `key` is a new tenant and `max_tenants` tenants are already admitted.
    pub fn admit(&mut self, key: &AdapterKey) -> std::result::Result<(), OverCap> {
        if self.pending.contains_key(key) {
            return Ok(());
        }
        if let Some(t) = key {
            let tenants = self.pending.keys().filter(|k| k.is_some()).count();
            if tenants >= self.max_tenants {
                return Err(OverCap { tenant: t.clone(), max_tenants: self.max_tenants });
            }
        }
        self.pending.insert(key.clone(), VecDeque::new());
        Ok(())
    }

    /// Buffers `item` for adapter `key`.
    ///
    /// # Errors
    /// [`OverCap`] as [`Batcher::admit`] (the item is not buffered).
    pub fn push(&mut self, key: AdapterKey, item: T) -> std::result::Result<(), OverCap> {
        self.push_at(key, item, std::time::Instant::now())
    }

    /// [`Batcher::push`] of an item that arrived at `at` (its wait for [`Batcher::next_due`] starts there).
    ///
    /// # Errors
    /// [`OverCap`] as [`Batcher::admit`].
    pub fn push_at(&mut self, key: AdapterKey, item: T, at: std::time::Instant) -> std::result::Result<(), OverCap> {
        self.admit(&key)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.entry(key).or_default().push_back((seq, at, item));
        Ok(())
    }

    /// While the input goes on: the next full batch ([`Batcher::next_full`]), else the partial batch of
    /// the adapter whose oldest item has waited longest, once that is at least the settings' maximum
    /// wait (`max_wait_s`) at `now` and the adapter holds at least `min_batch` items; None otherwise (and
    /// always without a maximum wait).
    pub fn next_due(&mut self, now: std::time::Instant) -> Option<(AdapterKey, Vec<T>)> {
        if let Some(b) = self.next_full() {
            return Some(b);
        }
        let max_wait = self.max_wait?;
        let key = self
            .pending
            .iter()
            .filter(|(_, q)| !q.is_empty() && q.len() >= self.min_batch)
            .filter(|(_, q)| q.front().is_some_and(|(_, at, _)| now.saturating_duration_since(*at) >= max_wait))
            .min_by_key(|(_, q)| q.front().map(|(s, _, _)| *s))
            .map(|(k, _)| k.clone())?;
        let q = self.pending.get_mut(&key)?;
        let batch = q.drain(..).map(|(_, _, x)| x).collect();
        Some((key, batch))
    }

    /// The next full batch: `batch_size` items of the adapter whose oldest buffered item arrived first
    /// among the adapters holding at least `batch_size`; None when no adapter has a full batch.
    pub fn next_full(&mut self) -> Option<(AdapterKey, Vec<T>)> {
        let key = self
            .pending
            .iter()
            .filter(|(_, q)| q.len() >= self.batch_size)
            .min_by_key(|(_, q)| q.front().map(|(s, _, _)| *s))
            .map(|(k, _)| k.clone())?;
        let q = self.pending.get_mut(&key)?;
        let batch = q.drain(..self.batch_size).map(|(_, _, x)| x).collect();
        Some((key, batch))
    }

    /// At the end of the input: the next batch of an adapter holding at least `min_batch` items (full
    /// batches first, as [`Batcher::next_full`], then the partial ones, oldest first); None when every
    /// adapter holds fewer than `min_batch` (those wait, [`Batcher::waiting`]).
    pub fn next_at_end(&mut self) -> Option<(AdapterKey, Vec<T>)> {
        if let Some(b) = self.next_full() {
            return Some(b);
        }
        let key = self
            .pending
            .iter()
            .filter(|(_, q)| !q.is_empty() && q.len() >= self.min_batch)
            .min_by_key(|(_, q)| q.front().map(|(s, _, _)| *s))
            .map(|(k, _)| k.clone())?;
        let q = self.pending.get_mut(&key)?;
        let batch = q.drain(..).map(|(_, _, x)| x).collect();
        Some((key, batch))
    }

    /// Forgets adapter `key`: returns its buffered items (oldest first) and frees its place under
    /// `max_tenants`; a later [`Batcher::admit`] registers it again.
    pub fn release(&mut self, key: &AdapterKey) -> Vec<T> {
        self.pending.remove(key).map(|q| q.into_iter().map(|(_, _, x)| x).collect()).unwrap_or_default()
    }

    /// Items buffered per adapter (adapters with none left out).
    pub fn waiting(&self) -> BTreeMap<AdapterKey, usize> {
        self.pending.iter().filter(|(_, q)| !q.is_empty()).map(|(k, q)| (k.clone(), q.len())).collect()
    }

    /// Every buffered item, any adapter.
    pub fn buffered(&self) -> impl Iterator<Item = &T> {
        self.pending.values().flat_map(|q| q.iter().map(|(_, _, x)| x))
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.pending.values().all(VecDeque::is_empty)
    }

    /// The admitted adapters (with or without buffered items).
    pub fn adapters(&self) -> impl Iterator<Item = &AdapterKey> {
        self.pending.keys()
    }
}

/// The tenant folders of a per-tenant run folder (`checkpoints/<run>/<tenant>/`): sub-folders whose
/// name is a valid tenant id and that hold at least one sub-folder (a checkpoint or a temporary one);
/// sorted. A missing run folder has none.
///
/// # Errors
/// [`crate::Error::Io`] when the run folder exists but cannot be listed.
pub fn tenant_folders(run_dir: &std::path::Path) -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(run_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(crate::Error::io("list", run_dir, e)),
    };
    let mut out = vec![];
    for entry in entries {
        let path = entry.map_err(|e| crate::Error::io("list", run_dir, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else { continue };
        if !path.is_dir() || name.starts_with('.') || crate::schema::validate_tenant(&name).is_err() {
            continue;
        }
        // a shared run's version folder holds a manifest; a tenant folder holds version folders
        if path.join(super::checkpoint::MANIFEST_FILE).is_file() {
            continue;
        }
        out.push(name);
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_tenant(batch_size: usize, min_batch: Option<usize>, max_tenants: usize) -> Batcher<u32> {
        Batcher::new(&TenantSettings { mode: TrainingMode::PerTenant, min_batch, max_tenants, max_wait_s: None }, batch_size)
    }

    fn k(t: &str) -> AdapterKey {
        Some(t.to_string())
    }

    #[test]
    fn adapter_of_maps_samples_by_mode() {
        let shared = TenantSettings::default();
        let pt = TenantSettings { mode: TrainingMode::PerTenant, ..Default::default() };
        assert_eq!(shared.adapter_of(Some("alice")), None);
        assert_eq!(pt.adapter_of(Some("alice")), k("alice"));
        assert_eq!(pt.adapter_of(None), k("default"));
        for m in [TrainingMode::Shared, TrainingMode::PerTenant] {
            assert_eq!(serde_json::to_value(m).unwrap(), serde_json::json!(m.as_str()), "as_str is the configuration's name");
        }
    }

    #[test]
    fn min_batch_defaults_by_mode_and_is_clamped() {
        let pt = TenantSettings { mode: TrainingMode::PerTenant, ..Default::default() };
        assert_eq!(TenantSettings::default().min_batch_for(8), 1);
        assert_eq!(pt.min_batch_for(8), 4);
        assert_eq!(pt.min_batch_for(5), 3);
        assert_eq!(pt.min_batch_for(1), 1);
        assert_eq!(TenantSettings { min_batch: Some(3), ..pt.clone() }.min_batch_for(8), 3);
    }

    #[test]
    fn validate_names_the_key() {
        let pt = TenantSettings { mode: TrainingMode::PerTenant, ..Default::default() };
        assert!(pt.validate(8, true).is_ok());
        assert!(pt.validate(8, false).unwrap_err().to_string().contains("enabled = true"));
        assert!(TenantSettings { min_batch: Some(9), ..pt.clone() }.validate(8, true).unwrap_err().to_string().contains("min_batch = 9"));
        assert!(TenantSettings { min_batch: Some(0), ..pt.clone() }.validate(8, true).is_err());
        assert!(TenantSettings { max_tenants: 0, ..pt }.validate(8, true).unwrap_err().to_string().contains("max_tenants"));
        assert!(TenantSettings::default().is_default());
    }

    #[test]
    fn batches_never_mix_tenants_and_the_oldest_full_adapter_goes_first() {
        let mut b = per_tenant(2, None, 8);
        // a1 b1 b2 a2: b fills first but a's oldest item arrived first
        b.push(k("a"), 1).unwrap();
        b.push(k("b"), 2).unwrap();
        assert_eq!(b.next_full(), None);
        b.push(k("b"), 3).unwrap();
        b.push(k("a"), 4).unwrap();
        assert_eq!(b.next_full(), Some((k("a"), vec![1, 4])));
        assert_eq!(b.next_full(), Some((k("b"), vec![2, 3])));
        assert_eq!(b.next_full(), None);
        assert!(b.is_empty());
    }

    #[test]
    fn at_the_end_adapters_below_min_batch_wait() {
        // batch 4, min_batch 2: a has 5 (one full batch, then 1 waiting), b has 2 (trains), c has 1 (waits)
        let mut b = per_tenant(4, Some(2), 8);
        for (t, x) in [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("a", 5), ("b", 6), ("a", 7), ("a", 8)] {
            b.push(k(t), x).unwrap();
        }
        assert_eq!(b.next_at_end(), Some((k("a"), vec![1, 3, 5, 7])));
        assert_eq!(b.next_at_end(), Some((k("b"), vec![2, 6])));
        assert_eq!(b.next_at_end(), None);
        assert_eq!(b.waiting(), BTreeMap::from([(k("a"), 1), (k("c"), 1)]));
        assert_eq!(b.buffered().copied().collect::<Vec<_>>(), vec![8, 4]);
    }

    #[test]
    fn shared_mode_trains_the_last_partial_batch() {
        let mut b: Batcher<u32> = Batcher::new(&TenantSettings::default(), 4);
        for x in 0..5 {
            b.push(None, x).unwrap();
        }
        assert_eq!(b.next_at_end(), Some((None, vec![0, 1, 2, 3])));
        assert_eq!(b.next_at_end(), Some((None, vec![4])));
        assert_eq!(b.next_at_end(), None);
    }

    #[test]
    fn tenants_beyond_the_cap_are_refused_and_the_admitted_keep_going() {
        let mut b = per_tenant(1, None, 2);
        b.push(k("a"), 1).unwrap();
        b.push(k("b"), 2).unwrap();
        let e = b.push(k("c"), 3).unwrap_err();
        assert_eq!(e, OverCap { tenant: "c".into(), max_tenants: 2 });
        assert!(e.to_string().contains("max_tenants = 2"));
        b.push(k("a"), 4).unwrap();
        let keys: Vec<AdapterKey> = std::iter::from_fn(|| b.next_full().map(|(k, _)| k)).collect();
        assert_eq!(keys, vec![k("a"), k("b"), k("a")]);
    }

    #[test]
    fn past_the_maximum_wait_an_adapter_with_min_batch_trains_a_partial_batch() {
        use std::time::{Duration, Instant};
        let settings = TenantSettings { mode: TrainingMode::PerTenant, min_batch: Some(2), max_tenants: 8, max_wait_s: Some(60.0) };
        let mut b: Batcher<u32> = Batcher::new(&settings, 4);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // a: 2 items from t0; b: 2 items from t0+10 s; c: 1 item from t0 (below min_batch)
        b.push_at(k("a"), 1, t0).unwrap();
        b.push_at(k("c"), 2, t0).unwrap();
        b.push_at(k("a"), 3, t0 + s(5)).unwrap();
        b.push_at(k("b"), 4, t0 + s(10)).unwrap();
        b.push_at(k("b"), 5, t0 + s(20)).unwrap();
        assert_eq!(b.next_due(t0 + s(59)), None, "nobody has waited 60 s");
        assert_eq!(b.next_due(t0 + s(60)), Some((k("a"), vec![1, 3])), "a's oldest waited 60 s");
        assert_eq!(b.next_due(t0 + s(65)), None, "b's oldest waited 55 s; c is below min_batch");
        assert_eq!(b.next_due(t0 + s(70)), Some((k("b"), vec![4, 5])));
        assert_eq!(b.next_due(t0 + s(10_000)), None, "c waits for its second sample");
        // no maximum: never a partial batch while the input goes on
        let mut n: Batcher<u32> = Batcher::new(&TenantSettings { max_wait_s: Some(0.0), ..settings.clone() }, 4);
        n.push_at(k("a"), 1, t0).unwrap();
        n.push_at(k("a"), 2, t0).unwrap();
        assert_eq!(n.next_due(t0 + s(10_000)), None);
        assert_eq!(TenantSettings { mode: TrainingMode::PerTenant, ..Default::default() }.max_wait(), Some(s(600)));
        assert_eq!(TenantSettings::default().max_wait(), None);
        assert!(TenantSettings { max_wait_s: Some(-1.0), ..settings.clone() }.validate(4, true).unwrap_err().to_string().contains("max_wait_s"));
        assert!(TenantSettings { max_wait_s: Some(f64::NAN), ..settings.clone() }.validate(4, true).is_err());
        assert!(TenantSettings { max_wait_s: Some(1e20), ..settings }.validate(4, true).is_err(), "beyond a Duration: an error, not a panic");
    }

    #[test]
    fn a_released_tenant_gives_back_its_items_and_its_place_under_the_cap() {
        let mut b = per_tenant(4, None, 2);
        for (t, x) in [("a", 1), ("b", 2), ("a", 3)] {
            b.push(k(t), x).unwrap();
        }
        assert!(b.push(k("c"), 4).is_err(), "two tenants admitted: c is over the cap");
        assert_eq!(b.release(&k("a")), vec![1, 3]);
        assert_eq!(b.release(&k("a")), Vec::<u32>::new(), "released once");
        b.push(k("c"), 5).unwrap();
        assert_eq!(b.waiting(), BTreeMap::from([(k("b"), 1), (k("c"), 1)]));
        assert_eq!(b.adapters().cloned().collect::<Vec<_>>(), vec![k("b"), k("c")]);
    }

    #[test]
    fn tenant_folders_skip_versions_and_hidden_folders() {
        let d = tempfile::tempdir().unwrap();
        for f in ["alice/1", "bob/.tmp-1-x", ".lineage", "3"] {
            std::fs::create_dir_all(d.path().join(f)).unwrap();
        }
        std::fs::write(d.path().join("3").join("manifest.json"), "{}").unwrap();
        assert_eq!(tenant_folders(d.path()).unwrap(), vec!["alice".to_string(), "bob".to_string()]);
        assert!(tenant_folders(&d.path().join("missing")).unwrap().is_empty());
    }
}
