#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "vmm.h"

namespace jaxvmm {
namespace {

constexpr uint64_t kRing = 1024;  // ops in flight per engine before the host waits for the GPU
constexpr uint64_t kNoTag = 0;    // "no prediction": never a valid token

std::atomic<int> g_depth{-1};
std::atomic<int> g_keep{-1};

uint64_t Salt() {
  static const uint64_t salt = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  return salt;
}

// The check word mixes a per-process salt with the engine's (backend, device), so a token is valid
// only on the engine that issued it: tickets of another device or process are refused, not misread.
uint32_t Check(uint64_t id, uint64_t engine_key) {
  uint64_t z = id ^ Salt() ^ (engine_key * 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<uint32_t>(z ^ (z >> 31)) | 1u;  // never 0, so no token is kNoTag
}

uint64_t MakeToken(uint64_t id, uint64_t key) {
  return (id & 0xffffffffULL) | (uint64_t{Check(id & 0xffffffffULL, key)} << 32);
}
bool TokenValid(uint64_t token, uint64_t key) {
  return (token >> 32) == Check(token & 0xffffffffULL, key) && (token & 0xffffffffULL);
}

std::string TokenStr(uint64_t token) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "ticket %llu", static_cast<unsigned long long>(token & 0xffffffffULL));
  return buf;
}

std::mutex g_engines_mu;
std::map<std::pair<int, int>, std::unique_ptr<Engine>>& Engines() {
  static auto* m = new std::map<std::pair<int, int>, std::unique_ptr<Engine>>();
  return *m;
}

}  // namespace

void EngineConfig::SetPrefetchDepth(int depth) { g_depth.store(std::max(depth, 1)); }
int EngineConfig::PrefetchDepth() {
  int d = g_depth.load();
  if (d > 0) return d;
  const char* env = std::getenv("JAXVMM_PREFETCH_DEPTH");
  d = env ? std::atoi(env) : 0;
  return d > 0 ? d : 2;
}

void EngineConfig::SetKeepResident(int n) { g_keep.store(std::max(n, 0)); }
int EngineConfig::KeepResident() {
  int k = g_keep.load();
  if (k >= 0) return k;
  const char* env = std::getenv("JAXVMM_KEEP_RESIDENT");
  k = env ? std::atoi(env) : 0;
  return k > 0 ? k : 0;
}

struct Engine::Ticket {
  uint64_t token = 0;
  ArrayMeta meta;
  HostBlock host;
  CUevent d2h_done = nullptr;  // recorded on the D2H stream after the copy
  uint64_t offload_seq = 0;
  bool enqueued = false;     // its D2H and d2h_done are on the D2H stream
  bool on_host = false;      // D2H finished and seen by the releaser
  bool consumed = false;     // a reload resolved to it
  bool reserved = false;     // an eager reload checked it (a second eager reload is refused)
  bool dropped = false;      // Python let go of it
  uint64_t claimed_by = 0;   // the reload op that predicted it, until that op resolves
  int pins = 0;              // ops that may still read its host block
  bool freed = false;
  int64_t resident_id = -1;  // device copy: a prefetch hint's, or the offload's own staging (kept)
  size_t resident_size = 0;
  CUdeviceptr resident = 0;
  CUevent resident_ready = nullptr;  // null: the copy is complete (kept offload staging)
};

struct Engine::Op {
  enum Kind { kOffload, kReload, kPrefetch };
  Engine* engine = nullptr;
  uint64_t seq = 0;
  Kind kind = kOffload;
  int pending = 0;  // callbacks still to run; the ring entry is reusable at 0
  bool mapped = false, map_failed = false;
  bool completion_launched = false;  // OnComplete is on ctl_: CompleteTask will run
  bool offloaded_launched = false;   // OnOffloaded is on d2h_: OffloadedTask will run
  CUstream stream = nullptr;         // XLA's stream for the op (null on cpu)
  int64_t staging_id = -1;
  size_t staging_size = 0;
  CUdeviceptr staging = 0;
  ArrayMeta meta;
  std::shared_ptr<Ticket> ticket;  // offload: its ticket; reload: the prediction (may be null)
  std::shared_ptr<Ticket> actual;  // reload/prefetch: what the token resolved to
  uint64_t tag = kNoTag;
  bool has_pages = false;        // the staging holds pages (mapped, or a later prefetch step failed)
  bool filled_recorded = false;  // the mapper prefetched into the staging and recorded `filled`
  CUevent tok = nullptr, done = nullptr, filled = nullptr;
};

// ---------------------------------------------------------------- lifetime

Engine::Engine(Backend b, int device) : backend_(b), device_(device), host_pool_(b, device) {}

Status Engine::For(Backend b, int device, Engine** out) {
  std::lock_guard<std::mutex> lock(g_engines_mu);
  auto& m = Engines();
  auto key = std::make_pair(static_cast<int>(b), device);
  auto it = m.find(key);
  if (it != m.end()) {
    *out = it->second.get();
    return Status();
  }
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

void Engine::ShutdownAll() {
  std::map<std::pair<int, int>, std::unique_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(g_engines_mu);
    engines.swap(Engines());
  }
  for (auto& [k, e] : engines) {
    Status st = e->Synchronize();
    if (!st.ok()) std::fprintf(stderr, "%s (at shutdown)\n", st.ToString().c_str());
    std::lock_guard<std::mutex> lock(e->mu_);
    e->shutting_down_ = true;
    e->cv_.notify_all();
  }
  engines.clear();
}

