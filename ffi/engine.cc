#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "vmm.h"

namespace jaxvmm {
namespace {

constexpr uint64_t kRing = 1024;    // ops in flight per engine before the host waits for the GPU
constexpr size_t kTimings = 4096;  // handler host times kept for the median

std::atomic<int> g_keep{0};
std::atomic<bool> g_graph_kernels{true};
std::atomic<int> g_graph_cells{2};
std::atomic<int> g_graph_spares{0};
std::atomic<bool> g_graph_fused{true};
std::atomic<size_t> g_copy_chunk{size_t{64} << 20};

// Calls copy(offset, bytes) for consecutive pieces of at most `chunk` bytes (0: one piece).
template <typename F>
Status InPieces(size_t nbytes, size_t chunk, F&& copy) {
  if (chunk == 0 || chunk >= nbytes) return copy(size_t{0}, nbytes);
  for (size_t off = 0; off < nbytes; off += chunk) JAXVMM_RETURN_IF_ERROR(copy(off, std::min(chunk, nbytes - off)));
  return Status();
}

std::mutex g_engines_mu;
bool g_final = false;  // the process is exiting: no engine may start again (guarded by g_engines_mu)
std::map<std::pair<int, int>, std::unique_ptr<Engine>>& Engines() {
  static auto* m = new std::map<std::pair<int, int>, std::unique_ptr<Engine>>();
  return *m;
}

}  // namespace

void EngineConfig::SetKeepResident(int n) { g_keep.store(std::max(n, 0)); }
int EngineConfig::KeepResident() { return g_keep.load(); }
void EngineConfig::SetGraphKernels(bool on) { g_graph_kernels.store(on); }
bool EngineConfig::GraphKernels() { return g_graph_kernels.load(); }
void EngineConfig::SetGraphCells(int k) { g_graph_cells.store(std::clamp(k, 1, kMaxCells)); }
int EngineConfig::GraphCells() { return g_graph_cells.load(); }
void EngineConfig::SetGraphSpares(int n) { g_graph_spares.store(std::clamp(n, 0, kMaxSpares)); }
int EngineConfig::GraphSpares() { return g_graph_spares.load(); }
void EngineConfig::SetGraphFused(bool on) { g_graph_fused.store(on); }
bool EngineConfig::GraphFused() { return g_graph_fused.load(); }
void EngineConfig::SetCopyChunk(size_t bytes) { g_copy_chunk.store(bytes); }
size_t EngineConfig::CopyChunk() { return g_copy_chunk.load(); }

// ---------------------------------------------------------------- async errors

void AsyncErrors::Record(CUstream stream, const Status& st) { pending_.emplace_back(stream, st); }

Status AsyncErrors::TakeFor(CUstream stream) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it)
    if (it->first == stream) {
      Status st = it->second;
      pending_.erase(it);
      return st;
    }
  return Status();
}

Status AsyncErrors::TakeAny() {
  if (pending_.empty()) return Status();
  Status st = pending_.front().second;
  pending_.erase(pending_.begin());
  return st;
}

// ---------------------------------------------------------------- op records

struct Engine::Op {
  enum Kind { kOffload, kReload, kPrefetch };
  Engine* engine = nullptr;
  uint64_t seq = 0;
  Kind kind = kOffload;
  int pending = 0;  // the host's reference plus callbacks still to run; the ring entry is reusable at 0
  bool completion_launched = false;  // OnComplete is on ctl_: CompleteTask will run
  bool offloaded_launched = false;   // OnOffloaded is on rel_: OffloadedTask will run
  bool abandoned = false;            // its enqueue failed part way: workers release, never consume
  CUstream stream = nullptr;         // XLA's stream for the op (null on cpu)
  CUdeviceptr staging = 0;           // the staging cell's address (reload: what XLA's stream copies out)
  StagingLease lease;                // held until the handler ends, or by AbandonTask after a failure
  ArrayMeta meta;
  std::shared_ptr<Ticket> ticket;  // offload: its ticket; reload: the prediction (may be null)
  std::shared_ptr<Ticket> actual;  // reload/prefetch: what the token resolved to
  uint64_t tag = 0;                // the predicted ticket's token (0: no prediction)
  CUevent tok = nullptr, done = nullptr;
  CUevent filled = nullptr;  // reload: recorded on h2d_ once the cell is free and the prefetch (if any) is in
};

// ---------------------------------------------------------------- lifetime

Engine::Engine(Backend b, int device)
    : backend_(b), device_(device), host_store_(b, device), staging_(b, device), tickets_(EngineKey()), channels_(b, device), kernels_(b), bounce_(b, device), ring_bounce_(b, device) {}

Status Engine::For(Backend b, int device, Engine** out) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  auto& m = Engines();
  auto key = std::make_pair(static_cast<int>(b), device);
  auto it = m.find(key);
  if (it != m.end()) {
    *out = it->second.get();
    return Status();
  }
  // A finalizer running after the exit shutdown (a ticket dropped during interpreter teardown) must
  // not start threads that would outlive the statics they use.
  if (g_final) return Status(Code::kUnavailable, "the offload engines were shut down (the process is exiting)");
  std::unique_ptr<Engine> e(new Engine(b, device));
  JAXVMM_RETURN_IF_ERROR(e->Init());
  *out = e.get();
  m[key] = std::move(e);
  return Status();
}

