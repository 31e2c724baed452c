// Staging area: device memory that offloads and reloads pass through, as *cells* (a fixed VA with pages:
// a staging slot of its own, or, for a cell of at most half a page of the device's granularity, a
// range of a shared page slot, so small tensors share pages) that stay mapped while ops flow and go
// back to the driver when the engine is idle, when the budget needs room for another size, or on Trim().
//
// Reuse is ordered on the device, not on the host: every cell has a `free` event recorded after the
// last device access of its previous user, and whoever acquires the cell makes its stream wait for that
// event before touching it. The host never waits for GPU progress to hand a cell out, except when the
// budget allows no new cell and no cell of the needed size exists yet (then it waits for an idle one of
// another size to finish, and returns its pages).
//
// Lock order: Ledger::mu_ -> StagingArea::mu_ -> Registry::mu_ -> Slot::mu_. Driver calls that map or
// return pages run with mu_ held (they are rare: the first use of a cell, eviction, trim).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "registry.h"
#include "stat_fields.h"
#include "status.h"

namespace jaxvmm {

// Which ops a cell serves. Offloads and reloads draw from pools of their own (Depth() cells each per size),
// so a reload's H2D never waits for an unrelated offload's D2H out of a shared cell, and an offload's
// snapshot never waits for a reload's prefetch. A finished idle cell may change pool (no wait involved).
enum class CellUse : int { kOffload = 0, kReload = 1 };

struct StagingStats {
  int64_t budget_bytes = 0;
  int64_t mapped_bytes = 0;   // pages of every cell, free or in use
  int64_t peak_mapped_bytes = 0;         // since the area was created
  int64_t window_peak_mapped_bytes = 0;  // since the last ResetPeak() (jaxvmm.reset_peaks())
  int64_t cells = 0;
  int64_t offload_cells = 0, reload_cells = 0;  // cells now in each pool (pinned ones included)
  int64_t acquires = 0;
  int64_t device_waits = 0;   // acquires that made the stream wait for the cell's previous user
  int64_t host_waits = 0;     // acquires that had to wait on the host (budget full, other sizes)
  int64_t pages_mapped = 0;   // slots mapped (a large cell's, or a page small cells share): pages taken from the driver
  int64_t pages_returned = 0; // such slots whose pages went back to the driver (idle, budget, trim)
  int64_t shared_pages = 0;   // page slots small cells share, now
  int64_t direct_reloads = 0; // Acquiring::kReload leases left empty: reloads copied straight into XLA's buffer
};

// engine_stats() keys after staging_.
inline constexpr StatField<StagingStats> kStagingStatsFields[] = {
    {"budget_bytes", &StagingStats::budget_bytes},
    {"mapped_bytes", &StagingStats::mapped_bytes},
    {"peak_bytes", &StagingStats::peak_mapped_bytes},
    {"window_peak_bytes", &StagingStats::window_peak_mapped_bytes},
    {"cells", &StagingStats::cells},
    {"offload_cells", &StagingStats::offload_cells},
    {"reload_cells", &StagingStats::reload_cells},
    {"acquires", &StagingStats::acquires},
    {"device_waits", &StagingStats::device_waits},
    {"host_waits", &StagingStats::host_waits},
    {"pages_mapped", &StagingStats::pages_mapped},
    {"pages_returned", &StagingStats::pages_returned},
    {"shared_pages", &StagingStats::shared_pages},
    {"direct_reloads", &StagingStats::direct_reloads},
};

// How Acquire may hand a cell out.
enum class Acquiring : int {
  kWait,     // any cell: the stream may wait for its previous user, or (budget full) the host for one
  kTryOnly,  // only a cell that needs no wait at all, else an empty lease (prefetch hints: their stream
             // must never wait for later work)
  // A reload: as kWait, except for a size RetireSize marked (a graph-mode call site of that size was
  // recorded for the first time): no cell then (those of that size are retiring), an empty lease, and
  // the caller copies straight into XLA's buffer. At most kDirectReloads such leases per mark, none
  // once an offload of that size came through here since (uncaptured traffic of that size: its
  // reloads get cells as before).
  kReload,
};

// A cell handed out: its address and the event its user must make a stream wait for before the first
// access (null: no wait needed). The user returns the lease with the stream of its last access.
struct StagingLease {
  int64_t cell = -1;  // index into the area's cells; -1: no lease
  CUdeviceptr address = 0;
  size_t size = 0;
  CUevent wait = nullptr;
  explicit operator bool() const { return cell >= 0; }
};

class StagingArea {
 public:
  StagingArea(Backend b, int device);
  ~StagingArea();  // returns every cell's pages; the owner has synchronized the streams first
  StagingArea(const StagingArea&) = delete;
  StagingArea& operator=(const StagingArea&) = delete;

