#include "staging.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "config.h"
#include "vmm.h"

namespace jaxvmm {

size_t StagingArea::Budget() { return static_cast<size_t>(std::max<int64_t>(EngineConfig::Get(Setting::kStagingBudget), 0)); }
int64_t StagingArea::IdleMillis() { return std::max<int64_t>(EngineConfig::Get(Setting::kStagingIdleMs), 1); }
int StagingArea::Depth() {
  return static_cast<int>(std::clamp<int64_t>(EngineConfig::Get(Setting::kPrefetchDepth), 1, std::numeric_limits<int>::max()));
}

StagingArea::StagingArea(Backend b, int device)
    : backend_(b), device_(device), last_acquire_(std::chrono::steady_clock::now()), janitor_([this] { Janitor(); }) {}

StagingArea::~StagingArea() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  janitor_cv_.notify_all();
  if (janitor_.joinable()) janitor_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Cell& c : cells_)
      if (c.slot_id >= 0) Drop(c);
  }
  Bury();
}

bool StagingArea::Finished(Cell& c) const {
  if (!c.recorded || c.done) return true;
  c.done = Driver(backend_).EventQuery(c.free) == CUDA_SUCCESS;
  return c.done;
}

void StagingArea::Drop(Cell& c) {
  // Caller holds mu_, the cell is not in use and its last user finished (or the owner synchronized).
  if (c.page >= 0) {
    graveyard_.push_back(Detached{-1, c.free});  // its event; the page goes with its last cell
    FreeSmall(c.page, c.offset, c.size);
  } else {
    graveyard_.push_back(Detached{c.slot_id, c.free});
    mapped_ -= c.size;
    ++stats_.pages_returned;
  }
  c = Cell();
  janitor_cv_.notify_all();  // the janitor buries what nobody else will
  NotifyWaiters();             // the budget has room
}

void StagingArea::Bury() {
  std::vector<Detached> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead.swap(graveyard_);
    if (dead.empty()) return;
    ++burying_;
  }
  {
    ScopedContext ctx(backend_, device_);
    const DriverTable& d = Driver(backend_);
    for (const Detached& x : dead) {
      if (x.free) d.EventDestroy(x.free);
      if (x.slot_id < 0) continue;
      Status st = Registry::Get().Close(x.slot_id);  // a failed teardown goes to the registry's quarantine
      (void)st;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  --burying_;
  NotifyWaiters();
}

bool StagingArea::CarveIn(int page, size_t size, size_t* offset) {
  Page& pg = pages_[page];
  for (auto it = pg.holes.begin(); it != pg.holes.end(); ++it) {
    if (it->second < size) continue;
    const size_t off = it->first, len = it->second;
    pg.holes.erase(it);
    if (len > size) pg.holes[off + size] = len - size;
    ++pg.cells;
    *offset = off;
    return true;
  }
  return false;
}

bool StagingArea::CarveSmall(size_t size, int* page, size_t* offset) {
  for (size_t p = 0; p < pages_.size(); ++p) {
    if (pages_[p].slot_id < 0 || !CarveIn(static_cast<int>(p), size, offset)) continue;
    *page = static_cast<int>(p);
    return true;
  }
  return false;
}

void StagingArea::FreeSmall(int page, size_t offset, size_t size) {
  Page& pg = pages_[page];
  auto it = pg.holes.emplace(offset, size).first;
  auto next = std::next(it);
  if (next != pg.holes.end() && it->first + it->second == next->first) {
    it->second += next->second;
    pg.holes.erase(next);
  }
  if (it != pg.holes.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      pg.holes.erase(it);
    }
  }
  if (--pg.cells > 0) return;
  graveyard_.push_back(Detached{pg.slot_id, nullptr});
  mapped_ -= pg.size;
  ++stats_.pages_returned;
  pg = Page();
  janitor_cv_.notify_all();
  NotifyWaiters();
}

void StagingArea::DropIdleSmall() {
  for (Cell& c : cells_)
    if (c.slot_id >= 0 && c.page >= 0 && !c.in_use && Finished(c)) Drop(c);
}

