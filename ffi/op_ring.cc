#include "op_ring.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "config.h"
#include "vmm.h"

namespace jaxvmm {
namespace {

constexpr uint64_t kRing = 1024;   // ops in flight per engine before the host waits for the GPU
constexpr size_t kTimings = 4096;  // handler host times kept for the median

int64_t Median(std::vector<int64_t> v) {  // v not empty
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

size_t OpRing::Timings::Add(int64_t v) {
  const size_t at = static_cast<size_t>(added++ % static_cast<int64_t>(kTimings));
  if (ns.size() <= at) ns.push_back(v);  // filling: at == ns.size()
  else ns[at] = v;
  return at;
}

struct OpRing::Op {
  enum Kind { kOffload, kReload, kPrefetch };
  uint64_t seq = 0;
  Kind kind = kOffload;
  int pending = 0;  // the host's reference plus callbacks still to run; the record is reusable at 0
  bool completion_posted = false;  // CompleteTask is posted to the resolver (behind `done`): it will run
  bool offloaded_posted = false;   // OffloadedTask is posted to the releaser (behind the D2H): it will run
  bool abandoned = false;            // its enqueue failed part way: workers release, never consume
  CUstream stream = nullptr;         // XLA's stream for the op (null on cpu)
  CUdeviceptr staging = 0;           // the staging cell's address (reload: what XLA's stream copies out;
                                     // a direct reload: XLA's buffer, which the resolver copies into)
  bool direct = false;               // reload: no staging cell, no prediction (Acquiring::kReload)
  StagingLease lease;                // held until the handler ends, or by AbandonTask after a failure
  ArrayMeta meta;
  std::shared_ptr<Ticket> ticket;  // offload: its ticket; reload: the prediction (may be null)
  std::shared_ptr<Ticket> actual;  // reload/prefetch: what the token resolved to
  uint64_t tag = 0;                // the predicted ticket's token (0: no prediction)
  // reload: copied out by jaxvmm_ring_reload, which publishes the token (probe, seen) and waits for
  // `ready` unless it holds `tag`; else a probe copy and a memop wait (`probe` == tag, or `ready`).
  bool kernel = false;
  CUevent tok = nullptr, done = nullptr;
  CUevent filled = nullptr;  // reload: recorded on h2d_ once the cell is free and the prefetch (if any) is in (a
                             // predicted reload's wait on XLA's stream; a correction's on fix_); a reload
                             // with no cell (copied straight into XLA's buffer): on XLA's stream, at the op
};

// ---------------------------------------------------------------- lifetime

OpRing::OpRing(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, const Transfers& transfers,
               const GraphKernels& kernels)
    : backend_(b),
      device_(device),
      ledger_(ledger),
      host_store_(host),
      staging_(staging),
      transfers_(transfers),
      kernels_(kernels),
      bounce_(b, device) {}

Status OpRing::Init() {
  const DriverTable& d = Driver(backend_);
  const char* stage = "engine init";
  // Copies run on their own streams so D2H and H2D overlap each other and XLA's compute; ctl_ only
  // carries the resolver's last-resort 0xFF fill. Bookkeeping waits for the device on the workers'
  // threads (Worker::PostAfter), never on a stream: no copy queues behind it, nor it behind a copy.
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
    words_[i].seen.store(0);
    words_[i].ready.store(0);
    words_[i].token = 0;
  }
  ops_.resize(kRing);
  for (auto& op : ops_) {
    for (CUevent* e : {&op.tok, &op.done, &op.filled})
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventCreate, [&] { return d.EventCreate(e, CU_EVENT_DISABLE_TIMING); }));
  }
  profile_ = EngineConfig::Get(Setting::kRingProfile) != 0;
  resolver_ = std::make_unique<Worker>("jaxvmm-resolve", backend_, device_);
  releaser_ = std::make_unique<Worker>("jaxvmm-release", backend_, device_);
  return Status();
}

