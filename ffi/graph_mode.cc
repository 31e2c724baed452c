// Graph mode: offload/reload call sites captured into XLA command buffers (CUDA graphs).
//
// A replay runs the recorded device work and nothing else, so what a round needs from the host (a new
// ticket and its host block, which ticket a token names, whether a cell already holds it) comes from
// the poller through the channel's pinned and device words. The device never touches a cell without a
// grant, and a grant is always ordered after every copy into or out of that cell.
//
// A channel has K cells; a round (K > 1) is three nodes: a one-thread take kernel takes a cell's
// pre-armed grant (or knocks/requests and waits for the poller) and leaves the cell's address in a
// device word, a copy kernel copies into/out of that address, and a one-thread publish kernel writes
// the cell's filled/done word. The poller arms each offload cell behind its own D2H (or holds it, its
// bytes readable on the device: spares all lent, or the one cell of a large call site until its next
// round; large call sites of the two directions trade their cells' pages) and prefetches the next
// predictions into the idle reload cells. The host is on the device's path only when there is no grant
// (first round, after a revocation, a mispredicted reload): then the device knocks / requests and
// waits for the poller's grant or go. Graph mode has no other protocol: where its kernels do not load
// (or warm up), every capture fails with why and how to turn command buffers off (GraphRecorder::Ready).
//
// The poller's work is done by its parts: GraphCells (graph_cells.cc: pages, spares, grants),
// OffloadRounds (graph_offload.cc) and ReloadRounds (graph_reload.cc). Nothing here runs on a
// capturing thread except the Captured* enqueues (no allocation there: the channel and its reserved
// cells were made by the initialize stage). DESIGN.md, "Graph mode".
#include <algorithm>

#include "graph_mode.h"

#include "config.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

// How long the poller keeps spinning after the last round or initialize before it sleeps.
constexpr auto kSpin = std::chrono::milliseconds(50);

}  // namespace

// ---------------------------------------------------------------- lifetime

GraphMode::GraphMode(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, Transfers& transfers,
                     GraphKernels& kernels)
    : g_(b, device, ledger, host, staging, transfers, kernels), cells_(g_), offloads_(g_, cells_), reloads_(g_, cells_),
      recorder_(b, device, kernels) {}

Status GraphMode::Init() {
  const DriverTable& d = Driver(g_.backend);
  for (CUstream* s : {&g_.gd2h, &g_.gh2d, &g_.garm, &g_.gfix})
    JAXVMM_RETURN_IF_ERROR(Call(-1, "engine init", Entry::kStreamCreateWithPriority,
                                [&] { return d.StreamCreateWithPriority(s, CU_STREAM_NON_BLOCKING, 0); }));
  return g_.round_host.Init();
}

GraphMode::~GraphMode() {
  ScopedContext ctx(g_.backend, g_.device);  // a member: the engine's own context is gone by now
  const DriverTable& d = Driver(g_.backend);
  for (CUstream s : {g_.gd2h, g_.gh2d, g_.garm, g_.gfix})
    if (s) GiveBack("graph mode teardown", Entry::kStreamDestroy, [&] { return d.StreamDestroy(s); });
}

void GraphMode::WakePoller() {
  // Caller holds mu_.
  awake_until_ = std::max(awake_until_, std::chrono::steady_clock::now() + kSpin);
  // Started by the first capture, or by the first cell an initialize stage mapped: a site XLA never
  // captures (a program too small for a command buffer) must still get its pages back when idle.
  if ((any_captured_ || g_.stats.mapped_bytes > 0) && !poller_.joinable()) poller_ = std::thread([this] { Poll(); });
  poll_cv_.notify_one();
}

// ---------------------------------------------------------------- the initialize stage

