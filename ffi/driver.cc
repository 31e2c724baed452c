// Entry names, error names, and run-time resolution of the real CUDA driver.
#include "driver.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>

namespace jaxvmm {
namespace {

constexpr const char* kEntryNames[] = {
#define X(member, version) "cu" #member,
    JAXVMM_DRIVER_ENTRIES(X)
#undef X
};

constexpr int kEntryVersions[] = {
#define X(member, version) version,
    JAXVMM_DRIVER_ENTRIES(X)
#undef X
};

struct ResultNameEntry {
  CUresult code;
  const char* name;
};
// The codes the engine can meet or inject. Kept local so names work with no driver at all.
#define JAXVMM_RESULT(name) {name, #name}
constexpr ResultNameEntry kResultNames[] = {
    JAXVMM_RESULT(CUDA_SUCCESS),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_VALUE),
    JAXVMM_RESULT(CUDA_ERROR_OUT_OF_MEMORY),
    JAXVMM_RESULT(CUDA_ERROR_NOT_INITIALIZED),
    JAXVMM_RESULT(CUDA_ERROR_DEINITIALIZED),
    JAXVMM_RESULT(CUDA_ERROR_NO_DEVICE),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_DEVICE),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_CONTEXT),
    JAXVMM_RESULT(CUDA_ERROR_ALREADY_MAPPED),
    JAXVMM_RESULT(CUDA_ERROR_NOT_MAPPED),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_HANDLE),
    JAXVMM_RESULT(CUDA_ERROR_NOT_FOUND),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_IMAGE),
    JAXVMM_RESULT(CUDA_ERROR_INVALID_PTX),
    JAXVMM_RESULT(CUDA_ERROR_UNSUPPORTED_PTX_VERSION),
    JAXVMM_RESULT(CUDA_ERROR_NOT_READY),
    JAXVMM_RESULT(CUDA_ERROR_ILLEGAL_ADDRESS),
    JAXVMM_RESULT(CUDA_ERROR_LAUNCH_FAILED),
    JAXVMM_RESULT(CUDA_ERROR_LAUNCH_TIMEOUT),
    JAXVMM_RESULT(CUDA_ERROR_NOT_PERMITTED),
    JAXVMM_RESULT(CUDA_ERROR_NOT_SUPPORTED),
    JAXVMM_RESULT(CUDA_ERROR_SYSTEM_NOT_READY),
    JAXVMM_RESULT(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
    JAXVMM_RESULT(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
    JAXVMM_RESULT(CUDA_ERROR_OPERATING_SYSTEM),
    JAXVMM_RESULT(CUDA_ERROR_UNKNOWN),
};
#undef JAXVMM_RESULT

DriverTable g_cuda;  // raw CUDA table, filled once by ResolveCuda()
DriverAvailability g_cuda_availability;

void ResolveCuda() {
  DriverAvailability& a = g_cuda_availability;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    a.reason = std::string("libcuda.so.1 could not be loaded (") + (why ? why : "unknown") +
               "); no NVIDIA driver on this machine";
    return;
  }
  // cuGetProcAddress_v2 (driver >= 12.0) is the only symbol taken with dlsym; everything else comes
  // through it, at the ABI version of the typedef the table was written against.
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    a.reason = "the NVIDIA driver is older than CUDA 12.0 (no cuGetProcAddress_v2); jaxvmm needs >= 12.0";
    return;
  }
  DriverTable t;
  void** slots = reinterpret_cast<void**>(&t);
  for (int i = 0; i < kEntryCount; ++i) {
    void* fn = nullptr;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get_proc(kEntryNames[i], &fn, kEntryVersions[i], CU_GET_PROC_ADDRESS_DEFAULT, &found);
    if (r != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS || fn == nullptr) {
      a.reason = std::string("the NVIDIA driver does not provide ") + kEntryNames[i] + " (version " +
                 std::to_string(kEntryVersions[i]) + ")";
      return;
    }
    slots[i] = fn;
  }
  CUresult r = t.Init(0);
  if (r != CUDA_SUCCESS) {
    a.reason = std::string("cuInit failed: ") + ResultName(r);
    return;
  }
  int count = 0;
  r = t.DeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count == 0) {
    a.reason = std::string("no CUDA device is visible (cuDeviceGetCount: ") + ResultName(r) + ", " +
               std::to_string(count) + " devices)";
    return;
  }
  t.DriverGetVersion(&a.driver_version);
  g_cuda = t;
  a.ok = true;
}

static_assert(sizeof(DriverTable) == sizeof(void*) * kEntryCount, "DriverTable must be a plain array of entries");

}  // namespace

const char* EntryName(Entry e) {
  int i = static_cast<int>(e);
  return (i >= 0 && i < kEntryCount) ? kEntryNames[i] : "cu?";
}

int EntryFromName(const std::string& name) {
  for (int i = 0; i < kEntryCount; ++i)
    if (name == kEntryNames[i]) return i;
  return -1;
}

const char* BackendName(Backend b) { return b == Backend::kCuda ? "cuda" : "posix"; }

const char* ResultName(CUresult r) {
  for (const auto& e : kResultNames)
    if (e.code == r) return e.name;
  return "CUDA_ERROR_UNRECOGNIZED";
}

bool ResultFromName(const std::string& name, CUresult* out) {
  for (const auto& e : kResultNames) {
    if (name == e.name) {
      *out = e.code;
      return true;
    }
  }
  return false;
}

const DriverAvailability& Availability(Backend b) {
  static std::once_flag once;
  if (b == Backend::kPosix) {
    static const DriverAvailability posix{true, "", 0};
    return posix;
  }
  std::call_once(once, ResolveCuda);
  return g_cuda_availability;
}

const DriverTable& RawCudaDriver() {
  Availability(Backend::kCuda);
  return g_cuda;
}

const DriverTable& RawDriver(Backend b) { return b == Backend::kCuda ? RawCudaDriver() : RawPosixDriver(); }

}  // namespace jaxvmm
