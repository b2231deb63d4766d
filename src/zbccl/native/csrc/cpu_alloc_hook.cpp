// zbccl CPU allocator hook: while a thread is inside `zbccl.heap_scope()`,
// every CPU torch allocation of that thread is served from a rank's shared heap.
//
// Installed once with c10::SetCPUAllocator; the previous CPU allocator is kept
// as `base`. Outside a scope an allocation costs one thread-local check more
// than torch's own.
//
// Python owns policy and the heap's sub-allocator (the SMA); this file owns the
// hot path, a per-heap front cache ("magazine"): for each size class a LIFO
// stack of block addresses Python handed out. Python installs the class sizes
// (the SMA's round_size values, so a magazine block is exactly an SMA block),
// the per-class stack depths and a byte limit.
//
//   allocate(n): scope off -> base. Else class = smallest class >= n;
//                hit: pop under the heap mutex (no Python).
//                miss: refill(class bytes) -> Python sma.try_malloc, outside
//                any native lock; 0 means full: strict -> c10::OutOfMemoryError,
//                else base allocator + fallback counters.
//   delete(ctx): push to the class stack if under depth and byte limits,
//                else release(addr) -> Python sma.free, outside the lock.
//
// The DataPtr context encodes the block address (low 48 bits) and a "bin" id
// (high 16 bits) naming (heap registration, class): a deleter finds its heap
// even after that heap was unregistered and a new one mapped at the same
// address, and then drops the block instead of caching it in the new heap.
// Heap objects are never freed, so a deleter racing an unregister is safe.
//
// Python callbacks (ctypes CFUNCTYPE) take the GIL themselves. While one runs,
// this thread's allocations go to base, so Python code inside a callback
// cannot re-enter the SMA through torch.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

// refill(class bytes, requested bytes, flags bit 0: strict) -> block address, or 0: heap full
using RefillFn = uint64_t (*)(uint64_t size, uint64_t requested, int32_t flags);
using ReleaseFn = void (*)(uint64_t addr);

constexpr int kAddrBits = 48;
constexpr uint64_t kAddrMask = (uint64_t{1} << kAddrBits) - 1;
constexpr uint32_t kNumBins = 1u << 16;
constexpr int kMaxHeaps = 4096;

// Exported counter order (zbh_stats); keep in sync with adapters/scope.py.
enum Counter {
  kHits, kMisses, kFallbackAllocs, kFallbackBytes, kStrictFailures, kLiveBytes, kLiveBlocks,
  kCachedBytes, kCachedBlocks, kReleases, kDroppedFrees, kNumCounters
};

struct Heap {
  uint64_t base = 0, end = 0;
  std::vector<uint64_t> sizes;               // class sizes, ascending
  std::vector<uint32_t> depth;               // per class: most cached blocks
  std::vector<std::vector<uint64_t>> stacks;  // per class: cached addresses, newest last
  uint64_t cache_limit = 0;                  // most cached bytes over all classes
  uint32_t first_bin = 0;
  RefillFn refill = nullptr;
  ReleaseFn release = nullptr;
  bool alive = true;  // guarded by mu
  std::mutex mu;
  uint64_t c[kNumCounters] = {};  // guarded by mu

  uint32_t class_of(uint64_t n) const {
    return static_cast<uint32_t>(std::lower_bound(sizes.begin(), sizes.end(), n) - sizes.begin());
  }
};

struct ThreadState {
  Heap* heap;        // innermost scope's heap, or null
  int32_t heap_id;   // its id (for tokens)
  int32_t strict;
  int32_t in_callback;
};
thread_local ThreadState tls = {nullptr, 0, 0, 0};

std::atomic<Heap*> g_bins[kNumBins];
std::atomic<Heap*> g_heaps[kMaxHeaps];
std::mutex g_reg_mu;
int g_next_id = 1;
uint32_t g_next_bin = 1;

void heap_delete(void* ctx);

struct CallbackGuard {  // this thread's allocations go to base while Python runs
  CallbackGuard() { ++tls.in_callback; }
  ~CallbackGuard() { --tls.in_callback; }
};

class HookAllocator final : public c10::Allocator {
 public:
  explicit HookAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    Heap* h = tls.heap;
    if (h == nullptr || n == 0 || tls.in_callback) return base_->allocate(n);
    return heap_allocate(h, n);
  }

  // Outside a scope every block is base's, so torch's raw API behaves as before.
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }


 private:
  c10::DataPtr heap_allocate(Heap* h, size_t n);
  c10::DataPtr oversize(Heap* h, size_t n);
  c10::DataPtr fallback(Heap* h, size_t n);
  c10::Allocator* base_;
};

HookAllocator* g_hook = nullptr;

