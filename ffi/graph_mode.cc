// Graph mode: offload/reload call sites captured into XLA command buffers (CUDA graphs).
//
// A replay runs the recorded device work and nothing else, so what a round needs from the host (a new
// ticket and its host block, which ticket a token names, whether a cell already holds it) comes from
// the poller through the channel's pinned and device words. The device never touches a cell without a
// grant, and a grant is always ordered after every copy into or out of that cell.
//
// Kernel grants (the default): a channel has K cells; a round (K > 1) is three nodes: a one-thread take
// kernel takes a cell's pre-armed grant (or knocks/requests and waits for the poller) and leaves the
// cell's address in a device word, a copy kernel copies into/out of that address, and a one-thread
// publish kernel writes the cell's filled/done word. JAXVMM_GRAPH_FUSED=1 records one fused kernel
// instead, whose first block to arrive takes and hands the cell to the other blocks, all of which then
// copy; its last block publishes.
// The poller arms each offload cell behind its own D2H (or holds it, its bytes readable on the device:
// spares all lent, or the one cell of a large call site until its next round; large call sites of the
// two directions trade their cells' pages) and prefetches the next predictions into the idle reload
// cells. Host grants (JAXVMM_GRAPH_KERNELS=0): one cell, and the host
// grants every round:
//
//   offload round (XLA's stream)          poller
//     write knock = 1                      sees knock: cell pages (within the budget), a new ticket,
//     wait  arm == 1                       token = its token; arm = 1 after the cell's last D2H
//     write arm = 0
//     copy  token_out <- token
//     copy  cell <- x
//     write filled = 1                     sees filled: D2H cell -> the ticket's host block on gd2h_
//
//   reload round (XLA's stream)
//     copy  probe <- token_in              sees request: the ticket `probe` names; go = 1 after its
//     write request = 1                    bytes are in the cell (a prefetched prediction: at once;
//     wait  go == 1                        else an H2D on gfix_), or after 0xFF for a bad token
//     write go = 0
//     copy  y <- cell
//     write done = 1                       sees done: the ticket is consumed; prefetch the next guess
//
// Nothing here runs on a capturing thread except the Captured* enqueues (no allocation there: the
// channel and its reserved cells were made by the initialize stage). DESIGN.md, "Graph mode".
#include <algorithm>
#include <cstdio>

#include "graph_mode.h"

#include "config.h"
#include "registry.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

// How long the poller keeps spinning after the last round or initialize before it sleeps.
constexpr auto kSpin = std::chrono::milliseconds(50);

}  // namespace

// ---------------------------------------------------------------- lifetime

GraphMode::GraphMode(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, Transfers& transfers,
                     GraphKernels& kernels)
    : backend_(b), xla_in_order_(EngineConfig::XlaKeepsCommandOrder()), device_(device), ledger_(ledger),
      host_store_(host), staging_(staging), transfers_(transfers), channels_(b, device), round_host_(b, device, host),
      kernels_(kernels), recorder_(b, device, kernels) {}

Status GraphMode::Init() {
  const DriverTable& d = Driver(backend_);
  for (CUstream* s : {&gd2h_, &gh2d_, &garm_, &gfix_})
    JAXVMM_RETURN_IF_ERROR(Call(-1, "engine init", Entry::kStreamCreateWithPriority,
                                [&] { return d.StreamCreateWithPriority(s, CU_STREAM_NON_BLOCKING, 0); }));
  return round_host_.Init();
}

GraphMode::~GraphMode() {
  ScopedContext ctx(backend_, device_);  // a member: the engine's own context is gone by now
  const DriverTable& d = Driver(backend_);
  for (CUstream s : {gd2h_, gh2d_, garm_, gfix_})
    if (s) GiveBack("graph mode teardown", Entry::kStreamDestroy, [&] { return d.StreamDestroy(s); });
}

void GraphMode::WakePoller() {
  // Caller holds mu_.
  awake_until_ = std::max(awake_until_, std::chrono::steady_clock::now() + kSpin);
  // Started by the first capture, or by the first cell an initialize stage mapped: a site XLA never
  // captures (a program too small for a command buffer) must still get its pages back when idle.
  if ((any_captured_ || stats_.mapped_bytes > 0) && !poller_.joinable()) poller_ = std::thread([this] { Poll(); });
  poll_cv_.notify_one();
}

// ---------------------------------------------------------------- the initialize stage

Status GraphMode::Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta, bool readers_can_bounce) {
  if (meta.nbytes == 0) return Status();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.prepares;
  Channel* c = nullptr;
  bool created = false;
  const bool first = !kernels_.tried() && channels_.size() == 0;
  JAXVMM_RETURN_IF_ERROR(channels_.GetOrCreate(site, kind, meta, &c, &created));
  recorder_.PrepareKernels(gd2h_, *c, first, any_captured_);
  // Round tickets the pinned pool has no room for go to pageable memory, copied through bounce buffers
  // made here; without them such a round fails instead.
  round_host_.Prepare(readers_can_bounce);
  if (created && kind == ChannelKind::kOffload) {
    // Pinned room for a new site's first rounds, made here (XLA's thread, before any round waits): the
    // poller only carves from the pool (RoundHostSupply::Allocate), and a fresh pool has nothing to carve. Over
    // the host pool's limit this fails and the rounds fall back as they would; later growth is the
    // grower's (once per site: an initialize stage runs for every execution).
    round_host_.Reserve(static_cast<size_t>(EngineConfig::GraphCells() + 1) * meta.nbytes);
  }
  c->stream = stream;
  if (c->ncells == 0) JAXVMM_RETURN_IF_ERROR(recorder_.ReserveCells(gd2h_, *c, meta, kind));
  if (created) ++stats_.channels;
  // XLA records a command buffer on the call site's second execution (the first is a warm-up): give
  // cell 0 pages before then (host grants: the capture names it; kernel grants: the first round's grant
  // needs no mapping). Later the poller maps on demand.
  // (Within the budget's free room and on the device only: no round waits for it yet, so a full device
  // is left to the capture, which must have pages and takes host pages if it has to.)
  // Not for call sites that trade pages (large arrays, one cell): their capture names no cell, and
  // pages mapped here would sit idle through the first execution (whose ops run on the op ring, with
  // staging cells of their own): on the H200 that first execution was the run's device peak, one
  // activation above every later step. Their first round maps (or takes) its pages when it comes.
  if (!c->captured && ++c->prepares <= 2 && !c->trades) (void)MapCell(*c, 0, /*evict=*/false);
  c->last_use = std::chrono::steady_clock::now();  // idle from now on until a round or a capture
  WakePoller();
  return Status();
}

Status GraphMode::CaptureChannel(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out) {
  // Caller holds mu_. The channel the initialize stage prepared; a re-recording (XLA saw new
  // buffer addresses) may find its cell idle and returned: map it again so the capture names mapped
  // memory (page calls, not stream work).
  const char* what = kind == ChannelKind::kOffload ? "offload" : "reload";
  Channel* c = channels_.Find(site, kind, meta);
  if (!c || c->ncells == 0)
    return Status(Code::kInternal, std::string(what) + " call site " + std::to_string(site) +
                                       " is being captured into a command buffer but its initialize stage never ran");
  // Host grants and one cell record copies that name cell 0. K > 1 cells record no cell address: the
  // device finds a cell through its grant, and the poller maps a cell before it grants it.
  if ((!recorder_.use_kernels() || c->FixedCell()) && !c->cells[0].mapped && !MapCell(*c, 0))
    return Status(Code::kOutOfMemory, "graph-mode cell of call site " + std::to_string(site) +
                                          " could not be mapped for capture within the staging budget");
  *out = c;
  return Status();
}

void GraphMode::Recorded(Channel& c) {
  // Caller holds mu_: the channel's device work is in a graph now; its rounds need the poller.
  const bool first = !c.captured;
  c.captured = any_captured_ = true;
  ++stats_.captures;
  // The op ring's cells of this size served its uncaptured runs. Only a first recording marks the size
  // for reloads: XLA re-records a command buffer whose buffers moved, and a mark set again at every
  // step would send a program's uncaptured reloads of that size past their prefetch every step.
  staging_.RetireSize(c.cell_size, /*mark_reloads=*/first);
  WakePoller();
}

Status GraphMode::CapturedOffload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out) {
  std::lock_guard<std::mutex> lock(mu_);
  Channel* c = nullptr;
  JAXVMM_RETURN_IF_ERROR(CaptureChannel(site, ChannelKind::kOffload, meta, &c));
  JAXVMM_RETURN_IF_ERROR(recorder_.RecordOffload(stream, *c, src, meta.nbytes, token_out));
  Recorded(*c);
  return Status();
}

