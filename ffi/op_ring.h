// The op ring: offloads, reloads and prefetch hints enqueued by handlers XLA calls per execution (the
// calls it did not capture into a command buffer). DESIGN.md, "Offload and reload".
//
// Each op takes one of kRing records (three events, pinned probe/ready/token words); its stream work
// is enqueued by the handler, which also posts the op's bookkeeping to two workers, each task behind an
// event the handler recorded (Worker::PostAfter: the worker polls the events, in order): the resolver
// (learns which ticket a reload holds, corrects a misprediction, records completion) and the releaser
// (an offload's D2H is done). No stream host function and no bookkeeping stream: a handler's host time
// is its copies, memops and event records (ffi/DESIGN.md, "Offload and reload").
//
// Owns: the records, the pinned words, streams d2h/h2d/fix/ctl, the workers, the bounce buffers
// its copies of pageable tickets use, the drops waiting for GPU progress, the handler timings. Handed:
// the ledger (tickets; its lock also guards the records here), the host store, the staging area, the
// transfers and the engine's kernels (their copy, once graph mode has warmed them). Knows nothing of
// graph mode.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bounce.h"
#include "graph_kernels.h"
#include "host_pool.h"
#include "ledger.h"
#include "stat_fields.h"
#include "staging.h"
#include "status.h"
#include "transfers.h"
#include "worker.h"

namespace jaxvmm {

struct RingStats {
  // Where the pipeline stands (for diagnosing a stall): ops not yet passed by XLA's stream, sequence
  // numbers handed out / passed.
  int64_t ops_in_flight = 0;
  int64_t seq_issued = 0, seq_completed = 0;
  // Host time spent in the handlers (XLA's thread), per call: median and 99th percentile of the last
  // 4096 calls, in nanoseconds.
  int64_t handler_calls = 0, handler_median_ns = 0, handler_p99_ns = 0;
  // The same median per kind of call (0 when none among the last 4096).
  int64_t offload_median_ns = 0, reload_median_ns = 0;
  // JAXVMM_DEBUG_RING_PROFILE=1: the median host time of each part of an offload / a reload handler, in
  // handler order (name, ns); empty otherwise.
  std::vector<std::pair<std::string, int64_t>> offload_sections, reload_sections;
  // The ring copies with the engine's jaxvmm_copy kernel (false: cuMemcpyDtoDAsync and a token copy,
  // until graph mode has loaded and warmed the kernels, or for good where they did not load).
  bool copy_kernel = false;
};

// engine_stats() keys (the sections are a dict of their own).
inline constexpr StatField<RingStats> kRingStatsFields[] = {
    {"ops_in_flight", &RingStats::ops_in_flight},
    {"seq_issued", &RingStats::seq_issued},
    {"seq_completed", &RingStats::seq_completed},
    {"handler_calls", &RingStats::handler_calls},
    {"handler_median_ns", &RingStats::handler_median_ns},
    {"handler_p99_ns", &RingStats::handler_p99_ns},
    {"handler_offload_median_ns", &RingStats::offload_median_ns},
    {"handler_reload_median_ns", &RingStats::reload_median_ns},
    {"ring_copy_kernel", &RingStats::copy_kernel},
};

class OpRing {
 public:
  OpRing(Backend b, int device, Ledger& ledger, HostStore& host, StagingArea& staging, const Transfers& transfers,
         const GraphKernels& kernels);
  ~OpRing();  // Stop() first
  OpRing(const OpRing&) = delete;
  OpRing& operator=(const OpRing&) = delete;

  Status Init();  // streams, records, pinned words, workers
  // The workers drained and stopped, then the streams synchronized (before the ledger frees tickets).
  void Stop();

  // The handlers' host time (outside any capture; `start`: when the handler began, for its timing).
  // `stream` is XLA's stream (null on the cpu platform).
  using Clock = std::chrono::steady_clock;
  // Where a handler's host time goes (JAXVMM_DEBUG_RING_PROFILE=1): the time of each mark, in order.
  enum Section { kEntry, kTake, kHostBlock, kStaging, kEvent, kBegin, kEnqueue, kReturn, kSections };
  struct Marks {
    Clock::time_point at[kSections];
    bool set[kSections] = {};
  };
  Status Offload(CUstream stream, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out, Clock::time_point start);
  Status Reload(CUstream stream, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta, Clock::time_point start);
  Status Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out, Clock::time_point start);

  // Python dropped its last reference to a ticket: freed once the GPU has passed every op enqueued so far.
  void Drop(uint64_t token);
  // Blocks until every enqueued op has completed and the workers are idle.
  Status Synchronize();
  // The bounce buffers for pageable round tickets the resolver copies (made at an initialize stage).
  bool InitBounce();  // true: ready
  int64_t bounce_copies() const { return bounce_.copies(); }
  RingStats Stats();

 private:
  struct Op;
  struct alignas(64) Words {
    std::atomic<uint64_t> probe;  // reload: the token the GPU read, copied here by XLA's stream (or the reload kernel)
    std::atomic<uint64_t> seen;   // reload kernel: op seq once it wrote probe (what the resolver polls)
    // reload without a prediction, or with the reload kernel: >= op seq once the resolver put its data in place
    std::atomic<uint64_t> ready;
    uint64_t token;               // offload: the ticket's token (for XLA's output: the copy kernel's argument, or copied)
  };
  using Held = Ledger::Held;

