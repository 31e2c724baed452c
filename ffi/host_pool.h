// Host store: where offloaded bytes live on the host. Page-locked host memory taken from the driver in
// large chunks (pinning costs ~0.6 s per GiB on H200) and reused across steps. A cap bounds the total;
// hitting it is an error returned to the caller, never an OOM kill.
//
// Two implementations of where a chunk comes from (HostChunkSource), behind one pool (HostPool: carving,
// limit, retirement) and one front the engine uses (HostStore):
//   pinned     cuMemHostAlloc / cuMemFreeHost (the default)
//   host_numa  VMM pages on the device's host NUMA node (cuMemCreate with CU_MEM_LOCATION_TYPE_HOST_NUMA),
//              mapped at a reserved host VA and granted to the device (and the CPU) with one
//              cuMemSetAccess; an empty chunk's pages go back on Trim() (its VA stays reserved and is
//              mapped again at the same address when the store grows). Copies to and from these blocks
//              use cuMemcpyAsync (unified addressing): HostBlock::unified().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <atomic>
#include <mutex>
#include <vector>

#include "driver.h"
#include "stat_fields.h"
#include "status.h"

namespace jaxvmm {

enum class HostStoreKind : int { kPinned = 0, kHostNuma = 1 };
inline constexpr int kHostStoreKinds = 2;
const char* HostStoreName(HostStoreKind k);  // "pinned", "host_numa"

struct HostBlock {
  void* ptr = nullptr;
  size_t size = 0;  // rounded to HostPool::kAlign
  HostStoreKind store = HostStoreKind::kPinned;
  // Plain pageable memory (malloc), outside both pools: a graph-mode round ticket made while the pool
  // had no room (HostStore::TryAllocate). The engine copies it through PageableBounce only (the driver never sees it).
  bool pageable = false;
  explicit operator bool() const { return ptr != nullptr; }
  // Copies name it by unified address (cuMemcpyAsync), not as a host pointer.
  bool unified() const { return store == HostStoreKind::kHostNuma; }
};

// Where a pool's chunks come from. Get may round `size` up (to its granularity) and says how much it
// took; Put gives back exactly what Get returned. Both may call the driver; the pool never holds its
// lock across them.
class HostChunkSource {
 public:
  virtual ~HostChunkSource() = default;
  virtual Status Get(size_t size, void** base, size_t* got) = 0;
  virtual void Put(void* base, size_t size) = 0;
};
std::unique_ptr<HostChunkSource> MakePinnedSource(Backend b, int device);
std::unique_ptr<HostChunkSource> MakeHostNumaSource(Backend b, int device);  // host_numa.cc

struct HostPoolStats {
  int64_t chunk_bytes = 0;   // pinned bytes held from the driver
  int64_t in_use_bytes = 0;  // handed out
  int64_t peak_in_use_bytes = 0;         // since the pool was created
  int64_t window_peak_in_use_bytes = 0;  // since the last ResetPeak() (jaxvmm.reset_peaks())
  int64_t driver_allocs = 0;  // chunks taken from the driver so far (steady state: constant)
  int64_t driver_frees = 0;   // chunks given back (trim, a lowered limit)
  int64_t alloc_ns = 0;       // host time spent taking chunks from the driver, in total
  int64_t limit_bytes = 0;
  int64_t chunks = 0;
};

// engine_stats() keys after the store's prefix (pinned_, host_numa_).
inline constexpr StatField<HostPoolStats> kHostPoolStatsFields[] = {
    {"bytes", &HostPoolStats::chunk_bytes},
    {"in_use_bytes", &HostPoolStats::in_use_bytes},
    {"peak_in_use_bytes", &HostPoolStats::peak_in_use_bytes},
    {"window_peak_bytes", &HostPoolStats::window_peak_in_use_bytes},
    {"allocs", &HostPoolStats::driver_allocs},
    {"frees", &HostPoolStats::driver_frees},
    {"alloc_ns", &HostPoolStats::alloc_ns},
    {"limit_bytes", &HostPoolStats::limit_bytes},
};

class HostPool {
 public:
  static constexpr size_t kAlign = 4096;