c10::DataPtr make_ptr(Heap* h, uint32_t cls, uint64_t addr) {
  uint64_t ctx = addr | (uint64_t{h->first_bin + cls} << kAddrBits);
  return c10::DataPtr(reinterpret_cast<void*>(addr), reinterpret_cast<void*>(ctx), &heap_delete,
                      c10::Device(c10::DeviceType::CPU));
}

c10::DataPtr HookAllocator::heap_allocate(Heap* h, size_t n) {
  uint32_t cls = h->class_of(n);
  if (cls == h->sizes.size()) return oversize(h, n);
  uint64_t size = h->sizes[cls];
  {
    std::lock_guard<std::mutex> g(h->mu);
    if (!h->alive) return base_->allocate(n);  // unregistered while the scope was open
    auto& st = h->stacks[cls];
    if (!st.empty()) {
      uint64_t addr = st.back();
      st.pop_back();
      h->c[kHits]++;
      h->c[kCachedBlocks]--;
      h->c[kCachedBytes] -= size;
      h->c[kLiveBlocks]++;
      h->c[kLiveBytes] += size;
      return make_ptr(h, cls, addr);
    }
    h->c[kMisses]++;
  }
  uint64_t addr;
  {
    CallbackGuard guard;
    addr = h->refill(size, n, tls.strict ? 1 : 0);
  }
  if (addr != 0) {
    bool dead;
    {
      std::lock_guard<std::mutex> g(h->mu);
      dead = !h->alive;
      if (!dead) {
        h->c[kLiveBlocks]++;
        h->c[kLiveBytes] += size;
      }
    }
    if (!dead) return make_ptr(h, cls, addr);  // a block handed out as the heap died is dropped
  }
  return fallback(h, n);
}

// Larger than every class, so larger than the heap: refill only lets Python see
// the failure (it counts the SMA's fallback); a block it returns anyway is given back.
c10::DataPtr HookAllocator::oversize(Heap* h, size_t n) {
  uint64_t addr;
  {
    CallbackGuard guard;
    addr = h->refill(n, n, tls.strict ? 1 : 0);
    if (addr != 0) h->release(addr);
  }
  return fallback(h, n);
}

c10::DataPtr HookAllocator::fallback(Heap* h, size_t n) {
  if (tls.strict) {
    {
      std::lock_guard<std::mutex> g(h->mu);
      h->c[kStrictFailures]++;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "heap_scope: heap out of memory (strict=True), requested ", n,
                     " bytes");
  }
  {
    std::lock_guard<std::mutex> g(h->mu);
    h->c[kFallbackAllocs]++;
    h->c[kFallbackBytes] += n;
  }
  return base_->allocate(n);
}

void heap_delete(void* ctx) {
  uint64_t v = reinterpret_cast<uint64_t>(ctx);
  uint64_t addr = v & kAddrMask;
  uint32_t bin = static_cast<uint32_t>(v >> kAddrBits);
  Heap* h = g_bins[bin].load(std::memory_order_acquire);
  if (h == nullptr) return;
  uint32_t cls = bin - h->first_bin;
  if (cls >= h->sizes.size() || addr < h->base || addr >= h->end) return;  // bin id reused: not ours
  uint64_t size = h->sizes[cls];
  {
    std::lock_guard<std::mutex> g(h->mu);
    if (!h->alive) {
      h->c[kDroppedFrees]++;
      return;
    }
    h->c[kLiveBlocks]--;
    h->c[kLiveBytes] -= size;
    auto& st = h->stacks[cls];
    if (st.size() < h->depth[cls] && h->c[kCachedBytes] + size <= h->cache_limit) {
      st.push_back(addr);
      h->c[kCachedBlocks]++;
      h->c[kCachedBytes] += size;
      return;
    }
    h->c[kReleases]++;
  }
  CallbackGuard guard;
  h->release(addr);
}

Heap* heap_by_id(int32_t id) {
  if (id <= 0 || id >= kMaxHeaps) return nullptr;
  return g_heaps[id].load(std::memory_order_acquire);
}

// Reserve `count` consecutive bin ids; caller holds g_reg_mu. 0 when none are free.
uint32_t reserve_bins(uint32_t count) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (g_next_bin + count > kNumBins) g_next_bin = 1;  // wrap: ids of dead heaps are reused
    uint32_t first = g_next_bin;
    bool busy = false;
    for (uint32_t b = first; b < first + count && !busy; ++b) {
      Heap* other = g_bins[b].load(std::memory_order_relaxed);
      if (other != nullptr) {
        std::lock_guard<std::mutex> g(other->mu);
        busy = other->alive;
      }
    }
    if (!busy) {
      g_next_bin = first + count;
      return first;
    }
    g_next_bin = kNumBins;  // force a wrap on the next attempt
  }
  return 0;
}

}  // namespace

extern "C" {

// Install the hook as torch's CPU allocator (idempotent). 1: installed; 0: a
// higher-priority allocator is in place, so the hook is not used.
int zbh_install(int priority) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (g_hook == nullptr) {
    // Never freed: torch keeps the pointer for the life of the process.
    g_hook = new HookAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_hook, static_cast<uint8_t>(priority));
  }
  return c10::GetCPUAllocator() == g_hook ? 1 : 0;
}

