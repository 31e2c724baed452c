#include "vmm.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "config.h"

namespace jaxvmm {

CUresult CopyToDeviceNow(const DriverTable& d, CUdeviceptr dst, const void* src, size_t n) {
  CUresult r = d.MemcpyHtoD(dst, src, n);
  return r == CUDA_SUCCESS ? d.StreamSynchronize(nullptr) : r;
}

// ---- tracing and reports ----
bool TraceEnabled() { return EngineConfig::Get(Setting::kTrace) != 0; }

void TraceCall(int64_t slot, const char* stage, Entry entry, CUresult r, double micros) {
  std::fprintf(stderr, "jaxvmm-trace: slot %lld %s %s %s %.1f us\n", static_cast<long long>(slot), stage,
               EntryName(entry), ResultName(r), micros);
}

namespace {
std::atomic<int64_t> g_leaks{0};
}

void ReportLeak(const Status& st) {
  static std::mutex mu;
  static std::set<std::string> seen;
  g_leaks.fetch_add(1);
  std::string key = st.stage() + "|" + st.message();
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(key).second)
    std::fprintf(stderr, "%s (resource leaked; reported once)\n", st.ToString().c_str());
}

int64_t LeakCount() { return g_leaks.load(); }

// ---- context ----
namespace {
constexpr int kMaxDevices = 64;
std::mutex g_ctx_mu;
CUcontext g_primary[kMaxDevices] = {};
}  // namespace

ScopedContext::ScopedContext(Backend b, int device) : backend_(b) {
  if (b != Backend::kCuda) return;  // the POSIX backend has no contexts worth switching
  if (device < 0 || device >= kMaxDevices) {
    status_ = Status(Code::kInvalidArgument, "device ordinal " + std::to_string(device) + " out of range");
    return;
  }
  const DriverTable& d = Driver(b);
  CUcontext target;
  {
    std::lock_guard<std::mutex> lock(g_ctx_mu);
    if (g_primary[device] == nullptr) {
      CUdevice dev;
      CUresult r = d.DeviceGet(&dev, device);
      if (r != CUDA_SUCCESS) {
        status_ = Status::Driver(r, Entry::kDeviceGet);
        return;
      }
      r = d.DevicePrimaryCtxRetain(&g_primary[device], dev);
      if (r != CUDA_SUCCESS) {
        status_ = Status::Driver(r, Entry::kDevicePrimaryCtxRetain);
        return;
      }
    }
    target = g_primary[device];
  }
  CUresult r = d.CtxGetCurrent(&previous_);
  if (r != CUDA_SUCCESS) {
    status_ = Status::Driver(r, Entry::kCtxGetCurrent);
    return;
  }
  if (previous_ != target) {
    r = d.CtxSetCurrent(target);
    if (r != CUDA_SUCCESS) {
      status_ = Status::Driver(r, Entry::kCtxSetCurrent);
      return;
    }
    switched_ = true;
  }
}

ScopedContext::~ScopedContext() {
  if (switched_) Driver(backend_).CtxSetCurrent(previous_);
}

// ---- Reservation ----
Reservation& Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    if (owned()) {
      Status st = Free(-1, "reservation destructor");
      if (!st.ok()) ReportLeak(st);
    }
    backend_ = o.backend_;
    base_ = o.base_;
    size_ = o.size_;
    o.base_ = 0;
    o.size_ = 0;
  }
  return *this;
}

Reservation::~Reservation() {
  if (owned()) {
    Status st = Free(-1, "reservation destructor");
    if (!st.ok()) ReportLeak(st);
  }
}

Status Reservation::Reserve(Backend b, size_t size, size_t alignment, int64_t slot, const char* stage) {
  if (owned()) return Status(Code::kInternal, "reservation already owned");
  CUdeviceptr p = 0;
  const DriverTable& d = Driver(b);
  JAXVMM_RETURN_IF_ERROR(
      Call(slot, stage, Entry::kMemAddressReserve, [&] { return d.MemAddressReserve(&p, size, alignment, 0, 0); }));
  backend_ = b;
  base_ = p;
  size_ = size;
  return Status();
}

