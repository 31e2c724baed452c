// POSIX host backend: the driver table implemented with the kernel's virtual memory, with the CUDA VMM
// semantics the engine relies on.
//
//   reservation      mmap(PROT_NONE, MAP_NORESERVE) of the exact (base, size)
//   physical handle  a "home" mapping of shared memory, pages committed at create (cuMemCreate commits
//                    memory too), PROT_NONE. No file descriptor is held for the handle's life: an
//                    anonymous MAP_SHARED mapping needs none. Only a handle created with
//                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested (or imported from one) keeps a
//                    memfd, because exporting it needs one.
//   map              mremap(home, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, va): old_size 0 duplicates a
//                    shared mapping, so the same pages appear at the reserved VA, PROT_NONE (no access
//                    until SetAccess)
//   set access       mprotect(READ|WRITE) of exactly mapped ranges
//   unmap            MAP_FIXED anonymous PROT_NONE over the range: the VA stays reserved, touching faults
//   release          munmap(home) (and close the memfd if one was kept): pages go back to the kernel once
//                    the last mapping is gone
//
// Streams are synchronous here: every "async" copy completes before the call returns, host functions
// run inline, events are always complete. A capturing stream records its operations instead; a
// launched graph replays them in order (graph mode tests). The bookkeeping below validates arguments the way the driver
// does (exact ranges, whole mappings, granularity) so the engine cannot pass CI by luck.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <thread>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "config.h"
#include "driver.h"
#include "graph_words.h"  // DeviceWords: the grant kernels' words

namespace jaxvmm {
namespace {

std::atomic<int> g_device_count{1};

struct Physical {
  void* home;   // PROT_NONE shared mapping that owns the pages while the handle lives
  size_t size;
  int fd;       // -1 unless the handle is exportable (POSIX file descriptor requested or imported)
  CUmemAllocationProp prop;  // as created, or as decoded from an imported memfd's name
  bool device_bytes = false;  // counted in PosixState::device_bytes (created at a device location)
};

// An exportable handle's memfd is named "jaxvmm-slot:<location type>:<location id>", so an importer can
// answer cuMemGetAllocationPropertiesFromHandle as the driver does, and a descriptor that is not such a
// memfd (a file, a pipe, someone else's memfd) is refused at import, as the driver refuses one that is
// not an allocation's.
constexpr const char kMemfdPrefix[] = "jaxvmm-slot:";

std::string MemfdName(const CUmemLocation& loc) {
  return std::string(kMemfdPrefix) + std::to_string(static_cast<int>(loc.type)) + ":" + std::to_string(loc.id);
}

// Decodes the location from /proc/self/fd/N -> "/memfd:jaxvmm-slot:T:I (deleted)"; false if not ours.
bool LocationOfMemfd(int fd, CUmemLocation* loc) {
  char link[64], target[256];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  const char* p = std::strstr(target, kMemfdPrefix);
  if (std::strncmp(target, "/memfd:", 7) != 0 || p != target + 7) return false;
  int type = -1, id = -1;
  if (std::sscanf(p + sizeof(kMemfdPrefix) - 1, "%d:%d", &type, &id) != 2) return false;
  if (type != CU_MEM_LOCATION_TYPE_DEVICE && type != CU_MEM_LOCATION_TYPE_HOST_NUMA) return false;
  loc->type = static_cast<CUmemLocationType>(type);
  loc->id = id;
  return true;
}

// An fd the process could not open is not "out of memory": EMFILE/ENFILE are reported as an operating
// system failure so nobody raises a limit that is not the problem.
CUresult FdError(int err) { return err == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM; }

// Maps `size` bytes of shared memory (of `fd`, or anonymous when fd < 0) with every page committed, then
// drops all access to it: the home mapping only keeps the pages alive.
CUresult MapHome(int fd, size_t size, bool populate, void** home) {
  int flags = MAP_SHARED | (fd < 0 ? MAP_ANONYMOUS : 0) | (populate ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  if (mprotect(p, size, PROT_NONE) != 0) {
    munmap(p, size);
    return CUDA_ERROR_OPERATING_SYSTEM;
  }
  *home = p;
  return CUDA_SUCCESS;
}

void DropPhysical(const Physical& ph) {
  munmap(ph.home, ph.size);  // pages mapped elsewhere stay alive until their last unmap
  if (ph.fd >= 0) close(ph.fd);
}

struct PosixState {
  std::mutex mu;
  std::map<uintptr_t, size_t> reservations;       // base -> size
  std::map<uintptr_t, size_t> mappings;           // base -> size
  std::unordered_map<uint64_t, Physical> handles;  // handle -> home mapping
  std::unordered_map<uintptr_t, size_t> host_allocs;
  std::unordered_map<uintptr_t, size_t> device_allocs;  // cuMemAlloc
  std::unordered_set<void*> streams;                     // PosixStream* (cuCtxSynchronize lands their D2Hs)
  uint64_t next_handle = 1;
  int64_t device_bytes = 0;  // live device-location handles created here (SetPosixDeviceMemoryLimit)
};

std::atomic<int64_t> g_device_limit{-1};

PosixState& S() {
  static PosixState* s = new PosixState();  // never destroyed: slots may be torn down at exit
  return *s;
}

size_t PageSize() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

thread_local CUcontext t_current = nullptr;

// Fake contexts: one distinct non-null pointer per ordinal.
char g_contexts[256];

// /proc/meminfo without iostreams (a statically linked libstdc++ beside jaxlib's can break them).
bool ReadMeminfo(size_t* available, size_t* total) {
  char buf[8192];
  int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
  if (fd >= 0) close(fd);
  unsigned long long t = 0, a = 0;
  if (n > 0) {
    buf[n] = '\0';
    if (const char* p = std::strstr(buf, "MemTotal:")) t = std::strtoull(p + 9, nullptr, 10) * 1024;
    if (const char* p = std::strstr(buf, "MemAvailable:")) a = std::strtoull(p + 13, nullptr, 10) * 1024;
  }
  if (t == 0) {  // no procfs: the C library's view
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    if (pages <= 0) return false;
    t = static_cast<unsigned long long>(pages) * PageSize();
    a = static_cast<unsigned long long>(avail > 0 ? avail : 0) * PageSize();
  }
  *total = static_cast<size_t>(t);
  *available = static_cast<size_t>(a ? a : t);
  return true;
}

bool ValidLocation(const CUmemLocation& loc) {
  if (loc.type == CU_MEM_LOCATION_TYPE_DEVICE) return loc.id >= 0 && loc.id < g_device_count.load();
  if (loc.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    if (loc.id == 0) return true;
    struct stat st;
    std::string node = "/sys/devices/system/node/node" + std::to_string(loc.id);
    return loc.id > 0 && stat(node.c_str(), &st) == 0;
  }
  return false;
}

// True if [base, base+size) lies inside one reservation.
bool InReservation(PosixState& s, uintptr_t base, size_t size) {
  auto it = s.reservations.upper_bound(base);
  if (it == s.reservations.begin()) return false;
  --it;
  return base >= it->first && base + size <= it->first + it->second;
}

// True if [base, base+size) is exactly covered by whole mappings.
bool CoveredByMappings(PosixState& s, uintptr_t base, size_t size) {
  uintptr_t at = base, end = base + size;
  while (at < end) {
    auto it = s.mappings.find(at);
    if (it == s.mappings.end() || at + it->second > end) return false;
    at += it->second;
  }
  return true;
}

bool OverlapsMapping(PosixState& s, uintptr_t base, size_t size) {
  auto it = s.mappings.lower_bound(base);
  if (it != s.mappings.end() && it->first < base + size) return true;
  if (it != s.mappings.begin()) {
    --it;
    if (it->first + it->second > base) return true;
  }
  return false;
}

// ---- init, devices, contexts, errors ----
CUresult PosixInit(unsigned int) { return CUDA_SUCCESS; }
CUresult PosixDriverGetVersion(int* v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  *v = 0;
  return CUDA_SUCCESS;
}
CUresult PosixDeviceGet(CUdevice* d, int ordinal) {
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= g_device_count.load()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult PosixDeviceGetCount(int* n) {
  if (!n) return CUDA_ERROR_INVALID_VALUE;
  *n = g_device_count.load();
  return CUDA_SUCCESS;
}
// A small device, as a MIG slice is: the ring reload's grid must fit one block per SM (graph_kernels.h),
// and a launch of it past that is refused below.
constexpr int kPosixSms = 16;

CUresult PosixDeviceGetAttribute(int* v, CUdevice_attribute attr, CUdevice dev) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_device_count.load()) return CUDA_ERROR_INVALID_DEVICE;
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
      *v = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID:
      *v = 0;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *v = kPosixSms;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:  // an sm_90 device: the engine loads the compute_90
      *v = 9;                                           // module and launches round copies early
      return CUDA_SUCCESS;
    default:
      *v = 0;
      return CUDA_SUCCESS;
  }
}
CUresult PosixDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= g_device_count.load() || dev >= 256) return CUDA_ERROR_INVALID_DEVICE;
  *ctx = reinterpret_cast<CUcontext>(&g_contexts[dev]);
  return CUDA_SUCCESS;
}
CUresult PosixDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult PosixCtxGetCurrent(CUcontext* ctx) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  *ctx = t_current;
  return CUDA_SUCCESS;
}
CUresult PosixCtxSetCurrent(CUcontext ctx) {
  t_current = ctx;
  return CUDA_SUCCESS;
}
CUresult PosixGetErrorName(CUresult r, const char** s) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  *s = ResultName(r);
  return CUDA_SUCCESS;
}
// On this backend the error string is the error name.
CUresult PosixGetErrorString(CUresult r, const char** s) { return PosixGetErrorName(r, s); }