  // Process-wide settings (config.h). The budget for mapped staging bytes per engine (staging_budget).
  static size_t Budget();
  // How long the area stays mapped with no acquire before its pages go back (staging_idle_ms).
  static int64_t IdleMillis();
  // Cells per size that may be in flight at once (prefetch_depth): how far copies of one size may run
  // ahead of XLA's stream, and how many pages they hold.
  static int Depth();

  // A mapped cell of at least `nbytes` from `use`'s pool. Never blocks on the device except as described
  // above; `how` as its enum says (an empty lease is no error). A device wait (lease.wait) is only ever
  // for a cell whose previous user was of the same `use`.
  Status Acquire(size_t nbytes, CellUse use, Acquiring how, StagingLease* out);
  static constexpr int kDirectReloads = 8;
  // Gives the cell back. `after` (may be null): the stream of the last access; the cell's free event is
  // recorded on it. With null, the last recorded free event (or none) still guards the next user.
  Status Return(StagingLease* lease, CUstream after);
  // Records the cell's free event on `s` now (the lease is kept): later users wait for what `s` holds,
  // and so can readers of the cell's contents (lease->wait becomes that event).
  Status Record(StagingLease* lease, CUstream s);
  // The cell is kept as a ticket's device copy: it no longer counts towards Depth() until returned.
  void Pin(const StagingLease& lease);
  // Graph-mode channel cells (their own slots) share the budget: Charge makes room by returning idle
  // cells (never waiting) and counts `bytes` as mapped, or returns false; Uncharge gives them back.
  // A graph cell also displaces idle cells of as many bytes, budget or not: once a program's call
  // sites are recorded, its ops no longer use these cells, which would otherwise stay mapped next to
  // the graph cells until IdleMillis() (a large program's whole first-execution staging, at its second).
  bool Charge(size_t bytes);
  void Uncharge(size_t bytes);
  // A graph-mode call site of `nbytes` was recorded: its ops no longer come through here, so the cells
  // of that size that exist now (not small ones: they share pages) go back as soon as their last user
  // finishes and none acquired them since, by the janitor, not after IdleMillis(). (A scan's first
  // iteration runs uncaptured, on these cells; the next ones replay graph-mode cells, and the two
  // stayed mapped side by side: one more activation at a large program's first execution.)
  // With `mark_reloads` (a call site's first recording) it also marks the size for Acquiring::kReload:
  // the scan's first backward iteration, uncaptured, comes to the host long before the device gets
  // there (XLA's host thread runs ahead through the forward's replays), and a new cell mapped then
  // stayed mapped beside the call sites' graph-mode cells through the whole forward (H200: 512 MiB at
  // the MLP row's first step, 256 in every later one).
  void RetireSize(size_t nbytes, bool mark_reloads);
  // Returns the pages of every cell not in use and whose last user finished. Returns bytes returned.
  size_t Trim();
  StagingStats Stats() const;
  void ResetPeak();  // window_peak_mapped_bytes := mapped bytes now

