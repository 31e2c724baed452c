// The Python module `jaxvmm._jaxvmm`: with module.h and module_testing.cc, the only files that see
// nanobind. Thin: decode arguments, call the core without the GIL, turn a failed Status into the Python
// exception built by jaxvmm.errors.
//
// What Python sees, in the order bound below:
//   errors        _set_error_factory
//   driver seam   backend_status, set_posix_device_count/_ids, granularity, shareable_check, memory_info,
//                 driver_counters, debug_thread_stacks
//   slots         Slot (a handle by id: info, release, remap, close, close_when_unviewed, write, read_into,
//                 export, dlpack), slot(id), create_slot, import_slot, find_range
//   accounting    stats, reset_peak, retry_quarantine, close_all, share_stats
//   engines       Engine (stats, graph_kernels_error, reset_peaks, take_error, sync, drop, check, unreserve,
//                 keep, reserve_host, trim, unclaimed_tickets), engine(backend, device), engine_devices,
//                 engines_quiesce_for_module_load, handlers, ffi_api_version
//   timeline      MemorySampler (stop, close, summary, series), start_sampler
//   settings      set_setting, get_setting (jaxvmm/_config.py), xla_keeps_command_order
//   hooks         load_testing() binds jaxvmm._jaxvmm._testing (module_testing.cc) on first use
#include "module.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "config.h"
#include "debug_stacks.h"
#include "driver.h"
#include "engine.h"
#include "fault.h"
#include "handlers.h"
#include "registry.h"
#include "sampler.h"
#include "share.h"
#include "slot.h"
#include "stat_fields.h"
#include "status.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

nb::object& ErrorFactory() {
  static nb::object* f = new nb::object();
  return *f;
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

CUmemAllocationHandleType ParseShareable(const std::string& kind) {
  if (kind.empty() || kind == "none") return CU_MEM_HANDLE_TYPE_NONE;
  if (kind == "posix_fd") return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (kind == "fabric") return CU_MEM_HANDLE_TYPE_FABRIC;
  Check(Status(Code::kInvalidArgument, "unknown shareable handle type '" + kind + "' (expected 'posix_fd' or 'fabric')"));
  return CU_MEM_HANDLE_TYPE_NONE;
}

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---- stats dicts, from the field tables next to the stats structs ----
template <typename T, size_t N>
void PutFields(nb::dict& d, const T& s, const StatField<T> (&fields)[N], const std::string& prefix = "") {
  for (const StatField<T>& f : fields) d[(prefix + f.key).c_str()] = f.Get(s);
}

template <typename T, size_t N>
nb::dict FieldsDict(const T& s, const StatField<T> (&fields)[N]) {
  nb::dict d;
  PutFields(d, s, fields);
  return d;
}

nb::dict StatsDict(const RegistryStats& s) {
  nb::dict d = FieldsDict(s, kRegistryStatsFields);
  d["user"] = FieldsDict(s.user, kSlotCountsFields);
  d["internal"] = FieldsDict(s.internal, kSlotCountsFields);
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
    nb::dict dd = FieldsDict(ds, kDeviceStatsFields);
    dd["user"] = FieldsDict(ds.user, kSlotCountsFields);
    dd["internal"] = FieldsDict(ds.internal, kSlotCountsFields);
    devs[nb::make_tuple(BackendName(static_cast<Backend>(key.first)), key.second)] = dd;
  }
  d["devices"] = devs;
  return d;
}

