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
//                any native lock; -1 means full: strict -> c10::OutOfMemoryError,
//                else base allocator + fallback counters.
//   delete(ctx): push to the class stack if under depth and byte limits,
//                else release(offset) -> Python sma.free, outside the lock.
//
// Python speaks heap offsets only (refill, release, zbh_drain): the block's address
// is this file's (base + offset), so no Python code does address arithmetic.
//
// A heap block's DataPtr has context == data (torch's raw_allocate asserts it,
// and copy-on-write clones need it) and a deleter chosen per heap registration
// (kDeleters[id], one template instance per id): the deleter finds its heap
// even after that heap was unregistered and a new one mapped at the same
// address, and then drops the block instead of caching it in the new heap.
// The block's class comes from the heap's table of live blocks. raw_deleter()
// (torch's raw_allocate/raw_deallocate, used by oneDNN for bf16 matmul
// scratch) only gets an address: it looks the address up among the live
// blocks of every registered heap and otherwise hands it to base's raw deleter.
// Heap objects are never freed, so a deleter racing an unregister is safe.
//
// Python callbacks (ctypes CFUNCTYPE) take the GIL themselves. While one runs,
// this thread's allocations go to base, so Python code inside a callback
// cannot re-enter the SMA through torch.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zb_hook_abi.h"

namespace {

// refill(class bytes, requested bytes, flags bit 0: strict) -> block offset in the heap, or -1: heap full
using RefillFn = int64_t (*)(uint64_t size, uint64_t requested, int32_t flags);
using ReleaseFn = void (*)(uint64_t offset);

constexpr uint64_t kAddrMask = (uint64_t{1} << 48) - 1;  // user-space addresses
constexpr int kMaxHeaps = 1024;  // registrations per process (ids are never reused); one deleter each

// Exported counter order (zbh_stats): enum Counter in zb_hook_abi.h, generated from abi.HOOK_COUNTERS.

struct Heap {
  uint64_t base = 0, end = 0;
  std::vector<uint64_t> sizes;               // class sizes, ascending
  std::vector<uint32_t> depth;               // per class: most cached blocks
  std::vector<std::vector<uint64_t>> stacks;  // per class: cached addresses, newest last
  uint64_t cache_limit = 0;                  // most cached bytes over all classes
  std::unordered_map<uint64_t, uint32_t> live;  // guarded by mu: live block address -> class
  int32_t id = 0;                            // registration id: picks the deleter
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

std::atomic<Heap*> g_heaps[kMaxHeaps];
std::mutex g_reg_mu;
std::atomic<int32_t> g_next_id{1};
c10::DeleterFnPtr g_base_raw = nullptr;  // base allocator's raw deleter (set once at install)

void heap_free(Heap* h, uint64_t addr);

template <int32_t Id>
void heap_delete(void* data) {
  Heap* h = g_heaps[Id].load(std::memory_order_acquire);
  if (h != nullptr) heap_free(h, reinterpret_cast<uint64_t>(data));
}

template <std::size_t... Ids>
constexpr std::array<c10::DeleterFnPtr, sizeof...(Ids)> deleter_table(std::index_sequence<Ids...>) {
  return {{&heap_delete<static_cast<int32_t>(Ids)>...}};
}
constexpr std::array<c10::DeleterFnPtr, kMaxHeaps> kDeleters = deleter_table(std::make_index_sequence<kMaxHeaps>{});

void raw_delete(void* data);

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

  // raw_allocate may return a heap block (inside a scope) or base's: raw_delete tells them apart.
  c10::DeleterFnPtr raw_deleter() const override { return g_base_raw != nullptr ? &raw_delete : nullptr; }

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

// Caller holds h->mu: the block becomes live (its class is looked up again on free).
c10::DataPtr make_ptr(Heap* h, uint32_t cls, uint64_t addr) {
  h->live.emplace(addr, cls);
  h->c[kLiveBlocks]++;
  h->c[kLiveBytes] += h->sizes[cls];
  void* p = reinterpret_cast<void*>(addr);
  return c10::DataPtr(p, p, kDeleters[h->id], c10::Device(c10::DeviceType::CPU));
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
      return make_ptr(h, cls, addr);
    }
    h->c[kMisses]++;
  }
  int64_t off;
  {
    CallbackGuard guard;
    off = h->refill(size, n, tls.strict ? 1 : 0);
  }
  if (off >= 0) {
    std::lock_guard<std::mutex> g(h->mu);
    if (h->alive) return make_ptr(h, cls, h->base + static_cast<uint64_t>(off));  // else dropped: the heap died
  }
  return fallback(h, n);
}