void OpRing::Stop() {
  // The workers first: they wait for the events of every op enqueued (on XLA's stream and d2h_ only)
  // and their tasks may still enqueue on fix_/ctl_ (a correction, a 0xFF fill, a prefetch hint's copy).
  // Then those streams, so nothing the engine's parts free afterwards is still being copied.
  if (resolver_) resolver_->Drain();
  if (releaser_) releaser_->Drain();
  resolver_.reset();
  releaser_.reset();
  const DriverTable& d = Driver(backend_);
  for (CUstream s : {h2d_, fix_, d2h_, ctl_})
    if (s) d.StreamSynchronize(s);
}

OpRing::~OpRing() {
  ScopedContext ctx(backend_, device_);  // a member: the engine's own context is gone by now
  const DriverTable& d = Driver(backend_);
  const char* what = "op ring teardown";
  for (auto& op : ops_)
    for (CUevent e : {op.tok, op.done, op.filled})
      if (e) GiveBack(what, Entry::kEventDestroy, [&] { return d.EventDestroy(e); });
  for (CUstream s : {d2h_, h2d_, fix_, ctl_})
    if (s) GiveBack(what, Entry::kStreamDestroy, [&] { return d.StreamDestroy(s); });
  if (words_) GiveBack(what, Entry::kMemFreeHost, [&] { return d.MemFreeHost(words_); });
}

bool OpRing::InitBounce() {
  Status st = bounce_.Init();
  if (!st.ok()) std::fprintf(stderr, "jaxvmm: pageable bounce buffers unavailable: %s\n", st.ToString().c_str());
  return st.ok();
}

// ---------------------------------------------------------------- host side

void OpRing::Report(const Op& op, const Status& st) {
  Status named = st;  // which call site, when the op has one (offload, reload)
  if (op.meta.site > 0) named.Append(" [call site " + std::to_string(op.meta.site) + "]");
  ledger_.Report(op.stream, named);
}

void OpRing::Release(Held& h, Op& op) {
  (void)h;
  --op.pending;
  cv_.notify_all();
}

bool OpRing::OneStreamInFlight(const Held& h) const {
  (void)h;
  return completed_seq_ + 1 >= stream_since_;
}

OpRing::Op& OpRing::BeginOp(Held& h, CUstream stream) {
  // Backpressure: the host may run at most kRing ops ahead of the GPU.
  cv_.wait(h, [&] { return ops_[(ledger_.issued(h) + 1) % kRing].pending == 0; });
  const uint64_t seq = ledger_.IssueSeq(h);
  Op& op = ops_[seq % kRing];
  op.seq = seq;
  op.pending = 1;  // the host's reference, dropped by FinishEnqueue
  op.completion_posted = op.offloaded_posted = false;
  op.abandoned = false;
  op.stream = stream;
  if (stream != last_stream_ || stream_since_ == 0) last_stream_ = stream, stream_since_ = seq;
  op.staging = 0;
  op.direct = false;
  op.lease = StagingLease();
  op.meta = ArrayMeta();
  op.ticket.reset();
  op.actual.reset();
  op.tag = 0;
  op.kernel = false;
  return op;
}

void OpRing::MarkCompleted(const Held& h, uint64_t seq) {
  // completed_seq_ only moves over a contiguous run of finished ops.
  (void)h;
  if (seq <= completed_seq_) return;
  finished_.insert(seq);
  while (!finished_.empty() && *finished_.begin() == completed_seq_ + 1) {
    finished_.erase(finished_.begin());
    ++completed_seq_;
  }
}

void OpRing::After(Worker& w, CUevent event, Op& op, void (OpRing::*task)(uint64_t), const std::atomic<uint64_t>* word,
                   uint64_t value) {
  {
    Held h = ledger_.Lock();
    ++op.pending;  // the task's reference: it may run (and release it) at once
  }
  const uint64_t seq = op.seq;
  auto run = [this, &op, seq, task](const Status& st) {
    if (!st.ok()) Report(op, st);  // the context failed: the bookkeeping still runs
    (this->*task)(seq);
  };
  if (word) w.PostWhen(word, value, event, std::move(run));
  else w.PostAfter(event, std::move(run));
}

