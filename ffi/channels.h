// Graph-mode channels: what a call site captured into an XLA command buffer (a CUDA graph) talks to.
//
// A replayed graph does the same device work every time and never calls the handler, so each
// (call site, kind) of an engine gets a *channel*: a staging cell at a fixed VA (an internal slot whose
// pages come and go while the VA stays) and a line of pinned words through which the replayed nodes
// and the engine's poller hand each round back and forth, plus two device-memory words through which
// the poller arms grants ahead of time that a round's grant kernel takes on the device (graph_kernels.h).
// Every per-round decision (which ticket, which host block, whether the prediction was right) is still
// the poller's; it is only made before the round instead of during it. DESIGN.md, "Graph mode".
//
// ChannelTable is plain data with no lock of its own: graph mode guards it with GraphMode::mu_.
// It owns the pinned and device word arenas (driver calls only when they grow, never on a capturing
// thread).
#pragma once

#include <atomic>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "graph_words.h"
#include "status.h"
#include "tickets.h"

namespace jaxvmm {

enum class ChannelKind : int { kOffload = 0, kReload = 1 };

// A *large* call site: its cell (the array rounded up to the VMM granularity) has at least this many
// bytes. It gets one cell whatever graph_cells says (GraphRecorder::ReserveCells), held after each
// round until the next one knocks, its pages passed between the two directions (Channel::trades).
constexpr size_t kLargeCellBytes = 32ull << 20;

// A pinned word's address as the device sees it (host memory mapped for the device, unified addressing).
inline CUdeviceptr WordAddr(const std::atomic<uint64_t>& word) { return reinterpret_cast<CUdeviceptr>(&word); }

// `value` into the 64-bit device word `word`, ordered on `s` (a memory barrier before it: copies
// enqueued earlier on `s` are visible first).
Status WriteDeviceWord(Backend b, CUstream s, CUdeviceptr word, uint64_t value, const char* stage);

// One line of pinned, device-mapped words per channel. Each word has one writer at a time: the
// device writes a flag (knock, filled, request, done) and the poller resets it (knock: the device
// clears the level it holds); the poller answers a request with `go` and the device takes it back by
// writing 0.
struct alignas(64) ChannelWords {
  // offload: knock (device: a round waits for a grant, a level held while it waits).
  std::atomic<uint64_t> knock;
  // reload: probe (device: the token it holds), request (device: a round waits for `go`), go (poller:
  // 1 + the cell that holds the probed ticket's bytes, or 0xFF).
  std::atomic<uint64_t> probe, request, go;
  // What jaxvmm_revoke found (nonzero: the grant was taken back before the device used it).
  std::atomic<uint64_t> result;
  // Only the kernels' warm-up uses these (GraphRecorder::WarmKernels): a stand-in cell, a copy's
  // destination, a token.
  std::atomic<uint64_t> scratch[3];
  // Per cell (device: the round that used cell i is through the cell): offload filled[i] (the cell
  // holds the round's bytes), reload done[i] (the device copied the cell out).
  std::atomic<uint64_t> filled[kMaxCells], done[kMaxCells];
};
static_assert(sizeof(ChannelWords) == 128, "two cache lines per channel");

// The memory of a staging cell or a spare: an internal slot whose VA is reserved once and whose pages
// are mapped on demand and returned when idle. A lend exchanges a cell's and a spare's.
struct CellPages {
  int64_t slot_id = -1;  // reserved at the channel's first initialize stage
  CUdeviceptr addr = 0;
  bool mapped = false;
  bool host_pages = false;  // mapped with host (HOST_NUMA) pages: the device had no memory for them
};

// One of a channel's K staging cells: its pages, and the state of the round that uses it.
struct Cell : CellPages {
  enum class Round : int {
    kIdle = 0,     // no grant out: the device does not touch the cell
    kGranted = 1,  // a round may be using the cell (a request the poller answered, or a take a revoke found)
    // Offload: grant[i] holds grant_token (the device may have taken it: only a revoke tells); reload:
    // grant[i] names `loaded`, whose bytes are in the cell.
    kArmed = 2,
    // Offload: spares: the cell's D2H is queued behind others and no spare was free to take its bytes,
    // so it is not armed behind that D2H; or the one cell of a large call site, until its next round
    // knocks (until_knock). Until the poller arms it (D2H done and no reader, or a spare free to lend),
    // or lets it go idle (its ticket consumed or dropped), no grant is out and its bytes stay readable
    // device to device (Ticket::lent_cell).
    kHeld = 3,
  };
  Round round = Round::kIdle;
  uint64_t grant_token = 0;        // offload, kArmed: the token in grant[i] (its ticket is made at filled[i])
  bool host_grant = false;         // the outstanding grant answered a knock/request (counted at the round's end)
  std::shared_ptr<Ticket> ticket;  // reload: the ticket of the round the poller granted (a request)
  std::shared_ptr<Ticket> loaded;  // reload: the predicted ticket copied into the cell ahead of time
  CUevent event = nullptr;         // after the last side-stream copy into/out of the cell
  CUstream stream = nullptr;       // the stream that copy ran on (grants are ordered after it)
  CUstream grant_stream = nullptr; // kArmed: the stream that wrote grant[i] (a revoke runs there)
  std::shared_ptr<Ticket> draining;  // offload: the ticket whose D2H out of this cell may still run
  bool until_knock = false;          // offload, kHeld: armed only once a round knocks (GraphHold::kLarge)
  // Reload: the pages came from a held offload cell whose D2H may still read them (GraphCells::
  // TakeHeldPages): they stay mapped here until the graph D2H clock reaches this (0: nothing reads them).
  uint64_t d2h_reads = 0;
  // Offload: the round ticket whose bytes the cell holds (its last round served), until its next round
  // or until its pages go. A reload round that waits for the poller may copy them device to device
  // (ReloadRounds::CellHolding): its go follows that copy, so no later round of XLA's stream can refill the
  // cell first.
  std::weak_ptr<Ticket> holds;
  // Offload: the reload cell such a copy went into (on gfix_, its event recorded behind it): the pages
  // stay mapped until that cell has no copy pending.
  const Cell* read_into = nullptr;
};

// A spare cell of an offload channel (graph_spares): VA reserved with the channel's cells, pages mapped
// on demand. Lent: it holds the bytes of `lent`, a round ticket whose D2H out of it may still run (the
// cell it was swapped out of took the spare's pages and VA in exchange). Free: it may still hold the
// bytes of `kept`, the ticket it was last lent to (D2H done, Ticket::lent_cell still names it), until a
// lend reuses it (oldest `returned` first) or its pages go back.
struct Spare : CellPages {
  std::shared_ptr<Ticket> lent;
  std::weak_ptr<Ticket> kept;
  uint64_t returned = 0;  // when it was last freed (GraphCells' return clock): the order of reuse
};

struct Channel {
  using Round = Cell::Round;
  ChannelKind kind = ChannelKind::kOffload;
  int64_t site = 0;
  int64_t index = 0;  // position in the table; names the channel in claims and diagnostics
  ArrayMeta meta;
  ChannelWords* w = nullptr;
  CUdeviceptr dw = 0;  // this channel's DeviceWords
  int ncells = 0;      // K: cells reserved (1 for a large call site); fixed at the first initialize stage
  Cell cells[kMaxCells];
  std::vector<Spare> spares;  // offload: graph_spares of them (DESIGN.md, "Spare cells")
  size_t cell_size = 0;
  int map_failures = 0;     // MapCell attempts failed in a row (reported once per streak)
  bool captured = false;  // some execute recorded this channel's device work
  int64_t prepares = 0;   // initialize stages seen
  bool waiting = false;   // a knock/request seen but not granted yet (no budget, data not enqueued)
  CUstream stream = nullptr;  // XLA's stream at the last Prepare: async errors are reported on it
  std::chrono::steady_clock::time_point last_use;
  int64_t rounds = 0;
  // The one cell of a large call site (GraphHold::kLarge): its pages may pass to and from a call site
  // of the other direction with cells of the same size (GraphCells::TradePages), so its address is
  // read from the device words, as a lend changes it with spares.
  bool trades = false;

