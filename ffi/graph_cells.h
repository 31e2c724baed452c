// Graph mode's cells (DESIGN.md, "Graph mode"): what the parts of graph mode share (GraphShared), and
// GraphCells, which owns what happens to a cell's pages and to the bytes and grants a cell holds:
// mapping within the staging budget (and host pages when the device is full), idle release, page
// trades between large call sites, spares and their lends, revocation of armed grants, and the copies
// that still read a ticket's bytes out of a lent or held cell (or a guess's, out of its host block).
//
// No lock of its own: every call is made with GraphMode::mu_ held, as are the calls of the two halves
// of the poller that use it (graph_offload.h, graph_reload.h). Lock order: GraphMode::mu_ -> Ledger::mu_
// -> HostPool / StagingArea -> Registry -> Slot.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "channels.h"
#include "graph_kernels.h"
#include "host_pool.h"
#include "ledger.h"
#include "round_host.h"
#include "stat_fields.h"
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
  // The grant kernels (DESIGN.md, "Graph mode"), and rounds whose grant the device took by itself (a
  // pre-armed offload grant, a reload whose prefetched token matched) vs rounds that waited for the poller.
  bool kernels = false;        // the kernels are loaded and warmed: captures can record rounds
  bool early_launch = false;   // their module launches a round's copy and publish early (sm_90 and later)
  std::string kernels_error;   // why not, when they failed to load or warm up (every capture fails with it)
  int64_t grants_device = 0, grants_host = 0;
  int64_t revokes = 0;         // grants taken back (idle release, trim, budget) before the device used them
  int64_t revokes_lost = 0;    // revocations that found the grant already taken (the round went on)
  int64_t host_cells = 0;      // cells mapped with host pages because the device was out of memory
  int64_t cells = 0;           // cells reserved over all channels (K per small call site, 1 per large one)
  int64_t host_fallbacks = 0;  // round tickets put in pageable memory: the host pool had no room (it grows behind them)
  int64_t bounce_copies = 0;   // pieces (<= 4 MiB) copied through the pinned bounce buffers to or from those tickets
  int64_t early_captures = 0;  // rounds whose copy and publish were recorded as early launches (sm_90 and later)
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

// engine_stats() keys after graph_ (kernels_error is not a count: Engine.graph_kernels_error()).
inline constexpr StatField<GraphStats> kGraphStatsFields[] = {
    {"channels", &GraphStats::channels},
    {"prepares", &GraphStats::prepares},
    {"captures", &GraphStats::captures},
    {"offload_rounds", &GraphStats::offload_rounds},
    {"reload_rounds", &GraphStats::reload_rounds},
    {"hits", &GraphStats::hits},
    {"misses", &GraphStats::misses},
    {"mapped_bytes", &GraphStats::mapped_bytes},
    {"pages_mapped", &GraphStats::pages_mapped},
    {"pages_returned", &GraphStats::pages_returned},
    {"kernels", &GraphStats::kernels},
    {"early_launch", &GraphStats::early_launch},
    {"grants_device", &GraphStats::grants_device},
    {"grants_host", &GraphStats::grants_host},
    {"revokes", &GraphStats::revokes},
    {"revokes_lost", &GraphStats::revokes_lost},
    {"cells_host", &GraphStats::host_cells},
    {"cells", &GraphStats::cells},
    {"host_fallbacks", &GraphStats::host_fallbacks},
    {"bounce_copies", &GraphStats::bounce_copies},
    {"early_captures", &GraphStats::early_captures},
    {"spares", &GraphStats::spares},
    {"lends", &GraphStats::lends},
    {"lent_reads", &GraphStats::lent_reads},
    {"kept_reads", &GraphStats::kept_reads},
    {"holds", &GraphStats::holds},
    {"trades", &GraphStats::trades},
    {"spare_bytes", &GraphStats::spare_bytes},
    {"spare_bytes_peak", &GraphStats::spare_bytes_peak},
    {"offload_cell_reads", &GraphStats::cell_reads},
    {"xla_in_order", &GraphStats::xla_in_order},
};

// What graph mode's parts are handed and share, guarded by GraphMode::mu_ (the objects referred to have
// locks of their own, below it in the lock order). Made by GraphMode, which creates the streams (Init)
// and destroys them.
struct GraphShared {
  GraphShared(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, Transfers& transfers,
              GraphKernels& kernels);

  const Backend backend;
  const int device;
  // XLA keeps the order of recorded commands (EngineConfig::XlaKeepsCommandOrder, when the engine was
  // made): only then may a waiting reload read another call site's offload cell (ReloadRounds).
  const bool xla_in_order;
  Ledger& ledger;
  HostStore& host_store;
  StagingArea& staging;
  Transfers& transfers;
  GraphKernels& kernels;  // the engine's (revocations); loaded and warmed by GraphMode's recorder
  // gd2h: D2H out of offload cells and the grants behind them; gh2d: prefetches into reload cells and
  // their grants; garm: grants of offload cells that took a spare (no copy of theirs is pending:
  // nothing to queue behind) and page trades' address words; gfix: corrections and 0xFF fills. Nothing
  // on them waits for XLA's streams.
  CUstream gd2h = nullptr, gh2d = nullptr, garm = nullptr, gfix = nullptr;
  ChannelTable channels;
  GraphStats stats;
  RoundHostSupply round_host;  // round tickets' host blocks, pageable ones' bounce buffers, the grower
};