std::vector<Engine*> Engine::All() {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  std::vector<Engine*> v;
  for (auto& [k, e] : Engines()) v.push_back(e.get());
  return v;
}

void Engine::ShutdownAll(bool final) {
  std::map<std::pair<int, int>, std::unique_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(g_engines_mu);
    g_final = g_final || final;
    engines.swap(Engines());
  }
  for (auto& [k, e] : engines) {
    Status st = e->Synchronize();
    if (!st.ok()) std::fprintf(stderr, "%s (at shutdown)\n", st.ToString().c_str());
    std::lock_guard<std::mutex> lock(e->mu_);
    e->shutting_down_ = true;
  }
  engines.clear();
}

Status Engine::Init() {
  JAXVMM_RETURN_IF_ERROR(CheckCapability(backend_, device_, Location{CU_MEM_LOCATION_TYPE_DEVICE, device_}));
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  const DriverTable& d = Driver(backend_);
  const char* stage = "engine init";
  // Copies run on their own streams so D2H and H2D overlap each other and XLA's compute; ctl_ and rel_
  // only carry event waits and host functions, so bookkeeping never queues behind a large copy and no
  // copy queues behind bookkeeping.
  for (CUstream* s : {&d2h_, &h2d_, &fix_, &ctl_, &rel_, &gd2h_, &gh2d_, &garm_})
    JAXVMM_RETURN_IF_ERROR(
        Call(-1, stage, Entry::kStreamCreateWithPriority, [&] { return d.StreamCreateWithPriority(s, CU_STREAM_NON_BLOCKING, 0); }));
  void* words = nullptr;
  JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemHostAlloc, [&] {
    return d.MemHostAlloc(&words, sizeof(Words) * (kRing + 1), CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
  }));
  words_ = static_cast<Words*>(words);
  for (uint64_t i = 0; i <= kRing; ++i) {  // the extra entry holds gd2h_done_
    new (&words_[i]) Words();
    words_[i].probe.store(0);
    words_[i].ready.store(0);
    words_[i].token = 0;
  }
  gd2h_done_ = &words_[kRing].ready;
  ops_.resize(kRing);
  for (auto& op : ops_) {
    op.engine = this;
    for (CUevent* e : {&op.tok, &op.done, &op.filled})
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventCreate, [&] { return d.EventCreate(e, CU_EVENT_DISABLE_TIMING); }));
  }
  resolver_ = std::make_unique<Worker>("jaxvmm-resolve", backend_, device_);
  releaser_ = std::make_unique<Worker>("jaxvmm-release", backend_, device_);
  grower_ = std::make_unique<Worker>("jaxvmm-grow", backend_, device_);
  return Status();
}

Engine::~Engine() {
  ScopedContext ctx(backend_, device_);
  const DriverTable& d = Driver(backend_);
  StopGraph();  // the poller first: it enqueues copies and owns the channels' cells
  // Streams first: a host function that fires later would post to a destroyed worker. Then the
  // workers drain (their tasks may still touch the state below) and stop.
  for (CUstream s : {h2d_, fix_, d2h_, rel_, ctl_, gd2h_, gh2d_, garm_})
    if (s) d.StreamSynchronize(s);
  if (resolver_) resolver_->Drain();
  if (releaser_) releaser_->Drain();
  resolver_.reset();
  releaser_.reset();
  grower_.reset();
  tickets_.ForEach([&](Ticket& t) {
    host_store_.Free(t.host);
    if (t.d2h_done) d.EventDestroy(t.d2h_done);
    if (t.resident) staging_.Return(&t.resident, nullptr);
  });
  for (auto& op : ops_)
    for (CUevent e : {op.tok, op.done, op.filled})
      if (e) d.EventDestroy(e);
  for (CUevent e : event_pool_) d.EventDestroy(e);
  for (CUstream s : {d2h_, h2d_, fix_, ctl_, rel_, gd2h_, gh2d_, garm_})
    if (s) d.StreamDestroy(s);
  if (words_) d.MemFreeHost(words_);
  kernels_.Unload();  // every stream that ran a grant kernel is synchronized
  // staging_ (a member) returns its cells' pages when it is destroyed, after this body.
}

// ---------------------------------------------------------------- host side

Status Engine::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  return errors_.TakeAny();
}

Status Engine::TakeErrorFor(CUstream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  return errors_.TakeFor(stream);
}

void Engine::Report(const Op& op, const Status& st) {
  Status named = st;  // which call site, when the op has one (offload, reload)
  if (op.meta.site > 0) named.Append(" [call site " + std::to_string(op.meta.site) + "]");
  std::fprintf(stderr, "%s\n", named.ToString().c_str());
  std::lock_guard<std::mutex> lock(mu_);
  errors_.Record(op.stream, named);
  ++stats_.errors;
}

