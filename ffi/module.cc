// The Python module `jaxvmm._jaxvmm`: the only file that sees nanobind. Thin: decode arguments, call the
// core with the GIL released, turn a failed Status into the Python exception built by jaxvmm.errors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <string>

#include "bench.h"
#include "driver.h"
#include "engine.h"
#include "fault.h"
#include "handlers.h"
#include "registry.h"
#include "replay.h"
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
                          std::vector<int> access, uint64_t nbytes) {
    SlotSpec spec;
    spec.backend = ParseBackend(backend);
    spec.device = device;
    spec.location = ParseLocation(loc, loc_id);
    spec.access = std::move(access);
    spec.nbytes = nbytes;
    int64_t id = -1;
    Status st;
    {
      nb::gil_scoped_release nogil;
      st = Registry::Get().Create(spec, &id);
    }
    Check(st);
    return id;
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
  m.def("close_all", [] {
    nb::gil_scoped_release nogil;
    Engine::ShutdownAll();
    Registry::Get().CloseAll();
  });

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
    d["offloads"] = s.offloads;
    d["reloads"] = s.reloads;
    d["prefetches"] = s.prefetches;
    d["prefetch_hits"] = s.prefetch_hits;
    d["prefetch_misses"] = s.prefetch_misses;
    d["tickets_live"] = s.tickets_live;
    d["ticket_host_bytes"] = s.ticket_host_bytes;
    d["errors"] = s.errors;
    d["drops"] = s.drops;
    d["seq_issued"] = s.seq_issued;
    d["seq_completed"] = s.seq_completed;
    d["handler_calls"] = s.handler_calls;
    d["handler_median_ns"] = s.handler_median_ns;
    d["handler_p99_ns"] = s.handler_p99_ns;
    d["staging_budget_bytes"] = s.staging.budget_bytes;
    d["staging_mapped_bytes"] = s.staging.mapped_bytes;
    d["staging_peak_bytes"] = s.staging.peak_mapped_bytes;
    d["staging_cells"] = s.staging.cells;
    d["staging_acquires"] = s.staging.acquires;
    d["staging_device_waits"] = s.staging.device_waits;
    d["staging_host_waits"] = s.staging.host_waits;
    d["staging_pages_mapped"] = s.staging.pages_mapped;
    d["staging_pages_returned"] = s.staging.pages_returned;
    d["ops_in_flight"] = s.ops_in_flight;
    d["pinned_bytes"] = s.host.chunk_bytes;
    d["pinned_in_use_bytes"] = s.host.in_use_bytes;
    d["pinned_peak_in_use_bytes"] = s.host.peak_in_use_bytes;
    d["pinned_allocs"] = s.host.driver_allocs;
    d["pinned_limit_bytes"] = s.host.limit_bytes;
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
    return d;
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
  m.def("engine_drop", [engine](const std::string& backend, int device, uint64_t token) {
    engine(backend, device)->Drop(token);
  });
  m.def("engine_check", [engine](const std::string& backend, int device, uint64_t token, uint64_t nbytes,
                                 int64_t signature, bool reserve) {
    Check(engine(backend, device)->CheckTicket(token, ArrayMeta{nbytes, signature}, reserve));
  });
  m.def("engine_unreserve", [engine](const std::string& backend, int device, uint64_t token) {
    engine(backend, device)->Unreserve(token);
  });
  m.def("set_trace", [](bool on) { SetTrace(on); });

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
  // Negative (or 0 where 0 is meaningless) leaves a knob as it is; returns every knob's value in force.
  m.def("configure", [](int64_t host_pool_limit, int64_t host_pool_chunk, int prefetch_depth, int keep_resident,
                        int64_t staging_budget, int64_t staging_idle_ms) {
    nb::gil_scoped_release nogil;  // lowering the limit may return pinned chunks to the driver
    if (host_pool_limit >= 0) HostPool::SetLimit(static_cast<size_t>(host_pool_limit));
    if (host_pool_chunk > 0) HostPool::SetChunkSize(static_cast<size_t>(host_pool_chunk));
    if (prefetch_depth > 0) StagingArea::SetDepth(prefetch_depth);
    if (keep_resident >= 0) EngineConfig::SetKeepResident(keep_resident);
    if (staging_budget > 0) StagingArea::SetBudget(static_cast<size_t>(staging_budget));
    if (staging_idle_ms > 0) StagingArea::SetIdleMillis(staging_idle_ms);
    size_t limit = HostPool::Limit(), chunk = HostPool::ChunkSize(), budget = StagingArea::Budget();
    int depth = StagingArea::Depth(), keep = EngineConfig::KeepResident();
    int64_t idle = StagingArea::IdleMillis();
    nb::gil_scoped_acquire gil;
    return nb::make_tuple(limit, chunk, depth, keep, budget, idle);
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
