// Offload engine: moves arrays between XLA's buffers and pinned host memory through the staging area.
// One engine per (backend, device). No XLA types here: handlers.cc decodes FFI calls into the host-time
// entry points below. The stream protocol is described in DESIGN.md ("Offload and reload").
//
// Parts, each owning its state (DESIGN.md, "Engine parts"):
//   HostStore    host blocks of offloaded tickets: pinned or host_numa pools (own locks)
//   StagingArea  mapped staging cells, budget, device-ordered reuse, idle trim (own lock)
//   TicketTable  tickets, tokens, lifetimes, prediction (guarded by Engine::mu_)
//   AsyncErrors  errors found by workers, reported once (guarded by Engine::mu_)
//   ChannelTable graph-mode channels of captured call sites (guarded by Engine::graph_mu_)
//   Engine       the op ring, the streams, the workers and the protocol that ties the parts together;
//                graph mode (engine_graph.cc): the captured device work and the poller that serves it
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <string>
#include <unordered_set>
#include <vector>

#include "channels.h"
#include "graph_kernels.h"
#include "bounce.h"
#include "host_pool.h"
#include "staging.h"
#include "status.h"
#include "tickets.h"
#include "worker.h"

namespace jaxvmm {

// Graph mode: call sites captured into command buffers and the rounds their replays made.
struct GraphStats {
  int64_t channels = 0;       // (call site, kind) pairs prepared by the initialize stage
  int64_t prepares = 0;       // initialize-stage calls (once per execution per call site)
  int64_t captures = 0;       // execute calls that ran under stream capture (recordings)
  int64_t offload_rounds = 0, reload_rounds = 0;  // device rounds served (replays included)
  int64_t hits = 0, misses = 0;                   // reload rounds whose cell already held the ticket
  int64_t mapped_bytes = 0;                       // channel cells with pages now
  int64_t pages_mapped = 0, pages_returned = 0;
  // Kernel grants (DESIGN.md, "Graph mode"): rounds whose grant the device took by itself (a pre-armed
  // offload grant, a reload whose prefetched token matched) vs rounds that waited for the poller.
  bool kernels = false;        // this engine's captures use the grant kernels
  std::string kernels_error;   // why not, when they failed to load (the host-granted protocol runs)
  int64_t grants_device = 0, grants_host = 0;
  int64_t revokes = 0;         // grants taken back (idle release, trim, budget) before the device used them
  int64_t revokes_lost = 0;    // revocations that found the grant already taken (the round went on)
  int64_t host_cells = 0;      // cells mapped with host pages because the device was out of memory
  int64_t cells = 0;           // cells reserved over all channels (K per channel with kernel grants, else 1)
  int64_t host_fallbacks = 0;  // round tickets put in pageable memory: the host pool had no room (it grows behind them)
  int64_t bounce_copies = 0;   // pieces (<= 4 MiB) copied through the pinned bounce buffers to or from those tickets
  int64_t fused_captures = 0;  // rounds recorded as one fused take + copy node (JAXVMM_GRAPH_FUSED)
  // Spare cells (graph_spares): offload rounds whose cell was re-armed with a spare while its D2H was
  // still queued (the cell's bytes lent to its ticket), and reload copies served from such a lent cell
  // (device to device, without waiting for PCIe).
  int64_t spares = 0, lends = 0, lent_reads = 0;
};

struct EngineStats {
  int64_t offloads = 0, reloads = 0, prefetches = 0;
  int64_t prefetch_hits = 0, prefetch_misses = 0;
  int64_t tickets_live = 0, ticket_host_bytes = 0;
  int64_t errors = 0, drops = 0;
  int64_t ops_in_flight = 0;
  // Where the pipeline stands (for diagnosing a stall): sequence numbers handed out / passed by XLA's
  // stream.
  int64_t seq_issued = 0, seq_completed = 0;
  // Host time spent in the handlers (XLA's thread), per call: median and 99th percentile of the last
  // 4096 calls, in nanoseconds.
  int64_t handler_calls = 0, handler_median_ns = 0, handler_p99_ns = 0;
  HostPoolStats host;       // the pinned pool
  HostPoolStats host_numa;  // the host_numa pool
  HostStoreKind host_store = HostStoreKind::kPinned;  // the store new offloads draw from
  StagingStats staging;
  GraphStats graph;
};

struct EngineConfig {
  // How many of the newest offloaded tickets keep their staging cell (a device copy) after the D2H,
  // so that their reloads copy device to device instead of waiting for an H2D. Default 0.
  static void SetKeepResident(int n);
  static int KeepResident();
  // Graph mode: grant rounds on the device with the grant kernels (default on). Read by an engine at
  // its first initialize stage; its captures keep that protocol.
  static void SetGraphKernels(bool on);
  static bool GraphKernels();
  // Graph mode with grant kernels: staging cells per channel (1..kMaxCells, default 2), so consecutive
  // rounds of one call site overlap their copies. Read when a channel is first prepared.
  static void SetGraphCells(int k);
  static int GraphCells();
  // Graph mode with grant kernels: spare cells per offload channel (0..kMaxSpares,
  // default 0). An offload cell whose D2H is still queued is re-armed with a free spare at once, so a
  // scan's forward runs ahead of PCIe; the queued bytes stay in the lent cell, and a reload of them
  // before their D2H ends copies device to device. Read when a channel is first prepared.
  static void SetGraphSpares(int n);
  static int GraphSpares();
  // Graph mode with grant kernels and K > 1 cells: record each round as one fused take + copy kernel
  // (default on) instead of a take kernel then a copy kernel. Read at each capture (a channel's rounds
  // may be recorded either way: each round leaves the channel's words as it found them).
  static void SetGraphFused(bool on);
  static bool GraphFused();
  // D2H and H2D copies between a staging cell and a host block are issued in pieces of at most this
  // many bytes (0: one copy), so that other copies on the copy engines (the other direction, XLA's
  // D2D snapshots) interleave with a large one instead of queueing behind all of it. Default 64 MiB.
  static void SetCopyChunk(size_t bytes);
  static size_t CopyChunk();
};

// Asynchronous errors (found by a worker after the handler returned). Each is reported once: by the
// next handler on the stream of the op that failed (a later program on that stream), or by check().
class AsyncErrors {
 public:
  void Record(CUstream stream, const Status& st);
  Status TakeFor(CUstream stream);  // the oldest error recorded for `stream`
  Status TakeAny();
  bool empty() const { return pending_.empty(); }