bool StagingArea::MakeRoom(size_t need, std::unique_lock<std::mutex>* wait, size_t limit) {
  // Caller holds mu_ (through `wait` when given). Cells whose last user finished go first (oldest
  // first). With `wait`, cells whose last user is still running are then waited for on the host (the
  // rare case: the budget is full of other sizes' copies in flight), with mu_ dropped while waiting:
  // a graph-mode round the device is blocked in may need the poller, whose Charge() takes mu_.
  bool counted = false;
  const auto fits = [&] { return mapped_ + need <= (limit ? limit : Budget()); };
  for (;;) {
    std::vector<Cell*> idle;
    for (Cell& c : cells_)
      if (c.slot_id >= 0 && !c.in_use) idle.push_back(&c);
    std::sort(idle.begin(), idle.end(), [](const Cell* a, const Cell* b) { return a->last_use < b->last_use; });
    bool running = false;
    for (Cell* c : idle) {
      if (fits()) break;
      if (c->slot_id < 0) continue;  // dropped with its page below
      if (c->page >= 0) {
        // A shared page is returned as a unit: dropping one of its cells frees no bytes while another
        // is in use or still running, and would only cost that cell's event again later.
        bool busy = false, unfinished = false;
        for (Cell& o : cells_)
          if (o.slot_id >= 0 && o.page == c->page) busy |= o.in_use, unfinished |= !o.in_use && !Finished(o);
        if (busy) continue;
        if (unfinished) {
          running = true;
          continue;
        }
        const int page = c->page;
        for (Cell& o : cells_)
          if (o.slot_id >= 0 && o.page == page) Drop(o);  // the last one returns the page
        continue;
      }
      if (!Finished(*c)) {
        running = true;
        continue;
      }
      Drop(*c);
    }
    if (fits()) return true;
    if (!wait || !running) return false;
    if (!counted) ++stats_.host_waits;
    counted = true;
    ++waiting_;
    cv_.wait_for(*wait, std::chrono::microseconds(100));  // the cells may change meanwhile: scan again
    --waiting_;
  }
}

Status StagingArea::NewCell(size_t size, size_t need, bool small, int page, size_t offset, Cell** out) {
  // Caller holds mu_. `page` >= 0: the range [offset, offset + size) already carved from that shared
  // page; else map `need` bytes: a slot of the cell's own, or (small) a new shared page whose first
  // range the cell takes. Then the cell's event and an entry in cells_; on failure nothing is kept.
  ScopedContext ctx(backend_, device_);  // the cell's (or its page's) slot and its event
  Status st;
  int64_t id = -1;
  CUdeviceptr address = 0;
  bool mapped = false;  // a slot was mapped for this cell (its own, or a new shared page)
  if (page < 0) {
    SlotSpec spec;
    spec.backend = backend_;
    spec.device = device_;
    spec.location = Location{CU_MEM_LOCATION_TYPE_DEVICE, device_};
    spec.nbytes = need;
    spec.internal = true;
    st = Registry::Get().Create(spec, &id);
    std::shared_ptr<Slot> slot;
    if (st.ok()) st = Registry::Get().Lookup(id, &slot);
    if (st.ok()) {
      address = slot->address();
      mapped = true;
      mapped_ += need;
      NotePeak();
      ++stats_.pages_mapped;
    } else if (id >= 0) {
      (void)Registry::Get().Close(id);
      id = -1;
    }
    if (mapped && small) {  // a new shared page: this cell is its first range
      auto empty = std::find_if(pages_.begin(), pages_.end(), [](const Page& p) { return p.slot_id < 0; });
      if (empty == pages_.end()) empty = pages_.insert(pages_.end(), Page());
      empty->slot_id = id;
      empty->base = address;
      empty->size = need;
      empty->holes[0] = need;
      page = static_cast<int>(empty - pages_.begin());
      (void)CarveIn(page, size, &offset);  // offset 0
    }
  }
  if (small && page >= 0) id = pages_[page].slot_id, address = pages_[page].base + offset;
  CUevent ev = nullptr;
  if (st.ok()) st = Call(id, "staging", Entry::kEventCreate, [&] { return Driver(backend_).EventCreate(&ev, CU_EVENT_DISABLE_TIMING); });
  if (!st.ok()) {
    if (small && page >= 0) {
      FreeSmall(page, offset, size);  // a page only this cell used goes to the graveyard
    } else if (mapped) {
      mapped_ -= need;
      ++stats_.pages_returned;
      (void)Registry::Get().Close(id);
    }
    return st;
  }
  auto empty = std::find_if(cells_.begin(), cells_.end(), [](const Cell& c) { return c.slot_id < 0; });
  if (empty == cells_.end()) empty = cells_.insert(cells_.end(), Cell());
  empty->slot_id = id;
  empty->page = small ? page : -1;
  empty->offset = offset;
  empty->address = address;
  empty->size = size;
  empty->free = ev;
  *out = &*empty;
  return Status();
}