Status Engine::Init() {
  JAXVMM_RETURN_IF_ERROR(CheckCapability(backend_, device_, Location{CU_MEM_LOCATION_TYPE_DEVICE, device_}));
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  const DriverTable& d = Driver(backend_);
  const char* stage = "engine init";
  // Copies run on their own streams so D2H and H2D overlap each other and XLA's compute; ctl_ only
  // carries event waits and host functions, so bookkeeping never queues behind a large copy.
  for (CUstream* s : {&d2h_, &h2d_, &fix_, &ctl_})
    JAXVMM_RETURN_IF_ERROR(
        Call(-1, stage, Entry::kStreamCreateWithPriority, [&] { return d.StreamCreateWithPriority(s, CU_STREAM_NON_BLOCKING, 0); }));
  void* words = nullptr;
  JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemHostAlloc, [&] {
    return d.MemHostAlloc(&words, sizeof(Words) * kRing, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
  }));
  words_ = static_cast<Words*>(words);
  for (uint64_t i = 0; i < kRing; ++i) {
    new (&words_[i]) Words();
    words_[i].probe.store(0);
    words_[i].ready.store(0);
    words_[i].token = 0;
  }
  ops_.resize(kRing);
  for (auto& op : ops_) {
    op.engine = this;
    for (CUevent* e : {&op.tok, &op.done, &op.filled})
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventCreate, [&] {
        return d.EventCreate(e, CU_EVENT_DISABLE_TIMING);
      }));
  }
  mapper_ = std::make_unique<Worker>("jaxvmm-map", backend_, device_);
  resolver_ = std::make_unique<Worker>("jaxvmm-resolve", backend_, device_);
  releaser_ = std::make_unique<Worker>("jaxvmm-release", backend_, device_);
  return Status();
}

Engine::~Engine() {
  mapper_.reset();
  resolver_.reset();
  releaser_.reset();
  ScopedContext ctx(backend_, device_);
  const DriverTable& d = Driver(backend_);
  for (CUstream s : {h2d_, fix_, d2h_, ctl_})  // nothing of ours may still read what is freed below
    if (s) d.StreamSynchronize(s);
  Registry& reg = Registry::Get();
  for (auto& [token, t] : tickets_) {
    host_pool_.Free(t->host);
    if (t->resident_id >= 0) reg.Close(t->resident_id);
    if (t->d2h_done) d.EventDestroy(t->d2h_done);
    if (t->resident_ready) d.EventDestroy(t->resident_ready);
  }
  for (auto& [size, ids] : free_staging_)
    for (int64_t id : ids) reg.Close(id);
  if (warm_) reg.Close(warm_->id);
  for (auto& op : ops_) {
    for (CUevent e : {op.tok, op.done, op.filled})
      if (e) d.EventDestroy(e);
  }
  for (CUevent e : event_pool_) d.EventDestroy(e);
  for (CUstream s : {d2h_, h2d_, fix_, ctl_})
    if (s) d.StreamDestroy(s);
  if (words_) d.MemFreeHost(words_);
}

// ---------------------------------------------------------------- host side

Status Engine::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  Status e = error_;
  error_ = Status();
  return e;
}

void Engine::RecordError(const Status& st) {
  // Caller holds mu_. The first error is kept (sticky) until a handler or check() takes it.
  if (error_.ok()) error_ = st;
  ++stats_.errors;
}

void Engine::Fail(const Status& st) {
  std::fprintf(stderr, "%s\n", st.ToString().c_str());
  std::lock_guard<std::mutex> lock(mu_);
  RecordError(st);
}

Status Engine::BeginOp(Op** out, const std::function<void(Op&)>& fill, bool map) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!error_.ok()) {
    Status e = error_;
    error_ = Status();
    return e;
  }
  // Backpressure (the host may run at most kRing ops ahead of the GPU): wait for the ring entry
  // *before* taking the sequence number, so numbers are taken, filled and handed to the mapper in
  // one critical section. Handlers can run on several threads at once; the mapper must see ops in
  // sequence order or its GPU-progress gate could wait on an op queued behind it.
  cv_.wait(lock, [&] { return ops_[next_seq_ % kRing].pending == 0; });
  uint64_t seq = next_seq_++;
  Op& op = ops_[seq % kRing];
  op.seq = seq;
  op.pending = 1;  // the host's reference, dropped by FinishEnqueue
  op.mapped = op.map_failed = op.has_pages = op.filled_recorded = false;
  op.completion_launched = op.offloaded_launched = false;
  op.staging_id = -1;
  op.staging_size = 0;
  op.staging = 0;
  op.stream = nullptr;
  op.ticket.reset();
  op.actual.reset();
  op.tag = kNoTag;
  fill(op);
  if (map) mapper_->Post([this, seq] { MapTask(seq); });
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

