// Offload engine: moves arrays between XLA's buffers and pinned host memory through fixed-address
// staging slots whose pages exist only while a copy needs them. One engine per (backend, device).
// No XLA types here: handlers.cc decodes FFI calls into these host-time entry points.
// The stream protocol is described in DESIGN.md ("Offload and reload").
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <set>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_pool.h"
#include "registry.h"
#include "status.h"
#include "worker.h"

namespace jaxvmm {

// What Python knows statically about an offloaded array; checked again when a reload resolves.
struct ArrayMeta {
  size_t nbytes = 0;
  int64_t signature = 0;  // hash of dtype and shape, computed in Python
};

struct EngineStats {
  int64_t offloads = 0, reloads = 0, prefetches = 0;
  int64_t prefetch_hits = 0, prefetch_misses = 0;
  int64_t tickets_live = 0, ticket_host_bytes = 0;
  int64_t errors = 0, drops = 0;
  int64_t staging_slots = 0;
  int64_t staging_handoffs = 0;  // staging pages passed from a finished op to the next, no driver call
  int64_t ops_in_flight = 0;
  // Where the pipeline stands (for diagnosing a stall): sequence numbers handed out / passed by XLA's
  // stream, the op the mapper waits to map (0: none), reload staging slots holding pages.
  int64_t seq_issued = 0, seq_completed = 0, map_waiting_seq = 0, reload_staging_mapped = 0;
  HostPoolStats host;
};

struct EngineConfig {
  static void SetPrefetchDepth(int depth);
  static int PrefetchDepth();  // default 2 (JAXVMM_PREFETCH_DEPTH)
  // How many of the newest offloaded tickets keep their staging pages (a device copy) after the D2H,
  // so that their reloads copy device to device instead of waiting for an H2D. Default 0
  // (JAXVMM_KEEP_RESIDENT). Costs that many staging slots of device memory.
  static void SetKeepResident(int n);
  static int KeepResident();
};

class Engine {
 public:
  // The engine of (b, device), created on first use (streams, events, workers, pinned words).
  static Status For(Backend b, int device, Engine** out);
  // Every engine: wait for outstanding work, return tickets' host memory, close staging slots.
  static void ShutdownAll();
  static std::vector<Engine*> All();

  // Host-time halves of the three handlers. `stream` is XLA's stream (nullptr on the cpu platform);
  // buffers are XLA's device (or, on cpu, host) pointers.
  Status Offload(CUstream stream, CUdeviceptr src, const ArrayMeta& meta, CUdeviceptr token_out);
  Status Reload(CUstream stream, CUdeviceptr token_in, CUdeviceptr dst, const ArrayMeta& meta);
  Status Prefetch(CUstream stream, CUdeviceptr token_in, CUdeviceptr token_out);

  // The first asynchronous error since the last call (reload of an unknown or used ticket, ...);
  // handlers return it on their next call, Python's jaxvmm.check() raises it.
  Status TakeError();
  // Python dropped its last reference to a ticket: its host memory is freed once the GPU has passed
  // every reload enqueued so far.
  void Drop(uint64_t token);
  // OK if the token names a live ticket of this engine that no reload has consumed or reserved; then
  // reserves it for the eager reload about to run (a second eager reload is refused synchronously).
  Status CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve);
  void Unreserve(uint64_t token);  // the eager reload that reserved it failed before it ran
  // Blocks until every enqueued op has completed and the workers are idle.
  Status Synchronize();
  EngineStats Stats();
  Backend backend() const { return backend_; }
  uint64_t EngineKey() const { return (static_cast<uint64_t>(backend_) << 32) | static_cast<uint32_t>(device_); }
  int device() const { return device_; }

  ~Engine();

 private:
  Engine(Backend b, int device);
  Status Init();

  struct Ticket;
  struct Op;
  // Where a ticket's bytes can be copied from: its device copy (when it keeps one) or its host block
  // (once its D2H is done). Snapshot under mu_: the releaser may attach a device copy at any time.
  struct Source {
    CUdeviceptr resident = 0;
    CUevent resident_ready = nullptr;  // null: the device copy is complete
    CUevent d2h_done = nullptr;
    const void* host = nullptr;
  };
  struct alignas(64) Words {
    std::atomic<uint64_t> probe;  // reload: the token the GPU read, copied here by XLA's stream
    std::atomic<uint64_t> ready;  // >= op seq once the staging slot holds what XLA's stream needs
    uint64_t token;               // offload: the ticket's token, copied into XLA's output
  };