Status OpRing::Copy(CUstream stream, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr token_out, const Words& w,
                    const char* stage) {
  // One kernel launch (the copy and the token together) once the engine's kernels are warm; until then
  // (or without them) a driver copy, and the token from its pinned word.
  if (kernels_.warmed()) return kernels_.Copy(stream, dst, src, nbytes, token_out, w.token, stage);
  const DriverTable& d = Driver(backend_);
  if (token_out)
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(token_out, reinterpret_cast<CUdeviceptr>(&w.token), sizeof(uint64_t), stream);
    }));
  return Call(-1, stage, Entry::kMemcpyDtoDAsync, [&] { return d.MemcpyDtoDAsync(dst, src, nbytes, stream); });
}

Status OpRing::EnqueueCompletion(Op& op, CUstream stream) {
  const DriverTable& d = Driver(backend_);
  const char* stage = "enqueue";
  JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op.done, stream); }));
  After(*resolver_, op.done, op, &OpRing::CompleteTask);
  Held h = ledger_.Lock();
  op.completion_posted = true;
  return Status();
}

void OpRing::FinishEnqueue(Op& op, const Status& st, Clock::time_point start, const Marks& marks) {
  // A synchronous failure is returned by the handler (XLA aborts the execution); it is not recorded
  // for later calls. What the op's missing callbacks would have done is undone once the work already
  // enqueued for it has drained.
  {
    Held h = ledger_.Lock();
    if (!st.ok()) {
      op.abandoned = true;
      if (!op.completion_posted) MarkCompleted(h, op.seq);  // no completion will ever be reported for it
      ++op.pending;  // AbandonTask's reference
    }
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    const size_t at = handler_ns_.Add(ns);
    if (handler_kind_.size() <= at) handler_kind_.resize(at + 1);
    handler_kind_[at] = static_cast<uint8_t>(op.kind);
    if (profile_ && st.ok() && (op.kind == Op::kOffload || op.kind == Op::kReload)) {
      auto& into = section_ns_[op.kind == Op::kOffload ? 0 : 1];
      Clock::time_point last = start;
      for (int i = 0; i < kSections; ++i) {
        if (!marks.set[i]) continue;
        into[i].Add(std::chrono::duration_cast<std::chrono::nanoseconds>(marks.at[i] - last).count());
        last = marks.at[i];
      }
      into[kSections].Add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - last).count());
    }
    Release(h, op);  // the host's own reference
  }
  // Undone before the handler returns its error, so a retry of the same ticket finds it reloadable.
  if (!st.ok()) AbandonTask(op.seq);
}

void OpRing::AbandonTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  const DriverTable& d = Driver(backend_);
  Held h = ledger_.Lock();
  // Every task already posted for this op runs first (the resolver releases XLA's
  // stream if it waits on us), so nothing below races a queued resolve: the cell is returned only once
  // no correction can write it, and a ticket is never consumed after the undo.
  cv_.wait(h, [&] { return op.pending == 1; });
  h.unlock();
  if (op.stream) d.StreamSynchronize(op.stream);
  for (CUstream s : {h2d_, fix_, d2h_, ctl_}) d.StreamSynchronize(s);
  staging_.Return(&op.lease, nullptr);  // every stream that touched the cell has drained
  h.lock();
  if (op.kind == Op::kReload && !op.completion_posted) {
    // The reload never delivered its data: the ticket it resolved to stays reloadable.
    if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
    if (op.actual) op.actual->consumed = false;
    if (op.ticket) {
      if (op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
      op.ticket->pins -= 1;
      ledger_.Retire(h, op.ticket);
    }
    if (op.actual) ledger_.Retire(h, op.actual);
  } else if (op.kind == Op::kOffload && op.ticket && !op.offloaded_posted) {
    op.ticket->on_host = true;  // nothing is copying into it any more
    op.ticket->dropped = true;  // its data never reached the host in full
    ledger_.Retire(h, op.ticket);
  }
  Release(h, op);
}

