// VMM handles: one move-only RAII type per driver step, each knowing its undo call.
//
//   Reservation       cuMemAddressReserve  / cuMemAddressFree
//   PhysicalMemory    cuMemCreate          / cuMemRelease
//   Mapping           cuMemMap             / cuMemUnmap
//
// Undo is explicit (`Free`, `Release`, `Unmap`) and commits ownership only on success, so a retry after
// a failure never repeats a finished step and never double-releases. A destructor that still owns
// something tries its undo once and reports a failure through ReportLeak (never throws).
// Also here: the traced driver call used by every lifecycle stage, and the scoped CUDA context.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "driver.h"
#include "status.h"

namespace jaxvmm {

// ---- traced driver calls ----
bool TraceEnabled();  // the trace setting (config.h)
void TraceCall(int64_t slot, const char* stage, Entry entry, CUresult r, double micros);

// Runs one driver call for `slot`'s `stage`; logs it while tracing (TraceEnabled); converts failure to Status.
template <typename F>
Status Call(int64_t slot, const char* stage, Entry entry, F&& fn) {
  CUresult r;
  if (!TraceEnabled()) {
    r = fn();
  } else {
    auto t0 = std::chrono::steady_clock::now();
    r = fn();
    auto t1 = std::chrono::steady_clock::now();
    TraceCall(slot, stage, entry, r, std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  if (r == CUDA_SUCCESS) return Status();
  return Status::Driver(r, entry).At(slot, stage);
}

// A synchronous host -> device copy whose bytes every stream sees when it returns. cuMemcpyHtoD from
// pageable memory returns once the bytes are staged; their DMA may still run on the legacy stream, which
// work on other (non-blocking) streams does not wait for. This also synchronizes the legacy stream.
CUresult CopyToDeviceNow(const DriverTable& d, CUdeviceptr dst, const void* src, size_t n);

// Non-raising report channel for destructors and background teardown: logs once per message kind
// and counts; the count shows in stats()["leaked"].
void ReportLeak(const Status& st);
int64_t LeakCount();

// Gives a driver object back (a destroy, free or unload in a destructor): a failure cannot be returned,
// so it is reported as a leak (stats()["leaked"]) instead of being dropped.
template <typename F>
void GiveBack(const char* what, Entry entry, F&& fn) {
  Status st = Call(-1, what, entry, std::forward<F>(fn));
  if (!st.ok()) ReportLeak(st);
}

// ---- context ----
// Makes `device`'s primary context current on this thread for the guard's lifetime (CUDA), restoring
// the previous one after. The primary context is retained once per device and kept (jax shares it).
class ScopedContext {
 public:
  ScopedContext(Backend b, int device);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  const Status& status() const { return status_; }

 private:
  Backend backend_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
  Status status_;
};

// ---- handles ----
class Reservation {
 public:
  Reservation() = default;
  Reservation(Reservation&& o) noexcept { *this = std::move(o); }
  Reservation& operator=(Reservation&& o) noexcept;
  ~Reservation();

  Status Reserve(Backend b, size_t size, size_t alignment, int64_t slot, const char* stage);
  Status Free(int64_t slot, const char* stage);

  bool owned() const { return base_ != 0; }
  CUdeviceptr base() const { return base_; }
  size_t size() const { return size_; }

 private:
  Backend backend_ = Backend::kPosix;
  CUdeviceptr base_ = 0;
  size_t size_ = 0;
};

class PhysicalMemory {
 public:
  PhysicalMemory() = default;
  PhysicalMemory(PhysicalMemory&& o) noexcept { *this = std::move(o); }
  PhysicalMemory& operator=(PhysicalMemory&& o) noexcept;
  ~PhysicalMemory();

  Status Create(Backend b, size_t size, const CUmemAllocationProp& prop, int64_t slot, const char* stage);
  // cuMemImportFromShareableHandle: `os_handle` is the descriptor (as a pointer-sized integer) for POSIX
  // file descriptors, or points at a CUmemFabricHandle. The descriptor is borrowed, never closed here; the
  // imported handle needs its own Release, like a created one.
  Status Import(Backend b, void* os_handle, CUmemAllocationHandleType type, int64_t slot, const char* stage);
  Status Release(int64_t slot, const char* stage);

  bool owned() const { return owned_; }
  CUmemGenericAllocationHandle handle() const { return handle_; }

 private:
  Backend backend_ = Backend::kPosix;
  CUmemGenericAllocationHandle handle_ = 0;
  bool owned_ = false;
};

class Mapping {
 public:
  Mapping() = default;
  Mapping(Mapping&& o) noexcept { *this = std::move(o); }
  Mapping& operator=(Mapping&& o) noexcept;
  ~Mapping();

  Status Map(Backend b, CUdeviceptr base, size_t size, CUmemGenericAllocationHandle h, int64_t slot,
             const char* stage);
  Status Unmap(int64_t slot, const char* stage);

  bool owned() const { return size_ != 0; }
  CUdeviceptr base() const { return base_; }
  size_t size() const { return size_; }

 private:
  Backend backend_ = Backend::kPosix;
  CUdeviceptr base_ = 0;
  size_t size_ = 0;
};

// One cuMemSetAccess call granting read/write on [base, base+size) to every device in `devices`.
Status GrantAccess(Backend b, CUdeviceptr base, size_t size, const std::vector<int>& devices, int64_t slot,
                   const char* stage);

}  // namespace jaxvmm