Status Engine::AcquireStaging(size_t nbytes, std::shared_ptr<Slot>* out, int64_t* id) {
  Location loc{CU_MEM_LOCATION_TYPE_DEVICE, device_};
  size_t g = 0;
  JAXVMM_RETURN_IF_ERROR(Granularity(backend_, device_, loc, &g));
  size_t size = (nbytes + g - 1) / g * g;
  Registry& reg = Registry::Get();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& v = free_staging_[size];
    if (!v.empty()) {
      *id = v.back();
      v.pop_back();
      return reg.Lookup(*id, out);
    }
  }
  SlotSpec spec;
  spec.backend = backend_;
  spec.device = device_;
  spec.location = loc;
  spec.nbytes = size;
  spec.map_on_create = false;  // a VA only: pages come just in time from the mapper
  spec.internal = true;        // jaxvmm's, not the user's: counted apart in stats()
  JAXVMM_RETURN_IF_ERROR(reg.Create(spec, id));
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.staging_slots;
  return reg.Lookup(*id, out);
}

void Engine::ReturnStaging(int64_t id, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  free_staging_[size].push_back(id);
}

std::shared_ptr<Engine::Ticket> Engine::Predict(const ArrayMeta& meta) {
  // Caller holds mu_.
  static const bool enabled = [] {
    const char* v = std::getenv("JAXVMM_PREDICT");
    return !(v && std::string(v) == "0");
  }();
  if (!enabled) return nullptr;
  // Training reloads in reverse offload order (LIFO); a run of misses that hit the other end of the
  // queue flips the guess (see ResolveTask). Only tickets whose D2H is enqueued (d2h_done recorded)
  // can be prefetched.
  auto fits = [&](const std::shared_ptr<Ticket>& t) {
    return t->enqueued && !t->consumed && !t->dropped && t->claimed_by == 0 && t->meta.nbytes == meta.nbytes &&
           t->meta.signature == meta.signature;
  };
  if (lifo_) {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (fits(*it)) return *it;
  } else {
    for (auto& t : order_)
      if (fits(t)) return t;
  }
  return nullptr;
}

Status Engine::Launch(CUstream stream, CUhostFn fn, Op& op, const char* stage) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++op.pending;  // before the launch: the host function may run (and decrement) at once
  }
  const DriverTable& d = Driver(backend_);
  Status st = Call(op.staging_id, stage, Entry::kLaunchHostFunc, [&] { return d.LaunchHostFunc(stream, fn, &op); });
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--op.pending == 0) cv_.notify_all();
  }
  return st;
}

void Engine::FinishEnqueue(Op& op, const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    RecordError(st);
    const bool undo_completion = !op.completion_launched;
    const bool undo_offloaded = op.kind == Op::kOffload && !op.offloaded_launched;
    if (undo_completion) MarkCompleted(op.seq);  // no completion will ever be reported for it
    if (undo_completion || undo_offloaded) {
      // Undo what the missing callbacks would have done, once work already enqueued for this op has
      // drained (a copy may still read or write its staging pages or the ticket's host block).
      ++op.pending;
      const uint64_t seq = op.seq;
      releaser_->Post([this, seq, undo_completion, undo_offloaded] { AbandonTask(seq, undo_completion, undo_offloaded); });
    }
  }
  if (--op.pending == 0) cv_.notify_all();  // the host's own reference
  cv_.notify_all();
}

