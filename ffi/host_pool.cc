#include "host_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <set>

#include "config.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Every live pool, so that lowering the limit can give back what the pools hold beyond it right away.
std::mutex g_pools_mu;
std::set<HostPool*>& Pools() {
  static auto* p = new std::set<HostPool*>();
  return *p;
}

class PinnedSource : public HostChunkSource {
 public:
  PinnedSource(Backend b, int device) : backend_(b), device_(device) {}
  Status Get(size_t size, void** base, size_t* got) override {
    ScopedContext ctx(backend_, device_);
    JAXVMM_RETURN_IF_ERROR(ctx.status());
    const DriverTable& d = Driver(backend_);
    JAXVMM_RETURN_IF_ERROR(Call(-1, "host pool", Entry::kMemHostAlloc, [&] {
      return d.MemHostAlloc(base, size, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    }));
    *got = size;
    return Status();
  }
  void Put(void* base, size_t) override { Driver(backend_).MemFreeHost(base); }

 private:
  const Backend backend_;
  const int device_;
};

}  // namespace

const char* HostStoreName(HostStoreKind k) {
  return EngineConfig::ChoiceName(Setting::kHostStore, static_cast<int64_t>(k));  // the setting's choices
}

std::unique_ptr<HostChunkSource> MakePinnedSource(Backend b, int device) { return std::make_unique<PinnedSource>(b, device); }

HostPool::HostPool(Backend b, int device, HostStoreKind kind)
    : backend_(b),
      device_(device),
      kind_(kind),
      source_(kind == HostStoreKind::kHostNuma ? MakeHostNumaSource(b, device) : MakePinnedSource(b, device)) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  Pools().insert(this);
}

void HostPool::ShrinkAllToLimit() {
  // Pools over the new limit return their empty chunks now; the rest follow as tickets free up (Free).
  std::lock_guard<std::mutex> lock(g_pools_mu);
  for (HostPool* p : Pools()) p->ShrinkToLimit();
}
size_t HostPool::Limit() { return static_cast<size_t>(std::max<int64_t>(EngineConfig::Get(Setting::kHostPoolLimit), 0)); }
size_t HostPool::ChunkSize() {
  return std::max<size_t>(RoundUp(static_cast<size_t>(std::max<int64_t>(EngineConfig::Get(Setting::kHostPoolChunk), 0)), kAlign),
                          kAlign);
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> lock(g_pools_mu);
    Pools().erase(this);
  }
  ScopedContext ctx(backend_, device_);
  for (auto& c : chunks_) source_->Put(c.base, c.size);
  for (size_t i = 0; i < retired_.size(); ++i) source_->Put(retired_[i], retired_sizes_[i]);
}

void HostPool::PutChunk(void* base, size_t size) {
  ScopedContext ctx(backend_, device_);
  source_->Put(base, size);
}

Status HostPool::AddChunk(size_t min_bytes, std::unique_lock<std::mutex>& lock) {
  size_t size = std::max(RoundUp(min_bytes, size_t{2} << 20), ChunkSize());
  size_t limit = Limit();
  size_t committed = static_cast<size_t>(stats_.chunk_bytes) + growing_;
  if (committed + size > limit) {
    // Try the exact request before giving up: the cap is on pinned bytes, not on chunk rounding.
    size = RoundUp(min_bytes, kAlign);
    if (committed + size > limit)
      return Status(Code::kOutOfMemory, "pinned host pool exhausted: " + std::to_string(min_bytes) +
                                            " bytes requested, " + std::to_string(stats_.in_use_bytes) +
                                            " in use, " + std::to_string(stats_.chunk_bytes) + " pinned, limit " +
                                            std::to_string(limit) +
                                            " (raise it with jaxvmm.configure(host_pool_limit=...))");
  }
  // Pinning is slow (~0.6 s/GiB) and may wait for the device: never hold the pool's lock across it,
  // so frees (from workers that release XLA's stream) are never stuck behind it.
  growing_ += size;
  lock.unlock();
  void* p = nullptr;
  size_t got = 0;
  const auto t0 = std::chrono::steady_clock::now();
  Status st = source_->Get(size, &p, &got);
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  lock.lock();
  growing_ -= size;
  stats_.alloc_ns += ns;
  JAXVMM_RETURN_IF_ERROR(st);
  size = got;
  Chunk c{static_cast<char*>(p), size, {}, 0};
  c.free[0] = size;
  chunks_.push_back(std::move(c));
  stats_.chunk_bytes += static_cast<int64_t>(size);
  stats_.driver_allocs += 1;
  stats_.chunks = static_cast<int64_t>(chunks_.size());
  return Status();
}

