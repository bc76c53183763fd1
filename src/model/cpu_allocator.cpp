// A caching allocator for libtorch's CPU tensors: see src/model/cpu_allocator.rs for what it is for,
// its limits and how it was measured. Blocks of at least `min_bytes` are mapped: from 2 MiB up
// 2 MiB-aligned in multiples of 2 MiB (transparent huge pages asked for with MADV_HUGEPAGE), below
// that page-aligned in multiples of 64 KiB. They are kept when their tensor is
// freed and handed to the next request of the same rounded size; freed blocks beyond `cache_limit`
// bytes are unmapped, oldest first, and all of them by trim() or, once started (trim_when_idle), by a
// thread that sees no block allocated or freed for a while. Smaller requests go to libtorch's default
// CPU allocator (through its raw interface, so that every buffer carries this allocator's deleter, as
// raw_deleter promises).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Granule of the blocks under one huge page: 64 KiB, glibc's mmap threshold as nextstate sets it.
constexpr size_t kGranule = size_t{64} << 10;

// A block's size: a multiple of 2 MiB from 2 MiB up, a multiple of 64 KiB below.
size_t round_up(size_t n) {
  const size_t unit = n >= kHugePage ? kHugePage : kGranule;
  return (n + unit - 1) / unit * unit;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class CachingCpuAllocator final : public c10::Allocator {
 public:
  // `min_bytes` is at least 1, so empty buffers always go to the fallback.
  CachingCpuAllocator(c10::Allocator* fallback, size_t min_bytes, size_t cache_limit)
      : fallback_(fallback), fallback_deleter_(fallback->raw_deleter()), min_bytes_(min_bytes < 1 ? 1 : min_bytes), cache_limit_(cache_limit) {
    TORCH_CHECK(fallback_deleter_ != nullptr, "nextstate CPU caching allocator: the default CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) {
      // Every DataPtr of this allocator carries Delete (raw_deleter's contract: oneDNN's allocator
      // hook calls raw_allocate/raw_deallocate on the CPU allocator); Delete hands blocks it did not
      // map back to the fallback's deleter.
      void* p = fallback_->raw_allocate(n);
      return {p, p, &CachingCpuAllocator::Delete, c10::Device(c10::DeviceType::CPU)};
    }
    const size_t size = round_up(n);
    last_activity_ns_.store(now_ns(), std::memory_order_relaxed);
    void* p = take_cached(size);
    if (p == nullptr) {
      p = map_block(size);
      if (p == nullptr) {
        // Out of address space or memory: give every cached block back and try once more.
        trim(0);
        p = map_block(size);
      }
      TORCH_CHECK(p != nullptr, "nextstate CPU caching allocator: mmap of ", size, " bytes failed: ", std::strerror(errno));
      std::lock_guard<std::mutex> g(mu_);
      mapped_ += size;
      if (mapped_ > peak_mapped_) peak_mapped_ = mapped_;
    }
    try {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      unmap_locked(p, size);
      throw;
    }
    return {p, p, &CachingCpuAllocator::Delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &CachingCpuAllocator::Delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void Delete(void* p);

  // Runs inside a noexcept deleter: never throws.
  void release(void* p) noexcept {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        const size_t size = it->second;
        live_.erase(it);
        last_activity_ns_.store(now_ns(), std::memory_order_relaxed);
        try {
          lru_.emplace_back(size, p);
          by_size_[size].push_back(std::prev(lru_.end()));
        } catch (...) {
          // No memory for the bookkeeping: give the block back instead of caching it.
          if (!lru_.empty() && lru_.back().second == p) lru_.pop_back();
          unmap_locked(p, size);
          return;
        }
        cached_ += size;
        evict_locked(cache_limit_);
        return;
      }
    }
    // Not one of our blocks: a small buffer from the fallback (or one the fallback handed out
    // before this allocator was installed, freed through raw_deleter).
    fallback_frees_.fetch_add(1, std::memory_order_relaxed);
    fallback_deleter_(p);
  }

  // Unmaps cached blocks until at most `keep` bytes stay cached.
  void trim(size_t keep) {
    std::lock_guard<std::mutex> g(mu_);
    evict_locked(keep);
  }

  // From now on, a thread unmaps every cached block once no cached-size buffer has been allocated or
  // freed for `idle_ms` milliseconds (0: stop doing so). The thread starts on the first call and
  // checks every idle_ms / 4 (at least 1 ms).
  void trim_when_idle(uint64_t idle_ms) {
    idle_ms_.store(idle_ms, std::memory_order_relaxed);
    if (idle_ms == 0 || trimmer_started_.exchange(true)) return;
    try {
      start_trimmer();
    } catch (...) {
      trimmer_started_.store(false);
      throw;
    }
  }

  void start_trimmer() {
    std::thread([this] {
      for (;;) {
        const uint64_t idle = idle_ms_.load(std::memory_order_relaxed);
        std::this_thread::sleep_for(std::chrono::milliseconds(idle == 0 ? 100 : std::max<uint64_t>(idle / 4, 1)));
        if (idle == 0) continue;
        if (now_ns() - last_activity_ns_.load(std::memory_order_relaxed) < static_cast<int64_t>(idle) * 1000000) continue;
        std::lock_guard<std::mutex> g(mu_);
        if (cached_ > 0) {
          evict_locked(0);
          ++idle_trims_;
        }
      }
    }).detach();
  }

  void stats(uint64_t out[8]) {
    std::lock_guard<std::mutex> g(mu_);
    out[0] = hits_;
    out[1] = misses_;
    out[2] = mapped_;
    out[3] = cached_;
    out[4] = peak_mapped_;
    out[5] = unmapped_total_;
    out[6] = fallback_frees_.load(std::memory_order_relaxed);
    out[7] = idle_trims_;
  }

 private:
  using Lru = std::list<std::pair<size_t, void*>>;

  void* take_cached(size_t size) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = by_size_.find(size);
    if (it == by_size_.end() || it->second.empty()) {
      ++misses_;
      return nullptr;
    }
    // The most recently freed block of this size (its pages are the likeliest to be in cache).
    Lru::iterator entry = it->second.back();
    it->second.pop_back();
    void* p = entry->second;
    lru_.erase(entry);
    cached_ -= size;
    ++hits_;
    return p;
  }

  void evict_locked(size_t keep) {
    while (cached_ > keep && !lru_.empty()) {
      auto [size, p] = lru_.front();
      // The oldest block of its size is the front of that size's list.
      auto& same = by_size_[size];
      same.pop_front();
      lru_.pop_front();
      cached_ -= size;
      unmap_locked(p, size);
    }
  }

  // Unmaps a block that is neither live nor cached (mu_ held).
  void unmap_locked(void* p, size_t size) noexcept {
    munmap(p, size);
    mapped_ -= size;
    unmapped_total_ += size;
  }

  static void* map_block(size_t size) {
    if (size < kHugePage) {
      // Under one huge page: page-aligned, as mmap gives it.
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    // Over-map by one huge page and cut the ends off so the block starts 2 MiB-aligned.
    const size_t span = size + kHugePage;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + span;
    if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
    void* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
  }

  c10::Allocator* fallback_;
  c10::DeleterFnPtr fallback_deleter_;
  const size_t min_bytes_;
  const size_t cache_limit_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> live_;
  Lru lru_;
  std::unordered_map<size_t, std::deque<Lru::iterator>> by_size_;
  uint64_t hits_ = 0, misses_ = 0, mapped_ = 0, cached_ = 0, peak_mapped_ = 0, unmapped_total_ = 0, idle_trims_ = 0;
  std::atomic<uint64_t> fallback_frees_{0};
  std::atomic<int64_t> last_activity_ns_{0};
  std::atomic<uint64_t> idle_ms_{0};
  std::atomic<bool> trimmer_started_{false};
};

// Leaked on purpose: tensors freed during process exit still call Delete.
CachingCpuAllocator* g_allocator = nullptr;
std::once_flag g_once;

void CachingCpuAllocator::Delete(void* p) {
  g_allocator->release(p);
}

}  // namespace