nb::dict EngineStatsDict(const EngineStats& s) {
  nb::dict d = FieldsDict(s.counts, kLedgerCountsFields);
  PutFields(d, s, kEngineStatsFields);
  PutFields(d, s.ring, kRingStatsFields);
  PutFields(d, s.staging, kStagingStatsFields, "staging_");
  PutFields(d, s.host, kHostPoolStatsFields, "pinned_");
  PutFields(d, s.host_numa, kHostPoolStatsFields, "host_numa_");
  d["host_store"] = HostStoreName(s.host_store);
  d["host_store_bytes"] = (s.host_store == HostStoreKind::kHostNuma ? s.host_numa : s.host).chunk_bytes;
  PutFields(d, s.graph, kGraphStatsFields, "graph_");
  if (!s.ring.offload_sections.empty() || !s.ring.reload_sections.empty()) {  // JAXVMM_RING_PROFILE=1
    nb::dict off, rel;
    for (const auto& [name, ns] : s.ring.offload_sections) off[name.c_str()] = ns;
    for (const auto& [name, ns] : s.ring.reload_sections) rel[name.c_str()] = ns;
    d["handler_offload_sections_ns"] = off;
    d["handler_reload_sections_ns"] = rel;
  }
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

// ---- slots ----
// A slot by id as Python holds it (`Slot`): each call looks the slot up, so a closed one raises NotFound.
struct SlotRef {
  int64_t id;

  std::shared_ptr<Slot> Get() const {
    std::shared_ptr<Slot> s;
    Check(Registry::Get().Lookup(id, &s));
    return s;
  }
};

// A Registry operation on the slot's id, as a method of `Slot`.
auto RegistryOp(Status (Registry::*op)(int64_t)) {
  return [op](const SlotRef& ref) { Run([&] { return (Registry::Get().*op)(ref.id); }); };
}

using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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

// A DLPack capsule aliasing [offset, offset + nbytes) of the slot; counts as a view until deleted.
nb::object MakeView(const std::shared_ptr<Slot>& s, uint64_t offset, const std::vector<int64_t>& shape, int code,
                    int bits, int device_type, int device_id) {
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
}

// ---- memory timeline ----
// A memory sampler Python owns (`MemorySampler`): close(), or the object's death, stops and frees it.
// Shared: a concurrent close() cannot free it under a call that runs without the GIL.
struct SamplerRef {
  std::shared_ptr<MemorySampler> sampler;

  std::shared_ptr<MemorySampler> Get() const {
    if (!sampler) Check(Status(Code::kNotFound, "the memory sampler is closed"));
    return sampler;
  }
};

nb::tuple SampleTuple(const MemorySample& x) { return nb::make_tuple(x.t_ns, x.used, x.mapped, x.internal); }

}  // namespace
}  // namespace jaxvmm

