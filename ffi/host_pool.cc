#include "host_pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "vmm.h"

namespace jaxvmm {
namespace {

size_t DefaultLimit() {
  if (const char* env = std::getenv("JAXVMM_HOST_POOL_LIMIT")) {
    unsigned long long v = std::strtoull(env, nullptr, 10);
    if (v > 0) return static_cast<size_t>(v);
  }
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / 2 : size_t{16} << 30;
}
std::atomic<size_t> g_limit{0};
std::atomic<size_t> g_chunk{size_t{256} << 20};
size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

void HostPool::SetLimit(size_t bytes) { g_limit.store(bytes); }
void HostPool::SetChunkSize(size_t bytes) { g_chunk.store(std::max<size_t>(RoundUp(bytes, kAlign), kAlign)); }
size_t HostPool::Limit() {
  size_t l = g_limit.load();
  return l ? l : DefaultLimit();
}
size_t HostPool::ChunkSize() { return g_chunk.load(); }

HostPool::~HostPool() {
  ScopedContext ctx(backend_, device_);
  for (auto& c : chunks_) Driver(backend_).MemFreeHost(c.base);
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
  // cuMemHostAlloc is slow (~0.6 s/GiB) and may wait for the device: never hold the pool's lock
  // across it, so frees (from workers that release XLA's stream) are never stuck behind it.
  growing_ += size;
  lock.unlock();
  void* p = nullptr;
  Status st;
  {
    ScopedContext ctx(backend_, device_);
    st = ctx.status();
    const DriverTable& d = Driver(backend_);
    if (st.ok())
      st = Call(-1, "host pool", Entry::kMemHostAlloc, [&] {
        return d.MemHostAlloc(&p, size, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
      });
  }
  lock.lock();
  growing_ -= size;
  JAXVMM_RETURN_IF_ERROR(st);
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

Status HostPool::Allocate(size_t nbytes, HostBlock* out) {
  size_t n = RoundUp(std::max<size_t>(nbytes, 1), kAlign);
  std::unique_lock<std::mutex> lock(mu_);
  bool ok = false;
  for (auto& c : chunks_)
    if ((ok = Carve(c, n, out))) break;
  if (!ok) {
    JAXVMM_RETURN_IF_ERROR(AddChunk(n, lock));
    for (auto it = chunks_.rbegin(); !ok && it != chunks_.rend(); ++it) ok = Carve(*it, n, out);
  }
  if (!ok) return Status(Code::kInternal, "host pool chunk too small after growth");
  stats_.in_use_bytes += static_cast<int64_t>(n);
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return Status();
}

void HostPool::Free(const HostBlock& block) {
  if (!block) return;
  std::lock_guard<std::mutex> lock(mu_);
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

void HostPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  ScopedContext ctx(backend_, device_);
  for (auto it = chunks_.begin(); it != chunks_.end();) {
    if (it->used == 0) {
      Driver(backend_).MemFreeHost(it->base);
      stats_.chunk_bytes -= static_cast<int64_t>(it->size);
      it = chunks_.erase(it);
    } else {
      ++it;
    }
  }
  stats_.chunks = static_cast<int64_t>(chunks_.size());
}

HostPoolStats HostPool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostPoolStats s = stats_;
  s.limit_bytes = static_cast<int64_t>(Limit());
  return s;
}

}  // namespace jaxvmm