Status Engine::GetEvent(CUevent* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!event_pool_.empty()) {
      *out = event_pool_.back();
      event_pool_.pop_back();
      return Status();
    }
  }
  return Call(-1, "event", Entry::kEventCreate, [&] { return Driver(backend_).EventCreate(out, CU_EVENT_DISABLE_TIMING); });
}

Status Engine::BeginOp(Op** out, const std::function<void(Op&)>& fill) {
  std::unique_lock<std::mutex> lock(mu_);
  // Backpressure: the host may run at most kRing ops ahead of the GPU.
  cv_.wait(lock, [&] { return ops_[next_seq_ % kRing].pending == 0; });
  uint64_t seq = next_seq_++;
  Op& op = ops_[seq % kRing];
  op.seq = seq;
  op.pending = 1;  // the host's reference, dropped by FinishEnqueue
  op.completion_launched = op.offloaded_launched = false;
  op.abandoned = false;
  op.stream = nullptr;
  op.staging = 0;
  op.lease = StagingLease();
  op.ticket.reset();
  op.actual.reset();
  op.tag = 0;
  fill(op);
  *out = &op;
  return Status();
}

void Engine::MarkCompleted(uint64_t seq) {
  // Caller holds mu_. completed_seq_ only moves over a contiguous run of finished ops.
  if (seq <= completed_seq_) return;
  finished_.insert(seq);
  while (!finished_.empty() && *finished_.begin() == completed_seq_ + 1) {
    finished_.erase(finished_.begin());
    ++completed_seq_;
  }
}

Status Engine::Launch(CUstream stream, CUhostFn fn, Op& op, const char* stage) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++op.pending;  // before the launch: the host function may run (and decrement) at once
  }
  Status st = Call(-1, stage, Entry::kLaunchHostFunc, [&] { return Driver(backend_).LaunchHostFunc(stream, fn, &op); });
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    --op.pending;
  cv_.notify_all();
  }
  return st;
}

Status Engine::EnqueueCompletion(Op& op, CUstream stream) {
  const DriverTable& d = Driver(backend_);
  const char* stage = "enqueue";
  JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op.done, stream); }));
  JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(ctl_, op.done, 0); }));
  JAXVMM_RETURN_IF_ERROR(Launch(ctl_, &Engine::OnComplete, op, stage));
  std::lock_guard<std::mutex> lock(mu_);
  op.completion_launched = true;
  return Status();
}

void Engine::FinishEnqueue(Op& op, const Status& st, std::chrono::steady_clock::time_point start) {
  // A synchronous failure is returned by the handler (XLA aborts the execution); it is not recorded
  // for later calls. What the op's missing callbacks would have done is undone once the work already
  // enqueued for it has drained.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      op.abandoned = true;
      if (!op.completion_launched) MarkCompleted(op.seq);  // no completion will ever be reported for it
      ++op.pending;  // AbandonTask's reference
    }
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    if (handler_ns_.size() < kTimings) handler_ns_.push_back(ns);
    else handler_ns_[stats_.handler_calls % kTimings] = ns;
    ++stats_.handler_calls;
    --op.pending;
  cv_.notify_all();  // the host's own reference
    cv_.notify_all();
  }
  // Undone before the handler returns its error, so a retry of the same ticket finds it reloadable.
  if (!st.ok()) AbandonTask(op.seq);
}

void Engine::AbandonTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  const DriverTable& d = Driver(backend_);
  std::unique_lock<std::mutex> lock(mu_);
  // Every host function already launched for this op runs its task first (the resolver releases XLA's
  // stream if it waits on us), so nothing below races a queued resolve: the cell is returned only once
  // no correction can write it, and a ticket is never consumed after the undo.
  cv_.wait(lock, [&] { return op.pending == 1; });
  lock.unlock();
  if (op.stream) d.StreamSynchronize(op.stream);
  for (CUstream s : {h2d_, fix_, d2h_, rel_, ctl_}) d.StreamSynchronize(s);
  staging_.Return(&op.lease, nullptr);  // every stream that touched the cell has drained
  lock.lock();
  if (op.kind == Op::kReload && !op.completion_launched) {
    // The reload never delivered its data: the ticket it resolved to stays reloadable.
    if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
    if (op.actual) op.actual->consumed = false;
    if (op.ticket) {
      if (op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
      op.ticket->pins -= 1;
      Retire(op.ticket);
    }
    if (op.actual) Retire(op.actual);
  } else if (op.kind == Op::kOffload && op.ticket && !op.offloaded_launched) {
    op.ticket->on_host = true;  // nothing is copying into it any more
    op.ticket->dropped = true;  // its data never reached the host in full
    Retire(op.ticket);
  }
  --op.pending;
  cv_.notify_all();
  cv_.notify_all();
}

