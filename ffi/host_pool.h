// Pinned host store: page-locked host memory for offloaded data, taken from the driver in large
// chunks (cuMemHostAlloc costs ~0.6 s per GiB on H200) and reused across steps. A cap bounds the total;
// hitting it is an error returned to the caller, never an OOM kill.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

struct HostBlock {
  void* ptr = nullptr;
  size_t size = 0;  // rounded to kHostAlign
  explicit operator bool() const { return ptr != nullptr; }
};

struct HostPoolStats {
  int64_t chunk_bytes = 0;   // pinned bytes held from the driver
  int64_t in_use_bytes = 0;  // handed out
  int64_t peak_in_use_bytes = 0;         // since the pool was created
  int64_t window_peak_in_use_bytes = 0;  // since the last ResetPeak() (jaxvmm.reset_peaks())
  int64_t driver_allocs = 0;  // cuMemHostAlloc calls so far (steady state: constant)
  int64_t limit_bytes = 0;
  int64_t chunks = 0;
};

class HostPool {
 public:
  static constexpr size_t kAlign = 4096;

  HostPool(Backend b, int device);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  Status Allocate(size_t nbytes, HostBlock* out);
  void Free(const HostBlock& block);
  // Returns chunks with nothing allocated in them to the driver.
  void Trim();
  HostPoolStats Stats() const;
  void ResetPeak();  // window_peak_in_use_bytes := in_use_bytes

  // Process-wide knobs (bytes). The default limit is half of physical memory; the default chunk is
  // 256 MiB (a larger request gets a chunk of its own size). The limit bounds the bytes handed out and
  // the bytes pinned: lowering it below what a pool pins returns that pool's empty chunks at once and
  // the others as their last block is freed; allocations past it fail with kOutOfMemory.
  static void SetLimit(size_t bytes);
  static void SetChunkSize(size_t bytes);
  static size_t Limit();
  static size_t ChunkSize();

 private:
  struct Chunk {
    char* base;
    size_t size;
    std::map<size_t, size_t> free;  // offset -> length, coalesced
    size_t used = 0;
  };
  Status AddChunk(size_t min_bytes, std::unique_lock<std::mutex>& lock);  // drops `lock` around the driver call
  bool Carve(Chunk& c, size_t n, HostBlock* out);
  void FreeLocked(const HostBlock& block);                 // caller holds mu_
  void RetireEmptyChunks(size_t limit);                    // caller holds mu_
  void DrainRetired(std::unique_lock<std::mutex>& lock);   // frees retired chunks; drops `lock` meanwhile
  void ShrinkToLimit();

  const Backend backend_;
  const int device_;
  mutable std::mutex mu_;
  std::vector<Chunk> chunks_;
  HostPoolStats stats_;
  size_t growing_ = 0;  // bytes being pinned right now (counted against the limit)
  std::vector<void*> retired_;        // empty chunks out of the pool, not yet returned to the driver
  std::vector<size_t> retired_sizes_;
  size_t retired_bytes_ = 0;          // still counted in stats_.chunk_bytes
};

}  // namespace jaxvmm
