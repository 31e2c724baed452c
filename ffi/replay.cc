#include "replay.h"

#include "vmm.h"

namespace jaxvmm {
namespace {

CUstream S(uint64_t s) { return reinterpret_cast<CUstream>(s); }

template <typename F>
Status InContext(Backend b, int device, const char* stage, Entry e, F f) {
  ScopedContext ctx(b, device);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  return Call(-1, stage, e, f);
}

}  // namespace

Status ReplayStreamCreate(Backend b, int device, uint64_t* stream) {
  CUstream s = nullptr;
  JAXVMM_RETURN_IF_ERROR(InContext(b, device, "replay", Entry::kStreamCreateWithPriority,
                                   [&] { return Driver(b).StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0); }));
  *stream = reinterpret_cast<uint64_t>(s);
  return Status();
}

Status ReplayStreamDestroy(Backend b, int device, uint64_t stream) {
  return InContext(b, device, "replay", Entry::kStreamDestroy, [&] { return Driver(b).StreamDestroy(S(stream)); });
}

Status ReplayStreamSynchronize(Backend b, int device, uint64_t stream) {
  return InContext(b, device, "replay", Entry::kStreamSynchronize, [&] { return Driver(b).StreamSynchronize(S(stream)); });
}

Status ReplayBeginCapture(Backend b, int device, uint64_t stream) {
  // Thread-local mode, as XLA captures: other threads (the engine's workers) stay free to call the driver.
  return InContext(b, device, "replay", Entry::kStreamBeginCapture,
                   [&] { return Driver(b).StreamBeginCapture(S(stream), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL); });
}

Status ReplayEndCapture(Backend b, int device, uint64_t stream, uint64_t* exec) {
  CUgraph g = nullptr;
  JAXVMM_RETURN_IF_ERROR(InContext(b, device, "replay", Entry::kStreamEndCapture, [&] { return Driver(b).StreamEndCapture(S(stream), &g); }));
  CUgraphExec x = nullptr;
  Status st = InContext(b, device, "replay", Entry::kGraphInstantiateWithFlags, [&] { return Driver(b).GraphInstantiateWithFlags(&x, g, 0); });
  Driver(b).GraphDestroy(g);
  JAXVMM_RETURN_IF_ERROR(st);
  *exec = reinterpret_cast<uint64_t>(x);
  return Status();
}

Status ReplayLaunch(Backend b, int device, uint64_t exec, uint64_t stream) {
  return InContext(b, device, "replay", Entry::kGraphLaunch,
                   [&] { return Driver(b).GraphLaunch(reinterpret_cast<CUgraphExec>(exec), S(stream)); });
}

Status ReplayDestroy(Backend b, int device, uint64_t exec) {
  return InContext(b, device, "replay", Entry::kGraphExecDestroy,
                   [&] { return Driver(b).GraphExecDestroy(reinterpret_cast<CUgraphExec>(exec)); });
}

}  // namespace jaxvmm