void Engine::KeepResident(const std::shared_ptr<Ticket>& t, StagingLease* lease, CUstream stream) {
  // Caller holds mu_. The newest K offloads keep their staging cell as a device copy; beyond K the
  // oldest copy that no op is about to read goes back, its free event recorded on d2h_ (after every
  // D2H enqueued so far, its own included).
  t->resident = *lease;
  *lease = StagingLease();
  staging_.Pin(t->resident);
  staging_.Record(&t->resident, stream);  // readers wait for the snapshot
  kept_.push_back(t);
  const size_t keep = static_cast<size_t>(EngineConfig::KeepResident());
  for (auto it = kept_.begin(); kept_.size() > keep && it != kept_.end();) {
    Ticket& old = **it;
    if (old.freed || !old.resident) {
      it = kept_.erase(it);
    } else if (old.pins == 0) {
      staging_.Return(&old.resident, d2h_);
      it = kept_.erase(it);
    } else {
      ++it;
    }
  }
}

Status Engine::Offload(CUstream stream, int64_t site, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out) {
  const auto start = std::chrono::steady_clock::now();
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "offload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) return CapturedOffload(stream, site, src, meta, token_out);
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(TakeErrorFor(stream));
  HostBlock host;
  JAXVMM_RETURN_IF_ERROR(host_store_.Allocate(meta.nbytes, &host).At(-1, "offload"));
  StagingLease lease;
  CUevent d2h_done = nullptr;
  Status st = staging_.Acquire(meta.nbytes, CellUse::kOffload, /*try_only=*/false, &lease);
  if (st.ok()) st = GetEvent(&d2h_done);
  if (!st.ok()) {
    host_store_.Free(host);
    staging_.Return(&lease, nullptr);
    if (d2h_done) Driver(backend_).EventDestroy(d2h_done);
    return st;
  }
  Op* op = nullptr;
  std::shared_ptr<Ticket> t;
  BeginOp(&op, [&](Op& o) {
    o.lease = lease;
    t = tickets_.Create(meta);
    t->offload_seq = o.seq;
    t->host = host;
    t->d2h_done = d2h_done;
    ++stats_.offloads;
    o.kind = Op::kOffload;
    o.meta = meta;
    o.ticket = t;
    o.stream = stream;
    o.staging = lease.address;
    words_[o.seq % kRing].token = t->token;
  });
  Words& w = words_[op->seq % kRing];
  const DriverTable& d = Driver(backend_);
  const char* stage = "offload";
  auto enqueue = [&]() -> Status {
    // XLA's stream: once the cell's previous user is done, snapshot x into it and hand out the token.
    if (lease.wait)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(stream, lease.wait, 0); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(token_out, reinterpret_cast<CUdeviceptr>(&w.token), sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(lease.address, src, meta.nbytes, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->done, stream); }));
    // Copy stream: after the snapshot, D2H into pinned memory; the cell is free once that is done.
    // The one host function after the D2H also reports the op complete (XLA's stream passed it
    // before the D2H began), so an offload costs one host function, not two.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(d2h_, op->done, 0); }));
    JAXVMM_RETURN_IF_ERROR(CopyToHost(d2h_, host, lease.address, meta.nbytes, stage));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(d2h_done, d2h_); }));
    // The host function waits on rel_, not on d2h_: the next D2H never queues behind it.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(rel_, d2h_done, 0); }));
    JAXVMM_RETURN_IF_ERROR(Launch(rel_, &Engine::OnOffloaded, *op, stage));
    std::lock_guard<std::mutex> lock(mu_);
    op->offloaded_launched = op->completion_launched = true;
    t->enqueued = true;
    if (EngineConfig::KeepResident() > 0) KeepResident(t, &op->lease, stream);
    return Status();
  };
  st = enqueue();
  if (st.ok()) st = staging_.Return(&op->lease, d2h_);  // the cell's next user waits for the D2H
  FinishEnqueue(*op, st, start);  // after a failure, AbandonTask returns the cell once the streams drained
  return st;
}