Status GraphMode::Prepare(CUstream stream, int64_t site, ChannelKind kind, const ArrayMeta& meta, bool readers_can_bounce) {
  if (meta.nbytes == 0) return Status();
  std::lock_guard<std::mutex> lock(mu_);
  ++g_.stats.prepares;
  Channel* c = nullptr;
  bool created = false;
  JAXVMM_RETURN_IF_ERROR(g_.channels.GetOrCreate(site, kind, meta, &c, &created));
  // Without its kernels graph mode can record no round: nothing to prepare (a capture fails, saying
  // why; an execution XLA does not capture runs on the op ring).
  if (!recorder_.PrepareKernels(g_.gd2h, *c).ok()) return Status();
  // Round tickets the pinned pool has no room for go to pageable memory, copied through bounce buffers
  // made here; without them such a round fails instead.
  g_.round_host.Prepare(readers_can_bounce);
  if (created && kind == ChannelKind::kOffload) {
    // Pinned room for a new site's first rounds, made here (XLA's thread, before any round waits): the
    // poller only carves from the pool (RoundHostSupply::Allocate), and a fresh pool has nothing to carve. Over
    // the host pool's limit this fails and the rounds fall back as they would; later growth is the
    // grower's (once per site: an initialize stage runs for every execution).
    g_.round_host.Reserve(static_cast<size_t>(EngineConfig::GraphCells() + 1) * meta.nbytes);
  }
  c->stream = stream;
  if (c->ncells == 0) JAXVMM_RETURN_IF_ERROR(recorder_.ReserveCells(g_.gd2h, *c, meta, kind));
  if (created) ++g_.stats.channels;
  // XLA records a command buffer on the call site's second execution (the first is a warm-up): give
  // cell 0 pages before then (a fixed cell's capture names it; otherwise the first round's grant needs
  // no mapping). Later the poller maps on demand.
  // (Within the budget's free room and on the device only: no round waits for it yet, so a full device
  // is left to the capture, which must have pages and takes host pages if it has to.)
  // Not for call sites that trade pages (large arrays, one cell): their capture names no cell, and
  // pages mapped here would sit idle through the first execution (whose ops run on the op ring, with
  // staging cells of their own): on the H200 that first execution was the run's device peak, one
  // activation above every later step. Their first round maps (or takes) its pages when it comes.
  if (!c->captured && ++c->prepares <= 2 && !c->trades) (void)cells_.MapCell(*c, 0, /*evict=*/false);
  c->last_use = std::chrono::steady_clock::now();  // idle from now on until a round or a capture
  WakePoller();
  return Status();
}

Status GraphMode::CaptureChannel(int64_t site, ChannelKind kind, const ArrayMeta& meta, Channel** out) {
  // Caller holds mu_. The channel the initialize stage prepared; a re-recording (XLA saw new
  // buffer addresses) may find its cell idle and returned: map it again so the capture names mapped
  // memory (page calls, not stream work).
  JAXVMM_RETURN_IF_ERROR(recorder_.Ready());  // no kernels, no rounds
  const char* what = kind == ChannelKind::kOffload ? "offload" : "reload";
  Channel* c = g_.channels.Find(site, kind, meta);
  if (!c || c->ncells == 0)
    return Status(Code::kInternal, std::string(what) + " call site " + std::to_string(site) +
                                       " is being captured into a command buffer but its initialize stage never ran");
  // A fixed cell's rounds record copies that name it. Otherwise the rounds record no cell address: the
  // device finds a cell through its grant, and the poller maps a cell before it grants it.
  if (c->FixedCell() && !c->cells[0].mapped && !cells_.MapCell(*c, 0))
    return Status(Code::kOutOfMemory, "graph-mode cell of call site " + std::to_string(site) +
                                          " could not be mapped for capture within the staging budget");
  *out = c;
  return Status();
}

