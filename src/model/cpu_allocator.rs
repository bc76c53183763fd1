//! A caching allocator for libtorch's CPU tensors, the CPU counterpart of PyTorch's CUDA caching
//! allocator (the C++ half is `src/model/cpu_allocator.cpp`, compiled by `build.rs`).
//!
//! Why: `nextstate` bounds its resident set by having glibc map every allocation of 64 KiB or more
//! fresh and unmap it when freed ([`super::return_freed_memory`]). A training step allocates the same
//! activation shapes again for every layer and every pass, so each of them is faulted in and zeroed by
//! the kernel again: on the 2 × 2,000-token LoRA step of `benches/train.rs` a third of the CPU time was
//! in the kernel's page-fault path (28 million minor faults in one warm-up and one timed step). glibc's
//! default allocator avoids the faults but lets the resident set grow to 4.3 GB on that step (1.25 GB
//! with the 64 KiB threshold). Measured figures: docs/trainer-memory.md.
//!
//! What it does: every tensor buffer of at least [`CachingAllocatorConfig::min_block_bytes`] (64 KiB)
//! is mapped as its own block: from 2 MiB up 2 MiB-aligned, rounded up to a multiple of 2 MiB, with
//! transparent huge pages asked for (`MADV_HUGEPAGE`; used where
//! `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`), below 2 MiB rounded up to
//! a multiple of 64 KiB. When its tensor is freed the block is kept and handed to the next request
//! of the same rounded size, so a step's repeated shapes reuse pages that are already resident.
//! Freed blocks beyond [`CachingAllocatorConfig::cache_limit_bytes`] are unmapped, oldest first, so
//! the resident set is at most the live tensors plus that limit (plus rounding). Smaller buffers go to
//! libtorch's default CPU allocator as before (through its raw interface, so that every buffer carries
//! this allocator's deleter, which `raw_deleter` promises to oneDNN's allocator hook). A thread of the
//! allocator unmaps every cached block once no block has been allocated or freed for
//! [`CachingAllocatorConfig::idle_trim_ms`] (1 s; [`trim_when_idle`]): back-to-back training steps
//! and decode batches reuse the blocks (in one process, the trainer's and the server's alike), while
//! an idle server holds none. [`trim`] unmaps them at once: the online trainer's thread calls it
//! whenever it has no command waiting after a step (`stages::train`), so between the pipeline's
//! steps it holds none either, while the offline loops (`train --sql`, `ablate`, the bench) run
//! their steps back to back on the cached blocks.
//!
//! Installing it changes only where new tensors' memory comes from: tensors allocated before keep
//! their own deleter (and a buffer the default allocator handed out through its raw interface before
//! the install, freed through this allocator's raw deleter, is handed back to it). It is
//! process-wide and cannot be removed once installed.

use std::sync::Mutex;

unsafe extern "C" {
    fn nextstate_cpu_cache_install(min_bytes: u64, cache_limit: u64) -> i32;
    fn nextstate_cpu_cache_trim(keep: u64) -> i32;
    fn nextstate_cpu_cache_stats(out: *mut u64) -> i32;
    fn nextstate_cpu_cache_trim_when_idle(idle_ms: u64) -> i32;
}

/// Settings of [`install`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachingAllocatorConfig {
    /// Buffers of at least this many bytes are cached; smaller ones go to libtorch's default
    /// allocator. Default 64 KiB (glibc's mmap threshold as [`super::return_freed_memory`] sets it,
    /// so no buffer is mapped fresh for each use); 0 counts as 1 (empty buffers always go to the
    /// default allocator).
    pub min_block_bytes: u64,
    /// Most bytes of freed blocks kept mapped for reuse; beyond it the oldest are unmapped. Default
    /// 512 MiB ([`DEFAULT_CACHE_LIMIT_BYTES`]).
    pub cache_limit_bytes: u64,
    /// Milliseconds without a cached-size buffer allocated or freed after which every cached block
    /// is unmapped, by a thread of the allocator ([`trim_when_idle`]); 0: only [`trim`] does. Default
    /// 1,000 ([`DEFAULT_IDLE_TRIM_MS`]): longer than one operation of a training step takes (a
    /// 256-token chunk of the 49,152-word output layer's product alone took over 200 ms on one
    /// thread), so back-to-back training steps and decode batches keep reusing the blocks, while an
    /// idle server holds none a second later.
    pub idle_trim_ms: u64,
}