  // Host side (handlers hold enqueue_mu_).
  Op& BeginOp(Held& h, CUstream stream);  // waits for a free record (kRing ops ahead of the GPU at most)
  // Every op not completed yet (those before this one included) runs on `stream`: a reload may then
  // wait on the device for the resolver with its kernel (its waiting blocks hold SMs; an op on another
  // stream that the resolver must see first might need them).
  bool OneStreamInFlight(const Held& h) const;
  void MarkCompleted(const Held& h, uint64_t seq);
  void Completed(const Held& h, uint64_t seq);  // MarkCompleted, then the drops it allows
  Status EnqueueCompletion(Op& op, CUstream stream);
  // Posts op's `task` to worker `w` behind `event` (recorded already), counted in op.pending. With
  // `word`: once *word == value instead, `event` only watched for a failed context (Worker::PostWhen).
  void After(Worker& w, CUevent event, Op& op, void (OpRing::*task)(uint64_t), const std::atomic<uint64_t>* word = nullptr,
             uint64_t value = 0);
  // XLA's stream: nbytes from src to dst, and with token_out != 0 the offload's token (w.token) there.
  // The kernels' jaxvmm_copy (one launch) once warmed; else cuMemcpyDtoDAsync and a token copy.
  Status Copy(CUstream stream, CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUdeviceptr token_out, const Words& w,
              const char* stage);
  // Ends a handler's enqueue: undoes a failed op, counts the handler's host time since `start` (and
  // its sections since `start`, with profiling on).
  void FinishEnqueue(Op& op, const Status& st, Clock::time_point start, const Marks& marks);
  void Mark(Marks& m, Section s) const {
    if (profile_) m.at[s] = Clock::now(), m.set[s] = true;
  }
  void KeepResident(const Held& h, const std::shared_ptr<Ticket>& t, StagingLease* lease, CUstream stream);

  // Worker side.
  void ResolveTask(uint64_t seq);    // resolver: the token a reload/prefetch read is known
  void CompleteTask(uint64_t seq);   // resolver: XLA's stream passed the reload/prefetch
  void OffloadedTask(uint64_t seq);  // releaser: D2H done; the ticket is on the host, the op complete
  void AbandonTask(uint64_t seq);    // the failed handler: undo an op whose enqueue failed part way
  // Releases XLA's stream for a reload whose data could not be put in place: fills the cell with 0xFF
  // (after every copy into it), then writes the word XLA's stream waits on.
  void ReleaseReload(Op& op, bool fill_ff);
  void Report(const Op& op, const Status& st);  // names the call site, then Ledger::Report
  Status Resident(const std::shared_ptr<Ticket>& t);  // a prefetch hint's device copy
  void Release(Held& h, Op& op);  // drops a reference to op (pending), waking BeginOp/AbandonTask

  const Backend backend_;
  const int device_;
  Ledger& ledger_;
  HostStore& host_store_;
  StagingArea& staging_;
  const Transfers& transfers_;
  const GraphKernels& kernels_;
  // d2h_: offload copies out; h2d_: reload prefetches (in handler order); fix_: the resolver's
  // corrections and prefetch-hint copies; ctl_: the resolver's last-resort 0xFF fill. d2h_ and h2d_
  // carry copies and event records only: nothing on them waits for the other direction's copies
  // except a reload's wait for its own ticket's D2H.
  CUstream d2h_ = nullptr, h2d_ = nullptr, fix_ = nullptr, ctl_ = nullptr;
  Words* words_ = nullptr;  // pinned, kRing entries
  std::vector<Op> ops_;
  PageableBounce bounce_;

  std::mutex enqueue_mu_;  // one handler enqueues at a time: streams see ops in sequence order
  // Guarded by the ledger lock: the records' `pending` and what follows.
  std::condition_variable cv_;
  uint64_t completed_seq_ = 0;   // every op <= this has passed XLA's stream
  std::set<uint64_t> finished_;  // finished ops above completed_seq_ (out of order)
  std::vector<std::shared_ptr<Ticket>> kept_;  // newest offloads keeping their staging cell
  std::vector<std::pair<uint64_t, uint64_t>> pending_drops_;  // (token, after seq)
  // The last kTimings values of one timing (a ring once full); `added` counts every value.
  struct Timings {
    std::vector<int64_t> ns;
    int64_t added = 0;
    size_t Add(int64_t v);  // returns the position written
  };
  Timings handler_ns_;                 // every handler call's host time
  std::vector<uint8_t> handler_kind_;  // their Op::Kind, same positions
  CUstream last_stream_ = nullptr;     // the stream of the newest op
  uint64_t stream_since_ = 0;          // the first op of the newest run of ops on last_stream_
  bool profile_ = false;               // JAXVMM_DEBUG_RING_PROFILE=1 (read at Init)
  Timings section_ns_[2][kSections + 1];  // [offload, reload][section; the last: the rest up to the end]

  // Workers last: destroyed first, after Stop() has drained them.
  std::unique_ptr<Worker> resolver_, releaser_;
};

}  // namespace jaxvmm
