// The ledger: one engine's tickets and everything its two paths (the op ring, graph mode) share about
// them, under one lock. DESIGN.md, "Engine parts".
//
// What it owns: the ticket table (tokens, lifetimes, prediction), the op sequence numbers handed out,
// the counters both paths report, the asynchronous errors not yet reported, the tokens graph-mode
// rounds were armed with before their tickets exist, and the pool of D2H events. What it is handed:
// the host store and the staging area, where a freed ticket's host block and device copy go back.
//
// The lock: members that take a `const Held&` need the ledger lock held, and the guard is the proof
// (checked at run time in debug builds). The op ring's records are guarded by this lock too (its
// condition variable waits on it). Lock order: OpRing::enqueue_mu_ -> GraphMode::mu_ -> Ledger::mu_ ->
// HostPool / StagingArea -> Registry -> Slot. Nothing here waits for GPU progress or calls back into
// the ring or graph mode.
#pragma once

#include <cassert>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "host_pool.h"
#include "stat_fields.h"
#include "staging.h"
#include "status.h"
#include "tickets.h"

namespace jaxvmm {

// Counted by both paths; reported by engine_stats().
struct LedgerCounts {
  int64_t offloads = 0, reloads = 0, prefetches = 0;
  int64_t prefetch_hits = 0, prefetch_misses = 0;
  int64_t errors = 0, drops = 0;
};

// engine_stats() keys.
inline constexpr StatField<LedgerCounts> kLedgerCountsFields[] = {
    {"offloads", &LedgerCounts::offloads},
    {"reloads", &LedgerCounts::reloads},
    {"prefetches", &LedgerCounts::prefetches},
    {"prefetch_hits", &LedgerCounts::prefetch_hits},
    {"prefetch_misses", &LedgerCounts::prefetch_misses},
    {"errors", &LedgerCounts::errors},
    {"drops", &LedgerCounts::drops},
};

// Asynchronous errors (found by a worker or the poller after the handler returned). Each is reported
// once: by the next handler on the stream of the op that failed (a later program on that stream), or
// by check().
class AsyncErrors {
 public:
  void Record(CUstream stream, const Status& st);
  Status TakeFor(CUstream stream);  // the oldest error recorded for `stream`
  Status TakeAny();
  bool empty() const { return pending_.empty(); }

 private:
  std::vector<std::pair<CUstream, Status>> pending_;
};

class Ledger {
 public:
  using Held = std::unique_lock<std::mutex>;

  Ledger(Backend b, int device, uint64_t engine_key, HostStore& host, StagingArea& staging);
  ~Ledger();  // frees every ticket left; the owner has synchronized every stream that reads them
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  Held Lock() { return Held(mu_); }

  TicketTable& tickets(const Held& h) { return Checked(h, tickets_); }
  LedgerCounts& counts(const Held& h) { return Checked(h, counts_); }
  // Op sequence numbers: the ring issues one per op; a graph round's ticket is stamped with the last.
  uint64_t IssueSeq(const Held& h) { return ++Checked(h, issued_); }
  uint64_t issued(const Held& h) { return Checked(h, issued_); }

  // Frees `t` once nothing can read its host block or device copy any more.
  void Retire(const Held& h, const std::shared_ptr<Ticket>& t);
  // Python let go of the ticket of `token` (no-op if it is gone).
  void DropTicket(const Held& h, uint64_t token);

  // Errors found after the call that caused them returned: logged, then reported once (AsyncErrors).
  void Report(CUstream stream, const Status& st);  // takes the lock
  Status TakeFor(CUstream stream);
  Status TakeAny();

  // Graph mode: a fresh token armed in a cell before its round's ticket exists (the
  // poller makes it when the round's `filled` arrives), and its end (made, or the grant revoked).
  uint64_t ArmToken();
  void Disarm(const Held& h, uint64_t token) { Checked(h, armed_).erase(token); }
  bool Armed(const Held& h, uint64_t token) { return Checked(h, armed_).count(token) > 0; }
  // Waits while `token` names a graph-mode offload round the device finished but the poller has not
  // served yet (no ticket yet, or its D2H not enqueued): a resolve must not find it unknown or copy
  // from its host block early. The poller never waits for this lock's holders, so the wait ends;
  // bounded anyway (past 60 s the caller goes on and reports what it finds).
  void WaitUntilServed(uint64_t token);

  // A consumed or dropped ticket may be some reload cell's guess: the poller takes such guesses back.
  void MarkStale(const Held& h) { Checked(h, stale_) = true; }
  bool stale(const Held& h) { return Checked(h, stale_); }
  bool TakeStale();  // takes the lock

  // Events for ring-path tickets' D2H completion, pooled (a freed ticket's goes back).
  Status GetEvent(CUevent* out);

  // Python's checks of a token before an eager reload (reserve: the one reload allowed), Keep (the
  // ticket's token lives in Python: reloads do not consume it), and the undo of a reservation.
  Status CheckTicket(uint64_t token, const ArrayMeta& meta, bool reserve);
  Status Keep(uint64_t token);
  void Unreserve(uint64_t token);
  // Every live ticket no reload has consumed, reserved or claimed: (token, sequence number of its offload).
  std::vector<std::pair<uint64_t, uint64_t>> Unclaimed();

 private:
  template <typename T>
  T& Checked(const Held& h, T& member) {
    assert(h.owns_lock() && h.mutex() == &mu_);
    (void)h;
    return member;
  }

  const Backend backend_;
  const int device_;
  HostStore& host_;
  StagingArea& staging_;
  std::mutex mu_;
  TicketTable tickets_;
  LedgerCounts counts_;
  uint64_t issued_ = 0;
  AsyncErrors errors_;
  std::unordered_set<uint64_t> armed_;
  bool stale_ = false;
  std::vector<CUevent> event_pool_;
};

}  // namespace jaxvmm