NB_MODULE(_jaxvmm, m) {
  using namespace jaxvmm;
  m.doc() = "jaxvmm native core (driver seam, slots, registry). Use the jaxvmm package, not this module.";
  // Handles (Slot, Engine, ...) that jax's caches or a dying thread still hold at interpreter exit are
  // no leak worth a report: close_all() at exit already returned what they name.
  nb::set_leak_warnings(false);

  // ---- errors ----
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

  // ---- the driver seam and devices ----
  m.def("backend_status", [](const std::string& backend) {
    Backend b = ParseBackend(backend);
    DriverAvailability a = NoGil([&] { return Availability(b); });
    return nb::make_tuple(a.ok, a.reason, a.driver_version);
  });
  m.def("set_posix_device_count", [](int n) { SetPosixDeviceCount(n); });
  m.def("set_posix_device_ids", [](std::vector<int64_t> ids) {
    SetPosixDeviceIds(ids.data(), static_cast<int>(ids.size()));
  });
  m.def("granularity", [](const std::string& backend, int device, const std::string& loc, int loc_id) {
    Backend b = ParseBackend(backend);
    Location l = ParseLocation(loc, loc_id);
    size_t g = 0;
    Run([&] { return Granularity(b, device, l, &g); });
    return g;
  });
  // Raises unless (backend, device) can make slots at `loc` exportable as `kind` (jaxvmm/share.py).
  m.def("shareable_check", [](const std::string& backend, int device, const std::string& loc, int loc_id,
                              const std::string& kind) {
    Backend b = ParseBackend(backend);
    Location l = ParseLocation(loc, loc_id);
    CUmemAllocationHandleType t = ParseShareable(kind);
    Status st = NoGil([&] { return CheckShareable(b, device, l, t); });
    Check(st.ok() ? st : Status(st).At(-1, "create"));
  });
  m.def("memory_info", [](const std::string& backend, int device) {
    Backend b = ParseBackend(backend);
    size_t free_b = 0, total = 0;
    Run([&]() -> Status {
      JAXVMM_RETURN_IF_ERROR(CheckCapability(b, device, Location{CU_MEM_LOCATION_TYPE_DEVICE, device}));
      ScopedContext ctx(b, device);
      JAXVMM_RETURN_IF_ERROR(ctx.status());
      CUresult r = Driver(b).MemGetInfo(&free_b, &total);
      return r == CUDA_SUCCESS ? Status() : Status::Driver(r, Entry::kMemGetInfo).At(-1, "memory_info");
    });
    return nb::make_tuple(free_b, total);
  });
  // The seam's live handles, reservations and mappings, armed faults' failures and per-entry calls.
  m.def("driver_counters", [](const std::string& backend) {
    DriverCounters c = ReadCounters(ParseBackend(backend));
    nb::dict d = FieldsDict(c, kDriverCountersFields);
    nb::dict calls;
    for (int i = 0; i < kEntryCount; ++i) calls[EntryName(static_cast<Entry>(i))] = c.calls[i];
    d["calls"] = calls;
    return d;
  });
  // Every thread's native stack to stderr (tools/watchdog.py, for hangs); returns how many answered.
  m.def("debug_thread_stacks", [] {
    nb::gil_scoped_release nogil;
    std::fflush(stderr);
    return DumpThreadStacks(2);
  });

  // ---- slots ----
  nb::class_<SlotRef>(m, "Slot", "A registry slot by id (jaxvmm.Slot holds one); made by create_slot, import_slot "
                                 "or slot(id).")
      .def_ro("id", &SlotRef::id)
      .def("info", [](const SlotRef& ref) {
        std::shared_ptr<Slot> s = ref.Get();
        return InfoDict(NoGil([&] { return s->Info(); }));
      })
      .def("release", RegistryOp(&Registry::Release))
      .def("remap", RegistryOp(&Registry::Remap))
      .def("close", RegistryOp(&Registry::Close))
      // The Python object died while views live: the last view closes the slot.
      .def("close_when_unviewed", [](const SlotRef& ref) {
        std::shared_ptr<Slot> s;
        if (!Registry::Get().Lookup(ref.id, &s).ok()) return;
        s->RequestCloseWhenUnviewed();
        if (s->views() == 0)  // the last view died in between
          (void)NoGil([&] { return Registry::Get().Close(ref.id); });
      })
      .def("write", [](const SlotRef& ref, uint64_t offset, ConstBytes data) {
        std::shared_ptr<Slot> s = ref.Get();
        Run([&] { return s->Write(offset, data.data(), data.shape(0)); });
      })
      .def("read_into", [](const SlotRef& ref, uint64_t offset, MutBytes out) {
        std::shared_ptr<Slot> s = ref.Get();
        Run([&] { return s->Read(offset, out.data(), out.shape(0)); });
      })
      // Returns (fd, fabric bytes, channel fd, generation, size); the descriptors are new and the caller's.
      .def("export", [](const SlotRef& ref, const std::string& kind) {
        std::shared_ptr<Slot> s = ref.Get();
        CUmemAllocationHandleType t = ParseShareable(kind);
        if (t == CU_MEM_HANDLE_TYPE_NONE)
          Check(Status(Code::kInvalidArgument, "export needs a handle type").At(ref.id, "export"));
        ExportedHandle h;
        Run([&] { return s->Export(t, &h); });
        nb::bytes fabric(reinterpret_cast<const char*>(h.fabric.data),
                         t == CU_MEM_HANDLE_TYPE_FABRIC ? sizeof(h.fabric.data) : 0);
        return nb::make_tuple(h.fd, fabric, h.channel_fd, h.generation, h.size);
      })
      .def("dlpack", [](const SlotRef& ref, uint64_t offset, std::vector<int64_t> shape, int code, int bits,
                        int device_type, int device_id) {
        return MakeView(ref.Get(), offset, shape, code, bits, device_type, device_id);
      });
  m.def("slot", [](int64_t id) { return SlotRef{id}; });
  m.def("create_slot", [](const std::string& backend, int device, const std::string& loc, int loc_id,
                          std::vector<int> access, uint64_t nbytes, const std::string& shareable) {
    SlotSpec spec;
    spec.backend = ParseBackend(backend);
    spec.device = device;
    spec.location = ParseLocation(loc, loc_id);
    spec.access = std::move(access);
    spec.nbytes = nbytes;
    spec.handle_types = ParseShareable(shareable);
    SlotRef ref{-1};
    Run([&] { return Registry::Get().Create(spec, &ref.id); });
    return ref;
  }, nb::arg("backend"), nb::arg("device"), nb::arg("loc"), nb::arg("loc_id"), nb::arg("access"), nb::arg("nbytes"),
     nb::arg("shareable") = "");
  // Maps the pages a handle names as a new slot of this process. `fd` is borrowed (never closed here).
  m.def("import_slot", [](const std::string& backend, int device, std::vector<int> access, const std::string& kind,
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
    SlotRef ref{-1};
    Run([&] { return Registry::Get().Import(spec, src, &ref.id); });
    return ref;
  });
  // The id of the slot holding [base, base + length).
  m.def("find_range", [](uint64_t base, uint64_t length) {
    int64_t id = -1;
    Check(Registry::Get().FindRange(base, length, &id));
    return id;
  });

  // ---- accounting ----
  m.def("stats", [] { return StatsDict(NoGil([] { return Registry::Get().Stats(); })); });
  m.def("reset_peak", [] { Registry::Get().ResetPeak(); });
  m.def("retry_quarantine", [] { return NoGil([] { return Registry::Get().RetryQuarantine(); }); });
  m.def("close_all", [](bool final) {
    nb::gil_scoped_release nogil;
    Engine::ShutdownAll(final);
    Registry::Get().CloseAll();
  }, nb::arg("final") = false);
  m.def("share_stats", [] { return FieldsDict(ReadShareStats(), kShareStatsFields); });

  // ---- offload engines ----
  nb::class_<EngineRef>(m, "Engine", "The offload engine of (backend, device), made by engine(); started on first use.")
      .def("stats", [](const EngineRef& ref) {
        Engine* e = ref.Get();
        return EngineStatsDict(NoGil([&] { return e->Stats(); }));
      })
      // Why the grant kernels did not load ("" when they did or were never tried); not a count of stats().
      .def("graph_kernels_error", [](const EngineRef& ref) {
        Engine* e = ref.Get();
        return NoGil([&] { return e->Stats(); }).graph.kernels_error;
      })
      .def("reset_peaks", EngineMethod(&Engine::ResetPeaks))
      .def("take_error", EngineMethod(&Engine::TakeError))
      .def("sync", EngineMethod(&Engine::Synchronize))
      // Best effort (Python finalizers): nothing to drop once the engines are gone.
      .def("drop", [](const EngineRef& ref, uint64_t token) {
        NoGil([&] {
          Engine* e = nullptr;
          if (Engine::For(ref.backend, ref.device, &e).ok()) e->Drop(token);
        });
      })
      // May wait for the poller to serve the round that made the token.
      .def("check", [](const EngineRef& ref, uint64_t token, uint64_t nbytes, int64_t signature, bool reserve) {
        Engine* e = ref.Get();
        Run([&] { return e->CheckTicket(token, ArrayMeta{nbytes, signature}, reserve); });
      })
      .def("unreserve", EngineMethod(&Engine::Unreserve))
      .def("keep", EngineMethod(&Engine::Keep))
      .def("reserve_host", EngineMethod(&Engine::ReserveHost))
      .def("trim", EngineMethod(&Engine::Trim))
      .def("unclaimed_tickets", EngineMethod(&Engine::UnclaimedTickets));
  m.def("engine", [](const std::string& backend, int device) { return EngineRef{ParseBackend(backend), device}; });
  m.def("engine_devices", [] {
    nb::list out;
    for (Engine* e : Engine::All()) out.append(nb::make_tuple(BackendName(e->backend()), e->device()));
    return out;
  });
  // Every engine whose call sites were captured: wait for the device to drain (no engine lock held), so
  // that a module load (the first run of a newly compiled program) never waits for rounds that need
  // the poller's driver calls. Returns how many engines waited.
  m.def("engines_quiesce_for_module_load", []() {
    int waited = 0;
    Run([&] {
      Status first;
      for (Engine* e : Engine::All()) {
        bool w = false;
        Status st = e->QuiesceForModuleLoad(&w);
        if (!st.ok() && first.ok()) first = st;
        waited += w ? 1 : 0;
      }
      return first;
    });
    return waited;
  });
  m.def("handlers", [] {
    nb::list out;
    auto cap = [](void* f) -> nb::object { return f ? nb::object(nb::capsule(f)) : nb::none(); };
    for (const auto& h : Handlers())
      out.append(nb::make_tuple(h.name, h.platform, cap(h.fn), cap(h.graph_fn), cap(h.initialize)));
    return out;
  });
  m.def("ffi_api_version", &FfiApiVersion);

  // ---- memory timeline (jaxvmm.memory_timeline) ----
  nb::class_<SamplerRef>(m, "MemorySampler", "A device's memory timeline, made by start_sampler().")
      .def("stop", [](const SamplerRef& ref) {
        std::shared_ptr<MemorySampler> s = ref.Get();
        NoGil([&] { s->Stop(); });
      })
      .def("close", [](SamplerRef& ref) {
        std::shared_ptr<MemorySampler> s = std::move(ref.sampler);
        NoGil([&] { s.reset(); });
      })
      .def("summary", [](const SamplerRef& ref) {
        MemorySamplerSummary s = ref.Get()->Summary();
        nb::dict d = FieldsDict(s, kSamplerSummaryFields);
        d["first"] = SampleTuple(s.first);
        d["peak"] = SampleTuple(s.peak);
        return d;
      })
      // The ring, oldest first, as raw int64 quadruples (t_ns, used, mapped, internal).
      .def("series", [](const SamplerRef& ref) {
        std::vector<MemorySample> v = ref.Get()->Series();
        static_assert(sizeof(MemorySample) == 4 * sizeof(int64_t), "packed int64 quadruples");
        return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(MemorySample));
      });
  m.def("start_sampler", [](const std::string& backend, int device, uint64_t capacity, int64_t interval_ns) {
    Backend b = ParseBackend(backend);
    std::unique_ptr<MemorySampler> s;
    Run([&] { return MemorySampler::Start(b, device, static_cast<size_t>(capacity), interval_ns, &s); });
    return SamplerRef{std::move(s)};
  });

  // ---- settings ----
  // Whether XLA keeps the order of recorded commands, as XLA_FLAGS says now (an engine asks once, when
  // it is made: graph mode reads another call site's offload cell only then).
  m.def("xla_keeps_command_order", [] { return EngineConfig::XlaKeepsCommandOrder(); });
  // The core's bounds the settings table checks its ranges against (tests/test_config.py).
  m.def("graph_max_cells", [] { return kMaxCells; });
  m.def("graph_max_spares", [] { return kMaxSpares; });
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

  // ---- hooks: the test, replay, benchmark and fault hooks (module_testing.cc), bound into the submodule
  // _testing on the first call (jaxvmm.testing); `import jaxvmm` never binds them ----
  m.def("load_testing", [mod = nb::handle(m)] {
    if (!nb::hasattr(mod, "_testing")) BindTesting(nb::borrow<nb::module_>(mod).def_submodule("_testing"));
    return nb::borrow<nb::module_>(mod.attr("_testing"));
  });
}