// ---- virtual memory management ----
CUresult PosixMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop,
                                          CUmemAllocationGranularity_flags) {
  if (!g || !prop) return CUDA_ERROR_INVALID_VALUE;
  if (!ValidLocation(prop->location)) return CUDA_ERROR_INVALID_DEVICE;
  *g = PageSize();
  return CUDA_SUCCESS;
}

CUresult PosixMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                unsigned long long) {
  if (!ptr || size == 0 || size % PageSize() != 0) return CUDA_ERROR_INVALID_VALUE;
  size_t align = alignment > PageSize() ? alignment : PageSize();
  if (align & (align - 1)) return CUDA_ERROR_INVALID_VALUE;
  if (size + align < size) return CUDA_ERROR_OUT_OF_MEMORY;
  void* hint = reinterpret_cast<void*>(addr);
  void* p = mmap(hint, size + align - PageSize(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t raw = reinterpret_cast<uintptr_t>(p);
  uintptr_t base = (raw + align - 1) & ~(uintptr_t)(align - 1);
  size_t total = size + align - PageSize();
  if (base > raw) munmap(p, base - raw);
  if (base + size < raw + total) munmap(reinterpret_cast<void*>(base + size), raw + total - (base + size));
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.reservations[base] = size;
  *ptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

CUresult PosixMemAddressFree(CUdeviceptr ptr, size_t size) {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.reservations.find(static_cast<uintptr_t>(ptr));
  if (it == s.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  if (OverlapsMapping(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;  // must be unmapped first
  if (munmap(reinterpret_cast<void*>(ptr), size) != 0) return CUDA_ERROR_OPERATING_SYSTEM;
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult PosixMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                        unsigned long long flags) {
  if (!handle || !prop || flags != 0 || size == 0 || size % PageSize() != 0) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  if (!ValidLocation(prop->location)) return CUDA_ERROR_INVALID_DEVICE;
  size_t available = 0, total = 0;
  if (ReadMeminfo(&available, &total) && size > available) return CUDA_ERROR_OUT_OF_MEMORY;
  if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  Physical ph{nullptr, size, -1, *prop};
  if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    // Exportable: the memfd is the shareable handle and lives as long as the handle.
    ph.fd = memfd_create(MemfdName(prop->location).c_str(), MFD_CLOEXEC);
    if (ph.fd < 0) return FdError(errno);
    if (ftruncate(ph.fd, static_cast<off_t>(size)) != 0) {
      close(ph.fd);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  // Commit the pages now (MAP_POPULATE), as cuMemCreate commits device memory; released slots then
  // visibly give memory back to the kernel.
  CUresult r = MapHome(ph.fd, size, /*populate=*/true, &ph.home);
  if (r != CUDA_SUCCESS) {
    if (ph.fd >= 0) close(ph.fd);
    return r;
  }
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    const int64_t limit = g_device_limit.load();
    if (limit >= 0 && s.device_bytes + static_cast<int64_t>(size) > limit) {
      DropPhysical(ph);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s.device_bytes += static_cast<int64_t>(size);
    ph.device_bytes = true;
  }
  uint64_t h = s.next_handle++;
  s.handles[h] = ph;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult PosixMemRelease(CUmemGenericAllocationHandle handle) {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.handles.find(handle);
  if (it == s.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (it->second.device_bytes) s.device_bytes -= static_cast<int64_t>(it->second.size);
  DropPhysical(it->second);  // mapped pages stay alive until their last unmap
  s.handles.erase(it);
  return CUDA_SUCCESS;
}

CUresult PosixMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                     unsigned long long flags) {
  if (offset != 0 || flags != 0 || size == 0 || ptr % PageSize() != 0) return CUDA_ERROR_INVALID_VALUE;
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (h->second.size != size) return CUDA_ERROR_INVALID_VALUE;  // the whole handle, as cuMemMap wants
  if (!InReservation(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  if (OverlapsMapping(s, ptr, size)) return CUDA_ERROR_ALREADY_MAPPED;
  // old_size 0 duplicates the shared home mapping: the same pages, PROT_NONE, at exactly ptr (replacing
  // the reservation's PROT_NONE placeholder there).
  void* p = mremap(h->second.home, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(ptr));
  if (p == MAP_FAILED) return errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
  if (p != reinterpret_cast<void*>(ptr)) return CUDA_ERROR_OPERATING_SYSTEM;
  s.mappings[ptr] = size;
  return CUDA_SUCCESS;
}

CUresult PosixMemUnmap(CUdeviceptr ptr, size_t size) {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!CoveredByMappings(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OPERATING_SYSTEM;
  for (uintptr_t at = ptr; at < ptr + size;) {
    auto it = s.mappings.find(at);
    at += it->second;
    s.mappings.erase(it);
  }
  return CUDA_SUCCESS;
}

CUresult PosixMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; ++i) {
    // HOST_NUMA: the CPU's access to host pages (the driver ignores the id); here the same protection.
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_HOST_NUMA &&
        (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !ValidLocation(desc[i].location)))
      return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot |= PROT_READ | PROT_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ) prot |= PROT_READ;
    else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE) return CUDA_ERROR_INVALID_VALUE;
  }
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!CoveredByMappings(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_OPERATING_SYSTEM;
  return CUDA_SUCCESS;
}

CUresult PosixMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
  return ReadMeminfo(free_bytes, total) ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
}

// A memfd is exactly a POSIX file-descriptor shareable handle. As with the driver, only a handle created
// with that handle type requested can be exported.
CUresult PosixMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType type,
                                         unsigned long long) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (h->second.fd < 0) return CUDA_ERROR_NOT_PERMITTED;  // not created as exportable
  int fd = fcntl(h->second.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return FdError(errno);
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CUresult PosixMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                           CUmemAllocationHandleType type) {
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  int src = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  struct stat st;
  if (fstat(src, &st) != 0) return CUDA_ERROR_INVALID_HANDLE;
  if (st.st_size <= 0 || static_cast<size_t>(st.st_size) % PageSize() != 0) return CUDA_ERROR_INVALID_VALUE;
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (!LocationOfMemfd(src, &prop.location)) return CUDA_ERROR_INVALID_VALUE;  // not an allocation's memfd
  int fd = fcntl(src, F_DUPFD_CLOEXEC, 0);  // kept: an imported handle can be exported again
  if (fd < 0) return FdError(errno);
  Physical ph{nullptr, static_cast<size_t>(st.st_size), fd, prop};
  CUresult r = MapHome(fd, ph.size, /*populate=*/false, &ph.home);
  if (r != CUDA_SUCCESS) {
    close(fd);
    return r;
  }
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  uint64_t h = s.next_handle++;
  s.handles[h] = ph;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult PosixMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  if (!prop) return CUDA_ERROR_INVALID_VALUE;
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  *prop = h->second.prop;
  return CUDA_SUCCESS;
}

// ---- streams, graphs: synchronous, except while a stream is capturing ----
// A stream that captures records its operations instead of running them; an instantiated graph runs
// the recorded operations in order, inline, on each launch. So a test can record the device work of a
// handler once and replay it N times without calling the handler again, as XLA's command buffers do.
// The posix_async setting (JAXVMM_DEBUG_POSIX_ASYNC) = 1 (read at each stream's creation): the stream
// runs its operations on a worker thread of its own, in order, as a GPU stream does, instead of inline
// in the calling thread. Events complete when their stream reaches them; a wait on an event or a value
// blocks that stream only. This exposes ordering between streams that the synchronous default hides
// (tests opt in per process). N > 1 also delays each operation by a random 0..N microseconds first, as
// a busy GPU delays a stream: an order that holds only by luck of timing shows.
// The cpu backend's test knobs are settings (config.h), validated in Python (jaxvmm/_config.py).
int SettingInt(Setting s) { return static_cast<int>(std::clamp<int64_t>(EngineConfig::Get(s), 0, 10'000'000)); }

int AsyncStreams() { return SettingInt(Setting::kPosixAsync); }

// Bytes a copy read at its call and that reach their destination later, at Land() (the models of the
// driver's staged copies below).
class StagedBytes {
 public:
  void Add(void* dst, const void* src, size_t n) {
    std::vector<char> bytes(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.emplace_back(dst, std::move(bytes));
  }
  void Land() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [dst, bytes] : pending_) std::memcpy(dst, bytes.data(), bytes.size());
    pending_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, std::vector<char>>> pending_;
};

struct PosixStream {
  bool capturing = false;
  std::vector<std::function<CUresult()>> recorded;
  // async mode
  bool async = false;
  std::mutex q_mu;
  std::condition_variable q_cv;
  std::deque<std::function<CUresult()>> q;
  uint64_t enqueued = 0, completed = 0;  // operations pushed / finished (q_mu)
  bool stop = false;
  std::thread worker;
  void Start(int jitter_us) {
    async = true;
    worker = std::thread([this, jitter_us] {
      uint64_t rng = reinterpret_cast<uintptr_t>(this) | 1;
      std::unique_lock<std::mutex> lock(q_mu);
      for (;;) {
        q_cv.wait(lock, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        auto op = std::move(q.front());
        q.pop_front();
        lock.unlock();
        if (jitter_us > 1) {
          rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;  // xorshift
          std::this_thread::sleep_for(std::chrono::microseconds(rng % static_cast<uint64_t>(jitter_us)));
        }
        CUresult r = op();
        if (r != CUDA_SUCCESS) std::fprintf(stderr, "jaxvmm posix stream: an operation failed (%d)\n", static_cast<int>(r));
        lock.lock();
        ++completed;
        q_cv.notify_all();
      }
    });
  }
  uint64_t Push(std::function<CUresult()> op) {
    std::lock_guard<std::mutex> lock(q_mu);
    q.push_back(std::move(op));
    q_cv.notify_all();
    return ++enqueued;
  }
  uint64_t Tail() {
    std::lock_guard<std::mutex> lock(q_mu);
    return enqueued;
  }
  bool Reached(uint64_t seq) {
    std::lock_guard<std::mutex> lock(q_mu);
    return completed >= seq;
  }
  void WaitFor(uint64_t seq) {
    std::unique_lock<std::mutex> lock(q_mu);
    q_cv.wait(lock, [&] { return completed >= seq; });
  }
  void Drain() {
    if (async) WaitFor(Tail());
  }
  void Stop() {
    if (!async) return;
    Drain();
    {
      std::lock_guard<std::mutex> lock(q_mu);
      stop = true;
      q_cv.notify_all();
    }
    worker.join();
  }
  // A D2H into pageable host memory: the bytes were read at the call (the DMA into the driver's
  // staging), and land at their destination when the stream is synchronized. The driver documents such
  // a copy as "might be synchronous" with the host; this is its weakest reading, so a reader of the
  // host bytes that is ordered only on the device (a memop, an event a later copy waits for) sees stale
  // bytes here too. jaxvmm never makes such a copy (PageableBounce); the model stays for the rule.
  StagedBytes landing;
  void Land() { landing.Land(); }
};
struct PosixGraph {
  std::vector<std::function<CUresult()>> ops;
};
struct PosixEvent {
  PosixStream* stream = nullptr;  // async mode: complete once `stream` has finished `seq` operations
  uint64_t seq = 0;
};

// Runs `op` now, or records it when `s` is capturing.
template <typename Op>
CUresult Enqueue(CUstream s, Op op) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (ps && ps->capturing) {
    ps->recorded.emplace_back(std::move(op));
    return CUDA_SUCCESS;
  }
  if (ps && ps->async) {
    ps->Push(std::move(op));
    return CUDA_SUCCESS;
  }
  return op();
}

// ---- copies (synchronous on this backend) ----
// cuMemcpyHtoD from pageable memory "returns once the pageable buffer has been copied to the staging
// memory for DMA transfer to device memory, but the DMA to final destination may not have completed"
// (the driver's API synchronization notes): the DMA runs on the legacy stream. Modelled as bytes that
// land at the legacy stream's next synchronization (cuStreamSynchronize(0), cuCtxSynchronize) or its next
// synchronous copy, so work on other streams before that reads the old bytes (found on the H200:
// Slot.write then a graph launch on another stream read the slot's old tail).
StagedBytes g_legacy_landing;

void LandLegacy() { g_legacy_landing.Land(); }
bool IsLegacy(CUstream s) { return s == nullptr || s == reinterpret_cast<CUstream>(0x1) /* CU_STREAM_LEGACY */; }

bool IsPinnedHost(const void* p, size_t n);

CUresult PosixMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  LandLegacy();  // in order behind earlier copies of the legacy stream
  if (IsPinnedHost(src, n)) {
    std::memcpy(reinterpret_cast<void*>(dst), src, n);
    return CUDA_SUCCESS;
  }
  g_legacy_landing.Add(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult PosixMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  LandLegacy();
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult PosixMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return Enqueue(s, [=] {
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
  });
}
bool IsPinnedHost(const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  PosixState& st = S();
  std::lock_guard<std::mutex> lock(st.mu);
  for (const auto& [base, size] : st.host_allocs)
    if (a >= base && a + n <= base + size) return true;
  return false;
}
std::atomic<int64_t> g_pageable_copies{0};  // async copies given a pageable host pointer (PosixPageableCopies)

// posix_link_us = N (JAXVMM_DEBUG_POSIX_LINK_US, with async streams): every async copy between pinned
// memory and the device (D2H, H2D) takes N more microseconds on its stream before it reads its source,
// as a PCIe link slower than the device: copies queue up behind one another, and a source overwritten
// before its copy runs shows in the bytes.
int LinkMicros() { return SettingInt(Setting::kPosixLinkUs); }

// An async copy that waits `us` microseconds on its stream before it reads its source, where that
// applies (an async stream, not capturing), else as any other copy.
CUresult DelayedCopyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, int us) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (!ps || !ps->async || ps->capturing || us <= 0) return PosixMemcpyAsync(dst, src, n, s);
  return Enqueue(s, [dst, src, n, us] {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
  });
}

// An async copy between pinned host memory and the device: over the slow link.
CUresult PinnedCopyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return DelayedCopyAsync(dst, src, n, s, LinkMicros());
}

CUresult PosixMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  if (IsPinnedHost(src, n)) return PinnedCopyAsync(dst, reinterpret_cast<CUdeviceptr>(src), n, s);
  ++g_pageable_copies;
  return PosixMemcpyAsync(dst, reinterpret_cast<CUdeviceptr>(src), n, s);
}

CUresult PosixMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (IsPinnedHost(dst, n)) return PinnedCopyAsync(reinterpret_cast<CUdeviceptr>(dst), src, n, s);
  if (!ps || ps->capturing) return PosixMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), src, n, s);
  ++g_pageable_copies;
  return Enqueue(s, [ps, dst, src, n] {
    ps->landing.Add(dst, reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
  });
}
// posix_dtod_us = N (JAXVMM_DEBUG_POSIX_DTOD_US, with async streams): every cuMemcpyDtoDAsync on a
// side stream (not capturing) waits N microseconds on its stream before it reads its source: a
// device-to-device copy queued behind a busy device, so a source reused before its copy runs shows in
// the bytes.
int DtoDMicros() { return SettingInt(Setting::kPosixDtodUs); }