void OpRing::KeepResident(const Held& h, const std::shared_ptr<Ticket>& t, StagingLease* lease, CUstream stream) {
  // The newest K offloads keep their staging cell as a device copy; beyond K the oldest copy that no
  // op is about to read goes back, its free event recorded on d2h_ (after every D2H enqueued so far,
  // its own included).
  (void)h;
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

Status OpRing::Offload(CUstream stream, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out, Clock::time_point start) {
  Marks marks;
  Mark(marks, kEntry);
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(ledger_.TakeFor(stream));
  Mark(marks, kTake);
  HostBlock host;
  JAXVMM_RETURN_IF_ERROR(host_store_.Allocate(meta.nbytes, &host).At(-1, "offload"));
  Mark(marks, kHostBlock);
  StagingLease lease;
  CUevent d2h_done = nullptr;
  Status st = staging_.Acquire(meta.nbytes, CellUse::kOffload, Acquiring::kWait, &lease);
  Mark(marks, kStaging);
  if (st.ok()) st = ledger_.GetEvent(&d2h_done);
  Mark(marks, kEvent);
  if (!st.ok()) {
    host_store_.Free(host);
    staging_.Return(&lease, nullptr);
    if (d2h_done) Driver(backend_).EventDestroy(d2h_done);
    return st;
  }
  Op* op = nullptr;
  std::shared_ptr<Ticket> t;
  {
    Held h = ledger_.Lock();
    op = &BeginOp(h, stream);
    op->lease = lease;
    t = ledger_.tickets(h).Create(meta);
    t->offload_seq = op->seq;
    t->host = host;
    t->d2h_done = d2h_done;
    ++ledger_.counts(h).offloads;
    op->kind = Op::kOffload;
    op->meta = meta;
    op->ticket = t;
    op->staging = lease.address;
    words_[op->seq % kRing].token = t->token;
  }
  Mark(marks, kBegin);
  Words& w = words_[op->seq % kRing];
  const DriverTable& d = Driver(backend_);
  const char* stage = "offload";
  auto enqueue = [&]() -> Status {
    // XLA's stream: once the cell's previous user is done, snapshot x into it and hand out the token.
    if (lease.wait)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(stream, lease.wait, 0); }));
    JAXVMM_RETURN_IF_ERROR(Copy(stream, lease.address, src, meta.nbytes, token_out, w, stage));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->done, stream); }));
    // Copy stream: after the snapshot, D2H into pinned memory; the cell is free once that is done.
    // The releaser's one task after the D2H also reports the op complete (XLA's stream passed it
    // before the D2H began), so an offload costs one wait, not two.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(d2h_, op->done, 0); }));
    JAXVMM_RETURN_IF_ERROR(transfers_.CopyToHost(d2h_, host, lease.address, meta.nbytes, stage));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(d2h_done, d2h_); }));
    After(*releaser_, d2h_done, *op, &OpRing::OffloadedTask);
    Held h = ledger_.Lock();
    op->offloaded_posted = op->completion_posted = true;
    t->enqueued = true;
    if (EngineConfig::KeepResident() > 0) KeepResident(h, t, &op->lease, stream);
    return Status();
  };
  st = enqueue();
  Mark(marks, kEnqueue);
  if (st.ok()) st = staging_.Return(&op->lease, d2h_);  // the cell's next user waits for the D2H
  Mark(marks, kReturn);
  FinishEnqueue(*op, st, start, marks);  // after a failure, AbandonTask returns the cell once the streams drained
  return st;
}

