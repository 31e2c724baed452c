// Offload engine: one per (backend, device). No XLA types here: handlers.cc decodes FFI calls into the
// host-time entry points below, and the engine hands each to the part that serves it. DESIGN.md,
// "Engine parts".
//
// Parts, each owning its state and handed what it needs (none reaches back into the engine):
//   HostStore    host blocks of offloaded tickets: pinned or host_numa pools (own locks)
//   StagingArea  mapped staging cells, budget, device-ordered reuse, idle trim (own lock)
//   Transfers    copies of a ticket's bytes; the graph D2H clock (no lock)
//   Ledger       tickets, op sequence numbers, counters, async errors, armed tokens (Ledger::mu_)
//   GraphMode    captured call sites: channels, cells, spares, grant kernels, the poller (GraphMode::mu_)
//   OpRing       per-execution ops: records, streams, resolver and releaser (enqueue_mu_, the ledger's lock)
// Lock order: OpRing::enqueue_mu_ -> GraphMode::mu_ -> Ledger::mu_ -> HostPool / StagingArea ->
// Registry -> Slot. The engine itself holds no lock of its own.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "channels.h"
#include "config.h"
#include "graph_kernels.h"
#include "graph_mode.h"
#include "host_pool.h"
#include "ledger.h"
#include "op_ring.h"
#include "stat_fields.h"
#include "staging.h"
#include "status.h"
#include "tickets.h"
#include "transfers.h"

namespace jaxvmm {

struct EngineStats {
  LedgerCounts counts;  // offloads, reloads, prefetch hints and hits, async errors, drops
  RingStats ring;       // where the op ring stands, its handlers' host time
  int64_t tickets_live = 0, ticket_host_bytes = 0;
  HostPoolStats host;       // the pinned pool
  HostPoolStats host_numa;  // the host_numa pool
  HostStoreKind host_store = HostStoreKind::kPinned;  // the store new offloads draw from
  StagingStats staging;
  GraphStats graph;
};

// engine_stats() keys of the engine's own (each part's table names the rest).
inline constexpr StatField<EngineStats> kEngineStatsFields[] = {
    {"tickets_live", &EngineStats::tickets_live},
    {"ticket_host_bytes", &EngineStats::ticket_host_bytes},
};

class Engine {
 public:
  // The engine of (b, device), created on first use (streams, events, workers, pinned words).
  static Status For(Backend b, int device, Engine** out);
  // Every engine: wait for outstanding work, return tickets' host memory, close staging cells. With
  // `final` (interpreter exit) no engine is created afterwards: For() fails.
  static void ShutdownAll(bool final = false);
  static std::vector<Engine*> All();

  // Host-time halves of the three handlers. `stream` is XLA's stream (nullptr on the cpu platform);
  // buffers are XLA's device (or, on cpu, host) pointers; `site` names the call site. When `stream` is
  // capturing (XLA records a command buffer), graph mode enqueues the call site's channel work (fixed
  // device work that its poller serves on every replay); otherwise the op ring enqueues one op.
  Status Offload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out);
  Status Reload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta);
  Status Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out);
  // The initialize stage of an offload/reload call site: once per execution, on the host, outside any
  // capture (GraphMode::Prepare); reports an asynchronous error of an earlier program on `stream`.
  Status Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta);

  // The first asynchronous error not yet reported (check()).
  Status TakeError() { return ledger_.TakeAny(); }
  // Python dropped its last reference to a ticket: its host memory is freed once the GPU has passed
  // every op enqueued so far.
  void Drop(uint64_t token) { ring_.Drop(token); }
  // OK if the token names a live ticket of this engine that no reload has consumed or reserved; then
  // reserves it for the eager reload about to run (a second eager reload is refused synchronously).
  Status CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve) { return ledger_.CheckTicket(token, meta, reserve); }
  void Unreserve(uint64_t token) { ledger_.Unreserve(token); }  // the eager reload that reserved it failed before it ran
  // Marks the live ticket of `token` kept: reloads no longer consume it (any number may read it) and it
  // is freed when dropped (Python: the last array holding its token died). For tokens that reached
  // Python, where a function (a jax.vjp function) may reload them more than once.
  Status Keep(uint64_t token) { return ledger_.Keep(token); }
  // Blocks until graph-mode rounds and every enqueued op have completed and the workers are idle.
  Status Synchronize();
  // Before the first run of a newly compiled program (module loads): once this engine's call sites were
  // captured, waits until the device has drained (GraphMode::QuiesceForModuleLoad).
  Status QuiesceForModuleLoad(bool* waited) { return graph_.QuiesceForModuleLoad(waited); }
  // Returns the staging area's idle pages, graph mode's idle cells and the host_numa store's empty
  // chunks to the driver now; returns the bytes returned.
  size_t Trim();
  // Pins host memory for tickets now: the store in force gets a free block of at least `bytes` (a new
  // chunk when it has none), within host_pool_limit. The first steps near a budget then need not wait
  // for the pool to grow (pinning is slow: ~0.6 s/GiB).
  Status ReserveHost(size_t bytes);
  // Test hook: while paused the poller serves no round (a round the device finished stays unserved).
  void PausePoller(bool paused) { graph_.PausePoller(paused); }
  EngineStats Stats();
  // The window peaks (pinned host in use, staging mapped) restart from the values now.
  void ResetPeaks();
  // Every live ticket that no reload has consumed or reserved: (token, sequence number of its offload).
  std::vector<std::pair<uint64_t, uint64_t>> UnclaimedTickets() { return ledger_.Unclaimed(); }
  void SetNextTicketNumber(uint32_t n);  // test hook (ticket number wrap-around)
  Backend backend() const { return backend_; }
  uint64_t EngineKey() const { return (static_cast<uint64_t>(backend_) << 32) | static_cast<uint32_t>(device_); }
  int device() const { return device_; }

  ~Engine();

 private:
  Engine(Backend b, int device);
  Status Init();
  Status Capturing(CUstream stream, bool* capturing);

  const Backend backend_;
  const int device_;
  // Destroyed bottom-up: the op ring and graph mode (stopped by ~Engine), then the ledger (frees the
  // tickets into the host store and the staging area), then those.
  HostStore host_store_;
  StagingArea staging_;
  Transfers transfers_;
  Ledger ledger_;
  GraphKernels kernels_;  // graph mode loads and warms it; the op ring copies with it once warmed
  GraphMode graph_;
  OpRing ring_;
};

}  // namespace jaxvmm