CUresult PosixMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return DelayedCopyAsync(dst, src, n, s, DtoDMicros());
}
CUresult PosixMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
  return Enqueue(s, [=] {
    std::memset(reinterpret_cast<void*>(dst), v, n);
    return CUDA_SUCCESS;
  });
}

CUresult PosixStreamCreateWithPriority(CUstream* s, unsigned int, int) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  auto* ps = new PosixStream();
  if (int a = AsyncStreams(); a > 0) ps->Start(a);
  {
    PosixState& st = S();
    std::lock_guard<std::mutex> lock(st.mu);
    st.streams.insert(ps);
  }
  *s = reinterpret_cast<CUstream>(ps);
  return CUDA_SUCCESS;
}
CUresult PosixStreamDestroy(CUstream s) {
  if (s) {
    reinterpret_cast<PosixStream*>(s)->Stop();
    reinterpret_cast<PosixStream*>(s)->Land();
    PosixState& st = S();
    std::lock_guard<std::mutex> lock(st.mu);
    st.streams.erase(s);
  }
  delete reinterpret_cast<PosixStream*>(s);
  return CUDA_SUCCESS;
}
CUresult PosixStreamSynchronize(CUstream s) {
  if (IsLegacy(s)) LandLegacy();
  if (s && !IsLegacy(s)) {
    reinterpret_cast<PosixStream*>(s)->Drain();
    reinterpret_cast<PosixStream*>(s)->Land();
  }
  return CUDA_SUCCESS;
}
CUresult PosixStreamQuery(CUstream s) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  return ps && ps->async && !ps->Reached(ps->Tail()) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
CUresult PosixCtxSynchronize() {  // streams complete their work in the call; pageable D2Hs land now
  LandLegacy();
  std::vector<void*> streams;
  {
    PosixState& st = S();
    std::lock_guard<std::mutex> lock(st.mu);
    streams.assign(st.streams.begin(), st.streams.end());
  }
  for (void* ps : streams) {
    static_cast<PosixStream*>(ps)->Drain();
    static_cast<PosixStream*>(ps)->Land();
  }
  return CUDA_SUCCESS;
}
CUresult PosixStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  auto* ev = reinterpret_cast<PosixEvent*>(e);
  PosixStream* other = ev->stream;
  const uint64_t seq = ev->seq;
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (!other || (ps && ps->capturing)) return CUDA_SUCCESS;  // complete already (or a capture: not modelled)
  return Enqueue(s, [other, seq] {
    other->WaitFor(seq);
    return CUDA_SUCCESS;
  });
}
// A stream that waits on a value blocks the calling thread until another thread (a worker) writes it,
// which is what the GPU's stream would do. A wait that is never satisfied is reported after a long
// timeout instead of hanging the process.
CUresult WaitValue(CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  auto* word = reinterpret_cast<std::atomic<uint64_t>*>(addr);
  auto satisfied = [&](uint64_t cur, bool* bad) {
    switch (flags & 0xf) {
      case CU_STREAM_WAIT_VALUE_GEQ: return static_cast<int64_t>(cur - value) >= 0;
      case CU_STREAM_WAIT_VALUE_EQ: return cur == value;
      case CU_STREAM_WAIT_VALUE_AND: return (cur & value) != 0;
      case CU_STREAM_WAIT_VALUE_NOR: return ~(cur | value) != 0;
      default: *bad = true; return true;
    }
  };
  bool bad = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int spins = 0;; ++spins) {
    if (satisfied(word->load(std::memory_order_acquire), &bad)) return bad ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (spins < 64) continue;
    if (std::chrono::steady_clock::now() > deadline) return CUDA_ERROR_LAUNCH_TIMEOUT;
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 5 : 200));
  }
}
CUresult PosixStreamWaitValue64(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  return Enqueue(s, [=] { return WaitValue(addr, value, flags); });
}
CUresult PosixStreamWriteValue64(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned int) {
  return Enqueue(s, [=] {
    reinterpret_cast<std::atomic<uint64_t>*>(addr)->store(value, std::memory_order_release);
    return CUDA_SUCCESS;
  });
}
CUresult PosixEventCreate(CUevent* e, unsigned int) {
  if (!e) return CUDA_ERROR_INVALID_VALUE;
  *e = reinterpret_cast<CUevent>(new PosixEvent());
  return CUDA_SUCCESS;
}
CUresult PosixEventRecord(CUevent e, CUstream s) {
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  auto* ev = reinterpret_cast<PosixEvent*>(e);
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (ps && ps->capturing) return CUDA_SUCCESS;  // not modelled under capture
  ev->stream = ps && ps->async ? ps : nullptr;
  ev->seq = ev->stream ? ps->Tail() : 0;
  return CUDA_SUCCESS;
}
CUresult PosixEventQuery(CUevent e) {
  auto* ev = reinterpret_cast<PosixEvent*>(e);
  return ev && ev->stream && !ev->stream->Reached(ev->seq) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
CUresult PosixEventDestroy(CUevent e) {
  delete reinterpret_cast<PosixEvent*>(e);
  return CUDA_SUCCESS;
}
CUresult PosixStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  auto* ps = reinterpret_cast<PosixStream*>(s);
  *status = ps && ps->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult PosixStreamBeginCapture(CUstream s, CUstreamCaptureMode) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (!ps) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // the legacy stream cannot capture
  if (ps->capturing) return CUDA_ERROR_ILLEGAL_STATE;
  ps->capturing = true;
  ps->recorded.clear();
  return CUDA_SUCCESS;
}
CUresult PosixStreamEndCapture(CUstream s, CUgraph* graph) {
  auto* ps = reinterpret_cast<PosixStream*>(s);
  if (!ps || !graph) return CUDA_ERROR_INVALID_VALUE;
  if (!ps->capturing) return CUDA_ERROR_ILLEGAL_STATE;
  ps->capturing = false;
  *graph = reinterpret_cast<CUgraph>(new PosixGraph{std::move(ps->recorded)});
  ps->recorded.clear();
  return CUDA_SUCCESS;
}
CUresult PosixGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long) {
  if (!exec || !graph) return CUDA_ERROR_INVALID_VALUE;
  *exec = reinterpret_cast<CUgraphExec>(new PosixGraph(*reinterpret_cast<PosixGraph*>(graph)));
  return CUDA_SUCCESS;
}
CUresult PosixGraphLaunch(CUgraphExec exec, CUstream s) {
  if (!exec) return CUDA_ERROR_INVALID_VALUE;
  const auto* g = reinterpret_cast<const PosixGraph*>(exec);
  return Enqueue(s, [g] {
    for (const auto& op : g->ops)
      if (CUresult r = op(); r != CUDA_SUCCESS) return r;
    return CUDA_SUCCESS;
  });
}
CUresult PosixGraphExecDestroy(CUgraphExec exec) {
  delete reinterpret_cast<PosixGraph*>(exec);
  return CUDA_SUCCESS;
}
CUresult PosixGraphDestroy(CUgraph graph) {
  delete reinterpret_cast<PosixGraph*>(graph);
  return CUDA_SUCCESS;
}
CUresult PosixMemHostAlloc(void** pp, size_t n, unsigned int) {
  if (!pp || n == 0) return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.host_allocs[reinterpret_cast<uintptr_t>(p)] = n;
  *pp = p;
  return CUDA_SUCCESS;
}
CUresult PosixMemFreeHost(void* p) {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.host_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.host_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  munmap(p, it->second);
  s.host_allocs.erase(it);
  return CUDA_SUCCESS;
}