Status OpRing::Reload(CUstream stream, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta, Clock::time_point start) {
  Marks marks;
  Mark(marks, kEntry);
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(ledger_.TakeFor(stream));
  Mark(marks, kTake);
  StagingLease lease;
  JAXVMM_RETURN_IF_ERROR(staging_.Acquire(meta.nbytes, CellUse::kReload, Acquiring::kReload, &lease));
  Mark(marks, kStaging);
  Op* op = nullptr;
  Source src;
  {
    Held h = ledger_.Lock();
    op = &BeginOp(h, stream);
    op->lease = lease;
    ++ledger_.counts(h).reloads;
    op->kind = Op::kReload;
    op->meta = meta;
    // No cell (Acquiring::kReload): the resolver copies straight into XLA's buffer, with no prediction.
    op->direct = !lease;
    op->staging = lease ? lease.address : dst;
    op->kernel = lease && kernels_.warmed() && kernels_.RingReloadFullGrid(meta.nbytes) && OneStreamInFlight(h);
    if (lease) op->ticket = ledger_.tickets(h).Predict(meta, [](const Ticket& t) { return !t.host.pageable; });
    if (op->ticket) {
      op->ticket->claimed_by = op->seq;
      op->ticket->pins += 1;
      op->tag = op->ticket->token;
      src = SourceOf(*op->ticket);
    }
  }
  Mark(marks, kBegin);
  const uint64_t seq = op->seq;
  Words& w = words_[seq % kRing];
  w.probe.store(0, std::memory_order_relaxed);
  const DriverTable& d = Driver(backend_);
  const char* stage = "reload";
  auto probe = reinterpret_cast<CUdeviceptr>(&w.probe);
  auto ready = reinterpret_cast<CUdeviceptr>(&w.ready);
  auto direct = [&]() -> Status {
    // XLA's stream publishes the token and waits for `ready` >= seq. The resolver, woken once XLA's
    // stream is here (so nothing of XLA's still uses `dst`), copies the ticket into `dst` on fix_, which
    // waits for `filled` (recorded here, after XLA's earlier work), and then writes `ready`.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] { return d.MemcpyAsync(probe, token_in, sizeof(uint64_t), stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->filled, stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    After(*resolver_, op->tok, *op, &OpRing::ResolveTask);
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
      return d.StreamWaitValue64(stream, ready, seq, CU_STREAM_WAIT_VALUE_GEQ);
    }));
    return EnqueueCompletion(*op, stream);
  };
  auto enqueue = [&]() -> Status {
    if (!lease) return direct();
    // h2d_ (in handler order): once the cell's previous user is done, prefetch the predicted ticket into
    // it. `filled` marks that point for a correction, which must follow it and must not queue behind
    // later ops' prefetches.
    if (lease.wait)
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(h2d_, lease.wait, 0); }));
    if (op->ticket) JAXVMM_RETURN_IF_ERROR(transfers_.CopyTicket(h2d_, src, lease.address, meta.nbytes, bounce_, "prefetch"));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->filled, h2d_); }));
    if (op->kernel) {
      // XLA's stream: (with a prediction) the prefetch in place, then one launch that reads the token,
      // publishes it to the resolver (probe, seen), waits for `ready` unless it is the prediction, and
      // copies the cell out. The resolver is posted first: a miss waits for it (on the cpu backend the
      // launch itself runs the kernel).
      if (op->ticket)
        JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(stream, op->filled, 0); }));
      After(*resolver_, op->filled, *op, &OpRing::ResolveTask, &w.seen, seq);
      Status launched = kernels_.RingReload(stream, dst, lease.address, meta.nbytes, token_in, op->tag, probe,
                                            reinterpret_cast<CUdeviceptr>(&w.seen), seq, ready);
      if (!launched.ok()) {
        // No kernel will publish: abandon the op, then wake the resolver, which then only releases.
        {
          Held h = ledger_.Lock();
          op->abandoned = true;
        }
        w.seen.store(seq, std::memory_order_release);
        return launched;
      }
      return EnqueueCompletion(*op, stream);
    }
    // XLA's stream: let the resolver learn which ticket the GPU holds, without a host round trip on
    // XLA's stream when the prediction was right.
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] { return d.MemcpyAsync(probe, token_in, sizeof(uint64_t), stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    After(*resolver_, op->tok, *op, &OpRing::ResolveTask);
    // XLA's stream waits for exactly this cell. With a prediction: its prefetch in place (`filled`) and
    // the right ticket (probe == predicted token: a hit, or the resolver's release after its correction
    // or 0xFF fill, both on fix_ after `filled`). Without one: `ready` >= seq, which only the resolver
    // writes, after it has put the right data (or 0xFF) in the cell.
    if (op->ticket) {
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(stream, op->filled, 0); }));
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
        return d.StreamWaitValue64(stream, probe, op->tag, CU_STREAM_WAIT_VALUE_EQ);
      }));
    } else {
      JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kStreamWaitValue64, [&] {
        return d.StreamWaitValue64(stream, ready, seq, CU_STREAM_WAIT_VALUE_GEQ);
      }));
    }
    JAXVMM_RETURN_IF_ERROR(Copy(stream, dst, lease.address, meta.nbytes, 0, w, stage));
    return EnqueueCompletion(*op, stream);
  };
  Status st = enqueue();
  Mark(marks, kEnqueue);
  if (st.ok()) st = staging_.Return(&op->lease, stream);  // the next user waits for XLA's copy out of the cell
  Mark(marks, kReturn);
  FinishEnqueue(*op, st, start, marks);  // after a failure, AbandonTask returns the cell once the streams drained
  return st;
}

