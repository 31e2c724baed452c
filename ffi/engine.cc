#include "engine.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "vmm.h"

namespace jaxvmm {
namespace {

std::mutex g_engines_mu;
bool g_final = false;  // the process is exiting: no engine may start again (guarded by g_engines_mu)
std::map<std::pair<int, int>, std::unique_ptr<Engine>>& Engines() {
  static auto* m = new std::map<std::pair<int, int>, std::unique_ptr<Engine>>();
  return *m;
}

}  // namespace

// ---------------------------------------------------------------- lifetime

Engine::Engine(Backend b, int device)
    : backend_(b),
      device_(device),
      host_store_(b, device),
      staging_(b, device),
      transfers_(b, device),
      ledger_(b, device, EngineKey(), host_store_, staging_),
      kernels_(b),
      graph_(b, device, ledger_, host_store_, staging_, transfers_, kernels_),
      ring_(b, device, ledger_, host_store_, staging_, transfers_, kernels_) {}

Status Engine::For(Backend b, int device, Engine** out) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  auto& m = Engines();
  auto key = std::make_pair(static_cast<int>(b), device);
  auto it = m.find(key);
  if (it != m.end()) {
    *out = it->second.get();
    return Status();
  }
  // A finalizer running after the exit shutdown (a ticket dropped during interpreter teardown) must
  // not start threads that would outlive the statics they use.
  if (g_final) return Status(Code::kUnavailable, "the offload engines were shut down (the process is exiting)");
  std::unique_ptr<Engine> e(new Engine(b, device));
  JAXVMM_RETURN_IF_ERROR(e->Init());
  *out = e.get();
  m[key] = std::move(e);
  return Status();
}

std::vector<Engine*> Engine::All() {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  std::vector<Engine*> v;
  for (auto& [k, e] : Engines()) v.push_back(e.get());
  return v;
}

void Engine::ShutdownAll(bool final) {
  std::map<std::pair<int, int>, std::unique_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(g_engines_mu);
    g_final = g_final || final;
    engines.swap(Engines());
  }
  for (auto& [k, e] : engines) {
    Status st = e->Synchronize();
    if (!st.ok()) std::fprintf(stderr, "%s (at shutdown)\n", st.ToString().c_str());
  }
  engines.clear();
}

Status Engine::Init() {
  JAXVMM_RETURN_IF_ERROR(CheckCapability(backend_, device_, Location{CU_MEM_LOCATION_TYPE_DEVICE, device_}));
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  JAXVMM_RETURN_IF_ERROR(transfers_.Init());
  JAXVMM_RETURN_IF_ERROR(graph_.Init());
  return ring_.Init();
}

Engine::~Engine() {
  ScopedContext ctx(backend_, device_);
  // Graph mode first (the poller enqueues copies and owns the channels' cells), then the op ring (its
  // workers drained, then its streams synchronized). The members' destructors then free the tickets
  // and the staging cells.
  graph_.Stop();
  ring_.Stop();
  kernels_.Unload();  // every stream that ran one of its kernels is synchronized
}

// ---------------------------------------------------------------- the handlers' host time

Status Engine::Capturing(CUstream stream, bool* capturing) {
  *capturing = false;
  if (!stream) return Status();  // the cpu platform's handlers have no stream
  CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
  JAXVMM_RETURN_IF_ERROR(Call(-1, "capture", Entry::kStreamIsCapturing, [&] { return Driver(backend_).StreamIsCapturing(stream, &cs); }));
  if (cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    return Status(Code::kInternal, "the stream's capture was invalidated before this call");
  *capturing = cs == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return Status();
}

Status Engine::Offload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out) {
  const auto start = OpRing::Clock::now();
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "offload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) return graph_.CapturedOffload(stream, site, src, meta, token_out);
  return ring_.Offload(stream, src, meta, token_out, start);
}

Status Engine::Reload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta) {
  const auto start = OpRing::Clock::now();
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "reload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) return graph_.CapturedReload(stream, site, token_in, dst, meta);
  return ring_.Reload(stream, token_in, dst, meta, start);
}

Status Engine::Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out) {
  const auto start = OpRing::Clock::now();
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) return graph_.CapturedPrefetch(stream, token_in, token_out);
  return ring_.Prefetch(stream, token_in, token_out, start);
}

Status Engine::Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta) {
  if (meta.nbytes == 0) return Status();
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  JAXVMM_RETURN_IF_ERROR(ledger_.TakeFor(stream));  // an earlier program on this stream failed later
  // The resolver copies graph-mode round tickets that live in pageable memory through these (made
  // here, outside any capture, with the poller's); without them no round ticket may be pageable.
  const bool readers_can_bounce = ring_.InitBounce();
  return graph_.Prepare(stream, site, kind, meta, readers_can_bounce);
}

// ---------------------------------------------------------------- the rest

Status Engine::Synchronize() {
  JAXVMM_RETURN_IF_ERROR(graph_.Synchronize());  // graph-mode rounds first: the ring may wait on their tickets
  return ring_.Synchronize();
}

Status Engine::ReserveHost(size_t bytes) {
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  return host_store_.Reserve(bytes).At(-1, "reserve_host");
}

size_t Engine::Trim() {
  size_t n = staging_.Trim();
  n += host_store_.Trim();
  return n + graph_.Trim();
}

void Engine::SetNextTicketNumber(uint32_t n) {
  Ledger::Held h = ledger_.Lock();
  ledger_.tickets(h).SetNextNumber(n);
}

void Engine::ResetPeaks() {
  host_store_.ResetPeak();
  staging_.ResetPeak();
}

EngineStats Engine::Stats() {
  EngineStats s;
  s.graph = graph_.Stats();  // before the ledger lock (lock order)
  s.graph.bounce_copies += ring_.bounce_copies();
  s.ring = ring_.Stats();
  {
    Ledger::Held h = ledger_.Lock();
    s.counts = ledger_.counts(h);
    s.tickets_live = static_cast<int64_t>(ledger_.tickets(h).live());
    s.ticket_host_bytes = ledger_.tickets(h).host_bytes();
  }
  s.host = host_store_.Stats(HostStoreKind::kPinned);
  s.host_numa = host_store_.Stats(HostStoreKind::kHostNuma);
  s.host_store = HostStore::Current();
  s.staging = staging_.Stats();
  return s;
}

}  // namespace jaxvmm
