// Graph mode: offload/reload call sites that XLA captured into command buffers (CUDA graphs), and the
// poller thread that serves their rounds on every replay. DESIGN.md, "Graph mode".
//
// Owns: the channels (per call site: pinned words, K cells at fixed VAs, spares), the poller thread,
// streams gd2h (D2H out of offload cells, the grants behind them, the graph D2H clock), gh2d (prefetches into reload cells), garm (grants of cells that took a spare) and gfix
// (corrections and 0xFF fills), the supply of round tickets' host blocks (RoundHostSupply: the
// pool, else pageable memory, its bounce buffers and the grower that pins more), and a GraphRecorder
// (graph_record.h: a channel's one-time setup, the kernels' loading, the rounds' recorded work; it
// maps no pages, and GraphMode gives a capture that names a cell its pages first). Handed: the ledger
// (tickets, errors, armed tokens), the host store, the staging area (its budget charges every cell's
// pages), the transfers (copies, the clock) and the engine's kernels (the recorder loads and warms
// them at the first initialize stage; the poller's revocations launch one). Knows nothing of the op ring.
//
// Lock order: GraphMode::mu_ -> Ledger::mu_ -> HostPool / StagingArea -> Registry -> Slot. The poller
// holds mu_ while it serves a pass (dropping it between passes); the op ring never takes it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "channels.h"
#include "graph_kernels.h"
#include "graph_record.h"
#include "host_pool.h"
#include "ledger.h"
#include "round_host.h"
#include "staging.h"
#include "status.h"
#include "transfers.h"

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
  bool early_launch = false;   // their module can launch a round's copy and publish early (JAXVMM_GRAPH_PDL)
  std::string kernels_error;   // why not, when they failed to load (the host-granted protocol runs)
  int64_t grants_device = 0, grants_host = 0;
  int64_t revokes = 0;         // grants taken back (idle release, trim, budget) before the device used them
  int64_t revokes_lost = 0;    // revocations that found the grant already taken (the round went on)
  int64_t host_cells = 0;      // cells mapped with host pages because the device was out of memory
  int64_t cells = 0;           // cells reserved over all channels (K per channel with kernel grants, else 1)
  int64_t host_fallbacks = 0;  // round tickets put in pageable memory: the host pool had no room (it grows behind them)
  int64_t bounce_copies = 0;   // pieces (<= 4 MiB) copied through the pinned bounce buffers to or from those tickets
  int64_t fused_captures = 0;  // rounds recorded as one fused take + copy node (JAXVMM_GRAPH_FUSED)
  int64_t early_captures = 0;  // rounds whose copy and publish were recorded as early launches (JAXVMM_GRAPH_PDL)
  // Spare cells (graph_spares): offload rounds whose cell was re-armed with a spare while its D2H was
  // still queued (the cell's bytes lent to its ticket), and reload copies served from such a lent cell
  // (device to device, without waiting for PCIe); kept_reads: those among them whose D2H had already
  // finished (a spare that kept the bytes after it was free again, or a lent or held cell whose D2H
  // ended while its bytes were still there).
  // holds: offload cells held unarmed, their bytes readable (Round::kHeld): every spare was lent, or
  // the one cell of a large call site until its next round.
  // trades: pages passed between the cells of large call sites of opposite directions (TradePages).
  int64_t spares = 0, lends = 0, lent_reads = 0, kept_reads = 0, holds = 0, trades = 0;
  // Device memory of mapped spares now and at its most (graph_spare_budget caps it when set).
  int64_t spare_bytes = 0, spare_bytes_peak = 0;
  // Reload rounds that waited for the poller (and the guesses staged with them) whose ticket's bytes
  // were copied device to device out of the offload cell that still held them, not from the host.
  int64_t cell_reads = 0;
  // 1 when XLA keeps the order of recorded commands (XLA_FLAGS, read when the engine was made), which
  // those reads rely on; 0 under CONCURRENT scheduling: no offload cell is read.
  int64_t xla_in_order = 1;
};

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

  // Caller holds mu_ (as do all the helpers below unless they say otherwise).
  Status CaptureChannel(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out);
  void Recorded(Channel& c);  // counts the recording, wakes the poller
  void WakePoller();
  void Poll();  // the poller thread
  bool ServiceOffload(Channel& c);  // host grants
  bool ServiceReload(Channel& c);
  bool ServiceOffloadK(Channel& c);  // kernel grants
  bool ServiceReloadK(Channel& c);
  // A graph-mode offload round's ticket with its host block: a new token (0), or the token the device
  // took (kernel grants). Null, and *st says why, when it cannot be made. Takes the ledger lock.
  std::shared_ptr<Ticket> MakeRoundTicket(const Channel& c, uint64_t token, Status* st);
  Status CopyOutOfCell(Channel& c, int i, const std::shared_ptr<Ticket>& t);  // D2H of cell i on gd2h_
  void RecordOffloadError(const Channel& c, const Status& st);
  // Caller holds the ledger lock too. The ticket a reload round's token names, if this call site can
  // reload it; the round consumes `a` in cell i (true: a hit, the cell holds it already).
  std::shared_ptr<Ticket> FindForRound(const Held& h, const Channel& c, uint64_t token, std::string* why);
  bool TakeForRound(const Held& h, Channel& c, int i, const std::shared_ptr<Ticket>& a, Source* src);
  // Caller holds the ledger lock too: SourceOf, or the lent, held or kept cell that still holds the
  // ticket's bytes (counted in Ticket::lent_readers: the caller then calls WatchLentRead).
  Source RoundSourceOf(Ticket& t);
  // After the copy from `src` and the record of `ev` behind it: a copy out of a lent or held cell is
  // watched until `ev` completes (Ticket::lent_readers), not until the ticket's pins go.
  void WatchLentRead(const Source& src, const std::shared_ptr<Ticket>& t, CUevent ev);
  bool ReleaseLentReads();  // watched copies that have ended
  void PrefetchInto(Channel& c);    // the next predictions into the channel's idle reload cells
  // Reload cell i's guess (cell.loaded, claimed and pinned) from `src` on `s`: the copy, its grant
  // (kernel grants) and the cell's event behind them. False on failure: `s` synchronized, the guess
  // unloaded unless its grant is out. *copied: the copy was enqueued.
  bool LoadGuess(Channel& c, int i, const Source& src, CUstream s, const char* stage, bool* copied = nullptr);
  // A small offload call site's cell, of a site whose rounds run on `stream`, that still holds t's bytes
  // (Cell::holds: no later round refilled it, its pages stayed), if any. Only while XLA's stream waits
  // for a reload's go may it be read.
  Cell* CellHolding(const std::shared_ptr<Ticket>& t, size_t cell_size, CUstream stream);
  // Reload channel c, whose round in cell `busy` waits for go: its other idle, empty cells take the next
  // guesses whose bytes are still in offload cells, copied device to device on gfix_; true when a copy
  // was enqueued (go must then follow it on gfix_).
  bool StageHeldGuesses(Channel& c, int busy);
  void FillInvalid(Channel& c, int i);  // 0xFF into cell i, ordered after every copy into it
  bool ReapOffloads();              // graph-mode D2H copies that finished: their tickets are on the host
  // Pages for cell i within the staging budget; false: not now. `evict` when a round (or a capture)
  // needs the cell: other channels' idle cells go to make room, and a full device gives host pages.
  // The last copy into or out of `cell` (on cell.stream, unless that is `except`) may still run.
  bool CopyPending(const Cell& cell, CUstream except = nullptr) const;
  // A reload cell's pages may still be read by the D2H of the held cell they came from (Cell::
  // d2h_reads, cleared here once the clock passed it): they are neither given back nor passed on.
  bool ReadByD2h(Cell& cell);
  bool MapCell(Channel& c, int i, bool evict = true);
  void UnmapCell(Channel& c, int i);
  void UnmapPages(Channel& c, CellPages* p, const char* kept);
  void Mapped(const Channel& c, CellPages* p);  // p's pages were just mapped: counts them
  // Cells of idle channels (after IdleMillis unless `now`; only those with device pages if `device_only`).
  size_t ReleaseIdleCells(bool now, bool device_only = false);
  void DropStaleGuesses();  // reload cells whose guess another reload consumed: revoke and unload
  void ReleaseUnpins(bool all);  // unloaded guesses' pins whose cell copy has ended (all: streams synced)
  // Writes `value` into `word`, ordered after cell i's last side-stream copy.
  void Grant(std::atomic<uint64_t>* word, Channel& c, int i, uint64_t value = 1);
  // Offload: a reserved token into grant[i], on gd2h_ after the cell's D2H; or on garm_ when no copy out
  // of the cell is pending (`settled`, or found so) or, when PCIe is behind and that D2H is still
  // queued, after the cell took a free spare's pages (Lend). With no spare to lend, holds the cell
  // instead (Hold; returns false).
  bool Arm(Channel& c, int i, bool host, bool settled = false);
  bool Lend(Channel& c, int i, bool may_map = true);  // swaps cell i with a free spare; true: the cell is free now
  void Hold(Channel& c, int i, bool host, bool until_knock);  // cell i keeps its bytes readable, unarmed
  static bool HoldsUntilKnock(const Channel& c);  // GraphHold::kLarge: the one cell of a large call site
  bool Unhold(const Held& h, Cell& cell);         // a held cell's bytes unreadable again; false: a copy out of it runs
  bool ServeHeld(Channel& c);                     // arms held cells that settled or found a spare
  // Large call sites (Channel::trades): cell i of `c` and cell k of `p` exchange their pages and VAs,
  // the device words naming them rewritten before any grant can follow. Neither has a grant out or a
  // copy pending.
  bool TradePages(Channel& c, int i, Channel& p, int k);
  static bool Partners(const Channel& a, const Channel& b);  // both trade, opposite directions, same cell size
  // Cell i of `c` (unmapped) takes the pages of an idle, empty cell of a call site of the other
  // direction with cells of its size, instead of new ones.
  bool TakeIdlePages(Channel& c, int i);
  // Reload cell j of `c` takes the pages of the offload cell holding ticket `a` (held, no copy but its
  // D2H reading it; a kept ticket's D2H done): the round reads the bytes where the offload left them.
  bool TakeHeldPages(Channel& c, int j, const std::shared_ptr<Ticket>& a);
  bool MapSpare(Channel& c, Spare& s);
  void UnmapSpare(Channel& c, Spare& s);
  bool ReturnSpares();              // lent spares whose ticket's D2H is done are free (they keep its bytes)
  bool Forget(const Held& h, Spare& sp);  // drops the bytes a free spare keeps; false: a copy out of it runs
  void ArmIdleCells(Channel& c);    // offload: arms every idle cell it can map within the budget
  bool Revoke(Channel& c, int i);   // takes cell i's armed grant back; true: none is outstanding any more
  void Unload(const Held& h, Channel& c, int i);  // drops the prediction reload cell i holds
  bool Idle();                      // no round in progress, no D2H outstanding

  const Backend backend_;
  // XLA keeps the order of recorded commands (EngineConfig::XlaKeepsCommandOrder, when the engine was
  // made): only then may a waiting reload read another call site's offload cell (CellHolding).
  const bool xla_in_order_;
  const int device_;
  Ledger& ledger_;
  HostStore& host_store_;
  StagingArea& staging_;
  Transfers& transfers_;
  // gd2h_: D2H out of offload cells and the grants behind them; gh2d_: prefetches into reload cells
  // and their grants; garm_: grants of offload cells that took a spare (no copy of theirs is pending:
  // nothing to queue behind); gfix_: corrections and 0xFF fills. Nothing on them waits for XLA's streams.
  CUstream gd2h_ = nullptr, gh2d_ = nullptr, garm_ = nullptr, gfix_ = nullptr;

  std::mutex mu_;  // guards everything below
  ChannelTable channels_;
  uint64_t return_clock_ = 0;  // counts spares freed (Spare::returned)
  uint64_t gd2h_issued_ = 0;  // the last graph D2H sequence number enqueued on gd2h_ (the clock's)
  std::vector<std::shared_ptr<Ticket>> round_d2h_;  // offload rounds whose D2H may still run
  GraphStats stats_;
  std::condition_variable poll_cv_;
  std::chrono::steady_clock::time_point awake_until_;
  bool any_captured_ = false;
  bool poll_stop_ = false;
  bool poll_paused_ = false;     // test hook (PausePoller): passes skipped while set
  RoundHostSupply round_host_;  // round tickets' host blocks, pageable ones' bounce buffers, the grower
  // Unloaded guesses whose cell's copy (the prefetch that reads them) may still run, with that cell's
  // event at the time: unpinned by ReleaseUnpins once it has completed.
  std::vector<std::pair<CUevent, std::shared_ptr<Ticket>>> unpin_after_;
  // Copies out of lent or held cells, with the reload cell's event recorded behind each.
  std::vector<std::pair<CUevent, std::shared_ptr<Ticket>>> lent_reading_;
  GraphKernels& kernels_;  // the engine's (revocations); loaded and warmed by recorder_
  GraphRecorder recorder_;  // the initialize stage's setup and the rounds' recorded work (guarded by mu_)
  std::thread poller_;  // started by the first capture or the first cell mapped by an initialize stage
};

}  // namespace jaxvmm