Status StagingArea::Acquire(size_t nbytes, CellUse use, Acquiring how, StagingLease* out) {
  const bool try_only = how == Acquiring::kTryOnly;
  *out = StagingLease();
  Location loc{CU_MEM_LOCATION_TYPE_DEVICE, device_};
  size_t g = granularity_.load(std::memory_order_relaxed);
  if (g == 0) {
    JAXVMM_RETURN_IF_ERROR(Granularity(backend_, device_, loc, &g));
    granularity_.store(g, std::memory_order_relaxed);
  }
  const bool small = Small(nbytes, g);
  const size_t size = CellBytes(nbytes, g);
  const size_t need = small ? g : size;  // what a new cell may have to map
  std::unique_lock<std::mutex> lock(mu_);
  if (need > Budget())
    return Status(Code::kOutOfMemory, "a staging cell of " + std::to_string(size) + " bytes (" + std::to_string(need) +
                                          " bytes of pages) does not fit the staging budget of " +
                                          std::to_string(Budget()) + " bytes (jaxvmm.configure(staging_budget=...) or JAXVMM_STAGING_BUDGET)");
  last_acquire_ = std::chrono::steady_clock::now();
  // A size whose graph-mode call site was recorded: an offload of it here means uncaptured traffic of
  // that size, so its reloads get cells again; a reload takes no cell (below) while the mark lasts.
  auto direct = direct_left_.find(size);
  if (direct != direct_left_.end() && use == CellUse::kOffload) {
    direct_left_.erase(direct);
    direct = direct_left_.end();
  }
  if (how == Acquiring::kReload && direct != direct_left_.end()) {
    // Every cell of a marked size was made before its mark (an offload since would have ended it), so
    // each is retiring: taking one would keep it mapped (DropRetired skips cells acquired since).
    // The caller copies straight into XLA's buffer.
    if (--direct->second == 0) direct_left_.erase(direct);
    ++stats_.direct_reloads;
    return Status();
  }
  for (;;) {
    // Cells of this size in `use`'s pool: reuse one whose last user finished; else, while the pool has
    // fewer than Depth() cells, take a finished idle cell of the other pool (no wait) or map a new one;
    // else take the pool's least recently used cell and let the device wait for its previous user,
    // which did the same kind of copy earlier in stream order. Never a wait across pools.
    Cell* finished = nullptr;
    Cell* oldest = nullptr;
    Cell* other_finished = nullptr;
    int count = 0, any = 0;
    for (Cell& c : cells_) {
      if (c.slot_id < 0 || c.size != size || c.pinned) continue;
      ++any;
      if (c.use != use) {
        if (!c.in_use && (!other_finished || c.last_use < other_finished->last_use) && Finished(c)) other_finished = &c;
        continue;
      }
      ++count;
      if (c.in_use) continue;
      if (!oldest || c.last_use < oldest->last_use) oldest = &c;
      if ((!finished || c.last_use < finished->last_use) && Finished(c)) finished = &c;
    }
    Cell* pick = finished;
    if (!pick && count < Depth() && other_finished) pick = other_finished;
    int page = -1;
    size_t offset = 0;
    bool carved = !pick && count < Depth() && small && CarveSmall(size, &page, &offset);
    bool room = false;
    if (!pick && !carved && count < Depth()) {
      room = MakeRoom(need, oldest != nullptr || try_only ? nullptr : &lock);
      // MakeRoom may have dropped small cells (mu_ may have been dropped while it waited): a hole may
      // fit now. With no room for a page, idle small cells of other sizes make one.
      if (small) {
        carved = CarveSmall(size, &page, &offset);
        if (!carved && !room) {
          DropIdleSmall();
          carved = CarveSmall(size, &page, &offset);
          room = !carved && mapped_ + need <= Budget();  // it may have returned whole pages
        }
      }
    }
    if (carved || room) {
      Status st = NewCell(size, need, small, page, offset, &pick);
      if (!st.ok() && !oldest) return st;
    }
    if (!pick && oldest && !try_only) {
      // With `try_only` (a prefetch hint on the fix stream) never: a wait for a later user of XLA's
      // stream would queue the corrections XLA's stream waits for behind it.
      pick = oldest;
      ++stats_.device_waits;
    }
    if (pick) {
      pick->in_use = true;
      pick->use = use;
      pick->last_use = ++clock_;
      ++stats_.acquires;
      out->cell = pick - cells_.data();
      out->address = pick->address;
      out->size = pick->size;
      out->wait = pick->recorded ? pick->free : nullptr;
      return Status();
    }
    if (try_only) return Status();
    if (any == 0)
      return Status(Code::kOutOfMemory, "the staging budget of " + std::to_string(Budget()) +
                                            " bytes is held by device copies kept for reloads (keep_resident, prefetch); "
                                            "raise staging_budget or lower keep_resident");
    // Every cell of this size is held by a handler on another thread, or (budget full) by the other
    // pool's copies still running: wait for one to be returned.
    ++waiting_;
    cv_.wait(lock);
    --waiting_;
  }
}

Status StagingArea::Record(StagingLease* lease, CUstream s) {
  if (!*lease) return Status();
  std::lock_guard<std::mutex> lock(mu_);
  Cell& c = cells_[lease->cell];
  Status st = Call(c.slot_id, "staging", Entry::kEventRecord, [&] { return Driver(backend_).EventRecord(c.free, s); });
  if (st.ok()) {
    c.recorded = true;
    c.done = false;
    lease->wait = c.free;
  }
  return st;
}