// ---- device memory (cuMemAlloc): ordinary host pages here ----
CUresult PosixMemAlloc(CUdeviceptr* p, size_t n) {
  if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
  void* q = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (q == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.device_allocs[reinterpret_cast<uintptr_t>(q)] = n;
  *p = reinterpret_cast<CUdeviceptr>(q);
  return CUDA_SUCCESS;
}
CUresult PosixMemFree(CUdeviceptr p) {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.device_allocs.find(static_cast<uintptr_t>(p));
  if (it == s.device_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), it->second);
  s.device_allocs.erase(it);
  return CUDA_SUCCESS;
}

// ---- modules and kernels: the graph-mode grant kernels as host functions ----
// A module "loaded" from a PTX image exposes the kernels the image declares (`.entry NAME`) that this
// backend implements (ffi/kernels/graph_kernels.cu, same names, same memory-ordering contract: the
// device's atomics are seq_cst here, its volatile loads are acquire loads, its stores release stores).
// cuLaunchKernel copies the parameters at launch (or at capture, as a graph node does) and runs the
// function in stream order.
using Word = std::atomic<uint64_t>;
Word* W(uint64_t p) { return reinterpret_cast<Word*>(p); }

std::mutex g_hook_mu;
void (*g_after_take)(void*) = nullptr;
void* g_after_take_arg = nullptr;