void Engine::AbandonTask(uint64_t seq, bool undo_completion, bool undo_offloaded) {
  Op& op = ops_[seq % kRing];
  const DriverTable& d = Driver(backend_);
  if (op.stream) d.StreamSynchronize(op.stream);
  for (CUstream s : {h2d_, fix_, d2h_, ctl_}) d.StreamSynchronize(s);
  bool release = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (op.kind == Op::kReload && undo_completion) {
      if (op.ticket) {
        if (op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
        op.ticket->pins -= 1;
        FreeTicket(op.ticket);
      }
      if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
      if (op.actual) FreeTicket(op.actual);
      if (op.mapped) --reload_mapped_;
      release = op.staging_id >= 0;
    }
    if (op.kind == Op::kOffload && undo_offloaded) {
      if (op.ticket) {
        op.ticket->on_host = true;  // nothing is copying into it any more
        op.ticket->dropped = true;  // its data never reached the host in full
        FreeTicket(op.ticket);
      }
      release = op.staging_id >= 0;
    }
  }
  if (release) {
    if (op.has_pages) ReleaseStaging(op.staging_id, op.staging_size);
    else ReturnStaging(op.staging_id, op.staging_size);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (--op.pending == 0) cv_.notify_all();
  cv_.notify_all();
}

Status Engine::WaitMapped(Op& op) {
  // The driver validates copy addresses when a copy is enqueued, so the staging pages must exist
  // before XLA's stream gets any copy that touches them. The mapper maps them once GPU progress
  // allows (op seq - depth passed), which bounds how far the host runs ahead of the GPU.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return op.mapped || op.map_failed; });
  if (op.map_failed) return Status(Code::kOutOfMemory, "staging pages could not be mapped").At(op.staging_id, "map");
  return Status();
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

Status Engine::Offload(CUstream stream, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out) {
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "offload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  auto t = std::make_shared<Ticket>();
  t->meta = meta;
  JAXVMM_RETURN_IF_ERROR(host_pool_.Allocate(meta.nbytes, &t->host).At(-1, "offload"));
  std::shared_ptr<Slot> staging;
  int64_t staging_id = -1;
  Status st = AcquireStaging(meta.nbytes, &staging, &staging_id);
  if (!st.ok()) {
    host_pool_.Free(t->host);
    return st;
  }
  const DriverTable& d = Driver(backend_);
  Op* op = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!event_pool_.empty()) {
      t->d2h_done = event_pool_.back();
      event_pool_.pop_back();
    }
  }
  if (!t->d2h_done) st = Call(-1, "offload", Entry::kEventCreate, [&] { return d.EventCreate(&t->d2h_done, CU_EVENT_DISABLE_TIMING); });
  if (st.ok())
    st = BeginOp(&op, [&](Op& o) {
      t->token = MakeToken(next_ticket_++, EngineKey());
      t->offload_seq = o.seq;
      tickets_[t->token] = t;
      order_.push_back(t);
      ++stats_.offloads;
      o.kind = Op::kOffload;
      o.meta = meta;
      o.ticket = t;
      o.stream = stream;
      o.staging_id = staging_id;
      o.staging_size = staging->size();
      o.staging = staging->address();
      words_[o.seq % kRing].token = t->token;
    }, /*map=*/true);
  if (!st.ok()) {
    host_pool_.Free(t->host);
    std::lock_guard<std::mutex> lock(mu_);
    if (t->d2h_done) event_pool_.push_back(t->d2h_done);
    free_staging_[staging->size()].push_back(staging_id);
    return st;
  }
  Words& w = words_[op->seq % kRing];

  // XLA's stream: snapshot x into the staging slot (mapped by now), hand out the token.
  const char* stage = "offload";
  auto enqueue = [&]() -> Status {
    JAXVMM_RETURN_IF_ERROR(WaitMapped(*op));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(token_out, reinterpret_cast<CUdeviceptr>(&w.token), sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kMemcpyDtoDAsync, [&] {
      return d.MemcpyDtoDAsync(op->staging, src, meta.nbytes, stream);
    }));
    JAXVMM_RETURN_IF_ERROR(EnqueueCompletion(*op, stream));
    // Copy stream: after the snapshot, D2H into pinned memory, then wake the releaser.
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(d2h_, op->done, 0); }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kMemcpyDtoHAsync, [&] {
      return d.MemcpyDtoHAsync(t->host.ptr, op->staging, meta.nbytes, d2h_);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kEventRecord, [&] { return d.EventRecord(t->d2h_done, d2h_); }));
    JAXVMM_RETURN_IF_ERROR(Launch(d2h_, &Engine::OnOffloaded, *op, stage));
    std::lock_guard<std::mutex> lock(mu_);
    op->offloaded_launched = true;
    t->enqueued = true;
    return Status();
  };
  st = enqueue();
  FinishEnqueue(*op, st);
  return st;
}

Status Engine::Reload(CUstream stream, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta) {
  if (meta.nbytes == 0) return Status(Code::kInvalidArgument, "reload of a zero-size array");
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  std::shared_ptr<Slot> staging;
  int64_t staging_id = -1;
  JAXVMM_RETURN_IF_ERROR(AcquireStaging(meta.nbytes, &staging, &staging_id));
  Op* op = nullptr;
  Status st = BeginOp(&op, [&](Op& o) {
    ++stats_.reloads;
    o.kind = Op::kReload;
    o.meta = meta;
    o.stream = stream;
    o.staging_id = staging_id;
    o.staging_size = staging->size();
    o.staging = staging->address();
    o.ticket = Predict(meta);
    if (o.ticket) {
      o.ticket->claimed_by = o.seq;
      o.ticket->pins += 1;
      o.tag = o.ticket->token;
    }
  }, /*map=*/true);
  if (!st.ok()) {
    ReturnStaging(staging_id, staging->size());
    return st;
  }
  const uint64_t seq = op->seq;
  Words& w = words_[seq % kRing];

  const DriverTable& d = Driver(backend_);
  const char* stage = "reload";
  auto probe = reinterpret_cast<CUdeviceptr>(&w.probe);
  auto enqueue = [&]() -> Status {
    JAXVMM_RETURN_IF_ERROR(WaitMapped(*op));
    // Let the resolver learn which ticket the GPU holds, without a host round trip on XLA's stream.
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(probe, token_in, sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(ctl_, op->tok, 0); }));
    JAXVMM_RETURN_IF_ERROR(Launch(ctl_, &Engine::OnResolve, *op, stage));
    // XLA's stream waits for exactly this slot: the right ticket (probe == predicted token, or the
    // resolver's correction) and its data in place (ready >= seq).
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(stream, probe, op->tag, CU_STREAM_WAIT_VALUE_EQ);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(stream, reinterpret_cast<CUdeviceptr>(&w.ready), seq, CU_STREAM_WAIT_VALUE_GEQ);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(op->staging_id, stage, Entry::kMemcpyDtoDAsync, [&] {
      return d.MemcpyDtoDAsync(dst, op->staging, meta.nbytes, stream);
    }));
    return EnqueueCompletion(*op, stream);
  };
  st = enqueue();
  FinishEnqueue(*op, st);
  return st;
}