 private:
  std::vector<std::pair<CUstream, Status>> pending_;
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
  // capturing (XLA records a command buffer), the call site's channel work is enqueued instead: fixed
  // device work that the poller serves on every replay (engine_graph.cc).
  Status Offload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out);
  Status Reload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta);
  Status Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out);
  // The initialize stage of an offload/reload call site: once per execution, on the host, outside any
  // capture. Creates the site's channel (pinned words, a reserved cell) and wakes the poller; reports
  // an asynchronous error of an earlier program on `stream`.
  Status Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta);

  // The first asynchronous error not yet reported (check()).
  Status TakeError();
  // Python dropped its last reference to a ticket: its host memory is freed once the GPU has passed
  // every op enqueued so far.
  void Drop(uint64_t token);
  // OK if the token names a live ticket of this engine that no reload has consumed or reserved; then
  // reserves it for the eager reload about to run (a second eager reload is refused synchronously).
  Status CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve);
  void Unreserve(uint64_t token);  // the eager reload that reserved it failed before it ran
  // Marks the live ticket of `token` kept: reloads no longer consume it (any number may read it) and it
  // is freed when dropped (Python: the last array holding its token died). For tokens that reached
  // Python, where a function (a jax.vjp function) may reload them more than once.
  Status Keep(uint64_t token);
  // Blocks until every enqueued op has completed and the workers are idle.
  Status Synchronize();
  // Before the first run of a newly compiled program (module loads): once this engine's call sites were
  // captured, waits until the device has drained, holding no engine lock, so graph-mode rounds still
  // pending complete (the poller serves them) before the driver loads a module. *waited: whether it did.
  // DESIGN.md, "Graph mode", module loads.
  Status QuiesceForModuleLoad(bool* waited);
  // Returns the staging area's idle pages and the host_numa store's empty chunks to the driver now;
  // returns the bytes returned.
  size_t Trim();
  // Test hook: while paused the poller serves no round (a round the device finished stays unserved).
  void PausePoller(bool paused);
  EngineStats Stats();
  // The window peaks (pinned host in use, staging mapped) restart from the values now.
  void ResetPeaks();
  // Every live ticket that no reload has consumed or reserved: (token, sequence number of its offload).
  std::vector<std::pair<uint64_t, uint64_t>> UnclaimedTickets();
  void SetNextTicketNumber(uint32_t n);  // test hook (ticket number wrap-around)
  Backend backend() const { return backend_; }
  uint64_t EngineKey() const { return (static_cast<uint64_t>(backend_) << 32) | static_cast<uint32_t>(device_); }
  int device() const { return device_; }

  ~Engine();

 private:
  Engine(Backend b, int device);
  Status Init();

  struct Op;
  // Where a ticket's bytes can be copied from: its device copy (when it keeps one) or its host block
  // (once its D2H is done). Snapshot under mu_.
  struct Source {
    CUdeviceptr resident = 0;  // a device copy (a kept staging cell, or a graph round's lent cell)
    CUevent resident_ready = nullptr;  // null: the device copy is complete
    CUevent d2h_done = nullptr;
    uint64_t d2h_seq = 0;  // graph-mode ticket: its D2H is done once *gd2h_done_ >= d2h_seq (no event)
    const void* host = nullptr;
    bool unified = false;   // the host block is a host_numa mapping: copy by unified address
    bool pageable = false;  // the host block is pageable memory: copy through bounce_
  };
  struct alignas(64) Words {
    std::atomic<uint64_t> probe;  // reload: the token the GPU read, copied here by XLA's stream
    std::atomic<uint64_t> ready;  // >= op seq once the staging cell holds what XLA's stream needs
    uint64_t token;               // offload: the ticket's token, copied into XLA's output
  };

  // Host side (handlers hold enqueue_mu_).
  Status BeginOp(Op** out, const std::function<void(Op&)>& fill);
  void MarkCompleted(uint64_t seq);  // caller holds mu_
  void Completed(uint64_t seq);      // caller holds mu_: MarkCompleted, then the drops it allows
  Status EnqueueCompletion(Op& op, CUstream stream);
  Status Launch(CUstream stream, CUhostFn fn, Op& op, const char* stage);  // host function, counted in op.pending
  // Ends a handler's enqueue: undoes a failed op, counts the handler's host time since `start`.
  void FinishEnqueue(Op& op, const Status& st, std::chrono::steady_clock::time_point start);
  Status TakeErrorFor(CUstream stream);
  Status GetEvent(CUevent* out);  // from the pool, or a new one
  // Graph mode: a round ticket's D2H completion is a sequence number that gd2h_ writes to a pinned
  // word after the copy (cuStreamWriteValue64), not an event: the poller creates no driver object (a
  // cuGraphLaunch spinning in the driver holds the lock event creation takes; DESIGN.md, driver facts).
  bool D2hDone(const Ticket& t) const;
  // The same for host memory: a round ticket is carved from what the pool has; without room it goes
  // to pageable memory and the grower thread pins more for the tickets after it.
  Status RoundTicketHost(size_t nbytes, HostBlock* out);
  void KeepResident(const std::shared_ptr<Ticket>& t, StagingLease* lease, CUstream stream);  // caller holds mu_

  // Worker side.
  void ResolveTask(uint64_t seq);    // resolver: the token a reload/prefetch read is known
  void CompleteTask(uint64_t seq);   // resolver: XLA's stream passed the reload/prefetch
  void OffloadedTask(uint64_t seq);  // releaser: D2H done; the ticket is on the host, the op complete
  void AbandonTask(uint64_t seq);    // the failed handler: undo an op whose enqueue failed part way
  // Releases XLA's stream for a reload whose data could not be put in place: fills the cell with 0xFF
  // (after every copy into it), then writes the word XLA's stream waits on.
  void ReleaseReload(Op& op, bool fill_ff);
  void Report(const Op& op, const Status& st);  // logs, then records an async error
  void Retire(const std::shared_ptr<Ticket>& t);  // caller holds mu_: frees `t` if it can be freed
  Status Resident(const std::shared_ptr<Ticket>& t);
  static Source SourceOf(const Ticket& t);  // caller holds mu_
  // Caller holds mu_: SourceOf, or the round's lent cell while it still holds the bytes (graph-mode
  // readers only: ReturnSpares keeps the cell while a reader's pin is on the ticket).
  Source RoundSourceOf(const Ticket& t);
  // Enqueues on `s`: wait until `src` holds the bytes, then copy them to `dst` (D2D or H2D).
  Status CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, const char* stage);
  // Enqueues on `s` the D2H of `nbytes` from `src` into `host` (by unified address for host_numa blocks).
  Status CopyToHost(CUstream s, const HostBlock& host, CUdeviceptr src, size_t nbytes, const char* stage);
  // Enqueues on `s` the H2D of `nbytes` from host memory `src` (unified: a host_numa block) into `dst`.
  Status CopyFromHost(CUstream s, CUdeviceptr dst, const void* src, bool unified, size_t nbytes, const char* stage);

  // Graph mode (engine_graph.cc). Captured*: the fixed device work of a round, enqueued under capture.
  Status Capturing(CUstream stream, bool* capturing);
  Status CapturedOffload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out);
  Status CapturedReload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta);
  // Caller holds graph_mu_: the prepared channel of a call site being captured, its cell mapped.
  Status CaptureChannel(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out);
  void Recorded(Channel& c);  // caller holds graph_mu_: counts the recording, wakes the poller
  void WakePoller();             // caller holds graph_mu_
  void Poll();                   // the poller thread
  bool ServiceOffload(Channel& c);  // caller holds graph_mu_ (as do the helpers below)
  bool ServiceReload(Channel& c);
  std::shared_ptr<Ticket> MakeRoundTicket(const Channel& c, uint64_t token, Status* st);  // takes mu_
  Status CopyOutOfCell(Channel& c, int i, const std::shared_ptr<Ticket>& t);  // D2H of cell i on gd2h_; takes mu_
  void RecordOffloadError(const Channel& c, const Status& st);         // takes mu_
  // A ring-path resolve of `token` waits while it names a graph-mode offload round the device finished
  // but the poller has not served yet (no ticket yet, or its D2H not enqueued). Caller holds no lock.
  void WaitForGraphRound(uint64_t token);
  std::shared_ptr<Ticket> FindForRound(const Channel& c, uint64_t token, std::string* why);  // caller holds mu_
  // Caller holds mu_: the round consumes `a` in cell i (a hit when the cell holds it).
  bool TakeForRound(Channel& c, int i, const std::shared_ptr<Ticket>& a, Source* src);
  void PrefetchInto(Channel& c);    // copies the next predictions into the channel's idle reload cells
  void FillInvalid(Channel& c, int i);  // 0xFF into cell i, ordered after every copy into it
  bool ReapOffloads();              // graph-mode D2H copies that finished: their tickets are on the host
  // Pages for cell i within the staging budget; false: not now. `evict` when a round (or a capture)
  // needs the cell: other channels' idle cells go to make room, and a full device gives host pages.
  bool MapCell(Channel& c, int i, bool evict = true);
  void UnmapCell(Channel& c, int i);
  void UnmapPages(Channel& c, CellPages* p, const char* kept);
  void Mapped(const Channel& c, CellPages* p);  // p's pages were just mapped: counts them
  Status ReservePages(const SlotSpec& spec, CellPages* p);  // a VA (internal slot, no pages) for a cell or spare
  // Cells of idle channels (after IdleMillis unless `now`; only those with device pages if `device_only`).
  size_t ReleaseIdleCells(bool now, bool device_only = false);
  void DropStaleGuesses();  // reload cells whose guess another reload consumed: revoke and unload
  void ReleaseUnpins(bool all);  // unloaded guesses' pins whose cell copy has ended (all: streams synced)
  // Writes `value` into `word`, ordered after cell i's last side-stream copy.
  void Grant(std::atomic<uint64_t>* word, Channel& c, int i, uint64_t value = 1);
  // Kernel grants (caller holds graph_mu_).
  bool ServiceOffloadK(Channel& c);
  bool ServiceReloadK(Channel& c);
  // Offload: a reserved token into grant[i], on gd2h_ after the cell's D2H; or, when a spare is free and
  // that D2H is still queued, on garm_ after the cell took the spare's pages (Lend).
  bool Arm(Channel& c, int i, bool host);
  bool Lend(Channel& c, int i);     // swaps cell i with a free spare; true: the cell is free now
  bool MapSpare(Channel& c, Spare& s);
  void UnmapSpare(Channel& c, Spare& s);
  bool ReturnSpares();              // lent spares whose ticket's D2H is done and no reader holds it
  void ArmIdleCells(Channel& c);    // offload: arms every idle cell it can map within the budget
  bool Revoke(Channel& c, int i);   // takes cell i's armed grant back; true: none is outstanding any more
  Status WriteDevice(CUstream s, CUdeviceptr word, uint64_t value, const char* stage);
  Status WarmKernels(Channel& c);   // each grant kernel launched once (loaded), at the first initialize
  Status SetUpCells(Channel& c);    // the channel's constant device words (K, cells, flags)
  void Unload(Channel& c, int i);   // drops the prediction reload cell i holds; caller holds mu_ too
  void ReportOn(CUstream stream, const Status& st);
  bool GraphIdle();                 // no round in progress, no D2H outstanding
  void StopGraph();                 // stops the poller, returns every channel's cell

  static void CUDA_CB OnResolve(void* op);
  static void CUDA_CB OnComplete(void* op);
  static void CUDA_CB OnOffloaded(void* op);

  const Backend backend_;
  const int device_;
  HostStore host_store_;
  StagingArea staging_;
  // d2h_: offload copies out; h2d_: reload prefetches (in handler order); fix_: the resolver's
  // corrections and prefetch-hint copies; ctl_: event waits and the resolver's host functions; rel_:
  // event waits and the releaser's host functions (an offload's D2H done). d2h_ and h2d_ carry copies,
  // event records and the `ready` writes only: nothing on them waits for the other direction's copies
  // except a reload's wait for its own ticket's D2H.
  CUstream d2h_ = nullptr, h2d_ = nullptr, fix_ = nullptr, ctl_ = nullptr, rel_ = nullptr;
  // Graph mode's copy streams: D2H out of offload cells and the grants behind them (gd2h_), prefetches
  // into reload cells and their `ready` writes (gh2d_). Nothing on them waits for XLA's streams.
  CUstream gd2h_ = nullptr, gh2d_ = nullptr;
  // garm_: grants of offload cells that took a spare (no copy of theirs is pending: nothing to queue behind).
  CUstream garm_ = nullptr;
  Words* words_ = nullptr;  // pinned, kRing entries
  std::vector<Op> ops_;

  // Lock order: enqueue_mu_ -> mu_ -> HostPool::mu_ / StagingArea::mu_ -> Registry::mu_ -> Slot::mu_.
  std::mutex enqueue_mu_;  // one handler enqueues at a time: streams see ops in sequence order
  std::mutex mu_;          // guards everything below
  std::condition_variable cv_;
  uint64_t next_seq_ = 1;
  uint64_t completed_seq_ = 0;   // every op <= this has passed XLA's stream
  std::set<uint64_t> finished_;  // finished ops above completed_seq_ (out of order)
  TicketTable tickets_;
  std::vector<std::shared_ptr<Ticket>> kept_;  // newest offloads keeping their staging cell
  std::vector<std::pair<uint64_t, uint64_t>> pending_drops_;  // (token, after seq)
  std::vector<CUevent> event_pool_;
  std::atomic<uint64_t>* gd2h_done_ = nullptr;  // pinned (after words_): the last graph D2H gd2h_ finished
  uint64_t gd2h_issued_ = 0;  // the last graph D2H sequence number enqueued on gd2h_ (graph_mu_)
  std::vector<int64_t> handler_ns_;  // ring of the last kTimings handler host times
  AsyncErrors errors_;
  bool shutting_down_ = false;
  EngineStats stats_;

  // Graph mode. Lock order: enqueue_mu_ -> graph_mu_ -> mu_. The poller holds graph_mu_ while it serves
  // a pass (dropping it between passes); handlers on the ring path never take it.
  std::mutex graph_mu_;
  ChannelTable channels_;
  std::vector<std::shared_ptr<Ticket>> graph_d2h_;  // graph-mode offloads whose D2H may still run
  GraphStats graph_stats_;
  std::condition_variable poll_cv_;
  std::chrono::steady_clock::time_point awake_until_;
  bool any_captured_ = false;
  bool poll_stop_ = false;
  bool poll_paused_ = false;  // test hook (PausePoller): passes skipped while set
  bool kernels_warmed_ = false;  // WarmKernels ran (graph_mu_)
  // Round tickets in pageable memory (RoundTicketHost) are copied through pinned buffers, made by the
  // first initialize stage (never on the poller): the poller's own (gd2h_, gh2d_, fix_), and the
  // resolver's (fix_), so that neither waits for a buffer behind the other's stream work. The ring
  // path's h2d_ prefetch never picks such a ticket (the handler would wait on the host).
  PageableBounce bounce_;
  PageableBounce ring_bounce_;
  PageableBounce& BounceForThisThread();
  // Kernel grants: tokens armed for a round whose ticket is not made yet (made when the poller serves
  // the round's `filled`). Guarded by mu_, so a resolve can tell a pending round without graph_mu_.
  std::unordered_set<uint64_t> armed_tokens_;
  // A reload consumed (or a drop freed) a ticket some reload cell may hold as a guess (mu_): the
  // poller takes such guesses back (DropStaleGuesses) and GraphIdle waits for that.
  bool stale_guesses_ = false;
  // Unloaded guesses whose cell's copy (the prefetch that reads them) may still run, with that cell's
  // event at the time (graph_mu_): unpinned by ReleaseUnpins once it has completed.
  std::vector<std::pair<CUevent, std::shared_ptr<Ticket>>> unpin_after_;
  GraphKernels kernels_;  // loaded by the first initialize stage (kernel grants), unloaded last
  bool use_kernels_ = false;  // decided at the first initialize stage, fixed for the engine's life
  std::thread poller_;  // started by the first capture or the first cell mapped by an initialize stage
  std::atomic<bool> growing_host_{false};  // a growth is queued on grower_ (RoundTicketHost)

  // Workers last: destroyed first, after ~Engine has synchronized every stream.
  std::unique_ptr<Worker> resolver_, releaser_;
  std::unique_ptr<Worker> grower_;  // pins host pool chunks for graph-mode round tickets (nothing waits for it)
};

}  // namespace jaxvmm