Status Reservation::Free(int64_t slot, const char* stage) {
  if (!owned()) return Status();
  const DriverTable& d = Driver(backend_);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemAddressFree, [&] { return d.MemAddressFree(base_, size_); }));
  base_ = 0;
  size_ = 0;
  return Status();
}

// ---- PhysicalMemory ----
PhysicalMemory& PhysicalMemory::operator=(PhysicalMemory&& o) noexcept {
  if (this != &o) {
    if (owned_) {
      Status st = Release(-1, "physical memory destructor");
      if (!st.ok()) ReportLeak(st);
    }
    backend_ = o.backend_;
    handle_ = o.handle_;
    owned_ = o.owned_;
    o.owned_ = false;
    o.handle_ = 0;
  }
  return *this;
}

PhysicalMemory::~PhysicalMemory() {
  if (owned_) {
    Status st = Release(-1, "physical memory destructor");
    if (!st.ok()) ReportLeak(st);
  }
}

Status PhysicalMemory::Create(Backend b, size_t size, const CUmemAllocationProp& prop, int64_t slot,
                              const char* stage) {
  if (owned_) return Status(Code::kInternal, "physical memory already owned");
  CUmemGenericAllocationHandle h = 0;
  const DriverTable& d = Driver(b);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemCreate, [&] { return d.MemCreate(&h, size, &prop, 0); }));
  backend_ = b;
  handle_ = h;
  owned_ = true;
  return Status();
}

Status PhysicalMemory::Import(Backend b, void* os_handle, CUmemAllocationHandleType type, int64_t slot,
                              const char* stage) {
  if (owned_) return Status(Code::kInternal, "physical memory already owned");
  CUmemGenericAllocationHandle h = 0;
  const DriverTable& d = Driver(b);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemImportFromShareableHandle,
                              [&] { return d.MemImportFromShareableHandle(&h, os_handle, type); }));
  backend_ = b;
  handle_ = h;
  owned_ = true;
  return Status();
}

Status PhysicalMemory::Release(int64_t slot, const char* stage) {
  if (!owned_) return Status();
  const DriverTable& d = Driver(backend_);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemRelease, [&] { return d.MemRelease(handle_); }));
  owned_ = false;
  handle_ = 0;
  return Status();
}

// ---- Mapping ----
Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (owned()) {
      Status st = Unmap(-1, "mapping destructor");
      if (!st.ok()) ReportLeak(st);
    }
    backend_ = o.backend_;
    base_ = o.base_;
    size_ = o.size_;
    o.base_ = 0;
    o.size_ = 0;
  }
  return *this;
}

Mapping::~Mapping() {
  if (owned()) {
    Status st = Unmap(-1, "mapping destructor");
    if (!st.ok()) ReportLeak(st);
  }
}

Status Mapping::Map(Backend b, CUdeviceptr base, size_t size, CUmemGenericAllocationHandle h, int64_t slot,
                    const char* stage) {
  if (owned()) return Status(Code::kInternal, "mapping already owned");
  const DriverTable& d = Driver(b);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemMap, [&] { return d.MemMap(base, size, 0, h, 0); }));
  backend_ = b;
  base_ = base;
  size_ = size;
  return Status();
}

Status Mapping::Unmap(int64_t slot, const char* stage) {
  if (!owned()) return Status();
  const DriverTable& d = Driver(backend_);
  JAXVMM_RETURN_IF_ERROR(Call(slot, stage, Entry::kMemUnmap, [&] { return d.MemUnmap(base_, size_); }));
  base_ = 0;
  size_ = 0;
  return Status();
}

Status GrantAccess(Backend b, CUdeviceptr base, size_t size, const std::vector<int>& devices, int64_t slot,
                   const char* stage) {
  constexpr size_t kMaxAccess = 64;
  if (devices.empty() || devices.size() > kMaxAccess)
    return Status(Code::kInvalidArgument, "access list must name 1 to 64 devices").At(slot, stage);
  CUmemAccessDesc desc[kMaxAccess] = {};
  for (size_t i = 0; i < devices.size(); ++i) {
    desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc[i].location.id = devices[i];
    desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  const DriverTable& d = Driver(b);
  return Call(slot, stage, Entry::kMemSetAccess, [&] { return d.MemSetAccess(base, size, desc, devices.size()); });
}

}  // namespace jaxvmm
