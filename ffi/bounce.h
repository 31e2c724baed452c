// Pageable bounce: copies between device memory and pageable host memory (malloc) through two pinned
// buffers, so that the driver never gets a pageable pointer for an asynchronous copy.
//
// Why: a graph-mode round ticket the pinned pool has no room for lives in pageable memory
// (RoundHostSupply::Allocate). Given such a pointer, cuMemcpyDtoHAsync/HtoDAsync "might be synchronous"
// with the host (the poller would wait inside the driver's staging) and the driver documents no order
// between those staged bytes and the memops jaxvmm orders its copies with. Here the CPU moves the
// pageable bytes (memcpy) and the DMA engine sees pinned memory only.
//
// Threads: any (the graph poller, the reload resolver); one copy at a time (mu_). A copy waits only for
// the bounce buffer's previous copy, on the stream that copy ran on (cuEventQuery, no cuEventSynchronize),
// and ToHost for its own D2H: callers pass streams that wait for nothing of XLA's in front of that.
// Init makes the buffers and events (cuMemHostAlloc, cuEventCreate): call it where those calls are safe
// (the initialize stage), never on the poller (DESIGN.md, driver facts).
#pragma once

#include <cstddef>
#include <mutex>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

class PageableBounce {
 public:
  static constexpr size_t kBufferBytes = size_t{4} << 20;

  PageableBounce(Backend b, int device) : backend_(b), device_(device) {}
  ~PageableBounce();  // the owner has synchronized the streams the buffers were used on
  PageableBounce(const PageableBounce&) = delete;
  PageableBounce& operator=(const PageableBounce&) = delete;

  Status Init();  // idempotent; the buffers and their events
  bool ready() const { return ready_; }

  // Device -> pageable host on `s`: returns once every byte is in `dst`.
  Status ToHost(CUstream s, void* dst, CUdeviceptr src, size_t n, const char* stage);
  // Pageable host -> device on `s`: returns once every byte of `src` was read (the H2Ds out of the
  // buffers run on `s` in order; what `s` runs after them sees the bytes).
  Status FromHost(CUstream s, CUdeviceptr dst, const void* src, size_t n, const char* stage);

  int64_t copies() const { return copies_; }  // pieces moved (stats)

 private:
  Status Wait(int i, const char* stage);  // buffer i's last copy has finished

  const Backend backend_;
  const int device_;
  std::mutex mu_;
  bool ready_ = false;
  void* buf_[2] = {nullptr, nullptr};
  CUevent done_[2] = {nullptr, nullptr};  // recorded after the last copy out of / into buffer i
  bool used_[2] = {false, false};
  int64_t copies_ = 0;
};

}  // namespace jaxvmm