bool HostPool::Carve(Chunk& c, size_t n, HostBlock* out) {
  for (auto it = c.free.begin(); it != c.free.end(); ++it) {
    if (it->second < n) continue;
    size_t off = it->first, len = it->second;
    c.free.erase(it);
    if (len > n) c.free[off + n] = len - n;
    c.used += n;
    *out = HostBlock{c.base + off, n};
    return true;
  }
  return false;
}

Status HostPool::CheckLimit(size_t n, size_t nbytes, size_t outside) const {
  // The limit may have been lowered below what the pool pinned earlier: carving from those chunks must
  // not exceed it either.
  size_t limit = Limit();
  if (static_cast<size_t>(stats_.in_use_bytes) + outside + n > limit)
    return Status(Code::kOutOfMemory, "pinned host pool exhausted: " + std::to_string(nbytes) + " bytes requested, " +
                                          std::to_string(stats_.in_use_bytes) + " in use" +
                                          (outside ? " (+" + std::to_string(outside) + " pageable)" : std::string()) +
                                          ", limit " + std::to_string(limit) +
                                          " (raise it with jaxvmm.configure(host_pool_limit=...) or "
                                          "JAXVMM_HOST_POOL_LIMIT)");
  return Status();
}

bool HostPool::CarveAny(size_t n, HostBlock* out) {
  bool ok = false;
  for (auto it = chunks_.begin(); !ok && it != chunks_.end(); ++it) ok = Carve(*it, n, out);  // first fit
  if (!ok) return false;
  stats_.in_use_bytes += static_cast<int64_t>(n);
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  stats_.window_peak_in_use_bytes = std::max(stats_.window_peak_in_use_bytes, stats_.in_use_bytes);
  return true;
}

Status HostPool::Allocate(size_t nbytes, HostBlock* out, size_t outside) {
  size_t n = RoundUp(std::max<size_t>(nbytes, 1), kAlign);
  std::unique_lock<std::mutex> lock(mu_);
  JAXVMM_RETURN_IF_ERROR(CheckLimit(n, nbytes, outside));
  size_t limit = Limit();
  if (static_cast<size_t>(stats_.chunk_bytes) > limit) {
    RetireEmptyChunks(limit);
    DrainRetired(lock);
  }
  if (CarveAny(n, out)) return Status();
  JAXVMM_RETURN_IF_ERROR(AddChunk(n, lock));
  if (!CarveAny(n, out)) return Status(Code::kInternal, "host pool chunk too small after growth");
  return Status();
}

Status HostPool::TryAllocate(size_t nbytes, HostBlock* out, bool* carved, size_t outside) {
  size_t n = RoundUp(std::max<size_t>(nbytes, 1), kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  *carved = false;
  JAXVMM_RETURN_IF_ERROR(CheckLimit(n, nbytes, outside));
  *carved = CarveAny(n, out);
  return Status();
}

Status HostPool::Reserve(size_t free_bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    size_t largest = 0;  // a block of free_bytes must fit in one hole
    for (const Chunk& c : chunks_)
      for (const auto& hole : c.free) largest = std::max(largest, hole.second);
    if (largest >= free_bytes) return Status();
    JAXVMM_RETURN_IF_ERROR(AddChunk(RoundUp(free_bytes, kAlign), lock));
  }
}

void HostPool::Free(const HostBlock& block) {
  if (!block) return;
  std::lock_guard<std::mutex> lock(mu_);
  FreeLocked(block);
  // Over a lowered limit: chunks emptied by this free leave the pool now. They are returned to the
  // driver by the next host-side call (Allocate, ShrinkAllToLimit), not here: Free runs on the engine's workers,
  // and cuMemFreeHost may wait for the device, whose stream may be waiting for those workers.
  if (static_cast<size_t>(stats_.chunk_bytes) > Limit()) RetireEmptyChunks(Limit());
}

void HostPool::ShrinkToLimit() {
  std::unique_lock<std::mutex> lock(mu_);
  if (static_cast<size_t>(stats_.chunk_bytes) > Limit()) RetireEmptyChunks(Limit());
  DrainRetired(lock);
}