Status Engine::Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out) {
  ScopedContext ctx(backend_, device_);
  JAXVMM_RETURN_IF_ERROR(ctx.status());
  Op* op = nullptr;
  JAXVMM_RETURN_IF_ERROR(BeginOp(&op, [&](Op& o) {
    ++stats_.prefetches;
    o.kind = Op::kPrefetch;
    o.stream = stream;
  }, /*map=*/false));
  Words& w = words_[op->seq % kRing];
  const DriverTable& d = Driver(backend_);
  const char* stage = "prefetch";
  auto enqueue = [&]() -> Status {
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(token_out, token_in, sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(&w.probe), token_in, sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(ctl_, op->tok, 0); }));
    JAXVMM_RETURN_IF_ERROR(Launch(ctl_, &Engine::OnResolve, *op, stage));
    return EnqueueCompletion(*op, stream);
  };
  Status st = enqueue();
  FinishEnqueue(*op, st);
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

void Engine::MapTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  const int depth = EngineConfig::PrefetchDepth();
  bool handed = false, filled = false;
  {
    // Gate on GPU progress: pages for op `seq` appear only once op `seq - depth` has passed XLA's
    // stream, so mapped staging stays <= depth x largest slot + offloads still copying out.
    // Reload staging is also capped at `depth` slots holding pages at once: pages of finished reloads
    // come back on the releaser, and a lagging releaser must not let mapped bytes grow.
    std::unique_lock<std::mutex> lock(mu_);
    map_head_ = seq;
    cv_.wait(lock, [&] { return MapGateOpen(op, depth) || shutting_down_; });
    map_head_ = 0;
    // Pages a finished op left for us (RetireStaging parks them only for this op, so the size
    // matches) are taken as they are: no unmap, release, create, map or access call, and no driver
    // work beside the copies in flight.
    if (warm_ && !shutting_down_) {
      free_staging_[op.staging_size].push_back(op.staging_id);  // our VA had no pages yet
      op.staging_id = warm_->id;
      op.staging = warm_->address;
      handed = true;
      ++stats_.staging_handoffs;
    } else if (warm_) {
      releaser_->Post([this, w = *warm_] { ReleaseStaging(w.id, w.size); });
    }
    warm_.reset();
    if (shutting_down_) {
      op.map_failed = true;
      cv_.notify_all();
      return;
    }
  }
  Registry& reg = Registry::Get();
  Status st = handed ? Status() : reg.Remap(op.staging_id);
  for (int attempt = 1; !st.ok() && st.code() == Code::kOutOfMemory && attempt <= 50; ++attempt) {
    // Pages of finished ops are being returned right now; give the releaser a moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(10 * attempt));
    st = reg.Remap(op.staging_id);
  }
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    op.has_pages = true;  // whatever fails below, these pages must be released, not returned as a bare VA
  }
  Words& w = words_[seq % kRing];
  const DriverTable& d = Driver(backend_);
  if (st.ok() && op.kind == Op::kReload && op.ticket) {
    // Prefetch the predicted ticket into the slot (H2D after its D2H, or D2D from a device copy it
    // kept), then mark the slot ready. The prediction pins the ticket, so its copies stay put.
    Source src;
    {
      std::lock_guard<std::mutex> lock(mu_);
      src = SourceOf(*op.ticket);
    }
    st = CopyTicket(h2d_, src, op.staging, op.meta.nbytes, op.staging_id, "prefetch");
    // A correction of this op (resolver, on fix_) must land after this copy, and must not queue
    // behind later ops' prefetches: it waits for this event only.
    if (st.ok()) st = Call(op.staging_id, "prefetch", Entry::kEventRecord, [&] { return d.EventRecord(op.filled, h2d_); });
    if (st.ok()) filled = true;
    if (st.ok())
      st = Call(op.staging_id, "prefetch", Entry::kStreamWriteValue64, [&] {
        return d.StreamWriteValue64(h2d_, reinterpret_cast<CUdeviceptr>(&w.ready), seq, 0);
      });
  } else if (st.ok()) {
    w.ready.store(seq, std::memory_order_release);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    op.map_failed = true;
    RecordError(st);
    std::fprintf(stderr, "%s (the op that needed these pages fails)\n", st.ToString().c_str());
  } else {
    op.mapped = true;
    if (op.kind == Op::kReload) ++reload_mapped_;
  }
  op.filled_recorded = filled;
  cv_.notify_all();
}

std::shared_ptr<Engine::Ticket> Engine::FindTicket(uint64_t token, std::string* why) {
  // Caller holds mu_.
  if (!TokenValid(token, EngineKey())) {
    *why = "the token is not a jaxvmm ticket of this device (forged, corrupted, or from another device or process)";
    return nullptr;
  }
  auto it = tickets_.find(token);
  if (it == tickets_.end()) {
    bool reloaded = std::find(recently_reloaded_.begin(), recently_reloaded_.end(), token) != recently_reloaded_.end();
    *why = TokenStr(token) + (reloaded ? " was already reloaded (a ticket can be reloaded once)"
                                       : " is gone (reloaded earlier, dropped, or from another device)");
    return nullptr;
  }
  return it->second;
}

