// Driver seam: the one table of every CUDA driver entry point jaxvmm uses.
//
// Three implementations share the table's signatures:
//   * the real driver, resolved at run time (dlopen("libcuda.so.1") + cuGetProcAddress);
//   * a POSIX host backend with the same VMM semantics (driver_posix.cc);
//   * a fault-injecting, counting wrapper over either (fault.cc). The engine only ever calls
//     through the wrapper, so production and the fault-matrix tests run the same code path.
//
// This header is the bottom of the include graph: it sees only cuda.h / cudaTypedefs.h.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

namespace jaxvmm {

// X(member, driver version of the PFN typedef). The symbol is "cu" #member; the type is
// PFN_cu<member>_v<version>. Members drop the "cu" prefix so cuda.h's _v2 renaming macros never apply.
#define JAXVMM_DRIVER_ENTRIES(X)                 \
  /* init, devices, contexts, errors */          \
  X(Init, 2000)                                  \
  X(DriverGetVersion, 2020)                      \
  X(DeviceGet, 2000)                             \
  X(DeviceGetCount, 2000)                        \
  X(DeviceGetAttribute, 2000)                    \
  X(DevicePrimaryCtxRetain, 7000)                \
  X(DevicePrimaryCtxRelease, 11000)              \
  X(CtxGetCurrent, 4000)                         \
  X(CtxSetCurrent, 4000)                         \
  X(GetErrorName, 6000)                          \
  X(GetErrorString, 6000)                        \
  /* virtual memory management */                \
  X(MemGetAllocationGranularity, 10020)          \
  X(MemAddressReserve, 10020)                    \
  X(MemAddressFree, 10020)                       \
  X(MemCreate, 10020)                            \
  X(MemRelease, 10020)                           \
  X(MemMap, 10020)                               \
  X(MemUnmap, 10020)                             \
  X(MemSetAccess, 10020)                         \
  X(MemGetInfo, 3020)                            \
  X(MemExportToShareableHandle, 10020)           \
  X(MemImportFromShareableHandle, 10020)         \
  X(MemGetAllocationPropertiesFromHandle, 10020) \
  /* synchronous copies (Slot.read / Slot.write) */ \
  X(MemcpyHtoD, 3020)                            \
  X(MemcpyDtoH, 3020)                            \
  /* streams, events, async copies, stream memory ops (offload engine) */ \
  X(StreamCreateWithPriority, 5050)              \
  X(StreamDestroy, 4000)                         \
  X(StreamSynchronize, 2000)                     \
  X(CtxSynchronize, 2000)                        \
  X(StreamQuery, 2000)                           \
  X(StreamWaitEvent, 3020)                       \
  X(StreamWaitValue64, 11070)                    \
  X(StreamWriteValue64, 11070)                   \
  X(EventCreate, 2000)                           \
  X(EventRecord, 2000)                           \
  X(EventQuery, 2000)                            \
  X(EventDestroy, 4000)                          \
  X(MemcpyAsync, 4000)                           \
  X(MemcpyHtoDAsync, 3020)                       \
  X(MemcpyDtoHAsync, 3020)                       \
  X(MemcpyDtoDAsync, 3020)                       \
  X(MemsetD8Async, 3020)                         \
  X(MemHostAlloc, 2020)                          \
  X(MemFreeHost, 2000)                           \
  X(MemAlloc, 3020)                              \
  X(MemFree, 3020)                               \
  /* graph mode: the grant kernels (PTX loaded at run time, ffi/graph_kernels.h) */ \
  X(ModuleLoadData, 2000)                        \
  X(ModuleUnload, 2000)                          \
  X(ModuleGetFunction, 2000)                     \
  X(LaunchKernel, 4000)                          \
  X(LaunchKernelEx, 11060)                       \
  /* graph mode: the engine asks whether XLA is capturing; tests capture and replay themselves */ \
  X(StreamIsCapturing, 10000)                    \
  X(StreamBeginCapture, 10010)                   \
  X(StreamEndCapture, 10000)                     \
  X(GraphInstantiateWithFlags, 11040)            \
  X(GraphLaunch, 10000)                          \
  X(GraphExecDestroy, 10000)                     \
  X(GraphDestroy, 10000)

#define JAXVMM_PFN(member, version) PFN_cu##member##_v##version

enum class Entry : int {
#define X(member, version) k##member,
  JAXVMM_DRIVER_ENTRIES(X)
#undef X
      kCount
};
inline constexpr int kEntryCount = static_cast<int>(Entry::kCount);

// Symbol name ("cuMemCreate") of an entry, and the reverse lookup (-1 when unknown).
const char* EntryName(Entry e);
int EntryFromName(const std::string& name);

struct DriverTable {
#define X(member, version) JAXVMM_PFN(member, version) member = nullptr;
  JAXVMM_DRIVER_ENTRIES(X)
#undef X
};

// Which implementation backs a table. kCuda serves jax "gpu" devices, kPosix serves jax "cpu" devices.
enum class Backend : int { kCuda = 0, kPosix = 1 };
inline constexpr int kBackendCount = 2;
const char* BackendName(Backend b);

// Availability of a backend's raw implementation. `reason` says why it is unusable (no libcuda, driver
// too old, cuInit failed, ...). Resolution happens once; the answer is cached.
struct DriverAvailability {
  bool ok = false;
  std::string reason;
  int driver_version = 0;  // CUDA: cuDriverGetVersion; POSIX: 0
};
const DriverAvailability& Availability(Backend b);

// The raw tables. Raw(kCuda) has null entries when unavailable (check Availability first).
const DriverTable& RawCudaDriver();
const DriverTable& RawPosixDriver();
const DriverTable& RawDriver(Backend b);

// The table the engine calls: the fault-injecting, counting wrapper over the raw table of `b`.
const DriverTable& Driver(Backend b);

// Name of a CUresult ("CUDA_ERROR_OUT_OF_MEMORY"); never null, works without a driver.
const char* ResultName(CUresult r);
// CUresult from its name; returns false if the name is unknown.
bool ResultFromName(const std::string& name, CUresult* out);

// POSIX backend knobs (set from Python before the first slot on the cpu platform).
void SetPosixDeviceCount(int n);
// jax's ids of this process's cpu devices, in local order. XLA names a cpu device to an FFI handler by its
// id, which is the local index only in a single process (with jax.distributed, process p's ids differ).
void SetPosixDeviceIds(const int64_t* ids, int n);
int PosixLocalOrdinal(int ffi_ordinal);  // the local index of that id; the ordinal itself if unknown

// Test hook (POSIX backend): `fn(arg)` runs once, right after the next jaxvmm_take_offload kernel took
// its grant and before the round goes on (on the replaying thread). Orders a revocation after a take
// deterministically. nullptr clears it.
void SetPosixAfterTakeHook(void (*fn)(void*), void* arg);

// Test hook (POSIX backend): device-location cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY once the
// live device-location handles would exceed `bytes` (a device whose memory XLA holds); < 0: no limit.
void SetPosixDeviceMemoryLimit(int64_t bytes);
// Test hook: device-location bytes of the live handles the cpu backend created (what the limit counts).
int64_t PosixDeviceBytes();

// Test hook (POSIX backend): how many asynchronous copies were given a pageable (not cuMemHostAlloc'd)
// host pointer since the process started. jaxvmm never does that (PageableBounce).
int64_t PosixPageableCopies();

}  // namespace jaxvmm
