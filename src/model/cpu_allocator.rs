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
//! What it does: every tensor buffer of at least [`CachingAllocatorConfig::min_block_bytes`] is
//! mapped 2 MiB-aligned, rounded up to a multiple of 2 MiB, with transparent huge pages asked for
//! (`MADV_HUGEPAGE`; used where `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or
//! `madvise`). When its tensor is freed the block is kept and handed to the next request of the same
//! rounded size, so a step's repeated shapes reuse pages that are already resident. Freed blocks
//! beyond [`CachingAllocatorConfig::cache_limit_bytes`] are unmapped, oldest first, so the resident
//! set is at most the live tensors plus that limit (plus rounding). Smaller buffers go to libtorch's
//! default CPU allocator as before. [`trim`] unmaps the cached blocks at once (the trainer calls it
//! after each step, so an idle process holds none).
//!
//! Installing it changes only where new tensors' memory comes from: tensors allocated before keep
//! their own deleter. It is process-wide and cannot be removed once installed.

use std::sync::OnceLock;

unsafe extern "C" {
    fn nextstate_cpu_cache_install(min_bytes: u64, cache_limit: u64) -> i32;
    fn nextstate_cpu_cache_trim(keep: u64) -> i32;
    fn nextstate_cpu_cache_stats(out: *mut u64) -> i32;
}

/// Settings of [`install`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachingAllocatorConfig {
    /// Buffers of at least this many bytes are cached; smaller ones go to libtorch's default
    /// allocator. Default 1 MiB.
    pub min_block_bytes: u64,
    /// Most bytes of freed blocks kept mapped for reuse; beyond it the oldest are unmapped. Default
    /// 512 MiB ([`DEFAULT_CACHE_LIMIT_BYTES`]).
    pub cache_limit_bytes: u64,
}

/// Default [`CachingAllocatorConfig::cache_limit_bytes`]: 512 MiB.
pub const DEFAULT_CACHE_LIMIT_BYTES: u64 = 512 << 20;