void Engine::ResolveTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  Words& w = words_[seq % kRing];
  const uint64_t token = w.probe.load(std::memory_order_acquire);
  const DriverTable& d = Driver(backend_);
  std::unique_lock<std::mutex> lock(mu_);
  std::string why;
  std::shared_ptr<Ticket> a = FindTicket(token, &why);
  if (a && a->consumed) why = TokenStr(token) + " was already reloaded (a ticket can be reloaded once)", a = nullptr;
  // A dropped ticket is still served while its block exists: jit dispatch is asynchronous, so a reload
  // can reach the engine after Python let go of the ticket.
  if (a && op.kind == Op::kReload && (a->meta.nbytes != op.meta.nbytes || a->meta.signature != op.meta.signature))
    why = TokenStr(token) + " holds " + std::to_string(a->meta.nbytes) + " bytes of another shape/dtype than the reload expects (" +
          std::to_string(op.meta.nbytes) + " bytes)",
    a = nullptr;

  if (op.kind == Op::kPrefetch) {
    if (!a) {
      lock.unlock();
      Fail(Status(Code::kInvalidArgument, "prefetch: " + why));
      lock.lock();
    } else if (a->resident_id < 0) {
      a->pins += 1;
      op.actual = a;
      lock.unlock();
      Status st = Resident(a);
      if (!st.ok()) Fail(st);
      lock.lock();
    }
    if (--op.pending == 0) cv_.notify_all();
    return;
  }

  const bool hit = a && op.ticket == a;
  if (op.ticket && op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
  if (a) {
    a->consumed = true;
    if (!hit) a->pins += 1;  // a prediction already pinned it
    op.actual = a;
  }
  if (hit) {
    ++stats_.prefetch_hits;
    if (--op.pending == 0) cv_.notify_all();
    return;
  }
  ++stats_.prefetch_misses;
  if (a && op.ticket) {
    // Learn the order: a miss that took the oldest candidate means reloads run first-in first-out.
    std::shared_ptr<Ticket> oldest, newest;
    for (auto& t : order_)
      if (!t->dropped && t->meta.signature == op.meta.signature && (!t->consumed || t == a)) {
        if (!oldest) oldest = t;
        newest = t;
      }
    if (a == oldest && a != newest) lifo_ = false;
    if (a == newest && a != oldest) lifo_ = true;
  }
  // The slot must have pages before anything is copied into it.
  cv_.wait(lock, [&] { return op.mapped || op.map_failed; });
  const bool mapped = op.mapped;
  const bool filled = op.filled_recorded;
  const Source src = a ? SourceOf(*a) : Source();
  lock.unlock();

  if (!a && token == op.tag) {
    // XLA's stream already passed the probe wait with the predicted data (a second reload of a
    // ticket): the staging must not be touched any more; report only.
    Fail(Status(Code::kInvalidArgument, "reload: " + why));
    lock.lock();
    if (--op.pending == 0) cv_.notify_all();
    return;
  }
  if (!a) Fail(Status(Code::kInvalidArgument, "reload: " + why + "; the output was filled with 0xFF bytes"));

  // Corrections run on fix_, not h2d_: h2d_ may already hold the prefetches of later ops, which wait
  // for offloads that sit behind this op on XLA's stream (a cycle once depth > 2). fix_ waits only
  // for this op's own prefetch, whose inputs all precede this op on XLA's stream.
  Status st;
  if (mapped && filled)
    st = Call(op.staging_id, "reload", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, op.filled, 0); });
  if (st.ok() && a) {
    st = CopyTicket(fix_, src, op.staging, op.meta.nbytes, op.staging_id, "reload");
  } else if (st.ok() && mapped) {
    st = Call(op.staging_id, "reload", Entry::kMemsetD8Async, [&] { return d.MemsetD8Async(op.staging, 0xFF, op.meta.nbytes, fix_); });
  }
  if (mapped) {
    // Release XLA's stream: the correction is ordered before this write on fix_.
    Status wst = Call(op.staging_id, "reload", Entry::kStreamWriteValue64, [&] {
      return d.StreamWriteValue64(fix_, reinterpret_cast<CUdeviceptr>(&w.probe), op.tag, 0);
    });
    if (!wst.ok()) {
      if (st.ok()) st = wst;
      d.StreamSynchronize(fix_);
      w.probe.store(op.tag, std::memory_order_release);
    }
  }
  if (!st.ok()) Fail(st);
  lock.lock();
  if (--op.pending == 0) cv_.notify_all();
}

Engine::Source Engine::SourceOf(const Ticket& t) {
  Source src;
  if (t.resident_id >= 0) {
    src.resident = t.resident;
    src.resident_ready = t.resident_ready;
  }
  src.d2h_done = t.d2h_done;
  src.host = t.host.ptr;
  return src;
}

Status Engine::CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, int64_t slot_id,
                          const char* stage) {
  const DriverTable& d = Driver(backend_);
  if (src.resident) {
    if (src.resident_ready)
      JAXVMM_RETURN_IF_ERROR(Call(slot_id, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.resident_ready, 0); }));
    return Call(slot_id, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(dst, src.resident, nbytes, s); });
  }
  JAXVMM_RETURN_IF_ERROR(Call(slot_id, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(s, src.d2h_done, 0); }));
  return Call(slot_id, stage, Entry::kMemcpyHtoDAsync, [&] { return d.MemcpyHtoDAsync(dst, src.host, nbytes, s); });
}