// Spins as a 1-thread kernel would, with a deadline instead of hanging the process.
template <typename F>
CUresult SpinUntil(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int spins = 0; !done(); ++spins) {
    if (spins < 64) continue;
    if (std::chrono::steady_clock::now() > deadline) return CUDA_ERROR_LAUNCH_TIMEOUT;
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 2 : 100));
  }
  return CUDA_SUCCESS;
}

// A channel's device words (graph_words.h, DeviceWords: the layout of `Cells` in graph_kernels.cu).
Word* Grant(const uint64_t* a, uint64_t i) { return W(a[0] + offsetof(DeviceWords, grant) + sizeof(uint64_t) * i); }
DeviceWords* Cells(const uint64_t* a) { return reinterpret_cast<DeviceWords*>(a[0]); }
uint64_t CellAddress(DeviceWords* c, uint64_t i) {
  // cell[i] changes when the poller lends an offload cell or trades a large call site's pages (a
  // release store on garm_, before the grant that follows): read it as the atomic it is.
  return reinterpret_cast<std::atomic<uint64_t>*>(&c->cell[i])->load(std::memory_order_acquire);
}

// The cells' addresses as the kernels load them before taking a grant (graph_kernels.cu, CellWords);
// they use them only on a `stable` channel and read the address again after the take otherwise. Here
// too, so that a channel marked stable whose address does change (a lend or a trade while its take
// waits) copies into the old cell, as the device would.
struct EarlyCells {
  bool stable;
  uint64_t cell[kMaxCells];
  explicit EarlyCells(DeviceWords* c) : stable(c->stable != 0) {
    for (uint64_t j = 0; j < kMaxCells; ++j) cell[j] = CellAddress(c, j);
  }
};