  // Lends (spares) and page trades rewrite a cell's address word; without either the addresses are
  // constant (the device words' `stable`).
  bool AddressesMove() const { return !spares.empty() || trades; }
  // A large call site (kLargeCellBytes): one cell whatever graph_cells says, held and trading pages
  // under GraphHold::kLarge.
  bool Large() const { return cell_size >= kLargeCellBytes; }
  // Rounds recorded as copies that name cell 0 (its address never changes) instead of kernels that
  // read the cell's address from the device words.
  bool FixedCell() const { return ncells == 1 && !AddressesMove(); }

  // Addresses of the device words.
  CUdeviceptr Grant(int i) const { return dw + offsetof(DeviceWords, grant) + sizeof(uint64_t) * i; }
  CUdeviceptr CellWord(int i) const { return dw + offsetof(DeviceWords, cell) + sizeof(uint64_t) * i; }
  CUdeviceptr Word(size_t offset) const { return dw + offset; }
  // The claim a channel puts on a ticket it prefetched (never a sequence number of the op ring).
  uint64_t Claim() const { return (uint64_t{1} << 63) | static_cast<uint64_t>(index); }
};

class ChannelTable {
 public:
  ChannelTable(Backend b, int device) : backend_(b), device_(device) {}
  ~ChannelTable();  // frees the word arena; the owner has returned every channel's cell first
  ChannelTable(const ChannelTable&) = delete;
  ChannelTable& operator=(const ChannelTable&) = delete;

  // The channel of (site, kind, array), created with fresh words when new (may grow the arena: only
  // ever called from the initialize stage, outside any capture). *created says whether it is new. One
  // traced call site can be compiled for several shapes (a sharded and an unsharded program, say), so
  // the array's size and signature are part of the key.
  Status GetOrCreate(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out, bool* created);
  // The channel of (site, kind, array), or null (capture: never creates).
  Channel* Find(int64_t site, ChannelKind kind, const ArrayMeta& meta);
  template <typename F>
  void ForEach(F f) {
    for (auto& c : channels_) f(*c);
  }
  size_t size() const { return channels_.size(); }

 private:
  static constexpr size_t kWordsPerChunk = 1024;
  const Backend backend_;
  const int device_;
  std::vector<ChannelWords*> chunks_;  // pinned, kWordsPerChunk lines each
  std::vector<CUdeviceptr> device_chunks_;  // device memory, kWordsPerChunk DeviceWords each, zeroed
  size_t used_ = 0;                    // lines handed out
  std::vector<std::unique_ptr<Channel>> channels_;
  using Key = std::tuple<int64_t, int, size_t, int64_t>;  // site, kind, nbytes, signature
  std::map<Key, Channel*> by_site_;
};

}  // namespace jaxvmm
