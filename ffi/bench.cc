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

#define JAXVMM_BENCH_CHECK(call, entry)                     \
  do {                                                      \
    CUresult _r = (call);                                   \
    if (_r != CUDA_SUCCESS) return Status::Driver(_r, entry).At(-1, "bench"); \
  } while (0)

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
  for (int i = 0; i < iters; ++i) {
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    auto t0 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemAddressReserve(&va, size, g, 0, 0), Entry::kMemAddressReserve);
    auto t1 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemCreate(&h, size, &prop, 0), Entry::kMemCreate);
    auto t2 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemMap(va, size, 0, h, 0), Entry::kMemMap);
    auto t3 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemSetAccess(va, size, &desc, 1), Entry::kMemSetAccess);
    auto t4 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemUnmap(va, size), Entry::kMemUnmap);
    auto t5 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemRelease(h), Entry::kMemRelease);
    auto t6 = Clock::now();
    // A second remap cycle at the same VA, timed as a unit (what Slot::Remap does).
    JAXVMM_BENCH_CHECK(d.MemCreate(&h, size, &prop, 0), Entry::kMemCreate);
    JAXVMM_BENCH_CHECK(d.MemMap(va, size, 0, h, 0), Entry::kMemMap);
    JAXVMM_BENCH_CHECK(d.MemSetAccess(va, size, &desc, 1), Entry::kMemSetAccess);
    auto t7 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemUnmap(va, size), Entry::kMemUnmap);
    JAXVMM_BENCH_CHECK(d.MemRelease(h), Entry::kMemRelease);
    auto t8 = Clock::now();
    JAXVMM_BENCH_CHECK(d.MemAddressFree(va, size), Entry::kMemAddressFree);
    auto t9 = Clock::now();
    t["raw_reserve"].push_back(Us(t0, t1));
    t["raw_create"].push_back(Us(t1, t2));
    t["raw_map"].push_back(Us(t2, t3));
    t["raw_access"].push_back(Us(t3, t4));
    t["raw_unmap"].push_back(Us(t4, t5));
    t["raw_release"].push_back(Us(t5, t6));
    t["raw_remap"].push_back(Us(t6, t7));
    t["raw_drop"].push_back(Us(t7, t8));
    t["raw_free"].push_back(Us(t8, t9));
    t["raw_setup"].push_back(Us(t0, t4));
    t["raw_teardown"].push_back(Us(t7, t9) );

    // The same work through the engine: registry + slot + wrapper + context guard.
    Registry& reg = Registry::Get();
    SlotSpec spec;
    spec.backend = b;
    spec.device = device;
    spec.location = loc;
    spec.nbytes = size;
    int64_t id = 0;
    auto s0 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Create(spec, &id));
    auto s1 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Release(id));
    auto s2 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Remap(id));
    auto s3 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Release(id));
    auto s4 = Clock::now();
    JAXVMM_RETURN_IF_ERROR(reg.Close(id));
    auto s5 = Clock::now();
    t["slot_create"].push_back(Us(s0, s1));
    t["slot_release"].push_back(Us(s1, s2));
    t["slot_remap"].push_back(Us(s2, s3));
    t["slot_close"].push_back(Us(s4, s5));
    (void)s4;
  }
  for (auto& [k, v] : t) (*out)[k] = Median(v);
  return Status();
}

}  // namespace jaxvmm