Status GraphMode::CapturedReload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta) {
  std::lock_guard<std::mutex> lock(mu_);
  Channel* c = nullptr;
  JAXVMM_RETURN_IF_ERROR(CaptureChannel(site, ChannelKind::kReload, meta, &c));
  JAXVMM_RETURN_IF_ERROR(recorder_.RecordReload(stream, *c, token_in, dst, meta.nbytes));
  Recorded(*c);
  return Status();
}

Status GraphMode::CapturedPrefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out) {
  return recorder_.RecordPrefetch(stream, token_in, token_out);  // no channel state: no lock
}

// ---------------------------------------------------------------- the poller

void GraphMode::Poll() {
  ScopedContext ctx(backend_, device_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!poll_stop_) {
    if (poll_paused_) {
      poll_cv_.wait_for(lock, std::chrono::milliseconds(1));
      continue;
    }
    bool busy = false;
    // Offloads first: a reload's token may name a ticket whose `filled` arrived in the same pass.
    channels_.ForEach([&](Channel& c) {
      if (c.kind == ChannelKind::kOffload) busy |= recorder_.use_kernels() ? ServiceOffloadK(c) : ServiceOffload(c);
    });
    channels_.ForEach([&](Channel& c) {
      if (c.kind == ChannelKind::kReload) busy |= recorder_.use_kernels() ? ServiceReloadK(c) : ServiceReload(c);
    });
    busy |= ReapOffloads();
    busy |= ReleaseLentReads();
    busy |= ReturnSpares();
    DropStaleGuesses();
    ReleaseUnpins(/*all=*/false);
    const auto now = std::chrono::steady_clock::now();
    if (busy) awake_until_ = std::max(awake_until_, now + kSpin);
    ReleaseIdleCells(/*now=*/false);
    if (now < awake_until_) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    } else {
      poll_cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
  }
}

bool GraphMode::CopyPending(const Cell& cell, CUstream except) const {
  return cell.stream && cell.stream != except && Driver(backend_).EventQuery(cell.event) != CUDA_SUCCESS;
}

bool GraphMode::ReadByD2h(Cell& cell) {
  if (cell.d2h_reads && transfers_.ClockReached(cell.d2h_reads)) cell.d2h_reads = 0;
  return cell.d2h_reads != 0;
}

bool GraphMode::MapCell(Channel& c, int i, bool evict) {
  Cell& cell = c.cells[i];
  if (cell.mapped) return true;
  if (c.trades && TakeIdlePages(c, i)) return true;  // the other direction's idle pages: no new ones
  if (!staging_.Charge(c.cell_size)) {
    if (!evict) return false;
    ReleaseIdleCells(/*now=*/true);  // other channels' idle cells first
    if (!staging_.Charge(c.cell_size)) return false;
  }
  Status st = Registry::Get().Remap(cell.slot_id);
  if (st.code() == Code::kOutOfMemory && evict) {  // (a cell armed ahead, with no round waiting, just waits)
    // The device is full (XLA's buffers, other processes). A round may be waiting for this cell on the
    // device, and the memory it needs may be freed only by that very program: waiting could be
    // forever. Other channels' idle cells first, then host pages at the same VA (the copies into and
    // out of the cell cross PCIe; the pages go back when the channel is idle, as device pages do).
    ReleaseIdleCells(/*now=*/true, /*device_only=*/true);
    st = Registry::Get().Remap(cell.slot_id);
    Location host;
    if (st.code() == Code::kOutOfMemory && HostNumaLocation(backend_, device_, &host).ok()) {
      Status hs = Registry::Get().RemapAt(cell.slot_id, host);
      if (hs.ok()) {
        std::fprintf(stderr, "jaxvmm: graph-mode cell of call site %lld (%zu bytes) mapped with host pages: the device is out of memory (%s)\n",
                     static_cast<long long>(c.site), c.cell_size, st.ToString().c_str());
        cell.host_pages = true;
        ++stats_.host_cells;
        st = hs;
      }
    }
  }
  if (!st.ok()) {
    staging_.Uncharge(c.cell_size);
    if (evict && c.map_failures++ == 0) ledger_.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode cell; retrying)"));
    return false;
  }
  c.map_failures = 0;
  Mapped(c, &cell);
  return true;
}

void GraphMode::Mapped(const Channel& c, CellPages* p) {
  p->mapped = true;
  stats_.mapped_bytes += static_cast<int64_t>(c.cell_size);
  ++stats_.pages_mapped;
}

void GraphMode::UnmapCell(Channel& c, int i) {
  c.cells[i].holds.reset();  // new pages hold nobody's bytes
  UnmapPages(c, &c.cells[i], "graph-mode cell kept");
}

void GraphMode::UnmapPages(Channel& c, CellPages* p, const char* kept) {
  // A cell's or a spare's pages back to the driver, uncharged from the budget.
  if (!p->mapped) return;
  Status st = Registry::Get().Release(p->slot_id);
  if (!st.ok()) {
    std::fprintf(stderr, "%s (%s)\n", st.ToString().c_str(), kept);
    return;
  }
  p->mapped = false;
  p->host_pages = false;
  staging_.Uncharge(c.cell_size);
  stats_.mapped_bytes -= static_cast<int64_t>(c.cell_size);
  ++stats_.pages_returned;
}

void GraphMode::Unload(const Held& h, Channel& c, int i) {
  // Caller holds mu_ and the ledger's lock (h). The guess's pin outlives the cell's last copy (its prefetch reads the
  // ticket's host block or device copy): while that copy may still run, the pin waits in unpin_after_.
  Cell& cell = c.cells[i];
  if (!cell.loaded) return;
  if (cell.loaded->claimed_by == c.Claim()) cell.loaded->claimed_by = 0;
  if (cell.stream && cell.event && Driver(backend_).EventQuery(cell.event) == CUDA_ERROR_NOT_READY) {
    unpin_after_.emplace_back(cell.event, std::move(cell.loaded));
    cell.loaded.reset();
    return;
  }
  cell.loaded->pins -= 1;
  ledger_.Retire(h, cell.loaded);
  cell.loaded.reset();
}

size_t GraphMode::ReleaseIdleCells(bool now, bool device_only) {
  const auto t = std::chrono::steady_clock::now();
  const auto idle = std::chrono::milliseconds(StagingArea::IdleMillis());
  size_t released = 0;
  channels_.ForEach([&](Channel& c) {
    if (!now && t - c.last_use < idle) return;
    // Free spares first, also a waiting channel's own: nothing waits for a spare, and the round that
    // waits may need exactly the room (or the device pages) its free spares hold.
    for (Spare& sp : c.spares) {
      if (!sp.mapped || sp.lent || (device_only && sp.host_pages)) continue;
      {
        Held h = ledger_.Lock();
        if (!Forget(h, sp)) continue;  // a reload still copies the bytes it keeps
      }
      UnmapSpare(c, sp);
      if (!sp.mapped) released += c.cell_size;
    }
    if (c.waiting) return;
    for (int i = 0; i < c.ncells; ++i) {
      Cell& cell = c.cells[i];
      if (!cell.mapped || cell.round == Channel::Round::kGranted || (device_only && cell.host_pages)) continue;
      if (ReadByD2h(cell)) continue;  // a D2H still reads its pages (their guess stays armed)
      if (cell.read_into && CopyPending(*cell.read_into)) continue;  // a reload's copy still reads them
      cell.read_into = nullptr;
      if (cell.round == Channel::Round::kArmed && !Revoke(c, i)) continue;  // the device took the grant: its round is live
      if (CopyPending(cell)) continue;  // a copy still uses it (a held cell's D2H)
      {
        Held h = ledger_.Lock();
        if (!Unhold(h, cell)) continue;  // a reload's copy still reads its bytes
        Unload(h, c, i);
      }
      UnmapCell(c, i);
      if (!cell.mapped) released += c.cell_size;
    }
  });
  return released;
}

void GraphMode::Grant(std::atomic<uint64_t>* word, Channel& c, int i, uint64_t value) {
  // The device may go on once every copy into (or out of) cell i has finished: at once when the last
  // one already has, else by a write ordered after it on its stream.
  const DriverTable& d = Driver(backend_);
  Cell& cell = c.cells[i];
  if (CopyPending(cell)) {
    Status st = Call(-1, "graph grant", Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(cell.stream, WordAddr(*word), value, 0); });
    if (st.ok()) return;
    d.StreamSynchronize(cell.stream);
  }
  word->store(value, std::memory_order_seq_cst);
}