  HostPool(Backend b, int device, HostStoreKind kind = HostStoreKind::kPinned);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  Status Allocate(size_t nbytes, HostBlock* out, size_t outside = 0);  // outside: as for TryAllocate
  // Carves from the chunks the pool already has, never taking one from the driver: *carved is false
  // when they have no room (an error only past the limit).
  // `outside`: bytes held elsewhere on the pool's behalf (pageable fallbacks) that count against the limit.
  Status TryAllocate(size_t nbytes, HostBlock* out, bool* carved, size_t outside = 0);
  // Takes chunks from the driver until at least `free_bytes` are free in the pool (within the limit).
  Status Reserve(size_t free_bytes);
  void Free(const HostBlock& block);
  // Returns chunks with nothing allocated in them to the driver; returns the bytes returned.
  size_t Trim();
  HostPoolStats Stats() const;
  void ResetPeak();  // window_peak_in_use_bytes := in_use_bytes
  HostStoreKind kind() const { return kind_; }

  // Process-wide settings (bytes; config.h: host_pool_limit, host_pool_chunk). A request larger than
  // a chunk gets a chunk of its own size. The limit bounds the bytes handed out and the bytes pinned:
  // lowering it below what a pool pins returns that pool's empty chunks at once (ShrinkAllToLimit, called
  // when the setting is set) and the others as their last block is freed; allocations past it fail with
  // kOutOfMemory.
  static size_t Limit();
  static size_t ChunkSize();  // rounded up to kAlign
  static void ShrinkAllToLimit();

 private:
  struct Chunk {
    char* base;
    size_t size;
    std::map<size_t, size_t> free;  // offset -> length, coalesced
    size_t used = 0;
  };
  Status AddChunk(size_t min_bytes, std::unique_lock<std::mutex>& lock);  // drops `lock` around the driver call
  bool Carve(Chunk& c, size_t n, HostBlock* out);
  Status CheckLimit(size_t n, size_t nbytes, size_t outside = 0) const;  // caller holds mu_
  bool CarveAny(size_t n, HostBlock* out);           // caller holds mu_; counts what it hands out
  void FreeLocked(const HostBlock& block);                 // caller holds mu_
  void RetireEmptyChunks(size_t limit);                    // caller holds mu_
  void DrainRetired(std::unique_lock<std::mutex>& lock);   // frees retired chunks; drops `lock` meanwhile
  void ShrinkToLimit();

  void PutChunk(void* base, size_t size);  // back to the source, in the device's context

  const Backend backend_;
  const int device_;
  const HostStoreKind kind_;
  const std::unique_ptr<HostChunkSource> source_;
  mutable std::mutex mu_;
  std::vector<Chunk> chunks_;
  HostPoolStats stats_;
  size_t growing_ = 0;  // bytes being pinned right now (counted against the limit)
  std::vector<void*> retired_;        // empty chunks out of the pool, not yet returned to the driver
  std::vector<size_t> retired_sizes_;
  size_t retired_bytes_ = 0;          // still counted in stats_.chunk_bytes
};

// What the engine uses: one pool per store kind (a pool takes nothing from the driver until used).
// Allocate draws from the store in force (Current: the host_store setting, config.h); Free returns a
// block to the pool it came from, so switching stores while tickets live is safe. The limit
// (HostPool::Limit) applies to each pool.
class HostStore {
 public:
  HostStore(Backend b, int device);
  Status Allocate(size_t nbytes, HostBlock* out);
  // From the store in force without taking memory from the driver (HostPool::TryAllocate).
  Status TryAllocate(size_t nbytes, HostBlock* out, bool* carved);
  Status Reserve(size_t free_bytes);  // the store in force (HostPool::Reserve)
  // A pageable block (null when malloc fails). Its bytes count against host_pool_limit (TryAllocate) until
  // it is freed, as the pinned ones do.
  HostBlock Pageable(size_t nbytes);
  void Free(const HostBlock& block);
  // Returns the host_numa pool's empty chunks (their pages; VAs stay reserved). The pinned pool keeps
  // its chunks (re-pinning is slow; lower host_pool_limit to shrink it). Returns the bytes returned.
  size_t Trim();
  HostPoolStats Stats(HostStoreKind k) const { return pool(k).Stats(); }
  void ResetPeak() {  // both pools' window peaks (jaxvmm.reset_peaks())
    pinned_.ResetPeak();
    numa_.ResetPeak();
  }

  static HostStoreKind Current();

 private:
  HostPool& pool(HostStoreKind k) { return k == HostStoreKind::kHostNuma ? numa_ : pinned_; }
  const HostPool& pool(HostStoreKind k) const { return k == HostStoreKind::kHostNuma ? numa_ : pinned_; }
  HostPool pinned_, numa_;
  std::atomic<size_t> pageable_bytes_{0};  // pageable blocks handed out and not freed yet
};

}  // namespace jaxvmm