impl Default for CachingAllocatorConfig {
    fn default() -> CachingAllocatorConfig {
        CachingAllocatorConfig { min_block_bytes: 1 << 20, cache_limit_bytes: DEFAULT_CACHE_LIMIT_BYTES }
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
    /// Frees of a block the allocator did not hand out (always 0 unless something is wrong; such a
    /// block is leaked rather than reused).
    pub unknown_frees: u64,
}

/// Environment variable that sets [`CachingAllocatorConfig::cache_limit_bytes`] in MiB for
/// `nextstate` and the benches ([`config_from_env`]); `0` leaves the allocator out.
pub const CACHE_ENV: &str = "NEXTSTATE_CPU_CACHE_MB";

/// The settings `nextstate` installs at start: [`CachingAllocatorConfig::default`], with the limit
/// from [`CACHE_ENV`] when set; `None` when it is `0` (libtorch's default allocator, as before).
///
/// # Errors
/// [`crate::Error::Config`] when [`CACHE_ENV`] is not a whole number of MiB.
pub fn config_from_env() -> crate::Result<Option<CachingAllocatorConfig>> {
    let Some(v) = std::env::var_os(CACHE_ENV) else {
        return Ok(Some(CachingAllocatorConfig::default()));
    };
    let mb: u64 = v.to_str().and_then(|v| v.trim().parse().ok()).ok_or_else(|| crate::config_err!("{CACHE_ENV} must be a whole number of MiB (0: off), got {v:?}"))?;
    Ok((mb > 0).then(|| CachingAllocatorConfig { cache_limit_bytes: mb << 20, ..CachingAllocatorConfig::default() }))
}

static INSTALLED: OnceLock<CachingAllocatorConfig> = OnceLock::new();

/// Installs the caching allocator as libtorch's CPU allocator for the rest of the process. Returns
/// the settings in force: `config` on the first call, the first call's settings on any later one.
/// Call it at start, before loading models, so their activations (not only later tensors) use it.
///
/// # Errors
/// [`crate::Error::Internal`] when libtorch threw while the allocator was registered.
pub fn install(config: CachingAllocatorConfig) -> crate::Result<CachingAllocatorConfig> {
    let mut result = Ok(());
    let installed = *INSTALLED.get_or_init(|| {
        // SAFETY: plain-value arguments; the C++ side registers a leaked allocator once.
        let rc = unsafe { nextstate_cpu_cache_install(config.min_block_bytes, config.cache_limit_bytes) };
        if rc < 0 {
            result = Err(crate::Error::Internal("libtorch refused the caching CPU allocator".into()));
        }
        config
    });
    result.map(|()| installed)
}

/// The settings in force, `None` when [`install`] was not called in this process.
pub fn installed() -> Option<CachingAllocatorConfig> {
    INSTALLED.get().copied()
}

/// Unmaps cached blocks until at most `keep_bytes` stay cached (0: all). Returns false when the
/// allocator is not installed (nothing to do).
pub fn trim(keep_bytes: u64) -> bool {
    if INSTALLED.get().is_none() {
        return false;
    }
    // SAFETY: plain-value argument; the C++ side locks its own state.
    unsafe { nextstate_cpu_cache_trim(keep_bytes) == 0 }
}

/// The allocator's counters, `None` when it is not installed.
pub fn stats() -> Option<CachingAllocatorStats> {
    INSTALLED.get()?;
    let mut out = [0u64; 7];
    // SAFETY: `out` has the 7 slots the C++ side writes.
    if unsafe { nextstate_cpu_cache_stats(out.as_mut_ptr()) } != 0 {
        return None;
    }
    let [hits, misses, mapped_bytes, cached_bytes, peak_mapped_bytes, unmapped_bytes, unknown_frees] = out;
    Some(CachingAllocatorStats { hits, misses, mapped_bytes, cached_bytes, peak_mapped_bytes, unmapped_bytes, unknown_frees })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// One test owns the process-wide allocator (the lib test binary runs every test in one process;
    /// installing it here changes only where later CPU tensors' memory comes from).
    #[test]
    fn blocks_are_reused_by_rounded_size_and_the_cache_is_bounded() {
        let cfg = CachingAllocatorConfig { min_block_bytes: 1 << 20, cache_limit_bytes: 8 << 20 };
        let got = install(cfg).unwrap();
        assert_eq!(got, cfg);
        assert_eq!(install(CachingAllocatorConfig::default()).unwrap(), cfg, "a second install changes nothing");
        let s0 = stats().unwrap();
        // 3 MiB of f32 rounds up to a 4 MiB block.
        let a = Tensor::ones([3 << 18], (Kind::Float, tch::Device::Cpu));
        let s1 = stats().unwrap();
        assert!(s1.misses > s0.misses);
        drop(a);
        let s2 = stats().unwrap();
        assert!(s2.cached_bytes >= 4 << 20, "{s2:?}");
        // Same rounded size (3.5 MiB → 4 MiB): served from the cache, and its values are its own.
        let b = Tensor::full([7 << 17], 2.5, (Kind::Float, tch::Device::Cpu));
        let s3 = stats().unwrap();
        assert!(s3.hits > s2.hits, "{s3:?}");
        assert_eq!(b.sum(Kind::Double).double_value(&[]), 2.5 * f64::from(7 << 17));
        // Small tensors bypass it.
        let small = Tensor::ones([16], (Kind::Float, tch::Device::Cpu));

        drop(small);
        drop(b);
        // Freeing three 4 MiB blocks with an 8 MiB limit keeps at most 8 MiB cached.
        let many: Vec<Tensor> = (0..3).map(|_| Tensor::zeros([1 << 20], (Kind::Float, tch::Device::Cpu))).collect();
        drop(many);
        let s4 = stats().unwrap();
        assert!(s4.cached_bytes <= 8 << 20, "{s4:?}");
        assert!(s4.unmapped_bytes >= 4 << 20, "{s4:?}");
        assert!(trim(0));
        let s5 = stats().unwrap();
        assert_eq!(s5.cached_bytes, 0);
        assert_eq!(s5.unknown_frees, 0);
        // A gradient step through cached blocks gives the same numbers as plain arithmetic.
        let x = Tensor::full([1 << 19], 3.0, (Kind::Float, tch::Device::Cpu)).requires_grad_(true);
        let y = (&x * &x).sum(Kind::Float);
        y.backward();
        assert_eq!(x.grad().mean(Kind::Double).double_value(&[]), 6.0);
    }
}