// Register a heap [base, base + nbytes). `sizes` (ascending, each an SMA
// round_size value) and `depth` have `nclasses` entries. Returns a heap id > 0,
// -1 on bad arguments, -2 when no bin ids or heap ids are left.
int32_t zbh_register(uint64_t base, uint64_t nbytes, const uint64_t* sizes, const uint32_t* depth,
                     uint32_t nclasses, uint64_t cache_limit, RefillFn refill, ReleaseFn release) {
  if (base == 0 || nbytes == 0 || base + nbytes > kAddrMask || nclasses == 0 || nclasses >= kNumBins / 2 ||
      refill == nullptr || release == nullptr)
    return -1;
  for (uint32_t i = 1; i < nclasses; ++i)
    if (sizes[i] <= sizes[i - 1]) return -1;
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (g_next_id >= kMaxHeaps) return -2;
  uint32_t first = reserve_bins(nclasses);
  if (first == 0) return -2;
  Heap* h = new Heap();  // never freed, see the header comment
  h->base = base;
  h->end = base + nbytes;
  h->sizes.assign(sizes, sizes + nclasses);
  h->depth.assign(depth, depth + nclasses);
  h->stacks.resize(nclasses);
  for (uint32_t i = 0; i < nclasses; ++i) h->stacks[i].reserve(depth[i]);
  h->cache_limit = cache_limit;
  h->first_bin = first;
  h->refill = refill;
  h->release = release;
  for (uint32_t i = 0; i < nclasses; ++i) g_bins[first + i].store(h, std::memory_order_release);
  int32_t id = g_next_id++;
  g_heaps[id].store(h, std::memory_order_release);
  return id;
}

// Stop serving from the heap: later allocations go to base and later frees of
// its blocks are dropped. Cached blocks stay for zbh_drain. 0, or -1 if unknown.
int32_t zbh_unregister(int32_t id) {
  Heap* h = heap_by_id(id);
  if (h == nullptr) return -1;
  std::lock_guard<std::mutex> g(h->mu);
  h->alive = false;
  return 0;
}

// Pop up to `cap` cached blocks into `out`; returns how many.
uint64_t zbh_drain(int32_t id, uint64_t* out, uint64_t cap) {
  Heap* h = heap_by_id(id);
  if (h == nullptr) return 0;
  std::lock_guard<std::mutex> g(h->mu);
  uint64_t k = 0;
  for (size_t cls = 0; cls < h->stacks.size() && k < cap; ++cls) {
    auto& st = h->stacks[cls];
    while (!st.empty() && k < cap) {
      out[k++] = st.back();
      st.pop_back();
      h->c[kCachedBlocks]--;
      h->c[kCachedBytes] -= h->sizes[cls];
    }
  }
  return k;
}

// Copy up to `n` counters (enum Counter order) into `out`; returns how many, -1 if unknown.
int32_t zbh_stats(int32_t id, uint64_t* out, int32_t n) {
  Heap* h = heap_by_id(id);
  if (h == nullptr) return -1;
  std::lock_guard<std::mutex> g(h->mu);
  int32_t k = std::min<int32_t>(n, kNumCounters);
  std::memcpy(out, h->c, sizeof(uint64_t) * static_cast<size_t>(k));
  return k;
}

// Block size the hook reserves for an n-byte request (0: larger than every class).
uint64_t zbh_class_size(int32_t id, uint64_t n) {
  Heap* h = heap_by_id(id);
  if (h == nullptr) return 0;
  uint32_t cls = h->class_of(n);
  return cls == h->sizes.size() ? 0 : h->sizes[cls];
}

// Enter a scope on heap `id` (0: none) for this thread; returns a token for zbh_scope_exit.
int64_t zbh_scope_enter(int32_t id, int32_t strict) {
  int64_t token = (int64_t{tls.heap_id} << 1) | (tls.strict ? 1 : 0);
  tls.heap = heap_by_id(id);
  tls.heap_id = tls.heap != nullptr ? id : 0;
  tls.strict = strict ? 1 : 0;
  return token;
}

// Restore the thread's scope state saved by zbh_scope_enter.
void zbh_scope_exit(int64_t token) {
  int32_t id = static_cast<int32_t>(token >> 1);
  tls.heap = heap_by_id(id);
  tls.heap_id = tls.heap != nullptr ? id : 0;
  tls.strict = static_cast<int32_t>(token & 1);
}

// This thread's current token (heap id << 1 | strict).
int64_t zbh_scope_state(void) { return (int64_t{tls.heap_id} << 1) | (tls.strict ? 1 : 0); }

int32_t zbh_num_counters(void) { return kNumCounters; }

}  // extern "C"