Status OpRing::Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out, Clock::time_point start) {
  std::lock_guard<std::mutex> serial(enqueue_mu_);
  JAXVMM_RETURN_IF_ERROR(ledger_.TakeFor(stream));
  Op* op = nullptr;
  {
    Held h = ledger_.Lock();
    op = &BeginOp(h, stream);
    ++ledger_.counts(h).prefetches;
    op->kind = Op::kPrefetch;
  }
  Words& w = words_[op->seq % kRing];
  const DriverTable& d = Driver(backend_);
  const char* stage = "prefetch";
  auto enqueue = [&]() -> Status {
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] { return d.MemcpyAsync(token_out, token_in, sizeof(uint64_t), stream); }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kMemcpyAsync, [&] {
      return d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(&w.probe), token_in, sizeof(uint64_t), stream);
    }));
    JAXVMM_RETURN_IF_ERROR(Call(-1, stage, Entry::kEventRecord, [&] { return d.EventRecord(op->tok, stream); }));
    After(*resolver_, op->tok, *op, &OpRing::ResolveTask);
    return EnqueueCompletion(*op, stream);
  };
  Status st = enqueue();
  FinishEnqueue(*op, st, start, Marks());
  return st;
}

// ---------------------------------------------------------------- workers

void OpRing::ReleaseReload(Op& op, bool fill_ff) {
  // Releases XLA's stream for a reload. With `fill_ff` the cell (a direct reload: XLA's buffer) first
  // gets 0xFF bytes, ordered after every copy into it (its prefetch on h2d_, any correction on fix_).
  // If the device cannot do that, the host waits for those streams and retries on ctl_; if that fails
  // too the stream is still released (never left waiting forever) and the error has been reported.
  const DriverTable& d = Driver(backend_);
  Words& w = words_[op.seq % kRing];
  // XLA's stream waits for probe == tag (a predicted reload's memop wait) or ready >= seq (no
  // prediction, or the reload kernel).
  const bool by_probe = op.tag && !op.kernel;
  const uint64_t value = by_probe ? op.tag : op.seq;
  auto word = reinterpret_cast<CUdeviceptr>(by_probe ? &w.probe : &w.ready);
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

void OpRing::ResolveTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  Words& w = words_[seq % kRing];
  const uint64_t token = w.probe.load(std::memory_order_acquire);
  const DriverTable& d = Driver(backend_);
  Held h = ledger_.Lock();
  if (op.abandoned) {
    // The enqueue failed after this task was posted: XLA aborts the execution. Release its
    // stream if it may wait on us, but consume nothing.
    if (op.kind == Op::kReload) {
      h.unlock();
      ReleaseReload(op, /*fill_ff=*/false);
      h.lock();
    }
    Release(h, op);
    return;
  }
  // The token may name a graph-mode offload round the device finished before this op (stream order)
  // whose `filled` the poller has not served: wait for it, else the ticket is "unknown" (not made yet)
  // or its D2H is not enqueued yet and a copy from its host block would read stale bytes.
  h.unlock();
  ledger_.WaitUntilServed(token);
  h.lock();
  std::string why;
  std::shared_ptr<Ticket> a = ledger_.tickets(h).Find(token, &why);
  if (a && op.kind == Op::kReload && (a->meta.nbytes != op.meta.nbytes || a->meta.signature != op.meta.signature)) {
    why = TokenStr(token) + " holds " + std::to_string(a->meta.nbytes) + " bytes of another shape/dtype than the reload expects (" +
          std::to_string(op.meta.nbytes) + " bytes)";
    a = nullptr;
  }

  if (op.kind == Op::kPrefetch) {
    if (!a) {
      h.unlock();
      Report(op, Status(Code::kInvalidArgument, "prefetch: " + why));
      h.lock();
    } else if (!a->resident) {
      a->pins += 1;
      op.actual = a;
      h.unlock();
      Status st = Resident(a);  // a hint: when it cannot be honoured, the reload copies from the host
      if (!st.ok()) std::fprintf(stderr, "%s (prefetch hint skipped)\n", st.ToString().c_str());
      h.lock();
    }
    Release(h, op);
    return;
  }

  const bool hit = a && op.ticket == a;
  // XLA's stream took the prediction by its token's value (the memop wait or the kernel saw token ==
  // tag) and went on: the cell has been read, or is being read, and may belong to a later op by now.
  const bool device_passed = op.tag != 0 && token == op.tag;
  if (op.ticket && op.ticket->claimed_by == seq) op.ticket->claimed_by = 0;
  if (a) {
    MarkReloaded(*a);
    if (a->claimed_by != 0) ledger_.MarkStale(h);  // a graph-mode reload cell may hold it as a guess
    if (!hit) a->pins += 1;  // a prediction already pinned it
    op.actual = a;
  }
  if (hit) {
    ++ledger_.counts(h).prefetch_hits;
    Release(h, op);
    return;
  }
  if (device_passed) {
    // The ledger refuses what the device accepted (a ticket that an earlier op, still in flight when
    // this one predicted it, has reloaded since): report it, and write nothing, since a fill or a
    // correction now would land in a cell XLA's stream may have handed to a later op.
    h.unlock();
    Report(op, Status(Code::kInvalidArgument, "reload: " + why + "; the output holds that ticket's bytes (read before this was known)"));
    h.lock();
    Release(h, op);
    return;
  }
  if (!op.direct) ++ledger_.counts(h).prefetch_misses;  // a direct reload predicted nothing
  if (a && op.ticket) ledger_.tickets(h).Learn(a, op.meta.signature);
  const Source src = a ? SourceOf(*a) : Source();
  h.unlock();

  if (!a) {
    Report(op, Status(Code::kInvalidArgument, "reload: " + why + "; the output was filled with 0xFF bytes"));
    ReleaseReload(op, /*fill_ff=*/true);
  } else {
    // Corrections run on fix_, not h2d_: h2d_ may already hold the prefetches of later ops, which wait
    // for offloads that sit behind this op on XLA's stream. fix_ waits only for this op's own
    // `filled` point, whose inputs all precede this op on XLA's stream.
    Status st = Call(-1, "reload", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, op.filled, 0); });
    if (st.ok()) st = transfers_.CopyTicket(fix_, src, op.staging, op.meta.nbytes, bounce_, "reload");
    if (st.ok()) {
      ReleaseReload(op, /*fill_ff=*/false);
    } else {
      // Never release XLA's stream onto the mispredicted ticket's bytes.
      Report(op, Status(st.code(), st.ToString() + " (reload of " + TokenStr(token) + " failed; the output was filled with 0xFF bytes)"));
      ReleaseReload(op, /*fill_ff=*/true);
    }
  }
  h.lock();
  Release(h, op);
}