std::shared_ptr<Ticket> GraphMode::MakeRoundTicket(const Channel& c, uint64_t token, Status* st) {
  // A graph-mode offload round's ticket, with its host block (its D2H completion is a gd2h_ sequence number): a new token (0), or
  // the reserved token the device took (kernel grants). Null, and *st says why, when it cannot be made.
  HostBlock host;
  *st = round_host_.Allocate(c.meta.nbytes, &host).At(-1, "offload (graph)");
  Held h = ledger_.Lock();
  if (token) ledger_.Disarm(h, token);  // from now on its ticket (or its absence) speaks for it
  std::shared_ptr<Ticket> t;
  if (st->ok()) {
    t = token ? ledger_.tickets(h).Create(c.meta, token) : ledger_.tickets(h).Create(c.meta);
    if (!t) *st = Status(Code::kInternal, TokenStr(token) + " was taken by another ticket before its round ended");
  }
  if (t) {
    t->offload_seq = ledger_.issued(h);
    t->host = host;
    t->graph_round = true;
    ++ledger_.counts(h).offloads;
  } else if (host.ptr) {
    host_store_.Free(host);
  }
  return t;
}

Status GraphMode::CopyOutOfCell(Channel& c, int i, const std::shared_ptr<Ticket>& t) {
  // The round's bytes, D2H out of cell i into t's host block on gd2h_: t is reloadable once that is
  // enqueued. A failure drops t (its bytes never reached the host: a reload of it fails).
  const DriverTable& d = Driver(backend_);
  const char* stage = "offload (graph)";
  Cell& cell = c.cells[i];
  // Pageable memory goes through the bounce buffers (their D2H waits for copies already on gd2h_,
  // which waits for nothing of XLA's): the bytes are on the host when it returns.
  Status st = t->host.pageable ? round_host_.bounce().ToHost(gd2h_, t->host.ptr, cell.addr, c.meta.nbytes, stage)
                               : transfers_.CopyToHost(gd2h_, t->host, cell.addr, c.meta.nbytes, stage);
  const uint64_t seq = gd2h_issued_ + 1;  // gd2h_ runs in order: its word passing seq means this D2H is done
  if (st.ok()) st = WriteDeviceWord(backend_, gd2h_, transfers_.graph_clock_address(), seq, stage);
  if (st.ok()) {
    gd2h_issued_ = seq;
    t->d2h_seq = seq;
  }
  if (st.ok()) st = Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gd2h_); });
  cell.stream = gd2h_;
  Held h = ledger_.Lock();
  if (st.ok()) {
    t->enqueued = true;
    round_d2h_.push_back(t);
  } else {
    d.StreamSynchronize(gd2h_);
    t->on_host = t->dropped = true;
    ledger_.Retire(h, t);
  }
  return st;
}

void GraphMode::RecordOffloadError(const Channel& c, const Status& st) {
  ledger_.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode offload of call site " + std::to_string(c.site) + ")"));
}

bool GraphMode::ServiceOffload(Channel& c) {
  // Host grants: one cell.
  ChannelWords& w = *c.w;
  Cell& cell = c.cells[0];
  bool busy = false;
  if (w.filled[0].load(std::memory_order_acquire) == 1) {
    // The device copied x into the cell and handed out the round's token: D2H it on gd2h_.
    w.filled[0].store(0, std::memory_order_relaxed);
    busy = true;
    std::shared_ptr<Ticket> t = std::move(cell.ticket);
    cell.ticket.reset();
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++stats_.offload_rounds;
    if (t) {
      Status st = CopyOutOfCell(c, 0, t);
      if (!st.ok()) RecordOffloadError(c, st);
    }
  }
  // A round waits for its grant. Only one grant is outstanding at a time: a knock that arrives while
  // a grant is unused (its round never reached the device) is served by that grant.
  if (cell.round == Channel::Round::kIdle && (c.waiting || w.knock.load(std::memory_order_acquire) == 1)) {
    if (!c.waiting) w.knock.store(0, std::memory_order_relaxed);
    c.waiting = true;
    busy = true;
    if (!MapCell(c, 0)) return busy;  // no room in the staging budget yet: the next pass retries
    Status st;
    std::shared_ptr<Ticket> t = MakeRoundTicket(c, /*token=*/0, &st);
    // Without one the round hands out token 0, which no ticket has: its reload fills 0xFF and reports.
    if (!t) RecordOffloadError(c, st);
    w.token.store(t ? t->token : 0, std::memory_order_relaxed);
    cell.ticket = t;
    c.waiting = false;
    cell.round = Channel::Round::kGranted;
    c.last_use = std::chrono::steady_clock::now();
    Grant(&w.arm, c, 0);  // after the cell's previous D2H
  }
  return busy;
}

bool GraphMode::ReapOffloads() {
  if (round_d2h_.empty()) return false;
  bool busy = false;
  Held h = ledger_.Lock();
  for (auto it = round_d2h_.begin(); it != round_d2h_.end();) {
    Ticket& t = **it;
    if (!transfers_.D2hDone(t)) {
      ++it;
      continue;
    }
    t.on_host = true;
    ledger_.Retire(h, *it);
    it = round_d2h_.erase(it);
    busy = true;
  }
  return busy;
}

void GraphMode::PrefetchInto(Channel& c) {
  // A round of the channel ended: fill each idle cell with a ticket a next round will most likely name
  // (the next predictions, each claimed by the channel so the next cell gets the one after), so their
  // grants need no copy on the device's path. Cells other than the one just freed are mapped only
  // within the budget as it is (no other channel's cell is returned for a guess).
  // Only a ticket whose bytes can be copied without waiting on XLA's streams: a graph round's (its D2H
  // on gd2h_ only follows its own round), or a ring-path one whose D2H already finished. A ring-path
  // D2H waits for an event of XLA's stream; a ticket offloaded *after* this channel's next round (the
  // next program, enqueued behind this one) would hold the cell, and the next round's request waits
  // for the cell's copies: the device would wait for itself.
  auto usable = [&](const Ticket& t) {
    return t.graph_round || t.on_host || transfers_.D2hDone(t);
  };
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kIdle || cell.loaded) continue;
    if (CopyPending(cell, gh2d_)) continue;  // a correction/0xFF still runs
    if (!cell.mapped) {
      {
        Held h = ledger_.Lock();
        if (!ledger_.tickets(h).Predict(c.meta, usable)) return;  // nothing to guess: no pages for it
      }
      if (!recorder_.use_kernels() || !MapCell(c, i, /*evict=*/false)) continue;
    }
    Source src;
    {
      Held h = ledger_.Lock();
      std::shared_ptr<Ticket> t = ledger_.tickets(h).Predict(c.meta, usable);
      if (!t) return;
      t->claimed_by = c.Claim();
      t->pins += 1;
      cell.loaded = t;
      src = RoundSourceOf(*t);
    }
    if (!LoadGuess(c, i, src, gh2d_, "reload prefetch (graph)")) return;
  }
}

bool GraphMode::LoadGuess(Channel& c, int i, const Source& src, CUstream s, const char* stage, bool* copied) {
  const DriverTable& d = Driver(backend_);
  Cell& cell = c.cells[i];
  Status st = transfers_.CopyTicket(s, src, cell.addr, c.meta.nbytes, round_host_.bounce(), stage);
  if (copied) *copied = st.ok();
  bool armed = false;
  if (st.ok() && recorder_.use_kernels()) {
    // The device's grant: grant[i] names the token only once its bytes are in the cell (stream
    // order, and the write's default memory barrier makes the copy visible first).
    st = WriteDeviceWord(backend_, s, c.Grant(i), cell.loaded->token, stage);
    armed = st.ok();
  }
  if (st.ok()) st = Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(cell.event, s); });
  cell.stream = s;
  WatchLentRead(src, cell.loaded, cell.event);
  if (armed) {
    cell.round = Channel::Round::kArmed;
    cell.host_grant = false;
    cell.grant_stream = s;  // a revoke runs behind the grant's write
  }
  if (st.ok()) return true;
  d.StreamSynchronize(s);
  cell.stream = nullptr;  // nothing runs on the cell any more
  if (!armed) {
    Held h = ledger_.Lock();
    Unload(h, c, i);  // a hint: the request copies what it needs
  }
  return false;
}

Cell* GraphMode::CellHolding(const std::shared_ptr<Ticket>& t, size_t cell_size, CUstream stream) {
  // Caller holds mu_. Small call sites only (no spares, no page trades): their cells' bytes change only
  // when a round fills them or their pages go, both of which clear or replace `holds`. And only call
  // sites whose rounds run on `stream` (XLA's, where the waiting round is): their next round cannot
  // start before that round's go. That is stream order, which XLA does not keep under CONCURRENT
  // command-buffer scheduling (an offload round with no data from the waiting reload may run beside
  // it and refill the cell): then no offload cell is read.
  if (!xla_in_order_) return nullptr;
  Cell* found = nullptr;
  channels_.ForEach([&](Channel& o) {
    if (found || o.kind != ChannelKind::kOffload || o.cell_size != cell_size || !o.spares.empty() || o.trades) return;
    if (o.stream != stream) return;  // another stream's rounds could run beside the waiting one
    for (int i = 0; i < o.ncells && !found; ++i) {
      Cell& cell = o.cells[i];
      // filled[i] set: a later round refilled the cell and is not served yet (`holds` is behind).
      if (cell.mapped && cell.holds.lock() == t && o.w->filled[i].load(std::memory_order_acquire) == 0) found = &cell;
    }
  });
  return found;
}