void Choose(DeviceWords* c, uint64_t i, const EarlyCells& early) {
  c->ptr = early.stable ? early.cell[i] : CellAddress(c, i);
  c->publish = c->flag[i];
}

// A ticket token into XLA's 8-byte, 4-byte aligned token buffer: two 32-bit halves, as the kernels do.
void StoreToken(uint64_t addr, uint64_t t) {
  auto* out = reinterpret_cast<uint32_t*>(addr);
  out[0] = static_cast<uint32_t>(t);
  out[1] = static_cast<uint32_t>(t >> 32);
}

CUresult KTakeOffload(const uint64_t* a) {  // (Cells* cells, u32* token_out, u64* knock)
  DeviceWords* c = Cells(a);
  const uint64_t k = c->ncells, start = c->next;
  if (k == 0 || k > kMaxCells) return CUDA_ERROR_ILLEGAL_ADDRESS;  // the device would spin forever
  const EarlyCells early(c);
  uint64_t t = 0, i = 0;
  auto scan = [&] {
    for (uint64_t j = 0; j < k && t == 0; ++j) {
      i = (start + j) % k;
      if (Grant(a, i)->load(std::memory_order_acquire) != 0) t = Grant(a, i)->exchange(0);
    }
    return t != 0;
  };
  if (!scan()) {
    W(a[2])->store(1, std::memory_order_release);
    CUresult r = SpinUntil(scan);
    if (r != CUDA_SUCCESS) return r;
    W(a[2])->store(0, std::memory_order_release);
  }
  c->next = (i + 1) % k;
  Choose(c, i, early);
  StoreToken(a[1], t);
  void (*hook)(void*) = nullptr;
  void* arg = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_hook_mu);
    std::swap(hook, g_after_take);
    arg = g_after_take_arg;
  }
  if (hook) hook(arg);
  return CUDA_SUCCESS;
}