class GraphCells {
 public:
  using Held = Ledger::Held;
  explicit GraphCells(GraphShared& g) : g_(g) {}
  GraphCells(const GraphCells&) = delete;
  GraphCells& operator=(const GraphCells&) = delete;

  // ---- pages
  // The last copy into or out of `cell` (on cell.stream, unless that is `except`) may still run.
  bool CopyPending(const Cell& cell, CUstream except = nullptr) const;
  // A reload cell's pages may still be read by the D2H of the held cell they came from (Cell::
  // d2h_reads, cleared here once the clock passed it): they are neither given back nor passed on.
  bool ReadByD2h(Cell& cell);
  // Pages for cell i within the staging budget; false: not now. `evict` when a round (or a capture)
  // needs the cell: other channels' idle cells go to make room, and a full device gives host pages.
  bool MapCell(Channel& c, int i, bool evict = true);
  void UnmapCell(Channel& c, int i);
  // Cells of idle channels (after IdleMillis unless `now`; only those with device pages if `device_only`);
  // returns the bytes returned.
  size_t ReleaseIdleCells(bool now, bool device_only = false);
  // Cell i of `c` (unmapped) takes the pages of an idle, empty cell of a call site of the other
  // direction with cells of its size, instead of new ones.
  bool TakeIdlePages(Channel& c, int i);
  // Reload cell j of `c` takes the pages of the offload cell holding ticket `a` (held, no copy but its
  // D2H reading it; a kept ticket's D2H done): the round reads the bytes where the offload left them.
  bool TakeHeldPages(Channel& c, int j, const std::shared_ptr<Ticket>& a);

  // ---- spares (graph_spares, graph_spare_budget)
  bool Lend(Channel& c, int i, bool may_map = true);  // swaps cell i with a free spare; true: the cell is free now
  bool ReturnSpares();  // lent spares whose ticket's D2H is done are free (they keep its bytes)

  // ---- grants
  // The reload round that waits for the poller may go with cell i: `go` = i + 1, ordered after cell i's
  // last side-stream copy.
  void Go(Channel& c, int i);
  bool Revoke(Channel& c, int i);  // takes cell i's armed grant back; true: none is outstanding any more

  // ---- what a cell holds (the caller holds the ledger's lock too: h)
  void Unload(const Held& h, Channel& c, int i);  // drops the prediction reload cell i holds
  bool Unhold(const Held& h, Cell& cell);  // a held cell's bytes unreadable again; false: a copy out of it runs

  // ---- copies that read a ticket's bytes
  // Caller holds the ledger lock too: SourceOf, or the lent, held or kept cell that still holds the
  // ticket's bytes (counted in Ticket::lent_readers: the caller then calls WatchLentRead).
  Source RoundSourceOf(Ticket& t);
  // After the copy from `src` and the record of `ev` behind it: a copy out of a lent or held cell is
  // watched until `ev` completes (Ticket::lent_readers), not until the ticket's pins go.
  void WatchLentRead(const Source& src, const std::shared_ptr<Ticket>& t, CUevent ev);
  bool ReleaseLentReads();  // watched copies that have ended
  void ReleaseUnpins(bool all);  // unloaded guesses' pins whose cell copy has ended (all: streams synced)
  bool UnpinsPending() const { return !unpin_after_.empty(); }

  // Stop: every channel's cells and spares, their tickets and guesses, back (graph mode's streams were
  // synchronized and the poller stopped).
  void ReturnAll();

 private:
  void Mapped(const Channel& c, CellPages* p);  // p's pages were just mapped: counts them
  void UnmapPages(Channel& c, CellPages* p, const char* kept);
  bool MapSpare(Channel& c, Spare& s);
  void UnmapSpare(Channel& c, Spare& s);
  bool Forget(const Held& h, Spare& sp);  // drops the bytes a free spare keeps; false: a copy out of it runs
  // Large call sites (Channel::trades): cell i of `c` and cell k of `p` exchange their pages and VAs,
  // the device words naming them rewritten before any grant can follow. Neither has a grant out or a
  // copy pending.
  bool TradePages(Channel& c, int i, Channel& p, int k);
  static bool Partners(const Channel& a, const Channel& b);  // both trade, opposite directions, same cell size

  GraphShared& g_;
  uint64_t return_clock_ = 0;  // counts spares freed (Spare::returned)
  // Unloaded guesses whose cell's copy (the prefetch that reads them) may still run, with that cell's
  // event at the time: unpinned by ReleaseUnpins once it has completed.
  std::vector<std::pair<CUevent, std::shared_ptr<Ticket>>> unpin_after_;
  // Copies out of lent or held cells, with the reload cell's event recorded behind each.
  std::vector<std::pair<CUevent, std::shared_ptr<Ticket>>> lent_reading_;
};

}  // namespace jaxvmm
