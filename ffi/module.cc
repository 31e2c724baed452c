// The Python module `jaxvmm._jaxvmm`: the only file that sees nanobind. Thin: decode arguments, call the
// core with the GIL released, turn a failed Status into the Python exception built by jaxvmm.errors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <unistd.h>

#include "bench.h"
#include "config.h"
#include "debug_stacks.h"
#include "driver.h"
#include "engine.h"
#include "fault.h"
#include "graph_kernels_ptx.h"
#include "handlers.h"
#include "registry.h"
#include "replay.h"
#include "sampler.h"
#include "share.h"
#include "slot.h"
#include "status.h"
#include "vmm.h"

namespace nb = nanobind;

namespace jaxvmm {
namespace {

struct StatusError {
  Status status;
};

nb::object& ErrorFactory() {
  static nb::object* f = new nb::object();
  return *f;
}

void Check(const Status& st) {
  if (!st.ok()) throw StatusError{st};
}

Backend ParseBackend(const std::string& name) {
  if (name == "cuda") return Backend::kCuda;
  if (name == "posix") return Backend::kPosix;
  Check(Status(Code::kInvalidArgument, "unknown backend '" + name + "' (expected 'cuda' or 'posix')"));
  return Backend::kPosix;
}

Setting FindSetting(const std::string& name) {
  Setting s{};
  if (!EngineConfig::Find(name, &s)) Check(Status(Code::kInvalidArgument, "unknown setting '" + name + "'"));
  return s;
}

Location ParseLocation(const std::string& kind, int id) {
  if (kind == "device") return Location{CU_MEM_LOCATION_TYPE_DEVICE, id};
  if (kind == "host_numa") return Location{CU_MEM_LOCATION_TYPE_HOST_NUMA, id};
  Check(Status(Code::kInvalidArgument, "unknown location '" + kind + "' (expected 'device' or 'host_numa')"));
  return {};
}

Entry ParseEntry(const std::string& name) {
  int e = EntryFromName(name);
  if (e < 0) Check(Status(Code::kInvalidArgument, "unknown driver entry '" + name + "'"));
  return static_cast<Entry>(e);
}

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

nb::dict CountsDict(const SlotCounts& c) {
  nb::dict d;
  d["slots"] = c.slots;
  d["reserved_bytes"] = c.reserved_bytes;
  d["mapped_bytes"] = c.mapped_bytes;
  d["peak_mapped_bytes"] = c.peak_mapped_bytes;
  return d;
}

nb::dict InfoDict(const SlotInfo& i) {
  nb::dict d;
  d["id"] = i.id;
  d["backend"] = BackendName(i.backend);
  d["device"] = i.device;
  d["location"] = i.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? "host_numa" : "device";
  d["location_id"] = i.location.id;
  d["address"] = static_cast<uint64_t>(i.address);
  d["nbytes"] = i.nbytes;
  d["size"] = i.size;
  d["generation"] = i.generation;
  d["state"] = SlotStateName(i.state);
  d["mapped"] = i.mapped;
  d["mapped_bytes"] = i.mapped_bytes;
  d["last_error"] = i.last_error;
  d["imported"] = i.imported;
  d["shareable"] = i.handle_types == CU_MEM_HANDLE_TYPE_NONE ? "" : ShareableName(static_cast<CUmemAllocationHandleType>(i.handle_types));
  d["views"] = i.views;
  return d;
}

nb::dict StatsDict() {
  RegistryStats s;
  {
    nb::gil_scoped_release nogil;
    s = Registry::Get().Stats();
  }
  nb::dict d;
  d["slots"] = s.slots;
  d["reserved_bytes"] = s.reserved_bytes;
  d["mapped_bytes"] = s.mapped_bytes;
  d["peak_mapped_bytes"] = s.peak_mapped_bytes;
  d["created"] = s.created;
  d["closed"] = s.closed;
  d["releases"] = s.releases;
  d["remaps"] = s.remaps;
  d["user"] = CountsDict(s.user);
  d["internal"] = CountsDict(s.internal);
  d["leaked"] = LeakCount();
  int64_t qbytes = 0;
  nb::list q;
  for (const auto& e : s.quarantine) {
    nb::dict qd;
    qd["slot"] = e.id;
    qd["backend"] = BackendName(e.backend);
    qd["device"] = e.device;
    qd["address"] = Hex(e.address);
    qd["size"] = e.size;
    qd["mapped_bytes"] = e.mapped_bytes;
    qd["error"] = e.error;
    qd["attempts"] = e.attempts;
    q.append(qd);
    qbytes += static_cast<int64_t>(e.size);
  }
  d["quarantined"] = static_cast<int64_t>(s.quarantine.size());
  d["quarantined_bytes"] = qbytes;
  d["quarantine"] = q;
  nb::dict devs;
  for (const auto& [key, ds] : s.devices) {
    nb::dict dd;
    dd["slots"] = ds.slots;
    dd["reserved_bytes"] = ds.reserved_bytes;
    dd["mapped_bytes"] = ds.mapped_bytes;
    dd["peak_mapped_bytes"] = ds.peak_mapped_bytes;
    dd["user"] = CountsDict(ds.user);
    dd["internal"] = CountsDict(ds.internal);
    devs[nb::make_tuple(BackendName(static_cast<Backend>(key.first)), key.second)] = dd;
  }
  d["devices"] = devs;
  return d;
}

CUmemAllocationHandleType ParseShareable(const std::string& kind) {
  if (kind.empty() || kind == "none") return CU_MEM_HANDLE_TYPE_NONE;
  if (kind == "posix_fd") return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (kind == "fabric") return CU_MEM_HANDLE_TYPE_FABRIC;
  Check(Status(Code::kInvalidArgument, "unknown shareable handle type '" + kind + "' (expected 'posix_fd' or 'fabric')"));
  return CU_MEM_HANDLE_TYPE_NONE;
}

// ---- DLPack (the v0.x ABI every consumer accepts: an unversioned DLManagedTensor in a "dltensor" capsule) ----
struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// Owns what the tensor points at and keeps the slot (and its view count) alive until the consumer
// deletes the tensor. The deleter may run on any thread, without the GIL: it touches no Python object.
struct ViewContext {
  std::shared_ptr<Slot> slot;
  std::vector<int64_t> shape, strides;
  DLManagedTensor tensor;
};

void DeleteView(DLManagedTensor* t) {
  auto* ctx = static_cast<ViewContext*>(t->manager_ctx);
  std::shared_ptr<Slot> slot = std::move(ctx->slot);
  delete ctx;
  slot->DropView();
  // The slot's Python object died while this view lived: the last view closes it (NotFound: someone
  // else already did; a failure is quarantined and reported by the registry). Not on this thread: jax
  // may run the deleter inside a CUDA host callback, where driver calls are forbidden.
  if (slot->close_when_unviewed() && slot->views() == 0) {
    int64_t id = slot->id();
    std::thread([id] { (void)Registry::Get().Close(id); }).detach();
  }
}

// A capsule nobody consumed still owns its tensor; a consumed one was renamed "used_dltensor".
void DestroyViewCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (t != nullptr) t->deleter(t);
  } else {
    PyErr_Clear();
  }
}