/// Default [`CachingAllocatorConfig::idle_trim_ms`]: 1,000 ms.
pub const DEFAULT_IDLE_TRIM_MS: u64 = 1_000;

/// Default [`CachingAllocatorConfig::cache_limit_bytes`]: 512 MiB.
pub const DEFAULT_CACHE_LIMIT_BYTES: u64 = 512 << 20;

impl Default for CachingAllocatorConfig {
    fn default() -> CachingAllocatorConfig {
        CachingAllocatorConfig { min_block_bytes: 64 << 10, cache_limit_bytes: DEFAULT_CACHE_LIMIT_BYTES, idle_trim_ms: DEFAULT_IDLE_TRIM_MS }
    }
}

/// Counters of the caching allocator since it was installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CachingAllocatorStats {
    /// Requests served from a cached block.
    pub hits: u64,
    /// Requests that mapped a new block.
    pub misses: u64,
    /// Bytes mapped now (live tensors and cached blocks).
    pub mapped_bytes: u64,
    /// Bytes of freed blocks kept for reuse now.
    pub cached_bytes: u64,
    /// Most bytes mapped at once.
    pub peak_mapped_bytes: u64,
    /// Bytes unmapped in all (evicted beyond the limit or trimmed).
    pub unmapped_bytes: u64,
    /// Frees handed to libtorch's default allocator: the buffers under `min_block_bytes`, and buffers
    /// it allocated before the install that are freed through this allocator's raw deleter.
    pub fallback_frees: u64,
    /// Times the idle thread ([`trim_when_idle`]) unmapped the cached blocks.
    pub idle_trims: u64,
}

/// Environment variable that sets [`CachingAllocatorConfig::cache_limit_bytes`] in MiB for
/// `nextstate` and the benches ([`config_from_env`]); `0` leaves the allocator out.
pub const CACHE_ENV: &str = "NEXTSTATE_CPU_CACHE_MB";

/// Environment variable that sets [`CachingAllocatorConfig::min_block_bytes`] in KiB for `nextstate`
/// and the benches ([`config_from_env`]).
pub const MIN_BLOCK_ENV: &str = "NEXTSTATE_CPU_CACHE_MIN_KB";

/// The settings `nextstate` installs at start: [`CachingAllocatorConfig::default`], with the limit
/// from [`CACHE_ENV`] and the smallest cached buffer from [`MIN_BLOCK_ENV`] when set; `None` when
/// [`CACHE_ENV`] is `0` (libtorch's default allocator, as before).
///
/// # Errors
/// [`crate::Error::Config`] when [`CACHE_ENV`] or [`MIN_BLOCK_ENV`] is not a whole number (of MiB,
/// of KiB) that fits in 44 bits.
pub fn config_from_env() -> crate::Result<Option<CachingAllocatorConfig>> {
    let mut config = CachingAllocatorConfig::default();
    if let Some(mb) = env_number(CACHE_ENV, "MiB (0: off)")? {
        if mb == 0 {
            return Ok(None);
        }
        config.cache_limit_bytes = mb << 20;
    }
    if let Some(kb) = env_number(MIN_BLOCK_ENV, "KiB")? {
        config.min_block_bytes = kb << 10;
    }
    Ok(Some(config))
}

/// The whole number in environment variable `name`, `None` when it is not set.
fn env_number(name: &str, unit: &str) -> crate::Result<Option<u64>> {
    std::env::var_os(name).map(|v| parse_number(name, &v, unit)).transpose()
}

/// `value` as a whole number below 2^44 (so that a MiB count fits in bytes), surrounding blanks allowed.
fn parse_number(name: &str, value: &std::ffi::OsStr, unit: &str) -> crate::Result<u64> {
    value.to_str().and_then(|v| v.trim().parse().ok()).filter(|n: &u64| *n < 1 << 44).ok_or_else(|| crate::config_err!("{name} must be a whole number of {unit}, got {value:?}"))
}