Status Engine::Reload(CUstream stream, int64_t site, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta) {
  const auto start = std::chrono::steady_clock::now();
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "reload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) return CapturedReload(stream, site, token_in, dst, meta);
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(TakeErrorFor(stream));
  StagingLease lease;
  JAXVMM_RETURN_IF_ERROR(staging_.Acquire(meta.nbytes, CellUse::kReload, /*try_only=*/false, &lease));
  Op* op = nullptr;
  Source src;
  BeginOp(&op, [&](Op& o) {
    o.lease = lease;
    ++stats_.reloads;
    o.kind = Op::kReload;
    o.meta = meta;
    o.stream = stream;
    o.staging = lease.address;
    o.ticket = tickets_.Predict(meta, [](const Ticket& t) { return !t.host.pageable; });
    if (o.ticket) {
      o.ticket->claimed_by = o.seq;
      o.ticket->pins += 1;
      o.tag = o.ticket->token;
      src = SourceOf(*o.ticket);
    }
  });
  const uint64_t seq = op->seq;
  Words& w = words_[seq % kRing];
  w.probe.store(0, std::memory_order_relaxed);
  const DriverTable& d = Driver(backend_);
  const char* stage = "reload";
  auto probe = reinterpret_cast<CUdeviceptr>(&w.probe);
  auto ready = reinterpret_cast<CUdeviceptr>(&w.ready);
  auto enqueue = [&]() -> Status {
    // h2d_ (in handler order): once the cell's previous user is done, prefetch the predicted ticket into
    // it. `filled` marks that point for a correction, which must follow it and must not queue behind
    // later ops' prefetches.
    if (lease.wait)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(h2d_, lease.wait, 0); }));
    if (op->ticket) JAXVMM_RETURN_IF_ERROR(CopyTicket(h2d_, src, lease.address, meta.nbytes, "prefetch"));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->filled, h2d_); }));
    if (op->ticket)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(h2d_, ready, seq, 0); }));
    // XLA's stream: let the resolver learn which ticket the GPU holds, without a host round trip on
    // XLA's stream when the prediction was right.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] { return d.MemcpyAsync(probe, token_in, sizeof(uint64_t), stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(ctl_, op->tok, 0); }));
    JAXVMM_RETURN_IF_ERROR(Launch(ctl_, &Engine::OnResolve, *op, stage));
    // XLA's stream waits for exactly this cell: the right ticket (probe == predicted token, or the
    // resolver's correction) and its data in place (ready >= seq). Without a prediction only the
    // resolver writes `ready`, after it has put the right data (or 0xFF) in the cell.
    if (op->ticket)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
        return d.StreamWaitValue64(stream, probe, op->tag, CU_STREAM_WAIT_VALUE_EQ);
      }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(stream, ready, seq, CU_STREAM_WAIT_VALUE_GEQ);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(dst, lease.address, meta.nbytes, stream); }));
    return EnqueueCompletion(*op, stream);
  };
  Status st = enqueue();
  if (st.ok()) st = staging_.Return(&op->lease, stream);  // the next user waits for XLA's copy out of the cell
  FinishEnqueue(*op, st, start);  // after a failure, AbandonTask returns the cell once the streams drained
  return st;
}

Status Engine::Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out) {
  const auto start = std::chrono::steady_clock::now();
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  bool capturing = false;
  JAXVMM_RETURN_IF_ERROR(Capturing(stream, &capturing));
  if (capturing) {
    // A hint cannot be decided at replay: the recorded work only passes the token on. The reload's
    // channel prefetches its own prediction instead.
    return Call(-1, "prefetch (capture)", Entry::kMemcpyAsync,
                [&] { return Driver(backend_).MemcpyAsync(token_out, token_in, sizeof(uint64_t), stream); });
  }
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(TakeErrorFor(stream));
  Op* op = nullptr;
  BeginOp(&op, [&](Op& o) {
    ++stats_.prefetches;
    o.kind = Op::kPrefetch;
    o.stream = stream;
  });
  Words& w = words_[op->seq % kRing];
  const DriverTable& d = Driver(backend_);
  const char* stage = "prefetch";
  auto enqueue = [&]() -> Status {
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] { return d.MemcpyAsync(token_out, token_in, sizeof(uint64_t), stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(&w.probe), token_in, sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(ctl_, op->tok, 0); }));
    JAXVMM_RETURN_IF_ERROR(Launch(ctl_, &Engine::OnResolve, *op, stage));
    return EnqueueCompletion(*op, stream);
  };
  Status st = enqueue();
  FinishEnqueue(*op, st, start);
  return st;
}

// ---------------------------------------------------------------- host functions: post, nothing else

void CUDA_CB Engine::OnResolve(void* p) {
  auto* op = static_cast<Op*>(p);
  uint64_t seq = op->seq;
  op->engine->resolver_->Post([e = op->engine, seq] { e->ResolveTask(seq); });
}

void CUDA_CB Engine::OnComplete(void* p) {
  auto* op = static_cast<Op*>(p);
  uint64_t seq = op->seq;
  op->engine->resolver_->Post([e = op->engine, seq] { e->CompleteTask(seq); });
}

void CUDA_CB Engine::OnOffloaded(void* p) {
  auto* op = static_cast<Op*>(p);
  uint64_t seq = op->seq;
  op->engine->releaser_->Post([e = op->engine, seq] { e->OffloadedTask(seq); });
}

// ---------------------------------------------------------------- workers

void Engine::ReleaseReload(Op& op, bool fill_ff) {
  // Releases XLA's stream for a reload. With `fill_ff` the cell first gets 0xFF bytes, ordered after
  // every copy into it (its prefetch on h2d_, any correction on fix_). If the device cannot do that, the
  // host waits for those streams and retries on ctl_; if that fails too the stream is still released
  // (never left waiting forever) and the error has been reported.
  const DriverTable& d = Driver(backend_);
  Words& w = words_[op.seq % kRing];
  const uint64_t value = op.tag ? op.tag : op.seq;
  auto word = reinterpret_cast<CUdeviceptr>(op.tag ? &w.probe : &w.ready);
  Status st;
  if (fill_ff) {
    st = Call(-1, "reload", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, op.filled, 0); });
    if (st.ok()) st = Call(-1, "reload", Entry::kMemsetD8Async, [&] { return d.MemsetD8Async(op.staging, 0xFF, op.meta.nbytes, fix_); });
    if (!st.ok()) {
      d.StreamSynchronize(h2d_);
      d.StreamSynchronize(fix_);
      st = Call(-1, "reload", Entry::kMemsetD8Async, [&] { return d.MemsetD8Async(op.staging, 0xFF, op.meta.nbytes, ctl_); });
      d.StreamSynchronize(ctl_);
    }
  }
  Status wst = Call(-1, "reload", Entry::kStreamWriteValue64, [&] { return d.StreamWriteValue64(fix_, word, value, 0); });
  if (!wst.ok()) {
    d.StreamSynchronize(fix_);
    reinterpret_cast<std::atomic<uint64_t>*>(word)->store(value, std::memory_order_release);
  }
  if (!st.ok()) Report(op, st);
}