using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace
}  // namespace jaxvmm

NB_MODULE(_jaxvmm, m) {
  using namespace jaxvmm;
  m.doc() = "jaxvmm native core (driver seam, slots, registry). Use the jaxvmm package, not this module.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const Status& st = e.status;
      nb::object& factory = ErrorFactory();
      if (!factory.is_valid()) {
        PyErr_SetString(PyExc_RuntimeError, st.ToString().c_str());
        return;
      }
      nb::object exc = factory(CodeName(st.code()), st.ToString(), st.driver_error(), st.slot(), st.stage());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("_set_error_factory", [](nb::object f) { ErrorFactory() = std::move(f); });

  m.def("backend_status", [](const std::string& backend) {
    Backend b = ParseBackend(backend);
    DriverAvailability a;
    {
      nb::gil_scoped_release nogil;
      a = Availability(b);
    }
    return nb::make_tuple(a.ok, a.reason, a.driver_version);
  });

  m.def("set_posix_device_count", [](int n) { SetPosixDeviceCount(n); });
  m.def("set_posix_device_ids", [](std::vector<int64_t> ids) {
    SetPosixDeviceIds(ids.data(), static_cast<int>(ids.size()));
  });

  m.def("granularity", [](const std::string& backend, int device, const std::string& loc, int loc_id) {
    size_t g = 0;
    Backend b = ParseBackend(backend);
    Location l = ParseLocation(loc, loc_id);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = Granularity(b, device, l, &g);
    }
    Check(st);
    return g;
  });

  m.def("slot_create", [](const std::string& backend, int device, const std::string& loc, int loc_id,
                          std::vector<int> access, uint64_t nbytes, const std::string& shareable) {
    SlotSpec spec;
    spec.backend = ParseBackend(backend);
    spec.device = device;
    spec.location = ParseLocation(loc, loc_id);
    spec.access = std::move(access);
    spec.nbytes = nbytes;
    spec.handle_types = ParseShareable(shareable);
    int64_t id = -1;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = Registry::Get().Create(spec, &id);
    }
    Check(st);
    return id;
  }, nb::arg("backend"), nb::arg("device"), nb::arg("loc"), nb::arg("loc_id"), nb::arg("access"), nb::arg("nbytes"),
     nb::arg("shareable") = "");

  // ---- sharing (jaxvmm/share.py) ----
  m.def("shareable_check", [](const std::string& backend, int device, const std::string& loc, int loc_id,
                              const std::string& kind) {
    Backend b = ParseBackend(backend);
    Location l = ParseLocation(loc, loc_id);
    CUmemAllocationHandleType t = ParseShareable(kind);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = CheckShareable(b, device, l, t);
    }
    Check(st.ok() ? st : Status(st).At(-1, "create"));
  });

  // Returns (fd, fabric bytes, channel fd, generation, size); the descriptors are new and the caller's.
  m.def("slot_export", [](int64_t id, const std::string& kind) {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    CUmemAllocationHandleType t = ParseShareable(kind);
    if (t == CU_MEM_HANDLE_TYPE_NONE) Check(Status(Code::kInvalidArgument, "export needs a handle type").At(id, "export"));
    ExportedHandle h;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = s->Export(t, &h);
    }
    Check(st);
    nb::bytes fabric(reinterpret_cast<const char*>(h.fabric.data),
                     t == CU_MEM_HANDLE_TYPE_FABRIC ? sizeof(h.fabric.data) : 0);
    return nb::make_tuple(h.fd, fabric, h.channel_fd, h.generation, h.size);
  });

  // Maps the pages a handle names as a new slot of this process. `fd` is borrowed (never closed here).
  m.def("slot_import", [](const std::string& backend, int device, std::vector<int> access, const std::string& kind,
                          int fd, nb::bytes fabric, uint64_t size, uint64_t granularity, uint64_t generation) {
    SlotSpec spec;
    spec.backend = ParseBackend(backend);
    spec.device = device;
    spec.location = Location{CU_MEM_LOCATION_TYPE_DEVICE, device};  // the importer's device (granularity, access)
    spec.access = std::move(access);
    spec.nbytes = size;
    ImportSource src;
    src.type = ParseShareable(kind);
    src.fd = fd;
    src.alignment = granularity;
    src.generation = generation;
    if (src.type == CU_MEM_HANDLE_TYPE_FABRIC) {
      if (fabric.size() != sizeof(src.fabric.data))
        Check(Status(Code::kInvalidArgument, "a fabric handle is " + std::to_string(sizeof(src.fabric.data)) +
                                                 " bytes, got " + std::to_string(fabric.size())).At(-1, "import"));
      std::memcpy(src.fabric.data, fabric.c_str(), sizeof(src.fabric.data));
    } else if (src.type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
      Check(Status(Code::kInvalidArgument, "import needs a handle type").At(-1, "import"));
    }
    int64_t id = -1;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = Registry::Get().Import(spec, src, &id);
    }
    Check(st);
    return id;
  });

  // A DLPack capsule aliasing [offset, offset + nbytes) of the slot; counts as a view until deleted.
  m.def("slot_dlpack", [](int64_t id, uint64_t offset, std::vector<int64_t> shape, int code, int bits,
                          int device_type, int device_id) {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    uint64_t n = static_cast<uint64_t>(bits) / 8;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    Check(s->AddView(offset, n));
    auto* ctx = new ViewContext{s, shape, std::vector<int64_t>(shape.size(), 1), {}};
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) ctx->strides[i] = ctx->strides[i + 1] * shape[i + 1];
    DLTensor& t = ctx->tensor.dl_tensor;
    t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(s->address() + offset));
    t.device = DLDevice{device_type, device_id};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = DLDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
    t.shape = ctx->shape.data();
    t.strides = ctx->strides.data();
    t.byte_offset = 0;
    ctx->tensor.manager_ctx = ctx;
    ctx->tensor.deleter = &DeleteView;
    PyObject* cap = PyCapsule_New(&ctx->tensor, "dltensor", &DestroyViewCapsule);
    if (cap == nullptr) {
      DeleteView(&ctx->tensor);
      throw nb::python_error();
    }
    return nb::steal(cap);
  });

  m.def("slot_close_when_unviewed", [](int64_t id) {
    std::shared_ptr<Slot> s;
    if (!Registry::Get().Lookup(id, &s).ok()) return;
    s->RequestCloseWhenUnviewed();
    if (s->views() == 0) {  // the last view died in between
      nb::gil_scoped_release nogil;
      (void)Registry::Get().Close(id);
    }
  });

  m.def("share_stats", [] {
    ShareStats s = ReadShareStats();
    nb::dict d;
    d["exports"] = s.exports;
    d["imports"] = s.imports;
    d["imported_slots"] = s.imported_slots;
    d["views"] = s.views;
    d["channel_fds"] = s.channel_fds;
    return d;
  });

  // Seconds per copy of `nbytes` from slot `src_id` to slot `dst_id` (offset 0) on a stream of `device`,
  // one entry per iteration (bench/share_bw.py). Both slots must be mapped and accessible from `device`.
  m.def("bench_slot_copy", [](const std::string& backend, int device, int64_t dst_id, int64_t src_id, uint64_t nbytes,
                              int iters) {
    std::shared_ptr<Slot> dst, src;
    Check(Registry::Get().Lookup(dst_id, &dst));
    Check(Registry::Get().Lookup(src_id, &src));
    if (nbytes > dst->spec().nbytes || nbytes > src->spec().nbytes)
      Check(Status(Code::kInvalidArgument, "nbytes exceeds a slot"));
    Backend b = ParseBackend(backend);
    std::vector<double> out;
    Status st;
    {
      nb::gil_scoped_release nogil;
      ScopedContext ctx(b, device);
      st = ctx.status();
      const DriverTable& d = Driver(b);
      CUstream stream = nullptr;
      if (st.ok()) st = Call(-1, "bench", Entry::kStreamCreateWithPriority,
                             [&] { return d.StreamCreateWithPriority(&stream, CU_STREAM_NON_BLOCKING, 0); });
      for (int i = 0; st.ok() && i < iters; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        st = Call(-1, "bench", Entry::kMemcpyDtoDAsync,
                  [&] { return d.MemcpyDtoDAsync(dst->address(), src->address(), nbytes, stream); });
        if (st.ok()) st = Call(-1, "bench", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(stream); });
        out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      if (stream != nullptr) d.StreamDestroy(stream);
    }
    Check(st);
    return out;
  });

  m.def("slot_info", [](int64_t id) {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    SlotInfo i;
    {
      nb::gil_scoped_release nogil;
      i = s->Info();
    }
    return InfoDict(i);
  });

  auto by_id = [](Status (Registry::*op)(int64_t)) {
    return [op](int64_t id) {
      Status st;
      {
        nb::gil_scoped_release nogil;
        st = (Registry::Get().*op)(id);
      }
      Check(st);
    };
  };
  m.def("slot_release", by_id(&Registry::Release));
  m.def("slot_remap", by_id(&Registry::Remap));
  m.def("slot_close", by_id(&Registry::Close));

  m.def("slot_write", [](int64_t id, uint64_t offset, ConstBytes data) {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = s->Write(offset, data.data(), data.shape(0));
    }
    Check(st);
  });

  m.def("slot_read_into", [](int64_t id, uint64_t offset, MutBytes out) {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = s->Read(offset, out.data(), out.shape(0));
    }
    Check(st);
  });

  m.def("find_range", [](uint64_t base, uint64_t length) {
    int64_t id = -1;
    Check(Registry::Get().FindRange(base, length, &id));
    return id;
  });

  m.def("stats", &StatsDict);
  m.def("reset_peak", [] { Registry::Get().ResetPeak(); });
  m.def("retry_quarantine", [] {
    nb::gil_scoped_release nogil;
    return Registry::Get().RetryQuarantine();
  });
  m.def("close_all", [](bool final) {
    nb::gil_scoped_release nogil;
    Engine::ShutdownAll(final);
    Registry::Get().CloseAll();
  }, nb::arg("final") = false);

  // ---- offload engine ----
  m.def("handlers", [] {
    nb::list out;
    auto cap = [](void* f) -> nb::object { return f ? nb::object(nb::capsule(f)) : nb::none(); };
    for (const auto& h : Handlers())
      out.append(nb::make_tuple(h.name, h.platform, cap(h.fn), cap(h.graph_fn), cap(h.initialize)));
    return out;
  });
  m.def("ffi_api_version", &FfiApiVersion);
  auto engine = [](const std::string& backend, int device) {
    Engine* e = nullptr;
    Backend b = ParseBackend(backend);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = Engine::For(b, device, &e);
    }
    Check(st);
    return e;
  };
  m.def("engine_stats", [engine](const std::string& backend, int device) {
    EngineStats s = engine(backend, device)->Stats();
    nb::dict d;
    d["offloads"] = s.counts.offloads;
    d["reloads"] = s.counts.reloads;
    d["prefetches"] = s.counts.prefetches;
    d["prefetch_hits"] = s.counts.prefetch_hits;
    d["prefetch_misses"] = s.counts.prefetch_misses;
    d["tickets_live"] = s.tickets_live;
    d["ticket_host_bytes"] = s.ticket_host_bytes;
    d["errors"] = s.counts.errors;
    d["drops"] = s.counts.drops;
    d["seq_issued"] = s.ring.seq_issued;
    d["seq_completed"] = s.ring.seq_completed;
    d["handler_calls"] = s.ring.handler_calls;
    d["handler_median_ns"] = s.ring.handler_median_ns;
    d["handler_p99_ns"] = s.ring.handler_p99_ns;
    d["handler_offload_median_ns"] = s.ring.offload_median_ns;
    d["handler_reload_median_ns"] = s.ring.reload_median_ns;
    if (!s.ring.offload_sections.empty() || !s.ring.reload_sections.empty()) {  // JAXVMM_DEBUG_RING_PROFILE=1
      nb::dict off, rel;
      for (const auto& [name, ns] : s.ring.offload_sections) off[name.c_str()] = ns;
      for (const auto& [name, ns] : s.ring.reload_sections) rel[name.c_str()] = ns;
      d["handler_offload_sections_ns"] = off;
      d["handler_reload_sections_ns"] = rel;
    }
    d["ring_copy_kernel"] = s.ring.copy_kernel ? 1 : 0;
    d["staging_budget_bytes"] = s.staging.budget_bytes;
    d["staging_mapped_bytes"] = s.staging.mapped_bytes;
    d["staging_peak_bytes"] = s.staging.peak_mapped_bytes;
    d["staging_cells"] = s.staging.cells;
    d["staging_acquires"] = s.staging.acquires;
    d["staging_device_waits"] = s.staging.device_waits;
    d["staging_host_waits"] = s.staging.host_waits;
    d["staging_direct_reloads"] = s.staging.direct_reloads;
    d["staging_pages_mapped"] = s.staging.pages_mapped;
    d["staging_pages_returned"] = s.staging.pages_returned;
    d["staging_shared_pages"] = s.staging.shared_pages;
    d["ops_in_flight"] = s.ring.ops_in_flight;
    d["pinned_bytes"] = s.host.chunk_bytes;
    d["pinned_in_use_bytes"] = s.host.in_use_bytes;
    d["pinned_peak_in_use_bytes"] = s.host.peak_in_use_bytes;
    d["pinned_window_peak_bytes"] = s.host.window_peak_in_use_bytes;
    d["staging_window_peak_bytes"] = s.staging.window_peak_mapped_bytes;
    d["pinned_allocs"] = s.host.driver_allocs;
    d["pinned_limit_bytes"] = s.host.limit_bytes;
    d["pinned_alloc_ns"] = s.host.alloc_ns;
    d["host_numa_bytes"] = s.host_numa.chunk_bytes;
    d["host_numa_in_use_bytes"] = s.host_numa.in_use_bytes;
    d["host_numa_peak_in_use_bytes"] = s.host_numa.peak_in_use_bytes;
    d["host_numa_window_peak_bytes"] = s.host_numa.window_peak_in_use_bytes;
    d["host_numa_allocs"] = s.host_numa.driver_allocs;
    d["host_numa_frees"] = s.host_numa.driver_frees;
    d["host_numa_alloc_ns"] = s.host_numa.alloc_ns;
    d["host_store"] = HostStoreName(s.host_store);
    d["host_store_bytes"] = s.host_store == HostStoreKind::kHostNuma ? s.host_numa.chunk_bytes : s.host.chunk_bytes;
    d["staging_offload_cells"] = s.staging.offload_cells;
    d["staging_reload_cells"] = s.staging.reload_cells;
    d["graph_channels"] = s.graph.channels;
    d["graph_prepares"] = s.graph.prepares;
    d["graph_captures"] = s.graph.captures;
    d["graph_offload_rounds"] = s.graph.offload_rounds;
    d["graph_reload_rounds"] = s.graph.reload_rounds;
    d["graph_hits"] = s.graph.hits;
    d["graph_misses"] = s.graph.misses;
    d["graph_mapped_bytes"] = s.graph.mapped_bytes;
    d["graph_pages_mapped"] = s.graph.pages_mapped;
    d["graph_pages_returned"] = s.graph.pages_returned;
    d["graph_kernels"] = static_cast<int64_t>(s.graph.kernels);
    d["graph_early_launch"] = static_cast<int64_t>(s.graph.early_launch);
    d["graph_grants_device"] = s.graph.grants_device;
    d["graph_grants_host"] = s.graph.grants_host;
    d["graph_revokes"] = s.graph.revokes;
    d["graph_revokes_lost"] = s.graph.revokes_lost;
    d["graph_cells_host"] = s.graph.host_cells;
    d["graph_host_fallbacks"] = s.graph.host_fallbacks;
    d["graph_bounce_copies"] = s.graph.bounce_copies;
    d["graph_cells"] = s.graph.cells;
    d["graph_early_captures"] = s.graph.early_captures;
    d["graph_spares"] = s.graph.spares;
    d["graph_lends"] = s.graph.lends;
    d["graph_lent_reads"] = s.graph.lent_reads;
    d["graph_kept_reads"] = s.graph.kept_reads;
    d["graph_holds"] = s.graph.holds;
    d["graph_spare_bytes"] = s.graph.spare_bytes;
    d["graph_spare_bytes_peak"] = s.graph.spare_bytes_peak;
    d["graph_trades"] = s.graph.trades;
    d["graph_offload_cell_reads"] = s.graph.cell_reads;
    d["graph_xla_in_order"] = s.graph.xla_in_order;
    return d;
  });
  // Why the engine's grant kernels did not load ("" when they did or were never tried). Not in
  // engine_stats(), whose values are all integers.
  m.def("engine_graph_kernels_error", [engine](const std::string& backend, int device) {
    return engine(backend, device)->Stats().graph.kernels_error;
  });
  m.def("engine_reset_peaks", [engine](const std::string& backend, int device) {
    engine(backend, device)->ResetPeaks();
  });
  m.def("engine_devices", [] {
    nb::list out;
    for (Engine* e : Engine::All()) out.append(nb::make_tuple(BackendName(e->backend()), e->device()));
    return out;
  });
  m.def("engine_take_error", [engine](const std::string& backend, int device) {
    Engine* e = engine(backend, device);
    Check(e->TakeError());
  });
  m.def("engine_sync", [engine](const std::string& backend, int device) {
    Engine* e = engine(backend, device);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = e->Synchronize();
    }
    Check(st);
  });
  m.def("engine_drop", [](const std::string& backend, int device, uint64_t token) {
    // Best effort (Python finalizers): nothing to drop once the engines are gone.
    Engine* e = nullptr;
    if (Engine::For(ParseBackend(backend), device, &e).ok()) e->Drop(token);
  });
  m.def("engine_check", [engine](const std::string& backend, int device, uint64_t token, uint64_t nbytes,
                                 int64_t signature, bool reserve) {
    Engine* e = engine(backend, device);
    Status st;
    {
      nb::gil_scoped_release nogil;  // it may wait for the poller to serve the round that made the token
      st = e->CheckTicket(token, ArrayMeta{nbytes, signature}, reserve);
    }
    Check(st);
  });
  m.def("engine_unreserve", [engine](const std::string& backend, int device, uint64_t token) {
    engine(backend, device)->Unreserve(token);
  });
  m.def("engine_keep", [engine](const std::string& backend, int device, uint64_t token) {
    Engine* e = engine(backend, device);
    Status st;
    {
      nb::gil_scoped_release nogil;  // it may wait for the poller to serve the round that made the token
      st = e->Keep(token);
    }
    Check(st);
  });
  // Every thread's native stack to stderr (tools/watchdog.py, for hangs); returns how many answered.
  m.def("debug_thread_stacks", [] {
    nb::gil_scoped_release nogil;
    std::fflush(stderr);
    return DumpThreadStacks(2);
  });

  // ---- capture and replay without XLA (tests): the engine's entry points on raw addresses ----
  m.def("engine_prepare", [engine](const std::string& backend, int device, uint64_t stream, int64_t site, int kind,
                                   uint64_t nbytes, int64_t signature) {
    Engine* e = engine(backend, device);
    nb::gil_scoped_release nogil;
    Check(e->Prepare(reinterpret_cast<CUstream>(stream), site, static_cast<ChannelKind>(kind), ArrayMeta{nbytes, signature}));
  });
  m.def("engine_offload", [engine](const std::string& backend, int device, uint64_t stream, int64_t site, uint64_t src,
                                   uint64_t nbytes, int64_t signature, uint64_t token_out) {
    Engine* e = engine(backend, device);
    nb::gil_scoped_release nogil;
    Check(e->Offload(reinterpret_cast<CUstream>(stream), site, src, ArrayMeta{nbytes, signature}, token_out));
  });
  m.def("engine_reload", [engine](const std::string& backend, int device, uint64_t stream, int64_t site, uint64_t token_in,
                                  uint64_t dst, uint64_t nbytes, int64_t signature) {
    Engine* e = engine(backend, device);
    nb::gil_scoped_release nogil;
    Check(e->Reload(reinterpret_cast<CUstream>(stream), site, token_in, dst, ArrayMeta{nbytes, signature}));
  });
  m.def("replay_stream_create", [](const std::string& backend, int device) {
    uint64_t s = 0;
    Backend b = ParseBackend(backend);
    Check(ReplayStreamCreate(b, device, &s));
    return s;
  });
  using StreamFn = Status (*)(Backend, int, uint64_t);
  for (auto [name, fn] : {std::pair<const char*, StreamFn>{"replay_stream_destroy", &ReplayStreamDestroy},
                          {"replay_stream_sync", &ReplayStreamSynchronize},
                          {"replay_begin", &ReplayBeginCapture},
                          {"replay_destroy", &ReplayDestroy}})
    m.def(name, [fn](const std::string& backend, int device, uint64_t handle) {
      Backend b = ParseBackend(backend);
      Status st;
      {
        nb::gil_scoped_release nogil;
        st = fn(b, device, handle);
      }
      Check(st);
    });
  m.def("replay_end", [](const std::string& backend, int device, uint64_t stream) {
    uint64_t x = 0;
    Backend b = ParseBackend(backend);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = ReplayEndCapture(b, device, stream, &x);
    }
    Check(st);
    return x;
  });
  m.def("replay_launch", [](const std::string& backend, int device, uint64_t exec, uint64_t stream) {
    Backend b = ParseBackend(backend);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = ReplayLaunch(b, device, exec, stream);
    }
    Check(st);
  });
  // Every engine whose call sites were captured: wait for the device to drain (no engine lock held), so
  // that a module load (the first run of a newly compiled program) never waits for rounds that need
  // the poller's driver calls. Returns how many engines waited.
  m.def("engines_quiesce_for_module_load", []() {
    int waited = 0;
    Status first;
    {
      nb::gil_scoped_release nogil;
      for (Engine* e : Engine::All()) {
        bool w = false;
        Status st = e->QuiesceForModuleLoad(&w);
        if (!st.ok() && first.ok()) first = st;
        waited += w ? 1 : 0;
      }
    }
    Check(first);
    return waited;
  });
  m.def("engine_reserve_host", [engine](const std::string& backend, int device, size_t bytes) {
    Engine* e = engine(backend, device);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = e->ReserveHost(bytes);
    }
    Check(st);
  });
  m.def("engine_trim", [engine](const std::string& backend, int device) {
    Engine* e = engine(backend, device);
    nb::gil_scoped_release nogil;
    return e->Trim();
  });
  m.def("engine_unclaimed_tickets", [engine](const std::string& backend, int device) {
    return engine(backend, device)->UnclaimedTickets();
  });
  m.def("engine_set_next_ticket", [engine](const std::string& backend, int device, uint32_t n) {
    engine(backend, device)->SetNextTicketNumber(n);
  });
  // Whether XLA keeps the order of recorded commands, as XLA_FLAGS says now (an engine asks once, when
  // it is made: graph mode reads another call site's offload cell only then).
  m.def("xla_keeps_command_order", [] { return EngineConfig::XlaKeepsCommandOrder(); });
  m.def("graph_max_cells", [] { return kMaxCells; });
  m.def("graph_max_spares", [] { return kMaxSpares; });
  m.def("graph_kernels_ptx", [] { return std::string(kGraphKernelsPtx); });
  // Test hook (cpu): right after the next offload round's take kernel took its grant, trim() the cpu
  // engine of `device` (a revocation ordered after a take, deterministically).
  // Test hook: pause (or resume) the graph-mode poller of the engine of (backend, device).
  m.def("testing_pause_poller", [engine](const std::string& backend, int device, bool paused) {
    engine(backend, device)->PausePoller(paused);
  });
  // Test hook (cpu): device-location pages beyond `bytes` fail to be created (out of memory); < 0: no limit.
  m.def("testing_posix_device_limit", [](int64_t bytes) { SetPosixDeviceMemoryLimit(bytes); });
  m.def("testing_posix_pageable_copies", [] { return PosixPageableCopies(); });
  m.def("testing_posix_device_bytes", [] { return PosixDeviceBytes(); });
  m.def("testing_trim_after_next_take", [](int device) {
    static int dev = 0;
    dev = device;
    SetPosixAfterTakeHook(
        [](void* arg) {
          Engine* e = nullptr;
          if (Engine::For(Backend::kPosix, *static_cast<int*>(arg), &e).ok()) e->Trim();
        },
        &dev);
  });
  // The one way settings arrive (jaxvmm/_config.py declares them, validates them first and pushes
  // every one at import): by name, a number (an int; a switch as 0 or 1) or a choice's name.
  m.def("set_setting", [](const std::string& name, std::variant<int64_t, std::string> value) {
    const Setting s = FindSetting(name);
    if (const auto* choice = std::get_if<std::string>(&value)) {
      if (!EngineConfig::SetChoice(s, *choice))
        Check(Status(Code::kInvalidArgument, "setting '" + name + "' has no choice '" + *choice + "'"));
    } else if (!EngineConfig::Set(s, std::get<int64_t>(value))) {
      Check(Status(Code::kInvalidArgument, "setting '" + name + "' takes the name of a choice"));
    }
    if (s == Setting::kHostPoolLimit) {
      nb::gil_scoped_release nogil;  // pools over a lowered limit return their empty chunks to the driver now
      HostPool::ShrinkAllToLimit();
    }
  });
  // The value in force: an int, or a choice's name.
  m.def("get_setting", [](const std::string& name) -> nb::object {
    const Setting s = FindSetting(name);
    const int64_t v = EngineConfig::Get(s);
    if (const char* choice = EngineConfig::ChoiceName(s, v)) return nb::str(choice);
    return nb::int_(v);
  });

  m.def("memory_info", [](const std::string& backend, int device) {
    Backend b = ParseBackend(backend);
    size_t free_b = 0, total = 0;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = CheckCapability(b, device, Location{CU_MEM_LOCATION_TYPE_DEVICE, device});
      if (st.ok()) {
        ScopedContext ctx(b, device);
        st = ctx.status();
        if (st.ok()) {
          CUresult r = Driver(b).MemGetInfo(&free_b, &total);
          if (r != CUDA_SUCCESS) st = Status::Driver(r, Entry::kMemGetInfo).At(-1, "memory_info");
        }
      }
    }
    Check(st);
    return nb::make_tuple(free_b, total);
  });

  // ---- memory timeline (jaxvmm.memory_timeline): samplers by id ----
  static std::mutex sampler_mu;
  static auto* samplers = new std::map<int64_t, std::shared_ptr<MemorySampler>>();
  static int64_t next_sampler = 1;
  auto sampler = [](int64_t id) {
    std::lock_guard<std::mutex> lock(sampler_mu);
    auto it = samplers->find(id);
    if (it == samplers->end()) Check(Status(Code::kNotFound, "memory sampler " + std::to_string(id) + " is closed"));
    return it->second;  // shared: a concurrent close cannot free it under the caller
  };
  m.def("sampler_start", [](const std::string& backend, int device, uint64_t capacity, int64_t interval_ns) {
    Backend b = ParseBackend(backend);
    std::unique_ptr<MemorySampler> s;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = MemorySampler::Start(b, device, static_cast<size_t>(capacity), interval_ns, &s);
    }
    Check(st);
    std::lock_guard<std::mutex> lock(sampler_mu);
    int64_t id = next_sampler++;
    (*samplers)[id] = std::move(s);
    return id;
  });
  m.def("sampler_stop", [sampler](int64_t id) {
    std::shared_ptr<MemorySampler> s = sampler(id);
    nb::gil_scoped_release nogil;
    s->Stop();
  });
  m.def("sampler_close", [](int64_t id) {
    std::shared_ptr<MemorySampler> s;
    {
      std::lock_guard<std::mutex> lock(sampler_mu);
      auto it = samplers->find(id);
      if (it == samplers->end()) return;
      s = std::move(it->second);
      samplers->erase(it);
    }
    nb::gil_scoped_release nogil;
    s.reset();
  });
  m.def("sampler_summary", [sampler](int64_t id) {
    MemorySamplerSummary m = sampler(id)->Summary();
    auto sample = [](const MemorySample& x) { return nb::make_tuple(x.t_ns, x.used, x.mapped, x.internal); };
    nb::dict d;
    d["taken"] = m.taken;
    d["kept"] = m.kept;
    d["errors"] = m.errors;
    d["total"] = m.total;
    d["first"] = sample(m.first);
    d["peak"] = sample(m.peak);
    d["peak_mapped"] = m.peak_mapped;
    d["elapsed_ns"] = m.elapsed_ns;
    return d;
  });
  // The ring, oldest first, as raw int64 quadruples (t_ns, used, mapped, internal).
  m.def("sampler_series", [sampler](int64_t id) {
    std::vector<MemorySample> v = sampler(id)->Series();
    static_assert(sizeof(MemorySample) == 4 * sizeof(int64_t), "packed int64 quadruples");
    return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(MemorySample));
  });

  // ---- test and benchmark hooks (jaxvmm.testing) ----
  m.def("driver_entries", [] {
    std::vector<std::string> names;
    for (int i = 0; i < kEntryCount; ++i) names.push_back(EntryName(static_cast<Entry>(i)));
    return names;
  });
  m.def("fault_arm", [](const std::string& backend, const std::string& entry, int64_t nth, int64_t times,
                        const std::string& error) {
    CUresult r;
    if (!ResultFromName(error, &r)) Check(Status(Code::kInvalidArgument, "unknown CUresult name '" + error + "'"));
    ArmFault(ParseBackend(backend), ParseEntry(entry), nth, times, r);
  });
  m.def("fault_clear", [](const std::string& backend) { ClearFaults(ParseBackend(backend)); });
  m.def("fault_counters", [](const std::string& backend) {
    DriverCounters c = ReadCounters(ParseBackend(backend));
    nb::dict d;
    d["live_handles"] = c.live_handles;
    d["live_reservations"] = c.live_reservations;
    d["live_mappings"] = c.live_mappings;
    d["injected"] = c.injected;
    nb::dict calls;
    for (int i = 0; i < kEntryCount; ++i) calls[EntryName(static_cast<Entry>(i))] = c.calls[i];
    d["calls"] = calls;
    return d;
  });
  m.def("bench_ops", [](const std::string& backend, int device, uint64_t nbytes, int iters) {
    std::map<std::string, double> out;
    Backend b = ParseBackend(backend);
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = BenchOps(b, device, nbytes, iters, &out);
    }
    Check(st);
    return out;
  });
}