Status OpRing::Resident(const std::shared_ptr<Ticket>& t) {
  // A prefetch hint: copy the ticket to a staging cell now (on fix_), if the budget has room without
  // waiting. Its readers wait for the cell's free event, recorded right after the copy.
  StagingLease lease;
  JAXVMM_RETURN_IF_ERROR(staging_.Acquire(t->meta.nbytes, CellUse::kReload, Acquiring::kTryOnly, &lease));
  if (!lease) return Status(Code::kOutOfMemory, "prefetch: no staging cell free within the staging budget");
  const DriverTable& d = Driver(backend_);
  Source host_only;
  {
    Held h = ledger_.Lock();
    host_only = SourceOf(*t);
    host_only.resident = 0;  // from its host block: the hint makes the device copy
    host_only.resident_ready = nullptr;
  }
  Status st;
  if (lease.wait) st = Call(-1, "prefetch", Entry::kStreamWaitEvent, [&] { return d.StreamWaitEvent(fix_, lease.wait, 0); });
  if (st.ok()) st = transfers_.CopyTicket(fix_, host_only, lease.address, t->meta.nbytes, bounce_, "prefetch");
  if (st.ok()) st = staging_.Record(&lease, fix_);  // readers wait for this event: the copy is in
  Held h = ledger_.Lock();
  if (!st.ok() || t->resident || t->freed) {
    staging_.Return(&lease, fix_);
    return st;
  }
  staging_.Pin(lease);
  t->resident = lease;
  return Status();
}

