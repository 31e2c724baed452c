#include "transfers.h"

#include <algorithm>
#include <new>

#include "config.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

// Calls copy(offset, bytes) for consecutive pieces of at most `chunk` bytes (0: one piece).
template <typename F>
Status InPieces(size_t nbytes, size_t chunk, F&& copy) {
  if (chunk == 0 || chunk >= nbytes) return copy(size_t{0}, nbytes);
  for (size_t off = 0; off < nbytes; off += chunk) JAXVMM_RETURN_IF_ERROR(copy(off, std::min(chunk, nbytes - off)));
  return Status();
}

}  // namespace

Source SourceOf(const Ticket& t) {
  Source src;
  if (t.resident) {
    src.resident = t.resident.address;
    src.resident_ready = t.resident.wait;
  }
  src.d2h_done = t.d2h_done;
  src.d2h_seq = t.d2h_seq;
  src.host = t.host.ptr;
  src.unified = t.host.unified();
  src.pageable = t.host.pageable;
  return src;
}

Transfers::~Transfers() {
  if (!clock_) return;
  ScopedContext ctx(backend_, device_);  // a member: the engine's own context is gone by now
  GiveBack("transfers teardown", Entry::kMemFreeHost, [&] { return Driver(backend_).MemFreeHost(clock_); });
}

Status Transfers::Init() {
  void* word = nullptr;
  JAXVMM_RETURN_IF_ERROR(Call(-1, "engine init", Entry::kMemHostAlloc, [&] {
    return Driver(backend_).MemHostAlloc(&word, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
  }));
  clock_ = new (word) std::atomic<uint64_t>(0);
  return Status();
}

bool Transfers::D2hDone(const Ticket& t) const {
  if (t.d2h_seq) return ClockReached(t.d2h_seq);
  return t.d2h_done && Driver(backend_).EventQuery(t.d2h_done) == CUDA_SUCCESS;
}

Status Transfers::CopyToHost(CUstream s, const HostBlock& host, CUdeviceptr src, size_t nbytes, const char* stage) const {
  const DriverTable& d = Driver(backend_);
  char* dst = static_cast<char*>(host.ptr);
  return InPieces(nbytes, EngineConfig::CopyChunk(), [&](size_t off, size_t n) {
    if (host.unified())
      return Call(-1, stage, Entry::kMemcpyAsync,
                  [&] { return d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst + off), src + off, n, s); });
    return Call(-1, stage, Entry::kMemcpyDtoHAsync, [&] { return d.MemcpyDtoHAsync(dst + off, src + off, n, s); });
  });
}

Status Transfers::CopyFromHost(CUstream s, CUdeviceptr dst, const void* src, bool unified, size_t nbytes, const char* stage) const {
  const DriverTable& d = Driver(backend_);
  const char* from = static_cast<const char*>(src);
  return InPieces(nbytes, EngineConfig::CopyChunk(), [&](size_t off, size_t n) {
    if (unified)
      return Call(-1, stage, Entry::kMemcpyAsync,
                  [&] { return d.MemcpyAsync(dst + off, reinterpret_cast<CUdeviceptr>(from + off), n, s); });
    return Call(-1, stage, Entry::kMemcpyHtoDAsync, [&] { return d.MemcpyHtoDAsync(dst + off, from + off, n, s); });
  });
}

Status Transfers::CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, PageableBounce& bounce,
                             const char* stage) const {
  const DriverTable& d = Driver(backend_);
  if (src.resident) {
    if (src.resident_ready)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.resident_ready, 0); }));
    return Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(dst, src.resident, nbytes, s); });
  }
  if (src.d2h_seq)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(s, graph_clock_address(), src.d2h_seq, CU_STREAM_WAIT_VALUE_GEQ);
    }));
  else if (src.d2h_done)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.d2h_done, 0); }));
  if (src.pageable) return bounce.FromHost(s, dst, src.host, nbytes, stage);
  return CopyFromHost(s, dst, src.host, src.unified, nbytes, stage);
}

}  // namespace jaxvmm