Status StagingArea::Return(StagingLease* lease, CUstream after) {
  if (!*lease) return Status();
  Status st;
  if (after) st = Record(lease, after);
  std::lock_guard<std::mutex> lock(mu_);
  Cell& c = cells_[lease->cell];
  c.in_use = false;
  c.pinned = false;
  *lease = StagingLease();
  NotifyWaiters();
  return st;
}

void StagingArea::Pin(const StagingLease& lease) {
  std::lock_guard<std::mutex> lock(mu_);
  cells_[lease.cell].pinned = true;
}

bool StagingArea::Charge(size_t bytes) {
  ScopedContext ctx(backend_, device_);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t before = mapped_;
  if (!MakeRoom(bytes, /*wait=*/nullptr)) return false;
  if (before > 0) (void)MakeRoom(bytes, /*wait=*/nullptr, /*limit=*/before);  // idle cells make way
  mapped_ += bytes;
  NotePeak();
  return true;
}

void StagingArea::Uncharge(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  mapped_ -= bytes;
  NotifyWaiters();
}

size_t StagingArea::Trim() {
  size_t returned = 0;
  {
    ScopedContext ctx(backend_, device_);
    std::lock_guard<std::mutex> lock(mu_);
    size_t before = mapped_;
    for (Cell& c : cells_)
      if (c.slot_id >= 0 && !c.in_use && Finished(c)) Drop(c);
    returned = before - mapped_;
  }
  Bury();  // this one's and any other's: given back when Trim returns, also those the janitor is
  std::unique_lock<std::mutex> lock(mu_);  // giving back right now
  ++waiting_;
  cv_.wait(lock, [&] { return burying_ == 0; });
  --waiting_;
  return returned;
}

void StagingArea::RetireSize(size_t nbytes, bool mark_reloads) {
  const size_t g = granularity_.load(std::memory_order_relaxed);
  if (g == 0 || Small(nbytes, g)) return;  // no cell made yet, or small cells (shared pages)
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = CellBytes(nbytes, g);  // the size Acquire gives cells of nbytes
  // One entry per size: a re-recording moves it on, to the cells made since too.
  auto it = std::find_if(retiring_.begin(), retiring_.end(), [&](const Retiring& r) { return r.size == size; });
  if (it != retiring_.end()) it->before = clock_;
  else retiring_.push_back(Retiring{size, clock_});
  if (mark_reloads) direct_left_[size] = kDirectReloads;
  retire_new_ = true;
  janitor_cv_.notify_all();
}

void StagingArea::DropRetired() {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    bool left = false;
    for (Cell& c : cells_) {
      if (c.slot_id < 0 || c.page >= 0 || c.size != it->size || c.pinned || c.last_use > it->before) continue;
      if (c.in_use || !Finished(c)) {
        left = true;  // its last user still runs: next time
        continue;
      }
      Drop(c);
    }
    it = left ? std::next(it) : retiring_.erase(it);
  }
}

void StagingArea::Janitor() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto idle = std::chrono::milliseconds(IdleMillis());
    const auto wait = retiring_.empty() ? idle : std::chrono::milliseconds(1);
    janitor_cv_.wait_for(lock, wait, [&] { return stop_ || retire_new_ || !graveyard_.empty(); });
    if (stop_) break;
    retire_new_ = false;
    if (!retiring_.empty()) {
      ScopedContext ctx(backend_, device_);  // Finished() queries the cells' events
      DropRetired();
    }
    if (!graveyard_.empty()) {
      lock.unlock();
      Bury();
      lock.lock();
    }
    if (mapped_ == 0 || std::chrono::steady_clock::now() - last_acquire_ < idle) continue;
    lock.unlock();
    Trim();
    lock.lock();
  }
}

void StagingArea::NotePeak() {
  stats_.peak_mapped_bytes = std::max<int64_t>(stats_.peak_mapped_bytes, static_cast<int64_t>(mapped_));
  stats_.window_peak_mapped_bytes = std::max<int64_t>(stats_.window_peak_mapped_bytes, static_cast<int64_t>(mapped_));
}

void StagingArea::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.window_peak_mapped_bytes = static_cast<int64_t>(mapped_);
}

StagingStats StagingArea::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StagingStats s = stats_;
  s.budget_bytes = static_cast<int64_t>(Budget());
  s.mapped_bytes = static_cast<int64_t>(mapped_);
  for (const Page& p : pages_) s.shared_pages += p.slot_id >= 0;
  for (const Cell& c : cells_) {
    if (c.slot_id < 0) continue;
    ++s.cells;
    (c.use == CellUse::kOffload ? s.offload_cells : s.reload_cells) += 1;
  }
  return s;
}

}  // namespace jaxvmm