bool GraphMode::StageHeldGuesses(Channel& c, int busy) {
  // Caller holds mu_. Like PrefetchInto, but only for guesses an offload cell still holds, and on gfix_
  // ahead of the waiting round's go (the backward's second reload then finds its bytes at once instead
  // of waiting for the prefetch its first reload's end starts). A guess that is not on the device is
  // left to PrefetchInto.
  bool staged = false;
  for (int k = 0; k < c.ncells; ++k) {
    Cell& cell = c.cells[k];
    if (k == busy || cell.round != Channel::Round::kIdle || cell.loaded) continue;
    if (CopyPending(cell, gfix_)) continue;  // a prefetch on gh2d_ still runs
    auto next = [&](const Held& h, Cell** from) {
      std::shared_ptr<Ticket> t = ledger_.tickets(h).Predict(c.meta, [](const Ticket& x) { return x.graph_round; });
      return t && (*from = CellHolding(t, c.cell_size, c.stream)) ? t : nullptr;
    };
    std::shared_ptr<Ticket> t;
    Cell* from = nullptr;
    if (!cell.mapped) {  // pages for a guess there is (within the budget as it is)
      {
        Held h = ledger_.Lock();
        if (!next(h, &from)) return staged;
      }
      if (!MapCell(c, k, /*evict=*/false)) continue;
    }
    {
      Held h = ledger_.Lock();
      if (!(t = next(h, &from))) return staged;
      t->claimed_by = c.Claim();
      t->pins += 1;
      cell.loaded = t;
    }
    Source src;
    src.resident = from->addr;
    staged = true;  // (a copy may have been enqueued even when it failed)
    from->read_into = &cell;
    bool copied = false;
    const bool ok = LoadGuess(c, k, src, gfix_, "reload guess (graph)", &copied);
    if (copied) ++stats_.cell_reads;
    if (!ok) return staged;
  }
  return staged;
}

void GraphMode::FillInvalid(Channel& c, int i) {
  const DriverTable& d = Driver(backend_);
  Cell& cell = c.cells[i];
  Status st;
  if (cell.stream && cell.stream != gfix_)
    st = Call(-1, "reload (graph)", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(gfix_, cell.event, 0); });
  if (st.ok()) st = Call(-1, "reload (graph)", Entry::kMemsetD8Async, [&] { return d.MemsetD8Async(cell.addr, 0xFF, c.meta.nbytes, gfix_); });
  if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gfix_); });
  cell.stream = gfix_;
  if (!st.ok()) {
    d.StreamSynchronize(gfix_);
    d.StreamSynchronize(gh2d_);
    cell.stream = nullptr;
    ledger_.Report(c.stream, st);
  }
}

std::shared_ptr<Ticket> GraphMode::FindForRound(const Held& h, const Channel& c, uint64_t token, std::string* why) {
  // Caller holds the ledger's lock (h). The ticket a reload round's probed token names, if it is one this call site can
  // reload (same size and signature).
  std::shared_ptr<Ticket> a = ledger_.tickets(h).Find(token, why);
  if (a && (a->meta.nbytes != c.meta.nbytes || a->meta.signature != c.meta.signature)) {
    *why = TokenStr(token) + " holds " + std::to_string(a->meta.nbytes) + " bytes of another shape/dtype than the reload expects (" +
           std::to_string(c.meta.nbytes) + " bytes)";
    return nullptr;
  }
  return a;
}

bool GraphMode::TakeForRound(const Held& h, Channel& c, int i, const std::shared_ptr<Ticket>& a, Source* src) {
  // Caller holds mu_ and the ledger's lock (h). The round consumes `a` (null: a bad token) in cell i: a hit when it is the
  // prediction cell i already holds (its pin passes to the round), else cell i's prediction is dropped
  // and *src says where the correction copies from.
  Cell& cell = c.cells[i];
  const bool hit = a && a == cell.loaded;
  if (a) {
    MarkReloaded(*a);
    if (hit) {
      if (a->claimed_by == c.Claim()) a->claimed_by = 0;
      cell.loaded.reset();
    } else {
      if (a->claimed_by != 0) ledger_.MarkStale(h);  // another cell holds it as a guess
      a->pins += 1;
      bool guessed = false;
      for (int j = 0; j < c.ncells; ++j) guessed |= c.cells[j].loaded != nullptr;
      if (guessed) ledger_.tickets(h).Learn(a, c.meta.signature);
      Unload(h, c, i);
      *src = RoundSourceOf(*a);
    }
  } else {
    Unload(h, c, i);
  }
  return hit;
}

bool GraphMode::ServiceReload(Channel& c) {
  // Host grants: one cell.
  ChannelWords& w = *c.w;
  Cell& cell = c.cells[0];
  const DriverTable& d = Driver(backend_);
  bool busy = false;
  if (w.done[0].load(std::memory_order_acquire) == 1) {
    // The device copied the cell out: the round's ticket is consumed and the cell is free.
    w.done[0].store(0, std::memory_order_relaxed);
    busy = true;
    {
      Held h = ledger_.Lock();
      if (cell.ticket) {
        ++ledger_.counts(h).reloads;  // a ticket's bytes reached XLA's buffer (a 0xFF round had no ticket)
        cell.ticket->pins -= 1;
        ledger_.Retire(h, cell.ticket);
        cell.ticket.reset();
      }
    }
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++stats_.reload_rounds;
    PrefetchInto(c);
  }
  if (cell.round == Channel::Round::kIdle && (c.waiting || w.request.load(std::memory_order_acquire) == 1)) {
    if (!c.waiting) w.request.store(0, std::memory_order_relaxed);
    c.waiting = true;
    busy = true;
    if (!MapCell(c, 0)) return busy;
    const uint64_t token = w.probe.load(std::memory_order_acquire);
    std::string why;
    Source src;
    bool hit = false;
    std::shared_ptr<Ticket> a;
    {
      Held h = ledger_.Lock();
      a = FindForRound(h, c, token, &why);
      // Its offload's `filled` is not served yet (it precedes this request on the device, so the
      // next pass serves it): its bytes are not on their way to the host yet.
      if (a && !a->enqueued) return busy;
      hit = TakeForRound(h, c, 0, a, &src);
    }
    cell.ticket = a;
    c.waiting = false;
    cell.round = Channel::Round::kGranted;
    c.last_use = std::chrono::steady_clock::now();
    if (hit) {
      ++stats_.hits;
      Grant(&w.go, c, 0);  // after the prefetch copy
      return busy;
    }
    ++stats_.misses;
    if (!a) {
      ledger_.Report(c.stream, Status(Code::kInvalidArgument, "reload (graph-mode call site " + std::to_string(c.site) + "): " + why +
                                                            "; the output was filled with 0xFF bytes"));
      FillInvalid(c, 0);
      Grant(&w.go, c, 0);
      return busy;
    }
    // A correction on gfix_, after any copy still running into the cell (a prefetch of another guess).
    Status st;
    if (cell.stream && cell.stream != gfix_)
      st = Call(-1, "reload (graph)", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(gfix_, cell.event, 0); });
    if (st.ok()) st = transfers_.CopyTicket(gfix_, src, cell.addr, c.meta.nbytes, round_host_.bounce(), "reload (graph)");
    if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gfix_); });
    cell.stream = gfix_;
    WatchLentRead(src, a, cell.event);
    if (!st.ok()) {
      ledger_.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode reload of " + TokenStr(token) + " failed; the output was filled with 0xFF bytes)"));
      FillInvalid(c, 0);
    }
    Grant(&w.go, c, 0);
  }
  return busy;
}

// ---------------------------------------------------------------- kernel grants
//
// The device takes its grant by itself (graph_kernels.cu): an offload round takes a token the poller
// pre-armed in one of the channel's K cells right after that cell's previous D2H; a reload round takes
// the cell whose grant names the probed token. The host is on the device's path only when there is no
// grant (first round, after a revocation, a mispredicted reload): then the device knocks / requests and
// waits, as in the host-granted protocol.

