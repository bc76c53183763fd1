//! The caching CPU allocator (`nextstate::model::cpu_allocator`): reuse by rounded size, the cache
//! limit, trim, the raw interface oneDNN uses, and gradients through cached blocks.

use nextstate::model::cpu_allocator::{install, stats, trim, trim_when_idle, CachingAllocatorConfig};
use tch::{Kind, Tensor};

/// The allocator is process-wide, and its counters are global: this binary holds this one test, so
/// no other test's tensors move them (under `cargo test` as under nextest).
#[test]
fn blocks_are_reused_by_rounded_size_and_the_cache_is_bounded() {
    // No idle thread until the end: the counters below must not move while the test waits on CI.
    let cfg = CachingAllocatorConfig { min_block_bytes: 1 << 20, cache_limit_bytes: 8 << 20, idle_trim_ms: 0 };
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
    // Under 2 MiB a block is a multiple of 64 KiB: 1,310,724 bytes (327,681 f32) map 21 x 64 KiB.
    // (The sum's f64 copy of `b` left an 8 MiB block cached: trimmed first, so no eviction moves
    // the count.)
    assert!(trim(0));
    let mapped = stats().unwrap().mapped_bytes;
    let mid = Tensor::ones([(5 << 16) + 1], (Kind::Float, tch::Device::Cpu));
    assert_eq!(stats().unwrap().mapped_bytes - mapped, 21 << 16);
    drop(mid);
    // 1,376,256 bytes exactly (the same class): the cached block, with no new mapping.
    let hits = stats().unwrap().hits;
    let mid = Tensor::full([21 << 14], 1.5, (Kind::Float, tch::Device::Cpu));
    let s = stats().unwrap();
    assert_eq!((s.hits, s.mapped_bytes - mapped), (hits + 1, 21 << 16), "{s:?}");
    assert_eq!(mid.sum(Kind::Double).double_value(&[]), 1.5 * f64::from(21 << 14));
    drop(mid);
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
    // A bf16 product: on CPUs where libtorch runs it through oneDNN, oneDNN's buffers come from this
    // allocator's raw interface (raw_allocate / raw_deleter), small ones included.
    let m = Tensor::ones([512, 512], (Kind::BFloat16, tch::Device::Cpu));
    assert_eq!(m.matmul(&m).to_kind(Kind::Float).double_value(&[3, 7]), 512.0);
    // A gradient step through cached blocks gives the same numbers as plain arithmetic.
    let x = Tensor::full([1 << 19], 3.0, (Kind::Float, tch::Device::Cpu)).requires_grad_(true);
    let y = (&x * &x).sum(Kind::Float);
    y.backward();
    assert_eq!(x.grad().mean(Kind::Double).double_value(&[]), 6.0);
    drop((x, y));
    // The idle thread: a freed block is unmapped once nothing was allocated or freed for 50 ms.
    assert!(trim_when_idle(50).unwrap());
    drop(Tensor::ones([1 << 20], (Kind::Float, tch::Device::Cpu)));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let idle = loop {
        let s = stats().unwrap();
        if s.cached_bytes == 0 && s.idle_trims > 0 {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "no idle trim within 30 s: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(idle.mapped_bytes, stats().unwrap().mapped_bytes);
}
