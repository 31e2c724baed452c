#include "bounce.h"

#include <cstring>
#include <thread>

#include "vmm.h"  // Call

namespace jaxvmm {

PageableBounce::~PageableBounce() {
  if (!buf_[0] && !buf_[1] && !done_[0] && !done_[1]) return;
  ScopedContext ctx(backend_, device_);
  const DriverTable& d = Driver(backend_);
  for (int i = 0; i < 2; ++i) {
    if (done_[i]) d.EventDestroy(done_[i]);
    if (buf_[i]) d.MemFreeHost(buf_[i]);
  }
}

Status PageableBounce::Init() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_) return Status();
  const DriverTable& d = Driver(backend_);
  const char* stage = "pageable bounce";
  for (int i = 0; i < 2; ++i) {
    if (!buf_[i])
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemHostAlloc, [&] { return d.MemHostAlloc(&buf_[i], kBufferBytes, 0); }));
    if (!done_[i])
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventCreate, [&] { return d.EventCreate(&done_[i], CU_EVENT_DISABLE_TIMING); }));
  }
  ready_ = true;
  return Status();
}

Status PageableBounce::Wait(int i, const char* stage) {
  if (!used_[i]) return Status();
  const DriverTable& d = Driver(backend_);
  for (int spins = 0;; ++spins) {
    CUresult r = d.EventQuery(done_[i]);
    if (r == CUDA_SUCCESS) break;
    if (r != CUDA_ERROR_NOT_READY) return Status::Driver(r, Entry::kEventQuery).At(-1, stage);
    if (spins > 64) std::this_thread::yield();
  }
  used_[i] = false;
  return Status();
}

Status PageableBounce::ToHost(CUstream s, void* dst, CUdeviceptr src, size_t n, const char* stage) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return Status(Code::kState, "pageable bounce buffers not made");
  const DriverTable& d = Driver(backend_);
  char* out = static_cast<char*>(dst);
  // Piece k goes D2H into buffer k % 2 while the CPU copies piece k - 1 out of the other one.
  size_t pending_off = 0, pending_n = 0;
  int pending = -1;
  auto drain = [&]() -> Status {
    if (pending < 0) return Status();
    JAXVMM_RETURN_IF_ERROR(Wait(pending, stage));
    std::memcpy(out + pending_off, buf_[pending], pending_n);
    pending = -1;
    return Status();
  };
  int i = 0;
  for (size_t off = 0; off < n; off += kBufferBytes, i ^= 1) {
    const size_t len = std::min(kBufferBytes, n - off);
    JAXVMM_RETURN_IF_ERROR(Wait(i, stage));  // (the other piece in flight uses buffer i ^ 1)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyDtoHAsync, [&] { return d.MemcpyDtoHAsync(buf_[i], src + off, len, s); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(done_[i], s); }));
    used_[i] = true;
    ++copies_;
    JAXVMM_RETURN_IF_ERROR(drain());
    pending = i, pending_off = off, pending_n = len;
  }
  return drain();
}

Status PageableBounce::FromHost(CUstream s, CUdeviceptr dst, const void* src, size_t n, const char* stage) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ready_) return Status(Code::kState, "pageable bounce buffers not made");
  const DriverTable& d = Driver(backend_);
  const char* in = static_cast<const char*>(src);
  int i = 0;
  for (size_t off = 0; off < n; off += kBufferBytes, i ^= 1) {
    const size_t len = std::min(kBufferBytes, n - off);
    JAXVMM_RETURN_IF_ERROR(Wait(i, stage));  // its previous H2D (or D2H) has read it
    std::memcpy(buf_[i], in + off, len);
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyHtoDAsync, [&] { return d.MemcpyHtoDAsync(dst + off, buf_[i], len, s); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(done_[i], s); }));
    used_[i] = true;
    ++copies_;
  }
  return Status();
}

}  // namespace jaxvmm