Status Engine::Resident(const std::shared_ptr<Ticket>& t) {
  std::shared_ptr<Slot> slot;
  int64_t id = -1;
  JAXVMM_RETURN_IF_ERROR(AcquireStaging(t->meta.nbytes, &slot, &id));
  Registry& reg = Registry::Get();
  Status st = reg.Remap(id);
  const DriverTable& d = Driver(backend_);
  CUevent ready = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!event_pool_.empty()) ready = event_pool_.back(), event_pool_.pop_back();
  }
  if (st.ok() && !ready) st = Call(id, "prefetch", Entry::kEventCreate, [&] { return d.EventCreate(&ready, CU_EVENT_DISABLE_TIMING); });
  Source host_only;  // this copy is made because the ticket keeps no device copy: read its host block
  host_only.d2h_done = t->d2h_done;
  host_only.host = t->host.ptr;
  if (st.ok()) st = CopyTicket(fix_, host_only, slot->address(), t->meta.nbytes, id, "prefetch");
  if (st.ok()) st = Call(id, "prefetch", Entry::kEventRecord, [&] { return d.EventRecord(ready, fix_); });
  const size_t size = slot->size();
  const bool mapped = slot->Info().mapped;
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok() || t->resident_id >= 0) {
    // Failed, or the ticket kept its offload staging meanwhile (keep_resident): give this copy back
    // once whatever was enqueued into it has finished.
    releaser_->Post([this, id, size, mapped, ready] {
      if (ready) Driver(backend_).EventSynchronize(ready);
      Driver(backend_).StreamSynchronize(fix_);
      if (mapped) ReleaseStaging(id, size);
      else ReturnStaging(id, size);
      if (ready) {
        std::lock_guard<std::mutex> lock(mu_);
        event_pool_.push_back(ready);
      }
    });
    return st;
  }
  t->resident_id = id;
  t->resident_size = slot->size();
  t->resident = slot->address();
  t->resident_ready = ready;
  return Status();
}

void Engine::FreeTicket(std::shared_ptr<Ticket> t) {  // by value: it erases the map entry that may own `t`
  // Caller holds mu_. Frees once nothing can read the host block any more.
  if (t->freed || !(t->consumed || t->dropped) || t->pins > 0 || !t->on_host) return;
  t->freed = true;
  if (t->consumed) {
    recently_reloaded_.push_back(t->token);
    if (recently_reloaded_.size() > 256) recently_reloaded_.pop_front();
  }
  tickets_.erase(t->token);
  order_.erase(std::remove(order_.begin(), order_.end(), t), order_.end());
  event_pool_.push_back(t->d2h_done);
  t->d2h_done = nullptr;
  const int64_t id = t->resident_id;
  const size_t size = t->resident_size;
  const HostBlock host = t->host;
  const CUevent ready = t->resident_ready;
  t->resident_id = -1;
  t->resident_ready = nullptr;
  if (!ready) {
    host_pool_.Free(host);
    if (id >= 0) releaser_->Post([this, id, size] { ReleaseStaging(id, size); });
    return;
  }
  // A prefetch hint's copy: its H2D reads the host block and writes the copy. Both go back only
  // after that copy has finished.
  releaser_->Post([this, id, size, host, ready] {
    Driver(backend_).EventSynchronize(ready);
    if (id >= 0) ReleaseStaging(id, size);
    std::lock_guard<std::mutex> lock(mu_);
    host_pool_.Free(host);
    event_pool_.push_back(ready);
  });
}

void Engine::CompleteTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  std::lock_guard<std::mutex> lock(mu_);
  MarkCompleted(seq);
  if (op.kind == Op::kReload) {
    if (op.ticket) op.ticket->pins -= 1, FreeTicket(op.ticket);
    if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
    if (op.actual) FreeTicket(op.actual);
    const int64_t id = op.staging_id;
    const size_t size = op.staging_size;
    const CUdeviceptr address = op.staging;
    const bool counted = op.mapped;
    releaser_->Post([this, id, size, address, counted] { RetireStaging(id, size, address, counted); });
  } else if (op.kind == Op::kPrefetch && op.actual) {
    op.actual->pins -= 1;
    FreeTicket(op.actual);
  }
  for (auto it = pending_drops_.begin(); it != pending_drops_.end();) {
    if (it->second > completed_seq_) {
      ++it;
      continue;
    }
    auto t = tickets_.find(it->first);
    if (t != tickets_.end() && !t->second->consumed) {
      t->second->dropped = true;
      ++stats_.drops;
      FreeTicket(t->second);
    }
    it = pending_drops_.erase(it);
  }
  if (--op.pending == 0) cv_.notify_all();
  cv_.notify_all();  // the mapper's gate moved
}