bool GraphMode::Arm(Channel& c, int i, bool host, bool settled) {
  // Every copy out of an offload cell runs on gd2h_, so a write on gd2h_ is ordered after the last one.
  // gd2h_/gh2d_ never wait on XLA's streams (unlike the op ring's d2h/h2d): a grant written there
  // cannot queue behind work that waits for the very round the grant releases.
  Cell& cell = c.cells[i];
  // PCIe is behind the device: as many graph D2Hs are queued as the channel has cells, so the next round
  // of this cell would wait for its D2H. Swap in a free spare instead (its pages hold no copy, so garm_
  // has none to follow). A shorter queue is what K cells absorb: no spare is taken for it.
  // With every spare lent, the cell is held instead (Round::kHeld): armed behind its D2H, at the end of
  // the queue, its bytes would be out of reach of the reloads that come first (the backward's first
  // layers) until the whole queue has drained.
  const bool behind = gd2h_issued_ - transfers_.graph_clock()->load(std::memory_order_acquire) >= static_cast<uint64_t>(c.ncells);
  bool lent = false;
  if (cell.draining && !c.spares.empty() && behind && !transfers_.D2hDone(*cell.draining)) {
    lent = Lend(c, i);
    if (!lent) {
      Hold(c, i, host, /*until_knock=*/false);
      return false;
    }
  }
  // The one cell of a large call site is held until its next round knocks (GraphHold::kLarge): after
  // the forward's last round no round comes, and the backward's first reload, of exactly these bytes,
  // copies them device to device instead of waiting for the D2H and an H2D of a large array. A knock
  // costs the next round a poller round trip, small beside the compute that makes such an array.
  if (!lent && cell.draining && HoldsUntilKnock(c)) {
    Hold(c, i, host, /*until_knock=*/true);
    return false;
  }
  // gd2h_ orders the grant after the cell's D2H; new pages (a lend) or a settled cell (no copy out of
  // it pending: its D2H done, its event complete) need no order, and garm_ does not queue the grant
  // behind other cells' D2Hs.
  if (!lent && !settled && (!cell.draining || transfers_.D2hDone(*cell.draining)))
    settled = !CopyPending(cell);
  cell.draining.reset();
  CUstream s = lent || settled ? garm_ : gd2h_;
  const uint64_t token = ledger_.ArmToken();  // armed before the device can take it (WaitUntilServed)
  Status st = WriteDeviceWord(backend_, s, c.Grant(i), token, "offload grant (graph)");
  if (!st.ok()) {
    // A retry may write its grant on gd2h_: the new address (on garm_) must be in place before it.
    if (lent) Driver(backend_).StreamSynchronize(garm_);
    {
      Held h = ledger_.Lock();
      ledger_.Disarm(h, token);
    }
    ledger_.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode grant of call site " + std::to_string(c.site) + "; retrying)"));
    return false;
  }
  cell.grant_token = token;
  cell.host_grant = host;
  cell.grant_stream = s;
  cell.round = Channel::Round::kArmed;
  return true;
}

bool GraphMode::HoldsUntilKnock(const Channel& c) {
  return EngineConfig::GraphHoldPolicy() == EngineConfig::GraphHold::kLarge && c.ncells == 1 && c.meta.nbytes > kMultiCellBytes;
}

void GraphMode::Hold(Channel& c, int i, bool host, bool until_knock) {
  // Caller holds mu_. Cell i keeps its draining ticket's bytes, readable device to device, until
  // ServeHeld arms it (or lets it go idle: the ticket consumed or dropped).
  Cell& cell = c.cells[i];
  cell.until_knock = until_knock;
  {
    Held h = ledger_.Lock();
    cell.draining->lent_cell = cell.addr;
  }
  cell.host_grant = host;
  cell.round = Channel::Round::kHeld;
  ++stats_.holds;
}

bool GraphMode::Unhold(const Held& h, Cell& cell) {
  // Caller holds mu_ and the ledger's lock (h). A held cell's bytes stop being readable, unless a copy
  // out of the cell still runs (false).
  (void)h;
  if (cell.round != Channel::Round::kHeld) return true;
  if (cell.draining->lent_readers > 0) return false;
  if (cell.draining->lent_cell == cell.addr) cell.draining->lent_cell = 0;
  // The cell no longer stands for that ticket: a later Arm must not hold it again for the ticket (its
  // pages may be returned and the cell mapped anew, with other bytes).
  cell.draining.reset();
  cell.until_knock = false;
  cell.round = Channel::Round::kIdle;
  return true;
}

bool GraphMode::ServeHeld(Channel& c) {
  // Caller holds mu_. A held cell is armed once a mapped spare is free to take its bytes (Lend moves
  // them, and the ticket's lent_cell, into the spare: the newest bytes stay readable, in place of the
  // oldest a spare kept), or else once its D2H is done and no copy reads it (on garm_: no copy of its
  // is pending). No new spare is mapped here: that is tried once, when the cell is armed after its
  // round, not on every pass. A cell held until a knock waits for one first (the device holds `knock`
  // while its round waits; c.waiting once a pass saw it), or goes idle unarmed once nothing can read its
  // bytes (below).
  bool busy = false;
  const bool knocked = c.waiting || c.w->knock.load(std::memory_order_acquire) == 1;
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kHeld) continue;
    if (cell.until_knock && !knocked) {
      // Nothing reads its bytes any more (the ticket was reloaded elsewhere and is not kept, or it was
      // dropped) once its D2H is done: the cell goes idle, unarmed (no busy: nothing arms it before a
      // knock), so that the partner call site's next round takes its pages (TakeIdlePages) instead of
      // mapping its own. (A scan's first backward iteration runs uncaptured and reloads the forward's
      // last offload through the op ring: that cell stayed held, and the reload call site's first
      // round mapped a second cell beside it.)
      if (!transfers_.D2hDone(*cell.draining)) continue;  // (no ledger lock for that: the clock's word)
      Held h = ledger_.Lock();
      if (cell.draining->consumed || cell.draining->dropped) (void)Unhold(h, cell);
      continue;
    }
    const bool host = cell.host_grant || cell.until_knock;  // a grant that answers a knock is the host's
    if (Lend(c, i, /*may_map=*/false)) {
      cell.round = Channel::Round::kIdle;
      cell.until_knock = false;
    } else {
      Held h = ledger_.Lock();
      if (!transfers_.D2hDone(*cell.draining) || !Unhold(h, cell)) continue;
    }
    busy = true;
    (void)Arm(c, i, host, /*settled=*/true);
  }
  return busy;
}

bool GraphMode::Lend(Channel& c, int i, bool may_map) {
  // Caller holds mu_. Cell i's pages (with the bytes its D2H still reads) go to a free spare, lent
  // to the ticket until that D2H is done; the cell takes the spare's pages and VA, and the device word
  // naming cell i's address changes on garm_, where the grant that follows is written.
  Cell& cell = c.cells[i];
  // A free spare, in this order: a mapped one that keeps no ticket's bytes; the mapped one freed longest
  // ago (the backward reads the newest offloads first), never one a reload still reads; a new mapping.
  // So the spares mapped are as many as were lent at once (the D2H backlog), not graph_spares.
  Spare* sp = nullptr;
  {
    Held h = ledger_.Lock();
    for (Spare& x : c.spares) {
      if (x.lent || !x.mapped) continue;
      const std::shared_ptr<Ticket> k = x.kept.lock();
      if (!k) {
        sp = &x;
        break;
      }
      if (k->lent_readers == 0 && (!sp || x.returned < sp->returned)) sp = &x;
    }
    if (sp && !Forget(h, *sp)) sp = nullptr;
  }
  if (!sp && may_map)
    for (Spare& x : c.spares)
      if (!x.lent && !x.mapped) {
        if (MapSpare(c, x)) sp = &x;
        break;  // one mapping attempt per lend: the budget (or the device) has no room for more
      }
  if (!sp) return false;
  Status st = WriteDeviceWord(backend_, garm_, c.CellWord(i), sp->addr, "offload grant (graph)");
  if (!st.ok()) {
    Driver(backend_).StreamSynchronize(garm_);
    return false;
  }
  std::swap(static_cast<CellPages&>(cell), static_cast<CellPages&>(*sp));  // both mapped
  sp->lent = std::move(cell.draining);
  {
    Held h = ledger_.Lock();
    sp->lent->lent_cell = sp->addr;
  }
  cell.stream = nullptr;  // its pages now are the spare's: no copy into or out of them is pending
  ++stats_.lends;
  return true;
}

bool GraphMode::TradePages(Channel& c, int i, Channel& p, int k) {
  // Caller holds mu_. No grant is out on either cell, so the device reads neither address word until
  // the poller grants again, after this (the words are written and garm_ synchronized first). The VA
  // goes with the pages, so nothing is unmapped and the budget's charge stays as it is.
  Cell& a = c.cells[i];
  Cell& b = p.cells[k];
  const DriverTable& d = Driver(backend_);
  auto words = [&] {
    Status st = WriteDeviceWord(backend_, garm_, c.CellWord(i), a.addr, "graph page trade");
    if (st.ok()) st = WriteDeviceWord(backend_, garm_, p.CellWord(k), b.addr, "graph page trade");
    Status sync = Call(-1, "graph page trade", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(garm_); });
    return st.ok() ? sync : st;
  };
  std::swap(static_cast<CellPages&>(a), static_cast<CellPages&>(b));
  Status st = words();
  if (!st.ok()) {
    std::swap(static_cast<CellPages&>(a), static_cast<CellPages&>(b));
    Status back = words();
    ledger_.Report(c.stream, Status(st.code(), st.ToString() + (back.ok() ? " (graph-mode cells keep their pages)" : " (graph-mode cell addresses may be stale)")));
    return false;
  }
  a.stream = b.stream = nullptr;  // neither has a copy pending (the callers checked)
  ++stats_.trades;
  return true;
}

