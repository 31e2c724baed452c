// The host_numa chunk source: host pages created by the VMM API on the device's host NUMA node, mapped
// at a reserved VA and granted to the device and the CPU. Reservations outlive their pages: a chunk
// given back unmaps and releases its pages and keeps its VA range, and the next chunk of that size is
// mapped at the same address (fixed host VAs, like a slot's).
#include <algorithm>
#include <map>
#include <mutex>

#include "host_pool.h"
#include "slot.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

class HostNumaSource : public HostChunkSource {
 public:
  HostNumaSource(Backend b, int device) : backend_(b), device_(device) {}

  ~HostNumaSource() override {
    // The pool has put every chunk back (its destructor runs first); only spare VA ranges remain.
    ScopedContext ctx(backend_, device_);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, r] : spare_) {
      Status st = r.Free(-1, "host_numa store");
      if (!st.ok()) ReportLeak(st);
    }
  }

  Status Get(size_t size, void** base, size_t* got) override {
    ScopedContext ctx(backend_, device_);
    JAXVMM_RETURN_IF_ERROR(ctx.status());
    JAXVMM_RETURN_IF_ERROR(Resolve());
    const char* stage = "host_numa store";
    size = (size + granule_ - 1) / granule_ * granule_;
    Reservation res;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = spare_.find(size);
      if (it != spare_.end()) {
        res = std::move(it->second);
        spare_.erase(it);
      }
    }
    if (!res.owned()) JAXVMM_RETURN_IF_ERROR(res.Reserve(backend_, size, granule_, -1, stage));
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = node_;
    PhysicalMemory mem;
    Mapping map;
    Status st = mem.Create(backend_, size, prop, -1, stage);
    if (st.ok()) st = map.Map(backend_, res.base(), size, mem.handle(), -1, stage);
    if (st.ok()) st = Grant(res.base(), size);
    // The mapping keeps the pages alive: the handle is not needed once mapped.
    if (mem.owned()) {
      Status rst = mem.Release(-1, stage);
      if (st.ok()) st = rst;
    }
    if (!st.ok()) {
      if (map.owned()) (void)map.Unmap(-1, stage);
      Keep(std::move(res));
      return st;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const CUdeviceptr at = res.base();  // before the moves below
    *base = reinterpret_cast<void*>(at);
    *got = size;
    live_.emplace(at, Live{std::move(res), std::move(map)});
    return Status();
  }

  void Put(void* base, size_t) override {
    ScopedContext ctx(backend_, device_);
    Live chunk;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(reinterpret_cast<CUdeviceptr>(base));
      if (it == live_.end()) return;
      chunk = std::move(it->second);
      live_.erase(it);
    }
    Status st = chunk.map.Unmap(-1, "host_numa store");
    if (!st.ok()) {
      ReportLeak(st);
      return;  // the Mapping and Reservation destructors report what stays
    }
    Keep(std::move(chunk.res));
  }

 private:
  struct Live {
    Reservation res;
    Mapping map;
  };

  // The device's host NUMA node (node 0 where the attribute says none), the capability, the granularity.
  Status Resolve() {
    std::lock_guard<std::mutex> lock(mu_);
    if (granule_) return Status();
    Location loc;
    JAXVMM_RETURN_IF_ERROR(HostNumaLocation(backend_, device_, &loc).At(-1, "host_numa store"));
    size_t g = 0;
    JAXVMM_RETURN_IF_ERROR(Granularity(backend_, device_, loc, &g));
    node_ = loc.id;
    granule_ = std::max<size_t>(g, 1);
    return Status();
  }

  // One cuMemSetAccess for the device and the CPU. A driver that refuses the CPU descriptor still
  // gets the device's grant (the engine never touches these bytes on the host).
  Status Grant(CUdeviceptr base, size_t size) {
    const DriverTable& d = Driver(backend_);
    CUmemAccessDesc desc[2] = {};
    desc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc[0].location.id = device_;
    desc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    desc[1].location.id = node_;
    desc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    Status st = Call(-1, "host_numa store", Entry::kMemSetAccess, [&] { return d.MemSetAccess(base, size, desc, 2); });
    if (st.ok()) return st;
    return Call(-1, "host_numa store", Entry::kMemSetAccess, [&] { return d.MemSetAccess(base, size, desc, 1); });
  }

  void Keep(Reservation res) {
    if (!res.owned()) return;
    std::lock_guard<std::mutex> lock(mu_);
    spare_.emplace(res.size(), std::move(res));
  }

  const Backend backend_;
  const int device_;
  std::mutex mu_;
  int node_ = 0;
  size_t granule_ = 0;
  std::map<CUdeviceptr, Live> live_;          // mapped chunks by base
  std::multimap<size_t, Reservation> spare_;  // VA ranges whose pages went back, by size
};

}  // namespace

std::unique_ptr<HostChunkSource> MakeHostNumaSource(Backend b, int device) {
  return std::make_unique<HostNumaSource>(b, device);
}

}  // namespace jaxvmm