void Engine::ResolveTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  Words& w = words_[seq % kRing];
  const uint64_t token = w.probe.load(std::memory_order_acquire);
  const DriverTable& d = Driver(backend_);
  std::unique_lock<std::mutex> lock(mu_);
  if (op.abandoned) {
    // The enqueue failed after this host function was launched: XLA aborts the execution. Release its
    // stream if it may wait on us, but consume nothing.
    if (op.kind == Op::kReload) {
      lock.unlock();
      ReleaseReload(op, /*fill_ff=*/false);
      lock.lock();
    }
    --op.pending;
  cv_.notify_all();
    return;
  }
  // The token may name a graph-mode offload round the device finished before this op (stream order)
  // whose `filled` the poller has not served: wait for it, else the ticket is "unknown" (kernel grants)
  // or its D2H is not enqueued yet and a copy from its host block would read stale bytes.
  lock.unlock();
  WaitForGraphRound(token);
  lock.lock();
  std::string why;
  std::shared_ptr<Ticket> a = tickets_.Find(token, &why);
  if (a && op.kind == Op::kReload && (a->meta.nbytes != op.meta.nbytes || a->meta.signature != op.meta.signature))
    why = TokenStr(token) + " holds " + std::to_string(a->meta.nbytes) + " bytes of another shape/dtype than the reload expects (" +
          std::to_string(op.meta.nbytes) + " bytes)",
    a = nullptr;

  if (op.kind == Op::kPrefetch) {
    if (!a) {
      lock.unlock();
      Report(op, Status(Code::kInvalidArgument, "prefetch: " + why));
      lock.lock();
    } else if (!a->resident) {
      a->pins += 1;
      op.actual = a;
      lock.unlock();
      Status st = Resident(a);  // a hint: when it cannot be honoured, the reload copies from the host
      if (!st.ok()) std::fprintf(stderr, "%s (prefetch hint skipped)\n", st.ToString().c_str());
      lock.lock();
    }
    --op.pending;
  cv_.notify_all();
    return;
  }

  const bool hit = a && op.ticket == a;
  if (op.ticket && op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
  if (a) {
    MarkReloaded(*a);
    if (a->claimed_by != 0) stale_guesses_ = true;  // a graph-mode reload cell may hold it as a guess
    if (!hit) a->pins += 1;  // a prediction already pinned it
    op.actual = a;
  }
  if (hit) {
    ++stats_.prefetch_hits;
    --op.pending;
  cv_.notify_all();
    return;
  }
  ++stats_.prefetch_misses;
  if (a && op.ticket) tickets_.Learn(a, op.meta.signature);
  const Source src = a ? SourceOf(*a) : Source();
  lock.unlock();

  if (!a) {
    Report(op, Status(Code::kInvalidArgument, "reload: " + why + "; the output was filled with 0xFF bytes"));
    ReleaseReload(op, /*fill_ff=*/true);
  } else {
    // Corrections run on fix_, not h2d_: h2d_ may already hold the prefetches of later ops, which wait
    // for offloads that sit behind this op on XLA's stream. fix_ waits only for this op's own
    // `filled` point, whose inputs all precede this op on XLA's stream.
    Status st = Call(-1, "reload", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, op.filled, 0); });
    if (st.ok()) st = CopyTicket(fix_, src, op.staging, op.meta.nbytes, "reload");
    if (st.ok()) {
      ReleaseReload(op, /*fill_ff=*/false);
    } else {
      // Never release XLA's stream onto the mispredicted ticket's bytes.
      Report(op, Status(st.code(), st.ToString() + " (reload of " + TokenStr(token) + " failed; the output was filled with 0xFF bytes)"));
      ReleaseReload(op, /*fill_ff=*/true);
    }
  }
  lock.lock();
  --op.pending;
  cv_.notify_all();
}

Engine::Source Engine::SourceOf(const Ticket& t) {
  Source src;
  if (t.resident) {
    src.resident = t.resident.address;
    src.resident_ready = t.resident.wait;
  }
  src.d2h_done = t.d2h_done;
  src.d2h_seq = t.d2h_seq;
  src.host = t.host.ptr;
  src.unified = t.host.unified();
  src.pageable = t.host.pageable;
  return src;
}

Engine::Source Engine::RoundSourceOf(const Ticket& t) {
  Source src = SourceOf(t);
  if (!src.resident && t.lent_cell) {
    src.resident = t.lent_cell;  // complete: the round finished before its cell was lent
    ++graph_stats_.lent_reads;
  }
  return src;
}