// Larger than every class, so larger than the heap: refill only lets Python see
// the failure (it counts the SMA's fallback); a block it returns anyway is given back.
c10::DataPtr HookAllocator::oversize(Heap* h, size_t n) {
  {
    CallbackGuard guard;
    int64_t off = h->refill(n, n, tls.strict ? 1 : 0);
    if (off >= 0) h->release(static_cast<uint64_t>(off));
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

void heap_free(Heap* h, uint64_t addr) {
  {
    std::lock_guard<std::mutex> g(h->mu);
    auto it = h->live.find(addr);
    if (it == h->live.end()) return;  // not a live block of this heap: nothing to do
    uint32_t cls = it->second;
    uint64_t size = h->sizes[cls];
    h->live.erase(it);
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
  h->release(addr - h->base);
}

// The raw deleter: an address only. A block still live in an unregistered heap
// wins over one of a live heap mapped at the same address (it is dropped; were
// the free meant for the new heap's block, that block leaks instead of being
// handed out twice). Addresses of no heap are base's.
void raw_delete(void* data) {
  uint64_t addr = reinterpret_cast<uint64_t>(data);
  Heap* owner = nullptr;
  int32_t n = g_next_id.load(std::memory_order_acquire);
  for (int32_t id = 1; id < n; ++id) {
    Heap* h = g_heaps[id].load(std::memory_order_acquire);
    if (h == nullptr || addr < h->base || addr >= h->end) continue;
    std::lock_guard<std::mutex> g(h->mu);
    if (h->live.count(addr) != 0 && (owner == nullptr || !h->alive)) owner = h;
  }
  if (owner != nullptr)
    heap_free(owner, addr);
  else
    g_base_raw(data);
}

Heap* heap_by_id(int32_t id) {
  if (id <= 0 || id >= kMaxHeaps) return nullptr;
  return g_heaps[id].load(std::memory_order_acquire);
}

}  // namespace

extern "C" {

// Install the hook as torch's CPU allocator (idempotent). 1: installed; 0: a
// higher-priority allocator is in place, so the hook is not used.
int zbh_install(int priority) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  if (g_hook == nullptr) {
    // Never freed: torch keeps the pointer for the life of the process.
    c10::Allocator* base = c10::GetCPUAllocator();
    g_base_raw = base->raw_deleter();
    g_hook = new HookAllocator(base);
    c10::SetCPUAllocator(g_hook, static_cast<uint8_t>(priority));
  }
  return c10::GetCPUAllocator() == g_hook ? 1 : 0;
}

// Register a heap [base, base + nbytes). `sizes` (ascending, each an SMA
// round_size value) and `depth` have `nclasses` entries. Returns a heap id > 0,
// -1 on bad arguments, -2 when no heap ids are left.
int32_t zbh_register(uint64_t base, uint64_t nbytes, const uint64_t* sizes, const uint32_t* depth,
                     uint32_t nclasses, uint64_t cache_limit, RefillFn refill, ReleaseFn release) {
  if (base == 0 || nbytes == 0 || base + nbytes > kAddrMask || nclasses == 0 || nclasses >= (1u << 16) ||
      refill == nullptr || release == nullptr)
    return -1;
  for (uint32_t i = 1; i < nclasses; ++i)
    if (sizes[i] <= sizes[i - 1]) return -1;
  std::lock_guard<std::mutex> g(g_reg_mu);
  int32_t id = g_next_id.load(std::memory_order_relaxed);
  if (id >= kMaxHeaps) return -2;
  Heap* h = new Heap();  // never freed, see the header comment
  h->base = base;
  h->end = base + nbytes;
  h->sizes.assign(sizes, sizes + nclasses);
  h->depth.assign(depth, depth + nclasses);
  h->stacks.resize(nclasses);
  for (uint32_t i = 0; i < nclasses; ++i) h->stacks[i].reserve(depth[i]);
  h->cache_limit = cache_limit;
  h->id = id;
  h->refill = refill;
  h->release = release;
  g_heaps[id].store(h, std::memory_order_release);
  g_next_id.store(id + 1, std::memory_order_release);  // after the store: raw_delete scans up to it
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

// Pop up to `cap` cached blocks into `out` (their heap offsets); returns how many.
uint64_t zbh_drain(int32_t id, uint64_t* out, uint64_t cap) {
  Heap* h = heap_by_id(id);
  if (h == nullptr) return 0;
  std::lock_guard<std::mutex> g(h->mu);
  uint64_t k = 0;
  for (size_t cls = 0; cls < h->stacks.size() && k < cap; ++cls) {
    auto& st = h->stacks[cls];
    while (!st.empty() && k < cap) {
      out[k++] = st.back() - h->base;
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

// The thread's scope state is set, never stacked, here: adapters/scope.py keeps each thread's open scopes
// and sets the innermost one still open after every enter and exit, so scopes may close in any order.
// Set this thread's scope to heap `id` (0: none); returns the previous state as a token.
int64_t zbh_scope_enter(int32_t id, int32_t strict) {
  int64_t token = (int64_t{tls.heap_id} << 1) | (tls.strict ? 1 : 0);
  tls.heap = heap_by_id(id);
  tls.heap_id = tls.heap != nullptr ? id : 0;
  tls.strict = strict ? 1 : 0;
  return token;
}

// Set this thread's scope state to `token` (heap id << 1 | strict; 0: no scope).
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