  // Host side.
  // Takes the next sequence number, fills the op and (if `map`) hands it to the mapper, atomically.
  Status BeginOp(Op** out, const std::function<void(Op&)>& fill, bool map);
  void MarkCompleted(uint64_t seq);  // caller holds mu_
  void AbandonTask(uint64_t seq, bool undo_completion, bool undo_offloaded);
  Status AcquireStaging(size_t nbytes, std::shared_ptr<Slot>* out, int64_t* id);
  void ReturnStaging(int64_t id, size_t size);
  std::shared_ptr<Ticket> Predict(const ArrayMeta& meta);
  Status EnqueueCompletion(Op& op, CUstream stream);
  Status Launch(CUstream stream, CUhostFn fn, Op& op, const char* stage);  // host function, counted in op.pending
  void FinishEnqueue(Op& op, const Status& st);
  Status WaitMapped(Op& op);

  // Worker side.
  void MapTask(uint64_t seq);        // mapper: gated on GPU progress
  void ResolveTask(uint64_t seq);    // resolver: the token a reload read is known
  void CompleteTask(uint64_t seq);   // resolver: XLA's stream passed the op
  void OffloadedTask(uint64_t seq);  // releaser: D2H done; staging pages go back
  void ReleaseStaging(int64_t id, size_t size);
  // A finished op's staging pages: handed to the op the mapper is about to map (same size, gate
  // open), or released. `reload_counted` also returns the op's place under the reload staging cap.
  void RetireStaging(int64_t id, size_t size, CUdeviceptr address, bool reload_counted);
  bool MapGateOpen(const Op& op, int depth) const;  // caller holds mu_
  void EvictResident();  // caller holds mu_; drops kept copies beyond KeepResident() that no op reads
  void Fail(const Status& st);         // logs, then RecordError
  void RecordError(const Status& st);  // caller holds mu_
  void FreeTicket(std::shared_ptr<Ticket> t);
  Status Resident(const std::shared_ptr<Ticket>& t);
  static Source SourceOf(const Ticket& t);  // caller holds mu_
  // Enqueues on `s`: wait until `src` holds the bytes, then copy them to `dst` (D2D or H2D).
  Status CopyTicket(CUstream s, const Source& src, CUdeviceptr dst, size_t nbytes, int64_t slot_id, const char* stage);
  std::shared_ptr<Ticket> FindTicket(uint64_t token, std::string* why);

  static void CUDA_CB OnResolve(void* op);
  static void CUDA_CB OnComplete(void* op);
  static void CUDA_CB OnOffloaded(void* op);

  const Backend backend_;
  const int device_;
  HostPool host_pool_;
  // d2h_: offload copies out; h2d_: the mapper's prefetches; fix_: the resolver's corrections and
  // prefetch-hint copies; ctl_: event waits and host functions only.
  CUstream d2h_ = nullptr, h2d_ = nullptr, fix_ = nullptr, ctl_ = nullptr;
  Words* words_ = nullptr;  // pinned, kRing entries
  std::vector<Op> ops_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  uint64_t next_seq_ = 1;
  uint64_t completed_seq_ = 0;  // every op <= this has passed XLA's stream
  std::set<uint64_t> finished_;  // finished ops above completed_seq_ (out of order)
  int reload_mapped_ = 0;       // reload staging slots holding pages (capped at the prefetch depth)
  uint64_t map_head_ = 0;       // the op the mapper waits to map (0: none)
  struct Warm {
    int64_t id;
    size_t size;
    CUdeviceptr address;
  };
  std::optional<Warm> warm_;    // mapped staging parked for map_head_ by RetireStaging
  uint64_t next_ticket_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Ticket>> tickets_;  // by token
  std::deque<std::shared_ptr<Ticket>> order_;                       // offload order, for prediction
  std::deque<uint64_t> recently_reloaded_;
  std::deque<std::shared_ptr<Ticket>> kept_resident_;  // newest offloads whose staging stays mapped  // tokens of freed, consumed tickets (diagnostics only)
  bool lifo_ = true;
  bool shutting_down_ = false;
  std::map<size_t, std::vector<int64_t>> free_staging_;  // size -> released staging slot ids
  std::vector<std::pair<uint64_t, uint64_t>> pending_drops_;  // (token, after seq)
  std::vector<CUevent> event_pool_;
  Status error_;
  EngineStats stats_;

  // Workers last: destroyed first, while the state above still exists.
  std::unique_ptr<Worker> mapper_, resolver_, releaser_;
};

}  // namespace jaxvmm