 private:
  void NotePeak();  // caller holds mu_: the peaks after mapped_ grew
  struct Cell {
    int64_t slot_id = -1;  // -1: this entry is empty (its pages went back); a small cell: its page's slot
    int page = -1;         // a small cell: its index in pages_ (-1: a slot of its own)
    size_t offset = 0;     // a small cell: where it starts in its page
    CUdeviceptr address = 0;
    size_t size = 0;
    CUevent free = nullptr;
    bool recorded = false;  // `free` has been recorded at least once since the cell was created
    bool done = false;      // `free`'s latest record is known complete (no need to query it again)
    bool in_use = false;
    bool pinned = false;
    CellUse use = CellUse::kOffload;
    uint64_t last_use = 0;
  };
  bool Finished(Cell& c) const;  // caller holds mu_; queries `free` until it completes once per record
  // A page slot (granularity bytes) that small cells are carved from, first fit; it goes back to the
  // driver when its last cell is dropped.
  struct Page {
    int64_t slot_id = -1;  // -1: this entry is empty
    CUdeviceptr base = 0;
    size_t size = 0;
    std::map<size_t, size_t> holes;  // offset -> length of each free range
    int cells = 0;
  };
  static constexpr size_t kSmallAlign = 256;  // a small cell's size and offset are multiples of this
  // A cell of at most half a page (granularity g) is small: it shares a page slot with other small
  // cells, its size a multiple of kSmallAlign; a larger one has a slot of its own, whole pages.
  static bool Small(size_t nbytes, size_t g) { return nbytes <= g / 2; }
  static size_t CellBytes(size_t nbytes, size_t g) {
    return Small(nbytes, g) ? (std::max<size_t>(nbytes, 1) + kSmallAlign - 1) / kSmallAlign * kSmallAlign : (nbytes + g - 1) / g * g;
  }
  bool CarveSmall(size_t size, int* page, size_t* offset);  // caller holds mu_; from an existing page
  bool CarveIn(int page, size_t size, size_t* offset);      // caller holds mu_; from that page
  // Caller holds mu_: a new cell in cells_ (mapping its slot or a new shared page unless `page` >= 0
  // names the page a range was carved from), its event created; on failure nothing is kept.
  Status NewCell(size_t size, size_t need, bool small, int page, size_t offset, Cell** out);
  // Caller holds mu_: drops every idle, finished small cell (a page stays while other cells use it:
  // holes for a small cell when the budget has no room for another page).
  void DropIdleSmall();
  void FreeSmall(int page, size_t offset, size_t size);      // caller holds mu_; the last frees the page
  // Drop takes a finished cell out (its bytes leave mapped_ at once) into graveyard_; Bury returns the
  // pages and destroys the event with no lock held. On the H200 the janitor's cuEventDestroy waited
  // for the driver lock a spinning cuGraphLaunch held, inside mu_, and the graph poller waited for mu_
  // (Uncharge): the launch waited for the poller (capacity trial, 27 layers). So no driver call that
  // gives something back runs under mu_, and the poller (Charge) never buries: the janitor does.
  void Drop(Cell& c);  // caller holds mu_
  void Bury();         // caller holds no lock
  // Evicts other cells until mapped_ + need <= limit (Budget() if 0); caller holds mu_.
  bool MakeRoom(size_t need, std::unique_lock<std::mutex>* wait, size_t limit = 0);
  void DropRetired();  // caller holds mu_: the retired cells whose last user finished
  void Janitor();                                    // trims after IdleMillis() without an acquire

  const Backend backend_;
  const int device_;
  mutable std::mutex mu_;  // guards everything below
  // cv_: a cell, budget or burial some thread waits for (notified only while `waiting_` > 0, so that a
  // handler's Return makes no futex call); janitor_cv_: the graveyard or stop_.
  std::condition_variable cv_, janitor_cv_;
  int waiting_ = 0;
  void NotifyWaiters() {  // caller holds mu_
    if (waiting_ > 0) cv_.notify_all();
  }
  std::atomic<size_t> granularity_{0};  // the device's page granularity, once known
  std::vector<Cell> cells_;
  std::vector<Page> pages_;
  struct Detached {
    int64_t slot_id;
    CUevent free;
  };
  std::vector<Detached> graveyard_;  // dropped cells whose pages and event have not been given back yet
  int burying_ = 0;                  // Bury calls giving cells back now (Trim waits for them)
  size_t mapped_ = 0;
  uint64_t clock_ = 0;
  std::chrono::steady_clock::time_point last_acquire_;
  struct Retiring {
    size_t size;      // cells of this size
    uint64_t before;  // last acquired at or before this clock_ value (a later acquire keeps the cell)
  };
  std::vector<Retiring> retiring_;  // RetireSize; the janitor polls every millisecond while non-empty
  std::map<size_t, int> direct_left_;  // RetireSize's sizes -> Acquiring::kReload leases left empty before it lapses
  bool retire_new_ = false;         // wakes the janitor
  bool stop_ = false;
  StagingStats stats_;
  std::thread janitor_;  // last: started once the state above exists
};

}  // namespace jaxvmm