CUresult KTakeReload(const uint64_t* a) {  // (Cells* cells, u32* token_in, u64* probe, u64* request, u64* go)
  DeviceWords* c = Cells(a);
  const auto* in = reinterpret_cast<const uint32_t*>(a[1]);
  const uint64_t t = uint64_t{in[0]} | (uint64_t{in[1]} << 32);
  const uint64_t k = c->ncells;
  if (k == 0 || k > kMaxCells) return CUDA_ERROR_ILLEGAL_ADDRESS;
  const EarlyCells early(c);
  if (t != 0)
    for (uint64_t i = 0; i < k; ++i) {
      uint64_t expect = t;
      if (Grant(a, i)->compare_exchange_strong(expect, 0)) {
        Choose(c, i, early);
        return CUDA_SUCCESS;
      }
    }
  W(a[2])->store(t, std::memory_order_release);
  W(a[3])->store(1, std::memory_order_release);
  uint64_t g = 0;
  CUresult r = SpinUntil([&] { return (g = W(a[4])->load(std::memory_order_acquire)) != 0; });
  if (r != CUDA_SUCCESS) return r;
  W(a[4])->store(0, std::memory_order_release);
  if (g > k) return CUDA_ERROR_ILLEGAL_ADDRESS;
  Choose(c, g - 1, early);
  return CUDA_SUCCESS;
}

// The whole grid's copy at once (memmove: any size and alignment); no publish (jaxvmm_publish follows).
CUresult KCellCopy(const uint64_t* a) {  // (Cells* cells, u64 other, u64 nbytes, u64 out)
  DeviceWords* c = Cells(a);
  if (!c->ptr || !c->publish) return CUDA_ERROR_ILLEGAL_ADDRESS;  // no take kernel chose a cell
  void* cell = reinterpret_cast<void*>(c->ptr);
  void* other = reinterpret_cast<void*>(a[1]);
  if (a[3]) std::memmove(other, cell, a[2]);
  else std::memmove(cell, other, a[2]);
  return CUDA_SUCCESS;
}

CUresult KCopy(const uint64_t* a) {  // (u64 dst, u64 src, u64 nbytes, u32* word, u64 value)
  if (a[3]) StoreToken(a[3], a[4]);
  std::memmove(reinterpret_cast<void*>(a[0]), reinterpret_cast<const void*>(a[1]), a[2]);
  return CUDA_SUCCESS;
}

// (u64 dst, u64 src, u64 nbytes, u32* token_in, u64 tag, u64* probe, u64* seen, u64 seq, u64* ready)
CUresult KRingReload(const uint64_t* a) {
  const auto* in = reinterpret_cast<const uint32_t*>(a[3]);
  const uint64_t t = uint64_t{in[0]} | (uint64_t{in[1]} << 32);
  W(a[5])->store(t, std::memory_order_release);
  W(a[6])->store(a[7], std::memory_order_release);
  if (a[4] == 0 || t != a[4]) {
    CUresult r = SpinUntil([&] { return W(a[8])->load(std::memory_order_acquire) >= a[7]; });
    if (r != CUDA_SUCCESS) return r;
  }
  std::memmove(reinterpret_cast<void*>(a[0]), reinterpret_cast<const void*>(a[1]), a[2]);
  return CUDA_SUCCESS;
}