bool GraphMode::Partners(const Channel& a, const Channel& b) {
  return a.trades && b.trades && a.kind != b.kind && a.cell_size == b.cell_size;
}

bool GraphMode::TakeIdlePages(Channel& c, int i) {
  // Caller holds mu_. A forward's first round takes the pages the previous backward's reloads used,
  // and the other way around, so a pair of large call sites keeps one cell of device memory between
  // them, not one each.
  Channel* from = nullptr;
  int k = -1;
  channels_.ForEach([&](Channel& p) {
    if (from || !Partners(c, p)) return;
    for (int j = 0; j < p.ncells; ++j) {
      Cell& cell = p.cells[j];
      // Host pages (the device had no memory) go back when idle, so that the next mapping tries the
      // device again: passing them on would keep them in use for good.
      if (!cell.mapped || cell.host_pages || cell.round != Channel::Round::kIdle || cell.loaded || cell.ticket || cell.draining) continue;
      if (CopyPending(cell) || ReadByD2h(cell)) continue;  // a copy into or out of it still runs
      from = &p;
      k = j;
      return;
    }
  });
  return from && TradePages(c, i, *from, k);
}

bool GraphMode::TakeHeldPages(Channel& c, int j, const std::shared_ptr<Ticket>& a) {
  // Caller holds mu_. Reload cell j (no round on it, nothing loaded, no copy pending) and the offload
  // cell that holds `a` (the forward's last round of a large call site) exchange their pages: the
  // bytes stay where the offload left them, and the reload copies nothing before its round.
  // a's D2H may still run (the forward's last D2H, when the backward's head is short): the round only
  // reads the pages too, and writing them later is harmless when the round consumes `a` (nothing reads
  // its host copy then), but they must not be unmapped under the copy: the cell keeps them until the
  // D2H clock passes a's D2H (Cell::d2h_reads). A kept ticket (a jax.vjp or jax.linearize function's,
  // which Python may call again) is not consumed: the next prefetch or correction into the pages
  // would end up in its host copy, so it trades only once its D2H is done. Before, such a reload
  // mapped a cell of new pages and copied device to device, and that second cell stayed mapped
  // through the step.
  Cell& mine = c.cells[j];
  if (mine.loaded || mine.ticket || mine.round == Channel::Round::kGranted) return false;
  if (CopyPending(mine) || ReadByD2h(mine)) return false;
  Channel* from = nullptr;
  int k = -1;
  uint64_t d2h_reads = 0;
  {
    Held h = ledger_.Lock();
    if (!a->lent_cell || a->lent_readers > 0) return false;
    if (!transfers_.D2hDone(*a)) {
      if (!a->d2h_seq || a->kept) return false;  // only the graph clock tells when the copy is done
      d2h_reads = a->d2h_seq;
    }
    channels_.ForEach([&](Channel& p) {
      if (from || !Partners(c, p)) return;
      for (int i = 0; i < p.ncells; ++i)
        if (p.cells[i].round == Channel::Round::kHeld && p.cells[i].draining == a && p.cells[i].addr == a->lent_cell) {
          from = &p;
          k = i;
          return;
        }
    });
  }
  if (!from) return false;
  Cell& held = from->cells[k];
  if (held.host_pages) return false;  // copied into the reload's own cell instead (see TakeIdlePages)
  // Its last copy is the D2H (done by the clock, or followed by d2h_reads; the event recorded behind it
  // may lag); anything else still running on it keeps it.
  if (CopyPending(held, gd2h_)) return false;
  if (!TradePages(c, j, *from, k)) return false;
  mine.d2h_reads = d2h_reads;
  {
    Held h = ledger_.Lock();
    a->lent_cell = 0;  // the bytes are this cell's now; the offload cell has others
    // As if prefetched: the request finds its ticket loaded (a hit, no copy), its pin passes to the round.
    // Another cell that guessed it (its prefetch copied from the held cell) holds a stale guess now.
    if (a->claimed_by != 0 && a->claimed_by != c.Claim()) ledger_.MarkStale(h);
    a->claimed_by = c.Claim();
    a->pins += 1;
    mine.loaded = a;
  }
  held.draining.reset();
  held.until_knock = false;
  held.round = Channel::Round::kIdle;
  return true;
}

bool GraphMode::MapSpare(Channel& c, Spare& sp) {
  // Device pages within the spare budget and the staging budget, or none: a spare is an optimization,
  // never waited for.
  if (sp.mapped) return true;
  const size_t cap = EngineConfig::GraphSpareBudget();
  const auto bytes = static_cast<int64_t>(c.cell_size);
  if (cap > 0 && static_cast<size_t>(stats_.spare_bytes + bytes) > cap) return false;
  if (!staging_.Charge(c.cell_size)) return false;
  if (!Registry::Get().Remap(sp.slot_id).ok()) {
    staging_.Uncharge(c.cell_size);
    return false;
  }
  Mapped(c, &sp);
  stats_.spare_bytes += bytes;
  stats_.spare_bytes_peak = std::max(stats_.spare_bytes_peak, stats_.spare_bytes);
  return true;
}

void GraphMode::UnmapSpare(Channel& c, Spare& sp) {
  if (!sp.mapped) return;
  UnmapPages(c, &sp, "graph-mode spare cell kept");
  if (!sp.mapped) stats_.spare_bytes -= static_cast<int64_t>(c.cell_size);
}

bool GraphMode::ReturnSpares() {
  // Caller holds mu_. A lent spare is free again once its ticket's D2H is done. It keeps the bytes
  // (the ticket's lent_cell still names it, so a reload reads them device to device) until a lend
  // reuses it or its pages go back; both skip it while a copy out of it still runs (lent_readers).
  bool busy = false;
  channels_.ForEach([&](Channel& c) {
    for (Spare& sp : c.spares) {
      if (!sp.lent || !transfers_.D2hDone(*sp.lent)) continue;
      Held h = ledger_.Lock();
      sp.kept = std::move(sp.lent);
      sp.lent.reset();
      sp.returned = ++return_clock_;
      busy = true;
    }
  });
  return busy;
}

void GraphMode::WatchLentRead(const Source& src, const std::shared_ptr<Ticket>& t, CUevent ev) {
  // Caller holds mu_. RoundSourceOf counted the reader; ev (recorded behind its copy, or on a stream
  // synchronized since) tells when it has ended. A reload cell's event is only recorded again behind
  // later copies into that cell, each ordered after the one before, so a later record is later still.
  if (src.lent) lent_reading_.emplace_back(ev, t);
}