void Engine::OffloadedTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  int64_t id;
  size_t size;
  std::shared_ptr<Ticket> t;
  bool keep = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = op.staging_id;
    size = op.staging_size;
    t = op.ticket;
    if (t && EngineConfig::KeepResident() > 0 && !t->consumed && !t->dropped && t->resident_id < 0) {
      // Keep the snapshot mapped as the ticket's device copy: its reload will copy device to device.
      keep = true;
      t->resident_id = id;
      t->resident_size = size;
      t->resident = op.staging;
      t->resident_ready = nullptr;  // the D2D that filled it finished before the D2H that woke us
      kept_resident_.push_back(t);
    }
  }
  if (!keep) RetireStaging(id, size, op.staging, false);  // the D2H is done: the snapshot's pages go
  std::lock_guard<std::mutex> lock(mu_);
  if (t) {
    t->on_host = true;
    FreeTicket(t);
  }
  EvictResident();
  if (--op.pending == 0) cv_.notify_all();
}

void Engine::EvictResident() {
  // Caller holds mu_. Oldest first; a copy that a pending op may still read (pins) stays until freed.
  kept_resident_.erase(std::remove_if(kept_resident_.begin(), kept_resident_.end(),
                                      [](const std::shared_ptr<Ticket>& t) { return t->freed || t->resident_id < 0; }),
                       kept_resident_.end());
  size_t keep = static_cast<size_t>(EngineConfig::KeepResident());
  for (auto it = kept_resident_.begin(); kept_resident_.size() > keep && it != kept_resident_.end();) {
    const auto& t = *it;
    if (t->pins > 0) {
      ++it;
      continue;
    }
    int64_t id = t->resident_id;
    size_t size = t->resident_size;
    t->resident_id = -1;
    t->resident = 0;
    releaser_->Post([this, id, size] { ReleaseStaging(id, size); });
    it = kept_resident_.erase(it);
  }
}

bool Engine::MapGateOpen(const Op& op, int depth) const {
  // Caller holds mu_.
  return completed_seq_ + depth >= op.seq && (op.kind != Op::kReload || reload_mapped_ < depth);
}

void Engine::RetireStaging(int64_t id, size_t size, CUdeviceptr address, bool reload_counted) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reload_counted) --reload_mapped_;
    // Back-to-back copies of one size: the op the mapper waits for would create and map pages of
    // this size right now, while we unmap and release ours. Unmap/release/create beside a running
    // H2D cost it ~10% of its bandwidth on the H200 (tools/gpu_copy_diag.py), so hand the pages over
    // instead. Only to an op whose gate is open, so mapped bytes never exceed what the gate allows.
    if (!shutting_down_ && map_head_ != 0 && !warm_) {
      const Op& head = ops_[map_head_ % kRing];
      if (head.staging_size == size && MapGateOpen(head, EngineConfig::PrefetchDepth())) {
        warm_ = Warm{id, size, address};
        cv_.notify_all();
        return;
      }
    }
    if (reload_counted) cv_.notify_all();  // the reload cap moved
  }
  ReleaseStaging(id, size);
}

void Engine::ReleaseStaging(int64_t id, size_t size) {
  Status st = Registry::Get().Release(id);
  if (!st.ok()) {
    // The slot stays out of the free list; close() will retry its teardown (quarantine if needed).
    Fail(st);
    Status cst = Registry::Get().Close(id);
    (void)cst;
    return;
  }
  ReturnStaging(id, size);
}

void Engine::Drop(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_drops_.emplace_back(token, next_seq_ - 1);
  if (next_seq_ - 1 <= completed_seq_) {
    auto it = tickets_.find(token);
    if (it != tickets_.end() && !it->second->consumed) {
      it->second->dropped = true;
      ++stats_.drops;
      FreeTicket(it->second);
    }
    pending_drops_.pop_back();
  }
}

Status Engine::CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string why;
  auto t = FindTicket(token, &why);
  if (!t) return Status(Code::kInvalidArgument, why);
  if (t->consumed || t->reserved)
    return Status(Code::kInvalidArgument, TokenStr(token) + " was already reloaded (a ticket can be reloaded once)");
  if (t->meta.nbytes != meta.nbytes || t->meta.signature != meta.signature)
    return Status(Code::kInvalidArgument, TokenStr(token) + " does not match the shape/dtype of the reload");
  if (reserve) t->reserved = true;  // the eager reload that follows is the one allowed reload
  return Status();
}

void Engine::Unreserve(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(token);
  if (it != tickets_.end() && !it->second->consumed) it->second->reserved = false;
}

Status Engine::Synchronize() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, std::chrono::seconds(120), [&] {
      for (auto& op : ops_)
        if (op.pending) return false;
      return true;
    });
    if (!ok) return Status(Code::kInternal, "engine did not drain within 120 s (a reload waiting for a ticket that never comes?)");
  }
  mapper_->Drain();
  resolver_->Drain();
  releaser_->Drain();
  return Status();
}

EngineStats Engine::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.tickets_live = static_cast<int64_t>(tickets_.size());
  for (auto& [token, t] : tickets_) s.ticket_host_bytes += static_cast<int64_t>(t->meta.nbytes);
  s.ops_in_flight = static_cast<int64_t>(next_seq_ - 1 - completed_seq_);
  s.seq_issued = static_cast<int64_t>(next_seq_ - 1);
  s.seq_completed = static_cast<int64_t>(completed_seq_);
  s.map_waiting_seq = static_cast<int64_t>(map_head_);
  s.reload_staging_mapped = reload_mapped_;
  s.host = host_pool_.Stats();
  return s;
}

}  // namespace jaxvmm