extern "C" {

// Installs the allocator as libtorch's CPU allocator (once per process; later calls change nothing).
// Returns 1 when this call installed it, 0 when it was already installed, -1 on a C++ exception.
int nextstate_cpu_cache_install(uint64_t min_bytes, uint64_t cache_limit) {
  try {
    int installed = 0;
    std::call_once(g_once, [&] {
      g_allocator = new CachingCpuAllocator(c10::GetDefaultCPUAllocator(), min_bytes, cache_limit);
      // Priority above the default allocator's (0), so GetCPUAllocator() returns this one.
      c10::SetCPUAllocator(g_allocator, /*priority=*/1);
      installed = 1;
    });
    return installed;
  } catch (...) {
    return -1;
  }
}

// Unmaps cached blocks until at most `keep` bytes stay cached. Returns 0, or -1 when not installed.
int nextstate_cpu_cache_trim(uint64_t keep) {
  if (g_allocator == nullptr) return -1;
  g_allocator->trim(keep);
  return 0;
}

// Unmaps every cached block whenever no cached-size buffer was allocated or freed for `idle_ms`
// milliseconds (0: stop). Returns 0, -1 when not installed, -2 when the thread could not start.
int nextstate_cpu_cache_trim_when_idle(uint64_t idle_ms) {
  if (g_allocator == nullptr) return -1;
  try {
    g_allocator->trim_when_idle(idle_ms);
    return 0;
  } catch (...) {
    return -2;
  }
}

// Writes hits, misses, mapped bytes, cached bytes, peak mapped bytes, unmapped bytes in all, frees
// handed to the fallback allocator and idle trims into out[0..8]. Returns 0, or -1 when not installed.
int nextstate_cpu_cache_stats(uint64_t* out) {
  if (g_allocator == nullptr) return -1;
  g_allocator->stats(out);
  return 0;
}

}  // extern "C"