void HostPool::RetireEmptyChunks(size_t limit) {
  // Caller holds mu_. Moves empty chunks (newest first) out of the pool until what stays in it pins at
  // most `limit` bytes. Retired chunks still count in chunk_bytes until DrainRetired frees them.
  size_t kept = static_cast<size_t>(stats_.chunk_bytes) - retired_bytes_;
  for (size_t i = chunks_.size(); i-- > 0 && kept > limit;) {
    if (chunks_[i].used != 0) continue;
    retired_.push_back(chunks_[i].base);
    retired_bytes_ += chunks_[i].size;
    kept -= chunks_[i].size;
    retired_sizes_.push_back(chunks_[i].size);
    chunks_.erase(chunks_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  stats_.chunks = static_cast<int64_t>(chunks_.size());
}

void HostPool::DrainRetired(std::unique_lock<std::mutex>& lock) {
  if (retired_.empty()) return;
  std::vector<void*> bases;
  std::vector<size_t> sizes;
  bases.swap(retired_);
  sizes.swap(retired_sizes_);
  lock.unlock();  // giving pages back may wait for the device
  for (size_t i = 0; i < bases.size(); ++i) PutChunk(bases[i], sizes[i]);
  lock.lock();
  for (size_t n : sizes) {
    retired_bytes_ -= n;
    stats_.chunk_bytes -= static_cast<int64_t>(n);
    ++stats_.driver_frees;
  }
}

void HostPool::FreeLocked(const HostBlock& block) {
  char* p = static_cast<char*>(block.ptr);
  for (auto& c : chunks_) {
    if (p < c.base || p >= c.base + c.size) continue;
    size_t off = static_cast<size_t>(p - c.base), len = block.size;
    auto next = c.free.lower_bound(off);
    if (next != c.free.end() && next->first == off + len) {  // merge with the following hole
      len += next->second;
      next = c.free.erase(next);
    }
    if (next != c.free.begin()) {  // merge with the preceding hole
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += len;
        len = 0;
      }
    }
    if (len) c.free[off] = len;
    c.used -= block.size;
    stats_.in_use_bytes -= static_cast<int64_t>(block.size);
    return;
  }
}

size_t HostPool::Trim() {
  std::unique_lock<std::mutex> lock(mu_);
  // Empty chunks leave the pool under the lock and go back without it (as DrainRetired does).
  size_t before = static_cast<size_t>(stats_.chunk_bytes);
  RetireEmptyChunks(0);
  DrainRetired(lock);
  return before - static_cast<size_t>(stats_.chunk_bytes);
}

void HostPool::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.window_peak_in_use_bytes = stats_.in_use_bytes;
}

HostPoolStats HostPool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostPoolStats s = stats_;
  s.limit_bytes = static_cast<int64_t>(Limit());
  return s;
}

// ---------------------------------------------------------------- the engine's front

HostStore::HostStore(Backend b, int device) : pinned_(b, device, HostStoreKind::kPinned), numa_(b, device, HostStoreKind::kHostNuma) {}

HostStoreKind HostStore::Current() {
  return EngineConfig::Get(Setting::kHostStore) == static_cast<int64_t>(HostStoreKind::kHostNuma) ? HostStoreKind::kHostNuma
                                                                                                 : HostStoreKind::kPinned;
}

Status HostStore::Allocate(size_t nbytes, HostBlock* out) {
  HostStoreKind k = Current();
  JAXVMM_RETURN_IF_ERROR(pool(k).Allocate(nbytes, out, pageable_bytes_.load()));
  out->store = k;
  return Status();
}

Status HostStore::TryAllocate(size_t nbytes, HostBlock* out, bool* carved) {
  HostStoreKind k = Current();
  JAXVMM_RETURN_IF_ERROR(pool(k).TryAllocate(nbytes, out, carved, pageable_bytes_.load()));
  out->store = k;
  return Status();
}

Status HostStore::Reserve(size_t free_bytes) { return pool(Current()).Reserve(free_bytes); }

HostBlock HostStore::Pageable(size_t nbytes) {
  HostBlock b;
  b.size = RoundUp(std::max<size_t>(nbytes, 1), HostPool::kAlign);
  b.ptr = std::aligned_alloc(HostPool::kAlign, b.size);
  b.pageable = b.ptr != nullptr;
  if (!b.ptr) b.size = 0;
  pageable_bytes_ += b.size;
  return b;
}

void HostStore::Free(const HostBlock& block) {
  if (!block) return;
  if (block.pageable) {
    pageable_bytes_ -= block.size;
    std::free(block.ptr);
    return;
  }
  pool(block.store).Free(block);
}

size_t HostStore::Trim() { return numa_.Trim(); }

}  // namespace jaxvmm