void GraphMode::Recorded(Channel& c) {
  // Caller holds mu_: the channel's device work is in a graph now; its rounds need the poller.
  const bool first = !c.captured;
  c.captured = any_captured_ = true;
  ++g_.stats.captures;
  // The op ring's cells of this size served its uncaptured runs. Only a first recording marks the size
  // for reloads: XLA re-records a command buffer whose buffers moved, and a mark set again at every
  // step would send a program's uncaptured reloads of that size past their prefetch every step.
  g_.staging.RetireSize(c.cell_size, /*mark_reloads=*/first);
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
  ScopedContext ctx(g_.backend, g_.device);
  std::unique_lock<std::mutex> lock(mu_);
  while (!poll_stop_) {
    if (poll_paused_) {
      poll_cv_.wait_for(lock, std::chrono::milliseconds(1));
      continue;
    }
    bool busy = false;
    // Offloads first: a reload's token may name a ticket whose `filled` arrived in the same pass.
    g_.channels.ForEach([&](Channel& c) {
      if (c.kind == ChannelKind::kOffload) busy |= offloads_.Serve(c);
    });
    g_.channels.ForEach([&](Channel& c) {
      if (c.kind == ChannelKind::kReload) busy |= reloads_.Serve(c);
    });
    busy |= offloads_.ReapOffloads();
    busy |= cells_.ReleaseLentReads();
    busy |= cells_.ReturnSpares();
    reloads_.DropStaleGuesses();
    cells_.ReleaseUnpins(/*all=*/false);
    const auto now = std::chrono::steady_clock::now();
    if (busy) awake_until_ = std::max(awake_until_, now + kSpin);
    cells_.ReleaseIdleCells(/*now=*/false);
    if (now < awake_until_) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    } else {
      poll_cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
  }
}

// ---------------------------------------------------------------- synchronize, trim, stop

Status GraphMode::QuiesceForModuleLoad(bool* waited) {
  *waited = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!any_captured_) return Status();  // no round of this engine can be pending on the device
  }
  ScopedContext ctx(g_.backend, g_.device);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  JAXVMM_RETURN_IF_ERROR(Call(-1, "quiesce before a module load", Entry::kCtxSynchronize, [&] { return Driver(g_.backend).CtxSynchronize(); }));
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

bool GraphMode::Idle() {
  // Caller holds mu_.
  bool idle = !offloads_.Draining() && !cells_.UnpinsPending();
  {
    Held h = g_.ledger.Lock();
    if (g_.ledger.stale(h)) idle = false;  // the poller's next pass takes them back
  }
  g_.channels.ForEach([&](Channel& c) {
    if (c.waiting || c.w->knock.load() || c.w->request.load()) idle = false;
    for (int i = 0; i < kMaxCells; ++i)
      if (c.w->filled[i].load() || c.w->done[i].load()) idle = false;
    // A granted offload whose round never reached the device (its execution stopped) holds no work.
    for (int i = 0; i < c.ncells; ++i)
      if (c.kind == ChannelKind::kReload && c.cells[i].round == Channel::Round::kGranted) idle = false;
  });
  return idle;
}

Status GraphMode::Synchronize() {
  // Rounds in progress (the poller serves them; a replay still running ends them).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Here too, not only in the poller: an engine with no graph channel has no poller.
    reloads_.DropStaleGuesses();
    cells_.ReleaseUnpins(/*all=*/false);
    if (Idle()) return Status();
    if (std::chrono::steady_clock::now() > deadline) return Status(Code::kInternal, "graph-mode rounds did not finish within 120 s");
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
}

size_t GraphMode::Trim() {
  ScopedContext ctx(g_.backend, g_.device);  // a user thread: the cells' event queries and revocations
  std::lock_guard<std::mutex> lock(mu_);
  (void)cells_.ReleaseLentReads();  // copies out of lent cells that ended since the poller's last pass
  (void)cells_.ReturnSpares();
  return cells_.ReleaseIdleCells(/*now=*/true);
}

void GraphMode::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    poll_stop_ = true;
  }
  poll_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  const DriverTable& d = Driver(g_.backend);
  for (CUstream s : {g_.gd2h, g_.gh2d, g_.garm, g_.gfix})  // every copy into or out of a cell has finished
    if (s) d.StreamSynchronize(s);
  std::lock_guard<std::mutex> lock(mu_);
  cells_.ReturnAll();
}

GraphStats GraphMode::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  GraphStats s = g_.stats;
  const RecordStats& r = recorder_.stats();
  s.kernels = r.kernels;
  s.early_launch = r.kernels && g_.kernels.can_launch_early();  // the recorder loaded them (GraphKernels::Load)
  s.kernels_error = r.kernels_error;
  s.cells = r.cells;
  s.spares = r.spares;
  s.early_captures = r.early_captures;
  s.bounce_copies = g_.round_host.copies();
  s.host_fallbacks = g_.round_host.fallbacks();
  s.xla_in_order = g_.xla_in_order ? 1 : 0;
  return s;
}

}  // namespace jaxvmm
