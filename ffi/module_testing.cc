// jaxvmm._jaxvmm._testing: the test, replay, benchmark and fault-injection hooks. Bound into the one
// extension module by load_testing() (jaxvmm.testing), so they drive the same core as the rest of it;
// `import jaxvmm` never binds them.
//
//   faults     driver_entries, arm_fault, clear_faults
//   engines    pause_poller, set_next_ticket (of an Engine), trim_after_next_take
//   posix      posix_device_limit, posix_device_bytes, posix_pageable_copies
//   replay     ReplayStream (prepare, offload, reload, begin, end, launch, sync, destroy, close), replay_stream
//   bench      bench_ops, bench_slot_copy
//   graph      graph_kernels_ptx
#include "module.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "driver.h"
#include "engine.h"
#include "fault.h"
#include "graph_kernels_ptx.h"
#include "registry.h"
#include "replay.h"
#include "slot.h"
#include "status.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

Entry ParseEntry(const std::string& name) {
  int e = EntryFromName(name);
  if (e < 0) Check(Status(Code::kInvalidArgument, "unknown driver entry '" + name + "'"));
  return static_cast<Entry>(e);
}

// A stream of jaxvmm's own on (backend, device): the engine's entry points called on it with raw
// addresses, captured into graphs and replayed without XLA (what XLA's command buffers do).
struct ReplayStream {
  Backend backend;
  int device;
  uint64_t stream = 0;

  Engine* engine() const { return EngineRef{backend, device}.Get(); }
  CUstream cu() const { return reinterpret_cast<CUstream>(stream); }
};

// A replay call on (backend, device, the stream), as a method of ReplayStream.
auto OnStream(Status (*fn)(Backend, int, uint64_t)) {
  return [fn](const ReplayStream& r) { Run([&] { return fn(r.backend, r.device, r.stream); }); };
}

// Seconds per copy of `nbytes` from slot `src` to slot `dst` (offset 0) on a stream of `device`,
// one entry per iteration (bench/share_bw.py). Both slots must be mapped and accessible from `device`.
Status SlotCopySeconds(Backend b, int device, const Slot& dst, const Slot& src, uint64_t nbytes, int iters,
                       std::vector<double>* out) {
  ScopedContext ctx(b, device);
  Status st = ctx.status();
  const DriverTable& d = Driver(b);
  CUstream stream = nullptr;
  if (st.ok()) st = Call(-1, "bench", Entry::kStreamCreateWithPriority,
                         [&] { return d.StreamCreateWithPriority(&stream, CU_STREAM_NON_BLOCKING, 0); });
  for (int i = 0; st.ok() && i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    st = Call(-1, "bench", Entry::kMemcpyDtoDAsync,
              [&] { return d.MemcpyDtoDAsync(dst.address(), src.address(), nbytes, stream); });
    if (st.ok()) st = Call(-1, "bench", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(stream); });
    out->push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (stream != nullptr) d.StreamDestroy(stream);
  return st;
}

}  // namespace