CUresult KPublish(const uint64_t* a) {  // (Cells* cells)
  DeviceWords* c = Cells(a);
  if (!c->publish) return CUDA_ERROR_ILLEGAL_ADDRESS;  // no take kernel chose a cell
  W(c->publish)->store(1, std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult KRevoke(const uint64_t* a) {  // (u64* word, u64 expect, u64* result)
  uint64_t old = 0;
  if (a[1]) {
    uint64_t expect = a[1];
    old = W(a[0])->compare_exchange_strong(expect, 0) ? a[1] : 0;
  } else {
    old = W(a[0])->exchange(0);
  }
  W(a[2])->store(old, std::memory_order_release);
  return CUDA_SUCCESS;
}

struct PosixKernel {
  const char* name;
  int params;  // all 8 bytes wide
  CUresult (*fn)(const uint64_t*);
  bool grid;   // launched as a grid (the copy kernels); the grant kernels are one thread
  bool waits = false;  // its grid may wait for the host (the ring reload): at most one block per SM
};
constexpr PosixKernel kKernels[] = {
    {"jaxvmm_take_offload", 3, KTakeOffload, false},
    {"jaxvmm_take_reload", 5, KTakeReload, false},
    {"jaxvmm_revoke", 3, KRevoke, false},
    {"jaxvmm_cell_copy", 4, KCellCopy, true},
    {"jaxvmm_publish", 1, KPublish, false},
    {"jaxvmm_copy", 5, KCopy, true},
    {"jaxvmm_ring_reload", 9, KRingReload, true, true},
};
constexpr int kMaxParams = 9;
struct PosixModule {
  std::vector<const PosixKernel*> kernels;
};

CUresult PosixModuleLoadData(CUmodule* m, const void* image) {
  if (!m || !image) return CUDA_ERROR_INVALID_VALUE;
  const char* text = static_cast<const char*>(image);
  if (!std::strstr(text, ".version") || !std::strstr(text, ".target")) return CUDA_ERROR_INVALID_IMAGE;
  auto* mod = new PosixModule();
  for (const PosixKernel& k : kKernels) {
    std::string entry = std::string(".entry ") + k.name + "(";
    if (std::strstr(text, entry.c_str())) mod->kernels.push_back(&k);
  }
  *m = reinterpret_cast<CUmodule>(mod);
  return CUDA_SUCCESS;
}
CUresult PosixModuleUnload(CUmodule m) {
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<PosixModule*>(m);
  return CUDA_SUCCESS;
}
CUresult PosixModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  if (!f || !m || !name) return CUDA_ERROR_INVALID_VALUE;
  for (const PosixKernel* k : reinterpret_cast<PosixModule*>(m)->kernels)
    if (std::strcmp(k->name, name) == 0) {
      *f = reinterpret_cast<CUfunction>(const_cast<PosixKernel*>(k));
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}
CUresult PosixLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned shared, CUstream s, void** params, void** extra) {
  if (!f || !params || extra) return CUDA_ERROR_INVALID_VALUE;
  const auto* k = reinterpret_cast<const PosixKernel*>(f);
  if (gx == 0 || bx == 0 || gy != 1 || gz != 1 || by != 1 || bz != 1 || shared != 0 || bx > 1024)
    return CUDA_ERROR_INVALID_VALUE;
  if (!k->grid && (gx != 1 || bx != 1)) return CUDA_ERROR_INVALID_VALUE;  // the grant kernels are one thread
  if (k->waits && gx > static_cast<unsigned>(kPosixSms)) return CUDA_ERROR_INVALID_VALUE;
  std::array<uint64_t, kMaxParams> a{};
  for (int i = 0; i < k->params; ++i) std::memcpy(&a[i], params[i], sizeof(uint64_t));
  return Enqueue(s, [k, a] { return k->fn(a.data()); });
}

// cuLaunchKernelEx: the same launch; the one attribute jaxvmm sets (an early launch of a round's copy
// and publish, programmatic stream serialization) changes nothing here, since a host-function kernel
// starts only once the one before it in stream order has returned. Any other attribute is refused.
CUresult PosixLaunchKernelEx(const CUlaunchConfig* cfg, CUfunction f, void** params, void** extra) {
  if (!cfg || (cfg->numAttrs && !cfg->attrs)) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned i = 0; i < cfg->numAttrs; ++i)
    if (cfg->attrs[i].id != CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION ||
        cfg->attrs[i].value.programmaticStreamSerializationAllowed > 1)
      return CUDA_ERROR_INVALID_VALUE;
  return PosixLaunchKernel(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ,
                           cfg->sharedMemBytes, cfg->hStream, params, extra);
}

DriverTable MakePosixTable() {
  DriverTable t;
#define X(member, version) t.member = &Posix##member;
  JAXVMM_DRIVER_ENTRIES(X)
#undef X
  return t;
}

}  // namespace

const DriverTable& RawPosixDriver() {
  static const DriverTable t = MakePosixTable();
  return t;
}

void SetPosixAfterTakeHook(void (*fn)(void*), void* arg) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  g_after_take = fn;
  g_after_take_arg = arg;
}

int64_t PosixPageableCopies() { return g_pageable_copies.load(); }

void SetPosixDeviceMemoryLimit(int64_t bytes) { g_device_limit.store(bytes < 0 ? -1 : bytes); }

int64_t PosixDeviceBytes() {
  PosixState& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.device_bytes;
}

void SetPosixDeviceCount(int n) { g_device_count.store(n > 0 ? n : 1); }

namespace {
constexpr int kMaxPosixIds = 256;
std::atomic<int> g_id_count{0};
std::atomic<int64_t> g_ids[kMaxPosixIds];
}  // namespace

void SetPosixDeviceIds(const int64_t* ids, int n) {
  n = n < kMaxPosixIds ? n : kMaxPosixIds;
  g_id_count.store(0);
  for (int i = 0; i < n; ++i) g_ids[i].store(ids[i]);
  g_id_count.store(n);
}

int PosixLocalOrdinal(int ffi_ordinal) {
  int n = g_id_count.load();
  for (int i = 0; i < n; ++i)
    if (g_ids[i].load() == ffi_ordinal) return i;
  return ffi_ordinal;
}

}  // namespace jaxvmm