static INSTALLED: Mutex<Option<CachingAllocatorConfig>> = Mutex::new(None);

fn installed_state() -> std::sync::MutexGuard<'static, Option<CachingAllocatorConfig>> {
    INSTALLED.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Installs the caching allocator as libtorch's CPU allocator for the rest of the process. Returns
/// the settings in force: `config` on the first successful call, those settings on any later one.
/// Call it at start, before loading models, so their activations (not only later tensors) use it.
///
/// # Errors
/// [`crate::Error::Internal`] when libtorch threw while the allocator was registered (nothing is
/// installed then; a later call tries again).
pub fn install(config: CachingAllocatorConfig) -> crate::Result<CachingAllocatorConfig> {
    let mut state = installed_state();
    if let Some(installed) = *state {
        return Ok(installed);
    }
    // SAFETY: plain-value arguments; the C++ side registers a leaked allocator once.
    let rc = unsafe { nextstate_cpu_cache_install(config.min_block_bytes, config.cache_limit_bytes) };
    if rc < 0 {
        return Err(crate::Error::Internal("libtorch refused the caching CPU allocator".into()));
    }
    *state = Some(config);
    drop(state);
    if config.idle_trim_ms > 0 {
        trim_when_idle(config.idle_trim_ms)?;
    }
    Ok(config)
}

/// From now on, a thread of the allocator unmaps every cached block once no buffer of at least
/// [`CachingAllocatorConfig::min_block_bytes`] has been allocated or freed for `idle_ms` milliseconds
/// (checked every `idle_ms / 4`); `0` stops it. [`install`] calls it with
/// [`CachingAllocatorConfig::idle_trim_ms`]. Returns false when the allocator is not installed.
///
/// # Errors
/// [`crate::Error::Internal`] when the thread could not be started.
pub fn trim_when_idle(idle_ms: u64) -> crate::Result<bool> {
    if installed().is_none() {
        return Ok(false);
    }
    // SAFETY: plain-value argument; the C++ side starts its thread once and catches its exceptions.
    match unsafe { nextstate_cpu_cache_trim_when_idle(idle_ms) } {
        0 => Ok(true),
        -1 => Ok(false),
        _ => Err(crate::Error::Internal("cannot start the caching CPU allocator's idle-trim thread".into())),
    }
}

/// The settings in force, `None` when [`install`] was not called in this process.
pub fn installed() -> Option<CachingAllocatorConfig> {
    *installed_state()
}

/// Unmaps cached blocks until at most `keep_bytes` stay cached (0: all). Returns false when the
/// allocator is not installed (nothing to do).
pub fn trim(keep_bytes: u64) -> bool {
    if installed().is_none() {
        return false;
    }
    // SAFETY: plain-value argument; the C++ side locks its own state.
    unsafe { nextstate_cpu_cache_trim(keep_bytes) == 0 }
}

/// The allocator's counters, `None` when it is not installed.
pub fn stats() -> Option<CachingAllocatorStats> {
    installed()?;
    let mut out = [0u64; 8];
    // SAFETY: `out` has the 8 slots the C++ side writes.
    if unsafe { nextstate_cpu_cache_stats(out.as_mut_ptr()) } != 0 {
        return None;
    }
    let [hits, misses, mapped_bytes, cached_bytes, peak_mapped_bytes, unmapped_bytes, fallback_frees, idle_trims] = out;
    Some(CachingAllocatorStats { hits, misses, mapped_bytes, cached_bytes, peak_mapped_bytes, unmapped_bytes, fallback_frees, idle_trims })
}

#[cfg(test)]
mod tests {
    use super::parse_number;

    #[test]
    fn settings_are_whole_numbers_that_fit_in_bytes() {
        let p = |v: &str| parse_number("X", std::ffi::OsStr::new(v), "KiB");
        assert_eq!(p("64").unwrap(), 64);
        assert_eq!(p(" 0 ").unwrap(), 0);
        assert_eq!(p("17592186044415").unwrap(), (1 << 44) - 1);
        for bad in ["", "-1", "1.5", "64k", "17592186044416"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("X must be a whole number of KiB"), "{bad:?}: {e}");
        }
    }
}