Status Engine::CopyToHost(CUstream s, const HostBlock& host, CUdeviceptr src, size_t nbytes, const char* stage) {
  const DriverTable& d = Driver(backend_);
  char* dst = static_cast<char*>(host.ptr);
  return InPieces(nbytes, EngineConfig::CopyChunk(), [&](size_t off, size_t n) {
    if (host.unified())
      return Call(-1, stage, Entry::kMemcpyAsync,
                  [&] { return d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst + off), src + off, n, s); });
    return Call(-1, stage, Entry::kMemcpyDtoHAsync, [&] { return d.MemcpyDtoHAsync(dst + off, src + off, n, s); });
  });
}

Status Engine::CopyFromHost(CUstream s, CUdeviceptr dst, const void* src, bool unified, size_t nbytes, const char* stage) {
  const DriverTable& d = Driver(backend_);
  const char* from = static_cast<const char*>(src);
  return InPieces(nbytes, EngineConfig::CopyChunk(), [&](size_t off, size_t n) {
    if (unified)
      return Call(-1, stage, Entry::kMemcpyAsync,
                  [&] { return d.MemcpyAsync(dst + off, reinterpret_cast<CUdeviceptr>(from + off), n, s); });
    return Call(-1, stage, Entry::kMemcpyHtoDAsync, [&] { return d.MemcpyHtoDAsync(dst + off, from + off, n, s); });
  });
}

Status Engine::CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, const char* stage) {
  const DriverTable& d = Driver(backend_);
  if (src.resident) {
    if (src.resident_ready)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.resident_ready, 0); }));
    return Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(dst, src.resident, nbytes, s); });
  }
  if (src.d2h_seq)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(s, reinterpret_cast<CUdeviceptr>(gd2h_done_), src.d2h_seq, CU_STREAM_WAIT_VALUE_GEQ);
    }));
  else if (src.d2h_done)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.d2h_done, 0); }));
  if (src.pageable) return BounceForThisThread().FromHost(s, dst, src.host, nbytes, stage);
  return CopyFromHost(s, dst, src.host, src.unified, nbytes, stage);
}

Status Engine::Resident(const std::shared_ptr<Ticket>& t) {
  // A prefetch hint: copy the ticket to a staging cell now (on fix_), if the budget has room without
  // waiting. Its readers wait for the cell's free event, recorded right after the copy.
  StagingLease lease;
  JAXVMM_RETURN_IF_ERROR(staging_.Acquire(t->meta.nbytes, CellUse::kReload, /*try_only=*/true, &lease));
  if (!lease) return Status(Code::kOutOfMemory, "prefetch: no staging cell free within the staging budget");
  const DriverTable& d = Driver(backend_);
  Source host_only;
  {
    std::lock_guard<std::mutex> lock(mu_);
    host_only.d2h_done = t->d2h_done;
    host_only.d2h_seq = t->d2h_seq;
    host_only.host = t->host.ptr;
    host_only.unified = t->host.unified();
    host_only.pageable = t->host.pageable;
  }
  Status st;
  if (lease.wait) st = Call(-1, "prefetch", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, lease.wait, 0); });
  if (st.ok()) st = CopyTicket(fix_, host_only, lease.address, t->meta.nbytes, "prefetch");
  if (st.ok()) st = staging_.Record(&lease, fix_);  // readers wait for this event: the copy is in
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok() || t->resident || t->freed) {
    staging_.Return(&lease, fix_);
    return st;
  }
  staging_.Pin(lease);
  t->resident = lease;
  return Status();
}

void Engine::Retire(const std::shared_ptr<Ticket>& t) {
  // Caller holds mu_. Frees once nothing can read the host block or the device copy any more.
  Retired r;
  if (!tickets_.MaybeFree(t, &r)) return;
  if (r.d2h_done) event_pool_.push_back(r.d2h_done);
  host_store_.Free(r.host);
  // Every reader of the device copy has completed (its op's completion dropped the pin), so the cell
  // is free once the copy that filled it is (its last recorded free event).
  if (r.resident) staging_.Return(&r.resident, nullptr);
}

void Engine::Completed(uint64_t seq) {
  // Caller holds mu_. Drops that waited for the GPU to pass every op enqueued before them.
  MarkCompleted(seq);
  for (auto it = pending_drops_.begin(); it != pending_drops_.end();) {
    if (it->second > completed_seq_) {
      ++it;
      continue;
    }
    std::string why;
    if (auto t = tickets_.Find(it->first, &why)) {
      t->dropped = true;
      if (t->claimed_by != 0) stale_guesses_ = true;  // a graph-mode reload cell may hold it as a guess
      ++stats_.drops;
      Retire(t);
    }
    it = pending_drops_.erase(it);
  }
}

void Engine::CompleteTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  std::lock_guard<std::mutex> lock(mu_);
  Completed(seq);
  if (op.kind == Op::kReload) {
    if (op.ticket) op.ticket->pins -= 1, Retire(op.ticket);
    if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
    if (op.actual) Retire(op.actual);
  } else if (op.kind == Op::kPrefetch && op.actual) {
    op.actual->pins -= 1;
    Retire(op.actual);
  }
  --op.pending;
  cv_.notify_all();
  cv_.notify_all();
}