bool GraphMode::ReleaseLentReads() {
  // Caller holds mu_.
  if (lent_reading_.empty()) return false;
  const DriverTable& d = Driver(backend_);
  bool busy = false;
  Held h = ledger_.Lock();
  for (auto it = lent_reading_.begin(); it != lent_reading_.end();) {
    if (d.EventQuery(it->first) == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    it->second->lent_readers -= 1;
    it = lent_reading_.erase(it);
    busy = true;
  }
  return busy;
}

bool GraphMode::Forget(const Held& h, Spare& sp) {
  // Caller holds mu_ and the ledger's lock (h).
  (void)h;
  const std::shared_ptr<Ticket> k = sp.kept.lock();
  if (k && k->lent_readers > 0) return false;
  if (k && k->lent_cell == sp.addr) k->lent_cell = 0;
  sp.kept.reset();
  return true;
}

void GraphMode::ArmIdleCells(Channel& c) {
  // A round of the channel ended: every idle cell gets a grant behind its own D2H, so the next K rounds
  // find one each. Cells without pages are mapped only within the budget as it is: a channel whose K
  // cells do not fit runs on fewer (a round that finds none armed knocks, as with one cell).
  for (int i = 0; i < c.ncells; ++i) {
    Cell& cell = c.cells[i];
    if (cell.round != Channel::Round::kIdle) continue;
    if (!cell.mapped && !MapCell(c, i, /*evict=*/false)) continue;
    Arm(c, i, /*host=*/false);
  }
}

bool GraphMode::Revoke(Channel& c, int i) {
  // Caller holds mu_. Takes cell i's armed grant back on the stream that wrote it (so after that
  // write), waits for the kernel, and reads what it found. Only a grant taken back lets the cell go.
  Cell& cell = c.cells[i];
  if (cell.round != Channel::Round::kArmed) return cell.round == Channel::Round::kIdle;
  ScopedContext ctx(backend_, device_);  // trim() calls this from a user thread
  const DriverTable& d = Driver(backend_);
  const bool offload = c.kind == ChannelKind::kOffload;
  CUstream s = cell.grant_stream ? cell.grant_stream : offload ? gd2h_ : gh2d_;
  const uint64_t expect = offload ? 0 : (cell.loaded ? cell.loaded->token : 0);
  c.w->result.store(0, std::memory_order_relaxed);
  Status st = kernels_.Revoke(s, c.Grant(i), expect, WordAddr(c.w->result));
  if (st.ok()) st = Call(-1, "graph revoke", Entry::kStreamSynchronize, [&] { return d.StreamSynchronize(s); });
  if (!st.ok()) {
    std::fprintf(stderr, "%s (graph-mode grant kept)\n", st.ToString().c_str());
    return false;
  }
  if (c.w->result.load(std::memory_order_acquire) == 0) {
    // The device took it first: the round is live (its filled/done comes), the cell stays.
    ++stats_.revokes_lost;
    cell.round = Channel::Round::kGranted;
    return false;
  }
  ++stats_.revokes;
  cell.round = Channel::Round::kIdle;
  {
    Held h = ledger_.Lock();
    if (offload) ledger_.Disarm(h, cell.grant_token);
    else Unload(h, c, i);
  }
  cell.grant_token = 0;  // a reserved number never used: no ticket was made for it
  return true;
}

bool GraphMode::ServiceOffloadK(Channel& c) {
  ChannelWords& w = *c.w;
  bool busy = ServeHeld(c);
  for (int i = 0; i < c.ncells; ++i) {
    if (w.filled[i].load(std::memory_order_acquire) != 1) continue;
    // The device took cell i's grant_token, copied x into the cell and handed the token out: make its
    // ticket, D2H the cell into it on gd2h_, and pre-arm the cell again right behind that copy.
    w.filled[i].store(0, std::memory_order_relaxed);
    busy = true;
    Cell& cell = c.cells[i];
    const uint64_t token = cell.grant_token;
    cell.grant_token = 0;
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++stats_.offload_rounds;
    ++(cell.host_grant ? stats_.grants_host : stats_.grants_device);
    Status st;
    std::shared_ptr<Ticket> t = MakeRoundTicket(c, token, &st);
    cell.holds = t;  // the round's bytes (none to name when its ticket could not be made)
    if (t) st = CopyOutOfCell(c, i, t);
    if (t && st.ok()) cell.draining = t;  // Arm may lend the cell to it (spares)
    // Failed: the token the device handed out names no ticket; its reload fills 0xFF and reports too.
    if (!st.ok()) RecordOffloadError(c, st);
  }
  if (busy) ArmIdleCells(c);
  // `knock` is a level the device holds while it waits with no grant. An armed grant answers it (its
  // write may still be on its way behind a D2H); with none, map an idle cell and arm it.
  bool armed = false;
  for (int i = 0; i < c.ncells; ++i) armed |= c.cells[i].round == Channel::Round::kArmed;
  if (armed) c.waiting = false;  // a knock seen earlier is answered by that grant
  if (!armed && (c.waiting || w.knock.load(std::memory_order_acquire) == 1)) {
    c.waiting = true;
    busy = true;
    int pick = -1;
    for (int i = 0; i < c.ncells; ++i) {
      if (c.cells[i].round != Channel::Round::kIdle) continue;
      if (pick < 0 || (c.cells[i].mapped && !c.cells[pick].mapped)) pick = i;
    }
    if (pick < 0) return busy;  // every cell is under a live round (its filled comes first) or held (ServeHeld arms it)
    if (!MapCell(c, pick)) return busy;  // no room in the staging budget yet: the next pass retries
    if (Arm(c, pick, /*host=*/true)) {
      c.waiting = false;
      c.last_use = std::chrono::steady_clock::now();
      ArmIdleCells(c);  // and the channel's other cells: the rounds after this one find their grants
    }
  }
  return busy;
}

bool GraphMode::ServiceReloadK(Channel& c) {
  ChannelWords& w = *c.w;
  const DriverTable& d = Driver(backend_);
  bool busy = false;
  for (int i = 0; i < c.ncells; ++i) {
    if (w.done[i].load(std::memory_order_acquire) != 1) continue;
    // The device copied cell i out. Its round was granted by the host (cell.ticket), or the device
    // took grant[i] itself (cell.loaded, the prefetched ticket, is what it copied).
    w.done[i].store(0, std::memory_order_relaxed);
    busy = true;
    Cell& cell = c.cells[i];
    bool device = false;
    {
      Held h = ledger_.Lock();
      std::shared_ptr<Ticket> t = std::move(cell.ticket);
      cell.ticket.reset();
      if (!t && cell.loaded) {
        t = std::move(cell.loaded);
        cell.loaded.reset();
        if (t->claimed_by == c.Claim()) t->claimed_by = 0;
        MarkReloaded(*t);
        device = true;
      }
      if (t) {
        ++ledger_.counts(h).reloads;  // a ticket's bytes reached XLA's buffer (a 0xFF round had no ticket)
        t->pins -= 1;
        ledger_.Retire(h, t);
      }
    }
    if (device) {
      ++stats_.grants_device;
      ++stats_.hits;
    } else {
      ++stats_.grants_host;
    }
    cell.round = Channel::Round::kIdle;
    c.last_use = std::chrono::steady_clock::now();
    ++c.rounds;
    ++stats_.reload_rounds;
  }
  if (busy) PrefetchInto(c);
  if (c.waiting || w.request.load(std::memory_order_acquire) == 1) {
    // The device found no cell whose grant names its token and waits for go: the host decides, as
    // without kernels. A `done` that came in since this pass read it belongs to the previous round:
    // serve it first.
    for (int i = 0; i < c.ncells; ++i)
      if (w.done[i].load(std::memory_order_acquire) == 1) return true;
    if (!c.waiting) w.request.store(0, std::memory_order_relaxed);
    c.waiting = true;
    busy = true;
    const uint64_t token = w.probe.load(std::memory_order_acquire);
    std::string why;
    std::shared_ptr<Ticket> a;
    {
      Held h = ledger_.Lock();
      a = FindForRound(h, c, token, &why);
      if (a && !a->enqueued) return busy;  // its offload's `filled` is served on the next pass
      // A token an offload round handed out whose `filled` is not served yet has no ticket yet.
      if (!a && ledger_.Armed(h, token)) return busy;
    }
    // The cell: the one that holds `a` already (its grant was not written yet when the device looked),
    // else an idle mapped one, else any the device is not using (its guess is dropped). The device is
    // in this round, so it takes no other grant of the channel until go.
    int j = -1;
    for (int i = 0; i < c.ncells && j < 0; ++i)
      if (a && c.cells[i].loaded == a) j = i;
    for (int pass = 0; pass < 3 && j < 0; ++pass)
      for (int i = 0; i < c.ncells && j < 0; ++i) {
        const Cell& cell = c.cells[i];
        if (cell.round == Channel::Round::kGranted) continue;
        if (pass == 0 ? (cell.mapped && !cell.loaded) : pass == 1 ? cell.mapped : true) j = i;
      }
    if (j < 0) return busy;
    if (!(a && c.trades && TakeHeldPages(c, j, a)) && !MapCell(c, j)) return busy;
    Cell& cell = c.cells[j];
    Source src;
    bool hit = false;
    {
      Held h = ledger_.Lock();
      hit = TakeForRound(h, c, j, a, &src);
    }
    cell.ticket = a;
    c.waiting = false;
    cell.round = Channel::Round::kGranted;
    cell.host_grant = true;
    c.last_use = std::chrono::steady_clock::now();
    const uint64_t go = static_cast<uint64_t>(j) + 1;
    // On gfix_, after every copy into the cell (a prefetch and its grant write): clear grant[j] (the
    // host decides what the cell holds now), put the bytes in, then go.
    Status st;
    if (cell.stream && cell.stream != gfix_)
      st = Call(-1, "reload (graph)", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(gfix_, cell.event, 0); });
    if (st.ok()) st = WriteDeviceWord(backend_, gfix_, c.Grant(j), 0, "reload (graph)");
    if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gfix_); });
    if (st.ok()) cell.stream = gfix_;
    if (!st.ok()) {
      // grant[j] may still name a prefetched token: wait for every copy, then clear it in order.
      d.StreamSynchronize(gh2d_);
      d.StreamSynchronize(gfix_);
      st = WriteDeviceWord(backend_, gfix_, c.Grant(j), 0, "reload (graph)");
      if (st.ok()) d.StreamSynchronize(gfix_);
      cell.stream = nullptr;
      if (!st.ok()) ledger_.Report(c.stream, st);
    }
    if (hit) {
      ++stats_.hits;
      Grant(&w.go, c, j, go);
      return busy;
    }
    ++stats_.misses;
    if (!a) {
      ledger_.Report(c.stream, Status(Code::kInvalidArgument, "reload (graph-mode call site " + std::to_string(c.site) + "): " + why +
                                                            "; the output was filled with 0xFF bytes"));
      FillInvalid(c, j);
      Grant(&w.go, c, j, go);
      return busy;
    }
    // The bytes may still be in the offload cell the round left them in (the backward's first reloads
    // name the forward's last offloads): a device-to-device copy then, not a wait for their D2H and an
    // H2D. XLA's stream waits in this round until go, written on gfix_ behind the copy, so no round
    // refills that cell before the copy has read it (where XLA keeps the recorded order: CellHolding).
    Cell* from = src.resident ? nullptr : CellHolding(a, c.cell_size, c.stream);
    if (from) {
      src = Source();
      src.resident = from->addr;  // complete: XLA's stream ran the round that filled it
    }
    st = transfers_.CopyTicket(gfix_, src, cell.addr, c.meta.nbytes, round_host_.bounce(), "reload (graph)");
    if (st.ok()) st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gfix_); });
    cell.stream = gfix_;
    WatchLentRead(src, a, cell.event);
    if (from) {
      from->read_into = &cell;  // its pages stay until cell j's copy has ended
      if (st.ok()) ++stats_.cell_reads;
    }
    if (!st.ok()) {
      ledger_.Report(c.stream, Status(st.code(), st.ToString() + " (graph-mode reload of " + TokenStr(token) + " failed; the output was filled with 0xFF bytes)"));
      FillInvalid(c, j);
    } else if (StageHeldGuesses(c, j)) {
      // go must follow the staged copies too (they read offload cells that XLA's stream may refill once
      // it goes on; CellHolding found them only where XLA keeps the recorded order): cell j's event
      // again, behind them, so that Grant writes go on gfix_.
      st = Call(-1, "reload (graph)", Entry::kEventRecord, [&] { return d.EventRecord(cell.event, gfix_); });
      if (!st.ok()) d.StreamSynchronize(gfix_);  // then go may be written at once
    }
    Grant(&w.go, c, j, go);
  }
  return busy;
}