void BindTesting(nb::module_ m) {
  // ---- fault injection at the driver seam (the counters are driver_counters()) ----
  m.def("driver_entries", [] {
    std::vector<std::string> names;
    for (int i = 0; i < kEntryCount; ++i) names.push_back(EntryName(static_cast<Entry>(i)));
    return names;
  });
  m.def("arm_fault", [](const std::string& backend, const std::string& entry, int64_t nth, int64_t times,
                        const std::string& error) {
    CUresult r;
    if (!ResultFromName(error, &r)) Check(Status(Code::kInvalidArgument, "unknown CUresult name '" + error + "'"));
    ArmFault(ParseBackend(backend), ParseEntry(entry), nth, times, r);
  });
  m.def("clear_faults", [](const std::string& backend) { ClearFaults(ParseBackend(backend)); });

  // ---- engines ----
  // While paused the engine's graph-mode poller serves no round.
  m.def("pause_poller", EngineMethod(&Engine::PausePoller));
  // The engine's next ticket number (wrap-around).
  m.def("set_next_ticket", EngineMethod(&Engine::SetNextTicketNumber));
  // cpu: right after the next offload round's take kernel took its grant, trim() the cpu engine of
  // `device` (a revocation ordered after a take, deterministically).
  m.def("trim_after_next_take", [](int device) {
    static int dev = 0;
    dev = device;
    SetPosixAfterTakeHook(
        [](void* arg) {
          Engine* e = nullptr;
          if (Engine::For(Backend::kPosix, *static_cast<int*>(arg), &e).ok()) e->Trim();
        },
        &dev);
  });

  // ---- the POSIX backend ----
  // Device-location pages beyond `bytes` fail to be created (out of memory); < 0: no limit.
  m.def("posix_device_limit", [](int64_t bytes) { SetPosixDeviceMemoryLimit(bytes); });
  m.def("posix_device_bytes", [] { return PosixDeviceBytes(); });
  m.def("posix_pageable_copies", [] { return PosixPageableCopies(); });

  // ---- capture and replay without XLA (jaxvmm.testing.Replay) ----
  nb::class_<ReplayStream>(m, "ReplayStream", "A stream of jaxvmm's own, made by replay_stream(); close() it.")
      .def("prepare", [](const ReplayStream& r, int64_t site, int kind, uint64_t nbytes, int64_t signature) {
        Engine* e = r.engine();
        Run([&] { return e->Prepare(r.cu(), site, static_cast<ChannelKind>(kind), ArrayMeta{nbytes, signature}); });
      })
      .def("offload", [](const ReplayStream& r, int64_t site, uint64_t src, uint64_t nbytes, int64_t signature,
                         uint64_t token_out) {
        Engine* e = r.engine();
        Run([&] { return e->Offload(r.cu(), site, src, ArrayMeta{nbytes, signature}, token_out); });
      })
      .def("reload", [](const ReplayStream& r, int64_t site, uint64_t token_in, uint64_t dst, uint64_t nbytes,
                        int64_t signature) {
        Engine* e = r.engine();
        Run([&] { return e->Reload(r.cu(), site, token_in, dst, ArrayMeta{nbytes, signature}); });
      })
      .def("begin", OnStream(&ReplayBeginCapture))
      // Ends the capture; returns the graph to launch.
      .def("end", [](const ReplayStream& r) {
        uint64_t graph = 0;
        Run([&] { return ReplayEndCapture(r.backend, r.device, r.stream, &graph); });
        return graph;
      })
      .def("launch", [](const ReplayStream& r, uint64_t graph) {
        Run([&] { return ReplayLaunch(r.backend, r.device, graph, r.stream); });
      })
      .def("sync", OnStream(&ReplayStreamSynchronize))
      .def("destroy", [](const ReplayStream& r, uint64_t graph) {
        Run([&] { return ReplayDestroy(r.backend, r.device, graph); });
      })
      .def("close", OnStream(&ReplayStreamDestroy));
  m.def("replay_stream", [](const std::string& backend, int device) {
    ReplayStream r{ParseBackend(backend), device};
    Run([&] { return ReplayStreamCreate(r.backend, r.device, &r.stream); });
    return r;
  });

  // ---- benchmarks (bench/) ----
  m.def("bench_ops", [](const std::string& backend, int device, uint64_t nbytes, int iters) {
    Backend b = ParseBackend(backend);
    std::map<std::string, double> out;
    Run([&] { return BenchOps(b, device, nbytes, iters, &out); });
    return out;
  });
  m.def("bench_slot_copy", [](const std::string& backend, int device, int64_t dst_id, int64_t src_id, uint64_t nbytes,
                              int iters) {
    std::shared_ptr<Slot> dst, src;
    Check(Registry::Get().Lookup(dst_id, &dst));
    Check(Registry::Get().Lookup(src_id, &src));
    if (nbytes > dst->spec().nbytes || nbytes > src->spec().nbytes)
      Check(Status(Code::kInvalidArgument, "nbytes exceeds a slot"));
    Backend b = ParseBackend(backend);
    std::vector<double> out;
    Run([&] { return SlotCopySeconds(b, device, *dst, *src, nbytes, iters, &out); });
    return out;
  });

  // ---- graph mode ----
  // The compute_80 module of the grant kernels' PTX (tests/test_graph_kernels_ptx.py).
  m.def("graph_kernels_ptx", [] { return std::string(kGraphKernelsPtx); });
}

}  // namespace jaxvmm