void Engine::OffloadedTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  std::lock_guard<std::mutex> lock(mu_);
  if (op.ticket) {
    op.ticket->on_host = true;
    Retire(op.ticket);
  }
  Completed(seq);
  --op.pending;
  cv_.notify_all();
}

void Engine::Drop(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_drops_.emplace_back(token, next_seq_ - 1);
  if (next_seq_ - 1 <= completed_seq_) {
    std::string why;
    if (auto t = tickets_.Find(token, &why)) {
      t->dropped = true;
      if (t->claimed_by != 0) stale_guesses_ = true;  // a graph-mode reload cell may hold it as a guess
      ++stats_.drops;
      Retire(t);
    }
    pending_drops_.pop_back();
  }
}

Status Engine::CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve) {
  WaitForGraphRound(token);  // a graph-mode round that made this token may not be served yet
  std::lock_guard<std::mutex> lock(mu_);
  std::string why;
  auto t = tickets_.Find(token, &why);
  if (!t) return Status(Code::kInvalidArgument, why);
  if (t->reserved && !t->kept)
    return Status(Code::kInvalidArgument, TokenStr(token) + " was already reloaded (a ticket can be reloaded once)");
  if (t->meta.nbytes != meta.nbytes || t->meta.signature != meta.signature)
    return Status(Code::kInvalidArgument, TokenStr(token) + " does not match the shape/dtype of the reload");
  if (reserve && !t->kept) t->reserved = true;  // the eager reload that follows is the one allowed reload
  return Status();
}

Status Engine::Keep(uint64_t token) {
  WaitForGraphRound(token);
  std::lock_guard<std::mutex> lock(mu_);
  std::string why;
  auto t = tickets_.Find(token, &why);
  if (!t) return Status(Code::kInvalidArgument, why);
  t->kept = true;
  t->reserved = false;
  return Status();
}

void Engine::Unreserve(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string why;
  if (auto t = tickets_.Find(token, &why)) t->reserved = false;
}

Status Engine::Synchronize() {
  {
    // Graph-mode rounds in progress first (the poller serves them; a replay still running ends them).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    std::unique_lock<std::mutex> lock(graph_mu_);
    for (;;) {
      // Here too, not only in the poller: an engine with no graph channel has no poller.
      DropStaleGuesses();
      ReleaseUnpins(/*all=*/false);
      if (GraphIdle()) break;
      if (std::chrono::steady_clock::now() > deadline) return Status(Code::kInternal, "graph-mode rounds did not finish within 120 s");
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      lock.lock();
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, std::chrono::seconds(120), [&] {
      for (auto& op : ops_)
        if (op.pending) return false;
      return true;
    });
    if (!ok) return Status(Code::kInternal, "engine did not drain within 120 s (a reload waiting for a ticket that never comes?)");
  }
  resolver_->Drain();
  releaser_->Drain();
  return Status();
}

size_t Engine::Trim() {
  size_t n = staging_.Trim() + host_store_.Trim();
  ScopedContext ctx(backend_, device_);  // a user thread: the cells' event queries and revocations
  std::lock_guard<std::mutex> lock(graph_mu_);
  (void)ReturnSpares();  // spares whose last reader finished since the poller's last pass
  return n + ReleaseIdleCells(/*now=*/true);
}

std::vector<std::pair<uint64_t, uint64_t>> Engine::UnclaimedTickets() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  tickets_.ForEach([&](const Ticket& t) {
    if (!t.consumed && !t.reserved && !t.dropped && t.claimed_by == 0) out.emplace_back(t.token, t.offload_seq);
  });
  return out;
}

void Engine::SetNextTicketNumber(uint32_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  tickets_.SetNextNumber(n);
}

void Engine::ResetPeaks() {
  host_store_.ResetPeak();
  staging_.ResetPeak();
}

EngineStats Engine::Stats() {
  std::lock_guard<std::mutex> glock(graph_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.graph = graph_stats_;
  s.graph.bounce_copies = bounce_.copies() + ring_bounce_.copies();
  s.tickets_live = static_cast<int64_t>(tickets_.live());
  s.ticket_host_bytes = tickets_.host_bytes();
  s.ops_in_flight = static_cast<int64_t>(next_seq_ - 1 - completed_seq_);
  s.seq_issued = static_cast<int64_t>(next_seq_ - 1);
  s.seq_completed = static_cast<int64_t>(completed_seq_);
  if (!handler_ns_.empty()) {
    std::vector<int64_t> v = handler_ns_;
    std::sort(v.begin(), v.end());
    s.handler_median_ns = v[v.size() / 2];
    s.handler_p99_ns = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  }
  s.host = host_store_.Stats(HostStoreKind::kPinned);
  s.host_numa = host_store_.Stats(HostStoreKind::kHostNuma);
  s.host_store = HostStore::Current();
  s.staging = staging_.Stats();
  return s;
}

}  // namespace jaxvmm