Status GraphMode::QuiesceForModuleLoad(bool* waited) {
  *waited = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!any_captured_) return Status();  // no round of this engine can be pending on the device
  }
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  JAXVMM_RETURN_IF_ERROR(Call(-1, "quiesce before a module load", Entry::kCtxSynchronize, [&] { return Driver(backend_).CtxSynchronize(); }));
  *waited = true;
  return Status();
}

void GraphMode::PausePoller(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    poll_paused_ = paused;
  }
  poll_cv_.notify_all();
}

void GraphMode::ReleaseUnpins(bool all) {
  // Caller holds mu_. Pins of unloaded guesses whose cell's copy has ended since (all: the
  // streams were synchronized).
  if (unpin_after_.empty()) return;
  ScopedContext ctx(backend_, device_);  // Synchronize calls this from a user thread
  const DriverTable& d = Driver(backend_);
  Held h = ledger_.Lock();
  for (auto it = unpin_after_.begin(); it != unpin_after_.end();) {
    if (!all && d.EventQuery(it->first) == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    it->second->pins -= 1;
    ledger_.Retire(h, it->second);
    it = unpin_after_.erase(it);
  }
}

void GraphMode::DropStaleGuesses() {
  // Caller holds mu_. A consumed ticket a cell still holds as its guess stays pinned (live, its
  // host block held) until the cell goes idle: take the guess back now. An armed one is revoked first
  // (its `ready` names the token); a revoke the device won leaves a live round, served as usual.
  if (!ledger_.TakeStale()) return;
  ScopedContext ctx(backend_, device_);  // Synchronize calls this from a user thread
  channels_.ForEach([&](Channel& c) {
    if (c.kind != ChannelKind::kReload) return;
    for (int i = 0; i < c.ncells; ++i) {
      Cell& cell = c.cells[i];
      bool stale = false;
      {
        Held h = ledger_.Lock();
        stale = cell.loaded && (cell.loaded->consumed || cell.loaded->dropped);
      }
      if (!stale) continue;
      if (cell.round == Channel::Round::kArmed) {
        (void)Revoke(c, i);  // unloads on success
      } else if (cell.round == Channel::Round::kIdle) {
        // Host grants: an unarmed guess. Its prefetch may still read the ticket: Unload keeps the pin
        // until that copy has ended (unpin_after_).
        Held h = ledger_.Lock();
        Unload(h, c, i);
      }
    }
  });
}

bool GraphMode::Idle() {
  // Caller holds mu_.
  bool idle = round_d2h_.empty() && unpin_after_.empty();
  {
    Held h = ledger_.Lock();
    if (ledger_.stale(h)) idle = false;  // the poller's next pass takes them back
  }
  channels_.ForEach([&](Channel& c) {
    if (c.waiting || c.w->knock.load() || c.w->request.load()) idle = false;
    for (int i = 0; i < kMaxCells; ++i)
      if (c.w->filled[i].load() || c.w->done[i].load()) idle = false;
    // A granted offload whose round never reached the device (its execution stopped) holds no work.
    for (int i = 0; i < c.ncells; ++i)
      if (c.kind == ChannelKind::kReload && c.cells[i].round == Channel::Round::kGranted) idle = false;
  });
  return idle;
}

void GraphMode::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    poll_stop_ = true;
  }
  poll_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  const DriverTable& d = Driver(backend_);
  for (CUstream s : {gd2h_, gh2d_, garm_, gfix_})  // every copy into or out of a cell has finished
    if (s) d.StreamSynchronize(s);
  std::lock_guard<std::mutex> lock(mu_);
  {
    Held h = ledger_.Lock();
    for (auto& [ev, t] : lent_reading_) t->lent_readers -= 1;  // every copy has ended (streams synchronized)
    lent_reading_.clear();
  }
  channels_.ForEach([&](Channel& c) {
    for (int i = 0; i < kMaxCells; ++i) {
      Cell& cell = c.cells[i];
      {
        Held h = ledger_.Lock();
        (void)Unhold(h, cell);
        Unload(h, c, i);
        if (cell.ticket) {
          if (c.kind == ChannelKind::kReload) cell.ticket->pins -= 1;
          else cell.ticket->dropped = cell.ticket->on_host = true;
          ledger_.Retire(h, cell.ticket);
          cell.ticket.reset();
        }
      }
      UnmapCell(c, i);
      if (cell.slot_id >= 0) (void)Registry::Get().Close(cell.slot_id);
      cell.slot_id = -1;
      if (cell.event) d.EventDestroy(cell.event);
      cell.event = nullptr;
      cell.draining.reset();
      cell.d2h_reads = 0;
    }
    for (Spare& sp : c.spares) {
      {
        Held h = ledger_.Lock();
        if (sp.lent) sp.lent->lent_cell = 0;
        sp.lent.reset();
        (void)Forget(h, sp);  // no copy out of it is left
      }
      UnmapSpare(c, sp);
      if (sp.slot_id >= 0) (void)Registry::Get().Close(sp.slot_id);
      sp.slot_id = -1;
    }
  });
  ReleaseUnpins(/*all=*/true);  // every stream was synchronized above
}

Source GraphMode::RoundSourceOf(Ticket& t) {
  Source src = SourceOf(t);
  if (!src.resident && t.lent_cell) {
    src.resident = t.lent_cell;  // complete: the round finished before its cell was lent
    src.lent = true;
    ++t.lent_readers;  // the caller watches the copy (WatchLentRead)
    ++stats_.lent_reads;
    if (transfers_.D2hDone(t)) ++stats_.kept_reads;
  }
  return src;
}

Status GraphMode::Synchronize() {
  // Rounds in progress (the poller serves them; a replay still running ends them).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Here too, not only in the poller: an engine with no graph channel has no poller.
    DropStaleGuesses();
    ReleaseUnpins(/*all=*/false);
    if (Idle()) return Status();
    if (std::chrono::steady_clock::now() > deadline) return Status(Code::kInternal, "graph-mode rounds did not finish within 120 s");
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
}

size_t GraphMode::Trim() {
  ScopedContext ctx(backend_, device_);  // a user thread: the cells' event queries and revocations
  std::lock_guard<std::mutex> lock(mu_);
  (void)ReleaseLentReads();  // copies out of lent cells that ended since the poller's last pass
  (void)ReturnSpares();
  return ReleaseIdleCells(/*now=*/true);
}

GraphStats GraphMode::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  GraphStats s = stats_;
  const RecordStats& r = recorder_.stats();
  s.kernels = r.kernels;
  s.early_launch = r.kernels && kernels_.can_launch_early();  // the recorder loaded them (GraphKernels::Load)
  s.kernels_error = r.kernels_error;
  s.cells = r.cells;
  s.spares = r.spares;
  s.fused_captures = r.fused_captures;
  s.early_captures = r.early_captures;
  s.bounce_copies = round_host_.copies();
  s.host_fallbacks = round_host_.fallbacks();
  s.xla_in_order = xla_in_order_ ? 1 : 0;
  return s;
}

}  // namespace jaxvmm
