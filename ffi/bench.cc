#include "bench.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "registry.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

using Clock = std::chrono::steady_clock;

double Us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Status BenchOps(Backend b, int device, size_t nbytes, int iters, std::map<std::string, double>* out) {
  Location loc{CU_MEM_LOCATION_TYPE_DEVICE, device};
  size_t g = 0;
  JAXVMM_RETURN_IF_ERROR(Granularity(b, device, loc, &g));
  size_t size = (nbytes + g - 1) / g * g;
  ScopedContext ctx(b, device);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  const DriverTable& d = RawDriver(b);  // raw: no wrapper, no tracing, no bookkeeping
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  CUmemAccessDesc desc = {};
  desc.location = prop.location;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  std::map<std::string, std::vector<double>> t;
  Registry& reg = Registry::Get();
  for (int i = 0; i < iters; ++i) {
    // Raw: the driver table without wrapper, tracing or bookkeeping. Whatever a failure leaves owned
    // is undone before returning.
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    bool have_h = false, mapped = false;
    auto cleanup = [&] {
      if (mapped) d.MemUnmap(va, size);
      if (have_h) d.MemRelease(h);
      if (va) d.MemAddressFree(va, size);
    };
#define JAXVMM_RAW(call, entry)                                              \
  do {                                                                       \
    CUresult _r = (call);                                                    \
    if (_r != CUDA_SUCCESS) {                                                \
      cleanup();                                                             \
      return Status::Driver(_r, entry).At(-1, "bench");                      \
    }                                                                        \
  } while (0)
    auto t0 = Clock::now();
    JAXVMM_RAW(d.MemAddressReserve(&va, size, g, 0, 0), Entry::kMemAddressReserve);
    auto t1 = Clock::now();
    JAXVMM_RAW(d.MemCreate(&h, size, &prop, 0), Entry::kMemCreate);
    have_h = true;
    auto t2 = Clock::now();
    JAXVMM_RAW(d.MemMap(va, size, 0, h, 0), Entry::kMemMap);
    mapped = true;
    auto t3 = Clock::now();
    JAXVMM_RAW(d.MemSetAccess(va, size, &desc, 1), Entry::kMemSetAccess);
    auto t4 = Clock::now();
    JAXVMM_RAW(d.MemUnmap(va, size), Entry::kMemUnmap);
    mapped = false;
    auto t5 = Clock::now();
    JAXVMM_RAW(d.MemRelease(h), Entry::kMemRelease);
    have_h = false;
    auto t6 = Clock::now();
    // A second cycle at the same VA, timed as units: what Slot::Remap and Slot::Release do.
    JAXVMM_RAW(d.MemCreate(&h, size, &prop, 0), Entry::kMemCreate);
    have_h = true;
    JAXVMM_RAW(d.MemMap(va, size, 0, h, 0), Entry::kMemMap);
    mapped = true;
    JAXVMM_RAW(d.MemSetAccess(va, size, &desc, 1), Entry::kMemSetAccess);
    auto t7 = Clock::now();
    JAXVMM_RAW(d.MemUnmap(va, size), Entry::kMemUnmap);
    mapped = false;
    JAXVMM_RAW(d.MemRelease(h), Entry::kMemRelease);
    have_h = false;
    auto t8 = Clock::now();
    JAXVMM_RAW(d.MemAddressFree(va, size), Entry::kMemAddressFree);
    va = 0;
    auto t9 = Clock::now();
#undef JAXVMM_RAW
    t["raw_reserve"].push_back(Us(t0, t1));
    t["raw_create"].push_back(Us(t1, t2));
    t["raw_map"].push_back(Us(t2, t3));
    t["raw_access"].push_back(Us(t3, t4));
    t["raw_unmap"].push_back(Us(t4, t5));
    t["raw_release"].push_back(Us(t5, t6));
    t["raw_setup"].push_back(Us(t0, t4));
    t["raw_remap"].push_back(Us(t6, t7));
    t["raw_drop"].push_back(Us(t7, t8));
    t["raw_free"].push_back(Us(t8, t9));

    // The same work through the engine: registry + slot + fault wrapper + context guard.
    SlotSpec spec;
    spec.backend = b;
    spec.device = device;
    spec.location = loc;
    spec.nbytes = size;
    int64_t id = 0;
    auto s0 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Create(spec, &id));
    auto s1 = Clock::now();
    Status st = reg.Release(id);
    auto s2 = Clock::now();
    if (st.ok()) st = reg.Remap(id);
    auto s3 = Clock::now();
    if (st.ok()) st = reg.Release(id);
    auto s4 = Clock::now();
    Status closed = reg.Close(id);
    auto s5 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(st);
    JAXVMM_RETURN_IF_ERROR(closed);
    t["slot_create"].push_back(Us(s0, s1));
    t["slot_release"].push_back(Us(s1, s2));
    t["slot_remap"].push_back(Us(s2, s3));
    t["slot_close"].push_back(Us(s4, s5));
  }
  for (auto& [k, v] : t) (*out)[k] = Median(v);
  return Status();
}

}  // namespace jaxvmm
