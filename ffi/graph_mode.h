// Graph mode: offload/reload call sites that XLA captured into command buffers (CUDA graphs), and the
// poller thread that serves their rounds on every replay. DESIGN.md, "Graph mode".
//
// GraphMode is the part the engine sees: the initialize stage (a call site's channel), the execute
// stage under capture (its recorded work), the poller's loop, and synchronize / trim / stats / stop.
// It owns, and guards with mu_, the parts that do the work:
//   GraphShared    (graph_cells.h)    the channels, streams gd2h/gh2d/garm/gfix, stats, round tickets' host
//                                     blocks (RoundHostSupply), and what the engine hands graph mode: the
//                                     ledger, the host store, the staging area (its budget charges every
//                                     cell's pages), the transfers and the engine's kernels
//   GraphCells     (graph_cells.h)    cells' pages, spares, grants, revocations, what a cell holds
//   OffloadRounds  (graph_offload.h)  the poller's offload half: round tickets, D2H, arming, holding
//   ReloadRounds   (graph_reload.h)   the poller's reload half: prefetches, requests, corrections
//   GraphRecorder  (graph_record.h)   a channel's one-time setup, the kernels' loading, the rounds'
//                                     recorded work (it maps no pages: a capture that names a cell gets
//                                     its pages from GraphCells first)
// Knows nothing of the op ring.
//
// Lock order: GraphMode::mu_ -> Ledger::mu_ -> HostPool / StagingArea -> Registry -> Slot. The poller
// holds mu_ while it serves a pass (dropping it between passes); the op ring never takes it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "channels.h"
#include "graph_cells.h"
#include "graph_kernels.h"
#include "graph_offload.h"
#include "graph_record.h"
#include "graph_reload.h"
#include "host_pool.h"
#include "ledger.h"
#include "staging.h"
#include "status.h"
#include "transfers.h"

namespace jaxvmm {

class GraphMode {
 public:
  GraphMode(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, Transfers& transfers,
            GraphKernels& kernels);
  ~GraphMode();  // Stop() first
  GraphMode(const GraphMode&) = delete;
  GraphMode& operator=(const GraphMode&) = delete;

  Status Init();  // streams, the grower
  // Stops the poller, synchronizes graph mode's streams and returns every channel's cells and spares.
  void Stop();

  // The initialize stage of an offload/reload call site: once per execution, on the host, outside any
  // capture. Creates the site's channel (pinned words, reserved cells) and wakes the poller.
  // `readers_can_bounce`: the engine's other readers of round tickets (the op ring's resolver) can copy
  // one in pageable memory; without that (and this part's own bounce buffers) a round ticket the pinned
  // pool has no room for fails instead of going to pageable memory.
  Status Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta, bool readers_can_bounce);
  // The fixed device work of one round, enqueued on XLA's capturing stream (no allocation here).
  Status CapturedOffload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out);
  Status CapturedReload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta);
  // A prefetch hint cannot be decided at replay: the recorded work only passes the token on (the
  // reload's channel prefetches its own prediction instead).
  Status CapturedPrefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out);

  // Waits until no round is in progress and no D2H is outstanding (up to 120 s).
  Status Synchronize();
  // Returns finished spares and idle channels' cells now; returns the bytes returned.
  size_t Trim();
  // Before the first run of a newly compiled program (module loads): once call sites were captured,
  // waits until the device has drained. DESIGN.md, "Graph mode", module loads.
  Status QuiesceForModuleLoad(bool* waited);
  // Test hook: while paused the poller serves no round (a round the device finished stays unserved).
  void PausePoller(bool paused);
  GraphStats Stats();

 private:
  using Held = Ledger::Held;

  // Caller holds mu_.
  Status CaptureChannel(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out);
  void Recorded(Channel& c);  // counts the recording, wakes the poller
  void WakePoller();
  void Poll();  // the poller thread
  bool Idle();  // no round in progress, no D2H outstanding

  std::mutex mu_;  // guards everything below
  GraphShared g_;
  GraphCells cells_;
  OffloadRounds offloads_;
  ReloadRounds reloads_;
  GraphRecorder recorder_;
  std::condition_variable poll_cv_;
  std::chrono::steady_clock::time_point awake_until_;
  bool any_captured_ = false;
  bool poll_stop_ = false;
  bool poll_paused_ = false;  // test hook (PausePoller): passes skipped while set
  std::thread poller_;  // started by the first capture or the first cell mapped by an initialize stage
};

}  // namespace jaxvmm
