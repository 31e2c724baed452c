// Tickets: what an offload leaves behind (a token, the array's metadata, a pinned host block, maybe a
// device copy), their lifetimes, and the guess of which ticket a reload will name (prediction).
//
// TicketTable is a plain data structure with no lock of its own: its owner (the ledger) guards it with
// Ledger::mu_. It makes no driver call. When a ticket can be freed, the table hands back what it held
// (a `Retired` record) and the owner returns those resources; the table never reaches into its owner.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "host_pool.h"
#include "staging.h"

namespace jaxvmm {

// What Python knows statically about an offloaded array; checked again when a reload resolves.
struct ArrayMeta {
  size_t nbytes = 0;
  int64_t signature = 0;  // hash of dtype and shape, computed in Python
  int64_t site = 0;       // the Python call site (jaxvmm maps it to a source line), 0: unknown
};

// Tokens are uint64: the low 32 bits a ticket number, the high 32 bits a check word salted per process
// and per engine key, never 0. So 0 is never a valid token, and a token is valid on one engine only.
uint64_t MakeToken(uint32_t number, uint64_t engine_key);
bool TokenValid(uint64_t token, uint64_t engine_key);
std::string TokenStr(uint64_t token);

struct Ticket {
  uint64_t token = 0;
  uint64_t offload_seq = 0;  // the sequence number of the offload that created it
  ArrayMeta meta;
  HostBlock host;
  CUevent d2h_done = nullptr;  // recorded on the D2H stream after the copy
  uint64_t d2h_seq = 0;        // graph-mode round: the D2H is done once the engine's gd2h_ word reaches it (no event)
  bool enqueued = false;       // its D2H and d2h_done are enqueued: a reload may copy from it
  bool graph_round = false;    // made by a graph-mode round: its D2H runs on gd2h_, which never waits
                               // on XLA's streams (a ring-path D2H waits for an event of XLA's stream)
  bool on_host = false;        // D2H finished and seen by the releaser
  bool consumed = false;       // a reload resolved to it
  bool reserved = false;       // an eager reload checked it (a second eager reload is refused)
  bool kept = false;           // reloads do not consume it (its token lives in Python, which may reload it
                               // any number of times, e.g. a jax.vjp function called twice); freed when dropped
  bool dropped = false;        // Python let go of it, or its offload failed
  uint64_t claimed_by = 0;     // the reload op that predicted it, until that op resolves
  int pins = 0;                // ops that may still read its host block or device copy
  bool freed = false;
  // A device copy (a prefetch hint's, or the offload's own staging cell kept by keep_resident):
  // readers wait for the cell's free event (recorded after the copy that filled it).
  StagingLease resident;
  // Graph mode: the round's bytes in a lent or kept spare, or a held cell, of its offload channel
  // (complete: its round finished before the poller lent or held it), until a lend reuses that spare or
  // its pages go back (GraphCells::Forget), or the held cell is armed or goes idle (GraphCells::Unhold).
  // The channel owns the cell; this is a view, set and cleared under Ledger::mu_.
  CUdeviceptr lent_cell = 0;
  int lent_readers = 0;  // copies out of lent_cell still running: the cell keeps the bytes until they end
};

// A reload resolved to `t`: it is consumed (freed once nothing reads it), unless it is kept.
inline void MarkReloaded(Ticket& t) {
  if (!t.kept) t.consumed = true;
}

// Resources a freed ticket held; its owner returns them.
struct Retired {
  HostBlock host;
  CUevent d2h_done = nullptr;
  StagingLease resident;
};

class TicketTable {
 public:
  explicit TicketTable(uint64_t engine_key) : key_(engine_key) {}

  // A new ticket with a fresh token. Numbers wrap at 2^32 and skip numbers still in use, so a new
  // token never aliases a live ticket.
  std::shared_ptr<Ticket> Create(const ArrayMeta& meta);
  // A fresh token with no ticket yet (a graph-mode grant hands it to the device before the round's
  // ticket exists), and the ticket of such a token (null if a live ticket took it meanwhile).
  uint64_t ReserveToken();
  std::shared_ptr<Ticket> Create(const ArrayMeta& meta, uint64_t token);
  // Test hook: the next ticket number to hand out.
  void SetNextNumber(uint32_t n) { next_ = n; }

  // The live ticket of `token`, or null with *why set (forged, gone, already reloaded).
  std::shared_ptr<Ticket> Find(uint64_t token, std::string* why) const;
  // The predicted ticket for a reload of `meta`: the newest (LIFO) or oldest (FIFO) unconsumed,
  // unclaimed ticket of that shape/dtype whose D2H is enqueued (and that `usable` accepts, if given).
  std::shared_ptr<Ticket> Predict(const ArrayMeta& meta, const std::function<bool(const Ticket&)>& usable = nullptr) const;
  // A reload resolved to `actual` while `predicted` was guessed: learn LIFO vs FIFO.
  void Learn(const std::shared_ptr<Ticket>& actual, int64_t signature);

  // Frees `t` if nothing can read it any more (consumed or dropped, no pins, its D2H done).
  bool MaybeFree(const std::shared_ptr<Ticket>& t, Retired* out);

  size_t live() const { return by_token_.size(); }
  int64_t host_bytes() const;
  template <typename F>
  void ForEach(F f) const {
    for (auto& [token, t] : by_token_) f(*t);
  }

 private:
  const uint64_t key_;
  uint32_t next_ = 1;
  std::unordered_set<int64_t> fifo_;  // signatures whose reloads were learned to come in offload order
  std::unordered_map<uint64_t, std::shared_ptr<Ticket>> by_token_;
  std::deque<std::shared_ptr<Ticket>> order_;  // offload order, for prediction
  std::deque<uint64_t> recently_reloaded_;     // tokens of freed, consumed tickets (diagnostics only)
};

}  // namespace jaxvmm