void OpRing::Completed(const Held& h, uint64_t seq) {
  // Drops that waited for the GPU to pass every op enqueued before them.
  MarkCompleted(h, seq);
  for (auto it = pending_drops_.begin(); it != pending_drops_.end();) {
    if (it->second > completed_seq_) {
      ++it;
      continue;
    }
    ledger_.DropTicket(h, it->first);
    it = pending_drops_.erase(it);
  }
}

void OpRing::CompleteTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  Held h = ledger_.Lock();
  Completed(h, seq);
  if (op.kind == Op::kReload) {
    if (op.ticket) op.ticket->pins -= 1, ledger_.Retire(h, op.ticket);
    if (op.actual && op.actual != op.ticket) op.actual->pins -= 1;
    if (op.actual) ledger_.Retire(h, op.actual);
  } else if (op.kind == Op::kPrefetch && op.actual) {
    op.actual->pins -= 1;
    ledger_.Retire(h, op.actual);
  }
  Release(h, op);
}

void OpRing::OffloadedTask(uint64_t seq) {
  Op& op = ops_[seq % kRing];
  Held h = ledger_.Lock();
  if (op.ticket) {
    op.ticket->on_host = true;
    ledger_.Retire(h, op.ticket);
  }
  Completed(h, seq);
  Release(h, op);
}

void OpRing::Drop(uint64_t token) {
  Held h = ledger_.Lock();
  const uint64_t after = ledger_.issued(h);
  if (after <= completed_seq_) ledger_.DropTicket(h, token);
  else pending_drops_.emplace_back(token, after);
}

Status OpRing::Synchronize() {
  {
    Held h = ledger_.Lock();
    const bool ok = cv_.wait_for(h, std::chrono::seconds(120), [&] {
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

RingStats OpRing::Stats() {
  Held h = ledger_.Lock();
  RingStats s;
  const uint64_t issued = ledger_.issued(h);
  s.ops_in_flight = static_cast<int64_t>(issued - completed_seq_);
  s.seq_issued = static_cast<int64_t>(issued);
  s.seq_completed = static_cast<int64_t>(completed_seq_);
  s.handler_calls = handler_ns_.added;
  s.copy_kernel = kernels_.warmed();
  if (!handler_ns_.ns.empty()) {
    std::vector<int64_t> v = handler_ns_.ns;
    std::sort(v.begin(), v.end());
    s.handler_median_ns = v[v.size() / 2];
    s.handler_p99_ns = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  }
  static const char* const kNames[kSections + 1] = {"entry", "lock and errors", "host block", "staging acquire", "event",
                                                   "begin op", "enqueue", "staging return", "finish"};
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i <= kSections; ++i)
      if (!section_ns_[k][i].ns.empty())
        (k == 0 ? s.offload_sections : s.reload_sections).emplace_back(kNames[i], Median(section_ns_[k][i].ns));
  for (auto [kind, out] : {std::pair{Op::kOffload, &s.offload_median_ns}, std::pair{Op::kReload, &s.reload_median_ns}}) {
    std::vector<int64_t> v;
    for (size_t i = 0; i < handler_ns_.ns.size(); ++i)
      if (handler_kind_[i] == kind) v.push_back(handler_ns_.ns[i]);
    if (!v.empty()) *out = Median(std::move(v));
  }
  return s;
}

}  // namespace jaxvmm
